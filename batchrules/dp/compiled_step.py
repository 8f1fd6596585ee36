"""``clipped_grad`` inside ``torch.compile``.

Note [clipped_grad under torch.compile]
Dynamo cannot trace clipped_grad's body: its own vmap levels, the recorded
autograd edges and ``torch.autograd.grad`` over them. So under Dynamo the call
is a ``torch._dynamo.nonstrict_trace`` function: Dynamo puts it in its graph as
one opaque call (no graph break, ``fullgraph=True`` holds), and AOTAutograd then
traces through the body as plain Python, with its functional, fake and proxy
modes: the forward under vmap, the one backward and the clipping become aten
ops of the caller's graph, and Inductor compiles them with the caller's noise
and update. The body is the eager one, with the interception a torch function
mode (Note [Intercepting while traced] in interceptor.py) and no in-place
scaling of output gradients whose storages cannot be told apart while traced.

Batch sizes: Dynamo's automatic dynamic shapes make the batch symbolic at the
second size, and the body's shape-dependent choices (the cost model's
strategies) become guards of that one graph, so a Poisson-sampled batch
compiles once more at most when a choice flips, not once per size. A kernel
that reads concrete sizes specializes it (the recurrence ops have fake kernels
for that: recurrent_fakes.py); torch's batching rule of ``cat`` does
(transformers' caches: pass ``use_cache=False``), and such a model compiles
once per batch size.

The ``StepSpec`` (the loss, max_norm, ...) is a constant of the graph, which
nonstrict_trace only takes from outside the compiled region: ``clipped_grad``
is created outside the compiled function and called inside it.

What the body closes over (the model's buffers, frozen parameters) is taken as
a constant of the graph, as nonstrict_trace does: it must not change between
calls; pass tensors that change as arguments.
"""
from typing import Any, Callable, Optional, Tuple, Union

from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils._pytree import register_constant

from .._post_import import when_imported

ArgNums = Union[int, Tuple[int, ...]]


class StepSpec:
    """What ``clipped_grad(loss, max_norm, ...)`` fixes: a constant of the
    compiled graph, one per clipped_grad object (compared by identity:
    ``in_dims`` may hold unhashable pytrees)."""

    def __init__(self, loss: Callable[..., Any], max_norm: float, in_dims: Any, argnums: ArgNums,
                 has_aux: bool, randomness: str) -> None:
        self.loss, self.max_norm, self.in_dims = loss, max_norm, in_dims
        self.argnums, self.has_aux, self.randomness = argnums, has_aux, randomness

    # nonstrict_trace guards a constant with ==, and needs it defined.
    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


register_constant(StepSpec)


def _run_traced(spec: StepSpec, args: Tuple[Any, ...]) -> Any:
    from .transform import clipped_step  # transform.py imports this module

    return clipped_step(spec, _thawed(args), traced=True)


_entry: Optional[Callable[..., Any]] = None


def _register(dynamo: Any) -> None:
    global _entry
    _entry = dynamo.nonstrict_trace(_run_traced)


when_imported("torch._dynamo", _register)


def traced_clipped_grad(spec: StepSpec, args: Tuple[Any, ...]) -> Any:
    """clipped_grad's call while Dynamo traces (Note [clipped_grad under torch.compile])."""
    assert _entry is not None  # Dynamo is imported while it traces
    return _entry(spec, args)


def _thawed(tree: Any) -> Any:
    """The arguments with Dynamo's immutable containers as plain ones:
    ``functional_call`` updates the dict it is given."""
    if isinstance(tree, immutable_dict):
        return {k: _thawed(v) for k, v in tree.items()}
    if isinstance(tree, immutable_list):
        return [_thawed(v) for v in tree]
    if type(tree) is tuple:
        return tuple(_thawed(v) for v in tree)
    return tree
