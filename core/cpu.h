// What the machine offers, for logs, benchmarks and thread defaults.
#ifndef ROPEATTN_CORE_CPU_H_
#define ROPEATTN_CORE_CPU_H_

#include <string>

namespace ropeattn {

// Logical CPUs available to this process (sched affinity), >= 1.
int AvailableCpus();
// "AMD EPYC ... | avx2 avx512f avx512_bf16 | 2 cpus"
std::string CpuDescription();
bool CpuHasAvx512();
bool CpuHasAvx512Bf16();

}  // namespace ropeattn

#endif  // ROPEATTN_CORE_CPU_H_
