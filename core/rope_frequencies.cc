// Scaling rules of RoPE: validation and inverse frequencies (all in fp64).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/rope.h"
#include "core/status_macros.h"

namespace ropeattn {
namespace {

constexpr double kPi = 3.14159265358979323846;

bool IsPositiveFinite(double x) { return std::isfinite(x) && x > 0.0; }

// base^(-2i/d) for i < d/2.
std::vector<double> BaseInvFreq(int64_t d, double base) {
  std::vector<double> inv_freq(d / 2);
  for (int64_t i = 0; i < d / 2; ++i) {
    inv_freq[i] = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(d));
  }
  return inv_freq;
}

// NTK-aware base growth: base * g^(d/(d-2)). Validation guarantees d >= 4.
double NtkBase(double base, double growth, int64_t d) {
  return base * std::pow(growth, static_cast<double>(d) / static_cast<double>(d - 2));
}

std::vector<double> YarnInvFreq(int64_t d, double base, const RopeScaling& s) {
  const double l0 = static_cast<double>(s.original_max_positions);
  // The fractional pair index at which a pair makes `rotations` full turns
  // over the original context.
  auto corr_dim = [&](double rotations) {
    return static_cast<double>(d) * std::log(l0 / (rotations * 2.0 * kPi)) / (2.0 * std::log(base));
  };
  double low = corr_dim(s.beta_fast), high = corr_dim(s.beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(d - 1));
  // A zero-width ramp would divide by zero; transformers widens it the same way.
  if (low == high) high += 0.001;

  std::vector<double> inv_freq(d / 2);
  for (int64_t j = 0; j < d / 2; ++j) {
    const double pos_freq = std::pow(base, 2.0 * static_cast<double>(j) / static_cast<double>(d));
    const double extrapolation = 1.0 / pos_freq;
    const double interpolation = 1.0 / (s.factor * pos_freq);
    const double ramp = std::clamp((static_cast<double>(j) - low) / (high - low), 0.0, 1.0);
    const double keep = 1.0 - ramp;  // weight of the unscaled (extrapolated) frequency
    inv_freq[j] = interpolation * (1.0 - keep) + extrapolation * keep;
  }
  return inv_freq;
}

double YarnAttentionFactor(const RopeScaling& s) {
  if (s.attention_factor.has_value()) return *s.attention_factor;
  // transformers' get_mscale(scale) is 1 for scale <= 1, in the pair too.
  if (s.factor <= 1.0) return 1.0;
  const double ln_f = std::log(s.factor);
  // transformers: `if mscale and mscale_all_dim` (0 is not given).
  if (s.mscale.value_or(0.0) != 0.0 && s.mscale_all_dim.value_or(0.0) != 0.0) {
    return (0.1 * *s.mscale * ln_f + 1.0) / (0.1 * *s.mscale_all_dim * ln_f + 1.0);
  }
  return 0.1 * ln_f + 1.0;
}

// The f of LongRoPE's attention factor: Phi-3 configs give it as how far
// the context was extended, max_position_embeddings / L0, not as `factor`.
double LongRopeExtension(const RopeScaling& s) {
  if (s.max_position_embeddings > 0) {
    return static_cast<double>(s.max_position_embeddings) /
           static_cast<double>(s.original_max_positions);
  }
  return s.factor;
}

double LongRopeAttentionFactor(const RopeScaling& s) {
  if (s.attention_factor.has_value()) return *s.attention_factor;
  const double f = LongRopeExtension(s);
  if (f <= 1.0) return 1.0;
  return std::sqrt(1.0 + std::log(f) / std::log(static_cast<double>(s.original_max_positions)));
}

// transformers' _compute_llama3_parameters, in its order: wavelengths past
// L0 / low_freq_factor are divided by the factor, those in
// [L0 / high_freq_factor, L0 / low_freq_factor] are smoothed, the rest kept.
// With high_freq_factor <= low_freq_factor the smoothed band is empty (at
// most its single boundary point when they are equal, which ValidateLlama3
// refuses), so the rule is a step at L0 / low_freq_factor.
std::vector<double> Llama3InvFreq(int64_t d, double base, const RopeScaling& s) {
  const double l0 = static_cast<double>(s.original_max_positions);
  const double low_freq_wavelen = l0 / s.low_freq_factor;
  const double high_freq_wavelen = l0 / s.high_freq_factor;
  std::vector<double> inv_freq = BaseInvFreq(d, base);
  for (double& theta : inv_freq) {
    const double wavelen = 2.0 * kPi / theta;
    if (wavelen > low_freq_wavelen) {
      theta /= s.factor;
    } else if (!(wavelen < high_freq_wavelen)) {
      const double smooth =
          (l0 / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      theta = (1.0 - smooth) * theta / s.factor + smooth * theta;
    }  // else: short wavelengths stay as trained
  }
  return inv_freq;
}

// A wavelength this close (relative) to the step of a llama3 rule with
// high_freq_factor <= low_freq_factor may fall on either side of it in
// transformers' float32 arithmetic (its inv_freq and wavelengths are f32).
constexpr double kLlama3StepMargin = 1e-5;

absl::Status ValidateFactorList(const std::vector<double>& list, const char* name, int64_t half) {
  if (static_cast<int64_t>(list.size()) != half) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "scaling.%s must have rotary_dim/2 = %d entries, got %d", name, half, list.size()));
  }
  for (size_t i = 0; i < list.size(); ++i) {
    if (!IsPositiveFinite(list[i])) {
      return absl::InvalidArgumentError(
          absl::StrFormat("scaling.%s[%d] must be finite and > 0, got %g", name, i, list[i]));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateOptionalPositive(const std::optional<double>& v, const char* name) {
  if (v.has_value() && !IsPositiveFinite(*v)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("scaling.%s must be finite and > 0, got %g", name, *v));
  }
  return absl::OkStatus();
}

// --- The rules: validation and frequencies, one pair per rule. ---

absl::Status NoChecks(const RopeConfig&, int64_t) { return absl::OkStatus(); }

absl::Status NeedTwoPairs(const RopeConfig& c, int64_t d) {
  // The NTK exponent d/(d-2) needs at least two pairs.
  if (d < 4) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s scaling needs rotary_dim >= 4, got %d", RopeScalingTypeName(c.scaling.type), d));
  }
  return absl::OkStatus();
}

