"""Hand-written baselines of the recurrent rows (``scenarios/recurrent.py``):
the members' stacked recurrence, the per-member loop of fused calls, and an LSTM
classifier's per-sample gradients by backpropagation through time. Gate order
as PyTorch's: LSTM ``i, f, g, o``; GRU ``r, z, n`` with ``n = tanh(W_in x + b_in
+ r * (W_hn h + b_hn))``. Zero initial state, ``batch_first``, no dropout.
"""
from typing import List, Sequence

import torch
from torch import Tensor

from .hand_written import cross_entropy_grad


def _input_projection(x: Tensor, w_ih: Tensor, bias: Tensor) -> Tensor:
    """Every member's input projection of every time step of ``x`` [B, T, I] in
    one GEMM: B*T,I x I,N*G*H -> B*T,N*G*H, read as [N, B, T, G*H] without a copy."""
    members, gh, in_f = w_ih.shape
    batch, steps, _ = x.shape
    z = torch.addmm(bias.reshape(-1), x.reshape(batch * steps, in_f), w_ih.reshape(members * gh, in_f).t())
    return z.view(batch, steps, members, gh).permute(2, 0, 1, 3)


def _lstm_layer(xp: Tensor, w_hh: Tensor) -> Tensor:
    """The recurrence over projected inputs ``xp`` [N, B, T, 4H] (both biases in it)."""
    hidden = w_hh.shape[-1]
    w_t = w_hh.transpose(1, 2)  # N, H, 4H
    h = c = None
    outputs = []
    for t in range(xp.shape[2]):
        # h0 = 0: the first step has no hidden projection
        gates = xp[:, :, t] if h is None else torch.baddbmm(xp[:, :, t], h, w_t)
        sig = torch.sigmoid(gates)
        i, f, o = sig[..., :hidden], sig[..., hidden:2 * hidden], sig[..., 3 * hidden:]
        g = torch.tanh(gates[..., 2 * hidden:3 * hidden])
        c = i * g if c is None else torch.addcmul(f * c, i, g)
        h = o * torch.tanh(c)
        outputs.append(h)
    return torch.stack(outputs, 2)


def _gru_layer(xp: Tensor, w_hh: Tensor, b_hh: Tensor) -> Tensor:
    """The recurrence over projected inputs ``xp`` [N, B, T, 3H] (b_ih in it)."""
    hidden = w_hh.shape[-1]
    w_t, b = w_hh.transpose(1, 2), b_hh.unsqueeze(1)  # N, H, 3H; N, 1, 3H
    h = None
    outputs = []
    for t in range(xp.shape[2]):
        x_t = xp[:, :, t]
        hh = b if h is None else torch.baddbmm(b, h, w_t)
        rz = torch.sigmoid(x_t[..., :2 * hidden] + hh[..., :2 * hidden])
        r, z = rz[..., :hidden], rz[..., hidden:]
        n = torch.tanh(torch.addcmul(x_t[..., 2 * hidden:], r, hh[..., 2 * hidden:]))
        # h' = (1 - z) * n + z * h
        h = n - z * n if h is None else torch.addcmul(n, z, h - n)
        outputs.append(h)
    return torch.stack(outputs, 2)


def ensemble_recurrence(kind: str, weights: Sequence[Tensor], x: Tensor) -> Tensor:
    """N stacked 1-layer ``nn.LSTM``/``nn.GRU`` (``weights``: w_ih, w_hh, b_ih,
    b_hh, each [N, ...]) on the shared ``x`` [B, T, I]. Returns their outputs [N, B, T, H]."""
    w_ih, w_hh, b_ih, b_hh = weights
    if kind == "lstm":
        return _lstm_layer(_input_projection(x, w_ih, b_ih + b_hh), w_hh)
    return _gru_layer(_input_projection(x, w_ih, b_ih), w_hh, b_hh)


def member_loop(kind: str, members: Sequence[Sequence[Tensor]], x: Tensor) -> Tensor:
    """One eager fused call per member (``members[e]``: its flat weights in
    ``nn.LSTM``'s ``_flat_weights`` order) on the shared ``x`` [B, T, I].
    Returns [N, B, T, H]."""
    h0 = x.new_zeros(1, x.shape[0], members[0][1].shape[-1])
    if kind == "lstm":
        return torch.stack([torch._VF.lstm(x, (h0, h0), list(w), True, 1, 0.0, True, False, True)[0]
                            for w in members])
    return torch.stack([torch._VF.gru(x, h0, list(w), True, 1, 0.0, True, False, True)[0] for w in members])


