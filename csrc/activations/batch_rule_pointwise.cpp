// Batching rules of the activation ops: pointwise, one kernel, no copies.
//
// Note [Batching rules call the batchrules ops]
// The rules compute with batchrules::<act> / <act>_backward on the physical
// tensors, not with the aten ops: those may still be batched at an enclosing
// vmap level (our rule runs again there, where aten::mish_backward has no
// functorch rule at all) or wrapped by an enclosing grad (where our autograd
// formulas apply, while aten::silu_backward has no derivative formula and
// aten::silu would record its create_graph backward again). On plain tensors
// they reach the same ATen kernel one dispatcher hop later.
//
// Note [Aligning the operands of a pointwise backward]
// <act>_backward(g, x) broadcasts g against x. Shapes physical, B the vmap
// size: a batched operand gets its batch dim in front and is padded with
// size-1 dims after it up to the larger logical rank, so the batch dims line
// up and the per-example dims broadcast as in eager:
//   g: B,N   x: B,M,N  ->  g: B,1,N   x: B,M,N  ->  B,M,N
// A shared operand broadcasts as it is (right-aligned against the batched
// one's logical dims):
//   g: B,M,N   x: N  ->  B,M,N        g: B,N   x: M,N  ->  g: B,1,N  ->  B,M,N
// movedim and the padding are views, so nothing is copied; the kernel reads
// any strides and writes its result in its inputs' memory layout.
#include "activations/batch_rules.h"
#include "activations/shape_checks.h"

#include <ATen/ATen.h>

namespace batchrules {

namespace {

// See Note [Aligning the operands of a pointwise backward].
Tensor batch_first_with_rank(const Tensor& t, std::optional<int64_t> bdim, int64_t rank) {
  if (!bdim.has_value()) {
    return t;
  }
  Tensor out = move_bdim_to_front(t, bdim);
  while (out.dim() < rank + 1) {
    out = out.unsqueeze(1);
  }
  return out;
}

}  // namespace

BatchedResult activation_batch_rule(const Activation& act, const Tensor& self,
                                    std::optional<int64_t> self_bdim) {
  // B at any dim -> same layout; see Note [Batching rules call the batchrules ops].
  return {act.op().call(self), self_bdim};
}

BatchedResult activation_backward_batch_rule(const Activation& act, const Tensor& grad_output,
                                             std::optional<int64_t> grad_output_bdim,
                                             const Tensor& self,
                                             std::optional<int64_t> self_bdim) {
  TORCH_INTERNAL_ASSERT(grad_output_bdim.has_value() || self_bdim.has_value());
  check_activation_backward_shapes(act, logical_sizes(grad_output, grad_output_bdim),
                                   logical_sizes(self, self_bdim));
  const int64_t rank =
      std::max(logical_rank(grad_output, grad_output_bdim), logical_rank(self, self_bdim));
  const Tensor g = batch_first_with_rank(grad_output, grad_output_bdim, rank);
  const Tensor x = batch_first_with_rank(self, self_bdim, rank);
  return {act.backward_op().call(g, x), 0};
}

}  // namespace batchrules
