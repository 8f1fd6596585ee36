"""Embeddings (F.embedding) under clipped_grad.

Sample i's gradient of an embedding table has one non-zero row per distinct
index it looked up: the sum of the output gradients of that index's
positions (divided by the index's count in the sample with
``scale_grad_by_freq``; none for ``padding_idx``). So the norm needs no
[V, D] table per sample: the rows are summed per (sample, index) pair
(groups of equal ``sample * V + index`` keys, then one ``index_add``), at
most B*T rows of D, and squared; a table looked up by several calls
concatenates their rows. The clipped sum is one
``aten.embedding_dense_backward`` (the op's own gradient kernel) with c
folded into g. For a table also used by another rule (GPT-2's tied lm_head),
``factors`` gives u as the indices (Note [Cross terms of tied parameters]).
"""
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.graph import GradientEdge

from ..cost import sq_norms
from ..rule import (
    NOT_HANDLED,
    Clipping,
    Factors,
    Use,
    batched,
    bind,
    cat_rows,
    physical,
    register,
    register_clipping,
)
from ..tape import Param, Tape, tap, weight_for

_EMBEDDING_ARGS = (("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
                    "sparse"), (None, None, 2.0, False, False))


@register
@dataclass(eq=False)
class EmbeddingUse(Use):
    """``F.embedding(idx, W, ...)`` with ``W`` a parameter, at clipped_grad's level."""

    functions = (F.embedding,)
    kind = "embedding"

    weight: Param
    indices: Tensor  # [B, T]
    padding_idx: Optional[int]  # in [0, V)
    scale_grad_by_freq: bool
    edge: GradientEdge
    grad: Tensor = field(init=False)  # [B, T, D]

    def roles(self) -> Dict[Param, str]:
        return {self.weight: "weight"}

    def set_grad(self, grad: Tensor) -> None:
        self.grad = grad.view(*self.indices.shape, grad.shape[-1])

    def scaled(self, s: slice) -> Tuple[Tensor, Tensor]:
        """Slice ``s``'s indices ``[b, T]`` and row gradients ``[b, T, D]``,
        padding positions zeroed and frequencies (within a sample) applied."""
        idx, g = self.indices[s], self.grad[s]
        if self.scale_grad_by_freq:
            sample = torch.arange(idx.shape[0], device=idx.device).unsqueeze(1)
            inverse = _key_groups((sample * self.weight.value.shape[0] + idx).flatten())
            counts = torch.zeros_like(inverse).index_add_(0, inverse, torch.ones_like(inverse))
            g = g / counts[inverse].view(idx.shape).unsqueeze(-1).to(g.dtype)
        if self.padding_idx is not None:
            g = g * (idx != self.padding_idx).unsqueeze(-1).to(g.dtype)
        return idx, g

    def keys(self) -> Tuple[Tensor, Tensor]:
        """Each position's (sample, index) key ``sample * V + index`` and its
        row's gradient (``scaled``)."""
        idx, g = self.scaled(slice(0, self.indices.shape[0]))
        sample = torch.arange(idx.shape[0], device=idx.device).unsqueeze(1)
        return (sample * self.weight.value.shape[0] + idx).flatten(), g.flatten(0, 1)

    def release(self) -> None:
        del self.grad, self.indices

    def per_sample_grad(self, role: str) -> Tensor:
        keys, g = self.keys()
        batch = self.indices.shape[0]
        vocab, dim = self.weight.value.shape
        return g.new_zeros(batch * vocab, dim).index_add_(0, keys, g).view(batch, vocab, dim)

    @classmethod
    def intercept(cls, tape: Tape, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        bound = bind(*_EMBEDDING_ARGS, args, kwargs)
        if bound is None:
            return NOT_HANDLED
        x, w, padding_idx, max_norm, _, scale_grad_by_freq, sparse = bound
        weight = tape.param(w)
        idx = physical(tape, x)
        if weight is None:
            return NOT_HANDLED
        if max_norm is not None:
            raise ValueError(
                f"clipped_grad: F.embedding(max_norm={max_norm}) of {weight.name} rescales the "
                "table in place during the forward, which a differentiated argument cannot be; "
                "renormalize the table outside the loss instead")
        if sparse:
            raise ValueError(f"clipped_grad: F.embedding(sparse=True) of {weight.name}: clipped "
                             "sums are dense; pass sparse=False")
        if idx is None or w.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            return NOT_HANDLED
        vocab = w.shape[0]
        if padding_idx is not None:
            if not -vocab <= padding_idx < vocab:
                return NOT_HANDLED  # F.embedding reports it
            padding_idx = padding_idx % vocab
        batch = idx.shape[0]
        flat = idx.reshape(batch, math.prod(idx.shape[1:])).long()
        out = F.embedding(flat.flatten(), weight_for(tape, w, False))  # B*T, D: a fresh tensor
        use = cls(weight, flat, padding_idx, bool(scale_grad_by_freq), tap(out))
        tape.record(use, (flat,), "embedding")
        return batched(tape, out.view(*idx.shape, w.shape[1]))


def _key_groups(keys: Tensor) -> Tensor:
    """``torch.unique(keys, return_inverse=True)[1]`` (each key's rank among
    the distinct keys) with no output of data-dependent size, so that a traced
    step keeps static shapes: by a sort and a running count of new keys."""
    ordered, order = keys.sort()
    new = torch.ones_like(ordered, dtype=torch.bool)
    new[1:] = ordered[1:] != ordered[:-1]
    return torch.empty_like(keys).scatter_(0, order, new.cumsum(0) - 1)


@register_clipping(EmbeddingUse.kind)
class EmbeddingClipping(Clipping[EmbeddingUse]):
    """A table's norms from its rows summed per (sample, index); its clipped
    sum the op's own gradient kernel."""

    def factored(self, uses: List[EmbeddingUse]) -> bool:
        return True  # a table looked up by several calls: their rows concatenated

    def norms_sq(self, uses: List[EmbeddingUse], bias: Optional[Param]) -> Tensor:
        """Per-sample squared norms: rows summed per (sample, index), squared, summed per sample."""
        keys, g = _all_keys(uses)
        inverse = _key_groups(keys)
        summed = torch.zeros_like(g).index_add_(0, inverse, g)  # groups first, zero rows after
        per_row = sq_norms(summed, 1)
        vocab = uses[0].weight.value.shape[0]
        batch = uses[0].indices.shape[0]
        group_sample = torch.zeros_like(keys).scatter_(0, inverse, keys // vocab)
        return per_row.new_zeros(batch).index_add_(0, group_sample, per_row)

    def clipped_sum(self, uses: List[EmbeddingUse], coef: Tensor, bias: Optional[Param],
                    owned: Callable[[Tensor], bool]) -> Tuple[Tensor, Optional[Tensor]]:
        """``sum_i c_i`` (table gradient of sample i) in one embedding_dense_backward."""
        idx, g = _scaled_rows(uses, slice(0, coef.shape[0]))
        scaled = g * coef.to(g.dtype).view(-1, 1, 1)  # b,T,D x b,1,1 -> b,T,D
        vocab = uses[0].weight.value.shape[0]
        return torch.ops.aten.embedding_dense_backward(scaled.flatten(0, 1), idx.flatten(), vocab,
                                                       -1, False), None

    def factors(self, uses: List[EmbeddingUse]) -> Factors:
        """In the layout ``[V, D]``: u = one-hot of the index (given as the
        indices), v = the row's gradient (``scaled``: at most a copy per chunk)."""
        vocab, dim = uses[0].weight.value.shape
        shapes = [u.indices.shape for u in uses]
        batch, rows = shapes[0][0], sum(shape[1] for shape in shapes)
        return Factors(batch, rows, vocab, dim, True, lambda s: _scaled_rows(uses, s), rows * dim)


def _scaled_rows(uses: List[EmbeddingUse], s: slice) -> Tuple[Tensor, Tensor]:
    """Slice ``s`` of every use's indices and row gradients (``scaled``), their rows concatenated."""
    parts = [u.scaled(s) for u in uses]
    return cat_rows([i for i, _ in parts]), cat_rows([g for _, g in parts])


def _all_keys(uses: List[EmbeddingUse]) -> Tuple[Tensor, Tensor]:
    """Keys and rows of every use of one table (a sum over uses is a sum over their rows)."""
    pairs = [u.keys() for u in uses]
    if len(pairs) == 1:
        return pairs[0]
    return torch.cat([k for k, _ in pairs]), torch.cat([g for _, g in pairs])
