// The int8 decode kernels' entry points: the AVX2 copy of
// int8_kernels_impl.h lives here, the AVX-512 VNNI copy in
// int8_kernels_vnni.cc; the two give the same bits.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "core/attention_kernels.h"
#include "core/cpu.h"

namespace ropeattn::internal {
namespace i8_avx2 {
constexpr int kRegs = 16;
inline __m256i Dp(__m256i acc, __m256i a, __m256i b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}
}  // namespace i8_avx2
}  // namespace ropeattn::internal

#define ROPEATTN_I8_NS i8_avx2
#include "core/int8_kernels_impl.h"
#undef ROPEATTN_I8_NS

namespace ropeattn::internal {

// int8_kernels_vnni.cc
void DotKeysRowsI8Vnni(const int16_t* q, int64_t q_stride, const int* q_exp, int64_t exp_stride,
                       int64_t rows, const int8_t* k, int64_t k_stride, const float* k_scale,
                       int64_t scale_stride, int64_t count, int64_t d, float* out,
                       int64_t out_stride);
void WeightedSumRowsI8Vnni(const float* w, int64_t w_stride, int64_t rows, const int8_t* v,
                           int64_t v_stride, const float* v_scale, int64_t scale_stride,
                           int64_t count, int64_t dv, float* acc, int64_t acc_stride);

namespace {
bool UseVnni() {
  static const bool has = CpuHasAvx512Vnni();
  return has && Avx512KernelsEnabled();
}
}  // namespace

int QuantizeQueryRowI16(const float* q, int64_t d, int16_t* q16) {
  float m = 0;
  for (int64_t i = 0; i < d; ++i) m = std::max(m, std::fabs(q[i]));
  if (!(m > 0)) {
    std::fill(q16, q16 + 2 * d, int16_t{0});
    return 0;
  }
  const int e = i8_avx2::ExpFor(m);
  const double f = i8_avx2::Pow2(e);
  for (int64_t i = 0; i < d; ++i) {
    i8_avx2::Digits(static_cast<double>(q[i]) * f, q16 + i, q16 + d + i);
  }
  return e;
}

void DotKeysRowsI8(const int16_t* q, int64_t q_stride, const int* q_exp, int64_t exp_stride,
                   int64_t rows, const int8_t* k, int64_t k_stride, const float* k_scale,
                   int64_t scale_stride, int64_t count, int64_t d, float* out,
                   int64_t out_stride) {
  if (UseVnni()) {
    DotKeysRowsI8Vnni(q, q_stride, q_exp, exp_stride, rows, k, k_stride, k_scale, scale_stride,
                      count, d, out, out_stride);
    return;
  }
  i8_avx2::DotKeysRowsI8(q, q_stride, q_exp, exp_stride, rows, k, k_stride, k_scale,
                         scale_stride, count, d, out, out_stride);
}

void WeightedSumRowsI8(const float* w, int64_t w_stride, int64_t rows, const int8_t* v,
                       int64_t v_stride, const float* v_scale, int64_t scale_stride, int64_t count,
                       int64_t dv, float* acc, int64_t acc_stride) {
  if (UseVnni()) {
    WeightedSumRowsI8Vnni(w, w_stride, rows, v, v_stride, v_scale, scale_stride, count, dv, acc,
                          acc_stride);
    return;
  }
  i8_avx2::WeightedSumRowsI8(w, w_stride, rows, v, v_stride, v_scale, scale_stride, count, dv,
                             acc, acc_stride);
}

}  // namespace ropeattn::internal
