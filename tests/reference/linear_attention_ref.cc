#include "tests/reference/linear_attention_ref.h"

#include <cmath>

#include "tests/reference/rope_ref.h"

namespace ropeattn::ref {
namespace {

double Phi(double x) { return x > 0 ? x + 1.0 : std::exp(x); }

std::vector<double> PhiAll(const std::vector<double>& x) {
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = Phi(x[i]);
  return out;
}

std::vector<double> MaybeRotate(const LinearAttentionRefParams& p, int64_t heads,
                                const std::vector<double>& features) {
  if (!p.use_rope) return features;
  RotateRefParams r;
  r.batch = p.batch;
  r.seq = p.seq;
  r.heads = heads;
  r.head_dim = p.head_dim;
  r.rotary_dim = p.rotary_dim;
  r.interleaved = p.interleaved;
  r.positions = p.positions;
  r.inv_freq = p.inv_freq;
  r.attention_factor = p.attention_factor;
  return Rotate(r, features);
}

}  // namespace

std::vector<double> LinearAttention(const LinearAttentionRefParams& p, const std::vector<double>& q,
                                    const std::vector<double>& k, const std::vector<double>& v) {
  const std::vector<double> phi_q = PhiAll(q);
  const std::vector<double> phi_k = PhiAll(k);
  const std::vector<double> rot_q = MaybeRotate(p, p.heads, phi_q);
  const std::vector<double> rot_k = MaybeRotate(p, p.kv_heads, phi_k);
  const int64_t group = p.heads / p.kv_heads;
  const int64_t d = p.head_dim;

  std::vector<double> out(p.batch * p.seq * p.heads * p.v_dim, 0.0);
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.heads; ++h) {
      const int64_t kvh = h / group;
      for (int64_t t = 0; t < p.seq; ++t) {
        const int64_t q_row = ((b * p.seq + t) * p.heads + h) * d;
        std::vector<double> numerator(p.v_dim, 0.0);
        double denominator = p.eps;
        for (int64_t s = 0; s <= t; ++s) {
          const int64_t k_row = ((b * p.seq + s) * p.kv_heads + kvh) * d;
          double rotated_dot = 0.0;
          double plain_dot = 0.0;
          for (int64_t i = 0; i < d; ++i) {
            rotated_dot += rot_q[q_row + i] * rot_k[k_row + i];
            plain_dot += phi_q[q_row + i] * phi_k[k_row + i];
          }
          denominator += plain_dot;
          for (int64_t e = 0; e < p.v_dim; ++e) {
            numerator[e] += rotated_dot * v[((b * p.seq + s) * p.kv_heads + kvh) * p.v_dim + e];
          }
        }
        for (int64_t e = 0; e < p.v_dim; ++e) {
          out[((b * p.seq + t) * p.heads + h) * p.v_dim + e] = numerator[e] / denominator;
        }
      }
    }
  }
  return out;
}

}  // namespace ropeattn::ref
