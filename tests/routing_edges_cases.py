"""The differential property test of every routed family, run in a child
process by test_routing_edges.py so that a crash fails one test instead of
ending the run.

Each family draws a per-example function and its batched arguments: random
per-example sizes (0 and 1 included), the vmap dim on any axis, non-contiguous
and expanded inputs, float32, float64, bfloat16 or float32 under bfloat16
autocast, and a transform: ``vmap``, ``vmap(grad)`` of the output's sum with
respect to the first argument, or ``vmap(vmap)``. The routed call must give
the per-example eager loop's outcome: a result of the same dtype, shape and
values, or an exception of the same type. An empty batch has no eager
example: its reference is one example of zeros, whose result the routed call
must return with 0 examples (or whose exception it must raise), unless stock
torch.func raises for the empty batch too: then the same exception type.

    python tests/routing_edges_cases.py FAMILY EXAMPLES PROGRESS_FILE
"""
import contextlib
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from routing_edges_families import FAMILIES, WHOLE_BATCH, Case, Draw
from torch import Tensor
from torch.func import grad, vmap

import batchrules

TOLERANCE = {torch.float64: (1e-7, 1e-7), torch.float32: (2e-4, 2e-4),
             torch.bfloat16: (5e-2, 5e-2)}
# What oneDNN's LSTM layer raises under bfloat16 autocast on CPUs without
# native bfloat16 support (eager's own failure; routing runs the layer).
EAGER_ONLY_FAILURES = ("could not create a primitive descriptor",)


# ---- running a case both ways -------------------------------------------------------


def autocast(case: Case) -> contextlib.AbstractContextManager:
    if case.dtype == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def summed_grad(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """d sum(fn(x, *rest)) / dx, in float32 for bfloat16 (grad needs a float scalar)."""
    return grad(lambda x, *rest: fn(x, *rest).float().sum())


def routed(case: Case, routing: bool = True) -> Tensor:
    with batchrules.enabled(routing), autocast(case):
        if case.transform == "whole":
            return case.fn(*case.args)[0](*case.args)
        fn = summed_grad(case.fn) if case.transform == "vmap_grad" else case.fn
        if case.transform == "vmap_vmap":
            inner = tuple(d[1] if isinstance(d, tuple) else None for d in case.in_dims)
            outer = tuple(d[0] if isinstance(d, tuple) else None for d in case.in_dims)
            return vmap(vmap(fn, in_dims=inner), in_dims=outer)(*case.args)
        return vmap(fn, in_dims=case.in_dims)(*case.args)


def example(args: Sequence[Tensor], in_dims: Sequence[Any], index: Tuple[int, ...]
            ) -> List[Tensor]:
    """The arguments of example ``index``, one level after the other; an empty
    batch gives zeros of the example's shape."""
    out = []
    for a, dims in zip(args, in_dims):
        dims = dims if isinstance(dims, tuple) else (dims,) * len(index)
        for d, i in zip(dims, index):
            if d is not None:
                a = a.select(d, i) if a.size(d) else a.new_zeros(a.shape[:d] + a.shape[d + 1:])
        out.append(a)
    return out


def eager_one(case: Case, args: List[Tensor]) -> Tensor:
    with batchrules.enabled(False), autocast(case):
        if case.transform != "vmap_grad":
            return case.fn(*args)
        x = args[0].detach().requires_grad_()
        out = case.fn(x, *args[1:]).float().sum()
        (g,) = torch.autograd.grad(out, x, allow_unused=True)
        return torch.zeros_like(x) if g is None else g


def eager(case: Case) -> Tensor:
    """The per-example loop's result, stacked; for an empty batch, one example of
    zeros' result with 0 examples."""
    if case.transform == "whole":
        return case.fn(*case.args)[1](*case.args)
    sizes = case.batch
    indices = [()]
    for n in sizes:
        indices = [i + (j,) for i in indices for j in range(max(n, 1))]
    results = [eager_one(case, example(case.args, case.in_dims, index)) for index in indices]
    stacked = torch.stack(results).unflatten(0, tuple(max(n, 1) for n in sizes))
    for level, n in enumerate(sizes):
        stacked = stacked.narrow(level, 0, n)
    return stacked


def outcome(call: Callable[[], Tensor]) -> Tuple[Optional[Tensor], Optional[BaseException]]:
    try:
        return call(), None
    except Exception as e:  # compared by type below
        return None, e


def check(case: Case) -> None:
    expected, eager_error = outcome(lambda: eager(case))
    if eager_error is not None and any(s in str(eager_error) for s in EAGER_ONLY_FAILURES):
        assume(False)
    actual, routed_error = outcome(lambda: routed(case))
    if routed_error is not None and eager_error is None and 0 in case.batch:
        _, eager_error = outcome(lambda: routed(case, routing=False))
    if eager_error is not None or routed_error is not None:
        assert type(routed_error) is type(eager_error), (
            f"eager raised {eager_error!r}, routed raised {routed_error!r}")
        return
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    dtype = torch.bfloat16 if case.dtype == "autocast" else expected.dtype
    atol, rtol = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True)


def run(family: str, examples: int, progress: str) -> None:
    draw_case = FAMILIES[family]

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def property_test(data: st.DataObject) -> None:
        d = Draw(data, transform="vmap" if family in WHOLE_BATCH else None)
        case = draw_case(d)
        with open(progress, "w") as f:  # the example a crash would end on
            f.write(f"{family}: {case.transform} over batch {case.batch}, {case.dtype}, "
                    f"in_dims {case.in_dims}, shapes {[tuple(a.shape) for a in case.args]}, "
                    f"strides {[a.stride() for a in case.args]}\n")
        check(case)

    property_test()


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), sys.argv[3])
