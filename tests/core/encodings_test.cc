// Absolute encodings: sinusoidal tables and learned position tables, compared
// with the plain fp64 reference in tests/reference/encodings_ref.
//
// Tolerances: f32 results within kF32Tol (1e-5, relative norm-wise) of the
// fp64 reference; bf16 results within kBF16Tol (1e-2), plus an exact check
// that bf16 is rounded once from the fp32 sum.
#include "core/encodings.h"

#include <quadmath.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/reference/encodings_ref.h"

namespace ropeattn {
namespace {

using ::ropeattn::testing::AllClose;
using ::ropeattn::testing::kBF16Tol;
using ::ropeattn::testing::kF32Tol;
using ::ropeattn::testing::RandomInts;
using ::ropeattn::testing::RandomTensor;
using ::ropeattn::testing::ToDoubles;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------
// SinusoidalTable

struct SinusoidalCase {
  int64_t num_positions;
  int64_t d_model;
  double base;
  int64_t first_position;
};

class SinusoidalVsReference : public ::testing::TestWithParam<SinusoidalLayout> {};

TEST_P(SinusoidalVsReference, MatchesReference) {
  const SinusoidalLayout layout = GetParam();
  const bool interleaved = layout == SinusoidalLayout::kInterleaved;
  const SinusoidalCase cases[] = {
      {64, 128, 10000.0, 0},
      {17, 2, 10000.0, 0},
      {33, 6, 500.0, 3},
      // Far positions: angles must be formed in fp64 to stay within tolerance.
      {16, 64, 10000.0, 100000},
      {8, 32, 1e6, (int64_t{1} << 30) + 12345},
  };
  for (const SinusoidalCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "P=" << c.num_positions << " D=" << c.d_model
                                      << " base=" << c.base << " first=" << c.first_position);
    absl::StatusOr<Tensor> table =
        SinusoidalTable(c.num_positions, c.d_model, c.base, layout, c.first_position);
    ASSERT_TRUE(table.ok()) << table.status();
    EXPECT_EQ(table->dtype(), DType::kF32);
    EXPECT_EQ(table->dims(), (Dims{c.num_positions, c.d_model}));
    EXPECT_TRUE(AllClose(
        ToDoubles(table->cview()),
        ref::SinusoidalTable(c.num_positions, c.d_model, c.base, interleaved, c.first_position),
        kF32Tol));
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, SinusoidalVsReference,
                         ::testing::Values(SinusoidalLayout::kInterleaved,
                                           SinusoidalLayout::kSinCosHalf),
                         [](const ::testing::TestParamInfo<SinusoidalLayout>& info) {
                           return info.param == SinusoidalLayout::kInterleaved ? "Interleaved"
                                                                               : "SinCosHalf";
                         });

// Values computed independently with python3's math.sin / math.cos of
// p / 10000^(2i/4), d_model 4 (w_0 = 1, w_1 = 0.01).
TEST(SinusoidalTableTest, KnownValuesInterleaved) {
  absl::StatusOr<Tensor> t = SinusoidalTable(8, 4, 10000.0, SinusoidalLayout::kInterleaved);
  ASSERT_TRUE(t.ok()) << t.status();
  const float* v = t->data<float>();
  // Position 0: sin 0, cos 0 for every pair.
  EXPECT_FLOAT_EQ(v[0], 0.0f);
  EXPECT_FLOAT_EQ(v[1], 1.0f);
  EXPECT_FLOAT_EQ(v[2], 0.0f);
  EXPECT_FLOAT_EQ(v[3], 1.0f);
  // Position 1.
  EXPECT_FLOAT_EQ(v[4 + 0], 0.8414709848078965f);
  EXPECT_FLOAT_EQ(v[4 + 1], 0.5403023058681398f);
  EXPECT_FLOAT_EQ(v[4 + 2], 0.009999833334166664f);
  EXPECT_FLOAT_EQ(v[4 + 3], 0.9999500004166653f);
  // Position 7.
  EXPECT_FLOAT_EQ(v[28 + 0], 0.6569865987187891f);
  EXPECT_FLOAT_EQ(v[28 + 1], 0.7539022543433046f);
  EXPECT_FLOAT_EQ(v[28 + 2], 0.06994284733753277f);
  EXPECT_FLOAT_EQ(v[28 + 3], 0.9975510002532796f);
}

TEST(SinusoidalTableTest, KnownValuesSinCosHalf) {
  absl::StatusOr<Tensor> t = SinusoidalTable(3, 4, 10000.0, SinusoidalLayout::kSinCosHalf);
  ASSERT_TRUE(t.ok()) << t.status();
  const float* v = t->data<float>();
  const float row0[] = {0.0f, 0.0f, 1.0f, 1.0f};
  // Position 2: [sin(2), sin(0.02), cos(2), cos(0.02)] (python3 math).
  const float row2[] = {0.9092974268256817f, 0.01999866669333308f, -0.4161468365471424f,
                        0.9998000066665778f};
  for (int c = 0; c < 4; ++c) {
    EXPECT_FLOAT_EQ(v[c], row0[c]) << c;
    EXPECT_FLOAT_EQ(v[8 + c], row2[c]) << c;
  }
}

// The two layouts differ by a fixed column permutation, nothing else.
TEST(SinusoidalTableTest, LayoutsArePermutationsOfEachOther) {
  const int64_t P = 40, D = 24;
  Tensor inter = SinusoidalTable(P, D, 10000.0, SinusoidalLayout::kInterleaved, 5).value();
  Tensor half = SinusoidalTable(P, D, 10000.0, SinusoidalLayout::kSinCosHalf, 5).value();
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t i = 0; i < D / 2; ++i) {
      EXPECT_EQ(half.data<float>()[p * D + i], inter.data<float>()[p * D + 2 * i]);
      EXPECT_EQ(half.data<float>()[p * D + D / 2 + i], inter.data<float>()[p * D + 2 * i + 1]);
    }
  }
}

