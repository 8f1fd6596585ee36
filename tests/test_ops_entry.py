"""batchrules.linear's Python entry: the unboxed eager fast path must behave
exactly like the torch.ops call it stands in for."""
from typing import Any, List

import torch

import batchrules


def test_fast_path_matches_torch_ops() -> None:
    x, w, b = torch.randn(5, 3, requires_grad=True), torch.randn(4, 3), torch.randn(4)
    fast = batchrules.linear(x, w, b)
    boxed = torch.ops.batchrules.linear.default(x, w, b)
    torch.testing.assert_close(fast, boxed, rtol=0, atol=0)
    assert fast.grad_fn.name() == boxed.grad_fn.name() == "BatchrulesLinearBackward0"


class Recording(torch.Tensor):
    """A __torch_function__ subclass that records the functions it sees."""
    seen: List[Any] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_torch_function_subclasses_see_the_op() -> None:
    Recording.seen.clear()
    x = torch.randn(2, 3).as_subclass(Recording)
    out = batchrules.linear(x, torch.randn(4, 3))
    assert torch.ops.batchrules.linear.default in Recording.seen
    assert out.shape == (2, 4)


def test_missing_tensor_gets_the_kernel_message() -> None:
    try:
        batchrules.linear(torch.randn(2, 3), None)  # type: ignore[arg-type]
    except RuntimeError as e:
        assert "expected input and weight to be tensors" in str(e)
    else:
        raise AssertionError("None weight was accepted")
