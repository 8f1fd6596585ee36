// The forward of the grouped recurrence as the op's kernel runs it.
//
// Note [The recurrence kernels]
// forward.cpp / backward.cpp are the recurrence as functional aten ops: what
// autograd can differentiate (the decomposition). Run as the kernel, most of
// their time went to allocations and small ops per step, not to the GEMM
// that is the step's real work. The kernels write each step into
// preallocated outputs with out= ops (one GEMM and a few pointwise ops per
// step, each vectorized by aten), and the backward moves everything that
// depends only on the forward's saved gates out of the loop: the gates'
// derivative coefficients are computed for all steps at once, so a step of
// the backward is its GEMM and three or four pointwise ops.
#include "common/packed_gemm.h"
#include "recurrent/fused_cells.h"
#include "recurrent/recurrence.h"

#include <ATen/ATen.h>

namespace batchrules {

namespace {

struct Buffers {
  Tensor output, workspace, gates, scratch;
  Tensor one;               // See Note [tanh as a sigmoid]
  bool fused = false;       // the LSTM or GRU cell as one CPU loop (Note [The fused LSTM cell])
  PackedRhs packed_w_hh_t;  // See Note [One packed W_hh for all steps]
};

// out = addend + h W_hh^T (addend broadcast; none: out = h W_hh^T):
// E,N,P x E,P,GH -> E,N,GH
void hidden_gemm_into(const Buffers& b, Tensor& out, const Tensor& h, const Tensor& w_hh_t,
                      const Tensor& addend) {
  if (b.packed_w_hh_t.defined()) {
    if (addend.defined()) {
      out.copy_(addend);
    }
    b.packed_w_hh_t.mm_out(h, out, addend.defined());
  } else if (addend.defined()) {
    at::baddbmm_out(out, addend, h, w_hh_t);
  } else {
    group_mm_out(out, h, w_hh_t);
  }
}

// i,f,g,o,c (+ h before the projection) into the workspace row; h into out_t.
// gates = x_t + h W_hh^T + b_hh; g's tanh as 2 sigmoid(2x) - 1, in the same
// sigmoid call as i, f, o (Note [tanh as a sigmoid]). The fused cell adds
// x_t and the bias itself, so the step's GEMM does not first copy x_t into
// its output.
void lstm_step_into(Buffers& b, const Tensor& x_t, const Tensor& h, const Tensor& c,
                    const Tensor& bias, const Tensor& w_hh_t, const Tensor& w_hr_t, int64_t t,
                    int64_t H) {
  Tensor ws = b.workspace.select(0, t);
  Tensor act = ws.narrow(-1, 0, 4 * H);
  Tensor c_new = ws.narrow(-1, 4 * H, H);
  Tensor out_t = b.output.select(0, t);
  if (b.fused) {  // Note [The fused LSTM cell]
    hidden_gemm_into(b, b.gates, h, w_hh_t, Tensor());
    Tensor h_new = w_hr_t.defined() ? ws.narrow(-1, 5 * H, H) : out_t;
    lstm_cell_forward_cpu(x_t, b.gates, bias, c, act, c_new, h_new);
    if (w_hr_t.defined()) {
      group_mm_out(out_t, h_new, w_hr_t);  // E,N,H x E,H,P -> E,N,P
    }
    return;
  }
  hidden_gemm_into(b, b.gates, h, w_hh_t, x_t);
  if (bias.defined()) {
    b.gates.add_(bias);
  }
  Tensor g_pre = b.gates.narrow(-1, 2 * H, H);
  g_pre.add_(g_pre);
  at::sigmoid_out(act, b.gates);
  Tensor g = act.narrow(-1, 2 * H, H);
  g.add_(g).sub_(b.one);
  at::mul_out(c_new, act.narrow(-1, H, H), c);  // f c
  c_new.addcmul_(act.narrow(-1, 0, H), g);      // + i g
  at::add_out(b.scratch, c_new, c_new);
  b.scratch.sigmoid_().add_(b.scratch).sub_(b.one);  // tanh(c')
  if (!w_hr_t.defined()) {
    at::mul_out(out_t, act.narrow(-1, 3 * H, H), b.scratch);
    return;
  }
  Tensor h_raw = ws.narrow(-1, 5 * H, H);
  at::mul_out(h_raw, act.narrow(-1, 3 * H, H), b.scratch);
  at::bmm_out(out_t, h_raw, w_hr_t);  // E,N,H x E,H,P -> E,N,P
}

// r,z,n and hn = (h W_hh^T + b_hh)_n into the workspace row; h' into out_t.
void gru_step_into(Buffers& b, const Tensor& x_t, const Tensor& h, const Tensor& bias,
                   const Tensor& w_hh_t, int64_t t, int64_t H) {
  hidden_gemm_into(b, b.gates, h, w_hh_t, bias);
  Tensor ws = b.workspace.select(0, t);
  Tensor out_t = b.output.select(0, t);
  if (b.fused) {  // Note [The fused LSTM cell]
    gru_cell_forward_cpu(x_t, b.gates, h, ws, out_t);
    return;
  }
  Tensor rz = ws.narrow(-1, 0, 2 * H);
  Tensor n = ws.narrow(-1, 2 * H, H);
  at::add_out(rz, x_t.narrow(-1, 0, 2 * H), b.gates.narrow(-1, 0, 2 * H));
  rz.sigmoid_();
  Tensor hn = ws.narrow(-1, 3 * H, H);
  hn.copy_(b.gates.narrow(-1, 2 * H, H));
  at::mul_out(n, rz.narrow(-1, 0, H), hn);
  tanh_in_place(n.add_(x_t.narrow(-1, 2 * H, H)), b.one);
  at::sub_out(out_t, h, n);  // n + z (h - n)
  out_t.mul_(rz.narrow(-1, H, H)).add_(n);
}

void rnn_step_into(Buffers& b, const Tensor& x_t, const Tensor& h, const Tensor& bias,
                   const Tensor& w_hh_t, int64_t t, RnnMode mode) {
  Tensor out_t = b.output.select(0, t);
  hidden_gemm_into(b, out_t, h, w_hh_t, x_t);
  if (bias.defined()) {
    out_t.add_(bias);
  }
  mode == RnnMode::RnnTanh ? tanh_in_place(out_t, b.one) : out_t.relu_();
}

}  // namespace

RecurrenceOutputs recurrence_forward_kernel(const Tensor& input_gates, const Tensor& h0,
                                            const Tensor& c0, const Tensor& w_hh,
                                            const Tensor& b_hh, const Tensor& w_hr, RnnMode mode,
                                            bool reverse) {
  const int64_t T = input_gates.size(0);
  const int64_t E = h0.size(0), N = h0.size(1), P = h0.size(2);
  const int64_t GH = w_hh.size(1), H = GH / gate_count(mode);
  const auto options = input_gates.options();
  Buffers b;
  // See Note [Steps in the input's memory order].
  b.output = empty_steps(input_gates, P);
  b.workspace = empty_steps(input_gates, workspace_width(mode, H, w_hr.defined()));
  b.gates = at::empty({E, N, GH}, options);
  b.scratch = at::empty({E, N, H}, options);
  b.one = one_like(b.scratch);
  const bool gru = mode == RnnMode::Gru;
  // the fused cells read the input gates' rows in place
  b.fused = cell_fusable(b.gates) && (mode == RnnMode::Lstm || gru) && input_gates.stride(-1) == 1;
  const Tensor w_hh_t = w_hh.transpose(1, 2);  // E,P,GH
  b.packed_w_hh_t = PackedRhs::pack(w_hh_t, N, T);
  const Tensor w_hr_t = w_hr.defined() ? w_hr.transpose(1, 2) : w_hr;  // E,H,P
  // E,1,GH; the fused LSTM cell reads rows with a unit stride, zeros for none
  // (the GRU's bias is added by its step's GEMM)
  const bool cell_reads_bias = b.fused && mode == RnnMode::Lstm;
  const Tensor bias = !cell_reads_bias ? (b_hh.defined() ? b_hh.unsqueeze(1) : b_hh)
                      : b_hh.defined() ? b_hh.unsqueeze(1).contiguous()
                                       : at::zeros({E, 1, GH}, options);
  const Tensor& x = input_gates;

  Tensor h = b.fused ? h0.contiguous() : h0;
  Tensor c = b.fused && c0.defined() ? c0.contiguous() : c0;
  for (int64_t s = 0; s < T; ++s) {
    const int64_t t = reverse ? T - 1 - s : s;
    const Tensor x_t = x.select(0, t);
    if (mode == RnnMode::Lstm) {
      lstm_step_into(b, x_t, h, c, bias, w_hh_t, w_hr_t, t, H);
      c = b.workspace.select(0, t).narrow(-1, 4 * H, H);
    } else if (gru) {
      gru_step_into(b, x_t, h, bias, w_hh_t, t, H);
    } else {
      rnn_step_into(b, x_t, h, bias, w_hh_t, t, mode);
    }
    h = b.output.select(0, t);
  }
  RecurrenceOutputs result;
  result.output = b.output;
  result.workspace = b.workspace;
  result.h_n = h.clone();
  result.c_n = c.defined() ? c.clone() : c;
  return result;
}

}  // namespace batchrules
