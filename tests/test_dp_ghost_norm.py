"""The ghost norm kernel (``batchrules::ghost_norms_sq``, Note [The ghost norm
kernel] in csrc/dp/ghost_norm/kernel.cpp) and where dp/cost.py uses it."""
import os
import subprocess
import sys

import pytest
import torch

import batchrules  # noqa: F401  (loads the operators)
from batchrules.dp import cost

ghost_norms_sq = torch.ops.batchrules.ghost_norms_sq.default


def materialized(a, g, biases=0):
    """``||g_i^T a_i||^2`` from the per-sample [O, I] gradients, in float64; with
    ``biases``, of ``[a, 1, ..., 1]``: that many bias gradients ``sum_t g_i,t`` more."""
    a = torch.cat([a.double(), a.new_ones(*a.shape[:-1], biases, dtype=torch.float64)], -1)
    return torch.einsum("bto,bti->boi", g.double(), a).square().sum((1, 2))


def operands(batch, rows, in_f, out_f, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, rows, in_f, generator=gen, dtype=dtype),
            torch.randn(batch, rows, out_f, generator=gen, dtype=dtype))


# Sizes around the 16 lanes and the 4-row tiles (remainders, fewer than 16 features) and the
# row counts clipped_grad meets.
SIZES = [
    (1, 1, 1, 1), (3, 1, 5, 7), (4, 2, 16, 16), (5, 12, 128, 384), (2, 7, 17, 33),
    (3, 20, 32, 512), (2, 32, 31, 15), (0, 4, 8, 8), (2, 0, 8, 8), (2, 3, 0, 8),
    (2, 9, 5, 3), (1, 128, 40, 24)]  # every tile remainder; the 128 rows cost.py sends


@pytest.mark.parametrize("biases", [0, 1, 2])
@pytest.mark.parametrize("batch, rows, in_f, out_f", SIZES)
def test_equals_the_materialized_norm_in_float64(batch, rows, in_f, out_f, biases) -> None:
    a, g = operands(batch, rows, in_f, out_f)
    got = ghost_norms_sq(a, g, biases)
    assert got.shape == (batch,) and got.dtype == torch.float64
    torch.testing.assert_close(got, materialized(a, g, biases), rtol=1e-12, atol=1e-12)


# float32 takes 4 x 4 Gram blocks where the CPU has AVX-512 or AVX2 (Note [Gram blocks] in
# gram_blocks.cpp): rows in blocks and in remainders, features in 16- and 8-lane passes and tails.
FLOAT32_SIZES = SIZES + [(2, 8, 160, 512), (3, 6, 48, 20), (2, 8, 7, 9), (3, 4, 8, 24)]


@pytest.mark.parametrize("biases", [0, 2])
@pytest.mark.parametrize("batch, rows, in_f, out_f", FLOAT32_SIZES)
def test_float32_equals_the_materialized_norm(batch, rows, in_f, out_f, biases) -> None:
    a, g = operands(batch, rows, in_f, out_f, torch.float32, seed=2)
    got = ghost_norms_sq(a, g, biases)
    assert got.shape == (batch,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), materialized(a, g, biases), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("widest", ["avx2", "rows"])
