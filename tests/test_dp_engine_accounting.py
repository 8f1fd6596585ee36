"""The engine's accounting and sampling: ``DPDataLoader``'s Poisson batches (rate,
batches per epoch, empty batches, generator determinism, secure sampling), and
``PrivacyEngine``'s epsilon against Opacus' accountants for the same (sigma, q,
steps), ``make_private_with_epsilon`` reaching its target."""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from batchrules.dp import BatchMemoryManager, PrivacyEngine
from batchrules.dp.engine.data_loader import DPDataLoader, PoissonBatchSampler


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def batches(sampler: PoissonBatchSampler) -> list:
    return [list(b) for b in sampler]


def test_poisson_rate_and_independence() -> None:
    """Each index is drawn with probability q, independently of the others: the
    total count and every index's count are within 5 standard deviations."""
    n, q, steps = 200, 0.1, 2000
    drawn = batches(PoissonBatchSampler(num_samples=n, sample_rate=q, steps=steps,
                                        generator=generator(0)))
    assert len(drawn) == steps
    counts = torch.zeros(n)
    for b in drawn:
        assert b == sorted(set(b)) and all(0 <= i < n for i in b)
        counts[b] += 1
    total_sd = (n * steps * q * (1 - q)) ** 0.5
    assert abs(counts.sum().item() - n * steps * q) < 5 * total_sd
    per_index_sd = (steps * q * (1 - q)) ** 0.5
    assert (counts - steps * q).abs().max().item() < 5 * per_index_sd
    sizes = torch.tensor([len(b) for b in drawn], dtype=torch.float64)
    assert abs(sizes.var().item() - n * q * (1 - q)) < 0.15 * n * q * (1 - q)  # binomial sizes


def test_from_data_loader_keeps_length_and_rate() -> None:
    data = TensorDataset(torch.randn(100, 3), torch.arange(100))
    loader = DPDataLoader.from_data_loader(DataLoader(data, batch_size=30), generator=generator(1))
    assert len(loader) == 4 and loader.sample_rate == 0.25
    assert len(list(loader)) == 4


def test_generator_determinism_and_state() -> None:
    data = TensorDataset(torch.arange(50))
    make = lambda seed: DPDataLoader.from_data_loader(  # noqa: E731
        DataLoader(data, batch_size=5), generator=generator(seed))
    first = [b[0].tolist() for b in make(3)]
    assert first == [b[0].tolist() for b in make(3)]
    assert first != [b[0].tolist() for b in make(4)]
    loader = make(3)
    state = loader.batch_sampler.generator.get_state()
    epoch = [b[0].tolist() for b in loader]
    loader.batch_sampler.generator.set_state(state)
    assert [b[0].tolist() for b in loader] == epoch
    assert [b[0].tolist() for b in loader] != epoch  # the next epoch draws anew


def test_default_generator_follows_manual_seed() -> None:
    data = TensorDataset(torch.arange(50))
    draws = []
    for _ in range(2):
        torch.manual_seed(7)
        draws.append([b[0].tolist() for b in DPDataLoader.from_data_loader(
            DataLoader(data, batch_size=5))])
    assert draws[0] == draws[1]


class DictData(Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": torch.full((4,), i), "mask": torch.ones(4, dtype=torch.bool),
                "label": i % 2, "pair": (torch.zeros(2, 3, dtype=torch.float64), 1.5)}


@pytest.mark.parametrize("dataset", ["tensors", "dict"])
def test_empty_batches_keep_trailing_shapes(dataset: str) -> None:
    data = DictData() if dataset == "dict" else \
        TensorDataset(torch.randn(6, 2, 5), torch.randint(0, 3, (6,)))
    full = next(iter(DataLoader(data, batch_size=2)))
    loader = DPDataLoader(data, sample_rate=1e-12, steps=3, generator=generator(0))
    empties = list(loader)
    assert len(empties) == 3
    flat_full, flat_empty = _leaves(full), _leaves(empties[0])
    assert len(flat_full) == len(flat_empty)
    for f, e in zip(flat_full, flat_empty):
        assert e.shape == (0, *f.shape[1:]) and e.dtype == f.dtype
    assert type(empties[0]) is type(full)


