"""LayerNorm's affine parameters under clipped_grad.

``F.layer_norm(x, shape, w, b)`` is ``x_hat * w + b`` with ``x_hat`` the
normalized input: sample i's gradients are ``sum_t g_i,t * x_hat_i,t`` for
``w`` and ``sum_t g_i,t`` for ``b``, each of the parameter's own size. The
rule runs the layer on physical tensors and records what ``x_hat`` is made
of; those [B, *shape] per-sample gradients are then formed directly (the
rule factors no weight: clipping.py's materialized kind), instead of
through per-sample copies of ``w`` and ``b`` under vmap, whose batched
LayerNorm takes several more kernels forward and backward.

Note [LayerNorm's own kernel, x_hat from what its node saves]
The rule calls ``torch.native_layer_norm`` with the detached affine
parameters: aten's fused kernel forward and backward, what the non-private
step runs. Its node saves the input, mean and inverse deviations; the tape
records those same tensors, and ``x_hat = (x - mean) * rstd`` is formed only
when the weight's per-sample gradient is, in the clip. So the step keeps one
[B, T, *shape] tensor per LayerNorm, as the non-private step does; an
operator of its own that normalizes, then an ``addcmul`` for the affine,
keeping ``x_hat`` instead of the input, would cost two kernels and two nodes
more. Under autocast the rule runs ``F.layer_norm`` without affine and the
``addcmul``, recording ``x_hat`` itself: ``layer_norm``'s dtype is autocast's
policy (float32 on CUDA, the input's on the CPU), which ``native_layer_norm``
does not share.
"""
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.graph import GradientEdge

from ..rule import NOT_HANDLED, batched, bind, physical, register
from ..tape import Tape, tap, weight_for
from .affine import AffineUse, affine_operands, affine_params

_LAYER_NORM_ARGS = (("input", "normalized_shape", "weight", "bias", "eps"), (None, None, 1e-5))


@register
@dataclass(eq=False)
class LayerNormUse(AffineUse):
    """``F.layer_norm(x, shape, w, b, eps)`` with ``w`` or ``b`` a parameter."""

    functions = (F.layer_norm,)

    rows: Tensor  # [B, T, *shape], T rows per sample: the input, or x_hat where mean is None
    edge: GradientEdge
    mean: Optional[Tensor] = None  # [B, T, 1, ...]: with rstd, x_hat = (rows - mean) * rstd
    rstd: Optional[Tensor] = None
    grad: Tensor = field(init=False)  # [B, T, *shape]

    def set_grad(self, grad: Tensor) -> None:
        # [B, *lead, *shape] -> [B, T, *shape]: merges the leading dims, a
        # copy when they are not contiguous (a pre-norm residual's gradient).
        self.grad = grad.reshape(self.rows.shape)
        if self.mean is None:  # x_hat under autocast: Note [clipped_grad under autocast]
            self.rows = self.rows.to(grad.dtype)

    def per_sample_grad(self, role: str) -> Tensor:
        if role == "bias":
            return self.grad.sum(1)
        if self.mean is None or self.rstd is None:
            return (self.grad * self.rows).sum(1)
        return (self.rows - self.mean).mul_(self.rstd).mul_(self.grad).sum(1)  # one temporary

    def release(self) -> None:
        del self.grad, self.rows
        self.mean = self.rstd = None

    @classmethod
    def intercept(cls, tape: Tape, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        bound = bind(*_LAYER_NORM_ARGS, args, kwargs)
        if bound is None:
            return NOT_HANDLED
        x, shape, w, b, eps = bound
        params = affine_params(tape, w, b)
        a = physical(tape, x)
        shape = tuple(shape) if isinstance(shape, (list, tuple, torch.Size)) else (shape,)
        if (a is None or params is None or not all(type(d) is int for d in shape)
                or tuple(a.shape[a.dim() - len(shape):]) != shape or a.dim() - 1 < len(shape)
                or any(t is not None and (t.shape != shape or t.dtype != a.dtype)
                       for t in (w, b))):
            return NOT_HANDLED
        batch = a.shape[0]
        lead = (batch, math.prod(a.shape[1:a.dim() - len(shape)]))
        needs = a.requires_grad
        if torch.is_autocast_enabled(a.device.type):  # See the Note above.
            normalized = F.layer_norm(a, shape, None, None, eps)
            if w is None:
                out = normalized + weight_for(tape, b, needs)
            elif b is None:
                out = normalized * weight_for(tape, w, needs)
            else:
                out = torch.addcmul(b.detach(), normalized, weight_for(tape, w, needs))
            use = cls(*params, normalized.detach().view(*lead, *shape), tap(out))
            recorded: Tuple[Tensor, ...] = ()
        else:  # Note [LayerNorm's own kernel, x_hat from what its node saves]
            w_op, b_op = affine_operands(tape, w, b, needs)
            # A fresh output with a node (Note [Tapping an output that may later change in place]).
            out, mean, rstd = torch.native_layer_norm(a, list(shape), w_op, b_op, eps)
            ones = (1,) * len(shape)
            use = cls(*params, a.detach().reshape(*lead, *shape), tap(out),
                      mean.view(*lead, *ones), rstd.view(*lead, *ones))
            recorded = (a,)
        tape.record(use, recorded, "layer norm")
        return batched(tape, out)
