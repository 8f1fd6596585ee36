"""After the backward: per-sample norms, clipping coefficients, clipped sums.

Each parameter is handled by the kind of its uses (the calls whose output
reached the loss):
  kind          uses                                 norms / clipped sum
  a use's kind  only weight uses of one layer rule,  its Clipping's
  (Use.kind)    which its Clipping's ``factored``    norms_sq / clipped_sum
                takes (rule.py)
  tied          weight uses of several rules (or     each part's, and cross
                calls), each part offering factors   terms (Note [One
                                                     parameter, several uses])
  bias          only bias uses                       [B, *shape] per-sample
                                                     gradients / one GEMV
  materialized  anything else: a per-sample copy     [B, *shape] per-sample
                (tape.py), a weight the Clipping     gradients / one GEMV
                does not factor, or parts without
                factors
  zero          no use reached the loss              zeros
A bias used by exactly the calls of its weight (its fused bias) is summed
with it, and its norm is the weight's when its Clipping's
``norms_include_bias``.
"""
from collections import Counter
from itertools import combinations
from typing import Callable, Dict, List, Optional, Tuple, Type

import torch
from torch import Tensor

from .cost import cross_inner, sq_norms
from .rule import CLIPPINGS, Factors, Use
from .tape import Param, zeros_grad

# Added to the norm before dividing, as Opacus does: c_i = min(1, C / (||g_i|| + EPS)).
EPS = 1e-6

# The kinds clipped from per-sample gradients; any kind but these, "zero" and
# "tied" is a Clipping's (Use.kind).
_PER_SAMPLE = ("bias", "materialized")
_NOT_CLIPPING_KINDS = (*_PER_SAMPLE, "zero", "tied")


# Note [One parameter, several uses]
# A parameter used by several calls (weights tied across layers, a layer
# applied twice) has as per-sample gradient the sum over its uses. A
# Clipping whose ``factored`` takes them all treats them as one use (a
# linear's: one linear over the concatenated rows). Otherwise its weight uses
# split into parts (a rule's uses that its Clipping's ``factored`` takes
# together, or single calls), and if every part offers factors the parameter is "tied": its norm is each
# part's own plus the cross terms (Note [Cross terms of tied parameters] in
# cost.py), its clipped sum the parts' clipped sums added. Anything else (a
# per-sample copy, a bias role among the uses, a part without factors) takes
# the materialized path: each use's per-sample gradient [B, *shape], summed.
def _parts(uses: List[Use]) -> Optional[List[List[Use]]]:
    """Weight uses grouped as their Clippings take them; None if some use is not taken."""
    by_class: Dict[Type[Use], List[Use]] = {}
    for u in uses:
        by_class.setdefault(type(u), []).append(u)
    parts: List[List[Use]] = []
    for cls, own in by_class.items():
        clipping = CLIPPINGS[cls.kind]
        if clipping.factored(own):
            parts.append(own)
        elif all(clipping.factored([u]) for u in own):
            parts += [[u] for u in own]
        else:
            return None
    return parts


def _tied_parts(param: Param) -> List[List[Use]]:
    """The parts of a parameter of the kind "tied"."""
    parts = _parts(param.uses)
    assert parts is not None
    return parts


def _factors(part: List[Use]) -> Factors:
    """A part's factors, which every part of a "tied" parameter offers."""
    factors = CLIPPINGS[part[0].kind].factors(part)
    assert factors is not None
    return factors


def kind(param: Param) -> str:
    if param.copy_grad is not None:
        return "materialized"
    if not param.uses:
        return "zero"
    roles = {u.roles()[param] for u in param.uses}
    if roles == {"bias"}:
        return "bias"
    parts = _parts(param.uses) if roles == {"weight"} else None
    if parts is None:
        return "materialized"
    if len(parts) == 1:
        return parts[0][0].kind
    if all(CLIPPINGS[part[0].kind].factors(part) is not None for part in parts):
        return "tied"
    return "materialized"


def factored_norms_sq(param: Param) -> Optional[Tensor]:
    """``[B]``: the squared per-sample gradient norms of a weight of a
    Clipping's kind (its bias left out), from its uses; None for any other
    kind (the first-step validation's engine norms)."""
    k = kind(param)
    return None if k in _NOT_CLIPPING_KINDS else CLIPPINGS[k].norms_sq(param.uses, None)


