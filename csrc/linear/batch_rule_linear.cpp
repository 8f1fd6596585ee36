// Batching rule for batchrules::linear.
#include "linear/batch_rules.h"
#include "linear/shape_checks.h"
#include "ops.h"

#include <ATen/ATen.h>

// Note [Batch dims and GEMMs in the linear rule]
// Shapes are physical: B the vmap size, lead the logical leading dims of the
// input (M their product), I/O the in/out features. A row bias (logical [O],
// [1] or []) rides on the GEMM:
//  - weight shared: the batch folds into the GEMM rows, [B*M, I], one addmm
//    through batchrules::linear.
//  - weight batched: one baddbmm, [B, M, I] x [B, I, O] + bias; a shared
//    input is expanded to [B, M, I] (stride 0, not copied).
// A bias the GEMM cannot take (batched while the weight is shared, or one
// with leading dims) is added after it: GEMM + one broadcast add.
//
// Note [Contiguous per-example results]
// Every result is batch-first with each example contiguous, as eager
// F.linear's output is: user code calls .view() on it (q_proj(x).view(B, T,
// H, D)), and functorch's view rule fails on an example that is not. So a
// batch dim elsewhere in the input moves to the front (the fold copies the
// input), and a shared input with batched weights runs as the expanded
// baddbmm, not one addmm against the stacked [B*O, I] weights: that result
// needs a copy to be contiguous, and addmm + copy is the slower of the two
// for ensemble shapes.
//
// Note [Nested vmap and fused GEMMs]
// functorch has no batching rule for addmm/baddbmm; under an enclosing vmap
// level it decomposes them into mm/bmm + mul + add. So the shared-weight
// branch calls batchrules::linear, and the enclosing level runs this rule
// again. So does a shared input with batched weights while anything is
// batched at an enclosing level: one linear against the stacked [B*O, I]
// weights plus one output copy, because functorch's bmm rule would
// materialize the expanded input (it folds levels by reshaping). A batched
// input with batched weights issues bmm + add there instead of baddbmm:
// functorch's bmm rule folds the levels the operands share into one bmm.
//
// Note [GEMM and bias apart when traced]
// Eager, a batched weight with a row bias runs as one baddbmm. Traced for
// torch.compile (AOTAutograd's functional/fake tensors carry the Python key)
// it is emitted as bmm + add, as stock torch.func's decomposition is:
// Inductor runs baddbmm as an extern kernel and cannot fuse the bias with
// what follows (the activation); bmm + add it fuses.
//
// Note [1-D weight as a one-row matrix]
// A 1-D weight [I] is run as the [1, I] matrix with the bias given a trailing
// 1 dim; the out dim (size 1) is squeezed from the result.

