"""Values of batchrules.linear and batchrules.linear_backward against F.linear.

Forward outputs must equal F.linear's (shape, dtype, values; on meta shape,
dtype and strides) for every sample; linear_backward's gradients must equal
those autograd computes through F.linear, for every output_mask.
"""
import itertools
from typing import Iterator, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from conftest import available_devices
from linear_samples import ALL_DTYPES, LinearSample, linear_reference, linear_samples, random_grad_output
from torch import Tensor
from torch.testing._internal.common_utils import noncontiguous_like

import batchrules

DEVICES = available_devices() + ["meta"]
MASKS = list(itertools.product([False, True], repeat=3))
INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def assert_same_result(actual: Optional[Tensor], expected: Optional[Tensor], msg: str,
                       low_precision_tol: bool = False) -> None:
    """Values on real devices; shape, dtype and device on meta."""
    assert actual is not None and expected is not None, msg
    assert actual.shape == expected.shape, f"{msg}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{msg}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.device == expected.device, msg
    if actual.device.type == "meta":
        return
    tol = {}
    if low_precision_tol and actual.dtype in (torch.float16, torch.bfloat16):
        # Reductions over differently folded dims round differently.
        tol = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(actual, expected, msg=msg, **tol)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_linear_matches_F_linear(device: str, dtype: torch.dtype) -> None:
    for sample in linear_samples(device, dtype):
        actual = batchrules.linear(*sample.args)
        if sample.kind == "bias_layout_quirk":
            if device != "meta":  # meta's in-place add lets the output grow instead
                with pytest.raises(RuntimeError):
                    F.linear(*sample.args)
            # Fused or not, the bias is rounded in once or twice.
            assert_same_result(actual, linear_reference(*sample.args), repr(sample),
                               low_precision_tol=True)
            continue
        expected = F.linear(*sample.args)
        assert_same_result(actual, expected, repr(sample))
        if device == "meta":
            # Same kernels below, so the meta output has F.linear's layout too.
            assert actual.stride() == expected.stride(), repr(sample)


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_linear_integer_dtypes_match_F_linear(dtype: torch.dtype) -> None:
    for sample in linear_samples("cpu", dtype, kinds=lambda k: k != "bias_layout_quirk"):
        torch.testing.assert_close(batchrules.linear(*sample.args), F.linear(*sample.args),
                                   msg=repr(sample))


def test_linear_keyword_and_positional_bias() -> None:
    x, w, b = torch.randn(2, 3), torch.randn(4, 3), torch.randn(4)
    expected = F.linear(x, w, b)
    torch.testing.assert_close(batchrules.linear(x, w, bias=b), expected)
    torch.testing.assert_close(torch.ops.batchrules.linear(x, w, b), expected)
    torch.testing.assert_close(torch.ops.batchrules.linear(x, w), F.linear(x, w))
    torch.testing.assert_close(batchrules.linear(x, w, None), F.linear(x, w))


# Shapes around every boundary of what linear accepts.
GRID_INPUTS = [(3,), (2, 3), (4, 2, 3), (0, 3), (2, 0, 3), (3, 1), (2, 1, 4, 3)]
GRID_WEIGHTS = [(3,), (4, 3), (1, 3), (0, 3), (4, 1), (2, 4, 3)]
GRID_BIASES = [None, (), (1,), (4,), (2,), (0,), (1, 4), (2, 4), (4, 2), (2, 1), (8, 1), (1, 1),
               (1, 1, 4), (2, 2, 4), (2, 1, 4), (1, 1, 1, 4)]


def grid() -> Iterator[Tuple[Tensor, Tensor, Optional[Tensor]]]:
    """Every grid combination, with the input contiguous and non-contiguous."""
    for i, w, b in itertools.product(GRID_INPUTS, GRID_WEIGHTS, GRID_BIASES):
        x, weight, bias = torch.randn(i), torch.randn(w), None if b is None else torch.randn(b)
        yield x, weight, bias
        yield noncontiguous_like(x), weight, bias


