"""DP-SGD with ``batchrules.clipped_grad``: Poisson sampling, clipping, noise, accounting.

Each step samples a Poisson batch (every example independently with
probability q), computes with one forward and one backward the sum of the
per-sample gradients clipped to norm C (``batchrules.clipped_grad``), adds
Gaussian noise N(0, (sigma C)^2) from a seeded generator, divides by the
expected batch size q*N and takes an optimizer step. Opacus' RDP accountant
(when Opacus is installed) turns (sigma, q, steps) into epsilon at delta.

With ``--ddp N``, N gloo processes on 127.0.0.1 draw the same Poisson batch
and each clips its share; the clipped sums are all-reduced and rank 0 alone
adds the noise (as Opacus' DistributedDPOptimizer does), so the update is
the one a single process computes.

    python -m batchrules.examples.dp_sgd [--ddp 2] [--steps 30]
"""
import argparse
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

import batchrules

AllReduce = Callable[[Tensor], None]


@dataclass(frozen=True)
class DPConfig:
    max_norm: float = 1.0  # C
    noise_multiplier: float = 1.0  # sigma
    sample_rate: float = 0.05  # q
    lr: float = 0.5
    steps: int = 30
    delta: float = 1e-5
    examples: int = 1024
    seed: int = 0


def make_data(config: DPConfig) -> Tuple[Tensor, Tensor]:
    """Labels of a fixed random linear teacher on Gaussian inputs (4 classes)."""
    g = torch.Generator().manual_seed(config.seed)
    x = torch.randn(config.examples, 20, generator=g)
    return x, (x @ torch.randn(20, 4, generator=g)).argmax(1)


def make_model(config: DPConfig) -> nn.Module:
    torch.manual_seed(config.seed)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


def poisson_batch(config: DPConfig, generator: torch.Generator) -> Tensor:
    """Indices of a Poisson-sampled batch (possibly empty)."""
    return (torch.rand(config.examples, generator=generator) < config.sample_rate).nonzero().flatten()


def dp_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor,
            config: DPConfig, noise: Optional[torch.Generator],
            all_reduce: Optional[AllReduce] = None) -> Tensor:
    """One DP-SGD step on this process' share ``(x, y)`` of the batch; adds
    noise only when given a ``noise`` generator. Returns the per-sample norms."""
    def loss(p: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (xi,)), yi)

    params = {k: p.detach() for k, p in model.named_parameters()}
    sums, norms = batchrules.clipped_grad(loss, config.max_norm)(params, x, y)
    std = config.noise_multiplier * config.max_norm
    for name, p in model.named_parameters():
        g = sums[name]
        if noise is not None:
            g = g + std * torch.randn(p.shape, generator=noise, dtype=p.dtype).to(p.device)
        if all_reduce is not None:
            all_reduce(g)
        p.grad = g / (config.sample_rate * config.examples)
    optimizer.step()
    return norms


def make_accountant():
    """Opacus' RDP accountant, or None when Opacus is not installed."""
    try:
        from opacus.accountants import RDPAccountant
    except ImportError:
        return None
    return RDPAccountant()


def train(config: DPConfig, model: Optional[nn.Module] = None, rank: int = 0, world: int = 1,
          all_reduce: Optional[AllReduce] = None,
          log: Callable[[str], None] = lambda line: None) -> Tuple[nn.Module, Optional[float]]:
    """DP-SGD for ``config.steps`` steps; returns the model and epsilon (None without Opacus)."""
    x, y = make_data(config)
    model = model if model is not None else make_model(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    sampler = torch.Generator().manual_seed(config.seed + 1)  # the same batches on every rank
    noise = torch.Generator().manual_seed(config.seed + 2) if rank == 0 else None
    accountant = make_accountant()
    for step in range(config.steps):
        batch = poisson_batch(config, sampler)
        share = batch[rank::world]
        norms = dp_step(model, optimizer, x[share], y[share], config, noise, all_reduce)
        if accountant is not None:
            accountant.step(noise_multiplier=config.noise_multiplier, sample_rate=config.sample_rate)
        if step % 10 == 0 or step == config.steps - 1:
            with torch.no_grad():
                full_loss = F.cross_entropy(model(x), y).item()
            clipped = int((norms > config.max_norm).sum())
            log(f"step {step}: batch {len(batch)}, clipped {clipped}/{len(share)} here, "
                f"loss {full_loss:.4f}")
    epsilon = accountant.get_epsilon(delta=config.delta) if accountant is not None else None
    return model, epsilon


# ---- distributed -------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, config: DPConfig, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        # DDP broadcasts rank 0's parameters; the clipped sums bypass its
        # backward hooks, so they are all-reduced explicitly.
        ddp = nn.parallel.DistributedDataParallel(make_model(config))
        model, _ = train(config, ddp.module, rank, world, lambda t: dist.all_reduce(t))
        torch.save(model.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train_ddp(config: DPConfig, world: int = 2, timeout_s: float = 300.0) -> List[Dict[str, Tensor]]:
    """``train`` on ``world`` gloo processes; returns every rank's final state dict."""
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_ddp_worker, args=(world, _free_port(), config, out_dir),
                                     nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):  # raises if a rank failed
            if time.monotonic() > deadline:
                for p in context.processes:
                    p.kill()
                raise TimeoutError(f"DP-SGD ranks still running after {timeout_s}s")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m batchrules.examples.dp_sgd")
    parser.add_argument("--ddp", type=int, metavar="N", help="train on N gloo processes")
    parser.add_argument("--steps", type=int, default=DPConfig.steps)
    args = parser.parse_args(argv)
    config = DPConfig(steps=args.steps)
    model, epsilon = train(config, log=print)
    if epsilon is None:
        print("epsilon: install opacus for its RDP accountant")
    else:
        print(f"epsilon {epsilon:.2f} at delta {config.delta:g} after {config.steps} steps "
              f"(sigma {config.noise_multiplier}, q {config.sample_rate}, RDP accountant)")
    if args.ddp:
        states = train_ddp(config, args.ddp)
        want = model.state_dict()
        same = all(torch.allclose(s[k], want[k], rtol=1e-5, atol=1e-6) for s in states for k in want)
        print(f"{args.ddp} DDP ranks match one process: {same}")


if __name__ == "__main__":
    main()
