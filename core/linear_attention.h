// Causal linear attention (Katharopoulos et al. 2020) with RoPE on the
// numerator only (RoFormer eq. 19):
//   phi(x) = elu(x) + 1
//   out_t = sum_{s<=t} <R_t phi(q_t), R_s phi(k_s)> v_s
//           / (sum_{s<=t} <phi(q_t), phi(k_s)> + eps)
// Query head h reads kv head h / (heads / kv_heads). The recurrent form keeps
//   S = sum_s (R_s phi(k_s)) v_s^T   [head_dim, v_dim]   and   z = sum_s phi(k_s)
// per batch row and kv head, so decoding needs O(1) memory per step.
#ifndef ROPEATTN_CORE_LINEAR_ATTENTION_H_
#define ROPEATTN_CORE_LINEAR_ATTENTION_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/rope.h"
#include "core/tensor.h"

namespace ropeattn {

struct LinearAttentionOptions {
  // Rotation of the numerator features; null means no RoPE. Its head_dim must
  // equal q's head_dim.
  const RopeRotator* rope = nullptr;
  // Added to the denominator; must be positive and finite.
  double eps = 1e-6;
  bool check_finite = true;
  int num_threads = 1;
};

// Whole-sequence causal form: equal to the sum above, computed with running
// prefix sums in fp64 (O(seq * head_dim * v_dim) per head, not O(seq^2)).
// q [batch, seq, heads, head_dim], k [batch, seq, kv_heads, head_dim],
// v [batch, seq, kv_heads, v_dim] (f32 or bf16), out [batch, seq, heads, v_dim]
// (f32 or bf16). positions: where each token sits (for RoPE), as in rope.h;
// causality follows the seq index, not the positions.
// Errors: InvalidArgument for shape mismatches (naming the tensor and dims),
// heads % kv_heads != 0, a rope of another head_dim, bad eps / num_threads,
// bad positions, non-finite inputs (naming tensor and index) or an output that
// does not fit its dtype; OutOfRange for a position above 2^40 (with rope);
// Unimplemented for an answer whose rotated numerator cancels beyond what
// fp64 computes to f32 precision (large, nearly orthogonal features over a
// small denominator: see linear_attention.cc).
absl::Status LinearAttend(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                          const Positions& positions, const LinearAttentionOptions& options,
                          TensorView out);

// Recurrent state for decoding. Copyable (a fork is a copy).
class LinearAttentionState {
 public:
  // InvalidArgument for non-positive sizes.
  static absl::StatusOr<LinearAttentionState> Create(int64_t batch, int64_t kv_heads,
                                                     int64_t head_dim, int64_t v_dim);

  // Appends `seq` tokens (q/k/v shaped as for LinearAttend, batch and kv
  // sizes matching the state) at positions position() .. position()+seq-1 and
  // writes their outputs. On error the state is unchanged.
  absl::Status Step(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                    const LinearAttentionOptions& options, TensorView out);

  int64_t position() const { return position_; }
  int64_t batch() const { return batch_; }
  int64_t kv_heads() const { return kv_heads_; }
  int64_t head_dim() const { return head_dim_; }
  int64_t v_dim() const { return v_dim_; }
  // Bytes held by S, z and the rounding estimate's sums (a, P).
  int64_t byte_size() const;

 private:
  int64_t batch_ = 0, kv_heads_ = 0, head_dim_ = 0, v_dim_ = 0;
  int64_t position_ = 0;
  std::vector<double> s_;  // [batch, kv_heads, head_dim, v_dim]
  std::vector<double> z_;  // [batch, kv_heads, head_dim]
  std::vector<double> a_;  // [batch, kv_heads, head_dim, v_dim]: sum_s |R_s phi(k_s)| |v_s|^T (rounding)
  std::vector<double> p_;  // [batch, kv_heads, head_dim, v_dim]: sum_s phi(k_s) |v_s|^T (scale)
};

}  // namespace ropeattn

#endif  // ROPEATTN_CORE_LINEAR_ATTENTION_H_
