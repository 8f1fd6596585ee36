"""Which ATen compute kernels a call really runs, read from the CPU profiler.

functorch records an op when it is called and again for each op its batching
rule (or decomposition) issues, so the profiler's op tree nests the ops a
transform turned a call into under the call itself. The kernels that ran are
the leaves of that tree among the compute ops below. A GEMM's own internal
copy_/fill_ (e.g. baddbmm initialising its output from the bias) belong to it
and are not counted separately.
"""
from typing import Callable, List, Optional

from torch.profiler import ProfilerActivity, profile

GEMMS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm",
                   "aten::mv", "aten::addmv", "aten::dot", "aten::vdot"})
INTERNAL = frozenset({"aten::copy_", "aten::fill_", "aten::zero_"})
COMPUTE = GEMMS | INTERNAL | frozenset({
    "aten::sum", "aten::add", "aten::add_", "aten::mul", "aten::mul_", "aten::sub",
    "aten::div", "aten::cat", "aten::stack", "aten::neg", "aten::conj_physical",
    "aten::_conj_physical", "aten::index_select", "aten::where"})


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def profile_events(fn: Callable, *args, **kwargs):
    """Runs ``fn`` once to warm up, then once under the CPU profiler; returns its events."""
    fn(*args, **kwargs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args, **kwargs)
    return list(prof.events())


def kernels_from_events(events, within: Optional[str] = None) -> List[str]:
    """Sorted short names (``"bmm"``) of the compute kernels that ran, optionally only
    those issued inside a call of the op named ``within`` (e.g. "batchrules::linear")."""
    # An op that issued compute ops below it was decomposed (or batched) into them.
    decomposed = set()
    for e in events:
        if e.name in COMPUTE - INTERNAL:
            decomposed.update(id(a) for a in _ancestors(e))
    names = []
    for e in events:
        if e.name not in COMPUTE or id(e) in decomposed:
            continue
        ancestors = list(_ancestors(e))
        if any(a.name in COMPUTE and id(a) not in decomposed for a in ancestors):
            continue  # internal to a kernel that ran (a GEMM's output initialisation)
        if within is not None and not any(a.name == within for a in ancestors):
            continue
        names.append(e.name[len("aten::"):])
    return sorted(names)


def ran_kernels(fn: Callable, *args, within: Optional[str] = None, **kwargs) -> List[str]:
    """The compute kernels ``fn(*args, **kwargs)`` runs; see :func:`kernels_from_events`."""
    return kernels_from_events(profile_events(fn, *args, **kwargs), within)
