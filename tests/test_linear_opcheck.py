"""torch.library.opcheck for both operators: schema, autograd registration,
FakeTensor (meta kernel == real kernel) and AOTAutograd with dynamic shapes,
with and without requires_grad.

Note [opcheck budget]
test_schema, test_autograd_registration and test_faketensor are cheap and run
on every sample, dtype and output_mask. test_aot_dispatch_dynamic compiles a
graph per call, so it runs with
requires_grad (which checks the forward outputs too) on one float32 sample of
each graph_signature (56 of the 72 samples: samples that differ only in sizes
above 1 trace the same graph under dynamic shapes) and on the first sample of
each of the first AOT_KINDS kinds for the other dtypes (the graph does not
depend on the dtype; these check each dtype's kernels and tolerances);
linear_backward's output_masks rotate over those samples, so every mask is
compiled in every dtype and every kind in float32.
"""
import itertools
from typing import List, Optional, Sequence

import pytest
import torch
from conftest import available_devices
from linear_samples import ALL_DTYPES, LinearSample, first_of_each_kind, linear_samples, random_grad_output
from torch.testing._internal.optests.aot_autograd import aot_autograd_check

CHEAP_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")
AOT_UTIL = "test_aot_dispatch_dynamic"
FULL_MASK = [True, True, True]
MASKS = [list(m) for m in itertools.product([False, True], repeat=3)]
LOW_PRECISION = (torch.float16, torch.bfloat16)

linear_op = torch.ops.batchrules.linear.default
linear_backward_op = torch.ops.batchrules.linear_backward.default


def assert_opcheck(op, args: tuple, utils: Sequence[str], what: str) -> None:
    results = torch.library.opcheck(op, args, test_utils=tuple(utils), raise_exception=False)
    assert set(results) == set(utils), results
    failed = {k: v for k, v in results.items() if v != "SUCCESS"}
    assert not failed, f"{what}: {failed}"


AOT_KINDS = len(MASKS)  # each mask compiled in every dtype: Note [opcheck budget]


def graph_signature(sample: LinearSample) -> tuple:
    """What a sample's graph depends on under dynamic shapes: its kind (the
    layouts), each operand's rank and its sizes 0 and 1 (specialized)."""
    def sizes(t: Optional[torch.Tensor]) -> Optional[tuple]:
        return None if t is None else tuple(min(d, 2) for d in t.shape)
    return sample.kind, sizes(sample.input), sizes(sample.weight), sizes(sample.bias)


def aot_samples(device: str, dtype: torch.dtype) -> List[LinearSample]:
    samples = linear_samples(device, dtype, requires_grad=True)
    if dtype != torch.float32:
        return first_of_each_kind(samples)[:AOT_KINDS]
    return first_of_each_kind(samples, kind=graph_signature)


def linear_backward_args(sample: LinearSample, mask: Sequence[bool], requires_grad: bool):
    g = random_grad_output(sample).requires_grad_(requires_grad)
    return (sample.input, g, sample.weight, list(mask))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "requires_grad"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("device", available_devices())
def test_opcheck_linear_cheap_utils(device: str, dtype: torch.dtype,
                                    requires_grad: bool) -> None:
    for sample in linear_samples(device, dtype, requires_grad=requires_grad):
        assert_opcheck(linear_op, sample.args, CHEAP_UTILS, repr(sample))
        if sample.bias is None:  # the optional bias left out rather than None
            assert_opcheck(linear_op, sample.args[:2], CHEAP_UTILS, repr(sample))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("device", available_devices())
def test_opcheck_linear_aot_dispatch(device: str, dtype: torch.dtype) -> None:
    for sample in aot_samples(device, dtype):
        assert_opcheck(linear_op, sample.args, [AOT_UTIL], repr(sample))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "requires_grad"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("device", available_devices())
def test_opcheck_linear_backward_cheap_utils(device: str, dtype: torch.dtype,
                                             requires_grad: bool) -> None:
    """Every mask in float32 / complex64, the full mask in the other dtypes."""
    masks = MASKS if dtype in (torch.float32, torch.complex64) else [FULL_MASK]
    for sample in linear_samples(device, dtype, requires_grad=requires_grad):
        for mask in masks:
            assert_opcheck(linear_backward_op, linear_backward_args(sample, mask, requires_grad),
                           CHEAP_UTILS, f"{sample!r}, mask {mask}")


def _assert_close_low_precision(actual, expected, msg=None) -> None:
    # Eager backward gets expanded (stride-0) incoming grads, the compiled one
    # dense ones: CPU half GEMMs then round differently, by an ulp or two.
    torch.testing.assert_close(actual, expected, atol=2e-2, rtol=1e-2, msg=msg)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("device", available_devices())
def test_opcheck_linear_backward_aot_dispatch(device: str, dtype: torch.dtype) -> None:
    samples = aot_samples(device, dtype)
    cases = [(s, FULL_MASK) for s in samples]
    cases += [(s, MASKS[i % len(MASKS)]) for i, s in enumerate(first_of_each_kind(samples))]
    for sample, mask in cases:
        args = linear_backward_args(sample, mask, requires_grad=True)
        if dtype in LOW_PRECISION and any(mask):
            # opcheck compares with the default (tight) half tolerances.
            aot_autograd_check(linear_backward_op, args, {}, dynamic=True,
                               assert_equals_fn=_assert_close_low_precision)
        else:
            assert_opcheck(linear_backward_op, args, [AOT_UTIL], f"{sample!r}, mask {mask}")


def test_opcheck_meta_inputs() -> None:
    """Meta inputs run the same kernels (FakeTensor conversion of meta tensors)."""
    utils = CHEAP_UTILS + (AOT_UTIL,)
    for sample in first_of_each_kind(linear_samples("meta", torch.float32, requires_grad=True)):
        assert_opcheck(linear_op, sample.args, utils, repr(sample))
        args = linear_backward_args(sample, FULL_MASK, requires_grad=True)
        assert_opcheck(linear_backward_op, args, utils, repr(sample))
