"""Batching rules of the activation ops against for-loop references, with the
vmap fallback disabled: every in_dims combination (one operand shared, batch
dims anywhere, operands that broadcast), out_dims, nested vmap, and the
transforms composed with vmap (grad, jacrev, jacfwd, hessian, jvp)."""
import itertools
from typing import Callable

import pytest
import torch
from activation_samples import ACTS, BACKWARD_SHAPES, SHAPES, Act
from batching_reference import all_bdims, assert_same, loop_reference, physical
from torch import Tensor
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

BATCH = 6
DTYPE = torch.float64

pytestmark = pytest.mark.usefixtures("no_vmap_fallback")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_forward_every_bdim(act: Act) -> None:
    for shape in SHAPES:
        for bdim in all_bdims(len(shape))[1:]:
            x = physical(shape, bdim, BATCH, DTYPE, gen(0))
            for out_dim in range(len(shape) + 1):
                got = vmap(act.op, in_dims=bdim, out_dims=out_dim)(x)
                want = loop_reference(act.stock, [x], [bdim], BATCH, out_dim)
                assert_same(got, want, msg=f"{shape} bdim {bdim} out_dim {out_dim}")


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_backward_every_in_dims(act: Act) -> None:
    """Every (grad_output, self) batch dim pair, shared operands included, over
    operands of equal and of different per-example shapes."""
    for g_shape, x_shape in BACKWARD_SHAPES:
        for g_bdim, x_bdim in itertools.product(all_bdims(len(g_shape)), all_bdims(len(x_shape))):
            if g_bdim is None and x_bdim is None:
                continue
            g = physical(g_shape, g_bdim, BATCH, DTYPE, gen(1))
            x = physical(x_shape, x_bdim, BATCH, DTYPE, gen(2))
            got = vmap(act.backward, in_dims=(g_bdim, x_bdim))(g, x)
            want = loop_reference(act.stock_backward, [g, x], [g_bdim, x_bdim], BATCH)
            assert_same(got, want, msg=f"{g_shape}@{g_bdim}, {x_shape}@{x_bdim}")


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_backward_shared_operand_is_not_copied(act: Act) -> None:
    """A shared operand broadcasts as a stride-0 view: the result is B x the example
    size and the shared operand's storage is read as it is."""
    x = torch.randn(3, 4, dtype=DTYPE)
    g = torch.randn(BATCH, 3, 4, dtype=DTYPE)
    got = vmap(act.backward, in_dims=(0, None))(g, x)
    assert got.shape == (BATCH, 3, 4)
    assert_same(got, act.stock_backward(g, x.expand(BATCH, 3, 4)))


NESTED = [
    # (inner in_dims, outer in_dims, g logical shape, x logical shape)
    ((0, 0), (0, 0), (3, 4), (3, 4)),
    ((None, 1), (2, 0), (3, 4), (3, 4)),
    ((1, None), (None, 0), (4,), (3, 4)),
    ((0, 0), (1, None), (3, 1), (4,)),
]


@pytest.mark.parametrize("case", NESTED, ids=str)
@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_nested_vmap_backward(act: Act, case) -> None:
    inner, outer, g_shape, x_shape = case
    outer_b, inner_b = 2, 5

    def build(shape, i_dim, o_dim, seed):
        t = physical(shape, i_dim, inner_b, DTYPE, gen(seed))
        return physical(t.shape, o_dim, outer_b, DTYPE, gen(seed)) if o_dim is not None else t

    g, x = build(g_shape, inner[0], outer[0], 1), build(x_shape, inner[1], outer[1], 2)
    got = vmap(vmap(act.backward, in_dims=inner), in_dims=outer)(g, x)
    want = loop_reference(lambda gi, xi: loop_reference(act.stock_backward, [gi, xi], inner,
                                                        inner_b),
                          [g, x], outer, outer_b)
    assert_same(got, want)


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_three_levels_forward(act: Act) -> None:
    x = torch.randn(2, 3, 4, 5, dtype=DTYPE)
    got = vmap(vmap(vmap(act.op, in_dims=1), in_dims=2), in_dims=0)(x)
    want = act.stock(x).permute(0, 3, 2, 1)
    assert_same(got, want)


