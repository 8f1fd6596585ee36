"""Batching rules of the CPU fused attention kernels against per-example loops.

The fused op and its backward are called under vmap with the per-example
fallback disabled, for every in_dims combination of q/k/v/mask (shared,
batch-first, a middle dim, last), every mask shape the kernel broadcasts,
is_causal, scale and GQA, and nested; F.scaled_dot_product_attention (which
picks the fused kernel on CPU) likewise with bool and float masks.
"""
from typing import Optional

import pytest
import torch
from attention_reference import (
    FLASH_CPU,
    FLASH_CPU_BACKWARD,
    KV_H,
    MASK_SHAPES,
    B,
    E,
    H,
    L,
    N,
    S,
    attention_args,
    flash,
    in_dims_combinations,
    loop,
    sdpa,
)
from batching_reference import example, physical
from torch.func import vmap

pytestmark = pytest.mark.usefixtures("routing_on", "no_vmap_fallback")

OPTIONS = {  # kwargs of the fused op / SDPA besides the mask
    "plain": {},
    "causal": {"is_causal": True},
    "scale": {"scale": 0.3},
}


# (mask, option, with a middle bdim too): every mask shape plainly, the options
# where they change the kernel's path.
FORWARD_CASES = [(m, "plain", m in ("B1LS", "LS")) for m in MASK_SHAPES] + [
    ("none", "causal", False), ("LS", "scale", False), ("1H1S", "causal", False)]


@pytest.mark.parametrize("mask_name,option,middle", FORWARD_CASES)
def test_fused_forward_every_in_dims(mask_name: str, option: str, middle: bool) -> None:
    mask_shape = MASK_SHAPES[mask_name]
    kw = OPTIONS[option]
    ranks = (4, 4, 4) + ((len(mask_shape),) if mask_shape else ())
    for dims in in_dims_combinations(ranks, middle):
        args = attention_args(mask_shape, dims)[:len(ranks)]
        got = vmap(lambda *a: flash(*a, **kw), in_dims=dims)(*args)
        want = loop(lambda *a: flash(*a, **kw), args, dims)
        torch.testing.assert_close(got, want, msg=lambda m: f"in_dims={dims}: {m}")


@pytest.mark.parametrize("mask_name", ["none", "LS", "B1LS"])
def test_fused_forward_gqa(mask_name: str) -> None:
    mask_shape = MASK_SHAPES[mask_name]
    ranks = (4, 4, 4) + ((len(mask_shape),) if mask_shape else ())
    for dims in in_dims_combinations(ranks):
        args = attention_args(mask_shape, dims, kv_heads=KV_H)[:len(ranks)]
        torch.testing.assert_close(vmap(flash, in_dims=dims)(*args), loop(flash, args, dims),
                                   msg=lambda m: f"in_dims={dims}: {m}")


@pytest.mark.parametrize("mask_name,grad_out_bdim", [("none", 0), ("none", None), ("LS", 0),
                                                    ("BHLS", None), ("1H1S", 0)])
def test_fused_backward_every_in_dims(mask_name: str, grad_out_bdim: Optional[int]) -> None:
    mask_shape = MASK_SHAPES[mask_name]
    ranks = (4, 4, 4) + ((len(mask_shape),) if mask_shape else ())
    for dims in in_dims_combinations(ranks):
        q, k, v, mask = attention_args(mask_shape, dims)
        inputs = [q, k, v] + ([mask] if mask is not None else [])
        # out and logsumexp as the forward under the same vmap returns them.
        out, lse = vmap(flash, in_dims=dims, out_dims=(0, 0))(*inputs)
        g = physical((B, H, L, E), grad_out_bdim, N, torch.float64,
                     torch.Generator().manual_seed(1))

        def backward(g, q, k, v, out, lse, mask=None):
            return FLASH_CPU_BACKWARD(g, q, k, v, out, lse, 0.0, False, attn_mask=mask)

        all_args = [g, q, k, v, out, lse] + inputs[3:]
        all_dims = (grad_out_bdim,) + dims[:3] + (0, 0) + dims[3:]
        got = vmap(backward, in_dims=all_dims)(*all_args)
        want = loop(backward, all_args, all_dims)
        torch.testing.assert_close(got, want, msg=lambda m: f"in_dims={all_dims}: {m}")


