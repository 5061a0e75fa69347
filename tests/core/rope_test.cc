// RopeRotator and ResolvePositions: the rotation against the fp64 reference
// (tests/reference/rope_ref.h) on seeded random inputs, RoPE's defining
// properties, and every error path with its exact status code.
//
// Tolerances (relative, norm-wise, see tests/core/test_util.h): f32 results
// within kF32Tol = 1e-5 of the fp64 reference, bf16 within kBF16Tol = 1e-2.
// Where two core paths must do the same float arithmetic (table vs on-the-fly
// rows, thread counts, bf16 vs f32 before rounding) the comparison is bitwise.
#include "core/rope.h"

#include <quadmath.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/reference/rope_ref.h"

namespace ropeattn {
namespace {

using ::ropeattn::testing::AllClose;
using ::ropeattn::testing::FromDoubles;
using ::ropeattn::testing::kBF16Tol;
using ::ropeattn::testing::kF32Tol;
using ::ropeattn::testing::RandomInts;
using ::ropeattn::testing::RandomTensor;
using ::ropeattn::testing::RelativeError;
using ::ropeattn::testing::ToDoubles;
using ::testing::HasSubstr;

RopeConfig MakeConfig(int64_t head_dim, int64_t rotary_dim, RopeLayout layout,
                      double theta = 10000.0) {
  RopeConfig c;
  c.head_dim = head_dim;
  c.rotary_dim = rotary_dim;
  c.theta = theta;
  c.layout = layout;
  return c;
}

// YaRN with a factor 8 over L0 = 64: an attention factor != 1 and a ramp
// that mixes interpolated and extrapolated pairs.
RopeConfig WithYarn(RopeConfig c) {
  c.scaling.type = RopeScalingType::kYarn;
  c.scaling.factor = 8.0;
  c.scaling.original_max_positions = 64;
  return c;
}

int64_t RotaryDim(const RopeConfig& c) { return c.rotary_dim == 0 ? c.head_dim : c.rotary_dim; }

// Reference frequencies for the two rules these tests rotate with.
struct RefRule {
  std::vector<double> inv_freq;
  double attention_factor = 1.0;
};
RefRule ReferenceRule(const RopeConfig& c) {
  RefRule r;
  if (c.scaling.type == RopeScalingType::kYarn) {
    ref::YarnRefParams y;
    y.factor = c.scaling.factor;
    y.original_len = c.scaling.original_max_positions;
    r.inv_freq = ref::YarnInvFreq(RotaryDim(c), c.theta, y);
    r.attention_factor = ref::YarnAttentionFactor(y);
  } else {
    r.inv_freq = ref::DefaultInvFreq(RotaryDim(c), c.theta);
  }
  return r;
}

std::vector<double> RefRotate(const std::vector<double>& x, const Dims& dims, const RopeConfig& c,
                              const std::vector<int64_t>& positions, bool inverse = false) {
  const RefRule rule = ReferenceRule(c);
  ref::RotateRefParams p;
  p.batch = dims[0];
  p.seq = dims[1];
  p.heads = dims[2];
  p.head_dim = dims[3];
  p.rotary_dim = RotaryDim(c);
  p.interleaved = c.layout == RopeLayout::kInterleaved;
  p.positions = positions;
  p.inv_freq = rule.inv_freq;
  p.attention_factor = rule.attention_factor;
  p.inverse = inverse;
  return ref::Rotate(p, x);
}

RopeRotator MakeRotator(const RopeConfig& c, int64_t table_positions) {
  absl::StatusOr<RopeRotator> r = RopeRotator::Create(c, 0, table_positions);
  EXPECT_TRUE(r.ok()) << r.status();
  return *std::move(r);
}

// A rotated copy of x; fails the test on a non-OK status.
Tensor Rotated(const RopeRotator& r, const Tensor& x, const Positions& pos,
               RopeDirection dir = RopeDirection::kForward, int threads = 2) {
  Tensor y = Tensor::CopyOf(x.cview()).value();
  const absl::Status s = r.Apply(y.view(), pos, dir, threads);
  EXPECT_TRUE(s.ok()) << s;
  return y;
}

bool BitwiseEqual(const Tensor& a, const Tensor& b) {
  return a.byte_size() == b.byte_size() &&
         std::memcmp(a.data<char>(), b.data<char>(), a.byte_size()) == 0;
}

// ---------------------------------------------------------------------------
// The rotation against the fp64 reference over dtypes, layouts, sizes,
// partial rotary, rules and every way of giving positions.

using RotateParam = std::tuple<DType, RopeLayout, int64_t /*seq*/, int64_t /*head_dim*/>;
class RopeApplyTest : public ::testing::TestWithParam<RotateParam> {};

// Partial rotary dims chosen so that neither d nor d/2 is always a multiple
// of the 8-float vector width (the kernels' remainder loops must run too).
int64_t PartialRotaryDim(int64_t head_dim) {
  switch (head_dim) {
    case 64:
      return 24;
    case 80:
      return 40;
    default:
      return 44;
  }
}

TEST_P(RopeApplyTest, MatchesReference) {
  const auto [dtype, layout, seq, head_dim] = GetParam();
  const int64_t batch = 2;
  const int64_t heads = 3;
  const Dims dims = {batch, seq, heads, head_dim};
  const double tol = dtype == DType::kF32 ? kF32Tol : kBF16Tol;
  uint64_t seed = 1000 + seq * 7 + head_dim;

  for (int64_t rotary_dim : {int64_t{0}, PartialRotaryDim(head_dim)}) {
    for (bool yarn : {false, true}) {
      RopeConfig c = MakeConfig(head_dim, rotary_dim, layout);
      if (yarn) c = WithYarn(c);
      // A table shorter than the sequence: later tokens use on-the-fly rows.
      const RopeRotator r = MakeRotator(c, 64);

      const std::vector<int64_t> offsets = {5, 1000};
      const std::vector<int64_t> explicit_pos = RandomInts(batch * seq, 0, 5000, seed);
      for (int mode = 0; mode < 3; ++mode) {
        Positions pos;
        std::vector<int64_t> want_pos(batch * seq);
        for (int64_t b = 0; b < batch; ++b) {
          for (int64_t s = 0; s < seq; ++s) {
            want_pos[b * seq + s] = mode == 0   ? s
                                    : mode == 1 ? offsets[b] + s
                                                : explicit_pos[b * seq + s];
          }
        }
        if (mode == 1) pos.offsets = offsets;
        if (mode == 2) pos.explicit_positions = explicit_pos;

        const Tensor x = RandomTensor(dtype, dims, ++seed);
        const Tensor y = Rotated(r, x, pos);
        const std::vector<double> want = RefRotate(ToDoubles(x.cview()), dims, c, want_pos);
        EXPECT_TRUE(AllClose(ToDoubles(y.cview()), want, tol))
            << "rotary_dim " << rotary_dim << (yarn ? " yarn" : " default") << " positions mode "
            << mode;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllShapes, RopeApplyTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                       ::testing::Values(RopeLayout::kHalfSplit, RopeLayout::kInterleaved),
                       ::testing::Values(int64_t{1}, int64_t{7}, int64_t{129}),
                       ::testing::Values(int64_t{64}, int64_t{80}, int64_t{128})),
    [](const ::testing::TestParamInfo<RotateParam>& info) {
      return absl::StrCat(DTypeName(std::get<0>(info.param)), "_",
                          RopeLayoutName(std::get<1>(info.param)), "_s", std::get<2>(info.param),
                          "_d", std::get<3>(info.param));
    });

// ---------------------------------------------------------------------------
// Properties.

TEST(RopePropertyTest, ScoreDependsOnlyOnPositionDifference) {
  for (RopeLayout layout : {RopeLayout::kHalfSplit, RopeLayout::kInterleaved}) {
    for (int64_t rotary_dim : {int64_t{0}, int64_t{32}}) {
      const RopeConfig c = MakeConfig(64, rotary_dim, layout);
      const RopeRotator r = MakeRotator(c, 128);
      const Dims dims = {1, 1, 1, 64};
      const Tensor q = RandomTensor(DType::kF32, dims, 11);
      const Tensor k = RandomTensor(DType::kF32, dims, 12);
      const std::vector<double> qd = ToDoubles(q.cview());
      const std::vector<double> kd = ToDoubles(k.cview());
      double qn = 0, kn = 0;
      for (int i = 0; i < 64; ++i) {
        qn += qd[i] * qd[i];
        kn += kd[i] * kd[i];
      }
      const double scale = std::sqrt(qn * kn);

      auto score = [&](int64_t m, int64_t n) {
        const std::vector<int64_t> pm = {m}, pn = {n};
        Positions at_m, at_n;
        at_m.explicit_positions = pm;
        at_n.explicit_positions = pn;
        const std::vector<double> rq = ToDoubles(Rotated(r, q, at_m).cview());
        const std::vector<double> rk = ToDoubles(Rotated(r, k, at_n).cview());
        double dot = 0;
        for (int i = 0; i < 64; ++i) dot += rq[i] * rk[i];
        return dot;
      };
      auto ref_score = [&](int64_t m, int64_t n) {
        const std::vector<double> rq = RefRotate(qd, dims, c, {m});
        const std::vector<double> rk = RefRotate(kd, dims, c, {n});
        double dot = 0;
        for (int i = 0; i < 64; ++i) dot += rq[i] * rk[i];
        return dot;
      };

      const double want = ref_score(3, 0);
      // Same difference 3 at positions in the table, past it, and far out.
      const std::vector<std::pair<int64_t, int64_t>> pairs = {
          {3, 0}, {10, 7}, {130, 127}, {1000, 997}, {65539, 65536}, {1000003, 1000000}};
      for (const auto& [m, n] : pairs) {
        EXPECT_NEAR(score(m, n), want, 1e-5 * scale) << "m " << m << " n " << n;
      }
      // The score does depend on the difference (a no-op rotation would not).
      EXPECT_GT(std::abs(ref_score(4, 0) - want), 1e-3 * scale);
      EXPECT_NEAR(score(104, 100), ref_score(4, 0), 1e-5 * scale);
    }
  }
}

TEST(RopePropertyTest, NormsPreservedWithUnitFactorAndScaledByAttentionFactor) {
  const Dims dims = {2, 9, 4, 128};
  const Tensor x = RandomTensor(DType::kF32, dims, 21);
  const std::vector<double> xd = ToDoubles(x.cview());
  const std::vector<int64_t> pos = RandomInts(18, 1, 100000, 22);
  Positions p;
  p.explicit_positions = pos;
  for (RopeLayout layout : {RopeLayout::kHalfSplit, RopeLayout::kInterleaved}) {
    for (bool yarn : {false, true}) {
      RopeConfig c = MakeConfig(128, 0, layout);
      if (yarn) c = WithYarn(c);
      const RopeRotator r = MakeRotator(c, 1024);
      const double a = r.frequencies().attention_factor;
      if (yarn) {
        EXPECT_GT(a, 1.1);  // 0.1 ln 8 + 1
      } else {
        EXPECT_EQ(a, 1.0);
      }
      const std::vector<double> yd = ToDoubles(Rotated(r, x, p).cview());
      double moved = 0;
      for (int64_t row = 0; row < 2 * 9 * 4; ++row) {
        double nx = 0, ny = 0;
        for (int64_t i = 0; i < 128; ++i) {
          nx += xd[row * 128 + i] * xd[row * 128 + i];
          ny += yd[row * 128 + i] * yd[row * 128 + i];
          moved += std::abs(yd[row * 128 + i] - xd[row * 128 + i]);
        }
        // The factor multiplies cos and sin, so it scales the whole vector.
        EXPECT_NEAR(std::sqrt(ny), a * std::sqrt(nx), 1e-5 * a * std::sqrt(nx)) << "row " << row;
      }
      EXPECT_GT(moved, 1.0);  // the rotation did something
    }
  }
}

TEST(RopePropertyTest, InterleavedEqualsHalfSplitAfterChannelPermutation) {
  const int64_t head_dim = 80;
  for (int64_t rotary_dim : {int64_t{0}, int64_t{40}, int64_t{20}}) {
    const int64_t d = rotary_dim == 0 ? head_dim : rotary_dim;
    const Dims dims = {2, 7, 3, head_dim};
    const Tensor xi = RandomTensor(DType::kF32, dims, 31 + rotary_dim);
    std::vector<double> vi = ToDoubles(xi.cview());
    // Half-split channel i holds interleaved channel 2i, i + d/2 holds 2i + 1.
    auto to_half = [&](const std::vector<double>& v) {
      std::vector<double> out = v;
      for (size_t row = 0; row < v.size() / head_dim; ++row) {
        for (int64_t i = 0; i < d / 2; ++i) {
          out[row * head_dim + i] = v[row * head_dim + 2 * i];
          out[row * head_dim + i + d / 2] = v[row * head_dim + 2 * i + 1];
        }
      }
      return out;
    };
    const Tensor xh = FromDoubles(DType::kF32, dims, to_half(vi));
    const RopeRotator ri =
        MakeRotator(MakeConfig(head_dim, rotary_dim, RopeLayout::kInterleaved), 16);
    const RopeRotator rh =
        MakeRotator(MakeConfig(head_dim, rotary_dim, RopeLayout::kHalfSplit), 16);
    Positions p;
    const std::vector<int64_t> offsets = {3, 40};
    p.offsets = offsets;
    const std::vector<double> yi = ToDoubles(Rotated(ri, xi, p).cview());
    const std::vector<double> yh = ToDoubles(Rotated(rh, xh, p).cview());
    EXPECT_TRUE(AllClose(to_half(yi), yh, 1e-6)) << "rotary_dim " << rotary_dim;
    // Without the permutation the layouts disagree (pitfall 5).
    EXPECT_GT(RelativeError(ToDoubles(Rotated(rh, xi, p).cview()), yi), 0.1);
  }
}

TEST(RopePropertyTest, InverseRecoversInput) {
  const Dims dims = {2, 33, 4, 80};
  for (RopeLayout layout : {RopeLayout::kHalfSplit, RopeLayout::kInterleaved}) {
    for (int64_t rotary_dim : {int64_t{0}, int64_t{40}}) {
      const RopeConfig c = WithYarn(MakeConfig(80, rotary_dim, layout));
      const RopeRotator r = MakeRotator(c, 16);
      const Tensor x = RandomTensor(DType::kF32, dims, 41);
      const std::vector<int64_t> pos = RandomInts(2 * 33, 0, 300000, 42);
      Positions p;
      p.explicit_positions = pos;
      const Tensor y = Rotated(r, x, p, RopeDirection::kForward);
      const Tensor back = Rotated(r, y, p, RopeDirection::kInverse);
      EXPECT_TRUE(AllClose(ToDoubles(back.cview()), ToDoubles(x.cview()), kF32Tol));
      // The inverse on its own is the reference's inverse (-angle, 1/a).
      const Tensor inv = Rotated(r, x, p, RopeDirection::kInverse);
      EXPECT_TRUE(AllClose(ToDoubles(inv.cview()),
                           RefRotate(ToDoubles(x.cview()), dims, c, pos,
                                     /*inverse=*/true),
                           kF32Tol));
    }
  }
}

TEST(RopePropertyTest, PartialRotaryLeavesTailUntouchedAndUsesRotaryDimFrequencies) {
  const Dims dims = {1, 20, 2, 128};
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (RopeLayout layout : {RopeLayout::kHalfSplit, RopeLayout::kInterleaved}) {
      const RopeConfig c = MakeConfig(128, 32, layout);
      const RopeRotator r = MakeRotator(c, 8);
      EXPECT_EQ(r.rotary_dim(), 32);
      ASSERT_EQ(r.frequencies().inv_freq.size(), 16u);
      const Tensor x = RandomTensor(dtype, dims, 51);
      const Tensor y = Rotated(r, x, Positions());
      const size_t es = DTypeSize(dtype);
      for (int64_t row = 0; row < 40; ++row) {
        const char* xt = x.data<char>() + (row * 128 + 32) * es;
        const char* yt = y.data<char>() + (row * 128 + 32) * es;
        EXPECT_EQ(std::memcmp(xt, yt, 96 * es), 0) << "tail of row " << row << " changed";
      }
      std::vector<int64_t> pos(20);
      for (int s = 0; s < 20; ++s) pos[s] = s;
      const std::vector<double> got = ToDoubles(y.cview());
      const double tol = dtype == DType::kF32 ? kF32Tol : kBF16Tol;
      EXPECT_TRUE(AllClose(got, RefRotate(ToDoubles(x.cview()), dims, c, pos), tol));
      // Frequencies from head_dim (pitfall 6) would be visibly different.
      ref::RotateRefParams wrong;
      wrong.seq = 20;
      wrong.heads = 2;
      wrong.head_dim = 128;
      wrong.rotary_dim = 32;
      wrong.interleaved = layout == RopeLayout::kInterleaved;
      wrong.positions = pos;
      wrong.inv_freq = ref::DefaultInvFreq(128, 10000.0);
      wrong.inv_freq.resize(16);
      EXPECT_GT(RelativeError(got, ref::Rotate(wrong, ToDoubles(x.cview()))), 0.05);
    }
  }
}

TEST(RopePropertyTest, Bf16IsTheF32RotationRoundedOnce) {
  for (RopeLayout layout : {RopeLayout::kHalfSplit, RopeLayout::kInterleaved}) {
    for (auto [head_dim, rotary_dim] :
         {std::pair<int64_t, int64_t>{128, 0}, {128, 44}, {80, 0}, {64, 24}, {6, 6}}) {
      const Dims dims = {2, 13, 3, head_dim};
      const RopeRotator r = MakeRotator(WithYarn(MakeConfig(head_dim, rotary_dim, layout)), 8);
      const Tensor xb = RandomTensor(DType::kBF16, dims, 61, -4.0f, 4.0f);
      const Tensor xf = FromDoubles(DType::kF32, dims, ToDoubles(xb.cview()));  // exact
      const Tensor yb = Rotated(r, xb, Positions());
      const Tensor yf = Rotated(r, xf, Positions());
      int mismatches = 0;
      for (int64_t i = 0; i < yb.num_elements(); ++i) {
        mismatches += yb.data<uint16_t>()[i] != FloatToBF16(yf.data<float>()[i]);
      }
      EXPECT_EQ(mismatches, 0) << "head_dim " << head_dim << " rotary_dim " << rotary_dim;
    }
  }
}

TEST(RopePropertyTest, PositionsPastTheTableEqualOnTheFlyValues) {
  const Dims dims = {2, 50, 2, 64};
  for (RopeLayout layout : {RopeLayout::kHalfSplit, RopeLayout::kInterleaved}) {
    const RopeConfig c = WithYarn(MakeConfig(64, 0, layout));
    const RopeRotator no_table = MakeRotator(c, 0);
    const RopeRotator short_table = MakeRotator(c, 16);
    const RopeRotator long_table = MakeRotator(c, 5000);
    const Tensor x = RandomTensor(DType::kF32, dims, 71);
    const std::vector<int64_t> pos = RandomInts(100, 0, 4999, 72);
    Positions p;
    p.explicit_positions = pos;
    const Tensor y0 = Rotated(no_table, x, p);
    EXPECT_TRUE(BitwiseEqual(y0, Rotated(short_table, x, p)));
    EXPECT_TRUE(BitwiseEqual(y0, Rotated(long_table, x, p)));
    // Past the table is rotated (never left alone, wrapped or clamped).
    EXPECT_TRUE(
        AllClose(ToDoubles(y0.cview()), RefRotate(ToDoubles(x.cview()), dims, c, pos), kF32Tol));

    std::vector<float> c0(100 * 32), s0(100 * 32), c1(100 * 32), s1(100 * 32);
    ASSERT_TRUE(no_table.CosSin(pos, absl::MakeSpan(c0), absl::MakeSpan(s0)).ok());
    ASSERT_TRUE(short_table.CosSin(pos, absl::MakeSpan(c1), absl::MakeSpan(s1)).ok());
    EXPECT_EQ(c0, c1);
    EXPECT_EQ(s0, s1);
  }
}

TEST(RopePropertyTest, CosSinMatchesFp64WithAttentionFactor) {
  const RopeConfig c = WithYarn(MakeConfig(64, 48, RopeLayout::kHalfSplit));
  const RopeRotator r = MakeRotator(c, 64);
  const RefRule rule = ReferenceRule(c);
  const std::vector<int64_t> pos = {0, 5, 63, 64, 1000, 123456, 10000000};
  std::vector<float> cs(pos.size() * 24), sn(pos.size() * 24);
  ASSERT_TRUE(r.CosSin(pos, absl::MakeSpan(cs), absl::MakeSpan(sn)).ok());
  for (size_t k = 0; k < pos.size(); ++k) {
    for (int i = 0; i < 24; ++i) {
      const double angle = static_cast<double>(pos[k]) * rule.inv_freq[i];
      EXPECT_NEAR(cs[k * 24 + i], rule.attention_factor * std::cos(angle), 1e-6)
          << "position " << pos[k] << " pair " << i;
      EXPECT_NEAR(sn[k * 24 + i], rule.attention_factor * std::sin(angle), 1e-6)
          << "position " << pos[k] << " pair " << i;
    }
  }
}

TEST(RopePropertyTest, LargePositionsAreAccurate) {
  // fp32 angles would be off by ~1e-2 rad at 1e6 (pitfall 1).
  const Dims dims = {1, 5, 2, 128};
  const std::vector<int64_t> pos = {1000000, 10000003, 123456789, int64_t{1} << 31,
                                    (int64_t{1} << 32) + 7};
  Positions p;
  p.explicit_positions = pos;
  for (RopeLayout layout : {RopeLayout::kHalfSplit, RopeLayout::kInterleaved}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const RopeConfig c = MakeConfig(128, 0, layout);
      const RopeRotator r = MakeRotator(c, 4096);
      const Tensor x = RandomTensor(dtype, dims, 81);
      const Tensor y = Rotated(r, x, p);
      EXPECT_TRUE(AllClose(ToDoubles(y.cview()), RefRotate(ToDoubles(x.cview()), dims, c, pos),
                           dtype == DType::kF32 ? kF32Tol : kBF16Tol));
    }
  }
}

// At the largest positions (2^40) and under a large frequency (linear
// factor 1e-6: angles near 1e18 rad), p * inv_freq rounded to fp64 is off
// by up to 1e-4 rad or by whole radians. Each angle is taken as the exact
// product of the position and the fp64 frequency: cos and sin are within
// fp32's rounding of a __float128 evaluation (113-bit mantissa: the 94-bit
// product is exact, and sinq/cosq reduce it exactly).
TEST(RopePropertyTest, AnglesAreExactProductsAtThePositionLimit) {
  RopeConfig big = MakeConfig(64, 0, RopeLayout::kHalfSplit);
  RopeConfig fast = big;
  fast.scaling.type = RopeScalingType::kLinear;
  fast.scaling.factor = 1e-6;
  const std::vector<int64_t> pos = {(int64_t{1} << 40) - 1, int64_t{1} << 40, 999999999989,
                                    123456789012, 1000003};
  for (const RopeConfig& c : {big, fast}) {
    const RopeRotator r = MakeRotator(c, 64);
    const std::vector<double>& inv_freq = r.frequencies().inv_freq;  // the fp64 frequencies
    ASSERT_EQ(inv_freq.size(), 32u);
    std::vector<float> cs(pos.size() * 32), sn(pos.size() * 32);
    ASSERT_TRUE(r.CosSin(pos, absl::MakeSpan(cs), absl::MakeSpan(sn)).ok());
    for (size_t k = 0; k < pos.size(); ++k) {
      for (int i = 0; i < 32; ++i) {
        const __float128 angle = static_cast<__float128>(pos[k]) * inv_freq[i];
        EXPECT_NEAR(cs[k * 32 + i], static_cast<double>(cosq(angle)), 6e-8)
            << "position " << pos[k] << " pair " << i << " factor " << c.scaling.factor;
        EXPECT_NEAR(sn[k * 32 + i], static_cast<double>(sinq(angle)), 6e-8)
            << "position " << pos[k] << " pair " << i << " factor " << c.scaling.factor;
      }
    }
  }
}

TEST(RopePropertyTest, ThreadCountDoesNotChangeTheResult) {
  const Dims dims = {3, 129, 4, 128};
  const RopeRotator r = MakeRotator(MakeConfig(128, 0, RopeLayout::kInterleaved), 100);
  const Tensor x = RandomTensor(DType::kF32, dims, 91);
  const Tensor y1 = Rotated(r, x, Positions(), RopeDirection::kForward, 1);
  for (int threads : {2, 3, 8}) {
    EXPECT_TRUE(BitwiseEqual(y1, Rotated(r, x, Positions(), RopeDirection::kForward, threads)))
        << threads << " threads";
  }
}

TEST(RopePropertyTest, RotatesAStridedCacheViewOnly) {
  // The first 5 of 16 cached rows, as a server views a preallocated KV cache.
  const Dims cache_dims = {2, 16, 3, 64};
  Tensor cache = RandomTensor(DType::kF32, cache_dims, 101);
  const std::vector<double> before = ToDoubles(cache.cview());
  const RopeConfig c = MakeConfig(64, 0, RopeLayout::kHalfSplit);
  const RopeRotator r = MakeRotator(c, 32);
  const std::vector<int64_t> offsets = {0, 9};
  Positions p;
  p.offsets = offsets;
  ASSERT_TRUE(r.Apply(cache.view().Slice(1, 0, 5), p, RopeDirection::kForward, 2).ok());
  const std::vector<double> after = ToDoubles(cache.cview());

  std::vector<double> head_rows, got_rows;
  std::vector<int64_t> pos;
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t s = 0; s < 16; ++s) {
      for (int64_t i = 0; i < 3 * 64; ++i) {
        const size_t at = (b * 16 + s) * 3 * 64 + i;
        if (s < 5) {
          head_rows.push_back(before[at]);
          got_rows.push_back(after[at]);
        } else {
          ASSERT_EQ(after[at], before[at]) << "row " << s << " of batch " << b << " changed";
        }
      }
      if (s < 5) pos.push_back(offsets[b] + s);
    }
  }
  EXPECT_TRUE(AllClose(got_rows, RefRotate(head_rows, {2, 5, 3, 64}, c, pos), kF32Tol));
}

