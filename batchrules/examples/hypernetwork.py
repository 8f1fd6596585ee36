"""Flow 1: vmap over per-sample weights produced by a hypernetwork.

A hypernetwork maps each sample's condition ``z[b]`` to the weight ``W[b]``
and bias ``bias[b]`` of a linear layer; the main network applies them under
vmap, so every sample runs through its own layer in one batched GEMM.
``vmap(grad(...))`` then gives per-sample gradients through both networks.

    python -m batchrules.examples.hypernetwork
"""
from typing import Dict, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import batchrules

Params = Dict[str, Tensor]


class HyperNet(nn.Module):
    """Condition ``(Z,)`` -> weight ``(O, I)`` and bias ``(O,)`` of one linear layer."""

    def __init__(self, cond_features: int, in_features: int, out_features: int, hidden: int = 16):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.body = nn.Sequential(nn.Linear(cond_features, hidden), nn.Tanh())
        self.to_weight = nn.Linear(hidden, out_features * in_features)
        self.to_bias = nn.Linear(hidden, out_features)

    def forward(self, z: Tensor) -> Tuple[Tensor, Tensor]:
        h = self.body(z)
        weight = self.to_weight(h).unflatten(-1, (self.out_features, self.in_features))
        return weight, self.to_bias(h)


class MainNet(nn.Module):
    """A linear layer with given weights, then a shared classifier head."""

    def __init__(self, hidden_features: int, classes: int):
        super().__init__()
        self.head = nn.Linear(hidden_features, classes)

    def forward(self, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        return self.head(torch.tanh(F.linear(x, weight, bias)))


def forward(hyper: HyperNet, main: MainNet, z: Tensor, x: Tensor) -> Tensor:
    """Logits ``(B, classes)``: the hypernetwork makes ``W[b], bias[b]`` for each
    sample and the main network applies them under vmap."""
    weight, bias = hyper(z)  # B,O,I and B,O
    return vmap(main)(x, weight, bias)


def sample_loss(hyper: HyperNet, main: MainNet, hyper_params: Params, main_params: Params,
                z: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy of one sample (``z (Z,)``, ``x (I,)``, class ``y ()``)."""
    weight, bias = functional_call(hyper, hyper_params, (z,))
    logits = functional_call(main, main_params, (x, weight, bias))
    return F.cross_entropy(logits, y)


def per_sample_grads(hyper: HyperNet, main: MainNet, z: Tensor, x: Tensor,
                     y: Tensor) -> Tuple[Params, Params]:
    """Per-sample gradients ``(hyper_grads, main_grads)``, each entry ``(B, *param.shape)``."""
    def loss(hp: Params, mp: Params, zi: Tensor, xi: Tensor, yi: Tensor) -> Tensor:
        return sample_loss(hyper, main, hp, mp, zi, xi, yi)

    hyper_params = {k: p.detach() for k, p in hyper.named_parameters()}
    main_params = {k: p.detach() for k, p in main.named_parameters()}
    grads = vmap(grad(loss, argnums=(0, 1)), in_dims=(None, None, 0, 0, 0))
    return grads(hyper_params, main_params, z, x, y)


def main() -> None:
    """Run the forward pass and per-sample gradients, and check both against a loop."""
    torch.manual_seed(0)
    batch, cond, in_f, hidden, classes = 8, 4, 6, 5, 3
    hyper, net = HyperNet(cond, in_f, hidden), MainNet(hidden, classes)
    z, x = torch.randn(batch, cond), torch.randn(batch, in_f)
    y = torch.randint(classes, (batch,))

    with batchrules.enabled():
        logits = forward(hyper, net, z, x)
        hyper_grads, main_grads = per_sample_grads(hyper, net, z, x, y)

    loop = torch.stack([net(x[b], *hyper(z[b])) for b in range(batch)])
    first = torch.autograd.grad(
        sample_loss(hyper, net, dict(hyper.named_parameters()), dict(net.named_parameters()),
                    z[0], x[0], y[0]),
        hyper.to_weight.weight)[0]
    print("logits", tuple(logits.shape), "match loop:", torch.allclose(logits, loop, atol=1e-6))
    print("per-sample grad of hyper.to_weight.weight", tuple(hyper_grads["to_weight.weight"].shape),
          "sample 0 matches autograd:", torch.allclose(hyper_grads["to_weight.weight"][0], first,
                                                       atol=1e-6))
    print("per-sample grad of main.head.weight", tuple(main_grads["head.weight"].shape))


if __name__ == "__main__":
    main()
