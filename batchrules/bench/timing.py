"""Interleaved wall-clock timing: round-robin over variants, one block each.

Note [Why interleave]
On a shared machine the load drifts over seconds; timing variant A for a while
and then B charges the drift to whichever ran during the busy spell. Every
repeat times one block of each variant back to back, in an order that rotates,
so drift hits all alike, and ratios are taken per repeat (``paired_ratios``).
A block starts with one untimed call of its own variant: straight after another
variant's block, its first call would find that one's leftovers in the caches
and the allocator, while a training loop runs each step after its own previous one.
"""
import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

import torch

from ..dp.gc_pause import paused_gc
from .case import Variant


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What to call before reading the clock so queued device work is counted."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


@dataclass
class Stats:
    """Per-call seconds of every repeat (or per-repeat ratios), with robust summaries."""

    times: List[float]

    def quantile(self, q: float) -> float:
        ordered = sorted(self.times)
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def iqr(self) -> float:
        return self.quantile(0.75) - self.quantile(0.25)


def paired_ratios(numerator: Stats, denominator: Stats) -> Stats:
    """Per-repeat ratios of two variants timed in the same rounds: blocks of one
    repeat ran back to back, so their ratio cancels the drift between repeats;
    the median is the estimate, the IQR its uncertainty."""
    return Stats([n / d for n, d in zip(numerator.times, denominator.times)])


def time_block(variant: Variant, calls: int, sync: Callable[[], None]) -> float:
    """Seconds per call over ``calls`` back-to-back calls of the variant,
    after one untimed call (Note [Why interleave])."""
    with variant.context():
        variant.fn()
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            variant.fn()
        sync()
        return (time.perf_counter() - start) / calls


@dataclass
class TimingPlan:
    """How long to time: blocks of ~block_s each, repeats within budget_s."""

    block_s: float
    budget_s: float
    min_repeats: int
    max_repeats: int
    warmup_calls: int = 2


def time_interleaved(variants: Sequence[Variant], plan: TimingPlan,
                     sync: Callable[[], None]) -> Dict[str, Stats]:
    """Times every variant round-robin (Note [Why interleave]), the garbage
    collector off. Each variant is warmed up, then one call sizes its block; the
    number of repeats fits all blocks into ``plan.budget_s`` within the plan's bounds."""
    calls: Dict[str, int] = {}
    round_s = 0.0
    for v in variants:
        with v.context():  # untimed warm-up calls
            for _ in range(plan.warmup_calls):
                v.fn()
        one = max(time_block(v, 1, sync), 1e-9)
        calls[v.name] = max(1, int(plan.block_s / one))
        round_s += calls[v.name] * one
    repeats = int(min(plan.max_repeats, max(plan.min_repeats, plan.budget_s / max(round_s, 1e-9))))
    times: Dict[str, List[float]] = {v.name: [] for v in variants}
    gc.collect()
    with paused_gc():
        for r in range(repeats):
            shift = r % len(variants)
            for v in [*variants[shift:], *variants[:shift]]:
                times[v.name].append(time_block(v, calls[v.name], sync))
    return {name: Stats(t) for name, t in times.items()}


def verdict(ratios: Stats, threshold: float) -> str:
    """"met" when the median of the paired ratios reaches ``threshold``, "noise"
    when only their upper quartile does (the miss is within their spread), else "missed"."""
    if ratios.median >= threshold:
        return "met"
    return "noise" if ratios.quantile(0.75) >= threshold else "missed"
