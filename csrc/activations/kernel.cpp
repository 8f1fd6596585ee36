// Backend kernels (CompositeExplicitAutograd: CPU, CUDA, Meta, ... alike).
//
// Each op validates its inputs with our messages and calls ATen's own fused
// kernel below autograd (see Note [Eager kernels delegate to ATen's fused
// paths]): silu/mish and silu_backward/mish_backward are one kernel each,
// exactly what eager F.silu / F.mish and their plain backward run.
#include "activations/definitions.h"
#include "activations/shape_checks.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace batchrules {

namespace {

Tensor activation_kernel(const Activation& act, Tensor (*aten_op)(const Tensor&),
                         const Tensor& self) {
  TORCH_CHECK(self.defined(), act.name, ": expected self to be a tensor, but got None");
  check_activation_dtype(act, act.name, self, "self");
  return aten_op(self);
}

Tensor activation_backward_kernel(const Activation& act,
                                  Tensor (*aten_op)(const Tensor&, const Tensor&),
                                  const Tensor& grad_output, const Tensor& self) {
  TORCH_CHECK(grad_output.defined() && self.defined(), act.backward_name,
              ": expected grad_output and self to be tensors, but got None");
  check_activation_backward_operands(act, grad_output, self);
  return aten_op(grad_output, self);
}

Tensor silu_kernel(const Tensor& self) {
  return activation_kernel(kSilu, &at::silu, self);
}

Tensor silu_backward_kernel(const Tensor& grad_output, const Tensor& self) {
  return activation_backward_kernel(kSilu, &at::silu_backward, grad_output, self);
}

Tensor mish_kernel(const Tensor& self) {
  return activation_kernel(kMish, &at::mish, self);
}

Tensor mish_backward_kernel(const Tensor& grad_output, const Tensor& self) {
  return activation_backward_kernel(kMish, &at::mish_backward, grad_output, self);
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, CompositeExplicitAutograd, m) {
  m.impl("silu", TORCH_FN(silu_kernel));
  m.impl("silu_backward", TORCH_FN(silu_backward_kernel));
  m.impl("mish", TORCH_FN(mish_kernel));
  m.impl("mish_backward", TORCH_FN(mish_backward_kernel));
}

}  // namespace batchrules
