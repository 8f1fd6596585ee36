// What each activation of the family is: its operators, names, ATen kernels
// and second derivative. Every kernel of the family is written once, over
// this descriptor, and registered for each entry of activation_list.h.
//
// Note [One backward kernel per activation]
// functorch's grad differentiates with create_graph=True, so aten::silu's
// autograd formula picks infinitely_differentiable_silu_backward: six
// pointwise ops (eight for mish), each through vmap's plumbing, where
// aten::silu_backward is one kernel. batchrules::<act> instead has one
// backward, batchrules::<act>_backward (one ATen kernel below autograd), and
// that op has its own derivative formulas, so higher orders stay explicit too:
//   d/d grad_output [g f'(x)] = <act>_backward(gg, x)     (one kernel again)
//   d/d self        [g f'(x)] = gg g f''(x)               (times_second_derivative)
// f'' is written with differentiable aten ops (sigmoid, tanh, mul, ...), so
// any order of derivative works without an operator of its own: a fused
// f'' kernel would only serve second-order workloads (hessians), and a third
// derivative of it would need yet another formula. Forward AD uses the same
// two pieces: jvp(f)(x; dx) = <act>_backward(dx, x) and
//   d [g f'(x)] = <act>_backward(dg, x) + (g dx) f''(x).
// aten::silu_backward / mish_backward have no derivative formulas at all
// (and mish_backward no batching rule), which is why the batching rules call
// the batchrules ops, never the aten ones; see Note [Batching rules call the
// batchrules ops].
#pragma once

#include "activations/activation_list.h"
#include "ops.h"

#include <c10/util/ArrayRef.h>

namespace batchrules {

struct Activation {
  const char* op_name;               // "silu": batchrules::silu, and the aten::silu it routes
  const char* name;                  // "batchrules.silu", for messages
  const char* backward_name;         // "batchrules.silu_backward"
  const char* backward_node;         // autograd node of the forward op
  const char* double_backward_node;  // autograd node of the backward op
  bool supports_complex;             // forward kernels (as ATen's; never autograd)
  const char* formula;               // f(input) in Python, for the docstrings
  const c10::TypedOperatorHandle<ActivationSig>& (*op)();
  const c10::TypedOperatorHandle<ActivationBackwardSig>& (*backward_op)();
  // ATen's kernels of f(self) and grad_output * f'(self): at::<name>, at::<name>_backward.
  Tensor (*aten_forward)(const Tensor& self);
  Tensor (*aten_backward)(const Tensor& grad_output, const Tensor& self);
  // grad * f''(self), in differentiable aten ops (grad broadcasts with self).
  Tensor (*times_second_derivative)(const Tensor& grad, const Tensor& self);
};

// kSilu, kMish, ...: one per entry of activation_list.h.
#define BATCHRULES_DECLARE_ACTIVATION(name, Name, ...) extern const Activation k##Name;
BATCHRULES_ACTIVATIONS(BATCHRULES_DECLARE_ACTIVATION)
#undef BATCHRULES_DECLARE_ACTIVATION

// All of them, in the list's order.
c10::ArrayRef<const Activation*> all_activations();

}  // namespace batchrules
