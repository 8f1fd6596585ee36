#include "common/cpu_gemm.h"

#include <ATen/Context.h>

#include <fstream>
#include <sstream>
#include <string>

namespace batchrules {

namespace {

struct Cpu {
  bool intel = false;
  bool amd = false;
  int family = 0;
  bool avx512 = false;
};

// The first processor's vendor, family and flags (Linux; elsewhere unknown).
Cpu read_cpu() {
  Cpu cpu;
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    const auto colon = line.find(':');
    const std::string value = colon == std::string::npos ? "" : line.substr(colon + 1);
    if (line.rfind("vendor_id", 0) == 0) {
      cpu.intel = value.find("GenuineIntel") != std::string::npos;
      cpu.amd = value.find("AuthenticAMD") != std::string::npos;
    } else if (line.rfind("cpu family", 0) == 0) {
      std::istringstream(value) >> cpu.family;
    } else if (line.rfind("flags", 0) == 0) {
      cpu.avx512 = (value + " ").find(" avx512f ") != std::string::npos;
      break;  // the first processor's block is enough
    }
  }
  return cpu;
}

const Cpu& this_cpu() {
  static const Cpu cpu = read_cpu();
  return cpu;
}

}  // namespace

bool mkl_gemm_beats_onednn() {
  // See Note [MKL or oneDNN by CPU vendor]: Intel, or a Zen 3 (family 19h, AVX2 only).
  static const bool beats =
      at::hasMKL() && (this_cpu().intel ||
                       (this_cpu().amd && this_cpu().family == 0x19 && !this_cpu().avx512));
  return beats;
}

bool intel_cpu() {
  return this_cpu().intel;
}

}  // namespace batchrules
