#include "activations/autograd_nodes.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>

namespace batchrules {

using torch::autograd::variable_list;

void ActivationBackward0::release_variables() {
  std::lock_guard<std::mutex> lock(mutex_);
  self_.reset_data();
}

variable_list ActivationBackward0::apply(variable_list&& grads) {
  std::lock_guard<std::mutex> lock(mutex_);
  variable_list result(num_outputs());
  const Tensor& grad = grads[0];
  if (grad.defined() && task_should_compute_output(0)) {
    result[0] = act_->backward_op().call(grad, self_.unpack());
  }
  return result;
}

void ActivationBackwardBackward0::release_variables() {
  std::lock_guard<std::mutex> lock(mutex_);
  grad_output_.reset_data();
  self_.reset_data();
}

// With out = g f'(x) (g and x broadcast to out's shape) and incoming gg:
//   d grad_output = gg f'(x)       = <act>_backward(gg, x)
//   d self        = gg g f''(x)
// each summed back to its operand's shape where it was broadcast.
variable_list ActivationBackwardBackward0::apply(variable_list&& grads) {
  std::lock_guard<std::mutex> lock(mutex_);
  variable_list result(num_outputs());
  const Tensor& gg = grads[0];
  const bool need_grad_output = task_should_compute_output(0);
  const bool need_self = task_should_compute_output(1);
  if (!gg.defined() || !(need_grad_output || need_self)) {
    return result;
  }
  const Tensor grad_output = grad_output_.unpack();
  const Tensor self = self_.unpack();
  if (need_grad_output) {
    result[0] = at::sum_to(act_->backward_op().call(gg, self), grad_output.sym_sizes());
  }
  if (need_self) {
    result[1] = at::sum_to(act_->times_second_derivative(gg * grad_output, self), self.sym_sizes());
  }
  return result;
}

}  // namespace batchrules
