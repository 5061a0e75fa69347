// Softmax attention: validation and planning once per call, then one of two
// kernels (see attention.h):
//  - decode: per (batch, kv head), one streaming pass over K then one over V
//    for all the query rows that share that kv head, so a long cache is read
//    exactly once per step;
//  - prefill: per (batch, head, block of query rows), oneDNN matmuls over the
//    union of the rows' visible key ranges only (every mask here - causal,
//    window, padding - leaves each query row a contiguous key range, so fully
//    masked tiles are never touched), with our own vectorized softmax between.
#include "core/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <limits>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "core/attention_kernels.h"
#include "core/gemm_internal.h"
#include "core/kv_cache.h"
#include "core/limits.h"
#include "core/status_macros.h"

namespace ropeattn {
namespace {

using internal::MatOperand;

constexpr int64_t kPrefillBlock = 128;  // query rows per prefill task
// T5 bias table entries (heads x relative positions): 256 MiB of f32.
constexpr int64_t kMaxT5TableEntries = int64_t{1} << 26;
// A worker keeps its prefill packing buffer between calls up to this size.
constexpr size_t kMaxRetainedPackBytes = size_t{16} << 20;
// A kernel thread keeps its prefill packing buffer of one (batch, kv head)
// group up to this size.
constexpr size_t kMaxRetainedGroupPackBytes = size_t{4} << 20;

struct Plan {
  int64_t batch, q_len, k_len, heads, kv_heads, head_dim, v_dim, group;
  DType q_dtype, kv_dtype, out_dtype;
  float scale;
  float softcap;
  int64_t window;
  bool causal;
  std::vector<int64_t> q_offset;    // [batch]
  std::vector<int64_t> key_length;  // [batch]
  // Explicit positions (AttentionOptions::q_positions / k_positions), empty
  // when the offsets say it: q [batch * q_len], k [batch * k_len].
  std::vector<int64_t> q_pos, k_pos;

  int64_t QPos(int64_t b, int64_t i) const {
    return q_pos.empty() ? q_offset[b] + i : q_pos[b * q_len + i];
  }
  int64_t KPos(int64_t b, int64_t j) const { return k_pos.empty() ? j : k_pos[b * k_len + j]; }
  BiasKind bias_kind = BiasKind::kNone;
  std::vector<double> alibi;  // [heads]
  const StopToken* stop = nullptr;
  // T5: bias per head for relative positions rel_min .. rel_min + rel_count - 1.
  int64_t rel_min = 0, rel_count = 0;
  std::vector<float> t5;  // [heads, rel_count]
  ConstTensorView bias_tensor;
  bool bias_has_batch = false;
  ConstTensorView q, k, v;             // k, v absent when keys come from `cache`
  const KvCache* cache = nullptr;      // AttendCache: keys [0, k_len) of a session cache
  const PagedKvView* paged = nullptr;  // AttendPaged: keys [0, k_len) of pages
  int64_t page_token_rows = 0, page_head_rows = 0;  // its row layout (resolved)
  TensorView out, probs;
  int threads;
  int plan_threads;  // what the decode kernel's key cut is planned for

  // Visible keys [lo, hi) of query i in batch row b.
  void KeyRange(int64_t b, int64_t i, int64_t* lo, int64_t* hi) const {
    const int64_t pos = QPos(b, i);
    if (!k_pos.empty()) {
      // Keys are in non-decreasing position order (checked at plan time), so
      // the visible ones are still one index range: found by binary search.
      const int64_t* row = k_pos.data() + b * k_len;
      const int64_t* end = row + key_length[b];
      const int64_t* l = row;
      const int64_t* h = end;
      if (causal) h = std::upper_bound(row, end, pos);
      if (window > 0) {
        l = std::upper_bound(row, end, pos - window);               // keys with pos - k < window
        if (!causal) h = std::lower_bound(row, end, pos + window);  // k - pos < window
      }
      *lo = l - row;
      *hi = std::max(*lo, static_cast<int64_t>(h - row));
      return;
    }
    int64_t h = key_length[b];
    int64_t l = 0;
    if (causal) h = std::min(h, pos + 1);
    if (window > 0) {
      l = std::max<int64_t>(0, pos - window + 1);
      if (!causal) h = std::min(h, pos + window);
    }
    if (h < l) h = l;
    *lo = l;
    *hi = std::max<int64_t>(l, h);
  }
};

// Shapes and options; the caller has filled p.k_len, p.kv_heads, p.v_dim and
// p.kv_dtype and checked its own key/value shapes.
absl::Status PlanCommon(const ConstTensorView& q, const AttentionOptions& o, const TensorView& out,
                        const TensorView& probs, Plan& p);

absl::StatusOr<Plan> MakePlan(const ConstTensorView& q, const ConstTensorView& k,
                              const ConstTensorView& v, const AttentionOptions& o,
                              const TensorView& out, const TensorView& probs) {
  RA_RETURN_IF_ERROR(CheckBSHD(q, "q"));
  RA_RETURN_IF_ERROR(CheckBSHD(k, "k"));
  RA_RETURN_IF_ERROR(CheckBSHD(v, "v"));
  RA_RETURN_IF_ERROR(CheckBSHD(out, "out"));
  Plan p;
  p.batch = q.dim(0);
  p.q_len = q.dim(1);
  p.heads = q.dim(2);
  p.head_dim = q.dim(3);
  p.k_len = k.dim(1);
  p.kv_heads = k.dim(2);
  p.v_dim = v.dim(3);
  p.kv_dtype = k.dtype();
  if (k.dtype() != v.dtype()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("k and v must share a dtype, got k %s and v %s", DTypeName(k.dtype()),
                        DTypeName(v.dtype())));
  }
  if (k.dim(0) != p.batch || v.dim(0) != p.batch) {
    return absl::InvalidArgumentError(
        absl::StrFormat("batch sizes differ: q %d, k %d, v %d", p.batch, k.dim(0), v.dim(0)));
  }
  if (v.dim(1) != p.k_len) {
    return absl::InvalidArgumentError(
        absl::StrFormat("k and v lengths differ: k %d, v %d", p.k_len, v.dim(1)));
  }
  if (v.dim(2) != p.kv_heads) {
    return absl::InvalidArgumentError(
        absl::StrFormat("k and v head counts differ: k %d, v %d", p.kv_heads, v.dim(2)));
  }
  if (k.dim(3) != p.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("head_dim of q (%d) and k (%d) differ", p.head_dim, k.dim(3)));
  }
  RA_RETURN_IF_ERROR(PlanCommon(q, o, out, probs, p));
  if (o.check_finite) {
    RA_RETURN_IF_ERROR(CheckFinite(k, "k"));
    RA_RETURN_IF_ERROR(CheckFinite(v, "v"));
  }
  p.k = k;
  p.v = v;
  return p;
}

