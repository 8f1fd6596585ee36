"""Hand-written baselines, the "limit" rows: what an expert writes without vmap,
computing exactly what the scenario's torch.func code computes with batched
GEMMs called directly and manual backward passes where torch.func uses ``grad``.
"""
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

Layer = Tuple[Tensor, Tensor]  # weight [.., O, I], bias [.., O]


def activation(z: Tensor, act: str) -> Tensor:
    return torch.relu(z) if act == "relu" else F.silu(z)


def activation_backward(grad: Tensor, z: Tensor, act: str) -> Tensor:
    """d act(z) / dz applied to ``grad`` in one kernel."""
    if act == "relu":
        return torch.ops.aten.threshold_backward(grad, z, 0)
    return torch.ops.aten.silu_backward(grad, z)


def ensemble_forward(layers: Sequence[Layer], act: str, x: Tensor, shared: bool) -> Tensor:
    """E stacked MLPs. ``x``: [N, I] shared by all members, or [E, N, I]. Returns [E, N, O]."""
    h = x
    for i, (w, b) in enumerate(layers):
        members, out_f, in_f = w.shape
        if i == 0 and shared:
            # N,I x I,E*O -> N,E*O, read as [E, N, O] without a copy.
            z = torch.addmm(b.reshape(-1), x, w.reshape(members * out_f, in_f).t())
            z = z.view(x.shape[0], members, out_f).transpose(0, 1)
        else:
            # E,N,I x E,I,O + E,1,O -> E,N,O
            z = torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2))
        h = activation(z, act) if i < len(layers) - 1 else z
    return h


def ensemble_mse_grads(layers: Sequence[Layer], act: str, x: Tensor, y: Tensor) -> List[Tensor]:
    """Per-member gradients of ``mse_loss(member(x[e]), y[e])``, manual backward:
    [gW0, gb0, gW1, gb1, ...] with a leading member dim."""
    inputs, pre_acts = [], []
    h = x
    for i, (w, b) in enumerate(layers):
        inputs.append(h)
        z = torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2))  # E,N,O
        pre_acts.append(z)
        h = activation(z, act) if i < len(layers) - 1 else z
    # d mean((h - y)^2) / dh per member
    g = (h - y).mul_(2.0 / (y.shape[1] * y.shape[2]))
    grads: List[Tensor] = []
    for i in reversed(range(len(layers))):
        w = layers[i][0]
        if i < len(layers) - 1:
            g = activation_backward(g, pre_acts[i], act)
        grads.append(g.sum(1))  # E,N,O -> E,O
        grads.append(torch.bmm(g.transpose(1, 2), inputs[i]))  # E,O,N x E,N,I -> E,O,I
        if i > 0:
            g = torch.bmm(g, w)  # E,N,O x E,O,I -> E,N,I
    return grads[::-1]


def cross_entropy_grad(logits: Tensor, target: Tensor) -> Tensor:
    """Per-sample d cross_entropy(logits_i, y_i) / d logits_i = softmax - onehot."""
    g = torch.softmax(logits, dim=1)
    g.scatter_add_(1, target.unsqueeze(1), torch.full_like(g[:, :1], -1.0))
    return g


def _outer(g: Tensor, a: Tensor) -> Tensor:
    # B,O x B,I -> B,O,I in one broadcast multiply
    return g.unsqueeze(2) * a.unsqueeze(1)


def mlp_output_grads(layers: Sequence[Layer], act: str, x: Tensor, y: Tensor
                     ) -> Tuple[List[Tensor], List[Tensor]]:
    """One MLP forward keeping each layer's input, one manual backward of the
    per-sample cross-entropy keeping each layer's output gradient (no weight
    gradient): ``(inputs, output_grads)``, per layer."""
    inputs, pre_acts = [], []
    h = x
    for i, (w, b) in enumerate(layers):
        inputs.append(h)
        z = torch.addmm(b, h, w.t())
        pre_acts.append(z)
        h = activation(z, act) if i < len(layers) - 1 else z
    g = cross_entropy_grad(h, y)
    grads: List[Tensor] = [g] * len(layers)
    for i in reversed(range(len(layers))):
        if i < len(layers) - 1:
            g = activation_backward(g, pre_acts[i], act)
        grads[i] = g
        if i > 0:
            g = torch.mm(g, layers[i][0])
    return inputs, grads


