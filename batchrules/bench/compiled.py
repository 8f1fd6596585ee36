"""Compiled twins: ``torch.compile`` of the user-code variants.

Note [Compiled twins]
A ``user_code`` variant's twin ``<name>_compiled`` is ``torch.compile(fn,
fullgraph=True)`` (Inductor) of the same step under the same routing state;
a loop that calls ``loss.backward()`` compiles its model instead
(``Variant.compiled``), with ``fullgraph=True`` too.
Routing acts while the transforms are traced and Dynamo neither guards on it nor
caches other than per code object, so each twin compiles a fresh copy of the
step's code object (``fresh_function``): the stock and batchrules twins are two
compilations of one function. A graph break is a failure reported on the row.

Note [Measuring compile time]
A twin's first call (tracing, code generation, compilation, one run) is its
compile time, excluded from the step timings. Caches are disabled and Inductor's
cache directory is a temporary one, so every twin compiles from scratch, after a
warm-up compile paid the process's one-off cost. A second call and the peak-memory
run, under ``fail_on_recompile``, check that nothing compiles while timed.
"""
import contextlib
import os
import tempfile
import time
import types
import warnings
from typing import Any, Callable, ContextManager, Iterator, Tuple, Union
from unittest import mock

import torch

from .case import Variant
from .timing import synchronizer


def twin_name(name: str) -> str:
    return name + "_compiled"


def fresh_function(fn: Callable[..., Any], tag: str) -> types.FunctionType:
    """``fn`` with a code object of its own, so that Dynamo's per-code-object cache
    starts empty for it (same globals, defaults and closure cells)."""
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"a user_code variant's fn must be a plain Python function to be compiled as a "
                        f"twin, got {type(fn).__name__}")
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}__{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def compiled_twin(variant: Variant, backend: Union[str, Callable[..., Any]] = "inductor") -> Variant:
    """The twin of a user-code variant: its step under torch.compile (not compiled
    yet: the first call compiles, see ``compile_now``)."""
    name = twin_name(variant.name)
    if variant.compiled is not None:
        twin = variant.compiled(backend)
        twin.name, twin.routing = name, variant.routing
        return twin
    step = torch.compile(fresh_function(variant.fn, name), fullgraph=True, backend=backend)
    return Variant(name, step, routing=variant.routing)


def compile_now(twin: Variant, sync: Callable[[], None]) -> Tuple[Any, float]:
    """Compiles the twin by calling it once with caches disabled; returns the
    step's result and the wall seconds the call took (Note [Measuring compile time])."""
    with twin.context(), mock.patch.object(torch.compiler.config, "force_disable_caches", True), \
            warnings.catch_warnings():
        # Dynamo says once that disabling caches disables its profile-guided dynamism too.
        warnings.filterwarnings("ignore", message=".*force disabled by")
        sync()
        start = time.perf_counter()
        result = twin.fn()
        sync()
        return result, time.perf_counter() - start


def no_recompile() -> ContextManager[None]:
    """Within the block, a call of a compiled twin that would compile anew raises."""
    return torch.compiler.set_stance("fail_on_recompile")


def check_no_recompile(twin: Variant) -> None:
    """Calls the compiled twin again; raises if that would compile anew."""
    with twin.context(), no_recompile():
        twin.fn()


def compile_failure(exc: BaseException) -> str:
    """One line saying why compilation failed (a first line that only announces
    the reason, like Inductor's "backend='inductor' raised:", gets the next one)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reason = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else "".join(lines[:1])
    return f"did not compile: {type(exc).__name__}: {reason}"


def warm_up_compiler(device: torch.device) -> float:
    """Compiles and runs a small function once, so that the one-off cost of the
    process's first compilation is not charged to the first twin. Returns seconds."""
    def warm_up(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w).sum(0)

    x, w = torch.randn(8, 16, device=device), torch.randn(16, 4, device=device)
    compiled = torch.compile(fresh_function(warm_up, "warm_up"), fullgraph=True)
    step = Variant("warm-up", lambda: compiled(x, w))
    return compile_now(step, synchronizer(device))[1]


@contextlib.contextmanager
def private_inductor_cache() -> Iterator[str]:
    """Points Inductor's cache directory at a temporary one for the block (removed
    afterwards), so the run neither reads nor fills the user's cache."""
    with tempfile.TemporaryDirectory(prefix="batchrules_bench_inductor_") as path, \
            mock.patch.dict(os.environ, TORCHINDUCTOR_CACHE_DIR=path):
        yield path
