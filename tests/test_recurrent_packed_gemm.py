"""rnn_recurrence's forward steps on W_hh^T packed once (Note [One packed W_hh
for all steps], csrc/common/packed_gemm.cpp): float32 runs them where torch
exports MKL's packed sgemm, float64 the aten GEMMs, so each float32 result is
checked against the float64 one, for every mode, member count and layout
of W_hh and h0 the packing reads."""
import platform

import pytest
import torch
from recurrent_reference import transposed_rows

from batchrules import _C

recurrence = torch.ops.batchrules.rnn_recurrence.default
GATES = {0: 4, 1: 3, 2: 1, 3: 1}  # LSTM, GRU, RNN tanh, RNN relu


def operands(mode, E, N, H, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    G = GATES[mode] * H
    return [r(steps, E, N, G), r(E, N, H), r(E, N, H) if mode == 0 else None,
            r(E, G, H) / H ** 0.5, r(E, G)]


def in_float32(ops):
    return [None if t is None else t.float() for t in ops]


def laid_out(t, layout):
    """t's values with W_hh's layouts: as given, columns contiguous (so that
    W_hh^T's rows are: packed untransposed), or every other column of a wider
    tensor (no unit stride: left to aten)."""
    if layout == "columns":
        return transposed_rows(t)
    if layout == "spaced":
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    return t


def test_packed_gemm_is_found_where_torch_has_mkl() -> None:
    """Catches the packing silently falling back: torch's x86 builds link MKL."""
    if not (torch.backends.mkl.is_available() and platform.machine() in ("x86_64", "AMD64")):
        pytest.skip("no MKL in this torch")
    assert _C._mkl_packed_gemm()


def rows_to_pack(mode, hidden):
    """The fewest rows whose step products are packed (kMinPackedMacs, 2^20 multiply-adds)."""
    return -(-(1 << 20) // (GATES[mode] * hidden * hidden))


STEP_GEMMS = {"aten::mm", "aten::bmm", "aten::baddbmm", "aten::addmm"}


def gemms_run(fn):
    with torch.profiler.profile() as prof:
        out = fn()
    return out, STEP_GEMMS & {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("E, size, steps", [(1, "packed", 4), (2, "packed", 3), (2, "small", 4),
                                            (2, "one step", 1)])
@pytest.mark.parametrize("layout", ["given", "columns", "spaced"])
@pytest.mark.parametrize("reverse", [False, True])
def test_float32_steps_equal_float64(mode, E, size, steps, layout, reverse) -> None:
    """Values against float64 and, from the profiler, which steps ran aten's
    GEMMs: none where W_hh^T was packed (a product of 2^20 multiply-adds or
    more, over several steps, W_hh with a unit stride), every step otherwise."""
    H = 128 if size != "small" else 8
    N = rows_to_pack(mode, H) if size != "small" else 5
    ops = operands(mode, E, N, H, steps)
    want = recurrence(*ops, None, mode, reverse)
    single = in_float32(ops)
    single[3] = laid_out(single[3], layout)
    single[1] = transposed_rows(single[1])  # h0's rows strided
    got, gemms = gemms_run(lambda: recurrence(*single, None, mode, reverse))
    packed = _C._mkl_packed_gemm() and size == "packed" and layout != "spaced"
    assert (not gemms) == packed, gemms
    for name, g, w in zip(("output", "h_n", "c_n", "workspace"), got, want):
        if w is None:
            assert g is None, name
            continue
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5, msg=name)


def test_one_row_below_the_threshold_keeps_aten() -> None:
    """One row fewer than rows_to_pack: aten's GEMMs."""
    ops = in_float32(operands(0, 1, rows_to_pack(0, 128) - 1, 128, 3))
    _, gemms = gemms_run(lambda: recurrence(*ops, None, 0, False))
    assert gemms


def test_gradients_through_packed_steps_equal_float64() -> None:
    """The backward reads the outputs the packed steps wrote; W_hh's gradient
    comes through its own (unpacked) products."""
    ops = operands(0, 2, rows_to_pack(0, 128), 128, 5, seed=3)
    grads = {}
    for dtype in (torch.float32, torch.float64):
        leaves = [t.to(dtype).requires_grad_() for t in ops]
        out, h_n, c_n, _ = recurrence(*leaves, None, 0, False)
        loss = out.sin().sum() + h_n.square().sum() + c_n.sum()
        grads[dtype] = torch.autograd.grad(loss, leaves)
    for g, w in zip(grads[torch.float32], grads[torch.float64]):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", [0, 1])
def test_strided_input_gates_take_the_aten_cell_with_packed_steps(mode) -> None:
    """Input gates whose rows are not contiguous keep the aten ops of the
    cell (the fused cells read rows in place), still on packed steps."""
    H = 128
    ops = operands(mode, 1, rows_to_pack(mode, H), H, 3)
    want = recurrence(*ops, None, mode, False)
    single = in_float32(ops)
    single[0] = transposed_rows(single[0])
    got, gemms = gemms_run(lambda: recurrence(*single, None, mode, False))
    assert not gemms or not _C._mkl_packed_gemm(), gemms
    for g, w in zip(got, want):
        if w is not None:
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)
