"""Recurrent layers (nn.LSTM, nn.GRU, nn.RNN and their cells) under clipped_grad.

A layer's input projection is a linear over all its steps: sample i's
``W_ih`` gradient is ``sum_t g_t x_t^T`` with ``g_t`` the gradient of the
step's gates, so ``W_ih`` gets a ``LinearUse`` of the step rows. ``W_hh``
multiplies the previous state: its gradient is ``sum_t k_t h_{t-1}^T`` with
``k_t`` the gradient of ``h_{t-1} W_hh^T + b_hh``, which is ``g_t`` itself for
LSTM and RNN, and for GRU ``g_t`` with its n part times the reset gate
(``n = tanh(x_n + r (h W_hn^T + b_hn))``). So ``W_hh`` (with ``b_hh``) is a
linear use too, of the previous states, read back through the same gates'
edge: both norms are ghost norms, both clipped sums one GEMM. For LSTM and
RNN the two gradients are the same ``g_t``, so the two norms are one ghost
norm over ``[x_t, h_{t-1}]`` (Note [Weights sharing an output gradient] in
clipping.py), and ``b_ih`` joins ``b_hh`` in the recurrence. The loop over
time is ``batchrules.rnn_recurrence`` on all samples' rows at once, with
``W_hh`` detached: its gradient comes from the use alone. A layer with a
projection (``proj_size``), or only some of its parameters differentiated,
takes the generic path (per-sample copies of its parameters).
"""
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..rule import NOT_HANDLED, Rule, autocast_dtype, batched, bind, physical, register
from ..tape import Tape, tap
from .linear import LinearUse, linear_use

_LAYER_ARGS = (("input", "hx", "params", "has_biases", "num_layers", "dropout", "train",
                "bidirectional", "batch_first"), ())
_CELL_ARGS = (("input", "hx", "w_ih", "w_hh", "b_ih", "b_hh"), (None, None))
_RECURRENCE = torch.ops.batchrules.rnn_recurrence.default
_GATES = {0: 4, 1: 3, 2: 1, 3: 1}  # rnn_recurrence's modes: LSTM, GRU, RNN tanh, RNN relu


@dataclass(eq=False)
class HiddenUse(LinearUse):
    """``W_hh`` (and ``b_hh``) of one layer and direction: rows ``h_{t-1}``."""

    reset: Optional[Tensor] = None  # GRU: r, [B, T*N, H]

    def set_grad(self, grad: Tensor) -> None:
        if self.reset is not None:
            hidden = self.reset.shape[-1]
            g = grad.view(*self.reset.shape[:2], grad.shape[-1])
            grad = torch.cat([g[..., :2 * hidden], g[..., 2 * hidden:] * self.reset], -1)
        super().set_grad(grad)

    def release(self) -> None:
        super().release()
        self.reset = None


def _handled(tape: Tape, x: Tensor, weights: Sequence[Optional[Tensor]]) -> bool:
    """All of a layer's weights differentiated parameters of x's dtype (else the generic path)."""
    given = [w for w in weights if w is not None]
    return all(tape.param(w) is not None and w.dtype == x.dtype and w.device == x.device
               for w in given)


