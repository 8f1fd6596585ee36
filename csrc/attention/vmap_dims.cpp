// Note [Folding the vmap dim into the attention batch dim]
// Every fused SDPA kernel takes [B, H, L, E] operands and treats each of the
// B attention batch entries on its own, so a vmap of size N folds into B: one
// kernel call on [N*B, H, L, E], each result viewed back as [N, B, ...]. The
// folded index is n*B + b, as in functorch's rules for the CUDA forwards, so
// a folded backward meets the dropout masks of its folded forward (see Note
// [Dropout in a folded backward]). Shapes are physical, N the vmap size:
//  - batched operand: [N, B, ...] after moving its batch dim to the front,
//    flattened (a view when N and B are adjacent in memory, one copy else:
//    nn.MultiheadAttention lays an example out sequence-first, [L, B, H, E]
//    in memory, so with B > 1 (ensembles) q, k, v and grad_out are copied,
//    a small part of an ensemble's encoder-layer step; per-sample gradients
//    have B = 1 and fold as views);
//  - unbatched operand: N copies, each with the operand's own layout (the
//    kernels index the batch with one stride, which cannot map n*B + b to b;
//    the CPU flash forward returns `out` as [B, L, H, E] in memory and its
//    backward gets it back so);
//  - masks and biases: rows of their own per example fold like operands (an
//    example's [1, ..] rows expanded to its B entries first); rows shared by
//    every example are not copied: they keep broadcasting where the kernel
//    broadcasts a size-1 batch (CPU flash), else expand to N*B (stride 0).
// A last dim that is not contiguous is made so: the fused kernels read rows
// as contiguous without checking it (stock eager gets a wrong result, SDPA
// itself never picks a fused kernel for such inputs).
#include "attention/vmap_dims.h"

#include <ATen/ops/constant_pad_nd.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>
#include <vector>

namespace batchrules {

namespace {

Tensor with_contiguous_rows(const Tensor& t) {
  return t.sym_size(-1) != 1 && t.sym_stride(-1) != 1 ? t.contiguous() : t;
}

// [B, ...] -> [N, B, ...]: N dense copies, each laid out as `t` (dims ordered
// by stride in memory), the copy index outermost.
Tensor repeat_preserving_layout(const Tensor& t, const c10::SymInt& n) {
  const int64_t rank = t.dim();
  std::vector<int64_t> order(rank);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return t.sym_stride(a) > t.sym_stride(b); });
  const Tensor in_memory_order = t.permute(order);
  c10::SymDimVector sizes(in_memory_order.sym_sizes().begin(), in_memory_order.sym_sizes().end());
  sizes.insert(sizes.begin(), n);
  const Tensor copies = in_memory_order.unsqueeze(0).expand_symint(sizes).contiguous();
  std::vector<int64_t> back(rank + 1);
  back[0] = 0;
  for (int64_t i = 0; i < rank; ++i) {
    back[order[i] + 1] = i + 1;
  }
  return copies.permute(back);
}

Tensor flatten_front(const Tensor& t) {
  c10::SymDimVector sizes(t.sym_sizes().begin() + 1, t.sym_sizes().end());
  sizes[0] = t.sym_size(0) * t.sym_size(1);
  return t.reshape_symint(sizes);
}

}  // namespace

Tensor fold_batch(const Tensor& t, std::optional<int64_t> bdim, const c10::SymInt& n) {
  if (!t.defined()) {
    return t;
  }
  const Tensor front =
      bdim.has_value() ? move_bdim_to_front(t, bdim) : repeat_preserving_layout(t, n);
  return with_contiguous_rows(flatten_front(front));
}

Tensor unfold_batch(const Tensor& t, const c10::SymInt& n, const c10::SymInt& batch) {
  if (!t.defined()) {
    return t;
  }
  c10::SymDimVector sizes(t.sym_sizes().begin(), t.sym_sizes().end());
  sizes[0] = batch;
  sizes.insert(sizes.begin(), n);
  return t.view_symint(sizes);
}

std::optional<Tensor> fold_mask(const std::optional<Tensor>& mask, std::optional<int64_t> bdim,
                                const c10::SymInt& n, const c10::SymInt& batch, MaskBatch mode) {
  if (!mask.has_value() || !mask->defined()) {
    return mask;
  }
  Tensor f;
  if (!bdim.has_value()) {
    f = mask->dim() == 2 ? mask->unsqueeze(0).unsqueeze(0) : *mask;  // Bm,Hm,L,S
    if (f.sym_size(0) != 1 && f.sym_stride(0) != 0) {
      // B,Hm,L,S with B > 1 rows of its own: example n reads them at n*B + b.
      return fold_batch(f, std::nullopt, n);
    }
    // One row (or B expanded from one): every entry of N*B reads it.
    if (mode == MaskBatch::kBroadcast) {
      return mask->dim() == 2 ? *mask : f.narrow(0, 0, 1);
    }
    c10::SymDimVector sizes(f.sym_sizes().begin(), f.sym_sizes().end());
    sizes[0] = n * batch;
    return f.narrow(0, 0, 1).expand_symint(sizes);
  }
  f = move_bdim_to_front(*mask, bdim);  // N,L,S or N,Bm,Hm,L,S
  if (f.dim() == 3) {
    f = f.unsqueeze(1).unsqueeze(1);  // N,1,1,L,S
  }
  if (f.sym_size(1) != batch) {
    // N,1,Hm,L,S -> N,B,Hm,L,S: every b of example n reads example n's rows.
    c10::SymDimVector sizes(f.sym_sizes().begin(), f.sym_sizes().end());
    sizes[1] = batch;
    f = f.expand_symint(sizes);
  }
  return with_contiguous_rows(flatten_front(f));
}

Tensor align_efficient_bias(const Tensor& bias) {
  constexpr int64_t kAlignment = 16;
  bool aligned = true;
  for (int64_t d = 0; d + 1 < bias.dim(); ++d) {
    aligned = aligned && bias.sym_stride(d) % kAlignment == 0;
  }
  if (aligned) {
    return bias;
  }
  const c10::SymInt cols = bias.sym_size(-1);
  const c10::SymInt pad = (kAlignment - cols % kAlignment) % kAlignment;
  return at::constant_pad_nd_symint(bias, {0, pad}).narrow_symint(-1, 0, cols);
}

}  // namespace batchrules
