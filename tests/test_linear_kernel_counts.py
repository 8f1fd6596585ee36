"""How many ATen compute kernels each batched case issues, read from the profiler.

Each case pins the exact kernels (e.g. one baddbmm, no mul/add) so that a
regression to a decomposition fails, and the stock path (F.linear under vmap
with routing off) is measured alongside to show the counts tell them apart.
Expected numbers are deterministic on CPU for a fixed PyTorch.
"""
from typing import Callable, List

import pytest
import torch
import torch.nn.functional as F
from batching_profile import GEMMS, kernels_from_events, profile_events, ran_kernels
from torch.func import grad, hessian, jacrev, vjp, vmap

import batchrules

B, E, N, IN, OUT = 4, 3, 5, 6, 7
MASK = (True, True, True)

pytestmark = pytest.mark.usefixtures("no_vmap_fallback")


def r(*shape: int) -> torch.Tensor:
    return torch.randn(shape)


def stock(fn: Callable, *args) -> List[str]:
    """Kernels of ``fn`` with F.linear as torch.func runs it without batchrules."""
    with batchrules.enabled(False):
        return ran_kernels(fn, *args)


LINEAR_CASES = {
    # name: (in_dims or nested vmap builder, args, expected kernels)
    "batched_weight_input_bias": (lambda f: vmap(f), (r(B, N, IN), r(B, OUT, IN), r(B, OUT)),
                                  ["baddbmm"]),
    "batched_weight_input": (lambda f: vmap(f), (r(B, N, IN), r(B, OUT, IN)), ["bmm"]),
    "batched_weight_1d": (lambda f: vmap(f), (r(B, IN), r(B, IN), r(B)), ["baddbmm"]),
    # The shared input is expanded, not copied; see Note [Contiguous per-example results].
    "shared_input_batched_weight": (lambda f: vmap(f, (None, 0, 0)),
                                    (r(N, IN), r(B, OUT, IN), r(B, OUT)), ["baddbmm"]),
    "shared_weight_bdim_front": (lambda f: vmap(f, (0, None, None)),
                                 (r(B, N, IN), r(OUT, IN), r(OUT)), ["addmm"]),
    # A batch dim elsewhere moves to the front (one copy) so each result is contiguous.
    "shared_weight_bdim_middle": (lambda f: vmap(f, (1, None, None)),
                                  (r(N, B, IN), r(OUT, IN), r(OUT)), ["addmm", "copy_"]),
    "shared_weight_bdim_last": (lambda f: vmap(f, (2, None, None)),
                                (r(N, IN, B), r(OUT, IN), r(OUT)), ["addmm", "copy_"]),
    # A per-example bias cannot ride on a shared weight's GEMM.
    "shared_weight_batched_bias": (lambda f: vmap(f, (0, None, 0)),
                                   (r(B, N, IN), r(OUT, IN), r(B, OUT)), ["add", "mm"]),
    # Two and three levels of per-example weights: one bmm for all levels + the bias add.
    "nested_2_levels": (lambda f: vmap(vmap(f)),
                        (r(E, B, N, IN), r(E, B, OUT, IN), r(E, B, OUT)), ["add", "bmm"]),
    "nested_3_levels": (lambda f: vmap(vmap(vmap(f))),
                        (r(2, E, B, N, IN), r(2, E, B, OUT, IN), r(2, E, B, OUT)),
                        ["add", "bmm"]),
    # A shared input batched at an enclosing level (per-sample data through an ensemble):
    # one GEMM against the stacked weights for both levels and one copy to put the
    # ensemble dim first, rather than the weights copied once per sample.
    "per_sample_of_ensemble": (lambda f: vmap(vmap(f, (None, 0, 0)), (0, None, None)),
                               (r(B, N, IN), r(E, OUT, IN), r(E, OUT)), ["addmm", "copy_"]),
    # An ensemble (outer) of models applied per sample (inner) to shared data.
    "ensemble_of_per_sample": (lambda f: vmap(vmap(f, (0, None, None)), (None, 0, 0)),
                               (r(B, N, IN), r(E, OUT, IN), r(E, OUT)), ["baddbmm"]),
}


