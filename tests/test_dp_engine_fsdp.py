"""``PrivacyEngine.make_private`` of a model sharded by FSDP2's ``fully_shard`` on 2
gloo ranks (each rank Poisson-samples its share, the noise drawn once) equals one
process stepping on the union of the ranks' batches (float64)."""
import pytest
from conftest import DISTRIBUTED, WORLD, spawn
from test_dp_engine_make_private_ddp import (
    assert_ranks_match_one_process,
    make_private,
    task,
    train_share,
)
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
    train_share(rank, engine, private, optimizer, loader,
                lambda: {k: v.full_tensor() for k, v in model.state_dict().items()}, out_dir)
    dp_sgd_ranks._finish()


def test_fsdp_make_private_matches_one_process(tmp_path) -> None:
    spawn(worker, str(tmp_path))
    assert_ranks_match_one_process(tmp_path, sharded_task)
