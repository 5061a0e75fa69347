// RoPE scaling rules: each rule against the fp64 reference (tests/reference/
// rope_ref.h), against known values from an independent Python script, its
// documented properties, and validation with exact status codes.
//
// Tolerance: frequencies are fp64 on both sides, so entries must agree to
// 1e-12 relative (only libm ulp differences remain).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/rope.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/reference/rope_ref.h"

namespace ropeattn {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr double kFreqTol = 1e-12;

void ExpectAllNear(absl::Span<const double> actual, absl::Span<const double> expected,
                   const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], kFreqTol * std::abs(expected[i]))
        << what << ", entry " << i;
  }
}

RopeConfig Config(int64_t head_dim, int64_t rotary_dim, double theta, RopeScalingType type) {
  RopeConfig c;
  c.head_dim = head_dim;
  c.rotary_dim = rotary_dim;
  c.theta = theta;
  c.scaling.type = type;
  return c;
}

// Deterministic, non-monotone per-pair factors (as LongRoPE's searched ones are).
std::vector<double> Factors(int64_t n, double scale) {
  std::vector<double> f(n);
  for (int64_t i = 0; i < n; ++i) f[i] = 1.0 + scale * i + 0.3 * (i % 3);
  return f;
}

// The reference frequencies of a config, dispatching by hand to ref::*.
struct RefFreqs {
  std::vector<double> inv_freq;
  double attention_factor = 1.0;
};
RefFreqs Reference(const RopeConfig& c, int64_t seq_len) {
  const int64_t d = c.rotary_dim == 0 ? c.head_dim : c.rotary_dim;
  const RopeScaling& s = c.scaling;
  RefFreqs r;
  switch (s.type) {
    case RopeScalingType::kDefault:
      r.inv_freq = ref::DefaultInvFreq(d, c.theta);
      break;
    case RopeScalingType::kLinear:
      r.inv_freq = ref::LinearInvFreq(d, c.theta, s.factor);
      break;
    case RopeScalingType::kNtk:
      r.inv_freq = ref::NtkInvFreq(d, c.theta, s.factor);
      break;
    case RopeScalingType::kDynamicNtk:
      r.inv_freq = ref::DynamicNtkInvFreq(d, c.theta, s.factor, s.original_max_positions, seq_len);
      break;
    case RopeScalingType::kYarn: {
      ref::YarnRefParams y;
      y.factor = s.factor;
      y.original_len = s.original_max_positions;
      y.beta_fast = s.beta_fast;
      y.beta_slow = s.beta_slow;
      y.attention_factor = s.attention_factor;
      y.mscale = s.mscale;
      y.mscale_all_dim = s.mscale_all_dim;
      y.truncate = s.truncate;
      r.inv_freq = ref::YarnInvFreq(d, c.theta, y);
      r.attention_factor = ref::YarnAttentionFactor(y);
      break;
    }
    case RopeScalingType::kLongRope:
      r.inv_freq = ref::LongRopeInvFreq(d, c.theta, s.short_factor, s.long_factor,
                                        s.original_max_positions, seq_len);
      r.attention_factor =
          ref::LongRopeAttentionFactor(s.factor, s.original_max_positions, s.attention_factor,
                                       s.max_position_embeddings);
      break;
    case RopeScalingType::kLlama3:
      r.inv_freq = ref::Llama3InvFreq(d, c.theta, s.factor, s.low_freq_factor, s.high_freq_factor,
                                      s.original_max_positions);
      break;
  }
  return r;
}

