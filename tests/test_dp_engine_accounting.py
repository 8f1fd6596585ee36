"""The engine's accounting and sampling: ``DPDataLoader``'s Poisson batches (rate,
batches per epoch, empty batches, generator determinism, secure sampling)."""
import os

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

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
