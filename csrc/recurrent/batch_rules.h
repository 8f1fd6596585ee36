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

}  // namespace batchrules
