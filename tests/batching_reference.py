"""For-loop references and argument builders shared by the batching-rule tests.

A batched argument is described by its logical (per-example) shape and its
batch dim; ``physical`` builds the tensor vmap sees and ``example`` slices
example ``i`` back out, so every reference is a plain Python loop over examples
of ``F.linear`` (or its autograd), independent of the rules under test.
"""
import math
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

BDim = Optional[int]
OutDims = Union[int, None, Tuple[Optional[int], ...]]


def physical_shape(logical: Sequence[int], bdim: BDim, batch: int) -> Tuple[int, ...]:
    """The physical shape of a tensor with the given logical shape and batch dim."""
    shape = list(logical)
    if bdim is not None:
        shape.insert(bdim, batch)
    return tuple(shape)


def physical(logical: Sequence[int], bdim: BDim, batch: int, dtype: torch.dtype,
             generator: Optional[torch.Generator] = None) -> Tensor:
    """A random tensor of ``logical`` shape, batched along ``bdim`` (None: shared), drawn
    on the CPU (where ``generator`` lives) and placed on the default device."""
    values = torch.randn(physical_shape(logical, bdim, batch), dtype=dtype, device="cpu",
                         generator=generator)
    return values.to(torch.get_default_device())


def example(t: Optional[Tensor], bdim: BDim, i: int) -> Optional[Tensor]:
    """Example ``i`` of a physical tensor (the tensor itself when it is shared).

    Contiguous, because F.linear's result for some bias shapes depends on the
    input's layout (a 1-D input with a [1, O] bias fails unless contiguous).
    """
    if t is None or bdim is None:
        return t
    return t.select(bdim, i).contiguous()


def stack_outputs(per_example: List, out_dims: OutDims):
    """Stacks per-example outputs (a tensor or a tuple of tensors/None) like vmap's out_dims."""
    if isinstance(per_example[0], tuple):
        dims = out_dims if isinstance(out_dims, tuple) else (out_dims,) * len(per_example[0])
        return tuple(
            stack_outputs([o[k] for o in per_example], dims[k])
            for k in range(len(per_example[0]))
        )
    if per_example[0] is None:
        return None
    if out_dims is None:
        return per_example[0]
    return torch.stack(per_example, dim=out_dims)


def loop_reference(fn: Callable, args: Sequence, in_dims: Sequence[BDim], batch: int,
                   out_dims: OutDims = 0):
    """``vmap(fn, in_dims, out_dims)(*args)`` computed with a Python for-loop."""
    outs = [fn(*[example(a, d, i) if isinstance(a, Tensor) else a
                 for a, d in zip(args, in_dims)]) for i in range(batch)]
    return stack_outputs(outs, out_dims)


def linear_backward_reference(x: Tensor, g: Tensor, w: Tensor,
                              mask: Sequence[bool]) -> Tuple[Optional[Tensor], ...]:
    """One example's ``linear_backward`` from autograd through ``F.linear``.

    grad_bias is grad_output summed over the leading dims, as F.linear's bias
    gradient for a bias of shape (out_features,) (or () for a 1-D weight).
    Falls back to the matmul formulas where F.linear's own backward fails
    (some empty shapes).
    """
    rows = math.prod(x.shape[:-1])
    g2 = g.reshape(rows, w.shape[0] if w.dim() == 2 else 1)
    gb = g2.sum(0) if w.dim() == 2 else g2.sum()
    try:
        xl = x.detach().requires_grad_(True)
        wl = w.detach().requires_grad_(True)
        gi, gw = torch.autograd.grad(F.linear(xl, wl), (xl, wl), g)
    except RuntimeError:
        w2 = w if w.dim() == 2 else w.unsqueeze(0)
        gi = (g2 @ w2.conj()).reshape(x.shape)
        gw = (g2.mT @ x.reshape(rows, x.shape[-1]).conj()).reshape(w.shape)
    return tuple(t if m else None for t, m in zip((gi, gw, gb), mask))


def assert_same(actual, expected, rtol: Optional[float] = None,
                atol: Optional[float] = None, msg: str = "") -> None:
    """Compares (tuples of) tensors/None: values, shapes and dtypes."""
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected), msg
        for a, e in zip(actual, expected):
            assert_same(a, e, rtol, atol, msg)
        return
    if expected is None:
        assert actual is None, f"expected None, got a tensor: {msg}"
        return
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{msg}\n{m}")


def all_bdims(rank: int) -> List[BDim]:
    """Every batch dim choice for a tensor of logical rank ``rank``, None included."""
    return [None] + list(range(rank + 1))


def math_linear(x: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    """``x @ w.T + b`` by matmul and broadcasting, for bias shapes F.linear mishandles.

    A 1-D input's bias may carry one extra leading size-1 dim (F.linear computes
    it as a one-row matrix); it is dropped so the result keeps the output shape.
    """
    out = x @ (w.mT if w.dim() == 2 else w)
    if b is None:
        return out
    if b.dim() > out.dim():
        b = b.reshape(b.shape[1:])
    return out + b


def reference_linear(x: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    """F.linear, or :func:`math_linear` where F.linear fails on a shape it should accept
    (a 1-D weight with a bias of rank >= 1, a rank-3 bias that squeezes to 1-D)."""
    try:
        return F.linear(x, w, b)
    except RuntimeError:
        return math_linear(x, w, b)


def layout(t: Tensor, kind: str, bdim: BDim) -> Tensor:
    """``t``'s values in another physical layout: "contiguous", "transposed" (all
    strides reversed), "strided" (every other element of a wider last dim) or
    "expanded" (the batch dim has stride 0; the values are example 0's)."""
    if kind == "transposed":
        perm = list(reversed(range(t.dim())))
        return t.permute(perm).contiguous().permute(perm)
    if kind == "strided" and t.dim() > 0:
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    if kind == "expanded" and bdim is not None:
        return t.narrow(bdim, 0, 1).expand(t.shape)
    return t
