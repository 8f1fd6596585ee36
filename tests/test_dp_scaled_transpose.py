"""``batchrules::scaled_transpose``, the clipped sums' scaled operand (Note [A scaled
transpose in 8 x 8 tiles] in csrc/dp/scaled_transpose/kernel.cpp): exactly
``x.permute(2, 0, 1) * scale[:, None]``, contiguous, for every tile remainder and layout."""
import pytest
import torch

import batchrules  # noqa: F401  (loads the operators)

scaled_transpose = torch.ops.batchrules.scaled_transpose.default


def reference(x, scale):
    return (x.permute(2, 0, 1) * scale.view(1, -1, 1)).contiguous()


def operands(batch, rows, width, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, rows, width, generator=gen, dtype=dtype),
            torch.rand(batch, generator=gen, dtype=dtype))


# Rows (B x T) and columns around the 8 x 8 tiles: whole tiles, remainders of either, fewer than
# eight, empty dims; the last, bands enough for more than one thread.
SIZES = [(1, 1, 1), (8, 1, 8), (9, 1, 17), (3, 5, 7), (128, 1, 512), (32, 20, 32), (4, 3, 24),
         (0, 3, 4), (3, 0, 4), (3, 4, 0), (64, 16, 72)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch, rows, width", SIZES)
def test_equals_the_permuted_product(batch, rows, width, dtype) -> None:
    x, scale = operands(batch, rows, width, dtype)
    got = scaled_transpose(x, scale)
    assert got.shape == (width, batch, rows) and got.is_contiguous() and got.dtype == dtype
    assert torch.equal(got, reference(x, scale))


@pytest.mark.parametrize("layout", ["sliced columns", "samples inner", "spaced rows", "expanded",
                                    "scale strided"])
def test_any_strides(layout) -> None:
    x, scale = operands(6, 5, 19)
    if layout == "sliced columns":
        x = torch.randn(6, 5, 24)[..., 2:21]
    elif layout == "samples inner":  # [T, B, K] memory, as a time-major recurrence records
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    elif layout == "spaced rows":  # a [CLS] token's rows
        x = torch.randn(6, 10, 19)[:, ::2]
    elif layout == "expanded":  # the stride-0 gradient of a sum
        x = x[:, :1].expand(-1, 5, -1)
    else:
        scale = torch.rand(12)[::2]
    assert torch.equal(scaled_transpose(x, scale), reference(x, scale))


def test_threads_split_the_columns() -> None:
    x, scale = operands(64, 16, 200, seed=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(scaled_transpose(x, scale), reference(x, scale))
    finally:
        torch.set_num_threads(threads)


def test_opcheck() -> None:
    x, scale = operands(3, 5, 9)
    torch.library.opcheck(scaled_transpose, (x, scale), test_utils=(
        "test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("x_shape, scale_shape, match", [
    ((2, 3), (2,), r"x \[B, T, K\] and scale \[B\], but got shapes \[2, 3\] and \[2\]"),
    ((2, 3, 4), (2, 1), r"but got shapes \[2, 3, 4\] and \[2, 1\]"),
    ((2, 3, 4), (3,), r"x \[2, 3, 4\] has 2 samples but scale \[3\] has 3"),
])
def test_bad_shapes_name_them(device, x_shape, scale_shape, match) -> None:
    with pytest.raises(RuntimeError, match=match):
        scaled_transpose(torch.zeros(x_shape, device=device), torch.zeros(scale_shape, device=device))


def test_bad_dtypes_name_them() -> None:
    with pytest.raises(RuntimeError, match="of one dtype, but got Float and Double"):
        scaled_transpose(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="floating-point tensors, but got Long"):
        scaled_transpose(torch.zeros(2, 3, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("shape, strides", [((3, 1, 5), (5, 7, 1)), ((1, 4, 5), (99, 5, 1)),
                                            ((3, 4, 1), (4, 1, 9)), ((3, 1, 5), (10, 3, 1))])
def test_size_one_dims_with_any_stride(shape, strides) -> None:
    """A size-1 dim's stride says nothing about the memory: the rows are read by the others."""
    x = torch.randn(200).as_strided(shape, strides)
    scale = torch.rand(shape[0])
    assert torch.equal(scaled_transpose(x, scale), reference(x, scale))
