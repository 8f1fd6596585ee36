"""``batchrules.ensemble_vmap`` returns what ``vmap`` returns whichever strategy
serves a call (one batched call, a loop over the members, or the trial calls
that choose between them): equal to the member loop in float64, for shared and
per-member inputs, members on any axis, pytrees of in/out dims, every randomness
mode, a vmapped ``func``, calls from several threads; the faster strategy is the
one chosen; vmap's errors unchanged."""
import threading
import time
from typing import Any, List

import pytest
import torch
import torch.nn.functional as F
from ensemble_reference import Params, assert_close, loop_grads, mlp, mlp_params, mse_of
from torch import Tensor
from torch.func import grad, vmap

import batchrules
from batchrules.ensemble import TIMED_PER_BLOCK, TRIAL_BLOCKS, TRIAL_CALLS, ensemble_vmap

pytestmark = pytest.mark.usefixtures("no_vmap_fallback")
STRATEGIES = ["batched", "members", "auto"]


def ensemble_inputs(members: int, batch: int, shared: bool) -> Any:
    sizes = (5, 8, 8, 1)
    x = torch.randn((batch, sizes[0]) if shared else (members, batch, sizes[0]), dtype=torch.float64)
    return mlp_params(members, sizes), x, torch.randn(members, batch, 1, dtype=torch.float64)


