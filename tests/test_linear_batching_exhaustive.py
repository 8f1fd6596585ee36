"""Exhaustive in_dims sweep of both batching rules against a for-loop reference.

Every batch dim choice per tensor argument (None included), input ranks 1-3,
1-D and 2-D weights, every bias shape F.linear accepts (absent, [O], [], [1],
the 1-D-input quirk [1, O], biases with leading dims) and every non-empty
output_mask, with out_dims cycling through all positions. Each result must also
be batch-first and contiguous per example, as eager's is, so that ``.view()``
works on it under vmap. The vmap fallback is off, so each case must be served
by the batching rules. Sizes are small and pairwise distinct so a wrong
broadcast cannot pass by coincidence.
"""
import itertools
from typing import List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from batching_reference import all_bdims, assert_same, linear_backward_reference, loop_reference, physical
from torch.func import vmap

import batchrules

BATCH = 3
LEAD = (2, 5)
IN, OUT = 4, 6
DTYPE = torch.float64
MASKS = [m for m in itertools.product([False, True], repeat=3) if any(m)]

pytestmark = pytest.mark.usefixtures("no_vmap_fallback")


def flat(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t.view(-1)``: fails under vmap unless each example is contiguous."""
    return None if t is None else t.view(-1)


def input_shape(rank: int) -> Tuple[int, ...]:
    return LEAD[len(LEAD) - (rank - 1):] + (IN,)


def weight_shape(rank: int) -> Tuple[int, ...]:
    return (OUT, IN) if rank == 2 else (IN,)


def output_shape(in_rank: int, w_rank: int) -> Tuple[int, ...]:
    return input_shape(in_rank)[:-1] + ((OUT,) if w_rank == 2 else ())


def bias_shapes(in_rank: int, w_rank: int) -> List[Optional[Tuple[int, ...]]]:
    """Every kind of bias F.linear accepts for these ranks (None: no bias)."""
    lead = input_shape(in_rank)[:-1]
    if w_rank == 1:
        # F.linear rejects any bias for 2-D input with a 1-D weight.
        shapes = [] if in_rank == 2 else [()]
        if in_rank == 3:
            shapes.append(lead)
        return [None] + shapes
    shapes = [(OUT,), (), (1,)]
    if in_rank == 1:
        shapes.append((1, OUT))  # 1-D input: the bias may broadcast against [1, O]
    else:
        shapes.append(lead + (OUT,))
    if in_rank == 3:
        shapes.append(lead[1:] + (OUT,))
    return [None] + shapes


@pytest.mark.parametrize("w_rank", [1, 2])
@pytest.mark.parametrize("in_rank", [1, 2, 3])
def test_linear_every_in_dims(in_rank: int, w_rank: int) -> None:
    gen = torch.Generator().manual_seed(in_rank * 10 + w_rank)
    out_rank = len(output_shape(in_rank, w_rank))
    failures, cases = [], 0
    for bias_shape in bias_shapes(in_rank, w_rank):
        bias_bdims = [None] if bias_shape is None else all_bdims(len(bias_shape))
        for x_bdim, w_bdim, b_bdim in itertools.product(
                all_bdims(in_rank), all_bdims(w_rank), bias_bdims):
            if x_bdim is None and w_bdim is None and b_bdim is None:
                continue
            x = physical(input_shape(in_rank), x_bdim, BATCH, DTYPE, gen)
            w = physical(weight_shape(w_rank), w_bdim, BATCH, DTYPE, gen)
            b = None if bias_shape is None else physical(bias_shape, b_bdim, BATCH, DTYPE, gen)
            in_dims = (x_bdim, w_bdim, b_bdim)
            out_dims = cases % (out_rank + 1)
            cases += 1
            expected = loop_reference(F.linear, (x, w, b), in_dims, BATCH, out_dims)
            label = f"x{tuple(x.shape)}@{x_bdim} w{tuple(w.shape)}@{w_bdim} " \
                    f"b{None if b is None else tuple(b.shape)}@{b_bdim} out_dims={out_dims}"
            try:
                actual = vmap(batchrules.linear, in_dims, out_dims)(x, w, b)
                assert_same(actual, expected, msg=label)
                viewed = vmap(lambda *a: flat(batchrules.linear(*a)), in_dims)(x, w, b)
                assert_same(viewed, expected.movedim(out_dims, 0).reshape(BATCH, -1), msg=label)
                assert vmap(batchrules.linear, in_dims)(x, w, b).is_contiguous(), label
            except Exception as e:  # collect every failing case, report them together
                failures.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0]}")
    assert cases > 0
    assert not failures, f"{len(failures)}/{cases} cases failed:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("w_rank", [1, 2])
@pytest.mark.parametrize("in_rank", [1, 2, 3])
def test_linear_backward_every_in_dims_and_mask(in_rank: int, w_rank: int) -> None:
    gen = torch.Generator().manual_seed(100 + in_rank * 10 + w_rank)
    out_shape = output_shape(in_rank, w_rank)
    # Logical ranks of (grad_input, grad_weight, grad_bias), for out_dims.
    result_ranks = (in_rank, w_rank, w_rank - 1)
    failures, cases = [], 0
    for x_bdim, g_bdim, w_bdim in itertools.product(
            all_bdims(in_rank), all_bdims(len(out_shape)), all_bdims(w_rank)):
        if x_bdim is None and g_bdim is None and w_bdim is None:
            continue
        x = physical(input_shape(in_rank), x_bdim, BATCH, DTYPE, gen)
        g = physical(out_shape, g_bdim, BATCH, DTYPE, gen)
        w = physical(weight_shape(w_rank), w_bdim, BATCH, DTYPE, gen)
        in_dims = (x_bdim, g_bdim, w_bdim, None)
        full = loop_reference(linear_backward_reference, (x, g, w, (True,) * 3), in_dims, BATCH)
        # torch.func's out_dims misplaces the batch dim of an output that is not
        # batched (it expands without unsqueezing), so those keep out_dims=0.
        batched = (g_bdim is not None or w_bdim is not None,
                   g_bdim is not None or x_bdim is not None, g_bdim is not None)
        for mask in MASKS:
            out_dims = tuple(None if not m else cases % (r + 1) if b else 0
                             for r, m, b in zip(result_ranks, mask, batched))
            cases += 1
            expected = tuple(
                None if not m else t.movedim(0, d) for t, m, d in zip(full, mask, out_dims))
            label = f"x{tuple(x.shape)}@{x_bdim} g{tuple(g.shape)}@{g_bdim} " \
                    f"w{tuple(w.shape)}@{w_bdim} mask={mask} out_dims={out_dims}"
            try:
                actual = vmap(batchrules.linear_backward, in_dims, out_dims)(x, g, w, mask)
                assert_same(tuple(actual), expected, msg=label)
                viewed = vmap(lambda *a: tuple(map(flat, batchrules.linear_backward(*a))),
                              in_dims, out_dims=tuple(0 if m else None for m in mask))(x, g, w, mask)
                assert_same(viewed, tuple(None if not m else t.movedim(d, 0).reshape(BATCH, -1)
                                          for t, m, d in zip(expected, mask, out_dims)), msg=label)
                batch_first = vmap(batchrules.linear_backward, in_dims,
                                   tuple(0 if m else None for m in mask))(x, g, w, mask)
                assert all(t.is_contiguous() for t, m, b in zip(batch_first, mask, batched)
                           if m and b), label
            except Exception as e:  # collect every failing case, report them together
                failures.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0]}")
    assert not failures, f"{len(failures)}/{cases} cases failed:\n" + "\n".join(failures[:20])
