// The CPU kernel of batchrules::ghost_norms_sq: per sample,
// sum_{t,s} (a_t . a_s)(g_t . g_s) = ||g^T a||_F^2 without the [T, T] Gram
// matrices or the [O, I] gradient.
//
// Note [The ghost norm kernel]
// aten's bmm of a sample's rows against themselves ([B, T, I] x [B, I, T])
// runs at 8-20 GMAC/s for T <= 32 on one CPU thread (many small GEMMs, each
// with its call overhead), and the ghost norm needs two of them plus a
// product and a reduction. Here each sample's two Gram matrices are formed in
// their lower triangles only (they are symmetric), one row of each at a time
// (no [T, T] scratch), the row against four earlier rows at once: it is
// loaded once for four dot products, whose 4 x 16 independent accumulators
// the compiler turns into SIMD lanes, the best of AVX-512, AVX2 and the
// baseline chosen at load time (target_clones). One dot product per call was
// bound by its loads and its horizontal sum, 1.4-2x slower. The Grams'
// products are summed in double. Measured (1 thread, AMD EPYC, float32,
// against the two bmms): B 32, T 12, I 128, O 384: 38 against 139 us; T 20,
// I 128, O 512: 112 against 311 us; B 16, T 64, I = O = 768: 1.8 against
// 2.2 ms; T 128: 7.5 against 8.8 ms, so dp/cost.py calls it up to 128 rows.
#include "ghost_norm/shape_checks.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

namespace batchrules {

namespace {

constexpr int kLanes = 16;

inline constexpr int kTile = 4;

template <typename T>
inline T lane_sum(const T* acc) {
  T sum = 0;
  for (int j = 0; j < kLanes; ++j) {
    sum += acc[j];
  }
  return sum;
}

// x . y0 .. x . y3 at once: x is loaded once for four products, and the
// 4 x kLanes independent accumulators become SIMD lanes.
template <typename T>
inline void dots4(const T* __restrict x, const T* __restrict y0, const T* __restrict y1,
                  const T* __restrict y2, const T* __restrict y3, int64_t n, T* out) {
  T a0[kLanes] = {}, a1[kLanes] = {}, a2[kLanes] = {}, a3[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const T v = x[k + j];
      a0[j] += v * y0[k + j];
      a1[j] += v * y1[k + j];
      a2[j] += v * y2[k + j];
      a3[j] += v * y3[k + j];
    }
  }
  T s0 = lane_sum(a0), s1 = lane_sum(a1), s2 = lane_sum(a2), s3 = lane_sum(a3);
  for (; k < n; ++k) {
    s0 += x[k] * y0[k];
    s1 += x[k] * y1[k];
    s2 += x[k] * y2[k];
    s3 += x[k] * y3[k];
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

template <typename T>
inline T dot1(const T* __restrict x, const T* __restrict y, int64_t n) {
  T acc[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      acc[j] += x[k + j] * y[k + j];
    }
  }
  T sum = lane_sum(acc);
  for (; k < n; ++k) {
    sum += x[k] * y[k];
  }
  return sum;
}

// Row t of one sample's Gram matrix up to the diagonal, out[s] = x_t . x_s
// for s <= t, of contiguous rows x [rows, n]: four earlier rows at a time.
template <typename T>
inline void tiled_gram_row(const T* x, int64_t t, int64_t n, T* out) {
  const T* xt = x + t * n;
  int64_t s = 0;
  for (; s + kTile <= t + 1; s += kTile) {
    dots4(xt, x + s * n, x + (s + 1) * n, x + (s + 2) * n, x + (s + 3) * n, n, out + s);
  }
  for (; s <= t; ++s) {
    out[s] = dot1(xt, x + s * n, n);
  }
}

// One function per dtype: target_clones takes plain (non-template, not overloaded) functions.
__attribute__((target_clones("avx512f", "avx2", "default"))) void gram_row_float(
    const float* x, int64_t t, int64_t n, float* out) {
  tiled_gram_row(x, t, n, out);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void gram_row_double(
    const double* x, int64_t t, int64_t n, double* out) {
  tiled_gram_row(x, t, n, out);
}

inline void gram_row(const float* x, int64_t t, int64_t n, float* out) {
  gram_row_float(x, t, n, out);
}
inline void gram_row(const double* x, int64_t t, int64_t n, double* out) {
  gram_row_double(x, t, n, out);
}

// One sample: a [T, I], g [T, O], both contiguous; ga, gg: T scratch each,
// one row of each Gram at a time.
template <typename T>
double sample_norm_sq(const T* a, const T* g, int64_t rows, int64_t in, int64_t out, T* ga,
                      T* gg) {
  double diagonal = 0;
  double off_diagonal = 0;  // the pairs s < t, each standing for (s, t) and (t, s)
  for (int64_t t = 0; t < rows; ++t) {
    gram_row(a, t, in, ga);
    gram_row(g, t, out, gg);
    for (int64_t s = 0; s < t; ++s) {
      off_diagonal += static_cast<double>(ga[s]) * static_cast<double>(gg[s]);
    }
    diagonal += static_cast<double>(ga[t]) * static_cast<double>(gg[t]);
  }
  return diagonal + 2 * off_diagonal;
}

at::Tensor ghost_norms_sq_cpu(const at::Tensor& rows_in, const at::Tensor& grads_in) {
  check_ghost_norm_inputs(rows_in, grads_in);
  const at::Tensor rows = rows_in.contiguous();
  const at::Tensor grads = grads_in.contiguous();
  const int64_t batch = rows.size(0), steps = rows.size(1);
  const int64_t in = rows.size(2), out = grads.size(2);
  at::Tensor result = at::empty({batch}, rows.options());
  AT_DISPATCH_FLOATING_TYPES(rows.scalar_type(), "ghost_norms_sq", [&] {
    const scalar_t* a = rows.const_data_ptr<scalar_t>();
    const scalar_t* g = grads.const_data_ptr<scalar_t>();
    scalar_t* norms = result.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> rows_of_grams(2 * steps);
      for (int64_t b = begin; b < end; ++b) {
        norms[b] = static_cast<scalar_t>(sample_norm_sq(a + b * steps * in, g + b * steps * out,
                                                        steps, in, out, rows_of_grams.data(),
                                                        rows_of_grams.data() + steps));
      }
    });
  });
  return result;
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, CPU, m) {
  m.impl("ghost_norms_sq", ghost_norms_sq_cpu);
}

}  // namespace batchrules
