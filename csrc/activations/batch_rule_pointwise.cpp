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
// The two operands of <act>_backward broadcast as in eager; see Note [Aligning
// the operands of a pointwise op] (common/batching_utils.h). The kernel reads
// any strides and writes its result in its inputs' memory layout.
#include "activations/batch_rules.h"
#include "activations/shape_checks.h"

#include <ATen/ATen.h>

namespace batchrules {

BatchedResult activation_batch_rule(const Activation& act, const Tensor& self,
                                    std::optional<int64_t> self_bdim) {
  // B at any dim -> same layout; see Note [Batching rules call the batchrules ops].
  return {act.op().call(self), self_bdim};
}

BatchedResult activation_backward_batch_rule(const Activation& act, const Tensor& grad_output,
                                             std::optional<int64_t> grad_output_bdim,
                                             const Tensor& self, std::optional<int64_t> self_bdim) {
  TORCH_INTERNAL_ASSERT(grad_output_bdim.has_value() || self_bdim.has_value());
  check_activation_backward_shapes(act, logical_sizes(grad_output, grad_output_bdim),
                                   logical_sizes(self, self_bdim));
  const int64_t rank =
      std::max(logical_rank(grad_output, grad_output_bdim), logical_rank(self, self_bdim));
  const Tensor g = align_batch_first(grad_output, grad_output_bdim, rank);
  const Tensor x = align_batch_first(self, self_bdim, rank);
  return {act.backward_op().call(g, x), 0};
}

}  // namespace batchrules
