// Autograd-key kernels of the recurrent family. See Note [Hand-written
// autograd nodes] and Note [Recurrent layers under higher-order transforms].
#include "common/transform_stack.h"
#include "ops.h"
#include "recurrent/autograd_nodes.h"
#include "recurrent/run_recurrence.h"

#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

namespace batchrules {

namespace {

using torch::autograd::SavedVariable;

Tensor value(const OptTensor& t) {
  return t.has_value() ? *t : Tensor();
}

template <class... Ts>
bool any_tangent(const Ts&... ts) {
  return (tangent(ts).defined() || ...);
}

RecurrenceResult rnn_recurrence_autograd(c10::DispatchKeySet ks, const Tensor& input_gates,
                                         const Tensor& h0, const OptTensor& c0, const Tensor& w_hh,
                                         const OptTensor& b_hh, const OptTensor& w_hr, int64_t mode,
                                         bool reverse) {
  const Tensor c0_t = value(c0), b_hh_t = value(b_hh), w_hr_t = value(w_hr);
  // Forward AD: the decomposition carries the tangents through every step.
  if (any_tangent(input_gates, h0, c0_t, w_hh, b_hh_t, w_hr_t)) {
    return run_recurrence(input_gates, h0, c0, w_hh, b_hh, w_hr, mode, reverse,
                          RecurrenceMath::Decomposition);
  }
  NodePtr<RnnRecurrenceBackward0> grad_fn;
  if (torch::autograd::compute_requires_grad(input_gates, h0, c0_t, w_hh, b_hh_t, w_hr_t)) {
    grad_fn = make_node<RnnRecurrenceBackward0>();
    grad_fn->set_next_edges(
        torch::autograd::collect_next_edges(input_gates, h0, c0_t, w_hh, b_hh_t, w_hr_t));
    grad_fn->h0_ = SavedVariable(h0, false);
    grad_fn->c0_ = SavedVariable(c0_t, false);
    grad_fn->w_hh_ = SavedVariable(w_hh, false);
    grad_fn->w_hr_ = SavedVariable(w_hr_t, false);
    grad_fn->mode_ = mode;
    grad_fn->reverse_ = reverse;
    grad_fn->recompute_ = !inside_transforms() || higher_order_transforms();
    if (grad_fn->recompute_) {
      grad_fn->input_gates_ = SavedVariable(input_gates, false);
      grad_fn->b_hh_ = SavedVariable(b_hh_t, false);
    }
  }
  RecurrenceResult result;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    result = rnn_recurrence_op().redispatch(ks & c10::after_autograd_keyset, input_gates, h0, c0,
                                            w_hh, b_hh, w_hr, mode, reverse);
  }
  if (grad_fn) {
    auto& [output, h_n, c_n, workspace] = result;
    torch::autograd::set_history({output, h_n, c_n}, grad_fn);
    grad_fn->output_ = SavedVariable(output, true);
    grad_fn->workspace_ = SavedVariable(workspace, false);
  }
  return result;
}

// Note [Recurrent layers under higher-order transforms]
// Derivatives of the recurrence beyond the first come from its decomposition:
// the aten ops of forward.cpp / backward.cpp run at the caller's level, which
// autograd, forward AD and functorch see like any others.
//  - Under a jvp or a second grad level the routes run the forward as its
//    decomposition (layers.cpp): every order works there, op by op.
//  - Outside transforms (torch.autograd with create_graph=True, gradgradcheck)
//    rnn_recurrence's node differentiates the decomposition when its backward
//    builds a graph, as does the op with tangents for forward AD; the backward
//    op called directly is differentiated as its decomposition in its inputs.
//  - Under a single grad level, functorch's backward passes create_graph=True,
//    so the graph of the backward is built but never run: there the fused
//    backward runs, under a node that raises if it ever is.
RecurrenceGradsResult rnn_recurrence_backward_autograd(
    c10::DispatchKeySet ks, const OptTensor& grad_output, const OptTensor& grad_h_n,
    const OptTensor& grad_c_n, const Tensor& h0, const OptTensor& c0, const Tensor& w_hh,
    const OptTensor& w_hr, const Tensor& output, const Tensor& workspace, int64_t mode,
    bool reverse) {
  const Tensor go = value(grad_output), ghn = value(grad_h_n), gcn = value(grad_c_n);
  const Tensor c0_t = value(c0), w_hr_t = value(w_hr);
  const bool differentiable =
      torch::autograd::compute_requires_grad(go, ghn, gcn, h0, c0_t, w_hh, w_hr_t, output) ||
      any_tangent(go, ghn, gcn, h0, c0_t, w_hh, w_hr_t, output, workspace);
  if (differentiable && (!inside_transforms() || higher_order_transforms())) {
    return run_recurrence_backward(grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output,
                                   workspace, mode, reverse, RecurrenceMath::Decomposition);
  }
  RecurrenceGradsResult result;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    result = rnn_recurrence_backward_op().redispatch(ks & c10::after_autograd_keyset, grad_output,
                                                     grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output,
                                                     workspace, mode, reverse);
  }
  if (differentiable) {
    auto grad_fn = make_node_with<NotDifferentiableTwice>("batchrules.rnn_recurrence");
    grad_fn->set_next_edges(
        torch::autograd::collect_next_edges(go, ghn, gcn, h0, c0_t, w_hh, w_hr_t, output));
    auto& [a, b, c, d, e] = result;
    torch::autograd::set_history({a, b, c, d, e}, grad_fn);
  }
  return result;
}