absl::Status ValidateYarn(const RopeConfig& c, int64_t) {
  const RopeScaling& s = c.scaling;
  // Turns over the trained length: the logarithm in the correction range
  // needs them > 0. Their order is free (transformers only warns when
  // beta_fast < beta_slow; the ramp then runs the other way).
  if (!IsPositiveFinite(s.beta_fast) || !IsPositiveFinite(s.beta_slow)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("scaling.beta_fast and beta_slow must be finite and > 0, "
                        "got beta_fast %g, beta_slow %g",
                        s.beta_fast, s.beta_slow));
  }
  RA_RETURN_IF_ERROR(ValidateOptionalPositive(s.attention_factor, "attention_factor"));
  for (const auto* m : {&s.mscale, &s.mscale_all_dim}) {
    if (m->has_value() && !std::isfinite(**m)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "scaling.%s must be finite, got %g", m == &s.mscale ? "mscale" : "mscale_all_dim", **m));
    }
  }
  if (!s.attention_factor.has_value()) {
    const double a = YarnAttentionFactor(s);
    if (!IsPositiveFinite(a)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "yarn attention factor from factor %g, mscale %g, mscale_all_dim %g must be finite "
          "and > 0, got %g",
          s.factor, s.mscale.value_or(1.0), s.mscale_all_dim.value_or(1.0), a));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateLongRope(const RopeConfig& c, int64_t d) {
  const RopeScaling& s = c.scaling;
  RA_RETURN_IF_ERROR(ValidateFactorList(s.short_factor, "short_factor", d / 2));
  RA_RETURN_IF_ERROR(ValidateFactorList(s.long_factor, "long_factor", d / 2));
  RA_RETURN_IF_ERROR(ValidateOptionalPositive(s.attention_factor, "attention_factor"));
  if (s.max_position_embeddings < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("scaling.max_position_embeddings must be >= 0 (0: use factor), got %d",
                        s.max_position_embeddings));
  }
  // sqrt(1 + ln f / ln L0) is undefined for L0 = 1.
  if (!s.attention_factor.has_value() && LongRopeExtension(s) > 1.0 &&
      s.original_max_positions < 2) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "longrope needs original_max_position_embeddings >= 2 to derive its attention factor, got %d",
        s.original_max_positions));
  }
  return absl::OkStatus();
}

