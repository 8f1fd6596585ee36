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
sequences through narrow layers. On the CPU a ghost norm of at most
``_GHOST_KERNEL_ROWS`` rows is one C++ kernel over the pairs instead of two
bmms (Note [The ghost norm kernel] in csrc/dp/ghost_norm/kernel.cpp).

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

from .rule import Factors


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


_GHOST_KERNEL = torch.ops.batchrules.ghost_norms_sq.default
_GHOST_KERNEL_ROWS = 128  # Note [The ghost norm kernel] (csrc/dp/ghost_norm/kernel.cpp)


def _ghost_kernel_runs(a: Tensor, g: Tensor) -> bool:
    """The C++ ghost norm for a CPU layer's few rows (faster than two bmms
    there, and than the four ops of the one-row norm)."""
    return (0 < a.shape[-2] <= _GHOST_KERNEL_ROWS and a.device.type == "cpu"
            and a.dtype == g.dtype and a.dtype in (torch.float32, torch.float64))


def pair_norms_sq(a: Tensor, g: Tensor, biases: int = 0) -> Tensor:
    """``||g_i^T a_i||^2`` for ``a: [B, *, T, I]``, ``g: [B, *, T, O]`` (``*``:
    groups, summed over), by the cheaper way (Note [Ghost or materialized norm]);
    plus ``biases`` times ``||sum_t g_i,t||^2`` (that many biases sharing the
    output gradient: a's rows with ``biases`` columns of ones; no groups)."""
    rows, in_f, out_f = a.shape[-2], a.shape[-1], g.shape[-1]
    assert biases == 0 or a.dim() == 3, "a bias term sums over a sample's rows: no groups"
    ghost = rows == 1 or ghost_is_cheaper(rows, in_f, out_f)
    if ghost and _ghost_kernel_runs(a, g):
        if a.dim() == 3:
            return _GHOST_KERNEL(a, g, biases)
        lead = math.prod(a.shape[:-2])  # named: -1 is ambiguous for 0 features
        norms = _GHOST_KERNEL(a.reshape(lead, rows, in_f), g.reshape(lead, rows, out_f), biases)
        return norms.view(a.shape[0], math.prod(a.shape[1:-2])).sum(1)
    if rows == 1:
        return ((sq_norms(a, -1) + biases) * sq_norms(g, -1)).flatten(1).sum(1)
    if ghost:
        # B,T,I x B,I,T -> B,T,T (and the same for g)
        aat = torch.matmul(a, a.transpose(-1, -2))
        ggt = torch.matmul(g, g.transpose(-1, -2))
        return ((aat + biases if biases else aat) * ggt).flatten(1).sum(1)
    # B,O,T x B,T,I -> B,O,I, or its transpose B,I,T x B,T,O -> B,I,O: the same
    # norm, and the wider output last runs far faster (LoRA's B: I = 8, O = 768)
    if out_f > in_f:
        squares = sq_norms(torch.matmul(a.transpose(-1, -2), g).flatten(1), 1)
    else:
        squares = sq_norms(torch.matmul(g.transpose(-1, -2), a).flatten(1), 1)
    return squares + biases * sq_norms(g.sum(-2), -1) if biases else squares


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


def rows_norms_sq(a: Tensor, g: Tensor, biases: int = 0) -> Tensor:
    """``pair_norms_sq`` of recorded rows, in chunks (Note [Bounded transients])."""
    groups = math.prod(a.shape[1:-2])
    per_sample = groups * transient_per_sample(a.shape[-2], a.shape[-1], g.shape[-1])
    return chunked(a.shape[0], per_sample, a.numel() + g.numel(),
                   lambda s: pair_norms_sq(samples(a, s), samples(g, s), biases))


def samples(t: Tensor, s: slice) -> Tensor:
    """``t[s]``: ``t`` itself for all its samples (no view op)."""
    return t if s.start == 0 and s.stop == t.shape[0] else t[s]


