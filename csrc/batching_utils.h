// Small helpers for batching rules that functorch does not export.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>

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

// Product of the given sizes (empty product is 1).
inline c10::SymInt numel_of(c10::SymIntArrayRef sizes) {
  c10::SymInt n = 1;
  for (const auto& s : sizes) {
    n = n * s;
  }
  return n;
}

}  // namespace batchrules
