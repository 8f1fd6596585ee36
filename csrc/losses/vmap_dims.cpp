#include "losses/vmap_dims.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace batchrules {

Tensor batch_first(const Tensor& t, std::optional<int64_t> bdim, const c10::SymInt& batch) {
  if (bdim.has_value()) {
    return move_bdim_to_front(t, bdim);
  }
  c10::SymDimVector sizes{batch};
  sizes.append(t.sym_sizes().begin(), t.sym_sizes().end());
  return t.unsqueeze(0).expand_symint(sizes);
}

NllRows::NllRows(NllOp op, c10::SymIntArrayRef self, const Tensor& target_in,
                 std::optional<int64_t> target_bdim, c10::SymInt batch_in)
    : batch(std::move(batch_in)) {
  Tensor t = batch_first(target_in, target_bdim, batch);
  loss_shape.push_back(batch);
  if (op == NllOp::Nll && self.size() == 1) {
    // [C] per example: each example is one row of a [B, C] problem. A [1]
    // target counts as its only element, as in eager.
    per_example_batch = false;
    rows = 1;
    target = t.dim() == 2 ? t.select(1, 0) : t;
    self_shape = {batch, self[0]};
    return;
  }
  // [N, C] / [N, C, H, W] per example: B*N rows (B*N images for nll_loss2d).
  const c10::SymIntArrayRef per_example = t.sym_sizes().slice(1);
  loss_shape.append(per_example.begin(), per_example.end());
  rows = numel_of(per_example);
  target = t.flatten(0, 1);
  self_shape = {batch * self[0]};
  self_shape.append(self.begin() + 1, self.end());
}

Tensor NllRows::fold_self(const Tensor& self, std::optional<int64_t> self_bdim) const {
  const Tensor x = batch_first(self, self_bdim, batch);
  return per_example_batch ? x.flatten(0, 1) : x;
}

namespace {

// uint8 targets (which the kernels accept) as int64, for comparisons with
// ignore_index (which would wrap to uint8) and as gather indices.
Tensor as_long(const Tensor& target) {
  return target.scalar_type() == at::kByte ? target.to(at::kLong) : target;
}

}  // namespace

Tensor NllRows::not_ignored(const c10::SymInt& ignore_index) const {
  return at::ne(as_long(target), c10::Scalar(ignore_index)).reshape_symint({batch, rows});
}

Tensor NllRows::row_weights(const Tensor& weight, std::optional<int64_t> weight_bdim,
                            const Tensor& not_ignored) const {
  // An ignored row's target may be any value: gather at class 0 there.
  const Tensor safe = at::where(not_ignored, as_long(target).reshape_symint({batch, rows}), 0);
  Tensor w;
  if (weight_bdim.has_value()) {
    // B,C gathered at B,R -> B,R
    const Tensor wb = move_bdim_to_front(weight, weight_bdim);
    w = at::gather(wb.reshape_symint({batch, self_shape[1]}), 1, safe);
  } else {
    // C gathered at B*R -> B,R
    w = weight.reshape(-1).index_select(0, safe.reshape(-1)).view_symint({batch, rows});
  }
  return w * not_ignored;
}

}  // namespace batchrules
