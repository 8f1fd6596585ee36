"""The DP rows of the benchmark: every variant runs and matches its reference
(the Opacus ones where Opacus is installed, else they are reported skipped),
peak memory is recorded, the DP targets are evaluated; a variant's own
reference replaces the case's. Timings are never asserted."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchrules.bench.baselines.opacus_variants import opacus_missing_reason
from batchrules.bench.case import Case, CaseSetup, Variant
from batchrules.bench.runner import run_case
from batchrules.bench.timing import TimingPlan

ROOT = Path(__file__).resolve().parents[1]
DP_SMOKE = ("dp_mlp/b8", "dp_cnn/b8", "dp_transformer/d64t16_b8")
OPACUS = ("opacus_hooks", "opacus_ghost")
GHOST_TARGET = "DP: clipped_grad >= 1.5x faster than Opacus ghost clipping"
PLAN = TimingPlan(block_s=0.001, budget_s=0.01, min_repeats=2, max_repeats=2, warmup_calls=0)


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "dp.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "batchrules.bench", "--smoke", "--threads", "1",
                           # compiled twins are tested in test_bench.py; compiling the
                           # DP rows' would cost CI minutes here
                           "--no-compiled", "--only", "dp_", "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_every_dp_variant_matches_its_reference(record: dict) -> None:
    assert [f"{c['scenario']}/{c['size']}" for c in record["cases"]] == list(DP_SMOKE)
    missing = opacus_missing_reason()
    for case in record["cases"]:
        expected = {"stock", "batchrules", "clipped_grad", "nonprivate", *OPACUS}
        if case["scenario"] == "dp_mlp":
            expected.add("limit")
        assert expected == case["variants"].keys(), case["variants"].keys()
        for name, v in case["variants"].items():
            assert v["error"] is None, (case["scenario"], name, v["error"])
            assert v["skipped"] == (missing if name in OPACUS else None), (name, v["skipped"])
            if v["skipped"] is not None:
                continue
            assert v["correct"], (case["scenario"], name, v["check_message"])
            assert v["peak_extra_bytes"] and v["peak_extra_bytes"] > 0


def test_dp_targets_evaluated(record: dict) -> None:
    by_case = {}
    for t in record["targets"]:
        by_case.setdefault(t["case"], {})[t["target"]] = t
    assert list(by_case) == list(DP_SMOKE)
    for case, targets in by_case.items():
        assert (targets[GHOST_TARGET]["verdict"] == "skipped") == (opacus_missing_reason() is not None)
        assert any("peak memory" in t for t in targets), case
    # the step-time target against the non-private step: transformer rows and MLP batch >= 128
    assert [case for case, targets in by_case.items()
            if any("non-private step (" in t for t in targets)] == ["dp_transformer/d64t16_b8"]


@pytest.mark.requires("opacus")
def test_dp_opacus_variants_run(record: dict) -> None:
    for case in record["cases"]:
        for name in OPACUS:
            assert case["variants"][name]["correct"] and case["variants"][name]["times_s"], (case, name)
    ghost = [t for t in record["targets"] if t["target"] == GHOST_TARGET]
    assert len(ghost) == len(DP_SMOKE) and all(t["verdict"] in ("met", "missed", "noise") for t in ghost)


def test_variant_reference_replaces_the_case_reference() -> None:
    x = torch.randn(4, dtype=torch.float64)

    def build(device: torch.device) -> CaseSetup:
        return CaseSetup([Variant("same", lambda: x.float()),
                          Variant("own", lambda: 2 * x.float(), reference=lambda: 2 * x),
                          Variant("wrong", lambda: 2 * x.float())],
                         reference=lambda: x)

    result = run_case(Case("unit", "s", "small", 0, "per-variant references", build),
                      torch.device("cpu"), PLAN)
    assert result.variants["same"].check.ok and result.variants["own"].check.ok
    assert not result.variants["wrong"].check.ok


def test_variant_tolerance_replaces_the_runners() -> None:
    x = torch.randn(4, dtype=torch.float64)
    off = x + 1e-2 * x.abs().max()

    def build(device: torch.device) -> CaseSetup:
        return CaseSetup([Variant("strict", lambda: off.float()),
                          Variant("loose", lambda: off.float(), rtol=5e-2)], reference=lambda: x)

    result = run_case(Case("unit", "s", "small", 0, "per-variant tolerances", build),
                      torch.device("cpu"), PLAN)
    assert not result.variants["strict"].check.ok and result.variants["loose"].check.ok


def test_bf16_row_matches_its_references() -> None:
    """The --full row dp_transformer_bf16: every variant (bf16 within its
    tolerance) matches; the target exists where the machine has bf16 kernels."""
    from batchrules.bench.scenarios import dp_bf16
    (case,) = dp_bf16.cases("full")
    assert dp_bf16.cases("quick") == []
    result = run_case(case, torch.device("cpu"), PLAN)
    assert set(result.variants) == {"clipped_grad", "clipped_grad_bf16", "nonprivate",
                                    "nonprivate_bf16"}
    for name, v in result.variants.items():
        assert v.error is None and v.check.ok, (name, v.error, v.check)
    assert bool(case.targets) == dp_bf16.has_bf16_kernels()
