// FuncTorchBatched kernels of the recurrent family: the rules of
// batch_rule_recurrence.cpp behind the shared plumbing (Note [Hand-written
// vmap plumbing]). The operands are checked with their per-example sizes
// before the rule folds them.
#include "common/vmap_plumbing.h"
#include "ops.h"
#include "recurrent/batch_rules.h"
#include "recurrent/shape_checks.h"

#include <torch/library.h>

namespace batchrules {

namespace {

RecurrenceResult rnn_recurrence_batched(const Tensor& input_gates, const Tensor& h0,
                                        const OptTensor& c0, const Tensor& w_hh,
                                        const OptTensor& b_hh, const OptTensor& w_hr, int64_t mode,
                                        bool reverse) {
  const BatchedKernelScope scope("batchrules.rnn_recurrence");
  const int64_t level = scope.level();
  if (!any_batched_at(level, input_gates, h0, c0, w_hh, b_hh, w_hr)) {
    return rnn_recurrence_op().call(input_gates, h0, c0, w_hh, b_hh, w_hr, mode, reverse);
  }
  check_recurrence_shapes("batchrules.rnn_recurrence", input_gates, h0, c0, w_hh, b_hh, w_hr,
                          rnn_mode(mode));
  auto [x, x_bdim] = unwrap_at(input_gates, level);
  auto [h, h_bdim] = unwrap_at(h0, level);
  auto [c, c_bdim] = optional_at(c0, level);
  auto [b, b_bdim] = optional_at(b_hh, level);
  auto [r, r_bdim] = optional_at(w_hr, level);
  auto [w, w_bdim] = unwrap_at(w_hh, level);
  auto [out, h_n, c_n, ws] = rnn_recurrence_batch_rule(x, x_bdim, h, h_bdim, c, c_bdim, w, w_bdim,
                                                       b, b_bdim, r, r_bdim, mode, reverse);
  const auto wrap = [level](const BatchedResult& t) {
    return wrap_at(std::get<0>(t), std::get<1>(t), level);
  };
  return {wrap(out), wrap(h_n), wrap(c_n), wrap(ws)};
}

RecurrenceGradsResult rnn_recurrence_backward_batched(
    const OptTensor& grad_output, const OptTensor& grad_h_n, const OptTensor& grad_c_n,
    const Tensor& h0, const OptTensor& c0, const Tensor& w_hh, const OptTensor& w_hr,
    const Tensor& output, const Tensor& workspace, int64_t mode, bool reverse) {
  const BatchedKernelScope scope("batchrules.rnn_recurrence_backward");
  const int64_t level = scope.level();
  if (!any_batched_at(level, grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output,
                      workspace)) {
    return rnn_recurrence_backward_op().call(grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr,
                                             output, workspace, mode, reverse);
  }
  check_recurrence_backward_shapes(grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output,
                                   workspace, rnn_mode(mode));
  auto [go, go_bdim] = optional_at(grad_output, level);
  auto [ghn, ghn_bdim] = optional_at(grad_h_n, level);
  auto [gcn, gcn_bdim] = optional_at(grad_c_n, level);
  auto [c, c_bdim] = optional_at(c0, level);
  auto [r, r_bdim] = optional_at(w_hr, level);
  auto [h, h_bdim] = unwrap_at(h0, level);
  auto [w, w_bdim] = unwrap_at(w_hh, level);
  auto [o, o_bdim] = unwrap_at(output, level);
  auto [ws, ws_bdim] = unwrap_at(workspace, level);
  auto grads = rnn_recurrence_backward_batch_rule(go, go_bdim, ghn, ghn_bdim, gcn, gcn_bdim, h,
                                                  h_bdim, c, c_bdim, w, w_bdim, r, r_bdim, o,
                                                  o_bdim, ws, ws_bdim, mode, reverse);
  const auto wrap = [level](const BatchedResult& t) {
    return wrap_at(std::get<0>(t), std::get<1>(t), level);
  };
  return {wrap(grads[0]), wrap(grads[1]), wrap(grads[2]), wrap(grads[3]), wrap(grads[4])};
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, FuncTorchBatched, m) {
  m.impl("rnn_recurrence", TORCH_FN(rnn_recurrence_batched));
  m.impl("rnn_recurrence_backward", TORCH_FN(rnn_recurrence_backward_batched));
}

}  // namespace batchrules
