"""Counting compute kernels with torch.profiler.

Note [What counts as a compute kernel]
A compute op is an ATen op that is not a view, metadata or allocation op
(mm, addmm, bmm, baddbmm, copy_, add, mul, sum, fill_, clamp_min, ...). A
kernel is a compute op in the profiler's CPU op tree with no compute op
below it: the innermost one, which does the work. Under vmap an op shows up
once per level (the batched ``add`` calls the physical ``add``) and composite
ops (linear, matmul, clone) call others; only the innermost compute op of
each chain is counted, so each count is one kernel launch (on CUDA, roughly
one device kernel). Exception: GEMM, convolution, reduction and scatter ops
do their own work even when they call a helper op first (CPU
``addmm``/``baddbmm`` copy the bias into the output with ``copy_``, then run
the GEMM with beta=1; ``sum`` fills its output, then reduces), so they count
unless another such op is below them. By this rule an
eager ``F.linear`` with bias is 2 kernels on CPU (copy_ + addmm): that is the
floor per linear, and the targets compare against it. The same rule applies
to every variant.

Kernels per linear forward: every outermost ``aten::linear`` (or a direct
``batchrules::linear``) event in the trace is one linear call; its subtree's
compute leaves are charged to it. Copies a linear makes to bring its input's
batch dim into place are therefore charged to that linear. The backward has
no such unambiguous attribution under stock torch.func (its autograd nodes
are those of the decomposition), so it is visible only in kernels per step.
"""
import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile

from .case import Variant

# Leaf ops that launch no compute: views, metadata, allocation, no-op resolves.
NON_COMPUTE = frozenset(
    "aten::" + name
    for name in (
        "view as_strided reshape _reshape_alias _unsafe_view expand expand_as t "
        "transpose permute unsqueeze squeeze movedim moveaxis select slice narrow "
        "alias detach mT numpy_T unflatten flatten split split_with_sizes unbind "
        "chunk diagonal view_as empty empty_like empty_strided resolve_conj "
        "resolve_neg lift_fresh to contiguous result_type size stride sym_size "
        "sym_stride is_nonzero _local_scalar_dense item set_ resize_ "
        "_has_compatible_shallow_copy_type conj _conj"
    ).split()
)

# Ops that do their own work even when they call helpers (see the Note).
WORK_OPS = frozenset(
    "aten::" + name
    for name in (
        "mm addmm bmm baddbmm addbmm mv addmv dot vdot addr _addmm_activation matmul "
        "mkldnn_convolution cudnn_convolution miopen_convolution convolution_backward "
        "_slow_conv2d_forward _slow_conv2d_backward slow_conv_dilated2d _nnpack_spatial_convolution "
        "sum mean prod amax amin norm logsumexp scatter scatter_add index_put_ index_add"
    ).split()
)

LINEAR_OPS = ("aten::linear", "batchrules::linear")


@dataclass
class KernelCounts:
    """Compute kernels of one step, and per linear forward call."""

    per_step: int
    linear_calls: int
    per_linear_forward: Optional[float]
    device_kernels_per_step: Optional[int]


def is_compute_op(event: FunctionEvent) -> bool:
    return event.name.startswith("aten::") and event.name not in NON_COMPUTE


def _count(event: FunctionEvent) -> Tuple[int, bool]:
    # (kernels in the subtree, whether the subtree holds a work op)
    kernels, work_below = 0, False
    for child in event.cpu_children:
        n, w = _count(child)
        kernels, work_below = kernels + n, work_below or w
    is_work = event.name in WORK_OPS
    if is_compute_op(event) and (kernels == 0 or (is_work and not work_below)):
        kernels += 1
    return kernels, work_below or is_work


def kernels_in(event: FunctionEvent) -> int:
    """Kernels in the event's subtree (Note [What counts as a compute kernel])."""
    return _count(event)[0]


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silences the profiler's C++ start/stop chatter on file descriptor 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _has_linear_ancestor(event: FunctionEvent) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in LINEAR_OPS:
            return True
        parent = parent.cpu_parent
    return False


def count_kernels(variant: Variant, device: torch.device) -> KernelCounts:
    """Profiles one (already warmed-up) step of the variant."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with variant.context(), quiet_stderr():
        with profile(activities=activities) as prof:
            variant.fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
    events: List[FunctionEvent] = list(prof.events())
    cpu_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    per_step = sum(kernels_in(e) for e in cpu_events if e.cpu_parent is None)
    linears = [e for e in cpu_events if e.name in LINEAR_OPS and not _has_linear_ancestor(e)]
    per_linear = sum(kernels_in(e) for e in linears) / len(linears) if linears else None
    device_kernels = None
    if device.type == "cuda":
        device_kernels = sum(
            1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA
        )
    return KernelCounts(per_step, len(linears), per_linear, device_kernels)



def eager_linear_kernels(device: torch.device) -> int:
    """Kernels of one eager ``F.linear`` with bias: the floor for one linear."""
    x = torch.randn(8, 16, device=device)
    w, b = torch.randn(4, 16, device=device), torch.randn(4, device=device)
    step = Variant("eager", lambda: torch.nn.functional.linear(x, w, b))
    step.fn()
    return count_kernels(step, device).per_step
