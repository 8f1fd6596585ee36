// Batching rule for batchrules::linear_backward: batched weight gradients.
//
// Note [One kernel per gradient in the backward rule]
// With gi = g @ conj(W), gW = g^T @ conj(x), gb = sum(g) each output depends
// on two operands at most, so each gets its own case analysis (shapes
// physical, B the vmap size, M the product of the logical leading dims):
//  - grad_input: W shared -> g's rows, batch included, fold into one mm (the
//    batch dim stays in place); W batched -> one bmm [B, M, O] x [B, O, I]
//    (a shared g is expanded, not copied).
//  - grad_weight: x and g batched (per-sample gradients) -> one bmm
//    [B, O, M] x [B, M, I] that contracts every leading dim, sequence dims
//    included; one side shared -> one mm with the other side's batch folded
//    into the GEMM (free when its batch dim sits next to the features, as in
//    the output of the stacked-weight forward; one copy otherwise).
//  - grad_bias: one reduction over the leading dims.
// An output none of whose operands is batched is computed once, unbatched.
// Every kernel here has a functorch batching rule that folds enclosing vmap
// levels into the same kernel (mm, bmm, sum).
// A 1-D weight runs as [1, I]; see Note [1-D weight as a one-row matrix].
#include "batch_rules.h"
#include "shape_checks.h"

#include <ATen/ATen.h>

