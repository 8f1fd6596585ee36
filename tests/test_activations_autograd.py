"""Explicit autograd formulas of the activation ops.

Numerical checks in float64 (gradcheck and gradgradcheck with forward AD,
forward-over-reverse and batched gradients, third order through the backward
op), the analytic derivatives against autograd through F.silu / F.mish (which
differentiates ATen's infinitely differentiable composite), and the graph:
one batchrules node per order, no aten composite.
"""
from typing import List

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from activation_samples import ACTS, BACKWARD_SHAPES, SHAPES, Act, sample
from torch import Tensor
from torch.autograd import gradcheck, gradgradcheck
from torch.func import hessian, jacfwd, jacrev, jvp

CHECKS = dict(check_forward_ad=True, check_backward_ad=True, check_batched_grad=True,
              check_undefined_grad=True)


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_gradcheck_forward_op(act: Act) -> None:
    for shape in SHAPES:
        for layout in ("contiguous", "transposed"):
            x = sample(shape, requires_grad=True, layout=layout)
            assert gradcheck(act.op, (x,), check_batched_forward_grad=True, **CHECKS)
            assert gradgradcheck(act.op, (x,), check_fwd_over_rev=True, check_rev_over_rev=True,
                                 check_batched_grad=True)


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_gradcheck_backward_op(act: Act) -> None:
    """First and second derivatives of <act>_backward (second and third of the
    activation), with broadcast operands."""
    for g_shape, x_shape in BACKWARD_SHAPES:
        g = sample(g_shape, requires_grad=True, seed=1)
        x = sample(x_shape, requires_grad=True)
        assert gradcheck(act.backward, (g, x), check_batched_forward_grad=True, **CHECKS)
        assert gradgradcheck(act.backward, (g, x), check_fwd_over_rev=True,
                             check_rev_over_rev=True, check_batched_grad=True)


def derivatives(fn, x: Tensor, order: int) -> List[Tensor]:
    """d^k/dx^k sum(fn(x)) elementwise for k = 1..order, by reverse mode."""
    out, results = fn(x).sum(), []
    for _ in range(order):
        (out,) = torch.autograd.grad(out, x, create_graph=True)
        results.append(out)
        out = out.sum()
    return results


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_derivatives_up_to_fourth_order_match_stock(act: Act) -> None:
    x = torch.linspace(-25, 25, 101, dtype=torch.float64, requires_grad=True)
    for ours, stock in zip(derivatives(act.op, x, 4), derivatives(act.stock, x, 4)):
        torch.testing.assert_close(ours, stock)


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_func_transforms_match_stock(act: Act) -> None:
    """jvp, jacrev, jacfwd and hessian (fwd-over-rev) of a function mixing the op with
    other ops, against the same function with the stock activation."""
    x, v = sample((4,), seed=2), sample((4,), seed=3)

    def f(op):
        return lambda t: (op(t * t.flip(0)) * t.cos()).sum()

    for transform in (lambda fn: jvp(fn, (x,), (v,)), lambda fn: jacrev(jacrev(fn))(x),
                      lambda fn: jacfwd(jacrev(fn))(x), lambda fn: jacrev(jacfwd(fn))(x),
                      lambda fn: hessian(fn)(x)):
        torch.testing.assert_close(transform(f(act.op)), transform(f(act.stock)))


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_dual_tensor_forward_ad(act: Act) -> None:
    x, dx = sample((2, 3)), sample((2, 3), seed=1)
    g, dg = sample((2, 3), seed=2), sample((2, 3), seed=3)
    with fwAD.dual_level():
        out = fwAD.unpack_dual(act.op(fwAD.make_dual(x, dx))).tangent
        torch.testing.assert_close(out, act.stock_backward(dx, x))
        # Only one operand of the backward op dual: each term on its own.
        only_g = fwAD.unpack_dual(act.backward(fwAD.make_dual(g, dg), x)).tangent
        torch.testing.assert_close(only_g, act.stock_backward(dg, x))
        only_x = fwAD.unpack_dual(act.backward(g, fwAD.make_dual(x, dx))).tangent
    xr = x.clone().requires_grad_()
    (first,) = torch.autograd.grad(act.stock(xr), xr, g, create_graph=True)
    (want,) = torch.autograd.grad(first, xr, dx)  # g f''(x) dx
    torch.testing.assert_close(only_x, want)


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_graph_has_one_batchrules_node_per_order(act: Act) -> None:
    x = sample((3,), requires_grad=True)
    y = act.op(x)
    node = f"Batchrules{act.name.capitalize()}Backward0"
    assert y.grad_fn.name() == node
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    assert g.grad_fn.name() == f"Batchrules{act.name.capitalize()}BackwardBackward0"
    (gg,) = torch.autograd.grad(g.sum(), x, create_graph=True)
    # The second derivative is written in differentiable aten ops.
    assert gg.grad_fn is not None and not gg.grad_fn.name().startswith("Batchrules")


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_grad_only_where_needed(act: Act) -> None:
    """The double-backward node computes each input's gradient only if asked."""
    g = sample((2, 3), requires_grad=True, seed=1)
    x = sample((2, 3), requires_grad=False)
    out = act.backward(g, x)
    (dg,) = torch.autograd.grad(out.sum(), g)
    torch.testing.assert_close(dg, act.stock_backward(torch.ones_like(out), x))
    x.requires_grad_()
    out = act.backward(g.detach(), x)
    (dx,) = torch.autograd.grad(out.sum(), x)
    assert dx.shape == x.shape


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_saved_tensors_are_released(act: Act) -> None:
    x = sample((3,), requires_grad=True)
    y = act.op(x)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()
