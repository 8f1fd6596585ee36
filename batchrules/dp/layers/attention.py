"""Self-attention (nn.MultiheadAttention, hence nn.TransformerEncoderLayer) under clipped_grad.

Note [Decomposing multi-head attention]
``F.multi_head_attention_forward`` is one call to the Interceptor: its in-
and out-projections are linears it never sees, so the generic path
would hand it per-sample copies of both projection weights ([B, 3E, E] and
[B, E, E] gradients). For the configuration transformer layers use (self-
attention with packed projections, no bias_k/bias_v/zero-attention, no
dropout, no attention weights returned, an optional shared attn_mask or the
causal hint, no key_padding_mask), this rule runs the same computation on
physical tensors as two recorded linears around one
``F.scaled_dot_product_attention`` over all B*N sequences, so the projections
take the ghost/materialized choice of linear layers and the attention runs
batched (functorch has no batching rule for the CPU flash-attention kernel;
under vmap it would loop). Any other configuration takes the generic path.

Note [Attention in float32 under bf16 on the CPU]
On the CPU, torch 2.13's flash-attention backward is several times slower in
bfloat16 than in float32 (the forwards cost the same), enough to make a bf16
DP step slower than the float32 one. With bf16 or fp16 q, k, v on the
CPU the rule runs the attention core in float32 (autocast off around it,
which would cast it back down) and returns its output in q's dtype: the dtypes
stock autocast gives, with the attention itself rounded once instead of in
each of its products.
"""
import inspect
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from ..._compat import batched_level
from ..rule import NOT_HANDLED, NOT_SPLIT, Rule, batched, bind, physical, register
from ..tape import Tape
from .linear import ghostable, recorded_linear

# (names, trailing defaults) for rule.bind: inspect's Signature.bind is slow per call
_PARAMETERS = list(inspect.signature(F.multi_head_attention_forward).parameters.values())
_FIRST_DEFAULT = next(i for i, p in enumerate(_PARAMETERS) if p.default is not p.empty)
_MHA_ARGS = (tuple(p.name for p in _PARAMETERS),
             tuple(p.default for p in _PARAMETERS[_FIRST_DEFAULT:]))
# Arguments outside the decomposed configuration unless None / False.
_MUST_BE_NONE = ("bias_k", "bias_v", "static_k", "static_v", "key_padding_mask")
_MUST_BE_FALSE = ("use_separate_proj_weight", "add_zero_attn", "need_weights")


def _shared_mask(tape: Tape, mask: Any, dtype: torch.dtype) -> Any:
    """A 2-D attn_mask shared by all samples as SDPA's additive float mask;
    NOT_HANDLED for anything else."""
    if (not isinstance(mask, torch.Tensor) or tape.param(mask) is not None
            or batched_level(mask) != -1 or mask.dim() != 2):
        return NOT_HANDLED
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask if mask.dtype == dtype else NOT_HANDLED


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
               causal: bool) -> torch.Tensor:
    """SDPA, in float32 for half-precision CPU tensors (Note [Attention in
    float32 under bf16 on the CPU])."""
    if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    if mask is not None and mask.is_floating_point():
        mask = mask.float()
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                             is_causal=causal)
    return out.to(q.dtype)


@register
class AttentionRule(Rule):
    """Note [Decomposing multi-head attention]: records two linear uses."""

    functions = (F.multi_head_attention_forward,)

    @classmethod
    def batch_dims(cls, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[Any, Any]]:
        """Sequence-first query, key and value ``[L, N, E]``, the output too; a
        2-D attn_mask is shared."""
        names = _MHA_ARGS[0]
        mask = kwargs.get("attn_mask", args[16] if len(args) > 16 else None)
        dims = {"query": 1, "key": 1, "value": 1,
                "attn_mask": NOT_SPLIT if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None}
        return ((tuple(dims.get(names[i]) for i in range(len(args))),
                 {k: dims.get(k) for k in kwargs}), (1, 0))

    @classmethod
    def intercept(cls, tape: Tape, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        values = bind(*_MHA_ARGS, args, kwargs)
        if values is None:
            return NOT_HANDLED
        p = dict(zip(_MHA_ARGS[0], values))
        query, heads, embed = p["query"], p["num_heads"], p["embed_dim_to_check"]
        if (query is not p["key"] or query is not p["value"]
                or any(p[name] is not None for name in _MUST_BE_NONE)
                or any(p[name] for name in _MUST_BE_FALSE)
                or (p["training"] and p["dropout_p"] > 0) or type(heads) is not int
                or type(embed) is not int or heads < 1 or embed % heads):
            return NOT_HANDLED
        x = physical(tape, query)
        w_in, b_in, w_out, b_out = (p["in_proj_weight"], p["in_proj_bias"], p["out_proj_weight"],
                                    p["out_proj_bias"])
        if (x is None or x.dim() not in (3, 4) or x.shape[-1] != embed
                or not ghostable(tape, x, w_in, b_in) or w_in.shape != (3 * embed, embed)
                or not ghostable(tape, x, w_out, b_out) or w_out.shape != (embed, embed)):
            return NOT_HANDLED
        causal, mask = bool(p["is_causal"]), p["attn_mask"]
        if causal:
            if mask is None:
                return NOT_HANDLED  # F.multi_head_attention_forward reports it
            mask = None  # as there: the causal hint replaces the mask
        elif mask is not None:
            mask = _shared_mask(tape, mask, x.dtype)
            if mask is NOT_HANDLED:
                return NOT_HANDLED
        unbatched = x.dim() == 3
        if unbatched:
            x = x.unsqueeze(2)
        batch, length, n, _ = x.shape
        head_dim = embed // heads
        qkv = recorded_linear(tape, x.reshape(batch * length * n, embed), batch, w_in, b_in)
        # B*L*N, 3E -> B, L, N, 3, H, hd -> (B*N, H, L, hd) each. Unbound along
        # the 3 in place, so that the backward stacks q, k and v's gradients
        # straight into the in-projection's [B*L*N, 3E] layout: one copy, not
        # a stack and then a copy into that layout.
        qkv = qkv.view(batch, length, n, 3, heads, head_dim)
        q, k, v = (t.permute(0, 2, 3, 1, 4).reshape(batch * n, heads, length, head_dim)
                   for t in qkv.unbind(3))
        attn = _attention(q, k, v, mask, causal)
        # B*N, H, L, hd -> B, L, N, H, hd -> B*L*N, E (the rows in (L, N) order)
        rows = attn.view(batch, n, heads, length, head_dim).permute(0, 3, 1, 2, 4)
        rows = rows.reshape(-1, embed)
        out = recorded_linear(tape, rows, batch, w_out, b_out).view(batch, length, n, embed)
        return batched(tape, out.squeeze(2) if unbatched else out), None
