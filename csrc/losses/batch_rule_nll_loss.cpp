// Batching rule for aten::nll_loss_forward and aten::nll_loss2d_forward.
//
// Note [Folding the vmap batch into the loss's rows]
// A class-index loss is already a batched problem: each row (each pixel of
// each image for nll_loss2d) picks -w[t] * x[t] from its own row of x. So the
// rules run ONE kernel of the op itself over the rows of all B examples
// ([B, N, C] -> [B*N, C], [B, N, C, H, W] -> [B*N, C, H, W]; a per-example [C]
// makes the vmap batch the loss's batch: [B, C]) with reduction 'none', and
// then reduce per example: the sum over an example's R rows, divided for
// 'mean' by that example's own total weight (the sum of w[t] over its rows
// whose target is not ignore_index; their count without weights). An example
// whose rows are all ignored gets 0/0 = nan for 'mean', as in eager. The
// backward runs one 'none' kernel with each row's gradient g / total_weight of
// its example. A shared weight goes to the kernel as it is; a per-example
// weight is gathered per row ([B, C] at [B, R]) and multiplied in, since the
// kernel takes one weight for all rows.
//
// Note [Why batching rules for the loss ops (and not an own operator)]
// Profiled stock (torch.profiler, torch 2.13, CPU) under vmap(grad), per-sample
// F.cross_entropy on [1, 10] logits, batch 8: functorch runs nll_loss_forward
// and nll_loss_backward through Python decompositions (where, gather, scatter,
// ne, sum, div, ... each dispatched through the vmap layer from Python): 30
// kernels per step, slower than cross_entropy's own log_softmax + gather
// composition. mse/smooth_l1/huber_loss_backward decompose the same way. With
// these rules the step runs 9 kernels and costs what the composition costs
// (bench loss_grad). What remains above vmap(grad) of a plain sum is the most
// an own cross_entropy operator routed at FrontMode could save: a few percent
// of a per-sample MLP step, for hand-written autograd, forward AD and double
// backward of every variant (probabilities, label smoothing, weights, K-dim).
// The aten rules keep ATen's autograd formulas (every order of derivative)
// and serve F.nll_loss, cross_entropy and every other caller.
#include "losses/batch_rules.h"
#include "losses/vmap_dims.h"

#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>

namespace batchrules {

namespace {

std::tuple<Tensor, Tensor> nll_forward_kernel(NllOp op, const Tensor& self, const Tensor& target,
                                              const std::optional<Tensor>& weight,
                                              const c10::SymInt& ignore_index) {
  return op == NllOp::Nll2d
             ? at::nll_loss2d_forward_symint(self, target, weight, at::Reduction::None,
                                             ignore_index)
             : at::nll_loss_forward_symint(self, target, weight, at::Reduction::None, ignore_index);
}

}  // namespace

BatchedPair nll_loss_forward_batch_rule(NllOp op, const Tensor& self,
                                        std::optional<int64_t> self_bdim, const Tensor& target,
                                        std::optional<int64_t> target_bdim,
                                        const std::optional<Tensor>& weight,
                                        std::optional<int64_t> weight_bdim, int64_t reduction,
                                        const c10::SymInt& ignore_index) {
  const c10::SymDimVector self_sizes = logical_sizes(self, self_bdim);
  const c10::SymDimVector weight_sizes =
      weight.has_value() ? logical_sizes(*weight, weight_bdim) : c10::SymDimVector();
  check_nll_loss_forward_shapes(
      op, self_sizes, logical_sizes(target, target_bdim),
      weight.has_value() ? std::optional<c10::SymIntArrayRef>(weight_sizes) : std::nullopt);
  check_nll_target_dtype(target);

  const NllRows rows(op, self_sizes, target, target_bdim,
                     vmap_size({{&self, self_bdim},
                                {&target, target_bdim},
                                {weight.has_value() ? &*weight : nullptr, weight_bdim}}));
  const bool weight_batched = weight_bdim.has_value();
  // See Note [Folding the vmap batch into the loss's rows].
  auto [loss, zero_weight] =
      nll_forward_kernel(op, rows.fold_self(self, self_bdim), rows.target,
                         weight_batched ? std::nullopt : weight, ignore_index);
  // eager returns total_weight 0 for 'none' with a batch dim of its own
  const bool total_weight_is_zero = reduction == at::Reduction::None && rows.per_example_batch;
  if (total_weight_is_zero && !weight_batched) {
    return {loss.view_symint(rows.loss_shape), 0, zero_weight, std::nullopt};
  }

  const Tensor not_ignored = rows.not_ignored(ignore_index);  // [B, R]
  Tensor loss2 = loss.view_symint({rows.batch, rows.rows});   // [B, R]
  // weight w[t] of each row, 0 where ignored
  const Tensor w =
      weight.has_value() ? rows.row_weights(*weight, weight_bdim, not_ignored) : Tensor();
  if (weight_batched) {
    loss2 = loss2 * w;
  }
  if (total_weight_is_zero) {
    return {loss2.view_symint(rows.loss_shape), 0, zero_weight, std::nullopt};
  }
  // B,R -> B
  Tensor total_weight;
  if (w.defined()) {
    total_weight = rows.rows == 1 ? w.view_symint({rows.batch}) : w.sum(1);
  } else {
    const auto dtype = self.scalar_type();
    total_weight = rows.rows == 1 ? not_ignored.view_symint({rows.batch}).to(dtype)
                                  : at::sum(not_ignored, {1}, /*keepdim=*/false, dtype);
  }
  if (reduction == at::Reduction::None) {
    // a per-example [C]: one row, whose weight eager returns as total_weight
    return {loss2.view_symint(rows.loss_shape), 0, total_weight, 0};
  }
  Tensor out = rows.rows == 1 ? loss2.view_symint({rows.batch}) : loss2.sum(1);
  if (reduction == at::Reduction::Mean) {
    out = out / total_weight;
  }
  return {out, 0, total_weight, 0};
}

}  // namespace batchrules
