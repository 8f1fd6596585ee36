"""Recurrent layers' edges under vmap: dropout's randomness modes, packed
sequences, bad shapes, and disable() restoring stock torch.func exactly."""
import functools
import re

import pytest
import torch
from conftest import vmap_fallback_off
from recurrent_reference import (
    HIDDEN,
    IN,
    KINDS,
    B,
    N,
    T,
    batched,
    call,
    check_forward,
    input_shape,
    loop,
    make_cell,
    make_rnn,
    routed,
)
from torch import nn
from torch.func import vmap
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence
from torch.utils._pytree import tree_map

import batchrules

ROUTED_OPS = [f"aten::{op}.input" for op in ("lstm", "gru", "rnn_tanh", "rnn_relu")] + [
    f"aten::{op}_cell" for op in ("lstm", "gru", "rnn_tanh", "rnn_relu")]


def with_dropout(kind: str) -> nn.Module:
    return make_rnn(kind, num_layers=2, dropout=0.5).train()


@pytest.mark.parametrize("kind", KINDS)
def test_dropout_error_mode_raises(kind) -> None:
    module = with_dropout(kind)
    x = batched(input_shape(module, True), 0)
    with routed(), pytest.raises(RuntimeError, match="randomness"):
        vmap(module)(x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("randomness", ["same", "different"])
def test_dropout_same_and_different(kind, randomness) -> None:
    # Every example has the same input: "same" draws one mask for all of them
    # (equal outputs), "different" one per example (outputs differ).
    module = with_dropout(kind)
    x = torch.randn(input_shape(module, True), dtype=torch.float64).expand(B, -1, -1, -1)
    with routed():
        out, h_n = vmap(module, randomness=randomness)(x)
    eval_out, eval_h = loop(module.eval(), (x,), (0,))
    shapes = functools.partial(tree_map, lambda t: t.shape)
    assert shapes((out, h_n)) == shapes((eval_out, eval_h))
    assert not torch.allclose(out, eval_out), "dropout was not applied"
    assert torch.allclose(out[0], out[1]) == (randomness == "same"), out


@pytest.mark.parametrize("kind", KINDS)
def test_dropout_off_in_eval_mode(kind) -> None:
    check_forward(with_dropout(kind).eval(), 0, True, "batched")


@pytest.mark.parametrize("kind", KINDS)
def test_packed_sequence_is_refused_by_name(kind) -> None:
    # A PackedSequence of per-example data with shared batch_sizes reaches
    # aten::lstm.data & co., which have no batching rule.
    module = make_rnn(kind)
    packed = pack_padded_sequence(torch.randn(T, N, IN, dtype=torch.float64), torch.tensor([T, 2]))
    data = torch.stack([packed.data, torch.randn_like(packed.data)])
    with routed(), pytest.raises(RuntimeError, match="(?i)packed"):
        vmap(lambda d: module(PackedSequence(d, packed.batch_sizes))[0].data)(data)


MODULES = {"rnn": make_rnn, "cell": make_cell}


def raised_by(fn) -> str:
    """The message of the RuntimeError/ValueError ``fn`` raises."""
    with pytest.raises((RuntimeError, ValueError)) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", MODULES)
def test_disabled_is_stock_again(kind, family) -> None:
    module = MODULES[family](kind)
    x = batched(input_shape(module, True), 0)
    with batchrules.enabled(False), vmap_fallback_off():
        stock = raised_by(lambda: vmap(module)(x))
    # stock: "Batching rule not implemented for aten::lstm.input. We could not
    # generate a fallback" or "aten::gru_cell hit the vmap fallback which is ...".
    assert re.search(r"aten::\w+.*fallback", stock), stock
    with routed():
        vmap(module)(x)
    with batchrules.enabled(False), vmap_fallback_off():
        assert raised_by(lambda: vmap(module)(x)) == stock


def test_disable_restores_dispatch_tables() -> None:
    with batchrules.enabled(False):
        stock = {op: torch._C._dispatch_dump(op) for op in ROUTED_OPS}
        with batchrules.enabled(True):
            pass
        assert {op: torch._C._dispatch_dump(op) for op in ROUTED_OPS} == stock


BAD, VMAP = 7, 5  # a wrong feature size, and a vmap size no per-example number equals
BAD_SHAPES = ["aten_input", "aten_h0_size", "aten_h0_batch", "cell_input", "cell_h_size",
              "module_input", "module_h0_size", "module_h0_batch"]


def bad_shape_case(kind: str, name: str):
    """(fn, one example's args) of a call whose every example is ill-shaped."""
    rnn, cell = make_rnn(kind), make_cell(kind)
    op = {"lstm": torch.lstm, "gru": torch.gru, "rnn_tanh": torch.rnn_tanh,
          "rnn_relu": torch.rnn_relu}[kind]
    lstm = kind == "lstm"

    def aten(x, hx):  # the aten op itself, past nn.Module's Python shape checks
        return op(x, list(hx) if lstm else hx, rnn._flat_weights, True, 1, 0.0, False, False,
                  False)

    def state(*shape):  # h (and c) of one example; an LSTM's h and c differing in
        h = torch.zeros(shape, dtype=torch.float64)  # size would ask for a projection
        return (h, h.clone()) if lstm else h

    x = torch.zeros(T, N, IN, dtype=torch.float64)
    bad_x = torch.zeros(T, N, BAD, dtype=torch.float64)
    return {"aten_input": (aten, (bad_x, state(1, N, HIDDEN))),
            "aten_h0_size": (aten, (x, state(1, N, IN))),
            "aten_h0_batch": (aten, (x, state(1, IN, HIDDEN))),
            "cell_input": (call(cell), (bad_x[0], state(N, HIDDEN))),
            "cell_h_size": (call(cell), (x[0], state(N, IN))),
            "module_input": (call(rnn), (bad_x, state(1, N, HIDDEN))),
            "module_h0_size": (call(rnn), (x, state(1, N, IN))),
            "module_h0_batch": (call(rnn), (x, state(1, IN, HIDDEN)))}[name]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", BAD_SHAPES)
def test_bad_shapes_name_one_example(kind, name) -> None:
    fn, args = bad_shape_case(kind, name)
    with batchrules.enabled(False):
        eager = raised_by(lambda: fn(*args))
    stacked = tree_map(lambda t: torch.stack([t] * VMAP), args)
    with routed():
        got = raised_by(lambda: vmap(fn)(*stacked))
    where = f"routed {got!r}, eager {eager!r}"
    # Only sizes one example has (or eager's message names): never the vmap
    # size, nor rows of examples folded together.
    per_example = {int(n) for n in re.findall(r"\d+", eager)} | {
        0, 1, N, T, IN, BAD, HIDDEN, 3 * HIDDEN, 4 * HIDDEN, T * N}
    assert {int(n) for n in re.findall(r"\d+", got)} <= per_example, where
    if name.startswith("module"):  # nn.Module's own Python checks, on one example
        assert got == eager, where
    else:  # the wrong size and the expected one (eager's LSTM h0 message names neither)
        wrong = BAD if name.endswith("input") else IN
        expected = IN if name.endswith("input") else HIDDEN
        assert re.search(rf"\b{wrong}\b", got) and re.search(rf"\b{expected}\b", got), where
