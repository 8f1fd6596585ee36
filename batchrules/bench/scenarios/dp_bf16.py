"""The DP transformer row under bfloat16 autocast (the loss's forward; the
cross-entropy in float32) against itself in float32: clipped_grad and the
non-private step, each checked against the float64 references within
``BF16_RTOL``. Target, where the machine has bf16 kernels (oneDNN's on a CPU
with avx512_bf16 or AMX; any CUDA device): the bf16 DP step faster than float32.
"""
import dataclasses
import functools
from typing import Callable, Dict, List

import torch
from torch import Tensor
from torch.func import functional_call

import batchrules

from ..baselines.opacus_variants import cross_entropy_sum
from ..case import Case, CaseSetup, Variant
from ..models import cross_entropy, detached_params
from ..targets import Speedup
from .dp_step import MAX_NORM, Encoder, clipped_grad_variant, loop_reference, summed_reference

BF16_RTOL = 5e-2
D_MODEL, HEADS, FF, TOKENS, BATCH = 256, 8, 1024, 32, 32


def _autocast(device: torch.device, on: bool) -> torch.autocast:
    return torch.autocast(device.type, torch.bfloat16, enabled=on)


def _build(device: torch.device) -> CaseSetup:
    model = Encoder(D_MODEL, HEADS, FF).to(device)
    x = torch.randn(BATCH, TOKENS, D_MODEL, device=device)
    y = torch.randint(0, 10, (BATCH,), device=device)
    params, trainable = detached_params(model), list(model.parameters())

    def dp_step(bf16: bool) -> Variant:
        def sample_loss(p: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
            with _autocast(device, bf16):
                logits = functional_call(model, p, (xi.unsqueeze(0),))
            return cross_entropy(logits.float(), yi.unsqueeze(0))

        variant = clipped_grad_variant(batchrules.clipped_grad(sample_loss, MAX_NORM), params, x, y)
        return dataclasses.replace(variant, name="clipped_grad_bf16", rtol=BF16_RTOL) if bf16 else variant

    def nonprivate(bf16: bool) -> Callable[[], List[Tensor]]:
        def step() -> List[Tensor]:
            with _autocast(device, bf16):
                logits = model(x)
            return list(torch.autograd.grad(cross_entropy_sum(logits.float(), y), trainable))
        return step

    summed = functools.partial(summed_reference, model, x, y)
    return CaseSetup([dp_step(False), dp_step(True),
                      Variant("nonprivate", nonprivate(False), reference=summed),
                      Variant("nonprivate_bf16", nonprivate(True), reference=summed, rtol=BF16_RTOL)],
                     reference=lambda: loop_reference(model, x, y))


def has_bf16_kernels() -> bool:
    """oneDNN's bf16 kernels on this CPU (avx512_bf16 or AMX), or a CUDA device."""
    return torch.cuda.is_available() or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cases(mode: str) -> List[Case]:
    """The bf16 row, with --full only."""
    if mode != "full":
        return []
    targets = [Speedup("bf16 autocast: the DP step faster than in float32 "
                       "(clipped_grad / clipped_grad_bf16 > 1)",
                       "clipped_grad", "clipped_grad_bf16", 1.0)] if has_bf16_kernels() else []
    return [Case("dp_transformer_bf16", f"d{D_MODEL}t{TOKENS}_b{BATCH}", "large", 5,
                 f"DP-SGD clipping under bfloat16 autocast vs float32, TransformerEncoderLayer("
                 f"d={D_MODEL}, heads={HEADS}, ff={FF}, gelu) over {TOKENS} tokens + linear head, "
                 f"batch {BATCH}", _build, targets)]
