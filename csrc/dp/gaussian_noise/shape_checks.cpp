#include "dp/gaussian_noise/shape_checks.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace batchrules {

void check_gaussian_fill_inputs(const at::Tensor& self, double stddev) {
  constexpr const char* op = "batchrules.gaussian_fill_";
  TORCH_CHECK(self.scalar_type() == at::kFloat, op, ": expected a float32 tensor, but got ",
              self.scalar_type());
  TORCH_CHECK(self.is_contiguous(), op, ": expected a contiguous tensor, but got shape ",
              self.sym_sizes(), " with strides ", self.sym_strides());
  TORCH_CHECK(std::isfinite(stddev) && stddev >= 0, op,
              ": expected a finite std >= 0, but got ", stddev);
}

}  // namespace batchrules
