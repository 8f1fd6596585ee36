// The Meta kernel of batchrules::scaled_gram (FakeTensor, torch.compile).
#include "dp/scaled_gram/shape_checks.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace batchrules {

namespace {

at::Tensor scaled_gram_meta(const at::Tensor& x, const at::Tensor& y, const at::Tensor& scale) {
  check_scaled_gram_inputs(x, y, scale);
  return at::empty_symint({x.sym_size(2), y.sym_size(2)}, x.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, Meta, m) {
  m.impl("scaled_gram", scaled_gram_meta);
}

}  // namespace batchrules