absl::Status PlanCommon(const ConstTensorView& q, const AttentionOptions& o, const TensorView& out,
                        const TensorView& probs, Plan& p) {
  if (p.kv_heads == 0 && p.heads != 0) {
    return absl::InvalidArgumentError("kv_heads must be >= 1, got 0");
  }
  if (p.kv_heads > 0 && p.heads % p.kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("heads (%d) must be a multiple of kv_heads (%d)", p.heads, p.kv_heads));
  }
  p.group = p.kv_heads > 0 ? p.heads / p.kv_heads : 1;
  p.stop = o.stop;
  if (out.dim(0) != p.batch || out.dim(1) != p.q_len || out.dim(2) != p.heads ||
      out.dim(3) != p.v_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "out must have shape %s, got %s", DimsToString({p.batch, p.q_len, p.heads, p.v_dim}),
        DimsToString(out.dims())));
  }
  p.q_dtype = q.dtype();
  p.out_dtype = out.dtype();

  if (!std::isfinite(o.scale) || o.scale < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("scale must be finite and >= 0, got %g", o.scale));
  }
  const double scale = o.scale > 0
                           ? o.scale
                           : 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(p.head_dim, 1)));
  if (scale > std::numeric_limits<float>::max()) {
    return absl::InvalidArgumentError(absl::StrFormat("scale %g overflows float", o.scale));
  }
  p.scale = static_cast<float>(scale);
  if (!std::isfinite(o.softcap) || o.softcap < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("softcap must be finite and >= 0, got %g", o.softcap));
  }
  p.softcap = static_cast<float>(o.softcap);
  // 0 means no cap: a positive cap must not round to it (nor to a
  // subnormal, whose few bits no longer hold the value).
  if (o.softcap > 0 && !(p.softcap >= std::numeric_limits<float>::min())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "softcap %g is below the smallest normal float (%g): it cannot be applied in f32",
        o.softcap, std::numeric_limits<float>::min()));
  }
  if (o.window < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("window must be >= 0, got %d", o.window));
  }
  // Positions lie in [0, kMaxPosition]: any window past kMaxPosition + 1
  // sees every key, and clamping it keeps pos +- window inside int64.
  p.window = std::min<int64_t>(o.window, kMaxPosition + 1);
  p.causal = o.causal;
  if (o.num_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_threads must be >= 1, got %d", o.num_threads));
  }
  p.threads = o.num_threads;
  if (o.plan_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("plan_threads must be >= 0, got %d", o.plan_threads));
  }
  p.plan_threads = o.plan_threads > 0 ? o.plan_threads : o.num_threads;

  if (!o.q_offsets.empty() && static_cast<int64_t>(o.q_offsets.size()) != p.batch) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "q_offsets must have one entry per batch row (%d), got %d", p.batch, o.q_offsets.size()));
  }
  if (!o.key_lengths.empty() && static_cast<int64_t>(o.key_lengths.size()) != p.batch) {
    return absl::InvalidArgumentError(
        absl::StrFormat("key_lengths must have one entry per batch row (%d), got %d", p.batch,
                        o.key_lengths.size()));
  }
  p.q_offset.resize(p.batch);
  p.key_length.resize(p.batch);
  for (int64_t b = 0; b < p.batch; ++b) {
    if (!o.key_lengths.empty()) {
      const int64_t len = o.key_lengths[b];
      if (len < 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("key_lengths[%d] must be >= 0, got %d", b, len));
      }
      if (len > p.k_len) {
        return absl::OutOfRangeError(absl::StrFormat(
            "key_lengths[%d] = %d exceeds the number of keys (%d)", b, len, p.k_len));
      }
      p.key_length[b] = len;
    } else {
      p.key_length[b] = p.k_len;
    }
    if (!o.q_offsets.empty()) {
      const int64_t off = o.q_offsets[b];
      RA_RETURN_IF_ERROR(
          CheckPositions(off, p.q_len, absl::StrFormat("q_offsets[%d]", b), "q.shape[1]"));
      p.q_offset[b] = off;
    } else {
      p.q_offset[b] = p.k_len - p.q_len;
    }
  }
  // Explicit positions.
  if (!o.q_positions.empty()) {
    if (!o.q_offsets.empty()) {
      return absl::InvalidArgumentError("give q_offsets or q_positions, not both");
    }
    if (static_cast<int64_t>(o.q_positions.size()) != SatMul(p.batch, p.q_len)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("q_positions must have batch * q_len = %d entries, got %d",
                          SatMul(p.batch, p.q_len), o.q_positions.size()));
    }
    for (size_t n = 0; n < o.q_positions.size(); ++n) {
      RA_RETURN_IF_ERROR(
          CheckPositions(o.q_positions[n], 1, absl::StrFormat("q_positions[%d]", n)));
    }
    p.q_pos.assign(o.q_positions.begin(), o.q_positions.end());
  }
  if (!o.k_positions.empty()) {
    if (o.q_positions.empty() && o.q_offsets.empty()) {
      return absl::InvalidArgumentError(
          "k_positions needs q_positions or q_offsets: where the queries sit cannot be inferred "
          "from key positions");
    }
    if (static_cast<int64_t>(o.k_positions.size()) != SatMul(p.batch, p.k_len)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("k_positions must have batch * k_len = %d entries, got %d",
                          SatMul(p.batch, p.k_len), o.k_positions.size()));
    }
    for (int64_t b = 0; b < p.batch; ++b) {
      for (int64_t j = 0; j < p.k_len; ++j) {
        const size_t n = static_cast<size_t>(b * p.k_len + j);
        RA_RETURN_IF_ERROR(
            CheckPositions(o.k_positions[n], 1, absl::StrFormat("k_positions[%d]", n)));
        if (j > 0 && o.k_positions[n] < o.k_positions[n - 1]) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "k_positions[%d] = %d is below the key before it (%d): keys must be in "
              "non-decreasing position order within a batch row",
              n, o.k_positions[n], o.k_positions[n - 1]));
        }
      }
    }
    p.k_pos.assign(o.k_positions.begin(), o.k_positions.end());
  }

  if (!probs.empty_view()) {
    if (probs.dtype() != DType::kF32 || probs.rank() != 4 || !probs.IsContiguous() ||
        probs.dim(0) != p.batch || probs.dim(1) != p.heads || probs.dim(2) != p.q_len ||
        probs.dim(3) != p.k_len) {
      return absl::InvalidArgumentError(
          absl::StrFormat("probs must be a dense f32 tensor of shape %s, got %s %s",
                          DimsToString({p.batch, p.heads, p.q_len, p.k_len}),
                          DTypeName(probs.dtype()), DimsToString(probs.dims())));
    }
  }

  // Biases.
  const AttentionBias& bias = o.bias;
  p.bias_kind = bias.kind;
  switch (bias.kind) {
    case BiasKind::kNone:
      break;
    case BiasKind::kAlibi: {
      if (static_cast<int64_t>(bias.alibi_slopes.size()) != p.heads) {
        return absl::InvalidArgumentError(
            absl::StrFormat("alibi_slopes must have one entry per head (%d), got %d", p.heads,
                            bias.alibi_slopes.size()));
      }
      for (size_t h = 0; h < bias.alibi_slopes.size(); ++h) {
        if (!std::isfinite(bias.alibi_slopes[h])) {
          return absl::InvalidArgumentError(absl::StrFormat("alibi_slopes[%d] is not finite", h));
        }
        p.alibi.push_back(bias.alibi_slopes[h]);
      }
      break;
    }
    case BiasKind::kT5: {
      RA_RETURN_IF_ERROR(ValidateT5BucketConfig(bias.t5_config));
      RA_RETURN_IF_ERROR(CheckRank(bias.t5_table, 2, "t5_table"));
      if (bias.t5_table.dim(0) != bias.t5_config.num_buckets || bias.t5_table.dim(1) != p.heads) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "t5_table must have shape [num_buckets=%d, heads=%d], got %s",
            bias.t5_config.num_buckets, p.heads, DimsToString(bias.t5_table.dims())));
      }
      RA_RETURN_IF_ERROR(CheckFinite(bias.t5_table, "t5_table"));
      // Relative positions k_pos - q_pos span [min k_pos - max q_pos,
      // max k_pos - min q_pos].
      int64_t min_pos = 0, max_pos = 0, min_k = 0, max_k = std::max<int64_t>(0, p.k_len - 1);
      bool first = true;
      for (int64_t b = 0; b < p.batch; ++b) {
        for (int64_t i = 0; i < p.q_len; ++i) {
          const int64_t pos = p.QPos(b, i);
          if (first || pos < min_pos) min_pos = pos;
          if (first || pos > max_pos) max_pos = pos;
          first = false;
        }
      }
      if (!p.k_pos.empty()) {
        min_k = *std::min_element(p.k_pos.begin(), p.k_pos.end());
        max_k = *std::max_element(p.k_pos.begin(), p.k_pos.end());
      }
      p.rel_min = min_k - max_pos;
      p.rel_count = std::max<int64_t>(0, (max_k - min_pos) - p.rel_min + 1);
      // The table holds heads x relative positions floats: bound the product
      // (a few heads far apart, or thousands of heads, both make it large).
      if (SatMul(p.heads, p.rel_count) > kMaxT5TableEntries) {
        return absl::ResourceExhaustedError(absl::StrFormat(
            "the T5 bias table for %d heads x %d relative positions (query positions %d..%d, "
            "%d keys) is above %d entries; bring the queries' positions closer to the keys",
            p.heads, p.rel_count, min_pos, max_pos, p.k_len, kMaxT5TableEntries));
      }
      std::vector<int> buckets(p.rel_count);
      for (int64_t r = 0; r < p.rel_count; ++r) {
        buckets[r] = T5RelativeBucket(p.rel_min + r, bias.t5_config);
      }
      p.t5.resize(p.heads * p.rel_count);
      for (int64_t h = 0; h < p.heads; ++h) {
        for (int64_t r = 0; r < p.rel_count; ++r) {
          p.t5[h * p.rel_count + r] = bias.t5_table.GetFloat({buckets[r], h});
        }
      }
      break;
    }
    case BiasKind::kTensor: {
      const ConstTensorView& t = bias.tensor;
      const bool ok3 =
          t.rank() == 3 && t.dim(0) == p.heads && t.dim(1) == p.q_len && t.dim(2) == p.k_len;
      const bool ok4 = t.rank() == 4 && t.dim(0) == p.batch && t.dim(1) == p.heads &&
                       t.dim(2) == p.q_len && t.dim(3) == p.k_len;
      if ((!ok3 && !ok4) || t.dtype() != DType::kF32 || !t.IsContiguous() ||
          (t.raw() == nullptr && t.num_elements() > 0)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("bias tensor must be dense f32 of shape %s or %s, got %s %s",
                            DimsToString({p.heads, p.q_len, p.k_len}),
                            DimsToString({p.batch, p.heads, p.q_len, p.k_len}),
                            DTypeName(t.dtype()), DimsToString(t.dims())));
      }
      // -inf is a legitimate mask value in an additive bias; NaN and +inf are not.
      const float* d = t.data<float>();
      for (int64_t i = 0; i < t.num_elements(); ++i) {
        if (std::isnan(d[i]) || d[i] == std::numeric_limits<float>::infinity()) {
          return absl::InvalidArgumentError(absl::StrFormat("bias tensor element %d is %s", i,
                                                            std::isnan(d[i]) ? "NaN" : "+inf"));
        }
      }
      p.bias_tensor = t;
      p.bias_has_batch = ok4;
      break;
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("unknown bias kind %d", static_cast<int>(bias.kind)));
  }

  RA_RETURN_IF_ERROR(CheckFinite(q, "q"));
  p.q = q;
  p.out = out;
  p.probs = probs;
  return absl::OkStatus();
}

// Turns raw dot products of one query row over its visible keys [lo, lo+n)
// into probabilities in place. Returns false if the logits overflowed.
bool FinishRow(const Plan& p, int64_t b, int64_t h, int64_t i, int64_t lo, float* x, int64_t n) {
  if (n == 0) return true;
  internal::ScaleInPlace(x, n, p.scale);
  if (p.softcap > 0) internal::SoftcapInPlace(x, n, p.softcap);
  const int64_t pos = p.QPos(b, i);
  if (!p.k_pos.empty() && p.bias_kind != BiasKind::kTensor && p.bias_kind != BiasKind::kNone) {
    // Keys at explicit positions: the same biases, key by key.
    const int64_t* kp = p.k_pos.data() + b * p.k_len + lo;
    if (p.bias_kind == BiasKind::kAlibi) {
      // Shifted by the row's largest visible bias, as below.
      const double slope = p.alibi[h];
      int64_t ref = slope >= 0 ? std::numeric_limits<int64_t>::max() : 0;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t dist = std::abs(pos - kp[j]);
        ref = slope >= 0 ? std::min(ref, dist) : std::max(ref, dist);
      }
      for (int64_t j = 0; j < n; ++j) {
        x[j] -= static_cast<float>(slope * static_cast<double>(std::abs(pos - kp[j]) - ref));
      }
    } else {
      const float* row = p.t5.data() + h * p.rel_count - p.rel_min;
      for (int64_t j = 0; j < n; ++j) x[j] += row[kp[j] - pos];
    }
  } else
    switch (p.bias_kind) {
      case BiasKind::kAlibi: {
        // Softmax ignores a per-row constant, so the row's largest visible bias
        // is subtracted first: -slope * (dist - ref), ref the nearest visible
        // key's distance (the farthest one's for a negative slope). The
        // difference is an exact integer and its product stays small where the
        // probabilities are not negligible; -slope * dist itself near 5e5
        // would carry an f32 step of 0.03 (positional-encodings.md 6.10).
        const double slope = p.alibi[h];
        const int64_t first = pos - lo, last = pos - (lo + n - 1);  // signed distances
        const int64_t nearest =
            first >= 0 && last <= 0 ? 0 : std::min(std::abs(first), std::abs(last));
        const int64_t ref = slope >= 0 ? nearest : std::max(std::abs(first), std::abs(last));
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
          const double excess = static_cast<double>(std::abs(first - j) - ref);
          x[j] -= static_cast<float>(slope * excess);
        }
        break;
      }
      case BiasKind::kT5: {
        const float* row = p.t5.data() + h * p.rel_count + (lo - pos - p.rel_min);
        for (int64_t j = 0; j < n; ++j) x[j] += row[j];
        break;
      }
      case BiasKind::kTensor: {
        const float* base = p.bias_tensor.data<float>();
        const int64_t off =
            ((p.bias_has_batch ? b * p.heads : 0) + h) * p.q_len * p.k_len + i * p.k_len + lo;
        const float* row = base + off;
        for (int64_t j = 0; j < n; ++j) x[j] += row[j];
        break;
      }
      default:
        break;
    }
  const float max = internal::RowMax(x, n);
  if (max == -std::numeric_limits<float>::infinity()) {
    // Only a bias tensor masks keys (with -inf): a row it masks entirely is
    // a fully masked row, answered with zeros. Any other row of -inf logits
    // overflowed from finite q and k (-2e40 for every key): its softmax is
    // defined (uniform when they are equal), not computable in f32.
    if (p.bias_kind != BiasKind::kTensor) return false;
    const float* row = p.bias_tensor.data<float>() +
                       ((p.bias_has_batch ? b * p.heads : 0) + h) * p.q_len * p.k_len +
                       i * p.k_len + lo;
    for (int64_t j = 0; j < n; ++j) {
      if (row[j] != -std::numeric_limits<float>::infinity()) return false;
    }
    std::memset(x, 0, n * sizeof(float));
    return true;
  }
  if (!std::isfinite(max)) return false;
  const float sum = internal::ExpSubMaxSum(x, n, max);
  if (!std::isfinite(sum) || sum <= 0) return false;
  internal::ScaleInPlace(x, n, 1.0f / sum);
  return true;
}

// Logits past the f32 range: their softmax (and the answer, a weighted mean
// of v) exists, but the kernels cannot compute it, so the request is refused
// as unimplemented, naming the limit. It is the dot product q.k (for int8
// keys q times the key's codes) that must fit: it is formed before the scale
// (and an int8 key's scale) is applied.
absl::Status OverflowError(const Plan& p, int64_t b, int64_t h, int64_t i) {
  // With a bias, the sum may overflow where q.k alone does not.
  const char* bias = p.bias_kind == BiasKind::kNone    ? ""
                     : p.bias_kind == BiasKind::kAlibi ? " and the ALiBi bias added to it"
                     : p.bias_kind == BiasKind::kT5    ? " and the T5 bias added to it"
                                                       : " and the bias added to it";
  return absl::UnimplementedError(absl::StrFormat(
      "attention logits for batch %d, head %d, query %d overflow the float range (to +inf or "
      "-inf): q.k is formed in f32 before the scale %g is applied and must stay within "
      "+-3.4e38 (for int8 keys, q times the key's int8 codes)%s%s; inputs of this magnitude are "
      "not supported, reduce the magnitude of q or k%s",
      b, h, i, p.scale, *bias ? ", as must the scaled q.k" : "", bias,
      *bias ? " or of the bias" : ""));
}

template <typename T>
const T* RowPtr(const ConstTensorView& t, int64_t b, int64_t s, int64_t h) {
  return t.data<T>() + b * t.stride(0) + s * t.stride(1) + h * t.stride(2);
}

