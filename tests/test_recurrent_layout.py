"""rnn_recurrence keeps its input gates' memory order (Note [Steps in the
input's memory order], csrc/recurrent/recurrence.h): input gates laid out
sample by sample give an output, a workspace and an input-gate gradient laid
out the same way, with the values of the time-major layout, in every mode,
fused (float32) or not (float64); and clipped_grad's LSTM step makes no
transposing copy of the gate gradients."""
import pytest
import torch
from recurrent_reference import one_gate, operands, sample_major
from torch import nn
from torch.func import functional_call
from torch.profiler import profile

import batchrules

recurrence = torch.ops.batchrules.rnn_recurrence.default
MODES = {"lstm": 0, "gru": 1, "rnn_tanh": 2, "rnn_relu": 3}


def is_sample_major(t: torch.Tensor) -> bool:
    return t.stride(2) == t.shape[0] * t.shape[3] and t.stride(0) == t.shape[3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", list(MODES))
def test_sample_major_input_gates(mode: str, dtype: torch.dtype) -> None:
    m = MODES[mode]
    ops = operands(2, 3, 5, mode=min(m, 1), seed=4)
    if m > 1:
        ops = one_gate(ops, 5)
    results = {}
    for layout in ("time-major", "sample-major"):
        leaves = {k: v.to(dtype).requires_grad_() for k, v in ops.items() if v is not None}
        x = leaves["input_gates"] if layout == "time-major" else sample_major(leaves["input_gates"])
        out, h_n, c_n, ws = recurrence(x, leaves["h0"], leaves.get("c0"), leaves["w_hh"],
                                       leaves["b_hh"], None, m, False)
        loss = out.sin().sum() + h_n.square().sum() + (c_n.sum() if c_n is not None else 0)
        (g_x,) = torch.autograd.grad(loss, [x])
        results[layout] = (out, ws, g_x)
    for t in results["sample-major"][:1] + results["sample-major"][2:]:
        assert is_sample_major(t), t.stride()
    # Equal up to an ulp or two: aten's vectorized sigmoid and tanh may round
    # an element in a vector's tail differently from one in a full lane.
    ulps = 2 * torch.finfo(dtype).eps
    for want, got in zip(results["time-major"], results["sample-major"]):
        torch.testing.assert_close(got, want, rtol=ulps, atol=ulps)


def test_opcheck_with_sample_major_input_gates() -> None:
    ops = operands(1, 4, 6, seed=5)
    args = (sample_major(ops["input_gates"]).requires_grad_(), ops["h0"], ops["c0"], ops["w_hh"],
            ops["b_hh"], None, 0, False)
    torch.library.opcheck(recurrence, args,
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))


def test_clipped_grad_lstm_step_makes_no_gate_gradient_copy() -> None:
    model = nn.LSTM(3, 8, batch_first=True)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(6, 5, 3)

    def loss(p, xi):
        return functional_call(model, p, (xi[None],))[0].square().sum()

    clipped = batchrules.clipped_grad(loss, 1.0)
    with profile(record_shapes=True) as prof:
        clipped(params, x)
    gates = [6, 5, 1, 4 * 8]  # B, T, N, 4H: autograd's copy of the gate gradient
    copies = [e for e in prof.events() if e.name in ("aten::clone", "aten::copy_")
              and e.input_shapes and list(e.input_shapes[0]) == gates]
    assert not copies
