// LinearRows: y = x W^T (+ bias) for a few rows, each output's bits
// independent of how many rows and threads compute it (see gemm.h).
//
// Every output y[r, o] is accumulated in 16 lanes: lane l sums
// x[r, k] * w[o, k] for k = l, l + 16, ... in ascending k with one fused
// multiply-add each (a partial last group of 16 adds zeros, which leave a
// lane as it is), then the 16 lanes are summed in a fixed tree and the bias
// is added. Blocking (R rows x C weight rows per register block), threads
// (a contiguous range of output columns each) and the instruction set
// (AVX-512: one 16-lane register; AVX2: two 8-lane ones) only decide which
// outputs are computed together, never the operations one output sees.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/cpu.h"
#include "core/gemm.h"
#include "core/gemm_internal.h"
#include "core/status_macros.h"

namespace ropeattn {
namespace {

std::atomic<bool> g_avx512{true};

constexpr int kCols = 4;  // weight rows (outputs) per register block
constexpr int kRows = 4;  // input rows per register block

// The fixed tree every output's 16 lanes are summed in.
inline float SumLanes(const float* l) {
  float a[8];
  for (int i = 0; i < 8; ++i) a[i] = l[i] + l[i + 8];
  const float b0 = a[0] + a[4], b1 = a[1] + a[5], b2 = a[2] + a[6], b3 = a[3] + a[7];
  return (b0 + b2) + (b1 + b3);
}

#define ROPEATTN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
ROPEATTN_AVX512 inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
ROPEATTN_AVX512 inline __m512 Load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
ROPEATTN_AVX512 inline __m512 Load16(__mmask16 m, const float* p) {
  return _mm512_maskz_loadu_ps(m, p);
}
ROPEATTN_AVX512 inline __m512 Load16(__mmask16 m, const uint16_t* p) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#pragma GCC diagnostic pop

// y[r * ys + c] = the lane sums of x row r (R rows, `in` apart) against
// weight row c (C rows, `in` apart).
template <int R, int C, typename T>
ROPEATTN_AVX512 void BlockAvx512(const float* x, const T* w, int64_t in, float* y, int64_t ys) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 16 <= in; k += 16) {
    __m512 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = Load16(w + c * in + k);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * in + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  if (k < in) {
    const __mmask16 m = static_cast<__mmask16>((1u << (in - k)) - 1u);
    __m512 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = Load16(m, w + c * in + k);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * in + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  alignas(64) float lanes[16];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      _mm512_store_ps(lanes, acc[r][c]);
      y[r * ys + c] = SumLanes(lanes);
    }
  }
}
#undef ROPEATTN_AVX512

// AVX2: lanes 0-7 and 8-15 of each output in two registers, the same
// operations per lane as BlockAvx512.
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int R, int C, typename T>
void BlockAvx2(const float* x, const T* w, int64_t in, float* y, int64_t ys) {
  __m256 lo[R][C], hi[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) lo[r][c] = hi[r][c] = _mm256_setzero_ps();
  }
  auto step = [&](const float* const* xr, const T* const* wr) {
    __m256 wl[C], wh[C];
    for (int c = 0; c < C; ++c) {
      wl[c] = Load8(wr[c]);
      wh[c] = Load8(wr[c] + 8);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xl = _mm256_loadu_ps(xr[r]), xh = _mm256_loadu_ps(xr[r] + 8);
      for (int c = 0; c < C; ++c) {
        lo[r][c] = _mm256_fmadd_ps(xl, wl[c], lo[r][c]);
        hi[r][c] = _mm256_fmadd_ps(xh, wh[c], hi[r][c]);
      }
    }
  };
  const float* xr[R];
  const T* wr[C];
  int64_t k = 0;
  for (; k + 16 <= in; k += 16) {
    for (int r = 0; r < R; ++r) xr[r] = x + r * in + k;
    for (int c = 0; c < C; ++c) wr[c] = w + c * in + k;
    step(xr, wr);
  }
  if (k < in) {
    // The last partial group from zero-padded copies.
    float xt[R][16] = {};
    T wt[C][16] = {};
    for (int r = 0; r < R; ++r) {
      std::memcpy(xt[r], x + r * in + k, (in - k) * sizeof(float));
      xr[r] = xt[r];
    }
    for (int c = 0; c < C; ++c) {
      std::memcpy(wt[c], w + c * in + k, (in - k) * sizeof(T));
      wr[c] = wt[c];
    }
    step(xr, wr);
  }
  alignas(32) float lanes[16];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      _mm256_store_ps(lanes, lo[r][c]);
      _mm256_store_ps(lanes + 8, hi[r][c]);
      y[r * ys + c] = SumLanes(lanes);
    }
  }
}

