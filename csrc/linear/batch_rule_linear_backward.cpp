// Batching rule for batchrules::linear_backward: batched weight gradients.
//
// Note [One kernel per gradient in the backward rule]
// With gi = g @ conj(W), gW = g^T @ conj(x), gb = sum(g) each output depends
// on two operands at most, so each gets its own case analysis (shapes
// physical, B the vmap size, M the product of the logical leading dims):
//  - grad_input: W shared -> g's rows, batch included, fold into one mm;
//    W batched -> one bmm [B, M, O] x [B, O, I] (a broadcast multiply when
//    O == 1, where a K=1 bmm is several times slower).
//  - grad_weight: one bmm [B, O, M] x [B, M, I] that contracts every leading
//    dim, sequence dims included (per-sample gradients when x and g are
//    batched, or a shared g or x expanded); a shared x with g's batch dim
//    next to the out features -> one mm [B*O, M] x [M, I] (g's batch joins
//    the rows as a view). A batch-first contiguous g would be copied by that
//    fold: with no more batch entries than rows (ensembles, not jacrev's
//    basis of many small GEMMs) the bmm against the expanded x copies
//    nothing, except under an enclosing vmap level, where functorch's bmm
//    rule would materialize the expanded x. Any other g: one mm.
//  - grad_bias: one reduction over the leading dims.
// A shared operand of a bmm is expanded (stride 0), not copied. An output
// none of whose operands is batched is computed once, unbatched. Results are
// batch-first and contiguous per example; see Note [Contiguous per-example
// results]. Every kernel here has a functorch batching rule that folds
// enclosing vmap levels into the same kernel (mm, bmm, sum).
// A 1-D weight runs as [1, I]; see Note [1-D weight as a one-row matrix].
#include "linear/batch_rules.h"
#include "linear/shape_checks.h"

#include <ATen/ATen.h>

namespace batchrules {

namespace {

struct Logical {
  c10::SymDimVector lead;  // logical leading dims of the input
  c10::SymInt rows;        // their product (M)
  c10::SymInt in_features;
  c10::SymInt out_features;
};

BatchedResult grad_input_rule(const Tensor& g, std::optional<int64_t> g_bdim, const Tensor& w,
                              std::optional<int64_t> w_bdim, const Logical& s) {
  if (!w_bdim.has_value()) {
    const Tensor gf = move_bdim_to_front(g, g_bdim);
    // [B*]M,O x O,I -> [B*]M,I
    return {unfold_leading_dims(at::mm(fold_leading_dims(gf), w.conj()), gf),
            g_bdim.has_value() ? std::optional<int64_t>(0) : std::nullopt};
  }
  const Tensor wf = move_bdim_to_front(w, w_bdim);  // [B, O, I]
  const c10::SymInt batch = wf.sym_size(0);
  c10::SymDimVector out_shape = s.lead;
  out_shape.insert(out_shape.begin(), batch);
  out_shape.push_back(s.in_features);
  const Tensor g3 = batch_first_3d(g, g_bdim, batch, s.rows);
  if (s.out_features == 1) {
    // One output feature (a critic's or regressor's head): a batch of outer
    // products, one broadcast multiply, as in grad_weight_rule's per-sample case.
    // B,M,1 * B,1,I -> B,M,I
    return {(g3 * wf.conj()).contiguous().view_symint(out_shape), 0};
  }
  // B,M,O x B,O,I -> B,M,I
  return {at::bmm(g3, wf.conj()).view_symint(out_shape), 0};
}

BatchedResult grad_weight_rule(const Tensor& g, std::optional<int64_t> g_bdim, const Tensor& x,
                               std::optional<int64_t> x_bdim, const Logical& s) {
  if (!g_bdim.has_value() && !x_bdim.has_value()) {
    // O,M x M,I -> O,I
    return {at::mm(fold_leading_dims(g).t(), fold_leading_dims(x).conj()), std::nullopt};
  }
  if (!x_bdim.has_value() && s.rows != 1) {
    // Only g batched (jacrev's cotangent basis, an ensemble on shared data):
    // the batch joins the GEMM's rows where that needs no copy of g.
    const Tensor cols = g.movedim(*g_bdim, -2);  // [*lead, B, O]
    const c10::SymInt batch = cols.sym_size(-2);
    if (cols.is_contiguous() || batch > s.rows || !move_bdim_to_front(g, g_bdim).is_contiguous() ||
        batched_at_outer_level(g) || batched_at_outer_level(x)) {
      // B*O,M x M,I -> B*O,I  viewed [B, O, I]
      const Tensor out = at::mm(cols.reshape_symint({s.rows, batch * s.out_features}).t(),
                                fold_leading_dims(x).conj());
      return {out.view_symint({batch, s.out_features, s.in_features}), 0};
    }
  }
  const c10::SymInt batch = g_bdim.has_value() ? g.sym_size(*g_bdim) : x.sym_size(*x_bdim);
  const Tensor gt = batch_first_3d(g, g_bdim, batch, s.rows).transpose(1, 2);  // [B, O, M]
  const Tensor xc = batch_first_3d(x, x_bdim, batch, s.rows).conj();           // [B, M, I]
  if (s.rows == 1) {
    // Per-sample vectors: a batch of outer products, where a K=1 bmm runs
    // several times slower than one broadcast multiply.
    // B,O,1 * B,1,I -> B,O,I; the product takes its operands' layout, so
    // one batched off the front (or O == 1) needs a copy to come out batch-first.
    return {(gt * xc).contiguous(), 0};
  }
  // B,O,M x B,M,I -> B,O,I
  return {at::bmm(gt, xc), 0};
}

BatchedResult grad_bias_rule(const Tensor& g, std::optional<int64_t> g_bdim) {
  // Sum every dim but the batch dim and the out dim: [B, *lead, O] -> [B, O]
  const Tensor gf = move_bdim_to_front(g, g_bdim);
  const int64_t first = g_bdim.has_value() ? 1 : 0;
  std::vector<int64_t> dims;
  for (int64_t d = first; d + 1 < gf.dim(); ++d) {
    dims.push_back(d);
  }
  // sum over an empty dim list would reduce everything: without leading dims
  // the gradient is a copy of g (a fresh tensor, as the schema promises).
  const Tensor out = dims.empty() ? gf.clone(at::MemoryFormat::Contiguous) : gf.sum(dims);
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
  return {std::get<0>(gi), std::get<1>(gi), std::get<0>(gw),
          std::get<1>(gw), std::get<0>(gb), std::get<1>(gb)};
}

}  // namespace batchrules
