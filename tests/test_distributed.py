"""torch.distributed with batchrules: DP-SGD under DDP, and DTensor sharding.

Each group of checks runs in 2 spawned gloo processes on 127.0.0.1 (a free
port picked per run) under a wall-clock deadline: a hung collective fails the
test instead of hanging CI. Workers record a result per case, so a failure
names its case; SPMD code raises on both ranks alike, so ranks stay in step.
"""
import faulthandler
import json
import os
import sys
import traceback
from datetime import timedelta
from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from conftest import DISTRIBUTED, WORLD, spawn
from torch.func import functional_call, grad, vmap

import batchrules

pytestmark = DISTRIBUTED


def init(rank: int, port: int) -> None:
    faulthandler.enable(all_threads=True)  # a crashing rank prints its stacks
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))


def finish() -> None:
    """Leave without interpreter finalization: with torch 2.13, processes that
    used DTensor on gloo abort (SIGABRT "terminate called without an active
    exception", or SIGBUS) while finalizing in roughly 1 of 4 runs, even after
    a clean destroy_process_group and without batchrules involved."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- DP-SGD with DDP ---------------------------------------------------------

GLOBAL_BATCH, STEPS, CLIP, NOISE = 8, 3, 1.0, 0.5


def dp_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def dp_data() -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)


def clipped_grad_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> List[torch.Tensor]:
    """Per-sample gradients by vmap(grad) with routing on, each clipped to norm
    CLIP, summed over the samples: one tensor per parameter."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    with batchrules.enabled():
        per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample.values()], 1).norm(dim=1)
    scale = (CLIP / (norms + 1e-6)).clamp(max=1.0)
    return [torch.einsum("n,n...->...", scale, per_sample[k]) for k in params]


