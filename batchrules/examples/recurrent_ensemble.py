"""An ensemble of GRU dynamics models trained with torch.func.

Each member reads a sequence of (state, action) pairs of a synthetic system,
two damped pendulums driven by the actions, and predicts every step's state
change. As in model-based RL, each member trains on its own bootstrap of the
recorded trajectories. The members are stacked with ``stack_module_state``
and trained at once: one ``vmap(grad_and_value(member_loss))`` per step over
the stacked parameters and the members' minibatches, with ``functional_call``
on a meta-device base and one optimizer over the stacked parameters.

Stock torch.func cannot ``vmap`` an ``nn.GRU`` ("Batching rule not
implemented for aten::gru.input"). With ``batchrules.enabled()`` the GRU runs
as its input projection and batchrules' recurrence op, whose batching rule
runs the members' recurrences as one batched matrix product per time step.

    python -m batchrules.examples.recurrent_ensemble [--steps N]
"""
import argparse
import copy
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, stack_module_state, vmap

import batchrules

Params = Dict[str, Tensor]
STATE, ACTION = 4, 2  # two pendulums: (angle, angular velocity) each; a torque each


class GruDynamics(nn.Module):
    """(state, action) sequence [B, T, 6] -> predicted state changes [B, T, 4]."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.gru = nn.GRU(STATE + ACTION, hidden, batch_first=True)
        self.head = nn.Linear(hidden, STATE)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.gru(x)[0])


def pendulum_step(state: Tensor, action: Tensor, dt: float = 0.05) -> Tensor:
    """One semi-implicit Euler step of two damped, driven pendulums."""
    angle, velocity = state[..., 0::2], state[..., 1::2]
    velocity = velocity + dt * (-9.8 * torch.sin(angle) - 0.3 * velocity + action)
    angle = angle + dt * velocity
    return torch.stack([angle, velocity], -1).flatten(-2)


def trajectories(count: int, steps: int, generator: torch.Generator) -> Tuple[Tensor, Tensor]:
    """Inputs [count, steps, 6] (state, action) and targets [count, steps, 4]
    (next state minus state) of random rollouts."""
    state = torch.randn(count, STATE, generator=generator)
    actions = torch.randn(count, steps, ACTION, generator=generator)
    inputs, deltas = [], []
    for t in range(steps):
        following = pendulum_step(state, actions[:, t])
        inputs.append(torch.cat([state, actions[:, t]], -1))
        deltas.append(following - state)
        state = following
    return torch.stack(inputs, 1), torch.stack(deltas, 1) * 10.0  # deltas scaled to ~unit size


def stack_models(models: Sequence[nn.Module]) -> Tuple[nn.Module, Params, Params]:
    """``(base, params, buffers)``: a meta-device copy and the stacked state."""
    params, buffers = stack_module_state(models)
    return copy.deepcopy(models[0]).to("meta"), params, buffers


def ensemble_predict(base: nn.Module, params: Params, buffers: Params, x: Tensor) -> Tensor:
    """Every member on the same sequences ``x`` [B, T, 6]: [N, B, T, 4]."""
    def member(p: Params, b: Params, xb: Tensor) -> Tensor:
        return functional_call(base, (p, b), (xb,))

    return vmap(member, in_dims=(0, 0, None))(params, buffers, x)


def train_step(base: nn.Module, params: Params, buffers: Params, x: Tensor, y: Tensor,
               optimizer: torch.optim.Optimizer) -> Tensor:
    """One step of every member on its minibatch ``x[n]`` [B, T, 6], ``y[n]``
    [B, T, 4]; ``optimizer`` holds the stacked parameters. Returns the N losses."""
    def member_loss(p: Params, b: Params, xb: Tensor, yb: Tensor) -> Tensor:
        return F.mse_loss(functional_call(base, (p, b), (xb,)), yb)

    detached = {k: v.detach() for k, v in params.items()}
    grads, losses = vmap(grad_and_value(member_loss))(detached, buffers, x, y)
    for name, p in params.items():
        p.grad = grads[name]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return losses


def main(argv: Optional[List[str]] = None) -> None:
    """Train 5 GRU dynamics models for a few Adam steps; show the per-member losses."""
    parser = argparse.ArgumentParser(prog="python -m batchrules.examples.recurrent_ensemble")
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    args = parser.parse_args([] if argv is None else argv)
    torch.manual_seed(0)
    members, batch, steps = 5, 32, 16
    generator = torch.Generator().manual_seed(0)
    x, y = trajectories(256, steps, generator)
    models = [GruDynamics() for _ in range(members)]
    base, params, buffers = stack_models(models)
    optimizer = torch.optim.Adam(params.values(), lr=1e-2)
    print(f"ensemble of {members} GRU dynamics models, {steps}-step sequences")

    with batchrules.enabled():
        predicted = ensemble_predict(base, params, buffers, x[:batch])
        with torch.no_grad():
            loop = torch.stack([m(x[:batch]) for m in models])
        print("predictions:", tuple(predicted.shape),
              "match the per-member loop:", torch.allclose(predicted, loop, atol=1e-5))
        for step in range(args.steps):
            # each member's own bootstrap minibatch of the trajectories
            picks = torch.randint(0, len(x), (members, batch), generator=generator)
            losses = train_step(base, params, buffers, x[picks], y[picks], optimizer)
            print(f"step {step}: losses {[round(v, 4) for v in losses.tolist()]}")


if __name__ == "__main__":
    main(sys.argv[1:])
