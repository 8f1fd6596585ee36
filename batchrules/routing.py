"""Opt-in routing of a training step's ops under torch.func transforms.

While enabled, under any ``torch.func`` transform (vmap, grad, vjp, jvp,
jacrev, jacfwd, hessian, functional_call inside them):

- ``aten::linear`` (``nn.Linear``, ``F.linear``) runs ``batchrules::linear``,
  ``aten::silu`` / ``aten::mish`` run ``batchrules::silu`` / ``mish``, with
  their autograd formulas and batching rules;
- ``aten::scaled_dot_product_attention`` picks a kernel that every transform
  in the stack can differentiate, and the fused attention kernels get batching
  rules instead of the per-example fallback;
- the losses' kernels (``nll_loss``/``nll_loss2d`` forward and backward, the
  mse/smooth_l1/huber backwards, huber forward) get batching rules instead of
  functorch's Python decompositions.

Eager code outside transforms is untouched and pays nothing: the kernels live
on dispatch keys that are only active inside transforms. Disabling restores
the stock kernels exactly.

The switch is process-wide (it changes the dispatcher's kernel table), not
per-thread. ``enable()``/``disable()`` may be called repeatedly and from
several threads; flip it while no other thread is inside a transform, as the
dispatcher does not guard running calls against kernel (de)registration.

Setting the environment variable ``BATCHRULES_ENABLE=1`` turns routing on when
``batchrules`` is imported.
"""
import contextlib
import os
import threading
from typing import Iterator

from . import _C
from ._compat import load_functorch_vmap_decompositions

ENABLE_ENV_VAR = "BATCHRULES_ENABLE"
_ENV_ON = frozenset({"1", "true", "yes", "on"})
_ENV_OFF = frozenset({"", "0", "false", "no", "off"})

# Makes the read-then-write of enabled() atomic across threads; the C++ switch
# itself is already serialized.
_lock = threading.Lock()


def enable() -> None:
    """Route linear, SiLU, Mish, attention and the losses under torch.func transforms.

    See the module docstring for what runs where. Idempotent, silent and
    process-wide.
    """
    # See Note [Routing aten ops only while transforms are active] (csrc/routing.cpp).
    load_functorch_vmap_decompositions()
    with _lock:
        _C._set_routing_enabled(True)


def disable() -> None:
    """Restore the stock torch.func kernels of every routed aten op exactly. Idempotent."""
    with _lock:
        _C._set_routing_enabled(False)


def is_enabled() -> bool:
    """Whether routing is on (process-wide)."""
    return _C._routing_enabled()


@contextlib.contextmanager
def enabled(on: bool = True) -> Iterator[None]:
    """Turn routing on (or off with ``on=False``) for the ``with`` block.

    The previous state is restored on exit, also when the block raises, so
    blocks nest. The state is process-wide: blocks overlapping in several
    threads restore in exit order, so prefer one ``enable()`` at start-up there.
    """
    if not isinstance(on, bool):
        raise TypeError(f"batchrules.enabled(on) expects a bool, got {type(on).__name__}")
    load_functorch_vmap_decompositions()
    with _lock:
        previous = _C._routing_enabled()
        _C._set_routing_enabled(on)
    try:
        yield
    finally:
        with _lock:
            _C._set_routing_enabled(previous)


def _enable_from_environment() -> None:
    """Apply ``BATCHRULES_ENABLE`` at import; a value that is neither on nor off raises."""
    value = os.environ.get(ENABLE_ENV_VAR, "").strip().lower()
    if value in _ENV_ON:
        enable()
    elif value not in _ENV_OFF:
        raise ValueError(
            f"{ENABLE_ENV_VAR}={os.environ[ENABLE_ENV_VAR]!r} is not understood: use 1/true/yes/on "
            f"to route aten::linear to batchrules under torch.func, or 0/false/no/off (or unset)")


_enable_from_environment()