// Configs of every rule, with and without partial rotary.
std::vector<RopeConfig> AllRuleConfigs() {
  std::vector<RopeConfig> out;
  for (int64_t head_dim : {64, 80, 128}) {
    for (int64_t rotary_dim : {int64_t{0}, head_dim / 2}) {
      for (double theta : {10000.0, 500000.0}) {
        const int64_t d = rotary_dim == 0 ? head_dim : rotary_dim;
        RopeConfig c = Config(head_dim, rotary_dim, theta, RopeScalingType::kDefault);
        out.push_back(c);
        // Factors below 1 compress (transformers only warns about them).
        for (double f : {0.5, 2.0, 8.0}) {
          c = Config(head_dim, rotary_dim, theta, RopeScalingType::kLinear);
          c.scaling.factor = f;
          out.push_back(c);
          c.scaling.type = RopeScalingType::kNtk;
          out.push_back(c);
          c.scaling.type = RopeScalingType::kDynamicNtk;
          c.scaling.original_max_positions = 2048;
          out.push_back(c);
          c.scaling.type = RopeScalingType::kLlama3;
          c.scaling.original_max_positions = 8192;
          out.push_back(c);
          c.scaling.low_freq_factor = 2.0;
          c.scaling.high_freq_factor = 8.0;
          out.push_back(c);
        }
        RopeConfig y = Config(head_dim, rotary_dim, theta, RopeScalingType::kYarn);
        y.scaling.factor = 16.0;
        y.scaling.original_max_positions = 4096;
        out.push_back(y);
        y.scaling.beta_fast = 64.0;
        y.scaling.beta_slow = 2.0;
        y.scaling.mscale = 0.9;
        y.scaling.mscale_all_dim = 0.5;
        out.push_back(y);
        y.scaling.attention_factor = 1.3;
        out.push_back(y);
        y.scaling.attention_factor.reset();
        y.scaling.truncate = false;
        out.push_back(y);
        // Betas the other way round: the ramp runs backwards (transformers
        // only warns); a factor below 1: attention factor 1 (get_mscale).
        y.scaling.truncate = true;
        y.scaling.beta_fast = 2.0;
        y.scaling.beta_slow = 64.0;
        out.push_back(y);
        y.scaling.factor = 0.5;
        out.push_back(y);
        RopeConfig l = Config(head_dim, rotary_dim, theta, RopeScalingType::kLongRope);
        l.scaling.factor = 32.0;
        l.scaling.original_max_positions = 4096;
        l.scaling.short_factor = Factors(d / 2, 0.01);
        l.scaling.long_factor = Factors(d / 2, 0.5);
        out.push_back(l);
        l.scaling.factor = 0.5;  // factor <= 1: attention factor 1
        out.push_back(l);
        l.scaling.attention_factor = 1.1;
        out.push_back(l);
        l.scaling.attention_factor.reset();
        l.scaling.max_position_embeddings = 131072;  // Phi-3: f' = 32 whatever factor says
        out.push_back(l);
      }
    }
  }
  return out;
}

TEST(RopeScalingNameTest, ParsesEveryHuggingFaceSpellingAndRoundTrips) {
  for (RopeScalingType t :
       {RopeScalingType::kDefault, RopeScalingType::kLinear, RopeScalingType::kNtk,
        RopeScalingType::kDynamicNtk, RopeScalingType::kYarn, RopeScalingType::kLongRope,
        RopeScalingType::kLlama3}) {
    absl::StatusOr<RopeScalingType> parsed = ParseRopeScalingType(RopeScalingTypeName(t));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, t);
  }
  EXPECT_EQ(std::string(RopeScalingTypeName(RopeScalingType::kDynamicNtk)), "dynamic");
  EXPECT_EQ(std::string(RopeScalingTypeName(RopeScalingType::kLongRope)), "longrope");
  absl::StatusOr<RopeScalingType> su = ParseRopeScalingType("su");
  ASSERT_TRUE(su.ok());
  EXPECT_EQ(*su, RopeScalingType::kLongRope);
  EXPECT_EQ(std::string(RopeLayoutName(RopeLayout::kHalfSplit)), "half_split");
  EXPECT_EQ(std::string(RopeLayoutName(RopeLayout::kInterleaved)), "interleaved");
}

