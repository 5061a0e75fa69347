#include "core/attention_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "core/cpu.h"
#include "core/kv_cache.h"

namespace ropeattn::internal {
namespace {

inline float Bits2F(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t F2Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float Bf(uint16_t b) { return Bits2F(static_cast<uint32_t>(b) << 16); }

// exp(v) for v <= 0: Cody-Waite reduction by ln2, degree-6 polynomial on
// |r| <= ln2/2, scale by 2^k built from the exponent bits, in two steps
// (2^(k+64), then 2^-64) so that results below the smallest normal float
// underflow gradually, as exp does: a weight of e^-90 times a value near
// 3e38 is 0.3, not 0 (and it was e^-87 for every v below -87, which
// turned a key 1000 below the row's max into 5.9 of a 1.0 answer). Below
// -104, where exp rounds to 0, 0. Branch-free so the loop vectorizes.
inline float ExpNonPositive(float v) {
  const bool zero = v < -104.0f;
  v = v < -104.0f ? -104.0f : v;
  const float kLog2e = 1.44269504088896341f;
  const float kLn2Hi = 0.693145751953125f;
  const float kLn2Lo = 1.42860682030941723212e-6f;
  const float kf = std::floor(v * kLog2e + 0.5f);
  const float r = (v - kf * kLn2Hi) - kf * kLn2Lo;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t ki = static_cast<int32_t>(kf);
  const float scale = Bits2F(static_cast<uint32_t>(ki + 64 + 127) << 23);
  const float result = (p * scale) * 0x1p-64f;
  return zero ? 0.0f : result;
}

// Eight lanes of ExpNonPositive, same reduction, polynomial and scaling.
inline __m256 ExpNonPositive8(__m256 v) {
  const __m256 zero = _mm256_cmp_ps(v, _mm256_set1_ps(-104.0f), _CMP_LT_OQ);
  v = _mm256_max_ps(v, _mm256_set1_ps(-104.0f));
  const __m256 kf = _mm256_floor_ps(
      _mm256_fmadd_ps(v, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(kf, _mm256_set1_ps(0.693145751953125f), v);
  r = _mm256_fnmadd_ps(kf, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i ki = _mm256_add_epi32(_mm256_cvttps_epi32(kf), _mm256_set1_epi32(64 + 127));
  const __m256 result = _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(ki, 23))),
                                      _mm256_set1_ps(0x1p-64f));
  return _mm256_andnot_ps(zero, result);
}

}  // namespace

// The dot products and axpys below run once per (query row, key) in the
// decode kernel, which must keep up with memory: four independent
// accumulators hide the FMA latency that a single reduction chain exposes.
namespace {
// Loaders are function objects (not function pointers) so the templates
// below inline them.
struct LoadBF16 {
  __m256 operator()(const uint16_t* p) const {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};
struct LoadF32 {
  __m256 operator()(const float* p) const { return _mm256_loadu_ps(p); }
};
struct LoadI8 {
  __m256 operator()(const int8_t* p) const {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
};
constexpr LoadBF16 LoadBF16x8{};
constexpr LoadF32 LoadF32x8{};
constexpr LoadI8 LoadI8x8{};
inline float HSum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
// Per-key factors: int8 keys' scales, applied to their scores, and int8
// values' scales, folded into their weights (the same products the separate
// passes computed, so the same bits); Unit for f32 and bf16 rows.
struct Unit {
  static constexpr bool kOn = false;
  float operator()(int64_t) const { return 1.0f; }
  __m256 Vec8(int64_t) const { return _mm256_set1_ps(1.0f); }
  Unit At(int64_t) const { return {}; }
};
struct KeyScale {
  static constexpr bool kOn = true;
  const float* s;
  int64_t st;
  float operator()(int64_t u) const { return s[u * st]; }
  __m256 Vec8(int64_t u) const {
    const float* p = s + u * st;
    if (st == 1) return _mm256_loadu_ps(p);
    return _mm256_setr_ps(p[0], p[st], p[2 * st], p[3 * st], p[4 * st], p[5 * st], p[6 * st],
                          p[7 * st]);
  }
  KeyScale At(int64_t u) const { return {s + u * st, st}; }
};
template <typename T, typename Load>
inline float DotImpl(const float* a, const T* b, int64_t n, Load load) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load(b + i + 8), s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), load(b + i + 16), s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), load(b + i + 24), s3);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load(b + i), s0);
  float s = HSum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  for (; i < n; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      s += a[i] * b[i];
    } else if constexpr (std::is_same_v<T, int8_t>) {
      s += a[i] * static_cast<float>(b[i]);
    } else {
      s += a[i] * Bf(b[i]);
    }
  }
  return s;
}
template <typename T, typename Load>
inline void AxpyImpl(float w, const T* x, float* acc, int64_t n, Load load) {
  const __m256 wv = _mm256_set1_ps(w);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(wv, load(x + i), _mm256_loadu_ps(acc + i)));
    _mm256_storeu_ps(acc + i + 8,
                     _mm256_fmadd_ps(wv, load(x + i + 8), _mm256_loadu_ps(acc + i + 8)));
    _mm256_storeu_ps(acc + i + 16,
                     _mm256_fmadd_ps(wv, load(x + i + 16), _mm256_loadu_ps(acc + i + 16)));
    _mm256_storeu_ps(acc + i + 24,
                     _mm256_fmadd_ps(wv, load(x + i + 24), _mm256_loadu_ps(acc + i + 24)));
  }
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(wv, load(x + i), _mm256_loadu_ps(acc + i)));
  }
  for (; i < n; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      acc[i] += w * x[i];
    } else if constexpr (std::is_same_v<T, int8_t>) {
      acc[i] += w * static_cast<float>(x[i]);
    } else {
      acc[i] += w * Bf(x[i]);
    }
  }
}
}  // namespace