void WriteOutRow(const Plan& p, int64_t b, int64_t i, int64_t h, const float* src) {
  const int64_t off = b * p.out.stride(0) + i * p.out.stride(1) + h * p.out.stride(2);
  if (p.out_dtype == DType::kF32) {
    std::memcpy(p.out.data<float>() + off, src, p.v_dim * sizeof(float));
  } else {
    internal::F32ToBF16(src, p.out.data<uint16_t>() + off, p.v_dim);
  }
}

void WriteProbsRow(const Plan& p, int64_t b, int64_t h, int64_t i, int64_t lo, const float* x,
                   int64_t n) {
  if (p.probs.empty_view()) return;
  float* row = p.probs.data<float>() + ((b * p.heads + h) * p.q_len + i) * p.k_len;
  std::memset(row, 0, p.k_len * sizeof(float));
  if (n > 0) std::memcpy(row + lo, x, n * sizeof(float));
}

// Per-thread scratch, reused across calls.
struct Scratch {
  std::vector<float> a, b, c;
  std::vector<uint16_t> h1, h2;
  std::vector<float> kf, vf;  // bf16 K / V widened, when FTZ could bite
  std::vector<uint16_t> vnz;  // per value channel: nonzero in some key
};

// The smallest nonzero magnitude among `rows` rows of `cols` bf16 values
// (row r at p + r * rs, columns cs apart), as a float; +inf when all are 0.
float MinNonzeroBF16(const uint16_t* p, int64_t rows, int64_t rs, int64_t cols, int64_t cs) {
  // Magnitudes order as their bits; a zero counts as 0xffff (branch-free,
  // so the contiguous case vectorizes: it runs on every prefill tile).
  uint16_t low = 0xffff;
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = p + r * rs;
    if (cs == 1) {
      uint16_t l = 0xffff;
#pragma omp simd reduction(min : l)
      for (int64_t c = 0; c < cols; ++c) {
        const uint16_t m = row[c] & 0x7fff;
        const uint16_t e = m == 0 ? 0xffff : m;
        l = e < l ? e : l;
      }
      low = l < low ? l : low;
      continue;
    }
    for (int64_t c = 0; c < cols; ++c) {
      const uint16_t m = row[c * cs] & 0x7fff;
      if (m != 0 && m < low) low = m;
    }
  }
  return low == 0xffff ? std::numeric_limits<float>::infinity() : BF16ToFloat(low);
}

// Whether a bf16 GEMM of operands whose smallest nonzero magnitudes are `a`
// and `b` could meet a subnormal input or product, which the AVX512-BF16
// GEMM flushes to zero (an answer of values near 1e-37 came back 0; a q of
// 1e-39 against keys of 1e38 scored 0).
bool Bf16GemmMayFlush(float a, float b) {
  const float normal = std::numeric_limits<float>::min();
  return a < normal || b < normal || static_cast<double>(a) * static_cast<double>(b) < 0x1p-126;
}
Scratch& ThreadScratch() {
  thread_local Scratch s;
  return s;
}

// A kernel thread keeps each scratch buffer between calls up to this size
// (a tile's scores at 4096 keys): they are memory no budget charges once
// the call is over (128 query rows x 65536 keys kept 32 MiB a thread).
constexpr size_t kMaxRetainedScratchBytes = size_t{2} << 20;

template <typename T>
void TrimVector(std::vector<T>& v, size_t keep_bytes) {
  if (v.capacity() * sizeof(T) > keep_bytes) std::vector<T>().swap(v);
}

// Called by each kernel thread at the end of its part of a call.
void TrimThreadScratch() {
  Scratch& s = ThreadScratch();
  TrimVector(s.a, kMaxRetainedScratchBytes);
  TrimVector(s.b, kMaxRetainedScratchBytes);
  TrimVector(s.c, kMaxRetainedScratchBytes);
  TrimVector(s.h1, kMaxRetainedScratchBytes);
  TrimVector(s.h2, kMaxRetainedScratchBytes);
  TrimVector(s.kf, kMaxRetainedScratchBytes);
  TrimVector(s.vf, kMaxRetainedScratchBytes);
  TrimVector(s.vnz, kMaxRetainedScratchBytes);
}

class FirstError {
 public:
  void Set(absl::Status s) {
    absl::MutexLock lock(&mu_);
    if (status_.ok()) status_ = std::move(s);
  }
  absl::Status Get() {
    absl::MutexLock lock(&mu_);
    return status_;
  }

 private:
  absl::Mutex mu_;
  absl::Status status_;
};

// ---------------------------------------------------------------- decode --
//
// K and V rows hold every kv head of a token contiguously ([seq, heads, dim]),
// so walking one head down the sequence touches a small piece of a new page
// per key and defeats the prefetchers. Instead every thread takes a range of
// keys and streams whole rows, once for K (scores of every query row) and
// once for V (partial outputs, merged across threads at the end).

constexpr int64_t kDecodeChunk = 64;  // keys per scheduling unit
constexpr int64_t kKeyBlock = 8;      // keys per inner block

struct DecodeLayout {
  int64_t rows;                      // batch * heads * q_len; row = (b * heads + h) * q_len + i
  int64_t n_max;                     // widest key span of any batch row
  std::vector<int64_t> lo, hi;       // per (b, i): visible key range
  std::vector<int64_t> ulo, uhi;     // per b: union of its rows' ranges
  std::vector<int64_t> chunk_begin;  // per b: first global chunk index
  int64_t chunks = 0;
  // Chunk c of row b covers keys [base + c' * chunk, base + (c'+1) * chunk)
  // clipped to [ulo, uhi), where c' = c - chunk_begin[b] and base = ulo
  // rounded down to a multiple of `align`.
  int64_t chunk = kDecodeChunk, align = 1;
};

// Whether a plan reads tiles (a KvCache, or pages in its layout).
bool ReadsTiles(const Plan& p) {
  return p.cache != nullptr || (p.paged != nullptr && p.paged->tiles);
}
// Calls fn with a value of the tiles' element type: float (a KvCache or f32
// pages), uint16_t (bf16 pages) or int8_t (int8 pages, scaled per key).
template <typename Fn>
inline void WithTileType(const Plan& p, Fn fn) {
  if (p.cache != nullptr || p.paged->type == PagedKvView::Type::kF32) return fn(float{});
  if (p.paged->type == PagedKvView::Type::kBF16) return fn(uint16_t{});
  return fn(int8_t{});
}

// A KvCache is read tile by tile, and its V rows in runs long enough that the
// second pair of query rows finds them in L2: chunks are whole tiles, as long
// as 512 keys, short enough that every thread gets work.
int64_t CacheChunk(const Plan& p, int64_t n) {
  const int64_t per_thread = (n + p.plan_threads - 1) / std::max(1, p.plan_threads);
  const int64_t tiles = (per_thread + KvCache::kTile - 1) / KvCache::kTile;
  return std::clamp<int64_t>(tiles, 1, 8) * KvCache::kTile;
}

DecodeLayout PlanDecode(const Plan& p) {
  DecodeLayout L;
  const bool tiles = ReadsTiles(p);
  if (tiles) L.align = KvCache::kTile;
  L.rows = p.batch * p.heads * p.q_len;
  L.lo.resize(p.batch * p.q_len);
  L.hi.resize(p.batch * p.q_len);
  L.ulo.assign(p.batch, 0);
  L.uhi.assign(p.batch, 0);
  L.n_max = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    int64_t ulo = p.k_len, uhi = 0;
    for (int64_t i = 0; i < p.q_len; ++i) {
      int64_t lo, hi;
      p.KeyRange(b, i, &lo, &hi);
      L.lo[b * p.q_len + i] = lo;
      L.hi[b * p.q_len + i] = hi;
      if (hi > lo) {
        ulo = std::min(ulo, lo);
        uhi = std::max(uhi, hi);
      }
    }
    if (uhi <= ulo) ulo = uhi = 0;
    L.ulo[b] = ulo;
    L.uhi[b] = uhi;
    L.n_max = std::max(L.n_max, uhi - ulo);
  }
  if (tiles) L.chunk = CacheChunk(p, L.n_max);
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t base = L.ulo[b] / L.align * L.align;
    L.chunk_begin.push_back(L.chunks);
    if (L.uhi[b] > L.ulo[b]) L.chunks += (L.uhi[b] - base + L.chunk - 1) / L.chunk;
  }
  L.chunk_begin.push_back(L.chunks);
  return L;
}

// Within a chunk, 8 keys at a time across every head (token-major), so memory
// sees a few sequential streams rather than a jump per head; the query heads
// sharing a kv head are processed together so each K/V slice is loaded once.
// Calls fn(j, lo, hi, r0) for kv head j, visible keys [lo, hi) of one block
// and r0 the first of the group's query rows (query index i).
// Blocks are aligned to multiples of the block size (a chunk starting inside
// one first finishes it). A block of more than 8 keys is passed as up to
// three runs, [lo, next multiple of 8), whole 8-key groups, the rest: the
// row kernels group keys from the start of a run, so every key meets the
// same group, and sums in the same order, whatever the block size (and a
// paged view can split a run at its page boundaries, multiples of 8).
template <int64_t kBlock = kKeyBlock, typename Fn>
inline void ForEachKeyBlock(const Plan& p, const DecodeLayout& L, int64_t b, int64_t t0, int64_t t1,
                            Fn fn) {
  static_assert(kBlock % 8 == 0, "blocks of whole 8-key groups");
  for (int64_t tb = t0, tb1; tb < t1; tb = tb1) {
    tb1 = std::min(t1, (tb / kBlock + 1) * kBlock);
    for (int64_t j = 0; j < p.kv_heads; ++j) {
      for (int64_t i = 0; i < p.q_len; ++i) {
        int64_t lo = std::max(tb, L.lo[b * p.q_len + i]);
        const int64_t hi = std::min(tb1, L.hi[b * p.q_len + i]);
        if (hi <= lo) continue;
        const int64_t r0 = (b * p.heads + j * p.group) * p.q_len + i;
        if constexpr (kBlock == 8) {
          fn(j, lo, hi, r0);
        } else {
          const int64_t head = std::min(hi, (lo + 7) / 8 * 8);
          if (head > lo) fn(j, lo, head, r0);
          lo = head;
          const int64_t body = lo + (hi - lo) / 8 * 8;
          if (body > lo) fn(j, lo, body, r0);
          if (hi > body) fn(j, body, hi, r0);
        }
      }
    }
  }
}

template <typename KV>
void DecodeScoresChunk(const Plan& p, const DecodeLayout& L, const float* qf, float* scores,
                       int64_t b, int64_t t0, int64_t t1) {
  const int64_t d = p.head_dim, ks = p.k.stride(1), ss = p.q_len * L.n_max;
  ForEachKeyBlock(p, L, b, t0, t1, [&](int64_t j, int64_t lo, int64_t hi, int64_t r0) {
    const KV* kj = RowPtr<KV>(p.k, b, 0, j);
    float* out = scores + r0 * L.n_max + (lo - L.ulo[b]);
    if constexpr (std::is_same_v<KV, float>) {
      internal::DotKeysRowsF32(qf + r0 * d, p.q_len * d, p.group, kj + lo * ks, ks, hi - lo, d, out,
                               ss);
    } else {
      internal::DotKeysRowsBF16(qf + r0 * d, p.q_len * d, p.group, kj + lo * ks, ks, hi - lo, d,
                                out, ss);
    }
  });
}

template <typename KV>
void DecodeValuesChunk(const Plan& p, const DecodeLayout& L, const float* scores, float* acc,
                       int64_t b, int64_t t0, int64_t t1) {
  const int64_t dv = p.v_dim, vs = p.v.stride(1), ws = p.q_len * L.n_max;
  ForEachKeyBlock(p, L, b, t0, t1, [&](int64_t j, int64_t lo, int64_t hi, int64_t r0) {
    const KV* vj = RowPtr<KV>(p.v, b, 0, j);
    const float* w = scores + r0 * L.n_max + (lo - L.ulo[b]);
    if constexpr (std::is_same_v<KV, float>) {
      internal::WeightedSumRowsF32(w, ws, p.group, vj + lo * vs, vs, hi - lo, dv, acc + r0 * dv,
                                   p.q_len * dv);
    } else {
      internal::WeightedSumRowsBF16(w, ws, p.group, vj + lo * vs, vs, hi - lo, dv, acc + r0 * dv,
                                    p.q_len * dv);
    }
  });
}