def mlp_per_sample_grads(layers: Sequence[Layer], act: str, x: Tensor, y: Tensor) -> List[Tensor]:
    """Per-sample gradients of ``cross_entropy(mlp(x_i), y_i)``, manual backward."""
    inputs, grads = mlp_output_grads(layers, act, x, y)
    return [t for a, g in zip(inputs, grads) for t in (_outer(g, a), g)]


def _conv_per_sample_grads(g: Tensor, a: Tensor, weight_shape: torch.Size) -> List[Tensor]:
    # Weight grad of a stride-1 unpadded conv as one bmm over unfolded patches:
    # B,O,P x B,P,C*k*k -> B,O,C*k*k
    patches = F.unfold(a, weight_shape[-2:])
    gw = torch.bmm(g.flatten(2), patches.transpose(1, 2))
    return [gw.view(g.shape[0], *weight_shape), g.sum((2, 3))]


def cnn_per_sample_grads(p: Dict[str, Tensor], x: Tensor, y: Tensor) -> List[Tensor]:
    """Per-sample gradients of ``models.small_cnn``: one batched backward to the
    layer outputs, then each layer's per-sample weight gradient by hand."""
    z1 = F.conv2d(x, p["0.weight"], p["0.bias"]).requires_grad_()
    a1 = F.max_pool2d(torch.relu(z1), 2)
    z2 = F.conv2d(a1, p["3.weight"], p["3.bias"])
    a2 = F.max_pool2d(torch.relu(z2), 2).flatten(1)
    z3 = torch.addmm(p["7.bias"], a2, p["7.weight"].t())
    a3 = torch.relu(z3)
    z4 = torch.addmm(p["9.bias"], a3, p["9.weight"].t())
    g4 = cross_entropy_grad(z4.detach(), y)
    g1, g2, g3 = torch.autograd.grad(z4, (z1, z2, z3), g4)
    a1, a2, a3 = a1.detach(), a2.detach(), a3.detach()
    return [
        *_conv_per_sample_grads(g1, x, p["0.weight"].shape),
        *_conv_per_sample_grads(g2, a1, p["3.weight"].shape),
        _outer(g3, a2), g3,
        _outer(g4, a3), g4,
    ]


def per_sample_weights_forward(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """Two linears with per-sample weights: [B, N, I] -> [B, N, O] as two baddbmm."""
    h = F.silu(torch.baddbmm(b1.unsqueeze(1), x, w1.transpose(1, 2)))
    return torch.baddbmm(b2.unsqueeze(1), h, w2.transpose(1, 2))


def mlp_bookkeeping(layers: Sequence[Layer], act: str, x: Tensor, y: Tensor,
                    max_norm: float) -> Tuple[List[Tensor], Tensor]:
    """DP-SGD clipping by book-keeping, the DP MLP rows' limit (Bu et al., ICML
    2023): each layer's input ``a`` and output gradient ``g``, per-sample norms
    from the factors (``||g_i||^2 (||a_i||^2 + 1)`` for a layer's weight and
    bias), then each layer's clipped sum as one GEMM of the scaled g against a.
    Returns ``([gW0, gb0, gW1, gb1, ...], norms)`` of cross-entropy per sample."""
    inputs, grads = mlp_output_grads(layers, act, x, y)
    squares = [g.square().sum(1) * (a.square().sum(1) + 1) for a, g in zip(inputs, grads)]
    norms = sum(squares[1:], squares[0]).sqrt()
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0).unsqueeze(1)
    sums: List[Tensor] = []
    for a, g in zip(inputs, grads):
        scaled = g * coef
        sums += [torch.mm(scaled.t(), a), scaled.sum(0)]  # B,O x B,I -> O,I
    return sums, norms
