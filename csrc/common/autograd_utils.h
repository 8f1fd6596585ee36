// Helpers shared by the hand-written Autograd kernels of every op family.
//
// Note [Hand-written autograd nodes]
// torch::autograd::Function is rejected under functorch transforms, and a
// CompositeImplicitAutograd op would decompose before its batching rule could
// run under vmap(grad(...)). So each operator has an Autograd-key kernel that
// builds its torch::autograd::Node by hand, the way PyTorch's generated
// VariableType code does (collect_next_edges, SavedVariable, set_history). The
// nodes call the operators back through the dispatcher, so every transform
// sees them, and each backward is itself an operator with its own node, so
// any order of derivative works.
#pragma once

#include "common/torch_compat.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>

namespace batchrules {

// Sum of two partial gradients, either of which may be undefined (absent).
inline at::Tensor add_defined(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined())
    return b;
  if (!b.defined())
    return a;
  return a + b;
}

// The tensor a forward-mode formula computes with: the primal of a dual
// tensor (level 0, the level torch.func.jvp and forward_ad use), so the
// tangent computation does not itself carry tangents.
inline at::Tensor primal(const at::Tensor& t) {
  return t.defined() && t._fw_grad(0).defined() ? t._fw_primal(0) : t;
}

inline at::Tensor tangent(const at::Tensor& t) {
  return t.defined() ? t._fw_grad(0) : at::Tensor();
}

}  // namespace batchrules
