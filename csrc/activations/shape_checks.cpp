#include "activations/shape_checks.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace batchrules {

void check_activation_dtype(const Activation& act, const char* op, const at::Tensor& t,
                            const char* name) {
  const auto dtype = t.scalar_type();
  // aten's exception and message first ("silu_cpu" not implemented for 'Long').
  TORCH_CHECK_NOT_IMPLEMENTED(
      at::isFloatingType(dtype) || (act.supports_complex && at::isComplexType(dtype)), "\"",
      act.op_name, "_", c10::DeviceTypeName(t.device().type(), /*lower_case=*/true),
      "\" not implemented for '", c10::toString(dtype), "'; ", op, ": expected ", name,
      " to be a floating-point", act.supports_complex ? " or complex" : "", " tensor, but got ",
      dtype);
}

void check_activation_backward_shapes(const Activation& act, c10::SymIntArrayRef grad_output,
                                      c10::SymIntArrayRef self) {
  // Right-aligned: dims only one of them has always broadcast.
  const size_t common = std::min(grad_output.size(), self.size());
  for (size_t i = 1; i <= common; ++i) {
    const c10::SymInt& g = grad_output[grad_output.size() - i];
    const c10::SymInt& x = self[self.size() - i];
    TORCH_CHECK(g == x || g == 1 || x == 1, act.backward_name, ": grad_output of shape ",
                grad_output, " and self of shape ", self, " cannot be broadcast together");
  }
}

void check_activation_backward_operands(const Activation& act, const at::Tensor& grad_output,
                                        const at::Tensor& self) {
  const char* op = act.backward_name;
  check_activation_dtype(act, op, self, "self");
  TORCH_CHECK(grad_output.scalar_type() == self.scalar_type(), op,
              ": expected grad_output and self to have the same dtype, but got grad_output ",
              grad_output.scalar_type(), " and self ", self.scalar_type());
  TORCH_CHECK(grad_output.device() == self.device(), op,
              ": expected grad_output and self to be on the same device, but got grad_output on ",
              grad_output.device(), " and self on ", self.device());
  check_activation_backward_shapes(act, grad_output.sym_sizes(), self.sym_sizes());
}

}  // namespace batchrules
