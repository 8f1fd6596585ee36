// Input validation of batchrules::ghost_norms_sq, shared by its kernels.
#pragma once

#include <ATen/core/Tensor.h>

namespace batchrules {

// rows [B, T, I] and grads [B, T, O] of one dtype and device, float32 or
// float64; biases >= 0.
void check_ghost_norm_inputs(const at::Tensor& rows, const at::Tensor& grads, int64_t biases);

}  // namespace batchrules
