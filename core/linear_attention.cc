// Causal linear attention. Both entry points run the same recurrence:
//   S += (R_s phi(k_s)) v_s^T,  z += phi(k_s),
//   out_t = (R_t phi(q_t))^T S / (phi(q_t)^T z + eps)
// LinearAttend starts from an empty state, Step from the session's. The
// recurrence is exactly the causal sum of the header (just reassociated), and
// costs O(seq * head_dim * v_dim) per head instead of O(seq^2 * head_dim).
// State and accumulation are fp64: S is a sum over the whole session, and the
// numerator (rotated features) can cancel, so fp32 sums would drift with length.
#include "core/linear_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"

namespace ropeattn {
namespace {

struct Shapes {
  int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0, v_dim = 0;
};

absl::Status ShapeError(absl::string_view name, const ConstTensorView& t,
                        absl::string_view expected) {
  return absl::InvalidArgumentError(
      absl::StrFormat("%s has shape %s, expected %s", name, DimsToString(t.dims()), expected));
}

absl::StatusOr<Shapes> ValidateInputs(const ConstTensorView& q, const ConstTensorView& k,
                                      const ConstTensorView& v, const ConstTensorView& out,
                                      const LinearAttentionOptions& options) {
  RA_RETURN_IF_ERROR(CheckBSHD(q, "q"));
  RA_RETURN_IF_ERROR(CheckBSHD(k, "k"));
  RA_RETURN_IF_ERROR(CheckBSHD(v, "v"));
  RA_RETURN_IF_ERROR(CheckBSHD(out, "out"));
  Shapes s;
  s.batch = q.dim(0);
  s.seq = q.dim(1);
  s.heads = q.dim(2);
  s.head_dim = q.dim(3);
  s.kv_heads = k.dim(2);
  s.v_dim = v.dim(3);
  const std::string bs = absl::StrFormat("[%d, %d", s.batch, s.seq);
  if (k.dim(0) != s.batch || k.dim(1) != s.seq || k.dim(3) != s.head_dim) {
    return ShapeError("k", k, absl::StrFormat("%s, kv_heads, %d] (from q)", bs, s.head_dim));
  }
  if (v.dim(0) != s.batch || v.dim(1) != s.seq || v.dim(2) != s.kv_heads) {
    return ShapeError("v", v, absl::StrFormat("%s, %d, v_dim] (from q and k)", bs, s.kv_heads));
  }
  if (out.dim(0) != s.batch || out.dim(1) != s.seq || out.dim(2) != s.heads ||
      out.dim(3) != s.v_dim) {
    return ShapeError("out", out, absl::StrFormat("%s, %d, %d]", bs, s.heads, s.v_dim));
  }
  if (s.kv_heads == 0 ? s.heads != 0 : s.heads % s.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "heads (%d, from q) must be a multiple of kv_heads (%d, from k)", s.heads, s.kv_heads));
  }
  if (!std::isfinite(options.eps) || options.eps <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("eps must be positive and finite, got ", options.eps));
  }
  if (options.num_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_threads must be >= 1, got ", options.num_threads));
  }
  if (options.rope != nullptr && options.rope->config().head_dim != s.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rope was planned for head_dim %d, but q has head_dim %d",
                        options.rope->config().head_dim, s.head_dim));
  }
  if (options.check_finite) {
    RA_RETURN_IF_ERROR(CheckFinite(q, "q"));
    RA_RETURN_IF_ERROR(CheckFinite(k, "k"));
    RA_RETURN_IF_ERROR(CheckFinite(v, "v"));
  }
  return s;
}

// Row (b, s, h) of a BSHD view, widened to double.
void LoadRow(const ConstTensorView& t, int64_t b, int64_t s, int64_t h, double* dst) {
  const int64_t n = t.dim(3);
  const int64_t off = b * t.stride(0) + s * t.stride(1) + h * n;
  if (t.dtype() == DType::kF32) {
    const float* p = t.data<float>() + off;
    for (int64_t i = 0; i < n; ++i) dst[i] = p[i];
  } else {
    const uint16_t* p = t.data<uint16_t>() + off;
    for (int64_t i = 0; i < n; ++i) dst[i] = BF16ToFloat(p[i]);
  }
}

