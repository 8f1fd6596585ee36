"""Poisson sampling: the data loader DP-SGD's accounting assumes.

The accountants bound the privacy loss of the Sampled Gaussian Mechanism:
every step, each sample joins the batch independently with probability q.
``DPDataLoader`` draws its batches that way, so batch sizes vary (around
``q * N``) and a batch may be empty; it yields as many batches per epoch as
the loader it replaces, with q = 1 / (that loader's length), so the expected
batch size is the original one.

Note [Empty Poisson batches]
An empty batch still reaches the model: skipping it would change the step
count the accountant sees and leak that the batch was empty (the noise alone
is the update). Most collate functions fail on ``[]``, so an empty batch is
the collated batch of ``dataset[0]`` cut to 0 rows: every tensor keeps its
trailing shape and dtype, and no sample's values come out. Collated values
other than tensors, mappings, lists and tuples are refused (TypeError): an
empty batch cannot be formed from them without data.
"""
from typing import Any, Callable, Iterator, List, Mapping, Optional

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler
from torch.utils.data._utils.collate import default_collate

from .noise import secure_uniform


class PoissonBatchSampler(Sampler[List[int]]):
    """``steps`` batches of indices in ``range(num_samples)``, each index in a
    batch independently with probability ``sample_rate``.

    ``generator`` (a CPU ``torch.Generator``) is the only source of
    randomness, so saving its state (``get_state()``) saves the sampler's;
    with ``secure=True`` the draws come from ``os.urandom`` instead (Note
    [Secure mode] in noise.py) and ``generator`` is None. ``indices``
    (default ``range(num_samples)``) maps the drawn positions to dataset
    indices: a rank's share of the dataset in data-parallel training.
    """

    def __init__(self, *, num_samples: int, sample_rate: float, steps: int,
                 generator: Optional[torch.Generator] = None, secure: bool = False,
                 indices: Optional[List[int]] = None) -> None:
        if num_samples <= 0:
            raise ValueError(f"PoissonBatchSampler: num_samples must be > 0, got {num_samples}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"PoissonBatchSampler: sample_rate must be in (0, 1], got {sample_rate}")
        if secure and generator is not None:
            raise ValueError("PoissonBatchSampler: secure sampling draws from os.urandom; "
                             "pass generator=None")
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.steps = steps
        self.generator = generator
        self.secure = secure
        self.indices = indices

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[List[int]]:
        for _ in range(self.steps):
            u = secure_uniform(self.num_samples) if self.secure else \
                torch.rand(self.num_samples, generator=self.generator, dtype=torch.float64)
            chosen = (u < self.sample_rate).nonzero().view(-1).tolist()
            yield chosen if self.indices is None else [self.indices[i] for i in chosen]


class CollateWithEmpty:
    """``collate_fn`` that also collates ``[]``: See Note [Empty Poisson batches]."""

    def __init__(self, collate_fn: Callable[[List[Any]], Any], dataset: Dataset) -> None:
        self.collate_fn = collate_fn
        self.dataset = dataset

    def __call__(self, batch: List[Any]) -> Any:
        if batch:
            return self.collate_fn(batch)
        return _without_rows(self.collate_fn([self.dataset[0]]))


def _without_rows(collated: Any) -> Any:
    if isinstance(collated, torch.Tensor):
        return collated[:0].clone()
    if isinstance(collated, Mapping):
        return {k: _without_rows(v) for k, v in collated.items()}
    if isinstance(collated, (list, tuple)):
        return type(collated)(_without_rows(v) for v in collated)
    raise TypeError(f"DPDataLoader: cannot form an empty batch holding a "
                    f"{type(collated).__name__}: the collate function must return tensors, "
                    f"or mappings, lists or tuples of them (See Note [Empty Poisson batches])")


class DPDataLoader(DataLoader):
    """A ``DataLoader`` over ``dataset`` with Poisson sampling (Opacus' name).

    Takes the ``DataLoader`` keyword arguments except the ones that choose
    batches (``batch_size``, ``shuffle``, ``sampler``, ``batch_sampler``,
    ``drop_last``). ``sample_rate`` is q; ``steps`` the batches per epoch
    (default ``round(1 / q)``). ``generator`` drives the sampling and the
    loader's worker seeds (None: a new generator seeded from torch's default
    one, so ``torch.manual_seed`` still fixes the run); it is the sampler's
    ``generator`` attribute, whose state a checkpoint saves. ``secure``:
    sample from ``os.urandom`` (no generator). ``distributed``: this rank
    samples from its share of the dataset (every ``world_size``-th sample
    from its rank), with the same q on every rank.
    """

    batch_sampler: PoissonBatchSampler

    def __init__(self, dataset: Dataset, *, sample_rate: float, steps: Optional[int] = None,
                 collate_fn: Optional[Callable[[List[Any]], Any]] = None,
                 generator: Optional[torch.Generator] = None, secure: bool = False,
                 distributed: bool = False, **kwargs: Any) -> None:
        if isinstance(dataset, IterableDataset):
            raise ValueError("DPDataLoader: Poisson sampling needs a map-style dataset, "
                             "not an IterableDataset")
        if not secure and generator is None:
            generator = _seeded_generator()
        size = len(dataset)  # type: ignore[arg-type]
        indices = None
        if distributed:
            import torch.distributed as dist
            indices = list(range(dist.get_rank(), size, dist.get_world_size()))
        self.sample_rate = sample_rate
        self.distributed = distributed
        sampler = PoissonBatchSampler(
            num_samples=size if indices is None else len(indices), sample_rate=sample_rate,
            steps=steps if steps is not None else round(1 / sample_rate), generator=generator,
            secure=secure, indices=indices)
        super().__init__(dataset, batch_sampler=sampler,
                         collate_fn=CollateWithEmpty(collate_fn or default_collate, dataset),
                         generator=generator, **kwargs)

    @classmethod
    def from_data_loader(cls, data_loader: DataLoader, *, generator: Optional[torch.Generator] = None,
                         secure: bool = False, distributed: bool = False) -> "DPDataLoader":
        """A ``DPDataLoader`` with ``data_loader``'s dataset, collate function
        and worker settings, q = 1 / ``len(data_loader)`` and as many batches
        per epoch. ``generator``: default ``data_loader.generator``."""
        collate = data_loader.collate_fn
        if isinstance(collate, CollateWithEmpty):
            collate = collate.collate_fn
        return cls(data_loader.dataset, sample_rate=1 / len(data_loader), steps=len(data_loader),
                   collate_fn=collate, secure=secure, distributed=distributed,
                   generator=None if secure else generator or data_loader.generator,
                   num_workers=data_loader.num_workers, pin_memory=data_loader.pin_memory,
                   timeout=data_loader.timeout, worker_init_fn=data_loader.worker_init_fn,
                   multiprocessing_context=data_loader.multiprocessing_context,
                   prefetch_factor=data_loader.prefetch_factor,
                   persistent_workers=data_loader.persistent_workers)


def _seeded_generator() -> torch.Generator:
    """A CPU generator seeded from torch's default generator."""
    generator = torch.Generator()
    generator.manual_seed(int(torch.randint(0, 2 ** 62, (), dtype=torch.int64)))
    return generator

