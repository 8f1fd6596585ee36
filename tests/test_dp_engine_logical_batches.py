"""``BatchMemoryManager``: logical batches in physical pieces, each yielded after
the optimizer's skip signal for it (a recording stub here)."""
from typing import List

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

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
