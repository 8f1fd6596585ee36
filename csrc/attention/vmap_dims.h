// Folding the vmap dim into the attention batch dim, shared by every SDPA
// batching rule. See Note [Folding the vmap dim into the attention batch dim].
#pragma once

#include "common/batching_utils.h"

#include <c10/core/SymInt.h>

#include <optional>

namespace batchrules {

// Physical [.., N, ..] (logical [B, ...]) -> [N*B, ...]; an unbatched operand
// is repeated N times, each copy laid out as the operand is.
Tensor fold_batch(const Tensor& t, std::optional<int64_t> bdim, const c10::SymInt& n);

// The inverse for a kernel's result: [N*B, ...] -> [N, B, ...] (a view). B is
// the example's batch, not N*B / N: N may be 0.
Tensor unfold_batch(const Tensor& t, const c10::SymInt& n, const c10::SymInt& batch);

// How a folded mask's batch dim meets the kernel.
enum class MaskBatch {
  kBroadcast,  // a mask every entry shares may keep batch size 1 (CPU flash)
  kFull,       // the kernel takes [N*B, ...]; shared rows are expanded (stride 0)
};

// An attention mask or bias (logical [L, S] or [Bm, Hm, L, S], Bm in {1, B})
// folded against operands of logical batch `batch`: per-example rows become
// [N*B, Hm, L, S]; a mask shared by every example is not copied.
std::optional<Tensor> fold_mask(const std::optional<Tensor>& mask, std::optional<int64_t> bdim,
                                const c10::SymInt& n, const c10::SymInt& batch, MaskBatch mode);

// The efficient-attention kernels need a bias whose batch, head and row
// strides are multiples of 16 elements (SDPA pads the bias's rows so); a
// folded copy that lost that layout is padded again (a copy, sliced back).
Tensor align_efficient_bias(const Tensor& bias);

}  // namespace batchrules