// ---------------------------------------------------------------------------
// Positions.

TEST(ResolvePositionsTest, DefaultOffsetsAndExplicit) {
  EXPECT_EQ(ResolvePositions(Positions(), 2, 3).value(), (std::vector<int64_t>{0, 1, 2, 0, 1, 2}));
  const std::vector<int64_t> offsets = {5, 10};
  Positions po;
  po.offsets = offsets;
  EXPECT_EQ(ResolvePositions(po, 2, 3).value(), (std::vector<int64_t>{5, 6, 7, 10, 11, 12}));
  const std::vector<int64_t> expl = {9, 0, 4, 4, 1, int64_t{1} << 40};
  Positions pe;
  pe.explicit_positions = expl;
  EXPECT_EQ(ResolvePositions(pe, 2, 3).value(), expl);
  EXPECT_TRUE(ResolvePositions(Positions(), 0, 3).value().empty());
}

void ExpectError(const absl::Status& s, absl::StatusCode code, const std::string& message) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(message));
}

TEST(ResolvePositionsTest, Errors) {
  const std::vector<int64_t> five = {0, 1, 2, 3, 4};
  Positions p;
  p.explicit_positions = five;
  ExpectError(ResolvePositions(p, 2, 3).status(), absl::StatusCode::kInvalidArgument,
              "explicit_positions has 5 entries, expected batch * seq = 2 * 3 = 6");

  const std::vector<int64_t> one = {0};
  Positions po;
  po.offsets = one;
  ExpectError(ResolvePositions(po, 2, 3).status(), absl::StatusCode::kInvalidArgument,
              "offsets has 1 entries, expected batch = 2");

  const std::vector<int64_t> two = {0, 0};
  const std::vector<int64_t> six = {0, 1, 2, 3, 4, 5};
  Positions both;
  both.offsets = two;
  both.explicit_positions = six;
  ExpectError(ResolvePositions(both, 2, 3).status(), absl::StatusCode::kInvalidArgument,
              "at most one");

  const std::vector<int64_t> negative = {0, 1, 2, -1, 4, 5};
  Positions pn;
  pn.explicit_positions = negative;
  ExpectError(ResolvePositions(pn, 2, 3).status(), absl::StatusCode::kInvalidArgument,
              "explicit_positions[3] must be >= 0, got -1");
  const std::vector<int64_t> neg_offset = {0, -7};
  Positions pno;
  pno.offsets = neg_offset;
  ExpectError(ResolvePositions(pno, 2, 3).status(), absl::StatusCode::kInvalidArgument,
              "offsets[1] must be >= 0, got -7");

  const std::vector<int64_t> huge = {0, 1, 2, 3, 4, (int64_t{1} << 40) + 1};
  Positions ph;
  ph.explicit_positions = huge;
  ExpectError(ResolvePositions(ph, 2, 3).status(), absl::StatusCode::kOutOfRange,
              "explicit_positions[5] = 1099511627777");
  const std::vector<int64_t> late = {0, (int64_t{1} << 40) - 1};
  Positions pl;
  pl.offsets = late;
  ExpectError(ResolvePositions(pl, 2, 3).status(), absl::StatusCode::kOutOfRange, "offsets[1]");
  ExpectError(ResolvePositions(Positions(), -1, 3).status(), absl::StatusCode::kInvalidArgument,
              "batch");
}

