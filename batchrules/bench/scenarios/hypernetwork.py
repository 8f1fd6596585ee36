"""Per-sample weights, as a hypernetwork produces them: two linears whose
weights and biases differ per sample (``vmap(target)(x, W1, b1, W2, b2)``), the
weights leaves standing in for the hypernetwork's output; the backward is eager
autograd through the vmapped code, as when the hypernetwork is trained.
"""
from typing import Any, Callable, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import vmap

from ..baselines import hand_written
from ..case import Case, CaseSetup, Variant, stock_and_batchrules, vmap_identity
from ..targets import transform_targets

# (name = tier, batch, rows: points per sample fed through its own target
# network, (in, hidden, out) features, modes)
SIZES = (("small", 8, 4, (16, 32, 8), {"smoke", "quick", "full"}),
         ("medium", 64, 32, (128, 128, 128), {"quick", "full"}),
         ("large", 256, 64, (256, 256, 256), {"full"}))


def target(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """The per-sample target network, written for one sample. SiLU, not ReLU:
    with millions of hidden units some pre-activation lands within float32
    rounding of ReLU's kink, where float32 and the float64 reference disagree."""
    return F.linear(F.silu(F.linear(x, w1, b1)), w2, b2)


def _case(size: str, b: int, rows: int, features: Tuple[int, int, int], backward: bool) -> Case:
    i, h, o = features

    def build(device: torch.device) -> CaseSetup:
        x = torch.randn(b, rows, i, device=device)
        weights = [
            torch.randn(b, h, i, device=device) / i**0.5, torch.randn(b, h, device=device),
            torch.randn(b, o, h, device=device) / h**0.5, torch.randn(b, o, device=device),
        ]
        inputs = [t.requires_grad_(backward) for t in [x, *weights]]

        def run(forward: Callable[..., Tensor]) -> Callable[[], Any]:
            def step() -> Any:
                out = forward(*inputs)
                return [out.detach(), *torch.autograd.grad(out.square().sum(), inputs)] if backward else out
            return step

        def reference() -> Any:
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

        return CaseSetup([*stock_and_batchrules(run(vmap(target))),
                          Variant("limit", run(hand_written.per_sample_weights_forward))],
                         reference=reference, floor=vmap_identity((0,) * len(inputs), inputs, returned=0))

    return Case("hyper_fwd_bwd" if backward else "hyper_fwd", size, size, 2,
                f"per-sample weights {i}-{h}-{o}, batch {b} x {rows} rows, "
                f"{'forward+backward' if backward else 'forward'}", build, transform_targets(size))


def cases(mode: str) -> List[Case]:
    """Per-sample-weight cases, forward and forward+backward, for a mode."""
    if mode == "headline":
        return [_case(*SIZES[1][:4], backward=True)]  # the training step, medium
    return [_case(*s[:4], backward) for backward in (False, True) for s in SIZES if mode in s[4]]
