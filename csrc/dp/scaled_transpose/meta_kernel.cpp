// The Meta kernel of batchrules::scaled_transpose (FakeTensor, torch.compile).
#include "dp/scaled_transpose/shape_checks.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace batchrules {

namespace {

at::Tensor scaled_transpose_meta(const at::Tensor& x, const at::Tensor& scale) {
  check_scaled_transpose_inputs(x, scale);
  return at::empty_symint({x.sym_size(2), x.sym_size(0), x.sym_size(1)}, x.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, Meta, m) {
  m.impl("scaled_transpose", scaled_transpose_meta);
}

}  // namespace batchrules
