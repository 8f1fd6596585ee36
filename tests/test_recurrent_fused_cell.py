"""The fused cells of rnn_recurrence's CPU kernels (Note [The fused LSTM
cell]): the LSTM's forward and backward (csrc/recurrent/lstm_cell_cpu.cpp),
the GRU's forward (gru_cell_cpu.cpp). float32 runs them, float64 the aten
ops, so each float32 result is checked against the float64 one."""
import itertools

import pytest
import torch
import torch.nn.functional as F
from recurrent_reference import GRU, LSTM, operands, transposed_rows
from torch import nn
from torch.func import grad, vmap

import batchrules

recurrence = torch.ops.batchrules.rnn_recurrence.default


def run(ops, dtype, reverse=False, c0_transposed=False, mode=LSTM, h0_transposed=False):
    ops = {k: None if v is None else v.to(dtype) for k, v in ops.items()}
    if c0_transposed:
        ops["c0"] = transposed_rows(ops["c0"])
    if h0_transposed:
        ops["h0"] = transposed_rows(ops["h0"])
    return recurrence(ops["input_gates"], ops["h0"], ops["c0"], ops["w_hh"], ops["b_hh"],
                      ops["w_hr"], mode, reverse)


@pytest.mark.parametrize("E, N, H, P", [(1, 1, 1, None), (1, 5, 7, None), (3, 4, 16, None),
                                        (2, 3, 33, None), (2, 3, 20, 6)])
@pytest.mark.parametrize("bias, reverse", list(itertools.product([True, False], [False, True])))
def test_values_and_workspace_equal_float64(E, N, H, P, bias, reverse) -> None:
    ops = operands(E, N, H, P, bias)
    got = run(ops, torch.float32, reverse, c0_transposed=True)
    want = run(ops, torch.float64, reverse)
    for name, g, w in zip(("output", "h_n", "c_n", "workspace"), got, want):
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=2e-6, msg=name)


@pytest.mark.parametrize("scale", [30.0, 1e3, 1e6])
def test_saturated_gates_stay_finite_and_exact(scale) -> None:
    """Pre-activations far past exp's float32 range: sigmoid 0/1, tanh -1/1."""
    ops = operands(2, 3, 9, scale=scale)
    got, want = run(ops, torch.float32), run(ops, torch.float64)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("P, reverse", [(None, False), (None, True), (5, False), (5, True)])
def test_gradients_equal_float64(P, reverse) -> None:
    """The fused backward (float32) against the aten ops' (float64), from the
    activations the fused forward saved; with and without a projection."""
    ops = operands(2, 4, 12, P, bias=True, seed=3)
    grads = {}
    for dtype in (torch.float32, torch.float64):
        leaves = {k: v.to(dtype).requires_grad_() for k, v in ops.items() if v is not None}
        out, h_n, c_n, _ = recurrence(leaves["input_gates"], leaves["h0"], leaves["c0"],
                                      leaves["w_hh"], leaves["b_hh"], leaves.get("w_hr"), LSTM,
                                      reverse)
        loss = out.sin().sum() + h_n.square().sum() + c_n.sum()
        grads[dtype] = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    for k, g in grads[torch.float32].items():
        torch.testing.assert_close(g.double(), grads[torch.float64][k], rtol=1e-4, atol=1e-5,
                                   msg=k)


@pytest.mark.parametrize("E, N, H", [(1, 1, 1), (1, 5, 7), (3, 4, 16), (2, 3, 33)])
@pytest.mark.parametrize("bias, reverse", list(itertools.product([True, False], [False, True])))
def test_gru_values_and_workspace_equal_float64(E, N, H, bias, reverse) -> None:
    ops = operands(E, N, H, bias=bias, mode=GRU)
    got = run(ops, torch.float32, reverse, mode=GRU, h0_transposed=True)
    want = run(ops, torch.float64, reverse, mode=GRU)
    for name, g, w in zip(("output", "h_n", "c_n", "workspace"), got, want):
        if name == "c_n":
            assert g is None and w is None
            continue
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=2e-6, msg=name)


