"""``python -m batchrules.bench --distributed [--smoke]``: the DP step on 2 gloo
ranks under DDP and FSDP2 against the non-private step under the same wrapper.
Not a scenario: the steps are collectives the ranks must run in the same order.
Each rank (1 thread) holds the transformer of ``examples/dp_sgd.py`` and its share
of a fixed batch, and alternates the non-private step with the DP one (``dp_step``,
one ``all_reduce_flat``; FSDP2: ``fsdp_step``, one ``reduce_scatter_flat``) in
rounds, a barrier before each step (Note [Why interleave]). Targets: each DP step
<= 1.3x its wrapper's non-private step (median of the paired ratios, "noise" when
within their IQR); per-rank peak memory under FSDP2 <= 1.3x the non-private step's.
"""
import copy
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..dp.gc_pause import paused_gc
from .case import Variant
from .machine import steady_malloc
from .memory import peak_extra_bytes
from .timing import Stats, paired_ratios, verdict

WORLD = 2
TIME_RATIO = MEMORY_RATIO = 1.3
TIMEOUT_S = 300.0
PEAK_READINGS = 5


class Sizes(NamedTuple):
    d_model: int = 128
    heads: int = 4
    ff: int = 512
    layers: int = 2
    batch: int = 32  # samples per rank
    repeats: int = 25  # timed steps per variant, interleaved
    warmup: int = 3
    steady_malloc: bool = False  # Note [Steady malloc for timing]


SMOKE = Sizes(d_model=32, ff=64, batch=8, repeats=3, warmup=1)


def _measure(steps: Dict[str, Callable[[], None]], sizes: Sizes) -> Dict[str, Dict[str, Any]]:
    """Each step's seconds per round (interleaved, barrier-aligned) and least peak bytes."""
    for _ in range(sizes.warmup):
        for step in steps.values():
            step()
    names = list(steps)
    times: Dict[str, List[float]] = {name: [] for name in names}
    gc.collect()
    with paused_gc():
        for r in range(sizes.repeats):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                dist.barrier()
                start = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - start)
    out = {}
    for name, step in steps.items():
        # Readings each after a step of its own kind: a step's peak counts the
        # previous step's gradients freed during it. The least of them: FSDP's
        # all-gather input buffers are freed by whichever thread drops gloo's
        # work object last, at times that vary from step to step, so a reading
        # holds them through the step or not.
        peaks = []
        for _ in range(PEAK_READINGS):
            dist.barrier()
            peaks.append(peak_extra_bytes(Variant(name, step), torch.device("cpu")))
        read = [p for p in peaks if p is not None]
        out[name] = {"times_s": times[name], "peak_bytes": min(read) if len(read) == len(peaks) else None}
    return out