// Pages (batch 1): as above, each 8-key block inside one page; int8 pages
// apply each key's scale to its scores and fold it into its weights.
// Pages (batch 1): as above, runs split at page boundaries; int8 pages
// apply each key's scale to its scores and fold it into its weights. int8
// pages are head-major (a session's), so a 16-key run of one head is one
// contiguous piece of its page and the heads follow in address order; the
// bits are the same as with 8-key blocks (see ForEachKeyBlock).
constexpr int64_t PagedBlock(PagedKvView::Type type) {
  return type == PagedKvView::Type::kInt8 ? 16 : kKeyBlock;
}

// Calls fn(page, row, lo, hi, r0) for each run of ForEachKeyBlock cut at
// page boundaries: keys [lo, hi) of kv head j start at row `row` of page
// `page` (rows token_rows apart).
template <PagedKvView::Type kType, typename Fn>
inline void ForEachPagedRun(const Plan& p, const DecodeLayout& L, int64_t t0, int64_t t1, Fn fn) {
  const int64_t P = p.paged->page_tokens, TR = p.page_token_rows, HR = p.page_head_rows;
  ForEachKeyBlock<PagedBlock(kType)>(p, L, 0, t0, t1,
                                     [&](int64_t j, int64_t lo0, int64_t hi0, int64_t r0) {
                                       for (int64_t lo = lo0, hi; lo < hi0; lo = hi) {
                                         const int64_t page = lo / P;
                                         hi = std::min(hi0, (page + 1) * P);
                                         fn(page, (lo - page * P) * TR + j * HR, lo, hi, r0);
                                       }
                                     });
}

template <PagedKvView::Type kType>
void DecodeScoresPaged(const Plan& p, const DecodeLayout& L, const float* qf, float* scores,
                       int64_t t0, int64_t t1) {
  const PagedKvView& kv = *p.paged;
  const int64_t d = p.head_dim, TR = p.page_token_rows, ks = TR * d, ss = p.q_len * L.n_max;
  ForEachPagedRun<kType>(
      p, L, t0, t1, [&](int64_t page, int64_t row, int64_t lo, int64_t hi, int64_t r0) {
        const float* q = qf + r0 * d;
        float* out = scores + r0 * L.n_max + (lo - L.ulo[0]);
        if constexpr (kType == PagedKvView::Type::kF32) {
          internal::DotKeysRowsF32(q, p.q_len * d, p.group,
                                   static_cast<const float*>(kv.k_pages[page]) + row * d, ks,
                                   hi - lo, d, out, ss);
        } else if constexpr (kType == PagedKvView::Type::kBF16) {
          internal::DotKeysRowsBF16(q, p.q_len * d, p.group,
                                    static_cast<const uint16_t*>(kv.k_pages[page]) + row * d, ks,
                                    hi - lo, d, out, ss);
        } else {
          internal::DotKeysRowsI8(q, p.q_len * d, p.group,
                                  static_cast<const int8_t*>(kv.k_pages[page]) + row * d, ks,
                                  kv.k_scales[page] + row, TR, hi - lo, d, out, ss);
        }
      });
}

template <PagedKvView::Type kType>
void DecodeValuesPaged(const Plan& p, const DecodeLayout& L, const float* scores, float* acc,
                       int64_t t0, int64_t t1) {
  const PagedKvView& kv = *p.paged;
  const int64_t dv = p.v_dim, TR = p.page_token_rows, vs = TR * dv, ws = p.q_len * L.n_max;
  ForEachPagedRun<kType>(
      p, L, t0, t1, [&](int64_t page, int64_t row, int64_t lo, int64_t hi, int64_t r0) {
        const float* w = scores + r0 * L.n_max + (lo - L.ulo[0]);
        float* a = acc + r0 * dv;
        if constexpr (kType == PagedKvView::Type::kF32) {
          internal::WeightedSumRowsF32(w, ws, p.group,
                                       static_cast<const float*>(kv.v_pages[page]) + row * dv, vs,
                                       hi - lo, dv, a, p.q_len * dv);
        } else if constexpr (kType == PagedKvView::Type::kBF16) {
          internal::WeightedSumRowsBF16(w, ws, p.group,
                                        static_cast<const uint16_t*>(kv.v_pages[page]) + row * dv,
                                        vs, hi - lo, dv, a, p.q_len * dv);
        } else {
          internal::WeightedSumRowsI8(w, ws, p.group,
                                      static_cast<const int8_t*>(kv.v_pages[page]) + row * dv, vs,
                                      kv.v_scales[page] + row, TR, hi - lo, dv, a, p.q_len * dv);
        }
      });
}

// Calls fn with the view's element type as a compile-time constant.
template <typename Fn>
inline void WithPagedType(PagedKvView::Type type, Fn fn) {
  using T = PagedKvView::Type;
  switch (type) {
    case T::kF32:
      return fn(std::integral_constant<T, T::kF32>{});
    case T::kBF16:
      return fn(std::integral_constant<T, T::kBF16>{});
    case T::kInt8:
      return fn(std::integral_constant<T, T::kInt8>{});
  }
}

// The order tiles are read in (batch 1), as (kv head j, first key tb) for
// the chunk's tiles [first, t1): a KvCache per kv head, each head's tiles
// in turn (one head's tiles are one contiguous run of memory); pages tile by
// tile, every kv head of a page in turn (a page's heads are one contiguous
// run). Each tile is scored, and each query row's weighted sum adds its
// tiles in ascending order, either way: the bits do not depend on it.
struct TileOrder {
  int64_t kv_heads, first, t1;
  bool heads_outer;
  static constexpr int64_t kT = KvCache::kTile;
  int64_t count() const { return kv_heads * ((t1 - first + kT - 1) / kT); }
  // The n-th tile visited.
  void At(int64_t n, int64_t* j, int64_t* tb) const {
    const int64_t tiles = (t1 - first + kT - 1) / kT;
    if (heads_outer) {
      *j = n / tiles;
      *tb = first + n % tiles * kT;
    } else {
      *j = n % kv_heads;
      *tb = first + n / kv_heads * kT;
    }
  }
};

TileOrder TileOrderOf(const Plan& p, int64_t t0, int64_t t1) {
  return TileOrder{p.kv_heads, t0 / KvCache::kTile * KvCache::kTile, t1, p.cache != nullptr};
}

// Scores of the tiles' visible keys for the query rows sharing their kv
// head; only the visible keys are copied into the score rows. T: the tiles'
// element type (f32, or bf16 pages).
template <typename T>
void DecodeScoresTiles(const Plan& p, const DecodeLayout& L, const float* qf, float* scores,
                       int64_t t0, int64_t t1) {
  constexpr int64_t kT = KvCache::kTile;
  const int64_t d = p.head_dim;
  std::vector<float> tmp(p.group * kT);
  auto tile_at = [&](int64_t j, int64_t tb) -> const T* {
    if constexpr (std::is_same_v<T, float>) {
      if (p.cache != nullptr) return p.cache->KTile(j, tb / kT);
    }
    return static_cast<const T*>(p.paged->k_pages[tb / kT]) + j * d * kT;
  };
  const TileOrder order = TileOrderOf(p, t0, t1);
  for (int64_t n = 0, count = order.count(); n < count; ++n) {
    int64_t j, tb;
    order.At(n, &j, &tb);
    const T* tile = tile_at(j, tb);
    for (int64_t i = 0; i < p.q_len; ++i) {
      const int64_t lo = std::max({t0, tb, L.lo[i]});
      const int64_t hi = std::min({t1, tb + kT, L.hi[i]});
      if (hi <= lo) continue;
      const int64_t r0 = j * p.group * p.q_len + i;
      internal::DotTileRows(qf + r0 * d, p.q_len * d, p.group, tile, d, tmp.data());
      for (int64_t r = 0; r < p.group; ++r) {
        float* dst = scores + (r0 + r * p.q_len) * L.n_max + (lo - L.ulo[0]);
        const float* src = tmp.data() + r * kT + (lo - tb);
        if constexpr (std::is_same_v<T, int8_t>) {
          // Each key's scale multiplies its score, as the row kernels do.
          const float* sc = p.paged->k_scales[tb / kT] + j * kT + (lo - tb);
          for (int64_t u = 0; u < hi - lo; ++u) dst[u] = sc[u] * src[u];
        } else {
          std::memcpy(dst, src, (hi - lo) * sizeof(float));
        }
      }
    }
  }
}

// Weighted sums over the tiles' V rows, tile by tile: each tile's keys are
// summed apart and the tile sums added (the kernel adds its run's sum to
// acc), so a chunk's error does not grow with its length.
template <typename T>
void DecodeValuesDense(const Plan& p, const DecodeLayout& L, const float* scores, float* acc,
                       int64_t t0, int64_t t1) {
  constexpr int64_t kT = KvCache::kTile;
  const int64_t dv = p.v_dim;
  auto row_at = [&](int64_t j, int64_t a) -> const T* {
    if constexpr (std::is_same_v<T, float>) {
      if (p.cache != nullptr) return p.cache->VRow(j, a);
    }
    return static_cast<const T*>(p.paged->v_pages[a / kT]) + (j * kT + a % kT) * dv;
  };
  std::vector<float> scaled(std::is_same_v<T, int8_t> ? p.group * kT : 0);
  const TileOrder order = TileOrderOf(p, t0, t1);
  for (int64_t n = 0, count = order.count(); n < count; ++n) {
    int64_t j, tb;
    order.At(n, &j, &tb);
    for (int64_t i = 0; i < p.q_len; ++i) {
      const int64_t a = std::max({t0, tb, L.lo[i]});
      const int64_t e = std::min({t1, tb + kT, L.hi[i]});
      if (e <= a) continue;
      const int64_t r0 = j * p.group * p.q_len + i;
      const float* w = scores + r0 * L.n_max + (a - L.ulo[0]);
      int64_t ws = p.q_len * L.n_max;
      if constexpr (std::is_same_v<T, int8_t>) {
        // Each key's scale folds into its weights, as the row kernels do.
        const float* sc = p.paged->v_scales[a / kT] + j * kT + a % kT;
        for (int64_t r = 0; r < p.group; ++r) {
          for (int64_t u = 0; u < e - a; ++u) scaled[r * kT + u] = w[r * ws + u] * sc[u];
        }
        w = scaled.data();
        ws = kT;
      }
      internal::WeightedSumDenseRows(w, ws, p.group, row_at(j, a), e - a, dv, acc + r0 * dv,
                                     p.q_len * dv);
    }
  }
}

// One decode computation of a pass: a call of its own, or one job of
// AttendBatch. Its key chunks are cut into `parts` contiguous runs; part t's
// partial output sums its chunks in order and the parts are summed in order
// at the end. The cut depends only on the plan (its own thread count), never
// on how many threads run the pass or what else is in it, so a job gives the
// same bits alone or batched with others.
struct DecodeRun {
  const Plan* p = nullptr;
  DecodeLayout L;
  int64_t parts = 1;
  float* qf = nullptr;      // [rows, head_dim]: the query rows in f32, row order
  float* scores = nullptr;  // [rows, n_max]
  float* acc = nullptr;     // [parts, rows, v_dim], zeroed
  // Per part: one chunk's sums, and the compensation of Kahan's summation
  // of the chunks into acc ([parts, rows, v_dim] each). Summed straight into
  // acc, every key of a part added one rounding to a running sum: with
  // near-uniform weights the error grew with the keys (1.6e-4 at 32k).
  float* chunk_acc = nullptr;
  float* comp = nullptr;
  FirstError err;

