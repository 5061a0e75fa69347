// Helpers shared by the core tests: seeded random tensors and comparisons
// with stated, norm-wise tolerances.
#ifndef ROPEATTN_TESTS_CORE_TEST_UTIL_H_
#define ROPEATTN_TESTS_CORE_TEST_UTIL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "core/tensor.h"
#include "gtest/gtest.h"

namespace ropeattn::testing {

// Tolerances (relative, norm-wise: ||actual - expected||_2 / ||expected||_2).
inline constexpr double kF32Tol = 1e-5;
inline constexpr double kBF16Tol = 1e-2;

// Uniform in [lo, hi), deterministic for a seed. bf16 tensors hold the
// rounded values (so a reference reading them back sees exactly the input).
Tensor RandomTensor(DType dtype, absl::Span<const int64_t> dims, uint64_t seed, float lo = -1.0f,
                    float hi = 1.0f);
// Elements of any view in row-major order of its dims, as doubles.
std::vector<double> ToDoubles(const ConstTensorView& view);
// A dense tensor holding `values` (rounded to dtype).
Tensor FromDoubles(DType dtype, absl::Span<const int64_t> dims, absl::Span<const double> values);
// Random integers in [lo, hi].
std::vector<int64_t> RandomInts(size_t n, int64_t lo, int64_t hi, uint64_t seed);

// ||a - e|| / max(||e||, 1e-30); also reports the worst element on failure.
double RelativeError(absl::Span<const double> actual, absl::Span<const double> expected);
::testing::AssertionResult AllClose(absl::Span<const double> actual,
                                    absl::Span<const double> expected, double tol);

}  // namespace ropeattn::testing

#endif  // ROPEATTN_TESTS_CORE_TEST_UTIL_H_
