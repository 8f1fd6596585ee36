"""Stacked float64 MLP members and what vmapping them must equal: autograd
member by member."""
from typing import Callable, Dict, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

ACTS: Dict[str, Callable[[Tensor], Tensor]] = {"relu": torch.relu, "silu": F.silu}
Params = Dict[str, Tensor]


def mlp_params(members: int, sizes: Sequence[int]) -> Params:
    """Stacked float64 ``Linear`` weights and biases, the member dim first."""
    p = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        p[f"w{i}"] = torch.randn(members, fan_out, fan_in, dtype=torch.float64) / fan_in ** 0.5
        p[f"b{i}"] = torch.randn(members, fan_out, dtype=torch.float64)
    return p


def mlp(p: Params, x: Tensor, act: str, dropout: float = 0.0) -> Tensor:
    n = len(p) // 2
    for i in range(n):
        x = F.linear(x, p[f"w{i}"], p[f"b{i}"])
        if i < n - 1:
            x = F.dropout(ACTS[act](x), dropout) if dropout else ACTS[act](x)
    return x


def mse_of(act: str, dropout: float = 0.0) -> Callable[[Params, Tensor, Tensor], Tensor]:
    return lambda p, x, y: F.mse_loss(mlp(p, x, act, dropout), y)


def member(p: Params, e: int, dim: int = 0) -> Params:
    return {k: v.select(dim, e) for k, v in p.items()}


def loop_grads(p: Params, x: Tensor, y: Tensor, act: str, shared: bool) -> Params:
    """What the vmapped step must equal: autograd member by member."""
    members = next(iter(p.values())).shape[0]
    rows = []
    for e in range(members):
        pe = {k: v.detach().requires_grad_() for k, v in member(p, e).items()}
        loss = F.mse_loss(mlp(pe, x if shared else x[e], act), y[e])
        rows.append(dict(zip(pe, torch.autograd.grad(loss, list(pe.values())))))
    return {k: torch.stack([r[k] for r in rows]) for k in p}


def assert_close(got: Params, want: Params) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=k)