@pytest.mark.parametrize("mode", [LSTM, GRU])
def test_input_gates_with_strided_rows_take_the_aten_ops(mode) -> None:
    """The fused cells read the input gates' rows in place; input gates whose
    rows are not contiguous keep the aten ops, with the same values."""
    ops = operands(2, 3, 6, mode=mode)
    strided = dict(ops, input_gates=transposed_rows(ops["input_gates"]))
    for g, w in zip(run(strided, torch.float32, mode=mode), run(ops, torch.float64, mode=mode)):
        if w is not None:
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("scale", [30.0, 1e3, 1e6])
def test_gru_saturated_gates_stay_finite_and_exact(scale) -> None:
    ops = operands(2, 3, 9, scale=scale, mode=GRU)
    got, want = run(ops, torch.float32, mode=GRU), run(ops, torch.float64, mode=GRU)
    for g, w in zip(got, want):
        if w is not None:
            assert torch.isfinite(g).all()
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("reverse", [False, True])
def test_gru_gradients_from_the_fused_workspace_equal_float64(reverse) -> None:
    """The GRU backward (aten ops) reads the workspace the fused forward wrote."""
    ops = operands(2, 4, 12, bias=True, seed=3, mode=GRU)
    grads = {}
    for dtype in (torch.float32, torch.float64):
        leaves = {k: v.to(dtype).requires_grad_() for k, v in ops.items() if v is not None}
        out, h_n, _, _ = recurrence(leaves["input_gates"], leaves["h0"], None, leaves["w_hh"],
                                    leaves["b_hh"], None, GRU, reverse)
        loss = out.sin().sum() + h_n.square().sum()
        grads[dtype] = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    for k, g in grads[torch.float32].items():
        torch.testing.assert_close(g.double(), grads[torch.float64][k], rtol=1e-4, atol=1e-5,
                                   msg=k)


def test_per_sample_forward_of_a_gru_in_float32() -> None:
    """vmap of nn.GRU over per-sample sequences (the recurrence on the folded
    batch), float32 against the float64 module on each sequence."""
    torch.manual_seed(0)
    gru = nn.GRU(5, 8, batch_first=True)
    x = torch.randn(6, 4, 5)
    params = {k: v.detach() for k, v in gru.named_parameters()}
    with batchrules.enabled():
        got = vmap(lambda p, xi: torch.func.functional_call(gru, p, (xi.unsqueeze(0),))[0],
                   in_dims=(None, 0))(params, x)
    gru.double()
    with torch.no_grad():
        for i in range(len(x)):
            torch.testing.assert_close(got[i].double(), gru(x[i : i + 1].double())[0], rtol=1e-5,
                                       atol=2e-6)


def test_per_sample_grads_of_an_lstm_in_float32() -> None:
    """vmap(grad) of an nn.LSTM classifier (the recurrence with shared
    weights), float32 against float64 per-sample autograd."""
    torch.manual_seed(0)
    lstm, head = nn.LSTM(5, 8, batch_first=True), nn.Linear(8, 3)
    x, y = torch.randn(6, 4, 5), torch.randint(0, 3, (6,))

    def loss(p, xi, yi):
        out = torch.func.functional_call(lstm, {k[5:]: v for k, v in p.items() if k[:5] == "lstm."},
                                         (xi.unsqueeze(0),))[0]
        logits = F.linear(out[:, -1], p["head.weight"], p["head.bias"])
        return F.cross_entropy(logits, yi.unsqueeze(0))

    params = {**{f"lstm.{k}": v.detach() for k, v in lstm.named_parameters()},
              **{f"head.{k}": v.detach() for k, v in head.named_parameters()}}
    with batchrules.enabled():
        got = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    p64 = {k: v.double() for k, v in params.items()}
    lstm.double()
    for i in range(len(x)):
        want = grad(loss)(p64, x[i].double(), y[i])
        for k in want:
            torch.testing.assert_close(got[k][i].double(), want[k], rtol=1e-4, atol=1e-5, msg=k)
