// A GRU step's pointwise part as one loop per row (Note [The fused LSTM
// cell]): as aten ops it is seven calls on [E, N, H] slices per step.
#include "recurrent/fused_cells.h"

#include "recurrent/cell_math.h"

#include <ATen/ATen.h>

#include <cstdint>

namespace batchrules {

namespace {

using namespace cell_math;

__attribute__((target_clones("avx512f", "avx2", "default"))) void gru_row(
    const float* __restrict x, const float* __restrict hidden, const float* __restrict h,
    float* __restrict ws, float* __restrict h_new, int64_t H) {
  for (int64_t j = 0; j < H; ++j) {
    const float r = sigmoid_approx(x[j] + hidden[j]);
    const float z = sigmoid_approx(x[H + j] + hidden[H + j]);
    const float hn = hidden[2 * H + j];
    const float n = tanh_approx(x[2 * H + j] + r * hn);
    ws[j] = r;
    ws[H + j] = z;
    ws[2 * H + j] = n;
    ws[3 * H + j] = hn;
    h_new[j] = n + z * (h[j] - n);
  }
}

}  // namespace

void gru_cell_forward_cpu(const at::Tensor& x, const at::Tensor& hidden, const at::Tensor& h,
                          at::Tensor& ws, at::Tensor& h_new) {
  const int64_t E = x.size(0), N = x.size(1), H = h.size(2);
  assert_contiguous_rows({&x, &hidden, &h, &ws, &h_new});
  const Rows<const float> x_rows(x), hidden_rows(hidden), h_rows(h);
  const Rows<float> ws_rows(ws), h_new_rows(h_new);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t n = 0; n < N; ++n) {
      gru_row(x_rows(e, n), hidden_rows(e, n), h_rows(e, n), ws_rows(e, n), h_new_rows(e, n), H);
    }
  }
}

}  // namespace batchrules
