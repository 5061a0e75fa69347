#include "core/relative_bias.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/limits.h"
#include "core/status_macros.h"

namespace ropeattn {
namespace {

// Buckets per direction (n) and the width of the exact range (max_exact) in
// T5's rule.
struct T5Split {
  int64_t n;
  int64_t max_exact;
};

T5Split SplitOf(const T5BucketConfig& config) {
  const int64_t n = config.bidirectional ? config.num_buckets / 2 : config.num_buckets;
  return {n, n / 2};
}

absl::Status CheckLengths(int64_t q_len, int64_t k_len, int64_t q_offset) {
  if (q_len < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("q_len must be >= 0, got %d", q_len));
  }
  if (k_len < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("k_len must be >= 0, got %d", k_len));
  }
  // Keeps q_offset + i and the differences j - q_pos inside int64; the same
  // bound as every other position (core/limits.h).
  RA_RETURN_IF_ERROR(CheckPositions(q_offset, q_len, "q_offset", "q_len"));
  return CheckPositions(0, k_len, "", "k_len");
}

}  // namespace

absl::Status ValidateT5BucketConfig(const T5BucketConfig& config) {
  if (config.num_buckets < 2) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_buckets must be >= 2, got %d", config.num_buckets));
  }
  if (config.bidirectional) {
    if (config.num_buckets % 2 != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "num_buckets must be even when bidirectional, got %d", config.num_buckets));
    }
    // With 2 buckets each direction has one bucket and an exact range of 0,
    // and T5's log(r / max_exact) divides by zero.
    if (config.num_buckets < 4) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "num_buckets must be >= 4 when bidirectional, got %d", config.num_buckets));
    }
  }
  const T5Split split = SplitOf(config);
  if (config.max_distance <= split.max_exact) {
    return absl::InvalidArgumentError(
        absl::StrFormat("max_distance must be > the exact range %d (num_buckets %d, %s), got %d",
                        split.max_exact, config.num_buckets,
                        config.bidirectional ? "bidirectional" : "causal", config.max_distance));
  }
  return absl::OkStatus();
}

int T5RelativeBucket(int64_t relative_position, const T5BucketConfig& config) {
  const T5Split split = SplitOf(config);
  int64_t bucket = 0;
  // Distance as a double: exact below 2^53 and, unlike -INT64_MIN, never
  // overflows. Far distances all land in the last bucket anyway.
  double r;
  if (config.bidirectional) {
    if (relative_position > 0) bucket = split.n;
    r = std::fabs(static_cast<double>(relative_position));
  } else {
    r = relative_position < 0 ? -static_cast<double>(relative_position) : 0.0;
  }
  if (r < static_cast<double>(split.max_exact)) {
    return static_cast<int>(bucket + static_cast<int64_t>(r));
  }
  const double me = static_cast<double>(split.max_exact);
  const double scaled = std::log(r / me) / std::log(config.max_distance / me) *
                        static_cast<double>(split.n - split.max_exact);
  // Compare before converting: a huge r would overflow the integer cast.
  const double last = static_cast<double>(split.n - 1);
  const double log_bucket = std::min(last, me + std::floor(scaled));
  return static_cast<int>(bucket + static_cast<int64_t>(log_bucket));
}

