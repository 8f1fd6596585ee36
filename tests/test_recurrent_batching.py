"""vmap over nn.LSTM / nn.GRU / nn.RNN and their cells against per-example loops.

Routed (routing on, vmap fallback off): shared weights with batched inputs
(every layout option the modules take), ensembles of stacked weights with a
shared or batched input, the cells, float32 / float64 / bf16 autocast, and
PyTorch's own ModuleInfo samples. References: stock eager calls in a loop.
"""
import functools
from typing import Any

import pytest
import torch
from conftest import assert_close
from recurrent_reference import (
    KINDS,
    LSTM_ONLY,
    PROJ,
    RNN_CASES,
    B,
    batched,
    call,
    check_forward,
    ensemble,
    input_shape,
    loop,
    make_cell,
    make_hx,
    make_rnn,
    routed,
    scalar,
)
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_leaves, tree_map

RNN_PARAMS = [pytest.param(kind, *case, id=f"{kind}-{name}") for kind in KINDS
              for name, case in RNN_CASES.items() if kind == "lstm" or name not in LSTM_ONLY]


@pytest.mark.parametrize("kind,options,per_example_batch,hx_spec,x_dim", RNN_PARAMS)
def test_rnn_forward_shared_weights(kind, options, per_example_batch, hx_spec, x_dim) -> None:
    check_forward(make_rnn(kind, **options), x_dim, per_example_batch, hx_spec)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("options,hx_spec", [({}, "none"),
                                             ({"num_layers": 2, "bidirectional": True,
                                               "batch_first": True}, "batched")])
@pytest.mark.parametrize("x_dim", [None, 0], ids=["x_shared", "x_batched"])
def test_rnn_ensemble(kind, options, hx_spec, x_dim) -> None:
    members, params, buffers, fn = ensemble(functools.partial(make_rnn, kind, **options))
    x = batched(input_shape(members[0], True), x_dim)
    hx, hx_dims = make_hx(members[0], True, hx_spec)
    with routed():
        got = vmap(fn, in_dims=(0, 0, x_dim, hx_dims))(params, buffers, x, hx)
    want = loop(lambda i, x, hx: call(members[i])(x, hx), (torch.arange(B), x, hx),
                (0, x_dim, hx_dims))
    assert_close(got, want)


def test_lstm_proj_ensemble() -> None:
    members, params, buffers, fn = ensemble(lambda: make_rnn("lstm", proj_size=PROJ))
    x = batched(input_shape(members[0], False), 0)
    with routed():
        got = vmap(fn, in_dims=(0, 0, 0))(params, buffers, x)
    assert_close(got, loop(lambda i, x: members[i](x), (torch.arange(B), x), (0, 0)))


CELL_PARAMS = [pytest.param(kind, hx_spec, id=f"{kind}-h_{hx_spec}") for kind in KINDS
               for hx_spec in ("none", "batched", "shared", "mixed")
               if kind == "lstm" or hx_spec != "mixed"]  # mixed: h batched, c shared


@pytest.mark.parametrize("kind,hx_spec", CELL_PARAMS)
@pytest.mark.parametrize("per_example_batch", [False, True], ids=["x_1d", "x_2d"])
def test_cell_forward(kind, hx_spec, per_example_batch) -> None:
    check_forward(make_cell(kind), 0, per_example_batch, hx_spec)


@pytest.mark.parametrize("kind", KINDS)
def test_cell_without_bias(kind) -> None:
    check_forward(make_cell(kind, bias=False), 0, True, "batched")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("x_dim", [None, 0], ids=["x_shared", "x_batched"])
def test_cell_ensemble(kind, x_dim) -> None:
    members, params, buffers, fn = ensemble(functools.partial(make_cell, kind))
    x = batched(input_shape(members[0], True), x_dim)
    hx, hx_dims = make_hx(members[0], True, "batched")
    with routed():
        got = vmap(fn, in_dims=(0, 0, x_dim, hx_dims))(params, buffers, x, hx)
    want = loop(lambda i, x, hx: members[i](x, hx), (torch.arange(B), x, hx), (0, x_dim, hx_dims))
    assert_close(got, want)


def routed_ops(fn, *args) -> set:
    with routed(), torch.profiler.profile() as prof:
        fn(*args)
    return {e.name for e in prof.events() if e.name.startswith("batchrules::rnn_recurrence")}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make", [make_rnn, make_cell], ids=["rnn", "cell"])
