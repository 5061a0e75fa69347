#include "core/attention_kernels.h"

#include <cmath>
#include <cstring>

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

float DotF32(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

float DotBF16(const float* a, const uint16_t* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * Bf(b[i]);
  return s;
}

void AxpyF32(float w, const float* x, float* acc, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += w * x[i];
}

void AxpyBF16(float w, const uint16_t* x, float* acc, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += w * Bf(x[i]);
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
