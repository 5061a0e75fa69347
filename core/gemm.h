// Dense matrix multiply on oneDNN, the same primitive cache the attention
// kernels use. Exposed so the benchmark can measure the machine's GEMM
// ceiling through exactly the library path the kernels take.
#ifndef ROPEATTN_CORE_GEMM_H_
#define ROPEATTN_CORE_GEMM_H_

#include "absl/status/status.h"
#include "core/tensor.h"

namespace ropeattn {

// c[M, N] = a[M, K] * b[K, N]. a and b: both f32 or both bf16; c: f32.
// Any strides with a unit innermost stride (for a and b, either axis may be
// the unit one: a transposed view is fine). Thread-safe. num_threads >= 1.
absl::Status MatMul(ConstTensorView a, ConstTensorView b, TensorView c, int num_threads);

// A linear layer in Hugging Face's weight layout:
//   y[rows, out] = x[rows, in] * W[out, in]^T (+ bias[out])
// x: f32 or bf16, dense; W: f32 or bf16, dense [out, in] (a memory-mapped
// checkpoint tensor works as is); bias: absent (empty view) or [out] f32/bf16;
// y: dense f32 [rows, out]. When x and W differ in dtype, x is converted to W's
// dtype first (bf16 weights then see bf16 activations, as in bf16 inference).
// InvalidArgument naming the operand for any shape or dtype mismatch.
absl::Status Linear(ConstTensorView x, ConstTensorView weight, ConstTensorView bias, TensorView y,
                    int num_threads);

// Linear for a few rows (a decode step's tokens), on our own kernel: the
// same operands, checks and math (x rounded to bf16 for bf16 weights,
// products and sums in f32, then the bias), and every output row has the
// same bits however many rows are computed with it and on however many
// threads. Each y[r, o] is one 16-lane accumulation over `in` in ascending
// order, its lanes summed in a fixed tree, then the bias added; nothing is
// flushed to zero. Rows computed in one call share each weight row's read,
// so steps of several sessions projected together read the weights once
// (oneDNN's matmul gives a row different bits for different row counts).
absl::Status LinearRows(ConstTensorView x, ConstTensorView weight, ConstTensorView bias,
                        TensorView y, int num_threads);

// Number of cached oneDNN primitives, and of primitives built since start
// (for tests of the cache).
int64_t MatMulCacheSize();
int64_t MatMulPrimitivesBuilt();

}  // namespace ropeattn

#endif  // ROPEATTN_CORE_GEMM_H_
