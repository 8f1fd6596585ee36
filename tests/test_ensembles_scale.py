"""Ensembles of MLPs under routing equal the member loop (float64), whichever
GEMM the linear rules pick from the shapes: grad_weight of a shared input as
one bmm against the expanded input or as one mm with the members in its rows
(more members than rows, an expanded or member-inner grad_output, enclosing
vmap levels), grad_input of a one-feature head as a broadcast multiply. Also
under chunked vmap (ragged last chunk), nested vmap, members stacked on any
axis, and every randomness mode. The bench's rows at these sizes, built tiny."""
from typing import List, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F
from ensemble_reference import ACTS, Params, assert_close, loop_grads, mlp_params, mse_of
from torch.func import grad, vmap

import batchrules
from batchrules.bench.case import MODES, Case
from batchrules.bench.runner import run_case
from batchrules.bench.scenarios import ensembles_scale as es
from batchrules.bench.timing import TimingPlan

pytestmark = pytest.mark.usefixtures("no_vmap_fallback")

# (members, batch, sizes): members <= batch takes the bmm for the first layer's
# grad_weight, members > batch the mm; a 1-feature head takes the multiply.
SHAPES = [(4, 16, (5, 12, 12, 1)), (6, 3, (5, 8, 8, 1)), (3, 10, (7, 9, 4)), (5, 5, (3, 6, 2))]


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per_member"])
@pytest.mark.parametrize("members,batch,sizes", SHAPES)
@pytest.mark.parametrize("chunk_size", [None, 1, 4], ids=["one_vmap", "chunk1", "chunk4"])
def test_training_step_equals_member_loop(act: str, shared: bool, members: int, batch: int,
                                          sizes: Sequence[int], chunk_size: Optional[int]) -> None:
    """Chunks of 4 over 3, 5 or 6 members leave a ragged last chunk."""
    p = mlp_params(members, sizes)
    x = torch.randn((batch, sizes[0]) if shared else (members, batch, sizes[0]), dtype=torch.float64)
    y = torch.randn(members, batch, sizes[-1], dtype=torch.float64)
    step = vmap(grad(mse_of(act)), in_dims=(0, None if shared else 0, 0), chunk_size=chunk_size)
    with batchrules.enabled():
        got = step(p, x, y)
    assert_close(got, loop_grads(p, x, y, act, shared))


@pytest.mark.parametrize("member_dim", [0, 1, 2])
def test_members_stacked_on_any_axis(member_dim: int) -> None:
    """Weights stacked on their out, in or a leading axis; inputs on the batch axis."""
    members, batch, sizes = 4, 8, (5, 6, 6, 1)
    p = mlp_params(members, sizes)
    moved = {k: v.movedim(0, min(member_dim, v.dim() - 1)).contiguous() for k, v in p.items()}
    dims = {k: min(member_dim, v.dim() - 1) for k, v in p.items()}
    x = torch.randn(batch, members, sizes[0], dtype=torch.float64)
    y = torch.randn(members, batch, 1, dtype=torch.float64)
    step = vmap(grad(mse_of("relu")), in_dims=(dims, 1, 0), out_dims=member_dim if member_dim < 2 else 0)
    with batchrules.enabled():
        got = step(moved, x, y)
    out_dim = member_dim if member_dim < 2 else 0
    want = loop_grads(p, x.movedim(1, 0), y, "relu", shared=False)
    assert_close({k: v.movedim(out_dim, 0) for k, v in got.items()}, want)


@pytest.mark.parametrize("g_dim", [0, 1, 2])
@pytest.mark.parametrize("out_features", [1, 7])
def test_linear_backward_shared_input_any_grad_layout(g_dim: int, out_features: int) -> None:
    """The weight gradient of a shared input with grad_output batched on each of
    its axes (batch-first: the bmm; next to the features: the mm on a view)."""
    members, rows, in_f = 3, 8, 5
    x = torch.randn(rows, in_f, dtype=torch.float64)
    w = torch.randn(members, out_features, in_f, dtype=torch.float64)
    g = torch.randn(members, rows, out_features, dtype=torch.float64)
    fn = vmap(lambda gi, wi: batchrules.linear_backward(x, gi, wi), in_dims=(g_dim, 0))
    with batchrules.enabled():
        gi, gw, gb = fn(g.movedim(0, g_dim).contiguous(), w)
    torch.testing.assert_close(gi, g @ w)
    torch.testing.assert_close(gw, g.transpose(1, 2) @ x)
    torch.testing.assert_close(gb, g.sum(1))


