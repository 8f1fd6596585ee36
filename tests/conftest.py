"""Shared pytest fixtures and markers for the batchrules test suite.

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
from typing import Dict, Iterator, List, Optional

import pytest
import torch

import batchrules  # noqa: F401  (registers the operators)


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
#   test_bench.py, test_dp_bench.py: their module-scoped fixture runs the benchmark once.
# (pytest.mark.xdist_group with --dist loadgroup does not group with pytest 9 and
# pytest-xdist 3.8: xdist renames item._nodeid, which pytest 9 no longer reads.)
XDIST_GROUPS = {"test_distributed.py": "distributed", "test_dp_ddp.py": "distributed",
                "test_dp_fsdp.py": "distributed",
                "test_bench.py": "test_bench.py", "test_dp_bench.py": "test_dp_bench.py"}


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
    """Why ``name`` cannot be imported (None when it can); cached per session."""
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


def available_devices() -> List[str]:
    """CPU always; CUDA when a GPU is present (tests parametrized over it skip cleanly without)."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def seeded() -> None:
    """Every test starts from the same global RNG state, whatever ran before it
    in its process: under pytest-xdist the tests a worker runs, and their order,
    change from run to run, and unseeded random inputs would change with them."""
    torch.manual_seed(0)


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
