"""Hand-written book-keeping DP-SGD clipping for the MLP: the DP rows' limit.

One forward keeping each layer's input ``a`` and pre-activation, one manual
backward keeping each layer's output gradient ``g`` (no weight gradient),
per-sample norms from the factors (``||g_i||^2 (||a_i||^2 + 1)`` for a
layer's weight and bias), then each layer's clipped sum as one GEMM of the
scaled g against a (Bu et al., ICML 2023).
"""
from typing import List, Sequence, Tuple

import torch
from torch import Tensor

from .hand_written import Layer, activation_backward, mlp_forward_recorded


def mlp_bookkeeping(layers: Sequence[Layer], act: str, x: Tensor, y: Tensor,
                    max_norm: float) -> Tuple[List[Tensor], Tensor]:
    """``([gW0, gb0, gW1, gb1, ...], norms)`` of cross-entropy per sample."""
    inputs, pre_acts, g = mlp_forward_recorded(layers, act, x, y)
    grads: List[Tensor] = [g] * len(layers)
    for i in reversed(range(len(layers))):
        if i < len(layers) - 1:
            g = activation_backward(g, pre_acts[i], act)
        grads[i] = g
        if i > 0:
            g = torch.mm(g, layers[i][0])
    squares = sum(g.square().sum(1) * (a.square().sum(1) + 1) for a, g in zip(inputs, grads))
    norms = squares.sqrt()
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0).unsqueeze(1)
    sums: List[Tensor] = []
    for a, g in zip(inputs, grads):
        scaled = g * coef
        sums += [torch.mm(scaled.t(), a), scaled.sum(0)]  # B,O x B,I -> O,I
    return sums, norms
