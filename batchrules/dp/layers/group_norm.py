"""GroupNorm's affine parameters under clipped_grad.

``F.group_norm(x, G, w, b)`` is ``x_hat * w + b`` per channel, ``x_hat``
normalized over each sample's groups of channels: sample i's gradients are
``sum_s g_i,c,s * x_hat_i,c,s`` for ``w`` and ``sum_s g_i,c,s`` for ``b``, of
the parameters' own size [C] (summed over the sample's N rows too, for a
sample ``[N, C, *S]``). As for LayerNorm (layer_norm.py), the rule runs aten's
fused kernel on the physical batch as ``B*N`` rows (a row's statistics are its
own, so the batch changes nothing) and records the input with the mean and
inverse deviation its node saves; x_hat is formed only for the weight's
per-sample gradient (clipping.py's materialized kind). The per-sample
copies of ``w`` and ``b`` under vmap it replaces went through torch's batched
GroupNorm, which reads concrete sizes: a compiled step then specialized on
the batch size.
"""
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.graph import GradientEdge

from ..rule import NOT_HANDLED, batched, bind, physical, register
from ..tape import Tape, tap
from .affine import AffineUse, affine_operands, affine_params

_GROUP_NORM_ARGS = (("input", "num_groups", "weight", "bias", "eps"), (None, None, 1e-5))


@register
@dataclass(eq=False)
class GroupNormUse(AffineUse):
    """``F.group_norm(x, G, w, b, eps)`` with ``w`` or ``b`` a parameter."""

    functions = (F.group_norm,)

    rows: Tensor  # [B, N, C, S]: the input, N rows a sample, S positions a channel
    edge: GradientEdge
    mean: Tensor  # [B, N, G, 1]: x_hat = (rows - mean) * rstd, per group of C/G channels
    rstd: Tensor
    grad: Tensor = field(init=False)  # [B, N, C, S]

    def set_grad(self, grad: Tensor) -> None:
        self.grad = grad.reshape(self.rows.shape)

    def per_sample_grad(self, role: str) -> Tensor:
        if role == "bias":
            return self.grad.sum((1, 3))  # B,N,C,S -> B,C
        shape = self.rows.shape
        # B,N,G,C/G*S: one temporary, then B,N,C,S x B,N,C,S -> B,C
        x_hat = (self.rows.reshape(*self.mean.shape[:3], -1) - self.mean).mul_(self.rstd)
        return x_hat.view(shape).mul_(self.grad).sum((1, 3))

    def release(self) -> None:
        del self.grad, self.rows, self.mean, self.rstd

    @classmethod
    def intercept(cls, tape: Tape, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        bound = bind(*_GROUP_NORM_ARGS, args, kwargs)
        if bound is None:
            return NOT_HANDLED
        x, groups, w, b, eps = bound
        params = affine_params(tape, w, b)
        a = physical(tape, x)
        if (a is None or params is None or a.dim() < 3
                or type(groups) is not int or groups <= 0 or a.shape[2] % groups != 0
                or any(t is not None and (t.shape != (a.shape[2],) or t.dtype != a.dtype)
                       for t in (w, b))
                or torch.is_autocast_enabled(a.device.type)):
            return NOT_HANDLED  # torch's own checks, or autocast's policy, on the generic path
        batch, rows, channels = a.shape[:3]  # a sample is [N, C, *S], as F.group_norm reads it
        positions = math.prod(a.shape[3:])
        needs = a.requires_grad
        w_op, b_op = affine_operands(tape, w, b, needs)
        # A fresh output with a node (Note [Tapping an output that may later change in place]).
        out, mean, rstd = torch.native_group_norm(a.reshape(batch * rows, *a.shape[2:]), w_op, b_op,
                                                  batch * rows, channels, positions, groups, eps)
        use = cls(*params, a.detach().reshape(batch, rows, channels, positions), tap(out),
                  mean.view(batch, rows, groups, 1), rstd.view(batch, rows, groups, 1))
        tape.record(use, (a,), "group norm")
        return batched(tape, out.view(a.shape))
