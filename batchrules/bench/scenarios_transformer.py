"""Scenario 5: one nn.TransformerEncoderLayer (d_model 64, 4 heads, T 32,
dropout 0, batch-first): per-sample gradients and a 4-member ensemble
training step.

The limit is one batched forward written with bmm over a stack of weights
(the members' own, or for per-sample gradients the shared weights expanded
per sample, stride 0) and one autograd backward through it: the gradient
w.r.t. each stacked copy is that member's (sample's) gradient. Attention runs
the fused SDPA kernel on the folded [stack * batch, H, T, hd] batch, as the
batchrules rule does under vmap.
"""
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from .case import Case, CaseSetup, Variant, vmap_identity
from .models import detached_params, in_float64, mse, stacked_ensemble
from .opacus_variant import quiet_input_hooks

D_MODEL, NHEAD, FFN, SEQ = 64, 4, 128, 32
MEMBERS = 4
# (batch, tier, modes)
PSG_BATCHES = ((8, "small", {"smoke", "quick", "full"}), (32, "medium", {"quick", "full"}))
ENSEMBLE_BATCHES = ((8, "small", {"smoke", "quick", "full"}), (32, "medium", {"quick", "full"}))
N_LINEARS = 4  # in_proj, out_proj, linear1, linear2


def encoder() -> nn.Module:
    return nn.TransformerEncoderLayer(D_MODEL, NHEAD, dim_feedforward=FFN, dropout=0.0,
                                      batch_first=True)


def stacked_encoder(p: Dict[str, Tensor], x: Tensor) -> Tensor:
    """The encoder layer (post-norm, relu) with a stack of S weight sets ``p``
    (entries [S, ...]) on ``x`` [S, B, T, d]."""
    s, b, t, d = x.shape
    hd = d // NHEAD

    def linear(h: Tensor, name: str) -> Tensor:
        # S,B*T,I x S,I,O + S,1,O -> S,B*T,O
        w, bias = p[f"{name}.weight"], p[f"{name}.bias"]
        return torch.baddbmm(bias.unsqueeze(1), h.reshape(s, b * t, -1), w.transpose(1, 2))

    def norm(h: Tensor, name: str) -> Tensor:
        normed = F.layer_norm(h, (d,), eps=1e-5)
        return torch.addcmul(p[f"{name}.bias"].unsqueeze(1), normed, p[f"{name}.weight"].unsqueeze(1))

    w_in, b_in = p["self_attn.in_proj_weight"], p["self_attn.in_proj_bias"]
    qkv = torch.baddbmm(b_in.unsqueeze(1), x.reshape(s, b * t, d), w_in.transpose(1, 2))
    # S,B*T,3d -> 3 x S*B,H,T,hd
    q, k, v = qkv.view(s * b, t, 3, NHEAD, hd).permute(2, 0, 3, 1, 4)
    attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(s, b * t, d)
    h1 = norm(x.reshape(s, b * t, d) + linear(attn, "self_attn.out_proj"), "norm1")
    h2 = norm(h1 + linear(torch.relu(linear(h1, "linear1")), "linear2"), "norm2")
    return h2.view(s, b, t, d)


def _stacked_grads(p: Dict[str, Tensor], x: Tensor, y: Tensor, names: List[str]) -> List[Tensor]:
    out = stacked_encoder(p, x)
    # sum over the stack of each member's (sample's) mean squared error
    loss = (out - y).pow(2).mean(dim=(1, 2, 3)).sum()
    return list(torch.autograd.grad(loss, [p[k] for k in names]))


def limit_per_sample_grads(params: Dict[str, Tensor], x: Tensor, y: Tensor) -> List[Tensor]:
    names = list(params)
    batch = x.shape[0]
    expanded = {k: v.detach().requires_grad_().expand(batch, *v.shape) for k, v in params.items()}
    return _stacked_grads(expanded, x.unsqueeze(1), y.unsqueeze(1), names)


def limit_ensemble_grads(params: Dict[str, Tensor], x: Tensor, y: Tensor) -> List[Tensor]:
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    return _stacked_grads(leaves, x, y, list(params))


