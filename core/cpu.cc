#include "core/cpu.h"

#include <sched.h>

#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ropeattn {

int AvailableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  return 1;
}

bool CpuHasAvx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

bool CpuHasAvx512Bf16() {
  // GCC 12's __builtin_cpu_supports knows "avx512bf16".
  return CpuHasAvx512() && __builtin_cpu_supports("avx512bf16");
}

std::string CpuDescription() {
  std::string model = "unknown CPU";
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto pos = line.find(':');
      if (pos != std::string::npos) model = line.substr(pos + 2);
      break;
    }
  }
  std::vector<std::string> feats;
  if (__builtin_cpu_supports("avx2")) feats.push_back("avx2");
  if (__builtin_cpu_supports("fma")) feats.push_back("fma");
  if (CpuHasAvx512()) feats.push_back("avx512");
  if (CpuHasAvx512Bf16()) feats.push_back("avx512_bf16");
  return absl::StrCat(model, " | ", absl::StrJoin(feats, " "), " | ", AvailableCpus(), " cpus");
}

}  // namespace ropeattn
