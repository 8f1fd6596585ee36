"""The bench's report and targets on synthetic results: verdicts, skipped
variants, the headline and per-variant tables; and each scenario's declared
targets and modes (no timing runs here)."""
import pytest
import torch

from batchrules.bench.case import MODES, Case
from batchrules.bench.check import compare
from batchrules.bench.report import all_correct, headline_table, limit_ratios_text, table, targets_text
from batchrules.bench.runner import CaseResult, VariantResult
from batchrules.bench.scenarios import all_cases
from batchrules.bench.targets import (COMPILED_TARGET, FASTER_THAN_OPACUS, compiled_limit_ratios, evaluate,
                                      transform_targets)
from batchrules.bench.timing import Stats, paired_ratios

TWINS = ("stock_compiled", "batchrules_compiled")


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


def test_case_targets_are_the_scenarios() -> None:
    """A case is judged by the targets its scenario declares, and only those."""
    r = _result({"stock": [4.0] * 5, "batchrules": [3.0] * 5, "limit": [2.0] * 5, "opacus": [9.0] * 5})
    assert evaluate([r], linear_floor=2) == []  # the synthetic case declares none
    r.case.targets = [*transform_targets("medium"), FASTER_THAN_OPACUS]
    verdicts = {c.target: c.verdict for c in evaluate([r], linear_floor=2)}
    assert verdicts == {
        "not slower than stock (stock / batchrules >= 1)": "met",
        "within 1.1x of the limit (limit / batchrules >= 0.91)": "missed",
        "faster than Opacus (opacus / batchrules > 1)": "met",
    }


def test_skipped_variant_skips_its_targets_and_shows_why() -> None:
    r = _result({"stock": [4.0] * 3, "batchrules": [2.0] * 3, "limit": [1.0] * 3})
    r.variants["opacus"] = VariantResult("opacus", skipped="opacus not importable (no)")
    r.case.targets = [FASTER_THAN_OPACUS]
    (check,) = evaluate([r], linear_floor=2)
    assert check.verdict == "skipped" and check.detail == "opacus: opacus not importable (no)"
    assert "0/0 met, 1 skipped" in targets_text([check])
    assert all_correct([r])
    assert "skipped: opacus not importable (no)" in table([r])
    (line,) = headline_table([r], [check]).splitlines()[2:]
    assert line.split()[:7] == ["ensemble_train/tiny", "4.000s", "2.000s", "2.00x", "1.000s", "2.00", "-"]
    assert line.endswith("opacus skipped")


def test_headline_table_marks_wrong_and_failed_variants() -> None:
    r = _result({"stock": [4.0] * 3, "batchrules": [2.0] * 3, "limit": [1.0] * 3})
    r.variants["batchrules"].check = compare(torch.zeros(1), torch.ones(1, dtype=torch.float64), 1e-4)
    r.variants["limit"] = VariantResult("limit", error="RuntimeError: boom")
    r.case.targets = transform_targets("small")
    checks = evaluate([r], linear_floor=2)
    (line,) = headline_table([r], checks).splitlines()[2:]
    assert "2.000s!" in line and "ERROR" in line and line.split()[-1] == "1/1"
    assert not all_correct([r])


@pytest.mark.parametrize("mode", MODES)
def test_every_case_declares_targets(mode: str) -> None:
    cases = all_cases(mode)
    assert len({c.name for c in cases}) == len(cases)
    assert all(c.targets for c in cases), [c.name for c in cases if not c.targets]


def test_headline_covers_every_workload_once() -> None:
    """Ensembles, per-sample gradients (with Opacus), a hypernetwork, the DP
    step, the training-step ops (linear, SiLU/Mish, losses, attention)."""
    assert [c.name for c in all_cases("headline")] == [
        "ensemble_train/mbpo", "psg_mlp/b32", "hyper_fwd_bwd/medium", "eager_linear/medium",
        "psg_transformer/b8", "loss_grad/cross_entropy/b8", "loss_grad/mse/b8", "dp_mlp/b128",
        "eager_silu/medium", "eager_mish/medium"]
