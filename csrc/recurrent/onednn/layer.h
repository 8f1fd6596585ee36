// oneDNN's LSTM layer as routing uses it (Note [oneDNN's LSTM layer under
// transforms], onednn/kernel_choice.cpp).
#pragma once

#include "ops.h"

namespace batchrules {

// One LSTM layer and direction as aten::mkldnn_rnn_layer, which reads dense
// time-major operands (x: T,N,I; h0, c0: N,H) and takes zeros for absent
// biases. It keeps the workspace its backward reads only in grad mode.
RecurrenceResult onednn_lstm_forward(const Tensor& x, const Tensor& w_ih, const Tensor& w_hh,
                                     const OptTensor& b_ih, const OptTensor& b_hh, const Tensor& h0,
                                     const Tensor& c0, bool reverse, bool train);

}  // namespace batchrules
