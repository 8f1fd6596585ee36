"""``python -m batchrules.bench``: batchrules against stock torch.func, Opacus and
hand-written code, side by side, in one process.

Every scenario runs the *same* user code (torch.func + ``nn.Linear`` /
``F.linear``) with batchrules routing off ("stock") and on ("batchrules"), next
to what an expert writes without vmap ("limit", ``baselines/``) and, for
per-sample gradients and DP, Opacus ("opacus*", skipped with the reason when it
is not installed). With ``--full`` or ``--compiled`` the user code also runs
under ``torch.compile`` ("stock_compiled", "batchrules_compiled": Note [Compiled
twins]). Every variant is checked against a float64 reference before it is
timed; variants are timed round-robin (Note [Why interleave]) and speedups are
medians of per-repeat paired ratios. Targets are declared per case by its
scenario and printed (met / missed / within noise), never asserted.

Usage::

    python -m batchrules.bench                 # headline: one row per workload, about 40 s
    python -m batchrules.bench --quick         # every scenario, named + small sizes
    python -m batchrules.bench --full --device cuda --json out.json --plot out.png
    python -m batchrules.bench --only psg_mlp --threads 1 --budget 5 --compiled
    python -m batchrules.bench --distributed   # the DP step under DDP and FSDP2, 2 gloo ranks
    python -m batchrules.bench --gpu-check OUT_DIR   # on a GPU machine: CUDA tests + bench

Columns of the table of every variant (every mode but the headline, or with
``--compiled``): median and IQR (% of the median) of seconds per step; ``vs
stock`` = time(stock) / time(variant); ``/limit`` = time(variant) / time(limit);
``k/lin`` and ``k/step``: compute kernels per linear forward call and per step
(Note [What counts as a compute kernel]); ``peak mem``: peak extra bytes of one
step (Note [How peak memory is measured]); ``-floor`` (small sizes): the median
minus the case's vmap floor (``vmap`` over a function returning its input, with
the case's inputs); ``vs s.comp`` = time(stock_compiled) / time(twin);
``compile``: seconds of a twin's compiling call (Note [Measuring compile time]).

Layout: the infrastructure at the top (``case``, ``runner``, ``timing``,
``check``, ``kernels``, ``memory``, ``compiled``, ``targets``, ``report``);
``scenarios/``, one module per workload with its cases and targets;
``baselines/``, the hand-written limits and the Opacus variants;
``distributed`` and ``gpu_check``, the jobs of ``--distributed`` and ``--gpu-check``.
"""
from .case import Case, CaseSetup, Variant

__all__ = ["Case", "CaseSetup", "Variant"]