absl::Status ValidateLlama3(const RopeConfig& c, int64_t d) {
  const RopeScaling& s = c.scaling;
  if (!IsPositiveFinite(s.low_freq_factor)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "scaling.low_freq_factor must be finite and > 0, got %g", s.low_freq_factor));
  }
  if (!IsPositiveFinite(s.high_freq_factor)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "scaling.high_freq_factor must be finite and > 0, got %g", s.high_freq_factor));
  }
  if (s.high_freq_factor <= s.low_freq_factor) {
    // transformers only warns: its smoothed band is empty and the rule is a
    // step at L0 / low_freq_factor, computed here. A wavelength on the step
    // gives transformers NaN (0/0 or x/0 when the factors are equal), and
    // one within float32 rounding of it is on an undecided side: refused.
    const double l0 = static_cast<double>(s.original_max_positions);
    const double step = l0 / s.low_freq_factor;
    const std::vector<double> base = BaseInvFreq(d, c.theta);
    for (size_t i = 0; i < base.size(); ++i) {
      const double wavelen = 2.0 * kPi / base[i];
      if (std::fabs(wavelen - step) <= kLlama3StepMargin * step) {
        return absl::UnimplementedError(absl::StrFormat(
            "scaling.high_freq_factor = %g <= low_freq_factor = %g makes llama3 a step at "
            "wavelength original_max_position_embeddings / low_freq_factor = %.17g, and pair %d's "
            "wavelength %.17g lies on it (within %g): transformers gives it NaN or decides its "
            "side in float32 rounding",
            s.high_freq_factor, s.low_freq_factor, step, i, wavelen, kLlama3StepMargin));
      }
    }
  }
  return absl::OkStatus();
}

void DefaultFreqs(const RopeConfig& c, int64_t d, int64_t, RopeFrequencies* out) {
  out->inv_freq = BaseInvFreq(d, c.theta);
}

void LinearFreqs(const RopeConfig& c, int64_t d, int64_t, RopeFrequencies* out) {
  out->inv_freq = BaseInvFreq(d, c.theta);
  for (double& x : out->inv_freq) x /= c.scaling.factor;
}

void NtkFreqs(const RopeConfig& c, int64_t d, int64_t, RopeFrequencies* out) {
  out->inv_freq = BaseInvFreq(d, NtkBase(c.theta, c.scaling.factor, d));
}

void DynamicNtkFreqs(const RopeConfig& c, int64_t d, int64_t seq_len, RopeFrequencies* out) {
  const RopeScaling& s = c.scaling;
  const double l0 = static_cast<double>(s.original_max_positions);
  const double len = std::max(static_cast<double>(seq_len), l0);
  // Equals 1 (the trained base) up to L0, then grows linearly with L.
  const double growth = s.factor * len / l0 - (s.factor - 1.0);
  out->inv_freq = BaseInvFreq(d, NtkBase(c.theta, growth, d));
}

void YarnFreqs(const RopeConfig& c, int64_t d, int64_t, RopeFrequencies* out) {
  out->inv_freq = YarnInvFreq(d, c.theta, c.scaling);
  out->attention_factor = YarnAttentionFactor(c.scaling);
}

void LongRopeFreqs(const RopeConfig& c, int64_t d, int64_t seq_len, RopeFrequencies* out) {
  const RopeScaling& s = c.scaling;
  const bool use_long = seq_len > s.original_max_positions;
  const std::vector<double>& ext = use_long ? s.long_factor : s.short_factor;
  out->inv_freq = BaseInvFreq(d, c.theta);
  for (int64_t i = 0; i < d / 2; ++i) out->inv_freq[i] /= ext[i];
  out->attention_factor = LongRopeAttentionFactor(s);
}