def per_sample_grad(param: Param, batch: int) -> Tensor:
    """``[B, *shape]``: the sum over its uses (and its per-sample copy)."""
    grads = [u.per_sample_grad(u.roles()[param]) for u in param.uses]
    if param.copy_grad is not None:
        grads.append(param.copy_grad)
    total = grads[0] if grads else zeros_grad(param, batch)
    for g in grads[1:]:
        total = total + g
    return total


def _fused_bias(weight: Param, kinds: Dict[Param, str]) -> Optional[Param]:
    """The bias whose every use is a use of ``weight``, in the role "bias":
    its norm and clipped sum come with the weight's."""
    uses = weight.uses
    bias = _role(uses[0], "bias")
    if bias is None or kinds[bias] != "bias" or bias.uses != uses:
        return None
    return bias


# Note [Weights sharing an output gradient]
# One call may apply several weights whose per-sample gradients share their
# output-gradient factor: an LSTM or RNN layer's W_ih (rows x_t) and W_hh
# (rows h_{t-1}) both multiply the gate gradient g_t. Sample i's squared
# norms of the two then add up to one ghost norm over their rows side by side,
#   sum_{t,s} (g_t . g_s)(x_t . x_s + h_{t-1} . h_{s-1}),
# one Gram of g for both instead of one each. The rule names such uses
# (Use.grad_partners) and offers joint_norms_sq; the norms are joint where
# each partner is its weight's only live use, that weight is of the rule's
# kind and its bias, if any, is fused to it. Otherwise (a layer called twice)
# each weight's norm is its own.
def _joint_groups(params: List[Param], kinds: Dict[Param, str],
                  fused: Dict[Param, Param]) -> Dict[Param, List[Use]]:
    """Each weight whose norm is part of a joint norm: its group's uses."""
    groups: Dict[Param, List[Use]] = {}
    for p in params:
        if kinds[p] in _NOT_CLIPPING_KINDS or len(p.uses) != 1 or p.uses[0].grad_partners is None:
            continue
        partners = p.uses[0].grad_partners
        weights = [_role(u, "weight") for u in partners]
        # w.uses == [u]: u reached the loss (the backward keeps only such uses) and is w's only one
        if all(CLIPPINGS[u.kind].norms_include_bias and w is not None
               and kinds.get(w) == u.kind and w.uses == [u]
               and _role(u, "bias") == fused.get(w) for u, w in zip(partners, weights)):
            groups.update((w, partners) for w in weights if w is not None)
    return groups


def _role(use: Use, role: str) -> Optional[Param]:
    return next((p for p, r in use.roles().items() if r == role), None)


def _norms(params: List[Param], kinds: Dict[Param, str], fused: Dict[Param, Param],
           per_sample: Dict[Param, Tensor], batch: int) -> Tensor:
    squares: List[Tensor] = []
    in_weight_norm = {b for w, b in fused.items() if CLIPPINGS[kinds[w]].norms_include_bias}
    joint = _joint_groups(params, kinds, fused)
    joined: List[List[Use]] = []
    for p in params:
        k = kinds[p]
        if p in joint:  # Note [Weights sharing an output gradient]
            group = joint[p]
            if not any(group is g for g in joined):
                joined.append(group)
                biases = [_role(u, "bias") for u in group]  # each its weight's fused bias
                squares.append(CLIPPINGS[group[0].kind].joint_norms_sq(group, biases))
        elif k in _PER_SAMPLE:
            if p not in in_weight_norm:
                per_sample[p] = per_sample_grad(p, batch)
                squares.append(sq_norms(per_sample[p].flatten(1), 1))
        elif k == "tied":
            squares.append(_tied_norms_sq(p))
        elif k != "zero":
            squares.append(CLIPPINGS[k].norms_sq(p.uses, fused.get(p)))
    if not squares:
        return torch.zeros(batch, dtype=params[0].value.dtype if params else None,
                           device=params[0].value.device if params else None)
    total = squares[0]
    for s in squares[1:]:
        total = total + s
    return total.sqrt()


