"""The project's performance targets, evaluated on measured results.

Targets are measured here, never asserted in tests. Speed targets use the
median of paired per-repeat ratios; a miss whose threshold still lies within
the ratios' interquartile range is reported as "noise" rather than missed.
Small sizes are also judged above the case's vmap floor (the cost of vmap
over a function returning its input, for the same inputs), which no rule
removes.

Compiled twins (Note [Compiled twins]) have one target, on every row where
both were timed: batchrules compiled is never slower than stock compiled.
A batchrules twin that does not compile where the stock one does misses it.
The compiled small rows' time relative to the limit is printed, with no
threshold (``compiled_limit_ratios``).
"""
from dataclasses import dataclass
from typing import Dict, List, Optional

from .compiled import twin_name
from .runner import CaseResult

EAGER_SCENARIO = "eager_"  # eager_linear, eager_silu, eager_mish (and their _fwd rows)
PSG_SCENARIOS = ("psg_mlp", "psg_cnn", "psg_transformer")
STOCK_COMPILED, BATCHRULES_COMPILED = twin_name("stock"), twin_name("batchrules")
COMPILED_TARGET = (f"compiled: not slower than stock compiled "
                   f"({STOCK_COMPILED} / {BATCHRULES_COMPILED} >= 1)")
DP_SCENARIO = "dp_"
# The DP rows' step-time targets against the non-private step apply here.
DP_NEAR_NONPRIVATE = ("dp_mlp/b128", "dp_mlp/b512", "dp_transformer/")


@dataclass
class TargetCheck:
    target: str
    case: str
    value: float
    threshold: float
    verdict: str  # "met" | "missed" | "noise"
    detail: str = ""


def _speed_check(
    target: str, result: CaseResult, slow: str, fast: str, threshold: float, detail: str = "",
    above_floor: bool = False,
) -> Optional[TargetCheck]:
    """Median of paired ``time(slow) / time(fast)`` >= threshold (``fast`` minus
    the case's vmap floor when ``above_floor``)."""
    ratios = result.ratio_above_floor(slow, fast) if above_floor else result.ratio(slow, fast)
    if ratios is None:
        return None
    value = ratios.median
    verdict = "met" if value >= threshold else ("noise" if ratios.quantile(0.75) >= threshold else "missed")
    return TargetCheck(target, result.case.name, value, threshold, verdict, detail)


def _compiled_check(result: CaseResult) -> Optional[TargetCheck]:
    stock, br = result.variants.get(STOCK_COMPILED), result.variants.get(BATCHRULES_COMPILED)
    if stock is None or br is None or stock.stats is None:
        return None  # no twins, or stock torch.compile itself fails on this flow
    if br.stats is None:
        why = br.not_compiled or br.error or "not timed"
        return TargetCheck(COMPILED_TARGET, result.case.name, 0.0, 1.0, "missed", f"batchrules: {why}")
    return _speed_check(COMPILED_TARGET, result, STOCK_COMPILED, BATCHRULES_COMPILED, 1.0)


