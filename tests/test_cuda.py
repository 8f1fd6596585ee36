"""Device coverage: every check runs on CPU and, when a GPU is present, on CUDA.

Without a GPU the CUDA cases are reported as skipped. ``python -m
batchrules.bench --gpu-check`` runs this file on a GPU machine.
"""
from typing import Dict, Optional, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import gradcheck, gradgradcheck
from torch.func import functional_call, grad, vmap

import batchrules

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
# Batched GEMMs and per-example loops may round float32 sums differently.
LOOSE = dict(rtol=1e-4, atol=1e-5)

SHAPES = [  # input, weight, bias
    ((4, 6), (5, 6), (5,)),
    ((2, 3, 6), (5, 6), (1, 5)),
    ((6,), (5, 6), None),
    ((2, 3, 6), (6,), ()),
]


def make(shapes: Tuple, device: str, dtype: torch.dtype = torch.float32,
         requires_grad: bool = False) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    x_shape, w_shape, b_shape = shapes
    x = torch.randn(x_shape, device=device, dtype=dtype, requires_grad=requires_grad)
    w = torch.randn(w_shape, device=device, dtype=dtype, requires_grad=requires_grad)
    b = None if b_shape is None else torch.randn(
        b_shape, device=device, dtype=dtype, requires_grad=requires_grad)
    return x, w, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shapes", SHAPES)
def test_forward_matches_F_linear(device: str, dtype: torch.dtype, shapes: Tuple) -> None:
    x, w, b = make(shapes, device, dtype)
    out = batchrules.linear(x, w, b)
    assert out.device == x.device and out.dtype == dtype
    torch.testing.assert_close(out, F.linear(x, w, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shapes", SHAPES)
def test_backward_matches_F_linear(device: str, shapes: Tuple) -> None:
    args = make(shapes, device, requires_grad=True)
    leaves = [t for t in args if t is not None]
    g = torch.randn(F.linear(*args).shape, device=device)
    got = torch.autograd.grad(batchrules.linear(*args), leaves, g)
    want = torch.autograd.grad(F.linear(*args), leaves, g)
    for a, e in zip(got, want):
        assert a.device == e.device
        torch.testing.assert_close(a, e, **LOOSE)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shapes", SHAPES[:2])
def test_gradcheck_lite(device: str, shapes: Tuple) -> None:
    args = make(shapes, device, torch.float64, requires_grad=True)
    assert gradcheck(batchrules.linear, args, fast_mode=True)
    assert gradgradcheck(batchrules.linear, args, fast_mode=True)


@pytest.mark.parametrize("device", DEVICES)
def test_vmap_batched_weights(device: str, no_vmap_fallback: None) -> None:
    batch = 3
    x = torch.randn(batch, 4, 6, device=device)
    w = torch.randn(batch, 5, 6, device=device)
    b = torch.randn(batch, 5, device=device)
    want = torch.stack([F.linear(x[i], w[i], b[i]) for i in range(batch)])
    torch.testing.assert_close(vmap(batchrules.linear)(x, w, b), want, **LOOSE)
    # Shared input against a stack of weights (model ensembling).
    shared = vmap(batchrules.linear, in_dims=(None, 0, 0))(x[0], w, b)
    want_shared = torch.stack([F.linear(x[0], w[i], b[i]) for i in range(batch)])
    torch.testing.assert_close(shared, want_shared, **LOOSE)


def per_sample_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
    names, params = zip(*model.named_parameters())
    rows = [torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
            for i in range(len(x))]
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(names)}


@pytest.mark.parametrize("device", DEVICES)
def test_per_sample_grads_with_routing(device: str, no_vmap_fallback: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(device)
    x, y = torch.randn(5, 6, device=device), torch.randint(0, 3, (5,), device=device)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    with batchrules.enabled():
        got = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    want = per_sample_loop(model, x, y)
    for name in want:
        assert got[name].device == want[name].device
        torch.testing.assert_close(got[name], want[name], **LOOSE)


@pytest.mark.parametrize("device", DEVICES)
def test_cpu_scalar_bias_behaves_like_F_linear(device: str) -> None:
    """A 0-dim CPU bias is what F.linear accepts next to device tensors or not;
    batchrules.linear must agree (same value, or an error, never a crash)."""
    x, w = torch.randn(4, 6, device=device), torch.randn(5, 6, device=device)
    b = torch.tensor(0.5)
    try:
        want = F.linear(x, w, b)
    except RuntimeError:
        with pytest.raises(RuntimeError):
            batchrules.linear(x, w, b)
        return
    torch.testing.assert_close(batchrules.linear(x, w, b), want)


@needs_cuda
def test_device_mismatch_is_a_clear_error() -> None:
    x, w = torch.randn(4, 6, device="cuda"), torch.randn(5, 6)
    with pytest.raises(RuntimeError, match=r"same device.*cuda.*cpu"):
        batchrules.linear(x, w)


@needs_cuda
def test_compiled_forward_backward_on_cuda() -> None:
    """Inductor (Triton) on the decomposed ops matches eager."""
    torch._dynamo.reset()
    x, w, b = make(((8, 16), (32, 16), (32,)), "cuda", requires_grad=True)

    def f(x, w, b):
        return batchrules.linear(x, w, b).relu().square().sum()

    out = torch.compile(f, fullgraph=True)(x, w, b)
    got = torch.autograd.grad(out, (x, w, b))
    ref = F.linear(x, w, b).relu().square().sum()
    want = torch.autograd.grad(ref, (x, w, b))
    torch.testing.assert_close(out, ref, **LOOSE)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, **LOOSE)


# --- scaled-dot-product attention (csrc/attention) ----------------------------------------------

SDPA_BACKENDS = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]


