// The normalization works over trailing dims only: the vmap dim, moved to
// the front, is one more leading dim. B,*lead,*shape -> (B,*lead,*shape ;
// B,*lead,1...)
#include "normalize/batch_rules.h"
#include "ops.h"

#include <c10/util/Exception.h>

namespace batchrules {

std::tuple<Tensor, std::optional<int64_t>, Tensor, std::optional<int64_t>> normalize_batch_rule(
    const Tensor& x, std::optional<int64_t> x_bdim, at::IntArrayRef normalized_shape,
    double eps) {
  const auto sizes = logical_sizes(x, x_bdim);
  const auto rank = static_cast<int64_t>(sizes.size());
  const auto n = static_cast<int64_t>(normalized_shape.size());
  bool trailing = rank >= n;
  for (int64_t i = 0; trailing && i < n; ++i) {
    trailing = sizes[rank - n + i] == normalized_shape[i];
  }
  TORCH_CHECK(trailing, "batchrules.normalize: expected a per-example input whose last dims are ",
              "normalized_shape ", normalized_shape, ", but got per-example shape ",
              c10::SymIntArrayRef(sizes));
  auto [normalized, rstd] = normalize_op().call(move_bdim_to_front(x, x_bdim), normalized_shape,
                                                eps);
  return {normalized, 0, rstd, 0};
}

}  // namespace batchrules
