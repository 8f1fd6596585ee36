// FuncTorchBatched kernels of the activation family: the rules of
// batch_rule_pointwise.cpp behind the shared plumbing (Note [Hand-written vmap
// plumbing]).
#include "activations/batch_rules.h"
#include "common/vmap_plumbing.h"

#include <torch/library.h>

namespace batchrules {

namespace {

template <const Activation& act>
Tensor activation_batched(const Tensor& self) {
  const BatchedKernelScope scope(act.name);
  const int64_t level = scope.level();
  if (!any_batched_at(level, self)) {
    return act.op().call(self);
  }
  auto [x, x_bdim] = unwrap_at(self, level);
  auto [out, out_bdim] = activation_batch_rule(act, x, x_bdim);
  return wrap_at(out, out_bdim, level);
}

template <const Activation& act>
Tensor activation_backward_batched(const Tensor& grad_output, const Tensor& self) {
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

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, FuncTorchBatched, m) {
#define BATCHRULES_REGISTER_ACTIVATION(name, Name, ...) \
  m.impl(#name, TORCH_FN(activation_batched<k##Name>)); \
  m.impl(#name "_backward", TORCH_FN(activation_backward_batched<k##Name>));
  BATCHRULES_ACTIVATIONS(BATCHRULES_REGISTER_ACTIVATION)
#undef BATCHRULES_REGISTER_ACTIVATION
}

}  // namespace batchrules
