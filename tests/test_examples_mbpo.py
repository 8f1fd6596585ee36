"""Flow: an MBPO-style SiLU ensemble with a Gaussian NLL head
(batchrules/examples/mbpo_ensemble.py), trained with vmap(grad) over stacked
parameters and one Adam, against training each member alone with
F.gaussian_nll_loss in a for-loop, in float64, with routing on and off."""
import copy
from collections import Counter
from typing import List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

import batchrules
from batchrules.examples.mbpo_ensemble import (
    BOUND_REG,
    Ensemble,
    GaussianDynamics,
    bootstrap,
    gaussian_nll,
    main,
)

MEMBERS, OBS, ACT, HIDDEN, LAYERS, BATCH, STEPS = 7, 3, 2, 8, 3, 5, 3
LR = 1e-2

pytestmark = pytest.mark.usefixtures("no_vmap_fallback")


def members() -> List[nn.Module]:
    torch.manual_seed(0)
    return [GaussianDynamics(OBS, ACT, HIDDEN, LAYERS).double() for _ in range(MEMBERS)]


def batches() -> List[Tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, OBS + ACT, dtype=torch.float64, generator=gen)
    y = torch.randn(40, OBS + 1, dtype=torch.float64, generator=gen)
    return [bootstrap(x, y, MEMBERS, BATCH, gen) for _ in range(STEPS)]


def train_one_by_one(models: List[nn.Module]) -> Tuple[List[nn.Module], Tensor]:
    """Each member alone, with the library loss and its own Adam."""
    models = [copy.deepcopy(m) for m in models]
    optimizers = [torch.optim.Adam(m.parameters(), lr=LR) for m in models]
    losses = []
    for x, y in batches():
        step_losses = []
        for e, (model, opt) in enumerate(zip(models, optimizers)):
            mean, logvar = model(x[e])
            loss = F.gaussian_nll_loss(mean, y[e], logvar.exp(), full=False)
            loss = loss + BOUND_REG * (model.max_logvar.sum() - model.min_logvar.sum())
            loss.backward()
            opt.step()
            opt.zero_grad()
            step_losses.append(loss.detach())
        losses.append(torch.stack(step_losses))
    return models, torch.stack(losses)


@pytest.mark.parametrize("routing", [True, False], ids=["routing", "stock"])
def test_training_matches_member_by_member(routing: bool) -> None:
    models = members()
    want_models, want_losses = train_one_by_one(models)
    ensemble = Ensemble(models, lr=LR)
    with batchrules.enabled(routing):
        losses = torch.stack([ensemble.train_step(x, y) for x, y in batches()])
    torch.testing.assert_close(losses, want_losses)
    for name, stacked in ensemble.params.items():
        want = torch.stack([dict(m.named_parameters())[name] for m in want_models])
        torch.testing.assert_close(stacked.detach(), want.detach(), msg=name)


def test_predict_matches_members() -> None:
    models = members()
    ensemble = Ensemble(models)
    x = torch.randn(6, OBS + ACT, dtype=torch.float64)
    with batchrules.enabled():
        mean, logvar = ensemble.predict(x)
    with torch.no_grad():
        for e, m in enumerate(models):
            want_mean, want_logvar = m(x)
            torch.testing.assert_close(mean[e], want_mean)
            torch.testing.assert_close(logvar[e], want_logvar)


def test_loss_is_gaussian_nll_loss() -> None:
    mean, logvar, y = (torch.randn(4, 5, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(gaussian_nll(mean, logvar, y),
                               F.gaussian_nll_loss(mean, y, logvar.exp(), full=False))


def test_one_silu_backward_kernel_per_layer() -> None:
    ensemble = Ensemble(members())
    x, y = batches()[0]
    counts = {}
    for routing in (True, False):
        with batchrules.enabled(routing):
            ensemble.train_step(x, y)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                ensemble.train_step(x, y)
        counts[routing] = Counter(e.name for e in prof.events())
    assert counts[True]["aten::silu_backward"] == LAYERS, counts[True]
    assert counts[True]["aten::sigmoid"] == 0, counts[True]
    assert counts[False]["aten::sigmoid"] >= LAYERS, counts[False]


def test_main_trains(capsys: pytest.CaptureFixture) -> None:
    with batchrules.enabled(False):
        main(steps=2)
        assert not batchrules.is_enabled()
    out = capsys.readouterr().out
    assert "step   0: loss per member" in out and "step   2: loss per member" in out
    assert "prediction: (7, 5, 18) mean, (7, 5, 18) log-variance" in out