// ---------------------------------------------------------------------------
// Apply / CosSin / planning errors.

TEST(RopeErrorsTest, ApplyRejectsBadInputsWithExactCodes) {
  const RopeRotator r = MakeRotator(MakeConfig(64, 0, RopeLayout::kHalfSplit), 16);
  Tensor x = RandomTensor(DType::kF32, {2, 3, 2, 64}, 111);
  const Tensor original = Tensor::CopyOf(x.cview()).value();

  const std::vector<int64_t> wrong_len = {0, 1, 2};
  Positions p;
  p.explicit_positions = wrong_len;
  ExpectError(r.Apply(x.view(), p, RopeDirection::kForward, 1), absl::StatusCode::kInvalidArgument,
              "explicit_positions has 3 entries");
  const std::vector<int64_t> negative = {0, 1, 2, 3, -4, 5};
  p.explicit_positions = negative;
  ExpectError(r.Apply(x.view(), p, RopeDirection::kForward, 1), absl::StatusCode::kInvalidArgument,
              "explicit_positions[4] must be >= 0, got -4");
  const std::vector<int64_t> past = {0, 1, 2, 3, 4, (int64_t{1} << 40) + 1};
  p.explicit_positions = past;
  ExpectError(r.Apply(x.view(), p, RopeDirection::kForward, 1), absl::StatusCode::kOutOfRange,
              "maximum position");
  // Errors leave the data alone.
  EXPECT_TRUE(BitwiseEqual(x, original));

  Tensor wrong_dim = RandomTensor(DType::kF32, {2, 3, 2, 32}, 112);
  ExpectError(r.Apply(wrong_dim.view(), Positions(), RopeDirection::kForward, 1),
              absl::StatusCode::kInvalidArgument, "x has head_dim 32");
  Tensor rank3 = RandomTensor(DType::kF32, {3, 2, 64}, 113);
  ExpectError(r.Apply(rank3.view(), Positions(), RopeDirection::kForward, 1),
              absl::StatusCode::kInvalidArgument, "x must have rank 4");
  ExpectError(r.Apply(x.view(), Positions(), RopeDirection::kForward, 0),
              absl::StatusCode::kInvalidArgument, "num_threads must be >= 1, got 0");
  ExpectError(r.Apply(TensorView(), Positions(), RopeDirection::kForward, 1),
              absl::StatusCode::kInvalidArgument, "x");
}

