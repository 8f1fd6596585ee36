"""Eager SiLU / Mish, no transform: routing must cost nothing.

``aten::silu`` / ``aten::mish`` are routed on a dispatch key that is only
active inside torch.func transforms, so eager ``F.silu`` / ``F.mish`` must run
at the same speed with routing on (``stock_routed``) as off (``stock``).
``batchrules`` calls the operator directly (``batchrules.silu``: a boxed
``torch.ops`` call, its own autograd node and one more dispatcher hop).
"""
from dataclasses import dataclass
from typing import Callable, FrozenSet, List

import torch
import torch.nn.functional as F
from torch import Tensor

import batchrules

from ..case import Case, CaseSetup, Variant
from ..targets import ROUTING_FREE_IN_EAGER

ACTIVATIONS = {"silu": (F.silu, batchrules.silu), "mish": (F.mish, batchrules.mish)}


@dataclass(frozen=True)
class ActivationSize:
    name: str
    tier: str
    shape: tuple
    modes: FrozenSet[str]


SIZES = (
    ActivationSize("small", "small", (8, 64), frozenset({"smoke", "quick", "full"})),
    ActivationSize("medium", "medium", (256, 512), frozenset({"headline", "quick", "full"})),
    ActivationSize("large", "large", (1024, 1024), frozenset({"full"})),
)


def _case(act: str, size: ActivationSize, backward: bool) -> Case:
    stock_fn, batchrules_fn = ACTIVATIONS[act]

    def build(device: torch.device) -> CaseSetup:
        x = torch.randn(size.shape, device=device).requires_grad_(backward)
        grad_out = torch.randn(size.shape, device=device)

        def step(fn: Callable[[Tensor], Tensor]) -> Callable[[], List[Tensor]]:
            def run() -> List[Tensor]:
                out = fn(x)
                if not backward:
                    return [out]
                return [out.detach(), *torch.autograd.grad(out, x, grad_out)]
            return run

        def reference() -> List[Tensor]:
            x64 = x.detach().cpu().double().requires_grad_(backward)
            out = stock_fn(x64)
            if not backward:
                return [out.detach()]
            return [out.detach(), *torch.autograd.grad(out, x64, grad_out.cpu().double())]

        return CaseSetup(
            variants=[
                Variant("stock", step(stock_fn), routing=False, user_code=True),
                Variant("batchrules", step(batchrules_fn), routing=True, user_code=True),
                # Routing must leave eager code alone (it acts under transforms only).
                Variant("stock_routed", step(stock_fn), routing=True),
            ],
            reference=reference,
        )

    return Case(
        scenario=f"eager_{act}" if backward else f"eager_{act}_fwd",
        size=size.name,
        tier=size.tier,
        n_linears=0,
        description=(f"no transform, {'forward+backward' if backward else 'forward, no grad'}, "
                     f"F.{act} on {list(size.shape)}"),
        build=build,
        # The direct entries are boxed torch.ops calls: shown in the table, not a target.
        targets=(ROUTING_FREE_IN_EAGER,),
    )


def cases(mode: str) -> List[Case]:
    """Eager F.silu / F.mish (routing off, on) vs batchrules.silu / mish, for a mode."""
    chosen = [s for s in SIZES if mode in s.modes]
    directions = (True,) if mode == "headline" else (True, False)
    return [_case(act, s, backward) for act in ACTIVATIONS for backward in directions for s in chosen]
