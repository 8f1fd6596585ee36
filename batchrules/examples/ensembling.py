"""Flow 2: model ensembling with ``torch.func.stack_module_state``.

N copies of an MLP are stacked into one set of ``(N, ...)`` parameters and run
as one model under vmap with ``functional_call`` on a meta-device base: each
model on its own minibatch, or all on one shared minibatch. A training step
takes ``vmap(grad_and_value(loss))`` over the stacked parameters and lets an ordinary
optimizer update them, which trains the N models at once.

    python -m batchrules.examples.ensembling
"""
import copy
from typing import Dict, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, stack_module_state, vmap

import batchrules

Params = Dict[str, Tensor]


def make_mlp(in_features: int, hidden: int, classes: int) -> nn.Sequential:
    """The ensemble member: a two-layer MLP."""
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def stack_models(models: Sequence[nn.Module]) -> Tuple[nn.Module, Params, Params]:
    """``(base, params, buffers)``: a stateless meta-device copy of the model and
    its members' parameters and buffers stacked along a new leading dim."""
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    return base, params, buffers


def ensemble_forward(base: nn.Module, params: Params, buffers: Params, x: Tensor,
                     shared_input: bool = False) -> Tensor:
    """Outputs ``(N, B, classes)``. ``x`` is ``(N, B, in)``, one minibatch per
    model, or with ``shared_input`` ``(B, in)``, one minibatch for all models."""
    def call(p: Params, b: Params, xb: Tensor) -> Tensor:
        return functional_call(base, (p, b), (xb,))

    return vmap(call, in_dims=(0, 0, None if shared_input else 0))(params, buffers, x)


def ensemble_train_step(base: nn.Module, params: Params, buffers: Params, x: Tensor, y: Tensor,
                        optimizer: torch.optim.Optimizer) -> Tensor:
    """One step for all N models, each on its minibatch ``x[n] (B, in)``,
    ``y[n] (B,)``; ``optimizer`` holds the stacked parameters. Returns the N losses."""
    def loss(p: Params, b: Params, xb: Tensor, yb: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(base, (p, b), (xb,)), yb)

    detached = {k: v.detach() for k, v in params.items()}
    grads, losses = vmap(grad_and_value(loss))(detached, buffers, x, y)
    for name, p in params.items():
        p.grad = grads[name]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return losses


def main() -> None:
    """Train an ensemble of 4 MLPs for a few Adam steps; show the per-model losses."""
    torch.manual_seed(0)
    n_models, batch, in_f, hidden, classes = 4, 16, 8, 32, 3
    models = [make_mlp(in_f, hidden, classes) for _ in range(n_models)]
    base, params, buffers = stack_models(models)
    optimizer = torch.optim.Adam(params.values(), lr=1e-2)
    x = torch.randn(n_models, batch, in_f)
    y = torch.randint(classes, (n_models, batch))

    with batchrules.enabled():
        print("per-model minibatches:", tuple(ensemble_forward(base, params, buffers, x).shape))
        print("shared minibatch:     ",
              tuple(ensemble_forward(base, params, buffers, x[0], shared_input=True).shape))
        for step in range(5):
            losses = ensemble_train_step(base, params, buffers, x, y, optimizer)
            print(f"step {step}: losses {[round(v, 4) for v in losses.tolist()]}")


if __name__ == "__main__":
    main()
