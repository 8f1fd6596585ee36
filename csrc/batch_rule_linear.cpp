// Batching rule for batchrules::linear.
//
// Note [Batch dims and GEMMs in the linear rule]
// Shapes are written physical, B the vmap size, lead the logical leading dims
// of the input (M their product), I/O the in/out features.
//  - weight unbatched: the batch folds into the GEMM rows; one addmm via
//    batchrules::linear. The input's batch dim stays where it is unless it is
//    the last dim (or a bias with leading dims must line up with it).
//  - weight batched, input batched: one baddbmm (bmm without bias).
//  - weight batched, input shared: one addmm against the stacked weights
//    [M, I] x [I, B*O], whose result is viewed as [*lead, B, O]: the batch
//    dim is returned in the middle rather than paying a copy to move it.
//  - a per-example bias with a shared weight: GEMM plus one broadcast add.
// Because every branch calls dispatcher ops, nested vmap collapses level by
// level: e.g. two levels of batched weights become one bmm of B1*B2 matrices.
//
// Note [1-D weight as a one-row matrix]
// A 1-D weight [I] is run as the [1, I] matrix with the bias given a trailing
// 1 dim; the trailing out dim (size 1) is squeezed from the result.
#include "batch_rules.h"
#include "ops.h"
#include "shape_checks.h"

#include <ATen/ATen.h>

