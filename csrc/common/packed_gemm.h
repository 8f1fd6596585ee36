// A GEMM's right operand packed once for many calls (MKL's packed sgemm).
//
// Note [One packed W_hh for all steps]
// Every step of a recurrence multiplies its state by the same W_hh^T. MKL's
// sgemm first copies ("packs") that operand into its kernel's layout, on
// every call, a sizeable part of a step's GEMM. MKL's
// packed API packs it once (cblas_sgemm_pack) and runs each step on the
// packed copy (cblas_sgemm_compute); the values came out identical where
// measured. aten does not offer it, but torch's MKL builds export MKL's CBLAS
// symbols from libtorch_cpu; they are declared weak (packed_gemm.cpp), so a
// torch without them still loads the extension and its steps stay aten
// GEMMs. A packed product costs more to set up: below ~1M multiply-adds it is
// slower than one bmm a step (a small ensemble's members), so only products
// of at least kMinPackedMacs are packed (packed_gemm.cpp). The backward's
// steps multiply by W_hh untransposed, which MKL does not pack per call:
// packed once it is no faster, so they stay aten GEMMs.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace batchrules {

// Whether this torch exports MKL's packed sgemm.
bool mkl_packed_gemm();

class PackedRhs {
 public:
  // `b` (E,K,M) packed for products with `rows`-row left operands; not
  // defined() where MKL's packed sgemm is missing, for fewer than two uses
  // (nothing to save) or small products (see the Note), or unless `b` is
  // float32 on the CPU with a unit stride in one of its last two dims.
  static PackedRhs pack(const at::Tensor& b, int64_t rows, int64_t uses);

  bool defined() const { return packed_.defined(); }

  // out[e] = a[e] b[e], or out[e] += a[e] b[e] when `accumulate`:
  // E,N,K x E,K,M -> E,N,M; out's rows have a unit stride (a is made so).
  void mm_out(const at::Tensor& a, const at::Tensor& out, bool accumulate) const;

 private:
  at::Tensor packed_;  // E packed copies, each `member_bytes_` long
  int64_t rows_ = 0, k_ = 0, m_ = 0, member_bytes_ = 0;
};

}  // namespace batchrules
