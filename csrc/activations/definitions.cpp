// The activations' second derivatives, and their descriptors built from
// activation_list.h.
#include "activations/definitions.h"

#include <ATen/ATen.h>

namespace batchrules {

namespace {

// silu(x) = x s with s = sigmoid(x):
//   f'  = s (1 + x (1 - s))
//   f'' = s (1 - s) (2 + x (1 - 2 s))
// and s (1 - s) a is sigmoid_backward(a, s).
Tensor silu_times_second_derivative(const Tensor& grad, const Tensor& self) {
  const Tensor s = at::sigmoid(self);
  return at::sigmoid_backward(grad * (self * (1 - 2 * s) + 2), s);
}

// mish(x) = x t with t = tanh(softplus(x)), s = sigmoid(x), t' = (1 - t^2) s:
//   f'  = t + x s (1 - t^2)
//   f'' = s (1 - t^2) (2 + x (1 - s (1 + 2 t)))
// and (1 - t^2) a is tanh_backward(a, t).
Tensor mish_times_second_derivative(const Tensor& grad, const Tensor& self) {
  const Tensor s = at::sigmoid(self);
  const Tensor t = at::tanh(at::softplus(self));
  return at::tanh_backward(grad * s * (self * (1 - s * (1 + 2 * t)) + 2), t);
}

}  // namespace

#define BATCHRULES_DEFINE_ACTIVATION(name, Name, supports_complex, formula)    \
  const Activation k##Name{#name,                                              \
                           "batchrules." #name,                                \
                           "batchrules." #name "_backward",                    \
                           "Batchrules" #Name "Backward0",                     \
                           "Batchrules" #Name "BackwardBackward0",             \
                           supports_complex,                                   \
                           formula,                                            \
                           &name##_op,                                         \
                           &name##_backward_op,                                \
                           [](const Tensor& self) { return at::name(self); },  \
                           [](const Tensor& grad_output, const Tensor& self) { \
                             return at::name##_backward(grad_output, self);    \
                           },                                                  \
                           &name##_times_second_derivative};
BATCHRULES_ACTIVATIONS(BATCHRULES_DEFINE_ACTIVATION)
#undef BATCHRULES_DEFINE_ACTIVATION

c10::ArrayRef<const Activation*> all_activations() {
#define BATCHRULES_ACTIVATION_ADDRESS(name, Name, ...) &k##Name,
  static const Activation* const activations[] = {
      BATCHRULES_ACTIVATIONS(BATCHRULES_ACTIVATION_ADDRESS)};
#undef BATCHRULES_ACTIVATION_ADDRESS
  return activations;
}

}  // namespace batchrules
