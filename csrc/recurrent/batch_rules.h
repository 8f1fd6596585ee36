// Batching rules of the recurrent family, functorch's style: physical
// operands with their batch dims in, physical outputs with theirs out.
#pragma once

#include "common/batching_utils.h"

#include <ATen/core/ATen_fwd.h>

#include <array>
#include <optional>

namespace batchrules {

using OptBdim = std::optional<int64_t>;

// {output, h_n, c_n, workspace}
std::array<BatchedResult, 4> rnn_recurrence_batch_rule(
    const Tensor& input_gates, OptBdim input_gates_bdim, const Tensor& h0, OptBdim h0_bdim,
    const Tensor& c0, OptBdim c0_bdim, const Tensor& w_hh, OptBdim w_hh_bdim, const Tensor& b_hh,
    OptBdim b_hh_bdim, const Tensor& w_hr, OptBdim w_hr_bdim, int64_t mode, bool reverse);

// {grad_input_gates, grad_hidden_gates, grad_h0, grad_c0, grad_projected}
std::array<BatchedResult, 5> rnn_recurrence_backward_batch_rule(
    const Tensor& grad_output, OptBdim grad_output_bdim, const Tensor& grad_h_n,
    OptBdim grad_h_n_bdim, const Tensor& grad_c_n, OptBdim grad_c_n_bdim, const Tensor& h0,
    OptBdim h0_bdim, const Tensor& c0, OptBdim c0_bdim, const Tensor& w_hh, OptBdim w_hh_bdim,
    const Tensor& w_hr, OptBdim w_hr_bdim, const Tensor& output, OptBdim output_bdim,
    const Tensor& workspace, OptBdim workspace_bdim, int64_t mode, bool reverse);

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
    int64_t hidden_size, int64_t num_layers, bool has_biases, bool bidirectional,
    bool batch_first, bool train);

}  // namespace batchrules
