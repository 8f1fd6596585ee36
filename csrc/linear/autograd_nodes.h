// Backward nodes of the linear family. See Note [Hand-written autograd nodes].
#pragma once

#include "common/autograd_utils.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <memory>
#include <optional>
#include <vector>

namespace batchrules {

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
