// The Autograd-key kernel of batchrules::normalize: its node saves the two
// outputs, not the input. See Note [Hand-written autograd nodes] and Note
// [The normalization's derivative].
#include "normalize/autograd_nodes.h"
#include "ops.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

namespace batchrules {

namespace {

using torch::autograd::SavedVariable;

std::tuple<Tensor, Tensor> normalize_autograd(c10::DispatchKeySet ks, const Tensor& input,
                                              at::IntArrayRef normalized_shape, double eps) {
  const Tensor dx = tangent(input);
  NodePtr<NormalizeBackward0> grad_fn;
  if (torch::autograd::compute_requires_grad(input)) {
    grad_fn = make_node<NormalizeBackward0>();
    grad_fn->set_next_edges(torch::autograd::collect_next_edges(input));
    grad_fn->normalized_shape_ = normalized_shape.vec();
  }
  std::tuple<Tensor, Tensor> result;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    result = normalize_op().redispatch(ks & c10::after_autograd_keyset, input, normalized_shape,
                                       eps);
  }
  auto& [normalized, rstd] = result;
  if (grad_fn) {
    torch::autograd::set_history({normalized, rstd}, grad_fn);
  }
  // Forward AD: the map is symmetric (Note [The normalization's derivative]).
  // Both tangents are computed before either is set: x_hat itself becomes a
  // dual tensor when its tangent is.
  if (dx.defined()) {
    const Tensor d_normalized =
        normalize_derivative(dx, Tensor(), normalized, rstd, normalized_shape);
    const Tensor d_rstd = rstd_tangent(dx, normalized, rstd, normalized_shape);
    normalized._set_fw_grad(d_normalized, /*level=*/0, /*is_inplace_op=*/false);
    rstd._set_fw_grad(d_rstd, /*level=*/0, /*is_inplace_op=*/false);
  }
  // Saved last, with their tangents (forward over reverse), as aten's
  // generated kernels save outputs.
  if (grad_fn) {
    grad_fn->normalized_ = SavedVariable(normalized, /*is_output=*/true);
    grad_fn->rstd_ = SavedVariable(rstd, /*is_output=*/true);
  }
  return result;
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, Autograd, m) {
  m.impl("normalize", TORCH_FN(normalize_autograd));
}

}  // namespace batchrules
