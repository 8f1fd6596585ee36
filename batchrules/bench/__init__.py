"""``python -m batchrules.bench``: batchrules against stock torch.func, Opacus and
hand-written code, side by side, in one process.

Every scenario runs the *same* user code (torch.func + ``nn.Linear`` /
``F.linear``) with batchrules routing off ("stock") and on ("batchrules"),
next to what an expert would write without vmap ("limit", ``baselines/``)
and, for per-sample gradients and DP, Opacus ("opacus*", skipped with the
reason when it is not installed). With ``--full`` or ``--compiled`` the same
user code also runs under ``torch.compile`` (fullgraph, Inductor) with routing
off and on: the compiled twins "stock_compiled" and "batchrules_compiled", two separate
compilations (``compiled.py``, Note [Compiled twins]); a flow that does not
compile says why on its row. Every variant is checked against a float64
for-loop reference before it is timed (``max err``); variants are timed
round-robin (``timing.py``) so machine noise hits all of them alike, and
speedups are medians of per-repeat paired ratios.

Usage::

    python -m batchrules.bench                 # headline: one row per workload, ~1 min
    python -m batchrules.bench --quick         # every scenario, named + small sizes
    python -m batchrules.bench --full --device cuda --json out.json --plot out.png
    python -m batchrules.bench --only psg_mlp --threads 1 --budget 5 --compiled
    python -m batchrules.bench --list

The default prints the headline table: per case stock, batchrules and limit
times, batchrules' speedup over stock and its ratio to the limit, how many of
the case's targets were met, and the other variants. Every other mode, and
``--compiled``, adds the table of every variant, whose columns are below.

Layout: the infrastructure (``case``, ``runner``, ``timing``, ``check``,
``kernels``, ``memory``, ``compiled``, ``targets``, ``report``, ``progress``,
``machine``, ``plot``, ``models``) at the top; ``scenarios/``, one module per
workload declaring its cases and their targets; ``baselines/``, the
hand-written limits and the Opacus variants. Also here: ``breakdown`` (where a
vmapped step's time goes), ``dp_overhead`` (clipped_grad's cost above the
non-private step, per recorded layer and per parameter-free op),
``compile_ops`` (extern vs decomposed ops under Inductor) and ``gpu_check``
(the one script for a GPU machine), each run with
``python -m batchrules.bench.<name>``.

Compiled twins: every case with ``--full`` or ``--compiled`` (never by default:
each twin compiles from scratch, caches off, ~10-30 s of CPU per twin on a
2-core machine). A scenario opts its variants in with
``Variant(..., user_code=True)``.

Columns: median and IQR (as % of the median) of seconds per step;
``vs stock`` = time(stock) / time(variant); ``/limit`` = time(variant) /
time(limit); ``k/lin`` = compute kernels per linear forward call and
``k/step`` = per step (``kernels.py``); ``peak mem`` = peak extra bytes of
one step (``memory.py``); ``-floor`` (small sizes) = median minus the case's
vmap floor, the cost of ``vmap`` over a function returning its input, timed
with the case's own inputs (it grows with their number); ``vs s.comp`` =
time(stock_compiled) / time(compiled twin); ``compile`` = seconds of a twin's
first, compiling call (Note [Measuring compile time]), never in ``median``.
``python -m batchrules.bench.breakdown`` splits three steps into torch.func's
layers (vmap, grad, functional_call) to show where the rest of the time goes.
Targets are declared per case by its scenario, evaluated and printed
(``targets.py``), never asserted.
"""
from .case import Case, CaseSetup, Variant

__all__ = ["Case", "CaseSetup", "Variant"]
