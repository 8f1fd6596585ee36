// aten's recurrent ops (nn.LSTM/GRU/RNN and their cells) as linear input
// projections and batchrules::rnn_recurrence: what routes.cpp sends them to.
#pragma once

#include "ops.h"
#include "recurrent/recurrence.h"

#include <ATen/core/List.h>

namespace batchrules {

// How an LSTM layer runs: Note [oneDNN's LSTM layer under transforms].
enum class LstmKernel {
  Recurrence,       // linear + batchrules::rnn_recurrence
  OneDnnInference,  // aten::mkldnn_rnn_layer, nothing differentiated
  OneDnnTraining,   // batchrules::fused_lstm_layer, oneDNN's backward
};

// Which LSTM kernel the active transforms and the operands allow.
LstmKernel lstm_kernel(const Tensor& input, at::TensorList hx, at::TensorList params,
                       bool batch_first);

struct RnnOptions {
  RnnMode mode;
  bool has_biases;
  int64_t num_layers;
  double dropout;
  bool train;
  bool bidirectional;
  bool batch_first;
  LstmKernel lstm_kernel = LstmKernel::Recurrence;
};

// The shape checks of aten::lstm/gru/rnn_*.input (see run_rnn), with the
// operands' own (per-example, under vmap) sizes in every message.
void check_rnn_operands(const Tensor& input, const Tensor& hx, const Tensor& cx,
                        at::TensorList params, const RnnOptions& options);

// Where vmap is the only transform and only the input and states are batched
// at it: aten's LSTM once, over the vmap dim folded into the rows (Note [An
// LSTM over per-sample sequences as one eager call]); nullopt elsewhere.
std::optional<std::tuple<Tensor, Tensor, Tensor>> lstm_over_folded_rows(const Tensor& input,
                                                                        const Tensor& hx,
                                                                        const Tensor& cx,
                                                                        at::TensorList params,
                                                                        const RnnOptions& options);

// aten::lstm/gru/rnn_*.input: input [T, N, I] ([N, T, I] batch_first), hx
// [L*D, N, P], cx [L*D, N, H] (LSTM), params per layer and direction
// w_ih, w_hh, (b_ih, b_hh), (w_hr). Returns output, h_n and c_n (LSTM).
std::tuple<Tensor, Tensor, Tensor> run_rnn(const Tensor& input, const Tensor& hx, const Tensor& cx,
                                           at::TensorList params, const RnnOptions& options);

// aten::lstm_cell/gru_cell/rnn_*_cell: input [N, I], hx [N, H]; returns h'
// and c' (LSTM).
std::tuple<Tensor, Tensor> run_cell(const Tensor& input, const Tensor& hx, const Tensor& cx,
                                    const Tensor& w_ih, const Tensor& w_hh, const OptTensor& b_ih,
                                    const OptTensor& b_hh, RnnMode mode);

}  // namespace batchrules