def evaluate(results: List[CaseResult], linear_floor: int) -> List[TargetCheck]:
    """Every target that applies to every case. ``linear_floor``: kernels of
    one eager F.linear with bias on this device (2 on CPU: copy_ + addmm)."""
    checks: List[Optional[TargetCheck]] = []
    for r in results:
        scenario = r.case.scenario
        checks.append(_compiled_check(r))
        if scenario.startswith(DP_SCENARIO):
            checks.extend(dp_checks(r))
            continue
        if scenario.startswith(EAGER_SCENARIO):
            # Routing acts under transforms only; batchrules.linear's C entry must
            # also cost nothing (the activations' direct entries are boxed torch.ops
            # calls: shown in the table, not a target).
            if scenario.startswith("eager_linear"):
                checks.append(_speed_check("eager: F.linear / batchrules.linear >= 0.98", r,
                                           "stock", "batchrules", 0.98))
            checks.append(_speed_check("eager: stock op / the same op with routing on >= 0.98", r,
                                       "stock", "stock_routed", 0.98))
            continue
        checks.append(_speed_check("not slower than stock (stock / batchrules >= 1)", r,
                                   "stock", "batchrules", 1.0))
        bound = 2.0 if r.case.tier == "small" else 1.1
        limit_check = _speed_check(f"within {bound:g}x of the limit (limit / batchrules >= {1 / bound:.2f})",
                                   r, "limit", "batchrules", 1.0 / bound)
        checks.append(limit_check)
        if r.case.tier == "small":
            checks.append(_speed_check(
                "within 2x of the limit above the vmap floor (limit / (batchrules - floor) >= 0.50)",
                r, "limit", "batchrules", 0.5, above_floor=True))
        if scenario in PSG_SCENARIOS:
            checks.append(_speed_check("faster than Opacus (opacus / batchrules > 1)", r,
                                       "opacus", "batchrules", 1.0))
        br, stock = r.variants.get("batchrules"), r.variants.get("stock")
        if br is not None and br.kernels is not None and br.kernels.per_linear_forward is not None:
            per_linear = br.kernels.per_linear_forward
            stock_per_linear = stock.kernels.per_linear_forward if stock and stock.kernels else None
            checks.append(TargetCheck(
                f"kernels per vmapped linear forward <= eager F.linear's ({linear_floor})",
                r.case.name, per_linear, float(linear_floor),
                "met" if per_linear <= linear_floor else "missed",
                f"stock: {stock_per_linear:.1f}" if stock_per_linear is not None else "",
            ))
    return [c for c in checks if c is not None]


@dataclass
class LimitRatios:
    """Median paired time(variant) / time(limit) of one case's variants."""

    case: str
    ratios: Dict[str, float]


def compiled_limit_ratios(results: List[CaseResult]) -> List[LimitRatios]:
    """For the small rows with a timed compiled twin: how far eager batchrules and
    the compiled twins are from the hand-written limit (printed, not a target)."""
    rows = []
    for r in results:
        if r.case.tier != "small" or not any(r.stats(n) for n in (STOCK_COMPILED, BATCHRULES_COMPILED)):
            continue
        ratios = {}
        for name in ("batchrules", STOCK_COMPILED, BATCHRULES_COMPILED):
            stats = r.ratio(name, "limit")
            if stats is not None:
                ratios[name] = stats.median
        if ratios:
            rows.append(LimitRatios(r.case.name, ratios))
    return rows
def dp_checks(r: CaseResult) -> List[Optional[TargetCheck]]:
    """The DP-SGD targets of one DP row (scenarios_dp), for ``clipped_grad``."""
    checks: List[Optional[TargetCheck]] = []
    name = r.case.name
    if any(name.startswith(n) for n in DP_NEAR_NONPRIVATE):
        checks.append(_speed_check("DP: clipped_grad <= 1.2x the non-private step "
                                   "(nonprivate / clipped_grad >= 0.83)", r,
                                   "nonprivate", "clipped_grad", 1 / 1.2))
    checks.append(_speed_check("DP: clipped_grad >= 1.5x faster than Opacus ghost clipping", r,
                               "opacus_ghost", "clipped_grad", 1.5))
    if name == "dp_mlp/b128":
        checks.append(_speed_check("DP: clipped_grad >= 20x faster than vmap(grad)+clip (stock)", r,
                                   "stock", "clipped_grad", 20.0))
    dp, plain = r.variants.get("clipped_grad"), r.variants.get("nonprivate")
    if dp is not None and plain is not None and dp.peak_bytes and plain.peak_bytes:
        value = plain.peak_bytes / dp.peak_bytes
        checks.append(TargetCheck(
            "DP: clipped_grad peak memory <= 1.3x the non-private step's "
            "(nonprivate / clipped_grad >= 0.77)", name, value, 1 / 1.3,
            "met" if value >= 1 / 1.3 else "missed",
            f"{dp.peak_bytes / 2**20:.1f}MB vs {plain.peak_bytes / 2**20:.1f}MB"))
    return checks
