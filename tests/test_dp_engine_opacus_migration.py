"""An Opacus training script that changes only its import runs on batchrules'
engine and takes the same steps (noise 0, both exact per-sample clipping)."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import batchrules.dp

opacus = pytest.importorskip("opacus")


def script(PrivacyEngine, grad_sample_mode):
    """An Opacus user's loop, verbatim but for the engine class."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    data = TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    criterion = nn.CrossEntropyLoss()
    privacy_engine = PrivacyEngine(accountant="rdp")
    made = privacy_engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=8),
        criterion=criterion, noise_multiplier=0.0, max_grad_norm=0.3, poisson_sampling=False,
        grad_sample_mode=grad_sample_mode)
    if grad_sample_mode == "ghost":
        model, optimizer, criterion, loader = made
    else:
        model, optimizer, loader = made
    for x, y in loader:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("grad_sample_mode", ["hooks", "ghost"])
def test_changing_the_import_takes_the_same_steps(grad_sample_mode):
    theirs = script(opacus.PrivacyEngine, grad_sample_mode)
    ours = script(batchrules.dp.PrivacyEngine, grad_sample_mode)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_options_opacus_has_and_the_engine_lacks_are_refused():
    engine = batchrules.dp.PrivacyEngine()
    model = nn.Linear(3, 2)
    loader = DataLoader(TensorDataset(torch.randn(4, 3)), batch_size=2)
    for option, message in ((dict(batch_first=False), "batch_first=False"),
                            (dict(clipping="per_layer"), "clipping='per_layer'"),
                            (dict(grad_sample_mode="nope"), "unknown grad_sample_mode")):
        with pytest.raises(ValueError, match=message):
            engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                                **option)