void Llama3Freqs(const RopeConfig& c, int64_t d, int64_t, RopeFrequencies* out) {
  out->inv_freq = Llama3InvFreq(d, c.theta, c.scaling);
}

// yarn reads mscale and mscale_all_dim only as a pair, and neither next to
// an explicit attention factor (transformers: `if mscale and mscale_all_dim`).
uint32_t YarnReads(uint32_t given) {
  uint32_t reads = kRopeFactor | kRopeOriginalMax | kRopeBetaFast | kRopeBetaSlow | kRopeTruncate |
                   kRopeAttentionFactor;
  const bool pair = (given & kRopeMscale) && (given & kRopeMscaleAllDim);
  if (pair && !(given & kRopeAttentionFactor)) reads |= kRopeMscale | kRopeMscaleAllDim;
  return reads;
}

// longrope's attention factor comes from attention_factor, else
// max_position_embeddings / L0, else factor.
uint32_t LongRopeReads(uint32_t given) {
  uint32_t reads = kRopeOriginalMax | kRopeShortFactor | kRopeLongFactor | kRopeAttentionFactor;
  if (!(given & kRopeAttentionFactor)) {
    reads |= kRopeMaxPositionEmbeddings;
    if (!(given & kRopeMaxPositionEmbeddings)) reads |= kRopeFactor;
  }
  return reads;
}

}  // namespace

const std::vector<RopeRule>& RopeRules() {
  using T = RopeScalingType;
  // clang-format off
  static const auto* rules = new std::vector<RopeRule>{
      // type, name, aliases, length-dependent, reads, in transformers,
      // needs factor, needs L0, L0 <- max_positions, factor <- extension,
      // validate, frequencies, conditional reads
      {T::kDefault, "default", {}, false, 0,
       true, false, false, false, false, NoChecks, DefaultFreqs, nullptr},
      {T::kLinear, "linear", {}, false, kRopeFactor,
       true, true, false, false, false, NoChecks, LinearFreqs, nullptr},
      {T::kNtk, "ntk", {}, false, kRopeFactor,
       false, true, false, false, false, NeedTwoPairs, NtkFreqs, nullptr},
      {T::kDynamicNtk, "dynamic", {}, true, kRopeFactor | kRopeOriginalMax,
       true, true, true, true, false, NeedTwoPairs, DynamicNtkFreqs, nullptr},
      {T::kYarn, "yarn", {}, false,
       kRopeFactor | kRopeOriginalMax | kRopeBetaFast | kRopeBetaSlow | kRopeTruncate |
           kRopeAttentionFactor | kRopeMscale | kRopeMscaleAllDim,
       true, false, true, true, true, ValidateYarn, YarnFreqs, YarnReads},
      {T::kLongRope, "longrope", {"su"}, true,
       kRopeFactor | kRopeOriginalMax | kRopeAttentionFactor | kRopeShortFactor | kRopeLongFactor |
           kRopeMaxPositionEmbeddings,
       true, false, true, true, true, ValidateLongRope, LongRopeFreqs, LongRopeReads},
      {T::kLlama3, "llama3", {}, false,
       kRopeFactor | kRopeOriginalMax | kRopeLowFreqFactor | kRopeHighFreqFactor,
       true, true, true, false, false, ValidateLlama3, Llama3Freqs, nullptr},
  };
  // clang-format on
  return *rules;
}

const RopeRule& RopeRuleOf(RopeScalingType type) {
  for (const RopeRule& r : RopeRules()) {
    if (r.type == type) return r;
  }
  return RopeRules().front();  // unreachable for a valid enum value
}

uint32_t RopeFieldsRead(const RopeRule& rule, uint32_t given) {
  const uint32_t reads = rule.reads_given != nullptr ? rule.reads_given(given) : rule.reads;
  return given & reads;
}

const char* RopeFieldName(RopeField field) {
  switch (field) {
    case kRopeFactor: return "factor";
    case kRopeOriginalMax: return "original_max_position_embeddings";
    case kRopeBetaFast: return "beta_fast";
    case kRopeBetaSlow: return "beta_slow";
    case kRopeTruncate: return "truncate";
    case kRopeAttentionFactor: return "attention_factor";
    case kRopeMscale: return "mscale";
    case kRopeMscaleAllDim: return "mscale_all_dim";
    case kRopeShortFactor: return "short_factor";
    case kRopeLongFactor: return "long_factor";
    case kRopeMaxPositionEmbeddings: return "max_position_embeddings";
    case kRopeLowFreqFactor: return "low_freq_factor";
    case kRopeHighFreqFactor: return "high_freq_factor";
  }
  return "?";
}

