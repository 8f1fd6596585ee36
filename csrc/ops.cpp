// Operator schemas: the one TORCH_LIBRARY block of the extension.
#include "ops.h"

#include <torch/library.h>

namespace batchrules {

const c10::TypedOperatorHandle<LinearSig>& linear_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("batchrules::linear", "")
                             .typed<LinearSig>();
  return op;
}

const c10::TypedOperatorHandle<LinearBackwardSig>& linear_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("batchrules::linear_backward", "")
                             .typed<LinearBackwardSig>();
  return op;
}

namespace {

template <class Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

}  // namespace

const c10::TypedOperatorHandle<ActivationSig>& silu_op() {
  static const auto op = find_op<ActivationSig>("batchrules::silu");
  return op;
}

const c10::TypedOperatorHandle<ActivationBackwardSig>& silu_backward_op() {
  static const auto op = find_op<ActivationBackwardSig>("batchrules::silu_backward");
  return op;
}

const c10::TypedOperatorHandle<ActivationSig>& mish_op() {
  static const auto op = find_op<ActivationSig>("batchrules::mish");
  return op;
}

const c10::TypedOperatorHandle<ActivationBackwardSig>& mish_backward_op() {
  static const auto op = find_op<ActivationBackwardSig>("batchrules::mish_backward");
  return op;
}

TORCH_LIBRARY(batchrules, m) {
  m.def("linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor");
  // Outputs not requested by output_mask are returned undefined (None).
  m.def(
      "linear_backward(Tensor self, Tensor grad_output, Tensor weight, bool[3] output_mask) "
      "-> (Tensor, Tensor, Tensor)");
  // grad_output and self broadcast against each other, as in aten::silu_backward.
  m.def("silu(Tensor self) -> Tensor");
  m.def("silu_backward(Tensor grad_output, Tensor self) -> Tensor");
  m.def("mish(Tensor self) -> Tensor");
  m.def("mish_backward(Tensor grad_output, Tensor self) -> Tensor");
}

}  // namespace batchrules
