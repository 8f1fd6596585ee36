"""Bad arguments under vmap raise clear errors that name the per-example shapes.

The batch dim is size 3 in every case and never a size of the logical shapes,
so a message quoting physical shapes (or a wrong broadcast) is caught.
"""
from typing import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from batching_reference import physical_shape
from torch.func import grad, vmap

import batchrules

B = 3
MASK = (True, True, True)

pytestmark = pytest.mark.usefixtures("no_vmap_fallback")


def r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype)


def expect_error(fn: Callable, *fragments: str, physical: Sequence[str] = ()) -> None:
    """``fn()`` raises a RuntimeError whose message holds every fragment and no
    physical (batched) shape."""
    with pytest.raises(RuntimeError) as info:
        fn()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    for shape in physical:
        assert shape not in message, f"physical shape {shape!r} leaked into {message!r}"


@pytest.mark.parametrize("in_dims", [(0, 0), (0, None), (None, 0), (1, 2)])
def test_feature_mismatch_names_logical_shapes(in_dims) -> None:
    shapes = {0: (5, 4), 1: (6, 2)}
    args = [r(*physical_shape(shapes[k], d, B)) for k, d in enumerate(in_dims)]
    expect_error(lambda: vmap(batchrules.linear, in_dims)(*args),
                 "batchrules.linear", "input [5, 4]", "weight [6, 2]",
                 physical=["[3, 5, 4]", "[5, 3, 4]", "[6, 2, 3]", "[3, 6, 2]"])


def test_routed_f_linear_reports_the_same_error() -> None:
    with batchrules.enabled(True):
        expect_error(lambda: vmap(F.linear)(r(B, 5, 4), r(B, 6, 2)),
                     "batchrules.linear", "input [5, 4]", "weight [6, 2]")


@pytest.mark.parametrize("name,args,in_dims,fragments", [
    ("weight_rank_3", (r(B, 5, 4), r(B, 6, 2, 4)), 0, ["weight of shape [6, 2, 4]"]),
    ("input_0d", (r(B), r(B, 6, 1)), 0, ["at least 1-D", "input of shape []"]),
    ("bias_out_mismatch", (r(B, 5, 4), r(B, 6, 4), r(B, 7)), 0,
     ["bias of shape [7]", "output shape [5, 6]"]),
    ("bias_lead_mismatch", (r(B, 5, 4), r(B, 6, 4), r(2, 6)), (0, 0, None),
     ["bias of shape [2, 6]", "output shape [5, 6]"]),
    # A shared bias whose leading size equals the batch size must not broadcast
    # against the batch dim.
    ("bias_like_batch", (r(B, 5, 4), r(6, 4), r(B, 6)), (0, None, None),
     ["bias of shape [3, 6]", "output shape [5, 6]"]),
    ("bias_2d_input_1d_weight", (r(B, 5, 4), r(B, 4), r(B)), 0,
     ["bias is not supported for 2-D input with 1-D weight", "input [5, 4]"]),
    ("dtype", (r(B, 5, 4), r(B, 6, 4, dtype=torch.float64)), 0,
     ["same dtype", "input Float", "weight Double"]),
    ("bias_dtype", (r(B, 5, 4), r(B, 6, 4), r(B, 6, dtype=torch.float64)), 0,
     ["same dtype", "bias Double"]),
])
def test_linear_errors(name: str, args, in_dims, fragments) -> None:
    expect_error(lambda: vmap(batchrules.linear, in_dims)(*args), "batchrules.linear",
                 *fragments)


@pytest.mark.parametrize("name,args,fragments", [
    ("grad_output_shape", (r(B, 5, 4), r(B, 5, 7), r(B, 6, 4)),
     ["grad_output of shape [5, 7]", "output shape [5, 6]", "input [5, 4]"]),
    ("input_weight_mismatch", (r(B, 5, 4), r(B, 5, 6), r(B, 6, 3)),
     ["input [5, 4]", "weight [6, 3]"]),
    ("dtype", (r(B, 5, 4), r(B, 5, 6, dtype=torch.float64), r(B, 6, 4)),
     ["same dtype", "grad_output Double"]),
])
def test_linear_backward_errors(name: str, args, fragments) -> None:
    expect_error(lambda: vmap(batchrules.linear_backward, (0, 0, 0, None))(*args, MASK),
                 "batchrules.linear_backward", *fragments)


def test_error_inside_vmap_grad() -> None:
    """Errors keep naming the per-example shapes through a grad transform."""
    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return batchrules.linear(x, w).sum()

    expect_error(lambda: vmap(grad(loss), (None, 0))(r(6, 2), r(B, 5, 4)),
                 "input [5, 4]", "weight [6, 2]")


@pytest.mark.parametrize("batch", [0, 1])
def test_degenerate_batch_sizes(batch: int) -> None:
    """Empty and size-1 batches go through every branch without error."""
    x, w, b = r(batch, 5, 4), r(batch, 6, 4), r(batch, 6)
    for in_dims in [(0, 0, 0), (0, None, None), (None, 0, 0), (0, None, 0)]:
        args = [t if d is not None else t.new_ones(t.shape[1:]) for t, d in zip((x, w, b), in_dims)]
        out = vmap(batchrules.linear, in_dims)(*args)
        assert out.shape == (batch, 5, 6)
        if batch:
            torch.testing.assert_close(
                out[0], F.linear(*[a[0] if d is not None else a for a, d in zip(args, in_dims)]))
    gi, gw, gb = vmap(batchrules.linear_backward, (0, 0, None, None))(
        x, r(batch, 5, 6), r(6, 4), MASK)
    assert (gi.shape, gw.shape, gb.shape) == ((batch, 5, 4), (batch, 6, 4), (batch, 6))


def test_empty_features() -> None:
    """in_features == 0: the output is the bias; out_features == 0: empty outputs."""
    x, w, b = r(B, 5, 0), r(B, 6, 0), r(B, 6)
    torch.testing.assert_close(vmap(batchrules.linear)(x, w, b), b[:, None, :].expand(B, 5, 6))
    torch.testing.assert_close(vmap(batchrules.linear, (None, 0, 0))(x[0], w, b),
                               b[:, None, :].expand(B, 5, 6))
    assert vmap(batchrules.linear)(r(B, 5, 4), r(B, 0, 4), r(B, 0)).shape == (B, 5, 0)
    gi, gw, gb = vmap(batchrules.linear_backward, (0, 0, 0, None))(r(B, 5, 0), r(B, 5, 6), r(B, 6, 0), MASK)
    assert (gi.shape, gw.shape, gb.shape) == ((B, 5, 0), (B, 6, 0), (B, 6))