def _worker(rank: int, world: int, port: int, sizes: Sizes, out_dir: str) -> None:
    from batchrules.dp import all_reduce_flat
    from batchrules.examples import dp_sgd, dp_sgd_ranks
    dp_sgd_ranks._init(rank, world, port)
    if sizes.steady_malloc:
        steady_malloc()
    config = dp_sgd.DPConfig(model="transformer", examples=world * sizes.batch, sample_rate=1.0,
                             noise_shards=world)
    x, y = dp_sgd.make_data(config)
    x, y = x[rank::world], y[rank::world]

    def model() -> nn.Module:
        torch.manual_seed(0)
        return dp_sgd.TinyTransformer(sizes.d_model, sizes.heads, sizes.ff, sizes.layers)

    def nonprivate(module: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(module(x), y, reduction="sum").backward()
            optimizer.step()
        return step

    ddp = nn.parallel.DistributedDataParallel(model())
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    ddp_noise = dp_sgd.noise_generators(config, [rank])

    def ddp_dp() -> None:
        dp_sgd.dp_step(ddp.module, ddp_opt, x, y, config, ddp_noise, all_reduce_flat, rank)

    sharded = model()
    arch = copy.deepcopy(sharded).to("meta")
    dp_sgd_ranks.shard_model(sharded)
    fsdp_opt = torch.optim.SGD(sharded.parameters(), lr=1e-3)
    fsdp_noise = dp_sgd.noise_generators(config, [rank])[0]

    def fsdp_dp() -> None:
        dp_sgd_ranks.fsdp_step(sharded, arch, fsdp_opt, x, y, config, fsdp_noise, rank)

    results = {
        "ddp": _measure({"nonprivate": nonprivate(ddp, ddp_opt), "dp": ddp_dp}, sizes),
        "fsdp2": _measure({"nonprivate": nonprivate(sharded, fsdp_opt), "dp": fsdp_dp}, sizes),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dp_sgd_ranks._finish()


def table(ranks: List[dict], sizes: Sizes) -> str:
    """Per rank and wrapper: both steps' median time and peak memory, the
    median and IQR of the paired dp/np ratios, and the targets."""
    lines = [f"DP step on {WORLD} gloo ranks, TinyTransformer(d={sizes.d_model}, heads={sizes.heads}, "
             f"ff={sizes.ff}, layers={sizes.layers}), {sizes.batch} samples/rank, float32, 1 thread/rank; "
             f"dp/np: median of {sizes.repeats} paired ratios [IQR]",
             f"{'wrapper':8} {'rank':>4} {'nonprivate ms':>13} {'dp ms':>8} {'dp/np':>6} {'IQR':>11} "
             f"{'np peak MiB':>11} {'dp peak MiB':>11} {'mem ratio':>9}  targets"]
    for wrapper in ("ddp", "fsdp2"):
        for rank, result in enumerate(ranks):
            np_, dp = result[wrapper]["nonprivate"], result[wrapper]["dp"]
            ratios = paired_ratios(Stats(dp["times_s"]), Stats(np_["times_s"]))
            iqr = f"{ratios.quantile(0.25):.2f}-{ratios.quantile(0.75):.2f}"
            # timing.verdict for "at most": on the negated ratios
            time_verdict = verdict(Stats([-r for r in ratios.times]), -TIME_RATIO)
            notes = [f"time <= {TIME_RATIO}x {time_verdict.replace('missed', 'MISSED')}"]
            peaks = (np_["peak_bytes"], dp["peak_bytes"])
            mem = peaks[1] / peaks[0] if peaks[0] and peaks[1] is not None else None
            if mem is not None and wrapper == "fsdp2":
                notes.append(f"memory <= {MEMORY_RATIO}x {'met' if mem <= MEMORY_RATIO else 'MISSED'}")
            mib = ["n/a" if b is None else f"{b / 2**20:.2f}" for b in peaks]
            lines.append(f"{wrapper:8} {rank:>4} {1e3 * statistics.median(np_['times_s']):13.2f} "
                         f"{1e3 * statistics.median(dp['times_s']):8.2f} {ratios.median:6.2f} {iqr:>11} "
                         f"{mib[0]:>11} {mib[1]:>11} {'n/a' if mem is None else f'{mem:.2f}':>9}  "
                         + "; ".join(notes))
    return "\n".join(lines)


def main(smoke: bool, steady: bool) -> int:
    """Runs both wrappers on ``WORLD`` gloo ranks (``smoke``: tiny sizes, 3 repeats:
    numbers are noise; ``steady``: Note [Steady malloc for timing] in each rank)
    and prints the table of their results ``{wrapper: {step: {times_s, peak_bytes}}}``."""
    from batchrules.examples.dp_sgd_ranks import _spawn
    sizes = (SMOKE if smoke else Sizes())._replace(steady_malloc=steady)
    with tempfile.TemporaryDirectory() as out_dir:
        # worker(rank, world, port, sizes, out_dir): _spawn passes its second argument through
        _spawn(_worker, cast(Any, sizes), WORLD, TIMEOUT_S, out_dir)
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(WORLD)]
    print(table(ranks, sizes), flush=True)
    return 0