def lstm_classifier_per_sample_grads(weights: Sequence[Tensor], x: Tensor, y: Tensor) -> List[Tensor]:
    """Per-sample gradients of ``cross_entropy(linear(lstm(x_i)[-1]), y_i)``
    for a 1-layer LSTM (I -> H, zero initial state) and a linear head (H -> C).
    ``weights``: ``w_ih, w_hh, b_ih, b_hh, w_out, b_out`` (nn.Module order), ``x``
    [B, T, I], ``y`` [B]. Returns their gradients, each with a leading B."""
    w_ih, w_hh, b_ih, b_hh, w_out, b_out = weights
    batch, steps, in_f = x.shape
    hidden = w_hh.shape[1]
    h1, h2, h3 = hidden, 2 * hidden, 3 * hidden
    # Forward into time-major buffers: activated gates [T, B, 4H] (i, f, o
    # sigmoid; g tanh), tanh of the cells [T, B, H]; cells and hidden states
    # [T + 1, B, H], row 0 the zero initial state.
    xp = torch.addmm(b_ih + b_hh, x.transpose(0, 1).reshape(steps * batch, in_f), w_ih.t())
    xp = xp.view(steps, batch, 4 * hidden)
    acts = x.new_empty(steps, batch, 4 * hidden)
    cells = x.new_zeros(steps + 1, batch, hidden)
    tanh_c = x.new_empty(steps, batch, hidden)
    hs = x.new_zeros(steps + 1, batch, hidden)
    w_hh_t = w_hh.t()
    for t in range(steps):
        a = acts[t]
        gates = torch.addmm(xp[t], hs[t], w_hh_t) if t else xp[t]  # h0 = 0: no hidden projection
        torch.sigmoid(gates, out=a)
        torch.tanh(gates[:, h2:h3], out=a[:, h2:h3])
        torch.addcmul(a[:, h1:h2] * cells[t], a[:, :h1], a[:, h2:h3], out=cells[t + 1])
        torch.tanh(cells[t + 1], out=tanh_c[t])
        torch.mul(a[:, h3:], tanh_c[t], out=hs[t + 1])
    logits = torch.addmm(b_out, hs[steps], w_out.t())
    d_logits = cross_entropy_grad(logits, y)  # B, C
    # Local derivatives of all steps at once, [T, B, 4H]: d i, d f, d g (pre-
    # activation) per unit of d c; d o per unit of d h. And d c per d h, [T, B, H].
    i, f, g, o = acts[..., :h1], acts[..., h1:h2], acts[..., h2:h3], acts[..., h3:]
    tc = tanh_c
    local = torch.cat([g * i * (1 - i), cells[:-1] * f * (1 - f), i * (1 - g * g), tc * o * (1 - o)], 2)
    c_per_h = o * (1 - tc * tc)
    # Backward through time: dg holds d loss / d gate pre-activations, batch-major.
    dg = x.new_empty(batch, steps, 4 * hidden)
    dh = d_logits @ w_out  # B, H
    dc = torch.zeros_like(dh)  # from the steps after t, through f
    for t in reversed(range(steps)):
        d = dg[:, t]
        dc = torch.addcmul(dc, dh, c_per_h[t])
        # d i, d f, d g: d c times their local derivatives, one kernel
        torch.mul(dc.unsqueeze(1), local[t, :, :h3].view(batch, 3, hidden),
                  out=d[:, :h3].view(batch, 3, hidden))
        torch.mul(dh, local[t, :, h3:], out=d[:, h3:])
        if t > 0:
            dc = dc * f[t]
            dh = d @ w_hh
    d_t = dg.transpose(1, 2)  # B, 4H, T
    g_b = dg.sum(1)  # both biases: a sum over time
    return [
        torch.bmm(d_t, x),                           # B,4H,T x B,T,I -> B,4H,I
        torch.bmm(d_t, hs[:steps].transpose(0, 1)),  # B,4H,T x B,T,H (h_{t-1}) -> B,4H,H
        g_b, g_b,
        d_logits.unsqueeze(2) * hs[steps].unsqueeze(1),  # B,C,H
        d_logits,
    ]