def _opacus_variant(model: nn.Module, x: Tensor, y: Tensor) -> Optional[Variant]:
    """Opacus with its DPMultiheadAttention (ModuleValidator.fix); gradients of the
    split q/k/v projections are concatenated back into in_proj's layout.

    Runs the layer sequence-first: Opacus 1.6's DPMultiheadAttention with
    batch_first=True merges the heads in the wrong order (its output differs from
    nn.MultiheadAttention's), sequence-first it computes the same function."""
    try:
        from opacus import GradSampleModule
        from opacus.validators import ModuleValidator
    except ImportError:
        return None
    seq_first = nn.TransformerEncoderLayer(D_MODEL, NHEAD, dim_feedforward=FFN, dropout=0.0,
                                           batch_first=False).to(x.device)
    seq_first.load_state_dict(model.state_dict())
    fixed = ModuleValidator.fix(seq_first)
    module = GradSampleModule(fixed, batch_first=False, loss_reduction="sum")
    mha = fixed.self_attn
    split_w = [mha.qlinear.weight, mha.klinear.weight, mha.vlinear.weight]
    split_b = [mha.qlinear.bias, mha.klinear.bias, mha.vlinear.bias]
    ordered = [mha.out_proj.weight, mha.out_proj.bias, fixed.linear1.weight, fixed.linear1.bias,
               fixed.linear2.weight, fixed.linear2.bias, fixed.norm1.weight, fixed.norm1.bias,
               fixed.norm2.weight, fixed.norm2.bias]
    x_t, y_t = x.transpose(0, 1), y.transpose(0, 1)  # T, B, d

    def step() -> List[Tensor]:
        with quiet_input_hooks():
            # per-sample mean squared error, summed: each sample's gradient is its own
            (module(x_t) - y_t).pow(2).mean(dim=(0, 2)).sum().backward()
        grads = [torch.cat([w.grad_sample for w in split_w], dim=1),
                 torch.cat([b.grad_sample for b in split_b], dim=1)]
        grads += [p.grad_sample for p in ordered]
        for p in module.parameters():
            p.grad_sample = None
            p.grad = None
        return grads

    return Variant("opacus", step)


def _psg_case(batch: int, tier: str) -> Case:
    def build(device: torch.device) -> CaseSetup:
        model = encoder().to(device)
        params = detached_params(model)
        x = torch.randn(batch, SEQ, D_MODEL, device=device)
        y = torch.randn(batch, SEQ, D_MODEL, device=device)

        def sample_loss(p: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
            return mse(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

        per_sample_grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))

        def reference() -> List[Tensor]:
            m64 = in_float64(model)
            x64, y64 = x.cpu().double(), y.cpu().double()
            rows = [torch.autograd.grad(mse(m64(x64[i:i + 1]), y64[i:i + 1]),
                                        list(m64.parameters())) for i in range(batch)]
            return [torch.stack(g) for g in zip(*rows)]

        def user_code() -> List[Tensor]:
            return list(per_sample_grads(params, x, y).values())

        variants = [
            Variant("stock", user_code, routing=False, user_code=True),
            Variant("batchrules", user_code, routing=True, user_code=True),
            Variant("limit", lambda: limit_per_sample_grads(params, x, y)),
        ]
        opacus = _opacus_variant(model, x, y)
        if opacus is not None:
            variants.append(opacus)
        return CaseSetup(variants, reference=reference,
                         floor=vmap_identity((None, 0, 0), (params, x, y), returned=0))

    return Case("psg_transformer", f"b{batch}", tier, N_LINEARS,
                f"per-sample grads, TransformerEncoderLayer d{D_MODEL} h{NHEAD} T{SEQ}, "
                f"batch {batch}", build)


def _ensemble_case(batch: int, tier: str) -> Case:
    def build(device: torch.device) -> CaseSetup:
        models = [encoder().to(device) for _ in range(MEMBERS)]
        params, buffers, base = stacked_ensemble(models)
        params = {k: v.detach() for k, v in params.items()}
        x = torch.randn(MEMBERS, batch, SEQ, D_MODEL, device=device)
        y = torch.randn(MEMBERS, batch, SEQ, D_MODEL, device=device)

        def member_loss(p: Dict[str, Tensor], b: Dict[str, Tensor], xb: Tensor,
                        yb: Tensor) -> Tensor:
            return mse(functional_call(base, (p, b), (xb,)), yb)

        ensemble_grads = vmap(grad(member_loss))

        def reference() -> List[Tensor]:
            per_member = []
            for m, model in enumerate(models):
                m64 = in_float64(model)
                loss = mse(m64(x[m].cpu().double()), y[m].cpu().double())
                per_member.append(torch.autograd.grad(loss, list(m64.parameters())))
            return [torch.stack(g) for g in zip(*per_member)]

        def user_code() -> List[Tensor]:
            return list(ensemble_grads(params, buffers, x, y).values())

        return CaseSetup(
            variants=[
                Variant("stock", user_code, routing=False, user_code=True),
                Variant("batchrules", user_code, routing=True, user_code=True),
                Variant("limit", lambda: limit_ensemble_grads(params, x, y)),
            ],
            reference=reference,
            floor=vmap_identity((0, 0, 0, 0), (params, buffers, x, y), returned=0),
        )

    return Case("ensemble_transformer", f"b{batch}", tier, N_LINEARS,
                f"vmap(grad(mse)) over {MEMBERS} TransformerEncoderLayers d{D_MODEL} h{NHEAD} "
                f"T{SEQ}, per-member batch {batch}", build)


def cases(mode: str) -> List[Case]:
    """Transformer per-sample-gradient and ensemble-training cases for a mode."""
    return [_psg_case(b, t) for b, t, m in PSG_BATCHES if mode in m] + [
        _ensemble_case(b, t) for b, t, m in ENSEMBLE_BATCHES if mode in m
    ]
