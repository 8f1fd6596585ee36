"""``PrivacyEngine.make_private`` of a ``DistributedDataParallel`` model on 2 gloo
ranks (Poisson sampling of each rank's share, noise from one generator) equals
one process stepping on the union of the ranks' batches (float64)."""
import os
from typing import Any, Callable, Dict

import pytest
import torch
import torch.nn.functional as F
from conftest import DISTRIBUTED, WORLD, spawn
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from batchrules.dp import PrivacyEngine
from batchrules.examples import dp_sgd_ranks

pytestmark = [*DISTRIBUTED, pytest.mark.requires("opacus")]

SIGMA, CLIP, LR, EPOCHS = 0.8, 0.5, 0.5, 2


def task():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    data = TensorDataset(torch.randn(40, 4, dtype=torch.float64), torch.randint(0, 3, (40,)),
                         torch.arange(40))
    return model, data


def make_private(engine: PrivacyEngine, model: nn.Module, data: TensorDataset, **kwargs):
    return engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(data, batch_size=10), noise_multiplier=SIGMA, max_grad_norm=CLIP,
        noise_generator=torch.Generator().manual_seed(7), **kwargs)


def step(private: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer.zero_grad()
    F.cross_entropy(private(x), y).backward()
    optimizer.step()


def train_share(rank: int, engine: PrivacyEngine, private: nn.Module, optimizer, loader,
                state: Callable[[], Dict[str, torch.Tensor]], out_dir: str) -> None:
    """This rank's epochs on its Poisson share; saves the full state, the
    drawn indices and the accountant's history."""
    drawn = []
    for _ in range(EPOCHS):
        for x, y, idx in loader:
            assert all(i % WORLD == rank for i in idx.tolist())  # this rank's share
            drawn.append(idx)
            step(private, optimizer, x, y)
    torch.save({"state": state(), "drawn": drawn, "history": engine.accountant.history},
               os.path.join(out_dir, f"rank{rank}.pt"))


def assert_ranks_match_one_process(tmp_path, make_task: Callable[[], Any]) -> None:
    """One process stepping on the union of the ranks' batches ends where every rank did."""
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    model, data = make_task()
    engine = PrivacyEngine(accountant="rdp")
    private, optimizer, _ = make_private(engine, model, data, poisson_sampling=False)
    steps = len(ranks[0]["drawn"])
    assert steps == EPOCHS * 4 and all(len(r["drawn"]) == steps for r in ranks)
    for k in range(steps):
        union = torch.cat([r["drawn"][k] for r in ranks])
        x, y, _ = data[union]
        step(private, optimizer, x, y)
    want = model.state_dict()
    for r, got in enumerate(ranks):
        assert got["history"] == [(SIGMA, 0.25, steps)]
        for name in want:
            torch.testing.assert_close(got["state"][name], want[name], rtol=1e-10, atol=1e-10,
                                       msg=lambda m: f"rank {r}, {name}: {m}")
    assert not torch.equal(want["0.weight"], make_task()[0].state_dict()["0.weight"])


def worker(rank: int, port: int, out_dir: str, backend: str = "") -> None:
    dp_sgd_ranks._init(rank, WORLD, port)
    model, data = task()
    engine = PrivacyEngine(accountant="rdp")
    private, optimizer, loader = make_private(engine, nn.parallel.DistributedDataParallel(model),
                                              data)
    assert optimizer.process_group is not None and optimizer.expected_batch_size == 10
    if backend:  # the private model compiled (Note [The engine under torch.compile])
        private = torch.compile(private, fullgraph=True, backend=backend)
    train_share(rank, engine, private, optimizer, loader, model.state_dict, out_dir)
    dp_sgd_ranks._finish()


@pytest.mark.parametrize("backend", ["", "aot_eager"], ids=["eager", "compiled"])
def test_ddp_make_private_matches_one_process(tmp_path, backend: str) -> None:
    spawn(worker, str(tmp_path), backend)
    assert_ranks_match_one_process(tmp_path, task)
