// Small helpers for batching rules that functorch does not export.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/functorch/BatchedTensorImpl.h>
#include <ATen/functorch/TensorWrapper.h>
#include <c10/core/SymInt.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <c10/util/Exception.h>

#include <initializer_list>
#include <optional>
#include <utility>
#include <vector>

namespace batchrules {

using at::Tensor;
using BatchedResult = std::tuple<Tensor, std::optional<int64_t>>;

// Moves the batch dim (if any) to dim 0.
inline Tensor move_bdim_to_front(const Tensor& t, std::optional<int64_t> bdim) {
  if (!bdim.has_value() || *bdim == 0) {
    return t;
  }
  return t.movedim(*bdim, 0);
}

inline int64_t logical_rank(const Tensor& t, std::optional<int64_t> bdim) {
  return bdim.has_value() ? t.dim() - 1 : t.dim();
}

// The per-example sizes of a physical tensor.
inline c10::SymDimVector logical_sizes(const Tensor& t, std::optional<int64_t> bdim) {
  c10::SymDimVector sizes(t.sym_sizes().begin(), t.sym_sizes().end());
  if (bdim.has_value()) {
    sizes.erase(sizes.begin() + *bdim);
  }
  return sizes;
}

// `t` with its batch dim at `pos`: moved there, or, for an operand with none,
// inserted there and expanded to `batch` (a view: nothing is copied).
inline Tensor batch_dim_at(const Tensor& t, std::optional<int64_t> bdim, int64_t pos,
                           int64_t batch) {
  if (bdim.has_value()) {
    return t.movedim(*bdim, pos);
  }
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes.insert(sizes.begin() + pos, batch);
  return t.unsqueeze(pos).expand(sizes);
}

// Removes logical dim `dim` (which must have size 1); the result has its
// batch dim (if any) at the front.
inline BatchedResult squeeze_logical_dim(const Tensor& t, std::optional<int64_t> bdim,
                                         int64_t dim) {
  if (!t.defined()) {
    return {t, std::nullopt};
  }
  if (!bdim.has_value()) {
    return {t.squeeze(dim), std::nullopt};
  }
  return {move_bdim_to_front(t, bdim).squeeze(dim + 1), 0};
}

// The vmap size B: the batch dim's size of the first batched operand (a
// rule runs only when one operand is batched).
inline c10::SymInt vmap_size(
    std::initializer_list<std::pair<const Tensor*, std::optional<int64_t>>> operands) {
  for (const auto& [t, bdim] : operands) {
    if (bdim.has_value()) {
      return t->sym_size(*bdim);
    }
  }
  TORCH_INTERNAL_ASSERT(false, "a batching rule ran with no batched operand");
}

// Note [Aligning the operands of a pointwise op]
// Shapes physical, B the vmap size: a batched operand gets its batch dim in
// front and is padded with size-1 dims after it up to the larger logical
// rank `rank`, so the batch dims line up and the per-example dims broadcast
// as in eager:
//   g: B,N   x: B,M,N  ->  g: B,1,N   x: B,M,N  ->  B,M,N
// A shared operand is returned as it is: it broadcasts right-aligned against
// the batched one's logical dims:
//   g: B,M,N   x: N  ->  B,M,N        g: B,N   x: M,N  ->  g: B,1,N  ->  B,M,N
// movedim and the padding are views: nothing is copied.
inline Tensor align_batch_first(const Tensor& t, std::optional<int64_t> bdim, int64_t rank) {
  if (!bdim.has_value()) {
    return t;
  }
  Tensor out = move_bdim_to_front(t, bdim);
  while (out.dim() < rank + 1) {
    out = out.unsqueeze(1);
  }
  return out;
}

// Product of the given sizes (empty product is 1). Used instead of
// reshape(-1, ..), which is ambiguous for empty tensors.
inline c10::SymInt numel_of(c10::SymIntArrayRef sizes) {
  c10::SymInt n = 1;
  for (const auto& s : sizes) {
    n = n * s;
  }
  return n;
}

// Physical [*dims, F] -> [prod(dims), F]: a view when the leading dims fold,
// one copy otherwise; 2-D tensors are returned as they are.
inline Tensor fold_leading_dims(const Tensor& t) {
  if (t.dim() == 2) {
    return t;
  }
  return t.reshape_symint({numel_of(t.sym_sizes().slice(0, t.dim() - 1)), t.sym_size(-1)});
}

// The inverse for a GEMM result: [prod(dims), F] -> [*dims, F] with `dims` the
// leading dims of `like`.
inline Tensor unfold_leading_dims(const Tensor& t, const Tensor& like) {
  if (like.dim() == 2) {
    return t;
  }
  c10::SymDimVector sizes(like.sym_sizes().begin(), like.sym_sizes().end() - 1);
  sizes.push_back(t.sym_size(-1));
  return t.view_symint(sizes);
}

// Physical [.., B, .., F] (batch dim anywhere) -> [batch, rows, F], where rows
// is the product of the logical leading dims; an unbatched [*lead, F] is
// expanded to that shape (stride 0, not copied), for one bmm with a batched
// operand.
inline Tensor batch_first_3d(const Tensor& t, std::optional<int64_t> bdim, const c10::SymInt& batch,
                             const c10::SymInt& rows) {
  if (!bdim.has_value()) {
    return fold_leading_dims(t).expand_symint({batch, rows, t.sym_size(-1)});
  }
  const Tensor f = move_bdim_to_front(t, bdim);
  return f.reshape_symint({batch, rows, f.sym_size(-1)});
}

// Whether `t` is still batched at an enclosing vmap level, looking through
// grad wrappers: every op on it is then batched again by functorch, which
// has no batching rule for the fused addmm/baddbmm and decomposes them.
inline bool batched_at_outer_level(const Tensor& t) {
  Tensor cur = t;
  while (cur.defined()) {
    if (at::functorch::isBatchedTensor(cur)) {
      return true;
    }
    const auto* wrapper = at::functorch::maybeGetTensorWrapper(cur);
    if (wrapper == nullptr) {
      return false;
    }
    cur = wrapper->value();
  }
  return false;
}

// Whether `t` is batched at vmap level `level`, looking through grad wrappers
// and the BatchedTensors of other levels.
inline bool batched_at_level_through_wrappers(const Tensor& t, int64_t level) {
  Tensor cur = t;
  while (cur.defined()) {
    if (const auto* batched = at::functorch::maybeGetBatchedImpl(cur)) {
      if (batched->level() == level) {
        return true;
      }
      cur = batched->value();
      continue;
    }
    const auto* wrapper = at::functorch::maybeGetTensorWrapper(cur);
    if (wrapper == nullptr) {
      return false;
    }
    cur = wrapper->value();
  }
  return false;
}

// The tensor below every BatchedTensor and grad wrapper of `t`: its elements
// are all the examples' (none when some vmap size is 0).
inline Tensor physical_tensor(const Tensor& t) {
  Tensor cur = t;
  while (cur.defined()) {
    if (const auto* batched = at::functorch::maybeGetBatchedImpl(cur)) {
      cur = batched->value();
    } else if (const auto* wrapper = at::functorch::maybeGetTensorWrapper(cur)) {
      cur = wrapper->value();
    } else {
      break;
    }
  }
  return cur;
}

// Whether `t` is being traced for torch.compile (AOTAutograd's functional and
// fake tensors carry the Python key, under its dispatch modes): rules then
// keep GEMMs and adds apart as functorch emits them (Note [GEMM and bias
// apart when traced], linear/batch_rule_linear.cpp).
inline bool traced_for_compile(const Tensor& t) {
  return t.key_set().has(c10::DispatchKey::Python) ||
         c10::impl::TorchDispatchModeTLS::any_modes_set();
}

}  // namespace batchrules
