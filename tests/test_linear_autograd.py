"""Explicit autograd formulas of batchrules.linear / linear_backward.

Numerical checks (gradcheck, gradgradcheck, forward-mode and fwd-over-rev,
third order) in float64 and complex128, and the analytic derivatives compared
with those of F.linear: backward, forward AD through torch.func.jvp, jacfwd and
forward_ad dual tensors.
"""
import itertools
import math
from typing import Callable, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from linear_samples import (
    LinearSample,
    first_of_each_kind,
    linear_reference,
    linear_samples,
    random_grad_output,
    without_overlap,
)
from torch import Tensor
from torch.autograd import gradcheck, gradgradcheck

import batchrules

GRAD_DTYPES = (torch.float64, torch.complex128)
MASKS = [m for m in itertools.product([False, True], repeat=3) if any(m)]


def grad_samples(dtype: torch.dtype, requires_grad: bool = True) -> List[LinearSample]:
    """Every sample, with no stride-0 dims (gradcheck and make_dual reject them)."""
    return [LinearSample(s.kind, *(without_overlap(t) for t in s.args))
            for s in linear_samples("cpu", dtype, requires_grad=requires_grad)]


def linear_fn(sample: LinearSample, op: Callable = batchrules.linear
              ) -> Tuple[Callable[..., Tensor], Tuple[Tensor, ...]]:
    """``op`` as a function of exactly the tensors the sample has."""
    if sample.bias is None:
        return (lambda x, w: op(x, w)), (sample.input, sample.weight)
    return op, sample.args


def linear_backward_fn(mask: Sequence[bool]) -> Callable[..., Tuple[Tensor, ...]]:
    """linear_backward with ``mask``, returning only the computed gradients."""
    def fn(x: Tensor, g: Tensor, w: Tensor) -> Tuple[Tensor, ...]:
        outs = batchrules.linear_backward(x, g, w, mask)
        assert all((o is None) != wanted for o, wanted in zip(outs, mask))
        return tuple(o for o in outs if o is not None)

    return fn


def linear_backward_args(sample: LinearSample) -> Tuple[Tensor, Tensor, Tensor]:
    g = random_grad_output(sample).requires_grad_()
    return sample.input, g, sample.weight


def linear_backward_reference(x: Tensor, g: Tensor, w: Tensor,
                              mask: Sequence[bool] = (True, True, True)) -> Tuple[Tensor, ...]:
    """The documented formulas in plain torch ops (the computed outputs only)."""
    w2 = w if w.dim() == 2 else w.unsqueeze(0)
    rows = math.prod(x.shape[:-1])
    g2, x2 = g.reshape(rows, w2.shape[0]), x.reshape(rows, w2.shape[1])
    grads = ((g2 @ w2.conj()).reshape(x.shape),
             (g2.mT @ x2.conj()).reshape(w.shape),
             g2.sum(0).reshape(w.shape[:-1]))
    return tuple(gr for gr, wanted in zip(grads, mask) if wanted)


# ---------------------------------------------------------------- numerical checks
# Note [gradcheck budget]
# Slow-mode gradcheck builds full Jacobians column by column; on the larger
# OpInfo samples that is seconds each. Every sample gets fast mode (random
# projections of the Jacobians: any wrong formula still fails) and one sample
# of each kind gets slow mode, which compares every entry: in float64 every
# kind, in complex128 (several times the float64 cost: real and imaginary parts
# are checked apart) the kinds of COMPLEX_SLOW_KINDS, the conjugate view
# among them.
COMPLEX_SLOW_KINDS = ("opinfo", "weight_1d", "bias_broadcast", "leading_dims", "conj_view")


