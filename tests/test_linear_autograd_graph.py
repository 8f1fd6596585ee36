"""The autograd graph batchrules.linear records, and what its backward runs.

One node per call, wired straight to the operands; its backward is exactly
one batchrules::linear_backward call asking only for the needed gradients
(counted with a TorchDispatchMode, which sees every op below autograd).
"""
import itertools
from typing import List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import batchrules


class OpLog(TorchDispatchMode):
    """Records (op name, args) of every op dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: List[Tuple[str, tuple]] = []
        self.grads: Tuple[Tensor, ...] = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func.overloadpacket._qualified_op_name), args))
        return func(*args, **(kwargs or {}))

    def named(self, name: str) -> List[tuple]:
        return [args for op, args in self.calls if op == name]


LINEAR = "batchrules::linear"
LINEAR_BACKWARD = "batchrules::linear_backward"


def leaf(*shape: int, requires_grad: bool = True) -> Tensor:
    return torch.randn(shape, dtype=torch.float64, requires_grad=requires_grad)


def test_one_node_wired_to_the_leaves() -> None:
    x, w, b = leaf(2, 3), leaf(4, 3), leaf(4)
    y = batchrules.linear(x, w, b)
    assert y.grad_fn.name() == "BatchrulesLinearBackward0"
    next_leaves = [fn.variable for fn, _ in y.grad_fn.next_functions]
    assert all(a is e for a, e in zip(next_leaves, (x, w, b))) and len(next_leaves) == 3
    y_no_bias = batchrules.linear(x, w)
    assert [fn.variable for fn, _ in y_no_bias.grad_fn.next_functions] == [x, w]


def test_operands_without_grad_have_no_edge() -> None:
    x, w, b = leaf(2, 3, requires_grad=False), leaf(4, 3), leaf(4, requires_grad=False)
    fns = [fn for fn, _ in batchrules.linear(x, w, b).grad_fn.next_functions]
    assert fns[0] is None and fns[1].variable is w and fns[2] is None
    assert batchrules.linear(x, w.detach()).grad_fn is None
    assert not batchrules.linear(x, w.detach()).requires_grad


def test_non_leaf_operands_chain_to_their_nodes() -> None:
    x0, w0 = leaf(2, 3), leaf(4, 3)
    x, w = x0 * 2, w0.t().t()
    y = batchrules.linear(x, w)
    assert [fn for fn, _ in y.grad_fn.next_functions] == [x.grad_fn, w.grad_fn]
    gx, gw = torch.autograd.grad(y.sum(), (x0, w0))
    ref = torch.autograd.grad(F.linear(x0 * 2, w0).sum(), (x0, w0))
    torch.testing.assert_close((gx, gw), ref)


def test_forward_is_one_dispatch() -> None:
    x, w, b = leaf(2, 3), leaf(4, 3), leaf(4)
    with OpLog() as log:
        batchrules.linear(x, w, b)
    assert [op for op, _ in log.calls] == [LINEAR]


def _backward_log(y: Tensor, grad: Tensor, inputs: Tuple[Tensor, ...]) -> OpLog:
    with OpLog() as log:
        log.grads = torch.autograd.grad(y, inputs, grad)
    return log


@pytest.mark.parametrize("needs", [n for n in itertools.product([False, True], repeat=3)
                                   if any(n)], ids=str)
def test_backward_is_one_linear_backward_with_needed_mask(needs: Tuple[bool, ...]) -> None:
    x, w, b = (leaf(*s, requires_grad=r) for s, r in zip([(5, 2, 3), (4, 3), (4,)], needs))
    y = batchrules.linear(x, w, b)
    log = _backward_log(y, torch.randn_like(y), tuple(t for t in (x, w, b) if t.requires_grad))
    (call,) = log.named(LINEAR_BACKWARD)
    assert list(call[3]) == list(needs)
    # Nothing else computes: the node's whole work is that one call.
    assert {op for op, _ in log.calls} <= {LINEAR_BACKWARD, "aten::detach"}, log.calls


@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)], ids=str)
def test_backward_mask_without_bias(needs: Tuple[bool, bool]) -> None:
    x, w = leaf(2, 3, requires_grad=needs[0]), leaf(4, 3, requires_grad=needs[1])
    y = batchrules.linear(x, w)
    log = _backward_log(y, torch.randn_like(y), tuple(t for t in (x, w) if t.requires_grad))
    (call,) = log.named(LINEAR_BACKWARD)
    assert list(call[3]) == [*needs, False]


def test_backward_asks_for_bias_grad_only_for_graph_inputs() -> None:
    """grad w.r.t. the weight alone asks for mask [False, True, False], even
    though input and bias require grad too."""
    x, w, b = leaf(2, 3), leaf(4, 3), leaf(4)
    y = batchrules.linear(x, w, b)
    (call,) = _backward_log(y, torch.randn_like(y), (w,)).named(LINEAR_BACKWARD)
    assert list(call[3]) == [False, True, False]


@pytest.mark.parametrize("shapes", [((2, 3), (4, 3), ()), ((2, 3), (4, 3), (1,)),
                                    ((2, 3), (4, 3), (2, 4)), ((3,), (4, 3), (1, 4)),
                                    ((2, 2, 3), (3,), ())], ids=str)
def test_broadcast_bias_grad_is_summed_apart(shapes) -> None:
    """A bias of another shape than linear_backward's grad_bias gets its
    gradient by one reduction of grad_output; linear_backward is not asked."""
    x, w, b = (leaf(*s) for s in shapes)
    y = batchrules.linear(x, w, b)
    g = torch.randn_like(y)
    log = _backward_log(y, g, (x, w, b))
    (call,) = log.named(LINEAR_BACKWARD)
    want_bias_from_op = w.dim() == 1 and b.dim() == 0
    assert list(call[3]) == [True, True, want_bias_from_op]
    gb = log.grads[2]
    (ref,) = torch.autograd.grad(F.linear(x, w) + b.reshape(b.shape[b.dim() - y.dim():]), (b,), g)
    torch.testing.assert_close(gb, ref)


def test_double_backward_node() -> None:
    x, w, b = leaf(2, 3), leaf(4, 3), leaf(4)
    y = batchrules.linear(x, w, b)
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), torch.randn_like(y, requires_grad=True),
                                     create_graph=True)
    assert gx.grad_fn.name() == "BatchrulesLinearBackwardBackward0"
    assert gx.grad_fn is gw.grad_fn is gb.grad_fn
    with OpLog() as log:
        torch.autograd.grad(gx.sum(), (w,))
    # d(g @ W)/dW needs only linear_backward's grad_weight of (ggi, g, W).
    assert [list(a[3]) for a in log.named(LINEAR_BACKWARD)] == [[False, True, False]]
    assert not log.named(LINEAR)


def test_second_backward_without_retain_graph_is_a_clean_error() -> None:
    x, w = leaf(2, 3), leaf(4, 3)
    y = batchrules.linear(x, w).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward()


def test_retain_graph_accumulates() -> None:
    x, w, b = leaf(2, 3), leaf(4, 3), leaf(4)
    y = batchrules.linear(x, w, b).sum()
    y.backward(retain_graph=True)
    y.backward()
    xr, wr, br = (t.detach().requires_grad_() for t in (x, w, b))
    (2 * F.linear(xr, wr, br).sum()).backward()
    for t, r in zip((x, w, b), (xr, wr, br)):
        torch.testing.assert_close(t.grad, r.grad)


def test_no_grad_and_inference_mode_record_nothing() -> None:
    x, w = leaf(2, 3), leaf(4, 3)
    with torch.no_grad():
        assert batchrules.linear(x, w).grad_fn is None
    with torch.inference_mode():
        out = batchrules.linear(x, w)
        assert out.grad_fn is None and out.is_inference()