TEST(RopeScalingNameTest, UnknownNameIsInvalidArgumentNamingIt) {
  absl::StatusOr<RopeScalingType> r = ParseRopeScalingType("foo");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("\"foo\""));
  // config.json spellings are case-sensitive.
  EXPECT_EQ(ParseRopeScalingType("Linear").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseRopeScalingType("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RopeFrequenciesTest, EveryRuleMatchesReference) {
  const std::vector<RopeConfig> configs = AllRuleConfigs();
  ASSERT_GT(configs.size(), 100u);
  for (const RopeConfig& c : configs) {
    for (int64_t seq_len :
         {int64_t{1}, int64_t{2048}, int64_t{4096}, int64_t{4097}, int64_t{50000}}) {
      const std::string what =
          absl::StrFormat("%s head_dim %d rotary_dim %d theta %g factor %g seq_len %d",
                          RopeScalingTypeName(c.scaling.type), c.head_dim, c.rotary_dim, c.theta,
                          c.scaling.factor, seq_len);
      absl::StatusOr<RopeFrequencies> f = ComputeRopeFrequencies(c, seq_len);
      ASSERT_TRUE(f.ok()) << what << ": " << f.status();
      const RefFreqs r = Reference(c, seq_len);
      ExpectAllNear(f->inv_freq, r.inv_freq, what);
      EXPECT_NEAR(f->attention_factor, r.attention_factor, kFreqTol) << what;
    }
  }
}

// Known values from tests/tools/rope_tables.py (d = 16). Regenerate with:
//   python3 tests/tools/rope_tables.py
constexpr double kDefaultInvFreq[] = {
    1,
    0.31622776601683794,
    0.10000000000000001,
    0.031622776601683791,
    0.01,
    0.003162277660168379,
    0.001,
    0.00031622776601683794,
};
constexpr double kLinearInvFreq[] = {
    0.25,
    0.079056941504209485,
    0.025000000000000001,
    0.0079056941504209478,
    0.0025000000000000001,
    0.00079056941504209474,
    0.00025000000000000001,
    7.9056941504209485e-05,
};
constexpr double kNtkInvFreq[] = {
    1,
    0.2594128170149228,
    0.067295009631617803,
    0.017457188019584336,
    0.0045286183213195334,
    0.0011747816359188909,
    0.00030475341355111886,
    7.9056941504209485e-05,
};
constexpr double kDynamicInvFreq[] = {
    1,
    0.2394813560059838,
    0.057351319874464762,
    0.013734571852269752,
    0.0032891738913431771,
    0.00078769582363834257,
    0.00018863846396516057,
    4.5175395145262567e-05,
};
constexpr double kYarnInvFreq[] = {
    1,
    0.31622776601683794,
    0.10000000000000001,
    0.024705294220065462,
    0.0056249999999999998,
    0.0010870329456828802,
    0.000125,
    3.9528470752104742e-05,
};
constexpr double kYarnAttention = 1.2079441541679836;
constexpr double kYarnMscaleInvFreq[] = {
    1,
    0.31622776601683794,
    0.10000000000000001,
    0.023914724805023366,
    0.0051250000000000002,
    0.00084986212117025184,
    2.5000000000000001e-05,
    7.9056941504209471e-06,
};
constexpr double kYarnMscaleAttention = 1.0857263992561355;
constexpr double kLongRopeShortInvFreq[] = {
    1,
    0.30116930096841704,
    0.090909090909090912,
    0.024325212770525996,
    0.0062500000000000003,
    0.0015811388300841895,
    0.00040000000000000002,
    0.00010540925533894597,
};
constexpr double kLongRopeLongInvFreq[] = {
    1,     0.26352313834736496,    0.055555555555555552,   0.010540925533894598,
    0.002, 0.00039528470752104737, 8.3333333333333331e-05, 1.9764235376052371e-05,
};
constexpr double kLongRopeAttention = 1.1902380714238083;
constexpr double kLlama3InvFreq[] = {
    1,
    0.19392274474868576,
    0.037606030930863933,
    0.0072926647372171085,
    0.00052484616099295468,
    3.4281021959525912e-05,
    6.6478698711812362e-06,
    1.2891731721515574e-06,
};
// The per-pair LongRoPE factors the script uses.
const std::vector<double> kShort = {1.0, 1.05, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0};
const std::vector<double> kLong = {1.0, 1.2, 1.8, 3.0, 5.0, 8.0, 12.0, 16.0};

void ExpectKnown(const RopeConfig& c, int64_t seq_len, absl::Span<const double> inv_freq,
                 double attention_factor, const std::string& what) {
  absl::StatusOr<RopeFrequencies> f = ComputeRopeFrequencies(c, seq_len);
  ASSERT_TRUE(f.ok()) << what << ": " << f.status();
  ExpectAllNear(f->inv_freq, inv_freq, what);
  EXPECT_NEAR(f->attention_factor, attention_factor, kFreqTol) << what;
}

TEST(RopeFrequenciesTest, KnownValues) {
  RopeConfig c = Config(16, 0, 10000.0, RopeScalingType::kDefault);
  ExpectKnown(c, 0, kDefaultInvFreq, 1.0, "default");

  c.scaling.type = RopeScalingType::kLinear;
  c.scaling.factor = 4.0;
  ExpectKnown(c, 0, kLinearInvFreq, 1.0, "linear");
  c.scaling.type = RopeScalingType::kNtk;
  ExpectKnown(c, 0, kNtkInvFreq, 1.0, "ntk");

  c.scaling.type = RopeScalingType::kDynamicNtk;
  c.scaling.factor = 2.0;
  c.scaling.original_max_positions = 64;
  ExpectKnown(c, 256, kDynamicInvFreq, 1.0, "dynamic");

  c.scaling.type = RopeScalingType::kYarn;
  c.scaling.factor = 8.0;
  c.scaling.original_max_positions = 4096;
  ExpectKnown(c, 0, kYarnInvFreq, kYarnAttention, "yarn");
  c.scaling.factor = 40.0;
  c.scaling.mscale = 1.0;
  c.scaling.mscale_all_dim = 0.707;
  ExpectKnown(c, 0, kYarnMscaleInvFreq, kYarnMscaleAttention, "yarn mscale");

  c = Config(16, 0, 10000.0, RopeScalingType::kLongRope);
  c.scaling.factor = 32.0;
  c.scaling.original_max_positions = 4096;
  c.scaling.short_factor = kShort;
  c.scaling.long_factor = kLong;
  ExpectKnown(c, 4096, kLongRopeShortInvFreq, kLongRopeAttention, "longrope short");
  ExpectKnown(c, 4097, kLongRopeLongInvFreq, kLongRopeAttention, "longrope long");

  c = Config(16, 0, 500000.0, RopeScalingType::kLlama3);
  c.scaling.factor = 8.0;
  c.scaling.original_max_positions = 8192;
  ExpectKnown(c, 0, kLlama3InvFreq, 1.0, "llama3");
}

TEST(RopeFrequenciesTest, PartialRotaryUsesRotaryDimNotHeadDim) {
  // Known values of d = 16 must come out of head_dim 128 with rotary_dim 16.
  RopeConfig c = Config(128, 16, 10000.0, RopeScalingType::kDefault);
  ExpectKnown(c, 0, kDefaultInvFreq, 1.0, "default, rotary_dim 16 of 128");
  c.scaling.type = RopeScalingType::kNtk;
  c.scaling.factor = 4.0;
  ExpectKnown(c, 0, kNtkInvFreq, 1.0, "ntk, rotary_dim 16 of 128");
  c = Config(128, 16, 500000.0, RopeScalingType::kLlama3);
  c.scaling.factor = 8.0;
  c.scaling.original_max_positions = 8192;
  ExpectKnown(c, 0, kLlama3InvFreq, 1.0, "llama3, rotary_dim 16 of 128");
}

TEST(RopeFrequenciesTest, DynamicNtkIsDefaultUpToOriginalLengthThenGrows) {
  RopeConfig c = Config(64, 0, 10000.0, RopeScalingType::kDynamicNtk);
  c.scaling.factor = 4.0;
  c.scaling.original_max_positions = 1024;
  RopeConfig plain = Config(64, 0, 10000.0, RopeScalingType::kDefault);
  const std::vector<double> base = ComputeRopeFrequencies(plain, 0).value().inv_freq;
  for (int64_t seq_len : {0, 1, 500, 1024}) {
    ExpectAllNear(ComputeRopeFrequencies(c, seq_len).value().inv_freq, base,
                  absl::StrCat("dynamic at seq_len ", seq_len));
  }
  // Past L0 the base grows with L, so every non-constant frequency shrinks.
  std::vector<double> prev = base;
  for (int64_t seq_len : {1025, 2048, 4096, 100000}) {
    const std::vector<double> f = ComputeRopeFrequencies(c, seq_len).value().inv_freq;
    EXPECT_EQ(f[0], 1.0);
    for (size_t i = 1; i < f.size(); ++i) {
      EXPECT_LT(f[i], prev[i]) << "seq_len " << seq_len << " entry " << i;
    }
    prev = f;
  }
}

TEST(RopeFrequenciesTest, LongRopeSwitchesStrictlyAfterOriginalLength) {
  RopeConfig c = Config(32, 0, 10000.0, RopeScalingType::kLongRope);
  c.scaling.factor = 16.0;
  c.scaling.original_max_positions = 4096;
  c.scaling.short_factor = Factors(16, 0.01);
  c.scaling.long_factor = Factors(16, 0.7);
  const RopeConfig plain = Config(32, 0, 10000.0, RopeScalingType::kDefault);
  const std::vector<double> base = ComputeRopeFrequencies(plain, 0).value().inv_freq;
  std::vector<double> want_short(16), want_long(16);
  for (int i = 0; i < 16; ++i) {
    want_short[i] = base[i] / c.scaling.short_factor[i];
    want_long[i] = base[i] / c.scaling.long_factor[i];
  }
  ExpectAllNear(ComputeRopeFrequencies(c, 4095).value().inv_freq, want_short, "L0 - 1");
  ExpectAllNear(ComputeRopeFrequencies(c, 4096).value().inv_freq, want_short, "exactly L0");
  ExpectAllNear(ComputeRopeFrequencies(c, 4097).value().inv_freq, want_long, "L0 + 1");
  // The factor is the same on both sides of the switch.
  const double a = std::sqrt(1.0 + std::log(16.0) / std::log(4096.0));
  EXPECT_NEAR(ComputeRopeFrequencies(c, 4096).value().attention_factor, a, 1e-15);
  EXPECT_NEAR(ComputeRopeFrequencies(c, 4097).value().attention_factor, a, 1e-15);
}

TEST(RopeFrequenciesTest, YarnAttentionFactorRules) {
  RopeConfig c = Config(64, 0, 10000.0, RopeScalingType::kYarn);
  c.scaling.factor = 4.0;
  c.scaling.original_max_positions = 2048;
  EXPECT_NEAR(ComputeRopeFrequencies(c, 0).value().attention_factor, 0.1 * std::log(4.0) + 1.0,
              1e-15);
  // Only one of mscale / mscale_all_dim: the plain rule still applies.
  c.scaling.mscale = 2.0;
  EXPECT_NEAR(ComputeRopeFrequencies(c, 0).value().attention_factor, 0.1 * std::log(4.0) + 1.0,
              1e-15);
  c.scaling.mscale_all_dim = 2.0;  // equal => the ratio is 1
  EXPECT_NEAR(ComputeRopeFrequencies(c, 0).value().attention_factor, 1.0, 1e-15);
  c.scaling.attention_factor = 0.75;  // an override wins
  EXPECT_EQ(ComputeRopeFrequencies(c, 0).value().attention_factor, 0.75);
  // As in transformers (`if mscale and mscale_all_dim`), 0 is not given.
  c.scaling.attention_factor.reset();
  c.scaling.mscale = 0.0;
  c.scaling.mscale_all_dim = 1.0;
  EXPECT_NEAR(ComputeRopeFrequencies(c, 0).value().attention_factor, 0.1 * std::log(4.0) + 1.0,
              1e-15);
  c.scaling.mscale = 1.0;
  c.scaling.mscale_all_dim = 0.0;
  EXPECT_NEAR(ComputeRopeFrequencies(c, 0).value().attention_factor, 0.1 * std::log(4.0) + 1.0,
              1e-15);
  // factor 1: no interpolation at all, and no attention scaling.
  RopeConfig one = Config(64, 0, 10000.0, RopeScalingType::kYarn);
  one.scaling.original_max_positions = 2048;
  const RopeFrequencies f = ComputeRopeFrequencies(one, 0).value();
  EXPECT_EQ(f.attention_factor, 1.0);
  ExpectAllNear(f.inv_freq, ref::DefaultInvFreq(64, 10000.0), "yarn factor 1");
}

// transformers' find_correction_range with truncate=False: the bounds stay
// fractional. d = 64, base 10000, L0 4096: corr_dim(32) = 15.86...,
// corr_dim(1) = 30.95..., so truncation moves them to 15 and 31.
TEST(RopeFrequenciesTest, YarnTruncateFalseKeepsFractionalCorrectionBounds) {
  RopeConfig c = Config(64, 0, 10000.0, RopeScalingType::kYarn);
  c.scaling.factor = 8.0;
  c.scaling.original_max_positions = 4096;
  const double kPi = 3.14159265358979323846;
  auto corr_dim = [&](double r) {
    return 64.0 * std::log(4096.0 / (r * 2.0 * kPi)) / (2.0 * std::log(10000.0));
  };
  const double low = corr_dim(32.0), high = corr_dim(1.0);
  ASSERT_NE(low, std::floor(low));
  ASSERT_NE(high, std::ceil(high));
  const std::vector<double> base = ref::DefaultInvFreq(64, 10000.0);
  for (bool truncate : {true, false}) {
    c.scaling.truncate = truncate;
    const double lo = truncate ? std::floor(low) : low, hi = truncate ? std::ceil(high) : high;
    std::vector<double> want(32);
    for (int j = 0; j < 32; ++j) {
      const double ramp = std::clamp((j - lo) / (hi - lo), 0.0, 1.0);
      want[j] = base[j] / 8.0 * ramp + base[j] * (1.0 - ramp);
    }
    const RopeFrequencies f = ComputeRopeFrequencies(c, 0).value();
    ExpectAllNear(f.inv_freq, want, absl::StrCat("truncate ", truncate));
    EXPECT_NEAR(f.attention_factor, 0.1 * std::log(8.0) + 1.0, 1e-15);
  }
  // Pair 16 lies inside [15.86, 30.95] either way but at a different ramp.
  c.scaling.truncate = true;
  const double truncated = ComputeRopeFrequencies(c, 0).value().inv_freq[16];
  c.scaling.truncate = false;
  EXPECT_NE(ComputeRopeFrequencies(c, 0).value().inv_freq[16], truncated);
}

// Phi-3: config.json has max_position_embeddings 131072 and (top level)
// original_max_position_embeddings 4096; transformers then takes f = 32 for
// the attention factor, whatever rope_scaling.factor says.
TEST(RopeFrequenciesTest, LongRopeAttentionFactorFromMaxPositionEmbeddings) {
  RopeConfig c = Config(32, 0, 10000.0, RopeScalingType::kLongRope);
  c.scaling.original_max_positions = 4096;
  c.scaling.short_factor = Factors(16, 0.01);
  c.scaling.long_factor = Factors(16, 0.7);
  c.scaling.max_position_embeddings = 131072;
  const double want = std::sqrt(1.0 + std::log(32.0) / std::log(4096.0));
  for (double factor : {1.0, 4.0}) {
    c.scaling.factor = factor;
    EXPECT_NEAR(ComputeRopeFrequencies(c, 0).value().attention_factor, want, 1e-15);
    EXPECT_NEAR(ComputeRopeFrequencies(c, 5000).value().attention_factor, want, 1e-15);
  }
  c.scaling.max_position_embeddings = 4096;  // not extended: 1
  EXPECT_EQ(ComputeRopeFrequencies(c, 0).value().attention_factor, 1.0);
  c.scaling.max_position_embeddings = 131072;
  c.scaling.attention_factor = 1.25;  // an override still wins
  EXPECT_EQ(ComputeRopeFrequencies(c, 0).value().attention_factor, 1.25);
  c.scaling.attention_factor.reset();
  c.scaling.max_position_embeddings = -1;
  const absl::Status s = ComputeRopeFrequencies(c, 0).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("max_position_embeddings"));
}

