// The CPU kernel of batchrules::scaled_transpose: out[k, b, t] = x[b, t, k]
// scale[b], contiguous; a clipped sum's scaled operand as oneDNN's matmul
// reads it (Note [oneDNN for the clipped sums] in batchrules/dp/gemm.py).
//
// Note [A scaled transpose in 8 x 8 tiles]
// aten's mul into a permuted output runs with a strided write (or read) per
// element, several times the same mul unpermuted and a sizeable part of the
// clipped sum's GEMM it feeds (docs/design.md). Here, with AVX2, eight rows of
// x are loaded as eight vectors, each multiplied by its sample's
// coefficient, transposed in registers (unpack, shuffle, permute2f128) and
// stored as pieces of eight output rows; the edges short of eight rows or
// columns run as scalars. The tiles go in bands of eight output rows, each
// written from its start to its end: bands of eight input rows write to
// every output row in turn, rows that lie a power of two apart and evict
// each other. Other dtypes and CPUs without AVX2 keep aten's mul.
#include "dp/scaled_transpose/shape_checks.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <vector>

namespace batchrules {

namespace {

constexpr int64_t kTile = 8;

// out[j * ldo + i] = x[i * ldx + j] s[i] for i, j < 8.
__attribute__((target("avx2"))) void tile_avx2(const float* x, int64_t ldx, const float* s,
                                               float* out, int64_t ldo) {
  __m256 r[kTile];
  for (int64_t i = 0; i < kTile; ++i) {
    r[i] = _mm256_mul_ps(_mm256_loadu_ps(x + i * ldx), _mm256_broadcast_ss(s + i));
  }
  // Pairs of rows interleaved, then quadruples: u[j] holds columns j and j + 4
  // of rows 0..3 (u[j]) and 4..7 (u[j + 4]) in its two 128-bit lanes.
  __m256 t[kTile], u[kTile];
  for (int64_t i = 0; i < kTile; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int64_t h = 0; h < kTile; h += 4) {
    u[h] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int64_t j = 0; j < 4; ++j) {
    _mm256_storeu_ps(out + j * ldo, _mm256_permute2f128_ps(u[j], u[j + 4], 0x20));
    _mm256_storeu_ps(out + (j + 4) * ldo, _mm256_permute2f128_ps(u[j], u[j + 4], 0x31));
  }
}

// Columns [begin, end) of out [K, R] from x [R, K] (row stride ldx), a band
// of eight output rows at a time: they are written in order, x read in tiles.
__attribute__((target("avx2"))) void columns_avx2(const float* x, int64_t ldx, const float* s,
                                                  float* out, int64_t R, int64_t begin,
                                                  int64_t end) {
  const int64_t r_tiled = R - R % kTile;
  int64_t k = begin;
  for (; k + kTile <= end; k += kTile) {
    for (int64_t r = 0; r < r_tiled; r += kTile) {
      tile_avx2(x + r * ldx + k, ldx, s + r, out + k * R + r, R);
    }
    for (int64_t j = k; j < k + kTile; ++j) {
      for (int64_t r = r_tiled; r < R; ++r) {
        out[j * R + r] = x[r * ldx + j] * s[r];
      }
    }
  }
  for (; k < end; ++k) {
    for (int64_t r = 0; r < R; ++r) {
      out[k * R + r] = x[r * ldx + k] * s[r];
    }
  }
}

bool tiles_run(const at::Tensor& x) {
  static const bool avx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
  }();
  return avx2 && x.scalar_type() == at::kFloat;
}

at::Tensor scaled_transpose_cpu(const at::Tensor& x_in, const at::Tensor& scale) {
  check_scaled_transpose_inputs(x_in, scale);
  const int64_t B = x_in.size(0), T = x_in.size(1), K = x_in.size(2);
  at::Tensor out = at::empty({K, B, T}, x_in.options());
  if (!tiles_run(x_in)) {
    at::Tensor as_x = out.permute({1, 2, 0});
    at::mul_out(as_x, x_in, scale.view({-1, 1, 1}));
    return out;
  }
  // x's rows as [R, K], one stride apart (a size-1 dim's stride is arbitrary).
  const bool rows_strided = (K <= 1 || x_in.stride(2) == 1) &&
                            (B <= 1 || T <= 1 || x_in.stride(0) == T * x_in.stride(1));
  const at::Tensor x = rows_strided ? x_in : x_in.contiguous();
  const int64_t R = B * T, ldx = T > 1 ? x.stride(1) : x.stride(0);
  const at::Tensor s = scale.contiguous();
  const float* sample_scale = s.const_data_ptr<float>();
  std::vector<float> row_scale(R);
  for (int64_t r = 0; r < R; ++r) {
    row_scale[r] = sample_scale[r / T];
  }
  const float* rows = x.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  // Bands of eight output rows, about 32K elements a thread at least.
  const int64_t bands = (K + kTile - 1) / kTile;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / (kTile * std::max<int64_t>(R, 1)));
  at::parallel_for(0, bands, grain, [&](int64_t begin, int64_t end) {
    columns_avx2(rows, ldx, row_scale.data(), dst, R, begin * kTile, std::min(end * kTile, K));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, CPU, m) {
  m.impl("scaled_transpose", scaled_transpose_cpu);
}

}  // namespace batchrules
