// Backward nodes of the activation family. See Note [Hand-written autograd
// nodes] and Note [One backward kernel per activation].
#pragma once

#include "activations/definitions.h"
#include "common/autograd_utils.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/saved_variable.h>

namespace batchrules {

// Backward of <act>(self): one <act>_backward(grad, self) call.
struct ActivationBackward0 : public torch::autograd::Node {
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  std::string name() const override { return act_->backward_node; }
  void release_variables() override;

  const Activation* act_ = nullptr;
  torch::autograd::SavedVariable self_;
};

// Backward of <act>_backward(grad_output, self): the activation's double
// backward.
struct ActivationBackwardBackward0 : public torch::autograd::Node {
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  std::string name() const override { return act_->double_backward_node; }
  void release_variables() override;

  const Activation* act_ = nullptr;
  torch::autograd::SavedVariable grad_output_;
  torch::autograd::SavedVariable self_;
};

}  // namespace batchrules