@pytest.mark.parametrize("case", list(LINEAR_CASES))
def test_linear_kernels(case: str) -> None:
    build, args, expected = LINEAR_CASES[case]
    assert ran_kernels(build(batchrules.linear), *args) == expected
    with batchrules.enabled(True):
        assert ran_kernels(build(F.linear), *args) == expected


@pytest.mark.parametrize("case", ["batched_weight_input_bias", "shared_input_batched_weight",
                                  "nested_2_levels", "ensemble_of_per_sample"])
def test_stock_linear_decomposes(case: str) -> None:
    """The counts distinguish the rules from torch.func's own decomposition."""
    build, args, expected = LINEAR_CASES[case]
    stock_kernels = stock(build(F.linear), *args)
    assert stock_kernels != expected and len(stock_kernels) > len(expected)
    assert "mul" in stock_kernels and "add" in stock_kernels


BACKWARD_CASES = {
    # name: (in_dims of (self, grad_output, weight, mask), args, expected kernels)
    # Per-sample gradients: grad_weight one bmm contracting T, grad_input one mm, grad_bias one sum.
    "per_sample_sequence": ((0, 0, None, None), (r(B, N, IN), r(B, N, OUT), r(OUT, IN)),
                            ["bmm", "mm", "sum"]),
    # Without leading dims grad_weight is a batch of outer products (one broadcast
    # mul, faster than a K=1 bmm) and grad_bias a copy of grad_output.
    "per_sample_vector": ((0, 0, None, None), (r(B, IN), r(B, OUT), r(OUT, IN)),
                          ["copy_", "mm", "mul"]),
    "ensemble": ((0, 0, 0, None), (r(B, N, IN), r(B, N, OUT), r(B, OUT, IN)),
                 ["bmm", "bmm", "sum"]),
    # Shared input: grad_weight one bmm against the expanded input (no copy of g).
    "ensemble_shared_input": ((None, 0, 0, None), (r(N, IN), r(B, N, OUT), r(B, OUT, IN)),
                              ["bmm", "bmm", "sum"]),
    # As in jacrev: only grad_output batched. Its batch dim next to the features
    # joins grad_weight's GEMM rows as it is; grad_input moves it to the front
    # (one copy) to come out contiguous per example.
    "batched_grad_output_only": ((None, 1, None, None), (r(N, IN), r(N, B, OUT), r(OUT, IN)),
                                 ["copy_", "mm", "mm", "sum"]),
}


@pytest.mark.parametrize("case", list(BACKWARD_CASES))
def test_linear_backward_kernels(case: str) -> None:
    in_dims, args, expected = BACKWARD_CASES[case]
    assert ran_kernels(vmap(batchrules.linear_backward, in_dims), *args, MASK) == expected


def per_sample_loss(lin: Callable):
    return lambda w, b, x: lin(x, w, b).pow(2).sum()


def linear_backward_rule_calls(events) -> List[List[str]]:
    """For each linear_backward call that issued GEMMs itself, the compute ops it issued."""
    calls = []
    for e in events:
        if e.name == "batchrules::linear_backward":
            children = [c.name[len("aten::"):] for c in e.cpu_children]
            if any("aten::" + c in GEMMS for c in children):
                calls.append(sorted(c for c in children if "aten::" + c in GEMMS | {"aten::sum"}))
    return calls


def test_vmap_grad_runs_the_backward_rule() -> None:
    """Per-sample grads reach the FuncTorchBatched kernel once: one bmm for grad_weight
    (contracting the sequence dim), one sum for grad_bias, no per-example loop."""
    w, b, x = r(OUT, IN), r(OUT), r(B, N, IN)
    events = profile_events(vmap(grad(per_sample_loss(batchrules.linear), (0, 1)),
                                 (None, None, 0)), w, b, x)
    assert linear_backward_rule_calls(events) == [["bmm", "sum"]]
    assert kernels_from_events(events, within="batchrules::linear_backward") == ["bmm", "sum"]
    assert kernels_from_events(events, within="batchrules::linear") == ["addmm"]


