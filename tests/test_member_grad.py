"""``ensemble_vmap``'s member loop runs a ``torch.func.grad`` (or
``grad_and_value``) as a plain autograd backward: its results equal grad's
for every argnums / has_aux form, pytree and unused input, in float64; grad
itself runs (and its results stay differentiable) wherever something outside
the call requires grad; grad's own errors are raised unchanged."""
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.nn.functional as F
from ensemble_reference import assert_close, mlp, mlp_params
from torch import Tensor
from torch.func import grad, grad_and_value, vmap
from torch.utils._pytree import tree_flatten, tree_map

import batchrules
from batchrules.ensemble import TRIAL_CALLS, ensemble_vmap
from batchrules.member_grad import MemberGrad


def member_call(transform: Callable[..., Any], *args: Any) -> Any:
    """``transform`` on ``args`` through the member loop's bound call."""
    member = MemberGrad.of(transform)
    assert member is not None
    leaves, spec = tree_flatten(args)
    return member.bind(leaves, spec, {})(leaves)


@pytest.fixture
def grad_calls(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """One entry a call of torch.func's grad (its grad_and_value_impl) within the test."""
    from torch._functorch import eager_transforms
    calls: List[int] = []
    impl = eager_transforms.grad_and_value_impl

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return impl(*args, **kwargs)
    monkeypatch.setattr(eager_transforms, "grad_and_value_impl", counting)
    return calls


def assert_tree_close(got: Any, want: Any) -> None:
    got_leaves, got_spec = tree_flatten(got)
    want_leaves, want_spec = tree_flatten(want)
    assert got_spec == want_spec
    for g, w in zip(got_leaves, want_leaves):
        if isinstance(w, Tensor):
            torch.testing.assert_close(g, w)
            assert not g.requires_grad
        else:
            assert g == w


def test_recognizes_grad_and_grad_and_value_only() -> None:
    def f(x: Tensor) -> Tensor:
        return x.sum()
    transform = grad(f)
    assert MemberGrad.of(transform) == (transform, f, 0, False, False)
    transform = grad_and_value(f, argnums=(0,), has_aux=True)
    assert MemberGrad.of(transform) == (transform, f, (0,), True, True)
    for other in (f, vmap(grad(f)), lambda x: grad(f)(x), torch.sin):
        assert MemberGrad.of(other) is None


def loss_of(p: Dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(mlp(p, x, "silu"), y)


@pytest.mark.parametrize("with_value", [False, True])
@pytest.mark.parametrize("argnums", [0, 1, -3, (0, 2), (2, 0)])
def test_equals_grad(argnums: Any, with_value: bool) -> None:
    p = {k: v[0] for k, v in mlp_params(1, (4, 6, 1)).items()}
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)
    transform = (grad_and_value if with_value else grad)(loss_of, argnums=argnums)
    assert_tree_close(member_call(transform, p, x, y), transform(p, x, y))


@pytest.mark.parametrize("with_value", [False, True])
def test_has_aux_unused_and_constant_inputs(with_value: bool) -> None:
    """aux (a pytree of tensors, detached); an input the loss does not use gets
    zeros; a loss that does not depend on the inputs, zeros."""
    def f(a: Tensor, unused: Tensor, x: Tensor) -> Any:
        out = (a * x).sum()
        return out, {"out": out * 2, "x": (x,)}

    a, unused, x = (torch.randn(3, dtype=torch.float64) for _ in range(3))
    transform = (grad_and_value if with_value else grad)(f, argnums=(0, 1), has_aux=True)
    got = member_call(transform, a, unused, x)
    assert_tree_close(got, transform(a, unused, x))
    grads = got[0]
    assert torch.equal(grads[1], torch.zeros_like(unused))
    constant = grad(lambda a, x: x.sum())
    assert_tree_close(member_call(constant, a, x), torch.zeros_like(a))


def test_grad_runs_where_something_outside_requires_grad() -> None:
    """A closure's parameter in the loss or only in the aux, an argument that
    requires grad: grad's results, differentiable as grad's are."""
    outer = torch.randn(3, dtype=torch.float64, requires_grad=True)
    a, x = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)

    def closure_loss(a: Tensor, x: Tensor) -> Tensor:
        return (a * outer * x).sum()

    def closure_aux(a: Tensor, x: Tensor) -> Any:
        return (a * x).sum(), outer * 2

    def returns_parameter(a: Tensor, x: Tensor) -> Any:
        return (a * x).sum(), outer

    got = member_call(grad(closure_loss), a, x)
    torch.testing.assert_close(got, grad(closure_loss)(a, x))
    assert got.requires_grad  # d(grad)/d(outer) = x, as grad keeps it
    torch.testing.assert_close(torch.autograd.grad(got.sum(), outer)[0], x)
    for f in (closure_aux, returns_parameter):
        aux = member_call(grad(f, has_aux=True), a, x)[1]
        assert aux.requires_grad
    a_leaf = a.clone().requires_grad_()
    got = member_call(grad(lambda a, x: (a * a * x).sum()), a_leaf, x)
    assert got.requires_grad  # 2 a x, differentiable in a


