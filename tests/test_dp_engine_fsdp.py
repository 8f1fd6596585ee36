"""``PrivacyEngine.make_private`` of a model sharded by FSDP2's ``fully_shard`` on 2
gloo ranks (each rank Poisson-samples its share, the noise drawn once) equals one
process stepping on the union of the ranks' batches (float64)."""
import os

import pytest
import torch
from conftest import DISTRIBUTED, WORLD, spawn
from test_dp_engine_make_private_ddp import EPOCHS, SIGMA, make_private, step, task
from torch import nn

from batchrules.dp import PrivacyEngine
from batchrules.examples import dp_sgd_ranks

pytestmark = [*DISTRIBUTED, pytest.mark.requires("opacus")]


def sharded_task():
    model, data = task()
    model = nn.Sequential(model[0], model[1], nn.Linear(8, 8).double(), nn.Tanh(), model[2])
    return model, data


def worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.fsdp import fully_shard
    dp_sgd_ranks._init(rank, WORLD, port)
    model, data = sharded_task()
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    engine = PrivacyEngine(accountant="rdp")
    private, optimizer, loader = make_private(engine, model, data)
    drawn = []
    for _ in range(EPOCHS):
        for x, y, idx in loader:
            assert all(i % WORLD == rank for i in idx.tolist())  # this rank's share
            drawn.append(idx)
            step(private, optimizer, x, y)
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    torch.save({"state": state, "drawn": drawn, "history": engine.accountant.history},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dp_sgd_ranks._finish()


def test_fsdp_make_private_matches_one_process(tmp_path) -> None:
    spawn(worker, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    model, data = sharded_task()
    engine = PrivacyEngine(accountant="rdp")
    private, optimizer, _ = make_private(engine, model, data, poisson_sampling=False)
    steps = len(ranks[0]["drawn"])
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
    assert not torch.equal(want["0.weight"], sharded_task()[0].state_dict()["0.weight"])
