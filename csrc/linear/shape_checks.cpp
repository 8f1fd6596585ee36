#include "linear/shape_checks.h"

#include <c10/util/Exception.h>

namespace batchrules {

namespace {

void check_ranks(const char* op, c10::SymIntArrayRef input, c10::SymIntArrayRef weight) {
  TORCH_CHECK(!input.empty() && !weight.empty(), op,
              ": both input and weight need to be at least 1-D, but got input of shape ", input,
              " and weight of shape ", weight);
  TORCH_CHECK(weight.size() <= 2, op,
              ": weight must be 1-D (in_features) or 2-D (out_features, in_features), but got "
              "weight of shape ",
              weight);
  // aten's message first (what users search for), as F.linear's GEMM words it.
  const c10::SymInt rows =
      input.size() == 1 ? c10::SymInt(1) : numel_of(input.slice(0, input.size() - 1));
  TORCH_CHECK(input.back() == weight.back(), "mat1 and mat2 shapes cannot be multiplied (", rows,
              "x", input.back(), " and ", weight.back(), "x",
              weight.size() == 2 ? weight.front() : c10::SymInt(1), "); ", op,
              ": input and weight shapes cannot be multiplied (input ", input, " and weight ",
              weight, "): input.size(-1) must equal weight.size(-1)");
}

SymShape output_shape(c10::SymIntArrayRef input, c10::SymIntArrayRef weight) {
  SymShape out(input.begin(), input.end() - 1);
  if (weight.size() == 2) {
    out.push_back(weight.front());
  }
  return out;
}

// True when `from` expands to `to` without changing `to` (right-aligned
// broadcasting where every dim of `from` is 1 or matches).
bool expands_to(c10::SymIntArrayRef from, c10::SymIntArrayRef to) {
  if (from.size() > to.size()) {
    return false;
  }
  const auto offset = to.size() - from.size();
  for (size_t i = 0; i < from.size(); ++i) {
    if (from[i] != 1 && from[i] != to[offset + i]) {
      return false;
    }
  }
  return true;
}

}  // namespace

SymShape check_linear_shapes(c10::SymIntArrayRef input, c10::SymIntArrayRef weight,
                             std::optional<c10::SymIntArrayRef> bias) {
  constexpr const char* op = "batchrules.linear";
  check_ranks(op, input, weight);
  SymShape out = output_shape(input, weight);
  if (bias.has_value()) {
    // F.linear runs 2-D input with a bias through addmm, which rejects a 1-D
    // weight; we reject the same inputs, with a message that says why.
    TORCH_CHECK(!(input.size() == 2 && weight.size() == 1), op,
                ": a bias is not supported for 2-D input with 1-D weight (input ", input,
                ", weight ", weight, ", bias ", *bias,
                "), as in torch.nn.functional.linear; use a 2-D weight of shape [1, ",
                weight.back(), "]");
    // 1-D input is computed as a 1-row matrix, so F.linear lets the bias
    // broadcast against [1, *output].
    SymShape target = out;
    if (input.size() == 1) {
      target.insert(target.begin(), c10::SymInt(1));
    }
    TORCH_CHECK(expands_to(*bias, target), op, ": bias of shape ", *bias,
                " cannot be broadcast to the output shape ", c10::SymIntArrayRef(out), " of input ",
                input, " and weight ", weight);
  }
  return out;
}

void check_linear_backward_shapes(c10::SymIntArrayRef self, c10::SymIntArrayRef grad_output,
                                  c10::SymIntArrayRef weight) {
  constexpr const char* op = "batchrules.linear_backward";
  check_ranks(op, self, weight);
  const SymShape out = output_shape(self, weight);
  TORCH_CHECK(grad_output.equals(out), op, ": grad_output of shape ", grad_output,
              " does not match the output shape ", c10::SymIntArrayRef(out),
              " of linear with input ", self, " and weight ", weight);
}

void check_input_and_weight(const char* op, const at::Tensor& input, const at::Tensor& weight) {
  // aten's message first, as F.linear's GEMM words it.
  TORCH_CHECK(input.scalar_type() == weight.scalar_type(),
              "expected m1 and m2 to have the same dtype, but got: ", input.dtype(), " != ",
              weight.dtype(), "; ", op,
              ": expected input and weight to have the same dtype, but got input ",
              input.scalar_type(), " and weight ", weight.scalar_type());
  check_same_dtype_and_device(op, input, "input", weight, "weight");
}

void check_same_dtype_and_device(const char* op, const at::Tensor& a, const char* a_name,
                                 const at::Tensor& b, const char* b_name) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, ": expected ", a_name, " and ", b_name,
              " to have the same dtype, but got ", a_name, " ", a.scalar_type(), " and ", b_name,
              " ", b.scalar_type());
  const bool cpu_scalar = b.dim() == 0 && b.device().is_cpu();
  TORCH_CHECK(a.device() == b.device() || cpu_scalar, op, ": expected ", a_name, " and ", b_name,
              " to be on the same device, but got ", a_name, " on ", a.device(), " and ", b_name,
              " on ", b.device());
}

}  // namespace batchrules
