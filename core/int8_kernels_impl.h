// The int8 decode kernels' bodies (docs/kv-memory.md, "Integer kernels"),
// included by int8_kernels.cc (AVX2: vpmaddwd + vpaddd) and by
// int8_kernels_vnni.cc (compiled for AVX-512 VNNI: vpdpwssd). Each includer
// defines ROPEATTN_I8_NS (the namespace its copy lives in, so the two copies,
// compiled with different -m flags, never share a symbol) and, inside that
// namespace, `__m256i Dp(__m256i acc, __m256i a, __m256i b)` (acc plus the
// sums of adjacent int16 products, in int32) and `kRegs`, the vector
// registers it has (16 or 32). Both Dp are exact here (|products| <= 16385 *
// 127), so the two copies give the same bits.
//
// The query rows and the weights are carried in fixed point with 29 bits and
// a power-of-two scale, as two int16 digits (X = 2^15 hi + lo); keys and
// values are the int8 codes. Every integer sum is exact; what is rounded is
// stated in attention_kernels.h.
#ifndef ROPEATTN_I8_NS
#error "define ROPEATTN_I8_NS before including core/int8_kernels_impl.h"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace ropeattn::internal::ROPEATTN_I8_NS {

// Channels per exact int32 digit sum: 512 * 16385 * 127 < 2^31.
constexpr int64_t kDotChunk = 512;
// Keys per weight scale: 512 * 16385 * 127 < 2^31 too; 256 keeps the
// weights on the stack small.
constexpr int64_t kRunKeys = 256;
// (row, key) pairs per score block: two accumulators each, within kRegs.
constexpr int kPairs = kRegs >= 32 ? 8 : 4;

// 2^e as a double, for |e| <= 1022.
inline double Pow2(int e) {
  const uint64_t bits = static_cast<uint64_t>(e + 1023) << 52;
  double x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// The exponent e with m * 2^e in [2^28, 2^29), for a normal double m > 0.
inline int ExpFor(double m) {
  uint64_t bits;
  std::memcpy(&bits, &m, sizeof(bits));
  return 28 - (static_cast<int>((bits >> 52) & 0x7ff) - 1023);
}

// x (|x| < 2^29 + 1) to the nearest integer X, as digits: X = 2^15 hi + lo,
// |hi| <= 16385, |lo| <= 16384.
inline void Digits(double x, int16_t* hi, int16_t* lo) {
  const double big = std::nearbyint(x);
  const double h = std::nearbyint(big * 0x1p-15);
  *hi = static_cast<int16_t>(h);
  *lo = static_cast<int16_t>(big - h * 0x1p15);
}

inline __m256i Load16(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// {sum(a0), ..., sum(a7)}
inline __m256i Transpose8SumI(const __m256i* a) {
  const __m256i s01 = _mm256_hadd_epi32(a[0], a[1]), s23 = _mm256_hadd_epi32(a[2], a[3]);
  const __m256i s45 = _mm256_hadd_epi32(a[4], a[5]), s67 = _mm256_hadd_epi32(a[6], a[7]);
  const __m256i s0123 = _mm256_hadd_epi32(s01, s23), s4567 = _mm256_hadd_epi32(s45, s67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20),
                          _mm256_permute2x128_si256(s0123, s4567, 0x31));
}

// sums[r * K + u] += <q_r, k_u> over channels [i0, i1), i1 - i0 <= kDotChunk:
// row r's digits at q + r * qs (hi) and q + r * qs + d (lo).
template <int R, int K>
inline void DotBlock(const int16_t* q, int64_t qs, int64_t d, const int8_t* k, int64_t ks,
                     int64_t i0, int64_t i1, int64_t* sums) {
  constexpr int N = R * K;
  static_assert(N == 1 || N == 2 || N == 4 || N == 8, "pairs");
  // acc[a]: hi digit sums, acc[N + a]: lo digit sums.
  __m256i acc[2 * N];
  for (int a = 0; a < 2 * N; ++a) acc[a] = _mm256_setzero_si256();
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16) {
    __m256i kv[K];
    for (int u = 0; u < K; ++u) kv[u] = Load16(k + u * ks + i);
    for (int r = 0; r < R; ++r) {
      const int16_t* qr = q + r * qs + i;
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr));
      const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + d));
      for (int u = 0; u < K; ++u) {
        acc[r * K + u] = Dp(acc[r * K + u], qh, kv[u]);
        acc[N + r * K + u] = Dp(acc[N + r * K + u], ql, kv[u]);
      }
    }
  }
  int32_t part[2 * N];
  if constexpr (N == 8) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(part), Transpose8SumI(acc));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(part + 8), Transpose8SumI(acc + 8));
  } else if constexpr (N == 4) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(part), Transpose8SumI(acc));
  } else {
    alignas(32) int32_t lanes[8];
    for (int a = 0; a < 2 * N; ++a) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[a]);
      int32_t t = 0;
      for (int32_t x : lanes) t += x;
      part[a] = t;
    }
  }
  for (; i < i1; ++i) {
    for (int r = 0; r < R; ++r) {
      for (int u = 0; u < K; ++u) {
        const int32_t kx = k[u * ks + i];
        part[r * K + u] += int32_t{q[r * qs + i]} * kx;
        part[N + r * K + u] += int32_t{q[r * qs + d + i]} * kx;
      }
    }
  }
  for (int a = 0; a < N; ++a) sums[a] += int64_t{part[a]} * 32768 + part[N + a];
}

