"""The loss batching rules against a for-loop of the aten op itself, in float64.

Every op the rules serve (nll_loss_forward/backward, nll_loss2d_forward/backward,
mse/smooth_l1/huber_loss_backward, huber_loss), every reduction, absent/shared/per-example
class weights, and every in_dims combination of the tensor arguments (each batch
dim position, or shared), with the vmap fallback off and routing on. ignore_index
is a valid class, so that ignored rows sit among real ones, and a batched target's
first example has all its rows ignored ('mean' gives 0/0 = nan there, as eager).
"""
import itertools
import warnings
from typing import Callable, List, Optional, Sequence

import pytest
import torch
from batching_reference import all_bdims, loop_reference
from conftest import assert_close, available_devices
from torch import Tensor
from torch.func import vmap

A = torch.ops.aten
B, N, C, H, W = 3, 4, 5, 2, 3
IGNORE = 1
REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}
DTYPE = torch.float64

pytestmark = pytest.mark.usefixtures("no_vmap_fallback", "routing_on")


def batched(make: Callable[[int], Tensor], bdim: Optional[int]) -> Tensor:
    """Examples ``make(i)`` stacked along ``bdim``; the shared ``make(1)`` when None."""
    if bdim is None:
        return make(1)
    return torch.stack([make(i) for i in range(B)], bdim)


def classes(shape: Sequence[int]) -> Callable[[int], Tensor]:
    """Targets of ``shape``: example 0 all ignored, the others with some ignored rows."""
    def make(i: int) -> Tensor:
        t = torch.randint(0, C, tuple(shape))
        if i == 0:
            return torch.full(tuple(shape), IGNORE)
        return t
    return make


def floats(shape: Sequence[int], positive: bool = False) -> Callable[[int], Tensor]:
    def make(i: int) -> Tensor:
        t = torch.randn(tuple(shape), dtype=DTYPE)
        return t.abs() + 0.5 if positive else t
    return make


def run(fn: Callable, args: List[Optional[Tensor]], in_dims: Sequence[Optional[int]],
        msg: str) -> None:
    """vmap(fn) against the loop, skipping the all-shared combination."""
    if all(d is None or a is None for a, d in zip(args, in_dims)):
        return
    dims = tuple(None if a is None else d for a, d in zip(args, in_dims))
    expected = loop_reference(fn, args, dims, B)
    actual = vmap(fn, in_dims=dims)(*args)
    assert_close(actual, expected, msg, equal_nan=True)


# (op, logical self shape, logical target shape)
NLL_SHAPES = [
    ("nll", (N, C), (N,)),
    ("nll", (C,), ()),
    ("nll", (C,), (1,)),  # eager reads the only element of a [1] target
    ("nll2d", (N, C, H, W), (N, H, W)),
]


def nll_forward_op(kind: str) -> Callable:
    return A.nll_loss2d_forward if kind == "nll2d" else A.nll_loss_forward


def nll_backward_op(kind: str) -> Callable:
    return A.nll_loss2d_backward if kind == "nll2d" else A.nll_loss_backward


def weight_choices() -> List[Optional[int]]:
    """'absent' is spelt as the string; otherwise the weight's batch dim (None: shared)."""
    return ["absent", None, 0, 1]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shapes", NLL_SHAPES, ids=lambda s: f"{s[0]}-{len(s[1])}d-t{len(s[2])}d")
def test_nll_forward_every_in_dims(shapes, reduction: str) -> None:
    kind, self_shape, target_shape = shapes
    op, red = nll_forward_op(kind), REDUCTIONS[reduction]
    for xd, td, wd in itertools.product(all_bdims(len(self_shape)), all_bdims(len(target_shape)),
                                        weight_choices()):
        x = batched(floats(self_shape), xd)
        t = batched(classes(target_shape), td)
        w = None if wd == "absent" else batched(floats((C,), positive=True), wd)
        run(lambda a, b, c: op(a, b, c, red, IGNORE), [x, t, w],
            (xd, td, None if wd == "absent" else wd), f"in_dims {(xd, td, wd)}")


