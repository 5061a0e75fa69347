#include "tests/core/test_util.h"

#include <cmath>
#include <random>

#include "absl/strings/str_format.h"

namespace ropeattn::testing {

Tensor RandomTensor(DType dtype, absl::Span<const int64_t> dims, uint64_t seed, float lo,
                    float hi) {
  Tensor t = Tensor::Create(dtype, dims).value();
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    float x = dist(rng);
    if (dtype == DType::kF32) {
      t.data<float>()[i] = x;
    } else {
      t.data<uint16_t>()[i] = FloatToBF16(x);
    }
  }
  return t;
}

std::vector<double> ToDoubles(const ConstTensorView& view) {
  std::vector<double> out;
  const int64_t n = view.num_elements();
  out.reserve(n);
  Dims index(view.rank(), 0);
  for (int64_t i = 0; i < n; ++i) {
    out.push_back(view.GetFloat(index));
    for (int a = view.rank() - 1; a >= 0; --a) {
      if (++index[a] < view.dim(a)) break;
      index[a] = 0;
    }
  }
  return out;
}

Tensor FromDoubles(DType dtype, absl::Span<const int64_t> dims, absl::Span<const double> values) {
  Tensor t = Tensor::Create(dtype, dims).value();
  EXPECT_EQ(static_cast<int64_t>(values.size()), t.num_elements());
  for (int64_t i = 0; i < t.num_elements() && i < static_cast<int64_t>(values.size()); ++i) {
    if (dtype == DType::kF32) {
      t.data<float>()[i] = static_cast<float>(values[i]);
    } else {
      t.data<uint16_t>()[i] = FloatToBF16(static_cast<float>(values[i]));
    }
  }
  return t;
}

std::vector<int64_t> RandomInts(size_t n, int64_t lo, int64_t hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> dist(lo, hi);
  std::vector<int64_t> out(n);
  for (auto& x : out) x = dist(rng);
  return out;
}

double RelativeError(absl::Span<const double> actual, absl::Span<const double> expected) {
  double num = 0, den = 0;
  for (size_t i = 0; i < actual.size() && i < expected.size(); ++i) {
    const double d = actual[i] - expected[i];
    num += d * d;
    den += expected[i] * expected[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

::testing::AssertionResult AllClose(absl::Span<const double> actual,
                                    absl::Span<const double> expected, double tol) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << "size mismatch: " << actual.size() << " vs " << expected.size();
  }
  for (size_t i = 0; i < actual.size(); ++i) {
    if (!std::isfinite(actual[i])) {
      return ::testing::AssertionFailure() << "element " << i << " is not finite: " << actual[i];
    }
  }
  const double err = RelativeError(actual, expected);
  if (err <= tol) return ::testing::AssertionSuccess();
  size_t worst = 0;
  double worst_d = -1;
  for (size_t i = 0; i < actual.size(); ++i) {
    double d = std::abs(actual[i] - expected[i]);
    if (d > worst_d) {
      worst_d = d;
      worst = i;
    }
  }
  return ::testing::AssertionFailure() << absl::StrFormat(
             "relative error %.3g > tolerance %.3g; worst element %d: got %.9g, want %.9g", err,
             tol, worst, actual[worst], expected[worst]);
}

}  // namespace ropeattn::testing
