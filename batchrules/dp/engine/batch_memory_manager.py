"""Logical batches in physical pieces: ``BatchMemoryManager`` (Opacus' shape).

A DP-SGD step is over a logical batch (a Poisson batch, often thousands of
samples), but memory bounds the physical batch one forward can take. Clipping
is per sample, so the logical batch's clipped sum is the sum of its pieces'
(the optimizer keeps running sums across skipped steps): the user's loop runs
``forward; backward; optimizer.step()`` per physical batch and the optimizer
steps, with noise, only after the last piece of each logical batch.

Note [Skip signals follow the batches]
Each physical batch is yielded after ``optimizer.signal_skip_step(skip)`` for
that batch: ``skip`` is True except for the last piece of a logical batch.
The flags are recorded when the batch sampler splits a logical batch (in the
main process, possibly ahead of the batches: workers prefetch) and consumed
in order when the loader yields each batch, so prefetching cannot shift them.
An empty logical batch is one empty physical batch, not skipped: the step
still happens, with noise only (Note [Empty Poisson batches] in data_loader.py).
"""
import collections
import math
from typing import Any, Deque, Iterator, List

from torch.utils.data import BatchSampler, DataLoader, Sampler

from .data_loader import PoissonBatchSampler


class _SplittingBatchSampler(Sampler[List[int]]):
    """The logical batches of ``sampler`` in pieces of at most ``max_size``
    indices, of near-equal sizes; records in ``skips`` whether each piece is
    followed by another of the same logical batch."""

    def __init__(self, sampler: Any, max_size: int) -> None:
        self.sampler = sampler
        self.max_size = max_size
        self.skips: Deque[bool] = collections.deque()

    def __iter__(self) -> Iterator[List[int]]:
        for logical in self.sampler:
            logical = list(logical)
            pieces = max(1, math.ceil(len(logical) / self.max_size))
            bounds = [len(logical) * k // pieces for k in range(pieces + 1)]
            for k in range(pieces):
                self.skips.append(k < pieces - 1)
                yield logical[bounds[k]:bounds[k + 1]]

    def __len__(self) -> int:
        """Pieces per epoch: exact for a ``BatchSampler``, expected for Poisson batches."""
        def pieces(size: float) -> int:
            return max(1, math.ceil(size / self.max_size))

        if isinstance(self.sampler, PoissonBatchSampler):
            return len(self.sampler) * pieces(self.sampler.sample_rate * self.sampler.num_samples)
        if isinstance(self.sampler, BatchSampler):
            full, rest = divmod(len(self.sampler.sampler), self.sampler.batch_size)  # type: ignore[arg-type]
            return full * pieces(self.sampler.batch_size) + (
                pieces(rest) if rest and not self.sampler.drop_last else 0)
        return len(self.sampler)


class _PhysicalBatchLoader(DataLoader):
    """``data_loader``'s batches split by ``_SplittingBatchSampler``, each
    yielded after the optimizer is told whether to skip its step."""

    batch_sampler: _SplittingBatchSampler

    def __init__(self, data_loader: DataLoader, max_size: int, optimizer: Any) -> None:
        super().__init__(
            data_loader.dataset, batch_sampler=_SplittingBatchSampler(data_loader.batch_sampler,
                                                                      max_size),
            collate_fn=data_loader.collate_fn, num_workers=data_loader.num_workers,
            pin_memory=data_loader.pin_memory, timeout=data_loader.timeout,
            worker_init_fn=data_loader.worker_init_fn,
            multiprocessing_context=data_loader.multiprocessing_context,
            generator=data_loader.generator, prefetch_factor=data_loader.prefetch_factor,
            persistent_workers=data_loader.persistent_workers)
        self.optimizer = optimizer

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        skips = self.batch_sampler.skips
        skips.clear()
        for batch in super().__iter__():
            # See Note [Skip signals follow the batches]
            self.optimizer.signal_skip_step(skips.popleft())
            yield batch


class BatchMemoryManager:
    """``with BatchMemoryManager(data_loader=, max_physical_batch_size=,
    optimizer=) as loader:`` yields a loader of physical batches of at most
    ``max_physical_batch_size`` samples; ``optimizer.step()`` steps once per
    logical batch of ``data_loader`` (See Note [Skip signals follow the batches]).

    Example::

        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=32,
                                optimizer=optimizer) as physical:
            for x, y in physical:
                optimizer.zero_grad()
                criterion(model(x), y).backward()
                optimizer.step()        # skips, keeping the clipped sums, until
                                        # the logical batch is complete

    ``optimizer`` is the engine's ``DPOptimizer`` (anything with
    ``signal_skip_step``). ``data_loader`` is not modified; the loader
    yielded draws from the same generator, so its logical batches are the
    ones ``data_loader`` itself would have drawn. Nothing happens on leaving the block.
    """

    def __init__(self, *, data_loader: DataLoader, max_physical_batch_size: int,
                 optimizer: Any) -> None:
        if isinstance(max_physical_batch_size, bool) or not isinstance(max_physical_batch_size, int) \
                or max_physical_batch_size < 1:
            raise ValueError(f"BatchMemoryManager: max_physical_batch_size must be an int >= 1, "
                             f"got {max_physical_batch_size!r}")
        if data_loader.batch_sampler is None:
            raise ValueError("BatchMemoryManager: data_loader must batch (batch_size=None "
                             "gives it no batch sampler)")
        self.data_loader = data_loader
        self.max_physical_batch_size = max_physical_batch_size
        self.optimizer = optimizer

    def __enter__(self) -> DataLoader:
        return _PhysicalBatchLoader(self.data_loader, self.max_physical_batch_size, self.optimizer)

    def __exit__(self, *exc: Any) -> None:
        pass
