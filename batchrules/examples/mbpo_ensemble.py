"""MBPO-style probabilistic dynamics ensemble trained with torch.func.

MBPO (Janner et al., 2019) learns the environment's dynamics with an ensemble
of 7 probabilistic networks: each maps (observation, action) to a Gaussian
over (next-observation delta, reward), a mean and a log-variance, through 4
hidden layers of 200 SiLU (swish) units; each member is trained on its own
bootstrap of the replay data with the Gaussian negative log-likelihood. The
log-variance is bounded softly by learned per-member bounds (as in PETS).

Here the 7 members are stacked with ``stack_module_state`` and trained at once:
``vmap(grad_and_value(member_loss))`` over the stacked parameters and each
member's minibatch, with ``functional_call`` on a meta-device base and one
optimizer over the stacked parameters. With ``batchrules.enable()`` every
``nn.Linear`` runs ``batchrules::linear`` and every ``nn.SiLU``
``batchrules::silu``, whose backward under ``grad`` is one ``silu_backward``
kernel per layer.

The loss is ``F.gaussian_nll_loss(mean, target, logvar.exp(), full=False)``
written out: in torch 2.13 ``F.gaussian_nll_loss`` checks ``var`` with a
data-dependent ``torch.any(var < 0)``, which vmap cannot run, and the variance
here is an exponential, positive by construction.

    python -m batchrules.examples.mbpo_ensemble
"""
import copy
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, stack_module_state, vmap

import batchrules

Params = Dict[str, Tensor]

# Weight of the log-variance bound regularizer (MBPO / PETS use 0.01).
BOUND_REG = 0.01


class GaussianDynamics(nn.Module):
    """One ensemble member: ``(obs, action) -> (mean, logvar)`` of (delta obs, reward)."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int = 200, layers: int = 4) -> None:
        super().__init__()
        self.out_dim = obs_dim + 1
        sizes = [obs_dim + act_dim] + [hidden] * layers
        body: List[nn.Module] = []
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            body += [nn.Linear(fan_in, fan_out), nn.SiLU()]
        self.net = nn.Sequential(*body, nn.Linear(hidden, 2 * self.out_dim))
        self.max_logvar = nn.Parameter(torch.full((self.out_dim,), 0.5))
        self.min_logvar = nn.Parameter(torch.full((self.out_dim,), -10.0))

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        mean, logvar = self.net(x).chunk(2, dim=-1)
        # Soft bounds: smooth, so the bounds themselves are learned.
        logvar = self.max_logvar - F.softplus(self.max_logvar - logvar)
        logvar = self.min_logvar + F.softplus(logvar - self.min_logvar)
        return mean, logvar


def gaussian_nll(mean: Tensor, logvar: Tensor, target: Tensor) -> Tensor:
    """``F.gaussian_nll_loss(mean, target, logvar.exp(), full=False)`` (mean reduction)."""
    return 0.5 * (logvar + (mean - target).square() * torch.exp(-logvar)).mean()


def member_loss(member: nn.Module, params: Params, buffers: Params, x: Tensor,
                target: Tensor) -> Tensor:
    """One member's training loss: Gaussian NLL plus the bound regularizer."""
    mean, logvar = functional_call(member, (params, buffers), (x,))
    bounds = params["max_logvar"].sum() - params["min_logvar"].sum()
    return gaussian_nll(mean, logvar, target) + BOUND_REG * bounds


class Ensemble:
    """The members' stacked parameters, their meta-device base and an optimizer."""

    def __init__(self, members: List[nn.Module], lr: float = 1e-3) -> None:
        params, self.buffers = stack_module_state(members)
        self.params = {k: v.detach().requires_grad_() for k, v in params.items()}
        self.base = copy.deepcopy(members[0]).to("meta")
        self.optimizer = torch.optim.Adam(self.params.values(), lr=lr)
        self._grads = vmap(grad_and_value(lambda p, b, x, y: member_loss(self.base, p, b, x, y)))

    def train_step(self, x: Tensor, target: Tensor) -> Tensor:
        """One optimizer step for every member, member ``e`` on ``x[e]`` ``(N, in)``
        and ``target[e]`` ``(N, out)``. Returns the members' losses before it."""
        detached = {k: v.detach() for k, v in self.params.items()}
        grads, losses = self._grads(detached, self.buffers, x, target)
        for name, p in self.params.items():
            p.grad = grads[name]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return losses

    def predict(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """Every member's ``(mean, logvar)`` for one shared batch ``x`` ``(N, in)``."""
        params = {k: v.detach() for k, v in self.params.items()}
        return vmap(functional_call, in_dims=(None, 0, None))(self.base, (params, self.buffers),
                                                               (x,))


def bootstrap(x: Tensor, y: Tensor, members: int, batch: int,
              generator: torch.Generator) -> Tuple[Tensor, Tensor]:
    """A minibatch per member, drawn with replacement: ``(members, batch, ...)``."""
    idx = torch.randint(len(x), (members, batch), generator=generator)
    return x[idx], y[idx]


def main(steps: int = 100) -> None:
    """Fit 7 members to synthetic HalfCheetah-sized dynamics (obs 17, action 6)."""
    torch.manual_seed(0)
    obs_dim, act_dim, members, batch = 17, 6, 7, 256
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, obs_dim + act_dim, generator=gen)
    w = torch.randn(obs_dim + act_dim, obs_dim + 1, generator=gen) / (obs_dim + act_dim) ** 0.5
    y = torch.tanh(x @ w) + 0.1 * torch.randn(len(x), obs_dim + 1, generator=gen)
    ensemble = Ensemble([GaussianDynamics(obs_dim, act_dim) for _ in range(members)])
    with batchrules.enabled():
        for step in range(steps + 1):
            losses = ensemble.train_step(*bootstrap(x, y, members, batch, gen))
            if step % 25 == 0 or step == steps:
                print(f"step {step:3d}: loss per member {[round(v, 3) for v in losses.tolist()]}")
        mean, logvar = ensemble.predict(x[:5])
    print("prediction:", tuple(mean.shape), "mean,", tuple(logvar.shape), "log-variance")


if __name__ == "__main__":
    main()
