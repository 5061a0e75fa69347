// Relative position biases added to attention logits: T5 buckets and ALiBi.
#ifndef ROPEATTN_CORE_RELATIVE_BIAS_H_
#define ROPEATTN_CORE_RELATIVE_BIAS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/tensor.h"

namespace ropeattn {

struct T5BucketConfig {
  int num_buckets = 32;
  int max_distance = 128;
  bool bidirectional = true;  // encoder style; false = causal (decoder)
};

// InvalidArgument unless num_buckets >= 2 (even and >= 4 when bidirectional,
// so that each direction has a non-empty exact range: with 2 buckets T5's
// log(r / max_exact) divides by zero) and max_distance > the exact range
// (num_buckets/2, or num_buckets/4 bidirectional).
absl::Status ValidateT5BucketConfig(const T5BucketConfig& config);

// The bucket of relative_position = key_pos - query_pos (T5's rule, see
// positional-encodings.md section 2, computed in fp64), in [0, num_buckets).
// Any int64 is accepted: far distances saturate in the last bucket of their
// direction. Config must be valid (not checked here: it is the hot path).
int T5RelativeBucket(int64_t relative_position, const T5BucketConfig& config);

// Bias [heads, q_len, k_len] f32: out[h, i, j] = table[bucket(j - (q_offset + i)), h],
// table is [num_buckets, heads] (f32 or bf16, any strides, finite, heads >= 1),
// num_buckets must match the config. InvalidArgument for those and for
// negative q_len / k_len / q_offset; OutOfRange for positions past 2^40.
absl::StatusOr<Tensor> T5Bias(ConstTensorView table, const T5BucketConfig& config, int64_t q_len,
                              int64_t k_len, int64_t q_offset);

// ALiBi slopes for any head count in [1, 65536] (Press et al.; for a head
// count that is not a power of two, the extra heads take the odd slopes of 2P
// heads), each 2^(-8k/P) or 2^(-4k/P) computed directly. InvalidArgument
// outside that range.
absl::StatusOr<std::vector<double>> AlibiSlopes(int64_t num_heads);

// Bias [heads, q_len, k_len] f32: -slope[h] * (q_pos - k_pos) with
// q_pos = q_offset + i, k_pos = j; bidirectional uses |q_pos - k_pos|.
// Causal keys after the query get a positive bias: the caller's causal mask
// removes them. InvalidArgument for empty or non-finite slopes and negative
// lengths or offset; OutOfRange for positions past 2^40.
absl::StatusOr<Tensor> AlibiBias(absl::Span<const double> slopes, int64_t q_len, int64_t k_len,
                                 int64_t q_offset, bool bidirectional);

}  // namespace ropeattn

#endif  // ROPEATTN_CORE_RELATIVE_BIAS_H_
