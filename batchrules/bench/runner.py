"""Runs one case: check every variant against its float64 reference, count its
kernels and memory, time them."""
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from .case import Case, Variant, vmap_identity
from .compiled import check_no_recompile, compile_failure, compile_now, compiled_twin, no_recompile, twin_name
from .kernels import KernelCounts, count_kernels
from .memory import peak_extra_bytes
from .timing import Stats, TimingPlan, paired_ratios, synchronizer, time_interleaved

# Tolerances of float32 results against the float64 reference (see compare).
RTOL, ABS_TOL = 1e-4, 1e-6
# The name the case's vmap floor is timed under (not a variant: never checked).
FLOOR = "vmap floor"


def flatten_result(result: Any) -> List[Tensor]:
    """Tensors of a result in a fixed order (dicts by insertion order)."""
    if isinstance(result, Tensor):
        return [result]
    if isinstance(result, dict):
        result = list(result.values())
    if isinstance(result, (list, tuple)):
        return [t for item in result for t in flatten_result(item)]
    raise TypeError(f"a step must return tensors, got {type(result).__name__}")


@dataclass
class CheckResult:
    """Largest absolute error against the reference, and whether it is acceptable."""

    max_abs_err: float
    scale: float
    ok: bool
    message: str = ""


def compare(result: Any, reference: Any, rtol: float) -> CheckResult:
    """Max abs error; acceptable within ``rtol`` of the reference's largest entry
    (GEMM outputs' rounding error scales with the magnitude of the sums;
    ``ABS_TOL`` only keeps all-zero references meaningful)."""
    got, want = flatten_result(result), flatten_result(reference)
    if len(got) != len(want):
        return CheckResult(float("inf"), 0.0, False, f"{len(got)} outputs, expected {len(want)}")
    err, scale = 0.0, 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            return CheckResult(float("inf"), 0.0, False,
                               f"output {i} has shape {tuple(g.shape)}, expected {tuple(w.shape)}")
        w = w.detach().to(device="cpu", dtype=torch.float64)
        err = max(err, (g.detach().to(device="cpu", dtype=torch.float64) - w).abs().max().item())
        scale = max(scale, w.abs().max().item())
    ok = err <= rtol * scale + ABS_TOL
    return CheckResult(err, scale, ok, "" if ok else f"max abs err {err:.3g} > {rtol:g} x {scale:.3g}")


@dataclass
class VariantResult:
    """Everything measured about one variant of a case. A compiled twin has
    ``compile_s``, or ``not_compiled`` saying why (then nothing else is set);
    ``skipped``: not run here, and why (its baseline's package is missing)."""

    name: str
    check: Optional[CheckResult] = None
    error: Optional[str] = None
    stats: Optional[Stats] = None
    kernels: Optional[KernelCounts] = None
    peak_bytes: Optional[int] = None
    compiled: bool = False
    compile_s: Optional[float] = None
    not_compiled: Optional[str] = None
    skipped: Optional[str] = None


@dataclass
class CaseResult:
    case: Case
    variants: Dict[str, VariantResult] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    floor: Optional[Stats] = None  # the case's vmap floor (CaseSetup.floor)

    def stats(self, variant: str) -> Optional[Stats]:
        v = self.variants.get(variant)
        return v.stats if v is not None else None

    def ratio(self, numerator: str, denominator: str) -> Optional[Stats]:
        """Paired per-repeat time ratios (``paired_ratios``), if both were timed."""
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


def _prepare(v: Variant, vr: VariantResult, reference: Any, device: torch.device) -> bool:
    """Correctness check (which also warms the variant up), kernels, peak memory.
    Returns whether the variant ran."""
    try:
        with v.context():
            vr.check = compare(v.fn(), reference, v.rtol or RTOL)
        vr.kernels = count_kernels(v, device)
        vr.peak_bytes = peak_extra_bytes(v, device)
    except Exception as exc:  # a failing variant must not stop the bench
        vr.error = _error(exc)
        return False
    return True


def _prepare_twin(source: Variant, vr: VariantResult, reference: Any,
                  device: torch.device) -> Optional[Variant]:
    """Compiles the twin of a user-code variant (timed), checks its result, that
    it does not recompile and its peak memory; returns it, or None on a failure.
    Kernels are not counted: Inductor's generated kernels are no ATen ops."""
    vr.compiled = True
    try:
        twin = compiled_twin(source)
        reference = reference if twin.reference is None else twin.reference()
        result, vr.compile_s = compile_now(twin, synchronizer(device))
    except Exception as exc:  # graph break, unsupported op, backend failure
        vr.not_compiled = compile_failure(exc)
        return None
    try:
        vr.check = compare(result, reference, source.rtol or RTOL)
        del result
        check_no_recompile(twin)
        with no_recompile():
            vr.peak_bytes = peak_extra_bytes(twin, device)
    except Exception as exc:
        vr.error = _error(exc)
        return None
    return twin


def run_case(case: Case, device: torch.device, plan: TimingPlan, compiled: bool = False) -> CaseResult:
    """Builds the case; checks each variant against its float64 reference (which
    warms it up), counts its kernels and peak memory; with ``compiled``, the same
    for the twins of the user-code variants; times the variants that ran,
    interleaved, with the case's vmap floor. A failing variant is reported, not timed."""
    result = CaseResult(case)
    setup = case.build(device)
    result.notes.extend(setup.notes)
    for name, why in setup.skipped.items():
        result.variants[name] = VariantResult(name, skipped=why)
    reference = setup.reference()
    runnable: List[Variant] = []
    for v in setup.variants:
        vr = result.variants[v.name] = VariantResult(v.name)
        if _prepare(v, vr, reference if v.reference is None else v.reference(), device):
            runnable.append(v)
    for v in setup.variants if compiled else []:
        if v.user_code or v.compiled is not None:
            name = twin_name(v.name)
            vr = result.variants[name] = VariantResult(name)
            twin = _prepare_twin(v, vr, reference if v.reference is None else v.reference(), device)
            if twin is not None:
                runnable.append(twin)
    del reference
    if runnable:
        floor = [Variant(FLOOR, setup.floor)] if setup.floor is not None else []
        stats = time_interleaved(runnable + floor, plan, synchronizer(device))
        result.floor = stats.pop(FLOOR, None)
        for name, s in stats.items():
            result.variants[name].stats = s
    return result


def measure_vmap_floor(device: torch.device, plan: TimingPlan) -> Stats:
    """Time of ``vmap`` over a function returning its input: the fixed cost
    any vmapped call pays, whatever its body."""
    floor = Variant(FLOOR, vmap_identity((0,), (torch.randn(8, 16, device=device),)))
    return time_interleaved([floor], plan, synchronizer(device))[FLOOR]
