"""Per-sample weights, as a hypernetwork produces them.

The target network is two linears whose weights and biases differ per sample
(``vmap(target)(x, W1, b1, W2, b2)``); the weights are leaves standing in for
a hypernetwork's output so that only the per-sample-weight part is measured.
Backward is eager autograd through the vmapped code, as when the hypernetwork
is trained.
"""
from dataclasses import dataclass
from typing import FrozenSet, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import vmap

from ..baselines import hand_written
from ..case import Case, CaseSetup, Variant, vmap_identity
from ..targets import transform_targets


@dataclass(frozen=True)
class HyperSize:
    name: str
    tier: str
    batch: int
    rows: int  # points per sample fed through its own target network
    features: Tuple[int, int, int]  # in, hidden, out
    modes: FrozenSet[str]


SIZES = (
    HyperSize("small", "small", 8, 4, (16, 32, 8), frozenset({"smoke", "quick", "full"})),
    HyperSize("medium", "medium", 64, 32, (128, 128, 128), frozenset({"quick", "full"})),
    HyperSize("large", "large", 256, 64, (256, 256, 256), frozenset({"full"})),
)


def target(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """The per-sample target network, written for one sample.

    SiLU, not ReLU: with millions of hidden units some pre-activation lands
    within float32 rounding of ReLU's kink, where float32 and the float64
    reference disagree on its derivative and the check would fail spuriously.
    """
    return F.linear(F.silu(F.linear(x, w1, b1)), w2, b2)


def _case(size: HyperSize, backward: bool) -> Case:
    def build(device: torch.device) -> CaseSetup:
        i, h, o = size.features
        b = size.batch
        x = torch.randn(b, size.rows, i, device=device)
        weights = [
            torch.randn(b, h, i, device=device) / i**0.5, torch.randn(b, h, device=device),
            torch.randn(b, o, h, device=device) / h**0.5, torch.randn(b, o, device=device),
        ]
        inputs = [t.requires_grad_(backward) for t in [x, *weights]]
        batched_target = vmap(target)

        def run(forward):
            def step():
                out = forward(*inputs)
                if not backward:
                    return out
                return [out.detach(), *torch.autograd.grad(out.square().sum(), inputs)]
            return step

        def reference() -> List[Tensor]:
            outs, grads = [], []
            for s in range(b):
                sample = [t[s].detach().cpu().double().requires_grad_(backward) for t in inputs]
                out = target(*sample)
                outs.append(out.detach())
                if backward:
                    grads.append(torch.autograd.grad(out.square().sum(), sample))
            if not backward:
                return torch.stack(outs)
            return [torch.stack(outs), *[torch.stack(g) for g in zip(*grads)]]

        user_code = run(batched_target)
        return CaseSetup(
            variants=[
                Variant("stock", user_code, routing=False, user_code=True),
                Variant("batchrules", user_code, routing=True, user_code=True),
                Variant("limit", run(hand_written.per_sample_weights_forward)),
            ],
            reference=reference,
            floor=vmap_identity((0,) * len(inputs), inputs, returned=0),
        )

    i, h, o = size.features
    what = "forward+backward" if backward else "forward"
    return Case(
        scenario="hyper_fwd_bwd" if backward else "hyper_fwd",
        size=size.name,
        tier=size.tier,
        n_linears=2,
        description=(
            f"per-sample weights {i}-{h}-{o}, batch {size.batch} x {size.rows} rows, {what}"
        ),
        build=build,
        targets=transform_targets(size.tier),
    )


def cases(mode: str) -> List[Case]:
    """Per-sample-weight cases, forward and forward+backward, for a mode."""
    if mode == "headline":
        return [_case(SIZES[1], backward=True)]  # the training step, medium
    chosen = [s for s in SIZES if mode in s.modes]
    return [_case(s, backward=False) for s in chosen] + [_case(s, backward=True) for s in chosen]
