// FuncTorchBatched kernels of the linear family: the rules of batch_rule_*.cpp
// behind the shared plumbing (Note [Hand-written vmap plumbing]); aten::addmm's
// is registered by routes.cpp while routing is on.
#include "linear/batched_kernel.h"

#include "common/autocast.h"
#include "common/vmap_plumbing.h"
#include "linear/autocast.h"
#include "linear/batch_rules.h"
#include "ops.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace batchrules {

namespace {

Tensor linear_batched(const Tensor& input, const Tensor& weight,
                      const std::optional<Tensor>& bias) {
  if (autocast_enabled_for(input)) {  // See Note [Autocast under vmap].
    return linear_lower_precision(input.device().type(), input, weight, bias);
  }
  const BatchedKernelScope scope("batchrules.linear");
  const int64_t level = scope.level();
  if (!any_batched_at(level, input, weight, bias)) {
    return linear_op().call(input, weight, bias);
  }
  auto [x, x_bdim] = unwrap_at(input, level);
  auto [w, w_bdim] = unwrap_at(weight, level);
  auto [b, b_bdim] = unwrap_at(bias, level);
  auto [out, out_bdim] = linear_batch_rule(x, x_bdim, w, w_bdim, b, b_bdim);
  return wrap_at(out, out_bdim, level);
}

TensorTriple linear_backward_batched(const Tensor& self, const Tensor& grad_output,
                                     const Tensor& weight, std::array<bool, 3> output_mask) {
  if (autocast_enabled_for(self)) {  // See Note [Autocast under vmap].
    return linear_backward_lower_precision(self.device().type(), self, grad_output, weight,
                                           output_mask);
  }
  const BatchedKernelScope scope("batchrules.linear_backward");
  const int64_t level = scope.level();
  if (!any_batched_at(level, self, grad_output, weight)) {
    return linear_backward_op().call(self, grad_output, weight, output_mask);
  }
  auto [x, x_bdim] = unwrap_at(self, level);
  auto [g, g_bdim] = unwrap_at(grad_output, level);
  auto [w, w_bdim] = unwrap_at(weight, level);
  auto [gi, gi_bdim, gw, gw_bdim, gb, gb_bdim] =
      linear_backward_batch_rule(x, x_bdim, g, g_bdim, w, w_bdim, output_mask);
  return {wrap_at(gi, gi_bdim, level), wrap_at(gw, gw_bdim, level), wrap_at(gb, gb_bdim, level)};
}

// Whether addmm at `level` takes the folded rule: Note [Folding addmm's batch
// into its rows]. Sizes and dims here are the per-example (logical) ones.
bool addmm_folds(const Tensor& self, const Tensor& mat1, const Tensor& mat2, int64_t level) {
  if (!batched_at(mat1, level) || any_batched_at(level, self, mat2) || traced_for_compile(self) ||
      traced_for_compile(mat1) || traced_for_compile(mat2) || mat1.dim() != 2 || mat2.dim() != 2 ||
      mat1.sym_size(1) != mat2.sym_size(0) || self.scalar_type() != mat1.scalar_type() ||
      mat2.scalar_type() != mat1.scalar_type()) {
    return false;
  }
  const c10::SymInt& out_features = mat2.sym_size(1);
  const auto row = [&](const c10::SymInt& n) { return n == out_features || n == 1; };
  switch (self.dim()) {
    case 0: return true;
    case 1: return row(self.sym_size(0));
    case 2: return self.sym_size(0) == 1 && row(self.sym_size(1));
    default: return false;
  }
}

}  // namespace

Tensor addmm_batched(const Tensor& self, const Tensor& mat1, const Tensor& mat2,
                     const c10::Scalar& beta, const c10::Scalar& alpha) {
  static const AtenAutocasts policy("aten::addmm", "");
  if (policy.applies_to(mat1)) {  // See Note [Autocast under vmap].
    const LowerPrecisionCast cast(mat1.device().type());
    return at::addmm(cast(self), cast(mat1), cast(mat2), beta, alpha);
  }
  const auto layer = at::functorch::maybeCurrentDynamicLayer();
  if (layer.has_value() && addmm_folds(self, mat1, mat2, layer->layerId())) {
    const BatchedKernelScope scope("aten::addmm");
    const int64_t level = scope.level();
    // self and mat2 are not batched at this level: they are their own physical tensors
    auto [x, x_bdim] = unwrap_at(mat1, level);
    auto [out, out_bdim] = addmm_row_bias_batch_rule(self, x, *x_bdim, mat2, beta, alpha);
    return wrap_at(out, out_bdim, level);
  }
  // functorch's own decomposition (it has no addmm rule), batched by its rules
  return at::add(self * beta, at::mm(mat1, mat2), alpha);
}

TORCH_LIBRARY_IMPL(batchrules, FuncTorchBatched, m) {
  m.impl("linear", TORCH_FN(linear_batched));
  m.impl("linear_backward", TORCH_FN(linear_backward_batched));
}

}  // namespace batchrules
