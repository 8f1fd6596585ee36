// Batching rule for aten::nll_loss_backward and aten::nll_loss2d_backward.
// See Note [Folding the vmap batch into the loss's rows].
//
// The kernel reads only self's shape and options (its result is zeros with
// -w[t] * g at each row's target), so the folded self is allocated, not
// copied from the input, whether or not the input is batched.
#include "losses/batch_rules.h"
#include "losses/vmap_dims.h"

#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>

namespace batchrules {

namespace {

Tensor nll_backward_kernel(NllOp op, const Tensor& grad_output, const Tensor& self,
                           const Tensor& target, const std::optional<Tensor>& weight,
                           const c10::SymInt& ignore_index, const Tensor& total_weight) {
  return op == NllOp::Nll2d
             ? at::nll_loss2d_backward_symint(grad_output, self, target, weight,
                                              at::Reduction::None, ignore_index, total_weight)
             : at::nll_loss_backward_symint(grad_output, self, target, weight, at::Reduction::None,
                                            ignore_index, total_weight);
}

// A single element of `t` (a view): what the kernel requires as total_weight,
// which it does not use for reduction 'none'.
// The kernel's total_weight: one element, unread with reduction 'none' (an
// empty batch has none to take).
Tensor first_element(const Tensor& t) {
  if (t.sym_numel() == 0) {
    return t.new_zeros({});
  }
  Tensor e = t;
  while (e.dim() > 0) {
    e = e.select(0, 0);
  }
  return e;
}

// The gradient of each row's loss, [B, R]: g itself for 'none'; g of its
// example ([B] or a shared []), divided for 'mean' by the example's total
// weight, for every row of the example.
Tensor row_grads(const NllRows& rows, const Tensor& grad_output,
                 std::optional<int64_t> grad_output_bdim, int64_t reduction,
                 const Tensor& total_weight, std::optional<int64_t> total_weight_bdim) {
  if (reduction == at::Reduction::None) {
    return batch_first(grad_output, grad_output_bdim, rows.batch)
        .reshape_symint({rows.batch, rows.rows});
  }
  // per example: logical [] or [1] -> [B, 1], shared -> [1, 1]
  const auto per_example = [&](const Tensor& t, std::optional<int64_t> bdim) {
    return bdim.has_value() ? move_bdim_to_front(t, bdim).reshape_symint({rows.batch, 1})
                            : t.reshape({1, 1});
  };
  Tensor g = per_example(grad_output, grad_output_bdim);
  if (reduction == at::Reduction::Mean) {
    g = g / per_example(total_weight, total_weight_bdim);
  }
  return g.expand_symint({rows.batch, rows.rows});
}

}  // namespace

BatchedResult nll_loss_backward_batch_rule(
    NllOp op, const Tensor& grad_output, std::optional<int64_t> grad_output_bdim,
    const Tensor& self, std::optional<int64_t> self_bdim, const Tensor& target,
    std::optional<int64_t> target_bdim, const std::optional<Tensor>& weight,
    std::optional<int64_t> weight_bdim, int64_t reduction, const c10::SymInt& ignore_index,
    const Tensor& total_weight, std::optional<int64_t> total_weight_bdim) {
  const c10::SymDimVector self_sizes = logical_sizes(self, self_bdim);
  const c10::SymDimVector weight_sizes =
      weight.has_value() ? logical_sizes(*weight, weight_bdim) : c10::SymDimVector();
  check_nll_loss_backward_shapes(
      op, logical_sizes(grad_output, grad_output_bdim), self_sizes,
      logical_sizes(target, target_bdim),
      weight.has_value() ? std::optional<c10::SymIntArrayRef>(weight_sizes) : std::nullopt,
      reduction, logical_sizes(total_weight, total_weight_bdim));
  check_nll_target_dtype(target);

  const NllRows rows(op, self_sizes, target, target_bdim,
                     vmap_size({{&grad_output, grad_output_bdim},
                                {&self, self_bdim},
                                {&target, target_bdim},
                                {weight.has_value() ? &*weight : nullptr, weight_bdim},
                                {&total_weight, total_weight_bdim}}));
  Tensor g = row_grads(rows, grad_output, grad_output_bdim, reduction, total_weight,
                       total_weight_bdim);  // [B, R]
  const bool weight_batched = weight_bdim.has_value();
  if (weight_batched) {
    g = g * rows.row_weights(*weight, weight_bdim, rows.not_ignored(ignore_index));
  }
  const Tensor grad_input = nll_backward_kernel(op, g.reshape_symint(rows.target.sym_sizes()),
                                                at::empty_symint(rows.self_shape, self.options()),
                                                rows.target, weight_batched ? std::nullopt : weight,
                                                ignore_index, first_element(total_weight));
  c10::SymDimVector out_shape{rows.batch};
  out_shape.append(self_sizes.begin(), self_sizes.end());
  return {grad_input.view_symint(out_shape), 0};
}

}  // namespace batchrules
