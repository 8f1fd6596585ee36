"""jacrev / jacfwd / hessian / jvp of an nn.Linear MLP with routing on,
compared with stock torch.func (routing off) and row-by-row autograd loops."""
from typing import Callable, Dict, Tuple, TypeVar

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacfwd, jacrev, jvp, vmap

import batchrules
from batchrules.examples.inspect_routing import batchrules_op_counts

IN, OUT, BATCH = 3, 2, 4
T = TypeVar("T")

torch.manual_seed(0)
MODEL = nn.Sequential(nn.Linear(IN, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(),
                      nn.Linear(4, OUT)).double()
PARAMS = {k: p.detach() for k, p in MODEL.named_parameters()}
X = torch.randn(BATCH, IN, dtype=torch.float64)


def f(x: Tensor) -> Tensor:
    return functional_call(MODEL, PARAMS, (x,))


def scalar(x: Tensor) -> Tensor:
    return f(x).sin().sum()


def loop_jacobian(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """d fn(x) / d x, one autograd.grad call per output element."""
    x = x.detach().requires_grad_()
    out = fn(x)
    y = out.reshape(-1)
    rows = [torch.autograd.grad(y[i], x, retain_graph=True)[0] for i in range(y.numel())]
    return torch.stack(rows).reshape(*out.shape, *x.shape)


def loop_hessian(x: Tensor) -> Tensor:
    def input_grad(xx: Tensor) -> Tensor:
        return torch.autograd.grad(scalar(xx), xx, create_graph=True)[0]

    return loop_jacobian(input_grad, x)


def both_ways(call: Callable[[], T]) -> Dict[bool, T]:
    """``{True: result with routing on, False: result with stock torch.func}``."""
    results = {}
    for routing in (True, False):
        with batchrules.enabled(routing):
            results[routing] = call()
    return results


CASES: Dict[str, Callable[[], Tensor]] = {
    "jacrev": lambda: jacrev(f)(X[0]),
    "jacfwd": lambda: jacfwd(f)(X[0]),
    "hessian": lambda: hessian(scalar)(X[0]),
    "vmap_jacrev": lambda: vmap(jacrev(f))(X),
    "vmap_jacfwd": lambda: vmap(jacfwd(f))(X),
    "vmap_hessian": lambda: vmap(hessian(scalar))(X),
}


def reference(name: str) -> Tensor:
    single = loop_hessian if "hessian" in name else (lambda x: loop_jacobian(f, x))
    return torch.stack([single(x) for x in X]) if name.startswith("vmap") else single(X[0])


@pytest.mark.parametrize("name", list(CASES))
def test_jacobians_and_hessians(name: str, no_vmap_fallback: None) -> None:
    results = both_ways(CASES[name])
    expected = reference(name)
    torch.testing.assert_close(results[True], expected)
    torch.testing.assert_close(results[False], expected)
    with batchrules.enabled(True):
        counts = batchrules_op_counts(CASES[name])
    assert counts.get("batchrules::linear", 0) >= 3
    if "jacfwd" not in name:
        assert counts.get("batchrules::linear_backward", 0) >= 3


def test_jacrev_wrt_parameters(no_vmap_fallback: None) -> None:
    def of_params(p: Dict[str, Tensor]) -> Tensor:
        return functional_call(MODEL, p, (X,))

    results = both_ways(lambda: jacrev(of_params)(PARAMS))
    for name, param in MODEL.named_parameters():
        def of_one(t: Tensor, name: str = name) -> Tensor:
            return functional_call(MODEL, {**PARAMS, name: t}, (X,))

        expected = loop_jacobian(of_one, param.detach())
        torch.testing.assert_close(results[True][name], expected)
        torch.testing.assert_close(results[False][name], expected)


@pytest.mark.parametrize("batched", [False, True])
def test_jvp(batched: bool, no_vmap_fallback: None) -> None:
    tangents = torch.randn(BATCH, IN, dtype=torch.float64)

    def call() -> Tuple[Tensor, Tensor]:
        if batched:
            return vmap(lambda x, t: jvp(f, (x,), (t,)))(X, tangents)
        return jvp(f, (X[0],), (tangents[0],))

    if batched:
        expected_primal = f(X)
        expected_tangent = torch.stack([loop_jacobian(f, x) @ t for x, t in zip(X, tangents)])
    else:
        expected_primal = f(X[0])
        expected_tangent = loop_jacobian(f, X[0]) @ tangents[0]
    for primal, tangent in both_ways(call).values():
        torch.testing.assert_close(primal, expected_primal)
        torch.testing.assert_close(tangent, expected_tangent)
    with batchrules.enabled(True):
        assert batchrules_op_counts(call).get("batchrules::linear", 0) >= 3
