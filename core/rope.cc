// Positions and the planned rotation (RopeRotator).
//
// Apply is memory bound: each element is read and written once, in place.
// Everything that does not depend on the element is hoisted out of the inner
// loop: per token, one cos/sin row (from the table, or computed in fp64 past
// it) serves every head; per head, the loop runs over contiguous floats.
#include "core/rope.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/limits.h"
#include "core/status_macros.h"
#include "core/trig.h"

namespace ropeattn {
namespace {

// Caps the cos + sin table at 2 GiB.
constexpr int64_t kMaxTableEntries = int64_t{1} << 28;
// Below this many rotated elements a thread team costs more than it saves.
constexpr int64_t kMinElementsPerThread = int64_t{1} << 14;

// cos/sin of position * inv_freq in fp64 (the product's rounding corrected,
// core/trig.h), scaled by the attention factor, then rounded once to fp32.
// fp32 angles would lose the phase of large positions (p * theta needs
// ~log2(p) more mantissa bits than fp32 has to spare).
void ComputeCosSinRow(int64_t position, const std::vector<double>& inv_freq, double factor,
                      float* cos_row, float* sin_row) {
  const double p = static_cast<double>(position);
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    double sn, cs;
    internal::SinCosOfProduct(p, inv_freq[i], &sn, &cs);
    cos_row[i] = static_cast<float>(factor * cs);
    sin_row[i] = static_cast<float>(factor * sn);
  }
}

absl::Status CheckPosition(int64_t position, const char* what, int64_t index) {
  if (position < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s[%d] must be >= 0, got %d", what, index, position));
  }
  if (position > kMaxPosition) {
    return absl::OutOfRangeError(
        absl::StrFormat("%s[%d] = %d is above the maximum position 2^40", what, index, position));
  }
  return absl::OkStatus();
}

// transformers computes inv_freq and the angles position * inv_freq in
// float32 (the rotary embedding's forward disables autocast and multiplies
// float32 tensors), so an inverse frequency or an angle past the float32
// range (FLT_MAX) is Inf there and cos/sin are NaN, while this server, which
// computes angles in double for accuracy, would still give finite numbers.
// Exact or refused: a tiny scaling factor (linear 1e-300, inside its range,
// gives inv_freq 1e300: Inf at every position; 1e-36 at position 1000 gives
// the angle 1e39) is refused up front, naming the settings that gave the
// frequency and, for an angle, the position. The angle is checked as float32
// computes it: both operands rounded to float32, the product rounded once
// (the double product of two floats is exact, so its float rounding is the
// float32 multiplication).
absl::Status CheckAngles(const RopeConfig& config, const std::vector<double>& inv_freq,
                         int64_t max_position, const char* what) {
  if (inv_freq.empty()) return absl::OkStatus();
  size_t top = 0;
  for (size_t i = 1; i < inv_freq.size(); ++i) {
    if (std::fabs(inv_freq[i]) > std::fabs(inv_freq[top])) top = i;
  }
  constexpr double kF32Max = std::numeric_limits<float>::max();
  const double inv = inv_freq[top];
  const float inv32 = static_cast<float>(inv);
  const bool inv_overflows = std::fabs(inv) > kF32Max || !std::isfinite(inv32);
  bool angle_overflows = false;
  if (!inv_overflows && max_position > 0) {
    const double p = static_cast<double>(max_position);
    const float angle32 =
        static_cast<float>(static_cast<double>(inv32) * static_cast<double>(static_cast<float>(p)));
    angle_overflows = std::fabs(p * inv) > kF32Max || !std::isfinite(angle32);
  }
  if (!inv_overflows && !angle_overflows) return absl::OkStatus();
  const RopeScaling& s = config.scaling;
  std::string cause;
  switch (s.type) {
    case RopeScalingType::kLongRope:
      cause = absl::StrFormat("theta %g, %s scaling.short_factor / long_factor[%d] = %g / %g",
                              config.theta, RopeScalingTypeName(s.type), top,
                              top < s.short_factor.size() ? s.short_factor[top] : 0.0,
                              top < s.long_factor.size() ? s.long_factor[top] : 0.0);
      break;
    default:
      cause = absl::StrFormat("theta %g, %s scaling.factor = %g", config.theta,
                              RopeScalingTypeName(s.type), s.factor);
      break;
  }
  if (inv_overflows) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "inv_freq[%d] = %g (from %s) is above the float32 range (%g) transformers computes "
        "inverse frequencies in, so its angle is not finite at any position (cos/sin NaN); "
        "use a larger scaling factor",
        top, inv, cause, kF32Max));
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s %d times inv_freq[%d] = %g (from %s) overflows the rotation angle (above the float32 "
      "range %g transformers computes angles in): the largest position times the largest "
      "inverse frequency must stay within it; use a larger scaling factor or smaller positions",
      what, max_position, top, inv, cause, kF32Max));
}

