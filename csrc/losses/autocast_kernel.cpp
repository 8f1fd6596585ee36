// FuncTorchDynamicLayerFrontMode kernels for the composite ops of the
// classification losses while routing is on (routes.cpp).
//
// Note [Autocast policies of the losses under vmap]
// Autocast runs nll_loss, nll_loss2d and (on the CPU) cross_entropy_loss in
// float32 (fp32), and (on CUDA) log_softmax and softmax with dtype=float32
// (fp32_set_opt_dtype), so an example's eager cross_entropy of bfloat16
// logits is a float32 loss. functorch decomposes these composites at
// FuncTorchBatched, above the Autocast keys, so under vmap no policy runs and
// the loss stays bfloat16. Here they run above every transform instead, as
// functorch's linear_hack does: the policy first, where aten has one for the
// device (AtenAutocasts; autocast's key then excluded for the rest of the op,
// as its own kernels do), then the composite, whose ops meet the front mode
// again. The element-wise losses are no composites: their batched kernels
// apply the policy (Note [Autocast under vmap], batched_kernel.cpp).
#include "common/autocast.h"
#include "losses/autocast.h"

#include <ATen/ops/cross_entropy_loss_native.h>
#include <ATen/ops/log_softmax_native.h>
#include <ATen/ops/nll_loss2d_native.h>
#include <ATen/ops/nll_loss_native.h>
#include <ATen/ops/nll_loss_nd_native.h>
#include <ATen/ops/softmax_native.h>

namespace batchrules {

namespace {

// fp32_set_opt_dtype: an eligible input (floating point, not float64) and no
// dtype given -> dtype float32.
template <Tensor (*op)(const Tensor&, int64_t, std::optional<at::ScalarType>)>
Tensor with_fp32_dtype(const AtenAutocasts& policy, const Tensor& self, int64_t dim,
                       std::optional<at::ScalarType> dtype) {
  if (!policy.applies_to(self)) {
    return op(self, dim, dtype);
  }
  const Fp32Cast no_autocast(self.device().type());
  const bool eligible = self.is_floating_point() && self.scalar_type() != at::kDouble;
  return op(self, dim, eligible && !dtype.has_value() ? at::kFloat : dtype);
}

template <Tensor (*op)(const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t,
                       c10::SymInt)>
Tensor in_fp32(const AtenAutocasts& policy, const Tensor& self, const Tensor& target,
               const std::optional<Tensor>& weight, int64_t reduction, c10::SymInt ignore_index) {
  if (!policy.applies_to(self)) {
    return op(self, target, weight, reduction, std::move(ignore_index));
  }
  const Fp32Cast cast(self.device().type());
  return op(cast(self), target, cast(weight), reduction, std::move(ignore_index));
}

}  // namespace

Tensor routed_log_softmax(const Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype) {
  static const AtenAutocasts policy("aten::log_softmax", "int");
  return with_fp32_dtype<at::native::log_softmax>(policy, self, dim, dtype);
}

Tensor routed_softmax(const Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype) {
  static const AtenAutocasts policy("aten::softmax", "int");
  return with_fp32_dtype<at::native::softmax>(policy, self, dim, dtype);
}

Tensor routed_nll_loss(const Tensor& self, const Tensor& target,
                       const std::optional<Tensor>& weight, int64_t reduction,
                       c10::SymInt ignore_index) {
  static const AtenAutocasts policy("aten::nll_loss", "");
  return in_fp32<at::native::nll_loss_symint>(policy, self, target, weight, reduction,
                                              std::move(ignore_index));
}

Tensor routed_nll_loss2d(const Tensor& self, const Tensor& target,
                         const std::optional<Tensor>& weight, int64_t reduction,
                         c10::SymInt ignore_index) {
  static const AtenAutocasts policy("aten::nll_loss2d", "");
  return in_fp32<at::native::nll_loss2d_symint>(policy, self, target, weight, reduction,
                                                std::move(ignore_index));
}

Tensor routed_nll_loss_nd(const Tensor& self, const Tensor& target,
                          const std::optional<Tensor>& weight, int64_t reduction,
                          c10::SymInt ignore_index) {
  return at::native::nll_loss_nd_symint(self, target, weight, reduction, std::move(ignore_index));
}

Tensor routed_cross_entropy_loss(const Tensor& self, const Tensor& target,
                                 const std::optional<Tensor>& weight, int64_t reduction,
                                 c10::SymInt ignore_index, double label_smoothing) {
  static const AtenAutocasts policy("aten::cross_entropy_loss", "");
  if (policy.applies_to(self)) {
    const Fp32Cast cast(self.device().type());
    return at::native::cross_entropy_loss_symint(cast(self), target, cast(weight), reduction,
                                                 std::move(ignore_index), label_smoothing);
  }
  return at::native::cross_entropy_loss_symint(self, target, weight, reduction,
                                               std::move(ignore_index), label_smoothing);
}

}  // namespace batchrules
