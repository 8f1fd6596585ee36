// See Note [One packed W_hh for all steps] in packed_gemm.h.
#include "common/packed_gemm.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstddef>
#include <initializer_list>
#include <limits>

// MKL's CBLAS entry points with LP64 ints (its enums are ints), resolved from
// libtorch_cpu when torch exports them and null otherwise.
extern "C" {
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha,
                      const float* src, int ld, float* dest) __attribute__((weak));
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a,
                         int lda, const float* b, int ldb, float beta, float* c, int ldc)
    __attribute__((weak));
}

namespace batchrules {

namespace {

// MKL's CBLAS enum values.
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;
constexpr int64_t kAlignment = 64;           // each member's packed copy starts on a cache line
constexpr int64_t kMinPackedMacs = 1 << 20;  // rows x K x M; see the Note

bool fits_int(std::initializer_list<int64_t> values) {
  for (int64_t v : values) {
    if (v > std::numeric_limits<int>::max()) {
      return false;
    }
  }
  return true;
}

}  // namespace

bool mkl_packed_gemm() {
  static const bool available = at::hasMKL() && cblas_sgemm_pack_get_size != nullptr &&
                                cblas_sgemm_pack != nullptr && cblas_sgemm_compute != nullptr;
  return available;
}

PackedRhs PackedRhs::pack(const at::Tensor& b, int64_t rows, int64_t uses) {
  PackedRhs packed;
  if (uses < 2 || !mkl_packed_gemm() || b.dim() != 3 || b.scalar_type() != at::kFloat ||
      !b.device().is_cpu() || rows < 1 || b.numel() == 0) {
    return packed;
  }
  const int64_t E = b.size(0), K = b.size(1), M = b.size(2);
  // row-major B (K,M), ld its row stride, or row-major B^T (M,K), ld its column stride
  const bool transposed = b.stride(2) != 1;
  const int64_t unit = transposed ? b.stride(1) : b.stride(2);
  const int64_t ld = transposed ? b.stride(2) : b.stride(1);
  if (unit != 1 || ld < (transposed ? K : M) || !fits_int({rows, K, M, ld}) ||
      static_cast<double>(rows) * K * M < kMinPackedMacs) {  // (no int64 overflow)
    return packed;
  }
  const int64_t bytes = static_cast<int64_t>(cblas_sgemm_pack_get_size(
      kBMatrix, static_cast<int>(rows), static_cast<int>(M), static_cast<int>(K)));
  packed.member_bytes_ = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  packed.packed_ = at::empty({E * packed.member_bytes_}, b.options().dtype(at::kByte));
  packed.rows_ = rows;
  packed.k_ = K;
  packed.m_ = M;
  const float* src = b.data_ptr<float>();
  uint8_t* dest = packed.packed_.data_ptr<uint8_t>();
  for (int64_t e = 0; e < E; ++e) {
    cblas_sgemm_pack(kRowMajor, kBMatrix, transposed ? kTrans : kNoTrans, static_cast<int>(rows),
                     static_cast<int>(M), static_cast<int>(K), 1.0f, src + e * b.stride(0),
                     static_cast<int>(ld),
                     reinterpret_cast<float*>(dest + e * packed.member_bytes_));
  }
  return packed;
}

void PackedRhs::mm_out(const at::Tensor& a, const at::Tensor& out, bool accumulate) const {
  TORCH_INTERNAL_ASSERT(member_bytes_ > 0, "mm_out of an unpacked PackedRhs");
  const int64_t E = packed_.numel() / member_bytes_;
  TORCH_INTERNAL_ASSERT(a.dim() == 3 && out.dim() == 3 && a.size(0) == E && out.size(0) == E &&
                        a.size(1) == rows_ && out.size(1) == rows_ && a.size(2) == k_ &&
                        out.size(2) == m_ && a.scalar_type() == at::kFloat &&
                        out.scalar_type() == at::kFloat);
  TORCH_INTERNAL_ASSERT(out.stride(2) == 1 || m_ == 1);
  // MKL reads rows with a unit stride, each at least a row's length after the
  // last (a single row's stride is free)
  const bool rows_read = (a.stride(2) == 1 || k_ == 1) && (rows_ == 1 || a.stride(1) >= k_);
  const at::Tensor lhs = rows_read ? a : a.contiguous();
  const int64_t lda = rows_ == 1 ? k_ : lhs.stride(1), ldc = rows_ == 1 ? m_ : out.stride(1);
  TORCH_INTERNAL_ASSERT(ldc >= m_ && fits_int({lda, ldc}));
  const float* a_data = lhs.data_ptr<float>();
  float* c_data = out.data_ptr<float>();
  const uint8_t* b_data = packed_.data_ptr<uint8_t>();
  for (int64_t e = 0; e < E; ++e) {
    cblas_sgemm_compute(kRowMajor, kNoTrans, kPacked, static_cast<int>(rows_), static_cast<int>(m_),
                        static_cast<int>(k_), a_data + e * lhs.stride(0), static_cast<int>(lda),
                        reinterpret_cast<const float*>(b_data + e * member_bytes_),
                        static_cast<int>(k_), accumulate ? 1.0f : 0.0f, c_data + e * out.stride(0),
                        static_cast<int>(ldc));
  }
}

}  // namespace batchrules