# ---------------------------------------------------------------- composed transforms

def mlp_loss(op: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
    """A two-layer network with the activation, as a function of its weights and data."""
    def loss(w1: Tensor, w2: Tensor, x: Tensor) -> Tensor:
        return (op(op(x @ w1.T) @ w2.T) ** 2).sum()

    return loss


def weights(seed: int):
    g = gen(seed)
    return (torch.randn(BATCH, 5, 4, dtype=DTYPE, generator=g),
            torch.randn(BATCH, 3, 5, dtype=DTYPE, generator=g),
            torch.randn(BATCH, 2, 4, dtype=DTYPE, generator=g))


TRANSFORMS = {
    "grad": lambda f: grad(f, argnums=(0, 1)),
    "jacrev": lambda f: jacrev(f, argnums=2),
    "jacfwd": lambda f: jacfwd(f, argnums=2),
    "hessian": lambda f: hessian(f, argnums=0),
    "jacfwd_jacrev": lambda f: jacfwd(jacrev(f, argnums=1), argnums=1),
    "grad_of_grad": lambda f: grad(lambda *a: grad(f, argnums=0)(*a).sum(), argnums=2),
}


@pytest.mark.parametrize("in_dims", [(0, 0, 0), (0, 0, None), (None, None, 0)], ids=str)
@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_vmap_of_transform_matches_loop(act: Act, transform: str, in_dims) -> None:
    w1, w2, x = weights(0)
    args = [t[0] if d is None else t for t, d in zip((w1, w2, x), in_dims)]
    got = vmap(TRANSFORMS[transform](mlp_loss(act.op)), in_dims=in_dims)(*args)
    want = loop_reference(TRANSFORMS[transform](mlp_loss(act.stock)), args, in_dims, BATCH)
    assert_same(got, want)


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_transform_of_vmap_matches_loop(act: Act) -> None:
    """grad and jacrev outside vmap (the batched kernels run under an enclosing grad)."""
    w1, w2, x = weights(1)

    def batched_loss(op):
        return lambda a, b, c: vmap(mlp_loss(op))(a, b, c).sum()

    for transform in (lambda f: grad(f, argnums=(0, 2)), lambda f: hessian(f, argnums=1)):
        assert_same(transform(batched_loss(act.op))(w1, w2, x),
                    transform(batched_loss(act.stock))(w1, w2, x))


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_plain_autograd_through_vmap(act: Act) -> None:
    """torch.autograd outside vmap: the batched kernels' calls record our nodes."""
    x, g = torch.randn(BATCH, 3, dtype=DTYPE), torch.randn(BATCH, 3, dtype=DTYPE)
    ours, stock = x.clone().requires_grad_(), x.clone().requires_grad_()
    (got,) = torch.autograd.grad(vmap(act.op, in_dims=1, out_dims=1)(ours.T), ours, g.T)
    (want,) = torch.autograd.grad(act.stock(stock), stock, g)
    assert_same(got, want)


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_vmap_of_jvp(act: Act) -> None:
    x, v = torch.randn(BATCH, 3, dtype=DTYPE), torch.randn(BATCH, 3, dtype=DTYPE)
    got = vmap(lambda a, b: jvp(act.op, (a,), (b,)))(x, v)
    want = loop_reference(lambda a, b: jvp(act.stock, (a,), (b,)), [x, v], [0, 0], BATCH)
    assert_same(got, want)


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_errors_name_per_example_shapes(act: Act) -> None:
    g, x = torch.randn(BATCH, 2, 3), torch.randn(BATCH, 4, 3)
    with pytest.raises(RuntimeError, match=rf"batchrules.{act.name}_backward: grad_output of "
                                           r"shape \[2, 3\] and self of shape \[4, 3\] cannot be "
                                           r"broadcast together"):
        vmap(act.backward)(g, x)
    with pytest.raises(RuntimeError, match=rf"batchrules.{act.name}: expected self to be a "
                                           r"floating-point"):
        vmap(act.op)(torch.ones(BATCH, 2, dtype=torch.long))