@pytest.mark.parametrize("routing", [False, True], ids=["stock", "routed"])
@pytest.mark.parametrize("act", ["relu", "silu"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per_member"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_step_equals_member_loop(strategy: str, shared: bool, act: str, routing: bool) -> None:
    """Every call, the first (always batched) and the trial calls included, equals the loop."""
    p, x, y = ensemble_inputs(3, 6, shared)
    step = ensemble_vmap(grad(mse_of(act)), in_dims=(0, None if shared else 0, 0), strategy=strategy)
    want = loop_grads(p, x, y, act, shared)
    with batchrules.enabled(routing):
        for _ in range(TRIAL_CALLS + 1):
            assert_close(step(p, x, y), want)
        chosen = step.strategy(p, x, y)
        assert chosen in ("batched", "members") and strategy in ("auto", chosen)


@pytest.mark.parametrize("members", [1, 4])
@pytest.mark.parametrize("out_dim", [0, 1, -1])
def test_members_on_any_axis_and_out_dims(members: int, out_dim: int) -> None:
    """Weights stacked on a middle axis, inputs on the batch axis, a pytree of
    in_dims and out_dims; one member is a size-1 member axis."""
    p, x, _ = ensemble_inputs(members, 6, shared=False)
    moved = {k: v.movedim(0, v.dim() - 1).contiguous() for k, v in p.items()}
    dims = {k: v.dim() - 1 for k, v in p.items()}

    def forward(q: Params, xi: Tensor) -> Any:
        out = mlp(q, xi, "relu")
        return {"mean": out, "sum": out.sum(0)}

    in_dims, out_dims = (dims, 1), {"mean": out_dim, "sum": 0}
    want = vmap(forward, in_dims=in_dims, out_dims=out_dims)(moved, x.movedim(0, 1))
    step = ensemble_vmap(forward, in_dims=in_dims, out_dims=out_dims, strategy="members")
    for _ in range(2):  # batched, then the member loop
        assert_close(step(moved, x.movedim(0, 1)), want)
    assert step.strategy(moved, x.movedim(0, 1)) == "members"


def test_randomness_same_replays_one_draw_per_member() -> None:
    p, x, y = ensemble_inputs(4, 8, shared=True)
    fn = mse_of("relu", dropout=0.5)
    results: List[Params] = []
    for strategy in ("batched", "members"):
        step = ensemble_vmap(grad(fn), in_dims=(0, None, 0), randomness="same", strategy=strategy)
        step(p, x, y)
        torch.manual_seed(0)
        results.append(step(p, x, y))
        results.append(torch.rand(3))  # the generator left where vmap leaves it
    assert_close(results[2], results[0])
    torch.testing.assert_close(results[3], results[1])


def test_randomness_different_draws_per_member() -> None:
    step = ensemble_vmap(lambda w, x: F.dropout(x * w, 0.5), in_dims=(0, None), randomness="different",
                         strategy="members")
    step(torch.ones(2, 1), torch.ones(64))
    mask = step(torch.ones(2, 1), torch.ones(64))
    assert step.strategy(torch.ones(2, 1), torch.ones(64)) == "members"
    assert mask.shape == (2, 64) and not torch.equal(mask[0], mask[1])


def test_random_ops_raise_as_vmap_does() -> None:
    """randomness="error": the first call with a signature is the batched one."""
    fn = ensemble_vmap(lambda x: F.dropout(x, 0.5), strategy="auto")
    with pytest.raises(RuntimeError, match="randomness"):
        fn(torch.ones(3, 4))


def test_auto_keeps_the_faster_strategy() -> None:
    """Each side made slow in turn: a member loop paying a sleep per member, then
    a batched call paying one when it sees a BatchedTensor."""
    def slow_loop(x: Tensor) -> Tensor:
        time.sleep(0.01)
        return x * 2

    def slow_batched(x: Tensor) -> Tensor:
        if torch._C._functorch.is_batchedtensor(x):
            time.sleep(0.05)
        return x * 2

    x = torch.randn(4, 3)
    for fn, want in ((slow_loop, "batched"), (slow_batched, "members")):
        step = ensemble_vmap(fn)
        for _ in range(TRIAL_CALLS):
            assert step.strategy(x) is None
            torch.testing.assert_close(step(x), x * 2)
        assert step.strategy(x) == want
        assert step.strategy(torch.randn(5, 3)) is None  # another signature: measured on its own


def test_trial_times_blocks_of_consecutive_calls() -> None:
    """Each strategy's trial calls come in blocks of consecutive calls, the
    batched call first (Note [Batched members or a member loop])."""
    seen: List[bool] = []

    def fn(x: Tensor) -> Tensor:
        seen.append(torch._C._functorch.is_batchedtensor(x))
        return x * 2
    step, x = ensemble_vmap(fn), torch.randn(3, 2)
    strategies = []
    for _ in range(TRIAL_CALLS):
        before = len(seen)
        torch.testing.assert_close(step(x), x * 2)
        calls = seen[before:]
        strategies.append("batched" if calls == [True] else "members" if calls == [False] * 3 else calls)
    assert strategies == [s for s in TRIAL_BLOCKS for _ in range(1 + TIMED_PER_BLOCK)]
    assert step.strategy(x) in ("batched", "members")


def test_batched_inside_transforms_and_equal() -> None:
    """Under an outer grad or vmap the batched call serves, and gradients flow."""
    p, x, y = ensemble_inputs(3, 5, shared=True)
    forward = ensemble_vmap(lambda q, xi: mlp(q, xi, "silu"), in_dims=(0, None), strategy="members")

    def loss(q: Params) -> Tensor:
        return F.mse_loss(forward(q, x), y)

    def vmap_loss(q: Params) -> Tensor:
        return F.mse_loss(vmap(lambda qi: mlp(qi, x, "silu"))(q), y)
    assert_close(grad(loss)(p), grad(vmap_loss)(p))
    stacked = {k: torch.stack([v, 2 * v]) for k, v in p.items()}
    assert_close(vmap(grad(loss))(stacked), vmap(grad(vmap_loss))(stacked))


def test_members_strategy_backpropagates_outside_transforms() -> None:
    p, x, y = ensemble_inputs(3, 5, shared=False)
    grads: List[Any] = []
    for strategy in ("batched", "members"):
        leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
        forward = ensemble_vmap(lambda q, xi: mlp(q, xi, "relu"), strategy=strategy)
        forward(leaves, x)
        F.mse_loss(forward(leaves, x), y).backward()
        grads.append({k: v.grad for k, v in leaves.items()})
    assert_close(grads[1], grads[0])


def test_under_torch_compile_fullgraph() -> None:
    p, x, y = ensemble_inputs(3, 5, shared=True)
    step = ensemble_vmap(grad(mse_of("relu")), in_dims=(0, None, 0))
    compiled = torch.compile(lambda *a: step(*a), backend="eager", fullgraph=True)
    assert_close(compiled(p, x, y), loop_grads(p, x, y, "relu", shared=True))


def test_errors() -> None:
    with pytest.raises(ValueError, match="strategy must be one of"):
        ensemble_vmap(torch.sin, strategy="loop")
    for strategy in STRATEGIES:  # vmap's own errors, whatever the strategy
        with pytest.raises(ValueError, match="same size in the mapped dimension"):
            ensemble_vmap(torch.add, strategy=strategy)(torch.ones(2, 3), torch.ones(3, 3))
        with pytest.raises(ValueError, match="in_dims"):
            ensemble_vmap(torch.add, in_dims=(0,), strategy=strategy)(torch.ones(2, 3), torch.ones(2, 3))
    def changes_structure(x: Tensor) -> Any:  # two outputs batched, three per member
        return (x, x) if torch._C._functorch.is_batchedtensor(x) else (x, x, x)
    step = ensemble_vmap(changes_structure, out_dims=(0, 0), strategy="members")
    step(torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"out_dims=\(0, 0\) does not match the output's structure"):
        step(torch.ones(2, 3))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_empty_batch_and_no_members(strategy: str) -> None:
    """A batch of 0 rows runs; 0 members is vmap's business (the batched call)."""
    p, x, y = ensemble_inputs(3, 0, shared=True)

    def sse(q: Params, xi: Tensor, yi: Tensor) -> Tensor:
        return (mlp(q, xi, "relu") - yi).pow(2).sum()
    step = ensemble_vmap(grad(sse), in_dims=(0, None, 0), strategy=strategy)
    for _ in range(TRIAL_CALLS + 1):
        got = step(p, x, y)
    assert_close(got, {k: torch.zeros_like(v) for k, v in p.items()})
    no_members = ensemble_vmap(torch.sin, strategy=strategy)
    torch.testing.assert_close(no_members(torch.ones(0, 3)), vmap(torch.sin)(torch.ones(0, 3)))


def test_calls_from_several_threads() -> None:
    """Trial calls overlapping in threads still return vmap's results and settle on a choice."""
    p, x, y = ensemble_inputs(3, 4, shared=True)
    step = ensemble_vmap(grad(mse_of("relu")), in_dims=(0, None, 0))
    want = loop_grads(p, x, y, "relu", shared=True)
    results: List[Params] = []

    def worker() -> None:
        for _ in range(TRIAL_CALLS):
            results.append(step(p, x, y))
    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 * TRIAL_CALLS
    for got in results:
        assert_close(got, want)
    assert step.strategy(p, x, y) in ("batched", "members")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_members_of_a_vmapped_function(strategy: str) -> None:
    """Per-sample gradients of each member: ensemble_vmap over vmap(grad(...))
    equals the nested vmap, the member loop running the inner vmap per member."""
    p, x, y = ensemble_inputs(3, 5, shared=True)
    per_sample = vmap(grad(lambda q, xi, yi: F.mse_loss(mlp(q, xi, "silu"), yi)), in_dims=(None, 0, 0))
    want = vmap(per_sample, in_dims=(0, None, 0))(p, x, y)
    step = ensemble_vmap(per_sample, in_dims=(0, None, 0), strategy=strategy)
    with batchrules.enabled():
        for _ in range(TRIAL_CALLS + 1):
            assert_close(step(p, x, y), want)
