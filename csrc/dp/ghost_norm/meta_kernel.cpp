// The Meta kernel of batchrules::ghost_norms_sq (FakeTensor, torch.compile).
#include "dp/ghost_norm/shape_checks.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace batchrules {

namespace {

at::Tensor ghost_norms_sq_meta(const at::Tensor& rows, const at::Tensor& grads, int64_t biases) {
  check_ghost_norm_inputs(rows, grads, biases);
  return at::empty_symint({rows.sym_size(0)}, rows.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, Meta, m) {
  m.impl("ghost_norms_sq", ghost_norms_sq_meta);
}

}  // namespace batchrules
