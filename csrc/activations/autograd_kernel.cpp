// Autograd-key kernels of the activation family: explicit backward and
// forward-mode formulas. See Note [Hand-written autograd nodes] and Note [One
// backward kernel per activation].
#include "activations/autograd_nodes.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

namespace batchrules {

namespace {

using torch::autograd::SavedVariable;

// As for aten::silu: complex values run forward, but have no derivative.
void check_real_for_autograd(const char* op, const Tensor& t) {
  TORCH_CHECK(!t.is_complex(), op,
              " does not support automatic differentiation for complex inputs (got ",
              t.scalar_type(), ")");
}

template <const Activation& act>
Tensor activation_autograd(c10::DispatchKeySet ks, const Tensor& self) {
  const Tensor dx = tangent(self);
  NodePtr<ActivationBackward0> grad_fn;
  if (torch::autograd::compute_requires_grad(self)) {
    check_real_for_autograd(act.name, self);
    grad_fn = make_node<ActivationBackward0>();
    grad_fn->act_ = &act;
    grad_fn->set_next_edges(torch::autograd::collect_next_edges(self));
    grad_fn->self_ = SavedVariable(self, /*is_output=*/false);
  }

  Tensor result;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    result = act.op().redispatch(ks & c10::after_autograd_keyset, self);
  }
  if (grad_fn) {
    torch::autograd::set_history(result, grad_fn);
  }

  // Forward AD: d f(x) = f'(x) dx = <act>_backward(dx, x).
  if (dx.defined()) {
    check_real_for_autograd(act.name, self);
    result._set_fw_grad(act.backward_op().call(dx, primal(self)), /*level=*/0,
                        /*is_inplace_op=*/false);
  }
  return result;
}

template <const Activation& act>
Tensor activation_backward_autograd(c10::DispatchKeySet ks, const Tensor& grad_output,
                                    const Tensor& self) {
  const Tensor dg = tangent(grad_output), dx = tangent(self);
  NodePtr<ActivationBackwardBackward0> grad_fn;
  if (torch::autograd::compute_requires_grad(grad_output, self)) {
    check_real_for_autograd(act.backward_name, self);
    grad_fn = make_node<ActivationBackwardBackward0>();
    grad_fn->act_ = &act;
    grad_fn->set_next_edges(torch::autograd::collect_next_edges(grad_output, self));
    grad_fn->grad_output_ = SavedVariable(grad_output, /*is_output=*/false);
    grad_fn->self_ = SavedVariable(self, /*is_output=*/false);
  }

  Tensor result;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    result = act.backward_op().redispatch(ks & c10::after_autograd_keyset, grad_output, self);
  }
  if (grad_fn) {
    torch::autograd::set_history(result, grad_fn);
  }

  // Forward AD: d [g f'(x)] = <act>_backward(dg, x) + (g dx) f''(x); each
  // term has the output's (broadcast) shape.
  if (dg.defined() || dx.defined()) {
    check_real_for_autograd(act.backward_name, self);
    const Tensor g = primal(grad_output), x = primal(self);
    Tensor t;
    if (dg.defined()) {
      t = act.backward_op().call(dg, x);
    }
    if (dx.defined()) {
      t = add_defined(t, act.times_second_derivative(g * dx, x));
    }
    result._set_fw_grad(t, /*level=*/0, /*is_inplace_op=*/false);
  }
  return result;
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, Autograd, m) {
#define BATCHRULES_REGISTER_ACTIVATION(name, Name, ...)  \
  m.impl(#name, TORCH_FN(activation_autograd<k##Name>)); \
  m.impl(#name "_backward", TORCH_FN(activation_backward_autograd<k##Name>));
  BATCHRULES_ACTIVATIONS(BATCHRULES_REGISTER_ACTIVATION)
#undef BATCHRULES_REGISTER_ACTIVATION
}

}  // namespace batchrules
