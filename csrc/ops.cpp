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

TORCH_LIBRARY(batchrules, m) {
  m.def("linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor");
  // Outputs not requested by output_mask are returned undefined (None).
  m.def(
      "linear_backward(Tensor self, Tensor grad_output, Tensor weight, bool[3] output_mask) "
      "-> (Tensor, Tensor, Tensor)");
}

}  // namespace batchrules
