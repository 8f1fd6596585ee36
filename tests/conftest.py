"""Shared pytest fixtures for the batchrules test suite."""
from typing import Iterator, List

import pytest
import torch

import batchrules  # noqa: F401  (registers the operators)


def available_devices() -> List[str]:
    """CPU always; CUDA when a GPU is present (tests parametrized over it skip cleanly without)."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def no_vmap_fallback() -> Iterator[None]:
    """Disable functorch's slow per-example fallback so a missing batching rule fails loudly."""
    previous = torch._C._functorch._is_vmap_fallback_enabled()
    torch._C._functorch._set_vmap_fallback_enabled(False)
    try:
        yield
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(previous)


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


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Start and leave with dynamo's caches empty, so compiled graphs of one test
    (compiled under one routing state) are never reused by another."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
