"""``python -m batchrules.bench``: batchrules against stock torch.func, Opacus and
hand-written code, side by side, in one process.

Every scenario runs the *same* user code (torch.func + ``nn.Linear`` /
``F.linear``) with batchrules routing off ("stock") and on ("batchrules"),
next to what an expert would write without vmap ("limit", see ``limits.py``)
and, for per-sample gradients, Opacus' hooks ("opacus"). The same user code
also runs under ``torch.compile`` (fullgraph, Inductor) with routing off and on:
the compiled twins "stock_compiled" and "batchrules_compiled", two separate
compilations (``compiled.py``, Note [Compiled twins]); a flow that does not
compile says why on its row. Every variant is checked against a float64
for-loop reference before it is timed (``max err``); variants are timed
round-robin (``timing.py``) so machine noise hits all of them alike, and
speedups are medians of per-repeat paired ratios.

Usage::

    python -m batchrules.bench                 # --quick: named + small sizes
    python -m batchrules.bench --full --device cuda --json out.json --plot out.png
    python -m batchrules.bench --only psg_mlp --threads 1 --budget 5
    python -m batchrules.bench --no-compiled   # eager variants only
    python -m batchrules.bench --list

Compiled twins: every case with ``--full`` and ``--smoke``, the small
(overhead-bound) tier with ``--quick``, as each twin compiles from scratch
(caches off, ~10-30 s of CPU per twin on a 2-core machine); ``--compiled`` /
``--no-compiled`` override. A scenario opts its variants in with
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
Targets are evaluated and printed (``targets.py``), never asserted.
"""
from .case import Case, CaseSetup, Variant

__all__ = ["Case", "CaseSetup", "Variant"]