// Writes one output row; false if a value does not fit the output dtype.
bool StoreRow(const TensorView& t, int64_t b, int64_t s, int64_t h, const double* src) {
  const int64_t n = t.dim(3);
  const int64_t off = b * t.stride(0) + s * t.stride(1) + h * n;
  bool finite = true;
  if (t.dtype() == DType::kF32) {
    float* p = t.data<float>() + off;
    for (int64_t i = 0; i < n; ++i) {
      p[i] = static_cast<float>(src[i]);
      finite &= std::isfinite(p[i]);
    }
  } else {
    uint16_t* p = t.data<uint16_t>() + off;
    for (int64_t i = 0; i < n; ++i) {
      p[i] = FloatToBF16(static_cast<float>(src[i]));
      finite &= std::isfinite(BF16ToFloat(p[i]));
    }
  }
  return finite;
}

// elu(x) + 1, which is positive for every finite x (so the denominator is too).
void Phi(double* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] > 0 ? x[i] + 1.0 : std::exp(x[i]);
}

// Rotates features in place with one position's cos/sin row (attention
// factor already folded in by the rotator); channels past rotary_dim stay.
void Rotate(double* x, const double* cos_row, const double* sin_row, int64_t rotary_dim,
            bool interleaved) {
  const int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = interleaved ? 2 * i : i;
    const int64_t b = interleaved ? 2 * i + 1 : i + half;
    const double c = cos_row[i];
    const double s = sin_row[i];
    const double xa = x[a];
    const double xb = x[b];
    x[a] = xa * c - xb * s;
    x[b] = xa * s + xb * c;
  }
}

// cos/sin rows for every token (row-major [batch * seq, rotary_dim / 2]),
// in double: the f32 rows' rounding (~3e-8) is magnified by a cancelling
// numerator past the answer's error estimate, which counts fp64 rounding
// only (an answer 3e9 came back 5e-4 off, its pair 500 tokens in).
struct RopeRows {
  std::vector<double> cos, sin;
  int64_t half = 0;
};

absl::StatusOr<RopeRows> MakeRopeRows(const RopeRotator& rope,
                                      absl::Span<const int64_t> positions) {
  RopeRows rows;
  rows.half = rope.rotary_dim() / 2;
  rows.cos.resize(positions.size() * rows.half);
  rows.sin.resize(positions.size() * rows.half);
  RA_RETURN_IF_ERROR(rope.CosSin(positions, absl::MakeSpan(rows.cos), absl::MakeSpan(rows.sin)));
  return rows;
}

