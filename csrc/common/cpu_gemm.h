// Which CPU GEMM is faster on this machine: aten's (MKL's sgemm) or oneDNN's.
//
// Note [MKL or oneDNN by CPU vendor]
// aten runs a float32 CPU GEMM as MKL's sgemm, and the LSTM layer and
// convolutions as oneDNN primitives. On an AMD EPYC oneDNN's matmul is the
// faster at the clipped sums' shapes (MKL takes slower paths on other
// vendors' CPUs), and oneDNN's LSTM layer beats rnn_recurrence's MKL GEMMs.
// On an Intel Xeon MKL's sgemm is the faster, and the recurrence's batched
// GEMMs beat a loop of oneDNN layers for an ensemble of small members' forward
// (Note [oneDNN's LSTM layer under transforms]). So the choices that compare
// the two ask this: MKL where aten has it and the CPU is Intel's (Linux:
// /proc/cpuinfo; elsewhere no vendor is read and oneDNN stays preferred).
#pragma once

namespace batchrules {

bool mkl_gemm_beats_onednn();

}  // namespace batchrules