def slow_mode_samples(samples: List[LinearSample], kinds: Optional[int] = None) -> List[LinearSample]:
    """One sample of each kind: of the first `kinds` (all by default) in float64,
    of COMPLEX_SLOW_KINDS in complex128 (Note [gradcheck budget])."""
    firsts = first_of_each_kind(samples)
    if samples[0].input.is_complex():
        return [s for s in firsts if s.kind in COMPLEX_SLOW_KINDS]
    return firsts[:kinds]


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_linear_gradcheck(dtype: torch.dtype) -> None:
    """Reverse and forward mode against finite differences."""
    samples = grad_samples(dtype)
    for fast_mode, subset in [(True, samples), (False, slow_mode_samples(samples))]:
        for sample in subset:
            fn, args = linear_fn(sample)
            assert gradcheck(fn, args, check_forward_ad=True, check_undefined_grad=True,
                             fast_mode=fast_mode), sample


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_linear_gradgradcheck(dtype: torch.dtype) -> None:
    """Double backward and forward-over-reverse."""
    samples = grad_samples(dtype)
    for fast_mode, subset in [(True, samples), (False, slow_mode_samples(samples))]:
        for sample in subset:
            fn, args = linear_fn(sample)
            assert gradgradcheck(fn, args, check_fwd_over_rev=True, fast_mode=fast_mode), sample


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_linear_backward_gradcheck(dtype: torch.dtype) -> None:
    """The full output_mask on every sample, every other mask on one of each kind."""
    samples = grad_samples(dtype)
    for fast_mode, subset in [(True, samples), (False, slow_mode_samples(samples))]:
        for sample in subset:
            assert gradcheck(linear_backward_fn((True, True, True)), linear_backward_args(sample),
                             check_forward_ad=True, check_undefined_grad=True,
                             fast_mode=fast_mode), sample
    for sample in first_of_each_kind(samples):
        args = linear_backward_args(sample)
        for mask in MASKS[:-1]:
            assert gradcheck(linear_backward_fn(mask), args, check_forward_ad=True,
                             fast_mode=True), (sample, mask)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_linear_backward_gradgradcheck(dtype: torch.dtype) -> None:
    samples = grad_samples(dtype)
    for fast_mode, subset in [(True, samples), (False, slow_mode_samples(samples, 8))]:
        for sample in subset:
            assert gradgradcheck(linear_backward_fn((True, True, True)),
                                 linear_backward_args(sample), check_fwd_over_rev=True,
                                 fast_mode=fast_mode), sample


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_third_order(dtype: torch.dtype) -> None:
    """Third derivatives through backward-of-double-backward, numerically and
    against F.linear's (tanh makes them non-zero; linear alone is bilinear)."""
    def grads_of(op: Callable) -> Callable[..., Tuple[Tensor, ...]]:
        def fn(x: Tensor, w: Tensor, b: Tensor) -> Tuple[Tensor, ...]:
            loss = torch.tanh(op(x, w, b)).abs().pow(2).sum()
            return torch.autograd.grad(loss, (x, w, b), create_graph=True)

        return fn

    # Small inputs: complex tanh has poles at i*pi/2, where numerical and
    # analytical third derivatives part ways.
    gen = torch.Generator().manual_seed(0)
    make = lambda *shape: (0.3 * torch.randn(shape, dtype=dtype, generator=gen)).requires_grad_()  # noqa: E731
    for args in [(make(2, 3), make(4, 3), make(4)), (make(3), make(3), make()),
                 (make(2, 2, 3), make(2, 3), make())]:
        assert gradgradcheck(grads_of(batchrules.linear), args)
        # d^3 loss along random directions: grad of <grad of <grad, v1>, v2> .
        ours, ref = (_third_directional(grads_of(op), args)
                     for op in (batchrules.linear, linear_reference))
        for a, r in zip(ours, ref):
            torch.testing.assert_close(a, r)