// Runs the recurrence over all tokens of q/k/v, updating s_state
// [batch, kv_heads, head_dim, v_dim] and z_state [batch, kv_heads, head_dim]
// and writing out. Returns InvalidArgument if an output is not finite.
//
// The rotated numerator can cancel: S holds cross terms of size
// |R phi(k)| |v| that vanish only in the dot product with R phi(q), so fp64
// rounding of order u |R phi(q)| sum_s |R phi(k_s)| |v_s| is divided by the
// denominator. a_state [batch, kv_heads, head_dim, v_dim] keeps
// sum_s |R_s phi(k_s)| |v_s|^T (element-wise magnitudes) for that estimate,
// u sum_i |R phi(q)|_i a_i (a dot product of d terms and the usual sqrt(n)
// growth of a sum of n): where nothing cancels (no RoPE, or position 0) it
// equals u times the unrotated numerator, so it refuses nothing there. It is weighed against the
// answer's scale: the larger of its largest output and of the unrotated
// weighted mean of |v|, sum_s <phi(q), phi(k_s)> |v_s| / den, which
// p_state [batch, kv_heads, head_dim, v_dim] (sum_s phi(k_s) |v_s|^T) gives
// (so values that cancel to an exact 0 are not refused). An answer whose
// estimate is not 2^-24 below that scale is refused (UNIMPLEMENTED) rather
// than answered inexactly: keys near -30 and features of 1e4 that cancel
// gave answers 35-82% off. `before`: tokens already summed into the state.
absl::Status RunRecurrence(const Shapes& sh, const ConstTensorView& q, const ConstTensorView& k,
                           const ConstTensorView& v, const LinearAttentionOptions& options,
                           const RopeRows* rope_rows, TensorView out, double* s_state,
                           double* z_state, double* a_state, double* p_state, int64_t before) {
  const int64_t d = sh.head_dim;
  const int64_t dv = sh.v_dim;
  const int64_t group = sh.kv_heads == 0 ? 1 : sh.heads / sh.kv_heads;
  const int64_t tasks = sh.batch * sh.kv_heads;
  const bool interleaved =
      options.rope != nullptr && options.rope->config().layout == RopeLayout::kInterleaved;
  const int64_t rotary_dim = options.rope != nullptr ? options.rope->rotary_dim() : 0;
  const int threads =
      static_cast<int>(std::min<int64_t>(options.num_threads, std::max<int64_t>(tasks, 1)));
  // First failing (b, t, h), reported after the parallel loop; tasks write disjoint slots.
  std::vector<int64_t> bad_token(tasks, -1), bad_head(tasks, -1);
  // First (t, h, bound / size) whose rounding bound is too large, per task.
  std::vector<int64_t> inexact_token(tasks, -1), inexact_head(tasks, -1);
  std::vector<double> inexact_ratio(tasks, 0.0);

#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t b = task / sh.kv_heads;
    const int64_t kvh = task % sh.kv_heads;
    double* S = s_state + task * d * dv;
    double* z = z_state + task * d;
    double* A = a_state + task * d * dv;
    double* P = p_state + task * d * dv;
    std::vector<double> phik(d), rk(d), vrow(dv), vabs(dv), phiq(d), rq(d), num(dv), mean(dv),
        err(dv);
    for (int64_t t = 0; t < sh.seq; ++t) {
      const double* cos_row = nullptr;
      const double* sin_row = nullptr;
      if (rope_rows != nullptr) {
        cos_row = rope_rows->cos.data() + (b * sh.seq + t) * rope_rows->half;
        sin_row = rope_rows->sin.data() + (b * sh.seq + t) * rope_rows->half;
      }
      LoadRow(k, b, t, kvh, phik.data());
      Phi(phik.data(), d);
      rk = phik;
      if (rope_rows != nullptr) Rotate(rk.data(), cos_row, sin_row, rotary_dim, interleaved);
      LoadRow(v, b, t, kvh, vrow.data());
      for (int64_t e = 0; e < dv; ++e) vabs[e] = std::fabs(vrow[e]);
      for (int64_t i = 0; i < d; ++i) {
        z[i] += phik[i];
        double* srow = S + i * dv;
        double* prow = P + i * dv;
        double* arow = A + i * dv;
        const double ri = rk[i];
        const double ai = std::fabs(rk[i]);
        const double pi = phik[i];
        for (int64_t e = 0; e < dv; ++e) {
          srow[e] += ri * vrow[e];
          prow[e] += pi * vabs[e];
          arow[e] += ai * vabs[e];
        }
      }
      // Rounding of a dot product of d terms and of sums over n tokens.
      const double gamma =
          (static_cast<double>(d) + 2.0 * std::sqrt(static_cast<double>(before + t + 1)) + 16.0) *
          0x1p-53;
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        LoadRow(q, b, t, h, phiq.data());
        Phi(phiq.data(), d);
        rq = phiq;
        if (rope_rows != nullptr) Rotate(rq.data(), cos_row, sin_row, rotary_dim, interleaved);
        double den = options.eps;
        std::fill(num.begin(), num.end(), 0.0);
        std::fill(mean.begin(), mean.end(), 0.0);
        std::fill(err.begin(), err.end(), 0.0);
        for (int64_t i = 0; i < d; ++i) {
          den += phiq[i] * z[i];
          const double* srow = S + i * dv;
          const double* prow = P + i * dv;
          const double* arow = A + i * dv;
          const double ri = rq[i];
          const double qi = phiq[i];
          const double ai = std::fabs(rq[i]);
          for (int64_t e = 0; e < dv; ++e) {
            num[e] += ri * srow[e];
            mean[e] += qi * prow[e];
            err[e] += ai * arow[e];
          }
        }
        double scale = 0, estimate = 0;
        for (int64_t e = 0; e < dv; ++e) {
          num[e] /= den;
          scale = std::max({scale, std::fabs(num[e]), mean[e] / den});
          estimate = std::max(estimate, err[e]);
        }
        estimate *= gamma / den;
        if (estimate > 0x1p-24 * scale && inexact_token[task] < 0) {
          inexact_token[task] = t;
          inexact_head[task] = h;
          inexact_ratio[task] = scale > 0 ? estimate / scale : INFINITY;
        }
        if (!StoreRow(out, b, t, h, num.data()) && bad_token[task] < 0) {
          bad_token[task] = t;
          bad_head[task] = h;
        }
      }
    }
  }
  for (int64_t task = 0; task < tasks; ++task) {
    if (inexact_token[task] >= 0) {
      return absl::UnimplementedError(absl::StrFormat(
          "linear attention out[%d, %d, %d, :]: the rotated numerator cancels so far that fp64 "
          "rounding could reach about %.2g of the answer's scale (more than f32 rounding): not "
          "computed. Its q and k features are large against a denominator near eps",
          task / sh.kv_heads, inexact_token[task], inexact_head[task], inexact_ratio[task]));
    }
    if (bad_token[task] >= 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "linear attention output out[%d, %d, %d, :] is not finite in %s: inputs are too large "
          "or not finite",
          task / sh.kv_heads, bad_token[task], bad_head[task], DTypeName(out.dtype())));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LinearAttend(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                          const Positions& positions, const LinearAttentionOptions& options,
                          TensorView out) {
  RA_ASSIGN_OR_RETURN(const Shapes sh, ValidateInputs(q, k, v, out, options));
  RA_ASSIGN_OR_RETURN(const std::vector<int64_t> pos,
                      ResolvePositions(positions, sh.batch, sh.seq));
  if (sh.batch * sh.seq * sh.heads == 0) return absl::OkStatus();
  RopeRows rows;
  if (options.rope != nullptr) {
    RA_ASSIGN_OR_RETURN(rows, MakeRopeRows(*options.rope, pos));
  }
  std::vector<double> s_state(sh.batch * sh.kv_heads * sh.head_dim * sh.v_dim, 0.0);
  std::vector<double> z_state(sh.batch * sh.kv_heads * sh.head_dim, 0.0);
  std::vector<double> a_state(s_state.size(), 0.0);
  std::vector<double> p_state(s_state.size(), 0.0);
  return RunRecurrence(sh, q, k, v, options, options.rope != nullptr ? &rows : nullptr, out,
                       s_state.data(), z_state.data(), a_state.data(), p_state.data(), 0);
}