def _layer(tape: Tape, a: Tensor, h0: Tensor, c0: Optional[Tensor], w: Sequence[Any],
           mode: int, reverse: bool) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """One layer and direction on physical ``a: [B, T, N, I]``, ``h0: [B, N, H]``."""
    w_ih, w_hh = w[0], w[1]
    b_ih, b_hh = (w[2], w[3]) if len(w) == 4 else (None, None)
    batch, steps, rows, width = a.shape
    hidden = w_hh.shape[0] // _GATES[mode]
    # Outside a GRU's reset gate b_ih and b_hh add up: the recurrence adds
    # both in its cell, instead of a pass of b_ih over every step's gates.
    shared_g = mode != 1
    gates, input_use = linear_use(tape, a.reshape(-1, width), batch, w_ih, b_ih,
                                  add_bias=not shared_g)  # B*T*N, G*H
    b_step = None if b_hh is None else b_hh.detach()
    if shared_g and b_step is not None and b_ih is not None:  # b_ih and b_hh come together
        b_step = b_step + b_ih.detach()
    # B,T,N,GH -> T,B*N,GH: every sample's rows in one recurrence, in the
    # state's dtype (see Note [Recurrent layers under autocast])
    gate_width = gates.shape[-1]
    folded = gates.view(batch, steps, rows, gate_width).transpose(0, 1).reshape(
        steps, batch * rows, gate_width)
    state = h0.dtype
    out, h_n, c_n, saved = _RECURRENCE(
        folded.to(state), h0.reshape(batch * rows, hidden),
        None if c0 is None else c0.reshape(-1, hidden), w_hh.detach().to(state),
        None if b_step is None else b_step.to(state), None, mode, reverse)
    out = out.view(steps, batch, rows, hidden).transpose(0, 1)  # B,T,N,H
    # W_hh's rows h_{t-1}, written after W_ih's rows x_t when the two share g:
    # their joint norm reads both without a concatenated copy
    joint = shared_g and a.dtype == out.dtype
    side_by_side = out.new_empty(batch, steps, rows, (width if joint else 0) + hidden)
    prev = side_by_side[..., side_by_side.shape[-1] - hidden:]
    if steps:  # h_{t-1}: h0 at the first step (the last when reversed), then the outputs
        rest = out.detach()
        if reverse:
            prev[:, :-1], prev[:, -1] = rest[:, 1:], h0.detach()
        else:
            prev[:, 0], prev[:, 1:] = h0.detach(), rest[:, :-1]
    if joint:
        side_by_side[..., :width] = a.detach()
    reset = None
    if mode == 1:
        reset = saved.view(steps, batch, rows, saved.shape[-1])[..., :hidden].transpose(0, 1)
        reset = reset.reshape(batch, steps * rows, hidden)
    weight = tape.param(w_hh)
    assert weight is not None  # _handled
    use = HiddenUse(weight, tape.param(b_hh), prev.reshape(batch, steps * rows, hidden), tap(gates),
                    reset=reset)
    tape.record(use, (), "recurrence")
    if shared_g:  # Note [Weights sharing an output gradient] in clipping.py
        input_use.grad_partners = use.grad_partners = [input_use, use]
        if joint:
            input_use.partner_rows = use.partner_rows = side_by_side.view(batch, steps * rows, width + hidden)
    return out, h_n.view(batch, rows, hidden), None if c_n is None else c_n.view(batch, rows, hidden)


# Note [Recurrent layers under autocast]
# The rule follows aten's CPU and CUDA autocast policy for these ops, as the
# routes do (csrc/recurrent/routes.cpp): an LSTM or RNN layer runs in the
# lower precision (input, states and weights cast; the output in that dtype),
# a GRU layer and the cells keep their state's dtype, with only their linears
# cast. On the CPU an LSTM layer is cast only where eager runs oneDNN's layer
# (oneDNN enabled, a non-empty input); elsewhere it keeps its state's dtype
# as GRU does. So the input projection (a linear, cast by autocast itself)
# hands the recurrence gates of the state's dtype, or is brought to it. The
# recorded rows and gate gradients are brought to the weights' dtype before
# the norms (Note [clipped_grad under autocast] in transform.py).
def _layer_cast(mode: int, a: Tensor) -> bool:
    """Whether eager casts the whole layer under autocast (see the Note); ``a``:
    the physical input, ``[B, T, N, I]``."""
    if mode == 1:  # GRU
        return False
    if mode == 0 and a.device.type == "cpu":
        return torch._C._get_mkldnn_enabled() and math.prod(a.shape[1:]) != 0
    return True


