"""DP-SGD with ``batchrules.clipped_grad``: Poisson sampling, clipping, noise, accounting.

Each step samples a Poisson batch (every example independently with
probability q), computes with one forward and one backward the sum of the
per-sample gradients clipped to norm C (``batchrules.clipped_grad``), adds
Gaussian noise N(0, (sigma C)^2) from seeded generators, divides by the
expected batch size q*N and takes an optimizer step. Opacus' RDP accountant
(when Opacus is installed) turns (sigma, q, steps) into epsilon at delta.

- ``--model transformer``: DP fine-tuning of a small transformer classifier
  (token embedding, 2 encoder layers, mean pool, linear head; random weights
  from the config) on a synthetic sequence task, instead of the MLP.
- ``--logical-batch N``: q = N / examples (a logical batch of N samples in
  expectation), run in physical chunks of ``--physical-batch`` samples
  (``batchrules.dp.clipped_grad_chunked``): the clipped sums add up, the
  noise is added once per logical step.
- ``--bf16``: the loss runs under ``torch.autocast("cpu", torch.bfloat16)``.
- ``--ddp N``: N gloo processes on 127.0.0.1 draw the same Poisson batch and
  each clips its share and adds the noise of its own dim-0 shard of every
  parameter (``noise_shards=N``: the noise is added once, and no rank draws
  all of it, as Opacus' DistributedDPOptimizer's rank 0 does); the sums are
  all-reduced once per step (``batchrules.dp.all_reduce_flat``): the update
  is one process's.
- ``--fsdp N``: the model sharded over N gloo processes with FSDP2's
  ``fully_shard`` (per encoder layer and at the root); see dp_sgd_ranks.py.

Noise is drawn per dim-0 shard of the parameters (``noise_shards``), from one
generator per shard, as one vector over that shard's rows of every parameter
(one randn call a step, not one per parameter): a DDP or FSDP rank draws only
its own shard's noise, and one process with ``noise_shards=N`` draws the same
noise as N ranks.

    python -m batchrules.examples.dp_sgd [--model transformer] [--ddp 2 | --fsdp 2]
        [--logical-batch 256 --physical-batch 32] [--bf16] [--steps 30]
"""
import argparse
import contextlib
import math
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from batchrules.dp import clipped_grad_chunked

Noise = Union[torch.Generator, Sequence[torch.Generator]]
AllReduce = Callable[[Dict[str, Tensor]], Dict[str, Tensor]]
VOCAB, TOKENS, CLASSES = 32, 12, 4


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
    model: str = "mlp"  # or "transformer"
    physical_batch: Optional[int] = None  # chunk size of a logical batch; None: one chunk
    bf16: bool = False  # the loss under autocast to bfloat16
    dtype: torch.dtype = torch.float32
    noise_shards: int = 1  # see the module docstring


class TinyTransformer(nn.Module):
    """Token embedding + learned positions, ``layers`` encoder layers
    (pre-norm, dropout 0), mean pool, linear head. Takes ``[..., T]`` tokens."""

    def __init__(self, d_model: int = 32, heads: int = 4, ff: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(0.02 * torch.randn(TOKENS, d_model))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True,
                                       norm_first=True) for _ in range(layers))
        self.head = nn.Linear(d_model, CLASSES)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens) + self.pos
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(-2))


def make_data(config: DPConfig) -> Tuple[Tensor, Tensor]:
    """MLP: labels of a fixed random linear teacher on Gaussian inputs.
    Transformer: random token sequences labelled by their most frequent token mod 4."""
    g = torch.Generator().manual_seed(config.seed)
    if config.model == "transformer":
        tokens = torch.randint(0, VOCAB, (config.examples, TOKENS), generator=g)
        counts = F.one_hot(tokens, VOCAB).sum(1)
        return tokens, counts.argmax(1) % CLASSES
    x = torch.randn(config.examples, 20, generator=g, dtype=config.dtype)
    return x, (x @ torch.randn(20, 4, generator=g, dtype=config.dtype)).argmax(1)


def make_model(config: DPConfig) -> nn.Module:
    torch.manual_seed(config.seed)
    model = TinyTransformer() if config.model == "transformer" else \
        nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    return model.to(config.dtype)


def poisson_batch(config: DPConfig, generator: torch.Generator) -> Tensor:
    """Indices of a Poisson-sampled batch (possibly empty)."""
    return (torch.rand(config.examples, generator=generator) < config.sample_rate).nonzero().flatten()


