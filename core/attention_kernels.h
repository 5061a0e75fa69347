// Internal row kernels for attention: plain loops written so GCC vectorizes
// them (AVX2/FMA at the x86-64-v3 baseline). Not part of the public API.
#ifndef ROPEATTN_CORE_ATTENTION_KERNELS_H_
#define ROPEATTN_CORE_ATTENTION_KERNELS_H_

#include <cstdint>

namespace ropeattn::internal {

// sum_i a[i] * b[i]; b is f32 or bf16 (uint16_t bits).
float DotF32(const float* a, const float* b, int64_t n);
float DotBF16(const float* a, const uint16_t* b, int64_t n);

// Scores of one query row against `count` keys: out[u] = <q, k + u*k_stride>
// for u < count. Processes 8 keys at a time with independent accumulators
// and one transposing reduction per 8 keys.
void DotKeysF32(const float* q, const float* k, int64_t k_stride, int64_t count, int64_t d,
                float* out);
void DotKeysBF16(const float* q, const uint16_t* k, int64_t k_stride, int64_t count, int64_t d,
                 float* out);

// acc[0..dv) += sum_u w[u] * v[u*v_stride + 0..dv), accumulating in registers
// over the keys.
void WeightedSumF32(const float* w, const float* v, int64_t v_stride, int64_t count, int64_t dv,
                    float* acc);
void WeightedSumBF16(const float* w, const uint16_t* v, int64_t v_stride, int64_t count, int64_t dv,
                     float* acc);

// Grouped-query versions: `rows` query rows (q + r*q_stride) against the same
// keys, loading each K/V slice once for all rows. out[r*out_stride + u],
// w[r*w_stride + u], acc[r*acc_stride + x].
void DotKeysRowsF32(const float* q, int64_t q_stride, int64_t rows, const float* k,
                    int64_t k_stride, int64_t count, int64_t d, float* out, int64_t out_stride);
void DotKeysRowsBF16(const float* q, int64_t q_stride, int64_t rows, const uint16_t* k,
                     int64_t k_stride, int64_t count, int64_t d, float* out, int64_t out_stride);
void WeightedSumRowsF32(const float* w, int64_t w_stride, int64_t rows, const float* v,
                        int64_t v_stride, int64_t count, int64_t dv, float* acc,
                        int64_t acc_stride);
void WeightedSumRowsBF16(const float* w, int64_t w_stride, int64_t rows, const uint16_t* v,
                         int64_t v_stride, int64_t count, int64_t dv, float* acc,
                         int64_t acc_stride);

// int8 rows (Int8KvView) with one scale per key: out[r*out_stride + u] =
// scale[u * scale_stride] * <q_r, k_u> for the scores, and acc[r] +=
// (w[r][u] * scale[u * scale_stride]) * v_u for the weighted sums.
void DotKeysRowsI8(const float* q, int64_t q_stride, int64_t rows, const int8_t* k,
                   int64_t k_stride, const float* k_scale, int64_t scale_stride, int64_t count,
                   int64_t d, float* out, int64_t out_stride);
void WeightedSumRowsI8(const float* w, int64_t w_stride, int64_t rows, const int8_t* v,
                       int64_t v_stride, const float* v_scale, int64_t scale_stride,
                       int64_t count, int64_t dv, float* acc, int64_t acc_stride);

// KvCache layout (kv_cache.h). Scores of `rows` query rows (q + r*q_stride,
// d channels) against one K tile ([d][kTile] f32, bf16 or int8 codes):
// out[r*kTile + u] = <q_r, key u of the tile>, u < kTile. A bf16 or int8
// tile gives the bits an f32 tile of the same values gives (widening is
// exact; an int8 tile's scales are the caller's).
void DotTileRows(const float* q, int64_t q_stride, int64_t rows, const float* tile, int64_t d,
                 float* out);
void DotTileRows(const float* q, int64_t q_stride, int64_t rows, const uint16_t* tile, int64_t d,
                 float* out);
void DotTileRows(const float* q, int64_t q_stride, int64_t rows, const int8_t* tile, int64_t d,
                 float* out);
// acc[r*acc_stride + x] += sum_u w[r*w_stride + u] * v[u*dv + x] for rows of
// V stored back to back (one kv head of a KvCache), keys in ascending order.
void WeightedSumDenseRows(const float* w, int64_t w_stride, int64_t rows, const float* v,
                          int64_t count, int64_t dv, float* acc, int64_t acc_stride);
void WeightedSumDenseRows(const float* w, int64_t w_stride, int64_t rows, const uint16_t* v,
                          int64_t count, int64_t dv, float* acc, int64_t acc_stride);
void WeightedSumDenseRows(const float* w, int64_t w_stride, int64_t rows, const int8_t* v,
                          int64_t count, int64_t dv, float* acc, int64_t acc_stride);
// The two kernels above use AVX-512 where the CPU has it. Tests turn it off to
// check the AVX2 versions too; returns the previous setting.
bool SetAvx512KernelsForTesting(bool enabled);
// Whether those kernels run their AVX-512 versions here and now.
bool Avx512KernelsEnabled();

// acc[i] += w * x[i]
void AxpyF32(float w, const float* x, float* acc, int64_t n);
void AxpyBF16(float w, const uint16_t* x, float* acc, int64_t n);

// x[i] = cap * tanh(x[i] / cap), about 1e-7 relative accuracy.
void SoftcapInPlace(float* x, int64_t n, float cap);

// x[i] = exp(x[i] - max) in place, returns the sum. Requires x[i] <= max
// (finite). Accuracy ~2 ulp; results below the smallest normal float
// underflow gradually, arguments below -104 give 0.
float ExpSubMaxSum(float* x, int64_t n, float max);
// sum[i] += x[i] for i < n by Kahan's compensated summation, comp[i] the
// running compensation (zero before the first add).
void KahanAddInPlace(const float* x, float* sum, float* comp, int64_t n);

// max over x[0..n), n >= 1; NaN when any x[i] is NaN (a logit of inf - inf:
// callers report overflow rather than exponentiate it).
float RowMax(const float* x, int64_t n);

// x[i] *= s
void ScaleInPlace(float* x, int64_t n, float s);

// dst[i] = bf16(src[i]), round to nearest even.
void F32ToBF16(const float* src, uint16_t* dst, int64_t n);
void BF16ToF32(const uint16_t* src, float* dst, int64_t n);
// x[i] = float(bf16(x[i])), round to nearest even (as F32ToBF16).
void RoundToBF16InPlace(float* x, int64_t n);

}  // namespace ropeattn::internal

#endif  // ROPEATTN_CORE_ATTENTION_KERNELS_H_
