"""aten::addmm under vmap with routing on (Note [Folding addmm's batch into its
rows], csrc/linear/batch_rule_addmm.cpp): a batched mat1 with a row bias is
one addmm over the folded rows; every other case is functorch's own
decomposition. Values against a per-example loop in float64, with the vmap
fallback off; the kernels that run; autocast and errors as stock's."""
import itertools

import pytest
import torch
from batching_profile import ran_kernels
from torch.func import grad, jacfwd, vjp, vmap

import batchrules

pytestmark = pytest.mark.usefixtures("no_vmap_fallback")

B, N, K, M = 3, 4, 5, 6
SELF_SHAPES = [(M,), (1, M), (1,), (), (N, M), (N, 1)]


def r(*shape, dtype=torch.float64):
    return torch.randn(shape, dtype=dtype)


def batched(shape, dim):
    """A tensor of per-example ``shape`` batched along ``dim`` (None: unbatched)."""
    if dim is None:
        return r(*shape)
    full = list(shape)
    full.insert(dim, B)
    return r(*full)


def loop(fn, args, in_dims):
    def example(i):
        return fn(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims)))
    return torch.stack([example(i) for i in range(B)])


@pytest.mark.parametrize("self_shape", SELF_SHAPES, ids=str)
@pytest.mark.parametrize("in_dims", [d for d in itertools.product([None, 0, 1], repeat=3)
                                     if any(x is not None for x in d)], ids=str)
@pytest.mark.parametrize("scalars", [(1, 1), (0.5, -2.0)], ids=["plain", "beta_alpha"])
def test_values_equal_the_loop(self_shape, in_dims, scalars) -> None:
    if in_dims[0] is not None and in_dims[0] >= len(self_shape) + 1:
        pytest.skip("no such dim")
    beta, alpha = scalars
    args = (batched(self_shape, in_dims[0]), batched((N, K), in_dims[1]),
            batched((K, M), in_dims[2]))

    def fn(s, x, w):
        return torch.addmm(s, x, w, beta=beta, alpha=alpha)

    with batchrules.enabled():
        got = vmap(fn, in_dims)(*args)
    torch.testing.assert_close(got, loop(fn, args, in_dims))


@pytest.mark.parametrize("self_shape", [(M,), (1, M), (1,), ()], ids=str)
@pytest.mark.parametrize("x_dim", [0, 1])
def test_a_batched_mat1_with_a_row_bias_is_one_addmm(self_shape, x_dim) -> None:
    args = (r(*self_shape), batched((N, K), x_dim), r(K, M))
    fn = vmap(torch.addmm, (None, x_dim, None))
    with batchrules.enabled(False):
        stock = ran_kernels(fn, *args)  # functorch's decomposition: a GEMM, then mul and add
    assert {"add", "mul"} <= set(stock) and "addmm" not in stock
    # a batch dim behind the rows is moved to the front: one copy, then the fold
    want = ["addmm"] if x_dim == 0 else ["addmm", "copy_"]
    with batchrules.enabled():
        assert ran_kernels(fn, *args) == want


@pytest.mark.parametrize("in_dims, shapes", [
    ((0, 0, None), ((M,), (N, K), (K, M))),  # batched bias
    ((None, 0, 0), ((M,), (N, K), (K, M))),  # batched weight
    ((None, 0, None), ((N, M), (N, K), (K, M))),  # a bias with rows
])
def test_other_cases_run_the_decomposition(in_dims, shapes) -> None:
    args = [batched(s, d) for s, d in zip(shapes, in_dims)]
    fn = vmap(torch.addmm, in_dims)
    with batchrules.enabled(False):
        stock = ran_kernels(fn, *args)
    with batchrules.enabled():
        assert ran_kernels(fn, *args) == stock


def test_under_autograd_and_forward_mode() -> None:
    """grad through vmap, vmap of grad (per-sample gradients), vjp and jacfwd."""
    s, x, w = r(M), r(B, N, K), r(K, M)

    def loss(s, xi, w):
        return torch.addmm(s, xi, w).tanh().sum()

    def per_example(fn):
        return torch.stack([fn(s, xi, w) for xi in x])

    with batchrules.enabled():
        psg = vmap(grad(loss, argnums=(0, 2)), (None, 0, None))(s, x, w)
        summed = grad(lambda s, w: vmap(loss, (None, 0, None))(s, x, w).sum(), argnums=(0, 1))(s, w)
        out, pullback = vjp(lambda x: vmap(torch.addmm, (None, 0, None))(s, x, w), x)
        (gx,) = pullback(torch.ones_like(out))
        jac = vmap(jacfwd(lambda xi: torch.addmm(s, xi, w)))(x)
    for got, argnum in zip(psg, (0, 2)):
        torch.testing.assert_close(got, per_example(grad(loss, argnums=argnum)))
    torch.testing.assert_close(summed[0], psg[0].sum(0))
    torch.testing.assert_close(summed[1], psg[1].sum(0))
    torch.testing.assert_close(gx, torch.ones(B, N, M, dtype=torch.float64) @ w.t())
    want = torch.stack([torch.func.jacfwd(lambda xi: torch.addmm(s, xi, w))(xi) for xi in x])
    torch.testing.assert_close(jac, want)


def test_nested_vmap() -> None:
    s, x, w = r(M), r(2, B, N, K), r(K, M)
    with batchrules.enabled():
        got = vmap(vmap(torch.addmm, (None, 0, None)), (None, 0, None))(s, x, w)
    torch.testing.assert_close(got, torch.addmm(s, x.reshape(-1, K), w).view(2, B, N, M))


@pytest.mark.parametrize("in_dims", [(None, 0, None), (0, 0, None), (None, 0, 0)])
def test_autocast_returns_eager_addmm_dtype(in_dims) -> None:
    """Under autocast each example's addmm returns bfloat16; so does the routed
    vmap, folded or not (stock's decomposition adds a float32 bias to the
    bfloat16 GEMM, which promotes)."""
    shapes = ((M,), (N, K), (K, M))
    args = [r(*((B,) + s if d == 0 else s), dtype=torch.float32) for s, d in zip(shapes, in_dims)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with batchrules.enabled():
            got = vmap(torch.addmm, in_dims)(*args)
        want = torch.stack([torch.addmm(*(a[i] if d == 0 else a for a, d in zip(args, in_dims)))
                            for i in range(B)])
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("shapes", [((M,), (N, K), (K + 1, M)), ((M + 1,), (N, K), (K, M)),
                                    ((M,), (K,), (K, M))])
def test_bad_shapes_raise_as_stock(shapes) -> None:
    args = (r(*shapes[0]), r(B, *shapes[1]), r(*shapes[2]))
    fn = vmap(torch.addmm, (None, 0, None))
    with batchrules.enabled(False), pytest.raises(RuntimeError) as stock:
        fn(*args)
    with batchrules.enabled(), pytest.raises(RuntimeError) as routed:
        fn(*args)
    assert str(routed.value) == str(stock.value)
