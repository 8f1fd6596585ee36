// Backward nodes of the batchrules operators.
//
// Note [Hand-written autograd nodes]
// torch::autograd::Function is rejected under functorch transforms, and a
// CompositeImplicitAutograd op would decompose before its batching rule could
// run under vmap(grad(...)). So each operator has an Autograd-key kernel that
// builds one of these nodes by hand, the way PyTorch's generated VariableType
// code does (collect_next_edges, SavedVariable, set_history). The nodes call
// the operators back through the dispatcher, so every transform sees them.
#pragma once

#include <ATen/TensorOperators.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

namespace batchrules {

// torch 2.13 owns autograd nodes through c10::intrusive_ptr, older releases
// (e.g. the 2.11 CUDA builds) through std::shared_ptr; build against either.
constexpr bool kIntrusiveNodes =
    std::is_base_of_v<c10::intrusive_ptr_target, torch::autograd::Node>;

template <class T>
using NodePtr = std::conditional_t<kIntrusiveNodes, c10::intrusive_ptr<T>, std::shared_ptr<T>>;

template <class T>
NodePtr<T> make_node() {
  if constexpr (kIntrusiveNodes) {
    return c10::make_intrusive<T>();
  } else {
    return std::make_shared<T>();
  }
}

// Sum of two partial gradients, either of which may be undefined (absent).
inline at::Tensor add_defined(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined()) return b;
  if (!b.defined()) return a;
  return a + b;
}

// Backward of linear(input, weight, bias): one batchrules::linear_backward
// call asking only for the gradients the graph needs.
struct LinearBackward0 : public torch::autograd::Node {
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  std::string name() const override { return "BatchrulesLinearBackward0"; }
  void release_variables() override;

  torch::autograd::SavedVariable input_;
  torch::autograd::SavedVariable weight_;
  bool has_bias_ = false;
  // Set when the bias is broadcast to the output in a way other than along
  // the leading dims (e.g. a 0-dim bias): its gradient is summed to this shape.
  std::optional<std::vector<c10::SymInt>> bias_sum_to_;
};

// Backward of linear_backward(self, grad_output, weight, mask): the double
// backward of linear, written with linear / linear_backward.
struct LinearBackwardBackward0 : public torch::autograd::Node {
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  std::string name() const override { return "BatchrulesLinearBackwardBackward0"; }
  void release_variables() override;

  torch::autograd::SavedVariable self_;
  torch::autograd::SavedVariable grad_output_;
  torch::autograd::SavedVariable weight_;
};

}  // namespace batchrules
