// Note [The fused LSTM cell]
// A step of the recurrence kernel is one GEMM and the cell's pointwise
// part. As aten ops the latter is ~11 calls on [E, N, H] slices (sigmoid,
// the tanh as a sigmoid, products, sums), each a pass over memory and a
// dispatch: at N 32, H 128 they cost as much as the step's GEMM. Here it is
// one loop per row over the H units, reading the four gate pre-activations
// once and writing the activations, c' and h'. exp is computed as 2^n p(r),
// r = x - n ln2 in [-ln2/2, ln2/2] and p the Taylor polynomial of degree 7
// (relative error < 1e-7, float32's own), in plain arithmetic that the
// compiler vectorizes for the best of AVX-512, AVX2 and the baseline chosen
// at load time (target_clones); tanh(x) = 2 sigmoid(2x) - 1 (Note [tanh as a
// sigmoid]). A GRU step's forward is fused the same way (gru_cell_cpu.cpp;
// its backward keeps the aten ops); the shared arithmetic is in
// cell_math.h. float64 keeps the aten ops: its tests compare exactly.
#include "recurrent/fused_cells.h"

#include "recurrent/cell_math.h"

#include <ATen/ATen.h>

#include <cstdint>

namespace batchrules {

namespace {

using namespace cell_math;

// One row: pre-activations x[0:4H] + hidden[0:4H] + bias[0:4H], state
// c[0:H]. (No branch in the loop, which would keep it scalar: an absent bias
// is zeros.)
__attribute__((target_clones("avx512f", "avx2", "default"))) void lstm_row(
    const float* __restrict x, const float* __restrict hidden, const float* __restrict bias,
    const float* __restrict c, float* __restrict act, float* __restrict c_new, float* __restrict h,
    int64_t H) {
  for (int64_t j = 0; j < H; ++j) {
    const float pi = x[j] + hidden[j] + bias[j];
    const float pf = x[H + j] + hidden[H + j] + bias[H + j];
    const float pg = x[2 * H + j] + hidden[2 * H + j] + bias[2 * H + j];
    const float po = x[3 * H + j] + hidden[3 * H + j] + bias[3 * H + j];
    const float i = sigmoid_approx(pi), f = sigmoid_approx(pf);
    const float g = tanh_approx(pg), o = sigmoid_approx(po);
    const float cn = f * c[j] + i * g;
    act[j] = i;
    act[H + j] = f;
    act[2 * H + j] = g;
    act[3 * H + j] = o;
    c_new[j] = cn;
    h[j] = o * tanh_approx(cn);
  }
}

// One row of the step's backward, with tc = tanh(c') recomputed and
// dh = dh_next + dh_out:
// dc* = dc + dh o (1 - tc^2);  [di, df, dg] = dc* [g i(1-i), c f(1-f), i (1-g^2)];
// do = dh tc o(1-o);  dc_prev = dc* f.
__attribute__((target_clones("avx512f", "avx2", "default"))) void lstm_row_backward(
    const float* __restrict dh_next, const float* __restrict dh_out, const float* __restrict dc,
    const float* __restrict act, const float* __restrict c_new, const float* __restrict c,
    float* __restrict d_gates, float* __restrict dc_prev, int64_t H) {
  for (int64_t j = 0; j < H; ++j) {
    const float i = act[j], f = act[H + j], g = act[2 * H + j], o = act[3 * H + j];
    const float tc = tanh_approx(c_new[j]);
    const float dh = dh_next[j] + dh_out[j];
    const float dcs = dc[j] + dh * o * (1.0f - tc * tc);
    d_gates[j] = dcs * g * (i - i * i);
    d_gates[H + j] = dcs * c[j] * (f - f * f);
    d_gates[2 * H + j] = dcs * i * (1.0f - g * g);
    d_gates[3 * H + j] = dh * tc * (o - o * o);
    dc_prev[j] = dcs * f;
  }
}

}  // namespace

void lstm_cell_forward_cpu(const at::Tensor& x, const at::Tensor& hidden, const at::Tensor& bias,
                           const at::Tensor& c, at::Tensor& act, at::Tensor& c_new, at::Tensor& h) {
  const int64_t E = x.size(0), N = x.size(1), H = c.size(2);
  assert_contiguous_rows({&x, &hidden, &bias, &c, &act, &c_new, &h});
  const Rows<const float> x_rows(x), hidden_rows(hidden), bias_rows(bias), c_rows(c);
  const Rows<float> act_rows(act), c_new_rows(c_new), h_rows(h);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t n = 0; n < N; ++n) {
      lstm_row(x_rows(e, n), hidden_rows(e, n), bias_rows(e, 0), c_rows(e, n), act_rows(e, n),
               c_new_rows(e, n), h_rows(e, n), H);
    }
  }
}

void lstm_cell_backward_cpu(const at::Tensor& dh, const at::Tensor& dh_out, const at::Tensor& dc,
                            const at::Tensor& act, const at::Tensor& c_new, const at::Tensor& c,
                            at::Tensor& d_gates, at::Tensor& dc_prev) {
  const int64_t E = dh.size(0), N = dh.size(1), H = dh.size(2);
  assert_contiguous_rows({&dh, &dh_out, &dc, &act, &c_new, &c, &d_gates, &dc_prev});
  const Rows<const float> dh_rows(dh), dh_out_rows(dh_out), dc_rows(dc), act_rows(act),
      c_new_rows(c_new), c_rows(c);
  const Rows<float> d_gates_rows(d_gates), dc_prev_rows(dc_prev);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t n = 0; n < N; ++n) {
      lstm_row_backward(dh_rows(e, n), dh_out_rows(e, n), dc_rows(e, n), act_rows(e, n),
                        c_new_rows(e, n), c_rows(e, n), d_gates_rows(e, n), dc_prev_rows(e, n), H);
    }
  }
}

}  // namespace batchrules