  int64_t PartBegin(int64_t t) const { return L.chunks * t / parts; }
  void Locate(int64_t c, int64_t* b, int64_t* t0, int64_t* t1) const {
    int64_t bb = 0;
    while (L.chunk_begin[bb + 1] <= c) ++bb;
    *b = bb;
    const int64_t start = L.ulo[bb] / L.align * L.align + (c - L.chunk_begin[bb]) * L.chunk;
    *t0 = std::max(L.ulo[bb], start);
    *t1 = std::min(L.uhi[bb], start + L.chunk);
  }
  void Scores(int64_t t) {
    const bool f32 = p->kv_dtype == DType::kF32;
    for (int64_t c = PartBegin(t); c < PartBegin(t + 1); ++c) {
      int64_t b, t0, t1;
      Locate(c, &b, &t0, &t1);
      if (ReadsTiles(*p)) {
        WithTileType(*p, [&](auto t) { DecodeScoresTiles<decltype(t)>(*p, L, qf, scores, t0, t1); });
      } else if (p->paged != nullptr) {
        WithPagedType(p->paged->type, [&](auto type) {
          DecodeScoresPaged<decltype(type)::value>(*p, L, qf, scores, t0, t1);
        });
      } else if (f32) {
        DecodeScoresChunk<float>(*p, L, qf, scores, b, t0, t1);
      } else {
        DecodeScoresChunk<uint16_t>(*p, L, qf, scores, b, t0, t1);
      }
    }
  }
  void Finish(int64_t r) {
    const Plan& q = *p;
    const int64_t i = r % q.q_len, h = (r / q.q_len) % q.heads, b = r / (q.q_len * q.heads);
    const int64_t lo = L.lo[b * q.q_len + i], hi = L.hi[b * q.q_len + i];
    float* x = scores + r * L.n_max + (lo - L.ulo[b]);
    if (!FinishRow(q, b, h, i, lo, x, hi - lo)) {
      err.Set(OverflowError(q, b, h, i));
      return;
    }
    WriteProbsRow(q, b, h, i, lo, x, hi - lo);
    // The bf16 contract (attention.h): P is rounded before P * V, as the
    // prefill's bf16 GEMM takes it.
    if (q.kv_dtype == DType::kBF16) internal::RoundToBF16InPlace(x, hi - lo);
  }
  void Values(int64_t t) {
    const bool f32 = p->kv_dtype == DType::kF32;
    const int64_t n = L.rows * p->v_dim;
    float* part_acc = acc + t * n;
    float* sums = chunk_acc + t * n;
    float* c_part = comp + t * n;
    // Each chunk's keys (64, or a cache's whole tiles, themselves summed
    // tile by tile) are summed apart before their sum joins acc: the error
    // of a row stays near fp32's step (6e-7 with 131072 equal weights;
    // 2.5e-6 with 256 keys per sum), for a few percent of the pass spent
    // clearing and adding the sums.
    constexpr int64_t kKeysPerSum = 64;
    int64_t keys_in_sums = 0;
    for (int64_t c = PartBegin(t); c < PartBegin(t + 1); ++c) {
      int64_t b, t0, t1;
      Locate(c, &b, &t0, &t1);
      if (keys_in_sums == 0) std::memset(sums, 0, n * sizeof(float));
      keys_in_sums += t1 - t0;
      if (ReadsTiles(*p)) {
        WithTileType(*p, [&](auto t) { DecodeValuesDense<decltype(t)>(*p, L, scores, sums, t0, t1); });
      } else if (p->paged != nullptr) {
        WithPagedType(p->paged->type, [&](auto type) {
          DecodeValuesPaged<decltype(type)::value>(*p, L, scores, sums, t0, t1);
        });
      } else if (f32) {
        DecodeValuesChunk<float>(*p, L, scores, sums, b, t0, t1);
      } else {
        DecodeValuesChunk<uint16_t>(*p, L, scores, sums, b, t0, t1);
      }
      if (keys_in_sums >= kKeysPerSum || c + 1 == PartBegin(t + 1)) {
        internal::KahanAddInPlace(sums, part_acc, c_part, n);
        keys_in_sums = 0;
      }
    }
  }
  void Reduce(int64_t r) {
    const Plan& q = *p;
    const int64_t dv = q.v_dim;
    float* sum = acc + r * dv;
    for (int64_t t = 1; t < parts; ++t) {
      const float* part = acc + (t * L.rows + r) * dv;
      for (int64_t x = 0; x < dv; ++x) sum[x] += part[x];
    }
    const int64_t i = r % q.q_len, h = (r / q.q_len) % q.heads, b = r / (q.q_len * q.heads);
    WriteOutRow(q, b, i, h, sum);
  }
};

// Plans run i of `plans` into runs[i], with buffers from the calling
// thread's pool (reused across calls: fresh multi-hundred-KiB allocations
// would page-fault on every decode step). Inside the parallel region only
// raw pointers are used: a thread_local named there would be each worker's
// own (empty) instance.
std::vector<std::vector<float>>& DecodePool() {
  thread_local std::vector<std::vector<float>> pool;
  return pool;
}

// After a pass: the calling thread keeps at most 32 MiB of its pool's
// buffers (every step of a 16-session pass at 1k context is well under it;
// a step's scores at 128k keys and 64 query rows are 32 MiB alone, and a
// batch of such steps would otherwise be kept whole).
void TrimDecodePool() {
  constexpr size_t kKeepBytes = size_t{32} << 20;
  size_t kept = 0;
  for (std::vector<float>& v : DecodePool()) {
    const size_t bytes = v.capacity() * sizeof(float);
    if (kept + bytes > kKeepBytes) {
      std::vector<float>().swap(v);
    } else {
      kept += bytes;
    }
  }
}

void PrepareDecodeRuns(absl::Span<const Plan* const> plans, std::deque<DecodeRun>& runs) {
  std::vector<std::vector<float>>& pool = DecodePool();
  if (pool.size() < 5 * plans.size()) pool.resize(5 * plans.size());
  runs.clear();  // a deque: FirstError is not movable
  for (size_t n = 0; n < plans.size(); ++n) {
    const Plan& p = *plans[n];
    runs.emplace_back();
    DecodeRun& run = runs.back();
    run.p = &p;
    run.L = PlanDecode(p);
    const DecodeLayout& L = run.L;
    const int64_t d = p.head_dim, dv = p.v_dim;
    run.parts = std::max<int64_t>(1, std::min<int64_t>(p.plan_threads, L.chunks));
    std::vector<float>& qf = pool[5 * n];
    std::vector<float>& scores = pool[5 * n + 1];
    std::vector<float>& acc = pool[5 * n + 2];
    std::vector<float>& chunk_acc = pool[5 * n + 3];
    std::vector<float>& comp = pool[5 * n + 4];
    qf.resize(L.rows * d);
    for (int64_t b = 0; b < p.batch; ++b) {
      for (int64_t h = 0; h < p.heads; ++h) {
        for (int64_t i = 0; i < p.q_len; ++i) {
          float* dst = qf.data() + ((b * p.heads + h) * p.q_len + i) * d;
          if (p.q_dtype == DType::kF32) {
            std::memcpy(dst, RowPtr<float>(p.q, b, i, h), d * sizeof(float));
            // The bf16 contract (attention.h): q meets bf16 keys in bf16.
            if (p.kv_dtype == DType::kBF16) internal::RoundToBF16InPlace(dst, d);
          } else {
            internal::BF16ToF32(RowPtr<uint16_t>(p.q, b, i, h), dst, d);
          }
        }
      }
    }
    // Every score that is read was written first (rows read only their range).
    scores.resize(L.rows * std::max<int64_t>(L.n_max, 1));
    acc.assign(static_cast<size_t>(run.parts) * L.rows * dv, 0.0f);
    chunk_acc.resize(static_cast<size_t>(run.parts) * L.rows * dv);
    comp.assign(static_cast<size_t>(run.parts) * L.rows * dv, 0.0f);
    run.qf = qf.data();
    run.scores = scores.data();
    run.acc = acc.data();
    run.chunk_acc = chunk_acc.data();
    run.comp = comp.data();
  }
}

// Every run's work items - (run, part) for the two streaming passes, (run,
// row) for the softmax and the final sums - in one parallel region of at
// most `threads` threads.
void RunDecodePass(std::deque<DecodeRun>& runs, int threads) {
  std::vector<int64_t> part_at{0}, row_at{0};
  for (const DecodeRun& r : runs) {
    part_at.push_back(part_at.back() + r.parts);
    row_at.push_back(row_at.back() + r.L.rows);
  }
  const int64_t parts = part_at.back(), rows = row_at.back();
  auto which = [](const std::vector<int64_t>& at, int64_t item) {
    return static_cast<size_t>(std::upper_bound(at.begin(), at.end(), item) - at.begin() - 1);
  };
  const int n = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, parts)));
#pragma omp parallel num_threads(n)
  {
    omp_set_num_threads(1);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < parts; ++it) {
      const size_t r = which(part_at, it);
      runs[r].Scores(it - part_at[r]);
    }
#pragma omp for schedule(static)
    for (int64_t it = 0; it < rows; ++it) {
      const size_t r = which(row_at, it);
      runs[r].Finish(it - row_at[r]);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < parts; ++it) {
      const size_t r = which(part_at, it);
      runs[r].Values(it - part_at[r]);
    }
#pragma omp for schedule(static)
    for (int64_t it = 0; it < rows; ++it) {
      const size_t r = which(row_at, it);
      runs[r].Reduce(it - row_at[r]);
    }
  }
}

absl::Status RunDecode(const Plan& p) {
  const Plan* plans[1] = {&p};
  std::deque<DecodeRun> runs;
  PrepareDecodeRuns(plans, runs);
  RunDecodePass(runs, p.threads);
  absl::Status st = runs[0].err.Get();
  runs.clear();
  TrimDecodePool();
  return st;
}

// --------------------------------------------------------------- prefill --

// oneDNN 2.6 runs its fast brgemm kernels only on dense operands (any row
// stride falls back to a much slower gemm), so the prefill packs the keys it
// needs into head-major dense buffers once per call, copies each query tile
// to a dense tile and computes each output tile densely.
// The visible K/V rows: packed, or (direct) read in place from p.k / p.v.
struct PackedKV {
  const char* k = nullptr;  // [batch, kv_heads, n, head_dim], KV dtype
  const char* v = nullptr;  // [batch, kv_heads, n, v_dim]
  int64_t first = 0;        // key index of packed row 0
  int64_t n = 0;            // packed rows per (batch, kv head)
  bool direct = false;      // no copy: rows of p.k / p.v at their own strides
  bool one_head = false;    // k / v hold one (batch, kv head)'s rows only
};

