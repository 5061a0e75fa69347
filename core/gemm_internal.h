// Internal: raw-pointer matmul on cached oneDNN primitives, for the kernels.
// Not part of the public API; callers validated shapes already.
#ifndef ROPEATTN_CORE_GEMM_INTERNAL_H_
#define ROPEATTN_CORE_GEMM_INTERNAL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "core/tensor.h"

namespace ropeattn::internal {

// A 2-D operand: element (r, c) is at data[r * row_stride + c * col_stride].
struct MatOperand {
  const void* data;
  DType dtype;
  int64_t row_stride;
  int64_t col_stride;
};

// c[M, N] (f32, row stride ldc, unit column stride) = a[M, K] * b[K, N].
// a and b have the same dtype. Runs on the calling thread only when called
// inside a parallel region; otherwise on up to `num_threads` threads.
// Errors (oneDNN refusing a descriptor) come back as Internal.
absl::Status Gemm(int64_t m, int64_t n, int64_t k, const MatOperand& a, const MatOperand& b,
                  float* c, int64_t ldc, int num_threads);

// Whether a bf16 Gemm here can flush subnormal inputs, products and partial
// sums to zero: oneDNN runs it on AVX512-BF16 (or AMX-BF16) instructions,
// which do. False where bf16 operands are widened to f32 or oneDNN emulates
// bf16 with f32 FMAs (avx512_core without AVX512-BF16): nothing is flushed.
bool Bf16GemmFlushes();

// Linear's and LinearRows' operand checks (InvalidArgument naming the operand).
absl::Status CheckLinear(const ConstTensorView& x, const ConstTensorView& weight,
                         const ConstTensorView& bias, const TensorView& y, int num_threads);

// Lets tests run LinearRows on its AVX2 path on an AVX-512 machine (the
// two give the same bits). Returns the previous setting.
bool SetLinearRowsAvx512ForTesting(bool enabled);

}  // namespace ropeattn::internal

#endif  // ROPEATTN_CORE_GEMM_INTERNAL_H_