template <int R, int K>
inline void DotKeysBlock(const int16_t* q, int64_t qs, const double* back, const int8_t* k,
                         int64_t ks, const float* scale, int64_t ss, int64_t d, float* out,
                         int64_t os) {
  int64_t sums[R * K] = {};
  for (int64_t i0 = 0; i0 < d; i0 += kDotChunk) {
    DotBlock<R, K>(q, qs, d, k, ks, i0, std::min(d, i0 + kDotChunk), sums);
  }
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < K; ++u) {
      out[r * os + u] = static_cast<float>(static_cast<double>(sums[r * K + u]) * back[r] *
                                           static_cast<double>(scale[u * ss]));
    }
  }
}

template <int R>
inline void DotKeysRows(const int16_t* q, int64_t qs, const double* back, const int8_t* k,
                        int64_t ks, const float* scale, int64_t ss, int64_t count, int64_t d,
                        float* out, int64_t os) {
  constexpr int K = kPairs / R;
  int64_t u = 0;
  for (; u + K <= count; u += K) {
    DotKeysBlock<R, K>(q, qs, back, k + u * ks, ks, scale + u * ss, ss, d, out + u, os);
  }
  for (; u < count; ++u) {
    DotKeysBlock<R, 1>(q, qs, back, k + u * ks, ks, scale + u * ss, ss, d, out + u, os);
  }
}

inline void DotKeysRowsI8(const int16_t* q, int64_t q_stride, const int* q_exp,
                          int64_t exp_stride, int64_t rows, const int8_t* k, int64_t k_stride,
                          const float* k_scale, int64_t scale_stride, int64_t count, int64_t d,
                          float* out, int64_t out_stride) {
  double back[4];
  int64_t r = 0;
  const auto fill = [&](int n) {
    for (int j = 0; j < n; ++j) back[j] = Pow2(-q_exp[(r + j) * exp_stride]);
  };
  // Several rows share each key load (the sign extension is the scarce
  // port), then fewer.
  for (; r + 4 <= rows; r += 4) {
    fill(4);
    DotKeysRows<4>(q + r * q_stride, q_stride, back, k, k_stride, k_scale, scale_stride, count, d,
                   out + r * out_stride, out_stride);
  }
  for (; r + 2 <= rows; r += 2) {
    fill(2);
    DotKeysRows<2>(q + r * q_stride, q_stride, back, k, k_stride, k_scale, scale_stride, count, d,
                   out + r * out_stride, out_stride);
  }
  for (; r < rows; ++r) {
    fill(1);
    DotKeysRows<1>(q + r * q_stride, q_stride, back, k, k_stride, k_scale, scale_stride, count, d,
                   out + r * out_stride, out_stride);
  }
}

