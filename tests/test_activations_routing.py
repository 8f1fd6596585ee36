"""Routing of aten::silu / aten::mish (F.silu, nn.SiLU, F.mish, nn.Mish) under
torch.func transforms: what runs under each transform, the kernels vmap(grad)
issues, exact restoration on disable, and eager code left alone."""
from collections import Counter
from typing import Callable, Dict, List

import pytest
import torch
import torch.nn.functional as F
from activation_samples import ACTS, Act
from routing_transforms import REVERSE_MODE, X, transforms
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.profiler import ProfilerActivity, profile

import batchrules
from batchrules.examples.inspect_routing import batchrules_op_counts

ROUTED_KERNEL_SOURCE = "routing.cpp"  # where the route libraries are created (the dump names it)


def dispatch_dumps() -> Dict[str, str]:
    """The dispatcher's registrations for the routed aten ops, inactive ones included."""
    return {op: torch._C._dispatch_dump(f"aten::{op}") for op in ("silu", "mish", "silu_", "mish_")}


with batchrules.enabled(False):
    STOCK_DUMPS = dispatch_dumps()


def callers(act: Act) -> Dict[str, Callable[[Tensor], Tensor]]:
    """The user-facing ways of calling the aten op (F.silu, nn.SiLU(), ...)."""
    return {"functional": act.stock, "module": act.module()}


def mlp(act: Act) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), act.module(), nn.Linear(4, 4), act.module(),
                         nn.Linear(4, 2)).double()




@pytest.mark.parametrize("name", list(transforms(nn.Identity())))
@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_transform_runs_batchrules_op(act: Act, name: str, no_vmap_fallback: None) -> None:
    call = transforms(mlp(act))[name]
    with batchrules.enabled(True):
        routed_counts = batchrules_op_counts(call)
        routed = call()
    with batchrules.enabled(False):
        stock_counts = batchrules_op_counts(call)
        stock = call()
    assert routed_counts.get(f"batchrules::{act.name}", 0) >= 2, routed_counts  # both layers
    if name in REVERSE_MODE:
        assert routed_counts.get(f"batchrules::{act.name}_backward", 0) >= 2, routed_counts
        node = f"Batchrules{act.name.capitalize()}Backward0"
        assert routed_counts.get(node, 0) >= 2, routed_counts
    assert stock_counts == {}
    torch.testing.assert_close(routed, stock)


@pytest.mark.parametrize("caller", ["functional", "module"])
@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_every_caller_is_routed(act: Act, caller: str, routing_on: None) -> None:
    fn = callers(act)[caller]
    counts = batchrules_op_counts(lambda: vmap(grad(lambda x: fn(x).sum()))(X))
    assert counts.get(f"batchrules::{act.name}_backward", 0) >= 1, counts


ALLOCATIONS = ("aten::empty", "aten::empty_like", "aten::empty_strided")


def ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def profiled_events(fn: Callable[[], object]) -> list:
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return list(prof.events())


def aten_ops_under(events, node: str) -> List[str]:
    """The aten ops (allocations aside) the autograd node ``node`` issued."""
    return sorted(e.name for e in events if e.name.startswith("aten::")
                  and e.name not in ALLOCATIONS and any(a.name == node for a in ancestors(e)))


def kernels(events, name: str) -> int:
    """Calls of ``name`` that ran a kernel (no op below them: not a route)."""
    return sum(1 for e in events if e.name == name and not any(
        c.name.startswith(("aten::", "batchrules::")) and c.name not in ALLOCATIONS
        for c in e.cpu_children))


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_vmap_grad_issues_one_backward_kernel(act: Act, no_vmap_fallback: None) -> None:
    """vmap(grad(act(x).sum())): stock autograd differentiates the create_graph
    composite (sigmoid, mul, add, ...); routed, the backward is one
    <act>_backward kernel, as for GELU or tanh."""
    x = torch.randn(4, 7)
    call = lambda: vmap(grad(lambda t: act.stock(t).sum()))(x)  # noqa: E731
    with batchrules.enabled(False):
        stock = profiled_events(call)
    with batchrules.enabled(True):
        routed = profiled_events(call)
    stock_ops = aten_ops_under(stock, f"{act.name.capitalize()}Backward0")
    assert "aten::sigmoid" in stock_ops and len(stock_ops) >= 6, stock_ops
    routed_ops = aten_ops_under(routed, f"Batchrules{act.name.capitalize()}Backward0")
    assert routed_ops == [f"aten::{act.name}_backward"], routed_ops
    assert kernels(routed, f"aten::{act.name}") == 1


