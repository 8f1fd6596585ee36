// FuncTorchBatched kernels: the vmap plumbing around the batching rules.
//
// Note [Hand-written vmap plumbing]
// functorch's VMAP_SUPPORT only serves aten ops, so this is the plumbing its
// codegen would write: exclude FuncTorchBatched, find the current vmap level,
// fall through when nothing is batched at it, unwrap, run the rule, rewrap.
#include "batch_rules.h"
#include "ops.h"

#include <ATen/functorch/BatchedTensorImpl.h>
#include <ATen/functorch/DynamicLayer.h>
#include <ATen/functorch/PlumbingHelper.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace batchrules {

namespace {

namespace ft = at::functorch;

int64_t current_vmap_level(const char* op) {
  const auto layer = ft::maybeCurrentDynamicLayer();
  TORCH_CHECK(layer.has_value(), op,
              ": a BatchedTensor escaped vmap (it was used after the vmap call that created "
              "it returned)");
  return layer->layerId();
}

Tensor linear_batched(const Tensor& input, const Tensor& weight,
                      const std::optional<Tensor>& bias) {
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  const int64_t level = current_vmap_level("batchrules.linear");
  if (!ft::isBatchedAtLevel(input, level) && !ft::isBatchedAtLevel(weight, level) &&
      !ft::isBatchedAtLevel(bias, level)) {
    return linear_op().call(input, weight, bias);
  }
  auto [x, x_bdim] = ft::unwrapTensorAtLevel(input, level);
  auto [w, w_bdim] = ft::unwrapTensorAtLevel(weight, level);
  std::optional<Tensor> b;
  std::optional<int64_t> b_bdim;
  if (bias.has_value() && bias->defined()) {
    std::tie(b, b_bdim) = ft::unwrapTensorAtLevel(*bias, level);
  }
  auto [out, out_bdim] = linear_batch_rule(x, x_bdim, w, w_bdim, b, b_bdim);
  return ft::makeBatched(out, out_bdim, level);
}

TensorTriple linear_backward_batched(const Tensor& self, const Tensor& grad_output,
                                     const Tensor& weight, std::array<bool, 3> output_mask) {
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  const int64_t level = current_vmap_level("batchrules.linear_backward");
  if (!ft::isBatchedAtLevel(self, level) && !ft::isBatchedAtLevel(grad_output, level) &&
      !ft::isBatchedAtLevel(weight, level)) {
    return linear_backward_op().call(self, grad_output, weight, output_mask);
  }
  auto [x, x_bdim] = ft::unwrapTensorAtLevel(self, level);
  auto [g, g_bdim] = ft::unwrapTensorAtLevel(grad_output, level);
  auto [w, w_bdim] = ft::unwrapTensorAtLevel(weight, level);
  auto [gi, gi_bdim, gw, gw_bdim, gb, gb_bdim] =
      linear_backward_batch_rule(x, x_bdim, g, g_bdim, w, w_bdim, output_mask);
  // Unrequested outputs stay undefined rather than being wrapped.
  auto wrap = [level](const Tensor& t, std::optional<int64_t> bdim) {
    return t.defined() ? ft::makeBatched(t, bdim, level) : t;
  };
  return {wrap(gi, gi_bdim), wrap(gw, gw_bdim), wrap(gb, gb_bdim)};
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, FuncTorchBatched, m) {
  m.impl("linear", TORCH_FN(linear_batched));
  m.impl("linear_backward", TORCH_FN(linear_backward_batched));
}

}  // namespace batchrules
