"""Typed Python entry points of the activation operators (SiLU, Mish, ...).

Each is the aten activation with its own identity under every transform: the
backward is one ``*_backward`` kernel also under ``torch.func.grad`` (where
autograd otherwise picks a twice-differentiable composite of six or eight
pointwise ops), the backward op has explicit derivative formulas of its own
(hessian, any order of grad, forward AD), and vmap batching rules issue one
kernel per call at every level.

The entries ``batchrules.<name>`` and ``<name>_backward`` are made here for
each activation of the extension's list (csrc/activations/activation_list.h,
read through ``_C._activations()``), so adding an activation changes nothing
in Python (csrc/activations/README.md).
"""
from typing import Callable, Dict, Tuple

import torch
from torch import Tensor

from . import _C

# The activations' names, in the list's order.
ACTIVATIONS: Tuple[str, ...] = tuple(name for name, _, _ in _C._activations())


def _entry(function: Callable, name: str, doc: str) -> Callable:
    function.__name__ = function.__qualname__ = name
    function.__doc__ = doc
    return function


def _forward(name: str, formula: str, supports_complex: bool) -> Callable[[Tensor], Tensor]:
    op = getattr(torch.ops.batchrules, name).default

    def forward(input: Tensor) -> Tensor:
        return op(input)

    inputs = ("Floating-point or complex input (complex without autograd, as in ATen)"
              if supports_complex else "Floating-point input")
    return _entry(forward, name, f"""``{formula}``, with the semantics of
    ``torch.nn.functional.{name}``.

    {inputs}.
    Under ``torch.func`` transforms its backward is one :func:`{name}_backward`
    call. ``batchrules.enable()`` routes ``F.{name}`` (and its ``nn`` module)
    under transforms here.
    """)


def _backward(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    op = getattr(torch.ops.batchrules, f"{name}_backward").default

    def backward(grad_output: Tensor, input: Tensor) -> Tensor:
        return op(grad_output, input)

    return _entry(backward, f"{name}_backward", f"""``grad_output * {name}'(input)`` in one
    kernel (``aten::{name}_backward``).

    ``grad_output`` and ``input`` have the same dtype and device and broadcast
    against each other. Differentiable in both arguments, to any order.
    """)


def _entries() -> Dict[str, Callable]:
    entries: Dict[str, Callable] = {}
    for name, formula, supports_complex in _C._activations():
        entries[name] = _forward(name, formula, supports_complex)
        entries[f"{name}_backward"] = _backward(name)
    return entries


_ENTRIES = _entries()
globals().update(_ENTRIES)

__all__ = list(_ENTRIES)
