// The CPU kernel of batchrules::ghost_norms_sq: per sample,
// sum_{t,s} (a_t . a_s + k)(g_t . g_s) = ||g^T [a, 1_k]||_F^2 without the
// [T, T] Gram matrices or the [O, I] gradient. With k = 0 that is the
// weight's squared gradient norm; each unit of k adds a bias sharing the
// output gradient, ||sum_t g_t||^2 (the rows with k columns of ones).
//
// Note [The ghost norm kernel]
// aten's bmm of a sample's rows against themselves ([B, T, I] x [B, I, T])
// is slow for few rows (many small GEMMs, each with its call overhead), and
// the ghost norm needs two of them plus a
// product and a reduction. Here each sample's two Gram matrices are formed in
// their lower triangles only (they are symmetric), one row of each at a time
// (no [T, T] scratch), the row against four earlier rows at once: it is
// loaded once for four dot products, whose 4 x 16 independent accumulators
// the compiler turns into SIMD lanes, the best of AVX-512, AVX2 and the
// baseline chosen at load time (target_clones). One dot product per call is
// bound by its loads and its horizontal sum. The Grams' products are summed
// in double. It beats the two bmms up to 128 rows a sample, so dp/cost.py
// calls it up to there.
// Where the CPU has AVX-512, or AVX2 with FMA, float32 takes 4 x 4 blocks of
// rows instead (Note [Gram blocks] in gram_blocks.cpp).
#include "dp/ghost_norm/gram_blocks.h"
#include "dp/ghost_norm/shape_checks.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>
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
__attribute__((target_clones("avx512f", "avx2", "default"))) void gram_row_float(const float* x,
                                                                                 int64_t t,
                                                                                 int64_t n,
                                                                                 float* out) {
  tiled_gram_row(x, t, n, out);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void gram_row_double(const double* x,
                                                                                  int64_t t,
                                                                                  int64_t n,
                                                                                  double* out) {
  tiled_gram_row(x, t, n, out);
}

inline void gram_row(const float* x, int64_t t, int64_t n, float* out) {
  gram_row_float(x, t, n, out);
}
inline void gram_row(const double* x, int64_t t, int64_t n, double* out) {
  gram_row_double(x, t, n, out);
}

// The rows [0, blocked) of one float32 sample in 4 x 4 blocks by `block`
// (Note [Gram blocks] in gram_blocks.cpp; blocked a multiple of 4), adding to
// diagonal and off_diagonal as sample_norm_sq does.
void blocked_norm_sq(GramBlock block, const float* a, const float* g, int64_t blocked, int64_t in,
                     int64_t out, double biases, double& diagonal, double& off_diagonal) {
  float ga[16], gg[16];
  for (int64_t tb = 0; tb < blocked; tb += 4) {
    for (int64_t sb = 0; sb <= tb; sb += 4) {
      block(a + tb * in, a + sb * in, in, ga);
      block(g + tb * out, g + sb * out, out, gg);
      for (int m = 0; m < 16; ++m) {
        const int64_t t = tb + m / 4, s = sb + m % 4;
        const double product = (static_cast<double>(ga[m]) + biases) * static_cast<double>(gg[m]);
        if (s < t) {
          off_diagonal += product;
        } else if (s == t) {
          diagonal += product;
        }
      }
    }
  }
}

// One sample: a [T, I], g [T, O], both contiguous; ga, gg: T scratch each,
// one row of each Gram at a time (after the rows formed in blocks, if any).
template <typename T>
double sample_norm_sq(const T* a, const T* g, int64_t rows, int64_t in, int64_t out, double biases,
                      T* ga, T* gg) {
  double diagonal = 0;
  double off_diagonal = 0;  // the pairs s < t, each standing for (s, t) and (t, s)
  int64_t blocked = 0;
  if constexpr (std::is_same_v<T, float>) {
    if (const GramBlock block = gram_block_kernel()) {
      blocked = rows - rows % 4;
      blocked_norm_sq(block, a, g, blocked, in, out, biases, diagonal, off_diagonal);
    }
  }
  for (int64_t t = blocked; t < rows; ++t) {
    gram_row(a, t, in, ga);
    gram_row(g, t, out, gg);
    for (int64_t s = 0; s < t; ++s) {
      off_diagonal += (static_cast<double>(ga[s]) + biases) * static_cast<double>(gg[s]);
    }
    diagonal += (static_cast<double>(ga[t]) + biases) * static_cast<double>(gg[t]);
  }
  return diagonal + 2 * off_diagonal;
}

at::Tensor ghost_norms_sq_cpu(const at::Tensor& rows_in, const at::Tensor& grads_in,
                              int64_t biases) {
  check_ghost_norm_inputs(rows_in, grads_in, biases);
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
        norms[b] = static_cast<scalar_t>(sample_norm_sq(
            a + b * steps * in, g + b * steps * out, steps, in, out, static_cast<double>(biases),
            rows_of_grams.data(), rows_of_grams.data() + steps));
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
