"""DP-SGD under DDP on the example's transformer: 2 gloo ranks equal one
process (float64), with ONE all-reduce per step (the clipped sums
flattened), and ``all_reduce_flat`` itself."""
import dataclasses
import os

import torch
import torch.distributed as dist
from conftest import DEADLINE_S, DISTRIBUTED, WORLD, spawn
from torch import nn

from batchrules.dp import all_reduce_flat
from batchrules.examples import dp_sgd, dp_sgd_ranks

pytestmark = DISTRIBUTED

# q*N = 4: some ranks' shares are empty in some steps; 2-sample chunks
CONFIG = dp_sgd.DPConfig(steps=3, examples=40, sample_rate=0.1, noise_multiplier=0.7,
                         model="transformer", dtype=torch.float64, physical_batch=2)


# Rank 0 adds all the noise, or each rank its dim-0 shard's.
NOISE_SHARDS = (1, WORLD)


def worker(rank: int, port: int, out_dir: str) -> None:
    dp_sgd_ranks._init(rank, WORLD, port)
    calls = []
    real = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counted  # this spawned process only
    # all_reduce_flat: one collective, any shapes, inputs left as they were
    tree = {"a": torch.full((2, 3), float(rank + 1)), "b": [torch.arange(4.0) * (rank + 1)]}
    summed = all_reduce_flat(tree)
    assert torch.equal(summed["a"], torch.full((2, 3), 3.0)) and torch.equal(tree["a"][0],
                                                                             tree["a"][1])
    assert torch.equal(summed["b"][0], torch.arange(4.0) * 3) and calls == [10]
    for noise_shards in NOISE_SHARDS:  # one spawn for both: starting the ranks is most of the time
        calls.clear()
        torch.manual_seed(100 + rank)  # ranks start different; DDP broadcasts rank 0's
        ddp = nn.parallel.DistributedDataParallel(dp_sgd.make_model(CONFIG))
        config = dataclasses.replace(CONFIG, noise_shards=noise_shards)
        model, _ = dp_sgd.train(config, ddp.module, rank, WORLD, all_reduce_flat)
        n_params = sum(p.numel() for p in model.parameters())
        assert calls == [n_params] * CONFIG.steps, calls
        torch.save(model.state_dict(), os.path.join(out_dir, f"rank{rank}_shards{noise_shards}.pt"))
    dp_sgd_ranks._finish()


def test_ddp_transformer_matches_one_process(tmp_path) -> None:
    """With either noise split, one process drawing the same shards gives
    the same parameters."""
    spawn(worker, str(tmp_path))
    for noise_shards in NOISE_SHARDS:
        config = dataclasses.replace(CONFIG, noise_shards=noise_shards)
        start = dp_sgd.make_model(config).state_dict()
        want = dp_sgd.train(config)[0].state_dict()
        assert not any(torch.equal(want[k], start[k]) for k in want)  # every tensor moved
        for rank in range(WORLD):
            got = torch.load(tmp_path / f"rank{rank}_shards{noise_shards}.pt")
            where = f"noise_shards={noise_shards}, rank {rank}"
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-10,
                                           msg=lambda m: f"{where}, {k}: {m}")


def test_ddp_example_matches_one_process() -> None:
    # the example's own DDP runner, on the MLP, without chunks
    config = dataclasses.replace(CONFIG, model="mlp", physical_batch=None)
    want = dp_sgd.train(dataclasses.replace(config, noise_shards=WORLD))[0].state_dict()
    for state in dp_sgd_ranks.train_ddp(config, WORLD, timeout_s=DEADLINE_S):
        for k in want:
            torch.testing.assert_close(state[k], want[k], rtol=1e-10, atol=1e-10)