def test_vmap_grad_routed_vs_stock() -> None:
    w, b, x = r(OUT, IN), r(OUT), r(B, N, IN)
    fn = vmap(grad(per_sample_loss(F.linear), (0, 1)), (None, None, 0))
    with batchrules.enabled(True):
        events = profile_events(fn, w, b, x)
    assert linear_backward_rule_calls(events) == [["bmm", "sum"]]
    routed = kernels_from_events(events)
    stock_kernels = stock(fn, w, b, x)
    # Forward: one addmm instead of mm + mul + add; backward alike.
    assert routed.count("addmm") == 1 and "addmm" not in stock_kernels
    assert len(routed) < len(stock_kernels)


def test_vmap_vjp_runs_the_backward_rule() -> None:
    x, w, g = r(B, N, IN), r(B, OUT, IN), r(B, N, OUT)

    def pullback(x, w, g):
        return vjp(batchrules.linear, x, w)[1](g)

    events = profile_events(vmap(pullback), x, w, g)
    assert linear_backward_rule_calls(events) == [["bmm", "bmm"]]


def test_jacrev_runs_the_backward_rule() -> None:
    x, w = r(N, IN), r(OUT, IN)
    events = profile_events(jacrev(batchrules.linear, argnums=(0, 1)), x, w)
    # The basis of cotangents is batched, x and w shared: two mm, no loop.
    assert linear_backward_rule_calls(events) == [["mm", "mm"]]


def test_hessian_runs_the_backward_rule() -> None:
    """hessian = jacfwd(jacrev): the backward runs once, batched over the cotangent
    basis (one mm for grad_weight); jvp differentiates the mm the rule issued."""
    x, w, b = r(N, IN), r(OUT, IN), r(OUT)
    events = profile_events(hessian(lambda w: batchrules.linear(x, w, b).tanh().sum()), w)
    assert linear_backward_rule_calls(events) == [["mm"]]
    assert not any(e.name in ("aten::stack", "aten::cat") for e in events)


def test_ensemble_of_per_sample_grads_kernels() -> None:
    """vmap(vmap(grad)): one bmm for grad_weight and one sum for grad_bias over both levels."""
    ws, bs, x = r(E, OUT, IN), r(E, OUT), r(E, B, N, IN)
    fn = vmap(vmap(grad(per_sample_loss(batchrules.linear), (0, 1)), (None, None, 0)))
    events = profile_events(fn, ws, bs, x)
    assert kernels_from_events(events, within="batchrules::linear_backward") == ["bmm", "sum"]
    assert kernels_from_events(events, within="batchrules::linear") == ["baddbmm"]


def test_grad_between_vmap_levels_kernels() -> None:
    """vmap(grad(vmap)) with weights batched at both levels: the inner rule sees the
    outer level through the grad wrapper and issues bmm + add, never a decomposed
    baddbmm (bmm + mul + add)."""
    ws, bs, xs = r(E, B, OUT, IN), r(E, B, OUT), r(E, B, N, IN)

    def member_loss(w, b, x):
        return vmap(batchrules.linear)(x, w, b).tanh().sum()

    events = profile_events(vmap(grad(member_loss, (0, 1))), ws, bs, xs)
    assert kernels_from_events(events, within="batchrules::linear") == ["add", "bmm"]


def test_grad_of_vmap_keeps_the_fused_kernel() -> None:
    """Under grad alone (no enclosing vmap) batched weights still run one baddbmm."""
    ws, bs, x = r(E, OUT, IN), r(E, OUT), r(E, N, IN)
    fn = grad(lambda ws, bs: vmap(batchrules.linear)(x, ws, bs).tanh().sum(), (0, 1))
    events = profile_events(fn, ws, bs)
    assert kernels_from_events(events, within="batchrules::linear") == ["baddbmm"]


@torch.library.custom_op("batchrules_tests::double_without_rule", mutates_args=())
def _double_without_rule(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_no_vmap_fallback_fixture_catches_missing_rules() -> None:
    """With the fallback off an op without a batching rule raises, so every vmap test
    in this suite that passes was served by a batching rule, not a per-example loop."""
    with pytest.raises(RuntimeError, match="vmap fallback which is currently disabled"):
        vmap(_double_without_rule)(r(B, 2))
