"""The networks the scenarios run, and their stacked (ensemble) form."""
import copy
from typing import Dict, List, NamedTuple, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import stack_module_state

ACTIVATIONS = {"relu": nn.ReLU, "silu": nn.SiLU}


class MlpSpec(NamedTuple):
    """Layer widths (input first) and the hidden activation."""
    sizes: Tuple[int, ...]
    act: str = "relu"

    @property
    def n_linears(self) -> int:
        return len(self.sizes) - 1

    def layers(self, params: Dict[str, Tensor]) -> List[Tuple[Tensor, Tensor]]:
        """Each linear layer's weight and bias in ``params``, keyed as ``mlp``'s ``nn.Sequential``."""
        return [(params[f"{2 * i}.weight"], params[f"{2 * i}.bias"]) for i in range(self.n_linears)]


def mlp(spec: MlpSpec) -> nn.Sequential:
    """``Linear, act, Linear, act, ..., Linear`` with PyTorch's default init."""
    layers: List[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(spec.sizes[:-1], spec.sizes[1:])):
        layers.append(nn.Linear(fan_in, fan_out))
        if i < spec.n_linears - 1:
            layers.append(ACTIVATIONS[spec.act]())
    return nn.Sequential(*layers)


class Critic(nn.Module):
    """A SAC/REDQ-style Q network (TorchRL's ``ValueOperator`` over an MLP):
    ``Q(obs, action) = mlp(cat(obs, action))`` with two ReLU hidden layers."""

    def __init__(self, obs: int, action: int, hidden: int) -> None:
        super().__init__()
        self.q = mlp(MlpSpec((obs + action, hidden, hidden, 1)))

    def forward(self, obs: Tensor, action: Tensor) -> Tensor:
        return self.q(torch.cat([obs, action], -1))


def small_cnn() -> nn.Sequential:
    """MNIST-sized CNN: two 5x5 convs with pooling, then two linears (28x28 -> 10)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def stacked_ensemble(models: Sequence[nn.Module]) -> Tuple[Dict[str, Tensor], Dict[str, Tensor], nn.Module]:
    """The torch.func ensembling recipe: stacked params/buffers and a meta-device base."""
    params, buffers = stack_module_state(list(models))
    base = copy.deepcopy(models[0]).to("meta")
    return params, buffers, base


def detached_params(model: nn.Module) -> Dict[str, Tensor]:
    """The model's parameters as plain tensors, for functional_call under grad."""
    return {k: v.detach() for k, v in model.named_parameters()}


# The scenarios' losses, mean over the batch.
mse, cross_entropy = F.mse_loss, F.cross_entropy


def in_float64(model: nn.Module) -> nn.Module:
    """A float64 copy on CPU, for references."""
    return copy.deepcopy(model).to(device="cpu", dtype=torch.float64)