def test_expanded_grad_output() -> None:
    """A sum loss straight after the linear: grad_output is an expanded one."""
    members, rows, in_f, out_f = 3, 8, 5, 4
    x = torch.randn(rows, in_f, dtype=torch.float64)
    w = torch.randn(members, out_f, in_f, dtype=torch.float64)
    fn = vmap(grad(lambda wi: F.linear(x, wi).sum()))
    with batchrules.enabled():
        got = fn(w)
    torch.testing.assert_close(got, x.sum(0).expand(members, out_f, in_f))


def test_nested_vmap_ensembles_of_ensembles() -> None:
    """vmap over groups of vmapped members, shared input at both levels."""
    groups, members, batch, sizes = 2, 3, 6, (4, 5, 5, 1)
    p = mlp_params(groups * members, sizes)
    x = torch.randn(batch, sizes[0], dtype=torch.float64)
    y = torch.randn(groups * members, batch, 1, dtype=torch.float64)
    inner = vmap(grad(mse_of("silu")), in_dims=(0, None, 0))
    step = vmap(inner, in_dims=(0, None, 0))
    grouped = {k: v.unflatten(0, (groups, members)) for k, v in p.items()}
    with batchrules.enabled():
        got = step(grouped, x, y.unflatten(0, (groups, members)))
    assert_close({k: v.flatten(0, 1) for k, v in got.items()}, loop_grads(p, x, y, "silu", shared=True))


@pytest.mark.parametrize("randomness", ["error", "same", "different"])
def test_routing_never_changes_values_in_any_randomness_mode(randomness: str) -> None:
    """With dropout between the layers (none under "error"), routed and stock
    vmap draw the same masks from the same seed and agree."""
    members, batch, sizes = 4, 8, (5, 9, 9, 1)
    dropout = 0.0 if randomness == "error" else 0.3
    p = mlp_params(members, sizes)
    x = torch.randn(batch, sizes[0], dtype=torch.float64)
    y = torch.randn(members, batch, 1, dtype=torch.float64)
    step = vmap(grad(mse_of("relu", dropout)), in_dims=(0, None, 0), randomness=randomness)
    results: List[Params] = []
    for on in (False, True):
        torch.manual_seed(0)
        with batchrules.enabled(on):
            results.append(step(p, x, y))
    assert_close(results[1], results[0])
    if randomness == "error":
        assert_close(results[1], loop_grads(p, x, y, "relu", shared=True))


def _tiny_bench_rows() -> List[Case]:
    rows = [es.ScaleRow(3, 8, 16, act, shared, train, frozenset())
            for act in ACTS for shared in (True, False) for train in (True, False)]
    return [*((es.train_case if r.train else es.forward_case)(r) for r in rows),
            es.critics_case(es.CriticSize(critics=3, batch=8, hidden=16, obs=5, action=2))]


@pytest.mark.parametrize("case", _tiny_bench_rows(), ids=lambda c: c.name)
def test_bench_rows_at_training_sizes_built_tiny(case: Case) -> None:
    """Each variant of the bench's ensemble rows (member loop and chunked vmap
    included) matches its float64 reference; timings are not asserted."""
    plan = TimingPlan(block_s=0.001, budget_s=0.01, min_repeats=1, max_repeats=1, warmup_calls=0)
    result = run_case(case, torch.device("cpu"), plan)
    assert {"stock", "batchrules", "limit", "loop", "ensemble_vmap"} <= result.variants.keys()
    for name, v in result.variants.items():
        assert v.error is None and v.check is not None and v.check.ok, (name, v.error, v.check)


def test_bench_rows_per_mode() -> None:
    """The rows at training sizes stay out of the smoke and headline runs."""
    names = {mode: [c.name for c in es.cases(mode)] for mode in MODES}
    assert names["smoke"] == names["headline"] == []
    assert len(names["quick"]) == 3 and set(names["quick"]) < set(names["full"])
    assert "critic_ensemble/redq_10x256" in names["quick"]
