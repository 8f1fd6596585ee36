"""The results tables (text), the JSON record and the speedup plot."""
import json
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .compiled import twin_name
from .runner import CaseResult, VariantResult
from .targets import TargetCheck
from .timing import Stats

STOCK_COMPILED = twin_name("stock")


def fmt_time(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    if abs(seconds) < 1e-3:
        return f"{seconds * 1e6:.1f}us"
    return f"{seconds * 1e3:.2f}ms" if abs(seconds) < 1.0 else f"{seconds:.3f}s"


def fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    scaled = [f"{n / scale:.1f}{unit}" for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10))
              if n >= scale]
    return scaled[0] if scaled else f"{n}B"


def _median(stats: Optional[Stats]) -> Optional[float]:
    return stats.median if stats is not None else None


def variant_numbers(result: CaseResult, vr: VariantResult) -> Dict[str, Any]:
    """Every number of one variant, as stored in the JSON record."""
    s, k, c = vr.stats, vr.kernels, vr.check
    median = s.median if s else None
    # The floor is vmap's: it means something only for the variants that vmap.
    floor = result.floor.median if result.floor and vr.name in ("stock", "batchrules") else None
    return {
        "median_s": median, "q1_s": s.quantile(0.25) if s else None, "q3_s": s.quantile(0.75) if s else None,
        "iqr_s": s.iqr if s else None, "times_s": s.times if s else None,
        # paired per-repeat ratios (timing.paired_ratios), not ratios of medians
        "speedup_vs_stock": _median(result.ratio("stock", vr.name)),
        "speedup_vs_stock_compiled": _median(result.ratio(STOCK_COMPILED, vr.name)) if vr.compiled else None,
        "ratio_to_limit": _median(result.ratio(vr.name, "limit")),
        "above_vmap_floor_s": median - floor if median is not None and floor is not None else None,
        "max_abs_err": c.max_abs_err if c else None, "reference_scale": c.scale if c else None,
        "correct": c.ok if c else False, "check_message": c.message if c else None, "error": vr.error,
        "kernels_per_step": k.per_step if k else None,
        "kernels_per_linear_forward": k.per_linear_forward if k else None,
        "linear_calls": k.linear_calls if k else None,
        "peak_extra_bytes": vr.peak_bytes, "compiled": vr.compiled, "compile_s": vr.compile_s,
        "not_compiled": vr.not_compiled, "skipped": vr.skipped,
    }


COLUMNS = (
    ("case", 30), ("variant", 19), ("median", 10), ("IQR", 6), ("vs stock", 9), ("vs s.comp", 9),
    ("/limit", 7), ("max err", 8), ("k/lin", 6), ("k/step", 7), ("peak mem", 9), ("-floor", 9),
    ("compile", 8),
)


def _row(cells: List[str], columns: Sequence[Tuple[str, int]] = COLUMNS, left: int = 2) -> str:
    """The cells padded to their columns' widths, the first ``left`` left-aligned."""
    widths = [w for _, w in columns]
    return " ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def table(results: List[CaseResult]) -> str:
    """One line per variant: median, spread, ratios, error, kernels, memory
    (the columns are described in the package's docstring)."""
    lines = [_row([name for name, _ in COLUMNS]), "-" * (sum(w for _, w in COLUMNS) + len(COLUMNS))]
    for r in results:
        for i, (name, vr) in enumerate(r.variants.items()):
            case = r.case.name if i == 0 else ""
            if vr.not_compiled is not None or vr.skipped is not None:
                why = vr.not_compiled or f"skipped: {vr.skipped}"
                lines.append(_row([case, name, "-"]) + " " + why)
                continue
            if vr.error is not None:
                lines.append(_row([case, name, "ERROR"]) + " " + vr.error)
                continue
            n = variant_numbers(r, vr)
            err = f"{n['max_abs_err']:.1e}" + ("" if n["correct"] else "!")
            spread = f"{100 * n['iqr_s'] / n['median_s']:.0f}%" if n["median_s"] else "-"
            small = r.case.tier == "small" and n["above_vmap_floor_s"] is not None
            above = fmt_time(n["above_vmap_floor_s"]) if small else ""
            lines.append(_row([
                case, name, fmt_time(n["median_s"]), spread,
                f"{n['speedup_vs_stock']:.2f}x" if n["speedup_vs_stock"] else "-",
                f"{n['speedup_vs_stock_compiled']:.2f}x" if n["speedup_vs_stock_compiled"] else "",
                f"{n['ratio_to_limit']:.2f}" if n["ratio_to_limit"] else "-",
                err,
                "-" if n["kernels_per_linear_forward"] is None else f"{n['kernels_per_linear_forward']:.1f}",
                "-" if n["kernels_per_step"] is None else str(n["kernels_per_step"]),
                fmt_bytes(n["peak_extra_bytes"]), above,
                f"{n['compile_s']:.1f}s" if n["compile_s"] is not None else "",
            ]))
            if not n["correct"]:
                lines.append(f"{'':50}CORRECTNESS FAILURE: {n['check_message']}")
    return "\n".join(lines)


HEADLINE_COLUMNS = (("case", 28), ("stock", 9), ("batchrules", 10), ("vs stock", 8), ("limit", 9),
                    ("br/limit", 8), ("targets", 7), ("other variants (vs stock)", 0))


