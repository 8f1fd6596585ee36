// Input validation shared by the eager kernels and the batching rules.
//
// The batching rules call these with *logical* (per-example) sizes, so the
// messages a user sees under vmap name the shapes of one example, as in eager.
#pragma once

#include "activations/definitions.h"

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace batchrules {

// The activation's kernels take floating-point tensors (and complex ones
// where ATen's do); anything else is a TypeError-like RuntimeError naming it.
void check_activation_dtype(const Activation& act, const char* op, const at::Tensor& t,
                            const char* name);

// <act>_backward(grad_output, self): same dtype and device, and shapes that
// broadcast against each other (as in aten::silu_backward).
void check_activation_backward_shapes(const Activation& act, c10::SymIntArrayRef grad_output,
                                      c10::SymIntArrayRef self);

void check_activation_backward_operands(const Activation& act, const at::Tensor& grad_output,
                                        const at::Tensor& self);

}  // namespace batchrules
