// Relative position biases: T5 buckets and ALiBi, against literal tables
// derived by hand / with python3, and against the plain fp64 reference in
// tests/reference/relative_bias_ref.
//
// Tolerances: buckets are compared exactly; T5Bias is a gather of table
// values, compared within kF32Tol (it should in fact be exact); ALiBi slopes
// within 1e-13 relative (the reference forms start^k by repeated products, so
// it carries up to ~k rounding errors, k <= 128); literal slope tables within
// 4 ulp (EXPECT_DOUBLE_EQ); ALiBi bias (stored f32) within kF32Tol.
#include "core/relative_bias.h"

#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/reference/relative_bias_ref.h"

namespace ropeattn {
namespace {

using ::ropeattn::testing::AllClose;
using ::ropeattn::testing::kF32Tol;
using ::ropeattn::testing::RandomTensor;
using ::ropeattn::testing::ToDoubles;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------
// T5 buckets

const int64_t kRelatives[] = {-200, -128, -100, -64, -32, -20, -16, -9, -8,  -7,  -1, 0,
                              1,    7,    8,    9,   16,  20,  32,  64, 100, 128, 200};

// 32 buckets, max_distance 128, bidirectional: n = 16 per direction,
// max_exact = 8; |rel| < 8 is exact, otherwise 8 + floor(ln(r/8)/ln(16) * 8)
// capped at 15; positive rel adds 16. E.g. rel -20: ln(2.5)/ln(16)*8 = 2.64
// -> 10; rel 100: ln(12.5)/ln(16)*8 = 7.29 -> 16 + 15 = 31. Worked by hand
// and checked with a ten-line python3 script using math.log (not the code
// under test). r = 16, 32, 64, 128 hit the boundaries 2, 4, 6, 8 exactly.
const int kBidirectional32[] = {15, 15, 15, 14, 12, 10, 10, 8,  8,  7,  1, 0,
                                17, 23, 24, 24, 26, 26, 28, 30, 31, 31, 31};
// Causal: n = 32, max_exact = 16, r = max(-rel, 0): 16 + floor(ln(r/16)/ln(8) * 16)
// capped at 31; keys after the query all fall in bucket 0. E.g. rel -100:
// ln(6.25)/ln(8)*16 = 14.10 -> 30.
const int kCausal32[] = {31, 31, 30, 26, 21, 17, 16, 9, 8, 7, 1, 0,
                         0,  0,  0,  0,  0,  0,  0,  0, 0, 0, 0};

TEST(T5RelativeBucketTest, KnownBidirectional) {
  const T5BucketConfig config{32, 128, true};
  ASSERT_TRUE(ValidateT5BucketConfig(config).ok());
  for (size_t i = 0; i < std::size(kRelatives); ++i) {
    EXPECT_EQ(T5RelativeBucket(kRelatives[i], config), kBidirectional32[i])
        << "relative position " << kRelatives[i];
  }
}

TEST(T5RelativeBucketTest, KnownCausal) {
  const T5BucketConfig config{32, 128, false};
  ASSERT_TRUE(ValidateT5BucketConfig(config).ok());
  for (size_t i = 0; i < std::size(kRelatives); ++i) {
    EXPECT_EQ(T5RelativeBucket(kRelatives[i], config), kCausal32[i])
        << "relative position " << kRelatives[i];
  }
}

TEST(T5RelativeBucketTest, MatchesReferenceOverManyConfigs) {
  const T5BucketConfig configs[] = {
      {32, 128, true},   {32, 128, false}, {8, 20, true}, {8, 20, false}, {64, 256, true},
      {64, 1000, false}, {4, 2, true},     {2, 2, false}, {3, 5, false},  {10, 6, true},
  };
  for (const T5BucketConfig& c : configs) {
    SCOPED_TRACE(::testing::Message() << c.num_buckets << " buckets, max_distance "
                                      << c.max_distance << (c.bidirectional ? " bi" : " causal"));
    ASSERT_TRUE(ValidateT5BucketConfig(c).ok()) << ValidateT5BucketConfig(c);
    int previous_neg = 0;
    for (int64_t rel = -2000; rel <= 2000; ++rel) {
      const int got = T5RelativeBucket(rel, c);
      ASSERT_EQ(got, ref::T5Bucket(rel, c.bidirectional, c.num_buckets, c.max_distance))
          << "rel " << rel;
      ASSERT_GE(got, 0);
      ASSERT_LT(got, c.num_buckets);
      // Going further into the past never moves to a smaller bucket.
      if (rel <= 0) {
        if (rel > -2000) {
          ASSERT_LE(got, previous_neg) << "rel " << rel;
        }
        previous_neg = got;
      }
    }
  }
}

TEST(T5RelativeBucketTest, ExtremeDistancesSaturate) {
  const T5BucketConfig bi{32, 128, true};
  const T5BucketConfig causal{32, 128, false};
  const int64_t lo = std::numeric_limits<int64_t>::min();
  const int64_t hi = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(T5RelativeBucket(lo, bi), 15);
  EXPECT_EQ(T5RelativeBucket(hi, bi), 31);
  EXPECT_EQ(T5RelativeBucket(lo, causal), 31);
  EXPECT_EQ(T5RelativeBucket(hi, causal), 0);
}

TEST(T5BucketConfigTest, RejectsBadConfigs) {
  struct Bad {
    T5BucketConfig config;
    const char* substr;
  };
  const Bad bads[] = {
      {{0, 128, true}, "num_buckets must be >= 2, got 0"},
      {{1, 128, false}, "num_buckets must be >= 2, got 1"},
      {{-4, 128, false}, "got -4"},
      {{31, 128, true}, "num_buckets must be even when bidirectional, got 31"},
      {{2, 128, true}, "num_buckets must be >= 4 when bidirectional, got 2"},
      // Bidirectional 32: exact range 8; max_distance must exceed it.
      {{32, 8, true}, "max_distance must be > the exact range 8"},
      {{32, 16, false}, "max_distance must be > the exact range 16"},
      {{32, -1, false}, "got -1"},
  };
  for (const Bad& b : bads) {
    absl::Status s = ValidateT5BucketConfig(b.config);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b.substr;
    EXPECT_THAT(std::string(s.message()), HasSubstr(b.substr));
  }
  EXPECT_TRUE(ValidateT5BucketConfig({32, 9, true}).ok());
  EXPECT_TRUE(ValidateT5BucketConfig({31, 16, false}).ok());
  EXPECT_TRUE(ValidateT5BucketConfig(T5BucketConfig{}).ok());
}

// ---------------------------------------------------------------------------
// T5Bias

TEST(T5BiasTest, MatchesReference) {
  struct Case {
    T5BucketConfig config;
    int64_t heads, q_len, k_len, q_offset;
    DType dtype;
  };
  const Case cases[] = {
      {{32, 128, true}, 4, 40, 40, 0, DType::kF32},
      {{32, 128, false}, 3, 7, 300, 293, DType::kF32},  // decode-style: queries at the end
      {{16, 40, true}, 2, 1, 90, 45, DType::kBF16},
      {{8, 20, false}, 5, 33, 17, 0, DType::kBF16},  // k_len < q_len
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "heads " << c.heads << " q " << c.q_len << " k " << c.k_len
                                      << " off " << c.q_offset);
    const Tensor table = RandomTensor(c.dtype, {c.config.num_buckets, c.heads}, 101);
    absl::StatusOr<Tensor> bias = T5Bias(table.cview(), c.config, c.q_len, c.k_len, c.q_offset);
    ASSERT_TRUE(bias.ok()) << bias.status();
    EXPECT_EQ(bias->dtype(), DType::kF32);
    EXPECT_EQ(bias->dims(), (Dims{c.heads, c.q_len, c.k_len}));
    const std::vector<double> expected =
        ref::T5Bias(ToDoubles(table.cview()), c.config.num_buckets, static_cast<int>(c.heads),
                    c.config.bidirectional, c.config.max_distance, c.q_len, c.k_len, c.q_offset);
    EXPECT_TRUE(AllClose(ToDoubles(bias->cview()), expected, kF32Tol));
  }
}

// A transposed (non-dense) table view reads the same values.
TEST(T5BiasTest, StridedTable) {
  const T5BucketConfig config{8, 20, true};
  const int64_t heads = 3;
  const Tensor storage = RandomTensor(DType::kF32, {heads, 8}, 111);  // [heads, buckets]
  const ConstTensorView table(storage.data<float>(), DType::kF32, Dims{8, heads}, Dims{1, 8});
  absl::StatusOr<Tensor> bias = T5Bias(table, config, 6, 9, 2);
  ASSERT_TRUE(bias.ok()) << bias.status();
  const std::vector<double> expected = ref::T5Bias(ToDoubles(table), 8, heads, true, 20, 6, 9, 2);
  EXPECT_TRUE(AllClose(ToDoubles(bias->cview()), expected, kF32Tol));
}

TEST(T5BiasTest, EmptyLengths) {
  const Tensor table = RandomTensor(DType::kF32, {32, 2}, 121);
  absl::StatusOr<Tensor> bias = T5Bias(table.cview(), T5BucketConfig{}, 0, 5, 0);
  ASSERT_TRUE(bias.ok()) << bias.status();
  EXPECT_EQ(bias->dims(), (Dims{2, 0, 5}));
  bias = T5Bias(table.cview(), T5BucketConfig{}, 3, 0, 9);
  ASSERT_TRUE(bias.ok()) << bias.status();
  EXPECT_EQ(bias->dims(), (Dims{2, 3, 0}));
}

TEST(T5BiasTest, RejectsBadArguments) {
  const Tensor table = RandomTensor(DType::kF32, {32, 2}, 131);
  const T5BucketConfig config;

  absl::StatusOr<Tensor> b = T5Bias(table.cview(), T5BucketConfig{31, 128, true}, 4, 4, 0);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("even"));