def test_empty_batch_refuses_what_has_no_rows() -> None:
    data = [("text", torch.zeros(2))] * 4
    loader = DPDataLoader(data, sample_rate=1e-12, steps=1, generator=generator(0))
    with pytest.raises(TypeError, match="empty batch holding a str"):
        next(iter(loader))


def _leaves(batch: object) -> list:
    if isinstance(batch, torch.Tensor):
        return [batch]
    values = batch.values() if isinstance(batch, dict) else batch
    return [leaf for v in values for leaf in _leaves(v)]  # type: ignore[attr-defined]


def test_secure_sampling_draws_from_urandom(monkeypatch: pytest.MonkeyPatch) -> None:
    """secure=True: the batches come from os.urandom; torch's generators are not
    used (fixing os.urandom's output fixes the batches)."""
    calls = []

    def fixed_urandom(n: int) -> bytes:
        calls.append(n)
        return bytes(range(256)) * (n // 256) + bytes(n % 256)

    monkeypatch.setattr(os, "urandom", fixed_urandom)
    data = TensorDataset(torch.arange(64))
    loader = DPDataLoader.from_data_loader(DataLoader(data, batch_size=8), secure=True)
    assert loader.batch_sampler.generator is None
    torch.manual_seed(0)
    first = [b[0].tolist() for b in loader]
    torch.manual_seed(1)
    assert [b[0].tolist() for b in loader] == first
    assert calls and all(n == 8 * 64 for n in calls)


def mlp_task(n: int = 60, batch_size: int = 10, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    data = TensorDataset(torch.randn(n, 4, dtype=torch.float64), torch.randint(0, 3, (n,)))
    return model, DataLoader(data, batch_size=batch_size)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader,
          epochs: int) -> int:
    steps = 0
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            steps += 1
    return steps


@pytest.mark.requires("opacus")
@pytest.mark.parametrize("mechanism", ["rdp", "prv", "gdp"])
def test_epsilon_equals_opacus_accountant(mechanism: str) -> None:
    from opacus.accountants import create_accountant
    model, loader = mlp_task()
    engine = PrivacyEngine(accountant=mechanism)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader, noise_multiplier=1.3, max_grad_norm=1.0)
    steps = train(model, optimizer, loader, epochs=2)
    reference = create_accountant(mechanism=mechanism)
    for _ in range(steps):
        reference.step(noise_multiplier=1.3, sample_rate=1 / 6)
    assert engine.accountant.history == [(1.3, 1 / 6, steps)] and steps == 12
    assert engine.get_epsilon(1e-5) == reference.get_epsilon(delta=1e-5) > 0


@pytest.mark.requires("opacus")
@pytest.mark.parametrize("mechanism", ["rdp", "prv"])
def test_make_private_with_epsilon_reaches_target(mechanism: str) -> None:
    """After the planned epochs the accountant's epsilon is the target, within
    1% and not above it (Opacus' search stops 0.01 below it)."""
    model, loader = mlp_task()
    engine = PrivacyEngine(accountant=mechanism)
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader, target_epsilon=3.0, target_delta=1e-5, epochs=3, max_grad_norm=1.0)
    assert optimizer.noise_multiplier > 0
    train(model, optimizer, loader, epochs=3)
    assert 0.99 * 3.0 <= engine.get_epsilon(1e-5) <= 3.0


@pytest.mark.requires("opacus")
def test_skipped_steps_are_not_counted() -> None:
    """Only real steps reach the accountant: a logical batch split in pieces
    is one step."""
    model, loader = mlp_task()
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2,
                            optimizer=optimizer) as physical:
        train(model, optimizer, physical, epochs=1)
    assert engine.accountant.history == [(1.0, 1 / 6, len(loader))] and len(loader) == 6


@pytest.mark.requires("opacus")
def test_make_private_refuses_foreign_parameters() -> None:
    model, loader = mlp_task()
    other = nn.Linear(2, 2).double()
    with pytest.raises(ValueError, match="not the module's"):
        PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="noise_generator must be None"):
        PrivacyEngine(secure_mode=True).make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            noise_generator=torch.Generator())