def clipped_sums(model: nn.Module, params: Dict[str, Tensor], x: Tensor, y: Tensor,
                 config: DPConfig) -> Tuple[Dict[str, Tensor], Tensor]:
    """``batchrules.clipped_grad`` of the cross-entropy through ``model``
    (used only for its architecture, by ``functional_call``) at ``params``,
    in chunks of ``config.physical_batch`` samples."""
    def loss(p: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        autocast = torch.autocast("cpu", torch.bfloat16) if config.bf16 else contextlib.nullcontext()
        with autocast:
            logits = functional_call(model, p, (xi,))
        return F.cross_entropy(logits.to(config.dtype), yi)

    chunk = config.physical_batch or max(len(x), 1)
    return clipped_grad_chunked(loss, config.max_norm, chunk)(params, x, y)


def noise_generators(config: DPConfig, shards: Sequence[int]) -> List[torch.Generator]:
    """The generators of the given dim-0 shards of every parameter's noise."""
    return [torch.Generator().manual_seed(config.seed + 2 + 1000 * s) for s in shards]


def shard_rows(rows: int, shards: int, shard: int) -> int:
    """Rows of shard ``shard`` when ``rows`` are split in ``shards`` as FSDP2
    splits dim 0 (``torch.chunk``; trailing shards possibly empty)."""
    per = -(-rows // shards)
    return max(0, min(per, rows - shard * per))


def shard_noise(shapes: Sequence[torch.Size], config: DPConfig, generator: torch.Generator,
                shard: int = 0) -> List[Tensor]:
    """N(0, (sigma C)^2) noise of dim-0 shard ``shard`` (of ``config.noise_shards``)
    of parameters of the given full ``shapes``: one draw from ``generator``
    over all their rows in that shard, split in order (a 0-dim parameter's
    noise belongs to shard 0; other shards get an empty tensor for it)."""
    rows = [shard_rows(s[0], config.noise_shards, shard) if len(s) else int(shard == 0)
            for s in shapes]
    sizes = [r * math.prod(s[1:]) for r, s in zip(rows, shapes)]
    flat = torch.randn(sum(sizes), generator=generator, dtype=config.dtype)
    flat.mul_(config.noise_multiplier * config.max_norm)
    return [piece.view(r, *s[1:]) if len(s) else piece.view(()) if r else piece
            for piece, r, s in zip(flat.split(sizes), rows, shapes)]


def add_noise_(grads: Sequence[Tensor], config: DPConfig, noise: Noise, first_shard: int = 0) -> None:
    """Adds to the full-size ``grads`` (in place) the noise of the dim-0 shards
    that ``noise``'s generators draw, from ``first_shard`` on (``shard_noise``):
    all of it when they are all the shards, else those rows (a DDP rank's share)."""
    generators = [noise] if isinstance(noise, torch.Generator) else list(noise)
    shapes = [g.shape for g in grads]
    for shard, generator in enumerate(generators, first_shard):
        targets, pieces = [], []
        for g, piece in zip(grads, shard_noise(shapes, config, generator, shard)):
            if not piece.numel():  # a 0-dim g's piece is 0-dim in shard 0, empty in the others
                continue
            if g.dim():  # this shard's rows
                start = sum(shard_rows(len(g), config.noise_shards, s) for s in range(shard))
                g = g[start:start + len(piece)]
            targets.append(g)
            pieces.append(piece)
        if targets:
            torch._foreach_add_(targets, pieces)


def dp_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor,
            config: DPConfig, noise: Optional[Noise],
            all_reduce: Optional[AllReduce] = None, first_shard: int = 0) -> Tensor:
    """One DP-SGD step on this process' share ``(x, y)`` of the batch; adds
    noise only when given ``noise`` generators (one, or one per noise shard,
    from ``first_shard`` on: ``add_noise_``). ``all_reduce`` sums the noised
    sums over the ranks (one collective). Returns the per-sample norms."""
    optimizer.zero_grad(set_to_none=True)  # the last step's gradients are not held during this one
    params = {k: p.detach() for k, p in model.named_parameters()}
    sums, norms = clipped_sums(model, params, x, y, config)
    if noise is not None:  # the sums are fresh tensors: noised in place
        add_noise_(list(sums.values()), config, noise, first_shard)
    if all_reduce is not None:
        sums = all_reduce(sums)
    torch._foreach_div_(list(sums.values()), config.sample_rate * config.examples)
    for name, p in model.named_parameters():
        p.grad = sums[name]
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
          all_reduce: Optional[AllReduce] = None, log: Callable[[str], None] = lambda line: None,
          step: Optional[Callable[[Tensor, Tensor], Tensor]] = None
          ) -> Tuple[nn.Module, Optional[float]]:
    """DP-SGD for ``config.steps`` steps; returns the model and epsilon (None
    without Opacus). ``step(x, y) -> norms`` replaces ``dp_step`` with SGD
    (FSDP's step, which draws its own shard's noise)."""
    x, y = make_data(config)
    model = model if model is not None else make_model(config)
    if step is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
        noise: Optional[List[torch.Generator]]
        if config.noise_shards == world:  # each rank its own shard's noise
            noise, first = noise_generators(config, [rank]), rank
        else:  # rank 0 all of it
            noise, first = (noise_generators(config, range(config.noise_shards))
                            if rank == 0 else None), 0

        def sgd_step(xs: Tensor, ys: Tensor) -> Tensor:
            return dp_step(model, optimizer, xs, ys, config, noise, all_reduce, first)
        step = sgd_step
    sampler = torch.Generator().manual_seed(config.seed + 1)  # the same batches on every rank
    accountant = make_accountant()
    for i in range(config.steps):
        batch = poisson_batch(config, sampler)
        share = batch[rank::world]
        norms = step(x[share], y[share])
        if accountant is not None:
            accountant.step(noise_multiplier=config.noise_multiplier, sample_rate=config.sample_rate)
        if i % 10 == 0 or i == config.steps - 1:
            log(f"step {i}: batch {len(batch)}, clipped "
                f"{int((norms > config.max_norm).sum())}/{len(share)} here")
    epsilon = accountant.get_epsilon(delta=config.delta) if accountant is not None else None
    return model, epsilon


