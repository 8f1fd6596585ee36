"""Speedup bars per case (matplotlib is optional)."""
from typing import List, Optional

from .runner import CaseResult

BAR_VARIANTS = ("batchrules", "limit", "opacus", "stock_routed", "stock_compiled", "batchrules_compiled")


def plot_speedups(results: List[CaseResult], path: str) -> Optional[str]:
    """Writes the figure; returns None, or a message when it cannot be drawn."""
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
        speedups = []
        for r in results:
            ratios = r.ratio("stock", variant)
            speedups.append(ratios.median if ratios is not None else 0.0)
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
