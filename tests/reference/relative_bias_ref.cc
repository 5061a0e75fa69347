#include "tests/reference/relative_bias_ref.h"

#include <cmath>

namespace ropeattn::ref {

int T5Bucket(int64_t relative_position, bool bidirectional, int num_buckets, int max_distance) {
  int result = 0;
  double distance;  // double so that -INT64_MIN cannot overflow
  if (bidirectional) {
    num_buckets = num_buckets / 2;
    if (relative_position > 0) result += num_buckets;
    distance = std::abs(static_cast<double>(relative_position));
  } else {
    distance = relative_position < 0 ? -static_cast<double>(relative_position) : 0.0;
  }
  const int max_exact = num_buckets / 2;
  if (distance < max_exact) {
    return result + static_cast<int>(distance);
  }
  const double log_ratio = std::log(distance / max_exact);
  const double log_range = std::log(static_cast<double>(max_distance) / max_exact);
  double large = max_exact + std::floor(log_ratio / log_range * (num_buckets - max_exact));
  if (large > num_buckets - 1) large = num_buckets - 1;
  return result + static_cast<int>(large);
}

std::vector<double> T5Bias(const std::vector<double>& table, int num_buckets, int heads,
                           bool bidirectional, int max_distance, int64_t q_len, int64_t k_len,
                           int64_t q_offset) {
  std::vector<double> out(heads * q_len * k_len);
  for (int h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < q_len; ++i) {
      for (int64_t j = 0; j < k_len; ++j) {
        const int64_t relative = j - (q_offset + i);
        const int bucket = T5Bucket(relative, bidirectional, num_buckets, max_distance);
        out[(h * q_len + i) * k_len + j] = table[bucket * heads + h];
      }
    }
  }
  return out;
}

namespace {

// start, start^2, ..., start^n with start = 2^(-8/n).
std::vector<double> PowerOfTwoSlopes(int n) {
  const double start = std::pow(2.0, -8.0 / n);
  std::vector<double> slopes;
  double value = start;
  for (int k = 0; k < n; ++k) {
    slopes.push_back(value);
    value *= start;
  }
  return slopes;
}

}  // namespace

std::vector<double> AlibiSlopes(int num_heads) {
  int closest = 1;
  while (closest * 2 <= num_heads) closest *= 2;
  std::vector<double> slopes = PowerOfTwoSlopes(closest);
  if (closest == num_heads) return slopes;
  const std::vector<double> doubled = PowerOfTwoSlopes(2 * closest);
  for (int k = 0; static_cast<int>(slopes.size()) < num_heads; k += 2) {
    slopes.push_back(doubled[k]);
  }
  return slopes;
}

std::vector<double> AlibiBias(const std::vector<double>& slopes, int64_t q_len, int64_t k_len,
                              int64_t q_offset, bool bidirectional) {
  const int64_t heads = static_cast<int64_t>(slopes.size());
  std::vector<double> out(heads * q_len * k_len);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < q_len; ++i) {
      for (int64_t j = 0; j < k_len; ++j) {
        double distance = static_cast<double>(q_offset + i) - static_cast<double>(j);
        if (bidirectional) distance = std::abs(distance);
        out[(h * q_len + i) * k_len + j] = -slopes[h] * distance;
      }
    }
  }
  return out;
}

}  // namespace ropeattn::ref
