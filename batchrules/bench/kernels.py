"""Counting compute kernels with torch.profiler.

Note [What counts as a compute kernel]
A compute op is an ATen op that is not a view, metadata or allocation op; a
kernel is a compute op with no compute op below it in the profiler's CPU op
tree (under vmap an op shows once per level, composite ops call others), one
kernel launch each. GEMM, convolution, reduction and scatter ops count even
when they call a helper first (CPU ``addmm`` copies the bias into its output,
``sum`` fills it) unless another such op is below them. So an eager
``F.linear`` with bias is 2 kernels on CPU (copy_ + addmm), the floor per
linear the targets compare against. Per linear forward: the kernels under each
outermost ``aten::linear`` (or ``batchrules::linear``) event, the copies that
bring its input's batch dim into place included; the backward has no such
attribution under stock torch.func, so it shows only in kernels per step.
"""
import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile

from .case import Variant
from .timing import synchronizer

# Leaf ops that launch no compute: views, metadata, allocation, no-op resolves.
NON_COMPUTE = frozenset("aten::" + name for name in (
    "view as_strided reshape _reshape_alias _unsafe_view expand expand_as t transpose permute unsqueeze "
    "squeeze movedim moveaxis select slice narrow alias detach mT numpy_T unflatten flatten split "
    "split_with_sizes unbind chunk diagonal view_as empty empty_like empty_strided resolve_conj resolve_neg "
    "lift_fresh to contiguous result_type size stride sym_size sym_stride is_nonzero _local_scalar_dense "
    "item set_ resize_ _has_compatible_shallow_copy_type conj _conj").split())
# Ops that do their own work even when they call helpers (see the Note).
WORK_OPS = frozenset("aten::" + name for name in (
    "mm addmm bmm baddbmm addbmm mv addmv dot vdot addr _addmm_activation matmul mkldnn_convolution "
    "cudnn_convolution miopen_convolution convolution_backward _slow_conv2d_forward _slow_conv2d_backward "
    "slow_conv_dilated2d _nnpack_spatial_convolution sum mean prod amax amin norm logsumexp scatter "
    "scatter_add index_put_ index_add").split())
LINEAR_OPS = ("aten::linear", "batchrules::linear")


@dataclass
class KernelCounts:
    """Compute kernels of one step, and per linear forward call."""

    per_step: int
    linear_calls: int
    per_linear_forward: Optional[float]


def _count(event: FunctionEvent) -> Tuple[int, bool]:
    """Kernels in the event's subtree (Note [What counts as a compute kernel]),
    and whether the subtree holds a work op."""
    kernels, work_below = 0, False
    for child in event.cpu_children:
        n, w = _count(child)
        kernels, work_below = kernels + n, work_below or w
    is_work = event.name in WORK_OPS
    is_compute = event.name.startswith("aten::") and event.name not in NON_COMPUTE
    if is_compute and (kernels == 0 or (is_work and not work_below)):
        kernels += 1
    return kernels, work_below or is_work


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
    while parent is not None and parent.name not in LINEAR_OPS:
        parent = parent.cpu_parent
    return parent is not None


def count_kernels(variant: Variant, device: torch.device) -> KernelCounts:
    """Profiles one (already warmed-up) step of the variant."""
    with variant.context(), quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        variant.fn()
        synchronizer(device)()
    cpu_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    per_step = sum(_count(e)[0] for e in cpu_events if e.cpu_parent is None)
    linears = [e for e in cpu_events if e.name in LINEAR_OPS and not _has_linear_ancestor(e)]
    per_linear = sum(_count(e)[0] for e in linears) / len(linears) if linears else None
    return KernelCounts(per_step, len(linears), per_linear)


def eager_linear_kernels(device: torch.device) -> int:
    """Kernels of one eager ``F.linear`` with bias: the floor for one linear."""
    x = torch.randn(8, 16, device=device)
    w, b = torch.randn(4, 16, device=device), torch.randn(4, device=device)
    step = Variant("eager", lambda: torch.nn.functional.linear(x, w, b))
    step.fn()
    return count_kernels(step, device).per_step
