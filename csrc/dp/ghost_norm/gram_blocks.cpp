// The ghost norm kernel's 4 x 4 blocks of float32 Gram products
// (gram_blocks.h), one function per instruction set.
//
// Note [Gram blocks]
// The row kernel (kernel.cpp) loads five vectors for four multiply-adds, and
// its sixteen-lane sums are reduced one dot product at a time. Where the CPU
// has AVX-512, or AVX2 with FMA, float32 Grams are formed in 4 x 4 blocks of
// rows instead, and each block's products are summed into the norm as they
// come, with no Gram held. The diagonal blocks compute their upper
// triangles too (6 of 16 products unused).
// - AVX-512: each pass over k loads four rows of each side for sixteen
//   multiply-adds into sixteen zmm accumulators (of 32 registers).
// - AVX2: sixteen accumulators and the eight rows do not fit AVX2's sixteen
//   ymm registers, so a block is two halves of 2 x 4 rows, eight
//   accumulators each (eight fused multiply-adds a pass of eight lanes, no
//   spills), and the eight sums of a half are reduced together (three
//   rounds of hadd). target_clones' "avx2" does not imply FMA and ISO C++
//   does not contract a * b + c into one, so the row kernel's AVX2 clone
//   multiplies and adds separately, two instructions where these blocks
//   issue one.
// The kernel is chosen once, at the first call. BATCHRULES_GRAM_BLOCKS=avx2
// leaves AVX-512's blocks out, =rows the AVX2 ones too: the tests' way to
// every kernel the CPU can run.
#include "dp/ghost_norm/gram_blocks.h"

#include <immintrin.h>

#include <cstdlib>
#include <string_view>

namespace batchrules {

namespace {

using Float16 = float __attribute__((vector_size(64)));
using Float8 = float __attribute__((vector_size(32)));
using Float4 = float __attribute__((vector_size(16)));

// The sum of v's lanes, by halves.
inline float lane_total(const Float16& v) {
  Float8 halves[2];
  __builtin_memcpy(halves, &v, sizeof(v));
  const Float8 eight = halves[0] + halves[1];
  Float4 quarters[2];
  __builtin_memcpy(quarters, &eight, sizeof(eight));
  const Float4 four = quarters[0] + quarters[1];
  return (four[0] + four[2]) + (four[1] + four[3]);
}

// out[4 i + l] = x_i . y_l for rows x_0..x_3 at x and y_0..y_3 at y (stride n).
__attribute__((target("avx512f"))) void dots4x4_avx512(const float* __restrict x,
                                                       const float* __restrict y, int64_t n,
                                                       float* out) {
  Float16 acc[16] = {};
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    Float16 xs[4], ys[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      __builtin_memcpy(&xs[i], x + i * n + k, sizeof(Float16));
      __builtin_memcpy(&ys[i], y + i * n + k, sizeof(Float16));
    }
#pragma GCC unroll 16
    for (int m = 0; m < 16; ++m) {
      acc[m] += xs[m / 4] * ys[m % 4];
    }
  }
  for (int m = 0; m < 16; ++m) {
    float sum = lane_total(acc[m]);
    for (int64_t r = k; r < n; ++r) {
      sum += x[(m / 4) * n + r] * y[(m % 4) * n + r];
    }
    out[m] = sum;
  }
}

// The sums of eight accumulators' lanes, in order.
__attribute__((target("avx2,fma"))) inline __m256 lane_totals(const __m256* acc) {
  // hadd(a, b) = a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7
  const __m256 pairs0 = _mm256_hadd_ps(acc[0], acc[1]), pairs1 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 pairs2 = _mm256_hadd_ps(acc[4], acc[5]), pairs3 = _mm256_hadd_ps(acc[6], acc[7]);
  // quads0 = acc 0..3's lanes 0..3 | their lanes 4..7; quads1 the same for acc 4..7
  const __m256 quads0 = _mm256_hadd_ps(pairs0, pairs1), quads1 = _mm256_hadd_ps(pairs2, pairs3);
  return _mm256_add_ps(_mm256_permute2f128_ps(quads0, quads1, 0x20),
                       _mm256_permute2f128_ps(quads0, quads1, 0x31));
}

// out[4 i + l] = x_i . y_l for x_0, x_1 and y_0..y_3 (stride n).
__attribute__((target("avx2,fma"))) void dots2x4_avx2(const float* __restrict x,
                                                      const float* __restrict y, int64_t n,
                                                      float* out) {
  __m256 acc[8];
  for (int m = 0; m < 8; ++m) {
    acc[m] = _mm256_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + n + k);
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) {
      const __m256 yl = _mm256_loadu_ps(y + l * n + k);
      acc[l] = _mm256_fmadd_ps(x0, yl, acc[l]);
      acc[4 + l] = _mm256_fmadd_ps(x1, yl, acc[4 + l]);
    }
  }
  _mm256_storeu_ps(out, lane_totals(acc));
  for (int m = 0; m < 8; ++m) {
    for (int64_t r = k; r < n; ++r) {
      out[m] += x[(m / 4) * n + r] * y[(m % 4) * n + r];
    }
  }
}

__attribute__((target("avx2,fma"))) void dots4x4_avx2(const float* x, const float* y, int64_t n,
                                                      float* out) {
  dots2x4_avx2(x, y, n, out);
  dots2x4_avx2(x + 2 * n, y, n, out + 8);
}

}  // namespace

GramBlock gram_block_kernel() {
  static const GramBlock kernel = [] {
    __builtin_cpu_init();
    // See Note [Gram blocks]: the tests' way to the narrower kernels.
    const char* forced = std::getenv("BATCHRULES_GRAM_BLOCKS");
    const std::string_view widest = forced != nullptr ? forced : "";
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (__builtin_cpu_supports("avx512f") && widest != "avx2" && widest != "rows") {
      return &dots4x4_avx512;
    }
    if (avx2 && widest != "rows") {
      return &dots4x4_avx2;
    }
    return static_cast<GramBlock>(nullptr);
  }();
  return kernel;
}

}  // namespace batchrules
