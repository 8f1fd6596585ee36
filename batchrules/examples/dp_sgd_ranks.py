"""The DP-SGD example (dp_sgd.py) on several gloo processes: DDP and FSDP2.

DDP: every rank holds the model; each clips its share of the Poisson batch
and adds its own dim-0 shard of the noise, and the clipped sums are
all-reduced with one collective per step (``batchrules.dp.all_reduce_flat``).

FSDP2: the model is sharded by ``fully_shard`` per encoder layer and at the
root, so a rank holds a dim-0 shard of every parameter, its gradient and its
optimizer state. A step (``fsdp_step``): FSDP's all-gather
(``batchrules.dp.unsharded``) gives the full weights; the rank clips its own
samples through ``functional_call`` on a weightless (meta) copy of the
architecture; one reduce-scatter (``batchrules.dp.reduce_scatter_flat``)
sums the clipped sums over the ranks into each rank's shard; the rank adds
its shard's noise (from its own seeded generator, so the noise is added once
and the run is reproducible), and the optimizer steps the shards.
"""
import copy
import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from batchrules.dp import all_reduce_flat, reduce_scatter_flat, unsharded

from .dp_sgd import DPConfig, clipped_sums, make_model, noise_generators, shard_noise, train


def shard_model(model: nn.Module) -> nn.Module:
    """``fully_shard`` each block (a transformer's encoder layers; an MLP's
    linears), then the root for the rest."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(model, "layers", None)
    blocks = list(layers) if isinstance(layers, nn.ModuleList) else \
        [m for m in model.modules() if isinstance(m, nn.Linear)]
    for block in blocks:
        fully_shard(block)
    fully_shard(model)  # the same module, now an FSDPModule too
    return model


def fsdp_step(model: nn.Module, arch: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor,
              y: Tensor, config: DPConfig, noise: torch.Generator, rank: int) -> Tensor:
    """One DP-SGD step of a ``fully_shard``-ed model on this rank's share
    ``(x, y)``; ``arch``: the model's architecture (e.g. on the meta device),
    for ``functional_call``. Returns this rank's per-sample norms."""
    optimizer.zero_grad(set_to_none=True)  # the last step's shards are not held during this one
    with unsharded(model) as params:
        sums, norms = clipped_sums(arch, params, x, y, config)
    shards = reduce_scatter_flat(sums, dict(model.named_parameters()))
    del sums  # the full-size sums: only the shards outlive the step
    from torch.distributed.tensor import DTensor

    named = list(model.named_parameters())
    pieces = shard_noise([p.shape for _, p in named], config, noise, shard=rank)
    for (name, p), piece in zip(named, pieces):
        shard = shards[name]
        local = shard.to_local() + piece
        p.grad = DTensor.from_local(local / (config.sample_rate * config.examples),
                                    shard.device_mesh, shard.placements, shape=p.shape,
                                    stride=p.stride())
    optimizer.step()
    return norms


def local_bytes(tensors: Sequence[Optional[Tensor]]) -> int:
    """Bytes of the tensors this rank holds (a DTensor's local shard)."""
    total = 0
    for t in tensors:
        if t is not None:
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


# ---- processes ------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))


def _finish() -> None:
    """Leave without interpreter finalization: with torch 2.13 a process that
    used DTensor on gloo may abort while finalizing (see tests/test_distributed.py)."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _ddp_worker(rank: int, world: int, port: int, config: DPConfig, out_dir: str) -> None:
    _init(rank, world, port)
    # DDP broadcasts rank 0's parameters; the clipped sums bypass its
    # backward hooks, so they are all-reduced explicitly.
    ddp = nn.parallel.DistributedDataParallel(make_model(config))
    model, _ = train(config, ddp.module, rank, world, all_reduce_flat)
    torch.save(model.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    _finish()


def _fsdp_worker(rank: int, world: int, port: int, config: DPConfig, out_dir: str) -> None:
    _init(rank, world, port)
    model = make_model(config)
    arch = copy.deepcopy(model).to("meta")  # the architecture only, for functional_call
    shard_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    noise = noise_generators(config, [rank])[0]
    train(config, model, rank, world,
          step=lambda x, y: fsdp_step(model, arch, optimizer, x, y, config, noise, rank))
    params = [p for _, p in model.named_parameters()]
    memory = {"params": local_bytes(params), "grads": local_bytes([p.grad for p in params]),
              "full": sum(p.numel() * p.element_size() for p in params)}
    with open(os.path.join(out_dir, f"memory{rank}.json"), "w") as f:
        json.dump(memory, f)
    from torch.distributed.tensor import DTensor

    # fully_shard made every parameter a DTensor; full_tensor is a collective: all ranks
    state = {k: cast(DTensor, p).full_tensor() for k, p in model.named_parameters()}
    torch.save(state, os.path.join(out_dir, f"rank{rank}.pt"))
    _finish()


def _spawn(worker: Callable, config: DPConfig, world: int, timeout_s: float,
           out_dir: str) -> None:
    context = mp.start_processes(worker, args=(world, _free_port(), config, out_dir),
                                 nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):  # raises if a rank failed
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            raise TimeoutError(f"DP-SGD ranks still running after {timeout_s}s")


def train_ddp(config: DPConfig, world: int = 2, timeout_s: float = 300.0) -> List[Dict[str, Tensor]]:
    """``train`` on ``world`` DDP gloo processes; returns every rank's final
    state dict. Equal to ``train`` on one process with ``noise_shards=world``
    (the same noise)."""
    config = replace(config, noise_shards=world)
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_ddp_worker, config, world, timeout_s, out_dir)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def train_fsdp(config: DPConfig, world: int = 2, timeout_s: float = 300.0,
               memory: Optional[List[Dict[str, Any]]] = None) -> List[Dict[str, Tensor]]:
    """``train`` with the model sharded over ``world`` gloo processes (FSDP2);
    returns every rank's final parameters (gathered). ``memory``, when given,
    receives per rank the bytes of its parameter and gradient shards and of
    the full parameters. Equal to ``train`` on one process with
    ``noise_shards=world`` (the same noise)."""
    config = replace(config, noise_shards=world)
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_fsdp_worker, config, world, timeout_s, out_dir)
        if memory is not None:
            for r in range(world):
                with open(os.path.join(out_dir, f"memory{r}.json")) as f:
                    memory.append(json.load(f))
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