// acc[i] += float((2^15 float(hi[i]) + float(lo[i])) * b), one rounding
// (float(hi), float(lo) each exact or rounded to 24 bits, their scaled sum
// exact in double).
inline void Emit(const int32_t* hi, const int32_t* lo, int64_t n, double b, float* acc) {
  // In f32 while b and 2^15 b are normal floats and the result cannot leave
  // the normal range (|2^15 hi + lo| < 2^47): the FMA rounds once, the same
  // as the double path.
  if (b >= 0x1p-126 && b <= 0x1p80) {
    const __m256 bh = _mm256_set1_ps(static_cast<float>(b * 0x1p15));
    const __m256 bl = _mm256_set1_ps(static_cast<float>(b));
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 h =
          _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + i)));
      const __m256 l = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + i))), bl);
      _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), _mm256_fmadd_ps(h, bh, l)));
    }
    for (; i < n; ++i) {
      acc[i] += std::fma(static_cast<float>(hi[i]), static_cast<float>(b * 0x1p15),
                         static_cast<float>(lo[i]) * static_cast<float>(b));
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const double t = static_cast<double>(static_cast<float>(hi[i])) * 0x1p15 +
                     static_cast<double>(static_cast<float>(lo[i]));
    acc[i] += static_cast<float>(t * b);
  }
}

