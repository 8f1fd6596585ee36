// Which CPU GEMM is faster on this machine: aten's (MKL's sgemm) or oneDNN's.
//
// Note [MKL or oneDNN by CPU vendor]
// aten runs a float32 CPU GEMM as MKL's sgemm, and the LSTM layer and
// convolutions as oneDNN primitives. Which of MKL's sgemm and oneDNN's matmul
// is the faster at the clipped sums' shapes depends on the CPU, measured
// (docs/design.md): MKL on an Intel Xeon and on an AMD Zen 3 (AVX2), oneDNN on
// a Zen 2 and on AMD CPUs with AVX-512 (there by 1.8-2.1x: MKL does not use
// AVX-512 on other vendors' CPUs). So mkl_gemm_beats_onednn() is true where
// aten has MKL and the CPU is Intel's or a Zen 3 (family 19h without
// AVX-512), read from /proc/cpuinfo (elsewhere no CPU is read and oneDNN
// stays preferred).
//
// The small LSTM ensembles' choice compares oneDNN's fused layer with the
// recurrence's MKL GEMMs, not two GEMMs: on Intel the recurrence wins
// (Note [oneDNN's LSTM layer under transforms]); on a Zen 3 it wins the
// forward but loses training, so there the choice stays oneDNN's: intel_cpu().
#pragma once

namespace batchrules {

bool mkl_gemm_beats_onednn();
bool intel_cpu();

}  // namespace batchrules