namespace batchrules {

namespace {

// A physical bias laid out to broadcast against a batch-first output of
// logical rank out_rank: batch dim (size 1 when shared) first, then padded
// with 1s up to the output's rank.
Tensor align_to_output(const Tensor& bias, std::optional<int64_t> bias_bdim, int64_t out_rank) {
  Tensor b = bias_bdim.has_value() ? move_bdim_to_front(bias, bias_bdim) : bias.unsqueeze(0);
  while (b.dim() < 1 + out_rank) {
    b = b.unsqueeze(1);
  }
  return b;
}

// A batched row bias as [B, 1] or [B, O].
Tensor batched_row_bias(const Tensor& bias, int64_t bias_bdim) {
  const Tensor b = move_bdim_to_front(bias, bias_bdim);
  return b.dim() == 1 ? b.unsqueeze(1) : b;
}

// [.., B, .., I] x [O, I] + row bias -> [B, .., O]
BatchedResult shared_weight_gemm(const Tensor& input, std::optional<int64_t> input_bdim,
                                 const Tensor& weight, const std::optional<Tensor>& bias) {
  if (!input_bdim.has_value()) {
    return {dispatch_linear(input, weight, bias), std::nullopt};
  }
  // See Note [Contiguous per-example results].
  const Tensor x = move_bdim_to_front(input, input_bdim);
  // B*M,I x O,I -> B*M,O
  const Tensor out = dispatch_linear(fold_leading_dims(x), weight, bias);
  return {unfold_leading_dims(out, x), 0};
}

// [*lead, I] x [B, O, I] + row bias -> [B, *lead, O] when an operand is
// batched at an enclosing level: one linear against the stacked [B*O, I]
// weights, so the enclosing level runs this rule again, then one copy of the
// output to put the batch first. See Note [Nested vmap and fused GEMMs].
BatchedResult stacked_weight_gemm(const Tensor& input, const Tensor& w,
                                  const std::optional<Tensor>& bias,
                                  std::optional<int64_t> bias_bdim, c10::SymIntArrayRef out_shape) {
  const c10::SymInt batch = w.sym_size(0), out_features = w.sym_size(1);
  std::optional<Tensor> b;
  if (bias.has_value()) {
    // [B, O|1] or a shared [O], [1], [] -> [B*O]
    const Tensor b2 = bias_bdim.has_value() ? batched_row_bias(*bias, *bias_bdim) : *bias;
    b = b2.expand_symint({batch, out_features}).reshape_symint({batch * out_features});
  }
  // M,I x I,B*O + B*O -> M,B*O
  const Tensor x2 = fold_leading_dims(input);
  const Tensor w2 = w.reshape_symint({batch * out_features, w.sym_size(2)});
  const Tensor out = dispatch_linear(x2, w2, b);
  // M,B*O -> B,M,O
  const Tensor front = out.view_symint({x2.sym_size(0), batch, out_features}).transpose(0, 1);
  return {front.contiguous().view_symint(out_shape), 0};
}

// [B, *lead, I] (or a shared [*lead, I]) x [B, O, I] + row bias -> [B, *lead, O]
BatchedResult batched_gemm(const Tensor& input, std::optional<int64_t> input_bdim,
                           const Tensor& weight, int64_t weight_bdim,
                           const std::optional<Tensor>& bias, std::optional<int64_t> bias_bdim) {
  const Tensor w = move_bdim_to_front(weight, weight_bdim);
  const c10::SymInt batch = w.sym_size(0);
  c10::SymDimVector out_shape{batch};
  const auto lead = logical_sizes(input, input_bdim);
  out_shape.insert(out_shape.end(), lead.begin(), lead.end() - 1);
  const c10::SymInt rows = numel_of(c10::SymIntArrayRef(out_shape).slice(1));
  out_shape.push_back(w.sym_size(1));
  if (!input_bdim.has_value() && (batched_at_outer_level(input) || batched_at_outer_level(w) ||
                                  (bias.has_value() && batched_at_outer_level(*bias)))) {
    return stacked_weight_gemm(input, w, bias, bias_bdim, out_shape);
  }
  // See Note [Contiguous per-example results] for why a shared input is expanded.
  const Tensor x3 = batch_first_3d(input, input_bdim, batch, rows);  // [B, M, I]
  const Tensor wt = w.transpose(1, 2);                               // [B, I, O]
  if (!bias.has_value()) {
    // B,M,I x B,I,O -> B,M,O
    return {at::bmm(x3, wt).view_symint(out_shape), 0};
  }
  // [B, 1, O|1] or a shared [O], [1], []: broadcasts against [B, M, O].
  const Tensor b3 =
      bias_bdim.has_value() ? batched_row_bias(*bias, *bias_bdim).unsqueeze(1) : *bias;
  // See Note [Nested vmap and fused GEMMs] and Note [GEMM and bias apart when traced].
  if (batched_at_outer_level(x3) || batched_at_outer_level(wt) || batched_at_outer_level(b3) ||
      traced_for_compile(x3)) {
    return {at::add(at::bmm(x3, wt), b3).view_symint(out_shape), 0};
  }
  // B,M,I x B,I,O + B,1,O -> B,M,O
  return {at::baddbmm(b3, x3, wt).view_symint(out_shape), 0};
}

// weight: logical [O, I]; bias: logical rank <= the output's.
BatchedResult linear_rule_2d_weight(const Tensor& input, std::optional<int64_t> input_bdim,
                                    const Tensor& weight, std::optional<int64_t> weight_bdim,
                                    const std::optional<Tensor>& bias,
                                    std::optional<int64_t> bias_bdim) {
  const bool fuse_bias = bias.has_value() && logical_rank(*bias, bias_bdim) <= 1 &&
                         (!bias_bdim.has_value() || weight_bdim.has_value());
  std::optional<Tensor> fused;
  std::optional<int64_t> fused_bdim;
  if (fuse_bias) {
    fused = bias;
    fused_bdim = bias_bdim;
  }

  BatchedResult result;
  if (!weight_bdim.has_value()) {
    result = shared_weight_gemm(input, input_bdim, weight, fused);
  } else {
    result = batched_gemm(input, input_bdim, weight, *weight_bdim, fused, fused_bdim);
  }
  if (!bias.has_value() || fuse_bias) {
    return result;
  }
  const auto& [out, out_bdim] = result;
  // Outputs are batch-first; an unbatched GEMM output means the bias carries the batch.
  TORCH_INTERNAL_ASSERT(out_bdim.value_or(0) == 0);
  TORCH_INTERNAL_ASSERT(out_bdim.has_value() || bias_bdim.has_value());
  const Tensor b = align_to_output(*bias, bias_bdim, logical_rank(input, input_bdim));
  // The sum takes the layout of its batched operand; see Note [Contiguous
  // per-example results].
  return {at::add(out, out_bdim.has_value() ? b : b.contiguous()), 0};
}

}  // namespace

BatchedResult linear_batch_rule(const Tensor& input, std::optional<int64_t> input_bdim,
                                const Tensor& weight, std::optional<int64_t> weight_bdim,
                                const std::optional<Tensor>& bias,
                                std::optional<int64_t> bias_bdim) {
  constexpr const char* op = "batchrules.linear";
  const c10::SymDimVector bias_sizes =
      bias.has_value() ? logical_sizes(*bias, bias_bdim) : c10::SymDimVector();
  const c10::SymDimVector out_shape = check_linear_shapes(
      logical_sizes(input, input_bdim), logical_sizes(weight, weight_bdim),
      bias.has_value() ? std::optional<c10::SymIntArrayRef>(bias_sizes) : std::nullopt);
  check_input_and_weight(op, input, weight);
  if (bias.has_value()) {
    check_same_dtype_and_device(op, input, "input", *bias, "bias");
  }

  // F.linear lets a 1-D input's bias carry one extra leading size-1 dim;
  // drop it so the bias rank never exceeds the output rank.
  std::optional<Tensor> b = bias;
  if (b.has_value() && bias_sizes.size() > out_shape.size()) {
    b = move_bdim_to_front(*b, bias_bdim).squeeze(bias_bdim.has_value() ? 1 : 0);
    bias_bdim = bias_bdim.has_value() ? std::optional<int64_t>(0) : std::nullopt;
  }

  if (logical_rank(weight, weight_bdim) == 2) {
    return linear_rule_2d_weight(input, input_bdim, weight, weight_bdim, b, bias_bdim);
  }
  // See Note [1-D weight as a one-row matrix].
  const Tensor w = weight_bdim.has_value() ? move_bdim_to_front(weight, weight_bdim).unsqueeze(1)
                                           : weight.unsqueeze(0);
  if (b.has_value()) {
    b = move_bdim_to_front(*b, bias_bdim).unsqueeze(-1);
    bias_bdim = bias_bdim.has_value() ? std::optional<int64_t>(0) : std::nullopt;
  }
  const auto [out, out_bdim] = linear_rule_2d_weight(
      input, input_bdim, w, weight_bdim.has_value() ? std::optional<int64_t>(0) : std::nullopt, b,
      bias_bdim);
  return squeeze_logical_dim(out, out_bdim, logical_rank(input, input_bdim) - 1);
}

}  // namespace batchrules