def _tied_norms_sq(p: Param) -> Tensor:
    """Each part's squared norms, plus twice the cross terms of each pair of parts."""
    parts = _tied_parts(p)
    total = CLIPPINGS[parts[0][0].kind].norms_sq(parts[0], None)
    for part in parts[1:]:
        total = total + CLIPPINGS[part[0].kind].norms_sq(part, None)
    factors = [_factors(part) for part in parts]
    for a, b in combinations(factors, 2):
        total = total + 2 * cross_inner(a, b)
    return total


def _clipped_sum(p: Param, k: str, coef: Tensor, fused: Dict[Param, Param],
                 per_sample: Dict[Param, Tensor],
                 owned: Callable[[Tensor], bool]) -> Tuple[Tensor, Optional[Tensor]]:
    """The clipped sum of ``p`` (and of its fused bias)."""
    if k in _PER_SAMPLE:
        g = per_sample.pop(p)
        # B x B,P -> P (torch.matmul: tensordot adds a Python wrapper's cost per parameter)
        return torch.matmul(coef.to(g.dtype), g.reshape(g.shape[0], -1)).view(g.shape[1:]), None
    if k == "zero":
        return torch.zeros_like(p.value), None
    if k == "tied":  # additive over the parts (their biases, if any, are of kind "bias")
        parts = _tied_parts(p)
        total = CLIPPINGS[parts[0][0].kind].clipped_sum(parts[0], coef, None, owned)[0]
        for part in parts[1:]:
            total = total + CLIPPINGS[part[0].kind].clipped_sum(part, coef, None, owned)[0]
        return total, None
    return CLIPPINGS[k].clipped_sum(p.uses, coef, fused.get(p), owned)


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def clip(params: List[Param], batch: int, max_norm: float,
         scale: float = 1.0, in_place: bool = True) -> Tuple[List[Tensor], Tensor]:
    """The clipped sum of every parameter (in order) and the per-sample norms.
    ``scale``: the recorded gradients are the per-sample losses' divided by
    it (the engine's mean over the batch, 1/B); norms and sums are then the
    per-sample losses'. ``in_place=False`` while traced, where storages are
    not known (the compiler reuses buffers itself).

    Recorded tensors are released as soon as every parameter of their use is
    summed, and the sums are formed smallest first, so that the largest
    parameter's sum is allocated when the least else is held (peak memory).
    """
    if batch == 0:  # an empty (Poisson-sampled) batch
        dtype = params[0].value.dtype if params else torch.get_default_dtype()
        device = params[0].value.device if params else None
        return [torch.zeros_like(p.value) for p in params], torch.zeros(0, dtype=dtype, device=device)
    kinds = {p: kind(p) for p in params}
    fused = {p: b for p in params if kinds[p] not in _NOT_CLIPPING_KINDS
             for b in [_fused_bias(p, kinds)] if b is not None}
    per_sample: Dict[Param, Tensor] = {}
    norms = _norms(params, kinds, fused, per_sample, batch)
    if scale != 1.0:
        norms = norms * scale
    coef = (max_norm / (norms + EPS)).clamp(max=1.0)
    if scale != 1.0:  # sum_i c_i (scale g_i) as sum_i (c_i scale) g_i
        coef = coef * scale

    # An output gradient is read once more, by its weight's clipped sum, which
    # may then scale it in place: unless autograd handed the same storage to
    # several recorded outputs (an add's backward passes one tensor to both).
    live = {id(u): u for p in params for u in p.uses}
    storages = Counter(_storage(u.grad) for u in live.values()) if in_place else Counter()

    def owned(g: Tensor) -> bool:
        return in_place and storages[_storage(g)] == 1

    sums: Dict[Param, Tensor] = {}
    fused_biases = set(fused.values())
    for p in sorted(params, key=lambda q: q.value.numel()):
        if p in sums or p in fused_biases:
            continue
        sums[p], grad_b = _clipped_sum(p, kinds[p], coef, fused, per_sample, owned)
        if grad_b is not None:  # p's fused bias'
            sums[fused[p]] = grad_b
        for use in p.uses:
            if all(q in sums for q in use.roles()):
                use.release()
    return [sums[p] for p in params], norms
