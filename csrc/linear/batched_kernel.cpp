// FuncTorchBatched kernels of the linear family: the rules of batch_rule_*.cpp
// behind the shared plumbing (Note [Hand-written vmap plumbing]).
#include "common/autocast.h"
#include "common/vmap_plumbing.h"
#include "linear/autocast.h"
#include "linear/batch_rules.h"
#include "ops.h"

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

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, FuncTorchBatched, m) {
  m.impl("linear", TORCH_FN(linear_batched));
  m.impl("linear_backward", TORCH_FN(linear_backward_batched));
}

}  // namespace batchrules