// Scalar element access, shared by the remainder loops of both dtypes.
inline float LoadOne(const float* p) { return *p; }
inline float LoadOne(const uint16_t* p) { return BF16ToFloat(*p); }
inline void StoreOne(float* p, float v) { *p = v; }
inline void StoreOne(uint16_t* p, float v) { *p = FloatToBF16(v); }

// a * b + c with one rounding where the vector loops also use FMA, so the
// remainder loop rounds exactly like the vector body and a bf16 result is
// always the f32 result rounded once.
#ifdef __FMA__
inline float MulAdd(float a, float b, float c) { return std::fma(a, b, c); }
#else
inline float MulAdd(float a, float b, float c) { return a * b + c; }
#endif

#ifdef __AVX2__
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void Store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// Round to nearest even exactly as FloatToBF16 (NaN stays a quiet NaN).
inline void Store8(uint16_t* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i high = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i quiet_nan = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
  // packus works per 128-bit lane; gather the two low quadwords afterwards.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

// Half-split pairs (x0[i], x1[i]); x0 and x1 are disjoint halves of one row.
// T is float or uint16_t (bf16): bf16 is widened, rotated in fp32 and rounded
// once, in registers.
template <typename T>
inline void RotateHalfSplit(T* __restrict x0, T* __restrict x1, const float* __restrict c,
                            const float* __restrict s, int64_t half) {
  int64_t i = 0;
#ifdef __AVX2__
  for (; i + 8 <= half; i += 8) {
    const __m256 a = Load8(x0 + i);
    const __m256 b = Load8(x1 + i);
    const __m256 ci = _mm256_loadu_ps(c + i);
    const __m256 si = _mm256_loadu_ps(s + i);
    Store8(x0 + i, _mm256_fmsub_ps(a, ci, _mm256_mul_ps(b, si)));
    Store8(x1 + i, _mm256_fmadd_ps(a, si, _mm256_mul_ps(b, ci)));
  }
#endif
  for (; i < half; ++i) {
    const float a = LoadOne(x0 + i);
    const float b = LoadOne(x1 + i);
    StoreOne(x0 + i, MulAdd(a, c[i], -(b * s[i])));
    StoreOne(x1 + i, MulAdd(a, s[i], b * c[i]));
  }
}

// Interleaved pairs (x[2i], x[2i+1]) with per-channel rows prepared by
// ExpandInterleaved: x'[j] = x[j] * cd[j] + x[j ^ 1] * sa[j].
template <typename T>
inline void RotateInterleaved(T* __restrict x, const float* __restrict cd,
                              const float* __restrict sa, int64_t d) {
  int64_t j = 0;
#ifdef __AVX2__
  for (; j + 8 <= d; j += 8) {
    const __m256 v = Load8(x + j);
    const __m256 swapped = _mm256_permute_ps(v, 0xB1);  // pairs swapped within
    Store8(x + j, _mm256_fmadd_ps(v, _mm256_loadu_ps(cd + j),
                                  _mm256_mul_ps(swapped, _mm256_loadu_ps(sa + j))));
  }
#endif
  for (; j < d; j += 2) {
    const float a = LoadOne(x + j);
    const float b = LoadOne(x + j + 1);
    StoreOne(x + j, MulAdd(a, cd[j], b * sa[j]));
    StoreOne(x + j + 1, MulAdd(b, cd[j + 1], a * sa[j + 1]));
  }
}

// Turns per-pair (c, s) into per-channel rows for RotateInterleaved, so the
// inner loop needs no shuffles of the cos/sin rows.
inline void ExpandInterleaved(const float* c, const float* s, int64_t half, float* cd, float* sa) {
  for (int64_t i = 0; i < half; ++i) {
    cd[2 * i] = c[i];
    cd[2 * i + 1] = c[i];
    sa[2 * i] = -s[i];
    sa[2 * i + 1] = s[i];
  }
}

// Rotates the first d channels of each of `heads` packed rows of one token.
template <typename T>
inline void RotateToken(T* token, int64_t heads, int64_t head_dim, int64_t d, bool interleaved,
                        const float* c, const float* s, const float* cd, const float* sa) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* row = token + h * head_dim;
    if (interleaved) {
      RotateInterleaved(row, cd, sa, d);
    } else {
      RotateHalfSplit(row, row + half, c, s, half);
    }
  }
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> ResolvePositions(const Positions& positions, int64_t batch,
                                                      int64_t seq) {
  if (batch < 0 || seq < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("batch and seq must be >= 0, got batch %d, seq %d", batch, seq));
  }
  const auto& expl = positions.explicit_positions;
  const auto& offsets = positions.offsets;
  if (!expl.empty() && !offsets.empty()) {
    return absl::InvalidArgumentError(
        "positions: set at most one of explicit_positions and offsets");
  }
  std::vector<int64_t> out(static_cast<size_t>(batch * seq));
  if (!expl.empty() || (batch * seq == 0 && offsets.empty())) {
    if (static_cast<int64_t>(expl.size()) != batch * seq) {
      return absl::InvalidArgumentError(
          absl::StrFormat("explicit_positions has %d entries, expected batch * seq = %d * %d = %d",
                          expl.size(), batch, seq, batch * seq));
    }
    for (size_t i = 0; i < expl.size(); ++i) {
      RA_RETURN_IF_ERROR(CheckPosition(expl[i], "explicit_positions", static_cast<int64_t>(i)));
      out[i] = expl[i];
    }
    return out;
  }
  if (!offsets.empty()) {
    if (static_cast<int64_t>(offsets.size()) != batch) {
      return absl::InvalidArgumentError(
          absl::StrFormat("offsets has %d entries, expected batch = %d", offsets.size(), batch));
    }
    for (int64_t b = 0; b < batch; ++b) {
      RA_RETURN_IF_ERROR(CheckPosition(offsets[b], "offsets", b));
      // offsets[b] <= 2^40 here, so the sum cannot overflow.
      if (seq > 0 && offsets[b] + (seq - 1) > kMaxPosition) {
        return absl::OutOfRangeError(
            absl::StrFormat("offsets[%d] = %d plus seq - 1 = %d is above the maximum position 2^40",
                            b, offsets[b], seq - 1));
      }
      for (int64_t s = 0; s < seq; ++s) out[b * seq + s] = offsets[b] + s;
    }
    return out;
  }
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t s = 0; s < seq; ++s) out[b * seq + s] = s;
  }
  return out;
}

