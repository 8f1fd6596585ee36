// Autocast for the operators batchrules owns or routes.
//
// Note [Autocast policy of batchrules' operators]
// Each operator follows ATen's cast policy for the op it stands for
// (aten/src/ATen/autocast_mode.cpp, the same lists for CPU and CUDA):
//  - batchrules::linear: aten::linear's lower_precision_fp. Routing sends
//    aten::linear to batchrules::linear on FuncTorchDynamicLayerFrontMode,
//    above aten's Autocast kernel, so batchrules::linear has its own
//    (linear/autocast_kernel.cpp).
//  - batchrules::linear_backward: lower_precision_fp too. It is GEMMs, i.e.
//    what aten's linear backward runs as mm, which autocast casts the same
//    way; under autograd its operands already have the forward's dtype, and
//    a caller holding operands of mixed dtypes (clipped_grad's recorded
//    float32 input with a bfloat16 output gradient) gets aten's behaviour.
//  - batchrules::silu, mish (and their backwards): none, as aten::silu and
//    aten::mish are on no autocast list: they run in their input's dtype.
//  - the losses: routing only adds FuncTorchBatched kernels for aten's own
//    loss ops (Note [Routing aten ops only while transforms are active]), so
//    aten's fp32 kernels for them run as in stock torch.func.
//  - aten::scaled_dot_product_attention: lower_precision_fp, which its route
//    (on FuncTorchDynamicLayerFrontMode, above aten's Autocast kernel) applies
//    itself before choosing a kernel.
// The cast is ATen's WrapFunction_<CastPolicy::lower_precision_fp>: every
// eligible floating-point tensor (not float64) to the autocast dtype, through
// ATen's weight cache, then the op called with the autocast key excluded.
//
// Note [Autocast under vmap]
// FuncTorchBatched is above the Autocast keys, so under vmap a batched kernel
// runs before any Autocast kernel could cast its logical operands. functorch's
// own rules pass mixed dtypes down to the physical op, whose Autocast kernel
// casts; batchrules' linear rules check dtypes and mix operands into GEMMs and
// adds themselves, so their batched kernels apply the policy first (casting
// the BatchedTensors, which casts the physical ones) and call the op again.
// vmap(f)(x) then has the dtype f(x[i]) has eagerly. (Stock torch.func's
// vmap of F.linear with a bias does not: it decomposes into a bfloat16 GEMM
// and a float32 bias add, which promotes its output to float32.)
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>

namespace batchrules {

// Whether autocast is on for `t`'s device type.
inline bool autocast_enabled_for(const at::Tensor& t) {
  const c10::DeviceType device = t.device().type();
  return at::autocast::is_autocast_available(device) && at::autocast::is_autocast_enabled(device);
}

// While alive: the autocast key of one device type excluded, and cast() as
// CastPolicy::lower_precision_fp casts (Note [Autocast policy of batchrules'
// operators]).
class LowerPrecisionCast {
 public:
  explicit LowerPrecisionCast(c10::DeviceType device)
      : device_(device),
        dtype_(at::autocast::get_lower_precision_fp_from_device_type(device)),
        no_autocast_(at::autocast::get_autocast_dispatch_key_from_device_type(device)) {}

  at::Tensor operator()(const at::Tensor& t) const {
    return at::autocast::cached_cast(dtype_, t, device_);
  }
  std::optional<at::Tensor> operator()(const std::optional<at::Tensor>& t) const {
    return at::autocast::cached_cast(dtype_, t, device_);
  }

 private:
  c10::DeviceType device_;
  at::ScalarType dtype_;
  c10::impl::ExcludeDispatchKeyGuard no_autocast_;
};

}  // namespace batchrules
