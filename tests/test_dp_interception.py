"""Note [Intercepting only the calls that take a parameter]: clipped_grad's
Interceptor sees exactly the calls that take a differentiated leaf (as an
argument, in a list, or as ``self``), never a parameter-free op, and the leaves
behave as plain tensors everywhere else."""
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.nn.functional as F
from dp_reference import assert_close_rel, loop_clipped_grad
from torch import Tensor

import batchrules
from batchrules.dp.interceptor import Differentiated, Interceptor

BATCH = 4


@pytest.fixture
def handled(monkeypatch) -> List[Callable]:
    """The torch functions the Interceptor was handed, in order."""
    seen: List[Callable] = []
    original = Interceptor.handle

    def recording(self: Interceptor, func: Callable, args: Any, kwargs: Dict[str, Any]) -> Any:
        seen.append(func)
        return original(self, func, args, kwargs)

    monkeypatch.setattr(Interceptor, "handle", recording)
    return seen


def params() -> Dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(5, 3, generator=g, dtype=torch.float64),
            "s": torch.randn(5, generator=g, dtype=torch.float64),
            "v": torch.randn(5, generator=g, dtype=torch.float64)}


def loss(p: Dict[str, Tensor], x: Tensor) -> Tensor:
    h = F.linear(x, p["w"])                       # an argument
    h = torch.tanh(h * 2.0 + 1.0).relu()          # no parameter: never handled
    h = torch.stack([h, p["s"].expand_as(h)])     # in a list; .expand_as: p["s"] is self
    return (h.sum(0) * 0.5).mul(p["v"]).sum()     # an argument of a method


def test_only_calls_taking_a_parameter_are_handled(handled: List[Callable]) -> None:
    x = torch.randn(BATCH, 3, dtype=torch.float64)
    got = batchrules.clipped_grad(loss, 0.7)(params(), x)
    assert_close_rel(got, loop_clipped_grad(loss, 0.7, (params(), x)))
    names = [getattr(f, "__name__", str(f)) for f in handled]
    assert names == ["linear", "expand_as", "mul"], names


def test_leaves_are_plain_outside_the_forward() -> None:
    seen: List[Any] = []

    def keep(p: Dict[str, Tensor], x: Tensor) -> Any:
        seen.append(p["w"])
        return loss(p, x), p["w"]

    x = torch.randn(BATCH, 3, dtype=torch.float64)
    (_, _), aux = batchrules.clipped_grad(keep, 1.0, has_aux=True)(params(), x)
    leaf = seen[0]
    assert isinstance(leaf, Differentiated)
    assert type(aux) is Tensor and type(leaf * 2) is Tensor and type(leaf.detach()) is Tensor
    assert torch.equal(leaf.detach(), params()["w"])
