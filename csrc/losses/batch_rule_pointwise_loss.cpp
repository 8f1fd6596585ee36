// Batching rule for aten::mse_loss, smooth_l1_loss and huber_loss.
//
// functorch's rules run the kernel on the physical operands as they are; with
// a shared input and a batched target (per-example targets for one
// prediction) huber_loss's output, allocated like the input, is too small
// for the batch and ATen resizes it with a deprecation warning, which a
// future release turns into an error. Here every operand is laid out
// batch-first and the input expanded (not copied) to the batch first, then
// one 'none' kernel and a per-example reduction. mse_loss and smooth_l1_loss
// take the same rule so that their batched kernels can apply autocast's fp32
// policy (Note [Autocast under vmap]).
#include "losses/batch_rules.h"
#include "losses/vmap_dims.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/core/Reduction.h>

namespace batchrules {

Tensor pointwise_loss(PointwiseLoss loss, const Tensor& self, const Tensor& target,
                      int64_t reduction, double param) {
  switch (loss) {
    case PointwiseLoss::Mse: return at::mse_loss(self, target, reduction);
    case PointwiseLoss::SmoothL1: return at::smooth_l1_loss(self, target, reduction, param);
    case PointwiseLoss::Huber: return at::huber_loss(self, target, reduction, param);
  }
  TORCH_INTERNAL_ASSERT(false, "unknown PointwiseLoss");
}

BatchedResult pointwise_loss_batch_rule(PointwiseLoss loss, const Tensor& self,
                                        std::optional<int64_t> self_bdim, const Tensor& target,
                                        std::optional<int64_t> target_bdim, int64_t reduction,
                                        double param) {
  c10::SymDimVector shape = at::infer_size_symdimvector(logical_sizes(self, self_bdim),
                                                        logical_sizes(target, target_bdim));
  const auto rank = static_cast<int64_t>(shape.size());
  const c10::SymInt elements = numel_of(shape);
  const c10::SymInt batch = vmap_size({{&self, self_bdim}, {&target, target_bdim}});
  shape.insert(shape.begin(), batch);
  const Tensor x = align_batch_first(self, self_bdim, rank).expand_symint(shape);
  const Tensor out = pointwise_loss(loss, x, align_batch_first(target, target_bdim, rank),
                                    at::Reduction::None, param);
  if (reduction == at::Reduction::None) {
    return {out, 0};
  }
  // B,* -> B
  const Tensor per_example = out.reshape_symint({batch, elements});
  return {reduction == at::Reduction::Mean ? per_example.mean(1) : per_example.sum(1), 0};
}

}  // namespace batchrules