absl::StatusOr<Tensor> T5Bias(ConstTensorView table, const T5BucketConfig& config, int64_t q_len,
                              int64_t k_len, int64_t q_offset) {
  RA_RETURN_IF_ERROR(ValidateT5BucketConfig(config));
  RA_RETURN_IF_ERROR(CheckRank(table, 2, "t5 table"));
  if (table.dim(0) != config.num_buckets) {
    return absl::InvalidArgumentError(
        absl::StrFormat("t5 table has %d buckets (shape %s), config says num_buckets %d",
                        table.dim(0), DimsToString(table.dims()), config.num_buckets));
  }
  const int64_t heads = table.dim(1);
  if (heads < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "t5 table must have at least one head, got shape %s", DimsToString(table.dims())));
  }
  RA_RETURN_IF_ERROR(CheckLengths(q_len, k_len, q_offset));
  RA_RETURN_IF_ERROR(CheckFinite(table, "t5 table"));
  RA_ASSIGN_OR_RETURN(Tensor out, Tensor::Create(DType::kF32, {heads, q_len, k_len}));
  // An empty bias has nothing to fill: its other extents (up to 2^40) must
  // not drive loops.
  if (out.num_elements() == 0) return out;

  // Buckets depend only on j - q_pos, which spans [-(q_offset + q_len - 1), k_len - 1 - q_offset]:
  // bucket that range once instead of per (i, j).
  const int64_t min_rel = -(q_offset + q_len - 1);
  const int64_t max_rel = k_len - 1 - q_offset;
  std::vector<int> bucket_of(static_cast<size_t>(max_rel - min_rel + 1));
  for (int64_t rel = min_rel; rel <= max_rel; ++rel) {
    bucket_of[rel - min_rel] = T5RelativeBucket(rel, config);
  }
  // A dense f32 copy of the (small) table keeps dtype and stride handling out
  // of the inner loop.
  std::vector<float> values(static_cast<size_t>(config.num_buckets * heads));
  for (int64_t b = 0; b < config.num_buckets; ++b) {
    for (int64_t h = 0; h < heads; ++h) values[b * heads + h] = table.GetFloat({b, h});
  }
  float* o = out.data<float>();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t q_pos = q_offset + i;
      float* row = o + (h * q_len + i) * k_len;
      for (int64_t j = 0; j < k_len; ++j) {
        row[j] = values[bucket_of[j - q_pos - min_rel] * heads + h];
      }
    }
  }
  return out;
}

absl::StatusOr<std::vector<double>> AlibiSlopes(int64_t num_heads) {
  // Far beyond any model; bounds the allocation for a hostile request.
  constexpr int64_t kMaxHeads = int64_t{1} << 16;
  if (num_heads < 1 || num_heads > kMaxHeads) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_heads must be in [1, %d], got %d", kMaxHeads, num_heads));
  }
  int64_t p = 1;  // the largest power of two <= num_heads
  while (p * 2 <= num_heads) p *= 2;
  std::vector<double> slopes;
  slopes.reserve(static_cast<size_t>(num_heads));
  // (2^(-8/P))^k == 2^(-8k/P): one exp2 per slope, no accumulated rounding.
  for (int64_t k = 1; k <= p; ++k) {
    slopes.push_back(std::exp2(-8.0 * static_cast<double>(k) / static_cast<double>(p)));
  }
  // Extra heads interleave between the first ones: odd powers of 2^(-8/(2P)).
  for (int64_t k = 1; static_cast<int64_t>(slopes.size()) < num_heads; k += 2) {
    slopes.push_back(std::exp2(-8.0 * static_cast<double>(k) / static_cast<double>(2 * p)));
  }
  return slopes;
}

absl::StatusOr<Tensor> AlibiBias(absl::Span<const double> slopes, int64_t q_len, int64_t k_len,
                                 int64_t q_offset, bool bidirectional) {
  if (slopes.empty()) {
    return absl::InvalidArgumentError("alibi slopes must not be empty (one per head)");
  }
  for (size_t h = 0; h < slopes.size(); ++h) {
    if (!std::isfinite(slopes[h])) {
      return absl::InvalidArgumentError(
          absl::StrFormat("alibi slopes[%d] must be finite, got %g", h, slopes[h]));
    }
  }
  RA_RETURN_IF_ERROR(CheckLengths(q_len, k_len, q_offset));
  const int64_t heads = static_cast<int64_t>(slopes.size());
  RA_ASSIGN_OR_RETURN(Tensor out, Tensor::Create(DType::kF32, {heads, q_len, k_len}));
  // An empty bias has nothing to fill: its other extents (up to 2^40) must
  // not drive loops.
  if (out.num_elements() == 0) return out;
  float* o = out.data<float>();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t q_pos = q_offset + i;
      float* row = o + (h * q_len + i) * k_len;
      for (int64_t j = 0; j < k_len; ++j) {
        int64_t distance = q_pos - j;
        if (bidirectional && distance < 0) distance = -distance;
        row[j] = static_cast<float>(-slopes[h] * static_cast<double>(distance));
      }
    }
  }
  return out;
}

}  // namespace ropeattn
