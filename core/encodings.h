// Absolute positional encodings, added to token embeddings.
#ifndef ROPEATTN_CORE_ENCODINGS_H_
#define ROPEATTN_CORE_ENCODINGS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/rope.h"
#include "core/tensor.h"

namespace ropeattn {

enum class SinusoidalLayout {
  // The paper's (Vaswani et al. 2017; XLM, DistilBERT):
  //   PE[p, 2i] = sin(p * w_i), PE[p, 2i+1] = cos(p * w_i), w_i = base^(-2i/d_model).
  kInterleaved = 0,
  // Sin half then cos half (Marian, RoFormer):
  //   PE[p, i] = sin(p * w_i), PE[p, d/2 + i] = cos(p * w_i), same w_i.
  kSinCosHalf = 1,
};
const char* SinusoidalLayoutName(SinusoidalLayout layout);

// A [num_positions, d_model] f32 table for positions first_position ..
// first_position + num_positions - 1. Angles in fp64. InvalidArgument for
// d_model odd or <= 0, num_positions < 0, first_position < 0, base <= 1 or
// non-finite, an unknown layout; OutOfRange if the last position exceeds 2^40
// (as ResolvePositions). num_positions 0 gives an empty [0, d_model] table.
absl::StatusOr<Tensor> SinusoidalTable(int64_t num_positions, int64_t d_model, double base,
                                       SinusoidalLayout layout, int64_t first_position = 0);

// Learned absolute positions (BERT, GPT-2): x[b, s, :] += table[pos(b, s), :].
// x is [batch, seq, d_model] (f32 or bf16, updated in place), table is
// [max_positions, d_model] (f32 or bf16); any strides. bf16 x is summed in
// fp32 and rounded once. Positions follow the rules of `Positions` (resolved
// here without linking the RoPE target). A position >= max_positions (or an
// offset whose positions overflow int64) is OutOfRange naming the position
// and its index; never wrapped or clamped. InvalidArgument for ranks, a
// d_model mismatch, bad position spans, negative positions, and non-finite
// values in x or table. On any error x is left unchanged.
absl::Status AddLearnedPositions(TensorView x, ConstTensorView table, const Positions& positions);

}  // namespace ropeattn

#endif  // ROPEATTN_CORE_ENCODINGS_H_
