"""Smoke tests of the benchmark instrument (``python -m batchrules.bench``).

Timings are never asserted: only that the CLI runs, its JSON holds every
number, every variant (compiled twins included) matches the reference, the
instruments count right and the target logic judges synthetic timings right.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchrules.bench.__main__ import compiled_tiers
from batchrules.bench.case import TIERS, Case, Variant
from batchrules.bench.check import compare
from batchrules.bench.compiled import (check_no_recompile, compile_failure, compile_now,
                                       compiled_twin, fresh_function)
from batchrules.bench.kernels import count_kernels, eager_linear_kernels
from batchrules.bench.memory import peak_extra_bytes
from batchrules.bench.report import all_correct, limit_ratios_text, table
from batchrules.bench.runner import CaseResult, VariantResult
from batchrules.bench.targets import COMPILED_TARGET, compiled_limit_ratios, evaluate
from batchrules.bench.timing import Stats, paired_ratios

ROOT = Path(__file__).resolve().parents[1]
SMOKE_CASES = ("ensemble_fwd_shared/small", "psg_mlp/b8", "eager_linear/small")
CPU = torch.device("cpu")
TWINS = ("stock_compiled", "batchrules_compiled")


def run_cli(*args: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **env_vars)
    return subprocess.run([sys.executable, "-m", "batchrules.bench", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def smoke_record(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "smoke.json"
    only = [arg for name in SMOKE_CASES for arg in ("--only", name)]
    proc = run_cli("--smoke", "--compiled", "--threads", "1", *only, "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Targets" in proc.stdout and "vmap floor" in proc.stdout
    assert "compiled twins" in proc.stdout and "compile" in proc.stdout
    return json.loads(out.read_text())


def test_smoke_json_structure(smoke_record: dict) -> None:
    assert smoke_record["all_correct"] is True
    assert {"torch", "torch_threads", "device", "cpu", "eager_linear_kernels"} <= smoke_record["machine"].keys()
    assert smoke_record["config"]["mode"] == "smoke"
    assert smoke_record["vmap_floor"]["median_s"] > 0
    names = [f"{c['scenario']}/{c['size']}" for c in smoke_record["cases"]]
    assert names == list(SMOKE_CASES)
    assert smoke_record["targets"], "targets must be evaluated"
    compiled = smoke_record["config"]["compiled"]
    assert compiled["tiers"] == list(TIERS) and compiled["fullgraph"] is True
    assert compiled["warm_up_s"] > 0


@pytest.mark.parametrize("case_index", range(len(SMOKE_CASES)))
def test_smoke_every_variant_checked_and_timed(smoke_record: dict, case_index: int) -> None:
    case = smoke_record["cases"][case_index]
    expected = {"stock", "batchrules", *TWINS}
    expected |= {"stock_routed"} if case["scenario"] == "eager_linear" else {"limit"}
    assert expected <= case["variants"].keys()
    for name, v in case["variants"].items():
        assert v["error"] is None, (name, v["error"])
        assert v["compiled"] == (name in TWINS)
        if v["not_compiled"] is not None:
            continue  # see test_smoke_compiled_twins
        assert v["correct"], (name, v["check_message"])
        assert v["max_abs_err"] < 1e-3
        assert all(t > 0 and math.isfinite(t) for t in v["times_s"])
        assert v["q1_s"] <= v["median_s"] <= v["q3_s"]
        assert v["peak_extra_bytes"] is not None and v["peak_extra_bytes"] > 0
        if name in TWINS:
            assert v["kernels_per_step"] is None  # Inductor's kernels are no ATen ops
        else:
            assert v["kernels_per_step"] > 0 and v["compile_s"] is None
    assert case["variants"]["stock"]["speedup_vs_stock"] == pytest.approx(1.0)


@pytest.mark.parametrize("case_index", range(len(SMOKE_CASES)))
def test_smoke_compiled_twins(smoke_record: dict, case_index: int) -> None:
    """Each twin compiled (compile time apart from the timings) or says in one
    line why not; batchrules compiles wherever stock torch.compile does."""
    case = smoke_record["cases"][case_index]
    stock, br = (case["variants"][name] for name in TWINS)
    if case["scenario"] != "eager_linear":  # the vmapped flows compile with fullgraph=True
        assert stock["not_compiled"] is None and br["not_compiled"] is None
    if stock["not_compiled"] is None:
        assert br["not_compiled"] is None, br["not_compiled"]
    for v in (stock, br):
        if v["not_compiled"] is None:
            assert v["compile_s"] > 0 and v["times_s"]
            assert v["speedup_vs_stock_compiled"] is not None
        else:
            assert v["not_compiled"].startswith("did not compile: ") and "\n" not in v["not_compiled"]
            assert v["compile_s"] is None and v["times_s"] is None
    targets = [t for t in smoke_record["targets"] if t["target"] == COMPILED_TARGET]
    assert any(t["case"].startswith(case["scenario"]) for t in targets) == (stock["not_compiled"] is None)


def test_smoke_compiled_limit_ratios(smoke_record: dict) -> None:
    rows = {r["case"]: r["ratios"] for r in smoke_record["compiled_limit_ratios"]}
    assert set(rows) == {"ensemble_fwd_shared/small", "psg_mlp/b8"}  # eager_linear has no limit
    for ratios in rows.values():
        assert set(ratios) == {"batchrules", *TWINS} and all(v > 0 for v in ratios.values())


def test_smoke_kernels_per_linear_forward(smoke_record: dict) -> None:
    ensemble = smoke_record["cases"][0]["variants"]
    assert ensemble["batchrules"]["linear_calls"] == 3
    assert ensemble["limit"]["kernels_per_linear_forward"] is None  # calls no linear
    floor = smoke_record["machine"]["eager_linear_kernels"]
    assert ensemble["stock"]["kernels_per_linear_forward"] >= floor


def test_cli_list_and_unmatched_filter() -> None:
    proc = run_cli("--quick", "--list")
    assert proc.returncode == 0 and "psg_cnn/b8" in proc.stdout
    assert run_cli("--only", "no_such_case").returncode == 2
    listed = proc.stdout.splitlines()
    assert [line.split()[2] for line in listed if "/small" in line] == ["compiled"] * sum(
        "/small" in line for line in listed)
    assert all(line.split()[2] == "eager" for line in listed if " large " in line or " medium " in line)


def test_cli_without_cpp_compiler_skips_twins(tmp_path: Path) -> None:
    """Where torch.compile cannot work at all (here: no C++ compiler), the bench
    says so once and runs the eager variants."""
    out = tmp_path / "no_cxx.json"
    proc = run_cli("--smoke", "--only", "eager_linear_fwd/small", "--json", str(out),
                   CXX="/nonexistent/g++")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no compiled twins were run, the compiler warm-up did not compile" in proc.stdout
    record = json.loads(out.read_text())
    assert record["config"]["compiled"]["tiers"] == []
    assert record["config"]["compiled"]["warm_up_error"].startswith("did not compile: ")
    assert set(record["cases"][0]["variants"]) == {"stock", "batchrules", "stock_routed"}


def test_compiled_tiers_per_mode_and_flag() -> None:
    assert compiled_tiers("quick", None) == ("small",)
    assert compiled_tiers("smoke", None) == ("small",)
    assert tuple(compiled_tiers("full", None)) == TIERS
    assert tuple(compiled_tiers("quick", True)) == TIERS
    assert tuple(compiled_tiers("full", False)) == ()


def test_kernel_counter_on_known_ops() -> None:
    x, w, b = torch.randn(8, 16), torch.randn(4, 16), torch.randn(4)
    # CPU addmm copies the bias into its output, then runs the GEMM.
    assert eager_linear_kernels(CPU) == 2
    assert count_kernels(Variant("clone", lambda: x.clone()), CPU).per_step == 1
    assert count_kernels(Variant("view", lambda: x.view(2, 64).t()), CPU).per_step == 0
    counts = count_kernels(Variant("linear", lambda: torch.nn.functional.linear(x, w, b)), CPU)
    assert (counts.linear_calls, counts.per_linear_forward) == (1, 2.0)
    assert count_kernels(Variant("bmm", lambda: torch.bmm(x.view(2, 4, 16), x.view(2, 16, 4))), CPU).per_step == 1


def test_peak_memory_counts_live_result() -> None:
    peak = peak_extra_bytes(Variant("alloc", lambda: torch.empty(1 << 18)), CPU)
    assert peak >= 4 << 18


def test_check_detects_wrong_results() -> None:
    ref = torch.randn(4, 5, dtype=torch.float64)
    assert compare(ref.float(), ref, rtol=1e-4).ok
    assert not compare(ref.float() + 1e-2, ref, rtol=1e-4).ok
    assert not compare(ref.float()[:3], ref, rtol=1e-4).ok
    assert not compare([ref.float()], [ref, ref], rtol=1e-4).ok


def test_paired_ratios_and_quantiles() -> None:
    a, b = Stats([2.0, 4.0, 6.0]), Stats([1.0, 2.0, 2.0])
    assert paired_ratios(a, b).times == [2.0, 2.0, 3.0]
    assert a.median == 4.0 and a.quantile(0.25) == 3.0 and a.iqr == 2.0


def test_breakdown_runs_every_layer() -> None:
    """``python -m batchrules.bench.breakdown`` times every layer of its steps."""
    import batchrules
    from batchrules.bench import breakdown
    from batchrules.bench.models import MlpSpec
    from batchrules.bench.timing import TimingPlan

    plan = TimingPlan(block_s=0.001, budget_s=0.05, min_repeats=3, max_repeats=3, warmup_calls=1)
    steps = (("fwd", 2, MlpSpec((4, 6, 3)), 5, False),
             ("train", 2, MlpSpec((4, 6, 3), "silu"), 5, True))
    with batchrules.enabled():
        lines = breakdown.run(steps, plan)
    text = "\n".join(lines)
    for layer in ("vmap identity", "+ functional_call", "vmap(grad) trivial", "direct F.linear",
                  "user code", "limit", "SiLU backward per step"):
        assert layer in text, text


# ---- compiled twins -------------------------------------------------------------

def test_fresh_function_has_its_own_code_object() -> None:
    box = [1]
    fn = lambda: box[0] + 1  # noqa: E731
    fresh = fresh_function(fn, "twin")
    assert fresh.__code__ is not fn.__code__ and fresh.__code__.co_name.endswith("twin")
    box[0] = 41
    assert fresh() == 42  # same closure cells
    with pytest.raises(TypeError, match="plain Python function"):
        fresh_function(torch.relu, "twin")


def _vmapped_linear_step() -> tuple:
    import torch.nn.functional as F
    from torch.func import vmap

    x, w, b = torch.randn(3, 5, 4), torch.randn(3, 6, 4), torch.randn(3, 6)
    batched = vmap(F.linear)

    def user_code() -> torch.Tensor:
        return batched(x, w, b)

    return user_code, torch.stack([F.linear(x[i], w[i], b[i]) for i in range(3)])


COMPUTE = {"aten.bmm.default", "aten.baddbmm.default", "aten.mul.Scalar", "aten.add.Tensor"}


def test_twins_are_separate_compilations_under_their_routing() -> None:
    """One step function, two twins: each keeps the routing it was compiled
    under (the routed graph is batchrules' batching rule, bmm + bias add as
    traced (Note [GEMM and bias apart when traced]); stock's is functorch's addmm
    decomposition, bmm, a scalar mul and the add)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    user_code, want = _vmapped_linear_step()
    ops = {}
    for routing in (False, True):
        recorder = AotEagerAndRecordGraphs()
        twin = compiled_twin(Variant("v", user_code, routing=routing, user_code=True), recorder)
        result, seconds = compile_now(twin, lambda: None)
        torch.testing.assert_close(result, want)
        assert seconds > 0
        check_no_recompile(twin)
        assert len(recorder.fw_graphs) == 1
        ops[routing] = [str(n.target) for n in recorder.fw_graphs[0].graph.nodes if n.op == "call_function"]
    assert [op for op in ops[True] if op in COMPUTE] == ["aten.bmm.default", "aten.add.Tensor"]
    assert [op for op in ops[False] if op in COMPUTE] == ["aten.bmm.default", "aten.mul.Scalar",
                                                          "aten.add.Tensor"]


