#include "recurrent/autograd_nodes.h"

#include "ops.h"
#include "recurrent/recurrence.h"
#include "recurrent/run_recurrence.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

namespace batchrules {

using torch::autograd::variable_list;

namespace {

// sum over steps and rows of d_t^T x_t:  T,N,G x T,N,F -> G,F  (grouped:
// T,E,N,G x T,E,N,F -> E,G,F)
Tensor weight_grad(const Tensor& d, const Tensor& x, bool grouped) {
  if (!grouped) {
    return at::mm(d.flatten(0, 1).t(), x.flatten(0, 1));
  }
  return at::bmm(d.transpose(0, 1).flatten(1, 2).transpose(1, 2), x.transpose(0, 1).flatten(1, 2));
}

}  // namespace

void RnnRecurrenceBackward0::release_variables() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto* v : {&h0_, &c0_, &w_hh_, &w_hr_, &output_, &workspace_, &input_gates_, &b_hh_}) {
    v->reset_data();
  }
}

variable_list RnnRecurrenceBackward0::apply(variable_list&& grads) {
  std::lock_guard<std::mutex> lock(mutex_);
  variable_list result(num_outputs());
  if (!grads[0].defined() && !grads[1].defined() && !grads[2].defined()) {
    return result;
  }
  if (recompute_ && at::GradMode::is_enabled()) {
    return differentiate_decomposition(grads);
  }
  const Tensor h0 = h0_.unpack(), c0 = c0_.unpack(), w_hh = w_hh_.unpack(), w_hr = w_hr_.unpack();
  const Tensor output = output_.unpack(owning_ptr<torch::autograd::Node>(this));
  const Tensor workspace = workspace_.unpack();
  auto [d_input, d_hidden, d_h0, d_c0, d_projected] = rnn_recurrence_backward_op().call(
      maybe_defined(grads[0]), maybe_defined(grads[1]), maybe_defined(grads[2]), h0,
      maybe_defined(c0), w_hh, maybe_defined(w_hr), output, workspace, mode_, reverse_);
  const bool grouped = w_hh.dim() == 3;
  const Tensor& d_hidden_gates = d_hidden.defined() ? d_hidden : d_input;
  // sym_size: a FakeTensor's symbolic batch stays symbolic (size() would specialize every dim)
  const bool empty = output.sym_size(0) == 0;
  result[0] = d_input;
  result[1] = d_h0;
  result[2] = d_c0;
  if (task_should_compute_output(3)) {
    result[3] = empty ? at::zeros_like(w_hh)
                      : weight_grad(d_hidden_gates, previous_states(h0, output, reverse_), grouped);
  }
  if (task_should_compute_output(4)) {
    result[4] = d_hidden_gates.sum(grouped ? at::IntArrayRef{0, 2} : at::IntArrayRef{0, 1});
  }
  if (w_hr.defined() && task_should_compute_output(5)) {
    const c10::SymInt H = w_hr.sym_size(-1);
    const Tensor h_raw = workspace.narrow_symint(-1, 5 * H, H);
    result[5] = empty ? at::zeros_like(w_hr) : weight_grad(d_projected, h_raw, grouped);
  }
  return result;
}

// The saved workspace holds the gates as constants, so a graph built from it
// would miss their dependence on the inputs: the forward is run again as its
// decomposition, and autograd differentiates that, building the graph.
variable_list RnnRecurrenceBackward0::differentiate_decomposition(const variable_list& grads) {
  const std::array<Tensor, 6> inputs = {input_gates_.unpack(), h0_.unpack(),   c0_.unpack(),
                                        w_hh_.unpack(),        b_hh_.unpack(), w_hr_.unpack()};
  auto [output, h_n, c_n, workspace] = run_recurrence(
      inputs[0], inputs[1], maybe_defined(inputs[2]), inputs[3], maybe_defined(inputs[4]),
      maybe_defined(inputs[5]), mode_, reverse_, RecurrenceMath::Decomposition);
  variable_list outs, outs_grads, wrt;
  const std::array<Tensor, 3> results = {output, h_n, c_n};
  for (size_t i = 0; i < 3; ++i) {
    if (grads[i].defined() && results[i].requires_grad()) {
      outs.push_back(results[i]);
      outs_grads.push_back(grads[i]);
    }
  }
  std::vector<size_t> slots;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].defined() && inputs[i].requires_grad() && task_should_compute_output(i)) {
      wrt.push_back(inputs[i]);
      slots.push_back(i);
    }
  }
  variable_list result(num_outputs());
  if (outs.empty() || wrt.empty()) {
    return result;
  }
  const auto found = torch::autograd::grad(outs, wrt, outs_grads, /*retain_graph=*/true,
                                           /*create_graph=*/true, /*allow_unused=*/true);
  for (size_t k = 0; k < slots.size(); ++k) {
    result[slots[k]] = found[k];
  }
  return result;
}

void FusedLstmLayerBackward0::release_variables() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto* v : {&input_, &w_ih_, &w_hh_, &b_ih_, &b_hh_, &h0_, &c0_, &output_, &h_n_, &c_n_}) {
    v->reset_data();
  }
  workspace_.clear();
}

variable_list FusedLstmLayerBackward0::apply(variable_list&& grads) {
  std::lock_guard<std::mutex> lock(mutex_);
  variable_list result(num_outputs());
  if (!grads[0].defined() && !grads[1].defined() && !grads[2].defined()) {
    return result;
  }
  const auto self = owning_ptr<torch::autograd::Node>(this);
  std::vector<Tensor> workspace;
  for (const auto& w : workspace_) {
    workspace.push_back(w.unpack());
  }
  auto [dx, dw_ih, dw_hh, db_ih, db_hh, dh0, dc0] = fused_lstm_layer_backward_op().call(
      input_.unpack(), w_ih_.unpack(), w_hh_.unpack(), maybe_defined(b_ih_.unpack()),
      maybe_defined(b_hh_.unpack()), h0_.unpack(), c0_.unpack(), output_.unpack(self),
      h_n_.unpack(self), c_n_.unpack(self), maybe_defined(grads[0]), maybe_defined(grads[1]),
      maybe_defined(grads[2]), workspace, reverse_);
  const std::array<Tensor, 7> all = {dx, dw_ih, dw_hh, db_ih, db_hh, dh0, dc0};
  for (size_t i = 0; i < all.size(); ++i) {
    if (task_should_compute_output(i)) {
      result[i] = all[i];
    }
  }
  return result;
}

variable_list NotDifferentiableTwice::apply(variable_list&&) {
  TORCH_CHECK(false, "batchrules: a second derivative through ", op_,
              " was asked for inside a torch.func transform stack with a single grad level. "
              "Recurrent layers support higher orders through nested transforms (grad(grad(f)), "
              "jacfwd, hessian), or call batchrules.disable()");
}

}  // namespace batchrules
