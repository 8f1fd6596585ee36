"""torch.func compositions over linear match for-loop references built on F.linear.

Each transform stack runs with the vmap fallback off, both on batchrules.linear
called directly and on F.linear routed to it. References are computed outside
torch.func transforms (per-example loops with torch.autograd), where routing
has no effect, so they exercise stock F.linear only.
"""
from typing import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from batching_reference import assert_same, physical_shape
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import batchrules

B, E, T, IN, OUT = 4, 3, 5, 6, 7
DTYPE = torch.float64

pytestmark = pytest.mark.usefixtures("no_vmap_fallback")


@pytest.fixture(params=["op", "routed_F.linear"])
def linear(request) -> Iterator[Callable]:
    """The linear under test: batchrules.linear, or F.linear with routing on."""
    if request.param == "op":
        yield batchrules.linear
    else:
        with batchrules.enabled(True):
            yield F.linear


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(shape, dtype=DTYPE)


def model(lin: Callable, x, w, b):
    """A non-linearity after linear, so second derivatives are not trivial."""
    return torch.tanh(lin(x, w, b))


def loss(lin: Callable, w, b, x):
    return model(lin, x, w, b).pow(2).sum()


def autograd_grads(w, b, x):
    """d loss / d (w, b) for one example, by torch.autograd through F.linear."""
    w, b = w.detach().requires_grad_(True), b.detach().requires_grad_(True)
    return torch.autograd.grad(loss(F.linear, w, b, x), (w, b))


def stacked(per_example):
    return tuple(torch.stack(ts) for ts in zip(*per_example))


@pytest.mark.parametrize("example_shape", [(IN,), (T, IN)], ids=["vector", "sequence"])
def test_vmap_grad_per_sample(linear, example_shape) -> None:
    w, b, x = rand(OUT, IN), rand(OUT), rand(B, *example_shape)
    actual = vmap(grad(lambda w, b, x: loss(linear, w, b, x), (0, 1)), (None, None, 0))(w, b, x)
    assert_same(actual, stacked(autograd_grads(w, b, xi) for xi in x))


def test_grad_of_vmap_over_ensemble(linear) -> None:
    ws, bs, x = rand(E, OUT, IN), rand(E, OUT), rand(T, IN)

    def total(ws, bs, x):
        return vmap(model, (None, None, 0, 0))(linear, x, ws, bs).pow(2).sum()

    actual = grad(total, (0, 1, 2))(ws, bs, x)
    leaves = [t.detach().requires_grad_(True) for t in (ws, bs, x)]
    ref = sum(loss(F.linear, leaves[0][e], leaves[1][e], leaves[2]) for e in range(E))
    assert_same(actual, torch.autograd.grad(ref, leaves))


def test_vmap_vmap_grad_ensemble_of_per_sample(linear) -> None:
    ws, bs, x = rand(E, OUT, IN), rand(E, OUT), rand(B, T, IN)
    per_sample = vmap(grad(lambda w, b, x: loss(linear, w, b, x), (0, 1)), (None, None, 0))
    actual = vmap(per_sample, (0, 0, None))(ws, bs, x)
    expected = stacked(stacked(autograd_grads(ws[e], bs[e], xi) for xi in x) for e in range(E))
    assert_same(actual, expected)


def test_vmap_grad_vmap_per_sample_weights(linear) -> None:
    """A grad transform between two vmap levels that both batch the weights."""
    ws, bs, xs = rand(E, B, OUT, IN), rand(E, B, OUT), rand(E, B, T, IN)

    def member_loss(w, b, x):
        return vmap(model, (None, 0, 0, 0))(linear, x, w, b).pow(2).sum()

    actual = vmap(grad(member_loss, (0, 1)))(ws, bs, xs)
    per_member = []
    for e in range(E):
        w, b = ws[e].detach().requires_grad_(True), bs[e].detach().requires_grad_(True)
        total = sum(loss(F.linear, w[i], b[i], xs[e, i]) for i in range(B))
        per_member.append(torch.autograd.grad(total, (w, b)))
    assert_same(actual, stacked(per_member))


def test_three_vmap_levels_of_per_example_weights(linear) -> None:
    x, w, b = rand(2, E, B, T, IN), rand(2, E, B, OUT, IN), rand(2, E, B, OUT)
    actual = vmap(vmap(vmap(linear)))(x, w, b)
    expected = torch.stack([torch.stack([torch.stack([
        F.linear(x[i, j, k], w[i, j, k], b[i, j, k]) for k in range(B)]) for j in range(E)])
        for i in range(2)])
    assert_same(actual, expected)


