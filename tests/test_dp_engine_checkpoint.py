"""``PrivacyEngine.save_checkpoint``/``load_checkpoint``: a run resumed from a
checkpoint is bit-identical to the uninterrupted run (parameters, Adam's state,
epsilon), with Poisson sampling and noise (float64)."""
import io
from typing import Any, Dict, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from batchrules.dp import PrivacyEngine

pytestmark = pytest.mark.requires("opacus")

DATA = TensorDataset(torch.randn(48, 5, generator=torch.Generator().manual_seed(0),
                                 dtype=torch.float64),
                     torch.randint(0, 3, (48,), generator=torch.Generator().manual_seed(1)))


def private_run(seed: int) -> Tuple[PrivacyEngine, nn.Module, Any, DataLoader]:
    """Model, Adam, engine and Poisson loader; ``seed`` fixes the initial
    weights and both generators (the noise's and the sampler's)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
        data_loader=DataLoader(DATA, batch_size=8), noise_multiplier=0.8, max_grad_norm=0.5)
    return engine, model, optimizer, loader


def train_epoch(model: nn.Module, optimizer: Any, loader: DataLoader) -> None:
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def snapshot(engine: PrivacyEngine, model: nn.Module, optimizer: Any) -> Dict[str, Any]:
    return {"params": {k: v.clone() for k, v in model.state_dict().items()},
            "adam": [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                     for s in optimizer.state_dict()["state"].values()],
            "epsilon": engine.get_epsilon(1e-5), "history": list(engine.accountant.history)}


def assert_identical(a: Dict[str, Any], b: Dict[str, Any]) -> None:
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert len(a["adam"]) == len(b["adam"]) > 0
    for sa, sb in zip(a["adam"], b["adam"]):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), k
    assert a["epsilon"] == b["epsilon"] and a["history"] == b["history"]


def uninterrupted(epochs: int) -> Dict[str, Any]:
    """The snapshot after ``epochs`` epochs of the seed-0 run."""
    engine, model, optimizer, loader = private_run(seed=0)
    for _ in range(epochs):
        train_epoch(model, optimizer, loader)
    return snapshot(engine, model, optimizer)


def checkpoint_after_one_epoch() -> io.BytesIO:
    """The seed-0 run's checkpoint after its first epoch, ready to read."""
    engine, model, optimizer, loader = private_run(seed=0)
    train_epoch(model, optimizer, loader)
    buffer = io.BytesIO()
    engine.save_checkpoint(path=buffer, module=model, optimizer=optimizer)
    buffer.seek(0)
    return buffer


def test_resume_is_bit_identical() -> None:
    want = uninterrupted(epochs=3)
    buffer = checkpoint_after_one_epoch()

    # other initial weights and generators: everything must come from the checkpoint
    engine, model, optimizer, loader = private_run(seed=1)
    engine.load_checkpoint(path=buffer, module=model, optimizer=optimizer)
    for _ in range(2):
        train_epoch(model, optimizer, loader)
    assert_identical(snapshot(engine, model, optimizer), want)


def test_resume_without_the_generators_differs() -> None:
    """The generators' states are what makes the resume exact: dropping them
    from the checkpoint gives another run (so the test above can fail)."""
    want = uninterrupted(epochs=2)
    buffer = checkpoint_after_one_epoch()
    checkpoint = torch.load(buffer, weights_only=True)
    for key in ("noise_generator_state", "data_loader_generator_states"):
        del checkpoint[key]
    stripped = io.BytesIO()
    torch.save(checkpoint, stripped)
    stripped.seek(0)

    engine, model, optimizer, loader = private_run(seed=1)
    engine.load_checkpoint(path=stripped, module=model, optimizer=optimizer)
    train_epoch(model, optimizer, loader)
    got = snapshot(engine, model, optimizer)
    assert got["epsilon"] == want["epsilon"]
    assert not all(torch.equal(got["params"][k], want["params"][k]) for k in want["params"])


def test_checkpoint_holds_opacus_keys_and_generator_states() -> None:
    engine, model, optimizer, loader = private_run(seed=0)
    buffer = io.BytesIO()
    engine.save_checkpoint(path=buffer, module=model, optimizer=optimizer,
                           checkpoint_dict={"epoch": 3})
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    assert set(checkpoint) == {"epoch", "module_state_dict", "privacy_accountant_state_dict",
                               "optimizer_state_dict", "noise_generator_state",
                               "data_loader_generator_states"}
    assert set(checkpoint["module_state_dict"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert len(checkpoint["data_loader_generator_states"]) == 1  # sampler and loader share one
