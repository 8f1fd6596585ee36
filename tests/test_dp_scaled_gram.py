"""``batchrules::scaled_gram``, a clipped sum as one op (Note [The clipped sum as one op] in
csrc/dp/scaled_gram/kernel.cpp): ``sum_i c_i x_i^T y_i`` on oneDNN's matmul where its rows are
packed, aten's mm otherwise (the compiled DP step that runs it: test_dp_gemm.py)."""
import pytest
import torch
from dp_reference import clipped_sum
from torch.profiler import profile

import batchrules  # noqa: F401  (loads the operators)

scaled_gram = torch.ops.batchrules.scaled_gram.default
# torch.backends.mkldnn.flags' own warning, on every call
pytestmark = pytest.mark.filterwarnings("ignore:TF32 acceleration")


def operands(batch, rows, m, n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, rows, m, generator=g, dtype=dtype),
            torch.randn(batch, rows, n, generator=g, dtype=dtype),
            torch.rand(batch, generator=g, dtype=dtype))


def ran_onednn(fn):
    with profile() as prof:
        out = fn()
    return out, any(e.name == "mkldnn::_linear_pointwise" for e in prof.events())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch, rows, m, n", [(8, 4, 64, 96), (8, 4, 96, 64), (3, 1, 17, 9),
                                               (1, 5, 1, 1), (0, 3, 4, 5), (2, 0, 4, 5),
                                               (2, 3, 0, 5), (2, 3, 4, 0)])
@pytest.mark.parametrize("onednn", [True, False])
def test_equals_the_float64_sum(batch, rows, m, n, dtype, onednn) -> None:
    x, y, c = operands(batch, rows, m, n, dtype)
    with torch.backends.mkldnn.flags(enabled=onednn):
        got = scaled_gram(x, y, c)
    assert got.shape == (m, n) and got.dtype == dtype and got.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got.double(), clipped_sum(x, y, c), rtol=tol, atol=tol)


@pytest.mark.parametrize("layout, onednn", [("packed", True), ("transposed memory", True),
                                            ("spaced rows", False), ("expanded", False)])
@pytest.mark.parametrize("narrow_first", [True, False])
def test_onednn_runs_only_on_packed_rows(layout, onednn, narrow_first) -> None:
    """oneDNN runs a reference kernel on spaced or overlapping rows: those take mm."""
    x, y, c = operands(6, 8, 32, 48)
    if layout == "transposed memory":  # the rows are still packed once the narrow side is copied
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    elif layout == "spaced rows":  # a [CLS] token's rows
        x, y = x[:, ::4], y[:, ::4]
    elif layout == "expanded":  # the wider operand as the gradient of a sum: stride 0
        y = torch.ones(1, 1, 48).expand(6, 8, 48)
    if not narrow_first:
        x, y = y, x
    got, ran = ran_onednn(lambda: scaled_gram(x, y, c))
    torch.testing.assert_close(got.double(), clipped_sum(x, y, c), rtol=1e-5, atol=1e-5)
    if torch.backends.mkldnn.is_available():
        assert ran == onednn


def test_float64_and_disabled_onednn_take_mm() -> None:
    x, y, c = operands(4, 4, 16, 24, torch.float64)
    assert not ran_onednn(lambda: scaled_gram(x, y, c))[1]
    x, y, c = operands(4, 4, 16, 24)
    with torch.backends.mkldnn.flags(enabled=False):
        assert not ran_onednn(lambda: scaled_gram(x, y, c))[1]


def test_opcheck() -> None:
    x, y, c = operands(3, 5, 9, 11)
    torch.library.opcheck(scaled_gram, (x, y, c), test_utils=(
        "test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("shapes, match", [
    (((2, 3), (2, 3, 4), (2,)), r"x \[B, T, M\], y \[B, T, N\] and scale \[B\], but got shapes "
                                r"\[2, 3\], \[2, 3, 4\] and \[2\]"),
    (((2, 3, 4), (2, 5, 4), (2,)), r"x \[2, 3, 4\], y \[2, 5, 4\] and scale \[2\] must agree"),
    (((2, 3, 4), (2, 3, 4), (3,)), r"must agree in samples B"),
])
def test_bad_shapes_name_them(device, shapes, match) -> None:
    with pytest.raises(RuntimeError, match=match):
        scaled_gram(*(torch.zeros(s, device=device) for s in shapes))


def test_bad_dtypes_name_them() -> None:
    with pytest.raises(RuntimeError, match="of one dtype, but got Float, Double and Float"):
        scaled_gram(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.float64), torch.zeros(2))
    with pytest.raises(RuntimeError, match="floating-point tensors, but got Long"):
        scaled_gram(*(torch.zeros(s, dtype=torch.long) for s in ((2, 3, 4), (2, 3, 4), (2,))))
