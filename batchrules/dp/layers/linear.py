"""Linear layers under clipped_grad: the forward rule, norms and clipped sums.

Sample i's rows ``a_i: [T, I]`` (one row, or a sequence) and output gradients
``g_i: [T, O]`` give its weight gradient ``g_i^T a_i`` and bias gradient
``sum_t g_i,t``. The norms come from (a, g) without the [O, I] per-sample
matrix where that is cheaper (cost.py); the clipped sum ``sum_i c_i g_i^T a_i``
is one GEMM over all rows with c folded into the narrower of g and a
(gemm.py).
"""
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.graph import GradientEdge

from ..._compat import batched_level
from ..cost import rows_norms_sq
from ..gemm import clipped_gemm
from ..rule import (
    NOT_HANDLED,
    Clipping,
    Factors,
    Use,
    autocast_matches,
    batched,
    bind,
    physical,
    register,
    register_clipping,
)
from ..tape import Param, Tape, tap, weight_for

_LINEAR_ARGS = (("input", "weight", "bias"), (None,))


@register
@dataclass(eq=False)
class LinearUse(Use):
    """``F.linear(x, W, b)`` with ``W`` a parameter, at clipped_grad's level."""

    # batchrules.linear under a mode takes its torch.ops entry
    functions: ClassVar[Tuple[Callable[..., Any], ...]] = (
        F.linear, torch.ops.batchrules.linear.default, torch.ops.batchrules.linear)
    kind = "linear"

    weight: Param
    bias: Optional[Param]
    rows: Tensor  # [B, T, I]
    edge: GradientEdge
    grad: Tensor = field(init=False)  # [B, T, O]
    grad_row_sum: Optional[Tensor] = None  # [B, O]: the bias' per-sample gradient, once formed
    # The grad_partners' rows side by side, [B, T, sum of widths], where the
    # rule wrote them so (the joint norm's rows without a concatenated copy).
    partner_rows: Optional[Tensor] = None

    def roles(self) -> Dict[Param, str]:
        return {self.weight: "weight", **({self.bias: "bias"} if self.bias is not None else {})}

    def set_grad(self, grad: Tensor) -> None:
        self.grad = grad.view(self.rows.shape[0], self.rows.shape[1], grad.shape[-1])
        if self.rows.dtype != grad.dtype:  # Note [clipped_grad under autocast]
            self.rows = self.rows.to(grad.dtype)

    def per_sample_grad(self, role: str) -> Tensor:
        if role == "bias":
            return self.grad.sum(1)
        return torch.bmm(self.grad.transpose(1, 2), self.rows)  # B,O,T x B,T,I -> B,O,I

    def release(self) -> None:
        del self.grad, self.rows
        self.grad_row_sum = self.partner_rows = None
        self.grad_partners = None  # a cycle through the partners' list

    @classmethod
    def intercept(cls, tape: Tape, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        bound = bind(*_LINEAR_ARGS, args, kwargs)
        if bound is None:
            return NOT_HANDLED
        x, w, b = bound
        a = physical(tape, x)
        weight = tape.param(w)
        if (weight is not None and a is not None and w.dim() == 2 and a.dim() >= 2
                and a.shape[-1] != w.shape[1]):
            raise RuntimeError(
                f"clipped_grad: F.linear with weight {weight.name} of shape {tuple(w.shape)}: the "
                f"input's per-sample shape {tuple(x.shape)} has {x.shape[-1]} features, expected "
                f"{w.shape[1]}")
        if a is None or not ghostable(tape, a, w, b):
            return NOT_HANDLED
        return batched(tape, batch_linear(tape, a, w, b).view(*a.shape[:-1], w.shape[0]))

    @classmethod
    def intercept_batch_first(cls, tape: Tape, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        bound = bind(*_LINEAR_ARGS, args, kwargs)
        if bound is None:
            return NOT_HANDLED
        x, w, b = bound
        if not splits_into_rows(tape, x) or not ghostable(tape, x, w, b):
            return NOT_HANDLED
        if x.dim() == 2:  # x holds the rows, the op's output is the call's
            return recorded_linear(tape, x, tape.batch_size, w, b)
        rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
        return recorded_linear(tape, rows, tape.batch_size, w, b).view(*x.shape[:-1], w.shape[0])


@register_clipping(LinearUse.kind)
class LinearClipping(Clipping[LinearUse]):
    """A linear's weight from its uses' rows and output gradients; its fused
    bias joins the weight's norm."""

    norms_include_bias = True

    def factored(self, uses: List[LinearUse]) -> bool:
        return True  # Note [One parameter, several uses] in clipping.py: one linear over all rows

    def norms_sq(self, uses: List[LinearUse], bias: Optional[Param]) -> Tensor:
        """Per-sample squared gradient norms of the weight and ``bias``: the
        bias' gradient ``sum_t g_i,t`` is the weight's of a column of ones,
        so it joins the same norm (``biases``; with one row, ``||g_i||^2
        (||a_i||^2 + 1)``)."""
        a, g = all_rows(uses)
        return rows_norms_sq(a, g, biases=int(bias is not None))

    def joint_norms_sq(self, uses: List[LinearUse], biases: List[Optional[Param]]) -> Tensor:
        """One ghost norm of the shared gradient g over the uses' rows side by
        side (Note [Weights sharing an output gradient] in clipping.py), each
        fused bias a column of ones among them."""
        g = uses[0].grad
        side_by_side = uses[0].partner_rows
        rows = (torch.cat([u.rows for u in uses], -1)
                if side_by_side is None else side_by_side.to(g.dtype))
        count = sum(b is not None for b in biases)
        if count:  # the partners' clipped sums share one row sum of g for their biases
            shared = bias_grads(uses, g)
            for u in uses:
                u.grad_row_sum = shared
        return rows_norms_sq(rows, g, biases=count)

    def clipped_sum(self, uses: List[LinearUse], coef: Tensor, bias: Optional[Param],
                    owned: Callable[[Tensor], bool]) -> Tuple[Tensor, Optional[Tensor]]:
        """The weight's clipped sum in one GEMM (``weight_sum``; c folded into the
        narrower of a and g, into g in place when ``writable``) and the bias'
        ``sum_i c_i sum_t g_i,t``, one GEMV."""
        a, g = all_rows(uses)
        c = coef if coef.dtype == g.dtype else coef.to(g.dtype)
        grad_b = torch.mv(bias_grads(uses, g).t(), c) if bias is not None else None
        in_place = len(uses) > 1 or writable(g, owned)  # several uses: g is a concatenated copy
        return self.weight_sum(a, g, c, in_place), grad_b

    def weight_sum(self, a: Tensor, g: Tensor, c: Tensor, g_writable: bool) -> Tensor:
        """``sum_i c_i g_i^T a_i`` in the weight's layout ``[O, I]`` (gemm.py)."""
        return clipped_gemm(g, a, c, (g_writable, False))

    def factors(self, uses: List[LinearUse]) -> Factors:
        """In the layout ``[O, I]``: u = output gradient rows, v = input rows."""
        return Factors.of_rows([u.grad for u in uses], [u.rows for u in uses])


def all_rows(uses: List[LinearUse]) -> Tuple[Tensor, Tensor]:
    """All uses' rows ``[B, T, I]`` and gradients ``[B, T, O]`` (Note [One
    parameter, several uses]: a sum over uses is a sum over their rows)."""
    if len(uses) == 1:
        return uses[0].rows, uses[0].grad
    return torch.cat([u.rows for u in uses], 1), torch.cat([u.grad for u in uses], 1)


def bias_grads(uses: List[LinearUse], g: Tensor) -> Tensor:
    """``sum_t g_i,t``: ``[B, O]``, the fused bias' per-sample gradients, formed
    once for its norm and its clipped sum (kept on the first use). With one
    row a sample (an MLP) it is a view of g: its readers run before g may be
    scaled in place (``clipped_sum`` forms the bias' sum first; partners share
    g, which is then not scaled in place)."""
    first = uses[0]
    if first.grad_row_sum is None:
        first.grad_row_sum = g[:, 0] if g.shape[1] == 1 else g.sum(1)
    return first.grad_row_sum


def writable(g: Tensor, owned: Callable[[Tensor], bool]) -> bool:
    """Whether a recorded output gradient may be scaled in place: ``owned`` by
    its use, and no two of its elements sharing memory (the gradient of
    ``out.sum()`` is an expanded, stride-0 tensor)."""
    return owned(g) and torch._debug_has_internal_overlap(g) == 0  # 0: no overlap


def shared_bias(tape: Tape, b: Any) -> bool:
    """A bias the rule can pass through as is: absent, or a plain tensor shared by all samples."""
    return b is None or (isinstance(b, Tensor) and tape.param(b) is None and batched_level(b) == -1)


def ghostable(tape: Tape, a: Tensor, w: Any, b: Any) -> bool:
    """Whether ``F.linear`` of the physical input ``a`` can run as a recorded
    use: ``w`` a 2-D parameter matching ``a``, ``b`` a matching parameter or
    a tensor shared by all samples (anything else takes the generic path,
    whose op then reports mismatches in per-sample shapes)."""
    if (tape.param(w) is None or w.dim() != 2 or a.dim() < 2
            or a.shape[-1] != w.shape[1] or not autocast_matches(a, w) or a.device != w.device):
        return False
    if tape.param(b) is not None:
        return b.shape == (w.shape[0],) and b.dtype == w.dtype
    return shared_bias(tape, b)


def splits_into_rows(tape: Tape, x: Any) -> bool:
    """Whether ``x`` is the engine's plain ``[k*B, ..., I]`` (k >= 0), whose
    sample i's rows are where the per-call vmap would split them (Note [A
    batched forward, one vmap per call])."""
    batch = tape.batch_size
    return (isinstance(x, Tensor) and x.dim() >= 2 and batch != 0 and x.shape[0] % batch == 0
            and tape.param(x) is None and batched_level(x) == -1)


def sample_rows(tape: Tape, x: Any) -> Optional[Tensor]:
    """``x`` of ``splits_into_rows`` as each sample's rows ``[B, k*..., I]``;
    None for anything else."""
    if not splits_into_rows(tape, x):
        return None
    batch = tape.batch_size
    per_sample = x.shape[0] // batch * math.prod(x.shape[1:-1])
    return x.reshape(batch, per_sample, x.shape[-1])


def batch_linear(tape: Tape, a: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    """``recorded_linear`` of physical ``a: [B, ..., I]``: the fresh ``[B*..., O]`` output."""
    return recorded_linear(tape, a.reshape(math.prod(a.shape[:-1]), a.shape[-1]), a.shape[0], w, b)


def recorded_linear(tape: Tape, rows: Tensor, batch: int, w: Tensor, b: Optional[Tensor]) -> Tensor:
    """``F.linear(rows, w, b)`` on physical rows ``[B*T, I]`` (``batch`` = B), recorded; returns
    the fresh ``[B*T, O]`` output (Note [Tapping an output that may later
    change in place]: callers hand the loss it or views of it)."""
    return linear_use(tape, rows, batch, w, b)[0]


def linear_use(tape: Tape, rows: Tensor, batch: int, w: Tensor, b: Optional[Tensor],
               add_bias: bool = True) -> Tuple[Tensor, LinearUse]:
    """``recorded_linear``, and the use it recorded; with ``add_bias`` False the
    output leaves out the parameter ``b``, which the caller adds to it later
    (the use still has it as its bias)."""
    weight, bias = tape.param(w), tape.param(b)
    assert weight is not None  # the callers' ghostable
    w_op = weight_for(tape, w, rows.requires_grad or (b is not None and bias is None and b.requires_grad))
    if b is not None and bias is not None:  # a parameter: detached, or added by the caller
        b = bias.value if add_bias else None
    out = F.linear(rows, w_op, b)
    per_sample = rows.shape[0] // batch if batch else 0
    use = LinearUse(weight, bias, rows.view(batch, per_sample, rows.shape[-1]), tap(out))
    tape.record(use, (rows,), "linear")
    return out, use
