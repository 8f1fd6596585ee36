"""Opt-in routing of ``F.linear`` / ``nn.Linear`` under torch.func transforms.

While enabled, ``aten::linear`` called under any ``torch.func`` transform (vmap,
grad, vjp, jvp, jacrev, jacfwd, hessian, functional_call inside them) runs
``batchrules::linear``. Eager code outside transforms is untouched: the kernel
lives on a dispatch key that is only active inside transforms.

The switch is process-wide (it changes the dispatcher's kernel table), not
per-thread; it is safe to flip from several threads.
"""
import contextlib
import threading
from typing import Iterator

from . import _C

_lock = threading.Lock()


def enable() -> None:
    """Route ``aten::linear`` under torch.func transforms to ``batchrules::linear``."""
    with _lock:
        _C._set_routing_enabled(True)


def disable() -> None:
    """Restore stock torch.func behaviour for ``aten::linear`` exactly."""
    with _lock:
        _C._set_routing_enabled(False)


def is_enabled() -> bool:
    """Whether routing is on."""
    return _C._routing_enabled()


@contextlib.contextmanager
def enabled(on: bool = True) -> Iterator[None]:
    """Context manager turning routing on (or off with ``on=False``) and
    restoring the previous state on exit, also on exceptions; nestable."""
    with _lock:
        previous = _C._routing_enabled()
        _C._set_routing_enabled(on)
    try:
        yield
    finally:
        with _lock:
            _C._set_routing_enabled(previous)
