// Backward through time of the grouped recurrence (Note [The grouped
// recurrence]): the steps in reverse order of the forward's, each gate
// gradient from the workspace the forward saved.
#include "recurrent/recurrence.h"

#include <ATen/ATen.h>

#include <vector>

namespace batchrules {

namespace {

struct StepGrads {
  Tensor input_gates, hidden_gates, h_prev, c_prev;
};

// c' = f c + i g,  h' = o tanh(c') with dh the gradient of o tanh(c'):
//   dc' = dc + dh o (1 - tanh²c')
//   di = dc' g i(1-i)   df = dc' c f(1-f)   dg = dc' i (1-g²)   do = dh tanh(c') o(1-o)
StepGrads lstm_step_grads(const Tensor& dh, const Tensor& dc, const Tensor& saved,
                          const Tensor& c_prev, const Tensor& w_hh) {
  const int64_t H = dh.size(-1);
  const Tensor i = saved.narrow(-1, 0, H), f = saved.narrow(-1, H, H);
  const Tensor g = saved.narrow(-1, 2 * H, H), o = saved.narrow(-1, 3 * H, H);
  const Tensor tc = saved.narrow(-1, 4 * H, H).tanh();
  const Tensor dcs = dc.defined() ? dc + dh * o * (1 - tc * tc) : dh * o * (1 - tc * tc);
  const Tensor gates = at::cat({dcs * g * i * (1 - i), dcs * c_prev * f * (1 - f),
                                dcs * i * (1 - g * g), dh * tc * o * (1 - o)},
                               -1);
  // E,N,GH x E,GH,P -> E,N,P
  return {gates, Tensor(), at::bmm(gates, w_hh), dcs * f};
}

// n = tanh(x_n + r hn), h' = n + z (h - n):
//   dn* = dh (1-z)(1-n²)  dz* = dh (h-n) z(1-z)  dr* = dn* hn r(1-r)
//   d input gates = [dr*, dz*, dn*]   d hidden gates = [dr*, dz*, dn* r]
StepGrads gru_step_grads(const Tensor& dh, const Tensor& saved, const Tensor& h_prev,
                         const Tensor& w_hh) {
  const int64_t H = dh.size(-1);
  const Tensor r = saved.narrow(-1, 0, H), z = saved.narrow(-1, H, H);
  const Tensor n = saved.narrow(-1, 2 * H, H), hn = saved.narrow(-1, 3 * H, H);
  const Tensor dn = dh * (1 - z) * (1 - n * n);
  const Tensor dr = dn * hn * r * (1 - r);
  const Tensor dz = dh * (h_prev - n) * z * (1 - z);
  const Tensor hidden = at::cat({dr, dz, dn * r}, -1);
  return {at::cat({dr, dz, dn}, -1), hidden, dh * z + at::bmm(hidden, w_hh), Tensor()};
}

StepGrads rnn_step_grads(const Tensor& dh, const Tensor& h, const Tensor& w_hh, RnnMode mode) {
  const Tensor gates = mode == RnnMode::RnnTanh ? dh * (1 - h * h) : dh * h.gt(0);
  return {gates, Tensor(), at::bmm(gates, w_hh), Tensor()};
}

Tensor stack_or_empty(const std::vector<Tensor>& steps, const Tensor& like, int64_t width) {
  if (!steps.empty()) {
    return at::stack(steps);
  }
  return at::empty({0, like.size(0), like.size(1), width}, like.options());
}

}  // namespace

RecurrenceGrads recurrence_backward(const Tensor& grad_output, const Tensor& grad_h_n,
                                    const Tensor& grad_c_n, const Tensor& h0, const Tensor& c0,
                                    const Tensor& w_hh, const Tensor& w_hr, const Tensor& output,
                                    const Tensor& workspace, RnnMode mode, bool reverse) {
  const int64_t T = output.size(0);
  const int64_t H = w_hh.size(1) / gate_count(mode);
  const bool lstm = mode == RnnMode::Lstm, gru = mode == RnnMode::Gru;
  const int64_t c_slot = 4 * H;

  std::vector<Tensor> d_input(T), d_hidden(gru ? T : 0), d_projected(w_hr.defined() ? T : 0);
  Tensor dh = grad_h_n.defined() ? grad_h_n : at::zeros_like(h0);
  Tensor dc = grad_c_n;
  for (int64_t s = 0; s < T; ++s) {
    const int64_t t = reverse ? s : T - 1 - s;
    const int64_t prev = reverse ? t + 1 : t - 1;  // the step the forward ran before t
    const bool first = prev < 0 || prev >= T;
    const Tensor dh_t = grad_output.defined() ? dh + grad_output.select(0, t) : dh;
    StepGrads step;
    if (lstm) {
      Tensor dh_raw = dh_t;
      if (w_hr.defined()) {
        d_projected[t] = dh_t;
        dh_raw = at::bmm(dh_t, w_hr);  // E,N,P x E,P,H -> E,N,H
      }
      const Tensor c_prev = first ? c0 : workspace.select(0, prev).narrow(-1, c_slot, H);
      step = lstm_step_grads(dh_raw, dc, workspace.select(0, t), c_prev, w_hh);
    } else if (gru) {
      const Tensor h_prev = first ? h0 : output.select(0, prev);
      step = gru_step_grads(dh_t, workspace.select(0, t), h_prev, w_hh);
      d_hidden[t] = step.hidden_gates;
    } else {
      step = rnn_step_grads(dh_t, output.select(0, t), w_hh, mode);
    }
    d_input[t] = step.input_gates;
    dh = step.h_prev;
    dc = step.c_prev;
  }
  RecurrenceGrads grads;
  grads.input_gates = stack_or_empty(d_input, h0, w_hh.size(1));
  if (gru) {
    grads.hidden_gates = stack_or_empty(d_hidden, h0, w_hh.size(1));
  }
  if (w_hr.defined()) {
    grads.projected = stack_or_empty(d_projected, h0, h0.size(-1));
  }
  // With no steps the gradients pass through: fresh tensors, not aliases.
  grads.h0 = T > 0 ? dh : (grad_h_n.defined() ? grad_h_n.clone() : at::zeros_like(h0));
  if (lstm) {
    grads.c0 = T > 0 && dc.defined() ? dc
               : grad_c_n.defined()  ? grad_c_n.clone()
                                     : at::zeros_like(c0);
  }
  return grads;
}

}  // namespace batchrules