float DotF32(const float* a, const float* b, int64_t n) { return DotImpl(a, b, n, LoadF32x8); }

float DotBF16(const float* a, const uint16_t* b, int64_t n) { return DotImpl(a, b, n, LoadBF16x8); }

void AxpyF32(float w, const float* x, float* acc, int64_t n) { AxpyImpl(w, x, acc, n, LoadF32x8); }

void AxpyBF16(float w, const uint16_t* x, float* acc, int64_t n) {
  AxpyImpl(w, x, acc, n, LoadBF16x8);
}

namespace {

// Sums each of 8 vectors: returns {sum(a0), ..., sum(a7)}.
inline __m256 Transpose8Sum(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                            __m256 a6, __m256 a7) {
  const __m256 s01 = _mm256_hadd_ps(a0, a1);  // a0 pairs | a1 pairs, per 128-bit lane
  const __m256 s23 = _mm256_hadd_ps(a2, a3);
  const __m256 s45 = _mm256_hadd_ps(a4, a5);
  const __m256 s67 = _mm256_hadd_ps(a6, a7);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23);  // lane: a0 a1 a2 a3 partial sums
  const __m256 s4567 = _mm256_hadd_ps(s45, s67);
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}

template <typename T, typename Load, typename Scale = Unit>
inline void DotKeysImpl(const float* q, const T* k, int64_t ks, int64_t count, int64_t d,
                        float* out, Load load, Scale sc = {}) {
  int64_t u = 0;
  if (d % 8 == 0) {
    for (; u + 8 <= count; u += 8) {
      const T* k0 = k + u * ks;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
             a7 = a0;
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, load(k0 + i), a0);
        a1 = _mm256_fmadd_ps(qv, load(k0 + ks + i), a1);
        a2 = _mm256_fmadd_ps(qv, load(k0 + 2 * ks + i), a2);
        a3 = _mm256_fmadd_ps(qv, load(k0 + 3 * ks + i), a3);
        a4 = _mm256_fmadd_ps(qv, load(k0 + 4 * ks + i), a4);
        a5 = _mm256_fmadd_ps(qv, load(k0 + 5 * ks + i), a5);
        a6 = _mm256_fmadd_ps(qv, load(k0 + 6 * ks + i), a6);
        a7 = _mm256_fmadd_ps(qv, load(k0 + 7 * ks + i), a7);
      }
      __m256 s = Transpose8Sum(a0, a1, a2, a3, a4, a5, a6, a7);
      if constexpr (Scale::kOn) s = _mm256_mul_ps(s, sc.Vec8(u));
      _mm256_storeu_ps(out + u, s);
    }
  }
  for (; u < count; ++u) {
    out[u] = DotImpl(q, k + u * ks, d, load);
    if constexpr (Scale::kOn) out[u] *= sc(u);
  }
}

