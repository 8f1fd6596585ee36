// FuncTorchBatched kernels of the activation family: the rules of
// batch_rule_pointwise.cpp behind the shared plumbing (Note [Hand-written vmap
// plumbing]).
#include "activations/batch_rules.h"
#include "common/vmap_plumbing.h"

#include <torch/library.h>

namespace batchrules {

namespace {

Tensor activation_batched(const Activation& act, const Tensor& self) {
  const BatchedKernelScope scope(act.name);
  const int64_t level = scope.level();
  if (!any_batched_at(level, self)) {
    return act.op().call(self);
  }
  auto [x, x_bdim] = unwrap_at(self, level);
  auto [out, out_bdim] = activation_batch_rule(act, x, x_bdim);
  return wrap_at(out, out_bdim, level);
}

Tensor activation_backward_batched(const Activation& act, const Tensor& grad_output,
                                   const Tensor& self) {
  const BatchedKernelScope scope(act.backward_name);
  const int64_t level = scope.level();
  if (!any_batched_at(level, grad_output, self)) {
    return act.backward_op().call(grad_output, self);
  }
  auto [g, g_bdim] = unwrap_at(grad_output, level);
  auto [x, x_bdim] = unwrap_at(self, level);
  auto [out, out_bdim] = activation_backward_batch_rule(act, g, g_bdim, x, x_bdim);
  return wrap_at(out, out_bdim, level);
}

Tensor silu_batched(const Tensor& self) {
  return activation_batched(kSilu, self);
}

Tensor silu_backward_batched(const Tensor& grad_output, const Tensor& self) {
  return activation_backward_batched(kSilu, grad_output, self);
}

Tensor mish_batched(const Tensor& self) {
  return activation_batched(kMish, self);
}

Tensor mish_backward_batched(const Tensor& grad_output, const Tensor& self) {
  return activation_backward_batched(kMish, grad_output, self);
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, FuncTorchBatched, m) {
  m.impl("silu", TORCH_FN(silu_batched));
  m.impl("silu_backward", TORCH_FN(silu_backward_batched));
  m.impl("mish", TORCH_FN(mish_batched));
  m.impl("mish_backward", TORCH_FN(mish_backward_batched));
}

}  // namespace batchrules
