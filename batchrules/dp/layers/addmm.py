"""``torch.addmm(b, x, W)`` with ``W: [I, O]`` a parameter: a linear with the
transposed weight, as transformers' GPT-2 ``Conv1D`` computes
``torch.addmm(bias, x.view(-1, nx), weight)``.

Sample i's weight gradient is ``a_i^T g_i``, the transpose of a linear's, so
the norms and the clipped sums are the linear's (linear.py), the weight's
``sum_i c_i a_i^T g_i`` one GEMM in its own layout (gemm.py).
"""
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

from ..gemm import clipped_gemm
from ..rule import (
    NOT_HANDLED,
    Factors,
    autocast_matches,
    batched,
    bind,
    physical,
    register,
    register_clipping,
)
from ..tape import Tape, tap, weight_for
from .linear import LinearClipping, LinearUse, sample_rows, shared_bias

_ADDMM_ARGS = (("input", "mat1", "mat2"), ())


@register
@dataclass(eq=False)
class AddmmUse(LinearUse):
    """``torch.addmm(b, x, W)`` (no beta, alpha) with ``W`` a parameter and a
    2-D per-sample ``x``, at clipped_grad's level."""

    functions = (torch.addmm,)
    kind = "addmm"

    def per_sample_grad(self, role: str) -> Tensor:
        if role == "bias":
            return super().per_sample_grad(role)
        return torch.bmm(self.rows.transpose(1, 2), self.grad)  # B,I,T x B,T,O -> B,I,O

    @classmethod
    def intercept(cls, tape: Tape, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        bound = bind(*_ADDMM_ARGS, args, kwargs)
        if bound is None:
            return NOT_HANDLED
        b, x, w = bound
        a = physical(tape, x)
        if a is None or a.dim() != 3:
            return NOT_HANDLED
        out = cls.recorded(tape, b, a, w)
        return out if out is NOT_HANDLED else batched(tape, out.view(a.shape[0], a.shape[1], w.shape[1]))

    @classmethod
    def intercept_batch_first(cls, tape: Tape, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        bound = bind(*_ADDMM_ARGS, args, kwargs)
        if bound is None:
            return NOT_HANDLED
        b, x, w = bound
        a = sample_rows(tape, x)
        return NOT_HANDLED if a is None or x.dim() != 2 else cls.recorded(tape, b, a, w)

    @classmethod
    def recorded(cls, tape: Tape, b: Any, a: Tensor, w: Tensor) -> Any:
        """``addmm(b, a, w)`` of physical rows ``a: [B, T, I]``, recorded: the
        fresh ``[B*T, O]`` output, or NOT_HANDLED."""
        weight, bias = tape.param(w), tape.param(b)
        if (weight is None or w.dim() != 2 or a.shape[-1] != w.shape[0]
                or not autocast_matches(a, w) or a.device != w.device):
            return NOT_HANDLED
        if bias is not None:
            if b.shape != (w.shape[1],) or b.dtype != w.dtype:
                return NOT_HANDLED
        elif b is None or not shared_bias(tape, b):
            return NOT_HANDLED
        batch, rows = a.shape[0], a.shape[1]
        flat = a.reshape(batch * rows, a.shape[-1])  # B*T, I
        w_op = weight_for(tape, w, flat.requires_grad or (bias is None and b.requires_grad))
        out = torch.addmm(b.detach() if bias is not None else b, flat, w_op)
        use = cls(weight, bias, flat.view(batch, rows, flat.shape[-1]), tap(out))
        tape.record(use, (flat,), "addmm")
        return out


@register_clipping(AddmmUse.kind)
class AddmmClipping(LinearClipping):
    """A linear's, with the weight in its transposed layout ``[I, O]``."""

    def weight_sum(self, a: Tensor, g: Tensor, c: Tensor, g_writable: bool) -> Tensor:
        """``sum_i c_i a_i^T g_i`` in the weight's layout ``[I, O]`` (gemm.py)."""
        return clipped_gemm(a, g, c, (False, g_writable))

    def factors(self, uses: List[LinearUse]) -> Factors:
        """In the layout ``[I, O]``: u = input rows, v = output gradient rows."""
        return Factors.of_rows([u.rows for u in uses], [u.grad for u in uses])