template <typename T, typename Load, typename Scale = Unit>
inline void WeightedSumImpl(const float* w, const T* v, int64_t vs, int64_t count, int64_t dv,
                            float* acc, Load load, Scale sc = {}) {
  int64_t i = 0;
  // 64 output lanes in registers at a time, over all keys.
  for (; i + 64 <= dv; i += 64) {
    __m256 c0 = _mm256_loadu_ps(acc + i), c1 = _mm256_loadu_ps(acc + i + 8),
           c2 = _mm256_loadu_ps(acc + i + 16), c3 = _mm256_loadu_ps(acc + i + 24),
           c4 = _mm256_loadu_ps(acc + i + 32), c5 = _mm256_loadu_ps(acc + i + 40),
           c6 = _mm256_loadu_ps(acc + i + 48), c7 = _mm256_loadu_ps(acc + i + 56);
    const T* vp = v + i;
    for (int64_t u = 0; u < count; ++u, vp += vs) {
      const __m256 wv =
          Scale::kOn ? _mm256_set1_ps(w[u] * sc(u)) : _mm256_broadcast_ss(w + u);
      c0 = _mm256_fmadd_ps(wv, load(vp), c0);
      c1 = _mm256_fmadd_ps(wv, load(vp + 8), c1);
      c2 = _mm256_fmadd_ps(wv, load(vp + 16), c2);
      c3 = _mm256_fmadd_ps(wv, load(vp + 24), c3);
      c4 = _mm256_fmadd_ps(wv, load(vp + 32), c4);
      c5 = _mm256_fmadd_ps(wv, load(vp + 40), c5);
      c6 = _mm256_fmadd_ps(wv, load(vp + 48), c6);
      c7 = _mm256_fmadd_ps(wv, load(vp + 56), c7);
    }
    _mm256_storeu_ps(acc + i, c0);
    _mm256_storeu_ps(acc + i + 8, c1);
    _mm256_storeu_ps(acc + i + 16, c2);
    _mm256_storeu_ps(acc + i + 24, c3);
    _mm256_storeu_ps(acc + i + 32, c4);
    _mm256_storeu_ps(acc + i + 40, c5);
    _mm256_storeu_ps(acc + i + 48, c6);
    _mm256_storeu_ps(acc + i + 56, c7);
  }
  if (i < dv) {
    for (int64_t u = 0; u < count; ++u) {
      AxpyImpl(Scale::kOn ? w[u] * sc(u) : w[u], v + u * vs + i, acc + i, dv - i, load);
    }
  }
}

}  // namespace

void DotKeysF32(const float* q, const float* k, int64_t k_stride, int64_t count, int64_t d,
                float* out) {
  DotKeysImpl(q, k, k_stride, count, d, out, LoadF32x8);
}
void DotKeysBF16(const float* q, const uint16_t* k, int64_t k_stride, int64_t count, int64_t d,
                 float* out) {
  DotKeysImpl(q, k, k_stride, count, d, out, LoadBF16x8);
}
void WeightedSumF32(const float* w, const float* v, int64_t v_stride, int64_t count, int64_t dv,
                    float* acc) {
  WeightedSumImpl(w, v, v_stride, count, dv, acc, LoadF32x8);
}
void WeightedSumBF16(const float* w, const uint16_t* v, int64_t v_stride, int64_t count, int64_t dv,
                     float* acc) {
  WeightedSumImpl(w, v, v_stride, count, dv, acc, LoadBF16x8);
}

namespace {

// R rows x K keys = 8 dot products per pass over d, each K slice loaded once.
template <int R, int K, typename T, typename Load, typename Scale>
__attribute__((always_inline)) inline void DotBlock(const float* q, int64_t qs, const T* k,
                                                    int64_t ks, int64_t d, float* out, int64_t os,
                                                    Load load, Scale sc) {
  static_assert(R * K == 8, "8 accumulators");
  __m256 acc[8];
  for (int a = 0; a < 8; ++a) acc[a] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    __m256 kv[K];
    for (int u = 0; u < K; ++u) kv[u] = load(k + u * ks + i);
    for (int r = 0; r < R; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * qs + i);
      for (int u = 0; u < K; ++u) acc[r * K + u] = _mm256_fmadd_ps(qv, kv[u], acc[r * K + u]);
    }
  }
  alignas(32) float sums[8];
  _mm256_store_ps(sums,
                  Transpose8Sum(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]));
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < K; ++u) {
      out[r * os + u] = Scale::kOn ? sums[r * K + u] * sc(u) : sums[r * K + u];
    }
  }
}

template <int R, typename T, typename Load, typename Scale>
inline void DotRowsFixed(const float* q, int64_t qs, const T* k, int64_t ks, int64_t count,
                         int64_t d, float* out, int64_t os, Load load, Scale sc) {
  constexpr int K = 8 / R;
  int64_t u = 0;
  for (; u + K <= count; u += K) {
    DotBlock<R, K>(q, qs, k + u * ks, ks, d, out + u, os, load, sc.At(u));
  }
  for (; u < count; ++u) {
    for (int r = 0; r < R; ++r) {
      out[r * os + u] = DotImpl(q + r * qs, k + u * ks, d, load);
      if constexpr (Scale::kOn) out[r * os + u] *= sc(u);
    }
  }
}

template <typename T, typename Load, typename Scale = Unit>
inline void DotKeysRowsImpl(const float* q, int64_t qs, int64_t rows, const T* k, int64_t ks,
                            int64_t count, int64_t d, float* out, int64_t os, Load load,
                            Scale sc = {}) {
  int64_t r = 0;
  if (d % 8 == 0) {
    // Two rows by four keys: 6 loads per 8 FMAs keeps the loop FMA-bound
    // (four rows by two keys needs 10 and is load-bound).
    for (; r + 2 <= rows; r += 2)
      DotRowsFixed<2>(q + r * qs, qs, k, ks, count, d, out + r * os, os, load, sc);
  }
  for (; r < rows; ++r) DotKeysImpl(q + r * qs, k, ks, count, d, out + r * os, load, sc);
}

