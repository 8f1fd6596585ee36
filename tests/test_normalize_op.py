"""``batchrules::normalize`` (csrc/normalize/): clipped_grad's LayerNorm
normalization, ``F.layer_norm`` without affine plus the inverse deviations,
whose node keeps its outputs and not its input (Note [Normalizing without
keeping the input] in dp/layers/layer_norm.py)."""
import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck, gradgradcheck
from torch.func import grad, jacfwd, vmap

import batchrules  # noqa: F401  (loads the operators)

normalize = torch.ops.batchrules.normalize.default
SHAPES = [((3, 4, 5), [5]), ((3, 4, 5), [4, 5]), ((7,), [7]), ((2, 1, 3), [3]), ((0, 4), [4])]


def reference(x, shape, eps):
    """x_hat and rstd from their definitions, in float64."""
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    x = x.double()
    centred = x - x.mean(dims, keepdim=True)
    rstd = (centred.square().mean(dims, keepdim=True) + eps).rsqrt()
    return centred * rstd, rstd


@pytest.mark.parametrize("size, shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_are_layer_norms(size, shape, dtype) -> None:
    x = torch.randn(size, dtype=dtype)
    x_hat, rstd = normalize(x, shape, 1e-3)
    want_hat, want_rstd = reference(x, shape, 1e-3)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x_hat.double(), want_hat, **tol)
    torch.testing.assert_close(rstd.double(), want_rstd, **tol)
    torch.testing.assert_close(x_hat, F.layer_norm(x, shape, eps=1e-3))


@pytest.mark.parametrize("size, shape", SHAPES[:4])
def test_derivatives_of_both_outputs(size, shape) -> None:
    """Backward, forward AD and second derivatives (both orders), of x_hat and rstd."""
    x = torch.randn(size, dtype=torch.float64, requires_grad=True)
    f = lambda t: normalize(t, shape, 1e-2)  # noqa: E731
    assert gradcheck(f, (x,), check_forward_ad=True)
    assert gradgradcheck(f, (x,), check_fwd_over_rev=True)
    assert gradcheck(lambda t: normalize(t, shape, 1e-2)[0], (x,), check_forward_ad=True)


def test_saves_its_outputs_not_its_input() -> None:
    x = torch.randn(3, 4, 5, requires_grad=True)
    x_hat, rstd = normalize(x, [5], 1e-5)
    node = x_hat.grad_fn
    assert node.name() == "NormalizeBackward0" and rstd.grad_fn is node
    x_hat.sum().backward()  # the node runs and releases what it saved
    with pytest.raises(RuntimeError, match="freed|already"):
        x_hat.sum().backward()


def test_the_no_graph_backward_equals_the_differentiable_one() -> None:
    """The fused backward (no create_graph) and the formula in aten ops."""
    x = torch.randn(6, 33, dtype=torch.float64, requires_grad=True)
    g = torch.randn(6, 33, dtype=torch.float64)
    x_hat, _ = normalize(x, [33], 1e-5)
    fused, = torch.autograd.grad(x_hat, x, g, retain_graph=True)
    built, = torch.autograd.grad(x_hat, x, g, create_graph=True)
    torch.testing.assert_close(fused, built, rtol=1e-12, atol=1e-12)
    want, = torch.autograd.grad(F.layer_norm(x, (33,)), x, g)
    torch.testing.assert_close(fused, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("size, shape", SHAPES[:4])
def test_opcheck(size, shape) -> None:
    torch.library.opcheck(normalize, (torch.randn(size, requires_grad=True), shape, 1e-5))


@pytest.mark.parametrize("in_dims", [0, 1, 2])
def test_vmap_without_the_fallback(in_dims) -> None:
    x = torch.randn(5, 5, 5, dtype=torch.float64)  # every in_dims: examples [5, 5]
    torch._C._functorch._set_vmap_fallback_enabled(False)
    try:
        x_hat, rstd = vmap(lambda t: normalize(t, [5], 1e-5), in_dims=in_dims)(x)
        per_grad = vmap(grad(lambda t: normalize(t, [5], 1e-5)[0].square().mul(t).sum()),
                        in_dims=in_dims)(x)
        jac = vmap(jacfwd(lambda t: normalize(t, [5], 1e-5)[0]), in_dims=in_dims)(x)
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(True)
    examples = x.movedim(in_dims, 0)
    for i, xi in enumerate(examples):
        want_hat, want_rstd = normalize(xi, [5], 1e-5)
        torch.testing.assert_close(x_hat[i], want_hat)
        torch.testing.assert_close(rstd[i], want_rstd)
        xi = xi.clone().requires_grad_()
        want_grad, = torch.autograd.grad(normalize(xi, [5], 1e-5)[0].square().mul(xi).sum(), xi)
        torch.testing.assert_close(per_grad[i], want_grad)
        torch.testing.assert_close(jac[i], torch.autograd.functional.jacobian(
            lambda t: normalize(t, [5], 1e-5)[0], xi.detach()))


def test_errors_name_the_shapes() -> None:
    with pytest.raises(RuntimeError, match=r"normalized_shape=\[4\]"):
        normalize(torch.randn(3, 5), [4], 1e-5)
    with pytest.raises(RuntimeError, match=r"per-example shape \[5\]"):
        vmap(lambda t: normalize(t, [4], 1e-5))(torch.randn(3, 5))
