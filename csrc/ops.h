// Typed dispatcher handles for the batchrules operators.
//
// Every C++ caller (autograd formulas, batching rules, routing) reaches the
// operators through these handles, so each call goes through the dispatcher
// and is seen by vmap, autograd, FakeTensor and torch.compile alike.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <optional>
#include <tuple>

namespace batchrules {

using at::Tensor;
using TensorTriple = std::tuple<Tensor, Tensor, Tensor>;

using LinearSig = Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&);
using LinearBackwardSig =
    TensorTriple(const Tensor&, const Tensor&, const Tensor&, std::array<bool, 3>);

const c10::TypedOperatorHandle<LinearSig>& linear_op();
const c10::TypedOperatorHandle<LinearBackwardSig>& linear_backward_op();

// Pointwise activations f(self) and their backward grad_output * f'(self).
using ActivationSig = Tensor(const Tensor&);
using ActivationBackwardSig = Tensor(const Tensor&, const Tensor&);

const c10::TypedOperatorHandle<ActivationSig>& silu_op();
const c10::TypedOperatorHandle<ActivationBackwardSig>& silu_backward_op();
const c10::TypedOperatorHandle<ActivationSig>& mish_op();
const c10::TypedOperatorHandle<ActivationBackwardSig>& mish_backward_op();

inline Tensor dispatch_linear(const Tensor& input, const Tensor& weight,
                     const std::optional<Tensor>& bias = std::nullopt) {
  return linear_op().call(input, weight, bias);
}

inline TensorTriple dispatch_linear_backward(const Tensor& self, const Tensor& grad_output,
                                    const Tensor& weight, std::array<bool, 3> output_mask) {
  return linear_backward_op().call(self, grad_output, weight, output_mask);
}

}  // namespace batchrules
