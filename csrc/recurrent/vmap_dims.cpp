#include "recurrent/vmap_dims.h"

#include <ATen/ATen.h>

namespace batchrules {

namespace {

// Dims pos, pos+1 as one; an undefined operand stays undefined.
Tensor fold_into(const Tensor& t, std::optional<int64_t> bdim, int64_t pos, int64_t batch) {
  return t.defined() ? batch_dim_at(t, bdim, pos, batch).flatten(pos, pos + 1) : t;
}

BatchedResult unfold_from(const Tensor& t, int64_t pos, int64_t batch, int64_t inner) {
  if (!t.defined()) {
    return {t, std::nullopt};
  }
  return {t.unflatten(pos, {batch, inner}), pos};
}

}  // namespace

Tensor BatchPlacement::seq(const Tensor& t, std::optional<int64_t> bdim) const {
  if (!into_groups) {
    return fold_into(t, bdim, 1 + grouped, batch);  // T,(E,)B,N,F -> T,(E,)B*N,F
  }
  if (!t.defined()) {
    return t;
  }
  const Tensor b = batch_dim_at(t, bdim, 1, batch);  // T,B,(E,)N,F
  return grouped ? b.flatten(1, 2) : b;
}

Tensor BatchPlacement::state(const Tensor& t, std::optional<int64_t> bdim) const {
  if (!into_groups) {
    return fold_into(t, bdim, grouped, batch);  // (E,)B,N,F -> (E,)B*N,F
  }
  return weight(t, bdim);
}

Tensor BatchPlacement::weight(const Tensor& t, std::optional<int64_t> bdim) const {
  if (!into_groups) {
    TORCH_INTERNAL_ASSERT(!bdim.has_value(), "a batched weight must be folded into the groups");
    return t;
  }
  if (!t.defined()) {
    return t;
  }
  const Tensor b = batch_dim_at(t, bdim, 0, batch);  // B,(E,)*w
  return grouped ? b.flatten(0, 1) : b;
}

BatchedResult BatchPlacement::seq_out(const Tensor& t) const {
  if (!into_groups) {
    return unfold_from(t, 1 + grouped, batch, inner);
  }
  if (!t.defined() || !grouped) {
    return {t, t.defined() ? std::optional<int64_t>(1) : std::nullopt};
  }
  return unfold_from(t, 1, batch, inner);
}

BatchedResult BatchPlacement::state_out(const Tensor& t) const {
  if (!into_groups) {
    return unfold_from(t, grouped, batch, inner);
  }
  if (!t.defined() || !grouped) {
    return {t, t.defined() ? std::optional<int64_t>(0) : std::nullopt};
  }
  return unfold_from(t, 0, batch, inner);
}

}  // namespace batchrules
