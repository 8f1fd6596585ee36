"""The loss rules are registered by the routing switch and withdrawn by it exactly."""
from typing import Dict

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

import batchrules

# The aten ops functorch batches through Python decompositions, which the rules replace ...
DECOMPOSED = ("nll_loss_forward", "nll_loss2d_forward", "nll_loss_backward",
              "nll_loss2d_backward", "mse_loss_backward", "smooth_l1_loss_backward",
              "huber_loss_backward")
# ... and one whose functorch C++ rule the rules replace.
OPS = DECOMPOSED + ("huber_loss",)
ROUTED_KERNEL_SOURCE = "routing.cpp"  # the __FILE__ of the routing libraries


def registrations() -> Dict[str, str]:
    return {op: torch._C._dispatch_dump(f"aten::{op}") for op in OPS}


with batchrules.enabled(False):  # loads functorch's decompositions first
    STOCK = registrations()


@pytest.mark.parametrize("op", OPS)
def test_stock_batching_rule(op: str) -> None:
    batched = [line for line in STOCK[op].splitlines() if line.startswith("FuncTorchBatched:")]
    source = "predispatch.py" if op in DECOMPOSED else "BatchRulesLoss.cpp"
    assert len(batched) == 1 and source in batched[0]


def test_enable_replaces_and_disable_restores(routing_off: None) -> None:
    batchrules.enable()
    routed = registrations()
    for op in OPS:
        active = [line for line in routed[op].splitlines() if line.startswith("FuncTorchBatched:")]
        assert len(active) == 1 and ROUTED_KERNEL_SOURCE in active[0], routed[op]
        assert "FuncTorchBatched (inactive)" in routed[op]  # functorch's, kept by the dispatcher
    batchrules.disable()
    assert registrations() == STOCK


def test_routing_off_runs_stock(routing_off: None) -> None:
    """With routing off the decompositions run: stock's kernels, not the rules'."""
    from torch.profiler import ProfilerActivity, profile
    f = vmap(grad(F.cross_entropy))
    x, t = torch.randn(3, 4, 5), torch.randint(0, 5, (3, 4))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        f(x, t)
    names = {e.name for e in prof.events()}
    assert "aten::nll_loss_forward" in names  # the op is called ...
    assert "aten::gather" in names            # ... and decomposed
    with batchrules.enabled(True), profile(activities=[ProfilerActivity.CPU]) as prof:
        f(x, t)
    assert "aten::gather" not in {e.name for e in prof.events()}