def top_level_ops(events) -> List[str]:
    """The ops the step issued itself (user code and autograd nodes), not those
    nested inside other ops."""
    def is_op(e) -> bool:
        return e.name.startswith(("aten::", "batchrules::"))

    return [e.name for e in events if is_op(e) and not any(is_op(a) for a in ancestors(e))]


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_vmap_grad_issues_as_many_ops_as_gelu(act: Act, no_vmap_fallback: None) -> None:
    """Under vmap(grad) stock SiLU runs 12 top-level ops (Mish 16) where GELU
    runs 5; routed, SiLU and Mish run 5 like GELU."""
    x = torch.randn(4, 7)

    def step(fn: Callable[[Tensor], Tensor]) -> List[str]:
        return top_level_ops(profiled_events(lambda: vmap(grad(lambda t: fn(t).sum()))(x)))

    with batchrules.enabled(True):
        routed, gelu = step(act.stock), step(F.gelu)
    with batchrules.enabled(False):
        stock = step(act.stock)
    assert len(gelu) == 5, gelu
    assert routed == [f"aten::{act.name}", "aten::sum", "aten::ones_like", "aten::expand",
                      f"batchrules::{act.name}_backward"], routed
    assert len(stock) == (12 if act.name == "silu" else 16), stock


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_one_backward_kernel_per_layer_in_an_ensemble(act: Act, no_vmap_fallback: None) -> None:
    model = mlp(act)
    params, buffers = torch.func.stack_module_state([model, mlp(act), mlp(act)])
    x, y = torch.randn(3, 5, 3, dtype=torch.float64), torch.randn(3, 5, 2, dtype=torch.float64)

    def loss(p, b, xi, yi):
        return F.mse_loss(functional_call(model, (p, b), (xi,)), yi)

    step = vmap(grad(loss))
    with batchrules.enabled(True):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(params, buffers, x, y)
    names = Counter(e.name for e in prof.events())
    assert names[f"aten::{act.name}_backward"] == 2, names  # two activation layers
    assert names["aten::sigmoid"] == 0, names


# --- Disabling and eager code -------------------------------------------------------------------


def test_enable_disable_restores_stock_exactly(routing_off: None) -> None:
    for _ in range(2):
        batchrules.enable()
    routed = dispatch_dumps()
    for op in ("silu", "mish"):
        assert routed[op].count(ROUTED_KERNEL_SOURCE) == 1, routed[op]
    for op in ("silu_", "mish_"):  # in-place variants stay stock
        assert routed[op] == STOCK_DUMPS[op]
    batchrules.disable()
    assert dispatch_dumps() == STOCK_DUMPS


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_disable_restores_stock_path(act: Act, routing_off: None) -> None:
    batchrules.enable()
    batchrules.disable()
    counts = batchrules_op_counts(lambda: vmap(grad(lambda t: act.stock(t).sum()))(X))
    assert counts == {}


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_eager_path_unchanged_while_enabled(act: Act) -> None:
    x = torch.randn(4, 3, requires_grad=True)

    def forward_backward() -> list:
        y = act.module()(x)
        (gx,) = torch.autograd.grad(y.sum(), x)
        return [y.detach(), gx, y.grad_fn.name()]

    with batchrules.enabled(False):
        stock = forward_backward()
    with batchrules.enabled(True):
        assert batchrules_op_counts(forward_backward) == {}
        routed = forward_backward()
    assert routed[2] == stock[2] == f"{act.name.capitalize()}Backward0"
    assert torch.equal(routed[0], stock[0]) and torch.equal(routed[1], stock[1])


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_inplace_variant_stays_stock(act: Act, routing_on: None) -> None:
    fn = F.silu if act.name == "silu" else F.mish

    def inplace(t: Tensor) -> Tensor:
        return fn(t.clone(), inplace=True)

    x = torch.randn(4, 3)
    counts = batchrules_op_counts(lambda: vmap(inplace)(x))
    assert counts == {}
    torch.testing.assert_close(vmap(inplace)(x), act.stock(x))
