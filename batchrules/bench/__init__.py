"""``python -m batchrules.bench``: batchrules against stock torch.func, Opacus and
hand-written code, side by side, in one process.

Every scenario runs the *same* user code (torch.func + ``nn.Linear`` / ``F.linear``)
with batchrules routing off ("stock") and on ("batchrules"), next to what an expert
writes without vmap ("limit", ``baselines/``) and, for per-sample gradients and DP,
Opacus ("opacus*", skipped with the reason when it is not installed); with ``--full``
or ``--compiled`` also under ``torch.compile`` (Note [Compiled twins]). Every variant
is checked against a float64 reference, then timed round-robin (Note [Why
interleave]); speedups are medians of per-repeat paired ratios. Each case's targets
are printed (met / missed / within noise), never asserted.

Usage::

    python -m batchrules.bench                 # headline: one row per workload, about 40 s
    python -m batchrules.bench --quick         # every scenario, named + small sizes
    python -m batchrules.bench --full --device cuda --json out.json --plot out.png
    python -m batchrules.bench --only psg_mlp --threads 1 --budget 5 --compiled
    python -m batchrules.bench --distributed   # the DP step under DDP and FSDP2, 2 gloo ranks
    python -m batchrules.bench --gpu-check OUT_DIR   # on a GPU machine: CUDA tests + bench

The table of every variant (every mode but the headline, or with --compiled):
median and IQR of seconds per step; ``vs stock`` = time(stock) / time(variant);
``/limit`` = time(variant) / time(limit); ``k/lin``, ``k/step``: compute kernels
per linear forward and per step (Note [What counts as a compute kernel]); ``peak
mem`` (Note [How peak memory is measured]); ``-floor`` (small sizes): the median
minus the case's vmap floor (``vmap`` of a function returning its input); ``vs
s.comp`` = time(stock_compiled) / time(twin); ``compile``: seconds of a twin's
compiling call (Note [Measuring compile time]).
"""