  const Tensor wrong_buckets = RandomTensor(DType::kF32, {16, 2}, 132);
  b = T5Bias(wrong_buckets.cview(), config, 4, 4, 0);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("has 16 buckets"));
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("num_buckets 32"));

  const Tensor rank3 = RandomTensor(DType::kF32, {32, 2, 1}, 133);
  b = T5Bias(rank3.cview(), config, 4, 4, 0);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("rank 2"));

  const Tensor no_heads = Tensor::Create(DType::kF32, {32, 0}).value();
  b = T5Bias(no_heads.cview(), config, 4, 4, 0);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("at least one head"));

  b = T5Bias(table.cview(), config, -1, 4, 0);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("q_len must be >= 0, got -1"));
  b = T5Bias(table.cview(), config, 4, -2, 0);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("k_len must be >= 0, got -2"));
  b = T5Bias(table.cview(), config, 4, 4, -3);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("q_offset must be >= 0, got -3"));
  b = T5Bias(table.cview(), config, 4, 4, std::numeric_limits<int64_t>::max());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kOutOfRange);

  Tensor nan_table = RandomTensor(DType::kF32, {32, 2}, 134);
  nan_table.data<float>()[5 * 2 + 1] = std::numeric_limits<float>::infinity();
  b = T5Bias(nan_table.cview(), config, 4, 4, 0);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("[5, 1] is +inf"));
}

