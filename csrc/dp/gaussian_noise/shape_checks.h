// Input validation of batchrules::gaussian_fill_, shared by its kernels.
#pragma once

#include <ATen/core/Tensor.h>

namespace batchrules {

void check_gaussian_fill_inputs(const at::Tensor& self, double stddev);

}  // namespace batchrules
