"""Property tests of both batching rules over random shapes, ranks, batch dims,
dtypes and physical layouts, against per-example for-loop references.

Sizes include 0 and 1 (empty leading dims, empty features, size-1 dims that
F.linear's fast paths squeeze), layouts include transposed, strided and
stride-0 batch dims. Runs derandomized with bounded examples for CI.
"""
from typing import Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from batching_reference import (
    all_bdims,
    assert_same,
    layout,
    linear_backward_reference,
    loop_reference,
    physical_shape,
    reference_linear,
)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.func import vjp, vmap

import batchrules

DTYPES = [torch.float32, torch.float64, torch.complex128]
LAYOUTS = ["contiguous", "transposed", "strided", "expanded"]
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float64: {},
             torch.complex128: {}}

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

pytestmark = pytest.mark.usefixtures("no_vmap_fallback")


@st.composite
def batched_tensor(draw, logical: Tuple[int, ...], batch: int, dtype: torch.dtype,
                   may_share: bool = True) -> Tuple[torch.Tensor, Optional[int]]:
    """A random physical tensor of the given logical shape with a random batch dim
    (None: shared) and layout."""
    bdim = draw(st.sampled_from(all_bdims(len(logical)) if may_share
                                else all_bdims(len(logical))[1:]))
    values = torch.randn(physical_shape(logical, bdim, batch), dtype=dtype)
    return layout(values, draw(st.sampled_from(LAYOUTS)), bdim), bdim


@st.composite
def linear_problem(draw):
    """Shapes of one linear problem: (lead, in, out or None for a 1-D weight, bias shape)."""
    lead = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    in_features = draw(st.integers(0, 4))
    out_features = draw(st.one_of(st.none(), st.integers(0, 4)))
    out_shape = lead + (() if out_features is None else (out_features,))
    bias: Optional[Tuple[int, ...]] = None
    if not (len(lead) == 1 and out_features is None) and draw(st.booleans()):
        # Any broadcastable suffix of the output shape, sizes kept or set to 1.
        k = draw(st.integers(0, len(out_shape)))
        bias = tuple(s if draw(st.booleans()) else 1 for s in out_shape[len(out_shape) - k:])
        if not lead and draw(st.booleans()):
            bias = (1,) + bias  # a 1-D input's bias may broadcast against [1, *out]
    return lead, in_features, out_features, bias


def weight_shape(in_features: int, out_features: Optional[int]) -> Tuple[int, ...]:
    return (in_features,) if out_features is None else (out_features, in_features)


def f_linear_accepts(x_shape, w_shape, b_shape) -> bool:
    try:
        F.linear(torch.zeros(x_shape), torch.zeros(w_shape),
                 None if b_shape is None else torch.zeros(b_shape))
        return True
    except RuntimeError:
        return False


@SETTINGS
@given(data=st.data(), problem=linear_problem(), dtype=st.sampled_from(DTYPES),
       batch=st.integers(1, 3))
def test_linear_matches_loop(data, problem, dtype, batch) -> None:
    lead, in_f, out_f, bias_shape = problem
    x, x_bdim = data.draw(batched_tensor(lead + (in_f,), batch, dtype))
    w, w_bdim = data.draw(batched_tensor(weight_shape(in_f, out_f), batch, dtype))
    b, b_bdim = None, None
    if bias_shape is not None:
        b, b_bdim = data.draw(batched_tensor(bias_shape, batch, dtype))
    if x_bdim is None and w_bdim is None and b_bdim is None:
        x, x_bdim = x.unsqueeze(0).expand(batch, *x.shape), 0
    out_rank = len(lead) + (out_f is not None)
    out_dims = data.draw(st.integers(-out_rank - 1, out_rank))
    in_dims = (x_bdim, w_bdim, b_bdim)
    actual = vmap(batchrules.linear, in_dims, out_dims)(x, w, b)
    expected = loop_reference(reference_linear, (x, w, b), in_dims, batch, out_dims)
    assert_same(actual, expected, **TOLERANCE[dtype])


@SETTINGS
@given(data=st.data(), problem=linear_problem(), dtype=st.sampled_from(DTYPES),
       batch=st.integers(1, 3),
       mask=st.tuples(st.booleans(), st.booleans(), st.booleans()).filter(any))
def test_linear_backward_matches_loop(data, problem, dtype, batch, mask) -> None:
    lead, in_f, out_f, _ = problem
    out_shape = lead + (() if out_f is None else (out_f,))
    x, x_bdim = data.draw(batched_tensor(lead + (in_f,), batch, dtype))
    g, g_bdim = data.draw(batched_tensor(out_shape, batch, dtype))
    w, w_bdim = data.draw(batched_tensor(weight_shape(in_f, out_f), batch, dtype))
    if x_bdim is None and g_bdim is None and w_bdim is None:
        g, g_bdim = g.unsqueeze(0).expand(batch, *g.shape), 0
    in_dims = (x_bdim, g_bdim, w_bdim, None)
    # Outputs not batched keep out_dims 0 (torch.func misplaces other out_dims there).
    batched = (g_bdim is not None or w_bdim is not None,
               g_bdim is not None or x_bdim is not None, g_bdim is not None)
    ranks = (len(lead) + 1, 1 + (out_f is not None), int(out_f is not None))
    out_dims = tuple(None if not m else data.draw(st.integers(0, r)) if bt else 0
                     for m, bt, r in zip(mask, batched, ranks))
    actual = vmap(batchrules.linear_backward, in_dims, out_dims)(x, g, w, mask)
    expected = loop_reference(linear_backward_reference, (x, g, w, mask), in_dims, batch,
                              out_dims)
    assert_same(tuple(actual), expected, **TOLERANCE[dtype])


@settings(SETTINGS, max_examples=100)
@given(data=st.data(), problem=linear_problem(), dtype=st.sampled_from(DTYPES),
       batch=st.integers(1, 3))
def test_vmap_vjp_matches_autograd_loop(data, problem, dtype, batch) -> None:
    """vmap over vjp of linear (input, weight and bias cotangents) with random batch dims."""
    lead, in_f, out_f, bias_shape = problem
    out_shape = lead + (() if out_f is None else (out_f,))
    x, x_bdim = data.draw(batched_tensor(lead + (in_f,), batch, dtype))
    w, w_bdim = data.draw(batched_tensor(weight_shape(in_f, out_f), batch, dtype))
    g, g_bdim = data.draw(batched_tensor(out_shape, batch, dtype, may_share=False))
    b = None if bias_shape is None else torch.randn(bias_shape, dtype=dtype)
    # The forward runs unbatched when only g is batched: keep to the shapes the
    # eager kernel (F.linear) accepts; see reference_linear.
    assume(f_linear_accepts(lead + (in_f,), weight_shape(in_f, out_f), bias_shape))

    def pullback(x, w, g):
        _, fn = vjp(lambda x, w: batchrules.linear(x, w, b), x, w)
        return fn(g)

    actual = vmap(pullback, (x_bdim, w_bdim, g_bdim))(x, w, g)

    def autograd_pullback(x, w, g):
        x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        return torch.autograd.grad(reference_linear(x, w, b), (x, w), g)

    expected = loop_reference(autograd_pullback, (x, w, g), (x_bdim, w_bdim, g_bdim), batch)
    assert_same(actual, expected, **TOLERANCE[dtype])