def test_graph_break_is_a_one_line_compile_failure() -> None:
    x = torch.randn(3, requires_grad=True)

    def user_code() -> torch.Tensor:
        return torch.autograd.grad(x.square().sum(), x)[0]

    twin = compiled_twin(Variant("v", user_code, user_code=True), "eager")
    with pytest.raises(Exception) as info:
        compile_now(twin, lambda: None)
    reason = compile_failure(info.value)
    assert reason.startswith("did not compile: ") and "\n" not in reason


# ---- report and targets on synthetic results ---------------------------------------

def _result(times: dict, not_compiled: tuple = (), tier: str = "small") -> CaseResult:
    case = Case("ensemble_train", "tiny", tier, 2, "synthetic", build=lambda device: None)
    r = CaseResult(case)
    for name, ts in times.items():
        vr = r.variants[name] = VariantResult(name, stats=Stats(list(ts)), compiled=name in TWINS,
                                              compile_s=1.5 if name in TWINS else None)
        vr.check = compare(torch.ones(1), torch.ones(1, dtype=torch.float64), 1e-4)
    for name in not_compiled:
        r.variants[name] = VariantResult(name, compiled=True, not_compiled="did not compile: Boom: why")
    return r


def _compiled_checks(r: CaseResult) -> list:
    return [c for c in evaluate([r], linear_floor=2) if c.target == COMPILED_TARGET]


