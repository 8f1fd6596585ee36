"""For-loop reference of clipped_grad: one autograd.grad per sample, then clip and sum.

Independent of vmap and of batchrules: each sample's arguments are sliced out
along their in_dims (pytrees of dims included) and its loss is differentiated
on its own, in float64 where the tests ask for it. Also the clipping of
materialized per-sample gradients (vmap(grad)'s), and the comparisons the DP
tests make (``check_model``: clipped_grad against the loop).
"""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

import batchrules

EPS = 1e-6
BATCH = 5  # check_model's data


def _select(arg: Any, dims: Any, i: int) -> Any:
    """Sample ``i`` of an argument batched along ``dims`` (an int, None, or a pytree of them)."""
    if dims is None:
        return arg
    if isinstance(dims, int):
        return tree_map(lambda t: t.select(dims, i), arg)
    return tree_map(lambda d, t: t if d is None else t.select(d, i), dims, arg,
                    is_leaf=lambda x: x is None)


def batch_size(args: Sequence[Any], in_dims: Sequence[Any]) -> int:
    for arg, dims in zip(args, in_dims):
        if dims is None:
            continue
        leaves = tree_flatten(arg)[0]
        dim_leaves = [dims] * len(leaves) if isinstance(dims, int) else tree_flatten(dims)[0]
        for t, d in zip(leaves, dim_leaves):
            if d is not None:
                return t.shape[d]
    raise ValueError("no batched argument")


def per_sample_grads(loss: Callable[..., Any], args: Sequence[Any], argnums: Tuple[int, ...],
                     in_dims: Sequence[Any], has_aux: bool = False) -> Tuple[List[List[Tensor]], list]:
    """Per sample, the gradients of the differentiated leaves (in flatten order)."""
    rows, specs = [], []
    for i in range(batch_size(args, in_dims)):
        sample = [_select(a, d, i) for a, d in zip(args, in_dims)]
        leaves: List[Tensor] = []
        for pos in argnums:
            flat, spec = tree_flatten(sample[pos])
            flat = [t.detach().requires_grad_() for t in flat]
            leaves += flat
            sample[pos] = tree_unflatten(flat, spec)
            if i == 0:
                specs.append(spec)
        out = loss(*sample)
        value = out[0] if has_aux else out
        grads = torch.autograd.grad(value, leaves, allow_unused=True)
        rows.append([torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)])
    return rows, specs


def loop_clipped_grad(loss: Callable[..., Any], max_norm: float, args: Sequence[Any],
                      argnums: Any = 0, in_dims: Optional[Sequence[Any]] = None,
                      has_aux: bool = False) -> Tuple[Any, Tensor]:
    """``(clipped_sum, norms)`` as ``batchrules.clipped_grad`` defines them, by a loop."""
    positions = argnums if isinstance(argnums, tuple) else (argnums,)
    if in_dims is None:
        in_dims = tuple(None if i in positions else 0 for i in range(len(args)))
    rows, specs = per_sample_grads(loss, args, positions, in_dims, has_aux)
    leaves = [t for pos in positions for t in tree_flatten(args[pos])[0]]
    norms = torch.stack([torch.cat([g.flatten() for g in row]).norm() if row else
                         torch.zeros((), dtype=torch.float64) for row in rows]) \
        if rows else torch.zeros(0, dtype=leaves[0].dtype if leaves else torch.float64)
    coef = clip_coef(norms, max_norm)
    sums = [sum((c * row[k] for c, row in zip(coef, rows)), torch.zeros_like(leaf))
            for k, leaf in enumerate(leaves)]
    it = iter(sums)
    results = tuple(tree_unflatten([next(it) for _ in range(spec.num_leaves)], spec)
                    for spec in (specs or [tree_flatten(args[p])[1] for p in positions]))
    return (results if isinstance(argnums, tuple) else results[0]), norms


def clip_coef(norms: Tensor, max_norm: float) -> Tensor:
    """Each sample's clipping coefficient ``min(1, max_norm / (norm + EPS))``."""
    return (max_norm / (norms + EPS)).clamp(max=1.0)


def clipped_sum(x: Tensor, y: Tensor, c: Tensor) -> Tensor:
    """A layer's clipped sum ``sum_i c_i x_i^T y_i`` over rows ``[B, T, *]``, in float64."""
    return torch.einsum("b,btm,btn->mn", c.double(), x.double(), y.double())


def per_sample_norms(per: Dict[str, Tensor]) -> Tensor:
    """``[B]``: the norms of the per-sample gradients ``per`` (``[B, *shape]``
    each, vmap(grad)'s) over all parameters together."""
    return torch.cat([g.flatten(1) for g in per.values()], 1).norm(dim=1)


def materialized_clipped_grad(per: Dict[str, Tensor],
                              max_norm: float) -> Tuple[Dict[str, Tensor], Tensor]:
    """``(clipped_sum, norms)`` as ``batchrules.clipped_grad`` defines them,
    from materialized per-sample gradients (``per_sample_norms``)."""
    norms = per_sample_norms(per)
    coef = clip_coef(norms, max_norm)
    return {k: torch.tensordot(coef, g, dims=1) for k, g in per.items()}, norms


def assert_close_rel(actual: Any, expected: Any, rel: float = 1e-10, min_scale: float = 1e-30) -> None:
    """Same pytree structure, shapes and dtypes; every leaf within ``rel`` of
    the largest magnitude of its expected value (at least ``min_scale``)."""
    got, got_spec = tree_flatten(actual)
    want, want_spec = tree_flatten(expected)
    assert got_spec == want_spec, f"structure {got_spec} != {want_spec}"
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        scale = max(w.abs().max().item() if w.numel() else 0.0, min_scale)
        err = (g.double() - w.double()).abs().max().item() if w.numel() else 0.0
        assert err <= rel * scale, f"max abs error {err:.3g} vs scale {scale:.3g}"


def check_model(model: nn.Module, x: Tensor, y: Tensor,
                loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
                max_norm: float = 0.5, unsqueeze: bool = True) -> None:
    """clipped_grad of ``model``'s loss on one sample (made a batch of one when
    ``unsqueeze``) against the per-sample loop, in float64."""
    model = model.double()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        if unsqueeze:
            xi, yi = xi.unsqueeze(0), yi.unsqueeze(0)
        return loss_fn(functional_call(model, p, (xi,)), yi)

    want = loop_clipped_grad(loss, max_norm, (params, x, y))
    got = batchrules.clipped_grad(loss, max_norm)(params, x, y)
    assert_close_rel(got, want)
    assert (want[1] > max_norm).any(), "the test must clip some samples"


def data(*shape: int, classes: int = 3) -> Tuple[Tensor, Tensor]:
    """``BATCH`` float64 inputs of per-sample ``shape`` and class labels."""
    torch.manual_seed(0)
    return torch.randn(BATCH, *shape, dtype=torch.float64), torch.randint(classes, (BATCH,))