def test_backward_undefined_grad_out_stays_undefined() -> None:
    q, k, v, _ = attention_args(None, (0, 0, 0))
    out, lse = vmap(flash)(q, k, v)
    got = vmap(lambda q, k, v, o, lse: FLASH_CPU_BACKWARD(None, q, k, v, o, lse, 0.0, False),
               out_dims=None)(q, k, v, out, lse)
    assert got == (None, None, None)


SDPA_CASES = [("float", m, "plain") for m in ("none", "LS", "B1LS", "BHLS")] + [
    ("bool", "LS", "plain"), ("bool", "B1LS", "plain"), ("float", "none", "causal"),
    ("bool", "BHLS", "scale")]


@pytest.mark.parametrize("mask_kind,mask_name,option", SDPA_CASES)
def test_sdpa_every_in_dims(mask_kind: str, mask_name: str, option: str) -> None:
    mask_shape = MASK_SHAPES[mask_name]
    kw = OPTIONS[option]
    ranks = (4, 4, 4) + ((len(mask_shape),) if mask_shape else ())
    for dims in in_dims_combinations(ranks):
        args = attention_args(mask_shape, dims, mask_kind=mask_kind)[:len(ranks)]
        got = vmap(lambda *a: sdpa(*a, **kw), in_dims=dims)(*args)
        want = loop(lambda *a: sdpa(*a, **kw), args, dims)
        torch.testing.assert_close(got, want, msg=lambda m: f"in_dims={dims}: {m}")


def test_sdpa_gqa() -> None:
    for dims in in_dims_combinations((4, 4, 4)):
        q, k, v, _ = attention_args(None, dims, kv_heads=KV_H)
        fn = lambda q, k, v: sdpa(q, k, v, enable_gqa=True)  # noqa: E731
        torch.testing.assert_close(vmap(fn, in_dims=dims)(q, k, v), loop(fn, [q, k, v], dims))


@pytest.mark.parametrize("outer,inner", [((0, 0, 0, 0), (0, 0, 0, 0)),
                                         ((0, None, None, 0), (None, 0, 0, None)),
                                         ((None, 0, 0, None), (0, None, None, 0)),
                                         ((1, 0, 2, None), (2, None, 0, 1))])
def test_nested_vmap(outer, inner) -> None:
    """Two vmap levels over q/k/v/mask, each level folding its own batch."""
    g = torch.Generator().manual_seed(3)
    shapes = [(B, H, L, E), (B, H, S, E), (B, H, S, E), (B, 1, L, S)]
    m = 2  # inner vmap size
    args = []
    for shape, od, idim in zip(shapes, outer, inner):
        t = physical(shape, idim, m, torch.float64, g)
        args.append(t if od is None else physical(t.shape, od, N, torch.float64, g))
    fn = lambda q, k, v, mask: sdpa(q, k, v, mask)  # noqa: E731
    got = vmap(vmap(fn, in_dims=inner), in_dims=outer)(*args)
    want = torch.stack([
        torch.stack([fn(*[example(example(a, od, i), idim, j)
                          for a, od, idim in zip(args, outer, inner)]) for j in range(m)])
        for i in range(N)])
    torch.testing.assert_close(got, want)


def test_kernel_called_once_per_level() -> None:
    """The fold runs one fused call per vmap level, not one per example."""
    q, k, v, _ = attention_args(None, (0, 0, 0))
    with torch.profiler.profile() as prof:
        vmap(flash)(q, k, v)
    calls = [e for e in prof.events() if e.name == FLASH_CPU.name()]
    assert len(calls) == 2  # the batched kernel's call and the CPU kernel under it
