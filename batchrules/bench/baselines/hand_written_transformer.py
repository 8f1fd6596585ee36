"""Hand-written transformer baseline: one nn.TransformerEncoderLayer (post-norm,
relu, batch-first) over a stack of weight sets (the members', or the shared weights
expanded per sample, stride 0) with bmm, SDPA on the folded [stack * batch, H, T,
hd] batch, and one autograd backward: each stacked copy's gradient is that member's
(sample's)."""
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import Tensor


def stacked_encoder(p: Dict[str, Tensor], x: Tensor, heads: int) -> Tensor:
    """The encoder layer (post-norm, relu) with a stack of S weight sets ``p``
    (entries [S, ...]) on ``x`` [S, B, T, d]."""
    s, b, t, d = x.shape
    hd = d // heads

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
    q, k, v = qkv.view(s * b, t, 3, heads, hd).permute(2, 0, 3, 1, 4)
    attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(s, b * t, d)
    h1 = norm(x.reshape(s, b * t, d) + linear(attn, "self_attn.out_proj"), "norm1")
    h2 = norm(h1 + linear(torch.relu(linear(h1, "linear1")), "linear2"), "norm2")
    return h2.view(s, b, t, d)


def _stacked_grads(p: Dict[str, Tensor], x: Tensor, y: Tensor, names: List[str], heads: int) -> List[Tensor]:
    out = stacked_encoder(p, x, heads)
    # sum over the stack of each member's (sample's) mean squared error
    loss = (out - y).pow(2).mean(dim=(1, 2, 3)).sum()
    return list(torch.autograd.grad(loss, [p[k] for k in names]))


def per_sample_grads(params: Dict[str, Tensor], x: Tensor, y: Tensor, heads: int) -> List[Tensor]:
    """Per-sample gradients of the layer's mean squared error, parameter order."""
    names = list(params)
    batch = x.shape[0]
    expanded = {k: v.detach().requires_grad_().expand(batch, *v.shape) for k, v in params.items()}
    return _stacked_grads(expanded, x.unsqueeze(1), y.unsqueeze(1), names, heads)


def ensemble_grads(params: Dict[str, Tensor], x: Tensor, y: Tensor, heads: int) -> List[Tensor]:
    """Each member's gradient of its mean squared error (``params`` stacked)."""
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    return _stacked_grads(leaves, x, y, list(params), heads)
