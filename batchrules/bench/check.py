"""Correctness of a variant's result against the float64 reference."""
from dataclasses import dataclass
from typing import Any, List

import torch
from torch import Tensor

ABS_TOL = 1e-6


def flatten_result(result: Any) -> List[Tensor]:
    """Tensors of a result in a fixed order (dicts by insertion order)."""
    if isinstance(result, Tensor):
        return [result]
    if isinstance(result, dict):
        result = list(result.values())
    if isinstance(result, (list, tuple)):
        return [t for item in result for t in flatten_result(item)]
    raise TypeError(f"a step must return tensors, got {type(result).__name__}")


@dataclass
class CheckResult:
    """Largest absolute error against the reference, and whether it is acceptable."""

    max_abs_err: float
    scale: float
    ok: bool
    message: str = ""


def compare(result: Any, reference: Any, rtol: float) -> CheckResult:
    """Max abs error; acceptable within ``rtol`` of the reference's largest entry
    (GEMM outputs' rounding error scales with the magnitude of the sums;
    ``ABS_TOL`` only keeps all-zero references meaningful)."""
    got, want = flatten_result(result), flatten_result(reference)
    if len(got) != len(want):
        return CheckResult(float("inf"), 0.0, False, f"{len(got)} outputs, expected {len(want)}")
    err, scale = 0.0, 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            return CheckResult(float("inf"), 0.0, False,
                               f"output {i} has shape {tuple(g.shape)}, expected {tuple(w.shape)}")
        w = w.detach().to(device="cpu", dtype=torch.float64)
        err = max(err, (g.detach().to(device="cpu", dtype=torch.float64) - w).abs().max().item())
        scale = max(scale, w.abs().max().item())
    ok = err <= rtol * scale + ABS_TOL
    return CheckResult(err, scale, ok, "" if ok else f"max abs err {err:.3g} > {rtol:g} x {scale:.3g}")
