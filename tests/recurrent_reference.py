"""Modules, inputs and for-loop references for the recurrent-layer tests.

The call under test runs inside ``routed()`` (routing on, functorch's per-example
fallback off, so a missing rule fails instead of looping); every reference is a
Python loop of stock eager calls, one example at a time, with routing off and no
transform, in float64 unless a test says otherwise.
"""
import contextlib
import copy
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from conftest import assert_close, vmap_fallback_off
from torch import Tensor, nn
from torch.func import functional_call, stack_module_state, vmap
from torch.utils._pytree import tree_leaves, tree_map

import batchrules

KINDS = ("lstm", "gru", "rnn_tanh", "rnn_relu")
B = 2  # vmap size (examples, or ensemble members)
T, N, IN, HIDDEN, PROJ = 4, 2, 3, 4, 2  # sequence length, per-example batch, sizes

# name: (module options, per-example input has a batch dim, hx spec, input's vmap dim)
RNN_CASES: Dict[str, tuple] = {
    "unbatched": ({}, False, "none", 0),
    "unbatched_h_batched": ({}, False, "batched", 0),
    "unbatched_h_shared": ({}, False, "shared", 0),
    "batched_h_batched": ({}, True, "batched", 0),
    "batched_h_mixed": ({}, True, "mixed", 0),
    "batched_x_bdim_last": ({}, True, "batched", 3),
    "batch_first_h_shared": ({"batch_first": True}, True, "shared", 0),
    "batch_first_no_h_bdim1": ({"batch_first": True}, True, "none", 1),
    "batch_first_unbatched": ({"batch_first": True}, False, "batched", 1),
    "two_layers_bidirectional": ({"num_layers": 2, "bidirectional": True}, True, "batched", 0),
    "two_layers_bidirectional_unbatched": ({"num_layers": 2, "bidirectional": True}, False,
                                           "none", 1),
    "no_bias": ({"bias": False}, True, "shared", 0),
    "proj": ({"proj_size": PROJ, "num_layers": 2}, True, "batched", 0),
    "proj_bidirectional_unbatched": ({"proj_size": PROJ, "bidirectional": True}, False,
                                     "mixed", 0),
}
LSTM_ONLY = {"batched_h_mixed", "proj", "proj_bidirectional_unbatched"}


@contextlib.contextmanager
def routed() -> Iterator[None]:
    """Routing on and the vmap fallback off, both restored afterwards."""
    with vmap_fallback_off(), batchrules.enabled(True):
        yield


# rnn_recurrence's modes, and the gates each has
LSTM, GRU = 0, 1
GATES = {LSTM: 4, GRU: 3}


def operands(E: int, N: int, H: int, P: Optional[int] = None, bias: bool = True,
             scale: float = 1.0, seed: int = 0, mode: int = LSTM) -> Dict[str, Optional[Tensor]]:
    """rnn_recurrence's operands for E ensemble members of N rows, 7 steps,
    hidden size H (projected to P when given)."""
    gen = torch.Generator().manual_seed(seed)
    P = P or H
    G = GATES[mode] * H

    def r(*s: int) -> Tensor:
        return torch.randn(*s, generator=gen)

    return dict(input_gates=scale * r(7, E, N, G), h0=r(E, N, P),
                c0=r(E, N, H) if mode == LSTM else None, w_hh=0.3 * r(E, G, P),
                b_hh=r(E, G) if bias else None, w_hr=0.3 * r(E, P, H) if P != H else None)


def one_gate(ops: Dict[str, Optional[Tensor]], hidden: int) -> Dict[str, Optional[Tensor]]:
    """GRU ``operands`` cut to one gate of ``hidden``: an RNN's (modes 2, 3)."""
    ops = dict(ops)
    ops["input_gates"] = ops["input_gates"][..., :hidden].contiguous()
    ops["w_hh"], ops["b_hh"] = ops["w_hh"][:, :hidden].contiguous(), ops["b_hh"][:, :hidden].contiguous()
    return ops


def sample_major(t: Tensor) -> Tensor:
    """T,E,N,F with the same values, stored as E,N,T,F."""
    return t.permute(1, 2, 0, 3).contiguous().permute(2, 0, 1, 3)