FusedLstmResult fused_lstm_layer_autograd(c10::DispatchKeySet ks, const Tensor& input,
                                          const Tensor& w_ih, const Tensor& w_hh,
                                          const OptTensor& b_ih, const OptTensor& b_hh,
                                          const Tensor& h0, const Tensor& c0, bool reverse) {
  const Tensor bi = value(b_ih), bh = value(b_hh);
  TORCH_CHECK(!any_tangent(input, w_ih, w_hh, bi, bh, h0, c0),
              "batchrules.fused_lstm_layer: oneDNN's LSTM layer has no forward-mode derivative");
  NodePtr<FusedLstmLayerBackward0> grad_fn;
  if (torch::autograd::compute_requires_grad(input, w_ih, w_hh, bi, bh, h0, c0)) {
    grad_fn = make_node<FusedLstmLayerBackward0>();
    grad_fn->set_next_edges(torch::autograd::collect_next_edges(input, w_ih, w_hh, bi, bh, h0, c0));
    grad_fn->input_ = SavedVariable(input, false);
    grad_fn->w_ih_ = SavedVariable(w_ih, false);
    grad_fn->w_hh_ = SavedVariable(w_hh, false);
    grad_fn->b_ih_ = SavedVariable(bi, false);
    grad_fn->b_hh_ = SavedVariable(bh, false);
    grad_fn->h0_ = SavedVariable(h0, false);
    grad_fn->c0_ = SavedVariable(c0, false);
    grad_fn->reverse_ = reverse;
  }
  FusedLstmResult result;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    result = fused_lstm_layer_op().redispatch(ks & c10::after_autograd_keyset, input, w_ih, w_hh,
                                              b_ih, b_hh, h0, c0, reverse);
  }
  if (grad_fn) {
    auto& [output, h_n, c_n, workspace] = result;
    torch::autograd::set_history({output, h_n, c_n}, grad_fn);
    grad_fn->output_ = SavedVariable(output, true);
    grad_fn->h_n_ = SavedVariable(h_n, true);
    grad_fn->c_n_ = SavedVariable(c_n, true);
    for (const Tensor& w : workspace) {
      grad_fn->workspace_.emplace_back(w, false);
    }
  }
  return result;
}

// oneDNN's backward has no derivative of its own (Note [Recurrent layers under
// higher-order transforms]: routing uses this op under one grad level only).
FusedLstmGradsResult fused_lstm_layer_backward_autograd(
    c10::DispatchKeySet ks, const Tensor& input, const Tensor& w_ih, const Tensor& w_hh,
    const OptTensor& b_ih, const OptTensor& b_hh, const Tensor& h0, const Tensor& c0,
    const Tensor& output, const Tensor& h_n, const Tensor& c_n, const OptTensor& grad_output,
    const OptTensor& grad_h_n, const OptTensor& grad_c_n, at::TensorList workspace, bool reverse) {
  const Tensor bi = value(b_ih), bh = value(b_hh), go = value(grad_output);
  const Tensor ghn = value(grad_h_n), gcn = value(grad_c_n);
  FusedLstmGradsResult result;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    result = fused_lstm_layer_backward_op().redispatch(
        ks & c10::after_autograd_keyset, input, w_ih, w_hh, b_ih, b_hh, h0, c0, output, h_n, c_n,
        grad_output, grad_h_n, grad_c_n, workspace, reverse);
  }
  if (torch::autograd::compute_requires_grad(input, w_ih, w_hh, bi, bh, h0, c0, go, ghn, gcn)) {
    auto grad_fn = make_node_with<NotDifferentiableTwice>("batchrules.fused_lstm_layer");
    grad_fn->set_next_edges(
        torch::autograd::collect_next_edges(input, w_ih, w_hh, bi, bh, h0, c0, go, ghn, gcn));
    auto& [a, b, c, d, e, f, g] = result;
    torch::autograd::set_history({a, b, c, d, e, f, g}, grad_fn);
  }
  return result;
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, Autograd, m) {
  m.impl("rnn_recurrence", TORCH_FN(rnn_recurrence_autograd));
  m.impl("rnn_recurrence_backward", TORCH_FN(rnn_recurrence_backward_autograd));
  m.impl("fused_lstm_layer", TORCH_FN(fused_lstm_layer_autograd));
  m.impl("fused_lstm_layer_backward", TORCH_FN(fused_lstm_layer_backward_autograd));
}

}  // namespace batchrules
