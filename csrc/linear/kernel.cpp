// Backend kernels (CompositeExplicitAutograd: CPU, CUDA, Meta, ... alike).
//
// Note [Eager kernels delegate to ATen's fused paths]
// The forward validates shapes with our messages and then calls at::linear
// below autograd, so eager batchrules.linear runs exactly ATen's kernels
// (addmm for 2-D input with bias, one flattened GEMM for contiguous N-D input)
// and costs nothing extra, but for the odd biases it adds itself (Note [Biases
// at::linear rejects by layout]). The backward folds all leading dims into one
// GEMM row dimension: grad_input and grad_weight are one mm each, grad_bias one
// reduction. The code is SymInt-aware so FakeTensor and dynamic-shape
// torch.compile can run it directly; no separate fake kernel is needed.
#include "common/batching_utils.h"
#include "linear/shape_checks.h"
#include "ops.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>

namespace batchrules {

namespace {

// Note [Biases at::linear rejects by layout]
// at::linear sends a contiguous input with a bias that squeezes to 1-D through
// addmm, which needs a 2-D weight and a bias of at most 2 dims; otherwise it
// adds the bias in place, which cannot enlarge the output. So it rejects some
// biases that broadcast, e.g. [2, 4, 3] x [3] + [1], for some layouts only.
// We accept by shape alone (check_linear_shapes), hand at::linear the biases
// every one of its paths takes, and add the others ourselves.

// Leading size-1 dims change nothing about how a bias broadcasts to the output
// (which check_linear_shapes ensures it does not enlarge). Dropping them also
// drops the extra one a 1-D input's bias may have: [1, 1, O] -> [O], [1] -> [].
Tensor without_leading_ones(const Tensor& bias, int64_t out_dim) {
  Tensor b = bias;
  while (b.dim() > std::min<int64_t>(out_dim, 1) && b.sym_size(0) == 1) {
    b = b.squeeze(0);
  }
  return b;
}

Tensor linear_kernel(const Tensor& input, const Tensor& weight,
                     const std::optional<Tensor>& bias_opt) {
  constexpr const char* op = "batchrules.linear";
  TORCH_CHECK(input.defined() && weight.defined(), op,
              ": expected input and weight to be tensors, but got None");
  const bool has_bias = bias_opt.has_value() && bias_opt->defined();
  const SymShape out_shape = check_linear_shapes(
      input.sym_sizes(), weight.sym_sizes(),
      has_bias ? std::optional<c10::SymIntArrayRef>(bias_opt->sym_sizes()) : std::nullopt);
  check_input_and_weight(op, input, weight);
  if (!has_bias) {
    return at::linear(input, weight);
  }
  check_same_dtype_and_device(op, input, "input", *bias_opt, "bias");
  const Tensor bias = without_leading_ones(*bias_opt, static_cast<int64_t>(out_shape.size()));
  // See Note [Biases at::linear rejects by layout].
  if (weight.dim() == 2 && (bias.dim() <= 1 || input.dim() == 2)) {
    return at::linear(input, weight, bias);
  }
  return at::add(at::linear(input, weight), bias);
}

// gi = g @ conj(W)    gW = g^T @ conj(x)    gb = sum of g over leading dims
// with x: [*, I] -> [M, I], g: [*, O] -> [M, O], W: [O, I]. A 1-D weight [I]
// is the O == 1 case whose out dim is squeezed (g: [*] -> [M, 1]).
TensorTriple linear_backward_kernel(const Tensor& self, const Tensor& grad_output,
                                    const Tensor& weight, std::array<bool, 3> output_mask) {
  constexpr const char* op = "batchrules.linear_backward";
  TORCH_CHECK(self.defined() && grad_output.defined() && weight.defined(), op,
              ": expected self, grad_output and weight to be tensors, but got None");
  check_linear_backward_shapes(self.sym_sizes(), grad_output.sym_sizes(), weight.sym_sizes());
  check_same_dtype_and_device(op, self, "self", weight, "weight");
  check_same_dtype_and_device(op, self, "self", grad_output, "grad_output");

  const bool weight_1d = weight.dim() == 1;
  // Not reshape(-1, ...): that is ambiguous for empty tensors.
  const c10::SymInt rows = numel_of(self.sym_sizes().slice(0, self.dim() - 1));
  const c10::SymInt in_features = weight.sym_size(-1);
  const c10::SymInt out_features = weight_1d ? c10::SymInt(1) : weight.sym_size(0);
  const Tensor g2 = grad_output.reshape_symint({rows, out_features});
  const Tensor w2 = weight_1d ? weight.unsqueeze(0) : weight;

  Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) {
    // [M, O] x [O, I] -> [M, I]
    grad_input = at::mm(g2, w2.conj()).view_symint(self.sym_sizes());
  }
  if (output_mask[1]) {
    // [O, M] x [M, I] -> [O, I]
    const Tensor x2 = self.reshape_symint({rows, in_features});
    grad_weight = at::mm(g2.t(), x2.conj()).view_symint(weight.sym_sizes());
  }
  if (output_mask[2]) {
    // [M, O] -> [O]   (a 1-D weight has no out dim: -> [])
    grad_bias = g2.sum(0);
    if (weight_1d) {
      grad_bias = grad_bias.squeeze(0);
    }
  }
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, CompositeExplicitAutograd, m) {
  m.impl("linear", TORCH_FN(linear_kernel));
  m.impl("linear_backward", TORCH_FN(linear_backward_kernel));
}

}  // namespace batchrules
