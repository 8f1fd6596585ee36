// An LSTM step's pointwise part as one CPU loop over float32 rows (Note [The
// fused LSTM cell]).
#pragma once

#include <ATen/core/Tensor.h>

namespace batchrules {

// Whether lstm_cell_forward_cpu runs a recurrence whose step gates are these
// (float32 on the CPU); its other operands must have contiguous rows.
bool lstm_cell_fusable(const at::Tensor& gates);

// pre = gates + bias (E,1,4H, contiguous rows; zeros for none); i,f,o = sigmoid, g = tanh of pre's parts;
// act <- [i, f, g, o], c_new <- f c + i g, h <- o tanh(c_new). gates E,N,4H;
// c, c_new, h E,N,H; act E,N,4H.
void lstm_cell_forward_cpu(const at::Tensor& gates, const at::Tensor& bias, const at::Tensor& c,
                           at::Tensor& act, at::Tensor& c_new, at::Tensor& h);

}  // namespace batchrules
