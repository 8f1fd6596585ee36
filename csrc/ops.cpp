// Operator schemas: the one TORCH_LIBRARY block of the extension, and the
// cached typed dispatcher handles of ops.h.
#include "ops.h"

#include <torch/library.h>

namespace batchrules {

namespace {

template <class Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

}  // namespace

const c10::TypedOperatorHandle<LinearSig>& linear_op() {
  static const auto op = find_op<LinearSig>("batchrules::linear");
  return op;
}

const c10::TypedOperatorHandle<LinearBackwardSig>& linear_backward_op() {
  static const auto op = find_op<LinearBackwardSig>("batchrules::linear_backward");
  return op;
}

const c10::TypedOperatorHandle<RnnRecurrenceSig>& rnn_recurrence_op() {
  static const auto op = find_op<RnnRecurrenceSig>("batchrules::rnn_recurrence");
  return op;
}

const c10::TypedOperatorHandle<RnnRecurrenceBackwardSig>& rnn_recurrence_backward_op() {
  static const auto op = find_op<RnnRecurrenceBackwardSig>("batchrules::rnn_recurrence_backward");
  return op;
}

const c10::TypedOperatorHandle<ScaledTransposeSig>& scaled_transpose_op() {
  static const auto op = find_op<ScaledTransposeSig>("batchrules::scaled_transpose");
  return op;
}

const c10::TypedOperatorHandle<FusedLstmSig>& fused_lstm_layer_op() {
  static const auto op = find_op<FusedLstmSig>("batchrules::fused_lstm_layer");
  return op;
}

const c10::TypedOperatorHandle<FusedLstmBackwardSig>& fused_lstm_layer_backward_op() {
  static const auto op = find_op<FusedLstmBackwardSig>("batchrules::fused_lstm_layer_backward");
  return op;
}

#define BATCHRULES_DEFINE_ACTIVATION_OPS(name, ...)                                          \
  const c10::TypedOperatorHandle<ActivationSig>& name##_op() {                               \
    static const auto op = find_op<ActivationSig>("batchrules::" #name);                     \
    return op;                                                                               \
  }                                                                                          \
  const c10::TypedOperatorHandle<ActivationBackwardSig>& name##_backward_op() {              \
    static const auto op = find_op<ActivationBackwardSig>("batchrules::" #name "_backward"); \
    return op;                                                                               \
  }
BATCHRULES_ACTIVATIONS(BATCHRULES_DEFINE_ACTIVATION_OPS)
#undef BATCHRULES_DEFINE_ACTIVATION_OPS

TORCH_LIBRARY(batchrules, m) {
  m.def("linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor");
  // Outputs not requested by output_mask are returned undefined (None).
  m.def(
      "linear_backward(Tensor self, Tensor grad_output, Tensor weight, bool[3] output_mask) "
      "-> (Tensor, Tensor, Tensor)");
  // One RNN layer's loop over time (recurrent/recurrence.h); mode 0 LSTM,
  // 1 GRU, 2 RNN tanh, 3 RNN relu. c_n is None but for LSTM; workspace is
  // what the backward reads. The backward's hidden-gate gradient is None where
  // it equals the input gates' (LSTM, RNN), its projected one without w_hr.
  m.def(
      "rnn_recurrence(Tensor input_gates, Tensor h0, Tensor? c0, Tensor w_hh, Tensor? b_hh, "
      "Tensor? w_hr, int mode, bool reverse) -> (Tensor output, Tensor h_n, Tensor c_n, "
      "Tensor workspace)");
  m.def(
      "rnn_recurrence_backward(Tensor? grad_output, Tensor? grad_h_n, Tensor? grad_c_n, "
      "Tensor h0, Tensor? c0, Tensor w_hh, Tensor? w_hr, Tensor output, Tensor workspace, "
      "int mode, bool reverse) -> (Tensor grad_input_gates, Tensor grad_hidden_gates, "
      "Tensor grad_h0, Tensor grad_c0, Tensor grad_projected)");
  // One LSTM layer and direction as oneDNN's fused CPU layer, time-major
  // input [T, N, I], float32; workspace is oneDNN's (bytes), one per fused
  // call (Note [The fused layer's workspace list], recurrent/batched_kernel.cpp).
  // Its backward is oneDNN's fused one (weight gradients summed over the rows).
  m.def(
      "fused_lstm_layer(Tensor input, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh, "
      "Tensor h0, Tensor c0, bool reverse) -> (Tensor output, Tensor h_n, Tensor c_n, "
      "Tensor[] workspace)");
  m.def(
      "fused_lstm_layer_backward(Tensor input, Tensor w_ih, Tensor w_hh, Tensor? b_ih, "
      "Tensor? b_hh, Tensor h0, Tensor c0, Tensor output, Tensor h_n, Tensor c_n, "
      "Tensor? grad_output, Tensor? grad_h_n, Tensor? grad_c_n, Tensor[] workspace, bool reverse) "
      "-> (Tensor grad_input, Tensor grad_w_ih, Tensor grad_w_hh, Tensor grad_b_ih, "
      "Tensor grad_b_hh, Tensor grad_h0, Tensor grad_c0)");
  // Per-sample squared norms ||g_i^T a_i||_F^2 of rows [B, T, I] and grads
  // [B, T, O] (clipped_grad's ghost norms; Note [The ghost norm kernel]),
  // plus `biases` times ||sum_t g_i,t||^2 (biases sharing the output
  // gradient): CPU (float32, float64) and Meta only, not differentiable.
  m.def("ghost_norms_sq(Tensor rows, Tensor grads, int biases=0) -> Tensor");
  // x.permute(2, 0, 1) * scale[:, None], contiguous: x [B, T, K], scale [B]
  // to [K, B, T] (a clipped sum's scaled operand; Note [A scaled transpose
  // in 8 x 8 tiles]): CPU and Meta only, not differentiable.
  m.def("scaled_transpose(Tensor x, Tensor scale) -> Tensor");
  // sum_i scale_i x_i^T y_i over all rows: x [B, T, M], y [B, T, N], scale
  // [B] to [M, N] (a clipped sum; Note [The clipped sum as one op]): CPU and
  // Meta only, not differentiable.
  m.def("scaled_gram(Tensor x, Tensor y, Tensor scale) -> Tensor");
  // self = N(0, std^2) from Philox4x32-10 under `key`, or with `accumulate`
  // self += it, in place: float32, contiguous (DP noise; Note [Gaussian
  // noise from Philox]): CPU and Meta only, not differentiable.
  m.def("gaussian_fill_(Tensor(a!) self, int key, float std, bool accumulate=False) -> ()");
  // Each activation: <name>(self) and <name>_backward(grad_output, self),
  // whose operands broadcast against each other as in aten::silu_backward.
#define BATCHRULES_DEFINE_ACTIVATION_SCHEMAS(name, ...) \
  m.def(#name "(Tensor self) -> Tensor");               \
  m.def(#name "_backward(Tensor grad_output, Tensor self) -> Tensor");
  BATCHRULES_ACTIVATIONS(BATCHRULES_DEFINE_ACTIVATION_SCHEMAS)
#undef BATCHRULES_DEFINE_ACTIVATION_SCHEMAS
}

}  // namespace batchrules
