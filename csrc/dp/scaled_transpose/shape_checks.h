// Input validation of batchrules::scaled_transpose, shared by its kernels.
#pragma once

#include <ATen/core/Tensor.h>

namespace batchrules {

// x [B, T, K] and scale [B] of one floating dtype and device.
void check_scaled_transpose_inputs(const at::Tensor& x, const at::Tensor& scale);

}  // namespace batchrules