TEST(SinusoidalTableTest, FirstPositionShiftsRows) {
  Tensor full = SinusoidalTable(20, 16, 10000.0, SinusoidalLayout::kInterleaved, 0).value();
  Tensor tail = SinusoidalTable(8, 16, 10000.0, SinusoidalLayout::kInterleaved, 12).value();
  for (int64_t i = 0; i < 8 * 16; ++i) {
    EXPECT_EQ(tail.data<float>()[i], full.data<float>()[12 * 16 + i]) << i;
  }
}

// Rows at the last positions (2^40): each angle is the exact product of
// the position and the fp64 frequency base^(-2i/d) (rounded to fp64 the
// product is off by up to 1e-4 rad), within fp32's rounding of a
// __float128 evaluation (the 94-bit product exact, sinq/cosq exact).
TEST(SinusoidalTableTest, RowsAtThePositionLimitAreExactProducts) {
  constexpr int64_t kD = 64, kRows = 4, kFirst = (int64_t{1} << 40) - kRows + 1;
  Tensor t = SinusoidalTable(kRows, kD, 10000.0, SinusoidalLayout::kSinCosHalf, kFirst).value();
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t i = 0; i < kD / 2; ++i) {
      const double w = std::pow(10000.0, -static_cast<double>(2 * i) / static_cast<double>(kD));
      const __float128 angle = static_cast<__float128>(kFirst + r) * w;
      EXPECT_NEAR(t.data<float>()[r * kD + i], static_cast<double>(sinq(angle)), 6e-8)
          << "row " << r << " pair " << i;
      EXPECT_NEAR(t.data<float>()[r * kD + kD / 2 + i], static_cast<double>(cosq(angle)), 6e-8)
          << "row " << r << " pair " << i;
    }
  }
}

TEST(SinusoidalTableTest, ZeroPositionsIsAnEmptyTable) {
  absl::StatusOr<Tensor> t = SinusoidalTable(0, 8, 10000.0, SinusoidalLayout::kSinCosHalf);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->dims(), (Dims{0, 8}));
  EXPECT_EQ(t->num_elements(), 0);
}

TEST(SinusoidalTableTest, RejectsBadArguments) {
  const auto kInter = SinusoidalLayout::kInterleaved;
  struct Bad {
    int64_t num_positions, d_model;
    double base;
    int64_t first;
    const char* substr;
  };
  const Bad bads[] = {
      {4, 63, 10000.0, 0, "d_model must be even and positive, got 63"},
      {4, 0, 10000.0, 0, "d_model must be even and positive, got 0"},
      {4, -8, 10000.0, 0, "got -8"},
      {-1, 8, 10000.0, 0, "num_positions must be >= 0, got -1"},
      {4, 8, 10000.0, -3, "first_position must be >= 0, got -3"},
      {4, 8, 1.0, 0, "base must be finite and > 1, got 1"},
      {4, 8, 0.5, 0, "got 0.5"},
      {4, 8, std::numeric_limits<double>::quiet_NaN(), 0, "base"},
      {4, 8, std::numeric_limits<double>::infinity(), 0, "base"},
  };
  for (const Bad& b : bads) {
    absl::StatusOr<Tensor> t = SinusoidalTable(b.num_positions, b.d_model, b.base, kInter, b.first);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << b.substr;
    EXPECT_THAT(std::string(t.status().message()), HasSubstr(b.substr));
  }
  absl::StatusOr<Tensor> bad_layout =
      SinusoidalTable(4, 8, 10000.0, static_cast<SinusoidalLayout>(7));
  EXPECT_EQ(bad_layout.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad_layout.status().message()), HasSubstr("layout 7"));
}

