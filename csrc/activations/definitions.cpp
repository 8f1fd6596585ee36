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

const Activation kSilu{"batchrules.silu",
                       "batchrules.silu_backward",
                       "BatchrulesSiluBackward0",
                       "BatchrulesSiluBackwardBackward0",
                       /*supports_complex=*/true,
                       &silu_op,
                       &silu_backward_op,
                       &silu_times_second_derivative};

const Activation kMish{"batchrules.mish",
                       "batchrules.mish_backward",
                       "BatchrulesMishBackward0",
                       "BatchrulesMishBackwardBackward0",
                       /*supports_complex=*/false,
                       &mish_op,
                       &mish_backward_op,
                       &mish_times_second_derivative};

}  // namespace batchrules
