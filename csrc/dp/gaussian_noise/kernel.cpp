// The CPU kernel of batchrules::gaussian_fill_: float32 normals of std
// `std` from Philox4x32-10 keyed by the caller, written or added in place.
//
// Note [Gaussian noise from Philox]
// DP-SGD adds a Gaussian to every parameter every step. aten's CPU normal_
// draws its uniforms one at a time from a Mersenne Twister behind the
// generator's lock, on one thread: several ns an element, a sizeable part of
// a small model's step, and it does not speed up with threads as the rest of
// the step does. Philox4x32-10 (Salmon et al., SC 2011; torch's CUDA and
// Inductor randomness) is counter-based: block b under key k is philox(k, b),
// so any thread computes any block and the result does not depend on the
// thread count. Block b's counter is (b's low and high 32 bits, 0, 0), as
// at::philox_engine(key, 0, b) counts; its four words make two pairs (w0, w1)
// and (w2, w3), each two normals by Box-Muller on aten's 24-bit float
// uniforms: r = sqrt(-2 log(1 - u(w0))), r cos(2 pi u(w1)), r sin(2 pi u(w1)).
// AVX2 computes eight blocks at once, one a lane, so the output goes in
// groups of 32: element 32 g + 8 j + l is output j (cos and sin of the first
// pair, then of the second) of block 8 g + l. The AVX2 kernel takes Sleef's
// 3.5-ulp log and sincos (faster than the 1-ulp ones; the noise's
// distribution cannot tell them apart), the scalar one at::philox_engine and
// std::log/sin/cos: the same words, and normals equal within float32
// rounding. BATCHRULES_GAUSSIAN=scalar holds a process to the scalar kernel.
// As with aten's float normal_, |z| <= sqrt(-2 log 2^-24) ~ 5.8.
#include "dp/gaussian_noise/shape_checks.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/PhiloxRNGEngine.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

// Sleef's AVX2 log and sincos, exported by libtorch_cpu (aten's vectorized
// ops call Sleef); sleef.h declares them only where the file is compiled with
// AVX, and this one dispatches at run time. The pair: Sleef___m256_2.
extern "C" {
struct SleefFloat8Pair {
  __m256 x, y;  // sin, cos
};
__m256 Sleef_logf8_u35avx2(__m256);
SleefFloat8Pair Sleef_sincosf8_u35avx2(__m256);
}

namespace batchrules {

namespace {

constexpr int64_t kNormalsPerGroup = 32;  // 8 blocks x 4 words
constexpr int kGroupsPerCall = 4;
constexpr int64_t kNormalsPerCall = kNormalsPerGroup * kGroupsPerCall;
constexpr uint32_t kPhiloxMul0 = 0xD2511F53, kPhiloxMul1 = 0xCD9E8D57;
constexpr uint32_t kPhiloxWeyl0 = 0x9E3779B9, kPhiloxWeyl1 = 0xBB67AE85;
constexpr float kTwoPi = 6.28318530717958647692f;
constexpr float kUniformScale = 1.0f / (1 << 24);

// kGroupsPerCall consecutive groups from first_group
using GroupsFn = void (*)(uint64_t key, uint64_t first_group, float scale, float* out);

float uniform24(uint32_t w) {
  return static_cast<float>(w & ((1u << 24) - 1)) * kUniformScale;
}

void group_scalar(uint64_t key, uint64_t group, float scale, float* out) {
  for (int64_t lane = 0; lane < 8; ++lane) {
    at::philox_engine engine(key, 0, group * 8 + lane);
    uint32_t w[4];
    for (auto& word : w) {
      word = engine();
    }
    for (int64_t pair = 0; pair < 2; ++pair) {
      const float r = std::sqrt(-2.0f * std::log(1.0f - uniform24(w[2 * pair])));
      const float theta = kTwoPi * uniform24(w[2 * pair + 1]);
      out[16 * pair + lane] = r * std::cos(theta) * scale;
      out[16 * pair + 8 + lane] = r * std::sin(theta) * scale;
    }
  }
}

// The high 32 bits of each lane's a * m (m the same in every lane).
__attribute__((target("avx2,fma"))) __m256i mulhi_u32(__m256i a, __m256i m) {
  const __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(a, m), 32);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  return _mm256_blend_epi32(even, odd, 0xAA);
}

__attribute__((target("avx2,fma"))) __m256 uniform24_avx2(__m256i w) {
  const __m256i low24 = _mm256_and_si256(w, _mm256_set1_epi32((1 << 24) - 1));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(low24), _mm256_set1_ps(kUniformScale));
}