namespace batchrules {

namespace {

struct Logical {
  c10::SymDimVector lead;  // logical leading dims of the input
  c10::SymInt rows;        // their product (M)
  c10::SymInt in_features;
  c10::SymInt out_features;
};

// Physical [B, *lead, F] (batch dim anywhere) -> [B, M, F].
Tensor front_3d(const Tensor& t, int64_t bdim, const Logical& s) {
  const Tensor f = move_bdim_to_front(t, bdim);
  return f.reshape_symint({f.sym_size(0), s.rows, f.sym_size(-1)});
}

// Physical batched [*lead, F] (batch dim anywhere) -> [M, B*F].
Tensor batch_into_columns(const Tensor& t, int64_t bdim, const Logical& s) {
  const Tensor m = t.movedim(bdim, -2);  // [*lead, B, F]
  return m.reshape_symint({s.rows, m.sym_size(-2) * m.sym_size(-1)});
}

BatchedResult grad_input_rule(const Tensor& g, std::optional<int64_t> g_bdim, const Tensor& w,
                              std::optional<int64_t> w_bdim, const Logical& s) {
  if (!w_bdim.has_value()) {
    // A batch dim in the last place would split the GEMM's rows from its columns.
    const bool bdim_last = g_bdim.has_value() && *g_bdim == g.dim() - 1;
    const Tensor gp = bdim_last ? g.movedim(-1, 0) : g;
    // [B*]M,O x O,I -> [B*]M,I
    return {unfold_leading_dims(at::mm(fold_leading_dims(gp), w.conj()), gp),
            bdim_last ? std::optional<int64_t>(0) : g_bdim};
  }
  const Tensor wf = move_bdim_to_front(w, w_bdim);  // [B, O, I]
  const c10::SymInt batch = wf.sym_size(0);
  const Tensor g3 = g_bdim.has_value()
                        ? front_3d(g, *g_bdim, s)
                        : fold_leading_dims(g).expand_symint({batch, s.rows, s.out_features});
  c10::SymDimVector out_shape = s.lead;
  out_shape.insert(out_shape.begin(), batch);
  out_shape.push_back(s.in_features);
  // B,M,O x B,O,I -> B,M,I
  return {at::bmm(g3, wf.conj()).view_symint(out_shape), 0};
}

BatchedResult grad_weight_rule(const Tensor& g, std::optional<int64_t> g_bdim, const Tensor& x,
                               std::optional<int64_t> x_bdim, const Logical& s) {
  if (g_bdim.has_value() && x_bdim.has_value()) {
    const Tensor gt = front_3d(g, *g_bdim, s).transpose(1, 2);  // [B, O, M]
    const Tensor xc = front_3d(x, *x_bdim, s).conj();            // [B, M, I]
    if (s.rows == 1) {
      // Per-sample vectors: a batch of outer products, where a K=1 bmm runs
      // several times slower than one broadcast multiply.
      // B,O,1 * B,1,I -> B,O,I
      return {gt * xc, 0};
    }
    // B,O,M x B,M,I -> B,O,I
    return {at::bmm(gt, xc), 0};
  }
  if (g_bdim.has_value()) {
    // B*O,M x M,I -> B*O,I  viewed [B, O, I]
    const Tensor cols = batch_into_columns(g, *g_bdim, s);
    const c10::SymInt batch = g.sym_size(*g_bdim);
    const Tensor out = at::mm(cols.t(), fold_leading_dims(x).conj());
    return {out.view_symint({batch, s.out_features, s.in_features}), 0};
  }
  if (x_bdim.has_value()) {
    // O,M x M,B*I -> O,B*I  viewed [O, B, I]
    const Tensor cols = batch_into_columns(x, *x_bdim, s);
    const c10::SymInt batch = x.sym_size(*x_bdim);
    const Tensor out = at::mm(fold_leading_dims(g).t(), cols.conj());
    return {out.view_symint({s.out_features, batch, s.in_features}), 1};
  }
  // O,M x M,I -> O,I
  return {at::mm(fold_leading_dims(g).t(), fold_leading_dims(x).conj()), std::nullopt};
}

BatchedResult grad_bias_rule(const Tensor& g, std::optional<int64_t> g_bdim) {
  // Sum every dim but the batch dim and the out dim: [.., B, .., O] -> [B, O]
  const bool bdim_last = g_bdim.has_value() && *g_bdim == g.dim() - 1;
  const Tensor gp = bdim_last ? g.movedim(-1, 0) : g;
  const int64_t bdim = g_bdim.has_value() ? (bdim_last ? 0 : *g_bdim) : -1;
  std::vector<int64_t> dims;
  for (int64_t d = 0; d + 1 < gp.dim(); ++d) {
    if (d != bdim) {
      dims.push_back(d);
    }
  }
  // sum over an empty dim list would reduce everything: without leading dims
  // the gradient is a copy of g (a fresh tensor, as the schema promises).
  const Tensor out = dims.empty() ? gp.clone() : gp.sum(dims);
  return {out, g_bdim.has_value() ? std::optional<int64_t>(0) : std::nullopt};
}

}  // namespace

std::tuple<Tensor, std::optional<int64_t>, Tensor, std::optional<int64_t>, Tensor,
           std::optional<int64_t>>
linear_backward_batch_rule(const Tensor& self, std::optional<int64_t> self_bdim,
                           const Tensor& grad_output, std::optional<int64_t> grad_output_bdim,
                           const Tensor& weight, std::optional<int64_t> weight_bdim,
                           std::array<bool, 3> output_mask) {
  constexpr const char* op = "batchrules.linear_backward";
  const c10::SymDimVector x_sizes = logical_sizes(self, self_bdim);
  const c10::SymDimVector w_sizes = logical_sizes(weight, weight_bdim);
  check_linear_backward_shapes(x_sizes, logical_sizes(grad_output, grad_output_bdim), w_sizes);
  check_same_dtype_and_device(op, self, "self", weight, "weight");
  check_same_dtype_and_device(op, self, "self", grad_output, "grad_output");

  // See Note [1-D weight as a one-row matrix]: w -> [1, I], g -> [*lead, 1].
  const bool weight_1d = w_sizes.size() == 1;
  Tensor w = weight, g = grad_output;
  if (weight_1d) {
    w = weight_bdim.has_value() ? move_bdim_to_front(weight, weight_bdim).unsqueeze(1)
                                : weight.unsqueeze(0);
    weight_bdim = weight_bdim.has_value() ? std::optional<int64_t>(0) : std::nullopt;
    g = grad_output.unsqueeze(-1);
  }
  Logical s;
  s.lead.assign(x_sizes.begin(), x_sizes.end() - 1);
  s.rows = numel_of(s.lead);
  s.in_features = x_sizes.back();
  s.out_features = weight_1d ? c10::SymInt(1) : w_sizes.front();

  BatchedResult gi{Tensor(), std::nullopt}, gw{Tensor(), std::nullopt}, gb{Tensor(), std::nullopt};
  if (output_mask[0]) {
    gi = grad_input_rule(g, grad_output_bdim, w, weight_bdim, s);
  }
  if (output_mask[1]) {
    gw = grad_weight_rule(g, grad_output_bdim, self, self_bdim, s);
    if (weight_1d) {
      gw = squeeze_logical_dim(std::get<0>(gw), std::get<1>(gw), 0);
    }
  }
  if (output_mask[2]) {
    gb = grad_bias_rule(g, grad_output_bdim);
    if (weight_1d) {
      gb = squeeze_logical_dim(std::get<0>(gb), std::get<1>(gb), 0);
    }
  }
  return {std::get<0>(gi), std::get<1>(gi), std::get<0>(gw), std::get<1>(gw), std::get<0>(gb),
          std::get<1>(gb)};
}

}  // namespace batchrules
