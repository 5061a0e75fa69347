// Rotary position embedding (RoPE): frequency rules and the rotation itself.
//
// Notation (see shared reference, positional-encodings.md section 3-4):
//   d = rotary_dim (<= head_dim, even), pairs i = 0 .. d/2 - 1,
//   inv_freq[i] = base^(-2i/d) under the default rule, angle = position * inv_freq[i].
// Pair layouts:
//   kHalfSplit  (GPT-NeoX, Llama in Hugging Face): channel i pairs with i + d/2.
//   kInterleaved (GPT-J, RoFormer, Meta's original Llama): channels 2i, 2i+1.
// Channels d .. head_dim-1 pass through unchanged (partial rotary).
// Each pair (x, y) becomes a * (x cos t - y sin t, x sin t + y cos t) where `a`
// is the rule's attention factor (it multiplies both cos and sin, so logits
// between rotated q and k scale by a^2).
#ifndef ROPEATTN_CORE_ROPE_H_
#define ROPEATTN_CORE_ROPE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/tensor.h"

namespace ropeattn {

enum class RopeLayout { kHalfSplit = 0, kInterleaved = 1 };

enum class RopeScalingType {
  kDefault = 0,     // "default"
  kLinear = 1,      // "linear": Position Interpolation, inv_freq / factor
  kNtk = 2,         // "ntk": static NTK-aware, base * factor^(d/(d-2))
  kDynamicNtk = 3,  // "dynamic": NTK base recomputed from the current length
  kYarn = 4,        // "yarn"
  kLongRope = 5,    // "longrope" (legacy "su")
  kLlama3 = 6,      // "llama3"
};

// Accepts the Hugging Face spellings above (case-sensitive, as in config.json);
// InvalidArgument naming the value otherwise. Both come from the registry
// below.
absl::StatusOr<RopeScalingType> ParseRopeScalingType(absl::string_view name);
const char* RopeScalingTypeName(RopeScalingType type);
const char* RopeLayoutName(RopeLayout layout);

// The RopeScaling fields a rule may read, as a bit mask.
enum RopeField : uint32_t {
  kRopeFactor = 1u << 0,
  kRopeOriginalMax = 1u << 1,  // original_max_positions (original_max_position_embeddings)
  kRopeBetaFast = 1u << 2,
  kRopeBetaSlow = 1u << 3,
  kRopeTruncate = 1u << 4,
  kRopeAttentionFactor = 1u << 5,
  kRopeMscale = 1u << 6,
  kRopeMscaleAllDim = 1u << 7,
  kRopeShortFactor = 1u << 8,
  kRopeLongFactor = 1u << 9,
  kRopeMaxPositionEmbeddings = 1u << 10,
  kRopeLowFreqFactor = 1u << 11,
  kRopeHighFreqFactor = 1u << 12,
};
inline constexpr uint32_t kRopeAllFields = (1u << 13) - 1;
// The field's Hugging Face / proto name ("original_max_position_embeddings").
const char* RopeFieldName(RopeField field);

struct RopeConfig;
struct RopeFrequencies;

// One scaling rule: everything about it in one row (the registry). The
// server's capability list, which fields a request may give, session
// policies (length dependence) and config.json resolution all derive from
// these rows; a new rule is a row here, its test and its proto spelling.
struct RopeRule {
  RopeScalingType type;
  const char* name;                   // "longrope"
  std::vector<const char*> aliases;   // legacy spellings ("su"), requests only
  bool length_dependent;              // frequencies depend on the sequence length
  uint32_t reads;                     // fields it may read (RopeFieldsRead: when)
  // config.json resolution (transformers): transformers has the rule
  // (ROPE_INIT_FUNCTIONS), so a config.json may name it (by `name`; an alias
  // only where a family's config class rewrites it); factor must be given;
  // L0 must be given (else it may default, below); L0 defaults to
  // max_position_embeddings; an absent factor is max_position_embeddings / L0.
  bool in_transformers;
  bool needs_factor;
  bool needs_original;
  bool original_defaults_to_max_positions;
  bool factor_defaults_to_extension;
  // Rule-specific checks after the common ones (d = effective rotary dim).
  absl::Status (*validate)(const RopeConfig& config, int64_t d);
  // Inverse frequencies and attention factor for `seq_len` tokens.
  void (*frequencies)(const RopeConfig& config, int64_t d, int64_t seq_len, RopeFrequencies* out);
  // Which of the fields given (a mask) the rule reads in their presence;
  // null: all of `reads` it is given.
  uint32_t (*reads_given)(uint32_t given);
};
const std::vector<RopeRule>& RopeRules();
const RopeRule& RopeRuleOf(RopeScalingType type);
// The fields of `given` the rule reads (some only in combination: yarn's
// mscale pair, longrope's factor without an attention factor).
uint32_t RopeFieldsRead(const RopeRule& rule, uint32_t given);

// Parameters of the scaling rule; fields a rule does not use are ignored
// here (the wire layer refuses them: server/convert.h).
struct RopeScaling {
  RopeScalingType type = RopeScalingType::kDefault;
  // f: linear, ntk, dynamic, yarn, longrope (for its attention factor), llama3.
  // Must be > 0 (below 1 compresses; transformers only warns).
  double factor = 1.0;
  // L0, the original (trained) context length. Required (> 0) by dynamic,
  // yarn, longrope and llama3.
  int64_t original_max_positions = 0;
  // yarn: the ramp between beta_fast and beta_slow rotations.
  // The correction dims use original_max_positions (L0) as the length, as
  // newer transformers and vLLM do; older transformers used
  // max_position_embeddings there. We follow the paper: the ramp is about how
  // many turns a pair makes over the length the model was trained on.
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  // yarn: whether the correction range is widened to whole pairs,
  // low = max(floor(corr_dim(beta_fast)), 0) and
  // high = min(ceil(corr_dim(beta_slow)), d - 1), as transformers does by
  // default; false keeps both bounds fractional (still clamped to [0, d-1]).
  // transformers' `truncate` key, default true.
  bool truncate = true;
  // yarn, longrope: overrides the rule's computed attention factor.
  std::optional<double> attention_factor;
  // yarn (DeepSeek style): both given and non-zero =>
  // (0.1 m ln f + 1) / (0.1 m_all ln f + 1); otherwise the factor is
  // 0.1 ln f + 1. As in transformers (`if mscale and mscale_all_dim`), a value
  // of 0 counts as not given, and one of the two alone has no effect.
  std::optional<double> mscale;
  std::optional<double> mscale_all_dim;
  // longrope: per-pair extension factors, d/2 each; long ones apply when the
  // sequence length is strictly greater than original_max_positions.
  std::vector<double> short_factor;
  std::vector<double> long_factor;
  // longrope: the model's max_position_embeddings, for configs that keep
  // original_max_position_embeddings at the top level (Phi-3). When > 0 and
  // attention_factor is not given, the attention factor is computed from
  // f' = max_position_embeddings / original_max_positions instead of `factor`
  // (transformers' _compute_longrope_parameters): 1 if f' <= 1, else
  // sqrt(1 + ln f' / ln original_max_positions). 0: `factor` is used. The
  // long/short switch still compares the length with original_max_positions.
  // Must be >= 0.
  int64_t max_position_embeddings = 0;
  // llama3
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
};

struct RopeConfig {
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;  // 0 means head_dim. Must be even and <= head_dim.
  double theta = 10000.0;  // base
  RopeLayout layout = RopeLayout::kHalfSplit;
  RopeScaling scaling;