// Four groups at once: each Philox round is a chain of dependent multiplies,
// so interleaving independent groups keeps the multipliers busy.
__attribute__((target("avx2,fma"))) void groups_avx2(uint64_t key, uint64_t first_group,
                                                     float scale, float* out) {
  constexpr int kAtOnce = kGroupsPerCall;
  __m256i c0[kAtOnce], c1[kAtOnce], c2[kAtOnce], c3[kAtOnce];
  for (int g = 0; g < kAtOnce; ++g) {
    alignas(32) uint32_t lo[8], hi[8];
    for (int64_t lane = 0; lane < 8; ++lane) {
      const uint64_t block = (first_group + g) * 8 + lane;
      lo[lane] = static_cast<uint32_t>(block);
      hi[lane] = static_cast<uint32_t>(block >> 32);
    }
    c0[g] = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo));
    c1[g] = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi));
    c2[g] = c3[g] = _mm256_setzero_si256();
  }
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(kPhiloxMul0));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(kPhiloxMul1));
  for (int round = 0; round < 10; ++round) {
    const __m256i key0 = _mm256_set1_epi32(static_cast<int>(k0));
    const __m256i key1 = _mm256_set1_epi32(static_cast<int>(k1));
    for (int g = 0; g < kAtOnce; ++g) {
      const __m256i hi0 = mulhi_u32(c0[g], m0), lo0 = _mm256_mullo_epi32(c0[g], m0);
      const __m256i hi1 = mulhi_u32(c2[g], m1), lo1 = _mm256_mullo_epi32(c2[g], m1);
      c0[g] = _mm256_xor_si256(_mm256_xor_si256(hi1, c1[g]), key0);
      c1[g] = lo1;
      c2[g] = _mm256_xor_si256(_mm256_xor_si256(hi0, c3[g]), key1);
      c3[g] = lo0;
    }
    k0 += kPhiloxWeyl0;
    k1 += kPhiloxWeyl1;
  }
  const __m256 one = _mm256_set1_ps(1.0f), times = _mm256_set1_ps(scale);
  for (int g = 0; g < kAtOnce; ++g) {
    const __m256i words[4] = {c0[g], c1[g], c2[g], c3[g]};
    float* dst = out + g * kNormalsPerGroup;
    for (int64_t pair = 0; pair < 2; ++pair) {
      const __m256 u1 = _mm256_sub_ps(one, uniform24_avx2(words[2 * pair]));
      const __m256 r =
          _mm256_sqrt_ps(_mm256_mul_ps(_mm256_set1_ps(-2.0f), Sleef_logf8_u35avx2(u1)));
      const SleefFloat8Pair sc = Sleef_sincosf8_u35avx2(
          _mm256_mul_ps(_mm256_set1_ps(kTwoPi), uniform24_avx2(words[2 * pair + 1])));
      const __m256 rs = _mm256_mul_ps(r, times);
      _mm256_storeu_ps(dst + 16 * pair, _mm256_mul_ps(rs, sc.y));     // cos
      _mm256_storeu_ps(dst + 16 * pair + 8, _mm256_mul_ps(rs, sc.x));  // sin
    }
  }
}

void groups_scalar(uint64_t key, uint64_t first_group, float scale, float* out) {
  for (int g = 0; g < kGroupsPerCall; ++g) {
    group_scalar(key, first_group + g, scale, out + g * kNormalsPerGroup);
  }
}

GroupsFn groups_kernel() {
  static const GroupsFn fn = [] {
    const char* forced = std::getenv("BATCHRULES_GAUSSIAN");
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return avx2 && !(forced && std::string(forced) == "scalar") ? &groups_avx2 : &groups_scalar;
  }();
  return fn;
}

void gaussian_fill_cpu(at::Tensor& self, int64_t key, double stddev, bool accumulate) {
  check_gaussian_fill_inputs(self, stddev);
  const int64_t n = self.numel();
  float* data = self.mutable_data_ptr<float>();
  const GroupsFn fn = groups_kernel();
  const uint64_t k = static_cast<uint64_t>(key);
  const float scale = static_cast<float>(stddev);
  const int64_t calls = (n + kNormalsPerCall - 1) / kNormalsPerCall;
  // about 16K normals a thread at least
  at::parallel_for(0, calls, 128, [&](int64_t begin, int64_t end) {
    float normals[kNormalsPerCall];
    for (int64_t c = begin; c < end; ++c) {
      const int64_t first = c * kNormalsPerCall, count = std::min(kNormalsPerCall, n - first);
      const uint64_t group = static_cast<uint64_t>(c) * kGroupsPerCall;
      if (!accumulate && count == kNormalsPerCall) {
        fn(k, group, scale, data + first);
        continue;
      }
      fn(k, group, scale, normals);
      float* dst = data + first;
      for (int64_t i = 0; i < count; ++i) {
        dst[i] = accumulate ? dst[i] + normals[i] : normals[i];
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(batchrules, CPU, m) {
  m.impl("gaussian_fill_", gaussian_fill_cpu);
}

}  // namespace batchrules