class RecurrentLayerRule(Rule):
    """``torch.lstm/gru/rnn_tanh/rnn_relu`` (what nn.LSTM, nn.GRU, nn.RNN call)."""

    mode: ClassVar[int]

    @classmethod
    def batch_dims(cls, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[Any, Any]]:
        """The input's batch dim (0 with batch_first, else 1), the states' 1."""
        bound = bind(*_LAYER_ARGS, args, kwargs)
        if bound is None or kwargs or isinstance(args[3], (list, tuple)):  # packed: refused
            return None
        dim = 0 if bound[-1] else 1
        return ((dim, 1) + (None,) * (len(args) - 2), {}), (dim, 1, 1)

    @classmethod
    def intercept(cls, tape: Tape, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if len(args) > 3 and isinstance(args[3], (list, tuple)):  # (data, batch_sizes, hx, params)
            if any(tape.param(p) is not None for p in args[3]):
                raise RuntimeError(
                    f"clipped_grad: torch.{cls.functions[0].__name__} on a PackedSequence: a "
                    "packed batch's layout is data, not a dim, so it cannot be split per sample. "
                    "Pad the sequences and select each sample's last valid step")
            return NOT_HANDLED
        bound = bind(*_LAYER_ARGS, args, kwargs)
        if bound is None:
            return NOT_HANDLED
        x, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first = bound
        lstm = cls.mode == 0
        h0, c0 = (hx[0], hx[1]) if lstm else (hx, None)
        a, hp = physical(tape, x), physical(tape, h0)
        cp = physical(tape, c0) if lstm else None
        if (a is None or hp is None or (lstm and (cp is None or hp.shape[-1] != cp.shape[-1]))
                or a.dim() != 4 or not _handled(tape, a, params)):
            return NOT_HANDLED
        if batch_first:
            a = a.transpose(1, 2)  # B,N,T,I -> B,T,N,I
        if a.shape[1] == 0:  # eager's check, which the recurrence's reshapes would not give
            raise RuntimeError("Expected sequence length to be larger than 0 in RNN")
        # See Note [Recurrent layers under autocast].
        low = autocast_dtype(a) if _layer_cast(cls.mode, a) else None
        if low is not None:
            a, hp = a.to(low), hp.to(low)
            cp = None if cp is None else cp.to(low)
        per_layer = 4 if has_biases else 2
        directions = 2 if bidirectional else 1
        h_n: List[Tensor] = []
        c_n: List[Tensor] = []  # an LSTM's
        for layer in range(layers):
            outs = []
            for d in range(directions):
                i = layer * directions + d
                out, h, c = _layer(tape, a, hp[:, i], None if cp is None else cp[:, i],
                                   params[i * per_layer:(i + 1) * per_layer], cls.mode, d == 1)
                outs.append(out)
                h_n.append(h)
                if c is not None:
                    c_n.append(c)
            a = torch.cat(outs, -1) if directions == 2 else outs[0]
            if dropout > 0 and train and layer + 1 < layers:
                a = F.dropout(a, dropout, True)  # each sample its own mask
        out = a.transpose(1, 2) if batch_first else a
        result = (batched(tape, out), batched(tape, torch.stack(h_n, 1)))
        return result + (batched(tape, torch.stack(c_n, 1)),) if lstm else result


class RecurrentCellRule(Rule):
    """``torch.lstm_cell/gru_cell/rnn_*_cell``: one step of ``_layer``."""

    mode: ClassVar[int]

    @classmethod
    def intercept(cls, tape: Tape, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        bound = bind(*_CELL_ARGS, args, kwargs)
        if bound is None:
            return NOT_HANDLED
        x, hx, w_ih, w_hh, b_ih, b_hh = bound
        lstm = cls.mode == 0
        h, c = (hx[0], hx[1]) if lstm else (hx, None)
        a, hp = physical(tape, x), physical(tape, h)
        cp = physical(tape, c) if lstm else None
        weights = [w_ih, w_hh] + ([b_ih, b_hh] if b_ih is not None and b_hh is not None else [])
        if (a is None or hp is None or (lstm and cp is None) or a.dim() != 3
                or (b_ih is None) != (b_hh is None) or not _handled(tape, a, weights)):
            return NOT_HANDLED
        _, h_new, c_new = _layer(tape, a.unsqueeze(1), hp, cp, weights, cls.mode, False)
        if c_new is not None:  # an LSTM cell's
            return batched(tape, h_new), batched(tape, c_new)
        return batched(tape, h_new)


for _base, _functions in ((RecurrentLayerRule, (torch.lstm, torch.gru, torch.rnn_tanh,
                                                torch.rnn_relu)),
                          (RecurrentCellRule, (torch.lstm_cell, torch.gru_cell,
                                               torch.rnn_tanh_cell, torch.rnn_relu_cell))):
    for _mode, _function in enumerate(_functions):
        register(type(f"{_function.__name__}Rule", (_base,),
                      {"functions": (_function,), "mode": _mode}))
