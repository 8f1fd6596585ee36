"""Shared pytest fixtures, helpers and markers for the batchrules test suite.

Markers (registered in pyproject.toml):
  slow                 a test that takes seconds; each one says why it is worth it.
                       ``-m "not slow"`` deselects them for a quick local loop.
  thorough             a property test's longer run: skipped unless ``--thorough``.
  requires(*modules)   needs optional packages (Opacus, transformers, ...): skipped,
                       with the reason, when one of them cannot be imported. The
                       suite passes with the required dependencies alone.

Under pytest-xdist (``-n N``, as README command 2 runs the suite) each worker gets
an equal share of the cores for torch's intra-op threads, so N workers do not
oversubscribe the machine, and the tests of each XDIST_GROUPS group run on one worker.
"""
import contextlib
import importlib
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import batchrules
from batchrules.dp import clipping, transform


def _xdist_worker_threads() -> Optional[int]:
    """torch threads for this process when it is one of several xdist workers."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "PYTEST_XDIST_WORKER" not in os.environ:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // int(workers))


_threads = _xdist_worker_threads()
if _threads is not None:
    torch.set_num_threads(_threads)


# Under pytest-xdist, the tests of each group below run on one worker, one after
# the other; every other test goes to whichever worker is free (xdist's --dist load).
#   distributed: each test spawns 2 ranks; two such tests at once would oversubscribe
#     a 2-core machine (and test_distributed's module-scoped fixture runs once).
#   test_bench.py: its module-scoped fixture runs the benchmark once.
# (pytest.mark.xdist_group with --dist loadgroup does not group with pytest 9 and
# pytest-xdist 3.8: xdist renames item._nodeid, which pytest 9 no longer reads.)
XDIST_GROUPS = {"test_distributed.py": "distributed", "test_dp_ddp.py": "distributed",
                "test_dp_fsdp.py": "distributed",
                "test_bench.py": "test_bench.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's default scheduling, except that XDIST_GROUPS stay together."""
    if config.getvalue("dist") != "load":
        return None  # an explicit other --dist
    from xdist.scheduler import LoadScopeScheduling

    class LoadKeepingGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
            return XDIST_GROUPS.get(module, nodeid)

    return LoadKeepingGroups(config, log)


_import_errors: Dict[str, Optional[str]] = {}


def missing_module(name: str) -> Optional[str]:
    """Why ``name`` cannot be imported (None when it can); cached per process."""
    if name not in _import_errors:
        try:
            importlib.import_module(name)
            _import_errors[name] = None
        except ImportError as e:
            _import_errors[name] = f"{type(e).__name__}: {e}"
    return _import_errors[name]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--thorough", action="store_true",
                     help="run the property tests' longer runs (marker 'thorough')")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("thorough") and not item.config.getoption("--thorough"):
        pytest.skip("a longer run: pytest --thorough")
    for marker in item.iter_markers("requires"):
        for name in marker.args:
            why = missing_module(name)
            if why is not None:
                pytest.skip(f"needs the optional package {name!r} ({why}); "
                            f"pip install {marker.kwargs.get('pip', name)}")


# The distributed tests: 2 gloo ranks, each its own process, under a wall-clock deadline (a
# hung collective fails the test instead of hanging CI); one xdist worker runs
# them (XDIST_GROUPS).
WORLD = 2
DEADLINE_S = 180.0
DISTRIBUTED = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                  reason="torch.distributed with gloo is not available"),
               # slow: each test runs 2 ranks, each its own process; the only run of the
               # rules across real process groups (DDP all-reduce, DTensor sharding).
               pytest.mark.slow]


# Note [Child processes from a preloaded fork server]
# Some tests need processes of their own: distributed ranks, and cases that once
# ended the process (a crash must fail one test, not the run). A fresh interpreter
# spends seconds importing torch (more with a CUDA build); these children are
# forked instead from multiprocessing's fork server, which imports torch,
# batchrules and hypothesis once per pytest process and then only forks: it never
# runs a kernel, so no thread (OpenMP's pool included) exists to be lost in the
# fork. A child sees the environment and sys.path its server started with.
# Where there is no fork server (Windows), children are spawned.
if "forkserver" in mp.get_all_start_methods():
    CHILDREN = mp.get_context("forkserver")
    CHILDREN.set_forkserver_preload(["torch", "batchrules", "hypothesis"])
else:
    CHILDREN = mp.get_context("spawn")


def _report_failure(report: str, target: Callable[..., None], args: Tuple[Any, ...]) -> None:
    try:
        target(*args)
    except BaseException:
        Path(report).write_text(traceback.format_exc())
        sys.exit(1)


