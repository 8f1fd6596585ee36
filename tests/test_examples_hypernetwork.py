"""Flow 1: a hypernetwork makes per-sample weights that the main net applies
under vmap; forward and vmap(grad) through both networks, compared with stock
torch.func (routing off) and a Python loop."""
from typing import Dict, Tuple

import pytest
import torch
from torch import Tensor

import batchrules
from batchrules.examples.hypernetwork import HyperNet, MainNet, forward, per_sample_grads, sample_loss
from batchrules.examples.inspect_routing import batchrules_op_counts

BATCH, COND, IN, HIDDEN, CLASSES = 6, 4, 5, 3, 4


def setup(dtype: torch.dtype) -> Tuple[HyperNet, MainNet, Tensor, Tensor, Tensor]:
    torch.manual_seed(0)
    hyper = HyperNet(COND, IN, HIDDEN).to(dtype)
    net = MainNet(HIDDEN, CLASSES).to(dtype)
    z, x = torch.randn(BATCH, COND, dtype=dtype), torch.randn(BATCH, IN, dtype=dtype)
    return hyper, net, z, x, torch.randint(CLASSES, (BATCH,))


def loop_per_sample_grads(hyper: HyperNet, net: MainNet, z: Tensor, x: Tensor,
                          y: Tensor) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    hp, mp = dict(hyper.named_parameters()), dict(net.named_parameters())
    rows = [torch.autograd.grad(sample_loss(hyper, net, hp, mp, z[b], x[b], y[b]),
                                [*hp.values(), *mp.values()]) for b in range(BATCH)]
    stacked = [torch.stack(column) for column in zip(*rows)]
    return dict(zip(hp, stacked[:len(hp)])), dict(zip(mp, stacked[len(hp):]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_forward_over_per_sample_weights(dtype: torch.dtype, no_vmap_fallback: None) -> None:
    hyper, net, z, x, _ = setup(dtype)
    with torch.no_grad():
        loop = torch.stack([net(x[b], *hyper(z[b])) for b in range(BATCH)])
        with batchrules.enabled(True):
            routed = forward(hyper, net, z, x)
            counts = batchrules_op_counts(forward, hyper, net, z, x)
        with batchrules.enabled(False):
            stock = forward(hyper, net, z, x)
    assert counts.get("batchrules::linear", 0) >= 2  # the per-sample layer and the head
    torch.testing.assert_close(routed, loop)
    torch.testing.assert_close(stock, loop)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_per_sample_grads_through_both_networks(dtype: torch.dtype, no_vmap_fallback: None) -> None:
    hyper, net, z, x, y = setup(dtype)
    loop_hyper, loop_main = loop_per_sample_grads(hyper, net, z, x, y)
    with batchrules.enabled(True):
        routed_hyper, routed_main = per_sample_grads(hyper, net, z, x, y)
        counts = batchrules_op_counts(per_sample_grads, hyper, net, z, x, y)
    with batchrules.enabled(False):
        stock_hyper, stock_main = per_sample_grads(hyper, net, z, x, y)
    # 3 linears in the hypernetwork, 2 in the main net, each with a backward
    assert counts.get("batchrules::linear", 0) >= 5
    assert counts.get("BatchrulesLinearBackward0", 0) >= 5
    for got in (routed_hyper, stock_hyper):
        torch.testing.assert_close(got, loop_hyper)
    for got in (routed_main, stock_main):
        torch.testing.assert_close(got, loop_main)
    assert routed_hyper["to_weight.weight"].shape == (BATCH, HIDDEN * IN, 16)
