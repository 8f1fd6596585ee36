"""The recurrent rows of the bench (scenarios/recurrent.py) and their
hand-written baselines (baselines/hand_written_recurrent.py): the baselines
equal autograd and loops of nn.LSTM / nn.GRU in float64, every case builds and
runs one tiny repetition, its variants match their references, and the rows
sit in the modes they promise. Timings are never asserted."""
from typing import List

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchrules.bench.baselines import hand_written_recurrent as hw
from batchrules.bench.case import MODES, Case
from batchrules.bench.check import compare
from batchrules.bench.runner import CaseResult, VariantResult, run_case
from batchrules.bench.scenarios import all_cases
from batchrules.bench.scenarios import recurrent as rec
from batchrules.bench.targets import SpeedupOverBest, evaluate
from batchrules.bench.timing import Stats, TimingPlan

PLAN = TimingPlan(block_s=0.001, budget_s=0.01, min_repeats=1, max_repeats=1, warmup_calls=0)
TINY = rec.Size(in_features=4, hidden=5, batch=3, steps=4, members=2, classes=3)
# Until batchrules routes the recurrent layers, its vmapped variants fail as stock vmap does.
ROUTED = hasattr(torch.ops.batchrules, "rnn_recurrence")
WEIGHTS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


def _stacked_layers(models: List[nn.Module], layers: int) -> List[hw.RnnLayer]:
    return [tuple(torch.stack([getattr(m, f"{w}_l{i}") for m in models]) for w in WEIGHTS)
            for i in range(layers)]


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("layers", [1, 2])
def test_ensemble_recurrence_equals_the_modules(kind: str, layers: int) -> None:
    models = [rec.RNN[kind](4, 5, layers, batch_first=True).double() for _ in range(3)]
    stacked = _stacked_layers(models, layers)
    shared, own = torch.randn(2, 6, 4, dtype=torch.float64), torch.randn(3, 2, 6, 4, dtype=torch.float64)
    with torch.no_grad():
        want_shared = torch.stack([m(shared)[0] for m in models])
        want_own = torch.stack([m(x)[0] for m, x in zip(models, own)])
        torch.testing.assert_close(hw.ensemble_recurrence(kind, stacked, shared), want_shared)
        torch.testing.assert_close(hw.ensemble_recurrence(kind, stacked, own), want_own)
        loop = hw.member_loop(kind, [m._flat_weights for m in models], shared, layers)
        torch.testing.assert_close(loop, want_shared)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_ensemble_recurrence_gradients_equal_autograd_per_member(kind: str) -> None:
    models = [rec.RNN[kind](4, 5, batch_first=True).double() for _ in range(3)]
    leaves = [t.detach().requires_grad_() for t in _stacked_layers(models, 1)[0]]
    x, y = torch.randn(2, 6, 4, dtype=torch.float64), torch.randn(2, 6, 5, dtype=torch.float64)
    out = hw.ensemble_recurrence(kind, [tuple(leaves)], x)
    got = torch.autograd.grad(sum(F.mse_loss(o, y) for o in out), leaves)
    for e, m in enumerate(models):
        want = torch.autograd.grad(F.mse_loss(m(x)[0], y), list(m.parameters()))
        for g, w in zip(got, want):
            torch.testing.assert_close(g[e], w)


def _per_sample_loop(model: nn.Module, x: Tensor, y: Tensor) -> List[Tensor]:
    rows = [torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters()))
            for i in range(len(x))]
    return [torch.stack(column) for column in zip(*rows)]


def test_bptt_per_sample_grads_equal_autograd() -> None:
    """(Stock vmap(grad) of an nn.LSTM fails in float64 on CPU: "output with
    shape [1, 24] doesn't match the broadcast shape [5, 1, 24]"; the loop is
    the reference.)"""
    model = rec.LstmClassifier(4, 6, 3).double()
    x, y = torch.randn(5, 7, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    params = [p.detach() for p in model.parameters()]
    got = hw.lstm_classifier_per_sample_grads(*params, x, y)
    for g, want in zip(got, _per_sample_loop(model, x, y)):
        torch.testing.assert_close(g, want)


def _cases() -> List[Case]:
    return [*(rec.ensemble_case(k, TINY, train, "small") for k in rec.RNN for train in (False, True)),
            *(rec.per_sample_forward_case(k, TINY, "small") for k in rec.RNN),
            rec.per_sample_grads_case(TINY, "small"), rec.dp_case(TINY, "small")]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.name)
def test_tiny_case_runs_and_matches(case: Case) -> None:
    """Every variant matches its reference or says why it did not run:
    stock vmap and clipped_grad may refuse the layer (skipped, with the
    error); the routed variant fails as stock vmap does until batchrules
    routes the recurrent layers."""
    result = run_case(case, torch.device("cpu"), PLAN)
    for name, v in result.variants.items():
        if v.skipped is not None:
            assert name in {"stock", "clipped_grad"} or name.startswith("opacus"), (name, v.skipped)
            assert "\n" not in v.skipped
            continue
        if name == "batchrules" and not ROUTED and v.error is not None:
            assert "Batching rule not implemented" in v.error
            continue
        assert v.error is None and v.check is not None and v.check.ok, (name, v.error, v.check)
        assert v.stats is not None and v.stats.times
    expected = {"rnn_ensemble_fwd": {"stock", "batchrules", "limit", "loop"},
                "rnn_ensemble_train": {"stock", "batchrules", "limit", "loop"},
                "rnn_psg_fwd": {"stock", "batchrules", "limit"},
                "psg_lstm": {"stock", "batchrules", "limit"},
                "dp_lstm": {"clipped_grad", "nonprivate", "opacus_hooks"}}[case.scenario]
    assert set(result.variants) == expected
    assert len(evaluate([result], linear_floor=2)) <= len(case.targets)


def test_faster_of_two_baselines_target() -> None:
    case = Case("rnn_ensemble_fwd", "tiny", "small", 0, "synthetic", build=lambda device: None)
    r = CaseResult(case)
    for name, times in {"loop": [2.0, 4.0, 1.0], "limit": [3.0, 1.0, 4.0], "batchrules": [2.0] * 3}.items():
        r.variants[name] = VariantResult(name, stats=Stats(times))
        r.variants[name].check = compare(torch.ones(1), torch.ones(1, dtype=torch.float64), 1e-4)
    check = SpeedupOverBest("best", ("loop", "limit"), "batchrules", 0.95).check(r, 2)
    assert check.value == pytest.approx(0.5) and check.verdict == "missed"  # per repeat: 1, 0.5, 0.5
    r.variants["limit"] = VariantResult("limit", skipped="why")
    assert SpeedupOverBest("best", ("loop", "limit"), "batchrules", 0.95).check(r, 2).verdict == "skipped"


def test_rows_per_mode() -> None:
    names = {mode: [c.name for c in all_cases(mode) if c.name.startswith(("rnn_", "psg_lstm", "dp_lstm"))]
             for mode in MODES}
    assert names["smoke"] == names["headline"] == []
    assert names["quick"] == ["rnn_ensemble_fwd/lstm_h32", "rnn_ensemble_fwd/gru_h32", "psg_lstm/b32"]
    assert len(names["full"]) == 12 and set(names["quick"]) < set(names["full"])
