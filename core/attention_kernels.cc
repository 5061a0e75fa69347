#include "core/attention_kernels.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <type_traits>

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
// |r| <= ln2/2, scale by 2^k built from the exponent bits. Branch-free so the
// loop vectorizes.
inline float ExpNonPositive(float v) {
  v = v < -87.0f ? -87.0f : v;
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
  const float scale = Bits2F(static_cast<uint32_t>(ki + 127) << 23);
  return p * scale;
}

}  // namespace

// The dot products and axpys below run once per (query row, key) in the
// decode kernel, which must keep up with memory: four independent
// accumulators hide the FMA latency that a single reduction chain exposes.
namespace {
inline __m256 LoadBF16x8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 LoadF32x8(const float* p) { return _mm256_loadu_ps(p); }
inline float HSum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
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
    } else {
      acc[i] += w * Bf(x[i]);
    }
  }
}
}  // namespace

float DotF32(const float* a, const float* b, int64_t n) { return DotImpl(a, b, n, LoadF32x8); }

float DotBF16(const float* a, const uint16_t* b, int64_t n) {
  return DotImpl(a, b, n, LoadBF16x8);
}

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

template <typename T, typename Load>
inline void DotKeysImpl(const float* q, const T* k, int64_t ks, int64_t count, int64_t d,
                        float* out, Load load) {
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
      _mm256_storeu_ps(out + u, Transpose8Sum(a0, a1, a2, a3, a4, a5, a6, a7));
    }
  }
  for (; u < count; ++u) out[u] = DotImpl(q, k + u * ks, d, load);
}

template <typename T, typename Load>
inline void WeightedSumImpl(const float* w, const T* v, int64_t vs, int64_t count, int64_t dv,
                            float* acc, Load load) {
  int64_t i = 0;
  // 64 output lanes in registers at a time, over all keys.
  for (; i + 64 <= dv; i += 64) {
    __m256 c0 = _mm256_loadu_ps(acc + i), c1 = _mm256_loadu_ps(acc + i + 8),
           c2 = _mm256_loadu_ps(acc + i + 16), c3 = _mm256_loadu_ps(acc + i + 24),
           c4 = _mm256_loadu_ps(acc + i + 32), c5 = _mm256_loadu_ps(acc + i + 40),
           c6 = _mm256_loadu_ps(acc + i + 48), c7 = _mm256_loadu_ps(acc + i + 56);
    const T* vp = v + i;
    for (int64_t u = 0; u < count; ++u, vp += vs) {
      const __m256 wv = _mm256_broadcast_ss(w + u);
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
    for (int64_t u = 0; u < count; ++u) AxpyImpl(w[u], v + u * vs + i, acc + i, dv - i, load);
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
void WeightedSumBF16(const float* w, const uint16_t* v, int64_t v_stride, int64_t count,
                     int64_t dv, float* acc) {
  WeightedSumImpl(w, v, v_stride, count, dv, acc, LoadBF16x8);
}

void PrefetchRange(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

void SoftcapInPlace(float* x, int64_t n, float cap) {
  const float inv = 1.0f / cap;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float y = x[i] * inv;
    const float a = std::fabs(y);
    // Large |y|: tanh = (1 - t) / (1 + t), t = exp(-2|y|), accurate while
    // 1 - t is not tiny. Small |y|: odd Taylor series to y^9 (error < 1e-12
    // for |y| < 0.125).
    const float t = ExpNonPositive(-2.0f * a);
    const float big = (1.0f - t) / (1.0f + t);
    const float a2 = a * a;
    const float small =
        a * (1.0f + a2 * (-1.0f / 3 + a2 * (2.0f / 15 + a2 * (-17.0f / 315 + a2 * (62.0f / 2835)))));
    const float th = a < 0.125f ? small : big;
    x[i] = cap * (y < 0 ? -th : th);
  }
}

float ExpSubMaxSum(float* x, int64_t n, float max) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) {
    const float e = ExpNonPositive(x[i] - max);
    x[i] = e;
    s += e;
  }
  return s;
}

float RowMax(const float* x, int64_t n) {
  float m = x[0];
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

void ScaleInPlace(float* x, int64_t n, float s) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

void F32ToBF16(const float* src, uint16_t* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = F2Bits(src[i]);
    u += 0x7fffu + ((u >> 16) & 1u);
    dst[i] = static_cast<uint16_t>(u >> 16);
  }
}

void BF16ToF32(const uint16_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = Bf(src[i]);
}

}  // namespace ropeattn::internal
