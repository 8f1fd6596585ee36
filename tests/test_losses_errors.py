"""Bad input to the losses under vmap: eager's error, naming one example's shapes.

The rules validate logical (per-example) shapes before folding the vmap batch into the
loss's rows, so a mismatch cannot pass as a differently shaped batch; each message is
compared with the one eager gives for the same example.
"""
import re
from typing import Callable, Sequence, Type

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

A = torch.ops.aten
B = 3

pytestmark = pytest.mark.usefixtures("no_vmap_fallback", "routing_on")


def r(*shape: int) -> torch.Tensor:
    return torch.randn(shape)


def idx(*shape: int, high: int = 5) -> torch.Tensor:
    return torch.randint(0, high, shape)


def eager_error(fn: Callable, args: Sequence[torch.Tensor], in_dims) -> Exception:
    example = [a if d is None else a.select(d, 0) for a, d in zip(args, in_dims)]
    with pytest.raises(Exception) as info:
        fn(*example)
    return info.value


def assert_same_error(fn: Callable, args: Sequence[torch.Tensor], in_dims,
                      kind: Type[Exception], names: str) -> None:
    """vmap(fn) raises eager's exception type and message for example 0, whose text names
    the per-example shapes in ``names``."""
    expected = eager_error(fn, args, in_dims)
    assert isinstance(expected, kind)
    with pytest.raises(kind, match=re.escape(names)) as info:
        vmap(fn, in_dims=in_dims)(*args)
    assert str(info.value).splitlines()[0] == str(expected).splitlines()[0]


CASES = {
    # name: (fn, args, in_dims, exception, text naming the per-example shapes)
    # F.nll_loss / F.cross_entropy check the batch sizes themselves (nll_loss_nd) ...
    "batch_size_mismatch": (F.nll_loss, (r(B, 4, 5), idx(B, 3)), (0, 0), ValueError,
                            "Expected input batch_size (4) to match target batch_size (3)"),
    # ... the aten ops' own checks are the rules'
    "target_rows_mismatch": (A.nll_loss_forward.default, (r(B, 4, 5), idx(B, 3), None, 1, -100),
                             (0, 0, None, None, None), RuntimeError,
                             "size mismatch (got input: [4, 5], target: [3])"),
    "target_rows_mismatch_shared_target": (
        A.nll_loss_forward.default, (r(B, 4, 5), idx(3), None, 1, -100),
        (0, None, None, None, None), RuntimeError, "got input: [4, 5], target: [3]"),
    "weight_classes": (lambda x, t: F.nll_loss(x, t, weight=torch.ones(4)),
                       (r(B, 4, 5), idx(B, 4)), (0, 0), RuntimeError,
                       "all 5 classes or no classes but got weight tensor of shape: [4]"),
    "per_example_weight_classes": (lambda x, t, w: F.nll_loss(x, t, weight=w),
                                   (r(B, 4, 5), idx(B, 4), r(B, 6)), (0, 0, 0), RuntimeError,
                                   "weight tensor of shape: [6]"),
    "target_1d_for_1d_input": (F.nll_loss, (r(B, 5), idx(B, 2)), (0, 0), ValueError,
                               "1D target must have size 1, but got target size: 2"),
    "input_rank": (A.nll_loss_forward.default, (r(B, 2, 4, 5), idx(B, 2), None, 1, -100),
                   (0, 0, None, None, None), RuntimeError, "input tensor should be 1D or 2D"),
    "spatial_mismatch": (F.cross_entropy, (r(B, 2, 5, 3, 4), idx(B, 2, 3, 5)), (0, 0),
                         RuntimeError, "size mismatch (got input: [2, 5, 3, 4] , target: [2, 3, 5]"),
    "target_dtype": (F.nll_loss, (r(B, 4, 5), idx(B, 4).int()), (0, 0), RuntimeError,
                     "expected target dtype to be Long or Byte, but got Int"),
    "target_out_of_bounds": (F.cross_entropy, (r(B, 4, 5), idx(B, 4, high=1) + 7), (0, 0),
                             IndexError, "Target 7 is out of bounds"),
    "backward_grad_output_rows": (
        lambda g, x, t: A.nll_loss_backward(g, x, t, None, 0, -100, torch.tensor(1.0)),
        (r(B, 3), r(B, 4, 5), idx(B, 4)), (0, 0, 0), RuntimeError,
        "tensor.size[0] == 4 but got: dimension 1 and tensor.size[0] = 3"),
    "backward_grad_output_not_scalar": (
        lambda g, x, t: A.nll_loss_backward(g, x, t, None, 1, -100, torch.tensor(1.0)),
        (r(B, 2), r(B, 4, 5), idx(B, 4)), (0, 0, 0), RuntimeError,
        "Expected a single element grad_output tensor, but got: [2]"),
    "mse_backward_shapes": (lambda g, x, t: A.mse_loss_backward(g, x, t, 0),
                            (r(B, 3, 4), r(B, 3, 4), r(B, 5)), (0, 0, 0), RuntimeError,
                            "size of tensor a (4) must match the size of tensor b (5)"),
}


@pytest.mark.parametrize("case", CASES)
def test_error_names_per_example_shapes(case: str) -> None:
    fn, args, in_dims, kind, names = CASES[case]
    assert_same_error(fn, args, in_dims, kind, names)


def test_error_under_vmap_grad() -> None:
    """The same message when the mismatch reaches a rule through vmap(grad)."""
    x, t = r(B, 2, 5, 3, 4), idx(B, 2, 3, 5)
    with pytest.raises(RuntimeError, match=re.escape("got input: [2, 5, 3, 4] , target: [2, 3, 5]")):
        vmap(grad(F.cross_entropy))(x, t)


def test_backward_total_weight_must_be_one_element() -> None:
    def fn(g, x, t, tw):
        return A.nll_loss_backward(g, x, t, None, 1, -100, tw)

    with pytest.raises(RuntimeError, match=re.escape("single element tensor, got: [2] (2 elements)")):
        vmap(fn)(r(B), r(B, 4, 5), idx(B, 4), r(B, 2))
