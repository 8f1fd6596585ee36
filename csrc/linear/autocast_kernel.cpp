// Autocast kernels of the linear family (CPU and CUDA); see Note [Autocast
// policy of batchrules' operators].
#include "common/autocast.h"
#include "linear/autocast.h"

#include <torch/library.h>

namespace batchrules {

Tensor linear_lower_precision(c10::DeviceType device, const Tensor& input, const Tensor& weight,
                              const std::optional<Tensor>& bias) {
  const LowerPrecisionCast cast(device);
  return linear_op().call(cast(input), cast(weight), cast(bias));
}

TensorTriple linear_backward_lower_precision(c10::DeviceType device, const Tensor& self,
                                             const Tensor& grad_output, const Tensor& weight,
                                             std::array<bool, 3> output_mask) {
  const LowerPrecisionCast cast(device);
  return linear_backward_op().call(cast(self), cast(grad_output), cast(weight), output_mask);
}

namespace {

template <c10::DeviceType device>
Tensor linear_autocast(const Tensor& input, const Tensor& weight,
                       const std::optional<Tensor>& bias) {
  return linear_lower_precision(device, input, weight, bias);
}

template <c10::DeviceType device>
TensorTriple linear_backward_autocast(const Tensor& self, const Tensor& grad_output,
                                      const Tensor& weight, std::array<bool, 3> output_mask) {
  return linear_backward_lower_precision(device, self, grad_output, weight, output_mask);
}

}  // namespace

// One block for both autocast keys: each kernel names its key.
TORCH_LIBRARY_FRAGMENT(batchrules, m) {
  using c10::DeviceType;
  using c10::DispatchKey;
  m.impl("linear",
         torch::dispatch(DispatchKey::AutocastCPU, TORCH_FN(linear_autocast<DeviceType::CPU>)));
  m.impl("linear_backward", torch::dispatch(DispatchKey::AutocastCPU,
                                            TORCH_FN(linear_backward_autocast<DeviceType::CPU>)));
  m.impl("linear",
         torch::dispatch(DispatchKey::AutocastCUDA, TORCH_FN(linear_autocast<DeviceType::CUDA>)));
  m.impl("linear_backward", torch::dispatch(DispatchKey::AutocastCUDA,
                                            TORCH_FN(linear_backward_autocast<DeviceType::CUDA>)));
}

}  // namespace batchrules
