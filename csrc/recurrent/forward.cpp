// The forward of the grouped recurrence (Note [The grouped recurrence]).
// Gate orders are PyTorch's: LSTM i,f,g,o; GRU r,z,n.
#include "recurrent/recurrence.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

namespace batchrules {

RnnMode rnn_mode(int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 3, "batchrules.rnn_recurrence: mode must be 0 (LSTM), 1 (GRU), ",
              "2 (RNN tanh) or 3 (RNN relu), but got ", mode);
  return static_cast<RnnMode>(mode);
}

Tensor& tanh_in_place(Tensor& t, const Tensor& one) {
  return t.add_(t).sigmoid_().add_(t).sub_(one);
}

Tensor one_like(const Tensor& t) {
  return at::ones({}, t.options());
}

Tensor tanh_of(const Tensor& t) {
  Tensor out = at::sigmoid(t * 2);
  return out.mul_(2).sub_(1);
}

Tensor previous_states(const Tensor& initial, const Tensor& seq, bool reverse) {
  const c10::SymInt T = seq.sym_size(0);
  const Tensor rest = seq.narrow_symint(0, reverse ? 1 : 0, T - 1);
  return reverse ? at::cat({rest, initial.unsqueeze(0)}) : at::cat({initial.unsqueeze(0), rest});
}

Tensor empty_steps(const Tensor& like, int64_t width) {
  const int64_t T = like.size(0), E = like.size(1), N = like.size(2);
  if (T > 1 && N > 1 && like.stride(0) < like.stride(2)) {
    return at::empty({E, N, T, width}, like.options()).permute({2, 0, 1, 3});
  }
  return at::empty({T, E, N, width}, like.options());
}

Tensor& group_mm_out(Tensor& out, const Tensor& a, const Tensor& b) {
  if (a.size(0) != 1) {
    return at::bmm_out(out, a, b);
  }
  Tensor out_rows = out.select(0, 0);
  at::mm_out(out_rows, a.select(0, 0), b.select(0, 0));
  return out;
}

Tensor group_mm(const Tensor& a, const Tensor& b) {
  return a.size(0) != 1 ? at::bmm(a, b) : at::mm(a.select(0, 0), b.select(0, 0)).unsqueeze(0);
}

int64_t gate_count(RnnMode mode) {
  switch (mode) {
    case RnnMode::Lstm: return 4;
    case RnnMode::Gru: return 3;
    default: return 1;
  }
}

// LSTM: i,f,g,o (activated), c (+ the unprojected h with w_hr); GRU: r,z,n
// and h W_hn^T + b_hn, which the reset gate multiplies; RNN: nothing, its
// backward reads the output.
int64_t workspace_width(RnnMode mode, int64_t hidden, bool projected) {
  switch (mode) {
    case RnnMode::Lstm: return (projected ? 6 : 5) * hidden;
    case RnnMode::Gru: return 4 * hidden;
    default: return 0;
  }
}

namespace {

struct Step {
  Tensor h, c, saved;
};

// gates = x_t + h W_hh^T + b_hh;  c' = f c + i g;  h' = o tanh(c') (W_hr^T)
Step lstm_step(const Tensor& x_t, const Tensor& hidden_gates, const Tensor& c,
               const Tensor& w_hr_t) {
  const int64_t H = c.size(-1);
  const Tensor gates = x_t + hidden_gates;
  const Tensor act = gates.sigmoid();
  const Tensor i = act.narrow(-1, 0, H), f = act.narrow(-1, H, H), o = act.narrow(-1, 3 * H, H);
  const Tensor g = gates.narrow(-1, 2 * H, H).tanh();
  const Tensor c_new = f * c + i * g;
  const Tensor h_raw = o * c_new.tanh();
  if (!w_hr_t.defined()) {
    return {h_raw, c_new, at::cat({i, f, g, o, c_new}, -1)};
  }
  // E,N,H x E,H,P -> E,N,P
  return {at::bmm(h_raw, w_hr_t), c_new, at::cat({i, f, g, o, c_new, h_raw}, -1)};
}

// r,z = sigmoid(x_rz + hg_rz);  n = tanh(x_n + r hg_n);  h' = n + z (h - n)
Step gru_step(const Tensor& x_t, const Tensor& hidden_gates, const Tensor& h) {
  const int64_t H = h.size(-1);
  const Tensor rz = (x_t.narrow(-1, 0, 2 * H) + hidden_gates.narrow(-1, 0, 2 * H)).sigmoid();
  const Tensor r = rz.narrow(-1, 0, H), z = rz.narrow(-1, H, H);
  const Tensor hn = hidden_gates.narrow(-1, 2 * H, H);
  const Tensor n = (x_t.narrow(-1, 2 * H, H) + r * hn).tanh();
  return {n + z * (h - n), Tensor(), at::cat({rz, n, hn}, -1)};
}

Step rnn_step(const Tensor& x_t, const Tensor& hidden_gates, RnnMode mode) {
  const Tensor pre = x_t + hidden_gates;
  return {mode == RnnMode::RnnTanh ? pre.tanh() : pre.relu(), Tensor(), Tensor()};
}

}  // namespace

RecurrenceOutputs recurrence_forward(const Tensor& input_gates, const Tensor& h0, const Tensor& c0,
                                     const Tensor& w_hh, const Tensor& b_hh, const Tensor& w_hr,
                                     RnnMode mode, bool reverse) {
  const int64_t T = input_gates.size(0);
  const int64_t E = h0.size(0), N = h0.size(1), P = h0.size(2);
  const int64_t H = w_hh.size(1) / gate_count(mode);
  const Tensor w_hh_t = w_hh.transpose(1, 2);                          // E,P,GH
  const Tensor w_hr_t = w_hr.defined() ? w_hr.transpose(1, 2) : w_hr;  // E,H,P
  const Tensor bias = b_hh.defined() ? b_hh.unsqueeze(1) : b_hh;       // E,1,GH
  const int64_t K = workspace_width(mode, H, w_hr.defined());

  std::vector<Tensor> outputs(T), saved(mode == RnnMode::Lstm || mode == RnnMode::Gru ? T : 0);
  Tensor h = h0, c = c0;
  for (int64_t s = 0; s < T; ++s) {
    const int64_t t = reverse ? T - 1 - s : s;
    // E,N,P x E,P,GH -> E,N,GH
    const Tensor hidden_gates = bias.defined() ? at::baddbmm(bias, h, w_hh_t) : at::bmm(h, w_hh_t);
    const Tensor x_t = input_gates.select(0, t);
    Step step = mode == RnnMode::Lstm  ? lstm_step(x_t, hidden_gates, c, w_hr_t)
                : mode == RnnMode::Gru ? gru_step(x_t, hidden_gates, h)
                                       : rnn_step(x_t, hidden_gates, mode);
    h = step.h;
    c = step.c;
    outputs[t] = h;
    if (!saved.empty()) {
      saved[t] = step.saved;
    }
  }
  RecurrenceOutputs result;
  const auto options = input_gates.options();
  result.output = T > 0 ? at::stack(outputs) : at::empty({0, E, N, P}, options);
  result.workspace = saved.empty() ? at::empty({T, E, N, K}, options) : at::stack(saved);
  // With no steps the final state is the initial one, as a fresh tensor.
  result.h_n = T > 0 ? h : h0.clone();
  result.c_n = T > 0 || !c0.defined() ? c : c0.clone();
  return result;
}

}  // namespace batchrules
