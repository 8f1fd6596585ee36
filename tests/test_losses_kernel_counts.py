"""How many ATen compute kernels the losses issue under vmap(grad), read from the profiler.

Each routed case pins its exact kernels, so that a regression to a decomposition fails,
and the stock path (routing off: functorch's Python decompositions) is counted alongside
to show the gain. Deterministic on CPU for a fixed PyTorch.
"""
from typing import Callable, List

import batching_profile
import pytest
import torch
import torch.nn.functional as F
from batching_profile import ran_kernels
from torch.func import grad, vmap

import batchrules

B, N, C = 8, 4, 10
WEIGHT = torch.rand(C)

pytestmark = pytest.mark.usefixtures("no_vmap_fallback")

# batching_profile counts the ops linear's tests need; the loss tests also count the loss
# kernels and what their decompositions issue.
LOSS_COMPUTE = frozenset("aten::" + name for name in (
    "nll_loss_forward nll_loss_backward nll_loss2d_forward nll_loss2d_backward "
    "mse_loss mse_loss_backward smooth_l1_loss smooth_l1_loss_backward huber_loss "
    "huber_loss_backward _log_softmax _log_softmax_backward_data gather scatter ne eq "
    "_to_copy abs sign lt gt pow masked_fill exp").split())


@pytest.fixture(autouse=True)
def count_loss_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batching_profile, "COMPUTE", batching_profile.COMPUTE | LOSS_COMPUTE)


def per_sample(loss: Callable) -> Callable:
    """vmap(grad) of ``loss`` on one example made a batch of one, as per-sample code does."""
    return vmap(grad(lambda x, t: loss(x.unsqueeze(0), t.unsqueeze(0))))


# The kernels of every routed step: the loss's forward kernel (nll: with reduction 'none')
# and backward kernel, and the per-example reductions around them.
NLL_PER_EXAMPLE = ["_to_copy", "div", "div", "ne"]  # total weight, 'mean' forward and backward
CASES = {
    # name: (transformed step, args, routed kernels (fill_: grad's ones_like seed))
    "ce_per_sample": (per_sample(F.cross_entropy), (torch.randn(B, C), torch.randint(0, C, (B,))),
                      sorted(["_log_softmax", "_log_softmax_backward_data", "fill_",
                              "nll_loss_forward", "nll_loss_backward"] + NLL_PER_EXAMPLE)),
    "nll_per_sample": (per_sample(F.nll_loss), (torch.randn(B, C), torch.randint(0, C, (B,))),
                       sorted(["fill_", "nll_loss_forward", "nll_loss_backward"] + NLL_PER_EXAMPLE)),
    # N rows per example: a sum of each example's rows; copy_: each row's gradient
    "ce_rows": (vmap(grad(F.cross_entropy)), (torch.randn(B, N, C), torch.randint(0, C, (B, N))),
                sorted(["_log_softmax", "_log_softmax_backward_data", "copy_", "fill_", "fill_",
                        "nll_loss_forward", "nll_loss_backward", "sum"] + NLL_PER_EXAMPLE)),
    "ce_weight_ignore": (
        vmap(grad(lambda x, t: F.cross_entropy(x, t, WEIGHT, ignore_index=1))),
        (torch.randn(B, N, C), torch.randint(0, C, (B, N))),
        sorted(["_log_softmax", "_log_softmax_backward_data", "_to_copy", "copy_", "div", "div",
                "fill_", "index_select", "ne", "nll_loss_backward", "nll_loss_forward", "sum",
                "sum", "where"])),
    "ce_spatial": (vmap(grad(F.cross_entropy)),
                   (torch.randn(B, 2, C, 3, 3), torch.randint(0, C, (B, 2, 3, 3))),
                   sorted(["_log_softmax", "_log_softmax_backward_data", "copy_", "fill_", "fill_",
                           "nll_loss2d_forward", "nll_loss2d_backward", "sum"] + NLL_PER_EXAMPLE)),
    # A division by a number shows as the _to_copy of its wrapped scalar (the forward
    # rule's mean, the backward's 1/numel); zero_ is the backward kernel's output init.
    "mse": (vmap(grad(F.mse_loss)), (torch.randn(B, C), torch.randn(B, C)),
            ["_to_copy", "_to_copy", "fill_", "mse_loss", "mse_loss_backward", "sum", "zero_"]),
    "smooth_l1": (vmap(grad(F.smooth_l1_loss)), (torch.randn(B, C), torch.randn(B, C)),
                  ["_to_copy", "_to_copy", "fill_", "smooth_l1_loss", "smooth_l1_loss_backward",
                   "sum", "zero_"]),
    "huber": (vmap(grad(F.huber_loss)), (torch.randn(B, C), torch.randn(B, C)),
              ["_to_copy", "_to_copy", "fill_", "huber_loss", "huber_loss_backward", "sum",
               "zero_"]),
}


def kernels(fn: Callable, args, routing: bool) -> List[str]:
    with batchrules.enabled(routing):
        return ran_kernels(fn, *args)


@pytest.mark.parametrize("case", CASES)
def test_routed_kernels(case: str) -> None:
    fn, args, expected = CASES[case]
    assert kernels(fn, args, routing=True) == expected


@pytest.mark.parametrize("case", CASES)
def test_fewer_kernels_than_stock(case: str) -> None:
    fn, args, _ = CASES[case]
    routed, stock = kernels(fn, args, routing=True), kernels(fn, args, routing=False)
    # mse's stock backward is already three kernels (sub, mul, mul); the rule's is one
    margin = 0 if case == "mse" else 5
    assert len(routed) + margin <= len(stock), (routed, stock)
    assert "where" not in routed or case == "ce_weight_ignore"


def test_stock_decomposes_nll() -> None:
    """The gap the rules close: stock runs nll_loss_forward/backward as ~10 ops each."""
    fn, args, _ = CASES["ce_per_sample"]
    stock = kernels(fn, args, routing=False)
    assert "nll_loss_forward" not in stock and "nll_loss_backward" not in stock
    assert stock.count("where") >= 4 and "scatter" in stock and "gather" in stock