TEST(RopeErrorsTest, ZeroSizeTensorsAreANoOp) {
  const RopeRotator r = MakeRotator(MakeConfig(64, 0, RopeLayout::kInterleaved), 16);
  for (const Dims& dims : {Dims{0, 7, 2, 64}, Dims{2, 0, 2, 64}, Dims{2, 7, 0, 64}}) {
    Tensor x = Tensor::Create(DType::kBF16, dims).value();
    EXPECT_TRUE(r.Apply(x.view(), Positions(), RopeDirection::kForward, 2).ok())
        << DimsToString(dims);
  }
  // No data pointer at all is fine when there is nothing to rotate.
  TensorView empty(nullptr, DType::kF32, Dims{2, 0, 2, 64});
  const std::vector<int64_t> offsets = {3, 4};
  Positions p;
  p.offsets = offsets;
  EXPECT_TRUE(r.Apply(empty, p, RopeDirection::kInverse, 1).ok());
}

TEST(RopeErrorsTest, CosSinAndPlanningErrors) {
  const RopeConfig c = MakeConfig(64, 0, RopeLayout::kHalfSplit);
  const RopeRotator r = MakeRotator(c, 16);
  const std::vector<int64_t> pos = {1, 2};
  std::vector<float> cs(64), sn(63);
  ExpectError(r.CosSin(pos, absl::MakeSpan(cs), absl::MakeSpan(sn)),
              absl::StatusCode::kInvalidArgument, "got 64 and 63");
  sn.resize(64);
  const std::vector<int64_t> negative = {1, -2};
  ExpectError(r.CosSin(negative, absl::MakeSpan(cs), absl::MakeSpan(sn)),
              absl::StatusCode::kInvalidArgument, "positions[1] must be >= 0, got -2");

  ExpectError(RopeRotator::Create(c, 0, -1).status(), absl::StatusCode::kInvalidArgument,
              "table_positions must be >= 0, got -1");
  ExpectError(RopeRotator::Create(c, -5, 8).status(), absl::StatusCode::kInvalidArgument,
              "seq_len must be >= 0, got -5");
  RopeFrequencies f = ComputeRopeFrequencies(c, 0).value();
  f.inv_freq.pop_back();
  ExpectError(RopeRotator::FromFrequencies(c, f, 8).status(), absl::StatusCode::kInvalidArgument,
              "inv_freq has 31 entries, expected rotary_dim / 2 = 32");
  f = ComputeRopeFrequencies(c, 0).value();
  f.attention_factor = std::nan("");
  ExpectError(RopeRotator::FromFrequencies(c, f, 8).status(), absl::StatusCode::kInvalidArgument,
              "attention_factor must be finite and > 0, got nan");
  f = ComputeRopeFrequencies(c, 0).value();
  f.inv_freq[3] = INFINITY;
  ExpectError(RopeRotator::FromFrequencies(c, f, 8).status(), absl::StatusCode::kInvalidArgument,
              "inv_freq[3] must be finite, got inf");
}

