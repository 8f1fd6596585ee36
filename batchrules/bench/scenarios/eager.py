"""Eager ops, no transform: batchrules must cost nothing there. stock:
``F.linear`` / ``F.silu`` / ``F.mish``, routing off; stock_routed: the same,
routing on (it acts only inside torch.func transforms); batchrules: the operator
called directly (``batchrules.linear`` / ``silu`` / ``mish``). Forward, or
forward and backward against a fixed output gradient.
"""
import functools
from typing import Callable, List, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

import batchrules

from ..case import Case, CaseSetup, Variant
from ..targets import ROUTING_FREE_IN_EAGER, Speedup, Target

# (name = tier, modes, linear [rows, in_features, out_features], activation input shape)
SIZES = (("small", {"smoke", "quick", "full"}, (8, 64, 64), (8, 64)),
         ("medium", {"headline", "quick", "full"}, (256, 512, 512), (256, 512)),
         ("large", {"full"}, (1024, 1024, 1024), (1024, 1024)))
ACTIVATIONS = {act: (getattr(F, act), getattr(batchrules, act)) for act in ("silu", "mish")}
# batchrules.linear's C entry must cost nothing either; the activations' direct
# entries are boxed torch.ops calls: shown in the table, not a target.
LINEAR_TARGETS = (Speedup("eager: F.linear / batchrules.linear >= 0.98", "stock", "batchrules", 0.98),
                  ROUTING_FREE_IN_EAGER)


def _case(scenario: str, size: str, n_linears: int, description: str,
          inputs: Callable[[torch.device], List[Tensor]], stock_fn: Callable[..., Tensor],
          batchrules_fn: Callable[..., Tensor], backward: bool, targets: Sequence[Target]) -> Case:
    def build(device: torch.device) -> CaseSetup:
        xs = [t.requires_grad_(backward) for t in inputs(device)]
        grad_out = torch.randn_like(stock_fn(*xs).detach())

        def step(fn: Callable[..., Tensor]) -> Callable[[], List[Tensor]]:
            def run() -> List[Tensor]:
                out = fn(*xs)
                return [out.detach(), *torch.autograd.grad(out, xs, grad_out)] if backward else [out]
            return run

        def reference() -> List[Tensor]:
            xs64 = [t.detach().cpu().double().requires_grad_() for t in xs]
            out = stock_fn(*xs64)
            grads = torch.autograd.grad(out, xs64, grad_out.cpu().double()) if backward else ()
            return [out.detach(), *grads]

        return CaseSetup([Variant("stock", step(stock_fn), routing=False, user_code=True),
                          Variant("batchrules", step(batchrules_fn), routing=True, user_code=True),
                          Variant("stock_routed", step(stock_fn), routing=True)], reference=reference)

    what = "forward+backward" if backward else "forward, no grad"
    return Case(scenario if backward else f"{scenario}_fwd", size, size, n_linears,
                f"no transform, {what}, {description}", build, targets)


def _linear(size: str, shape: Sequence[int], backward: bool) -> Case:
    rows, in_f, out_f = shape

    def inputs(device: torch.device) -> List[Tensor]:
        return [torch.randn(rows, in_f, device=device),
                torch.randn(out_f, in_f, device=device) / in_f**0.5, torch.randn(out_f, device=device)]

    return _case("eager_linear", size, 1, f"[{rows}, {in_f}] x [{out_f}, {in_f}] + bias", inputs,
                 F.linear, batchrules.linear, backward, LINEAR_TARGETS)


def linear_cases(mode: str) -> List[Case]:
    """F.linear vs batchrules.linear, forward+backward (and forward alone but in the headline)."""
    chosen = [(name, linear) for name, modes, linear, _ in SIZES if mode in modes]
    directions = (True,) if mode == "headline" else (True, False)
    return [_linear(name, shape, backward) for backward in directions for name, shape in chosen]


def _randn(shape: Sequence[int], device: torch.device) -> List[Tensor]:
    return [torch.randn(shape, device=device)]


def activation_cases(mode: str) -> List[Case]:
    """F.silu / F.mish vs batchrules.silu / mish, as ``linear_cases``."""
    directions = (True,) if mode == "headline" else (True, False)
    return [_case(f"eager_{act}", name, 0, f"F.{act} on {list(shape)}", functools.partial(_randn, shape),
                  *ACTIVATIONS[act], backward, (ROUTING_FREE_IN_EAGER,))
            for act in ACTIVATIONS for backward in directions
            for name, modes, _, shape in SIZES if mode in modes]
