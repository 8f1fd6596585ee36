"""Flow 2: ensembling with stack_module_state and functional_call on a meta
base under vmap, compared with stock torch.func (routing off) and with running
or training the N models one by one."""
import copy
from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import batchrules
from batchrules.examples.ensembling import ensemble_forward, ensemble_train_step, make_mlp, stack_models
from batchrules.examples.inspect_routing import batchrules_op_counts

N_MODELS, BATCH, IN, HIDDEN, CLASSES = 3, 5, 4, 6, 3


def make_models() -> List[nn.Module]:
    torch.manual_seed(0)
    return [make_mlp(IN, HIDDEN, CLASSES).double() for _ in range(N_MODELS)]


def data() -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N_MODELS, BATCH, IN, dtype=torch.float64, generator=gen)
    return x, torch.randint(CLASSES, (N_MODELS, BATCH), generator=gen)


def test_base_lives_on_meta() -> None:
    base, params, _ = stack_models(make_models())
    assert {p.device.type for p in base.parameters()} == {"meta"}
    assert params["0.weight"].shape == (N_MODELS, HIDDEN, IN)


@pytest.mark.parametrize("shared_input", [False, True], ids=["per_model_batches", "shared_batch"])
def test_ensemble_forward(shared_input: bool, no_vmap_fallback: None) -> None:
    models = make_models()
    base, params, buffers = stack_models(models)
    x = data()[0][0] if shared_input else data()[0]
    with torch.no_grad():
        loop = torch.stack([m(x if shared_input else x[n]) for n, m in enumerate(models)])
        with batchrules.enabled(True):
            routed = ensemble_forward(base, params, buffers, x, shared_input)
            counts = batchrules_op_counts(ensemble_forward, base, params, buffers, x, shared_input)
        with batchrules.enabled(False):
            stock = ensemble_forward(base, params, buffers, x, shared_input)
    assert counts.get("batchrules::linear", 0) >= 2
    torch.testing.assert_close(routed, loop)
    torch.testing.assert_close(stock, loop)


OPTIMIZERS: Dict[str, Callable[[List[Tensor]], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05),
}


def train_one_by_one(models: List[nn.Module], optimizer_name: str, steps: int) -> List[nn.Module]:
    x, y = data()
    trained = copy.deepcopy(models)
    for n, model in enumerate(trained):
        optimizer = OPTIMIZERS[optimizer_name](list(model.parameters()))
        for _ in range(steps):
            F.cross_entropy(model(x[n]), y[n]).backward()
            optimizer.step()
            optimizer.zero_grad()
    return trained


def train_stacked(models: List[nn.Module], optimizer_name: str, steps: int,
                  routing: bool) -> Tuple[Dict[str, Tensor], List[Tensor]]:
    x, y = data()
    base, params, buffers = stack_models(models)
    optimizer = OPTIMIZERS[optimizer_name](list(params.values()))
    losses = []
    with batchrules.enabled(routing):
        for _ in range(steps):
            losses.append(ensemble_train_step(base, params, buffers, x, y, optimizer))
    return params, losses


@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
def test_training_step_equals_training_models_one_by_one(optimizer_name: str,
                                                          no_vmap_fallback: None) -> None:
    models, steps = make_models(), 3
    reference = train_one_by_one(models, optimizer_name, steps)
    routed, routed_losses = train_stacked(models, optimizer_name, steps, routing=True)
    stock, _ = train_stacked(models, optimizer_name, steps, routing=False)
    for params in (routed, stock):
        for name, stacked in params.items():
            expected = torch.stack([dict(m.named_parameters())[name] for m in reference])
            torch.testing.assert_close(stacked.detach(), expected)
    assert routed_losses[-1].shape == (N_MODELS,)
    assert bool((routed_losses[-1] < routed_losses[0]).all())  # it trains


def test_training_step_runs_batchrules(routing_on: None, no_vmap_fallback: None) -> None:
    x, y = data()
    base, params, buffers = stack_models(make_models())
    optimizer = torch.optim.SGD(list(params.values()), lr=0.1)
    counts = batchrules_op_counts(ensemble_train_step, base, params, buffers, x, y, optimizer)
    assert counts.get("batchrules::linear_backward", 0) >= 2
    assert counts.get("BatchrulesLinearBackward0", 0) >= 2