def config_from_args(args: argparse.Namespace) -> DPConfig:
    config = DPConfig(steps=args.steps, model=args.model, bf16=args.bf16)
    if args.logical_batch:
        examples = max(config.examples, 4 * args.logical_batch)
        config = replace(config, examples=examples, sample_rate=args.logical_batch / examples,
                         physical_batch=args.physical_batch)
    return config


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m batchrules.examples.dp_sgd")
    parser.add_argument("--model", choices=["mlp", "transformer"], default="mlp")
    parser.add_argument("--ddp", type=int, metavar="N", help="also train on N gloo processes (DDP)")
    parser.add_argument("--fsdp", type=int, metavar="N",
                        help="also train sharded on N gloo processes (FSDP2)")
    parser.add_argument("--logical-batch", type=int, metavar="N",
                        help="expected (Poisson) batch size, run in physical chunks")
    parser.add_argument("--physical-batch", type=int, default=32, metavar="M")
    parser.add_argument("--bf16", action="store_true", help="the loss under bfloat16 autocast")
    parser.add_argument("--steps", type=int, default=DPConfig.steps)
    args = parser.parse_args(argv)
    if args.ddp and args.fsdp and args.ddp != args.fsdp:
        parser.error("--ddp and --fsdp together take the same N: the one-process run they are "
                     "checked against draws N noise shards")
    config = config_from_args(args)
    if args.fsdp or args.ddp:  # the ranks draw their shards' noise: the same noise here
        config = replace(config, noise_shards=args.fsdp or args.ddp)
    model, epsilon = train(config, log=print)
    with torch.no_grad():
        x, y = make_data(config)
        print(f"loss {F.cross_entropy(model(x), y).item():.4f} on all {config.examples} examples")
    if epsilon is None:
        print("epsilon: install opacus for its RDP accountant")
    else:
        print(f"epsilon {epsilon:.2f} at delta {config.delta:g} after {config.steps} steps "
              f"(sigma {config.noise_multiplier}, q {config.sample_rate:g}, RDP accountant)")
    from . import dp_sgd_ranks

    want = model.state_dict()
    for flag, run in (("ddp", dp_sgd_ranks.train_ddp), ("fsdp", dp_sgd_ranks.train_fsdp)):
        world = getattr(args, flag)
        if world:
            states = run(config, world)
            same = all(torch.allclose(s[k], want[k], rtol=1e-4, atol=1e-5)
                       for s in states for k in want)
            print(f"{world} {flag.upper()} ranks match one process: {same}")


if __name__ == "__main__":
    main()
