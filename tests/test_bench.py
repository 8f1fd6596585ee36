"""Smoke tests of the benchmark instrument (``python -m batchrules.bench``).

Timings are never asserted: only that the CLI runs, its JSON holds every
number, every variant matches the reference, and the instruments count right.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchrules.bench.case import Variant
from batchrules.bench.check import compare
from batchrules.bench.kernels import count_kernels, eager_linear_kernels
from batchrules.bench.memory import peak_extra_bytes
from batchrules.bench.timing import Stats, paired_ratios

ROOT = Path(__file__).resolve().parents[1]
SMOKE_CASES = ("ensemble_fwd_shared/small", "psg_mlp/b8", "eager_linear/small")
CPU = torch.device("cpu")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "batchrules.bench", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def smoke_record(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "smoke.json"
    only = [arg for name in SMOKE_CASES for arg in ("--only", name)]
    proc = run_cli("--smoke", *only, "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Targets" in proc.stdout and "vmap floor" in proc.stdout
    return json.loads(out.read_text())


def test_smoke_json_structure(smoke_record: dict) -> None:
    assert smoke_record["all_correct"] is True
    assert {"torch", "torch_threads", "device", "cpu", "eager_linear_kernels"} <= smoke_record["machine"].keys()
    assert smoke_record["config"]["mode"] == "smoke"
    assert smoke_record["vmap_floor"]["median_s"] > 0
    names = [f"{c['scenario']}/{c['size']}" for c in smoke_record["cases"]]
    assert names == list(SMOKE_CASES)
    assert smoke_record["targets"], "targets must be evaluated"


@pytest.mark.parametrize("case_index", range(len(SMOKE_CASES)))
def test_smoke_every_variant_checked_and_timed(smoke_record: dict, case_index: int) -> None:
    case = smoke_record["cases"][case_index]
    expected = {"stock", "batchrules"} | ({"stock_routed"} if case["scenario"] == "eager_linear" else {"limit"})
    assert expected <= case["variants"].keys()
    for name, v in case["variants"].items():
        assert v["error"] is None, (name, v["error"])
        assert v["correct"], (name, v["check_message"])
        assert v["max_abs_err"] < 1e-3
        assert all(t > 0 and math.isfinite(t) for t in v["times_s"])
        assert v["q1_s"] <= v["median_s"] <= v["q3_s"]
        assert v["kernels_per_step"] > 0
        assert v["peak_extra_bytes"] is not None and v["peak_extra_bytes"] > 0
    assert case["variants"]["stock"]["speedup_vs_stock"] == pytest.approx(1.0)


def test_smoke_kernels_per_linear_forward(smoke_record: dict) -> None:
    ensemble = smoke_record["cases"][0]["variants"]
    assert ensemble["batchrules"]["linear_calls"] == 3
    assert ensemble["limit"]["kernels_per_linear_forward"] is None  # calls no linear
    floor = smoke_record["machine"]["eager_linear_kernels"]
    assert ensemble["stock"]["kernels_per_linear_forward"] >= floor


def test_cli_list_and_unmatched_filter() -> None:
    listed = run_cli("--smoke", "--list")
    assert listed.returncode == 0 and "psg_cnn/b8" in listed.stdout
    assert run_cli("--only", "no_such_case").returncode == 2


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
