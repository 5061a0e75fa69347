// The AVX-512 VNNI copy of int8_kernels_impl.h (this file is compiled with
// -mavx512f -mavx512bw -mavx512vl -mavx512vnni; int8_kernels.cc calls it only
// where the CPU has them).
#include <immintrin.h>

#include <cstdint>

namespace ropeattn::internal {
namespace i8_vnni {
constexpr int kRegs = 32;
inline __m256i Dp(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
}  // namespace i8_vnni
}  // namespace ropeattn::internal

#define ROPEATTN_I8_NS i8_vnni
#include "core/int8_kernels_impl.h"
#undef ROPEATTN_I8_NS

namespace ropeattn::internal {

void DotKeysRowsI8Vnni(const int16_t* q, int64_t q_stride, const int* q_exp, int64_t exp_stride,
                       int64_t rows, const int8_t* k, int64_t k_stride, const float* k_scale,
                       int64_t scale_stride, int64_t count, int64_t d, float* out,
                       int64_t out_stride) {
  i8_vnni::DotKeysRowsI8(q, q_stride, q_exp, exp_stride, rows, k, k_stride, k_scale, scale_stride,
                         count, d, out, out_stride);
}

void WeightedSumRowsI8Vnni(const float* w, int64_t w_stride, int64_t rows, const int8_t* v,
                           int64_t v_stride, const float* v_scale, int64_t scale_stride,
                           int64_t count, int64_t dv, float* acc, int64_t acc_stride) {
  i8_vnni::WeightedSumRowsI8(w, w_stride, rows, v, v_stride, v_scale, scale_stride, count, dv,
                             acc, acc_stride);
}

}  // namespace ropeattn::internal