// R rows x (64/R) output lanes in 8 registers, over all keys; each V slice
// is loaded once for the R rows.
template <int R, typename T, typename Load, typename Scale>
inline void WeightedRowsFixed(const float* w, int64_t wst, const T* v, int64_t vs, int64_t count,
                              int64_t dv, float* acc, int64_t as, Load load, Scale sc) {
  constexpr int V = 8 / R;  // vectors per row
  constexpr int64_t L = 8 * V;
  int64_t x = 0;
  for (; x + L <= dv; x += L) {
    __m256 c[8];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < V; ++j) c[r * V + j] = _mm256_loadu_ps(acc + r * as + x + 8 * j);
    }
    const T* vp = v + x;
    for (int64_t u = 0; u < count; ++u, vp += vs) {
      __m256 vv[V];
      for (int j = 0; j < V; ++j) vv[j] = load(vp + 8 * j);
      for (int r = 0; r < R; ++r) {
        const __m256 wv = Scale::kOn ? _mm256_set1_ps(w[r * wst + u] * sc(u))
                                     : _mm256_broadcast_ss(w + r * wst + u);
        for (int j = 0; j < V; ++j) c[r * V + j] = _mm256_fmadd_ps(wv, vv[j], c[r * V + j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < V; ++j) _mm256_storeu_ps(acc + r * as + x + 8 * j, c[r * V + j]);
    }
  }
  if (x < dv) {
    for (int r = 0; r < R; ++r) {
      for (int64_t u = 0; u < count; ++u) {
        AxpyImpl(Scale::kOn ? w[r * wst + u] * sc(u) : w[r * wst + u], v + u * vs + x,
                 acc + r * as + x, dv - x, load);
      }
    }
  }
}

template <typename T, typename Load, typename Scale = Unit>
inline void WeightedSumRowsImpl(const float* w, int64_t wst, int64_t rows, const T* v, int64_t vs,
                                int64_t count, int64_t dv, float* acc, int64_t as, Load load,
                                Scale sc = {}) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4)
    WeightedRowsFixed<4>(w + r * wst, wst, v, vs, count, dv, acc + r * as, as, load, sc);
  for (; r + 2 <= rows; r += 2)
    WeightedRowsFixed<2>(w + r * wst, wst, v, vs, count, dv, acc + r * as, as, load, sc);
  for (; r < rows; ++r) WeightedSumImpl(w + r * wst, v, vs, count, dv, acc + r * as, load, sc);
}

// ------------------------------------------------------ KvCache kernels --
// Both read memory strictly in address order: on the development machine
// that is what lets the hardware prefetchers keep a stream in flight while
// the FMAs run (docs/core-design.md).

constexpr int64_t kTile = KvCache::kTile;
constexpr int kTileZmm = static_cast<int>(kTile / 16), kTileYmm = static_cast<int>(kTile / 8);