// --- Validation: each bad field gives InvalidArgument naming it. ---

struct BadConfigCase {
  std::string name;
  RopeConfig config;
  std::string message;  // substring of the error
};

std::vector<BadConfigCase> BadConfigs() {
  std::vector<BadConfigCase> v;
  const RopeConfig ok = Config(64, 0, 10000.0, RopeScalingType::kDefault);
  auto add = [&](std::string name, std::string message, auto mutate) {
    RopeConfig c = ok;
    mutate(c);
    v.push_back({std::move(name), c, std::move(message)});
  };
  add("head_dim 0", "head_dim must be > 0, got 0", [](RopeConfig& c) { c.head_dim = 0; });
  add("odd rotary_dim", "rotary_dim must be even, got 63",
      [](RopeConfig& c) { c.rotary_dim = 63; });
  add("odd head_dim, full rotary", "rotary_dim must be even, got 63",
      [](RopeConfig& c) { c.head_dim = 63; });
  add("rotary_dim > head_dim", "rotary_dim must be <= head_dim (64), got 66",
      [](RopeConfig& c) { c.rotary_dim = 66; });
  add("negative rotary_dim", "rotary_dim must be >= 0", [](RopeConfig& c) { c.rotary_dim = -2; });
  add("theta NaN", "theta must be finite and > 1, got nan",
      [](RopeConfig& c) { c.theta = std::nan(""); });
  add("theta inf", "theta must be finite and > 1, got inf",
      [](RopeConfig& c) { c.theta = INFINITY; });
  add("theta 1", "theta must be finite and > 1, got 1", [](RopeConfig& c) { c.theta = 1.0; });
  add("factor NaN", "scaling.factor must be finite and > 0, got nan",
      [](RopeConfig& c) { c.scaling.factor = std::nan(""); });
  add("factor inf", "scaling.factor must be finite and > 0, got inf", [](RopeConfig& c) {
    c.scaling.type = RopeScalingType::kLinear;
    c.scaling.factor = INFINITY;
  });
  add("linear factor 0", "scaling.factor must be finite and > 0, got 0", [](RopeConfig& c) {
    c.scaling.type = RopeScalingType::kLinear;
    c.scaling.factor = 0.0;
  });
  add("ntk rotary_dim 2", "ntk scaling needs rotary_dim >= 4, got 2", [](RopeConfig& c) {
    c.rotary_dim = 2;
    c.scaling.type = RopeScalingType::kNtk;
  });
  add("dynamic without L0", "scaling.original_max_position_embeddings must be > 0 for dynamic, got 0",
      [](RopeConfig& c) { c.scaling.type = RopeScalingType::kDynamicNtk; });
  add("llama3 without L0", "original_max_position_embeddings must be > 0 for llama3",
      [](RopeConfig& c) { c.scaling.type = RopeScalingType::kLlama3; });
  add("yarn beta negative",
      "beta_fast and beta_slow must be finite and > 0, got beta_fast 32, beta_slow -1",
      [](RopeConfig& c) {
        c.scaling.type = RopeScalingType::kYarn;
        c.scaling.original_max_positions = 4096;
        c.scaling.beta_slow = -1.0;
      });
  add("yarn attention_factor NaN", "scaling.attention_factor must be finite and > 0, got nan",
      [](RopeConfig& c) {
        c.scaling.type = RopeScalingType::kYarn;
        c.scaling.original_max_positions = 4096;
        c.scaling.attention_factor = std::nan("");
      });
  add("yarn mscale inf", "scaling.mscale must be finite, got inf", [](RopeConfig& c) {
    c.scaling.type = RopeScalingType::kYarn;
    c.scaling.original_max_positions = 4096;
    c.scaling.mscale = INFINITY;
    c.scaling.mscale_all_dim = 1.0;
  });
  auto longrope = [](RopeConfig& c) {
    c.scaling.type = RopeScalingType::kLongRope;
    c.scaling.factor = 4.0;
    c.scaling.original_max_positions = 4096;
    c.scaling.short_factor.assign(32, 1.0);
    c.scaling.long_factor.assign(32, 2.0);
  };
  add("longrope short_factor length",
      "scaling.short_factor must have rotary_dim/2 = 32 entries, got 31", [&](RopeConfig& c) {
        longrope(c);
        c.scaling.short_factor.pop_back();
      });
  add("longrope long_factor entry", "scaling.long_factor[5] must be finite and > 0, got -1",
      [&](RopeConfig& c) {
        longrope(c);
        c.scaling.long_factor[5] = -1.0;
      });
  add("longrope factor 0", "scaling.factor must be finite and > 0, got 0", [&](RopeConfig& c) {
    longrope(c);
    c.scaling.factor = 0.0;
  });
  add("longrope L0 1", "longrope needs original_max_position_embeddings >= 2", [&](RopeConfig& c) {
    longrope(c);
    c.scaling.original_max_positions = 1;
  });
  add("llama3 high 0", "scaling.high_freq_factor must be finite and > 0, got 0",
      [](RopeConfig& c) {
        c.scaling.type = RopeScalingType::kLlama3;
        c.scaling.factor = 8.0;
        c.scaling.original_max_positions = 8192;
        c.scaling.high_freq_factor = 0.0;
      });
  return v;
}