TEST(SinusoidalTableTest, PositionsPast2To40AreOutOfRange) {
  const int64_t limit = int64_t{1} << 40;
  EXPECT_TRUE(SinusoidalTable(1, 4, 10000.0, SinusoidalLayout::kInterleaved, limit).ok());
  absl::StatusOr<Tensor> t = SinusoidalTable(2, 4, 10000.0, SinusoidalLayout::kInterleaved, limit);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kOutOfRange);
  t = SinusoidalTable(2, 4, 10000.0, SinusoidalLayout::kInterleaved,
                      std::numeric_limits<int64_t>::max());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kOutOfRange);
}

TEST(SinusoidalTableTest, LayoutNames) {
  EXPECT_STREQ(SinusoidalLayoutName(SinusoidalLayout::kInterleaved), "interleaved");
  EXPECT_STREQ(SinusoidalLayoutName(SinusoidalLayout::kSinCosHalf), "sin_cos_half");
}

// ---------------------------------------------------------------------------
// AddLearnedPositions

std::vector<int64_t> DefaultPositions(int64_t batch, int64_t seq) {
  std::vector<int64_t> p;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t s = 0; s < seq; ++s) p.push_back(s);
  }
  return p;
}

std::vector<int64_t> OffsetPositions(absl::Span<const int64_t> offsets, int64_t seq) {
  std::vector<int64_t> p;
  for (int64_t off : offsets) {
    for (int64_t s = 0; s < seq; ++s) p.push_back(off + s);
  }
  return p;
}

struct DTypePair {
  DType x;
  DType table;
};

class LearnedVsReference : public ::testing::TestWithParam<DTypePair> {};

TEST_P(LearnedVsReference, AllPositionModes) {
  const DTypePair types = GetParam();
  const int64_t B = 3, S = 11, D = 40, P = 64;
  const double tol = (types.x == DType::kBF16 || types.table == DType::kBF16) ? kBF16Tol : kF32Tol;
  const Tensor table = RandomTensor(types.table, {P, D}, /*seed=*/11);
  const std::vector<int64_t> explicit_pos = RandomInts(B * S, 0, P - 1, /*seed=*/12);
  const std::vector<int64_t> offsets = {0, 7, P - S};

  struct Mode {
    const char* name;
    Positions positions;
    std::vector<int64_t> resolved;
  };
  const Mode modes[] = {
      {"default", Positions{}, DefaultPositions(B, S)},
      {"explicit", Positions{explicit_pos, {}}, explicit_pos},
      {"offsets", Positions{{}, offsets}, OffsetPositions(offsets, S)},
  };
  for (const Mode& m : modes) {
    SCOPED_TRACE(m.name);
    Tensor x = RandomTensor(types.x, {B, S, D}, /*seed=*/13);
    const std::vector<double> expected = ref::AddLearnedPositions(
        ToDoubles(x.cview()), B, S, D, ToDoubles(table.cview()), m.resolved);
    ASSERT_TRUE(AddLearnedPositions(x.view(), table.cview(), m.positions).ok());
    EXPECT_TRUE(AllClose(ToDoubles(x.cview()), expected, tol));
  }
}

INSTANTIATE_TEST_SUITE_P(
    DTypes, LearnedVsReference,
    ::testing::Values(DTypePair{DType::kF32, DType::kF32}, DTypePair{DType::kF32, DType::kBF16},
                      DTypePair{DType::kBF16, DType::kF32}, DTypePair{DType::kBF16, DType::kBF16}),
    [](const ::testing::TestParamInfo<DTypePair>& info) {
      return std::string(DTypeName(info.param.x)) + "_x_" + DTypeName(info.param.table) + "_table";
    });

