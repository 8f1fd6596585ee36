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
//  - the losses: fp32 (and log_softmax/softmax fp32_set_opt_dtype), which
//    functorch's decompositions skip under vmap; the routes apply them (Note
//    [Autocast policies of the losses under vmap], losses/autocast_kernel.cpp).
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
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>

namespace batchrules {

// Whether autocast is on for `t`'s device type.
inline bool autocast_enabled_for(const at::Tensor& t) {
  const c10::DeviceType device = t.device().type();
  return at::autocast::is_autocast_available(device) && at::autocast::is_autocast_enabled(device);
}

// Whether aten has a kernel for one of its ops at a device's autocast key:
// autocast's lists differ between devices (CPU casts cross_entropy_loss to
// float32, CUDA log_softmax and the RNN cells) and between releases, so a
// route that stands in for an aten op asks the dispatcher, once per device.
class AtenAutocasts {
 public:
  AtenAutocasts(const char* op, const char* overload)
      : cpu_(registered(op, overload, c10::DispatchKey::AutocastCPU)),
        cuda_(registered(op, overload, c10::DispatchKey::AutocastCUDA)) {}

  // On for `t`'s device, and aten's op has a policy there.
  bool applies_to(const at::Tensor& t) const {
    return autocast_enabled_for(t) && (t.is_cuda() ? cuda_ : t.is_cpu() && cpu_);
  }

 private:
  static bool registered(const char* op, const char* overload, c10::DispatchKey key) {
    const auto handle = c10::Dispatcher::singleton().findSchema({op, overload});
    return handle.has_value() && handle->hasKernelForDispatchKey(key);
  }

  bool cpu_, cuda_;
};

// While alive: the autocast key of one device type excluded, and cast() as
// ATen's cached_cast casts to `dtype` (floating-point tensors other than
// float64, through ATen's weight cache).
class AutocastCast {
 public:
  at::Tensor operator()(const at::Tensor& t) const {
    return at::autocast::cached_cast(dtype_, t, device_);
  }
  std::optional<at::Tensor> operator()(const std::optional<at::Tensor>& t) const {
    return at::autocast::cached_cast(dtype_, t, device_);
  }

 protected:
  AutocastCast(c10::DeviceType device, at::ScalarType dtype)
      : device_(device),
        dtype_(dtype),
        no_autocast_(at::autocast::get_autocast_dispatch_key_from_device_type(device)) {}

 private:
  c10::DeviceType device_;
  at::ScalarType dtype_;
  c10::impl::ExcludeDispatchKeyGuard no_autocast_;
};

// CastPolicy::lower_precision_fp (Note [Autocast policy of batchrules' operators]).
class LowerPrecisionCast : public AutocastCast {
 public:
  explicit LowerPrecisionCast(c10::DeviceType device)
      : AutocastCast(device, at::autocast::get_lower_precision_fp_from_device_type(device)) {}
};

// CastPolicy::fp32 (and fp32_set_opt_dtype's key exclusion).
class Fp32Cast : public AutocastCast {
 public:
  explicit Fp32Cast(c10::DeviceType device) : AutocastCast(device, at::kFloat) {}
};

}  // namespace batchrules