def _variant_time(vr: Optional[VariantResult]) -> str:
    """The median, marked "!" when the result was wrong; or why there is none."""
    if vr is None:
        return "-"
    if vr.skipped is not None:
        return "skipped"
    if vr.error is not None or vr.not_compiled is not None:
        return "ERROR" if vr.error is not None else "no compile"
    ok = vr.check is not None and vr.check.ok
    return fmt_time(_median(vr.stats)) + ("" if ok else "!")


def _others(result: CaseResult) -> str:
    """The case's variants besides stock, batchrules and limit: median (speedup over stock)."""
    cells = []
    for name, vr in result.variants.items():
        if name not in ("stock", "batchrules", "limit"):
            vs = result.ratio("stock", name)
            cells.append(f"{name} {_variant_time(vr)}" + (f" ({vs.median:.2f}x)" if vs else ""))
    return ", ".join(cells)


def headline_table(results: List[CaseResult], checks: List[TargetCheck]) -> str:
    """One line per case: stock vs batchrules vs the hand-written limit, how many
    of the case's targets were met, and the case's other variants."""
    lines = [_row([name for name, _ in HEADLINE_COLUMNS], HEADLINE_COLUMNS, 1).rstrip(), "-" * 120]
    for r in results:
        mine = [c for c in checks if c.case == r.case.name and c.verdict != "skipped"]
        speedup, to_limit = r.ratio("stock", "batchrules"), r.ratio("batchrules", "limit")
        lines.append(_row([
            r.case.name, _variant_time(r.variants.get("stock")), _variant_time(r.variants.get("batchrules")),
            f"{speedup.median:.2f}x" if speedup else "-", _variant_time(r.variants.get("limit")),
            f"{to_limit.median:.2f}" if to_limit else "-",
            f"{sum(c.verdict == 'met' for c in mine)}/{len(mine)}" if mine else "-", _others(r),
        ], HEADLINE_COLUMNS, 1).rstrip())
    return "\n".join(lines)


def targets_text(checks: List[TargetCheck]) -> str:
    """Targets grouped, with each miss listed."""
    lines = []
    for target in dict.fromkeys(c.target for c in checks):
        group = [c for c in checks if c.target == target]
        met = sum(c.verdict == "met" for c in group)
        noise, skipped = (sum(c.verdict == v for c in group) for v in ("noise", "skipped"))
        noted = (f", {noise} within noise" if noise else "") + (f", {skipped} skipped" if skipped else "")
        lines.append(f"{target}: {met}/{len(group) - skipped} met{noted}")
        for c in group:
            if c.verdict == "skipped":
                lines.append(f"    skipped {c.case:30} {c.detail}")
            elif c.verdict != "met":
                extra = f" ({c.detail})" if c.detail else ""
                lines.append(f"    {c.verdict:7} {c.case:30} {c.value:.3f} vs {c.threshold:.3f}{extra}")
    return "\n".join(lines)


def to_json(results: List[CaseResult], floor: Optional[Stats], checks: List[TargetCheck],
            machine: Dict[str, Any], config: Dict[str, Any]) -> str:
    cases = [{"scenario": r.case.scenario, "size": r.case.size, "tier": r.case.tier,
              "description": r.case.description, "n_linears": r.case.n_linears, "notes": r.notes,
              "vmap_floor_s": r.floor.median if r.floor else None,
              "variants": {name: variant_numbers(r, vr) for name, vr in r.variants.items()}} for r in results]
    return json.dumps({
        "machine": machine, "config": config,
        "vmap_floor": {"median_s": floor.median if floor else None, "iqr_s": floor.iqr if floor else None,
                       "times_s": floor.times if floor else None},
        "cases": cases, "targets": [asdict(c) for c in checks],
        "all_correct": all_correct(results),
    }, indent=1)


def _acceptable(result: CaseResult, vr: VariantResult) -> bool:
    if vr.skipped is not None:
        return True
    if vr.not_compiled is not None:
        # Acceptable only where stock torch.compile fails on the flow too.
        stock = result.variants.get(STOCK_COMPILED)
        return stock is not None and stock.not_compiled is not None
    return vr.error is None and vr.check is not None and vr.check.ok


def all_correct(results: List[CaseResult]) -> bool:
    """Every variant that was not skipped ran and matched the reference; a
    compiled twin may fail to compile only where the stock twin does too (the
    flow, not batchrules, is what torch.compile cannot handle)."""
    return all(_acceptable(r, vr) for r in results for vr in r.variants.values())


BAR_VARIANTS = ("batchrules", "limit", "opacus", "stock_routed", "stock_compiled", "batchrules_compiled")


def plot_speedups(results: List[CaseResult], path: str) -> Optional[str]:
    """Speedup bars per case (matplotlib is optional); returns None, or a
    message when the figure cannot be drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot needs matplotlib (pip install matplotlib); no plot written"
    names = [r.case.name for r in results]
    variants = [v for v in BAR_VARIANTS if any(v in r.variants for r in results)]
    width = 0.8 / max(len(variants), 1)
    fig, ax = plt.subplots(figsize=(max(10.0, 0.6 * len(names)), 5.5))
    for j, variant in enumerate(variants):
        speedups = [_median(r.ratio("stock", variant)) or 0.0 for r in results]
        xs = [i + (j - (len(variants) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, speedups, width, label=variant)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("speedup vs stock torch.func (median paired ratio, log)")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
    ax.legend()
    ax.set_title("batchrules benchmark: higher is faster")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
