// A plain fp64 reference for softmax attention, written to be read, not to be
// fast. It shares no code with core/: every rule of core/attention.h is spelled
// out again here as loops over indices, so a test comparing the two catches a
// misreading on either side. T5 buckets come from relative_bias_ref.h.
//
// Arrays are dense row-major doubles in the core's layout:
//   q   [batch, q_len, heads, head_dim]
//   k   [batch, k_len, kv_heads, head_dim]
//   v   [batch, k_len, kv_heads, v_dim]
//   out [batch, q_len, heads, v_dim]
//   probs [batch, heads, q_len, k_len]
#ifndef ROPEATTN_TESTS_REFERENCE_ATTENTION_REF_H_
#define ROPEATTN_TESTS_REFERENCE_ATTENTION_REF_H_

#include <cstdint>
#include <vector>

namespace ropeattn::ref {

enum class RefBias { kNone, kAlibi, kT5, kTensor };

struct AttentionRefParams {
  int64_t batch = 1;
  int64_t q_len = 1;
  int64_t k_len = 1;
  int64_t heads = 1;
  int64_t kv_heads = 1;
  int64_t head_dim = 1;
  int64_t v_dim = 1;

  double scale = 0.0;  // 0: 1 / sqrt(head_dim)
  bool causal = false;
  int64_t window = 0;                // 0: no window
  double softcap = 0.0;              // 0: no cap
  std::vector<int64_t> q_offsets;    // empty: k_len - q_len for every row
  std::vector<int64_t> key_lengths;  // empty: k_len for every row
  // Explicit positions (masks and biases by position, padding by index):
  // [batch * q_len] instead of q_offsets, [batch * k_len] instead of 0..k_len-1.
  std::vector<int64_t> q_positions;
  std::vector<int64_t> k_positions;

  RefBias bias = RefBias::kNone;
  std::vector<double> alibi_slopes;  // [heads]
  // T5: table [t5_num_buckets, heads].
  std::vector<double> t5_table;
  int t5_num_buckets = 32;
  int t5_max_distance = 128;
  bool t5_bidirectional = true;
  // Tensor bias: [heads, q_len, k_len], or [batch, heads, q_len, k_len] when
  // bias_per_batch.
  std::vector<double> bias_tensor;
  bool bias_per_batch = false;

  // Round each probability to bf16 (nearest even, through f32) before the
  // weighted sum of v, as a call with bf16 k and v does (core/attention.h).
  // `probs` in the result stay unrounded.
  bool bf16_probs = false;
};

struct AttentionRefResult {
  std::vector<double> out;    // [batch, q_len, heads, v_dim]
  std::vector<double> probs;  // [batch, heads, q_len, k_len]
  // 1 where key j is visible to query i (same layout as probs): tells masked
  // keys apart from visible ones whose probability underflowed to zero.
  std::vector<char> visible;
};

// Softmax attention in fp64. Rows with no visible key give zero outputs and
// zero probabilities.
AttentionRefResult Attention(const AttentionRefParams& params, const std::vector<double>& q,
                             const std::vector<double>& k, const std::vector<double>& v);

// c[m, n] = sum_k a[m, k] * b[k, n], all dense row-major (for the MatMul test).
std::vector<double> MatMul(const std::vector<double>& a, const std::vector<double>& b, int64_t m,
                           int64_t k, int64_t n);

}  // namespace ropeattn::ref

#endif  // ROPEATTN_TESTS_REFERENCE_ATTENTION_REF_H_
