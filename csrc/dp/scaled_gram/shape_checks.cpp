#include "dp/scaled_gram/shape_checks.h"

#include <c10/util/Exception.h>

namespace batchrules {

void check_scaled_gram_inputs(const at::Tensor& x, const at::Tensor& y, const at::Tensor& scale) {
  constexpr const char* op = "batchrules.scaled_gram";
  TORCH_CHECK(x.dim() == 3 && y.dim() == 3 && scale.dim() == 1, op,
              ": expected x [B, T, M], y [B, T, N] and scale [B], but got shapes ", x.sym_sizes(),
              ", ", y.sym_sizes(), " and ", scale.sym_sizes());
  // sym_size: FakeTensor's symbolic batch stays symbolic (a guard, not a specialization).
  TORCH_CHECK(x.sym_size(0) == y.sym_size(0) && x.sym_size(1) == y.sym_size(1) &&
                  x.sym_size(0) == scale.sym_size(0),
              op, ": x ", x.sym_sizes(), ", y ", y.sym_sizes(), " and scale ", scale.sym_sizes(),
              " must agree in samples B (and x and y in rows T)");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && x.scalar_type() == scale.scalar_type(), op,
              ": expected x, y and scale of one dtype, but got ", x.scalar_type(), ", ",
              y.scalar_type(), " and ", scale.scalar_type());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), op,
              ": expected floating-point tensors, but got ", x.scalar_type());
  TORCH_CHECK(x.device() == y.device() && x.device() == scale.device(), op, ": x on ", x.device(),
              ", y on ", y.device(), " and scale on ", scale.device());
}

}  // namespace batchrules
