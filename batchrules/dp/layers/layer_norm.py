"""LayerNorm's affine parameters under clipped_grad.

``F.layer_norm(x, shape, w, b)`` is ``x_hat * w + b`` with ``x_hat`` the
normalized input: sample i's gradients are ``sum_t g_i,t * x_hat_i,t`` for
``w`` and ``sum_t g_i,t`` for ``b``, each of the parameter's own size. The
rule runs the normalization and the affine step on physical tensors
(``F.layer_norm`` without affine, then one ``addcmul``) and records
``x_hat``; those [B, *shape] per-sample gradients are then formed directly
(the rule factors no weight: clipping.py's materialized kind), instead of
through per-sample copies of ``w`` and ``b`` under vmap, whose batched
LayerNorm takes several more kernels forward and backward.

Note [Normalizing without keeping the input]
``F.layer_norm``'s autograd keeps its input for the backward, and the tape
keeps ``x_hat`` for the per-sample gradients: two [B, T, *shape] tensors
where the non-private step keeps one. ``_normalize`` keeps ``x_hat`` and the
inverse deviations instead (its backward, ``rstd * (g - mean(g) - x_hat *
mean(g * x_hat))``, needs nothing else: aten's fused kernel run on x_hat as
its own input, then scaled), so the tape's ``x_hat`` is the only
one and the input is freed once the next layer is done with it (BERT bench
row, B 16: peak 92.3 MB instead of 94.5; GPT-2: 169.5 instead of 178.9).
Under autocast ``F.layer_norm`` runs as before: its dtype is autocast's policy
for ``layer_norm`` (float32 on CUDA, the input's on the CPU), which
``native_layer_norm`` does not share. ``_normalize`` is a C++ operator with
a hand-written node (csrc/normalize/), not an ``autograd.Function``: under
clipped_grad's vmap a Function goes through functorch's generated vmap rule
even on unbatched tensors, 180-360 µs a call over ``F.layer_norm``'s (10% of
the DDP row's small transformer step), and as a Python torch.library op
its forward and backward with the affine ``addcmul`` took 175 µs, against
95 µs now and 50 µs for ``F.layer_norm``'s own (1 thread, [32, 12, 128]).
"""
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..rule import NOT_HANDLED, Use, batched, bind, physical, register
from ..tape import Param, Tape, tap, weight_for


# The normalization without affine and its inverse deviations; its node
# saves those two, not the input (Note [Normalizing without keeping the
# input]; csrc/normalize/).
_normalize = torch.ops.batchrules.normalize.default


_LAYER_NORM_ARGS = (("input", "normalized_shape", "weight", "bias", "eps"), (None, None, 1e-5))


@register
@dataclass(eq=False)
class LayerNormUse(Use):
    """``F.layer_norm(x, shape, w, b, eps)`` with ``w`` or ``b`` a parameter."""

    functions = (F.layer_norm,)

    weight: Optional[Param]
    bias: Optional[Param]
    normalized: Tensor  # [B, T, *shape]: x_hat, T rows per sample
    edge: Any
    grad: Optional[Tensor] = None  # [B, T, *shape]

    def roles(self) -> Dict[Param, str]:
        return {p: role for p, role in ((self.weight, "weight"), (self.bias, "bias")) if p is not None}

    def set_grad(self, grad: Optional[Tensor]) -> None:
        if grad is not None:
            # [B, *lead, *shape] -> [B, T, *shape]: merges the leading dims, a
            # copy when they are not contiguous (a pre-norm residual's gradient).
            self.grad = grad.reshape(self.normalized.shape)
            self.normalized = self.normalized.to(grad.dtype)  # Note [clipped_grad under autocast]

    def per_sample_grad(self, role: str) -> Tensor:
        if role == "bias":
            return self.grad.sum(1)
        return (self.grad * self.normalized).sum(1)

    def release(self) -> None:
        self.grad = self.normalized = None  # type: ignore[assignment]

    @classmethod
    def intercept(cls, tape: Tape, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        bound = bind(*_LAYER_NORM_ARGS, args, kwargs)
        if bound is None:
            return NOT_HANDLED
        x, shape, w, b, eps = bound
        weight, bias = tape.param(w), tape.param(b)
        a = physical(tape, x)
        shape = tuple(shape) if isinstance(shape, (list, tuple, torch.Size)) else (shape,)
        if (a is None or (weight is None and bias is None) or (w is not None and weight is None)
                or (b is not None and bias is None) or not all(type(d) is int for d in shape)
                or tuple(a.shape[a.dim() - len(shape):]) != shape or a.dim() - 1 < len(shape)
                or any(t is not None and (t.shape != shape or t.dtype != a.dtype)
                       for t in (w, b))):
            return NOT_HANDLED
        batch = a.shape[0]
        rows = math.prod(a.shape[1:a.dim() - len(shape)])
        normalized = (F.layer_norm(a, shape, None, None, eps)
                      if torch.is_autocast_enabled(a.device.type)
                      else _normalize(a, list(shape), eps)[0])
        # A fresh output with a node (Note [Tapping an output that may later change in place]).
        needs = normalized.requires_grad
        if w is None:
            out = normalized + weight_for(b, needs)
        elif b is None:
            out = normalized * weight_for(w, needs)
        else:
            out = torch.addcmul(b.detach(), normalized, weight_for(w, needs))
        use = cls(weight, bias, normalized.detach().view(batch, rows, *shape), tap(out))
        tape.record(use, (), "layer norm")
        return batched(tape, out)
