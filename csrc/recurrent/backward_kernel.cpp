// Backward through time of the grouped recurrence as the op's kernel runs it:
// gate-derivative coefficients for all steps first, then per step one GEMM
// and a few pointwise ops (Note [The recurrence kernels]).
#include "recurrent/fused_cells.h"
#include "recurrent/recurrence.h"

#include <ATen/ATen.h>

#include <utility>

namespace batchrules {

namespace {

// a * b into `out`, a view of a preallocated gradient.
void mul_into(Tensor out, const Tensor& a, const Tensor& b) {
  at::mul_out(out, a, b);
}

// s(1-s): the sigmoid's derivative from its value.
Tensor sigmoid_slope(const Tensor& s) {
  return s - s * s;
}

struct Loop {
  const Tensor& grad_output;
  RnnMode mode;
  bool reverse;
  int64_t T;
  // dh + grad_output_t, the gradient reaching step t's h.
  Tensor incoming(const Tensor& dh, int64_t t) const {
    return grad_output.defined() ? dh + grad_output.select(0, t) : dh;
  }
};

// The gradient reaching step t's LSTM h before any projection (dh_t W_hr),
// keeping the projected one, dh_t, for the projection's weight gradient.
Tensor lstm_incoming(const Loop& loop, const Tensor& dh, int64_t t, const Tensor& w_hr,
                     RecurrenceGrads& grads) {
  const Tensor dh_t = loop.incoming(dh, t);
  if (!w_hr.defined()) {
    return dh_t;
  }
  grads.projected.select(0, t).copy_(dh_t);
  return at::bmm(dh_t, w_hr);  // E,N,P x E,P,H -> E,N,H
}

// The same with the step's pointwise part as one CPU loop (Note [The fused
// LSTM cell]): nothing computed ahead for all steps, two dc buffers in turn.
void lstm_backward_fused(const Loop& loop, Tensor dh, Tensor dc, const Tensor& c0,
                         const Tensor& w_hh, const Tensor& w_hr, const Tensor& workspace,
                         RecurrenceGrads& grads) {
  const int64_t H = c0.size(-1);
  const Tensor act = workspace.narrow(-1, 0, 4 * H), c = workspace.narrow(-1, 4 * H, H);
  const Tensor c_first = c0.contiguous();
  Tensor dc_next = at::empty_like(dc);
  // The cell adds the output's gradient at t to dh itself (no pass of its own
  // a step) where that has rows to read: no projection, a unit last stride.
  const Tensor& grad_output = loop.grad_output;
  const bool cell_adds = grad_output.defined() && !w_hr.defined() && grad_output.stride(-1) == 1;
  const Tensor no_output_grad = cell_adds ? Tensor() : at::zeros_like(dc);
  for (int64_t s = 0; s < loop.T; ++s) {
    const int64_t t = loop.reverse ? s : loop.T - 1 - s;
    const int64_t prev = loop.reverse ? t + 1 : t - 1;  // the step the forward ran before t
    const Tensor dh_raw = (cell_adds ? dh : lstm_incoming(loop, dh, t, w_hr, grads)).contiguous();
    Tensor d_t = grads.input_gates.select(0, t);  // E,N,4H
    const Tensor c_prev = prev < 0 || prev >= loop.T ? c_first : c.select(0, prev);
    lstm_cell_backward_cpu(dh_raw, cell_adds ? grad_output.select(0, t) : no_output_grad, dc,
                           act.select(0, t), c.select(0, t), c_prev, d_t, dc_next);
    std::swap(dc, dc_next);
    dh = group_mm(d_t, w_hh);  // E,N,GH x E,GH,P -> E,N,P (Note [A step's GEMM])
  }
  grads.h0 = dh;
  grads.c0 = dc;
}

// dc* = dc + dh o (1 - tanh²c);  [di, df, dg] = dc* [g s'(i), c_prev s'(f), i (1-g²)];
// do = dh tanh(c) s'(o);  dc_prev = dc* f;  dh_prev = dgates W_hh
void lstm_backward(const Loop& loop, Tensor dh, Tensor dc, const Tensor& c0, const Tensor& w_hh,
                   const Tensor& w_hr, const Tensor& workspace, RecurrenceGrads& grads) {
  const int64_t H = c0.size(-1);
  const Tensor act = workspace.narrow(-1, 0, 4 * H), c = workspace.narrow(-1, 4 * H, H);
  const Tensor i = act.narrow(-1, 0, H), f = act.narrow(-1, H, H);
  const Tensor g = act.narrow(-1, 2 * H, H), o = act.narrow(-1, 3 * H, H);
  const Tensor tc = tanh_of(c);
  const Tensor dc_coef = o * (1 - tc * tc);  // T,E,N,H
  // T,E,N,3,H: the coefficients of dc* for i, f, g
  const Tensor ifg_coef =
      at::stack({g * sigmoid_slope(i), previous_states(c0, c, loop.reverse) * sigmoid_slope(f),
                 i * (1 - g * g)},
                -2);
  const Tensor o_coef = tc * sigmoid_slope(o);
  const auto sizes = ifg_coef.sizes();
  Tensor dcs = at::empty_like(dc);
  for (int64_t s = 0; s < loop.T; ++s) {
    const int64_t t = loop.reverse ? s : loop.T - 1 - s;
    const Tensor dh_raw = lstm_incoming(loop, dh, t, w_hr, grads);
    at::addcmul_out(dcs, dc, dh_raw, dc_coef.select(0, t));
    const Tensor d_t = grads.input_gates.select(0, t);  // E,N,4H
    mul_into(d_t.narrow(-1, 0, 3 * H).view({sizes[1], sizes[2], 3, H}), ifg_coef.select(0, t),
             dcs.unsqueeze(-2));
    mul_into(d_t.narrow(-1, 3 * H, H), dh_raw, o_coef.select(0, t));
    dc = dcs * f.select(0, t);
    dh = group_mm(d_t, w_hh);  // E,N,GH x E,GH,P -> E,N,P
  }
  grads.h0 = dh;
  grads.c0 = dc;
}

// With dh reaching h' = n + z (h - n):
//   [dr*, dz*, dn*] = dh [cn hn s'(r), (h-n) s'(z), cn],  cn = (1-z)(1-n²)
//   hidden gates: [dr*, dz*, dn* r];  dh_prev = dh z + hidden W_hh
void gru_backward(const Loop& loop, Tensor dh, const Tensor& h0, const Tensor& w_hh,
                  const Tensor& output, const Tensor& workspace, RecurrenceGrads& grads) {
  const int64_t H = h0.size(-1);
  const Tensor r = workspace.narrow(-1, 0, H), z = workspace.narrow(-1, H, H);
  const Tensor n = workspace.narrow(-1, 2 * H, H), hn = workspace.narrow(-1, 3 * H, H);
  const Tensor cn = (1 - z) * (1 - n * n);
  const Tensor cr = cn * hn * sigmoid_slope(r);
  const Tensor cz = (previous_states(h0, output, loop.reverse) - n) * sigmoid_slope(z);
  const Tensor input_coef = at::stack({cr, cz, cn}, -2);  // T,E,N,3,H
  const Tensor hidden_coef = at::stack({cr, cz, cn * r}, -2);
  const auto sizes = input_coef.sizes();
  for (int64_t s = 0; s < loop.T; ++s) {
    const int64_t t = loop.reverse ? s : loop.T - 1 - s;
    const Tensor dh_t = loop.incoming(dh, t).unsqueeze(-2);  // E,N,1,H
    const Tensor hidden_t = grads.hidden_gates.select(0, t);
    mul_into(grads.input_gates.select(0, t).view({sizes[1], sizes[2], 3, H}),
             input_coef.select(0, t), dh_t);
    mul_into(hidden_t.view({sizes[1], sizes[2], 3, H}), hidden_coef.select(0, t), dh_t);
    dh = at::baddbmm(dh_t.squeeze(-2) * z.select(0, t), hidden_t, w_hh);
  }
  grads.h0 = dh;
}

void rnn_backward(const Loop& loop, Tensor dh, const Tensor& w_hh, const Tensor& output,
                  RecurrenceGrads& grads) {
  const Tensor coef =
      loop.mode == RnnMode::RnnTanh ? 1 - output * output : output.gt(0).to(output.scalar_type());
  for (int64_t s = 0; s < loop.T; ++s) {
    const int64_t t = loop.reverse ? s : loop.T - 1 - s;
    const Tensor d_t = grads.input_gates.select(0, t);
    mul_into(d_t, loop.incoming(dh, t), coef.select(0, t));
    dh = group_mm(d_t, w_hh);
  }
  grads.h0 = dh;
}

}  // namespace

RecurrenceGrads recurrence_backward_kernel(const Tensor& grad_output, const Tensor& grad_h_n,
                                           const Tensor& grad_c_n, const Tensor& h0,
                                           const Tensor& c0, const Tensor& w_hh, const Tensor& w_hr,
                                           const Tensor& output, const Tensor& workspace,
                                           RnnMode mode, bool reverse) {
  const int64_t T = output.size(0);
  const int64_t GH = w_hh.size(1);
  RecurrenceGrads grads;
  // See Note [Steps in the input's memory order].
  grads.input_gates = empty_steps(output, GH);
  if (mode == RnnMode::Gru) {
    grads.hidden_gates = empty_steps(output, GH);
  }
  if (w_hr.defined()) {
    grads.projected = empty_steps(output, h0.size(-1));
  }
  // Fresh tensors: with no steps they are the gradients returned.
  const Tensor dh = grad_h_n.defined() ? grad_h_n.clone() : at::zeros_like(h0);
  const Tensor dc = mode != RnnMode::Lstm ? Tensor()
                    : grad_c_n.defined()  ? grad_c_n.clone()
                                          : at::zeros_like(c0);
  if (T == 0) {
    grads.h0 = dh;
    grads.c0 = dc;
    return grads;
  }
  const Loop loop{grad_output, mode, reverse, T};
  if (mode == RnnMode::Lstm && cell_fusable(workspace)) {
    lstm_backward_fused(loop, dh, dc.contiguous(), c0, w_hh, w_hr, workspace, grads);
  } else if (mode == RnnMode::Lstm) {
    lstm_backward(loop, dh, dc, c0, w_hh, w_hr, workspace, grads);
  } else if (mode == RnnMode::Gru) {
    gru_backward(loop, dh, h0, w_hh, output, workspace, grads);
  } else {
    rnn_backward(loop, dh, w_hh, output, grads);
  }
  return grads;
}

}  // namespace batchrules