// Loads of 16 (AVX-512) or 8 (AVX2) elements as f32: bf16 (uint16_t bits)
// widened, which is exact, so a bf16 tile gives the bits an f32 tile of
// the same values gives.
#define ROPEATTN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
// GCC 12 reads the intrinsics' _mm512_undefined_epi32 as uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
ROPEATTN_AVX512 inline __m512 Tile16(const float* p) { return _mm512_loadu_ps(p); }
ROPEATTN_AVX512 inline __m512 Tile16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
ROPEATTN_AVX512 inline __m512 Tile16(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
ROPEATTN_AVX512 inline __m512 Tile16(__mmask16 m, const float* p) {
  return _mm512_maskz_loadu_ps(m, p);
}
ROPEATTN_AVX512 inline __m512 Tile16(__mmask16 m, const uint16_t* p) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
ROPEATTN_AVX512 inline __m512 Tile16(__mmask16 m, const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
#pragma GCC diagnostic pop
inline __m256 Tile8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Tile8(const int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
inline __m256 Tile8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// R rows x kTile keys in R * kTile/16 zmm accumulators; one tile row (the
// tile's keys at one channel) per step, no horizontal sums.
template <int R, typename T>
ROPEATTN_AVX512 void DotTileAvx512(const float* q, int64_t qs, const T* tile, int64_t d,
                                   float* out) {
  __m512 a[R][kTileZmm];
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < kTileZmm; ++u) a[r][u] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < d; ++i) {
    const T* row = tile + i * kTile;
    __m512 k[kTileZmm];
    for (int u = 0; u < kTileZmm; ++u) k[u] = Tile16(row + 16 * u);
    for (int r = 0; r < R; ++r) {
      const __m512 qb = _mm512_set1_ps(q[r * qs + i]);
      for (int u = 0; u < kTileZmm; ++u) a[r][u] = _mm512_fmadd_ps(qb, k[u], a[r][u]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < kTileZmm; ++u) _mm512_storeu_ps(out + r * kTile + 16 * u, a[r][u]);
  }
}

// One row x kTile keys in kTile/8 ymm accumulators.
template <typename T>
void DotTileAvx2(const float* q, const T* tile, int64_t d, float* out) {
  __m256 a[kTileYmm];
  for (int u = 0; u < kTileYmm; ++u) a[u] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    const T* row = tile + i * kTile;
    const __m256 qb = _mm256_set1_ps(q[i]);
    for (int u = 0; u < kTileYmm; ++u) a[u] = _mm256_fmadd_ps(qb, Tile8(row + 8 * u), a[u]);
  }
  for (int u = 0; u < kTileYmm; ++u) _mm256_storeu_ps(out + 8 * u, a[u]);
}

// R rows (1 or 2) x NV*16 lanes in registers, over all keys, added to acc
// at the end (the keys' sum starts from zero, so a caller cutting a long run
// into tiles sums each tile apart and adds the tile sums: the error does not
// grow with the run). With kMasked the last vector holds only the lanes in
// `last`.
template <int R, int NV, bool kMasked, typename T>
ROPEATTN_AVX512 void WeightedDenseSlab(const float* w, int64_t ws, const T* v, int64_t count,
                                       int64_t dv, float* acc, int64_t as, __mmask16 last) {
  __m512 c0[NV], c1[NV];
#pragma GCC unroll 8
  for (int x = 0; x < NV; ++x) {
    c0[x] = _mm512_setzero_ps();
    if constexpr (R == 2) c1[x] = _mm512_setzero_ps();
  }
  for (int64_t u = 0; u < count; ++u) {
    const T* vr = v + u * dv;
    const __m512 w0 = _mm512_set1_ps(w[u]);
    const __m512 w1 = _mm512_set1_ps(R == 2 ? w[ws + u] : 0.0f);
#pragma GCC unroll 8
    for (int x = 0; x < NV; ++x) {
      const __m512 vv =
          (kMasked && x == NV - 1) ? Tile16(last, vr + 16 * x) : Tile16(vr + 16 * x);
      c0[x] = _mm512_fmadd_ps(w0, vv, c0[x]);
      if constexpr (R == 2) c1[x] = _mm512_fmadd_ps(w1, vv, c1[x]);
    }
  }
#pragma GCC unroll 8
  for (int x = 0; x < NV; ++x) {
    if (kMasked && x == NV - 1) {
      _mm512_mask_storeu_ps(acc + 16 * x, last,
                            _mm512_add_ps(_mm512_maskz_loadu_ps(last, acc + 16 * x), c0[x]));
      if constexpr (R == 2) {
        _mm512_mask_storeu_ps(
            acc + as + 16 * x, last,
            _mm512_add_ps(_mm512_maskz_loadu_ps(last, acc + as + 16 * x), c1[x]));
      }
    } else {
      _mm512_storeu_ps(acc + 16 * x, _mm512_add_ps(_mm512_loadu_ps(acc + 16 * x), c0[x]));
      if constexpr (R == 2) {
        _mm512_storeu_ps(acc + as + 16 * x,
                         _mm512_add_ps(_mm512_loadu_ps(acc + as + 16 * x), c1[x]));
      }
    }
  }
}

// Calls WeightedDenseSlab with NV = nv (1..8) known at compile time.
template <int R, bool kMasked, typename T, int N = 1>
ROPEATTN_AVX512 void WeightedDenseSlabN(int nv, const float* w, int64_t ws, const T* v,
                                        int64_t count, int64_t dv, float* acc, int64_t as,
                                        __mmask16 last) {
  if constexpr (N < 8) {
    if (nv != N) {
      WeightedDenseSlabN<R, kMasked, T, N + 1>(nv, w, ws, v, count, dv, acc, as, last);
      return;
    }
  }
  WeightedDenseSlab<R, N, kMasked, T>(w, ws, v, count, dv, acc, as, last);
}

template <int R, typename T>
ROPEATTN_AVX512 void WeightedDenseAvx512(const float* w, int64_t ws, const T* v, int64_t count,
                                         int64_t dv, float* acc, int64_t as) {
  for (int64_t x0 = 0; x0 < dv; x0 += 128) {
    const int64_t lanes = std::min<int64_t>(128, dv - x0);
    const int nv = static_cast<int>((lanes + 15) / 16);
    const int tail = static_cast<int>(lanes - (nv - 1) * 16);
    const __mmask16 last = static_cast<__mmask16>((1u << tail) - 1u);
    const T* vx = v + x0;
    float* ax = acc + x0;
    if (tail == 16) {
      WeightedDenseSlabN<R, false, T>(nv, w, ws, vx, count, dv, ax, as, last);
    } else {
      WeightedDenseSlabN<R, true, T>(nv, w, ws, vx, count, dv, ax, as, last);
    }
  }
}
// Sixteen lanes of ExpNonPositive8: the same operations lane by lane, so
// the same bits per weight.
ROPEATTN_AVX512 inline __m512 ExpNonPositive16(__m512 v) {
  const __mmask16 zero = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-104.0f), _CMP_LT_OQ);
  v = _mm512_max_ps(v, _mm512_set1_ps(-104.0f));
  const __m512 kf = _mm512_roundscale_ps(
      _mm512_fmadd_ps(v, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(kf, _mm512_set1_ps(0.693145751953125f), v);
  r = _mm512_fnmadd_ps(kf, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i ki = _mm512_add_epi32(_mm512_cvttps_epi32(kf), _mm512_set1_epi32(64 + 127));
  const __m512 result = _mm512_mul_ps(
      _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(ki, 23))), _mm512_set1_ps(0x1p-64f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~zero), result);
}

