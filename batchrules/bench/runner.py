"""Runs one case: check every variant, count its kernels and memory, time them."""
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from .case import Case, Variant, vmap_identity
from .check import CheckResult, compare
from .kernels import KernelCounts, count_kernels
from .memory import peak_extra_bytes
from .timing import Stats, TimingPlan, paired_ratios, synchronizer, time_interleaved

# Relative tolerance of float32 results against the float64 reference.
RTOL = 1e-4
# The name the case's vmap floor is timed under (not a variant: never checked).
FLOOR = "vmap floor"


@dataclass
class VariantResult:
    """Everything measured about one variant of a case."""

    name: str
    check: Optional[CheckResult] = None
    error: Optional[str] = None
    stats: Optional[Stats] = None
    kernels: Optional[KernelCounts] = None
    peak_bytes: Optional[int] = None


@dataclass
class CaseResult:
    case: Case
    variants: Dict[str, VariantResult] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    floor: Optional[Stats] = None  # the case's vmap floor (CaseSetup.floor)

    def stats(self, variant: str) -> Optional[Stats]:
        v = self.variants.get(variant)
        return v.stats if v is not None else None

    def median(self, variant: str) -> Optional[float]:
        s = self.stats(variant)
        return s.median if s is not None else None

    def ratio(self, numerator: str, denominator: str) -> Optional[Stats]:
        """Paired per-repeat time ratios (see ``paired_ratios``), if both were timed."""
        n, d = self.stats(numerator), self.stats(denominator)
        return paired_ratios(n, d) if n is not None and d is not None else None

    def ratio_above_floor(self, numerator: str, denominator: str) -> Optional[Stats]:
        """Paired per-repeat ``time(numerator) / (time(denominator) - floor)``, over
        the repeats where the denominator took longer than the floor (in the others
        noise made the difference meaningless); None if there are none."""
        n, d, f = self.stats(numerator), self.stats(denominator), self.floor
        if n is None or d is None or f is None:
            return None
        ratios = [a / (b - c) for a, b, c in zip(n.times, d.times, f.times) if b > c]
        return Stats(ratios) if ratios else None


def _error(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:]
    where = f" at {last[0].filename}:{last[0].lineno}" if last else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{where}"


def run_case(
    case: Case,
    device: torch.device,
    plan: TimingPlan,
    on_stage: Callable[[str], None] = lambda stage: None,
) -> CaseResult:
    """Builds the case, then for each variant: correctness check (which also
    warms it up), kernel count, peak memory; finally times the variants that
    ran, interleaved. A variant that raises is reported, not timed."""
    result = CaseResult(case)
    on_stage("setup")
    setup = case.build(device)
    result.notes.extend(setup.notes)
    reference = setup.reference()
    runnable: List[Variant] = []
    for v in setup.variants:
        vr = result.variants[v.name] = VariantResult(v.name)
        on_stage(f"check {v.name}")
        try:
            with v.context():
                vr.check = compare(v.fn(), reference if v.reference is None else v.reference(), RTOL)
            on_stage(f"profile {v.name}")
            vr.kernels = count_kernels(v, device)
            vr.peak_bytes = peak_extra_bytes(v, device)
        except Exception as exc:  # a failing variant must not stop the bench
            vr.error = _error(exc)
            continue
        runnable.append(v)
    del reference
    if runnable:
        # The floor is timed in the same rounds, so it can be paired with them.
        floor = [Variant(FLOOR, setup.floor)] if setup.floor is not None else []
        stats = time_interleaved(
            runnable + floor, plan, synchronizer(device),
            on_repeat=lambda done, total: on_stage(f"timing {done}/{total}"),
        )
        result.floor = stats.pop(FLOOR, None)
        for name, s in stats.items():
            result.variants[name].stats = s
    return result


def measure_vmap_floor(device: torch.device, plan: TimingPlan) -> Stats:
    """Time of ``vmap`` over a function returning its input: the fixed cost
    any vmapped call pays, whatever its body."""
    floor = Variant(FLOOR, vmap_identity((0,), (torch.randn(8, 16, device=device),)))
    return time_interleaved([floor], plan, synchronizer(device))[FLOOR]
