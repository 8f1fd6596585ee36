// The fused cells' shared arithmetic (Note [The fused LSTM cell]): exp, the
// sigmoid and tanh in plain float32 arithmetic that the compiler vectorizes,
// and row access. Included only by the cells' .cpp files: the pragma below
// applies to every function after it in the file that includes it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>

// The clamp in exp_approx is a select that GCC only turns into vector code
// when it need not preserve floating-point traps (which nothing here reads);
// without this, only the AVX-512 clone was vectorized.
#pragma GCC optimize("no-trapping-math")

namespace batchrules::cell_math {

// e^x, x clamped to [-87, 88] so that 2^n stays a normal float32 (e^88 is
// 1.7e38): a sigmoid or tanh there is already 0, 1 or -1 to float32's
// precision.
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : x;  // not std::min/max: declared before the pragma, not inlined
  x = x > 88.0f ? 88.0f : x;
  constexpr float kLog2e = 1.44269504f, kLn2Hi = 0.693145752f, kLn2Lo = 1.42860677e-6f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * kLog2e + kRound) - kRound;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  // 1 + r + r^2/2! + ... + r^7/7!, Horner's form
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float sigmoid_approx(float x) {
  return 1.0f / (1.0f + exp_approx(-x));
}

inline float tanh_approx(float x) {
  return 2.0f * sigmoid_approx(2.0f * x) - 1.0f;
}

// Rows (e, n) of an E,N,* float32 tensor. Its data pointer and strides are
// read once per call, not per row: data_ptr's checks cost as much as a row
// of H 128.
template <typename T>
class Rows {
 public:
  explicit Rows(const at::Tensor& t)
      : base_(t.data_ptr<float>()), stride0_(t.stride(0)), stride1_(t.stride(1)) {}
  T* operator()(int64_t e, int64_t n) const { return base_ + e * stride0_ + n * stride1_; }

 private:
  T* base_;
  int64_t stride0_, stride1_;
};

// The loops read and write whole rows: each operand's last dim is contiguous.
inline void assert_contiguous_rows(std::initializer_list<const at::Tensor*> operands) {
  for (const at::Tensor* t : operands) {
    TORCH_INTERNAL_ASSERT(t->stride(2) == 1 || t->size(2) <= 1);
  }
}

}  // namespace batchrules::cell_math