def test_compiled_target_verdicts() -> None:
    eager = {"stock": [4.0] * 5, "batchrules": [3.0] * 5, "limit": [1.0] * 5}
    faster = _result({**eager, "stock_compiled": [2.0] * 5, "batchrules_compiled": [1.8] * 5})
    (check,) = _compiled_checks(faster)
    assert check.verdict == "met" and check.value == pytest.approx(2.0 / 1.8)
    slower = _result({**eager, "stock_compiled": [2.0] * 5, "batchrules_compiled": [3.0] * 5})
    assert _compiled_checks(slower)[0].verdict == "missed"
    noisy = _result({**eager, "stock_compiled": [2.0] * 5, "batchrules_compiled": [1.9, 2.1, 2.1, 2.2, 1.8]})
    assert _compiled_checks(noisy)[0].verdict == "noise"
    broken = _result({**eager, "stock_compiled": [2.0] * 5}, not_compiled=("batchrules_compiled",))
    (check,) = _compiled_checks(broken)
    assert check.verdict == "missed" and "Boom" in check.detail
    assert not all_correct([broken])
    neither = _result(eager, not_compiled=TWINS)
    assert _compiled_checks(neither) == [] and all_correct([neither])


def test_compiled_columns_and_limit_ratios() -> None:
    eager = {"stock": [4.0] * 3, "batchrules": [3.0] * 3, "limit": [1.0] * 3}
    r = _result({**eager, "stock_compiled": [2.0] * 3, "batchrules_compiled": [1.6] * 3})
    text = table([r])
    header, _, *rows = text.splitlines()
    assert "vs s.comp" in header and "compile" in header
    twin_row = next(line for line in rows if "batchrules_compiled" in line)
    assert "1.25x" in twin_row and "1.5s" in twin_row and "1.60" in twin_row
    (ratios,) = compiled_limit_ratios([r])
    assert ratios.ratios == pytest.approx({"batchrules": 3.0, "stock_compiled": 2.0, "batchrules_compiled": 1.6})
    assert "batchrules_compiled 1.60" in limit_ratios_text([ratios])
    assert compiled_limit_ratios([_result(eager, tier="small")]) == []
    assert "did not compile: Boom: why" in table([_result(eager, not_compiled=TWINS)])
