// Typed dispatcher handles for the batchrules operators.
//
// Every C++ caller (autograd formulas, batching rules, routing) reaches the
// operators through these handles, so each call goes through the dispatcher
// and is seen by vmap, autograd, FakeTensor and torch.compile alike.
#pragma once

#include "activations/activation_list.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

namespace batchrules {

using at::Tensor;
using TensorTriple = std::tuple<Tensor, Tensor, Tensor>;

using RecurrenceResult = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using RecurrenceGradsResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
using OptTensor = std::optional<Tensor>;

// An undefined tensor (an output not computed, an absent operand) as None.
inline OptTensor maybe_defined(const Tensor& t) {
  return t.defined() ? OptTensor(t) : std::nullopt;
}

using LinearSig = Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&);
using LinearBackwardSig = TensorTriple(const Tensor&, const Tensor&, const Tensor&,
                                       std::array<bool, 3>);

const c10::TypedOperatorHandle<LinearSig>& linear_op();
const c10::TypedOperatorHandle<LinearBackwardSig>& linear_backward_op();

// See Note [The grouped recurrence] (recurrent/recurrence.h).
using RnnRecurrenceSig = RecurrenceResult(const Tensor&, const Tensor&, const OptTensor&,
                                          const Tensor&, const OptTensor&, const OptTensor&,
                                          int64_t, bool);
using RnnRecurrenceBackwardSig = RecurrenceGradsResult(const OptTensor&, const OptTensor&,
                                                       const OptTensor&, const Tensor&,
                                                       const OptTensor&, const Tensor&,
                                                       const OptTensor&, const Tensor&,
                                                       const Tensor&, int64_t, bool);

const c10::TypedOperatorHandle<RnnRecurrenceSig>& rnn_recurrence_op();
const c10::TypedOperatorHandle<RnnRecurrenceBackwardSig>& rnn_recurrence_backward_op();

// See Note [A scaled transpose in 8 x 8 tiles] (dp/scaled_transpose/kernel.cpp).
using ScaledTransposeSig = Tensor(const Tensor&, const Tensor&);

const c10::TypedOperatorHandle<ScaledTransposeSig>& scaled_transpose_op();

// oneDNN's LSTM layer with its own fused backward (recurrent/onednn/kernel.cpp);
// its workspace is a list, one per fused call.
using FusedLstmResult = std::tuple<Tensor, Tensor, Tensor, std::vector<Tensor>>;
using FusedLstmSig = FusedLstmResult(const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                                     const OptTensor&, const Tensor&, const Tensor&, bool);
using FusedLstmGradsResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
using FusedLstmBackwardSig = FusedLstmGradsResult(const Tensor&, const Tensor&, const Tensor&,
                                                  const OptTensor&, const OptTensor&, const Tensor&,
                                                  const Tensor&, const Tensor&, const Tensor&,
                                                  const Tensor&, const OptTensor&, const OptTensor&,
                                                  const OptTensor&, at::TensorList, bool);

const c10::TypedOperatorHandle<FusedLstmSig>& fused_lstm_layer_op();
const c10::TypedOperatorHandle<FusedLstmBackwardSig>& fused_lstm_layer_backward_op();

// Pointwise activations f(self) and their backward grad_output * f'(self):
// <name>_op() and <name>_backward_op() for each entry of
// activations/activation_list.h.
using ActivationSig = Tensor(const Tensor&);
using ActivationBackwardSig = Tensor(const Tensor&, const Tensor&);

#define BATCHRULES_DECLARE_ACTIVATION_OPS(name, ...)          \
  const c10::TypedOperatorHandle<ActivationSig>& name##_op(); \
  const c10::TypedOperatorHandle<ActivationBackwardSig>& name##_backward_op();
BATCHRULES_ACTIVATIONS(BATCHRULES_DECLARE_ACTIVATION_OPS)
#undef BATCHRULES_DECLARE_ACTIVATION_OPS

inline Tensor dispatch_linear(const Tensor& input, const Tensor& weight,
                              const std::optional<Tensor>& bias = std::nullopt) {
  return linear_op().call(input, weight, bias);
}

inline TensorTriple dispatch_linear_backward(const Tensor& self, const Tensor& grad_output,
                                             const Tensor& weight,
                                             std::array<bool, 3> output_mask) {
  return linear_backward_op().call(self, grad_output, weight, output_mask);
}

}  // namespace batchrules