absl::Status PrefillTask(const Plan& p, const PackedKV& kv, int64_t b, int64_t h, int64_t i0,
                         int64_t i1) {
  const int64_t rows = i1 - i0;
  const int64_t d = p.head_dim, dv = p.v_dim;
  const int64_t kvh = h / p.group;
  int64_t lo[kPrefillBlock], hi[kPrefillBlock];
  int64_t ulo = p.k_len, uhi = 0;
  for (int64_t r = 0; r < rows; ++r) {
    p.KeyRange(b, i0 + r, &lo[r], &hi[r]);
    if (hi[r] > lo[r]) {
      ulo = std::min(ulo, lo[r]);
      uhi = std::max(uhi, hi[r]);
    }
  }
  Scratch& s = ThreadScratch();
  if (uhi <= ulo) {  // the whole tile is masked
    s.c.assign(dv, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      WriteOutRow(p, b, i0 + r, h, s.c.data());
      WriteProbsRow(p, b, h, i0 + r, 0, nullptr, 0);
    }
    return absl::OkStatus();
  }
  const int64_t n = uhi - ulo;
  const size_t es = DTypeSize(p.kv_dtype);
  // A operand: the query tile, dense, in the K/V dtype.
  MatOperand qa;
  if (p.kv_dtype == DType::kBF16) {
    s.h1.resize(rows * d);
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t* dst = s.h1.data() + r * d;
      if (p.q_dtype == DType::kBF16) {
        std::memcpy(dst, RowPtr<uint16_t>(p.q, b, i0 + r, h), d * sizeof(uint16_t));
      } else {
        internal::F32ToBF16(RowPtr<float>(p.q, b, i0 + r, h), dst, d);
      }
    }
    qa = {s.h1.data(), DType::kBF16, d, 1};
  } else {
    s.a.resize(rows * d);
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = s.a.data() + r * d;
      if (p.q_dtype == DType::kF32) {
        std::memcpy(dst, RowPtr<float>(p.q, b, i0 + r, h), d * sizeof(float));
      } else {
        internal::BF16ToF32(RowPtr<uint16_t>(p.q, b, i0 + r, h), dst, d);
      }
    }
    qa = {s.a.data(), DType::kF32, d, 1};
  }
  // B operands: K rows ulo..uhi read as a [d, n] matrix, V rows as [n, dv]
  // (packed, or in place: kv.k / kv.v are null then, and no offset is
  // applied to them).
  MatOperand kb{}, vb{};
  if (!kv.direct) {
    const int64_t head_row0 =
        (kv.one_head ? 0 : (b * p.kv_heads + kvh) * kv.n) + (ulo - kv.first);
    kb = {kv.k + head_row0 * d * es, p.kv_dtype, 1, d};
    vb = {kv.v + head_row0 * dv * es, p.kv_dtype, dv, 1};
  } else {
    kb = {static_cast<const char*>(p.k.raw()) +
              (b * p.k.stride(0) + ulo * p.k.stride(1) + kvh * p.k.stride(2)) * es,
          p.kv_dtype, 1, p.k.stride(1)};
    vb = {static_cast<const char*>(p.v.raw()) +
              (b * p.v.stride(0) + ulo * p.v.stride(1) + kvh * p.v.stride(2)) * es,
          p.kv_dtype, p.v.stride(1), 1};
  }
  s.b.resize(rows * n);
  float* scores = s.b.data();
  // Only a bf16 GEMM on AVX512-BF16 flushes subnormals (gemm_internal.h).
  const bool ftz = p.kv_dtype == DType::kBF16 && internal::Bf16GemmFlushes();
  // Q.K^T: subnormal inputs or products go through the f32 GEMM below. A
  // partial sum below FLT_MIN that is flushed loses less than FLT_MIN, so a
  // logit loses less than 2 d FLT_MIN x scale (3e-36 x scale for d = 128)
  // and each weight after exp that much relatively: immaterial at any usual
  // scale (3e-37 at 0.09, against f32 rounding of 6e-8), so the sums get
  // no repair as P.V does below. Only scales beyond 2^-24 / (2 d FLT_MIN)
  // (2e28 for d = 128) could notice (a logit of 0.5 came back 0 at a scale
  // of 1e38): they take the f32 GEMM too.
  if (ftz && (Bf16GemmMayFlush(MinNonzeroBF16(s.h1.data(), rows, d, d, 1),
                               MinNonzeroBF16(static_cast<const uint16_t*>(kb.data), n,
                                              kb.col_stride, d, kb.row_stride)) ||
              2.0 * static_cast<double>(d) * std::numeric_limits<float>::min() *
                      static_cast<double>(p.scale) >
                  0x1p-24)) {
    // The same bf16 values in an f32 GEMM, which keeps subnormals (bf16
    // products are exact in f32).
    s.a.resize(rows * d);
    internal::BF16ToF32(s.h1.data(), s.a.data(), rows * d);
    s.kf.resize(n * d);
    const uint16_t* k0 = static_cast<const uint16_t*>(kb.data);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t x = 0; x < d; ++x) {
        s.kf[j * d + x] = BF16ToFloat(k0[j * kb.col_stride + x * kb.row_stride]);
      }
    }
    qa = {s.a.data(), DType::kF32, d, 1};
    kb = {s.kf.data(), DType::kF32, 1, d};
  }
  RA_RETURN_IF_ERROR(internal::Gemm(rows, n, d, qa, kb, scores, n, 1));
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * n;
    const int64_t l = lo[r] - ulo, len = hi[r] - lo[r];
    if (len <= 0) {
      std::memset(row, 0, n * sizeof(float));
      WriteProbsRow(p, b, h, i0 + r, 0, nullptr, 0);
      continue;
    }
    if (!FinishRow(p, b, h, i0 + r, lo[r], row + l, len)) return OverflowError(p, b, h, i0 + r);
    std::memset(row, 0, l * sizeof(float));
    std::memset(row + l + len, 0, (n - l - len) * sizeof(float));
    WriteProbsRow(p, b, h, i0 + r, ulo, row, n);
  }
  MatOperand pa{scores, DType::kF32, n, 1};
  // P and V in bf16 widened to f32 (exact) for an f32 GEMM, which keeps
  // subnormals: bf16 products are exact in f32.
  auto widen_pv = [&] {
    internal::BF16ToF32(s.h2.data(), scores, rows * n);
    s.vf.resize(n * dv);
    const uint16_t* v0 = static_cast<const uint16_t*>(vb.data);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t x = 0; x < dv; ++x) {
        s.vf[j * dv + x] = BF16ToFloat(v0[j * vb.row_stride + x * vb.col_stride]);
      }
    }
    pa = {scores, DType::kF32, n, 1};
    vb = {s.vf.data(), DType::kF32, dv, 1};
  };
  bool widened = false;
  if (p.kv_dtype == DType::kBF16) {
    s.h2.resize(rows * n);
    internal::F32ToBF16(scores, s.h2.data(), rows * n);
    pa = {s.h2.data(), DType::kBF16, n, 1};
    // Weights of far keys (e^-90) or values near 1e-37 make subnormal
    // products, which the bf16 GEMM flushes: the same bf16 P and V then go
    // through an f32 GEMM.
    if (ftz && Bf16GemmMayFlush(MinNonzeroBF16(s.h2.data(), rows, n, n, 1),
                                MinNonzeroBF16(static_cast<const uint16_t*>(vb.data), n,
                                               vb.row_stride, dv, vb.col_stride))) {
      widen_pv();
      widened = true;
    }
  }
  s.c.resize(rows * dv);
  RA_RETURN_IF_ERROR(internal::Gemm(rows, dv, n, pa, vb, s.c.data(), dv, 1));
  // Normal inputs and products can still sum to a subnormal, which the bf16
  // GEMM flushes too: values 3e-38 and -2.5e-38 with weights 0.5 answered 0,
  // not 2.5e-39. Each flushed partial sum loses less than FLT_MIN and an
  // output has fewer than 2n of them (n keys, weights at most 1), so an
  // output 2^24 times above 2n FLT_MIN is exact to f32 rounding. Where one
  // is not (and is not an exact 0: a masked row, or a value channel that is
  // 0 for every key of the tile), the tile's P.V is redone in f32 on the
  // same bf16 values. This task holds every key of its query rows (the
  // softmax is not carried across key tiles), so the redone output is the
  // f32 GEMM's result as it stands.
  if (ftz && !widened) {
    const float bound = static_cast<float>(0x1p24 * 2.0 * static_cast<double>(n) *
                                           std::numeric_limits<float>::min());
    bool suspect = false;
    for (int64_t r = 0; r < rows && !suspect; ++r) {
      if (hi[r] <= lo[r]) continue;  // masked: P's row is 0
      const float* crow = s.c.data() + r * dv;
      for (int64_t x = 0; x < dv; ++x) suspect |= !(std::fabs(crow[x]) >= bound);
    }
    if (suspect) {
      // The value channels that are not 0 for every key of the tile.
      s.vnz.assign(dv, 0);
      const uint16_t* v0 = static_cast<const uint16_t*>(vb.data);
      for (int64_t j = 0; j < n; ++j) {
        const uint16_t* vrow = v0 + j * vb.row_stride;
        for (int64_t x = 0; x < dv; ++x) s.vnz[x] |= vrow[x * vb.col_stride] & 0x7fff;
      }
      suspect = false;
      for (int64_t r = 0; r < rows && !suspect; ++r) {
        if (hi[r] <= lo[r]) continue;
        const float* crow = s.c.data() + r * dv;
        for (int64_t x = 0; x < dv; ++x) {
          suspect |= !(std::fabs(crow[x]) >= bound) && s.vnz[x] != 0;
        }
      }
    }
    if (suspect) {
      widen_pv();
      RA_RETURN_IF_ERROR(internal::Gemm(rows, dv, n, pa, vb, s.c.data(), dv, 1));
    }
  }
  for (int64_t r = 0; r < rows; ++r) WriteOutRow(p, b, i0 + r, h, s.c.data() + r * dv);
  return absl::OkStatus();
}

// The calling thread's packing buffer, kept between calls (a long prefill
// would otherwise pay page faults on every call) unless it grew very large.
std::vector<char>& PackBuffer() {
  thread_local std::vector<char> buffer;
  return buffer;
}

// Copies the visible rows [first, first + n) of (batch b, kv head j) of K
// and V into dense head-major buffers.
void PackHead(const Plan& p, int64_t b, int64_t j, int64_t first, int64_t n, char* k, char* v) {
  const size_t es = DTypeSize(p.kv_dtype);
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(k + t * p.head_dim * es,
                static_cast<const char*>(p.k.raw()) +
                    (b * p.k.stride(0) + (first + t) * p.k.stride(1) + j * p.k.stride(2)) * es,
                p.head_dim * es);
    std::memcpy(v + t * p.v_dim * es,
                static_cast<const char*>(p.v.raw()) +
                    (b * p.v.stride(0) + (first + t) * p.v.stride(1) + j * p.v.stride(2)) * es,
                p.v_dim * es);
  }
}

// Whether the prefill's work is cut by (batch, kv head): each thread packs
// one group's K/V at a time into its own buffer and runs all of the group's
// query heads and blocks against it, so the group's rows stay in cache
// across its tasks and no call-sized buffer is faulted in. Needs groups
// enough to keep every thread busy to the end (a group is one thread's).
bool PrefillByGroup(const Plan& p, int threads) {
  const int64_t groups = p.batch * p.kv_heads;
  return groups >= threads && (groups % threads == 0 || groups >= 4 * threads);
}