def test_vmap_vjp_batched_primals_and_cotangents(linear) -> None:
    x, w, b, g = rand(B, T, IN), rand(B, OUT, IN), rand(OUT), rand(B, T, OUT)

    def vjp_all(x, w, g):
        _, pullback = vjp(lambda x, w, b: model(linear, x, w, b), x, w, b)
        return pullback(g)

    actual = vmap(vjp_all, (0, 0, 0))(x, w, g)
    per_example = []
    for i in range(B):
        leaves = [t.detach().requires_grad_(True) for t in (x[i], w[i], b)]
        per_example.append(torch.autograd.grad(model(F.linear, *leaves), leaves, g[i]))
    assert_same(actual, stacked(per_example))


def test_vmap_jvp(linear) -> None:
    x, w, b = rand(B, T, IN), rand(OUT, IN), rand(B, OUT)
    dx, dw, db = rand(B, T, IN), rand(B, OUT, IN), rand(B, OUT)

    def tangent(x, w, b, dx, dw, db):
        return jvp(lambda x, w, b: model(linear, x, w, b), (x, w, b), (dx, dw, db))

    actual = vmap(tangent, (0, None, 0, 0, 0, 0))(x, w, b, dx, dw, db)
    per_example = []
    for i in range(B):
        with torch.autograd.forward_ad.dual_level():
            fw = torch.autograd.forward_ad
            out = model(F.linear, fw.make_dual(x[i], dx[i]), fw.make_dual(w, dw[i]),
                        fw.make_dual(b[i], db[i]))
            per_example.append(tuple(t.clone() for t in fw.unpack_dual(out)[:2]))
    assert_same(actual, stacked(per_example))


@pytest.mark.parametrize("jac", [jacrev, jacfwd], ids=["jacrev", "jacfwd"])
def test_jacobians(linear, jac) -> None:
    x, w, b = rand(T, IN), rand(OUT, IN), rand(OUT)
    actual = jac(lambda x, w, b: model(linear, x, w, b), argnums=(0, 1, 2))(x, w, b)
    expected = torch.autograd.functional.jacobian(
        lambda x, w, b: model(F.linear, x, w, b), (x, w, b))
    assert_same(actual, expected)


def test_hessian(linear) -> None:
    x, w, b = rand(T, IN), rand(OUT, IN), rand(OUT)
    actual = hessian(lambda x, w: loss(linear, w, b, x), argnums=(0, 1))(x, w)
    expected = torch.autograd.functional.hessian(lambda x, w: loss(F.linear, w, b, x), (x, w))
    assert_same(actual, expected)


def test_vmap_chunk_size(linear) -> None:
    w, b, x = rand(OUT, IN), rand(OUT), rand(5, T, IN)
    per_sample = grad(lambda w, b, x: loss(linear, w, b, x), (0, 1))
    actual = vmap(per_sample, (None, None, 0), chunk_size=2)(w, b, x)
    assert_same(actual, stacked(autograd_grads(w, b, xi) for xi in x))


@pytest.mark.parametrize("in_dims,out_dims", [
    ((1, None, None), 1), ((2, 0, None), 0), ((None, 2, 0), 2), ((1, 1, 1), -1)])
def test_in_dims_out_dims(linear, in_dims, out_dims) -> None:
    logical = {0: (T, IN), 1: (OUT, IN), 2: (OUT,)}
    args = [rand(*physical_shape(logical[k], d, B)) for k, d in enumerate(in_dims)]
    actual = vmap(lambda x, w, b: model(linear, x, w, b), in_dims, out_dims)(*args)
    examples = [[a if d is None else a.select(d, i) for a, d in zip(args, in_dims)]
                for i in range(B)]
    expected = torch.stack([model(F.linear, *ex) for ex in examples], dim=out_dims)
    assert_same(actual, expected)


def test_nn_linear_functional_call_per_sample_grads() -> None:
    """The Opacus-style recipe: functional_call of an nn.Module under vmap(grad)."""
    net = torch.nn.Sequential(torch.nn.Linear(IN, OUT), torch.nn.Tanh(),
                              torch.nn.Linear(OUT, 3)).to(DTYPE)
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = rand(B, T, IN)

    def sample_loss(p, xi):
        return torch.func.functional_call(net, p, (xi,)).pow(2).sum()

    with batchrules.enabled(True):
        actual = vmap(grad(sample_loss), (None, 0))(params, x)
    for i in range(B):
        expected = torch.autograd.grad(net(x[i]).pow(2).sum(), list(net.parameters()))
        for (name, value), ref in zip(actual.items(), expected):
            assert_same(value[i], ref, msg=name)