def run_in_child(target: Callable[..., None], *args: Any, timeout: float) -> Tuple[int, str]:
    """``target(*args)`` in a child process (Note [Child processes from a preloaded
    fork server]): its exit code (negative: the signal that ended it) and, where it
    raised, the traceback. ``target`` must be importable by name."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "failure.txt"
        child = CHILDREN.Process(target=_report_failure, args=(str(report), target, args))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            pytest.fail(f"{target.__name__}{args} still running after {timeout} s")
        return child.exitcode, report.read_text() if report.exists() else ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker: Callable[..., None], *args: object) -> None:
    """Run ``worker(rank, port, *args)`` on WORLD processes; fail on error or deadline.
    See Note [Child processes from a preloaded fork server]."""
    context = mp.start_processes(worker, args=(free_port(), *args), nprocs=WORLD, join=False,
                                 start_method=CHILDREN.get_start_method())
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=1.0):  # raises if a rank failed (and stops the others)
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"distributed workers still running after {DEADLINE_S}s")


def root_cause(exc: BaseException) -> BaseException:
    """The first exception of ``exc``'s chain: a user error raised while
    Dynamo or AOTAutograd traced, under the exceptions they wrap it in."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return exc


def available_devices() -> List[str]:
    """CPU always; CUDA when a GPU is present (tests parametrized over it skip cleanly without)."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def seeded() -> None:
    """Every test starts from the same global RNG state, whatever ran before it
    in its process: under pytest-xdist the tests a worker runs, and their order,
    change from run to run, and unseeded random inputs would change with them."""
    torch.manual_seed(0)


def params_of(model: nn.Module) -> Dict[str, Tensor]:
    """A module's parameters, detached, by name: what functional_call takes."""
    return {k: p.detach() for k, p in model.named_parameters()}


def assert_close(actual: Any, expected: Any, msg: str = "", **tol: Any) -> None:
    """torch.testing.assert_close on tensors or pytrees of them (structure,
    shapes, dtypes, values; ``tol``: its keyword arguments), ``msg`` leading
    the failure's message."""
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{msg}\n{m}" if msg else m, **tol)


@contextlib.contextmanager
def vmap_fallback_off() -> Iterator[None]:
    """functorch's slow per-example fallback off, so a missing batching rule
    fails loudly; restored afterwards."""
    previous = torch._C._functorch._is_vmap_fallback_enabled()
    torch._C._functorch._set_vmap_fallback_enabled(False)
    try:
        yield
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(previous)


@pytest.fixture
def no_vmap_fallback() -> Iterator[None]:
    with vmap_fallback_off():
        yield


@pytest.fixture
def routing_off() -> Iterator[None]:
    """Run with batchrules routing disabled, restoring the previous state after."""
    with batchrules.enabled(False):
        yield


@pytest.fixture
def routing_on() -> Iterator[None]:
    """Run with batchrules routing enabled, restoring the previous state after."""
    with batchrules.enabled(True):
        yield


@pytest.fixture(params=[False, True], ids=["routing_off", "routing_on"])
def routing(request) -> Iterator[bool]:
    """Run once with routing off and once on (a test's own parametrize of
    ``routing`` takes precedence), restoring the previous state after."""
    with batchrules.enabled(request.param):
        yield request.param


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Start and leave with dynamo's caches empty, so compiled graphs of one test
    (compiled under one routing state) are never reused by another."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def kinds(monkeypatch: pytest.MonkeyPatch) -> Dict[str, str]:
    """The kind (dp/clipping.py) each parameter of the last clipped_grad call took."""
    seen: Dict[str, str] = {}
    original = clipping.kind

    def record(param: Any) -> str:
        key = param.name[param.name.index("['") + 2:param.name.rindex("']")]  # argument 0['key']
        seen[key] = original(param)
        return seen[key]

    monkeypatch.setattr(clipping, "kind", record)
    return seen


class Shapes(TorchDispatchMode):
    """The shape of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: List[Tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, Tensor)]
        return out


@pytest.fixture
def clip_shapes(monkeypatch: pytest.MonkeyPatch) -> List[Tuple[int, ...]]:
    """The shapes of the tensors formed by clipped_grad's clip step (norms and sums)."""
    mode = Shapes()
    original = transform.clip

    def clip(*args: Any, **kwargs: Any) -> Any:
        with mode:
            return original(*args, **kwargs)

    monkeypatch.setattr(transform, "clip", clip)
    return mode.shapes
