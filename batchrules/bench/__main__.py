"""CLI of ``python -m batchrules.bench``; see ``--help`` and the package's docstring."""
import argparse
import contextlib
import dataclasses
import itertools
import sys
import time
import warnings
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from . import distributed, gpu_check
from .baselines.opacus_variants import opacus_missing_reason
from .case import TIERS
from .compiled import compile_failure, private_inductor_cache, warm_up_compiler
from .kernels import eager_linear_kernels
from .machine import machine_info, overloaded, steady_malloc
from .report import all_correct, headline_table, plot_speedups, table, targets_text, to_json
from .runner import RTOL, CaseResult, measure_vmap_floor, run_case
from .scenarios import all_cases
from .targets import evaluate
from .timing import TimingPlan

# Per-variant blocks of ~block_s; repeats fill budget_s per case within bounds. The
# check and profiling runs already warmed every variant up.
PLANS = {
    "smoke": TimingPlan(block_s=0.002, budget_s=0.1, min_repeats=3, max_repeats=3, warmup_calls=1),
    "headline": TimingPlan(block_s=0.01, budget_s=0.5, min_repeats=5, max_repeats=15, warmup_calls=0),
    "quick": TimingPlan(block_s=0.01, budget_s=1.0, min_repeats=5, max_repeats=25, warmup_calls=0),
    "full": TimingPlan(block_s=0.05, budget_s=10.0, min_repeats=15, max_repeats=200, warmup_calls=3),
}


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m batchrules.bench", description=(
        "batchrules vs stock torch.func, Opacus and hand-written code; by default one row per workload, "
        "eager only (about 40 s)."))
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="every scenario at its named and small sizes, short timing (~3 min on 2 cores)")
    size.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="all sizes, long timing, compiled twins of every case (an hour on 2 cores)")
    size.add_argument("--smoke", dest="mode", action="store_const", const="smoke",
                      help="smallest sizes, minimal timing: checks the bench runs, numbers are noise")
    p.set_defaults(mode="headline")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--only", action="append", metavar="NAME",
                   help="run the cases whose scenario/size contains NAME (repeatable)")
    p.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=None,
                   help="add torch.compile'd twins of the user code to every case (default: with --full "
                        "only); each compiles from scratch, ~10-30 s on 2 cores, reported, not timed")
    p.add_argument("--threads", type=int,
                   help="torch.set_num_threads before running (default: torch's, or 1 when the load "
                        "average exceeds the CPU count)")
    p.add_argument("--steady-malloc", action="store_true",
                   help="fix glibc malloc's mmap and trim thresholds, as jemalloc or tcmalloc do: "
                        "steadier runs (Note [Steady malloc for timing]); off by default, as most users run")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help="timing budget per case (overrides the mode's; repeats stay within its bounds)")
    p.add_argument("--json", metavar="PATH", help="write every number and machine info as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="draw speedup bars per case (needs matplotlib)")
    job = p.add_mutually_exclusive_group()
    job.add_argument("--list", action="store_true", help="list the cases of the mode and exit")
    job.add_argument("--distributed", action="store_true",
                     help="instead of the cases: the DP step under DDP and FSDP2 on 2 gloo ranks against "
                          "the non-private step, time and per-rank memory (with --smoke: tiny sizes)")
    job.add_argument("--gpu-check", metavar="OUT_DIR", type=Path,
                     help="instead of the cases, on a GPU machine: the CUDA tests and the headline bench "
                          "on cuda, logs and summary.json in OUT_DIR (under 4 minutes)")
    return p.parse_args(argv)


def compiled_tiers(mode: str, compiled: Optional[bool]) -> Sequence[str]:
    """Every tier with --full or --compiled (``compiled``: the --[no-]compiled flag), none otherwise."""
    return TIERS if (mode == "full" if compiled is None else compiled) else ()


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.distributed:
        return distributed.main(args.mode == "smoke", args.steady_malloc)
    if args.gpu_check:
        return gpu_check.main(args.gpu_check)
    cases = all_cases(args.mode)
    if args.only:
        cases = [c for c in cases if any(o in c.name for o in args.only)]
    tiers = compiled_tiers(args.mode, args.compiled)
    if args.list:
        for c in cases:
            print(f"{c.name:32} {c.tier:7} {'compiled' if c.tier in tiers else 'eager   '} {c.description}")
        return 0
    if not cases:
        print(f"no case matches --only {args.only}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available in this torch build", file=sys.stderr)
        return 2
    if device.type == "cuda":  # full fp32, so every variant is checked at the same precision
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    load = overloaded()
    # Multi-threaded torch stalls whenever one of its threads is descheduled:
    # on an overloaded machine one thread is both faster and steadier.
    if args.threads or load is not None:
        torch.set_num_threads(args.threads or 1)
    torch.manual_seed(0)
    # Stock vmap runs SDPA through functorch's per-example fallback and says so on
    # every call; that fallback is what the stock rows measure.
    warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet "
                                              "implemented the batching rule")

    machine = machine_info(device)
    machine["steady_malloc"] = args.steady_malloc and steady_malloc()
    note = opacus_missing_reason()
    print(f"batchrules bench ({args.mode}) on {device}: torch {machine['torch']}, "
          f"{machine['torch_threads']} threads, {machine['cpu']}; load {machine['load_average_1m_5m_15m']}"
          f"{'; glibc malloc thresholds fixed' if machine['steady_malloc'] else ''}")
    if load is not None:
        threads = "" if args.threads else "; running on 1 thread (--threads N overrides)"
        print(f"warning: load average {load:.1f} exceeds the {machine['cpu_count']} CPUs: timings are "
              f"unreliable{threads}")
    if note:
        print(f"note: {note}: the Opacus variants are skipped. Install it with `pip install opacus` "
              "(its deps are scipy and opt_einsum; check with --dry-run that it leaves torch alone)")

    plan = PLANS[args.mode]
    plan = plan if args.budget is None else dataclasses.replace(plan, budget_s=args.budget)
    start = time.perf_counter()
    any_compiled = any(c.tier in tiers for c in cases)
    steps = len(cases) + 1 + int(any_compiled)
    finished = itertools.count(1)

    def progress(name: str) -> None:
        """One line per finished step, on stderr: stdout keeps the tables."""
        print(f"[{next(finished)}/{steps}] {name} ({time.perf_counter() - start:.0f}s)", file=sys.stderr,
              flush=True)

    floor = measure_vmap_floor(device, plan)
    progress("vmap floor")
    results: List[CaseResult] = []
    warm_up_s, compile_broken = None, None
    with private_inductor_cache() if any_compiled else contextlib.nullcontext():
        if any_compiled:
            try:
                warm_up_s = warm_up_compiler(device)
            except Exception as exc:  # no C++ compiler, broken Inductor install, ...
                compile_broken = compile_failure(exc)
                tiers, any_compiled = (), False
            progress("compile warm-up")
        for case in cases:
            results.append(run_case(case, device, plan, compiled=case.tier in tiers))
            progress(case.name)

    linear_floor = eager_linear_kernels(device)
    checks = evaluate(results, linear_floor)
    print()
    if compile_broken:
        print(f"note: no compiled twins were run, the compiler warm-up {compile_broken}\n")
    if any_compiled:
        print(f"compiled twins (tiers: {', '.join(tiers)}): torch.compile(fullgraph=True), Inductor, "
              f"caches off (every twin compiles from scratch); compile = wall time of the first call, "
              f"excluded from the timings; one-off compiler warm-up {warm_up_s:.1f}s\n")
    if args.mode != "headline" or any_compiled:  # the compile times are in this table
        print(f"vmap floor (vmap over identity of one tensor): {floor.median * 1e6:.1f}us "
              f"(IQR {floor.iqr * 1e6:.1f}us); each case's own, for its inputs, is in -floor\n")
        print(table(results))
        print(f"(k/lin: kernels per linear forward call; an eager F.linear with bias is {linear_floor} "
              "here)\n")
    print(headline_table(results, checks))
    print("\nTargets (measured, not asserted):")
    print(targets_text(checks))
    ok = all_correct(results)
    verdict = ("all variants match the float64 reference" if ok
               else "SOME VARIANTS FAILED (see !, ERROR and did-not-compile rows)")
    print(f"\n{verdict}; {time.perf_counter() - start:.0f}s")
    if args.json:
        machine["load_average_at_end"] = machine_info(device)["load_average_1m_5m_15m"]
        machine["eager_linear_kernels"] = linear_floor
        config = {"mode": args.mode, "device": str(device), "only": args.only, "rtol": RTOL,
                  "timing_plan": vars(plan), "argv": sys.argv[1:] if argv is None else argv,
                  "compiled": {"tiers": list(tiers), "fullgraph": True, "backend": "inductor",
                               "caches": "disabled (torch.compiler.config.force_disable_caches)",
                               "compile_time": "wall time of the first call",
                               "warm_up_s": warm_up_s, "warm_up_error": compile_broken}}
        with open(args.json, "w") as f:
            f.write(to_json(results, floor, checks, machine, config))
        print(f"wrote {args.json}")
    if args.plot:
        print(plot_speedups(results, args.plot) or f"wrote {args.plot}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