// llama3 with high_freq_factor <= low_freq_factor: transformers only warns.
// Its smoothed band [L0/high, L0/low] is then empty and torch.where divides
// every wavelength past L0/low by the factor, keeping the rest (the smooth
// factor's division is computed but not selected): a step, computed. A
// wavelength on the step is NaN in transformers (equal factors) or on a side
// float32 rounding decides: UNIMPLEMENTED naming both fields.
TEST(RopeFrequenciesTest, Llama3WithHighFactorNotAboveLowIsAStep) {
  for (const auto& [low, high] : {std::pair{4.0, 1.0}, std::pair{4.0, 4.0}}) {
    SCOPED_TRACE(absl::StrCat("low ", low, " high ", high));
    RopeConfig c = Config(64, 0, 500000.0, RopeScalingType::kLlama3);
    c.scaling.factor = 8.0;
    c.scaling.original_max_positions = 8192;
    c.scaling.low_freq_factor = low;
    c.scaling.high_freq_factor = high;
    absl::StatusOr<RopeFrequencies> f = ComputeRopeFrequencies(c, 0);
    ASSERT_TRUE(f.ok()) << f.status();
    const std::vector<double> base = ref::DefaultInvFreq(64, 500000.0);
    int divided = 0, kept = 0;
    for (size_t i = 0; i < base.size(); ++i) {
      const double wavelen = 2.0 * M_PI / base[i];
      const bool past = wavelen > 8192.0 / low;
      // Between L0/low and L0/high (high < low) transformers divides too.
      EXPECT_DOUBLE_EQ(f->inv_freq[i], past ? base[i] / 8.0 : base[i]) << i;
      (past ? divided : kept)++;
    }
    EXPECT_GT(divided, 0);
    EXPECT_GT(kept, 0);
    const std::vector<double> want = ref::Llama3InvFreq(64, 500000.0, 8.0, low, high, 8192);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_DOUBLE_EQ(f->inv_freq[i], want[i]) << i;
  }
  // Pair 0's wavelength is 2 pi: a step there (L0 / low = 2 pi) is refused.
  RopeConfig c = Config(64, 0, 10000.0, RopeScalingType::kLlama3);
  c.scaling.factor = 8.0;
  c.scaling.original_max_positions = 64;
  c.scaling.low_freq_factor = 64.0 / (2.0 * M_PI);
  for (double high : {c.scaling.low_freq_factor, 1.0}) {
    c.scaling.high_freq_factor = high;
    const absl::Status st = ValidateRopeConfig(c);
    EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented) << st;
    EXPECT_THAT(std::string(st.message()),
                AllOf(HasSubstr("high_freq_factor"), HasSubstr("low_freq_factor"),
                      HasSubstr("pair 0")));
    EXPECT_EQ(ComputeRopeFrequencies(c, 0).status(), st);
  }
}

