// The backward node of batchrules::normalize. See Note [Hand-written
// autograd nodes] and Note [The normalization's derivative].
#pragma once

#include "common/autograd_utils.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <vector>

namespace batchrules {

// Backward of normalize(x) -> (x_hat, rstd): both saved as outputs, so the
// input is not kept.
struct NormalizeBackward0 : public torch::autograd::Node {
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  std::string name() const override { return "NormalizeBackward0"; }
  void release_variables() override;

  std::vector<int64_t> normalized_shape_;
  torch::autograd::SavedVariable normalized_;
  torch::autograd::SavedVariable rstd_;
};

// The input's tangent (forward AD) or gradient (backward) of the
// normalization, from a tangent or gradient of x_hat (and of rstd, either
// may be undefined). See Note [The normalization's derivative].
at::Tensor normalize_derivative(const at::Tensor& d_normalized, const at::Tensor& d_rstd,
                                const at::Tensor& normalized, const at::Tensor& rstd,
                                at::IntArrayRef normalized_shape);

// The tangent of rstd from the input's tangent dx: -rstd^2 mean(x_hat dx).
at::Tensor rstd_tangent(const at::Tensor& dx, const at::Tensor& normalized, const at::Tensor& rstd,
                        at::IntArrayRef normalized_shape);

}  // namespace batchrules