absl::Status RunPrefill(const Plan& p) {
  const int64_t blocks = (p.q_len + kPrefillBlock - 1) / kPrefillBlock;
  const int64_t tasks = p.batch * p.heads * blocks;
  // Keys any query can see.
  int64_t first = p.k_len, last = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t i = 0; i < p.q_len; ++i) {
      int64_t lo, hi;
      p.KeyRange(b, i, &lo, &hi);
      if (hi > lo) {
        first = std::min(first, lo);
        last = std::max(last, hi);
      }
    }
  }
  PackedKV kv;
  kv.first = first;
  kv.n = last > first ? last - first : 0;
  const size_t es = DTypeSize(p.kv_dtype);
  // Packing copies every visible K/V row once (into memory the first touch
  // faults in) so that the GEMMs read them contiguously; it pays off when
  // each row is read by several query blocks, not for one block (a short
  // prefill against a long history: a chunk, a speculative step). Measured
  // (AVX2, f32, 32 heads, d 128, 4096 keys, 1 thread), packed / in place:
  // 17 queries 154 / 48 ms, 64 queries 186 / 77 ms, 128 queries 258 / 134
  // ms; a causal 512 x 512 prefill (4 blocks) 28 / 32 ms, 2048 x 2048 (16)
  // 339 / 383 ms and, with 4 heads per kv head, 263 / 377 ms.
  kv.direct = p.k.stride(3) == 1 && p.v.stride(3) == 1 && blocks == 1;
  const int threads = static_cast<int>(std::min<int64_t>(p.threads, std::max<int64_t>(tasks, 1)));
  kv.one_head = !kv.direct && PrefillByGroup(p, threads);
  const int64_t group_k_bytes = kv.n * p.head_dim * static_cast<int64_t>(es);
  const int64_t group_v_bytes = kv.n * p.v_dim * static_cast<int64_t>(es);
  const int64_t k_bytes = (kv.one_head ? 1 : p.batch * p.kv_heads) * group_k_bytes;
  const int64_t v_bytes = (kv.one_head ? 1 : p.batch * p.kv_heads) * group_v_bytes;
  FirstError err;
  auto run = [&](const PackedKV& packed, int64_t b, int64_t h, int64_t blk) {
    const int64_t i0 = blk * kPrefillBlock;
    const int64_t i1 = std::min(p.q_len, i0 + kPrefillBlock);
    if (ShouldStop(p.stop)) {
      err.Set(p.stop->status());
      return;
    }
    absl::Status s = PrefillTask(p, packed, b, h, i0, i1);
    if (!s.ok()) err.Set(std::move(s));
  };
  if (kv.one_head) {
    const int64_t groups = p.batch * p.kv_heads;
#pragma omp parallel num_threads(threads)
    {
      omp_set_num_threads(1);
      // Each thread's own buffer (thread_local here is the worker's).
      std::vector<char>& buffer = PackBuffer();
      if (buffer.size() < static_cast<size_t>(k_bytes + v_bytes)) buffer.resize(k_bytes + v_bytes);
      PackedKV mine = kv;
      mine.k = buffer.data();
      mine.v = buffer.data() + k_bytes;
#pragma omp for schedule(dynamic, 1)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t b = g / p.kv_heads, j = g % p.kv_heads;
        if (ShouldStop(p.stop)) {
          err.Set(p.stop->status());
          continue;
        }
        PackHead(p, b, j, first, kv.n, buffer.data(), buffer.data() + k_bytes);
        for (int64_t h = j * p.group; h < (j + 1) * p.group; ++h) {
          for (int64_t blk = 0; blk < blocks; ++blk) run(mine, b, h, blk);
        }
      }
      // Each thread of each worker keeps its own: kept only while a group's
      // K/V is small (S2048 at d 128, f32: 2 MiB).
      if (buffer.size() > kMaxRetainedGroupPackBytes) std::vector<char>().swap(buffer);
      TrimThreadScratch();
    }
    return err.Get();
  }
  std::vector<char>& buffer = PackBuffer();
  if (!kv.direct) {
    if (buffer.size() < static_cast<size_t>(k_bytes + v_bytes)) buffer.resize(k_bytes + v_bytes);
    kv.k = buffer.data();
    kv.v = buffer.data() + k_bytes;
  }
#pragma omp parallel num_threads(threads)
  {
    omp_set_num_threads(1);
    // Pack: one pass over the visible K/V rows.
#pragma omp for schedule(static)
    for (int64_t g = 0; g < (kv.direct ? 0 : p.batch * p.kv_heads); ++g) {
      PackHead(p, g / p.kv_heads, g % p.kv_heads, first, kv.n,
               buffer.data() + g * group_k_bytes, buffer.data() + k_bytes + g * group_v_bytes);
    }
    // Later query blocks see more keys under a causal mask: hand them out
    // first so the tail of the schedule is made of short tasks.
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t bh = t % (p.batch * p.heads);
      run(kv, bh / p.heads, bh % p.heads, blocks - 1 - t / (p.batch * p.heads));
    }
    TrimThreadScratch();
  }
  // Kept between calls only while small: a worker must not hold a large
  // request's packed K/V (uncharged memory) after the call.
  if (buffer.size() > kMaxRetainedPackBytes) std::vector<char>().swap(buffer);
  return err.Get();
}

// Last line of defence: never hand back a non-finite number.
absl::Status CheckResultFinite(const TensorView& out) {
  absl::Status fin = CheckFinite(out, "out");
  if (!fin.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("attention result overflowed the float range (",
                                                   fin.message(), "); reduce the magnitude of v"));
  }
  return absl::OkStatus();
}

}  // namespace

AttentionPath ChooseAttentionPath(int64_t q_len, int64_t heads, int64_t kv_heads,
                                  bool return_probs) {
  const int64_t group = kv_heads > 0 ? heads / kv_heads : 1;
  // The decode kernel's cost per key grows with the rows sharing a kv head;
  // past a few dozen rows the GEMM path is faster even though it rereads K/V.
  if (q_len <= 16 && q_len * group <= 64) return AttentionPath::kDecode;
  return AttentionPath::kPrefill;
}

absl::Status Attend(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                    const AttentionOptions& options, TensorView out, TensorView probs) {
  RA_ASSIGN_OR_RETURN(Plan p, MakePlan(q, k, v, options, out, probs));
  if (p.batch == 0 || p.q_len == 0 || p.heads == 0) return absl::OkStatus();
  AttentionPath path = ChooseAttentionPath(p.q_len, p.heads, p.kv_heads, !probs.empty_view());
  if (options.force_path == AttentionOptions::Path::kDecode) path = AttentionPath::kDecode;
  if (options.force_path == AttentionOptions::Path::kPrefill) path = AttentionPath::kPrefill;
  if (p.head_dim == 0 || p.v_dim == 0) path = AttentionPath::kDecode;  // oneDNN dislikes 0-dims
  absl::Status s = path == AttentionPath::kDecode ? RunDecode(p) : RunPrefill(p);
  if (!s.ok()) return s;
  return CheckResultFinite(out);
}

namespace {

// The plan of an AttendCache call (shapes checked), and the path it takes.
absl::StatusOr<Plan> MakeCachePlan(const ConstTensorView& q, const KvCache& cache, int64_t length,
                                   const AttentionOptions& options, const TensorView& out,
                                   const TensorView& probs) {
  RA_RETURN_IF_ERROR(CheckBSHD(q, "q"));
  RA_RETURN_IF_ERROR(CheckBSHD(out, "out"));
  if (q.dim(0) != 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "q must have batch 1 against a KvCache, got shape %s", DimsToString(q.dims())));
  }
  if (length < 0 || length > cache.capacity()) {
    return absl::OutOfRangeError(absl::StrFormat(
        "length %d is outside the KvCache's capacity of %d", length, cache.capacity()));
  }
  if (q.dim(3) != cache.head_dim()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "head_dim of q (%d) and of the KvCache (%d) differ", q.dim(3), cache.head_dim()));
  }
  Plan p;
  p.batch = 1;
  p.q_len = q.dim(1);
  p.heads = q.dim(2);
  p.head_dim = q.dim(3);
  p.k_len = length;
  p.kv_heads = cache.kv_heads();
  p.v_dim = cache.v_dim();
  p.kv_dtype = DType::kF32;
  p.cache = &cache;
  RA_RETURN_IF_ERROR(PlanCommon(q, options, out, probs, p));
  return p;
}

absl::StatusOr<Plan> MakePagedPlan(const ConstTensorView& q, const PagedKvView& kv, int64_t length,
                                   const AttentionOptions& options, const TensorView& out,
                                   const TensorView& probs) {
  RA_RETURN_IF_ERROR(CheckBSHD(q, "q"));
  RA_RETURN_IF_ERROR(CheckBSHD(out, "out"));
  if (q.dim(0) != 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "q must have batch 1 against paged rows, got shape %s", DimsToString(q.dims())));
  }
  if (kv.pages < 0 || kv.page_tokens < 0 || kv.kv_heads < 1 || kv.head_dim < 0 || kv.v_dim < 0 ||
      (kv.pages > 0 && kv.page_tokens < 1) || (kv.pages > 1 && kv.page_tokens % 8 != 0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a paged view needs pages >= 0, page_tokens >= 1 (a multiple of 8 for several pages), "
        "kv_heads >= 1, head_dim and v_dim >= 0; got %d, %d, %d, %d, %d",
        kv.pages, kv.page_tokens, kv.kv_heads, kv.head_dim, kv.v_dim));
  }
  const bool int8 = kv.type == PagedKvView::Type::kInt8;
  if (kv.pages > 0 && (kv.k_pages == nullptr || kv.v_pages == nullptr ||
                       (int8 && (kv.k_scales == nullptr || kv.v_scales == nullptr)))) {
    return absl::InvalidArgumentError("a paged view needs its page (and int8 scale) pointers");
  }
  for (int64_t n = 0; n < kv.pages; ++n) {
    if (kv.k_pages[n] == nullptr || kv.v_pages[n] == nullptr ||
        (int8 && (kv.k_scales[n] == nullptr || kv.v_scales[n] == nullptr))) {
      return absl::InvalidArgumentError(absl::StrFormat("page %d of the paged view is missing", n));
    }
  }
  if (kv.tiles && kv.page_tokens != KvCache::kTile) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a paged view in tiles holds pages of %d tokens; got page_tokens %d", KvCache::kTile,
        kv.page_tokens));
  }
  int64_t token_rows = kv.token_rows, head_rows = kv.head_rows;
  if (kv.tiles || (token_rows == 0 && head_rows == 0)) {
    token_rows = kv.kv_heads;  // unused for tiles
    head_rows = 1;
  }
  if (!(token_rows == kv.kv_heads && head_rows == 1) &&
      !(token_rows == 1 && head_rows == kv.page_tokens)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a paged view's rows are token-major (token_rows %d = kv_heads, head_rows 1) or "
        "head-major (token_rows 1, head_rows %d = page_tokens); got %d and %d",
        kv.kv_heads, kv.page_tokens, kv.token_rows, kv.head_rows));
  }
  if (length < 0 || length > kv.pages * kv.page_tokens) {
    return absl::OutOfRangeError(absl::StrFormat("length %d is outside the paged view's %d rows",
                                                 length, kv.pages * kv.page_tokens));
  }
  if (q.dim(3) != kv.head_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "head_dim of q (%d) and of the paged rows (%d) differ", q.dim(3), kv.head_dim));
  }
  Plan p;
  p.batch = 1;
  p.q_len = q.dim(1);
  p.heads = q.dim(2);
  p.head_dim = q.dim(3);
  p.k_len = length;
  p.kv_heads = kv.kv_heads;
  p.v_dim = kv.v_dim;
  // int8 is computed in f32 from the dequantized values.
  p.kv_dtype = kv.type == PagedKvView::Type::kBF16 ? DType::kBF16 : DType::kF32;
  p.paged = &kv;
  p.page_token_rows = token_rows;
  p.page_head_rows = head_rows;
  RA_RETURN_IF_ERROR(PlanCommon(q, options, out, probs, p));
  return p;
}

AttentionPath PathOf(const Plan& p, const AttentionOptions& options, bool probs) {
  AttentionPath path = ChooseAttentionPath(p.q_len, p.heads, p.kv_heads, probs);
  if (options.force_path == AttentionOptions::Path::kDecode) path = AttentionPath::kDecode;
  if (options.force_path == AttentionOptions::Path::kPrefill) path = AttentionPath::kPrefill;
  if (p.head_dim == 0 || p.v_dim == 0) path = AttentionPath::kDecode;  // oneDNN dislikes 0-dims
  return path;
}

// A long step against a cache: its GEMMs cost far more than one copy of the rows.
absl::Status CachePrefill(const ConstTensorView& q, const KvCache& cache, int64_t length,
                          const AttentionOptions& options, const TensorView& out,
                          const TensorView& probs) {
  RA_ASSIGN_OR_RETURN(Tensor k,
                      Tensor::Create(DType::kF32, {1, length, cache.kv_heads(), cache.head_dim()}));
  RA_ASSIGN_OR_RETURN(Tensor v,
                      Tensor::Create(DType::kF32, {1, length, cache.kv_heads(), cache.v_dim()}));
  RA_RETURN_IF_ERROR(cache.ReadK(0, k.view()));
  RA_RETURN_IF_ERROR(cache.ReadV(0, v.view()));
  AttentionOptions o = options;
  o.check_finite = false;
  o.force_path = AttentionOptions::Path::kPrefill;
  return Attend(q, k.cview(), v.cview(), o, out, probs);
}

