// Batching rule for aten::addmm (registered while routing is on: routes.cpp).
//
// Note [Folding addmm's batch into its rows]
// functorch has no rule for addmm: under vmap it runs mm, then adds beta *
// self in a second pass over the [B, N, M] result. transformers' GPT-2
// Conv1D is torch.addmm(bias, x, W): under vmap (per-sample gradients, and
// clipped_grad's forward through frozen Conv1Ds, e.g. LoRA's base model)
// every such layer pays that extra pass, a broadcast add over its whole
// output. When only
// mat1 is batched and self is one row for all rows (logical [M], [1, M],
// [1] or []), the batch folds into the rows instead:
//   B,N,K -> B*N,K x K,M + self -> B*N,M -> B,N,M
// one addmm, as eager runs it. Every other case runs functorch's
// decomposition (addmm_batched, batched_kernel.cpp), and so does tracing for
// torch.compile (Note [GEMM and bias apart when traced]). Under autocast the
// operands are cast first, so that either path returns eager addmm's lower
// precision (Note [Autocast under vmap]).
#include "linear/batch_rules.h"

#include <ATen/ATen.h>

namespace batchrules {

BatchedResult addmm_row_bias_batch_rule(const Tensor& self, const Tensor& mat1, int64_t mat1_bdim,
                                        const Tensor& mat2, const c10::Scalar& beta,
                                        const c10::Scalar& alpha) {
  const Tensor x = move_bdim_to_front(mat1, mat1_bdim);  // B,N,K
  const Tensor out = at::addmm(self, fold_leading_dims(x), mat2, beta, alpha);
  return {unfold_leading_dims(out, x), 0};
}

}  // namespace batchrules
