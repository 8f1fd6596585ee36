// Backend kernels (CompositeExplicitAutograd: CPU, CUDA, Meta, ... alike).
//
// Each op validates its inputs with our messages and calls ATen's own fused
// kernel below autograd (see Note [Eager kernels delegate to ATen's fused
// paths]): <act> and <act>_backward are one kernel each, exactly what eager
// F.silu / F.mish and their plain backward run.
#include "activations/definitions.h"
#include "activations/shape_checks.h"

#include <torch/library.h>

namespace batchrules {

namespace {

template <const Activation& act>
Tensor activation_kernel(const Tensor& self) {
  TORCH_CHECK(self.defined(), act.name, ": expected self to be a tensor, but got None");
  check_activation_dtype(act, act.name, self, "self");
  return act.aten_forward(self);
}

template <const Activation& act>
Tensor activation_backward_kernel(const Tensor& grad_output, const Tensor& self) {
  TORCH_CHECK(grad_output.defined() && self.defined(), act.backward_name,
              ": expected grad_output and self to be tensors, but got None");
  check_activation_backward_operands(act, grad_output, self);
  return act.aten_backward(grad_output, self);
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, CompositeExplicitAutograd, m) {
#define BATCHRULES_REGISTER_ACTIVATION(name, Name, ...) \
  m.impl(#name, TORCH_FN(activation_kernel<k##Name>));  \
  m.impl(#name "_backward", TORCH_FN(activation_backward_kernel<k##Name>));
  BATCHRULES_ACTIVATIONS(BATCHRULES_REGISTER_ACTIVATION)
#undef BATCHRULES_REGISTER_ACTIVATION
}

}  // namespace batchrules