int64_t RopeTablePositionsFor(int64_t positions_spanned, int64_t rotated_tokens, int64_t cap) {
  if (positions_spanned <= 0 || positions_spanned > rotated_tokens) return 0;
  return std::min(positions_spanned, std::max<int64_t>(cap, 0));
}

absl::StatusOr<RopeRotator> RopeRotator::Create(const RopeConfig& config, int64_t seq_len,
                                                int64_t table_positions) {
  RA_ASSIGN_OR_RETURN(RopeFrequencies freqs, ComputeRopeFrequencies(config, seq_len));
  return FromFrequencies(config, std::move(freqs), table_positions);
}

absl::StatusOr<RopeRotator> RopeRotator::FromFrequencies(const RopeConfig& config,
                                                         RopeFrequencies frequencies,
                                                         int64_t table_positions) {
  RA_RETURN_IF_ERROR(ValidateRopeConfig(config));
  const int64_t half = config.effective_rotary_dim() / 2;
  if (static_cast<int64_t>(frequencies.inv_freq.size()) != half) {
    return absl::InvalidArgumentError(
        absl::StrFormat("frequencies.inv_freq has %d entries, expected rotary_dim / 2 = %d",
                        frequencies.inv_freq.size(), half));
  }
  for (size_t i = 0; i < frequencies.inv_freq.size(); ++i) {
    if (!std::isfinite(frequencies.inv_freq[i])) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "frequencies.inv_freq[%d] must be finite, got %g", i, frequencies.inv_freq[i]));
    }
  }
  const double a = frequencies.attention_factor;
  if (!std::isfinite(a) || a <= 0.0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("frequencies.attention_factor must be finite and > 0, got %g", a));
  }
  if (table_positions < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("table_positions must be >= 0, got %d", table_positions));
  }
  if (half > 0 && table_positions > kMaxTableEntries / half) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "a cos/sin table of %d positions x %d pairs exceeds the limit of %d entries",
        table_positions, half, kMaxTableEntries));
  }

  RA_RETURN_IF_ERROR(
      CheckAngles(config, frequencies.inv_freq, table_positions - 1, "table position"));
  RopeRotator r;
  r.config_ = config;
  r.freqs_ = std::move(frequencies);
  r.table_positions_ = table_positions;
  r.cos_.resize(static_cast<size_t>(table_positions * half));
  r.sin_.resize(static_cast<size_t>(table_positions * half));
  for (int64_t p = 0; p < table_positions; ++p) {
    ComputeCosSinRow(p, r.freqs_.inv_freq, a, &r.cos_[p * half], &r.sin_[p * half]);
  }
  return r;
}

