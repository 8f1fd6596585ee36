// The linear family under autocast: Note [Autocast policy of batchrules' operators].
#pragma once

#include "ops.h"

#include <c10/core/DeviceType.h>

namespace batchrules {

// The op on its operands cast as CastPolicy::lower_precision_fp casts for
// `device`, called with that device's autocast key excluded.
Tensor linear_lower_precision(c10::DeviceType device, const Tensor& input, const Tensor& weight,
                              const std::optional<Tensor>& bias);
TensorTriple linear_backward_lower_precision(c10::DeviceType device, const Tensor& self,
                                             const Tensor& grad_output, const Tensor& weight,
                                             std::array<bool, 3> output_mask);

}  // namespace batchrules