// ExpSubMaxSum on 32 lanes a step; blocks of 1024 weights summed apart.
ROPEATTN_AVX512 float ExpSubMaxSumAvx512(float* x, int64_t n, float max) {
  constexpr int64_t kBlock = 1024;
  const __m512 m = _mm512_set1_ps(max);
  double total = 0.0;
  int64_t i = 0;
  while (i + 32 <= n) {
    const int64_t end = std::min(n, i + kBlock) / 32 * 32;
    __m512 s0 = _mm512_setzero_ps(), s1 = s0;
    for (; i < end; i += 32) {
      const __m512 e0 = ExpNonPositive16(_mm512_sub_ps(_mm512_loadu_ps(x + i), m));
      const __m512 e1 = ExpNonPositive16(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16), m));
      _mm512_storeu_ps(x + i, e0);
      _mm512_storeu_ps(x + i + 16, e1);
      s0 = _mm512_add_ps(s0, e0);
      s1 = _mm512_add_ps(s1, e1);
    }
    total += static_cast<double>(_mm512_reduce_add_ps(_mm512_add_ps(s0, s1)));
  }
  float s = 0.0f;
  for (; i < n; ++i) {
    x[i] = ExpNonPositive(x[i] - max);
    s += x[i];
  }
  return static_cast<float>(total + s);
}

#undef ROPEATTN_AVX512

std::atomic<bool> g_avx512_kernels{true};

bool UseAvx512() {
  static const bool has = CpuHasAvx512();
  return has && g_avx512_kernels.load(std::memory_order_relaxed);
}

}  // namespace

bool SetAvx512KernelsForTesting(bool enabled) { return g_avx512_kernels.exchange(enabled); }

bool Avx512KernelsEnabled() { return UseAvx512(); }

namespace {

template <typename T>
void DotTileRowsImpl(const float* q, int64_t q_stride, int64_t rows, const T* tile, int64_t d,
                     float* out) {
  if (UseAvx512()) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
      DotTileAvx512<4>(q + r * q_stride, q_stride, tile, d, out + r * kTile);
    switch (rows - r) {
      case 3:
        DotTileAvx512<3>(q + r * q_stride, q_stride, tile, d, out + r * kTile);
        break;
      case 2:
        DotTileAvx512<2>(q + r * q_stride, q_stride, tile, d, out + r * kTile);
        break;
      case 1:
        DotTileAvx512<1>(q + r * q_stride, q_stride, tile, d, out + r * kTile);
        break;
      default:
        break;
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) DotTileAvx2(q + r * q_stride, tile, d, out + r * kTile);
}

template <typename T>
void WeightedSumDenseRowsImpl(const float* w, int64_t w_stride, int64_t rows, const T* v,
                              int64_t count, int64_t dv, float* acc, int64_t acc_stride) {
  if (UseAvx512()) {
    // Two rows at a time keep one V row's 128 lanes in registers for both;
    // the next pair rereads the keys from L2.
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) {
      WeightedDenseAvx512<2>(w + r * w_stride, w_stride, v, count, dv, acc + r * acc_stride,
                             acc_stride);
    }
    if (r < rows)
      WeightedDenseAvx512<1>(w + r * w_stride, w_stride, v, count, dv, acc + r * acc_stride,
                             acc_stride);
    return;
  }
  if constexpr (std::is_same_v<T, int8_t>) {
    // A scale of 1 per key: w * 1 is w, so these are the plain sums.
    static constexpr float kOne = 1.0f;
    WeightedSumRowsI8(w, w_stride, rows, v, dv, &kOne, 0, count, dv, acc, acc_stride);
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      if constexpr (std::is_same_v<T, float>) {
        WeightedSumF32(w + r * w_stride, v, dv, count, dv, acc + r * acc_stride);
      } else {
        WeightedSumBF16(w + r * w_stride, v, dv, count, dv, acc + r * acc_stride);
      }
    }
  }
}

}  // namespace