// transformers computes inv_freq and position * inv_freq in float32: an
// angle past FLT_MAX (a tiny linear factor, or a tiny longrope factor, at a
// large position) is refused before any rotation, naming the position and
// the setting, and x is left alone; an inverse frequency past FLT_MAX (Inf
// in float32: NaN at every position, 0 included) is refused when the
// rotator is built. Angles are still computed in double.
TEST(RopeErrorsTest, AnglesThatOverflowFloat32AreRefusedUpFront) {
  RopeConfig c = MakeConfig(8, 0, RopeLayout::kHalfSplit);
  c.scaling.type = RopeScalingType::kLinear;
  c.scaling.factor = 1e-36;  // inv_freq[0] = 1e36: finite in float32
  const RopeRotator r = MakeRotator(c, 0);
  Tensor x = RandomTensor(DType::kF32, {1, 2, 1, 8}, 7);
  const Tensor original = Tensor::CopyOf(x.cview()).value();
  // 1e36 * 1000 = 1e39: finite in double, Inf in float32.
  const std::vector<int64_t> pos = {1, 1000};
  Positions p;
  p.explicit_positions = pos;
  ExpectError(r.Apply(x.view(), p, RopeDirection::kForward, 1), absl::StatusCode::kInvalidArgument,
              "position 1000 times inv_freq[0] = 1e+36 (from theta 10000, linear "
              "scaling.factor = 1e-36) overflows the rotation angle (above the float32 range");
  EXPECT_TRUE(BitwiseEqual(x, original));
  std::vector<float> cs(8), sn(8);
  ExpectError(r.CosSin(pos, absl::MakeSpan(cs), absl::MakeSpan(sn)),
              absl::StatusCode::kInvalidArgument, "linear scaling.factor = 1e-36");
  // Small positions are fine with the same factor: 1e36 * 300 = 3e38.
  const std::vector<int64_t> small = {0, 300};
  p.explicit_positions = small;
  EXPECT_TRUE(r.Apply(x.view(), p, RopeDirection::kForward, 1).ok());
  EXPECT_TRUE(r.CosSin(small, absl::MakeSpan(cs), absl::MakeSpan(sn)).ok());
  // 1e36 * 341 = 3.41e38 > FLT_MAX (3.4028e38): refused.
  const std::vector<int64_t> edge = {341};
  EXPECT_FALSE(r.CosSin(edge, absl::MakeSpan(cs).subspan(0, 4),
                        absl::MakeSpan(sn).subspan(0, 4)).ok());
  // An inverse frequency past float32 is refused outright (no position is
  // finite in transformers), naming the factor.
  c.scaling.factor = 1e-300;
  ExpectError(RopeRotator::Create(c, 0, 0).status(), absl::StatusCode::kInvalidArgument,
              "inv_freq[0] = 1e+300 (from theta 10000, linear scaling.factor = 1e-300) is above "
              "the float32 range");
  c.scaling.factor = 2.9e-39;  // 1 / 2.9e-39 = 3.45e38 > FLT_MAX, finite in double
  EXPECT_FALSE(RopeRotator::Create(c, 0, 0).ok());
  // A table planned that far is refused the same way.
  c.scaling.factor = 1e-36;
  ExpectError(RopeRotator::Create(c, 0, 1000).status(), absl::StatusCode::kInvalidArgument,
              "table position 999 times inv_freq[0]");
  EXPECT_TRUE(RopeRotator::Create(c, 0, 300).ok());
  // LongRoPE names its factor lists.
  RopeConfig lr = MakeConfig(4, 0, RopeLayout::kHalfSplit);
  lr.scaling.type = RopeScalingType::kLongRope;
  lr.scaling.original_max_positions = 8;
  lr.scaling.short_factor = {1e-36, 1.0};
  lr.scaling.long_factor = {1.0, 1.0};
  lr.scaling.attention_factor = 1.0;
  const RopeRotator rl = MakeRotator(lr, 0);
  ExpectError(rl.CosSin(pos, absl::MakeSpan(cs).subspan(0, 4), absl::MakeSpan(sn).subspan(0, 4)),
              absl::StatusCode::kInvalidArgument, "short_factor / long_factor[0] = 1e-36 / 1");
}

