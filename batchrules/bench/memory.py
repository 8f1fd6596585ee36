"""Peak extra memory of one step.

Note [How peak memory is measured]
CUDA: the caching allocator's peak during the step minus what was allocated
before it. CPU: torch keeps no CPU allocator statistics and tracemalloc does not
see its allocations, but the profiler (``profile_memory=True``) records every
allocation of torch's CPU allocator, with its address: the peak over the step
of the bytes the step allocated and has not yet freed, its returned result
included. Frees of blocks allocated before the step are left out: the
profiler reports one only for a block allocated while some earlier profile
ran (it knows no other block's size), and with that block's size even after
malloc handed its address to another, so counting them made the same step's
peak vary from run to run (a user's loop that frees the previous step's
gradients: 57 KB to 1.7 MB). Nor does an earlier step's reference cycle
collected during this one (torch.func leaves some), so on the CPU no
collection (a third of a second in a large process) precedes the step. Both
count tensor storage only.
"""
import gc
from typing import Any, Dict, Iterable, Iterator, Optional

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from .case import Variant
from .kernels import quiet_stderr


def peak_extra_bytes(variant: Variant, device: torch.device) -> Optional[int]:
    """Peak bytes the step allocated beyond what was live before it."""
    with variant.context():
        if device.type == "cuda":
            # an earlier step's reference cycle (torch.func leaves some), were it
            # collected during this step, would lower this step's peak
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            result = variant.fn()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(device) - before
            del result
            return int(peak)
        with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = variant.fn()
        del result
    kineto = getattr(prof.profiler, "kineto_results", None)
    if kineto is None:  # a torch without raw profiler records: report nothing
        return None
    allocations = sorted((e for e in _events(kineto.experimental_event_tree())
                          if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"),
                         key=lambda e: e.start_time_ns)
    live: Dict[int, int] = {}  # address -> bytes of the step's own blocks
    running = peak = 0
    for event in allocations:
        ptr, size = event.extra_fields.ptr, event.extra_fields.alloc_size
        if size > 0:
            live[ptr] = size
            running += size
        elif ptr in live:  # a block of this step's (Note [How peak memory is measured])
            running -= live.pop(ptr)
        peak = max(peak, running)
    return int(peak)


def _events(nodes: Iterable[Any]) -> Iterator[Any]:
    """Every event of the profiler's event tree, depth first."""
    for node in nodes:
        yield node
        yield from _events(node.children)
