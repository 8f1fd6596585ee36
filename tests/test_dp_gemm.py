"""The clipped sums' GEMM (batchrules/dp/gemm.py, Note [oneDNN for the clipped sums]):
which kernel runs, and that every way gives sum_i c_i x_i^T y_i."""
import pytest
import torch
import torch.nn.functional as F
from dp_reference import clipped_sum, loop_clipped_grad
from torch.profiler import profile

import batchrules
from batchrules import _C
from batchrules.dp import gemm

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="torch built without oneDNN")


def operands(batch, rows, m, n, dtype=torch.float32):
    g = torch.Generator().manual_seed(batch * 1000 + m + n)
    return (torch.randn(batch, rows, m, generator=g, dtype=dtype),
            torch.randn(batch, rows, n, generator=g, dtype=dtype),
            torch.rand(batch, generator=g, dtype=dtype))


@pytest.fixture
def onednn_calls(monkeypatch):
    """Counts the sums clipped_gemm hands to oneDNN (batchrules::scaled_gram),
    oneDNN preferred (as where MKL is not the faster: test_mkl_where_it_is_the_faster)."""
    monkeypatch.setattr(gemm, "_ONEDNN_PREFERRED", torch.backends.mkldnn.is_available())
    calls = []
    real = gemm._SCALED_GRAM

    def counted(x, y, c):
        calls.append((x.shape, y.shape))
        return real(x, y, c)

    monkeypatch.setattr(gemm, "_SCALED_GRAM", counted)
    return calls


