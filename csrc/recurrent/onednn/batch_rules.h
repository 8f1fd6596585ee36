// Batching rules for oneDNN's fused LSTM layer, functorch's style: physical
// operands with their batch dims in, physical outputs with theirs out. See
// Note [oneDNN's LSTM layer under transforms] (kernel_choice.cpp).
#pragma once

#include "recurrent/batch_rules.h"

#include <tuple>

namespace batchrules {

// {output, h_n, c_n} of aten::lstm over shared weights, the input's batch dim
// folded into its rows (Note [An LSTM over per-sample sequences as one eager
// call]); runs below the transforms.
std::array<BatchedResult, 3> lstm_folded_batch_rule(const Tensor& input, int64_t input_bdim,
                                                    const Tensor& h0, OptBdim h0_bdim,
                                                    const Tensor& c0, OptBdim c0_bdim,
                                                    at::TensorList params, bool has_biases,
                                                    int64_t num_layers, double dropout, bool train,
                                                    bool bidirectional, bool batch_first);

// FuncTorchBatched kernel for aten::mkldnn_rnn_layer (registered by routes.cpp).
std::tuple<Tensor, Tensor, Tensor, Tensor> mkldnn_rnn_layer_batched(
    const Tensor& input, const Tensor& w0, const Tensor& w1, const Tensor& w2, const Tensor& w3,
    const Tensor& hx, const Tensor& cx, bool reverse, at::IntArrayRef batch_sizes, int64_t mode,
    int64_t hidden_size, int64_t num_layers, bool has_biases, bool bidirectional, bool batch_first,
    bool train);

}  // namespace batchrules
