#include "normalize/autograd_nodes.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/accumulate.h>

#include <numeric>

namespace batchrules {

using torch::autograd::variable_list;

namespace {

// The normalized dims: the last len(normalized_shape) of x.
std::vector<int64_t> normalized_dims(const at::Tensor& x, at::IntArrayRef normalized_shape) {
  std::vector<int64_t> dims(normalized_shape.size());
  std::iota(dims.begin(), dims.end(), x.dim() - static_cast<int64_t>(normalized_shape.size()));
  return dims;
}

}  // namespace

// Note [The normalization's derivative]
// With x_hat = (x - mean) r and r = (var + eps)^-1/2 over the normalized dims
// (n elements), dr = -r^2 mean(x_hat dx) and
//   dx_hat = r (dx - mean(dx) - x_hat mean(x_hat dx)),
// a symmetric map: the backward of a gradient g of x_hat is the same formula
// applied to g, and a gradient g_r of r adds -r^2 g_r x_hat / n. Without a
// graph to build, the x_hat part is aten's fused layer-norm backward run on
// x_hat itself (mean 0, rstd 1), scaled by r. With one (create_graph), it is
// written in differentiable ops: aten's double backward of native_layer_norm
// would treat the given mean 0 and rstd 1 as x_hat's own statistics.
at::Tensor normalize_derivative(const at::Tensor& d_normalized, const at::Tensor& d_rstd,
                                const at::Tensor& normalized, const at::Tensor& rstd,
                                at::IntArrayRef normalized_shape) {
  const auto dims = normalized_dims(normalized, normalized_shape);
  at::Tensor result;
  if (d_normalized.defined()) {
    if (at::GradMode::is_enabled()) {
      const at::Tensor centred = d_normalized - d_normalized.mean(dims, /*keepdim=*/true);
      result = rstd * (centred - normalized * (normalized * d_normalized).mean(dims, true));
    } else {
      auto [unit, unused_mean, unused_rstd] = at::native_layer_norm_backward(
          d_normalized, normalized, normalized_shape, at::zeros_like(rstd), at::ones_like(rstd),
          std::nullopt, std::nullopt, {true, false, false});
      result = unit * rstd;
    }
  }
  if (d_rstd.defined()) {
    const int64_t n = c10::multiply_integers(normalized_shape);
    result = add_defined(result, -(rstd * rstd * d_rstd / n) * normalized);
  }
  return result;
}

at::Tensor rstd_tangent(const at::Tensor& dx, const at::Tensor& normalized, const at::Tensor& rstd,
                        at::IntArrayRef normalized_shape) {
  const auto dims = normalized_dims(normalized, normalized_shape);
  return -(rstd * rstd) * (normalized * dx).mean(dims, /*keepdim=*/true);
}

void NormalizeBackward0::release_variables() {
  std::lock_guard<std::mutex> lock(mutex_);
  normalized_.reset_data();
  rstd_.reset_data();
}

variable_list NormalizeBackward0::apply(variable_list&& grads) {
  std::lock_guard<std::mutex> lock(mutex_);
  variable_list result(num_outputs());
  if (!grads[0].defined() && !grads[1].defined()) {
    return result;
  }
  const auto self = owning_ptr<torch::autograd::Node>(this);
  result[0] = normalize_derivative(grads[0], grads[1], normalized_.unpack(self),
                                   rstd_.unpack(self), normalized_shape_);
  return result;
}

}  // namespace batchrules
