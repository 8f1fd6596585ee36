"""Attention under transforms: one nn.TransformerEncoderLayer (d_model 64,
4 heads, T 32, dropout 0, batch-first): per-sample gradients and a 4-member
ensemble training step, against a hand-written stacked layer
(``baselines/hand_written_transformer.py``) and, for per-sample gradients,
Opacus' DPMultiheadAttention.
"""
from typing import List

import torch
from torch import nn

from ..baselines import hand_written_transformer
from ..baselines.opacus_variants import opacus_encoder_variant
from ..case import Case, CaseSetup, Variant
from ..models import mse
from ..targets import FASTER_THAN_OPACUS, transform_targets
from .ensembles import train_setup
from .per_sample_grads import psg_setup

D_MODEL, NHEAD, FFN, SEQ = 64, 4, 128, 32
MEMBERS = 4
# (batch, tier, modes)
PSG_BATCHES = ((8, "small", {"smoke", "headline", "quick", "full"}), (32, "medium", {"quick", "full"}))
ENSEMBLE_BATCHES = ((8, "small", {"smoke", "quick", "full"}), (32, "medium", {"quick", "full"}))
N_LINEARS = 4  # in_proj, out_proj, linear1, linear2


def encoder(batch_first: bool = True) -> nn.Module:
    return nn.TransformerEncoderLayer(D_MODEL, NHEAD, dim_feedforward=FFN, dropout=0.0,
                                      batch_first=batch_first)


def _psg_case(batch: int, tier: str) -> Case:
    def build(device: torch.device) -> CaseSetup:
        model = encoder().to(device)
        x = torch.randn(batch, SEQ, D_MODEL, device=device)
        y = torch.randn(batch, SEQ, D_MODEL, device=device)
        def opacus() -> Variant:
            return opacus_encoder_variant(model, encoder(batch_first=False).to(device), x, y)

        return psg_setup(model, x, y, lambda p: hand_written_transformer.per_sample_grads(p, x, y, NHEAD),
                         mse, opacus)

    return Case("psg_transformer", f"b{batch}", tier, N_LINEARS,
                f"per-sample grads, TransformerEncoderLayer d{D_MODEL} h{NHEAD} T{SEQ}, "
                f"batch {batch}", build, [*transform_targets(tier), FASTER_THAN_OPACUS])


def _ensemble_case(batch: int, tier: str) -> Case:
    def build(device: torch.device) -> CaseSetup:
        models = [encoder().to(device) for _ in range(MEMBERS)]
        x = torch.randn(MEMBERS, batch, SEQ, D_MODEL, device=device)
        y = torch.randn(MEMBERS, batch, SEQ, D_MODEL, device=device)
        grads = hand_written_transformer.ensemble_grads
        return train_setup(models, x, y, lambda p: lambda: grads(p, x, y, NHEAD))

    return Case("ensemble_transformer", f"b{batch}", tier, N_LINEARS,
                f"vmap(grad(mse)) over {MEMBERS} TransformerEncoderLayers d{D_MODEL} h{NHEAD} "
                f"T{SEQ}, per-member batch {batch}", build, transform_targets(tier))


def cases(mode: str) -> List[Case]:
    """Transformer per-sample-gradient and ensemble-training cases for a mode."""
    return [_psg_case(b, t) for b, t, m in PSG_BATCHES if mode in m] + [
        _ensemble_case(b, t) for b, t, m in ENSEMBLE_BATCHES if mode in m
    ]
