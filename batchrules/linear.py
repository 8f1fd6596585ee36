"""Typed Python entry points of the linear operators: ``batchrules.linear`` and
``batchrules.linear_backward``."""
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _C

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
    # See Note [Eager entry of batchrules.linear] (csrc/python_module.cpp);
    # torch.compile traces it as the operator (batchrules/compile.py).
    return _C.linear(input, weight, bias)


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
