"""Eager linear, no transform: ``F.linear`` against ``batchrules.linear``.

The no-perf-hit check: outside transforms batchrules must cost nothing, both
when routing is on (it only acts under transforms) and when its operator is
called directly (one extra dispatcher hop, its own autograd node).
"""
from dataclasses import dataclass
from typing import Callable, FrozenSet, List

import torch
import torch.nn.functional as F
from torch import Tensor

import batchrules

from ..case import Case, CaseSetup, Variant
from ..targets import ROUTING_FREE_IN_EAGER, Speedup


@dataclass(frozen=True)
class EagerSize:
    name: str
    tier: str
    rows: int
    in_features: int
    out_features: int
    modes: FrozenSet[str]


SIZES = (
    EagerSize("small", "small", 8, 64, 64, frozenset({"smoke", "quick", "full"})),
    EagerSize("medium", "medium", 256, 512, 512, frozenset({"headline", "quick", "full"})),
    EagerSize("large", "large", 1024, 1024, 1024, frozenset({"full"})),
)


# batchrules.linear's C entry must cost nothing either.
TARGETS = (Speedup("eager: F.linear / batchrules.linear >= 0.98", "stock", "batchrules", 0.98),
           ROUTING_FREE_IN_EAGER)


def _case(size: EagerSize, backward: bool) -> Case:
    def build(device: torch.device) -> CaseSetup:
        x = torch.randn(size.rows, size.in_features, device=device)
        w = torch.randn(size.out_features, size.in_features, device=device) / size.in_features**0.5
        b = torch.randn(size.out_features, device=device)
        inputs = [t.requires_grad_(backward) for t in (x, w, b)]
        grad_out = torch.randn(size.rows, size.out_features, device=device)

        def step(linear: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Callable[[], List[Tensor]]:
            def run() -> List[Tensor]:
                out = linear(*inputs)
                if not backward:
                    return [out]
                return [out.detach(), *torch.autograd.grad(out, inputs, grad_out)]
            return run

        def reference() -> List[Tensor]:
            x64, w64, b64 = (t.detach().cpu().double().requires_grad_() for t in inputs)
            out = F.linear(x64, w64, b64)
            if not backward:
                return [out.detach()]
            return [out.detach(), *torch.autograd.grad(out, (x64, w64, b64), grad_out.cpu().double())]

        return CaseSetup(
            variants=[
                Variant("stock", step(F.linear), routing=False, user_code=True),
                Variant("batchrules", step(batchrules.linear), routing=True, user_code=True),
                # Routing must leave eager F.linear alone (it acts under transforms only).
                Variant("stock_routed", step(F.linear), routing=True),
            ],
            reference=reference,
        )

    return Case(
        scenario="eager_linear" if backward else "eager_linear_fwd",
        size=size.name,
        tier=size.tier,
        n_linears=1,
        description=(
            f"no transform, {'forward+backward' if backward else 'forward, no grad'}, "
            f"[{size.rows}, {size.in_features}] x [{size.out_features}, {size.in_features}] + bias"
        ),
        build=build,
        targets=TARGETS,
    )


def cases(mode: str) -> List[Case]:
    """Eager F.linear vs batchrules.linear cases (with and without backward) for a mode."""
    chosen = [s for s in SIZES if mode in s.modes]
    forward_only = [] if mode == "headline" else [_case(s, backward=False) for s in chosen]
    return [_case(s, backward=True) for s in chosen] + forward_only
