#include "linear/autograd_nodes.h"

#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>

namespace batchrules {

using torch::autograd::variable_list;

namespace {

// Gradient of a bias that F.linear broadcast to the output. F.linear also
// accepts a bias with one more leading size-1 dim than a 1-D input's output
// ([1, O] for output [O]), so sum to the trailing dims, then view.
Tensor bias_grad_by_sum_to(const Tensor& grad, c10::SymIntArrayRef bias_shape) {
  if (bias_shape.size() <= static_cast<size_t>(grad.dim())) {
    return at::sum_to(grad, bias_shape);
  }
  const auto extra = bias_shape.size() - grad.dim();
  return at::sum_to(grad, bias_shape.slice(extra)).view_symint(bias_shape);
}

}  // namespace

void LinearBackward0::release_variables() {
  std::lock_guard<std::mutex> lock(mutex_);
  input_.reset_data();
  weight_.reset_data();
}

variable_list LinearBackward0::apply(variable_list&& grads) {
  std::lock_guard<std::mutex> lock(mutex_);
  variable_list result(num_outputs());
  const Tensor& grad = grads[0];
  const bool need_input = task_should_compute_output(0);
  const bool need_weight = task_should_compute_output(1);
  const bool need_bias = has_bias_ && task_should_compute_output(2);
  if (!grad.defined() || !(need_input || need_weight || need_bias)) {
    return result;
  }
  const bool bias_from_op = need_bias && !bias_sum_to_.has_value();
  if (need_input || need_weight || bias_from_op) {
    auto [grad_input, grad_weight, grad_bias] = dispatch_linear_backward(
        input_.unpack(), grad, weight_.unpack(), {need_input, need_weight, bias_from_op});
    result[0] = std::move(grad_input);
    result[1] = std::move(grad_weight);
    if (bias_from_op) {
      result[2] = std::move(grad_bias);
    }
  }
  if (need_bias && bias_sum_to_.has_value()) {
    result[2] = bias_grad_by_sum_to(grad, *bias_sum_to_);
  }
  return result;
}

void LinearBackwardBackward0::release_variables() {
  std::lock_guard<std::mutex> lock(mutex_);
  self_.reset_data();
  grad_output_.reset_data();
  weight_.reset_data();
}

// With gi = g @ conj(W), gW = g^T @ conj(x), gb = sum(g) and incoming
// gradients (ggi, ggW, ggb):
//   d self        = g @ conj(ggW)                 = linear_backward(x, g, ggW).gi
//   d grad_output = ggi @ W^T + x @ ggW^T + ggb   = linear(ggi, W) + linear(x, ggW, ggb)
//   d weight      = g^T @ conj(ggi)               = linear_backward(ggi, g, W).gW
variable_list LinearBackwardBackward0::apply(variable_list&& grads) {
  std::lock_guard<std::mutex> lock(mutex_);
  variable_list result(num_outputs());
  const Tensor& ggi = grads[0];
  const Tensor& ggw = grads[1];
  const Tensor& ggb = grads[2];
  const bool need_self = task_should_compute_output(0);
  const bool need_grad_output = task_should_compute_output(1);
  const bool need_weight = task_should_compute_output(2);
  if (!(need_self || need_grad_output || need_weight)) {
    return result;
  }
  const Tensor self = self_.unpack();
  const Tensor grad_output = grad_output_.unpack();
  const Tensor weight = weight_.unpack();

  if (need_self && ggw.defined()) {
    result[0] = std::get<0>(dispatch_linear_backward(self, grad_output, ggw, {true, false, false}));
  }
  if (need_grad_output) {
    // A 1-D weight with 2-D input takes no bias in F.linear: add ggb apart.
    const bool fuse_ggb = ggb.defined() && ggw.defined() && weight.dim() == 2;
    Tensor g;
    if (ggw.defined()) {
      g = dispatch_linear(self, ggw, fuse_ggb ? std::optional<Tensor>(ggb) : std::nullopt);
    }
    if (ggi.defined()) {
      g = add_defined(g, dispatch_linear(ggi, weight));
    }
    if (ggb.defined() && !fuse_ggb) {
      g = g.defined() ? g + ggb : ggb.expand_symint(grad_output.sym_sizes());
    }
    result[1] = std::move(g);
  }
  if (need_weight && ggi.defined()) {
    result[2] =
        std::get<1>(dispatch_linear_backward(ggi, grad_output, weight, {false, true, false}));
  }
  return result;
}

}  // namespace batchrules