def bias_broadcasts(x: Tensor, w: Tensor, b: Optional[Tensor]) -> bool:
    """The shape rule linear implements: ranks and features as F.linear; a bias
    broadcasts to the output without enlarging it (a 1-D input is one row, so
    its bias may have a leading size-1 dim); 2-D input with a 1-D weight takes
    no bias (F.linear runs it through addmm)."""
    if x.dim() == 0 or w.dim() not in (1, 2) or x.shape[-1] != w.shape[-1]:
        return False
    if b is None:
        return True
    if x.dim() == 2 and w.dim() == 1:
        return False
    out = x.shape[:-1] + w.shape[:-1]
    target = (1,) + out if x.dim() == 1 else out
    try:
        return torch.broadcast_shapes(b.shape, target) == target
    except RuntimeError:
        return False


def test_linear_accepts_by_shape_alone() -> None:
    """Whatever the layout, linear accepts exactly the shapes of bias_broadcasts,
    with linear_reference's values, and rejects the others with its own message."""
    accepted = 0
    for x, w, b in grid():
        shapes = f"{list(x.shape)} {list(w.shape)} {None if b is None else list(b.shape)}"
        if not bias_broadcasts(x, w, b):
            with pytest.raises(RuntimeError, match="^(?:[^;]*; )?batchrules.linear: "):
                batchrules.linear(x, w, b)
            continue
        accepted += 1
        torch.testing.assert_close(batchrules.linear(x, w, b), linear_reference(x, w, b),
                                   msg=shapes)
    assert accepted > 200  # the grid is not mostly errors


def f_linear_accepts(x: Tensor, w: Tensor, b: Optional[Tensor]) -> bool:
    try:
        F.linear(x, w, b)
    except RuntimeError:
        return False
    return True


def test_shape_rule_differs_from_F_linear_only_where_documented() -> None:
    """F.linear's acceptance depends on the input's layout (see linear_samples'
    bias_layout_quirk). Our shape rule accepts a shape iff F.linear accepts it
    for some layout, except in two documented ways."""
    flattened_row_bias, contiguous_only_input = set(), set()
    for i, w, b in itertools.product(GRID_INPUTS, GRID_WEIGHTS, GRID_BIASES):
        x, weight, bias = torch.randn(i), torch.randn(w), None if b is None else torch.randn(b)
        f_accepts = (f_linear_accepts(x, weight, bias)
                     or f_linear_accepts(noncontiguous_like(x), weight, bias))
        if f_accepts and not bias_broadcasts(x, weight, bias):
            # F.linear's addmm path for contiguous N-D input lets a 2-D bias index
            # the flattened rows, e.g. [4, 2, 3] x [4, 3] + [8, 1]: rejected here.
            assert len(i) >= 3 and len(b) == 2, (i, w, b)
            flattened_row_bias.add((i, w, b))
        if not f_accepts and bias_broadcasts(x, weight, bias):
            # A 1-D or empty input is always contiguous, so F.linear always takes
            # its addmm path, which cannot take every bias that broadcasts, e.g.
            # [3] x [3] + [1] or [2, 0, 3] x [4, 3] + [1, 1, 4]: accepted here.
            assert len(i) == 1 or x.numel() == 0, (i, w, b)
            contiguous_only_input.add((i, w, b))
    assert flattened_row_bias and contiguous_only_input


def linear_grads_reference(sample: LinearSample, grad_output: Tensor) -> Tuple[Tensor, ...]:
    """(grad_input, grad_weight, grad_bias) of F.linear by autograd, grad_bias for a
    bias of shape (out_features,), or () for a 1-D weight, added to the output."""
    x = sample.input.detach().requires_grad_()
    w = sample.weight.detach().requires_grad_()
    b = torch.zeros(w.shape[:-1], device=x.device, dtype=x.dtype, requires_grad=True)
    out = F.linear(x, w) + b
    return torch.autograd.grad(out, (x, w, b), grad_output)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_linear_backward_matches_autograd(device: str, dtype: torch.dtype) -> None:
    for sample in linear_samples(device, dtype):
        g = random_grad_output(sample)
        expected = linear_grads_reference(sample, g)
        for mask in MASKS:
            actual = batchrules.linear_backward(sample.input, g, sample.weight, mask)
            assert len(actual) == 3
            for name, wanted, got, ref in zip(("input", "weight", "bias"), mask, actual,
                                              expected):
                msg = f"grad_{name} of {sample!r}, mask {mask}"
                if not wanted:
                    assert got is None, msg
                else:
                    assert_same_result(got, ref, msg, low_precision_tol=True)
