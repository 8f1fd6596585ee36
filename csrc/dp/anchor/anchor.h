#pragma once

#include <ATen/core/Tensor.h>

namespace batchrules {

// See Note [Anchored outputs] in batchrules/dp/tape.py.
void anchor(const at::Tensor& out);

}  // namespace batchrules