def dp_sgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int,
           all_reduce: Callable[[torch.Tensor], None]) -> None:
    """DP-SGD as Opacus runs it distributed: each rank sums its clipped
    per-sample gradients, rank 0 alone adds the noise (so it is added once),
    the sums are all-reduced, and divided by the global batch size."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    noise = torch.Generator().manual_seed(11)  # the same stream on every rank
    for _ in range(STEPS):
        for p, g in zip(model.parameters(), clipped_grad_sum(model, x, y)):
            z = torch.randn(p.shape, generator=noise) * NOISE * CLIP
            p.grad = g + z if rank == 0 else g
            all_reduce(p.grad)
            p.grad /= GLOBAL_BATCH
        opt.step()


def ddp_worker(rank: int, port: int, out_dir: str) -> None:
    init(rank, port)
    torch.manual_seed(100 + rank)  # ranks start different; DDP broadcasts rank 0's
    ddp = nn.parallel.DistributedDataParallel(dp_model())
    x, y = dp_data()
    shard = slice(rank * GLOBAL_BATCH // WORLD, (rank + 1) * GLOBAL_BATCH // WORLD)
    # Per-sample gradients bypass DDP's autograd hooks, so the all-reduce is
    # explicit (as in Opacus' DistributedDPOptimizer); DDP provides the
    # synchronized start.
    dp_sgd(ddp.module, x[shard], y[shard], rank, lambda t: dist.all_reduce(t))
    torch.save(ddp.module.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    finish()


def test_ddp_dp_sgd_matches_single_process(tmp_path) -> None:
    spawn(ddp_worker, str(tmp_path))
    torch.manual_seed(100)
    model = dp_model()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    dp_sgd(model, *dp_data(), rank=0, all_reduce=lambda t: None)
    want = model.state_dict()
    assert not any(torch.equal(want[k], start[k]) for k in want)  # training moved every tensor
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


# ---- DTensor -----------------------------------------------------------------

def dtensor_cases() -> Dict[str, Callable]:
    """Case name -> fn(mesh) that raises AssertionError on a mismatch."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    def check_linear(mesh, x_shape, w_shape, b_shape, x_p, w_p, b_p, out_p) -> None:
        torch.manual_seed(0)
        full = [torch.randn(s, dtype=torch.float64, requires_grad=True) if s is not None else None
                for s in (x_shape, w_shape, b_shape)]
        leaves = [t for t in full if t is not None]
        ref = F.linear(*full)
        g = torch.randn(ref.shape, dtype=torch.float64)
        want = torch.autograd.grad(ref, leaves, g)
        dts = [None if t is None else distribute_tensor(t.detach(), mesh, [p]).requires_grad_()
               for t, p in zip(full, (x_p, w_p, b_p))]
        out = batchrules.linear(*dts)
        assert out.placements == (out_p,), out.placements
        torch.testing.assert_close(out.full_tensor(), ref)
        got = torch.autograd.grad(out, [t for t in dts if t is not None],
                                  distribute_tensor(g, mesh, [Replicate()]))
        for a, e in zip(got, want):
            torch.testing.assert_close(a.full_tensor(), e)

    def backward_masks(mesh) -> None:
        """Same operands, different output_mask: DTensor's sharding cache must
        not hand one mask's result to another."""
        x, g, w = (torch.randn(s, dtype=torch.float64) for s in ((4, 6), (4, 8), (8, 6)))
        dx, dg = (distribute_tensor(t, mesh, [Replicate()]) for t in (x, g))
        dw = distribute_tensor(w, mesh, [Shard(0)])
        for mask in ([False, False, True], [True, False, False], [True, True, True]):
            got = batchrules.linear_backward(dx, dg, dw, mask)
            want = batchrules.linear_backward(x, g, w, mask)
            for a, e in zip(got, want):
                assert (a is None) == (e is None), mask
                if a is not None:
                    torch.testing.assert_close(a.full_tensor(), e)

    def megatron_mlp(mesh) -> None:
        """Column- then row-parallel layers chain without redistribution."""
        torch.manual_seed(0)
        x = torch.randn(4, 6, dtype=torch.float64)
        w1, b1 = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
        w2, b2 = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
        params = [w1, b1, w2, b2]
        ref_params = [p.clone().requires_grad_() for p in params]
        ref = F.linear(F.linear(x, *ref_params[:2]).relu(), *ref_params[2:]).square().sum()
        want = torch.autograd.grad(ref, ref_params)
        placements = [Shard(0), Shard(0), Shard(1), Replicate()]
        dparams = [distribute_tensor(p, mesh, [pl]).requires_grad_()
                   for p, pl in zip(params, placements)]
        h = batchrules.linear(distribute_tensor(x, mesh, [Replicate()]), *dparams[:2]).relu()
        assert h.placements == (Shard(1),), h.placements
        out = batchrules.linear(h, *dparams[2:])
        assert out.placements == (Partial(),), out.placements
        loss = out.full_tensor().square().sum()
        torch.testing.assert_close(loss, ref)
        for a, e in zip(torch.autograd.grad(loss, dparams), want):
            torch.testing.assert_close(a.full_tensor(), e)

    R, S0, S1, S2, P = Replicate(), Shard(0), Shard(1), Shard(2), Partial()
    return {
        "column_parallel": lambda m: check_linear(m, (4, 6), (8, 6), (8,), R, S0, S0, S1),
        "column_parallel_3d_input": lambda m: check_linear(m, (2, 3, 6), (8, 6), (8,), R, S0, S0, S2),
        "row_parallel": lambda m: check_linear(m, (4, 6), (8, 6), (8,), S1, S1, R, P),
        "row_parallel_no_bias": lambda m: check_linear(m, (2, 3, 6), (8, 6), None, S2, S1, R, P),
        "data_parallel": lambda m: check_linear(m, (4, 6), (8, 6), (8,), S0, R, R, S0),
        "weight_1d_row_parallel": lambda m: check_linear(m, (4, 6), (6,), None, S1, S0, R, P),
        "backward_masks": backward_masks,
        "megatron_mlp": megatron_mlp,
    }


CASES = ["column_parallel", "column_parallel_3d_input", "row_parallel", "row_parallel_no_bias",
         "data_parallel", "weight_1d_row_parallel", "backward_masks", "megatron_mlp"]


def dtensor_worker(rank: int, port: int, out_dir: str) -> None:
    init(rank, port)
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}
    for name, case in dtensor_cases().items():
        try:
            case(mesh)
            results[name] = "ok"
        except Exception:  # recorded per case; see the module docstring
            results[name] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    finish()


@pytest.fixture(scope="module")
def dtensor_results(tmp_path_factory) -> List[Dict[str, str]]:
    out_dir = tmp_path_factory.mktemp("dtensor")
    spawn(dtensor_worker, str(out_dir))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("case", CASES)
def test_dtensor(dtensor_results: List[Dict[str, str]], case: str) -> None:
    for rank, results in enumerate(dtensor_results):
        assert results[case] == "ok", f"rank {rank}:\n{results[case]}"
