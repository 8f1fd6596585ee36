"""Attention under grad-based transforms against for-loop references.

vmap(grad) and jacrev run the fused CPU kernels and their batching rules;
jacfwd, hessian and second derivatives run SDPA's math composite (Note [Fused
attention under forward-mode and higher-order transforms]). References are
float64 loops over examples (or over output elements, for Jacobians) of
torch.autograd on the written-out math of attention.
"""
import pytest
import torch
from attention_reference import FLASH_CPU, N, attention_args, math_attention, sdpa
from batching_reference import example
from torch.autograd.functional import hessian as loop_hessian
from torch.autograd.functional import jacobian as loop_jacobian
from torch.func import grad, hessian, jacfwd, jacrev, vmap

pytestmark = pytest.mark.usefixtures("routing_on", "no_vmap_fallback")

SMALL = dict(q=(1, 2, 3, 4), k=(1, 2, 5, 4))  # one small attention call


def small_args(mask: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(SMALL["q"], dtype=torch.float64, generator=g)
    k = torch.randn(SMALL["k"], dtype=torch.float64, generator=g)
    v = torch.randn(SMALL["k"], dtype=torch.float64, generator=g)
    m = torch.randn(3, 5, dtype=torch.float64, generator=g) if mask else None
    return q, k, v, m


def fused_calls(fn, *args) -> int:
    with torch.profiler.profile() as prof:
        fn(*args)
    return sum(e.name == FLASH_CPU.name() for e in prof.events())


@pytest.mark.parametrize("dims", [(0, 0, 0, None), (0, None, None, None), (None, 0, 0, 0),
                                  (2, 1, 0, 0), (0, 0, 0, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_vmap_grad_matches_loop(dims, causal: bool) -> None:
    mask_shape = None if causal else (2, 1, 5, 6)
    q, k, v, mask = attention_args(mask_shape, dims)
    mask_dim = dims[3] if mask is not None else None
    weights = torch.randn(2, 4, 5, 8, dtype=torch.float64)

    def loss(q, k, v, mask):
        return (sdpa(q, k, v, mask, is_causal=causal) * weights).sum()

    def math_loss(q, k, v, mask):
        return (math_attention(q, k, v, mask, is_causal=causal) * weights).sum()

    in_dims = dims[:3] + (mask_dim,)
    got = vmap(grad(loss, argnums=(0, 1, 2)), in_dims=in_dims)(q, k, v, mask)
    want = []
    for i in range(N):
        ex = [example(a, d, i) for a, d in zip((q, k, v, mask), in_dims)]
        leaves = [t.detach().requires_grad_() for t in ex[:3]]
        want.append(torch.autograd.grad(math_loss(*leaves, ex[3]), leaves))
    for g_got, g_want in zip(got, zip(*want)):
        torch.testing.assert_close(g_got, torch.stack(g_want))
    assert fused_calls(vmap(grad(loss, argnums=(0, 1, 2)), in_dims=in_dims), q, k, v, mask) > 0


@pytest.mark.parametrize("mask", [False, True])
def test_jacrev_matches_loop(mask: bool) -> None:
    q, k, v, m = small_args(mask)
    got = jacrev(sdpa, argnums=(0, 1, 2))(q, k, v, m)
    want = loop_jacobian(lambda q, k, v: math_attention(q, k, v, m), (q, k, v))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)
    assert fused_calls(jacrev(sdpa, argnums=(0, 1, 2)), q, k, v, m) > 0


@pytest.mark.parametrize("mask", [False, True])
def test_jacfwd_matches_loop(mask: bool) -> None:
    q, k, v, m = small_args(mask)
    got = jacfwd(sdpa, argnums=(0, 1, 2))(q, k, v, m)
    want = loop_jacobian(lambda q, k, v: math_attention(q, k, v, m), (q, k, v))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


def test_hessian_matches_loop() -> None:
    q, k, v, m = small_args(mask=True)

    def energy(q, attention):
        return attention(q, k, v, m).pow(2).sum()

    got = hessian(lambda q: energy(q, sdpa))(q)
    want = loop_hessian(lambda q: energy(q, math_attention), q)
    torch.testing.assert_close(got, want)


def test_per_example_gradient_penalty() -> None:
    """vmap(grad(grad-norm)): two grad levels, a second derivative per example."""
    q, k, v, _ = attention_args(None, (0, 0, 0))

    def penalty(q, k, v):
        return grad(lambda q: sdpa(q, k, v).sin().sum())(q).pow(2).sum()

    got = vmap(grad(penalty))(q, k, v)
    want = []
    for i in range(N):
        qi = q[i].detach().requires_grad_()
        (g,) = torch.autograd.grad(math_attention(qi, k[i], v[i]).sin().sum(), qi,
                                   create_graph=True)
        want.append(torch.autograd.grad(g.pow(2).sum(), qi)[0])
    torch.testing.assert_close(got, torch.stack(want))


def test_vmap_jacrev_per_example_jacobians() -> None:
    q, k, v, _ = attention_args(None, (0, 0, 0))
    q, k, v = (t[:, :1, :2].contiguous() for t in (q, k, v))
    got = vmap(jacrev(sdpa))(q, k, v)
    want = torch.stack([loop_jacobian(lambda q: math_attention(q, k[i], v[i]), q[i])
                        for i in range(N)])
    torch.testing.assert_close(got, want)