template <typename T>
using BlockFn = void (*)(const float*, const T*, int64_t, float*, int64_t);

template <typename T, int R, int C>
BlockFn<T> PickBlock(bool avx512) {
  return avx512 ? &BlockAvx512<R, C, T> : &BlockAvx2<R, C, T>;
}

template <typename T, int R>
BlockFn<T> PickBlockC(int c, bool avx512) {
  switch (c) {
    case 1:
      return PickBlock<T, R, 1>(avx512);
    case 2:
      return PickBlock<T, R, 2>(avx512);
    case 3:
      return PickBlock<T, R, 3>(avx512);
    default:
      return PickBlock<T, R, 4>(avx512);
  }
}

template <typename T>
BlockFn<T> Block(int r, int c, bool avx512) {
  switch (r) {
    case 1:
      return PickBlockC<T, 1>(c, avx512);
    case 2:
      return PickBlockC<T, 2>(c, avx512);
    case 3:
      return PickBlockC<T, 3>(c, avx512);
    default:
      return PickBlockC<T, 4>(c, avx512);
  }
}

// Columns [c0, c1) of every row: each block of kCols weight rows is read
// from memory once and from cache for the next rows.
template <typename T>
void Columns(const float* x, int64_t rows, const T* w, int64_t in, int64_t out, int64_t c0,
             int64_t c1, float* y, bool avx512) {
  for (int64_t c = c0; c < c1; c += kCols) {
    const int cn = static_cast<int>(std::min<int64_t>(kCols, c1 - c));
    for (int64_t r = 0; r < rows; r += kRows) {
      const int rn = static_cast<int>(std::min<int64_t>(kRows, rows - r));
      Block<T>(rn, cn, avx512)(x + r * in, w + c * in, in, y + r * out + c, out);
    }
  }
}

}  // namespace

namespace internal {
bool SetLinearRowsAvx512ForTesting(bool enabled) { return g_avx512.exchange(enabled); }
}  // namespace internal

absl::Status LinearRows(ConstTensorView x, ConstTensorView weight, ConstTensorView bias,
                        TensorView y, int num_threads) {
  RA_RETURN_IF_ERROR(internal::CheckLinear(x, weight, bias, y, num_threads));
  const int64_t rows = x.dim(0), in = x.dim(1), out = weight.dim(0);
  if (rows == 0 || out == 0) return absl::OkStatus();
  float* yp = y.data<float>();
  if (in == 0) {
    std::fill(yp, yp + rows * out, 0.0f);
  } else {
    // x in f32, rounded to bf16 first for bf16 weights (as Linear rounds
    // it): exact from either dtype (an f32 x against f32 weights as is).
    std::vector<float> copy;
    const float* xp = x.dtype() == DType::kF32 ? x.data<float>() : nullptr;
    const bool round = weight.dtype() == DType::kBF16;
    if (xp == nullptr || round) {
      copy.resize(static_cast<size_t>(rows * in));
      for (int64_t i = 0; i < rows * in; ++i) {
        const float v = x.dtype() == DType::kF32 ? x.data<float>()[i]
                                                 : BF16ToFloat(x.data<uint16_t>()[i]);
        copy[static_cast<size_t>(i)] = round ? BF16ToFloat(FloatToBF16(v)) : v;
      }
      xp = copy.data();
    }
    const bool avx512 = CpuHasAvx512() && g_avx512.load(std::memory_order_relaxed);
    // Contiguous column ranges of whole blocks per thread, and only as many
    // threads as there are 64-column ranges (a small layer stays on one).
    const int64_t blocks = (out + kCols - 1) / kCols;
    const int threads = static_cast<int>(std::clamp<int64_t>(
        std::min<int64_t>(num_threads, (out + 63) / 64), 1, blocks));
    auto run = [&](int t) {
      const int64_t b0 = blocks * t / threads, b1 = blocks * (t + 1) / threads;
      const int64_t c0 = b0 * kCols, c1 = std::min(out, b1 * kCols);
      if (weight.dtype() == DType::kF32) {
        Columns(xp, rows, weight.data<float>(), in, out, c0, c1, yp, avx512);
      } else {
        Columns(xp, rows, weight.data<uint16_t>(), in, out, c0, c1, yp, avx512);
      }
    };
    if (threads <= 1 || omp_in_parallel()) {
      for (int t = 0; t < threads; ++t) run(t);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
      for (int t = 0; t < threads; ++t) run(t);
    }
  }
  if (!bias.empty_view()) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < out; ++c) {
        yp[r * out + c] += bias.dtype() == DType::kF32 ? bias.data<float>()[c]
                                                       : BF16ToFloat(bias.data<uint16_t>()[c]);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace ropeattn
