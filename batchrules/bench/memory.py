"""Peak extra memory of one step.

Note [How peak memory is measured]
CUDA: the caching allocator's peak during the step minus what was allocated
before it. CPU: torch keeps no CPU allocator statistics and tracemalloc does not
see its allocations, but the profiler (``profile_memory=True``) records every
allocation and free of torch's CPU allocator: the peak of their running sum over
the step, its returned result included. Both count tensor storage only.
"""
import gc
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile

from .case import Variant
from .kernels import quiet_stderr


def peak_extra_bytes(variant: Variant, device: torch.device) -> Optional[int]:
    """Peak bytes the step allocated beyond what was live before it."""
    # torch.func leaves reference cycles behind; were an earlier step's cycle
    # (and tensors it keeps alive) collected during this step, its memory
    # would be subtracted from this step's peak.
    gc.collect()
    with variant.context():
        if device.type == "cuda":
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
    records = [e for e in kineto.events()
               if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    running = peak = 0
    for record in sorted(records, key=lambda e: e.start_ns()):
        running += record.nbytes()
        peak = max(peak, running)
    return int(peak)
