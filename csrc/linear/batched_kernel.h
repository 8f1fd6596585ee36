// The linear family's FuncTorchBatched kernel for an aten op, registered by
// routes.cpp while routing is on.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>

namespace batchrules {

// aten::addmm: Note [Folding addmm's batch into its rows] (batch_rule_addmm.cpp).
at::Tensor addmm_batched(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                         const c10::Scalar& beta, const c10::Scalar& alpha);

}  // namespace batchrules
