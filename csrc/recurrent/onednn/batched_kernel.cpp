// FuncTorchBatched kernels of batchrules::fused_lstm_layer and its backward:
// oneDNN's layer over folded rows or once per member (batching.h), behind the
// shared plumbing (Note [Hand-written vmap plumbing]).
#include "common/vmap_plumbing.h"
#include "ops.h"
#include "recurrent/onednn/batching.h"

#include <torch/library.h>

namespace batchrules {

namespace {

// Note [oneDNN's LSTM layer under transforms] (onednn/kernel_choice.cpp): routing calls it
// where weights are shared only when no grad level needs per-example weight
// gradients, so the forward folds the rows; its backward is exact only per
// example (or per member).
//
// Note [The fused layer's workspace list]
// oneDNN's training workspace is large (2.5 MB for one LSTM of hidden 128
// over 16 rows and 20 steps) and opaque: only its own backward reads it. So
// fused_lstm_layer returns it as a list, one entry per fused call, and its
// rules pass the entries on as they are, never stacked (stacking copied 20
// MB and held it twice for an ensemble of 8). A rule at vmap level L that ran
// one call per member returns the members' lists concatenated in member order;
// the backward rule at L, seeing the same weights batched at L, splits the
// list into as many equal parts as members. Where no weight is batched at L
// the forward folded the rows, or was not batched at L at all (only output
// gradients are: jacrev), and every member's backward reads the whole list.
FusedLstmResult fused_lstm_layer_batched(const Tensor& input, const Tensor& w_ih,
                                         const Tensor& w_hh, const OptTensor& b_ih,
                                         const OptTensor& b_hh, const Tensor& h0, const Tensor& c0,
                                         bool reverse) {
  const BatchedKernelScope scope("batchrules.fused_lstm_layer");
  const int64_t level = scope.level();
  if (!any_batched_at(level, input, w_ih, w_hh, b_ih, b_hh, h0, c0)) {
    return fused_lstm_layer_op().call(input, w_ih, w_hh, b_ih, b_hh, h0, c0, reverse);
  }
  const std::vector<BatchedResult> ops = {unwrap_at(input, level),  unwrap_at(w_ih, level),
                                          unwrap_at(w_hh, level),   optional_at(b_ih, level),
                                          optional_at(b_hh, level), unwrap_at(h0, level),
                                          unwrap_at(c0, level)};
  BatchedLstmLayer r = batched_lstm_layer(ops, level, [&](const std::vector<Tensor>& a) {
    auto [o, h, c, ws] = fused_lstm_layer_op().call(a[0], a[1], a[2], maybe_defined(a[3]),
                                                    maybe_defined(a[4]), a[5], a[6], reverse);
    return LstmLayerCall{o, h, c, std::move(ws)};
  });
  return {r.output, r.h_n, r.c_n, std::move(r.workspaces)};
}

FusedLstmGradsResult fused_lstm_layer_backward_batched(
    const Tensor& input, const Tensor& w_ih, const Tensor& w_hh, const OptTensor& b_ih,
    const OptTensor& b_hh, const Tensor& h0, const Tensor& c0, const Tensor& output,
    const Tensor& h_n, const Tensor& c_n, const OptTensor& grad_output, const OptTensor& grad_h_n,
    const OptTensor& grad_c_n, at::TensorList workspace, bool reverse) {
  const BatchedKernelScope scope("batchrules.fused_lstm_layer_backward");
  const int64_t level = scope.level();
  if (!any_batched_at(level, input, w_ih, w_hh, b_ih, b_hh, h0, c0, output, h_n, c_n, grad_output,
                      grad_h_n, grad_c_n)) {
    return fused_lstm_layer_backward_op().call(input, w_ih, w_hh, b_ih, b_hh, h0, c0, output, h_n,
                                               c_n, grad_output, grad_h_n, grad_c_n, workspace,
                                               reverse);
  }
  const bool per_member = any_batched_at(level, w_ih, w_hh, b_ih, b_hh);
  TORCH_CHECK(per_member || !any_batched_at(level, input, h0, c0),
              "batchrules.fused_lstm_layer_backward: a forward over folded rows cannot be "
              "differentiated per example (a routing invariant; please report)");
  const std::vector<BatchedResult> ops = {
      unwrap_at(input, level),     unwrap_at(w_ih, level),          unwrap_at(w_hh, level),
      optional_at(b_ih, level),    optional_at(b_hh, level),        unwrap_at(h0, level),
      unwrap_at(c0, level),        unwrap_at(output, level),        unwrap_at(h_n, level),
      unwrap_at(c_n, level),       optional_at(grad_output, level), optional_at(grad_h_n, level),
      optional_at(grad_c_n, level)};
  const int64_t batch = vmap_size_of(ops);
  // See Note [The fused layer's workspace list].
  const int64_t part = per_member && batch > 0 ? static_cast<int64_t>(workspace.size()) / batch
                                               : static_cast<int64_t>(workspace.size());
  TORCH_CHECK(!per_member || batch == 0 || part * batch == static_cast<int64_t>(workspace.size()),
              "batchrules.fused_lstm_layer_backward: expected the workspace list of the forward, "
              "a multiple of the ",
              batch, " members' (batched weights), but got ", workspace.size(), " entries");
  const auto outs = per_example(ops, batch, [&](const std::vector<Tensor>& a, int64_t b) {
    const at::TensorList mine = workspace.slice(per_member ? b * part : 0, part);
    auto [dx, dwi, dwh, dbi, dbh, dh, dc] = fused_lstm_layer_backward_op().call(
        a[0], a[1], a[2], maybe_defined(a[3]), maybe_defined(a[4]), a[5], a[6], a[7], a[8], a[9],
        maybe_defined(a[10]), maybe_defined(a[11]), maybe_defined(a[12]), mine, reverse);
    return std::vector<Tensor>{dx, dwi, dwh, dbi, dbh, dh, dc};
  });
  const auto wrap = [level](const Tensor& t) {
    return wrap_at(t, t.defined() ? std::optional<int64_t>(0) : std::nullopt, level);
  };
  return {wrap(outs[0]), wrap(outs[1]), wrap(outs[2]), wrap(outs[3]),
          wrap(outs[4]), wrap(outs[5]), wrap(outs[6])};
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, FuncTorchBatched, m) {
  m.impl("fused_lstm_layer", TORCH_FN(fused_lstm_layer_batched));
  m.impl("fused_lstm_layer_backward", TORCH_FN(fused_lstm_layer_backward_batched));
}

}  // namespace batchrules