def test_runs_the_recurrence_op(kind, make) -> None:
    # Values alone would not tell the route from a stock path that happens to work.
    module = make(kind)
    x = batched(input_shape(module, True), 0)
    params = {k: v.detach() for k, v in module.named_parameters()}
    per_sample = grad(lambda p, x: scalar(functional_call(module, p, (x,))))
    assert routed_ops(vmap(module), x) == {"batchrules::rnn_recurrence"}
    assert routed_ops(vmap(per_sample, in_dims=(None, 0)), params, x) == {
        "batchrules::rnn_recurrence", "batchrules::rnn_recurrence_backward"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtypes(kind, dtype) -> None:
    # float32 eager LSTM runs oneDNN's kernel, the routed call linear + recurrence:
    # the same math, float32 rounding apart.
    check_forward(make_rnn(kind, dtype, num_layers=2), 0, True, "batched", dtype)
    check_forward(make_cell(kind, dtype), 0, True, "batched", dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_autocast_bf16_matches_eager_autocast(kind) -> None:
    # Eager float32 under CPU autocast: LSTM and RNN return bf16 (oneDNN's layer
    # casts), GRU float32; the vmapped call must return what each example's call does.
    module = make_rnn(kind, torch.float32)
    check_like_eager_under_autocast(module, batched(input_shape(module, True), 0, torch.float32), kind)


def check_like_eager_under_autocast(module: nn.Module, x: torch.Tensor, kind: str) -> None:
    """vmap(module)(x) routed under CPU bf16 autocast against the loop of eager
    calls: the same dtypes and values (skipped where eager's oneDNN layer cannot run)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with routed():
            got = vmap(module)(x)
        try:
            want = loop(module, (x,), (0,))
        except RuntimeError as e:
            if "could not create a primitive descriptor" not in str(e):
                raise
            pytest.skip(f"eager's oneDNN {kind} layer has no bfloat16 kernel on this CPU: {e}")
    for g, w in zip(tree_leaves(got), tree_leaves(want)):
        assert g.dtype == w.dtype, f"{kind}: {g.dtype}, eager under autocast gives {w.dtype}"
    assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rows, onednn", [(0, True), (2, False), (2, True)],
                         ids=["empty", "onednn_off", "onednn"])
@pytest.mark.parametrize("proj", [0, 2], ids=["plain", "projected"])
def test_lstm_under_autocast_has_eagers_dtypes(rows, onednn, proj) -> None:
    # Eager's LSTM is in bf16 under CPU autocast through oneDNN's layer only, which it
    # skips for an empty input, with oneDNN off and with projections: then its
    # composite's linears are cast and its states are not (float32 out; a projected
    # LSTM's h is its projection's, bf16, its c float32).
    torch.manual_seed(0)
    module = nn.LSTM(3, 4, proj_size=proj)
    with torch.backends.mkldnn.flags(enabled=onednn):
        check_like_eager_under_autocast(module, batched([5, rows, 3], 0, torch.float32), "LSTM")


MODULE_DB_CLASSES = [nn.LSTM, nn.GRU, nn.RNN, nn.LSTMCell, nn.GRUCell, nn.RNNCell]


@functools.lru_cache(maxsize=None)
def module_info(cls: type):
    from torch.testing._internal.common_modules import module_db

    (info,) = [m for m in module_db if m.module_cls is cls]
    return info


def batchable(arg: Any) -> bool:
    """A tensor, or a tuple of tensors (an LSTM's (h0, c0)); not a PackedSequence."""
    if isinstance(arg, PackedSequence):
        return False
    return isinstance(arg, torch.Tensor) or (
        isinstance(arg, tuple) and all(isinstance(a, torch.Tensor) for a in arg))


@pytest.mark.parametrize("cls", MODULE_DB_CLASSES, ids=lambda c: c.__name__)
def test_module_db_samples(cls: type) -> None:
    info = module_info(cls)
    samples = info.module_inputs_func(info, device="cpu", dtype=torch.float64,
                                      requires_grad=False, training=False)
    checked = 0
    for k, sample in enumerate(samples):
        fwd = sample.forward_input
        if fwd.kwargs or not all(batchable(a) for a in fwd.args):
            continue
        ctor = sample.constructor_input
        module = cls(*ctor.args, **ctor.kwargs).to(torch.float64).train(False)
        # The sample and a second draw of its shapes: identical copies would hide
        # one example's values leaking into another's.
        args = tree_map(lambda t: torch.stack([t, torch.randn_like(t)]), tuple(fwd.args))
        with routed():
            got = vmap(module)(*args)
        assert_close(got, loop(module, args, (0,) * len(args)),
                     msg=f"sample {k}: {ctor.kwargs or ctor.args}, {sample.desc}")
        checked += 1
    assert checked > 0, f"all {len(samples)} samples skipped (PackedSequence or unbatchable)"