absl::StatusOr<LinearAttentionState> LinearAttentionState::Create(int64_t batch, int64_t kv_heads,
                                                                  int64_t head_dim, int64_t v_dim) {
  if (batch <= 0 || kv_heads <= 0 || head_dim <= 0 || v_dim <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "linear attention state sizes must be positive, got batch %d, kv_heads %d, head_dim %d, "
        "v_dim %d",
        batch, kv_heads, head_dim, v_dim));
  }
  RA_ASSIGN_OR_RETURN(const int64_t s_size, NumElements({batch, kv_heads, head_dim, v_dim}));
  LinearAttentionState state;
  state.batch_ = batch;
  state.kv_heads_ = kv_heads;
  state.head_dim_ = head_dim;
  state.v_dim_ = v_dim;
  state.s_.assign(s_size, 0.0);
  state.z_.assign(batch * kv_heads * head_dim, 0.0);
  state.a_.assign(s_size, 0.0);
  state.p_.assign(s_size, 0.0);
  return state;
}

int64_t LinearAttentionState::byte_size() const {
  return static_cast<int64_t>((s_.size() + z_.size() + a_.size() + p_.size()) * sizeof(double));
}

absl::Status LinearAttentionState::Step(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                        const LinearAttentionOptions& options, TensorView out) {
  RA_ASSIGN_OR_RETURN(const Shapes sh, ValidateInputs(q, k, v, out, options));
  if (sh.batch != batch_ || sh.kv_heads != kv_heads_ || sh.head_dim != head_dim_ ||
      sh.v_dim != v_dim_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "inputs have batch %d, kv_heads %d, head_dim %d, v_dim %d, but the state was created for "
        "batch %d, kv_heads %d, head_dim %d, v_dim %d",
        sh.batch, sh.kv_heads, sh.head_dim, sh.v_dim, batch_, kv_heads_, head_dim_, v_dim_));
  }
  if (sh.seq == 0) return absl::OkStatus();
  // Every row of the batch decodes in lockstep, so token t sits at position_ + t.
  std::vector<int64_t> pos(sh.batch * sh.seq);
  for (int64_t b = 0; b < sh.batch; ++b) {
    for (int64_t t = 0; t < sh.seq; ++t) pos[b * sh.seq + t] = position_ + t;
  }
  RopeRows rows;
  if (options.rope != nullptr) {
    RA_ASSIGN_OR_RETURN(rows, MakeRopeRows(*options.rope, pos));
  }
  // Work on copies so a failure leaves the session exactly as it was.
  std::vector<double> s_next = s_;
  std::vector<double> z_next = z_;
  std::vector<double> a_next = a_;
  std::vector<double> p_next = p_;
  RA_RETURN_IF_ERROR(RunRecurrence(sh, q, k, v, options, options.rope != nullptr ? &rows : nullptr,
                                   out, s_next.data(), z_next.data(), a_next.data(),
                                   p_next.data(), position_));
  s_ = std::move(s_next);
  z_ = std::move(z_next);
  a_ = std::move(a_next);
  p_ = std::move(p_next);
  position_ += sh.seq;
  return absl::OkStatus();
}

}  // namespace ropeattn
