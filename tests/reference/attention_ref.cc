#include "tests/reference/attention_ref.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "tests/reference/relative_bias_ref.h"

namespace ropeattn::ref {

std::vector<double> MatMul(const std::vector<double>& a, const std::vector<double>& b, int64_t m,
                           int64_t k, int64_t n) {
  std::vector<double> c(m * n, 0.0);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t col = 0; col < n; ++col) {
      double sum = 0.0;
      for (int64_t x = 0; x < k; ++x) sum += a[r * k + x] * b[x * n + col];
      c[r * n + col] = sum;
    }
  }
  return c;
}

namespace {

// x rounded to f32, then to bf16 (round to nearest even), as a double.
double RoundToBF16(double x) {
  const float f = static_cast<float>(x);
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  float r;
  std::memcpy(&r, &u, sizeof(r));
  return r;
}

// Whether key j is visible to the query at absolute position q_pos.
// Key j (index) sits at k_pos; padding goes by index, masks by position.
bool Visible(const AttentionRefParams& p, int64_t q_pos, int64_t k_pos, int64_t j,
             int64_t key_length) {
  if (j >= key_length) return false;
  if (p.causal && k_pos > q_pos) return false;
  if (p.window > 0) {
    const int64_t distance = q_pos > k_pos ? q_pos - k_pos : k_pos - q_pos;
    if (distance >= p.window) return false;
  }
  return true;
}

double Bias(const AttentionRefParams& p, int64_t b, int64_t h, int64_t i, int64_t q_pos,
            int64_t k_pos, int64_t j) {
  switch (p.bias) {
    case RefBias::kNone:
      return 0.0;
    case RefBias::kAlibi:
      return -p.alibi_slopes[h] * std::abs(static_cast<double>(q_pos - k_pos));
    case RefBias::kT5: {
      const int bucket =
          T5Bucket(k_pos - q_pos, p.t5_bidirectional, p.t5_num_buckets, p.t5_max_distance);
      return p.t5_table[bucket * p.heads + h];
    }
    case RefBias::kTensor: {
      const int64_t bb = p.bias_per_batch ? b : 0;
      return p.bias_tensor[((bb * p.heads + h) * p.q_len + i) * p.k_len + j];
    }
  }
  return 0.0;
}

}  // namespace

AttentionRefResult Attention(const AttentionRefParams& p, const std::vector<double>& q,
                             const std::vector<double>& k, const std::vector<double>& v) {
  AttentionRefResult result;
  result.out.assign(p.batch * p.q_len * p.heads * p.v_dim, 0.0);
  result.probs.assign(p.batch * p.heads * p.q_len * p.k_len, 0.0);
  result.visible.assign(p.batch * p.heads * p.q_len * p.k_len, 0);
  const double scale = p.scale > 0 ? p.scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  const int64_t group = p.heads / p.kv_heads;
  const double kNegInf = -std::numeric_limits<double>::infinity();

  std::vector<double> logits(p.k_len);
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t q_offset = p.q_offsets.empty() ? p.k_len - p.q_len : p.q_offsets[b];
    const int64_t key_length = p.key_lengths.empty() ? p.k_len : p.key_lengths[b];
    for (int64_t h = 0; h < p.heads; ++h) {
      const int64_t kvh = h / group;
      for (int64_t i = 0; i < p.q_len; ++i) {
        const int64_t q_pos =
            p.q_positions.empty() ? q_offset + i : p.q_positions[b * p.q_len + i];
        double max_logit = kNegInf;
        for (int64_t j = 0; j < p.k_len; ++j) {
          logits[j] = kNegInf;
          const int64_t k_pos = p.k_positions.empty() ? j : p.k_positions[b * p.k_len + j];
          if (!Visible(p, q_pos, k_pos, j, key_length)) continue;
          result.visible[((b * p.heads + h) * p.q_len + i) * p.k_len + j] = 1;
          double dot = 0.0;
          for (int64_t d = 0; d < p.head_dim; ++d) {
            dot += q[((b * p.q_len + i) * p.heads + h) * p.head_dim + d] *
                   k[((b * p.k_len + j) * p.kv_heads + kvh) * p.head_dim + d];
          }
          double x = scale * dot;
          if (p.softcap > 0) x = p.softcap * std::tanh(x / p.softcap);
          x += Bias(p, b, h, i, q_pos, k_pos, j);
          logits[j] = x;
          max_logit = std::max(max_logit, x);
        }
        if (max_logit == kNegInf) continue;  // nothing visible: zeros

        double denom = 0.0;
        for (int64_t j = 0; j < p.k_len; ++j) {
          if (logits[j] != kNegInf) denom += std::exp(logits[j] - max_logit);
        }
        for (int64_t j = 0; j < p.k_len; ++j) {
          if (logits[j] == kNegInf) continue;
          const double prob = std::exp(logits[j] - max_logit) / denom;
          result.probs[((b * p.heads + h) * p.q_len + i) * p.k_len + j] = prob;
          const double weight = p.bf16_probs ? RoundToBF16(prob) : prob;
          for (int64_t e = 0; e < p.v_dim; ++e) {
            result.out[((b * p.q_len + i) * p.heads + h) * p.v_dim + e] +=
                weight * v[((b * p.k_len + j) * p.kv_heads + kvh) * p.v_dim + e];
          }
        }
      }
    }
  }
  return result;
}

}  // namespace ropeattn::ref