TEST(RopeValidationTest, BadConfigsAreInvalidArgumentNamingTheField) {
  for (const BadConfigCase& bad : BadConfigs()) {
    const absl::Status s = ValidateRopeConfig(bad.config);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad.name << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(bad.message)) << bad.name;
    // Every entry point validates the same way.
    EXPECT_EQ(ComputeRopeFrequencies(bad.config, 0).status(), s) << bad.name;
    EXPECT_EQ(RopeRotator::Create(bad.config, 0, 8).status(), s) << bad.name;
  }
}

TEST(RopeValidationTest, GoodConfigsPass) {
  for (const RopeConfig& c : AllRuleConfigs()) {
    EXPECT_TRUE(ValidateRopeConfig(c).ok()) << ValidateRopeConfig(c);
  }
  // Odd head_dim is fine when the rotated part is even.
  EXPECT_TRUE(ValidateRopeConfig(Config(63, 62, 10000.0, RopeScalingType::kDefault)).ok());
}

TEST(RopeValidationTest, NegativeSeqLenIsInvalidArgument) {
  const absl::Status s =
      ComputeRopeFrequencies(Config(64, 0, 10000.0, RopeScalingType::kDefault), -1).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("seq_len must be >= 0, got -1"));
}

}  // namespace

// The registry: every rule has one row whose name and aliases parse back to
// it, and whose length dependence is what its frequencies actually do (a
// rule that claims to be length-independent but is not would leave stale
// keys in a session cache).
TEST(RopeRegistryTest, RowsAgreeWithWhatTheRulesCompute) {
  EXPECT_EQ(RopeRules().size(), 7u);
  for (const RopeRule& rule : RopeRules()) {
    SCOPED_TRACE(rule.name);
    EXPECT_EQ(ParseRopeScalingType(rule.name).value(), rule.type);
    for (const char* alias : rule.aliases) EXPECT_EQ(ParseRopeScalingType(alias).value(), rule.type);
    EXPECT_STREQ(RopeScalingTypeName(rule.type), rule.name);
    EXPECT_EQ(&RopeRuleOf(rule.type), &rule);
    RopeConfig c;
    c.head_dim = 16;
    c.theta = 10000.0;
    c.scaling.type = rule.type;
    if (rule.reads & kRopeFactor) c.scaling.factor = 4.0;
    if (rule.reads & kRopeOriginalMax) c.scaling.original_max_positions = 16;
    if (rule.reads & kRopeShortFactor) c.scaling.short_factor.assign(8, 1.5);
    if (rule.reads & kRopeLongFactor) c.scaling.long_factor.assign(8, 6.0);
    ASSERT_TRUE(ValidateRopeConfig(c).ok()) << ValidateRopeConfig(c);
    const RopeFrequencies short_len = ComputeRopeFrequencies(c, 8).value();
    const RopeFrequencies long_len = ComputeRopeFrequencies(c, 64).value();
    const bool differs = short_len.inv_freq != long_len.inv_freq ||
                         short_len.attention_factor != long_len.attention_factor;
    EXPECT_EQ(differs, rule.length_dependent);
    // A field outside `reads` is never read, whatever else is given.
    EXPECT_EQ(RopeFieldsRead(rule, kRopeAllFields) & ~rule.reads, 0u);
  }
  // Conditional reads: yarn's mscale pair, longrope's factor.
  const RopeRule& yarn = RopeRuleOf(RopeScalingType::kYarn);
  EXPECT_EQ(RopeFieldsRead(yarn, kRopeMscale), 0u);
  EXPECT_EQ(RopeFieldsRead(yarn, kRopeMscale | kRopeMscaleAllDim), kRopeMscale | kRopeMscaleAllDim);
  EXPECT_EQ(RopeFieldsRead(yarn, kRopeMscale | kRopeMscaleAllDim | kRopeAttentionFactor),
            kRopeAttentionFactor);
  const RopeRule& longrope = RopeRuleOf(RopeScalingType::kLongRope);
  EXPECT_EQ(RopeFieldsRead(longrope, kRopeFactor), kRopeFactor);
  EXPECT_EQ(RopeFieldsRead(longrope, kRopeFactor | kRopeMaxPositionEmbeddings),
            kRopeMaxPositionEmbeddings);
  EXPECT_THAT(ParseRopeScalingType("bogus").status().message(), HasSubstr("longrope (or su)"));
}

}  // namespace ropeattn