def _third_directional(grad_fn: Callable, args: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    v1 = [torch.randn(a.shape, dtype=a.dtype, generator=gen) for a in args]
    v2 = [torch.randn(a.shape, dtype=a.dtype, generator=gen) for a in args]
    first = grad_fn(*args)
    second = torch.autograd.grad(sum((f * v.conj()).real.sum() for f, v in zip(first, v1)), args,
                                 create_graph=True)
    return torch.autograd.grad(sum((s * v.conj()).real.sum() for s, v in zip(second, v2)), args)


# ---------------------------------------------------------------- analytic vs F.linear

@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_linear_grads_match_F_linear(dtype: torch.dtype) -> None:
    for sample in grad_samples(dtype):
        fn, args = linear_fn(sample)
        ref_fn, _ = linear_fn(sample, linear_reference)
        out = fn(*args)
        g = torch.randn_like(out)
        ours = torch.autograd.grad(out, args, g)
        ref = torch.autograd.grad(ref_fn(*args), args, g)
        for a, r in zip(ours, ref):
            torch.testing.assert_close(a, r, msg=repr(sample))


def _tangents(args: Sequence[Tensor], which: Sequence[bool]) -> List[Optional[Tensor]]:
    gen = torch.Generator().manual_seed(len(args))
    return [torch.randn(a.shape, dtype=a.dtype, generator=gen) if on else None
            for a, on in zip(args, which)]


def _dual_forward(fn: Callable, args: Sequence[Tensor], tangents: Sequence[Optional[Tensor]]):
    with fwAD.dual_level():
        duals = [a if t is None else fwAD.make_dual(a, t) for a, t in zip(args, tangents)]
        out = fn(*duals)
        outs = out if isinstance(out, tuple) else (out,)
        return [tuple(fwAD.unpack_dual(o)) for o in outs]


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_linear_forward_ad_dual_tensors_match_F_linear(dtype: torch.dtype) -> None:
    """forward_ad with a tangent on every subset of the operands."""
    for sample in grad_samples(dtype, requires_grad=False):
        fn, args = linear_fn(sample)
        ref_fn, _ = linear_fn(sample, linear_reference)
        for which in itertools.product([False, True], repeat=len(args)):
            tangents = _tangents(args, which)
            ((primal, tangent),) = _dual_forward(fn, args, tangents)
            ((ref_primal, ref_tangent),) = _dual_forward(ref_fn, args, tangents)
            msg = f"{sample!r}, tangents on {which}"
            torch.testing.assert_close(primal, ref_primal, msg=msg)
            if any(which):
                torch.testing.assert_close(tangent, ref_tangent, msg=msg)
            else:
                assert tangent is None, msg


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_linear_func_jvp_matches_F_linear(dtype: torch.dtype) -> None:
    for sample in grad_samples(dtype, requires_grad=False):
        fn, args = linear_fn(sample)
        ref_fn, _ = linear_fn(sample, linear_reference)
        tangents = tuple(torch.randn_like(a) for a in args)
        ours = torch.func.jvp(fn, args, tangents)
        # F.linear trips an internal assert on conj views under torch.func.jvp.
        ref = torch.func.jvp(ref_fn, tuple(a.resolve_conj() for a in args), tangents)
        torch.testing.assert_close(ours, ref, msg=repr(sample))


@pytest.mark.parametrize("dtype", [torch.float64], ids=str)  # jacfwd takes real inputs only
def test_linear_jacfwd_matches_F_linear(dtype: torch.dtype) -> None:
    """jacfwd (vmap over jvp) and jacfwd-of-jacrev, one sample of each kind."""
    for sample in first_of_each_kind(grad_samples(dtype, requires_grad=False)):
        fn, args = linear_fn(sample)
        ref_fn, _ = linear_fn(sample, linear_reference)
        argnums = tuple(range(len(args)))
        torch.testing.assert_close(torch.func.jacfwd(fn, argnums)(*args),
                                   torch.func.jacfwd(ref_fn, argnums)(*args), msg=repr(sample))
    x, w, b = (torch.randn(s, dtype=dtype) for s in [(2, 3), (4, 3), (4,)])
    loss = lambda op: lambda x, w, b: torch.sin(op(x, w, b)).sum().real  # noqa: E731
    hessian = lambda op: torch.func.jacfwd(torch.func.jacrev(loss(op), (0, 1, 2)),  # noqa: E731
                                           (0, 1, 2))(x, w, b)
    torch.testing.assert_close(hessian(batchrules.linear), hessian(linear_reference))


def test_nested_jvp_matches_F_linear() -> None:
    """Forward over forward: jvp of a function that itself calls jvp."""
    x, w, b, dx, dw, db = (torch.randn(s, dtype=torch.float64)
                           for s in [(2, 3), (4, 3), (4,)] * 2)

    def second(op: Callable) -> Tuple[Tensor, Tensor]:
        inner = lambda x, w: torch.func.jvp(lambda w: torch.sin(op(x, w, b)), (w,), (dw,))[1]  # noqa: E731
        return torch.func.jvp(lambda x: inner(x, w), (x,), (dx,))

    torch.testing.assert_close(second(batchrules.linear), second(linear_reference))


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_linear_backward_forward_ad_matches_reference(dtype: torch.dtype) -> None:
    """jvp of linear_backward equals jvp of its formulas in plain torch ops."""
    for sample in first_of_each_kind(grad_samples(dtype, requires_grad=False), per_kind=3):
        args = (sample.input, random_grad_output(sample), sample.weight)
        for mask in MASKS:
            for which in [(True, True, True), (True, False, False), (False, True, False),
                          (False, False, True), (True, False, True)]:
                tangents = _tangents(args, which)
                ours = _dual_forward(linear_backward_fn(mask), args, tangents)
                ref = _dual_forward(lambda *a: linear_backward_reference(*a, mask), args,
                                    tangents)
                msg = f"{sample!r}, mask {mask}, tangents on {which}"
                for (p, t), (rp, rt) in zip(ours, ref, strict=True):
                    torch.testing.assert_close(p, rp, msg=msg)
                    if rt is None:
                        assert t is None or not t.any(), msg
                    else:
                        torch.testing.assert_close(t, rt, msg=msg)