absl::StatusOr<RopeScalingType> ParseRopeScalingType(absl::string_view name) {
  std::vector<std::string> known;
  for (const RopeRule& r : RopeRules()) {
    if (name == r.name) return r.type;
    for (const char* alias : r.aliases) {
      if (name == alias) return r.type;
    }
    std::string k = r.name;
    for (const char* alias : r.aliases) absl::StrAppend(&k, " (or ", alias, ")");
    known.push_back(std::move(k));
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown RoPE scaling type \"", name,
                                                 "\"; expected one of ",
                                                 absl::StrJoin(known, ", ")));
}

const char* RopeScalingTypeName(RopeScalingType type) {
  for (const RopeRule& r : RopeRules()) {
    if (r.type == type) return r.name;
  }
  return "unknown";
}

const char* RopeLayoutName(RopeLayout layout) {
  switch (layout) {
    case RopeLayout::kHalfSplit:
      return "half_split";
    case RopeLayout::kInterleaved:
      return "interleaved";
  }
  return "unknown";
}

absl::Status ValidateRopeConfig(const RopeConfig& config) {
  if (config.head_dim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("head_dim must be > 0, got %d", config.head_dim));
  }
  if (config.rotary_dim < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rotary_dim must be >= 0 (0 means head_dim), got %d", config.rotary_dim));
  }
  if (config.rotary_dim > config.head_dim) {
    return absl::InvalidArgumentError(absl::StrFormat("rotary_dim must be <= head_dim (%d), got %d",
                                                      config.head_dim, config.rotary_dim));
  }
  const int64_t d = config.effective_rotary_dim();
  if (d % 2 != 0) {
    if (config.rotary_dim == 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rotary_dim must be even, got %d (rotary_dim 0 means head_dim, which is odd)", d));
    }
    return absl::InvalidArgumentError(absl::StrFormat("rotary_dim must be even, got %d", d));
  }
  if (!std::isfinite(config.theta) || config.theta <= 1.0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("theta must be finite and > 1, got %g", config.theta));
  }
  const RopeScaling& s = config.scaling;
  bool known = false;
  for (const RopeRule& r : RopeRules()) known = known || r.type == s.type;
  if (!known) {
    return absl::InvalidArgumentError(
        absl::StrFormat("unknown scaling type %d", static_cast<int>(s.type)));
  }
  const RopeRule& rule = RopeRuleOf(s.type);
  if (!IsPositiveFinite(s.factor)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("scaling.factor must be finite and > 0, got %g", s.factor));
  }
  if (rule.needs_original && s.original_max_positions <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("scaling.original_max_position_embeddings must be > 0 for %s, got %d", rule.name,
                        s.original_max_positions));
  }
  return rule.validate(config, d);
}

absl::StatusOr<RopeFrequencies> ComputeRopeFrequencies(const RopeConfig& config, int64_t seq_len) {
  if (absl::Status st = ValidateRopeConfig(config); !st.ok()) return st;
  if (seq_len < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("seq_len must be >= 0, got %d", seq_len));
  }
  RopeFrequencies out;
  const RopeScaling& s = config.scaling;
  RopeRuleOf(s.type).frequencies(config, config.effective_rotary_dim(), seq_len, &out);
  for (size_t i = 0; i < out.inv_freq.size(); ++i) {
    if (!std::isfinite(out.inv_freq[i])) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s scaling produced a non-finite inv_freq[%d] (theta %g, factor %g)",
                          RopeScalingTypeName(s.type), i, config.theta, s.factor));
    }
  }
  if (!IsPositiveFinite(out.attention_factor)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s scaling produced attention factor %g; it must be finite and > 0",
                        RopeScalingTypeName(s.type), out.attention_factor));
  }
  return out;
}

}  // namespace ropeattn
