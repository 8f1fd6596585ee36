// Shape validation shared by the eager kernels and the batching rules.
//
// The batching rules call these with *logical* (per-example) sizes, so the
// messages a user sees under vmap name the shapes of one example, as in eager.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>
#include <c10/util/ArrayRef.h>

#include <optional>

namespace batchrules {

using SymShape = c10::SymDimVector;

// Validates linear(input, weight, bias) and returns the output shape.
// Mirrors what torch.nn.functional.linear accepts, with clearer messages.
SymShape check_linear_shapes(c10::SymIntArrayRef input, c10::SymIntArrayRef weight,
                             std::optional<c10::SymIntArrayRef> bias);

// Validates linear_backward(self, grad_output, weight): grad_output must have
// exactly the shape of linear(self, weight).
void check_linear_backward_shapes(c10::SymIntArrayRef self, c10::SymIntArrayRef grad_output,
                                  c10::SymIntArrayRef weight);

// Eager-only checks that two operands share dtype and device (under vmap the
// physical tensors already do). A 0-dim CPU `b` may sit beside any device, as
// ATen's CPU-scalar rule allows.
// batchrules.linear's input and weight: the same dtype (aten's message) and device.
void check_input_and_weight(const char* op, const at::Tensor& input, const at::Tensor& weight);

void check_same_dtype_and_device(const char* op, const at::Tensor& a, const char* a_name,
                                 const at::Tensor& b, const char* b_name);

}  // namespace batchrules
