"""What the numbers were measured on, and the allocator they were measured with."""
import ctypes
import ctypes.util
import os
import platform
from pathlib import Path
from typing import Any, Dict, Optional

import torch

import batchrules


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def overloaded() -> Optional[float]:
    """The 1-minute load average when it exceeds the CPU count, else None."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return load if load > (os.cpu_count() or 1) else None


# Note [Steady malloc for timing]
# torch's CPU allocator takes every tensor from malloc. glibc serves a large block
# by mmap and, on freeing it, raises its thresholds or trims the heap: whether a
# step's large temporaries arrive as fresh pages to fault in depends on what ran
# before, so a kernel's time varies between runs. Fixing both thresholds (as
# jemalloc/tcmalloc, which torch's CPU tuning guide recommends, do) makes every
# variant pay the same. It also makes stock vmap(grad)'s large per-sample
# gradients much cheaper, so it is a flag, off by default: the default run
# measures what a user's default environment gets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD, _TRIM_THRESHOLD = 32 << 20, 256 << 20


def steady_malloc() -> bool:
    """Fixes glibc's mmap and trim thresholds (Note [Steady malloc for
    timing]); False where malloc is not glibc's."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))


def machine_info(device: torch.device) -> Dict[str, Any]:
    """Versions, threads, CPU, device and load: enough to judge the numbers."""
    info: Dict[str, Any] = {
        "torch": torch.__version__,
        "batchrules": batchrules.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "load_average_1m_5m_15m": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    try:
        import opacus
        info["opacus"] = opacus.__version__
    except ImportError:
        info["opacus"] = None
    return info
