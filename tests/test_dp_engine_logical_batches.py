"""``BatchMemoryManager``: logical batches in physical pieces, each yielded after
the optimizer's skip signal for it (against a recording stub), and, with the
engine, pieces giving the parameters one batch gives (float64), empty batches
stepping with the noise alone."""
from typing import List

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from batchrules.dp import PrivacyEngine
from batchrules.dp.engine.batch_memory_manager import BatchMemoryManager
from batchrules.dp.engine.data_loader import DPDataLoader


class RecordingOptimizer:
    def __init__(self) -> None:
        self.skips: List[bool] = []

    def signal_skip_step(self, do_skip: bool = True) -> None:
        self.skips.append(do_skip)


def dp_loader(n: int = 40, batch_size: int = 10, seed: int = 0, **kwargs) -> DPDataLoader:
    data = TensorDataset(torch.arange(n), torch.randn(n, 3))
    return DPDataLoader.from_data_loader(DataLoader(data, batch_size=batch_size, **kwargs),
                                         generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("max_size", [1, 3, 10, 100])
def test_pieces_rebuild_the_logical_batches(max_size: int) -> None:
    logical = [b[0].tolist() for b in dp_loader()]
    optimizer = RecordingOptimizer()
    with BatchMemoryManager(data_loader=dp_loader(), max_physical_batch_size=max_size,
                            optimizer=optimizer) as physical:
        pieces = []
        for idx, _ in physical:
            assert len(idx) <= max_size
            assert len(optimizer.skips) == len(pieces) + 1  # signalled before the batch
            pieces.append(idx.tolist())
    # the pieces, cut where the optimizer may step, are the logical batches
    rebuilt, current = [], []
    for piece, skip in zip(pieces, optimizer.skips):
        current += piece
        if not skip:
            rebuilt.append(current)
            current = []
    assert current == [] and rebuilt == logical
    sizes = [len(p) for p in pieces]
    assert all(max(sizes[i:j]) - min(sizes[i:j]) <= 1 for i, j in _spans(optimizer.skips))


def _spans(skips: List[bool]) -> list:
    spans, start = [], 0
    for k, skip in enumerate(skips):
        if not skip:
            spans.append((start, k + 1))
            start = k + 1
    return spans


def test_empty_logical_batch_is_one_empty_step() -> None:
    data = TensorDataset(torch.arange(8), torch.randn(8, 3))
    loader = DPDataLoader(data, sample_rate=1e-12, steps=2, generator=torch.Generator())
    optimizer = RecordingOptimizer()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4,
                            optimizer=optimizer) as physical:
        shapes = [tuple(x.shape) for _, x in physical]
    assert shapes == [(0, 3), (0, 3)] and optimizer.skips == [False, False]


def test_fixed_batches_and_length() -> None:
    data = TensorDataset(torch.arange(10))
    optimizer = RecordingOptimizer()
    with BatchMemoryManager(data_loader=DataLoader(data, batch_size=4),
                            max_physical_batch_size=3, optimizer=optimizer) as physical:
        assert len(physical) == 5
        assert [b[0].tolist() for b in physical] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert optimizer.skips == [True, False, True, False, False]


def test_flags_follow_prefetching_workers() -> None:
    """With workers the sampler runs ahead of the batches; the skip signals still
    arrive with their own batches."""
    optimizer = RecordingOptimizer()
    with BatchMemoryManager(data_loader=dp_loader(num_workers=2), max_physical_batch_size=3,
                            optimizer=optimizer) as physical:
        seen = [(idx.tolist(), len(optimizer.skips)) for idx, _ in physical]
    assert [k for _, k in seen] == list(range(1, len(seen) + 1))
    logical = [b[0].tolist() for b in dp_loader()]
    rebuilt, current = [], []
    for (piece, _), skip in zip(seen, optimizer.skips):
        current += piece
        if not skip:
            rebuilt.append(current)
            current = []
    assert rebuilt == logical


def test_refuses_bad_sizes() -> None:
    with pytest.raises(ValueError, match="max_physical_batch_size"):
        BatchMemoryManager(data_loader=dp_loader(), max_physical_batch_size=0,
                           optimizer=RecordingOptimizer())


def private_mlp(sigma: float, loss_reduction: str = "mean"):
    """A private float64 MLP with SGD and a Poisson loader of 60 samples, q = 1/5;
    the same seed gives the same weights, batches and noise."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    data = TensorDataset(torch.randn(60, 4, dtype=torch.float64), torch.randint(0, 3, (60,)))
    engine = PrivacyEngine(accountant="rdp")
    private, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        data_loader=DataLoader(data, batch_size=12), noise_multiplier=sigma, max_grad_norm=0.3,
        loss_reduction=loss_reduction, noise_generator=torch.Generator().manual_seed(1))
    return engine, model, private, optimizer, loader


def run_epochs(private: nn.Module, optimizer, loader, loss_reduction: str, epochs: int = 2) -> None:
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(private(x), y, reduction=loss_reduction).backward()
            optimizer.step()


@pytest.mark.requires("opacus")
@pytest.mark.parametrize("sigma", [0.0, 1.1])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_logical_batches_equal_one_batch(sigma: float, loss_reduction: str) -> None:
    """Physical pieces of at most 3 samples give the parameters one batch gives
    (float64, up to the order of the additions), noise included."""
    engine, model, private, optimizer, loader = private_mlp(sigma, loss_reduction)
    run_epochs(private, optimizer, loader, loss_reduction)
    want, history = model.state_dict(), engine.accountant.history

    engine, model, private, optimizer, loader = private_mlp(sigma, loss_reduction)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3,
                            optimizer=optimizer) as physical:
        run_epochs(private, optimizer, physical, loss_reduction)
    got = model.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12)
    assert engine.accountant.history == history == [(sigma, 0.2, 10)]
    engine, model, private, optimizer, loader = private_mlp(sigma, loss_reduction)
    assert not torch.equal(model.state_dict()["0.weight"], want["0.weight"])  # it trained


@pytest.mark.requires("opacus")
@pytest.mark.parametrize("sigma", [0.0, 1.1])
def test_empty_batch_steps_with_noise_alone(sigma: float) -> None:
    """An empty Poisson batch is a step: the update is the noise over the
    expected batch size (nothing without noise)."""
    _, model, private, optimizer, _ = private_mlp(sigma)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    empty = DPDataLoader(TensorDataset(torch.randn(5, 4, dtype=torch.float64),
                                       torch.randint(0, 3, (5,))),
                         sample_rate=1e-12, steps=1, generator=torch.Generator())
    with BatchMemoryManager(data_loader=empty, max_physical_batch_size=3,
                            optimizer=optimizer) as physical:
        run_epochs(private, optimizer, physical, "mean", epochs=1)
    noise = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        want = start[name] - 0.5 * sigma * 0.3 * torch.randn(p.shape, generator=noise,
                                                            dtype=p.dtype) / 12
        torch.testing.assert_close(p.detach(), want, rtol=1e-12, atol=1e-12)