@needs_onednn
@pytest.mark.parametrize("m, n", [(512, 784), (784, 512), (64, 64)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_onednn_sum_equals_the_float64_sum(m, n, layout, onednn_calls) -> None:
    x, y, c = operands(8, 32, m, n)
    if layout == "transposed":  # the wider operand as a view with strided rows
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
        y = y.transpose(0, 1).contiguous().transpose(0, 1)
    before = (x.clone(), y.clone())
    got = gemm.clipped_gemm(x, y, c, (False, False))
    assert got.shape == (m, n) and got.is_contiguous()
    torch.testing.assert_close(got.double(), clipped_sum(x, y, c), rtol=1e-5, atol=1e-4)
    assert torch.equal(x, before[0]) and torch.equal(y, before[1])  # nothing scaled in place
    assert len(onednn_calls) == 1


@pytest.mark.filterwarnings("ignore:TF32 acceleration")  # torch.backends.mkldnn.flags' own
@pytest.mark.parametrize("case", ["float64", "small", "disabled", "expanded", "spaced_rows",
                                  "in_place_larger", "wide_and_long"])
def test_other_cases_take_mm(case, onednn_calls) -> None:
    """Exactly the cases Note [oneDNN for the clipped sums] gives to torch.mm."""
    x, y, c = operands(4, 8, 16, 24) if case == "small" else operands(
        8, 32, 512, 784, torch.float64 if case == "float64" else torch.float32)
    if case == "expanded":  # the wider operand as the gradient of a sum: stride 0
        y = torch.ones(1, 1, 784).expand(8, 32, 784)
    if case == "spaced_rows":  # a [CLS] token's rows: one of 32 positions (oneDNN: a reference kernel)
        x, y = x[:, :1], y[:, :1]
    writable = (case == "in_place_larger", False)
    if case == "in_place_larger":  # a scaled copy larger than the result
        x, y, c = operands(64, 64, 32, 48)
    if case == "wide_and_long":  # GPT-2's c_attn: where MKL was the faster
        x, y, c = operands(9, 32, 256, gemm._ONEDNN_MAX_WIDTH + 8)
    want = clipped_sum(x, y, c)
    with torch.backends.mkldnn.flags(enabled=case != "disabled"):
        got = gemm.clipped_gemm(x, y, c, writable)
    torch.testing.assert_close(got.double(), want, rtol=1e-5 if got.dtype == torch.float32 else 1e-12,
                               atol=1e-4 if got.dtype == torch.float32 else 1e-12)
    assert onednn_calls == []


@needs_onednn
def test_any_width_on_few_rows(onednn_calls) -> None:
    """A wider operand over _ONEDNN_MAX_WIDTH still takes oneDNN on at most
    _ONEDNN_ANY_WIDTH_ROWS rows (an MLP's batch)."""
    x, y, c = operands(gemm._ONEDNN_ANY_WIDTH_ROWS, 1, 512, 784)
    got = gemm.clipped_gemm(x, y, c, (False, False))
    torch.testing.assert_close(got.double(), clipped_sum(x, y, c), rtol=1e-5, atol=1e-4)
    assert len(onednn_calls) == 1


def cpu_fields():
    """The first processor's vendor, family and flags from /proc/cpuinfo."""
    fields = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
            if key.strip() == "flags":
                break
    return fields


def test_mkl_where_it_is_the_faster() -> None:
    """Note [MKL or oneDNN by CPU vendor]: MKL's sgemm on an Intel CPU or a Zen 3
    (AMD family 25 without AVX-512) with aten's MKL, oneDNN's matmul elsewhere
    (torch.mm always where oneDNN is absent); the small LSTM ensembles' choice
    on Intel only."""
    cpu = cpu_fields()
    intel = cpu.get("vendor_id") == "GenuineIntel"
    zen3 = (cpu.get("vendor_id") == "AuthenticAMD" and cpu.get("cpu family") == "25"
            and "avx512f" not in cpu.get("flags", "").split())
    mkl = torch.backends.mkl.is_available() and (intel or zen3)
    assert _C._mkl_gemm_beats_onednn() == mkl
    assert _C._intel_cpu() == intel
    assert gemm._ONEDNN_PREFERRED == (torch.backends.mkldnn.is_available() and not mkl)


def test_empty_rows() -> None:
    x, y, c = operands(0, 3, 512, 784)
    assert torch.equal(gemm.clipped_gemm(x, y, c, (False, False)), torch.zeros(512, 784))


def wide_mlp():
    """A float32 MLP's parameters, batch and per-sample loss, w1's sum wide enough for oneDNN
    (64 x 256 x 196 multiply-adds)."""
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(256, 196, generator=g) / 14, "b1": torch.zeros(256),
              "w2": torch.randn(10, 256, generator=g) / 16, "b2": torch.zeros(10)}
    x, y = torch.randn(64, 196, generator=g), torch.randint(0, 10, (64,), generator=g)

    def loss(p, xi, yi):
        h = F.silu(F.linear(xi, p["w1"], p["b1"]))
        return F.cross_entropy(F.linear(h, p["w2"], p["b2"]), yi)

    return params, x, y, loss


@needs_onednn
def test_clipped_grad_float32_mlp_on_onednn(onednn_calls) -> None:
    """A float32 MLP wide enough for oneDNN: sums and norms against the float64 loop."""
    params, x, y, loss = wide_mlp()
    sums, norms = batchrules.clipped_grad(loss, 0.5)(params, x, y)
    want_sums, want_norms = loop_clipped_grad(
        loss, 0.5, ({k: v.double() for k, v in params.items()}, x.double(), y))
    assert onednn_calls  # w1's sum: 64 x 256 x 196 multiply-adds
    torch.testing.assert_close(norms.double(), want_norms, rtol=1e-5, atol=1e-6)
    for k in params:
        torch.testing.assert_close(sums[k].double(), want_sums[k], rtol=1e-4, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_step_sums_on_the_op(backend, monkeypatch) -> None:
    """Compiled, clipped_grad forms a wide float32 layer's sum with the same op as eager (it was
    Inductor's mm), equal to eager."""
    monkeypatch.setattr(gemm, "_ONEDNN_PREFERRED", True)
    params, x, y, loss = wide_mlp()
    step = batchrules.clipped_grad(loss, 0.5)
    want_sums, want_norms = step(params, x, y)
    torch._dynamo.reset()
    compiled = torch.compile(lambda p, a, b: step(p, a, b), fullgraph=True, backend=backend)
    compiled(params, x, y)
    with profile() as prof:
        sums, norms = compiled(params, x, y)
    names = {e.name for e in prof.events()}
    assert "batchrules::scaled_gram" in names and "mkldnn::_linear_pointwise" in names
    torch.testing.assert_close(norms, want_norms, rtol=1e-5, atol=1e-6)
    for k in params:
        torch.testing.assert_close(sums[k], want_sums[k], rtol=1e-5, atol=1e-6)
