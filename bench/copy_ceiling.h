// The machine's copy bandwidth, measured the same way by every benchmark
// binary (ropeattn-bench's ceiling/copy_bandwidth, ropeattn-server-bench's
// fractions): `threads` threads memcpy one 512 MiB buffer into another;
// bytes read plus bytes written per second.
#ifndef ROPEATTN_BENCH_COPY_CEILING_H_
#define ROPEATTN_BENCH_COPY_CEILING_H_

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>

#include "core/tensor.h"

namespace ropeattn::bench {

constexpr int64_t kCopyBytes = int64_t{512} << 20;  // far beyond any L3

// Allocated like every kernel input (core Tensor: huge-page backed), so the
// ceiling and the kernels see the same memory system.
struct CopyBuffers {
  Tensor src_t = Tensor::Create(DType::kF32, {kCopyBytes / 4}).value();
  Tensor dst_t = Tensor::Create(DType::kF32, {kCopyBytes / 4}).value();
  char* src = src_t.data<char>();
  char* dst = dst_t.data<char>();
  CopyBuffers() {
    std::memset(src, 1, kCopyBytes);
    std::memset(dst, 2, kCopyBytes);
  }
};

inline void ParallelCopy(CopyBuffers& b, int threads) {
#pragma omp parallel num_threads(threads)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t chunk = (kCopyBytes / nt) & ~int64_t{4095};
    const int64_t begin = t * chunk;
    const int64_t end = t == nt - 1 ? kCopyBytes : begin + chunk;
    std::memcpy(b.dst + begin, b.src + begin, end - begin);
  }
}

// The best of `reps` copies after a warm-up, in bytes (read + written) per second.
inline double BestCopyBandwidth(int threads, int reps = 5) {
  CopyBuffers b;
  ParallelCopy(b, threads);
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    ParallelCopy(b, threads);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * kCopyBytes / s);
  }
  return best;
}

}  // namespace ropeattn::bench

#endif  // ROPEATTN_BENCH_COPY_CEILING_H_