// ---------------------------------------------------------------------------
// ALiBi slopes

void ExpectSlopes(int64_t heads, const std::vector<double>& expected) {
  SCOPED_TRACE(::testing::Message() << heads << " heads");
  absl::StatusOr<std::vector<double>> slopes = AlibiSlopes(heads);
  ASSERT_TRUE(slopes.ok()) << slopes.status();
  ASSERT_EQ(slopes->size(), expected.size());
  for (size_t h = 0; h < expected.size(); ++h) {
    EXPECT_DOUBLE_EQ((*slopes)[h], expected[h]) << "head " << h;
  }
}

// Literal tables: P = 2^floor(log2 H); slopes 2^(-8k/P) for k = 1..P, then
// the odd k of the 2P sequence, 2^(-4k/P) for k = 1, 3, 5, ...
TEST(AlibiSlopesTest, KnownPowerOfTwo) {
  // H = 8: 2^-1 .. 2^-8.
  ExpectSlopes(8, {0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625});
  // H = 1: P = 1, slope 2^-8.
  ExpectSlopes(1, {0.00390625});
}

TEST(AlibiSlopesTest, KnownNotPowerOfTwo) {
  // H = 12: the 8 slopes of P = 8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
  // (python3: 2**-0.5 etc.).
  ExpectSlopes(
      12, {0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625, 0.7071067811865476,
           0.3535533905932738, 0.1767766952966369, 0.08838834764831845});
  // H = 3: P = 2 gives 2^-4, 2^-8; the extra head takes 2^-2 (k = 1 of 4 heads).
  ExpectSlopes(3, {0.0625, 0.00390625, 0.25});
  // H = 6: P = 4 gives 2^-2, 2^-4, 2^-6, 2^-8; extras 2^-1, 2^-3.
  ExpectSlopes(6, {0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125});
}

