"""DTensor sharding strategies for ``batchrules::linear`` and ``linear_backward``.

Per mesh dimension, with ``x: [*, I]``, ``W: [O, I]``, ``g = grad_output: [*, O]``
(R = Replicate, S(d) = Shard(d), P = Partial sum; ``-1`` = last dim)::

    linear(x, W, b) -> y
      replicated        y R      <- x R      W R     b R
      data parallel     y S(d)   <- x S(d)   W R     b S(d) or R   (d a leading dim)
      column parallel   y S(-1)  <- x R      W S(0)  b S(-1) or R
      row parallel      y P      <- x S(-1)  W S(1)  b P

    linear_backward(x, g, W) -> (gi, gW, gb)
      replicated        R     R     R       <- x R      g R      W R
      data parallel     S(d)  P     P       <- x S(d)   g S(d)   W R
      column parallel   P     S(0)  S(0)    <- x R      g S(-1)  W S(0)
      row parallel      S(-1) S(1)  R       <- x S(-1)  g R      W S(1)

A bias is sharded along the output dim it is broadcast over only where it has
that dim with size > 1. A 1-D weight ``[I]`` has no output-feature dim, so it
gets no column-parallel strategy and its row-parallel weight is ``S(0)``.
DTensor expands these to every mesh dimension and picks the cheapest.

The strategies are registered once ``torch.distributed.tensor`` is imported
(see Note [Registering with optional torch subsystems lazily]).
"""
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor.experimental import register_sharding
from torch.distributed.tensor.placement_types import Placement

# (output placements, input placements) for one mesh dimension.
Strategy = Tuple[List[Optional[Placement]], List[Optional[Placement]]]

_linear = torch.ops.batchrules.linear.default
_linear_backward = torch.ops.batchrules.linear_backward.default


def _bias_placement(bias: Any, out_ndim: int, out_dim: int) -> Optional[Placement]:
    """Placement of a bias for an output sharded on ``out_dim``: the bias is
    right-aligned with the output (a 1-D input's bias may have one extra
    leading size-1 dim)."""
    if bias is None:
        return None
    bias_dim = out_dim - (out_ndim - bias.ndim)
    if 0 <= bias_dim < bias.ndim and bias.shape[bias_dim] != 1:
        return Shard(bias_dim)
    return Replicate()


def linear_strategies(input: Any, weight: Any, bias: Any = None) -> List[Strategy]:
    """Single-mesh-dim strategies of ``batchrules::linear`` (table above)."""
    out_ndim = input.ndim - 1 + (weight.ndim == 2)
    replicate_bias = None if bias is None else Replicate()
    strategies: List[Strategy] = [
        ([Replicate()], [Replicate(), Replicate(), replicate_bias]),
    ]
    for d in range(input.ndim - 1):
        strategies.append(([Shard(d)], [Shard(d), Replicate(), _bias_placement(bias, out_ndim, d)]))
    if weight.ndim == 2:
        last = out_ndim - 1
        strategies.append(
            ([Shard(last)], [Replicate(), Shard(0), _bias_placement(bias, out_ndim, last)]))
    # Each rank contracts its slice of in_features; the bias must be added once
    # in total, so it comes in as a partial sum too.
    strategies.append(([Partial()], [Shard(input.ndim - 1), Shard(weight.ndim - 1),
                                     None if bias is None else Partial()]))
    return strategies


def linear_backward_strategies(self: Any, grad_output: Any, weight: Any,
                               output_mask: Sequence[bool]) -> List[Strategy]:
    """Single-mesh-dim strategies of ``batchrules::linear_backward`` (table above).

    Placements are given for all three outputs whatever ``output_mask`` says;
    masked outputs are None and DTensor leaves them so."""
    strategies: List[Strategy] = [
        ([Replicate()] * 3, [Replicate(), Replicate(), Replicate(), None]),
    ]
    for d in range(self.ndim - 1):
        strategies.append(
            ([Shard(d), Partial(), Partial()], [Shard(d), Shard(d), Replicate(), None]))
    if weight.ndim == 2:
        strategies.append(([Partial(), Shard(0), Shard(0)],
                           [Replicate(), Shard(grad_output.ndim - 1), Shard(0), None]))
    in_dim = self.ndim - 1
    strategies.append(([Shard(in_dim), Shard(weight.ndim - 1), Replicate()],
                       [Shard(in_dim), Replicate(), Shard(weight.ndim - 1), None]))
    return strategies


def register_sharding_strategies() -> None:
    """Register the strategies with DTensor (idempotent: a re-registration replaces)."""
    register_sharding(_linear)(linear_strategies)
    register_sharding(_linear_backward)(linear_backward_strategies)
    # register_sharding keys DTensor's sharding cache on tensor specs and int
    # arguments only. output_mask decides which outputs exist (and so get
    # shapes), so it has to be part of the key: without this, a cached result
    # computed with an output masked off is reused for a call that wants it.
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.op_to_schema_info[_linear_backward] = RuntimeSchemaInfo(
        static_argnum=3, needs_pytree=True)
