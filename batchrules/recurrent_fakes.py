"""Fake (meta) kernels of ``batchrules::rnn_recurrence`` and its backward.

Without them FakeTensor runs the ops' CompositeExplicitAutograd C++ kernels,
whose loops read concrete sizes: a compiled step specialized on the batch and
compiled once per size. These give the outputs' sizes and strides from the
operands' (symbolic) ones, as the kernels allocate them (csrc/recurrent:
``empty_steps`` keeps the input gates' memory order, Note [Steps in the input's
memory order]; the state gradients are fresh contiguous tensors, or copies of
the given ones with no steps). The ops check their operands when they run.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

_GATES = {0: 4, 1: 3, 2: 1, 3: 1}  # modes: LSTM, GRU, RNN tanh, RNN relu
_LSTM, _GRU = 0, 1
_library: Optional[torch.library.Library] = None


def _workspace_width(mode: int, hidden: int, projected: bool) -> int:
    # LSTM: i,f,g,o and c (+ the unprojected h); GRU: r,z,n and h W_hn^T + b_hn
    return (6 if projected else 5) * hidden if mode == _LSTM else 4 * hidden if mode == _GRU else 0


def _steps(like: Tensor, width: int) -> Tensor:
    """``empty_steps``: [T, E, N, width], stored sample-major where ``like`` is."""
    steps, groups, rows = like.shape[:3]
    if steps > 1 and rows > 1 and like.stride(0) < like.stride(2):
        return like.new_empty((groups, rows, steps, width)).permute(2, 0, 1, 3)
    return like.new_empty((steps, groups, rows, width))


def _recurrence(input_gates: Tensor, h0: Tensor, c0: Optional[Tensor], w_hh: Tensor,
                b_hh: Optional[Tensor], w_hr: Optional[Tensor], mode: int,
                reverse: bool) -> Tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
    grouped = w_hh.dim() == 3  # else one group: T,N,F as T,1,N,F
    x = input_gates if grouped else input_gates.unsqueeze(1)
    hidden = w_hh.shape[-2] // _GATES[mode]
    state = h0.shape[-1]
    output = _steps(x, state)
    workspace = _steps(x, _workspace_width(mode, hidden, w_hr is not None))
    h_n = h0.new_empty(h0.shape)
    c_n = None if mode != _LSTM else h0.new_empty((*h0.shape[:-1], hidden))
    if not grouped:
        output, workspace = output.squeeze(1), workspace.squeeze(1)
    return output, h_n, c_n, workspace


def _recurrence_backward(grad_output: Optional[Tensor], grad_h_n: Optional[Tensor],
                         grad_c_n: Optional[Tensor], h0: Tensor, c0: Optional[Tensor], w_hh: Tensor,
                         w_hr: Optional[Tensor], output: Tensor, workspace: Tensor, mode: int,
                         reverse: bool) -> Tuple[Optional[Tensor], ...]:
    grouped = w_hh.dim() == 3
    out = output if grouped else output.unsqueeze(1)
    gates = w_hh.shape[-2]

    def seq(width: int) -> Tensor:
        t = _steps(out, width)
        return t if grouped else t.squeeze(1)

    hidden_gates = seq(gates) if mode == _GRU else None
    projected = seq(h0.shape[-1]) if w_hr is not None else None
    lstm = mode == _LSTM
    if out.shape[0] == 0:  # no steps: copies of the given gradients, or zeros like the states
        d_h0 = torch.empty_like(grad_h_n if grad_h_n is not None else h0)
        like = grad_c_n if grad_c_n is not None else c0
        d_c0 = None if not lstm or like is None else torch.empty_like(like)
    else:
        d_h0 = h0.new_empty(h0.shape)
        d_c0 = None if not lstm or c0 is None else c0.new_empty(c0.shape)
    return seq(gates), hidden_gates, d_h0, d_c0, projected


def register_recurrence_fakes() -> None:
    """Registers both fake kernels (``import batchrules``; idempotent)."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("batchrules", "FRAGMENT")
    torch.library.register_fake("batchrules::rnn_recurrence", _recurrence, lib=library)
    torch.library.register_fake("batchrules::rnn_recurrence_backward", _recurrence_backward,
                                lib=library)
    _library = library
