#include "dp/ghost_norm/shape_checks.h"

#include <c10/util/Exception.h>

namespace batchrules {

void check_ghost_norm_inputs(const at::Tensor& rows, const at::Tensor& grads, int64_t biases) {
  constexpr const char* op = "batchrules.ghost_norms_sq";
  TORCH_CHECK(biases >= 0, op, ": expected a count of biases >= 0, but got ", biases);
  TORCH_CHECK(rows.dim() == 3 && grads.dim() == 3, op,
              ": expected rows [B, T, I] and grads [B, T, O], but got shapes ", rows.sym_sizes(),
              " and ", grads.sym_sizes());
  // sym_size: FakeTensor's symbolic batch stays symbolic (a guard, not a specialization).
  TORCH_CHECK(rows.sym_size(0) == grads.sym_size(0) && rows.sym_size(1) == grads.sym_size(1), op,
              ": rows ", rows.sym_sizes(), " and grads ", grads.sym_sizes(),
              " must agree in their first two dims (samples B, rows T)");
  TORCH_CHECK(rows.scalar_type() == grads.scalar_type(), op,
              ": expected rows and grads of one dtype, but got ", rows.scalar_type(), " and ",
              grads.scalar_type());
  TORCH_CHECK(rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kDouble, op,
              ": expected float32 or float64 tensors, but got ", rows.scalar_type());
  TORCH_CHECK(rows.device() == grads.device(), op, ": rows on ", rows.device(), " and grads on ",
              grads.device());
}

}  // namespace batchrules
