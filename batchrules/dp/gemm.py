"""The clipped sums' GEMM: ``sum_i c_i x_i^T y_i`` over every recorded row.

Note [oneDNN for the clipped sums]
A layer's clipped sum is one GEMM over all B*T recorded rows, ``[R, M]`` and
``[R, N]`` to ``[M, N]``, with each sample's clipping coefficient folded into
the narrower operand. On the CPU aten runs a float32 GEMM as MKL's sgemm; on
an AMD EPYC with AVX-512 or a Zen 2, oneDNN's matmul (the library aten
already runs convolutions and LSTM layers with) computes most of these
shapes faster, to the same float32 accuracy, but on a Zen 2 it was the
slower where the wider operand is both wide and long (GPT-2's ``c_attn`` and
head; the measurements: docs/design.md). So float32 CPU sums of at least
``_ONEDNN_MIN_MACS`` multiply-adds (below it oneDNN's call costs more than
it saves) whose wider operand is at most ``_ONEDNN_MAX_WIDTH`` wide or
``_ONEDNN_ANY_WIDTH_ROWS`` rows long are ``batchrules::scaled_gram``, whose
kernel runs oneDNN's matmul (aten's ``mkldnn::_linear_pointwise``), eager
and compiled alike (Note [The clipped sum as one op]), when oneDNN is built
in and enabled (``torch.backends.mkldnn.flags(enabled=False)`` turns it off). Its scaled
operand is written once, transposed and contiguous, by
``batchrules::scaled_transpose`` (Note [A scaled transpose in 8 x 8 tiles]):
oneDNN copies a transposed X itself, so the only temporary is the scaled copy
the other path makes too. Where that path would scale a writable operand in
place and the copy would be larger than the result, it keeps the in-place
sgemm instead (peak memory before speed). Every other case is ``torch.mm``:
float64, CUDA, no oneDNN, and a wider operand whose rows are not packed one
after the other: overlapping (the stride-0 gradient of a sum) or spaced (a
slice, as a [CLS] token's rows), for which oneDNN runs a reference kernel,
orders of magnitude slower. Where MKL's sgemm is the faster (an Intel CPU, a
Zen 3: Note [MKL or oneDNN by CPU vendor] in csrc/common/cpu_gemm.h) every
sum is ``torch.mm`` (``_ONEDNN_PREFERRED``).
"""
from typing import Tuple

import torch
from torch import Tensor

from .. import _C

_SCALED_GRAM = torch.ops.batchrules.scaled_gram.default
_ONEDNN_MIN_MACS = 1 << 20
_ONEDNN_MAX_WIDTH, _ONEDNN_ANY_WIDTH_ROWS = 512, 256


# Note [oneDNN for the clipped sums]: not where MKL's sgemm is the faster.
_ONEDNN_PREFERRED = torch.backends.mkldnn.is_available() and not _C._mkl_gemm_beats_onednn()


def clipped_gemm(x: Tensor, y: Tensor, c: Tensor, writable: Tuple[bool, bool]) -> Tensor:
    """``sum_i c_i x_i^T y_i`` for ``x: [B, T, M]``, ``y: [B, T, N]``, ``c: [B]``:
    ``[M, N]``, c folded into the narrower of x and y (in place where
    ``writable`` says that operand may be overwritten)."""
    batch, rows, m = x.shape
    n = y.shape[-1]
    scale_x = m <= n
    narrow, wide = (x, y) if scale_x else (y, x)
    in_place = writable[0 if scale_x else 1]
    wide_rows = wide.reshape(batch * rows, wide.shape[-1])
    if _onednn_runs(narrow, wide_rows, batch * rows * m * n, in_place):
        return _SCALED_GRAM(x, y, c)  # Note [The clipped sum as one op]
    c3 = c.view(-1, 1, 1)
    scaled_rows = (narrow.mul_(c3) if in_place else narrow * c3).reshape(batch * rows,
                                                                          narrow.shape[-1])
    return (torch.mm(scaled_rows.t(), wide_rows) if scale_x
            else torch.mm(wide_rows.t(), scaled_rows))


def _onednn_runs(narrow: Tensor, wide_rows: Tensor, macs: int, in_place: bool) -> bool:
    """Whether oneDNN's matmul forms the sum (Note [oneDNN for the clipped sums]);
    ``wide_rows``: the wider operand as ``[R, K]``."""
    rows, width = wide_rows.shape
    return (_ONEDNN_PREFERRED and torch._C._get_mkldnn_enabled() and macs >= _ONEDNN_MIN_MACS
            and (rows <= _ONEDNN_ANY_WIDTH_ROWS or width <= _ONEDNN_MAX_WIDTH)
            and narrow.device.type == "cpu" and narrow.dtype == wide_rows.dtype == torch.float32
            and wide_rows.is_contiguous()
            and not (in_place and narrow.numel() > narrow.shape[-1] * width))
