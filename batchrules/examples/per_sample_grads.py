"""Flow 3: per-sample gradients and a DP-SGD step.

``vmap(grad(loss), in_dims=(None, 0, 0))`` with ``functional_call`` gives the
gradient of every sample's loss at once, for an MLP or a network mixing conv
and linear layers. DP-SGD clips each sample's gradient to norm ``max_norm``,
sums them, adds gaussian noise and averages.

    python -m batchrules.examples.per_sample_grads
"""
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import batchrules

Params = Dict[str, Tensor]


def make_mlp(in_features: int = 16, hidden: int = 32, classes: int = 10) -> nn.Sequential:
    """An MLP classifier for ``(in_features,)`` samples."""
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def make_conv_net(classes: int = 10) -> nn.Sequential:
    """Conv and linear layers for ``(1, 8, 8)`` images."""
    return nn.Sequential(
        nn.Conv2d(1, 4, kernel_size=3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),  # 4,3,3
        nn.Linear(4 * 3 * 3, 16), nn.ReLU(), nn.Linear(16, classes))


def per_sample_grads(model: nn.Module, params: Params, x: Tensor, y: Tensor) -> Params:
    """Gradient of each sample's loss: entries ``(B, *param.shape)``."""
    def loss(p: Params, xi: Tensor, yi: Tensor) -> Tensor:
        # The model expects a batch: run each sample as a batch of one.
        logits = functional_call(model, p, (xi.unsqueeze(0),))
        return F.cross_entropy(logits, yi.unsqueeze(0))

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def clipped_sum(grads: Params, max_norm: float) -> Params:
    """Sum over samples of the per-sample gradients, each first scaled so its
    norm over all parameters is at most ``max_norm``."""
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()], dim=1).norm(dim=1)
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)  # B
    return {k: torch.einsum("b,b...->...", scale, g) for k, g in grads.items()}


def dp_sgd_step(model: nn.Module, params: Params, x: Tensor, y: Tensor, lr: float,
                max_norm: float, noise_multiplier: float,
                generator: Optional[torch.Generator] = None) -> Params:
    """New parameters after one DP-SGD step on the batch ``(x, y)``: per-sample
    gradients clipped to ``max_norm``, summed, plus gaussian noise of std
    ``noise_multiplier * max_norm`` (drawn from ``generator``), averaged."""
    summed = clipped_sum(per_sample_grads(model, params, x, y), max_norm)
    std = noise_multiplier * max_norm
    new_params = {}
    for name, p in params.items():
        noise = torch.randn(p.shape, generator=generator, dtype=p.dtype, device=p.device) * std
        new_params[name] = p - lr * (summed[name] + noise) / x.shape[0]
    return new_params


def main() -> None:
    """Per-sample gradients of both models, then a few DP-SGD steps on the conv net."""
    torch.manual_seed(0)
    batch = 8
    mlp, conv = make_mlp(), make_conv_net()
    x_flat, images = torch.randn(batch, 16), torch.randn(batch, 1, 8, 8)
    y = torch.randint(10, (batch,))

    with batchrules.enabled():
        for name, model, x in (("mlp", mlp, x_flat), ("conv", conv, images)):
            params = {k: p.detach() for k, p in model.named_parameters()}
            grads = per_sample_grads(model, params, x, y)
            print(name, {k: tuple(g.shape) for k, g in grads.items()})

        params = {k: p.detach() for k, p in conv.named_parameters()}
        generator = torch.Generator().manual_seed(0)
        for step in range(3):
            params = dp_sgd_step(conv, params, images, y, lr=0.5, max_norm=1.0,
                                 noise_multiplier=0.5, generator=generator)
            loss = F.cross_entropy(functional_call(conv, params, (images,)), y)
            print(f"DP-SGD step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