def grad_output_shape(kind: str, self_shape, target_shape, reduction: str):
    if reduction != "none" or len(self_shape) == 1:
        return ()
    return target_shape


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shapes", [s for s in NLL_SHAPES if s[2] != (1,)],
                         ids=lambda s: f"{s[0]}-{len(s[1])}d")
def test_nll_backward_every_in_dims(shapes, reduction: str) -> None:
    kind, self_shape, target_shape = shapes
    op, red = nll_backward_op(kind), REDUCTIONS[reduction]
    g_shape = grad_output_shape(kind, self_shape, target_shape, reduction)
    # first, last or shared for each argument (every position for self)
    def ends(rank):
        return sorted({None, 0, rank}, key=lambda d: -1 if d is None else d)

    for gd, xd, td, wd, twd in itertools.product(ends(len(g_shape)), all_bdims(len(self_shape)),
                                                  ends(len(target_shape)), ["absent", None, 0],
                                                  [None, 0]):
        g = batched(floats(g_shape), gd)
        x = batched(floats(self_shape), xd)
        t = batched(classes(target_shape), td)
        w = None if wd == "absent" else batched(floats((C,), positive=True), wd)
        tw = batched(floats((), positive=True), twd)
        run(lambda g_, x_, t_, w_, tw_: op(g_, x_, t_, w_, red, IGNORE, tw_), [g, x, t, w, tw],
            (gd, xd, td, None if wd == "absent" else wd, twd), f"in_dims {(gd, xd, td, wd, twd)}")


def test_nll_backward_target_of_one_element() -> None:
    """A [1] target with a [C] input: eager's forward takes it (and its backward does not);
    the rule answers as stock vmap's decomposition does, with the [] target's gradient."""
    g, x = torch.rand(B, dtype=DTYPE), torch.randn(B, C, dtype=DTYPE)
    t, tw = torch.randint(0, C, (B, 1)), torch.ones(B, dtype=DTYPE)
    actual = vmap(lambda *a: A.nll_loss_backward(a[0], a[1], a[2], None, 1, -100, a[3]))(g, x, t, tw)
    expected = vmap(lambda *a: A.nll_loss_backward(a[0], a[1], a[2], None, 1, -100, a[3]))(
        g, x, t.squeeze(1), tw)
    assert_close(actual, expected, "[1] target", equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64])
def test_nll_target_dtypes(dtype: torch.dtype) -> None:
    """uint8 targets (which the kernels accept) compare with ignore_index as numbers."""
    x = torch.randn(B, N, C, dtype=DTYPE)
    t = torch.randint(0, C, (B, N)).to(dtype)
    for ignore in (-100, IGNORE):
        def fn(a, b):
            return A.nll_loss_forward(a, b, torch.ones(C, dtype=DTYPE), 1, ignore)

        assert_close(vmap(fn)(x, t), loop_reference(fn, [x, t], (0, 0), B), f"ignore {ignore}",
                     equal_nan=True)


