// Input validation of batchrules::scaled_gram, shared by its kernels.
#pragma once

#include <ATen/core/Tensor.h>

namespace batchrules {

// x [B, T, M], y [B, T, N] and scale [B] of one floating dtype and device.
void check_scaled_gram_inputs(const at::Tensor& x, const at::Tensor& y, const at::Tensor& scale);

}  // namespace batchrules