// A long step against pages: the rows gathered once (int8: dequantized),
// then Attend's prefill.
absl::Status PagedPrefill(const ConstTensorView& q, const PagedKvView& kv, int64_t length,
                          const AttentionOptions& options, const TensorView& out,
                          const TensorView& probs) {
  const DType dtype = kv.type == PagedKvView::Type::kBF16 ? DType::kBF16 : DType::kF32;
  RA_ASSIGN_OR_RETURN(Tensor k, Tensor::Create(dtype, {1, length, kv.kv_heads, kv.head_dim}));
  RA_ASSIGN_OR_RETURN(Tensor v, Tensor::Create(dtype, {1, length, kv.kv_heads, kv.v_dim}));
  const int64_t es = DTypeSize(dtype);
  const bool head_major = kv.head_rows == kv.page_tokens && kv.token_rows == 1 && kv.kv_heads > 1;
  // Row (t, j) of the page into row t0 + t, head j of the tensor.
  auto gather = [&](const void* page, const float* scales, int64_t t, int64_t j, int64_t dim,
                    char* base, bool keys) {
    const int64_t r = head_major ? j * kv.page_tokens + t : t * kv.kv_heads + j;
    char* dst = base + (t * kv.kv_heads + j) * dim * es;
    if (kv.tiles && kv.type == PagedKvView::Type::kInt8) {
      // As below, int8 codes dequantized with the scale of (t, j) at j * P + t.
      const int8_t* c = static_cast<const int8_t*>(page);
      const int64_t P = kv.page_tokens;
      const float scale = scales[j * P + t];
      float* f = reinterpret_cast<float*>(dst);
      for (int64_t x = 0; x < dim; ++x) {
        f[x] = scale * static_cast<float>(c[keys ? (j * dim + x) * P + t : (j * P + t) * dim + x]);
      }
      return;
    }
    if (kv.tiles) {
      // K (t, j, x) at (j * dim + x) * P + t; V row (t, j) at (j * P + t),
      // elements of es bytes (f32 or bf16).
      const char* f = static_cast<const char*>(page);
      const int64_t P = kv.page_tokens;
      if (keys) {
        for (int64_t x = 0; x < dim; ++x) {
          std::memcpy(dst + x * es, f + ((j * dim + x) * P + t) * es, es);
        }
      } else {
        std::memcpy(dst, f + (j * P + t) * dim * es, dim * es);
      }
      return;
    }
    if (kv.type != PagedKvView::Type::kInt8) {
      std::memcpy(dst, static_cast<const char*>(page) + r * dim * es, dim * es);
      return;
    }
    const int8_t* src = static_cast<const int8_t*>(page) + r * dim;
    float* f = reinterpret_cast<float*>(dst);
    for (int64_t x = 0; x < dim; ++x) f[x] = scales[r] * static_cast<float>(src[x]);
  };
  const bool int8 = kv.type == PagedKvView::Type::kInt8;
  for (int64_t t0 = 0; t0 < length; t0 += kv.page_tokens) {
    const int64_t page = t0 / kv.page_tokens;
    const int64_t tokens = std::min(kv.page_tokens, length - t0);
    char* kd = k.data<char>() + t0 * kv.kv_heads * kv.head_dim * es;
    char* vd = v.data<char>() + t0 * kv.kv_heads * kv.v_dim * es;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < kv.kv_heads; ++j) {
        gather(kv.k_pages[page], int8 ? kv.k_scales[page] : nullptr, t, j, kv.head_dim, kd, true);
        gather(kv.v_pages[page], int8 ? kv.v_scales[page] : nullptr, t, j, kv.v_dim, vd, false);
      }
    }
  }
  AttentionOptions o = options;
  o.check_finite = false;
  o.force_path = AttentionOptions::Path::kPrefill;
  return Attend(q, k.cview(), v.cview(), o, out, probs);
}

}  // namespace

namespace {

// One row's scale for its largest magnitude m > 0: m / 127, at least the
// smallest denormal, and finite times 127.
float Int8Scale(float m) {
  float scale = m / 127.0f;
  if (scale < std::numeric_limits<float>::min()) {
    // A denormal scale sits on the grid of 2^-149 steps, where m / 127
    // rounded to nearest could clamp the largest code (m of 300 steps at a
    // scale of 2 steps is 150): the scale is rounded up instead, so every
    // code is within [-127, 127] unclamped and within half a step (m is a
    // whole number of steps below 2^30, so the quotient and its ceiling
    // are exact in double). A row below 127 steps (m / 127 would be 0, and
    // 0 / 0) gets the smallest denormal, exact for such values.
    const double steps = std::ceil(std::ldexp(static_cast<double>(m), 149) / 127.0);
    return static_cast<float>(std::ldexp(std::max(steps, 1.0), -149));
  }
  // Near FLT_MAX, m / 127 rounded up would read 127 back as +-Inf: the
  // next float down keeps every stored row finite (its quotients still
  // round into [-127, 127]).
  if (!std::isfinite(127.0f * scale)) scale = std::nextafter(scale, 0.0f);
  return scale;
}

// The row's codes at `scale`; returns the largest |code|.
int QuantizeRow(const float* row, int64_t dim, float scale, int8_t* out) {
  int top = 0;
  for (int64_t i = 0; i < dim; ++i) {
    // Round to nearest even (the default rounding mode); |x| <= m keeps
    // the quotient within [-127, 127] up to one rounding of the division.
    const float t = std::clamp(std::nearbyint(row[i] / scale), -127.0f, 127.0f);
    out[i] = static_cast<int8_t>(t);
    top = std::max(top, std::abs(static_cast<int>(out[i])));
  }
  return top;
}

}  // namespace

void QuantizeInt8Rows(const float* x, int64_t x_stride, int64_t rows, int64_t dim, int8_t* q,
                      float* scales) {
  std::vector<float> held;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * x_stride;
    float m = 0.0f;
    bool finite = true;
    for (int64_t i = 0; i < dim; ++i) {
      finite = finite && std::isfinite(row[i]);
      m = std::max(m, std::fabs(row[i]));
    }
    int8_t* out = q + r * dim;
    if (!finite) {
      // Non-finite input (not yet refused by the caller's checks): the row
      // reads back as NaN (0 x NaN), never as a made-up value, and no NaN
      // is converted to int8 (undefined behaviour).
      scales[r] = std::numeric_limits<float>::quiet_NaN();
      std::memset(out, 0, dim);
      continue;
    }
    if (m == 0.0f) {
      scales[r] = 0.0f;
      std::memset(out, 0, dim);
      continue;
    }
    float scale = Int8Scale(m);
    int top = QuantizeRow(row, dim, scale, out);
    // The stored row must quantize to itself: an exported int8 session
    // (scale x code in f32) opened again as a prefix holds the same cache
    // bit for bit. With a denormal scale of a few steps the largest code can
    // fall short of 127 (m of 890 steps: scale 8, code 111), and the stored
    // row's largest magnitude (888) then gives another scale (7). Such a row
    // is stored as the fixed point of quantizing what it holds: scales only
    // decrease towards it, and one round reached it for every m checked (2^18
    // and 300,000 random m up to 2^30 steps); each round moves a value by at
    // most half of its step.
    for (int round = 0; round < 64; ++round) {
      const float next = Int8Scale(scale * static_cast<float>(top));
      if (next == scale) break;
      held.resize(dim);
      for (int64_t i = 0; i < dim; ++i) held[i] = scale * static_cast<float>(out[i]);
      scale = next;
      top = QuantizeRow(held.data(), dim, scale, out);
    }
    scales[r] = scale;
  }
}

namespace {

// A planned call against a session's stored K/V: the decode kernel on the
// storage itself, or `prefill` (the rows copied out once) for a long step.
template <typename Prefill>
absl::Status RunStored(absl::StatusOr<Plan> plan, const AttentionOptions& options,
                       const TensorView& out, const TensorView& probs, Prefill prefill) {
  if (!plan.ok()) return plan.status();
  const Plan& p = *plan;
  if (p.q_len == 0 || p.heads == 0) return absl::OkStatus();
  if (PathOf(p, options, !probs.empty_view()) == AttentionPath::kPrefill) return prefill();
  RA_RETURN_IF_ERROR(RunDecode(p));
  return CheckResultFinite(out);
}

}  // namespace

absl::Status AttendPaged(ConstTensorView q, const PagedKvView& kv, int64_t length,
                         const AttentionOptions& options, TensorView out, TensorView probs) {
  return RunStored(MakePagedPlan(q, kv, length, options, out, probs), options, out, probs,
                   [&] { return PagedPrefill(q, kv, length, options, out, probs); });
}

absl::Status AttendInt8(ConstTensorView q, const Int8KvView& kv, int64_t length,
                        const AttentionOptions& options, TensorView out, TensorView probs) {
  if (kv.seq < 0 || kv.kv_heads < 1 || kv.head_dim < 0 || kv.v_dim < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "an int8 view needs seq >= 0, kv_heads >= 1, head_dim and v_dim >= 0; got %d, %d, %d, %d",
        kv.seq, kv.kv_heads, kv.head_dim, kv.v_dim));
  }
  if (kv.seq > 0 &&
      (kv.k == nullptr || kv.k_scale == nullptr || kv.v == nullptr || kv.v_scale == nullptr)) {
    return absl::InvalidArgumentError("an int8 view of rows needs its k, v and scale pointers");
  }
  if (length < 0 || length > kv.seq) {
    return absl::OutOfRangeError(
        absl::StrFormat("length %d is outside the int8 view's %d rows", length, kv.seq));
  }
  // One page holding every row.
  const void* k = kv.k;
  const void* v = kv.v;
  const float* ks = kv.k_scale;
  const float* vs = kv.v_scale;
  PagedKvView one;
  one.type = PagedKvView::Type::kInt8;
  one.k_pages = &k;
  one.v_pages = &v;
  one.k_scales = &ks;
  one.v_scales = &vs;
  one.pages = kv.seq > 0 ? 1 : 0;
  one.page_tokens = kv.seq;
  one.kv_heads = kv.kv_heads;
  one.head_dim = kv.head_dim;
  one.v_dim = kv.v_dim;
  return AttendPaged(q, one, length, options, out, probs);
}

absl::Status AttendCache(ConstTensorView q, const KvCache& cache, int64_t length,
                         const AttentionOptions& options, TensorView out, TensorView probs) {
  return RunStored(MakeCachePlan(q, cache, length, options, out, probs), options, out, probs,
                   [&] { return CachePrefill(q, cache, length, options, out, probs); });
}

void AttendBatch(absl::Span<AttentionJob> jobs, int threads) {
  std::vector<Plan> plans(jobs.size());
  std::vector<const Plan*> decode;
  std::vector<AttentionJob*> decode_jobs;
  for (size_t n = 0; n < jobs.size(); ++n) {
    AttentionJob& j = jobs[n];
    absl::StatusOr<Plan> plan =
        j.cache != nullptr
            ? MakeCachePlan(j.q, *j.cache, j.cache_length, j.options, j.out, TensorView())
        : j.paged != nullptr
            ? MakePagedPlan(j.q, *j.paged, j.cache_length, j.options, j.out, TensorView())
            : MakePlan(j.q, j.k, j.v, j.options, j.out, TensorView());
    if (!plan.ok()) {
      j.status = plan.status();
      continue;
    }
    plans[n] = *std::move(plan);
    const Plan& p = plans[n];
    j.status = absl::OkStatus();
    if (p.batch == 0 || p.q_len == 0 || p.heads == 0) continue;
    if (PathOf(p, j.options, false) == AttentionPath::kPrefill) {
      // A prompt: its own tiled GEMM pass, one after another.
      j.status = j.cache != nullptr
                     ? CachePrefill(j.q, *j.cache, j.cache_length, j.options, j.out, TensorView())
                 : j.paged != nullptr
                     ? PagedPrefill(j.q, *j.paged, j.cache_length, j.options, j.out, TensorView())
                     : RunPrefill(p);
      if (j.status.ok()) j.status = CheckResultFinite(j.out);
      continue;
    }
    decode.push_back(&p);
    decode_jobs.push_back(&j);
  }
  if (decode.empty()) return;
  std::deque<DecodeRun> runs;
  PrepareDecodeRuns(decode, runs);
  RunDecodePass(runs, threads);
  for (size_t n = 0; n < decode.size(); ++n) {
    decode_jobs[n]->status = runs[n].err.Get();
    if (decode_jobs[n]->status.ok())
      decode_jobs[n]->status = CheckResultFinite(decode_jobs[n]->out);
  }
  runs.clear();
  TrimDecodePool();
}

}  // namespace ropeattn