void DotTileRows(const float* q, int64_t q_stride, int64_t rows, const float* tile, int64_t d,
                 float* out) {
  DotTileRowsImpl(q, q_stride, rows, tile, d, out);
}
void DotTileRows(const float* q, int64_t q_stride, int64_t rows, const uint16_t* tile, int64_t d,
                 float* out) {
  DotTileRowsImpl(q, q_stride, rows, tile, d, out);
}
void DotTileRows(const float* q, int64_t q_stride, int64_t rows, const int8_t* tile, int64_t d,
                 float* out) {
  DotTileRowsImpl(q, q_stride, rows, tile, d, out);
}
void WeightedSumDenseRows(const float* w, int64_t w_stride, int64_t rows, const float* v,
                          int64_t count, int64_t dv, float* acc, int64_t acc_stride) {
  WeightedSumDenseRowsImpl(w, w_stride, rows, v, count, dv, acc, acc_stride);
}
void WeightedSumDenseRows(const float* w, int64_t w_stride, int64_t rows, const int8_t* v,
                          int64_t count, int64_t dv, float* acc, int64_t acc_stride) {
  WeightedSumDenseRowsImpl(w, w_stride, rows, v, count, dv, acc, acc_stride);
}
void WeightedSumDenseRows(const float* w, int64_t w_stride, int64_t rows, const uint16_t* v,
                          int64_t count, int64_t dv, float* acc, int64_t acc_stride) {
  WeightedSumDenseRowsImpl(w, w_stride, rows, v, count, dv, acc, acc_stride);
}

namespace {}  // namespace

void DotKeysRowsF32(const float* q, int64_t q_stride, int64_t rows, const float* k,
                    int64_t k_stride, int64_t count, int64_t d, float* out, int64_t out_stride) {
  DotKeysRowsImpl(q, q_stride, rows, k, k_stride, count, d, out, out_stride, LoadF32x8);
}
void DotKeysRowsBF16(const float* q, int64_t q_stride, int64_t rows, const uint16_t* k,
                     int64_t k_stride, int64_t count, int64_t d, float* out, int64_t out_stride) {
  DotKeysRowsImpl(q, q_stride, rows, k, k_stride, count, d, out, out_stride, LoadBF16x8);
}
void WeightedSumRowsF32(const float* w, int64_t w_stride, int64_t rows, const float* v,
                        int64_t v_stride, int64_t count, int64_t dv, float* acc,
                        int64_t acc_stride) {
  WeightedSumRowsImpl(w, w_stride, rows, v, v_stride, count, dv, acc, acc_stride, LoadF32x8);
}
void DotKeysRowsI8(const float* q, int64_t q_stride, int64_t rows, const int8_t* k,
                   int64_t k_stride, const float* k_scale, int64_t scale_stride, int64_t count,
                   int64_t d, float* out, int64_t out_stride) {
  // Each key's scale multiplies its scores as they leave the registers.
  DotKeysRowsImpl(q, q_stride, rows, k, k_stride, count, d, out, out_stride, LoadI8x8,
                  KeyScale{k_scale, scale_stride});
}
void WeightedSumRowsI8(const float* w, int64_t w_stride, int64_t rows, const int8_t* v,
                       int64_t v_stride, const float* v_scale, int64_t scale_stride, int64_t count,
                       int64_t dv, float* acc, int64_t acc_stride) {
  // Each key's scale folds into its weight as the weight is broadcast.
  WeightedSumRowsImpl(w, w_stride, rows, v, v_stride, count, dv, acc, acc_stride, LoadI8x8,
                      KeyScale{v_scale, scale_stride});
}
void WeightedSumRowsBF16(const float* w, int64_t w_stride, int64_t rows, const uint16_t* v,
                         int64_t v_stride, int64_t count, int64_t dv, float* acc,
                         int64_t acc_stride) {
  WeightedSumRowsImpl(w, w_stride, rows, v, v_stride, count, dv, acc, acc_stride, LoadBF16x8);
}

namespace {
inline __m256 Tanh8(__m256 y) {
  const __m256 sign = _mm256_and_ps(y, _mm256_set1_ps(-0.0f));
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), y);
  // Large |y|: (1 - t) / (1 + t), t = exp(-2|y|). Small |y| (< 0.125): odd
  // Taylor series to y^9, where 1 - t would lose precision.
  const __m256 t = ExpNonPositive8(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 big = _mm256_div_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t));
  const __m256 a2 = _mm256_mul_ps(a, a);
  __m256 p = _mm256_set1_ps(62.0f / 2835);
  p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(-17.0f / 315));
  p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(2.0f / 15));
  p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(-1.0f / 3));
  p = _mm256_fmadd_ps(p, a2, one);
  const __m256 small = _mm256_mul_ps(a, p);
  const __m256 th =
      _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.125f), _CMP_LT_OQ));
  return _mm256_or_ps(th, sign);
}
}  // namespace

