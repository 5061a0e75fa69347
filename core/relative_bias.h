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

// InvalidArgument unless num_buckets >= 2 (even when bidirectional) and
// max_distance > the exact range (num_buckets/2 or /4 bidirectional).
absl::Status ValidateT5BucketConfig(const T5BucketConfig& config);

// The bucket of relative_position = key_pos - query_pos (T5's rule, see
// positional-encodings.md section 2). Config must be valid.
int T5RelativeBucket(int64_t relative_position, const T5BucketConfig& config);

// Bias [heads, q_len, k_len] f32: out[h, i, j] = table[bucket(j - (q_offset + i)), h],
// table is [num_buckets, heads] (f32 or bf16), num_buckets must match the config.
absl::StatusOr<Tensor> T5Bias(ConstTensorView table, const T5BucketConfig& config, int64_t q_len,
                              int64_t k_len, int64_t q_offset);

// ALiBi slopes for any head count >= 1 (Press et al.; for a head count that is
// not a power of two, the extra heads take the odd slopes of 2P heads).
absl::StatusOr<std::vector<double>> AlibiSlopes(int64_t num_heads);

// Bias [heads, q_len, k_len] f32: -slope[h] * (q_pos - k_pos) with
// q_pos = q_offset + i, k_pos = j; bidirectional uses |q_pos - k_pos|.
absl::StatusOr<Tensor> AlibiBias(absl::Span<const double> slopes, int64_t q_len, int64_t k_len,
                                 int64_t q_offset, bool bidirectional);

}  // namespace ropeattn

#endif  // ROPEATTN_CORE_RELATIVE_BIAS_H_
