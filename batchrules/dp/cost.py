"""How per-sample norms are computed: ghost or materialized, and in how many chunks.

Note [Ghost or materialized norm]
A layer whose per-sample gradient is ``G_i = g_i^T a_i`` (linear: the rows of
sample i; convolution: its unfolded patches; ``a_i: [T, I]``, ``g_i: [T, O]``)
has two ways to ``||G_i||^2``:
  ghost:         <a_i a_i^T, g_i g_i^T>   T*T*(I + O) multiply-adds, a [T, T] pair
  materialized:  ||g_i^T a_i||^2          T*O*I multiply-adds, an [O, I] matrix
With one row (T = 1) the ghost norm is ``||g_i||^2 ||a_i||^2`` (I + O). The
cheaper one is chosen per layer, as book-keeping's "mixed" rule does (Bu et
al., ICML 2023: ghost when 2T^2 < I*O, i.e. the same comparison up to the
lower-order terms): ghost for wide layers over short sequences, the
materialized norm for convolutions with many output positions and for long
sequences through narrow layers.

Note [Bounded transients]
Either way the temporaries ([B, T, T] pairs, or [B, O, I] per-sample
gradients, and a convolution's unfolded patches) are computed over chunks of
the batch small enough that a chunk's temporaries hold no more elements than
the layer's recorded input and output gradient together (which are held
until the clipped sum anyway), or one sample's worth when that is more: the
norms never hold a B x (layer parameters) tensor beyond that bound.
"""
import math
from typing import Callable, List, Sequence, Union

import torch
from torch import Tensor


def sq_norms(t: Tensor, dims: Union[int, Sequence[int]]) -> Tensor:
    """Squared L2 norms over ``dims``, by one reduction (no squared copy of ``t``)."""
    return torch.linalg.vector_norm(t, dim=dims).square()


def ghost_is_cheaper(rows: int, in_features: int, out_features: int) -> bool:
    """Note [Ghost or materialized norm]."""
    return rows * (in_features + out_features) < in_features * out_features


def transient_per_sample(rows: int, in_features: int, out_features: int) -> int:
    """Elements the cheaper norm allocates per sample (and per group)."""
    if rows <= 1:
        return 0
    if ghost_is_cheaper(rows, in_features, out_features):
        return 2 * rows * rows
    return in_features * out_features


def pair_norms_sq(a: Tensor, g: Tensor) -> Tensor:
    """``||g_i^T a_i||^2`` for ``a: [B, *, T, I]``, ``g: [B, *, T, O]`` (``*``:
    groups, summed over), by the cheaper way (Note [Ghost or materialized norm])."""
    rows, in_f, out_f = a.shape[-2], a.shape[-1], g.shape[-1]
    if rows == 1:
        return (sq_norms(a, -1) * sq_norms(g, -1)).flatten(1).sum(1)
    if ghost_is_cheaper(rows, in_f, out_f):
        # B,T,I x B,I,T -> B,T,T (and the same for g)
        aat = torch.matmul(a, a.transpose(-1, -2))
        ggt = torch.matmul(g, g.transpose(-1, -2))
        return (aat * ggt).flatten(1).sum(1)
    # B,O,T x B,T,I -> B,O,I
    return sq_norms(torch.matmul(g.transpose(-1, -2), a).flatten(1), 1)


def chunked(batch: int, per_sample_elements: int, budget_elements: int,
            norms_sq: Callable[[slice], Tensor]) -> Tensor:
    """``norms_sq`` over slices of the batch sized by Note [Bounded transients];
    returns the concatenated ``[B]`` result."""
    step = max(1, budget_elements // max(1, per_sample_elements))
    if step >= batch:
        return norms_sq(slice(0, batch))
    parts: List[Tensor] = [norms_sq(slice(start, min(start + step, batch)))
                           for start in range(0, batch, step)]
    return torch.cat(parts)


def rows_norms_sq(a: Tensor, g: Tensor) -> Tensor:
    """``pair_norms_sq`` of recorded rows, in chunks (Note [Bounded transients])."""
    groups = math.prod(a.shape[1:-2])
    per_sample = groups * transient_per_sample(a.shape[-2], a.shape[-1], g.shape[-1])
    return chunked(a.shape[0], per_sample, a.numel() + g.numel(),
                   lambda s: pair_norms_sq(a[s], g[s]))
