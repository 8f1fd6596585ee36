"""Convolutions (F.conv1d / F.conv2d) under clipped_grad.

A convolution is a linear over its unfolded input patches: sample i's weight
gradient is ``g_i^T a_i`` with ``a_i: [N*P, C/G*k]`` (its patches, N images of
P output positions, per group) and ``g_i: [N*P, O/G]``. The clipped sum is
one call of the convolution's own weight-gradient kernel
(``aten.convolution_backward``) with c folded into g.

Note [Convolution norms]
The norms take the cheaper of ghost and materialized (cost.py). Ghost needs
the patches (``F.unfold``, chunk by chunk). Materialized does not: the
per-sample weight gradients of b samples are the weight gradient of one
convolution with b times the groups, the samples stacked along the channels
(input [N, b*C, ...], output gradient [N, b*O, ...], groups b*G), so the
backend's weight-gradient kernel computes them without unfolded patches,
faster than unfold + bmm. Where the whole batch's per-sample gradients fit
the bound of Note [Bounded transients] (small weights: small_cnn's first
conv), they are kept, and the clipped sum is ``sum_i c_i G_i`` from them instead of a
second weight-gradient kernel.

Note [Convolutions with few output positions]
Where a sample has at most ``_GEMM_ROWS`` output positions (a ResNet's last
stages on small images: 1x1 or 2x2 outputs), the clipped sum is not the
convolution's weight-gradient kernel but the clipped sums' GEMM (gemm.py) over
the unfolded patches ``[B, rows, C*k]`` (at most 4 rows a sample), unfolded
once for the whole batch and kept from the ghost norm to the sum (a transient
the sum needs anyway, so the norm is not chunked: Note [Bounded transients]
would cut layer 4 of a ResNet on 32x32 images into chunks of 3 samples, each
its own unfold). oneDNN's weight-gradient kernel is slower than unfold +
GEMM at these shapes on the CPU; from 4x4 outputs on, the kernel is the
faster.
"""
import math
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.graph import GradientEdge

from ..cost import chunked, ghost_is_cheaper, pair_norms_sq, sq_norms, transient_per_sample
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
from .conv_geometry import explicit_padding, ints, pixel_tap
from .linear import shared_bias, writable

