"""The CUDA attention batching rules, run on CPU against test-only CPU kernels.

No GPU here: each CUDA op (flash/efficient/cudnn forward and backward) gets a
CPU kernel for the length of a test, written out in float64 math with the
op's schema and output shapes, and a deterministic "dropout" whose mask is a
function of the philox seed and each entry's position in the attention batch,
as the CUDA kernels' is. That checks the rules' folding (every in_dims
combination, bias broadcasting) and Note [Dropout in a folded backward]; the
kernels themselves run in tests/test_cuda.py on a GPU.
"""
import itertools
from typing import Iterator, Optional

import pytest
import torch
from attention_reference import B, E, H, L, N, S, in_dims_combinations
from batching_reference import example, physical
from torch import Tensor
from torch.func import grad, vjp, vmap

aten = torch.ops.aten
pytestmark = pytest.mark.usefixtures("routing_on", "no_vmap_fallback")
_seed = itertools.count(1)


def keep_mask(seed: int, shape, p: float) -> Tensor:
    b, h, lq, lk = shape
    pos = torch.arange(b * h * lq * lk).view(b, h, lq, lk)
    return (pos * 2654435761 + seed * 97) % 1000 >= int(p * 1000)


def scores_and_probs(q, k, bias, is_causal, scale):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = q @ k.transpose(-2, -1) * scale
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if bias is not None:
        s = s + bias
    return s, torch.softmax(s, -1), scale


def dropped(probs, p, seed):
    return probs * keep_mask(seed, probs.shape, p) / (1 - p) if p > 0 else probs


def attention(q, k, v, bias, p, is_causal, scale, seed):
    """(out, logsumexp) with the seeded dropout."""
    s, probs, _ = scores_and_probs(q, k, bias, is_causal, scale)
    return dropped(probs, p, seed) @ v, torch.logsumexp(s, -1)


def attention_grads(g, q, k, v, bias, p, is_causal, scale, seed, with_bias):
    """The backward written out (the kernels run below autograd)."""
    _, probs, scale = scores_and_probs(q, k, bias, is_causal, scale)
    gv = dropped(probs, p, seed).transpose(-2, -1) @ g
    g_probs = dropped(g @ v.transpose(-2, -1), p, seed)
    g_scores = probs * (g_probs - (g_probs * probs).sum(-1, keepdim=True))
    gq, gk = g_scores @ k * scale, g_scores.transpose(-2, -1) @ q * scale
    if not with_bias:
        return gq, gk, gv
    return gq, gk, gv, None if bias is None else g_scores.sum_to_size(bias.shape)


def empty():
    return torch.empty(0, dtype=torch.int64)


def efficient_fwd(q, k, v, bias, compute_lse, p=0.0, is_causal=False, scale=None):
    seed = next(_seed)
    out, lse = attention(q, k, v, bias, p, is_causal, scale, seed)
    rows = -(-q.shape[2] // 32) * 32 if compute_lse else 0
    padded = torch.zeros(*lse.shape[:2], rows, dtype=torch.float32)
    padded[..., :min(rows, lse.shape[2])] = lse[..., :rows]
    return out, padded, torch.tensor(seed), torch.tensor(0)


def efficient_bwd(g, q, k, v, bias, out, lse, seed, offset, p, mask, is_causal=False,
                  scale=None):
    b = bias if bias is not None and bias.numel() else None
    gq, gk, gv, gb = attention_grads(g, q, k, v, b, p, is_causal, scale, int(seed), True)
    return tuple(t if m else None for t, m in zip((gq, gk, gv, gb), mask))


def flash_fwd(q, k, v, p=0.0, is_causal=False, return_debug_mask=False, scale=None):
    seed = next(_seed)
    out, lse = attention(q, k, v, None, p, is_causal, scale, seed)
    return (out, lse.float(), empty(), empty(), q.shape[2], k.shape[2], torch.tensor(seed),
            torch.tensor(0), empty())


def flash_bwd(g, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, p, is_causal, seed, offset,
              scale=None):
    return attention_grads(g, q, k, v, None, p, is_causal, scale, int(seed), False)


def cudnn_fwd(q, k, v, bias, compute_lse, p=0.0, is_causal=False, return_debug_mask=False,
              scale=None):
    seed = next(_seed)
    out, lse = attention(q, k, v, bias, p, is_causal, scale, seed)
    return (out, lse.float().unsqueeze(-1), empty(), empty(), q.shape[2], k.shape[2],
            torch.tensor(seed), torch.tensor(0), empty())


def cudnn_bwd(g, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, p,
              is_causal, scale=None):
    b = bias if bias is not None and bias.numel() else None
    return attention_grads(g, q, k, v, b, p, is_causal, scale, int(seed), False)


@pytest.fixture(autouse=True)
def cpu_kernels() -> Iterator[None]:
    lib = torch.library.Library("aten", "IMPL")
    for name, fn in [("_scaled_dot_product_efficient_attention", efficient_fwd),
                     ("_scaled_dot_product_efficient_attention_backward", efficient_bwd),
                     ("_scaled_dot_product_flash_attention", flash_fwd),
                     ("_scaled_dot_product_flash_attention_backward", flash_bwd),
                     ("_scaled_dot_product_cudnn_attention", cudnn_fwd),
                     ("_scaled_dot_product_cudnn_attention_backward", cudnn_bwd)]:
        lib.impl(name, fn, "CPU")
    yield
    lib._destroy()


def efficient(q, k, v, bias=None, p=0.0, is_causal=False):
    return aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, p, is_causal)[0]


