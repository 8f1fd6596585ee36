"""Per-sample gradients of an LSTM classifier.

``vmap(grad(loss), in_dims=(None, 0, 0))`` with ``functional_call`` gives the
gradient of every sample's loss at once. Stock torch.func runs the LSTM of
each sample's ``grad`` through vmap's per-example fallback; with
``batchrules.enabled()`` the samples' sequences are folded into the layer's
batch, and each weight's per-sample gradient is a batched product over time.
The result is checked against a float64 loop of one backward per sample.

    python -m batchrules.examples.lstm_per_sample_grads
"""
import copy
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import batchrules

Params = Dict[str, Tensor]


class LstmClassifier(nn.Module):
    """An LSTM over ``(T, in_features)`` sequences; its last hidden state -> logits."""

    def __init__(self, in_features: int = 8, hidden: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.lstm = nn.LSTM(in_features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lstm(x)[0][:, -1])


def per_sample_grads(model: nn.Module, params: Params, x: Tensor, y: Tensor) -> Params:
    """Gradient of each sample's loss: entries ``(B, *param.shape)``."""
    def loss(p: Params, xi: Tensor, yi: Tensor) -> Tensor:
        # The model expects a batch: run each sequence as a batch of one.
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def loop_reference(model: nn.Module, x: Tensor, y: Tensor) -> List[Tensor]:
    """float64: one backward per sample, stacked per parameter."""
    m64 = copy.deepcopy(model).double()
    rows = [torch.autograd.grad(F.cross_entropy(m64(x[i:i + 1].double()), y[i:i + 1]),
                                list(m64.parameters())) for i in range(len(x))]
    return [torch.stack(column) for column in zip(*rows)]


def main() -> None:
    """Per-sample gradients of a batch of 8 sequences, and their error against float64."""
    torch.manual_seed(0)
    batch, steps = 8, 12
    model = LstmClassifier()
    x, y = torch.randn(batch, steps, 8), torch.randint(5, (batch,))
    params = {k: p.detach() for k, p in model.named_parameters()}

    with batchrules.enabled():
        grads = per_sample_grads(model, params, x, y)
    print({k: tuple(g.shape) for k, g in grads.items()})
    reference = loop_reference(model, x, y)
    err = max((g.double() - r).abs().max().item() for g, r in zip(grads.values(), reference))
    scale = max(r.abs().max().item() for r in reference)
    print(f"max abs error vs the float64 loop: {err:.1e} (largest entry {scale:.2f})")
    print("per-sample grads match the float64 loop:", err <= 1e-5 * max(scale, 1.0))


if __name__ == "__main__":
    main()
