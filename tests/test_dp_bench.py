"""The DP rows of the benchmark: every variant runs and matches its reference,
peak memory is recorded, the DP targets are evaluated; a variant's own
reference replaces the case's. Timings are never asserted."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchrules.bench.case import Case, CaseSetup, Variant
from batchrules.bench.runner import run_case
from batchrules.bench.timing import TimingPlan

ROOT = Path(__file__).resolve().parents[1]
DP_SMOKE = ("dp_mlp/b8", "dp_cnn/b8", "dp_transformer/d64t16_b8")
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
    for case in record["cases"]:
        expected = {"stock", "batchrules", "clipped_grad", "nonprivate"}
        if case["scenario"] == "dp_mlp":
            expected.add("limit")
        try:
            import opacus  # noqa: F401

            expected |= {"opacus_hooks", "opacus_ghost"}
        except ImportError:
            pass
        assert expected <= case["variants"].keys(), case["variants"].keys()
        for name, v in case["variants"].items():
            assert v["error"] is None, (case["scenario"], name, v["error"])
            assert v["correct"], (case["scenario"], name, v["check_message"])
            assert v["peak_extra_bytes"] and v["peak_extra_bytes"] > 0


def test_dp_targets_evaluated(record: dict) -> None:
    targets = {t["target"] for t in record["targets"]}
    assert any("peak memory" in t for t in targets)
    assert any("Opacus ghost" in t for t in targets)


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