// One run (count <= kRunKeys keys) of R rows' weighted sums. The weights of
// key pair (2j, 2j+1) are packed as one int32 (low half the even key's), per
// digit, so that Dp against the two keys' values interleaved by channel sums
// both.
template <int R>
inline void WeightedRun(const float* w, int64_t ws, const int8_t* v, int64_t vs,
                        const float* scale, int64_t ss, int64_t count, int64_t dv, float* acc,
                        int64_t as) {
  int32_t pairs[R][2][kRunKeys / 2];  // [row][hi, lo][pair]
  int16_t w16[R][2][kRunKeys];
  double back[R];
  bool live[R];
  for (int r = 0; r < R; ++r) {
    double m = 0;
    for (int64_t u = 0; u < count; ++u) {
      m = std::max(m, std::fabs(static_cast<double>(w[r * ws + u]) *
                                static_cast<double>(scale[u * ss])));
    }
    live[r] = m > 0;
    const int e = live[r] ? ExpFor(m) : 0;
    back[r] = Pow2(-e);
    const double f = Pow2(e);
    for (int64_t u = 0; u < count; ++u) {
      Digits(static_cast<double>(w[r * ws + u]) * static_cast<double>(scale[u * ss]) * f,
             &w16[r][0][u], &w16[r][1][u]);
    }
    if (count % 2 != 0) w16[r][0][count] = w16[r][1][count] = 0;
    for (int g = 0; g < 2; ++g) {
      for (int64_t j = 0; j < (count + 1) / 2; ++j) {
        pairs[r][g][j] = static_cast<int32_t>(
            static_cast<uint32_t>(static_cast<uint16_t>(w16[r][g][2 * j])) |
            (static_cast<uint32_t>(static_cast<uint16_t>(w16[r][g][2 * j + 1])) << 16));
      }
    }
  }
  const int64_t npairs = (count + 1) / 2;
  // Slabs of 16 N channels: 4 accumulators per row and 16 channels (two
  // halves, two digits), R * 4 * N of them within the registers.
  constexpr int NV = std::max(1, kRegs / 2 / (4 * R));
  int64_t x = 0;
  const auto slab = [&](auto n_const) {
    constexpr int N = decltype(n_const)::value;
    __m256i lo[R][2][N], hi[R][2][N];  // [row][digit][16 channels]
    for (int r = 0; r < R; ++r) {
      for (int g = 0; g < 2; ++g) {
        for (int j = 0; j < N; ++j) lo[r][g][j] = hi[r][g][j] = _mm256_setzero_si256();
      }
    }
    for (int64_t p = 0; p < npairs; ++p) {
      const int8_t* v0 = v + 2 * p * vs + x;
      const bool second = 2 * p + 1 < count;
      __m256i wv[R][2];
      for (int r = 0; r < R; ++r) {
        wv[r][0] = _mm256_set1_epi32(pairs[r][0][p]);
        wv[r][1] = _mm256_set1_epi32(pairs[r][1][p]);
      }
      for (int j = 0; j < N; ++j) {
        const __m256i a = Load16(v0 + 16 * j);
        const __m256i b = second ? Load16(v0 + vs + 16 * j) : _mm256_setzero_si256();
        // Channels {0-3, 8-11} and {4-7, 12-15} of the 16, each as pairs
        // (key 2p, key 2p+1).
        const __m256i il = _mm256_unpacklo_epi16(a, b), ih = _mm256_unpackhi_epi16(a, b);
        for (int r = 0; r < R; ++r) {
          for (int g = 0; g < 2; ++g) {
            lo[r][g][j] = Dp(lo[r][g][j], wv[r][g], il);
            hi[r][g][j] = Dp(hi[r][g][j], wv[r][g], ih);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      if (!live[r]) continue;
      int32_t s[2][16 * N];
      for (int g = 0; g < 2; ++g) {
        for (int j = 0; j < N; ++j) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(s[g] + 16 * j),
                              _mm256_permute2x128_si256(lo[r][g][j], hi[r][g][j], 0x20));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(s[g] + 16 * j + 8),
                              _mm256_permute2x128_si256(lo[r][g][j], hi[r][g][j], 0x31));
        }
      }
      Emit(s[0], s[1], 16 * N, back[r], acc + r * as + x);
    }
  };
  for (; x + 16 * NV <= dv; x += 16 * NV) slab(std::integral_constant<int, NV>{});
  for (; x + 16 <= dv; x += 16) slab(std::integral_constant<int, 1>{});
  if (x < dv) {
    int32_t s[2][16];
    for (int r = 0; r < R; ++r) {
      if (!live[r]) continue;
      for (int64_t i = x; i < dv; ++i) {
        int32_t th = 0, tl = 0;
        for (int64_t u = 0; u < count; ++u) {
          th += int32_t{w16[r][0][u]} * v[u * vs + i];
          tl += int32_t{w16[r][1][u]} * v[u * vs + i];
        }
        s[0][i - x] = th;
        s[1][i - x] = tl;
      }
      Emit(s[0], s[1], dv - x, back[r], acc + r * as + x);
    }
  }
}

inline void WeightedSumRowsI8(const float* w, int64_t w_stride, int64_t rows, const int8_t* v,
                              int64_t v_stride, const float* v_scale, int64_t scale_stride,
                              int64_t count, int64_t dv, float* acc, int64_t acc_stride) {
  for (int64_t u0 = 0; u0 < count; u0 += kRunKeys) {
    const int64_t n = std::min(kRunKeys, count - u0);
    const float* wu = w + u0;
    const int8_t* vu = v + u0 * v_stride;
    const float* su = v_scale + u0 * scale_stride;
    int64_t r = 0;
    if constexpr (kRegs >= 32) {
      for (; r + 4 <= rows; r += 4) {
        WeightedRun<4>(wu + r * w_stride, w_stride, vu, v_stride, su, scale_stride, n, dv,
                       acc + r * acc_stride, acc_stride);
      }
    }
    for (; r + 2 <= rows; r += 2) {
      WeightedRun<2>(wu + r * w_stride, w_stride, vu, v_stride, su, scale_stride, n, dv,
                     acc + r * acc_stride, acc_stride);
    }
    for (; r < rows; ++r) {
      WeightedRun<1>(wu + r * w_stride, w_stride, vu, v_stride, su, scale_stride, n, dv,
                     acc + r * acc_stride, acc_stride);
    }
  }
}

}  // namespace ropeattn::internal::ROPEATTN_I8_NS