def transposed_rows(t: Tensor) -> Tensor:
    """t with the same values and rows that are not contiguous."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _make(classes: Tuple[type, type, type], kind: str, dtype: torch.dtype,
          options: Any) -> nn.Module:
    lstm, gru, rnn = classes
    if kind == "lstm":
        module = lstm(IN, HIDDEN, **options)
    elif kind == "gru":
        module = gru(IN, HIDDEN, **options)
    else:
        module = rnn(IN, HIDDEN, nonlinearity=kind.split("_")[1], **options)
    return module.to(dtype)


def make_rnn(kind: str, dtype: torch.dtype = torch.float64, **options: Any) -> nn.Module:
    """nn.LSTM / nn.GRU / nn.RNN (tanh or relu) of input IN and hidden HIDDEN."""
    return _make((nn.LSTM, nn.GRU, nn.RNN), kind, dtype, options)


def make_cell(kind: str, dtype: torch.dtype = torch.float64, **options: Any) -> nn.Module:
    """nn.LSTMCell / nn.GRUCell / nn.RNNCell (tanh or relu)."""
    return _make((nn.LSTMCell, nn.GRUCell, nn.RNNCell), kind, dtype, options)


def batched(shape: Sequence[int], bdim: Optional[int], dtype: torch.dtype = torch.float64,
            size: int = B) -> Tensor:
    """A random tensor of per-example ``shape`` with ``size`` examples along ``bdim`` (None: shared)."""
    shape = list(shape)
    if bdim is not None:
        shape.insert(bdim, size)
    return torch.randn(shape, dtype=dtype)


def input_shape(module: nn.Module, per_example_batch: bool) -> List[int]:
    """One example's input: [T, in] / [T, N, in] / [N, T, in]; a cell's [in] / [N, in]."""
    if isinstance(module, nn.RNNCellBase):
        return [N, IN] if per_example_batch else [IN]
    if not per_example_batch:
        return [T, IN]
    return [N, T, IN] if module.batch_first else [T, N, IN]


def hidden_shapes(module: nn.Module, per_example_batch: bool) -> List[List[int]]:
    """One example's hidden state shapes: [h] or, for LSTMs, [h, c]."""
    lead = [N] if per_example_batch else []
    if isinstance(module, nn.RNNCellBase):
        shapes = [lead + [module.hidden_size]]
        return shapes * 2 if isinstance(module, nn.LSTMCell) else shapes
    layers = [module.num_layers * (2 if module.bidirectional else 1)]
    h_size = module.proj_size or module.hidden_size
    shapes = [layers + lead + [h_size]]
    if isinstance(module, nn.LSTM):
        shapes.append(layers + lead + [module.hidden_size])
    return shapes


def make_hx(module: nn.Module, per_example_batch: bool, spec: str,
            dtype: torch.dtype = torch.float64, size: int = B) -> Tuple[Any, Any]:
    """(hx, its in_dims) for ``spec``: "none", "batched", "shared" or "mixed" (h
    batched, c shared; for modules without c the same as "batched"); ``size``
    examples where batched."""
    if spec == "none":
        return None, None
    shapes = hidden_shapes(module, per_example_batch)
    dims = [None if spec == "shared" or (spec == "mixed" and k == 1) else 0
            for k in range(len(shapes))]
    tensors = [batched(s, d, dtype, size) for s, d in zip(shapes, dims)]
    if len(tensors) == 2:
        return tuple(tensors), tuple(dims)
    return tensors[0], dims[0]


def example_args(args: Sequence, in_dims: Sequence, i: int) -> List:
    """Example ``i`` of vmap's arguments (in_dims as vmap takes them, prefixes included)."""
    def select(dim: Optional[int], arg: Any) -> Any:
        return arg if dim is None else tree_map(lambda t: t.select(dim, i), arg)

    return tree_map(select, list(in_dims), list(args),
                    is_leaf=lambda d: d is None or isinstance(d, int))


def stack(outputs: List) -> Any:
    """Per-example outputs (pytrees of tensors) stacked along a new dim 0."""
    return tree_map(lambda *ts: torch.stack(ts), outputs[0], *outputs[1:])


def loop(fn: Callable, args: Sequence, in_dims: Sequence, size: int = B) -> Any:
    """``vmap(fn, in_dims)(*args)`` as a loop of stock eager calls, routing off."""
    with batchrules.enabled(False):
        return stack([fn(*example_args(args, in_dims, i)) for i in range(size)])


def check_forward(module: nn.Module, x_dim: Optional[int], per_example_batch: bool,
                  hx_spec: str, dtype: torch.dtype = torch.float64, **tol: Any) -> None:
    """vmap(module) routed against the loop, over a random input batched along x_dim."""
    x = batched(input_shape(module, per_example_batch), x_dim, dtype)
    hx, hx_dims = make_hx(module, per_example_batch, hx_spec, dtype)
    with routed():
        got = vmap(call(module), in_dims=(x_dim, hx_dims))(x, hx)
    assert_close(got, loop(call(module), (x, hx), (x_dim, hx_dims)), **tol)


def call(module: nn.Module) -> Callable:
    """module(x) or module(x, hx): the signature the tests vmap over."""
    return lambda x, hx=None: module(x) if hx is None else module(x, hx)


def ensemble(make: Callable[[], nn.Module]) -> Tuple[List[nn.Module], dict, dict, Callable]:
    """B members, their stacked state and ``fn(params, buffers, x, hx=None)`` on a meta copy."""
    members = [make() for _ in range(B)]
    params, buffers = stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")

    def fn(p, b, x, hx=None):
        return functional_call(base, (p, b), (x,) if hx is None else (x, hx))

    return members, params, buffers, fn


def scalar(output: Any) -> Tensor:
    """A nonlinear scalar of every output tensor (h_n, c_n included), for gradients."""
    return sum(t.sin().sum() for t in tree_leaves(output))


def leaves_like(tree: Any) -> Any:
    """Fresh leaves requiring grad with ``tree``'s values."""
    return tree_map(lambda t: t.detach().clone().requires_grad_(True), tree)
