// A plain fp64 reference for causal linear attention with RoPE on the
// numerator only (positional-encodings.md section 3, RoFormer eq. 19):
//   out_t = sum_{s<=t} <R_t phi(q_t), R_s phi(k_s)> v_s
//           / (sum_{s<=t} <phi(q_t), phi(k_s)> + eps),   phi(x) = elu(x) + 1.
// Written as the quadratic double sum, to be read; shares no code with core/
// (the rotation is rope_ref's).
//
// Arrays are dense row-major doubles: q [batch, seq, heads, head_dim],
// k [batch, seq, kv_heads, head_dim], v [batch, seq, kv_heads, v_dim];
// the result is [batch, seq, heads, v_dim].
#ifndef ROPEATTN_TESTS_REFERENCE_LINEAR_ATTENTION_REF_H_
#define ROPEATTN_TESTS_REFERENCE_LINEAR_ATTENTION_REF_H_

#include <cstdint>
#include <vector>

namespace ropeattn::ref {

struct LinearAttentionRefParams {
  int64_t batch = 1;
  int64_t seq = 1;
  int64_t heads = 1;
  int64_t kv_heads = 1;
  int64_t head_dim = 2;
  int64_t v_dim = 1;
  double eps = 1e-6;

  bool use_rope = false;
  int64_t rotary_dim = 0;  // channels [rotary_dim, head_dim) are not rotated
  bool interleaved = false;
  std::vector<double> inv_freq;  // rotary_dim / 2
  double attention_factor = 1.0;
  std::vector<int64_t> positions;  // [batch * seq]
};

std::vector<double> LinearAttention(const LinearAttentionRefParams& params,
                                    const std::vector<double>& q, const std::vector<double>& k,
                                    const std::vector<double>& v);

}  // namespace ropeattn::ref

#endif  // ROPEATTN_TESTS_REFERENCE_LINEAR_ATTENTION_REF_H_