def test_grads_own_errors() -> None:
    a = torch.randn(3, dtype=torch.float64)
    cases: List[Any] = [
        (grad(lambda a: a * 2), (a,), "Expected f\\(\\*args\\) to return a scalar Tensor"),
        (grad(lambda a: (a.sum(), a, a), has_aux=True), (a,), "output of function f should be a tuple"),
        (grad(lambda a: 1.0), (a,), "to return a Tensor"),
        (grad(lambda n, a: a.sum()), (torch.arange(3), a), "floating point"),
        (grad(lambda a: a.sum(), argnums=3), (a,), "argnum=3"),
        (grad(lambda a: (a.sum(), "text"), has_aux=True), (a,), "Expected tensors"),
    ]
    for transform, args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            transform(*args)
        with pytest.raises(RuntimeError, match=message):
            member_call(transform, *args)
    with pytest.raises(ValueError, match="must be Tensor"):
        member_call(grad(lambda d: d["a"].sum()), {"a": a, "b": "text"})


@pytest.mark.parametrize("shared", [True, False])
def test_ensemble_member_loop_skips_functorch(shared: bool, grad_calls: List[int]) -> None:
    """After the first (batched) call, ensemble_vmap's member loop of a grad
    never enters torch.func's grad, and its results equal vmap's (routing on)."""
    p = mlp_params(3, (5, 8, 1))
    x = torch.randn((6, 5) if shared else (3, 6, 5), dtype=torch.float64)
    y = torch.randn(3, 6, 1, dtype=torch.float64)
    in_dims = (0, None if shared else 0, 0)
    step = ensemble_vmap(grad(loss_of), in_dims=in_dims, strategy="members")
    want = vmap(grad(loss_of), in_dims=in_dims)(p, x, y)
    with batchrules.enabled():
        step(p, x, y)
        grad_calls.clear()
        for _ in range(TRIAL_CALLS):
            assert_close(step(p, x, y), want)
    assert not grad_calls
    stacked = tree_map(lambda t: t.clone().requires_grad_(), p)
    assert_close(step(stacked, x, y), want)  # an argument requires grad: grad runs
    assert grad_calls


def test_a_grad_inside_the_loss() -> None:
    """Second derivatives: the loss itself takes a torch.func.grad (as a
    gradient penalty does); the plain backward differentiates through it."""
    def f(a: Tensor, x: Tensor) -> Tensor:
        return (torch.sin(a) * x).sum() ** 2

    def penalty(a: Tensor, x: Tensor) -> Tensor:
        return grad(f)(a, x).pow(2).sum()

    a, x = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    assert_tree_close(member_call(grad(penalty), a, x), grad(penalty)(a, x))


def test_a_closure_requiring_grad_sends_the_call_to_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a member's loss shows a closure's parameter, the call's later members
    go to grad without a plain forward first: one forward a member, plus one."""
    outer = torch.randn(1, dtype=torch.float64, requires_grad=True)
    forwards: List[int] = []

    def loss(q: Tensor, x: Tensor) -> Tensor:
        forwards.append(1)
        return (q * x * outer).sum()

    q, x = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    step = ensemble_vmap(grad(loss), in_dims=(0, None), strategy="members")
    step(q, x)  # the batched call
    forwards.clear()
    got = step(q, x)
    assert len(forwards) == 3 + 1
    torch.testing.assert_close(got, vmap(grad(loss), in_dims=(0, None))(q, x))
    assert got.requires_grad


def test_under_no_grad_nothing_outside_is_recorded(grad_calls: List[int]) -> None:
    """Under torch.no_grad grad's results do not require grad even for arguments
    and closures that do: the plain backward serves, with grad's values."""
    outer = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def loss(q: Tensor, x: Tensor) -> Any:
        return (q * x * outer).sum(), outer * 2

    q = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, dtype=torch.float64)
    with torch.no_grad():
        want = vmap(grad(loss, has_aux=True), in_dims=(0, None))(q, x)
        step = ensemble_vmap(grad(loss, has_aux=True), in_dims=(0, None), strategy="members")
        step(q, x)  # the batched call
        grad_calls.clear()
        got = step(q, x)
    assert not grad_calls
    assert_tree_close(got, want)