namespace batchrules {

namespace {

// Physical bias of rank 1 + out_rank with its batch dim (size B, or 1 when the
// bias is shared) at the front, broadcastable against [B, *lead, O].
Tensor align_bias(const Tensor& bias, std::optional<int64_t> bias_bdim, int64_t out_rank) {
  Tensor b = bias_bdim.has_value() ? move_bdim_to_front(bias, bias_bdim) : bias.unsqueeze(0);
  while (b.dim() < 1 + out_rank) {
    b = b.unsqueeze(1);
  }
  return b;
}

// A row bias (logical [] or [O]) with a batch dim, as [B, 1] or [B, O].
Tensor row_bias_batched(const Tensor& bias, int64_t bias_bdim) {
  const Tensor b = move_bdim_to_front(bias, bias_bdim);
  return b.dim() == 1 ? b.unsqueeze(1) : b;
}

// weight: logical [O, I]; bias: logical rank <= logical rank of the output.
BatchedResult linear_rule_2d_weight(const Tensor& input, std::optional<int64_t> input_bdim,
                                    const Tensor& weight, std::optional<int64_t> weight_bdim,
                                    const std::optional<Tensor>& bias,
                                    std::optional<int64_t> bias_bdim) {
  const int64_t out_rank = logical_rank(input, input_bdim);
  // A bias that broadcasts only along the out dim.
  const bool row_bias = !bias.has_value() || logical_rank(*bias, bias_bdim) <= 1;

  if (!weight_bdim.has_value()) {
    if (bias_bdim.has_value()) {
      // [B, *lead, I] x [O, I] -> [B, *lead, O], + [B, 1.., *bias]
      const Tensor out = dispatch_linear(move_bdim_to_front(input, input_bdim), weight);
      return {at::add(out, align_bias(*bias, bias_bdim, out_rank)), 0};
    }
    TORCH_INTERNAL_ASSERT(input_bdim.has_value());
    if (*input_bdim == input.dim() - 1 || !row_bias) {
      // [B, *lead, I] x [O, I] -> [B, *lead, O]
      return {dispatch_linear(move_bdim_to_front(input, input_bdim), weight, bias), 0};
    }
    // [.., B, .., I] x [O, I] -> [.., B, .., O]
    return {dispatch_linear(input, weight, bias), input_bdim};
  }

  const Tensor w = move_bdim_to_front(weight, weight_bdim);  // [B, O, I]
  const c10::SymInt batch = w.sym_size(0);
  const c10::SymInt out_features = w.sym_size(1);
  const c10::SymInt in_features = w.sym_size(2);

  if (input_bdim.has_value() || !row_bias) {
    // A bias with leading dims against a shared input: run the input as
    // batched (an expand, no copy).
    const Tensor x = input_bdim.has_value()
                         ? move_bdim_to_front(input, input_bdim)
                         : input.unsqueeze(0).expand_symint(
                               [&] {
                                 c10::SymDimVector s(input.sym_sizes().begin(),
                                                     input.sym_sizes().end());
                                 s.insert(s.begin(), batch);
                                 return s;
                               }());
    c10::SymDimVector out_shape(x.sym_sizes().begin(), x.sym_sizes().end() - 1);
    const c10::SymInt rows = numel_of(c10::SymIntArrayRef(out_shape).slice(1));
    out_shape.push_back(out_features);
    const Tensor x3 = x.reshape_symint({batch, rows, in_features});  // [B, M, I]
    const Tensor wt = w.transpose(1, 2);                               // [B, I, O]
    if (!bias.has_value()) {
      // B,M,I x B,I,O -> B,M,O
      return {at::bmm(x3, wt).view_symint(out_shape), 0};
    }
    Tensor b3;
    if (!row_bias) {
      b3 = align_bias(*bias, bias_bdim, out_rank)
               .expand_symint(out_shape)
               .reshape_symint({bias_bdim.has_value() ? batch : c10::SymInt(1), rows, out_features});
    } else if (bias_bdim.has_value()) {
      b3 = row_bias_batched(*bias, *bias_bdim).unsqueeze(1);  // [B, 1, O]
    } else {
      b3 = *bias;  // [O] broadcasts
    }
    // B,M,I x B,I,O + B,M,O -> B,M,O
    return {at::baddbmm(b3, x3, wt).view_symint(out_shape), 0};
  }

  // Shared input, batched weight, row bias: one GEMM against stacked weights.
  c10::SymDimVector out_shape(input.sym_sizes().begin(), input.sym_sizes().end() - 1);
  const auto lead_rank = static_cast<int64_t>(out_shape.size());
  const c10::SymInt rows = numel_of(out_shape);
  out_shape.push_back(batch);
  out_shape.push_back(out_features);
  const Tensor x2 = input.reshape_symint({rows, in_features});               // [M, I]
  const Tensor w2 = w.reshape_symint({batch * out_features, in_features});  // [B*O, I]
  Tensor out;
  if (!bias.has_value()) {
    // M,I x I,B*O -> M,B*O
    out = at::mm(x2, w2.t());
  } else {
    // [B, O] (batched) or [O] (shared) -> [B*O]
    const Tensor b = bias_bdim.has_value() ? row_bias_batched(*bias, *bias_bdim) : *bias;
    const Tensor b_flat = b.expand_symint({batch, out_features}).reshape_symint({batch * out_features});
    // M,I x I,B*O + B*O -> M,B*O
    out = at::addmm(b_flat, x2, w2.t());
  }
  return {out.view_symint(out_shape), lead_rank};
}

}  // namespace

BatchedResult linear_batch_rule(const Tensor& input, std::optional<int64_t> input_bdim,
                                const Tensor& weight, std::optional<int64_t> weight_bdim,
                                const std::optional<Tensor>& bias,
                                std::optional<int64_t> bias_bdim) {
  const c10::SymDimVector bias_sizes =
      bias.has_value() ? logical_sizes(*bias, bias_bdim) : c10::SymDimVector();
  const c10::SymDimVector out_shape = check_linear_shapes(
      logical_sizes(input, input_bdim), logical_sizes(weight, weight_bdim),
      bias.has_value() ? std::optional<c10::SymIntArrayRef>(bias_sizes) : std::nullopt);

  // F.linear lets a 1-D input's bias carry one extra leading size-1 dim;
  // drop it so the bias rank never exceeds the output rank.
  std::optional<Tensor> b = bias;
  if (b.has_value() && static_cast<int64_t>(bias_sizes.size()) > static_cast<int64_t>(out_shape.size())) {
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
  auto [out, out_bdim] = linear_rule_2d_weight(
      input, input_bdim, w, weight_bdim.has_value() ? std::optional<int64_t>(0) : std::nullopt, b,
      bias_bdim);
  // The out dim is the last physical dim in every branch.
  return {out.squeeze(-1), out_bdim};
}

}  // namespace batchrules
