"""The rows outside the smoke run, built tiny and run once: every variant
matches its reference or says why it did not run (the recurrent rows; the
third-party DP rows, whose missing model package skips the whole row), and the
rows sit in the modes they promise. Timings are never asserted."""
from typing import List

import pytest
import torch

from batchrules.bench.baselines.opacus_variants import opacus_missing_reason
from batchrules.bench.case import MODES, Case
from batchrules.bench.runner import run_case
from batchrules.bench.scenarios import all_cases, dp_bf16
from batchrules.bench.scenarios import dp_third_party as tp
from batchrules.bench.scenarios import recurrent as rec
from batchrules.bench.targets import evaluate
from batchrules.bench.timing import TimingPlan

CPU = torch.device("cpu")
PLAN = TimingPlan(block_s=0.001, budget_s=0.01, min_repeats=1, max_repeats=1, warmup_calls=0)
RNN = rec.Size(in_features=4, hidden=5, batch=3, steps=4, members=2, classes=3)
LM = tp.Size(layers=1, d=16, heads=2, tokens=8, vocab=31, batch=4)


@pytest.fixture(autouse=True)
def cudnn_flags_settable():
    """Opacus' embedding hook sets ``torch.backends.cudnn.deterministic``, which
    torch's test utilities (imported by other test modules of the same worker)
    freeze; users' processes do not."""
    with torch.backends.__allow_nonbracketed_mutation():
        yield


def _recurrent_cases() -> List[Case]:
    return [*(rec.ensemble_case(k, RNN, train, "small") for k in rec.RNN for train in (False, True)),
            rec.per_sample_grads_case(RNN, "small"), rec.dp_case(RNN, "small")]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", _recurrent_cases(), ids=lambda c: c.name)
def test_recurrent_row_runs_and_matches(case: Case) -> None:
    """Stock vmap may refuse the layer: skipped, with its error."""
    result = run_case(case, CPU, PLAN)
    for name, v in result.variants.items():
        if v.skipped is not None:
            assert name in {"stock", "clipped_grad"} or name.startswith("opacus"), (name, v.skipped)
            continue
        assert v.error is None and v.check is not None and v.check.ok, (name, v.error, v.check)
    expected = {"rnn_ensemble_fwd": {"stock", "batchrules", "limit", "loop"},
                "rnn_ensemble_train": {"stock", "batchrules", "limit", "loop"},
                "psg_lstm": {"stock", "batchrules", "limit"},
                "dp_lstm": {"clipped_grad", "nonprivate", "opacus_hooks"}}[case.scenario]
    assert set(result.variants) == expected
    assert len(evaluate([result], linear_floor=2)) <= len(case.targets)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("scenario", ["dp_gpt2", "dp_bert", "dp_lora"])
def test_third_party_row_runs_and_matches(scenario: str) -> None:
    pytest.importorskip("transformers")
    if scenario == "dp_lora":
        pytest.importorskip("peft")
    result = run_case(next(c for c in tp.lm_cases(LM) if c.scenario == scenario), CPU, PLAN)
    ran = {n: v for n, v in result.variants.items() if v.skipped is None}
    assert {"stock", "clipped_grad", "nonprivate"} <= ran.keys()
    for name, v in ran.items():
        assert v.error is None and v.check is not None and v.check.ok, (name, v.error, v.check)
    if opacus_missing_reason() is None:
        assert "opacus_hooks" in ran
        if scenario == "dp_gpt2":  # the tied wte
            assert "tying" in result.variants["opacus_ghost"].skipped
        else:
            assert "opacus_ghost" in ran


def test_bf16_row_matches_its_references() -> None:
    """Every variant of the --full row dp_transformer_bf16 (bf16 within its
    tolerance) matches; the target exists where the machine has bf16 kernels."""
    (case,) = dp_bf16.cases("full")
    result = run_case(case, CPU, PLAN)
    assert set(result.variants) == {"clipped_grad", "clipped_grad_bf16", "nonprivate", "nonprivate_bf16"}
    for name, v in result.variants.items():
        assert v.error is None and v.check is not None and v.check.ok, (name, v.error, v.check)
    assert bool(case.targets) == dp_bf16.has_bf16_kernels()


def test_missing_model_package_skips_the_row() -> None:
    def problem(device: torch.device) -> tp.Problem:
        import batchrules_no_such_package  # noqa: F401
        raise AssertionError("unreachable")

    case = Case("dp_x", "b1", "large", 1, "missing", tp.guarded(problem), tp.targets(True, "opacus_ghost"))
    result = run_case(case, CPU, PLAN)
    assert set(result.variants) == set(tp.VARIANTS)
    assert all("batchrules_no_such_package" in v.skipped for v in result.variants.values())
    assert all(c.verdict == "skipped" for c in evaluate([result], linear_floor=2))


def test_rows_per_mode() -> None:
    names = {mode: [c.name for c in all_cases(mode)] for mode in MODES}
    recurrent = {mode: [n for n in ns if n.startswith(("rnn_", "psg_lstm", "dp_lstm"))]
                 for mode, ns in names.items()}
    assert recurrent["smoke"] == recurrent["headline"] == []
    assert recurrent["quick"] == ["rnn_ensemble_fwd/lstm_h32", "rnn_ensemble_fwd/gru_h32", "psg_lstm/b32"]
    assert len(recurrent["full"]) == 10
    third_party = {"dp_gpt2", "dp_bert", "dp_lora", "dp_resnet18_gn", "dp_vit"}
    for mode, ns in names.items():
        assert ({n.split("/")[0] for n in ns} >= third_party) if mode == "full" else not (
            {n.split("/")[0] for n in ns} & third_party), mode
