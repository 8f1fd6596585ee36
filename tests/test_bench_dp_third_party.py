"""The third-party DP rows of the bench (scenarios/dp_third_party.py), run
tiny: every variant matches its reference, Opacus ghost clipping is skipped
with its reason on tied GPT-2, a missing model package skips the whole row,
and the rows are in ``--full`` only. Timings are never asserted."""
import pytest
import torch

from batchrules.bench.baselines.opacus_variants import opacus_missing_reason
from batchrules.bench.case import MODES
from batchrules.bench.runner import run_case
from batchrules.bench.scenarios import all_cases
from batchrules.bench.scenarios import dp_third_party as tp
from batchrules.bench.targets import evaluate
from batchrules.bench.timing import TimingPlan


@pytest.fixture(autouse=True)
def cudnn_flags_settable():
    """Opacus' embedding hook sets ``torch.backends.cudnn.deterministic``, which
    torch's test utilities (imported by other test modules of the same worker)
    freeze; users' processes do not."""
    with torch.backends.__allow_nonbracketed_mutation():
        yield

PLAN = TimingPlan(block_s=0.001, budget_s=0.01, min_repeats=2, max_repeats=2, warmup_calls=0)
TINY = tp.Size(layers=1, d=16, heads=2, tokens=8, vocab=31, batch=4)
ROWS = {"dp_gpt2": ("transformers",), "dp_bert": ("transformers",), "dp_lora": ("transformers", "peft")}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("scenario", sorted(ROWS))
def test_tiny_row_runs_and_matches(scenario: str) -> None:
    for package in ROWS[scenario]:
        pytest.importorskip(package)
    case = next(c for c in tp.lm_cases(TINY) if c.scenario == scenario)
    result = run_case(case, torch.device("cpu"), PLAN)
    ran = {n: v for n, v in result.variants.items() if v.skipped is None}
    assert {"stock", "clipped_grad", "nonprivate"} <= ran.keys()
    for name, v in ran.items():
        assert v.error is None and v.check is not None and v.check.ok, (name, v.error, v.check)
        assert v.peak_bytes is not None or name.startswith("opacus")
    if opacus_missing_reason() is None:
        assert "opacus_hooks" in ran
        if scenario == "dp_gpt2":  # the tied wte
            assert "tying" in result.variants["opacus_ghost"].skipped
        else:
            assert "opacus_ghost" in ran
    checks = evaluate([result], linear_floor=2)
    assert any("Opacus" in c.target for c in checks)


IMAGE_ROWS = {"dp_resnet18_gn": (tp.resnet18_gn_problem, ("torchvision",)),
              "dp_vit": (tp.vit_problem, ("timm", "torchvision"))}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("scenario", sorted(IMAGE_ROWS))
def test_image_row_runs_and_matches(scenario: str) -> None:
    """The image rows at batch 2, Opacus included (its ModuleValidator pickles the model)."""
    problem, packages = IMAGE_ROWS[scenario]
    for package in packages:
        pytest.importorskip(package)
    case = tp.Case(scenario, "b2", "large", 1, "tiny", tp.guarded(lambda d: problem(d, batch=2)),
                   tp.targets(True, "opacus_ghost"))
    result = run_case(case, torch.device("cpu"), PLAN)
    ran = {n: v for n, v in result.variants.items() if v.skipped is None}
    assert {"stock", "clipped_grad", "nonprivate"} <= ran.keys()
    if opacus_missing_reason() is None:
        assert {"opacus_hooks", "opacus_ghost"} <= ran.keys()
    for name, v in ran.items():
        assert v.error is None and v.check is not None and v.check.ok, (name, v.error, v.check)


def test_missing_package_skips_the_row() -> None:
    def build(device: torch.device) -> tp.Problem:
        import batchrules_no_such_package  # noqa: F401
        raise AssertionError("unreachable")

    case = tp.Case("dp_x", "b1", "large", 1, "missing", tp.guarded(build), tp.targets(True, "opacus_ghost"))
    result = run_case(case, torch.device("cpu"), PLAN)
    assert set(result.variants) == set(tp.VARIANTS)
    assert all("batchrules_no_such_package" in v.skipped for v in result.variants.values())
    assert all(c.verdict == "skipped" for c in evaluate([result], linear_floor=2))


def test_rows_in_full_only() -> None:
    scenarios = {"dp_gpt2", "dp_bert", "dp_lora", "dp_resnet18_gn", "dp_vit"}
    for mode in MODES:
        names = {c.scenario for c in all_cases(mode)}
        assert (scenarios <= names) if mode == "full" else not (scenarios & names), mode