TEST(RopeErrorsTest, FromFrequenciesUsesTheGivenFrequencies) {
  // A caller (a dynamic-NTK session, say) may plan with its own frequencies.
  const RopeConfig c = MakeConfig(8, 0, RopeLayout::kHalfSplit);
  RopeFrequencies f;
  f.inv_freq = {0.5, 0.25, 0.125, 0.0625};
  f.attention_factor = 2.0;
  const RopeRotator r = RopeRotator::FromFrequencies(c, f, 4).value();
  const std::vector<int64_t> pos = {3, 9};
  std::vector<float> cs(8), sn(8);
  ASSERT_TRUE(r.CosSin(pos, absl::MakeSpan(cs), absl::MakeSpan(sn)).ok());
  for (int k = 0; k < 2; ++k) {
    for (int i = 0; i < 4; ++i) {
      EXPECT_NEAR(cs[k * 4 + i], 2.0 * std::cos(pos[k] * f.inv_freq[i]), 1e-6);
      EXPECT_NEAR(sn[k * 4 + i], 2.0 * std::sin(pos[k] * f.inv_freq[i]), 1e-6);
    }
  }
}


// The error table (issue 14's closing note): every registry rule rotating
// f32 vectors at positions up to 1e6, against the fp64 reference with the
// reference's own frequencies for the length the rule is planned for.
// Relative error per token (norm-wise over heads x head_dim), the largest
// per position band; every entry must be <= 1e-6. Printed for the record.
TEST(RopeAccuracyTest, EveryRuleWithinOneMillionthOfFp64UpToPositionOneMillion) {
  const int64_t d = 128, heads = 4;
  const std::vector<int64_t> positions = {0,      1,      4095,   4096,   65535,
                                          65537,  999983, 999999, 1000000};
  const int64_t seq_len = 1000001;
  std::vector<double> short_f, long_f;
  for (int64_t i = 0; i < d / 2; ++i) {
    short_f.push_back(1.0 + 0.02 * i);
    long_f.push_back(1.5 + 0.5 * i);
  }
  std::printf("%-10s %12s %12s %12s\n", "rule", "pos<=4096", "pos<=65537", "pos<=1e6");
  for (const RopeRule& rule : RopeRules()) {
    for (bool variant : {false, true}) {
      if (variant && rule.type != RopeScalingType::kYarn) continue;  // yarn truncate=false
      RopeConfig c = MakeConfig(d, 0, RopeLayout::kHalfSplit, 500000.0);
      RopeScaling& sc = c.scaling;
      sc.type = rule.type;
      if (rule.reads & kRopeFactor) sc.factor = 8.0;
      if (rule.reads & kRopeOriginalMax) sc.original_max_positions = 4096;
      sc.short_factor = short_f;
      sc.long_factor = long_f;
      if (rule.type != RopeScalingType::kLongRope) sc.short_factor.clear(), sc.long_factor.clear();
      sc.truncate = !variant;
      RefRule want;
      switch (rule.type) {
        case RopeScalingType::kDefault:
          want.inv_freq = ref::DefaultInvFreq(d, c.theta);
          break;
        case RopeScalingType::kLinear:
          want.inv_freq = ref::LinearInvFreq(d, c.theta, 8.0);
          break;
        case RopeScalingType::kNtk:
          want.inv_freq = ref::NtkInvFreq(d, c.theta, 8.0);
          break;
        case RopeScalingType::kDynamicNtk:
          want.inv_freq = ref::DynamicNtkInvFreq(d, c.theta, 8.0, 4096, seq_len);
          break;
        case RopeScalingType::kYarn: {
          ref::YarnRefParams y;
          y.factor = 8.0;
          y.original_len = 4096;
          y.truncate = !variant;
          want.inv_freq = ref::YarnInvFreq(d, c.theta, y);
          want.attention_factor = ref::YarnAttentionFactor(y);
          break;
        }
        case RopeScalingType::kLongRope:
          want.inv_freq = ref::LongRopeInvFreq(d, c.theta, short_f, long_f, 4096, seq_len);
          want.attention_factor = ref::LongRopeAttentionFactor(8.0, 4096, std::nullopt);
          break;
        case RopeScalingType::kLlama3:
          want.inv_freq = ref::Llama3InvFreq(d, c.theta, 8.0, 1.0, 4.0, 4096);
          break;
      }
      const RopeRotator r = RopeRotator::Create(c, seq_len, 8192).value();
      const int64_t n = static_cast<int64_t>(positions.size());
      const Tensor x = RandomTensor(DType::kF32, {1, n, heads, d}, 4242);
      const Tensor y = Rotated(r, x, Positions{positions, {}});
      ref::RotateRefParams p;
      p.seq = n;
      p.heads = heads;
      p.head_dim = p.rotary_dim = d;
      p.positions = positions;
      p.inv_freq = want.inv_freq;
      p.attention_factor = want.attention_factor;
      const std::vector<double> expect = ref::Rotate(p, ToDoubles(x.cview()));
      const std::vector<double> got = ToDoubles(y.cview());
      double band[3] = {0, 0, 0};
      const int64_t row = heads * d;
      for (int64_t t = 0; t < n; ++t) {
        const double err = RelativeError(
            absl::MakeConstSpan(got).subspan(t * row, row),
            absl::MakeConstSpan(expect).subspan(t * row, row));
        const int b = positions[t] <= 4096 ? 0 : positions[t] <= 65537 ? 1 : 2;
        band[b] = std::max(band[b], err);
        EXPECT_LE(err, 1e-6) << rule.name << " at position " << positions[t];
      }
      std::printf("%-10s %12.2e %12.2e %12.2e\n",
                  variant ? "yarn/trunc0" : rule.name, band[0], band[1], band[2]);
    }
  }
}

}  // namespace
}  // namespace ropeattn