_CONV_ARGS = (("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
              (None, 1, 0, 1, 1))
_CONV = {1: F.conv1d, 2: F.conv2d}
_GEMM_ROWS = 4  # Note [Convolutions with few output positions]


@register
@dataclass(eq=False)
class ConvUse(Use):
    """``F.conv1d/conv2d(x, W, b, ...)`` with ``W`` a parameter, at clipped_grad's level."""

    functions = tuple(_CONV.values())
    kind = "conv"

    weight: Param
    bias: Optional[Param]
    input: Tensor  # [B*N, C, *spatial]
    samples: int  # B
    stride: Tuple[int, ...]
    padding: Tuple[int, ...]
    dilation: Tuple[int, ...]
    groups: int
    edge: GradientEdge
    grad: Tensor = field(init=False)  # [B*N, O, *out_spatial]
    kept: Optional[Tensor] = None  # [B, numel]: per-sample weight gradients, when they fit
    # [B, rows, C*k]: few output positions' patches, from the norm to the sum
    few_patches: Optional[Tensor] = None

    def roles(self) -> Dict[Param, str]:
        return {self.weight: "weight", **({self.bias: "bias"} if self.bias is not None else {})}

    def set_grad(self, grad: Tensor) -> None:
        if grad.dim() == 2:  # Note [A convolution over one pixel]
            grad = grad.view(*grad.shape, *[1] * len(self.stride))
        self.grad = grad
        self.input = self.input.to(grad.dtype)  # Note [clipped_grad under autocast]

    @property
    def images(self) -> int:  # N
        return self.input.shape[0] // self.samples if self.samples else 1

    @property
    def rows(self) -> int:  # N*P: a sample's output positions
        return self.images * math.prod(self.grad.shape[2:])

    @property
    def few_positions(self) -> bool:
        """Note [Convolutions with few output positions]."""
        return self.groups == 1 and self.rows <= _GEMM_ROWS

    def patches(self, s: slice) -> Tensor:
        """Sample slice ``s``'s unfolded input, ``[b, G, N*P, C/G*k]``."""
        n, dims = self.images, len(self.stride)
        x = self.input[s.start * n:s.stop * n]
        kernel, stride = tuple(self.weight.value.shape[2:]), self.stride
        padding, dilation = self.padding, self.dilation
        if dims == 1:  # as a conv2d of height 1
            x, kernel, stride = x.unsqueeze(2), (1, *kernel), (1, *stride)
            padding, dilation = (0, *padding), (1, *dilation)
        cols = F.unfold(x, kernel, dilation, padding, stride)  # bN, C*k, P
        return self._per_sample_rows(cols, s)

    def grads(self, s: slice) -> Tensor:
        """Sample slice ``s``'s output gradients, ``[b, G, N*P, O/G]``."""
        n = self.images
        g = self.grad[s.start * n:s.stop * n]
        return self._per_sample_rows(g.flatten(2), s)

    def _per_sample_rows(self, t: Tensor, s: slice) -> Tensor:
        # bN, G*F, P -> b, N, G, F, P -> b, G, N*P, F
        b, n, groups = s.stop - s.start, self.images, self.groups
        t = t.view(b, n, groups, t.shape[1] // groups, t.shape[2]).permute(0, 2, 1, 4, 3)
        return t.reshape(b, groups, n * t.shape[3], t.shape[4]) if n > 1 else t.squeeze(2)

    def release(self) -> None:
        del self.grad, self.input
        self.kept = self.few_patches = None

    def per_sample_grad(self, role: str) -> Tensor:
        every = slice(0, self.samples)
        if role == "bias":
            return self.grads(every).sum(2).flatten(1)  # b, G, T, O/G -> b, O
        # b,G,O/G,T x b,G,T,C/G*k -> b,G,O/G,C/G*k
        grad = torch.matmul(self.grads(every).transpose(-1, -2), self.patches(every))
        return grad.reshape(self.samples, *self.weight.value.shape)

    def grouped_grads(self, s: slice) -> Tensor:
        """Sample slice ``s``'s weight gradients, ``[b, numel]``: one
        convolution weight-gradient call with the b samples as b*G groups
        (Note [Convolution norms])."""
        b, n, dims = s.stop - s.start, self.images, len(self.stride)
        x = self.input[s.start * n:s.stop * n]
        g = self.grad[s.start * n:s.stop * n]
        # b*n, C, *spatial -> n, b*C, *spatial (a view when n == 1)
        x = x.view(b, n, *x.shape[1:]).transpose(0, 1).reshape(n, b * x.shape[1], *x.shape[2:])
        g = g.view(b, n, *g.shape[1:]).transpose(0, 1).reshape(n, b * g.shape[1], *g.shape[2:])
        w = self.weight.value
        # Only the weight's shape matters to its own gradient: zeros, no memory.
        weight = w.new_zeros(()).expand(b * w.shape[0], *w.shape[1:])
        _, per_sample, _ = torch.ops.aten.convolution_backward(
            g, x, weight, None, self.stride, self.padding, self.dilation, False, [0] * dims,
            b * self.groups, [False, True, False])
        return per_sample.reshape(b, -1)  # channels-last (a copy here) for a channels-last input

    @classmethod
    def intercept(cls, tape: Tape, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        bound = bind(*_CONV_ARGS, args, kwargs)
        if bound is None:
            return NOT_HANDLED
        x, w, b, stride, padding, dilation, groups = bound
        weight, bias = tape.param(w), tape.param(b)
        a = physical(tape, x)
        if weight is None or a is None or w.dim() - 2 not in _CONV or type(groups) is not int:
            return NOT_HANDLED
        dims = w.dim() - 2
        stride, dilation = ints(stride, dims), ints(dilation, dims)
        if stride is None or dilation is None:
            return NOT_HANDLED
        padding = explicit_padding(padding, tuple(w.shape[2:]), stride, dilation)
        per_sample_dims = a.dim() - 1
        if per_sample_dims in (dims + 1, dims + 2) and a.shape[-dims - 1] != w.shape[1] * groups:
            raise RuntimeError(
                f"clipped_grad: conv{dims}d with weight {weight.name} of shape {tuple(w.shape)} "
                f"and groups={groups} expects {w.shape[1] * groups} input channels; the input's "
                f"per-sample shape {tuple(x.shape)} has {a.shape[-dims - 1]}")
        if (padding is None or per_sample_dims not in (dims + 1, dims + 2) or groups < 1
                or a.shape[-dims - 1] != w.shape[1] * groups or w.shape[0] % groups
                or not autocast_matches(a, w) or a.device != w.device):
            return NOT_HANDLED
        if bias is not None:
            if b.shape != (w.shape[0],) or b.dtype != w.dtype:
                return NOT_HANDLED
        elif not shared_bias(tape, b):
            return NOT_HANDLED
        batch = a.shape[0]
        folded = a.reshape(math.prod(a.shape[:-dims - 1]), *a.shape[-dims - 1:])  # B*N, C, *spatial
        w_op = weight_for(tape, w, folded.requires_grad
                          or (b is not None and bias is None and b.requires_grad))
        b_op = b.detach() if bias is not None else b
        pixel = pixel_tap(tuple(folded.shape[2:]), tuple(w.shape[2:]), stride, padding, dilation)
        if pixel is not None and groups == 1:  # Note [A convolution over one pixel]
            # the tap's [O, C] slice made contiguous once, for the forward's GEMM and the backward's
            index: Tuple[Union[EllipsisType, int], ...] = (..., *pixel)
            w_tap = w_op[index].contiguous()
            flat = F.linear(folded.flatten(1), w_tap, b_op)  # B*N,C x O,C -> B*N,O
            edge, out = tap(flat), flat.view(*flat.shape, *[1] * dims)
        else:
            out = _CONV[dims](folded, w_op, b_op, stride, padding, dilation, groups)
            edge = tap(out)
        use = cls(weight, bias, folded, batch, stride, padding, dilation, groups, edge)
        tape.record(use, (folded,), "convolution")
        lead = a.shape[1:-dims - 1]  # (N,) or ()
        if lead:  # per-sample [N, O, *spatial]: vmap cannot query a channels-last layout there
            out = out.contiguous()
        return batched(tape, out.view(batch, *lead, *out.shape[1:]))


@register_clipping(ConvUse.kind)
class ConvClipping(Clipping[ConvUse]):
    """A convolution's weight and bias, one use at a time."""

    def factored(self, uses: List[ConvUse]) -> bool:
        return len(uses) == 1  # several would need their patches concatenated

    def norms_sq(self, uses: List[ConvUse], bias: Optional[Param]) -> Tensor:
        """Per-sample ``||weight gradient||^2`` (without the bias'), the cheaper
        way, in chunks (Note [Convolution norms], Note [Bounded transients]);
        few output positions: ghost, whole-batch, the patches kept for the sum
        (Note [Convolutions with few output positions])."""
        (use,) = uses
        w = use.weight.value
        rows, every = use.rows, slice(0, use.samples)
        in_f, out_f = w[0].numel(), w.shape[0] // use.groups
        budget = use.input.numel() + use.grad.numel()
        if ghost_is_cheaper(rows, in_f, out_f):
            if use.few_positions:
                use.few_patches = use.patches(every)[:, 0]
                return pair_norms_sq(use.few_patches, use.grads(every)[:, 0])
            per_sample = use.groups * (rows * in_f + transient_per_sample(rows, in_f, out_f))
            return chunked(use.samples, per_sample, budget,
                           lambda s: pair_norms_sq(use.patches(s), use.grads(s)))
        if use.samples * w.numel() <= budget:
            use.kept = use.grouped_grads(every)
            return sq_norms(use.kept, 1)
        return chunked(use.samples, w.numel(), budget,
                       lambda s: sq_norms(use.grouped_grads(s), 1))

    def clipped_sum(self, uses: List[ConvUse], coef: Tensor, bias: Optional[Param],
                    owned: Callable[[Tensor], bool]) -> Tuple[Tensor, Optional[Tensor]]:
        """``sum_i c_i`` (weight gradient of sample i), and its bias': from the
        kept per-sample gradients; for few output positions, the GEMM over the
        patches (Note [Convolutions with few output positions]); else one
        weight-gradient kernel with c folded into the smaller of input and
        output gradient (the kernel is bilinear in them; scaling the larger
        would copy it: small_cnn's first conv has 12x more output gradient than
        input); g in place when ``writable`` (linear.py)."""
        (use,) = uses
        w = use.weight.value.detach()
        c = coef.to(use.grad.dtype)
        x, g = use.input, use.grad
        every = slice(0, use.samples)
        gemm = use.kept is None and use.few_positions
        fuse_bias = (bias is not None and use.kept is None and not gemm
                     and g.numel() <= x.numel())
        grad_b = None
        if bias is not None and not fuse_bias:  # sum_i c_i (its bias gradient): one GEMV
            grad_b = torch.mv(use.per_sample_grad("bias").t(), c)
        if use.kept is not None:
            return torch.mv(use.kept.t(), c).view_as(w), grad_b
        if gemm:  # B,rows,O x B,rows,C*k -> O,C*k
            patches = use.few_patches if use.few_patches is not None else use.patches(every)[:, 0]
            grad_w = clipped_gemm(use.grads(every)[:, 0], patches, c, (writable(g, owned), True))
            return grad_w.view_as(w), grad_b
        # [B*N, ...] -> [B, N, ...] splits a dim, a view whatever the strides
        # (a ViT's patch embedding hands back a transposed output gradient).
        scale = c.view(-1, *[1] * g.dim())
        if fuse_bias or g.numel() <= x.numel():
            g_s = g.unflatten(0, (use.samples, -1))
            g = (g_s.mul_(scale) if writable(g, owned) else g_s * scale).flatten(0, 1)
        else:
            x = (x.unflatten(0, (use.samples, -1)) * scale).flatten(0, 1)
        _, grad_w, fused_b = torch.ops.aten.convolution_backward(
            g, x, w, [w.shape[0]] if fuse_bias else None, use.stride, use.padding,
            use.dilation, False, [0] * len(use.stride), use.groups, [False, True, fuse_bias])
        return grad_w, fused_b if fuse_bias else grad_b

    def factors(self, uses: List[ConvUse]) -> Optional[Factors]:
        """In the layout ``[O, C*k]``: u = output gradient rows, v = unfolded
        patches (computed per chunk); one group only (groups would make u block-sparse)."""
        (use,) = uses
        if use.groups != 1:
            return None
        rows, w = use.rows, use.weight.value
        return Factors(use.samples, rows, w.shape[0], w[0].numel(), False,
                       lambda s: (use.grads(s)[:, 0], use.patches(s)[:, 0]), rows * w[0].numel())
