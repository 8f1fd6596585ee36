#include "common/cpu_gemm.h"

#include <ATen/Context.h>

#include <fstream>
#include <string>

namespace batchrules {

namespace {

bool intel_cpu() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("vendor_id", 0) == 0) {
      return line.find("GenuineIntel") != std::string::npos;
    }
  }
  return false;
}

}  // namespace

bool mkl_gemm_beats_onednn() {
  static const bool beats = at::hasMKL() && intel_cpu();  // See Note [MKL or oneDNN by CPU vendor]
  return beats;
}

}  // namespace batchrules
