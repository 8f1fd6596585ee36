// How the loss rules lay out batched operands: batch dim first, and for the
// nll rules folded into the loss's own rows (see Note [Folding the vmap batch
// into the loss's rows]).
#pragma once

#include "common/batching_utils.h"
#include "losses/shape_checks.h"

#include <c10/core/SymInt.h>

#include <initializer_list>
#include <optional>
#include <utility>

namespace batchrules {

// Physical `t` with its batch dim first; a shared `t` is expanded to B
// (stride 0, not copied).
Tensor batch_first(const Tensor& t, std::optional<int64_t> bdim, const c10::SymInt& batch);

// One nll problem over the rows of all B examples at once.
struct NllRows {
  NllRows(NllOp op, c10::SymIntArrayRef self, const Tensor& target,
          std::optional<int64_t> target_bdim, c10::SymInt batch);

  // self [B, C] for a per-example [C] (the vmap batch is the loss's batch),
  // [B*N, C] for [N, C], [B*N, C, H, W] for [N, C, H, W]: the kernel's self.
  Tensor fold_self(const Tensor& self, std::optional<int64_t> self_bdim) const;

  // The class weight of each row's target, 0 where ignored: [B, R]. `weight`
  // is logical [C] (any shape of C elements), batched or shared.
  Tensor row_weights(const Tensor& weight, std::optional<int64_t> weight_bdim,
                     const Tensor& not_ignored) const;

  // [B, R] true where the row's target is not ignore_index.
  Tensor not_ignored(const c10::SymInt& ignore_index) const;

  c10::SymInt batch;              // B
  c10::SymInt rows;               // R, rows per example (N, N*H*W, or 1 for [C])
  bool per_example_batch = true;  // false for a per-example [C] self
  Tensor target;                  // the kernel's target: [B], [B*N] or [B*N, H, W]
  c10::SymDimVector self_shape;   // the kernel's self shape
  c10::SymDimVector loss_shape;   // reduction 'none': [B], [B, N] or [B, N, H, W]
};

}  // namespace batchrules
