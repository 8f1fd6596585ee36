"""Typed Python entry points of the batchrules operators."""
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.overrides import has_torch_function

from . import _C

_linear = torch.ops.batchrules.linear.default
_linear_backward = torch.ops.batchrules.linear_backward.default


def linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``y = input @ weight.T + bias``, with the semantics of ``torch.nn.functional.linear``.

    Unlike ``F.linear`` it keeps its identity under every transform: it has its
    own backward (one ``batchrules::linear_backward`` call), double backward and
    forward-mode AD formulas, and vmap batching rules that run batched weights
    as one batched GEMM.

    Args:
        input: ``(*, in_features)`` or ``(in_features,)``.
        weight: ``(out_features, in_features)`` or ``(in_features,)``.
        bias: optional, broadcastable to the output ``(*, out_features)``.
    """
    # Eager calls take the unboxed C++ entry (as cheap as F.linear's binding);
    # torch.compile and __torch_function__ overrides need the torch.ops call,
    # and a missing tensor gets the kernel's own message through it.
    if (input is None or weight is None or torch.compiler.is_compiling()
            or has_torch_function((input, weight, bias))):
        return _linear(input, weight, bias)
    return _C._linear(input, weight, bias)


def linear_backward(
    input: Tensor,
    grad_output: Tensor,
    weight: Tensor,
    output_mask: Sequence[bool] = (True, True, True),
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients of :func:`linear` with respect to ``(input, weight, bias)``.

    ``grad_input = grad_output @ weight.conj()``,
    ``grad_weight = grad_output^T @ input.conj()`` and ``grad_bias`` the sum of
    ``grad_output`` over all leading dims (shape ``(out_features,)``, or ``()``
    for a 1-D weight), all leading dims folded into one GEMM. Outputs whose
    ``output_mask`` entry is False are not computed and returned as ``None``.
    """
    mask: List[bool] = [bool(m) for m in output_mask]
    if len(mask) != 3:
        raise ValueError(f"output_mask must have 3 entries, got {len(mask)}")
    return _linear_backward(input, grad_output, weight, mask)
