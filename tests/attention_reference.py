"""Argument builders and for-loop references for the attention batching tests.

Every reference runs the stock aten op (or F.scaled_dot_product_attention) on
one example at a time, outside vmap, in float64; the batched call under test
sees the same values in the physical layout its in_dims describe.
"""
import itertools
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from batching_reference import BDim, example, physical
from torch import Tensor

FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def flash(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None,
          **kw: object) -> Tuple[Tensor, Tensor]:
    """The CPU flash-attention op, the mask as SDPA names it."""
    return FLASH_CPU(q, k, v, attn_mask=mask, **kw)


# An example: attention batch B, heads H (key/value KV_H for GQA), lengths L/S, head dim E.
B, H, KV_H, L, S, E = 2, 4, 2, 5, 6, 8
N = 3  # vmap size

# Logical mask shapes of one example: every shape the CPU kernel broadcasts.
MASK_SHAPES: Dict[str, Optional[Tuple[int, ...]]] = {
    "none": None,
    "LS": (L, S),
    "11LS": (1, 1, L, S),
    "B1LS": (B, 1, L, S),
    "BHLS": (B, H, L, S),
    "1H1S": (1, H, 1, S),
}


def bdim_choices(rank: int, middle: bool = False) -> List[BDim]:
    """Shared, batch-first and last (whose rows are then strided); ``middle`` adds
    a dim in between."""
    return [None, 0, rank // 2, rank] if middle else [None, 0, rank]


def in_dims_combinations(ranks: Sequence[int], middle: bool = False) -> Iterator[Tuple[BDim, ...]]:
    """Every combination of bdim_choices with at least one operand batched."""
    for dims in itertools.product(*(bdim_choices(r, middle) for r in ranks)):
        if any(d is not None for d in dims):
            yield dims


def make_mask(shape: Optional[Tuple[int, ...]], kind: str, bdim: BDim,
              generator: torch.Generator) -> Optional[Tensor]:
    """A float mask (additive, -inf in a few places but never a whole row) or a bool one."""
    if shape is None:
        return None
    keep = physical(shape, bdim, N, torch.float64, generator) > -1.0
    keep[..., 0] = True  # every query row attends to something
    if kind == "bool":
        return keep
    values = physical(shape, bdim, N, torch.float64, generator)
    return values.masked_fill(~keep, float("-inf"))


def attention_args(mask_shape: Optional[Tuple[int, ...]], dims: Sequence[BDim],
                   kv_heads: int = H, mask_kind: str = "float",
                   seed: int = 0) -> List[Optional[Tensor]]:
    """q, k, v (and the mask) in the physical layout of ``dims``."""
    g = torch.Generator().manual_seed(seed)
    q = physical((B, H, L, E), dims[0], N, torch.float64, g)
    k = physical((B, kv_heads, S, E), dims[1], N, torch.float64, g)
    v = physical((B, kv_heads, S, E), dims[2], N, torch.float64, g)
    return [q, k, v, make_mask(mask_shape, mask_kind, dims[3] if len(dims) > 3 else None, g)]


def loop(fn, args: Sequence, dims: Sequence[BDim]):
    """Stacks fn over the N examples (tuples of outputs stacked elementwise)."""
    outs = [fn(*[example(a, d, i) for a, d in zip(args, dims)]) for i in range(N)]
    if isinstance(outs[0], tuple):
        return tuple(torch.stack(col) for col in zip(*outs))
    return torch.stack(outs)


def math_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None,
                   is_causal: bool = False, scale: Optional[float] = None) -> Tensor:
    """softmax(q k^T * scale + mask) v written out, for derivatives of every order."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if k.shape[-3] != q.shape[-3]:
        reps = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(reps, -3), v.repeat_interleave(reps, -3)
    scores = q @ k.transpose(-2, -1) * scale
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
            else scores + mask
    return torch.softmax(scores, -1) @ v


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, **kw) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