void SoftcapInPlace(float* x, int64_t n, float cap) {
  const __m256 capv = _mm256_set1_ps(cap), inv = _mm256_set1_ps(1.0f / cap);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(x + i, _mm256_mul_ps(capv, Tanh8(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv))));
  }
  if (i < n) {
    alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t j = i; j < n; ++j) tmp[j - i] = x[j];
    _mm256_store_ps(tmp, _mm256_mul_ps(capv, Tanh8(_mm256_mul_ps(_mm256_load_ps(tmp), inv))));
    for (int64_t j = i; j < n; ++j) x[j] = tmp[j - i];
  }
}

float ExpSubMaxSum(float* x, int64_t n, float max) {
  if (UseAvx512()) return ExpSubMaxSumAvx512(x, n, max);
  // Sixteen lanes sum blocks of 1024 weights; the block sums add up in
  // fp64, so the sum's error does not grow with the row's length.
  constexpr int64_t kBlock = 1024;
  const __m256 m = _mm256_set1_ps(max);
  double total = 0.0;
  int64_t i = 0;
  while (i + 16 <= n) {
    const int64_t end = std::min(n, i + kBlock) / 16 * 16;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    for (; i < end; i += 16) {
      const __m256 e0 = ExpNonPositive8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
      const __m256 e1 = ExpNonPositive8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), m));
      _mm256_storeu_ps(x + i, e0);
      _mm256_storeu_ps(x + i + 8, e1);
      s0 = _mm256_add_ps(s0, e0);
      s1 = _mm256_add_ps(s1, e1);
    }
    total += HSum(_mm256_add_ps(s0, s1));
  }
  float s = 0.0f;
  for (; i < n; ++i) {
    x[i] = ExpNonPositive(x[i] - max);
    s += x[i];
  }
  return static_cast<float>(total + s);
}

void KahanAddInPlace(const float* x, float* sum, float* comp, int64_t n) {
  // Kahan's compensated summation, lane by lane: sum + comp carries the
  // running total to about one rounding, however many chunks are added.
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 y = _mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(comp + i));
    const __m256 s = _mm256_loadu_ps(sum + i);
    const __m256 t = _mm256_add_ps(s, y);
    _mm256_storeu_ps(comp + i, _mm256_sub_ps(_mm256_sub_ps(t, s), y));
    _mm256_storeu_ps(sum + i, t);
  }
  for (; i < n; ++i) {
    const float y = x[i] - comp[i];
    const float t = sum[i] + y;
    comp[i] = (t - sum[i]) - y;
    sum[i] = t;
  }
}

float RowMax(const float* x, int64_t n) {
  int64_t i = 0;
  float m = x[0];
  bool nan = false;
  if (n >= 8) {
    __m256 mv = _mm256_loadu_ps(x);
    __m256 unordered = _mm256_cmp_ps(mv, mv, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      mv = _mm256_max_ps(mv, v);
    }
    nan = _mm256_movemask_ps(unordered) != 0;
    __m128 lo = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
    m = _mm_cvtss_f32(lo);
  }
  for (; i < n; ++i) {
    nan |= std::isnan(x[i]);
    m = x[i] > m ? x[i] : m;
  }
  return nan || std::isnan(m) ? std::numeric_limits<float>::quiet_NaN() : m;
}

void ScaleInPlace(float* x, int64_t n, float s) {
  const __m256 sv = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), sv));
  for (; i < n; ++i) x[i] *= s;
}

void F32ToBF16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
  for (; i + 16 <= n; i += 16) {
    __m256i a = _mm256_castps_si256(_mm256_loadu_ps(src + i));
    __m256i b = _mm256_castps_si256(_mm256_loadu_ps(src + i + 8));
    a = _mm256_srli_epi32(
        _mm256_add_epi32(a,
                         _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(a, 16), one))),
        16);
    b = _mm256_srli_epi32(
        _mm256_add_epi32(b,
                         _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(b, 16), one))),
        16);
    // packus works per 128-bit lane: fix the order afterwards.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
  }
  for (; i < n; ++i) {
    uint32_t u = F2Bits(src[i]);
    u += 0x7fffu + ((u >> 16) & 1u);
    dst[i] = static_cast<uint16_t>(u >> 16);
  }
}

void RoundToBF16InPlace(float* x, int64_t n) {
  int64_t i = 0;
  const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (; i + 8 <= n; i += 8) {
    const __m256i a = _mm256_castps_si256(_mm256_loadu_ps(x + i));
    const __m256i r = _mm256_add_epi32(
        a, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(a, 16), one)));
    _mm256_storeu_ps(x + i, _mm256_castsi256_ps(_mm256_and_si256(r, high)));
  }
  for (; i < n; ++i) {
    uint32_t u = F2Bits(x[i]);
    u += 0x7fffu + ((u >> 16) & 1u);
    x[i] = Bits2F(u & 0xffff0000u);
  }
}

void BF16ToF32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, LoadBF16x8(src + i));
  for (; i < n; ++i) dst[i] = Bf(src[i]);
}

}  // namespace ropeattn::internal
