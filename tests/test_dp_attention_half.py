"""clipped_grad's decomposed self-attention on half-precision CPU tensors
(Note [Attention in float32 under bf16 on the CPU], dp/layers/attention.py)."""
from typing import Dict

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

import batchrules
from batchrules.bench.models import detached_params


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive"])
def test_attention_core_runs_in_float32_on_the_cpu(dtype, mask_kind, monkeypatch) -> None:
    """Note [Attention in float32 under bf16 on the CPU]: the decomposed
    attention's SDPA gets float32 q, k, v (and mask) for half-precision ones
    and hands back their dtype; the attention output is that of float64 SDPA
    rounded once, and clipped_grad's result equals the float32 model's
    within that precision."""
    from batchrules.dp.layers import attention
    seen = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, is_causal=False):
        seen.append((q.dtype, k.dtype, v.dtype, None if attn_mask is None else attn_mask.dtype))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 5, 4, generator=gen).to(dtype) for _ in range(3))
    mask = {"none": None, "causal": None, "bool": torch.ones(5, 5, dtype=torch.bool).tril(),
            "additive": torch.randn(5, 5, generator=gen).to(dtype)}[mask_kind]
    with torch.autocast("cpu", torch.bfloat16):
        out = attention._attention(q, k, v, mask, mask_kind == "causal")
    assert out.dtype == dtype and seen[-1][:3] == (torch.float32,) * 3
    assert seen[-1][3] in (None, torch.float32, torch.bool)
    m64 = None if mask is None else (mask if mask.dtype == torch.bool else mask.double())
    want = sdpa(q.double(), k.double(), v.double(), attn_mask=m64, is_causal=mask_kind == "causal")
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), want, rtol=eps, atol=eps * want.abs().max().item())

    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    p, x = detached_params(layer), torch.randn(4, 5, 8)

    def loss(p: Dict[str, Tensor], xi: Tensor) -> Tensor:
        return functional_call(layer, p, (xi[None],)).float().square().mean()

    seen.clear()
    got = batchrules.clipped_grad(loss, 1.0)({k: t.to(dtype) for k, t in p.items()}, x.to(dtype))
    assert seen and all(s[:3] == (torch.float32,) * 3 for s in seen)
    want = batchrules.clipped_grad(loss, 1.0)(p, x)
    torch.testing.assert_close(got[1].float(), want[1], rtol=0.05, atol=0)