def flash(q, k, v, bias=None, p=0.0, is_causal=False):
    assert bias is None
    return aten._scaled_dot_product_flash_attention(q, k, v, p, is_causal)[0]


def cudnn(q, k, v, bias=None, p=0.0, is_causal=False):
    return aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, p, is_causal)[0]


KERNELS = {"efficient": efficient, "flash": flash, "cudnn": cudnn}
BIAS_SHAPES = {"none": None, "LS": (L, S), "1HLS": (1, H, L, S), "BHLS": (B, H, L, S)}


def args_for(dims, bias_shape: Optional[tuple], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = physical((B, H, L, E), dims[0], N, torch.float64, g)
    k = physical((B, H, S, E), dims[1], N, torch.float64, g)
    v = physical((B, H, S, E), dims[2], N, torch.float64, g)
    bias = None if bias_shape is None else physical(bias_shape, dims[3], N, torch.float64, g)
    return q, k, v, bias


@pytest.mark.parametrize("kernel,bias_name", [("flash", "none")] + [
    (k, b) for k in ("efficient", "cudnn") for b in BIAS_SHAPES])
def test_vmap_grad_every_in_dims(kernel: str, bias_name: str) -> None:
    """Forward and backward rules against per-example autograd through the op."""
    fn = KERNELS[kernel]
    bias_shape = BIAS_SHAPES[bias_name]
    ranks = (4, 4, 4) + ((len(bias_shape),) if bias_shape else ())
    weights = torch.randn(B, H, L, E, dtype=torch.float64)

    def loss(q, k, v, bias=None):
        return (fn(q, k, v, bias) * weights).sum()

    # The efficient kernel also returns the bias's gradient.
    argnums = (0, 1, 2, 3) if bias_shape and kernel == "efficient" else (0, 1, 2)
    for dims in in_dims_combinations(ranks):
        q, k, v, bias = args_for(dims + (None,) * (4 - len(dims)), bias_shape)
        args = (q, k, v) + ((bias,) if bias is not None else ())
        got = vmap(grad(loss, argnums=argnums), in_dims=dims)(*args)
        for i in range(N):
            ex = [example(a, d, i) for a, d in zip(args, dims)]
            leaves = [t.detach().requires_grad_() for t in ex[:len(argnums)]]
            want = torch.autograd.grad(loss(*leaves, *ex[len(argnums):]), leaves)
            for a, e in zip(got, want):
                torch.testing.assert_close(a[i], e, msg=lambda m: f"in_dims={dims}: {m}")


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_dropout_backward_replays_forward_masks(kernel: str) -> None:
    """Folded forward and backward (randomness="different"): the gradient is that of
    the masks the forward drew, i.e. of the op on the folded batch."""
    fn = KERNELS[kernel]
    q, k, v, _ = args_for((0, 0, 0, None), None)
    g = torch.randn(N, B, H, L, E, dtype=torch.float64)

    def vjp_of(q, k, v, g):
        out, pullback = vjp(lambda q, k, v: fn(q, k, v, p=0.3), q, k, v)
        return out, pullback(g)

    before = next(_seed)
    out, grads = vmap(vjp_of, randomness="different")(q, k, v, g)
    folded_seed = before + 1  # the one folded forward call
    fold = lambda t: t.reshape(N * B, *t.shape[2:])  # noqa: E731
    want_out, _ = attention(fold(q), fold(k), fold(v), None, 0.3, False, None, folded_seed)
    want = attention_grads(fold(g), fold(q), fold(k), fold(v), None, 0.3, False, None,
                           folded_seed, False)
    torch.testing.assert_close(out, want_out.view_as(out))
    for a, e in zip(grads, want):
        torch.testing.assert_close(a, e.view_as(a))


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_dropout_jacrev_backward_runs_per_example(kernel: str) -> None:
    """Forward outside vmap, backward vmapped over cotangents: every cotangent meets
    the forward's own masks (positions b, not n*B + b)."""
    fn = KERNELS[kernel]
    q, k, v, _ = args_for((None, None, None, None), None)
    out, pullback = vjp(lambda q, k, v: fn(q, k, v, p=0.3), q, k, v)
    seed = next(_seed) - 1
    gs = torch.randn(N, *out.shape, dtype=torch.float64)
    got = vmap(pullback)(gs)
    for i in range(N):
        want = attention_grads(gs[i], q, k, v, None, 0.3, False, None, seed, False)
        for a, e in zip(got, want):
            torch.testing.assert_close(a[i], e)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_dropout_randomness_modes(kernel: str) -> None:
    fn = KERNELS[kernel]
    q, k, v, _ = args_for((0, 0, 0, None), None)
    with pytest.raises(RuntimeError, match="randomness error mode"):
        vmap(lambda q, k, v: fn(q, k, v, p=0.3))(q, k, v)
    if kernel != "flash":  # functorch's own flash forward rule allows "same"
        with pytest.raises(RuntimeError, match=r"randomness='same'\) is not supported"):
            vmap(lambda q, k, v: fn(q, k, v, p=0.3), randomness="same")(q, k, v)