  int64_t effective_rotary_dim() const { return rotary_dim == 0 ? head_dim : rotary_dim; }
};

// InvalidArgument naming the field and value for: head_dim <= 0, rotary_dim
// odd / negative / > head_dim (an odd head_dim with rotary_dim 0 is odd),
// theta <= 1 or non-finite, a non-finite factor or one out of range, missing
// original_max_positions, ntk / dynamic with rotary_dim < 4 (the exponent
// d/(d-2) needs two pairs), yarn beta_fast <= beta_slow or beta_slow <= 0,
// a non-finite mscale, an attention_factor override that is not finite and
// > 0, longrope factor lists of the wrong length or with non-positive
// entries, a negative max_position_embeddings, longrope deriving its
// attention factor from L0 < 2, llama3
// low_freq_factor or high_freq_factor <= 0. Unimplemented for llama3 with
// high_freq_factor <= low_freq_factor (a step at L0 / low_freq_factor,
// computed, as transformers does with a warning) when a pair's wavelength
// lies within 1e-5 relative of the step: transformers gives it NaN (equal
// factors) or decides its side in float32 rounding.
absl::Status ValidateRopeConfig(const RopeConfig& config);

struct RopeFrequencies {
  std::vector<double> inv_freq;  // d/2 entries
  double attention_factor = 1.0;
};

// The inverse frequencies and attention factor of the config's rule, for a
// sequence whose total length is `seq_len` (used by "dynamic", which grows the
// base once seq_len > L0, and by "longrope", which switches to the long
// factors once seq_len > L0; other rules ignore it). seq_len >= 0.
absl::StatusOr<RopeFrequencies> ComputeRopeFrequencies(const RopeConfig& config, int64_t seq_len);

// Where each token of a [batch, seq, ...] tensor sits.
// At most one of `explicit_positions` (batch*seq entries, row-major [b][s])
// and `offsets` (batch entries: token s of row b is at offsets[b] + s) may be
// set; with neither, token s is at position s. Positions must be >= 0.
struct Positions {
  absl::Span<const int64_t> explicit_positions;
  absl::Span<const int64_t> offsets;
};

// Resolves positions for a [batch, seq] grid: InvalidArgument for a wrong
// span length or a negative position (naming the index), OutOfRange for a
// position above 2^40 (angles would lose all precision).
absl::StatusOr<std::vector<int64_t>> ResolvePositions(const Positions& positions, int64_t batch,
                                                      int64_t seq);

enum class RopeDirection { kForward, kInverse };

// How many cos/sin rows a rotator should precompute for a call that rotates
// `rotated_tokens` token rows at positions below `positions_spanned`: all of
// them (at most `cap`) when the table has no more rows than the tokens, so
// every row is used at least about once; otherwise none, and each token's
// row is computed as it is rotated. Either way the fp64 angle work is at
// most rotated_tokens rows, never proportional to how high the positions
// are (a table of 2^16 rows for one token at position 65535 took 60 ms).
// The rows are the same values with or without a table.
int64_t RopeTablePositionsFor(int64_t positions_spanned, int64_t rotated_tokens, int64_t cap);

// A planned rotation: validated config, frequencies, and a cos/sin table for
// positions [0, table_positions) computed once (angles in fp64, stored fp32,
// attention factor folded in). Positions past the table are computed on the
// fly in fp64, never wrapped or clamped. Immutable after Create: safe to use
// from many threads at once.
class RopeRotator {
 public:
  // seq_len as for ComputeRopeFrequencies. The frequencies are fixed at plan
  // time: for "dynamic" and "longrope" a caller whose length crosses L0 must
  // plan a new rotator and re-rotate (or keep unrotated) cached keys; the
  // rotator never changes under it. Errors: those of ValidateRopeConfig and
  // ComputeRopeFrequencies; InvalidArgument for table_positions < 0;
  // ResourceExhausted for a table above 2^28 entries.
  static absl::StatusOr<RopeRotator> Create(const RopeConfig& config, int64_t seq_len,
                                            int64_t table_positions);
  // As Create, with frequencies the caller computed (rotary_dim/2 finite
  // entries, attention_factor finite and > 0; InvalidArgument otherwise).
  static absl::StatusOr<RopeRotator> FromFrequencies(const RopeConfig& config,
                                                     RopeFrequencies frequencies,
                                                     int64_t table_positions);