namespace {

// Checks CosSin's output sizes and positions; returns rotary_dim / 2.
absl::StatusOr<int64_t> CheckCosSin(const RopeConfig& config, const RopeFrequencies& freqs,
                                    int64_t half, absl::Span<const int64_t> positions,
                                    size_t cos_size, size_t sin_size) {
  const int64_t n = static_cast<int64_t>(positions.size());
  if (static_cast<int64_t>(cos_size) != n * half || static_cast<int64_t>(sin_size) != n * half) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cos_out and sin_out must have positions.size() * rotary_dim / 2 = %d * %d = %d entries, "
        "got %d and %d",
        n, half, n * half, cos_size, sin_size));
  }
  int64_t max_position = 0;
  for (int64_t k = 0; k < n; ++k) {
    RA_RETURN_IF_ERROR(CheckPosition(positions[k], "positions", k));
    max_position = std::max(max_position, positions[k]);
  }
  RA_RETURN_IF_ERROR(CheckAngles(config, freqs.inv_freq, max_position, "position"));
  return half;
}

}  // namespace

absl::Status RopeRotator::CosSin(absl::Span<const int64_t> positions, absl::Span<float> cos_out,
                                 absl::Span<float> sin_out) const {
  RA_ASSIGN_OR_RETURN(const int64_t half, CheckCosSin(config_, freqs_, rotary_dim() / 2, positions,
                                                      cos_out.size(), sin_out.size()));
  for (size_t k = 0; k < positions.size(); ++k) {
    const int64_t p = positions[k];
    float* c = cos_out.data() + k * half;
    float* s = sin_out.data() + k * half;
    if (p < table_positions_) {
      std::copy_n(&cos_[p * half], half, c);
      std::copy_n(&sin_[p * half], half, s);
    } else {
      ComputeCosSinRow(p, freqs_.inv_freq, freqs_.attention_factor, c, s);
    }
  }
  return absl::OkStatus();
}

