"""Performance targets, declared per case by its scenario (``Case.targets``),
evaluated, never asserted. Speed targets use the median of paired per-repeat
ratios (``timing.verdict``: a miss within their spread is "noise"); a target
whose variant was skipped is reported skipped, with the reason. Every row with
compiled twins has one more: batchrules compiled not slower than stock compiled
(a batchrules twin that does not compile where the stock one does misses it).
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

from .compiled import twin_name
from .runner import CaseResult
from .timing import Stats, paired_ratios, verdict

STOCK_COMPILED, BATCHRULES_COMPILED = twin_name("stock"), twin_name("batchrules")
COMPILED_TARGET = (f"compiled: not slower than stock compiled "
                   f"({STOCK_COMPILED} / {BATCHRULES_COMPILED} >= 1)")


@dataclass
class TargetCheck:
    target: str
    case: str
    value: float
    threshold: float
    verdict: str  # "met" | "missed" | "noise" | "skipped"
    detail: str = ""


@dataclass(frozen=True)
class Speedup:
    """Median of paired ``time(slow) / time(fast)`` >= threshold. ``slow``: a
    variant, or several (then the fastest of them, repeat by repeat);
    ``above_floor``: ``fast`` minus the case's vmap floor."""

    label: str
    slow: Union[str, Tuple[str, ...]]
    fast: str
    threshold: float
    above_floor: bool = False

    def check(self, result: CaseResult, linear_floor: int) -> Optional[TargetCheck]:
        slow = (self.slow,) if isinstance(self.slow, str) else self.slow
        for name in (*slow, self.fast):
            v = result.variants.get(name)
            if v is not None and v.skipped is not None:
                return TargetCheck(self.label, result.case.name, 0.0, 0.0, "skipped", f"{name}: {v.skipped}")
        *slow_stats, fast = [result.stats(name) for name in (*slow, self.fast)]
        if fast is None or any(s is None for s in slow_stats):
            return None
        best = Stats([min(times) for times in zip(*(s.times for s in slow_stats if s))])
        ratios = (result.ratio_above_floor(slow[0], self.fast) if self.above_floor
                  else paired_ratios(best, fast))
        if ratios is None:
            return None
        return TargetCheck(self.label, result.case.name, ratios.median, self.threshold,
                           verdict(ratios, self.threshold))


@dataclass(frozen=True)
class KernelsPerLinear:
    """The batchrules variant's kernels per vmapped linear forward are no more
    than one eager ``F.linear`` with bias (``linear_floor``: 2 on CPU, copy_ + addmm)."""

    def check(self, result: CaseResult, linear_floor: int) -> Optional[TargetCheck]:
        br, stock = result.variants.get("batchrules"), result.variants.get("stock")
        if br is None or br.kernels is None or br.kernels.per_linear_forward is None:
            return None
        per_linear = br.kernels.per_linear_forward
        stock_per_linear = stock.kernels.per_linear_forward if stock and stock.kernels else None
        return TargetCheck(
            f"kernels per vmapped linear forward <= eager F.linear's ({linear_floor})",
            result.case.name, per_linear, float(linear_floor),
            "met" if per_linear <= linear_floor else "missed",
            f"stock: {stock_per_linear:.1f}" if stock_per_linear is not None else "")


@dataclass(frozen=True)
class PeakMemory:
    """``peak(baseline) / peak(variant) >= threshold``."""

    label: str
    baseline: str
    variant: str
    threshold: float

    def check(self, result: CaseResult, linear_floor: int) -> Optional[TargetCheck]:
        v, base = result.variants.get(self.variant), result.variants.get(self.baseline)
        if v is None or base is None or not v.peak_bytes or not base.peak_bytes:
            return None
        value = base.peak_bytes / v.peak_bytes
        return TargetCheck(self.label, result.case.name, value, self.threshold,
                           "met" if value >= self.threshold else "missed",
                           f"{v.peak_bytes / 2**20:.1f}MB vs {base.peak_bytes / 2**20:.1f}MB")


Target = Union[Speedup, KernelsPerLinear, PeakMemory]
NOT_SLOWER = Speedup("not slower than stock (stock / batchrules >= 1)", "stock", "batchrules", 1.0)
# Outside transforms routing must cost nothing (it acts under transforms only).
ROUTING_FREE_IN_EAGER = Speedup("eager: stock op / the same op with routing on >= 0.98",
                                "stock", "stock_routed", 0.98)
FASTER_THAN_OPACUS = Speedup("faster than Opacus (opacus / batchrules > 1)", "opacus", "batchrules", 1.0)


def transform_targets(tier: str) -> List[Target]:
    """The targets of a row running vmapped user code next to a hand-written
    limit: not slower than stock, within 2x (small, overhead-bound sizes; also
    above the vmap floor) or 1.1x of the limit, no extra kernels per linear."""
    bound = 2.0 if tier == "small" else 1.1
    targets: List[Target] = [
        NOT_SLOWER,
        Speedup(f"within {bound:g}x of the limit (limit / batchrules >= {1 / bound:.2f})",
                "limit", "batchrules", 1.0 / bound),
        KernelsPerLinear(),
    ]
    if tier == "small":
        targets.append(Speedup(
            "within 2x of the limit above the vmap floor (limit / (batchrules - floor) >= 0.50)",
            "limit", "batchrules", 0.5, above_floor=True))
    return targets


def _compiled_check(result: CaseResult) -> Optional[TargetCheck]:
    stock, br = result.variants.get(STOCK_COMPILED), result.variants.get(BATCHRULES_COMPILED)
    if stock is None or br is None or stock.stats is None:
        return None  # no twins, or stock torch.compile itself fails on this flow
    if br.stats is None:
        why = br.not_compiled or br.error or "not timed"
        return TargetCheck(COMPILED_TARGET, result.case.name, 0.0, 1.0, "missed", f"batchrules: {why}")
    return Speedup(COMPILED_TARGET, STOCK_COMPILED, BATCHRULES_COMPILED, 1.0).check(result, 0)


def evaluate(results: List[CaseResult], linear_floor: int) -> List[TargetCheck]:
    """Every case's own targets, and the compiled-twin target. ``linear_floor``:
    kernels of one eager F.linear with bias on this device."""
    checks: List[Optional[TargetCheck]] = []
    for r in results:
        checks.append(_compiled_check(r))
        checks.extend(t.check(r, linear_floor) for t in r.case.targets)
    return [c for c in checks if c is not None]