// bf16 x is summed in fp32 and rounded once: the fp32 sum of two values that
// came from bf16/f32 is the correctly rounded exact sum, so rounding the
// exact (double) sum to f32 and then to bf16 is the expected result, bit for bit.
TEST(AddLearnedPositionsTest, Bf16IsRoundedOnceFromFp32Sum) {
  const int64_t B = 2, S = 9, D = 16, P = 12;
  Tensor x = RandomTensor(DType::kBF16, {B, S, D}, 21);
  const Tensor table = RandomTensor(DType::kF32, {P, D}, 22, -0.01f, 0.01f);
  const std::vector<double> x0 = ToDoubles(x.cview());
  const std::vector<double> t = ToDoubles(table.cview());
  const std::vector<int64_t> offsets = {1, 3};
  ASSERT_TRUE(AddLearnedPositions(x.view(), table.cview(), Positions{{}, offsets}).ok());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t c = 0; c < D; ++c) {
        const int64_t i = (b * S + s) * D + c;
        const double exact = x0[i] + t[(offsets[b] + s) * D + c];
        EXPECT_EQ(x.data<uint16_t>()[i], FloatToBF16(static_cast<float>(exact))) << i;
      }
    }
  }
}

// x may be a strided view (e.g. rows of a bigger buffer); only its own
// elements change.
TEST(AddLearnedPositionsTest, StridedViewTouchesOnlyItsElements) {
  const int64_t B = 2, S_full = 10, S = 6, D = 8, P = 16;
  Tensor buffer = RandomTensor(DType::kF32, {B, S_full, D}, 31);
  const std::vector<double> before = ToDoubles(buffer.cview());
  const Tensor table = RandomTensor(DType::kF32, {P, D}, 32);
  TensorView x = buffer.view().Slice(1, 2, S);  // seq rows 2 .. 7
  const std::vector<double> expected = ref::AddLearnedPositions(
      ToDoubles(ConstTensorView(x)), B, S, D, ToDoubles(table.cview()), DefaultPositions(B, S));
  ASSERT_TRUE(AddLearnedPositions(x, table.cview(), Positions{}).ok());
  EXPECT_TRUE(AllClose(ToDoubles(ConstTensorView(x)), expected, kF32Tol));
  const std::vector<double> after = ToDoubles(buffer.cview());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S_full; ++s) {
      if (s >= 2 && s < 2 + S) continue;
      for (int64_t c = 0; c < D; ++c) {
        const int64_t i = (b * S_full + s) * D + c;
        EXPECT_EQ(after[i], before[i]) << "b=" << b << " s=" << s << " c=" << c;
      }
    }
  }
}

TEST(AddLearnedPositionsTest, ZeroTokensIsANoOp) {
  Tensor x = Tensor::Create(DType::kF32, {2, 0, 8}).value();
  const Tensor table = RandomTensor(DType::kF32, {4, 8}, 41);
  EXPECT_TRUE(AddLearnedPositions(x.view(), table.cview(), Positions{}).ok());
  const std::vector<int64_t> offsets = {3, 100};  // past the table, but no tokens
  EXPECT_TRUE(AddLearnedPositions(x.view(), table.cview(), Positions{{}, offsets}).ok());
}

TEST(AddLearnedPositionsTest, PositionPastTableIsOutOfRangeAndLeavesXUnchanged) {
  const int64_t B = 2, S = 8, D = 4, P = 16;
  Tensor x = RandomTensor(DType::kF32, {B, S, D}, 51);
  const std::vector<double> before = ToDoubles(x.cview());
  const Tensor table = RandomTensor(DType::kF32, {P, D}, 52);
  std::vector<int64_t> pos = RandomInts(B * S, 0, P - 1, 53);
  pos[11] = P;  // exactly max_positions: one past the last row
  absl::Status s = AddLearnedPositions(x.view(), table.cview(), Positions{pos, {}});
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(s.message()), HasSubstr("position 16 at index 11"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("max_positions 16"));
  EXPECT_EQ(ToDoubles(x.cview()), before);

  // With offsets: row 1 starts at 10, so its token 6 sits at 16.
  const std::vector<int64_t> offsets = {0, 10};
  s = AddLearnedPositions(x.view(), table.cview(), Positions{{}, offsets});
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(s.message()), HasSubstr("position 16 at index 14 (batch 1, seq 6)"));
  EXPECT_EQ(ToDoubles(x.cview()), before);

  // Default positions 0 .. S-1 past a short table.
  const Tensor short_table = RandomTensor(DType::kF32, {5, D}, 54);
  s = AddLearnedPositions(x.view(), short_table.cview(), Positions{});
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(s.message()), HasSubstr("position 5 at index 5"));

  // An offset so large that offset + s would overflow int64.
  const std::vector<int64_t> huge = {0, std::numeric_limits<int64_t>::max() - 2};
  s = AddLearnedPositions(x.view(), table.cview(), Positions{{}, huge});
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(ToDoubles(x.cview()), before);
}