# Note [Cross terms of tied parameters]
# A weight whose uses are of several classes (GPT-2's tied wte: an embedding
# and the lm_head's linear) or several calls one class does not factor (a
# convolution applied twice) has per-sample gradient G_i = sum_k G_k,i over
# those parts, so
#   ||G_i||^2 = sum_k ||G_k,i||^2 + 2 sum_{k<l} <G_k,i, G_l,i>.
# Each part's own norm is its class's norms_sq; each offers factors
# (rule.Factors: G_k,i = sum_t u_t (x) v_t in the weight's layout), and
#   <G_a,i, G_b,i> = sum_{t,s} (u_a,t . u_b,s) (v_a,t . v_b,s)
# by one of:
#   ghost:         two [T_a, T_b] pairs          T_a*T_b*(P + Q) multiply-adds
#   materialized:  both [P, Q] gradients         (T_a + T_b)*P*Q
# the cheaper, as Note [Ghost or materialized norm]. An index-valued u (an
# embedding's one-hot) is always ghost, u_a,t . u_b,s being a gather of
# u_b,s at index k_a,t (or k_a,t == k_b,s): O(T_a*T_b*Q), no one-hot and no
# [V, D] gradient; for GPT-2 small's wte (V = 50257, D = 768) this replaces a
# 154 MB per-sample gradient by a [T, T] pair, in a fraction of the time and
# the memory.
# Chunked as Note [Bounded transients], the bound being both parts' recorded
# rows. The clipped sum needs no cross term: sum_i c_i G_i = sum_k (sum_i c_i
# G_k,i), each part's clipped_sum, all computed after the norms (a part may
# scale its output gradient in place).
def cross_inner(a: Factors, b: Factors) -> Tensor:
    """``[B]``: the per-sample ``<G_a,i, G_b,i>`` (Note [Cross terms of tied parameters])."""
    if b.indexed and not a.indexed:
        a, b = b, a  # an index-valued u first
    ghost = a.indexed or a.rows * b.rows * (a.p + a.q) <= (a.rows + b.rows) * a.p * a.q
    pair = 2 * a.rows * b.rows if ghost else 2 * a.p * a.q
    recorded = sum(f.rows * ((1 if f.indexed else f.p) + f.q) for f in (a, b))
    return chunked(a.batch, pair + a.copies + b.copies, a.batch * recorded,
                   lambda s: _cross(a, b, s, ghost))


def _cross(a: Factors, b: Factors, s: slice, ghost: bool) -> Tensor:
    (ua, va), (ub, vb) = a.at(s), b.at(s)
    if not ghost:
        # b,P,Ta x b,Ta,Q -> b,P,Q (and the same for b)
        return _dot(torch.bmm(ua.transpose(1, 2), va), torch.bmm(ub.transpose(1, 2), vb))
    if a.indexed and not b.indexed:
        # b,Tb,P gathered at b,Tb,Ta indices -> b,Tb,Ta; b,Tb,Q x b,Q,Ta -> b,Tb,Ta
        uu = ub.gather(2, ua.unsqueeze(1).expand(-1, ub.shape[1], -1))
        return _dot(uu, torch.bmm(vb, va.transpose(1, 2)))
    vv = torch.bmm(va, vb.transpose(1, 2))  # b,Ta,Q x b,Q,Tb -> b,Ta,Tb
    if a.indexed:  # both: the one-hots meet where the indices are equal
        return _dot((ua.unsqueeze(2) == ub.unsqueeze(1)).to(vv.dtype), vv)
    return _dot(torch.bmm(ua, ub.transpose(1, 2)), vv)  # b,Ta,P x b,P,Tb -> b,Ta,Tb


def _dot(x: Tensor, y: Tensor) -> Tensor:
    """Per-sample dot products of ``[b, ...]`` tensors, with no product tensor."""
    return torch.bmm(x.reshape(x.shape[0], 1, -1), y.reshape(y.shape[0], -1, 1)).view(-1)