def _sdpa_inputs(device: str, dtype: torch.dtype, batch: int = 3):
    g = torch.Generator().manual_seed(0)
    shape = (batch, 2, 4, 16, 32)  # vmap, attention batch, heads, length, head dim
    return [torch.randn(shape, generator=g).to(device, dtype) for _ in range(3)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", SDPA_BACKENDS)
@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_vmap_grad_per_backend(device: str, backend: str, masked: bool,
                                    no_vmap_fallback: None) -> None:
    """vmap(grad) through each SDPA backend: fused forward and backward rules, no
    fallback, against a loop of per-example autograd."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device == "cpu" and backend != "MATH":
        backend = "FLASH_ATTENTION"  # the CPU fused kernel
    dtype = torch.float16 if device == "cuda" and backend != "MATH" else torch.float32
    q, k, v = _sdpa_inputs(device, dtype)
    mask = (torch.rand(q.shape[0], 1, 1, 16, 16, device=device) > 0.2) if masked else None
    if mask is not None:
        mask[..., 0] = True

    def loss(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m).float().square().sum()

    try:
        with sdpa_kernel(getattr(SDPBackend, backend)), batchrules.enabled(True):
            got = vmap(grad(loss, argnums=(0, 1, 2)),
                       in_dims=(0, 0, 0, 0 if masked else None))(q, k, v, mask)
            want = []
            for i in range(q.shape[0]):
                leaves = [t[i].detach().requires_grad_() for t in (q, k, v)]
                want.append(torch.autograd.grad(
                    loss(*leaves, None if mask is None else mask[i]), leaves))
    except RuntimeError as e:
        if "No available kernel" in str(e):
            pytest.skip(f"{backend} does not take these inputs on this device: {e}")
        raise
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.float16 else LOOSE
    for a, e in zip(got, zip(*want)):
        torch.testing.assert_close(a, torch.stack(e), **tol)


@needs_cuda
@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION"])
def test_sdpa_dropout_under_vmap_on_cuda(backend: str, no_vmap_fallback: None) -> None:
    """dropout_p > 0 under randomness="different": each example its own mask, and the
    backward replays the forward's masks (gradient of out w.r.t. v is the dropped P^T g)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = _sdpa_inputs("cuda", torch.float16)

    def out_and_grad_v(q, k, v):
        fn = lambda v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)  # noqa: E731
        out, pullback = torch.func.vjp(fn, v)
        return out, pullback(torch.ones_like(out))[0]

    with sdpa_kernel(getattr(SDPBackend, backend)), batchrules.enabled(True):
        with pytest.raises(RuntimeError, match="randomness"):
            vmap(out_and_grad_v)(q, k, v)
        out, gv = vmap(out_and_grad_v, randomness="different")(q, k, v)
    assert not torch.equal(out[0], out[1])
    # out = D(P) v with D dropping and rescaling: with v = I rows summing... check linearity:
    # sum over the query rows of out == (1^T D(P)) v == gv^T v for g = 1.
    lhs = out.float().sum(-2)
    rhs = (gv.float() * v.float()).sum(-2)
    torch.testing.assert_close(lhs, rhs, rtol=2e-2, atol=2e-2)
