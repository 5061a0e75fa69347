// Plain fp64 reference for relative position biases (T5 buckets, ALiBi).
// Written for reading, not speed; shares no code with core/.
#ifndef ROPEATTN_TESTS_REFERENCE_RELATIVE_BIAS_REF_H_
#define ROPEATTN_TESTS_REFERENCE_RELATIVE_BIAS_REF_H_

#include <cstdint>
#include <vector>

namespace ropeattn::ref {

// T5's bucket of relative_position = key_pos - query_pos, following the
// Hugging Face T5 code step by step (positional-encodings.md section 2).
int T5Bucket(int64_t relative_position, bool bidirectional, int num_buckets, int max_distance);

// Bias row-major [heads][q_len][k_len]: table[bucket(j - (q_offset + i))][h],
// table row-major [num_buckets][heads].
std::vector<double> T5Bias(const std::vector<double>& table, int num_buckets, int heads,
                           bool bidirectional, int max_distance, int64_t q_len, int64_t k_len,
                           int64_t q_offset);

// ALiBi slopes as in the ALiBi authors' code: a geometric sequence for a
// power of two, and for other counts the first P of it plus every other
// slope of the 2P sequence.
std::vector<double> AlibiSlopes(int num_heads);

// Bias row-major [heads][q_len][k_len]: -slope[h] * (q_pos - k_pos), or
// -slope[h] * |q_pos - k_pos| when bidirectional; q_pos = q_offset + i.
std::vector<double> AlibiBias(const std::vector<double>& slopes, int64_t q_len, int64_t k_len,
                              int64_t q_offset, bool bidirectional);

}  // namespace ropeattn::ref

#endif  // ROPEATTN_TESTS_REFERENCE_RELATIVE_BIAS_REF_H_