  // Rotates x ([batch, seq, heads, head_dim], f32 or bf16; head_dim equal to the
  // config's) in place. bf16 data is rotated in fp32 and rounded once.
  // kInverse undoes kForward exactly up to rounding: rotation by -angle and
  // division by the attention factor.
  // Batch and seq strides are free (a view of a larger cache is fine).
  // num_threads >= 1: the call never uses more OpenMP threads, and uses fewer
  // for small inputs. A tensor with no elements is a no-op (positions are
  // still validated). Errors (x untouched): InvalidArgument for a bad shape,
  // head_dim, num_threads or positions, or when the largest position times
  // the largest inverse frequency overflows the angle (a tiny scaling
  // factor: the message names the position and the factor); OutOfRange for
  // a position above 2^40.
  // Elements are not checked for finiteness (that would be a second pass over
  // memory): a non-finite input element gives a non-finite output element.
  absl::Status Apply(TensorView x, const Positions& positions, RopeDirection direction,
                     int num_threads) const;

  // cos and sin (attention factor folded in) for each position: writes
  // positions.size() * rotary_dim/2 floats to each output, row-major.
  // InvalidArgument for wrong output sizes, a negative position or an angle
  // that overflows (as Apply), OutOfRange for a position above 2^40.
  absl::Status CosSin(absl::Span<const int64_t> positions, absl::Span<float> cos_out,
                      absl::Span<float> sin_out) const;
  // The same in double, computed for each position (no f32 table): for
  // fp64 callers (linear attention), whose cancelling sums would magnify the
  // f32 rounding of cos and sin (~3e-8) past their error estimate.
  absl::Status CosSin(absl::Span<const int64_t> positions, absl::Span<double> cos_out,
                      absl::Span<double> sin_out) const;

  const RopeConfig& config() const { return config_; }
  const RopeFrequencies& frequencies() const { return freqs_; }
  int64_t rotary_dim() const { return config_.effective_rotary_dim(); }

 private:
  RopeConfig config_;
  RopeFrequencies freqs_;
  int64_t table_positions_ = 0;
  std::vector<float> cos_;  // [table_positions, rotary_dim/2]
  std::vector<float> sin_;
};

}  // namespace ropeattn

#endif  // ROPEATTN_CORE_ROPE_H_
