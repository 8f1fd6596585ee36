"""Smoke tests of ``python -m batchrules.bench`` and its options: the default
headline, ``--smoke`` with compiled twins, the DP rows, ``--list``/``--only``,
without Opacus, without a C++ compiler, ``--distributed`` and ``--gpu-check``.
Timings are never asserted; the timing method itself: ``test_bench_timing.py``."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchrules.bench.__main__ import compiled_tiers
from batchrules.bench.__main__ import main as bench_main
from batchrules.bench.baselines.opacus_variants import opacus_missing_reason
from batchrules.bench.case import TIERS
from batchrules.bench.scenarios import all_cases
from batchrules.bench.targets import COMPILED_TARGET

ROOT = Path(__file__).resolve().parents[1]
SMOKE_CASES = ("ensemble_fwd_shared/small", "psg_mlp/b8", "eager_linear/small")
CPU = torch.device("cpu")
TWINS = ("stock_compiled", "batchrules_compiled")


def run_cli(*args: str, pythonpath: str = "", **env_vars: str) -> subprocess.CompletedProcess:
    """The bench in a subprocess; ``pythonpath`` goes first on its module path."""
    path = [p for p in (pythonpath, str(ROOT), os.environ.get("PYTHONPATH")) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), **env_vars)
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
    machine = smoke_record["machine"]
    assert {"torch", "torch_threads", "device", "cpu", "eager_linear_kernels"} <= machine.keys()
    assert smoke_record["machine"]["steady_malloc"] is False  # Note [Steady malloc for timing]: a flag
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
        if v["skipped"] is not None:  # see test_without_opacus_its_variants_are_skipped
            assert name == "opacus" and opacus_missing_reason() is not None
            continue
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


def test_smoke_kernels_per_linear_forward(smoke_record: dict) -> None:
    ensemble = smoke_record["cases"][0]["variants"]
    assert ensemble["batchrules"]["linear_calls"] == 3
    assert ensemble["limit"]["kernels_per_linear_forward"] is None  # calls no linear
    floor = smoke_record["machine"]["eager_linear_kernels"]
    assert ensemble["stock"]["kernels_per_linear_forward"] >= floor


def test_cli_list_and_unmatched_filter(capsys: pytest.CaptureFixture) -> None:
    """Twins only with --full or --compiled; the default is the headline. In
    process: --list and an unmatched --only return before touching any setting."""
    for args, compiled in ((["--quick"], False), (["--quick", "--compiled"], True), (["--full"], True)):
        assert bench_main([*args, "--list"]) == 0
        out = capsys.readouterr().out
        assert "psg_cnn/b8" in out
        assert {line.split()[2] for line in out.splitlines()} == {"compiled" if compiled else "eager"}
    assert bench_main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == [c.name for c in all_cases("headline")]
    assert bench_main(["--only", "no_such_case"]) == 2
    assert "no case matches" in capsys.readouterr().err


def test_default_mode_prints_the_headline_table(tmp_path: Path) -> None:
    """The default run (here one cheap case of it): eager only, one line per
    case, the targets, no per-variant table."""
    out = tmp_path / "headline.json"
    proc = run_cli("--only", "loss_grad/mse", "--budget", "0.05", "--threads", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header = next(line for line in proc.stdout.splitlines() if line.startswith("case"))
    assert header.split()[:4] == ["case", "stock", "batchrules", "vs"] and "k/lin" not in proc.stdout
    assert "loss_grad/mse/b8" in proc.stdout and "Targets" in proc.stdout
    assert "compiled twins" not in proc.stdout
    record = json.loads(out.read_text())
    assert record["config"]["mode"] == "headline" and record["config"]["compiled"]["tiers"] == []
    assert record["all_correct"] is True
    assert {t["target"] for t in record["targets"]} == {"not slower than stock (stock / batchrules >= 1)"}


def test_without_opacus_its_variants_are_skipped(tmp_path: Path) -> None:
    """With Opacus not importable the bench says why once, reports its rows
    and targets as skipped with the reason, and still passes."""
    fake = tmp_path / "opacus"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise ImportError("opacus hidden by the test")\n')
    out = tmp_path / "no_opacus.json"
    proc = run_cli("--smoke", "--only", "psg_mlp/b8", "--threads", "1", "--json", str(out),
                   pythonpath=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "note: opacus not importable (opacus hidden by the test)" in proc.stdout
    record = json.loads(out.read_text())
    assert record["all_correct"] is True
    opacus = record["cases"][0]["variants"]["opacus"]
    assert opacus["skipped"] == "opacus not importable (opacus hidden by the test)"
    assert opacus["times_s"] is None and opacus["error"] is None
    (target,) = [t for t in record["targets"] if "Opacus" in t["target"]]
    assert target["verdict"] == "skipped" and "opacus hidden by the test" in target["detail"]


def test_cli_without_cpp_compiler_skips_twins(tmp_path: Path) -> None:
    """Where torch.compile cannot work at all (here: no C++ compiler), the bench
    says so once and runs the eager variants."""
    out = tmp_path / "no_cxx.json"
    proc = run_cli("--smoke", "--compiled", "--only", "eager_linear_fwd/small", "--json", str(out),
                   CXX="/nonexistent/g++")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no compiled twins were run, the compiler warm-up did not compile" in proc.stdout
    record = json.loads(out.read_text())
    assert record["config"]["compiled"]["tiers"] == []
    assert record["config"]["compiled"]["warm_up_error"].startswith("did not compile: ")
    assert set(record["cases"][0]["variants"]) == {"stock", "batchrules", "stock_routed"}


def test_compiled_tiers_per_mode_and_flag() -> None:
    for mode in ("smoke", "headline", "quick"):
        assert tuple(compiled_tiers(mode, None)) == ()
        assert tuple(compiled_tiers(mode, True)) == TIERS
    assert tuple(compiled_tiers("full", None)) == TIERS
    assert tuple(compiled_tiers("full", False)) == ()


DP_SMOKE = ("dp_mlp/b8", "dp_cnn/b8", "dp_transformer/d64t16_b8")
OPACUS_DP = ("opacus_hooks", "opacus_ghost")


def test_dp_rows_match_their_references_and_evaluate_their_targets(tmp_path: Path) -> None:
    """The DP rows (compiled twins are covered above): every variant matches its
    reference (the Opacus ones where Opacus is installed, else skipped), peak
    memory is recorded, the DP targets are evaluated."""
    out = tmp_path / "dp.json"
    proc = run_cli("--smoke", "--threads", "1", "--no-compiled", "--only", "dp_mlp", "--only", "dp_cnn",
                   "--only", "dp_transformer", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    assert [f"{c['scenario']}/{c['size']}" for c in record["cases"]] == list(DP_SMOKE)
    missing = opacus_missing_reason()
    for case in record["cases"]:
        expected = {"stock", "batchrules", "clipped_grad", "nonprivate", "nonprivate_grad", *OPACUS_DP}
        assert case["variants"].keys() == expected | ({"limit"} if case["scenario"] == "dp_mlp" else set())
        for name, v in case["variants"].items():
            assert v["error"] is None and v["skipped"] == (missing if name in OPACUS_DP else None), name
            if v["skipped"] is None:
                assert v["correct"] and v["peak_extra_bytes"] > 0, (case["scenario"], name)
    by_case: dict = {}
    for t in record["targets"]:
        by_case.setdefault(t["case"], []).append(t["target"])
    assert list(by_case) == list(DP_SMOKE)
    assert all(any("peak memory" in t for t in ts) for ts in by_case.values())
    # the step-time target against the non-private step: transformer rows and MLP batch >= 128
    assert [c for c, ts in by_case.items() if any("non-private step (" in t for t in ts)] == [DP_SMOKE[2]]


def test_dp_engine_row_matches_its_reference_and_evaluates_its_targets(tmp_path: Path) -> None:
    """The DP engine's row: the user's loop with the engine, its first step,
    its step with noise, the loop without DP and with Opacus' modules, each
    against its reference."""
    out = tmp_path / "engine.json"
    proc = run_cli("--smoke", "--threads", "1", "--only", "dp_engine", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    assert [f"{c['scenario']}/{c['size']}" for c in record["cases"]] == ["dp_engine_mlp/b16"]
    missing = opacus_missing_reason()
    variants = record["cases"][0]["variants"]
    assert variants.keys() == {"engine", "engine_first", "engine_noised", "nonprivate", *OPACUS_DP}
    for name, v in variants.items():
        assert v["error"] is None and v["skipped"] == (missing if name in OPACUS_DP else None), name
        if v["skipped"] is None:
            assert v["correct"] and v["peak_extra_bytes"] > 0, name
    targets = [t["target"] for t in record["targets"]]
    assert any("peak memory" in t for t in targets) and any("first step" in t for t in targets)


@pytest.mark.slow  # spawns 2 processes that import torch and run DDP and FSDP2
def test_distributed_prints_its_table(capsys: pytest.CaptureFixture) -> None:
    assert bench_main(["--distributed", "--smoke"]) == 0
    out = capsys.readouterr().out
    assert "TinyTransformer(d=32" in out
    for wrapper in ("ddp", "fsdp2"):
        rows = [line for line in out.splitlines() if line.startswith(wrapper)]
        assert len(rows) == 2 and all("time <= 1.3x" in row for row in rows)
        assert all(("memory <= 1.3x" in row) == (wrapper == "fsdp2") for row in rows)


def test_gpu_check_without_a_gpu_says_so(tmp_path: Path) -> None:
    """With no GPU visible the check says so plainly, in its output and
    summary.json, and fails without a traceback."""
    proc = run_cli("--gpu-check", str(tmp_path), CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "[gpu_check] no CUDA device visible to torch" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["error"] == "no CUDA device" and summary["ok"] is False and summary["steps"] == {}
    assert summary["torch"] == str(torch.__version__) == summary["built_for_torch"]
