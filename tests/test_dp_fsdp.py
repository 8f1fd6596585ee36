"""DP-SGD on a model sharded by FSDP2's ``fully_shard`` (per encoder layer and
at the root), 2 gloo ranks: the parameters after several steps equal one
process with the same noise (float64), each rank's parameters and gradients
are its shard (measured), and ``reduce_scatter_flat`` on FSDP's layout."""
import dataclasses

import pytest
import torch
from conftest import DEADLINE_S, DISTRIBUTED, WORLD, spawn
from torch import nn

from batchrules.dp import reduce_scatter_flat, unsharded
from batchrules.examples import dp_sgd, dp_sgd_ranks

pytestmark = DISTRIBUTED

# q*N = 4 over 4 steps: some ranks' shares are empty; chunks of 3 samples
CONFIG = dp_sgd.DPConfig(steps=4, examples=40, sample_rate=0.1, noise_multiplier=0.7,
                         model="transformer", dtype=torch.float64, physical_batch=3)


def test_fsdp_transformer_matches_one_process() -> None:
    memory = []
    states = dp_sgd_ranks.train_fsdp(CONFIG, WORLD, timeout_s=DEADLINE_S, memory=memory)
    start = dp_sgd.make_model(CONFIG).state_dict()
    want = dp_sgd.train(dataclasses.replace(CONFIG, noise_shards=WORLD))[0].state_dict()
    assert not any(torch.equal(want[k], start[k]) for k in want)  # every tensor moved
    for state in states:
        assert state.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(state[k], want[k], rtol=1e-10, atol=1e-10)
    # Each rank holds its dim-0 shard of every parameter and gradient, nothing more:
    # the shards add up to the model, and a rank's share is half of it up to the
    # odd rows (one row of each parameter at most).
    full = memory[0]["full"]
    assert full == sum(v.numel() * 8 for v in want.values())
    assert sum(m["params"] for m in memory) == sum(m["grads"] for m in memory) == full
    row_bytes = sum(v[0].numel() * 8 if v.dim() else 8 for v in want.values())
    for m in memory:
        assert m["params"] == m["grads"] <= full / WORLD + row_bytes, m


def rs_worker(rank: int, port: int) -> None:
    dp_sgd_ranks._init(rank, WORLD, port)
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # rows 7 (4 + 3), 1 (1 + 0: an empty shard), 3-D weight
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(3, 1), nn.Conv1d(2, 3, 2)).double()
    full_shapes = {k: p.shape for k, p in model.named_parameters()}
    fully_shard(model[0])
    fully_shard(model)
    with unsharded(model) as params:
        assert {k: p.shape for k, p in params.items()} == full_shapes
        assert not any(hasattr(p, "to_local") for p in params.values())
    sharded = dict(model.named_parameters())
    assert all(hasattr(p, "to_local") for p in sharded.values())  # resharded on exit
    g = torch.Generator().manual_seed(rank)
    full = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in full_shapes.items()}
    # every rank's ``full``, summed: rank r's generator draws per key in turn
    gens = [torch.Generator().manual_seed(r) for r in range(WORLD)]
    want = {k: sum(torch.randn(s, generator=gen, dtype=torch.float64) for gen in gens)
            for k, s in full_shapes.items()}
    shards = reduce_scatter_flat(full, sharded)
    for k, shard in shards.items():
        assert shard.placements == sharded[k].placements and shard.shape == full_shapes[k]
        assert shard.to_local().shape == sharded[k].to_local().shape
        torch.testing.assert_close(shard.full_tensor(), want[k], rtol=1e-12, atol=1e-12)
    dp_sgd_ranks._finish()


def test_reduce_scatter_flat_on_fsdp_layout() -> None:
    spawn(rs_worker)


def test_unsharded_needs_fully_shard() -> None:
    with pytest.raises(ValueError, match="fully_shard"):
        with unsharded(nn.Linear(2, 2)):
            pass