POINTWISE = {
    "mse": lambda g, x, t, red: A.mse_loss_backward(g, x, t, red),
    "smooth_l1": lambda g, x, t, red: A.smooth_l1_loss_backward(g, x, t, red, 0.7),
    "smooth_l1_beta0": lambda g, x, t, red: A.smooth_l1_loss_backward(g, x, t, red, 0.0),
    "huber": lambda g, x, t, red: A.huber_loss_backward(g, x, t, red, 0.7),
}


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("target_shape", [(2, 3), (3,), ()], ids=["same", "row", "scalar"])
@pytest.mark.parametrize("loss", POINTWISE)
def test_pointwise_backward_every_in_dims(loss: str, target_shape, reduction: str) -> None:
    op, red = POINTWISE[loss], REDUCTIONS[reduction]
    self_shape = (2, 3)
    g_shape = self_shape if reduction == "none" else ()
    for gd, xd, td in itertools.product(all_bdims(len(g_shape)), all_bdims(len(self_shape)),
                                        all_bdims(len(target_shape))):
        # values around the smooth_l1/huber thresholds
        args = [batched(floats(g_shape), gd), batched(floats(self_shape), xd),
                batched(floats(target_shape), td)]
        run(lambda g, x, t: op(g, x, t, red), args, (gd, xd, td), f"in_dims {(gd, xd, td)}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("target_shape", [(2, 3), (3,)], ids=["same", "row"])
def test_huber_forward_every_in_dims(target_shape, reduction: str) -> None:
    """Replaces functorch's rule, whose output for a shared input and a batched target ATen
    resizes with a deprecation warning (the test suite's warnings are not errors, so the
    warning is checked for explicitly)."""
    red, self_shape = REDUCTIONS[reduction], (2, 3)
    for xd, td in itertools.product(all_bdims(len(self_shape)), all_bdims(len(target_shape))):
        args = [batched(floats(self_shape), xd), batched(floats(target_shape), td)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            run(lambda x, t: A.huber_loss(x, t, red, 0.7), args, (xd, td), f"in_dims {(xd, td)}")


@pytest.mark.parametrize("loss", POINTWISE)
def test_pointwise_backward_broadcasts_like_stock(loss: str) -> None:
    """A target larger than self: the result has the broadcast shape, as stock vmap's
    decomposition gives (eager resizes its output to it with a deprecation warning)."""
    op = POINTWISE[loss]
    g, x, t = torch.randn(B, dtype=DTYPE), torch.randn(B, 3, dtype=DTYPE), torch.randn(2, 3, dtype=DTYPE)
    def fn(g_, x_, t_):
        return op(g_, x_, t_, 1)

    actual = vmap(fn, in_dims=(0, 0, None))(g, x, t)
    expected = torch.stack([op(g[i], x[i].expand(2, 3), t, 2) / x[i].numel() for i in range(B)])
    assert_close(actual, expected, "broadcast", equal_nan=True)


@pytest.mark.parametrize("device", available_devices())
def test_rules_on_device(device: str) -> None:
    """Representative cases of every rule on each available device (CUDA when present)."""
    with torch.device(device):
        x, t = torch.randn(B, N, C, dtype=DTYPE), torch.randint(0, C, (B, N))
        t[0] = IGNORE
        w = torch.rand(B, C, dtype=DTYPE)
        g, tw = torch.rand(B, dtype=DTYPE), torch.rand(B, dtype=DTYPE) + 0.5
        x2d, t2d = torch.randn(B, N, C, H, W, dtype=DTYPE), torch.randint(0, C, (B, N, H, W))
        y = torch.randn(B, N, C, dtype=DTYPE)
        cases = [
            (lambda a, b, c: A.nll_loss_forward(a, b, c, 1, IGNORE), [x, t, w], (0, 0, 0)),
            (lambda a, b: A.nll_loss2d_forward(a, b, None, 1, IGNORE), [x2d, t2d], (0, 0)),
            (lambda g_, a, b, c: A.nll_loss_backward(g_, a, b, None, 1, IGNORE, c), [g, x, t, tw],
             (0, 0, 0, 0)),
            (lambda g_, a, b, c: A.nll_loss2d_backward(g_, a, b, None, 2, IGNORE, c),
             [g, x2d, t2d, tw], (0, 0, 0, 0)),
            (lambda g_, a, b: A.mse_loss_backward(g_, a, b, 1), [g, x, y[0]], (0, 0, None)),
            (lambda g_, a, b: A.huber_loss_backward(g_, a, b, 1, 0.5), [g, x, y], (0, 0, 0)),
        ]
        for k, (fn, args, dims) in enumerate(cases):
            run(fn, args, dims, f"case {k} on {device}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_examples(reduction: str) -> None:
    """Examples with no rows: 'mean' is 0/0 = nan, as in eager; gradients are empty."""
    red = REDUCTIONS[reduction]
    x, t = torch.randn(B, 0, C, dtype=DTYPE), torch.zeros(B, 0, dtype=torch.long)
    g = torch.randn(B, 0, dtype=DTYPE) if reduction == "none" else torch.randn(B, dtype=DTYPE)
    tw = torch.zeros((), dtype=DTYPE)
    run(lambda a, b: A.nll_loss_forward(a, b, None, red, IGNORE), [x, t], (0, 0), "forward")
    run(lambda g_, a, b: A.nll_loss_backward(g_, a, b, None, red, IGNORE, tw), [g, x, t], (0, 0, 0),
        "backward")
    run(lambda a, b: A.huber_loss(a, b, red, 1.0), [x, x], (0, 0), "huber")
