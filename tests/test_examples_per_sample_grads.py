"""Flow 3: per-sample gradients with vmap(grad(loss), in_dims=(None, 0, 0)) over
an MLP and a conv+linear net, and a DP-SGD step, compared with stock
torch.func (routing off) and a Python loop of per-sample autograd calls."""
from typing import Callable, Dict, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import batchrules
from batchrules.examples.inspect_routing import batchrules_op_counts
from batchrules.examples.per_sample_grads import (
    clipped_sum,
    dp_sgd_step,
    make_conv_net,
    make_mlp,
    per_sample_grads,
)

BATCH, CLASSES = 6, 10
Params = Dict[str, Tensor]

MODELS: Dict[str, Tuple[Callable[[], nn.Module], Tuple[int, ...]]] = {
    "mlp": (make_mlp, (16,)),
    "conv_linear": (make_conv_net, (1, 8, 8)),
}


def setup(name: str) -> Tuple[nn.Module, Params, Tensor, Tensor]:
    torch.manual_seed(0)
    make, sample_shape = MODELS[name]
    model = make().double()
    params = {k: p.detach() for k, p in model.named_parameters()}
    x = torch.randn(BATCH, *sample_shape, dtype=torch.float64)
    return model, params, x, torch.randint(CLASSES, (BATCH,))


def loop_per_sample_grads(model: nn.Module, x: Tensor, y: Tensor) -> Params:
    params = dict(model.named_parameters())
    rows = [torch.autograd.grad(F.cross_entropy(model(x[b:b + 1]), y[b:b + 1]),
                                list(params.values())) for b in range(BATCH)]
    return {k: torch.stack(column) for k, column in zip(params, zip(*rows))}


def loop_clipped_sum(model: nn.Module, x: Tensor, y: Tensor, max_norm: float) -> Params:
    grads = loop_per_sample_grads(model, x, y)
    total = {k: torch.zeros_like(g[0]) for k, g in grads.items()}
    for b in range(BATCH):
        norm = torch.cat([g[b].flatten() for g in grads.values()]).norm()
        scale = min(1.0, max_norm / (norm.item() + 1e-6))
        for k, g in grads.items():
            total[k] += scale * g[b]
    return total


@pytest.mark.parametrize("name", list(MODELS))
def test_per_sample_grads(name: str, no_vmap_fallback: None) -> None:
    model, params, x, y = setup(name)
    loop = loop_per_sample_grads(model, x, y)
    with batchrules.enabled(True):
        routed = per_sample_grads(model, params, x, y)
        counts = batchrules_op_counts(per_sample_grads, model, params, x, y)
    with batchrules.enabled(False):
        stock = per_sample_grads(model, params, x, y)
    assert counts.get("batchrules::linear_backward", 0) >= 2
    assert counts.get("BatchrulesLinearBackward0", 0) >= 2
    torch.testing.assert_close(routed, loop)
    torch.testing.assert_close(stock, loop)


@pytest.mark.parametrize("name", list(MODELS))
def test_dp_sgd_clipped_sum_equals_loop(name: str, no_vmap_fallback: None) -> None:
    model, params, x, y = setup(name)
    max_norm = 0.5
    loop = loop_clipped_sum(model, x, y, max_norm)
    for routing in (True, False):
        with batchrules.enabled(routing):
            got = clipped_sum(per_sample_grads(model, params, x, y), max_norm)
        torch.testing.assert_close(got, loop)
    grads = loop_per_sample_grads(model, x, y).values()
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads]).norm(dim=0)
    assert bool((norms > max_norm).any())  # clipping is exercised


def test_dp_sgd_step_with_fixed_generator(no_vmap_fallback: None) -> None:
    model, params, x, y = setup("conv_linear")
    lr, max_norm, sigma = 0.1, 0.5, 1.2
    summed = loop_clipped_sum(model, x, y, max_norm)
    gen = torch.Generator().manual_seed(7)
    expected = {}
    for k, p in params.items():
        noise = torch.randn(p.shape, generator=gen, dtype=p.dtype) * sigma * max_norm
        expected[k] = p - lr * (summed[k] + noise) / BATCH
    for routing in (True, False):
        with batchrules.enabled(routing):
            got = dp_sgd_step(model, params, x, y, lr, max_norm, sigma,
                              generator=torch.Generator().manual_seed(7))
        torch.testing.assert_close(got, expected)
