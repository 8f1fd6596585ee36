// The FuncTorchBatched kernel of batchrules::normalize: the rule of
// batch_rule_normalize.cpp behind the shared plumbing (Note [Hand-written
// vmap plumbing]).
#include "common/vmap_plumbing.h"
#include "normalize/batch_rules.h"
#include "ops.h"

#include <torch/library.h>

namespace batchrules {

namespace {

std::tuple<Tensor, Tensor> normalize_batched(const Tensor& input,
                                             at::IntArrayRef normalized_shape, double eps) {
  const BatchedKernelScope scope("batchrules.normalize");
  const int64_t level = scope.level();
  if (!any_batched_at(level, input)) {
    return normalize_op().call(input, normalized_shape, eps);
  }
  auto [x, x_bdim] = unwrap_at(input, level);
  auto [normalized, normalized_bdim, rstd, rstd_bdim] =
      normalize_batch_rule(x, x_bdim, normalized_shape, eps);
  return {wrap_at(normalized, normalized_bdim, level), wrap_at(rstd, rstd_bdim, level)};
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, FuncTorchBatched, m) {
  m.impl("normalize", TORCH_FN(normalize_batched));
}

}  // namespace batchrules
