"""Typed Python entry points of the batchrules operators."""
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _C

_linear = torch.ops.batchrules.linear.default
_linear_backward = torch.ops.batchrules.linear_backward.default


linear = _C.linear


@torch._dynamo.substitute_in_graph(linear, skip_signature_check=True)
def _linear_polyfill(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """What torch.compile traces in place of the C entry: the operator itself."""
    return _linear(input, weight, bias)


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