TEST(AddLearnedPositionsTest, BadPositionsAreInvalidArgument) {
  const int64_t B = 2, S = 4, D = 4, P = 16;
  Tensor x = RandomTensor(DType::kF32, {B, S, D}, 61);
  const std::vector<double> before = ToDoubles(x.cview());
  const Tensor table = RandomTensor(DType::kF32, {P, D}, 62);

  std::vector<int64_t> pos = {0, 1, 2, 3, 4, -5, 6, 7};
  absl::Status s = AddLearnedPositions(x.view(), table.cview(), Positions{pos, {}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("explicit_positions[5]"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("-5"));

  const std::vector<int64_t> short_pos = {0, 1, 2};
  s = AddLearnedPositions(x.view(), table.cview(), Positions{short_pos, {}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("explicit_positions has 3 entries"));

  const std::vector<int64_t> neg_offsets = {0, -1};
  s = AddLearnedPositions(x.view(), table.cview(), Positions{{}, neg_offsets});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("offsets[1] is negative (-1)"));

  const std::vector<int64_t> three_offsets = {0, 1, 2};
  s = AddLearnedPositions(x.view(), table.cview(), Positions{{}, three_offsets});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("offsets has 3 entries"));

  const std::vector<int64_t> full_pos = {0, 1, 2, 3, 0, 1, 2, 3};
  const std::vector<int64_t> offsets = {0, 0};
  s = AddLearnedPositions(x.view(), table.cview(), Positions{full_pos, offsets});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("both"));

  EXPECT_EQ(ToDoubles(x.cview()), before);
}

TEST(AddLearnedPositionsTest, BadShapesAreInvalidArgument) {
  Tensor x = RandomTensor(DType::kF32, {2, 4, 8}, 71);
  const Tensor table = RandomTensor(DType::kF32, {16, 8}, 72);

  const Tensor odd_table = RandomTensor(DType::kF32, {16, 7}, 73);
  absl::Status s = AddLearnedPositions(x.view(), odd_table.cview(), Positions{});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("table d_model 7 does not match x d_model 8"));

  Tensor x2 = RandomTensor(DType::kF32, {8, 8}, 74);
  s = AddLearnedPositions(x2.view(), table.cview(), Positions{});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("x must have rank 3"));

  const Tensor table3 = RandomTensor(DType::kF32, {1, 16, 8}, 75);
  s = AddLearnedPositions(x.view(), table3.cview(), Positions{});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("table must have rank 2"));

  s = AddLearnedPositions(x.view(), ConstTensorView(), Positions{});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

TEST(AddLearnedPositionsTest, NonFiniteTableIsInvalidArgument) {
  Tensor x = RandomTensor(DType::kF32, {1, 4, 4}, 81);
  const std::vector<double> before = ToDoubles(x.cview());
  Tensor table = RandomTensor(DType::kF32, {8, 4}, 82);
  table.data<float>()[2 * 4 + 1] = std::numeric_limits<float>::quiet_NaN();
  absl::Status s = AddLearnedPositions(x.view(), table.cview(), Positions{});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("table[2, 1] is NaN"));
  EXPECT_EQ(ToDoubles(x.cview()), before);
}

// Odd d_model is fine for a learned table (only sinusoids need pairs).
TEST(AddLearnedPositionsTest, OddDModel) {
  const int64_t B = 1, S = 5, D = 7, P = 9;
  Tensor x = RandomTensor(DType::kF32, {B, S, D}, 91);
  const Tensor table = RandomTensor(DType::kF32, {P, D}, 92);
  const std::vector<int64_t> pos = {8, 0, 3, 3, 1};
  const std::vector<double> expected =
      ref::AddLearnedPositions(ToDoubles(x.cview()), B, S, D, ToDoubles(table.cview()), pos);
  ASSERT_TRUE(AddLearnedPositions(x.view(), table.cview(), Positions{pos, {}}).ok());
  EXPECT_TRUE(AllClose(ToDoubles(x.cview()), expected, kF32Tol));
}

}  // namespace
}  // namespace ropeattn
