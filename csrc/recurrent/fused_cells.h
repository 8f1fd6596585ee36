// An LSTM or GRU step's pointwise part as one CPU loop over float32 rows
// (Note [The fused LSTM cell]; lstm_cell_cpu.cpp, gru_cell_cpu.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace batchrules {

// Whether the fused cells run a recurrence of t's dtype and device (float32
// on the CPU); their operands must then have contiguous rows.
inline bool cell_fusable(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.device().is_cpu();
}

// pre = x + hidden + bias (the step's input gates, h W_hh^T, and E,1,4H
// zeros for no bias); i,f,o = sigmoid and g = tanh of pre's parts; act <-
// [i, f, g, o], c_new <- f c + i g, h <- o tanh(c_new). x, hidden, act
// E,N,4H; c, c_new, h E,N,H; all with contiguous rows.
void lstm_cell_forward_cpu(const at::Tensor& x, const at::Tensor& hidden, const at::Tensor& bias,
                           const at::Tensor& c, at::Tensor& act, at::Tensor& c_new, at::Tensor& h);

// The step's backward from dh + dh_out (reaching h', after any projection:
// from the next step and from the output) and dc (reaching c'), the
// forward's act = [i, f, g, o] and c_new = c', and c, the state the step
// started from: d_gates <- the gradient of the gate pre-activations
// (E,N,4H), dc_prev <- that of c. All E,N,* with contiguous rows; dc_prev
// must not alias dc.
void lstm_cell_backward_cpu(const at::Tensor& dh, const at::Tensor& dh_out, const at::Tensor& dc,
                            const at::Tensor& act, const at::Tensor& c_new, const at::Tensor& c,
                            at::Tensor& d_gates, at::Tensor& dc_prev);

// x = the step's input gates (E,N,3H), hidden = h W_hh^T + b_hh (E,N,3H), h
// (E,N,H): r, z = sigmoid(x + hidden) of their parts, n = tanh(x_n + r
// hidden_n); ws <- [r, z, n, hidden_n] (E,N,4H, the layout the GRU backward
// reads), h_new <- n + z (h - n). All with contiguous rows.
void gru_cell_forward_cpu(const at::Tensor& x, const at::Tensor& hidden, const at::Tensor& h,
                          at::Tensor& ws, at::Tensor& h_new);

}  // namespace batchrules
