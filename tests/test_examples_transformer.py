"""Transformer flows with the per-example fallback disabled, against float64
for-loop references: per-sample gradients of an nn.TransformerEncoderLayer
(no mask, key-padding mask, causal mask) and an ensemble of 4 encoder layers
(d_model=64, nhead=4, T=32), forward and vmap(grad) training."""
from typing import Dict, Optional

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close
from torch import Tensor
from torch.func import functional_call, grad, vmap

import batchrules
from batchrules.examples import transformer

pytestmark = pytest.mark.usefixtures("routing_on", "no_vmap_fallback")

Params = Dict[str, Tensor]
BATCH, SEQ = 4, 12
MEMBERS, ENS_BATCH, ENS_SEQ, D_MODEL, NHEAD = 4, 3, 32, 64, 4


@pytest.mark.parametrize("mask", ["none", "padding", "causal"])
def test_per_sample_grads(mask: str) -> None:
    torch.manual_seed(0)
    layer = transformer.make_encoder(32, 4, 48).double()
    params = {k: p.detach() for k, p in layer.named_parameters()}
    x = torch.randn(BATCH, SEQ, 32, dtype=torch.float64)
    y = torch.randn(BATCH, SEQ, 32, dtype=torch.float64)
    padding: Optional[Tensor] = None
    if mask == "padding":
        padding = torch.arange(SEQ) >= torch.tensor([[SEQ], [7], [3], [10]])
    causal = mask == "causal"
    got = transformer.per_sample_grads(layer, params, x, y, padding, causal)
    want = transformer.loop_per_sample_grads(layer, x, y, padding, causal)
    assert_close(got, want)


def make_ensemble():
    torch.manual_seed(1)
    layers = [transformer.make_encoder(D_MODEL, NHEAD).double() for _ in range(MEMBERS)]
    base, params, buffers = transformer.stack_layers(layers)
    x = torch.randn(MEMBERS, ENS_BATCH, ENS_SEQ, D_MODEL, dtype=torch.float64)
    y = torch.randn(MEMBERS, ENS_BATCH, ENS_SEQ, D_MODEL, dtype=torch.float64)
    return layers, base, params, buffers, x, y


def test_ensemble_forward() -> None:
    layers, base, params, buffers, x, _ = make_ensemble()
    got = transformer.ensemble_forward(base, params, buffers, x)
    want = torch.stack([layer(x[m]) for m, layer in enumerate(layers)])
    torch.testing.assert_close(got, want)


def test_ensemble_training_grads() -> None:
    layers, base, params, buffers, x, y = make_ensemble()

    def loss(p: Params, b: Params, xb: Tensor, yb: Tensor) -> Tensor:
        return F.mse_loss(functional_call(base, (p, b), (xb,)), yb)

    got = vmap(grad(loss))(params, buffers, x, y)
    per_member = [torch.autograd.grad(F.mse_loss(layer(x[m]), y[m]), list(layer.parameters()))
                  for m, layer in enumerate(layers)]
    names = [k for k, _ in layers[0].named_parameters()]
    assert_close(got, {k: torch.stack(col) for k, col in zip(names, zip(*per_member))})


def test_ensemble_train_step_runs_without_fallback() -> None:
    _, base, params, buffers, x, y = make_ensemble()
    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    first = transformer.ensemble_train_step(base, params, buffers, x, y, optimizer)
    second = transformer.ensemble_train_step(base, params, buffers, x, y, optimizer)
    assert first.shape == (MEMBERS,) and bool((second < first).all())


def test_example_main(capsys: pytest.CaptureFixture) -> None:
    transformer.main()
    printed = capsys.readouterr().out
    assert "self_attn.in_proj_weight: (8, 192, 64)" in printed
    assert "matches loop: True" in printed
    assert "ensemble output: (4, 8, 32, 64)" in printed
    assert batchrules.is_enabled()
