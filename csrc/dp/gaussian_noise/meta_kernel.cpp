// The Meta kernel of batchrules::gaussian_fill_ (FakeTensor, torch.compile).
#include "dp/gaussian_noise/shape_checks.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace batchrules {

namespace {

void gaussian_fill_meta(at::Tensor& self, int64_t /*key*/, double stddev, bool /*accumulate*/) {
  check_gaussian_fill_inputs(self, stddev);
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, Meta, m) {
  m.impl("gaussian_fill_", gaussian_fill_meta);
}

}  // namespace batchrules
