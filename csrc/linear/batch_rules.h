// vmap batching rules for the batchrules operators, in functorch's style:
// physical tensors with their optional batch dim in, (result, bdim) out.
#pragma once

#include "common/batching_utils.h"

#include <c10/core/Scalar.h>

#include <array>
#include <optional>
#include <tuple>

namespace batchrules {

BatchedResult linear_batch_rule(const Tensor& input, std::optional<int64_t> input_bdim,
                                const Tensor& weight, std::optional<int64_t> weight_bdim,
                                const std::optional<Tensor>& bias,
                                std::optional<int64_t> bias_bdim);

std::tuple<Tensor, std::optional<int64_t>, Tensor, std::optional<int64_t>, Tensor,
           std::optional<int64_t>>
linear_backward_batch_rule(const Tensor& self, std::optional<int64_t> self_bdim,
                           const Tensor& grad_output, std::optional<int64_t> grad_output_bdim,
                           const Tensor& weight, std::optional<int64_t> weight_bdim,
                           std::array<bool, 3> output_mask);

// aten::addmm with only mat1 batched and a row bias: Note [Folding addmm's
// batch into its rows] (batch_rule_addmm.cpp).
BatchedResult addmm_row_bias_batch_rule(const Tensor& self, const Tensor& mat1, int64_t mat1_bdim,
                                        const Tensor& mat2, const c10::Scalar& beta,
                                        const c10::Scalar& alpha);

}  // namespace batchrules
