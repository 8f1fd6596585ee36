#include "dp/scaled_transpose/shape_checks.h"

#include <c10/util/Exception.h>

namespace batchrules {

void check_scaled_transpose_inputs(const at::Tensor& x, const at::Tensor& scale) {
  constexpr const char* op = "batchrules.scaled_transpose";
  TORCH_CHECK(x.dim() == 3 && scale.dim() == 1, op,
              ": expected x [B, T, K] and scale [B], but got shapes ", x.sym_sizes(), " and ",
              scale.sym_sizes());
  // sym_size: FakeTensor's symbolic batch stays symbolic (a guard, not a specialization).
  TORCH_CHECK(x.sym_size(0) == scale.sym_size(0), op, ": x ", x.sym_sizes(), " has ",
              x.sym_size(0), " samples but scale ", scale.sym_sizes(), " has ",
              scale.sym_size(0));
  TORCH_CHECK(x.scalar_type() == scale.scalar_type(), op,
              ": expected x and scale of one dtype, but got ", x.scalar_type(), " and ",
              scale.scalar_type());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), op,
              ": expected floating-point tensors, but got ", x.scalar_type());
  TORCH_CHECK(x.device() == scale.device(), op, ": x on ", x.device(), " and scale on ",
              scale.device());
}

}  // namespace batchrules