TEST(AlibiSlopesTest, MatchesReferenceForManyHeadCounts) {
  for (int heads = 1; heads <= 100; ++heads) {
    absl::StatusOr<std::vector<double>> slopes = AlibiSlopes(heads);
    ASSERT_TRUE(slopes.ok()) << slopes.status();
    const std::vector<double> expected = ref::AlibiSlopes(heads);
    ASSERT_EQ(slopes->size(), expected.size()) << heads;
    for (int h = 0; h < heads; ++h) {
      EXPECT_NEAR((*slopes)[h], expected[h], 1e-13 * expected[h]) << heads << " heads, head " << h;
      EXPECT_GT((*slopes)[h], 0.0);
      EXPECT_LT((*slopes)[h], 1.0);
    }
  }
}

TEST(AlibiSlopesTest, RejectsBadHeadCounts) {
  for (int64_t heads :
       {int64_t{0}, int64_t{-1}, (int64_t{1} << 16) + 1, std::numeric_limits<int64_t>::max()}) {
    absl::StatusOr<std::vector<double>> s = AlibiSlopes(heads);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << heads;
    EXPECT_THAT(std::string(s.status().message()), HasSubstr("num_heads"));
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(std::to_string(heads)));
  }
}

// ---------------------------------------------------------------------------
// ALiBi bias

TEST(AlibiBiasTest, MatchesReference) {
  const std::vector<double> slopes = ref::AlibiSlopes(6);
  for (bool bidirectional : {false, true}) {
    for (int64_t q_offset : {int64_t{0}, int64_t{37}}) {
      SCOPED_TRACE(::testing::Message()
                   << "bidirectional " << bidirectional << " offset " << q_offset);
      const int64_t q_len = 13, k_len = 50;
      absl::StatusOr<Tensor> bias = AlibiBias(slopes, q_len, k_len, q_offset, bidirectional);
      ASSERT_TRUE(bias.ok()) << bias.status();
      EXPECT_EQ(bias->dims(), (Dims{6, q_len, k_len}));
      EXPECT_TRUE(AllClose(ToDoubles(bias->cview()),
                           ref::AlibiBias(slopes, q_len, k_len, q_offset, bidirectional), kF32Tol));
    }
  }
}

// One head, slope 0.5, queries at positions 1 and 2, keys 0..3, by hand:
// causal -0.5 * (q - k); bidirectional -0.5 * |q - k|.
TEST(AlibiBiasTest, KnownValues) {
  const std::vector<double> slopes = {0.5};
  Tensor causal = AlibiBias(slopes, 2, 4, 1, false).value();
  const float causal_expected[] = {-0.5f, 0.0f,  0.5f, 1.0f,  //
                                   -1.0f, -0.5f, 0.0f, 0.5f};
  Tensor bi = AlibiBias(slopes, 2, 4, 1, true).value();
  const float bi_expected[] = {-0.5f, 0.0f,  -0.5f, -1.0f,  //
                               -1.0f, -0.5f, 0.0f,  -0.5f};
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(causal.data<float>()[i], causal_expected[i]) << i;
    EXPECT_EQ(bi.data<float>()[i], bi_expected[i]) << i;
  }
}

TEST(AlibiBiasTest, EmptyLengths) {
  absl::StatusOr<Tensor> bias = AlibiBias({0.5, 0.25}, 0, 0, 0, false);
  ASSERT_TRUE(bias.ok()) << bias.status();
  EXPECT_EQ(bias->dims(), (Dims{2, 0, 0}));
}

TEST(AlibiBiasTest, RejectsBadArguments) {
  absl::StatusOr<Tensor> b = AlibiBias({}, 4, 4, 0, false);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("empty"));

  const std::vector<double> nan_slopes = {0.5, std::nan("")};
  b = AlibiBias(nan_slopes, 4, 4, 0, false);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("slopes[1]"));

  const std::vector<double> slopes = {0.5};
  b = AlibiBias(slopes, -1, 4, 0, false);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("q_len must be >= 0, got -1"));
  b = AlibiBias(slopes, 4, -1, 0, true);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("k_len must be >= 0, got -1"));
  b = AlibiBias(slopes, 4, 4, -7, false);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("q_offset must be >= 0, got -7"));
}

}  // namespace
}  // namespace ropeattn