def test_float32_on_the_narrower_kernels(widest) -> None:
    """The same in a process held to AVX2's blocks or to the row kernel
    (BATCHRULES_GRAM_BLOCKS): the kernels a CPU with AVX-512 would not run."""
    check = (
        "import torch, test_dp_ghost_norm as t\n"
        "for batch, rows, in_f, out_f in t.FLOAT32_SIZES:\n"
        "    for biases in (0, 2):\n"
        "        a, g = t.operands(batch, rows, in_f, out_f, torch.float32, seed=2)\n"
        "        torch.testing.assert_close(t.ghost_norms_sq(a, g, biases).double(),\n"
        "                                   t.materialized(a, g, biases), rtol=1e-5, atol=1e-5)\n")
    env = {**os.environ, "BATCHRULES_GRAM_BLOCKS": widest,
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_float32_is_as_accurate_as_the_bmm_formula() -> None:
    a, g = operands(16, 24, 200, 300, torch.float32, seed=1)
    want = materialized(a, g)
    got = ghost_norms_sq(a, g)
    assert got.dtype == torch.float32
    bmm = ((a @ a.transpose(1, 2)) * (g @ g.transpose(1, 2))).sum((1, 2))
    kernel_err = ((got.double() - want).abs() / want).max()
    bmm_err = ((bmm.double() - want).abs() / want).max()
    assert kernel_err < 1e-6 and kernel_err <= 2 * bmm_err + 1e-7


@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded"])
def test_any_strides(layout) -> None:
    a, g = operands(4, 6, 10, 12)
    if layout == "transposed":
        a = a.transpose(0, 1).contiguous().transpose(0, 1)
        g = g.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    elif layout == "sliced":
        a, g = a[:, ::2], g[:, ::2]
    else:  # the stride-0 gradient of a sum
        g = g[:, :1].expand(-1, a.shape[1], -1)
    torch.testing.assert_close(ghost_norms_sq(a, g), materialized(a, g), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("biases", [(), (1,)])
def test_opcheck(biases) -> None:
    a, g = operands(3, 5, 9, 11)
    torch.library.opcheck(ghost_norms_sq, (a, g, *biases), test_utils=(
        "test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("a_shape, g_shape, match", [
    ((2, 3), (2, 3, 4), r"rows \[B, T, I\] and grads \[B, T, O\].*\[2, 3\]"),
    ((2, 3, 4), (2, 5, 4), r"\[2, 3, 4\] and grads \[2, 5, 4\] must agree"),
    ((3, 3, 4), (2, 3, 4), r"must agree in their first two dims"),
])
def test_bad_shapes_name_them(a_shape, g_shape, match) -> None:
    with pytest.raises(RuntimeError, match=match):
        ghost_norms_sq(torch.zeros(a_shape), torch.zeros(g_shape))
    with pytest.raises(RuntimeError, match=match):  # the Meta kernel: the same message
        ghost_norms_sq(torch.zeros(a_shape, device="meta"), torch.zeros(g_shape, device="meta"))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_negative_biases_are_refused(device) -> None:
    with pytest.raises(RuntimeError, match="a count of biases >= 0, but got -1"):
        ghost_norms_sq(torch.zeros(2, 3, 4, device=device), torch.zeros(2, 3, 5, device=device), -1)


def test_bad_dtypes_name_them() -> None:
    with pytest.raises(RuntimeError, match="of one dtype, but got Float and Double"):
        ghost_norms_sq(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="expected float32 or float64 tensors, but got BFloat16"):
        ghost_norms_sq(torch.zeros(2, 3, 4, dtype=torch.bfloat16),
                       torch.zeros(2, 3, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize("rows, used", [(1, True), (12, True), (cost._GHOST_KERNEL_ROWS, True),
                                        (cost._GHOST_KERNEL_ROWS + 1, False)])
@pytest.mark.parametrize("groups", [(), (3,)])
def test_pair_norms_sq_uses_it_for_few_rows(rows, used, groups, monkeypatch) -> None:
    """cost.pair_norms_sq takes the kernel for a ghost norm of at most
    _GHOST_KERNEL_ROWS rows (groups summed), and bmm above; both exact."""
    calls = []
    monkeypatch.setattr(cost, "_GHOST_KERNEL",
                        lambda a, g, biases: calls.append(a.shape) or ghost_norms_sq(a, g, biases))
    gen = torch.Generator().manual_seed(rows)
    a = torch.randn(4, *groups, rows, 256, generator=gen, dtype=torch.float64)
    g = torch.randn(4, *groups, rows, 300, generator=gen, dtype=torch.float64)
    assert cost.ghost_is_cheaper(rows, 256, 300)
    got = cost.pair_norms_sq(a, g)
    want = materialized(a.flatten(0, -3), g.flatten(0, -3)).view(4, -1).sum(1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert bool(calls) == used


# (rows, in, out): one row; the kernel; the bmm ghost norm (more rows than the kernel takes);
# the materialized norm (ghost not cheaper).
@pytest.mark.parametrize("rows, in_f, out_f", [(1, 7, 5), (12, 64, 96),
                                               (cost._GHOST_KERNEL_ROWS + 2, 300, 260),
                                               (40, 6, 9)])
@pytest.mark.parametrize("biases", [0, 1, 2])
def test_pair_norms_sq_adds_the_biases_on_every_path(rows, in_f, out_f, biases) -> None:
    """Each of cost.pair_norms_sq's ways adds ``biases`` bias gradients ``sum_t g_t``
    (the rows with that many columns of ones), exactly."""
    a, g = operands(3, rows, in_f, out_f, seed=rows)
    torch.testing.assert_close(cost.pair_norms_sq(a, g, biases), materialized(a, g, biases),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cost.rows_norms_sq(a, g, biases), materialized(a, g, biases),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("biases", [0, 2])
def test_one_row_without_the_kernel(biases, monkeypatch) -> None:
    """The one-row norm where the kernel does not run (CUDA, half precision):
    (||a_i||^2 + biases) ||g_i||^2, exactly."""
    monkeypatch.setattr(cost, "_ghost_kernel_runs", lambda a, g: False)
    a, g = operands(3, 1, 7, 5, seed=1)
    torch.testing.assert_close(cost.pair_norms_sq(a, g, biases), materialized(a, g, biases),
                               rtol=1e-12, atol=1e-12)
