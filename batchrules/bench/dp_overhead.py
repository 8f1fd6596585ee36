"""``python -m batchrules.bench.dp_overhead``: what clipped_grad costs above
a non-private step, per recorded layer and per op that touches no parameter.

A synthetic network of ``L`` linear layers (d = 64, batch 32, tanh between
them) with ``K`` parameter-free ops after each layer (``x * 1.0``) is timed,
interleaved in one process, four ways:

- ``nonprivate``: forward and ``autograd.grad`` of the summed loss;
- ``eager forward``: the forward alone;
- ``vmap forward``: ``vmap`` of the per-sample loss (routing on) over
  parameters that require grad: the forward clipped_grad runs, autograd's
  recording included, without its interception;
- ``clipped_grad``: the whole DP step.

``overhead`` is clipped_grad minus nonprivate. Least-squares slopes then give
its cost per recorded layer (over L at K = 0: the layer's interception,
recording, norm and clipped sum) and per parameter-free op (over L*K at fixed
L), next to what vmap itself adds per op over eager code (the vmap forward
minus the eager forward), which any per-sample transform pays. The fixed
part is the intercept at L = 0. Small layers keep the GEMMs out of the
picture; the README's "What to expect" quotes this tool's output.
"""
import argparse
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap

import batchrules

from .case import Variant
from .timing import TimingPlan, time_interleaved

PLAN = TimingPlan(block_s=0.02, budget_s=2.0, min_repeats=7, max_repeats=41, warmup_calls=3)
WIDTH, BATCH = 64, 32
# (L, K): layers, then parameter-free ops per layer at a fixed L
LAYER_SWEEP = ((1, 0), (4, 0), (16, 0))
OP_SWEEP = ((4, 0), (4, 16), (4, 64))


class Stack(nn.Module):
    """``layers`` linears with ``ops`` parameter-free multiplications after each, then a head."""

    def __init__(self, layers: int, ops: int) -> None:
        super().__init__()
        self.ops = ops
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
            for _ in range(self.ops):
                x = x * 1.0
            x = torch.tanh(x)
        return self.head(x)


@dataclass
class Row:
    layers: int
    ops: int
    times: Dict[str, float]  # seconds per step, by variant

    @property
    def overhead(self) -> float:
        return self.times["clipped_grad"] - self.times["nonprivate"]

    @property
    def vmap_overhead(self) -> float:
        return self.times["vmap forward"] - self.times["eager forward"]


def _variants(layers: int, ops: int) -> List[Variant]:
    torch.manual_seed(0)
    model = Stack(layers, ops)
    params = {k: v.detach() for k, v in model.named_parameters()}
    leaves = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    trainable = list(model.parameters())
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))

    def loss(p: Dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    clipped = batchrules.clipped_grad(loss, 1.0)
    per_sample = vmap(loss, in_dims=(None, 0, 0))
    steps: Sequence[Tuple[str, Callable[[], object], Optional[bool]]] = (
        ("nonprivate", lambda: torch.autograd.grad(
            F.cross_entropy(model(x), y, reduction="sum"), trainable), None),
        ("eager forward", lambda: F.cross_entropy(model(x), y, reduction="none"), None),
        ("vmap forward", lambda: per_sample(leaves, x, y), True),
        ("clipped_grad", lambda: clipped(params, x, y), None),
    )
    return [Variant(name, fn, routing=routing) for name, fn, routing in steps]


def measure(layers: int, ops: int, plan: TimingPlan = PLAN) -> Row:
    stats = time_interleaved(_variants(layers, ops), plan, lambda: None)
    return Row(layers, ops, {name: s.median for name, s in stats.items()})


def slope(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float]:
    """Least-squares ``(slope, intercept)`` of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((a - mx) ** 2 for a in xs)
    k = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sxx
    return k, my - k * mx


def run(layer_sweep: Sequence[Tuple[int, int]] = LAYER_SWEEP,
        op_sweep: Sequence[Tuple[int, int]] = OP_SWEEP, plan: TimingPlan = PLAN) -> List[str]:
    rows = {cfg: measure(*cfg, plan=plan) for cfg in dict.fromkeys((*layer_sweep, *op_sweep))}
    lines = [f"{'layers':>6s} {'ops/layer':>9s} {'nonprivate':>11s} {'clipped_grad':>12s} "
             f"{'overhead':>9s} {'vmap fwd - eager fwd':>21s}"]
    for r in rows.values():
        lines.append(f"{r.layers:6d} {r.ops:9d} {r.times['nonprivate'] * 1e6:9.0f}us "
                     f"{r.times['clipped_grad'] * 1e6:10.0f}us {r.overhead * 1e6:7.0f}us "
                     f"{r.vmap_overhead * 1e6:19.0f}us")
    by_layer = [rows[c] for c in layer_sweep]
    per_layer, fixed = slope([r.layers for r in by_layer], [r.overhead for r in by_layer])
    by_op = [rows[c] for c in op_sweep]
    n_ops = [r.layers * r.ops for r in by_op]
    per_op = slope(n_ops, [r.overhead for r in by_op])[0]
    vmap_per_op = slope(n_ops, [r.vmap_overhead for r in by_op])[0]
    lines += [f"clipped_grad above the non-private step: {fixed * 1e6:.0f} us fixed, "
              f"{per_layer * 1e6:.0f} us per recorded linear layer (weight and bias), "
              f"{per_op * 1e6:.1f} us per parameter-free op, of which vmap's own batching "
              f"(vmap forward - eager forward) is {vmap_per_op * 1e6:.1f} us"]
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m batchrules.bench.dp_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, width {WIDTH}, "
          f"batch {BATCH}")
    for line in run():
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
