"""Typed Python entry points of the activation operators (SiLU and Mish).

Each is the aten activation with its own identity under every transform: the
backward is one ``*_backward`` kernel also under ``torch.func.grad`` (where
autograd otherwise picks a twice-differentiable composite of six or eight
pointwise ops), the backward op has explicit derivative formulas of its own
(hessian, any order of grad, forward AD), and vmap batching rules issue one
kernel per call at every level.
"""
import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers the operators)

_silu = torch.ops.batchrules.silu.default
_silu_backward = torch.ops.batchrules.silu_backward.default
_mish = torch.ops.batchrules.mish.default
_mish_backward = torch.ops.batchrules.mish_backward.default


def silu(input: Tensor) -> Tensor:
    """``input * sigmoid(input)``, with the semantics of ``torch.nn.functional.silu``.

    Floating-point or complex input (complex without autograd, as in ATen).
    Under ``torch.func`` transforms its backward is one
    :func:`silu_backward` call. ``batchrules.enable()`` routes ``F.silu`` /
    ``nn.SiLU`` under transforms here.
    """
    return _silu(input)


def silu_backward(grad_output: Tensor, input: Tensor) -> Tensor:
    """``grad_output * silu'(input)`` in one kernel (``aten::silu_backward``).

    ``grad_output`` and ``input`` have the same dtype and device and broadcast
    against each other. Differentiable in both arguments, to any order.
    """
    return _silu_backward(grad_output, input)


def mish(input: Tensor) -> Tensor:
    """``input * tanh(softplus(input))``, with the semantics of ``torch.nn.functional.mish``.

    Floating-point input. Under ``torch.func`` transforms its backward is one
    :func:`mish_backward` call. ``batchrules.enable()`` routes ``F.mish`` /
    ``nn.Mish`` under transforms here.
    """
    return _mish(input)


def mish_backward(grad_output: Tensor, input: Tensor) -> Tensor:
    """``grad_output * mish'(input)`` in one kernel (``aten::mish_backward``).

    ``grad_output`` and ``input`` have the same dtype and device and broadcast
    against each other. Differentiable in both arguments, to any order.
    """
    return _mish_backward(grad_output, input)