absl::Status RopeRotator::CosSin(absl::Span<const int64_t> positions, absl::Span<double> cos_out,
                                 absl::Span<double> sin_out) const {
  RA_ASSIGN_OR_RETURN(const int64_t half, CheckCosSin(config_, freqs_, rotary_dim() / 2, positions,
                                                      cos_out.size(), sin_out.size()));
  for (size_t k = 0; k < positions.size(); ++k) {
    const double p = static_cast<double>(positions[k]);
    for (int64_t i = 0; i < half; ++i) {
      double sn, cs;
      internal::SinCosOfProduct(p, freqs_.inv_freq[i], &sn, &cs);
      cos_out[k * half + i] = freqs_.attention_factor * cs;
      sin_out[k * half + i] = freqs_.attention_factor * sn;
    }
  }
  return absl::OkStatus();
}

absl::Status RopeRotator::Apply(TensorView x, const Positions& positions, RopeDirection direction,
                                int num_threads) const {
  RA_RETURN_IF_ERROR(CheckBSHD(x, "x"));
  if (x.dim(3) != config_.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("x has head_dim %d, but the rotator was planned for head_dim %d", x.dim(3),
                        config_.head_dim));
  }
  if (num_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_threads must be >= 1, got %d", num_threads));
  }
  const int64_t batch = x.dim(0);
  const int64_t seq = x.dim(1);
  const int64_t heads = x.dim(2);
  RA_ASSIGN_OR_RETURN(const std::vector<int64_t> pos, ResolvePositions(positions, batch, seq));
  if (!pos.empty()) {
    RA_RETURN_IF_ERROR(CheckAngles(config_, freqs_.inv_freq,
                                   *std::max_element(pos.begin(), pos.end()), "position"));
  }
  if (x.num_elements() == 0) return absl::OkStatus();

  const int64_t d = rotary_dim();
  const int64_t half = d / 2;
  const int64_t head_dim = config_.head_dim;
  const int64_t tokens = batch * seq;
  const int64_t stride_b = x.stride(0);
  const int64_t stride_s = x.stride(1);
  const bool interleaved = config_.layout == RopeLayout::kInterleaved;
  const bool inverse = direction == RopeDirection::kInverse;
  const bool bf16 = x.dtype() == DType::kBF16;
  // Inverse: rotate by -angle and divide by a. The table holds a*cos, a*sin,
  // so scaling them by 1/a^2 (and negating sin) gives exactly that.
  const double a = freqs_.attention_factor;
  const float inv_a2 = static_cast<float>(1.0 / (a * a));

  const int64_t work = tokens * heads * d;
  int threads =
      static_cast<int>(std::min<int64_t>({static_cast<int64_t>(num_threads), tokens,
                                          std::max<int64_t>(1, work / kMinElementsPerThread)}));
  threads = std::max(threads, 1);

#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    // Per-thread scratch: a cos/sin row and its interleaved expansion.
    std::vector<float> scratch(static_cast<size_t>(2 * half + 2 * d));
    float* const row_c = scratch.data();
    float* const row_s = row_c + half;
    float* const exp_c = row_s + half;
    float* const exp_s = exp_c + d;

#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t p = pos[t];
      const float* c;
      const float* s;
      if (p < table_positions_) {
        c = &cos_[p * half];
        s = &sin_[p * half];
      } else {
        ComputeCosSinRow(p, freqs_.inv_freq, a, row_c, row_s);
        c = row_c;
        s = row_s;
      }
      if (inverse) {
        for (int64_t i = 0; i < half; ++i) {
          const float ci = c[i];
          const float si = s[i];
          row_c[i] = ci * inv_a2;
          row_s[i] = -si * inv_a2;
        }
        c = row_c;
        s = row_s;
      }
      if (interleaved) ExpandInterleaved(c, s, half, exp_c, exp_s);

      const int64_t offset = (t / seq) * stride_b + (t % seq) * stride_s;
      if (bf16) {
        RotateToken(static_cast<uint16_t*>(x.raw()) + offset, heads, head_dim, d, interleaved, c, s,
                    exp_c, exp_s);
      } else {
        RotateToken(static_cast<float*>(x.raw()) + offset, heads, head_dim, d, interleaved, c, s,
                    exp_c, exp_s);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace ropeattn
