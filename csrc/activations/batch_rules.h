// vmap batching rules for the activation ops, in functorch's style:
// physical tensors with their optional batch dim in, (result, bdim) out.
#pragma once

#include "activations/definitions.h"
#include "common/batching_utils.h"

#include <optional>

namespace batchrules {

BatchedResult activation_batch_rule(const Activation& act, const Tensor& self,
                                    std::optional<int64_t> self_bdim);

BatchedResult activation_backward_batch_rule(const Activation& act, const Tensor& grad_output,
                                             std::optional<int64_t> grad_output_bdim,
                                             const Tensor& self, std::optional<int64_t> self_bdim);

}  // namespace batchrules
