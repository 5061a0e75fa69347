#include "tests/reference/layer_ref.h"

#include <cmath>
#include <limits>

namespace ropeattn::ref {
namespace {

// y[s, o] = sum_i x[s, i] * w[o, i] + b[o]
std::vector<double> Linear(const std::vector<double>& x, int64_t seq, int64_t in,
                           const std::vector<double>& w, const std::vector<double>& b,
                           int64_t out) {
  std::vector<double> y(static_cast<size_t>(seq * out));
  for (int64_t s = 0; s < seq; ++s) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = b.empty() ? 0.0 : b[o];
      for (int64_t i = 0; i < in; ++i) acc += x[s * in + i] * w[o * in + i];
      y[s * out + o] = acc;
    }
  }
  return y;
}

void Norm(std::vector<double>& x, int64_t rows, int64_t d, RefNorm kind,
          const std::vector<double>& w, double eps) {
  if (kind == RefNorm::kNone) return;
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0.0;
    for (int64_t i = 0; i < d; ++i) ms += x[r * d + i] * x[r * d + i];
    ms /= static_cast<double>(d);
    const double inv = 1.0 / std::sqrt(ms + eps);
    for (int64_t i = 0; i < d; ++i) {
      const double g = kind == RefNorm::kRms ? w[i] : 1.0 + w[i];
      x[r * d + i] = x[r * d + i] * inv * g;
    }
  }
}

// Rotates x [seq, heads, head_dim] at positions start + s.
void Rope(std::vector<double>& x, int64_t seq, int64_t heads, const LayerRefParams& p) {
  const int64_t d = p.head_dim, r = p.rotary_dim, half = r / 2;
  for (int64_t s = 0; s < seq; ++s) {
    const double pos = static_cast<double>(p.start + s);
    for (int64_t h = 0; h < heads; ++h) {
      double* v = &x[(s * heads + h) * d];
      for (int64_t i = 0; i < half; ++i) {
        const long double a = static_cast<long double>(pos) * p.inv_freq[i];
        const double c = static_cast<double>(std::cos(a)) * p.attention_factor,
                     sn = static_cast<double>(std::sin(a)) * p.attention_factor;
        const int64_t i0 = p.interleaved ? 2 * i : i;
        const int64_t i1 = p.interleaved ? 2 * i + 1 : i + half;
        const double x0 = v[i0], x1 = v[i1];
        v[i0] = x0 * c - x1 * sn;
        v[i1] = x1 * c + x0 * sn;
      }
    }
  }
}

}  // namespace

std::vector<double> LayerRef(const LayerRefParams& p, const std::vector<double>& x, int64_t seq) {
  const int64_t hd = p.head_dim, H = p.heads, G = p.kv_heads;
  const int64_t qo = H * hd, ko = G * hd;
  std::vector<double> q, k, v;
  switch (p.qkv) {
    case RefQkv::kSeparate:
      q = Linear(x, seq, p.hidden, p.q, p.q_bias, qo);
      k = Linear(x, seq, p.hidden, p.k, p.k_bias, ko);
      v = Linear(x, seq, p.hidden, p.v, p.v_bias, ko);
      break;
    case RefQkv::kConcat: {
      const int64_t n = qo + 2 * ko;
      const std::vector<double> all = Linear(x, seq, p.hidden, p.fused, p.fused_bias, n);
      q.resize(seq * qo), k.resize(seq * ko), v.resize(seq * ko);
      for (int64_t s = 0; s < seq; ++s) {
        for (int64_t j = 0; j < qo; ++j) q[s * qo + j] = all[s * n + j];
        for (int64_t j = 0; j < ko; ++j) k[s * ko + j] = all[s * n + qo + j];
        for (int64_t j = 0; j < ko; ++j) v[s * ko + j] = all[s * n + qo + ko + j];
      }
      break;
    }
    case RefQkv::kPerHead: {
      const int64_t n = 3 * qo;
      const std::vector<double> all = Linear(x, seq, p.hidden, p.fused, p.fused_bias, n);
      q.resize(seq * qo), k.resize(seq * qo), v.resize(seq * qo);
      for (int64_t s = 0; s < seq; ++s) {
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t j = 0; j < hd; ++j) {
            const double* head = &all[s * n + h * 3 * hd];
            q[(s * H + h) * hd + j] = head[j];
            k[(s * H + h) * hd + j] = head[hd + j];
            v[(s * H + h) * hd + j] = head[2 * hd + j];
          }
        }
      }
      break;
    }
  }
  Norm(q, seq * H, hd, p.norm, p.q_norm, p.eps);
  Norm(k, seq * G, hd, p.norm, p.k_norm, p.eps);
  if (p.rope) {
    Rope(q, seq, H, p);
    Rope(k, seq, G, p);
  }
  const double scale = p.scale > 0.0 ? p.scale : 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<double> attn(static_cast<size_t>(seq * qo), 0.0);
  std::vector<double> w(static_cast<size_t>(seq));
  for (int64_t i = 0; i < seq; ++i) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / G);
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < seq; ++j) {
        const bool visible = (!p.causal || j <= i) && (p.window == 0 || i - j < p.window) &&
                             (p.causal || p.window == 0 || j - i < p.window);
        if (!visible) {
          w[j] = -std::numeric_limits<double>::infinity();
          continue;
        }
        double dot = 0.0;
        for (int64_t t = 0; t < hd; ++t) dot += q[(i * H + h) * hd + t] * k[(j * G + g) * hd + t];
        double logit = dot * scale;
        if (p.softcap > 0.0) logit = p.softcap * std::tanh(logit / p.softcap);
        w[j] = logit;
        mx = std::max(mx, logit);
      }
      double sum = 0.0;
      for (int64_t j = 0; j < seq; ++j) {
        w[j] = std::isinf(w[j]) ? 0.0 : std::exp(w[j] - mx);
        sum += w[j];
      }
      for (int64_t j = 0; j < seq; ++j) {
        const double pj = w[j] / sum;
        for (int64_t t = 0; t < hd; ++t) attn[(i * H + h) * hd + t] += pj * v[(j * G + g) * hd + t];
      }
    }
  }
  return Linear(attn, seq, qo, p.o, p.o_bias, p.hidden);
}

}  // namespace ropeattn::ref
