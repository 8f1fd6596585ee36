// The CPU kernel of batchrules::scaled_gram: sum_i scale_i x_i^T y_i over
// every row of every sample, [M, N]: a linear-like layer's clipped sum
// (batchrules/dp/gemm.py).
//
// Note [The clipped sum as one op]
// On the CPU, float32 clipped sums run as oneDNN's matmul, through aten's
// mkldnn::_linear_pointwise (Note [oneDNN for the clipped sums] in gemm.py).
// Traced, that op cannot be left in a graph: Inductor lowers it for frozen
// weights only. Inside this op's kernel it is one opaque call, run as eager
// runs it, so a compiled DP step forms its sums with the same GEMM as the
// eager one. The coefficients are folded into the narrower operand, which
// batchrules::scaled_transpose writes as oneDNN reads its left operand; the
// wider one is read in place, transposed, when its rows are packed one after
// the other. Otherwise (spaced or overlapping rows, for which oneDNN runs a
// reference kernel; a torch without oneDNN, or with it disabled; empty
// operands) the product is aten's mm.
#include "dp/scaled_gram/shape_checks.h"
#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <optional>
#include <string>

namespace batchrules {

namespace {

// aten's oneDNN linear (X W^T) where this torch registers it.
const std::optional<c10::OperatorHandle>& onednn_linear() {
  static const std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  return op;
}

// a [K, R] times wide_rows [R, W], which has packed rows: [K, W].
at::Tensor onednn_mm(const c10::OperatorHandle& op, const at::Tensor& a,
                     const at::Tensor& wide_rows) {
  c10::List<std::optional<at::Scalar>> scalars;
  scalars.push_back(std::nullopt);
  torch::jit::Stack stack{a,
                          wide_rows.t(),
                          c10::IValue(),
                          c10::IValue(std::string("none")),
                          c10::IValue(scalars),
                          c10::IValue(std::string())};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

at::Tensor scaled_gram_cpu(const at::Tensor& x, const at::Tensor& y, const at::Tensor& scale) {
  check_scaled_gram_inputs(x, y, scale);
  const int64_t rows = x.size(0) * x.size(1);
  const bool scale_x = x.size(2) <= y.size(2);
  const at::Tensor& narrow = scale_x ? x : y;
  const at::Tensor& wide = scale_x ? y : x;
  const at::Tensor wide_rows = wide.reshape({rows, wide.size(2)});
  // K,B,T -> K,R: the narrower operand scaled, transposed
  const at::Tensor scaled =
      scaled_transpose_op().call(narrow, scale).view({narrow.size(2), rows});
  const auto& onednn = onednn_linear();
  // oneDNN where the wider operand's rows are packed (see the Note)
  const bool onednn_runs = onednn.has_value() && x.scalar_type() == at::kFloat &&
                           at::globalContext().userEnabledMkldnn() &&
                           wide_rows.is_contiguous() && scaled.numel() > 0 &&
                           wide_rows.numel() > 0;
  // K,R x R,W -> K,W
  const at::Tensor out =
      onednn_runs ? onednn_mm(*onednn, scaled, wide_rows) : at::mm(scaled, wide_rows);
  return scale_x ? out : out.t().contiguous();
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, CPU, m) {
  m.impl("scaled_gram", scaled_gram_cpu);
}

}  // namespace batchrules
