// A plain fp64 reference for RoPE, written to be read, not to be fast. It
// shares no code with core/: each scaling rule of the shared reference
// (positional-encodings.md, section 4) is spelled out again here, one function
// per rule, with loops over indices and doubles everywhere, so a test
// comparing the two catches a misreading on either side.
//
// `d` is the rotary dim (even); every rule returns d/2 inverse frequencies.
#ifndef ROPEATTN_TESTS_REFERENCE_ROPE_REF_H_
#define ROPEATTN_TESTS_REFERENCE_ROPE_REF_H_

#include <cstdint>
#include <optional>
#include <vector>

namespace ropeattn::ref {

// theta_i = base^(-2i/d).
std::vector<double> DefaultInvFreq(int64_t d, double base);
// Position Interpolation: theta_i / factor.
std::vector<double> LinearInvFreq(int64_t d, double base, double factor);
// Static NTK-aware: base' = base * factor^(d/(d-2)).
std::vector<double> NtkInvFreq(int64_t d, double base, double factor);
// Dynamic NTK: L = max(seq_len, original_len),
// base' = base * (factor*L/original_len - (factor-1))^(d/(d-2)).
std::vector<double> DynamicNtkInvFreq(int64_t d, double base, double factor, int64_t original_len,
                                      int64_t seq_len);

struct YarnRefParams {
  double factor = 1.0;
  int64_t original_len = 0;  // L0, used in the correction dims
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  // false: the correction range bounds are not floored / ceiled.
  bool truncate = true;
  std::optional<double> attention_factor;
  // Used only when both are given and non-zero (transformers'
  // `if mscale and mscale_all_dim`).
  std::optional<double> mscale;
  std::optional<double> mscale_all_dim;
};
std::vector<double> YarnInvFreq(int64_t d, double base, const YarnRefParams& params);
double YarnAttentionFactor(const YarnRefParams& params);

// LongRoPE: theta_i = 1 / (ext_i * base^(2i/d)) with ext = long_factor when
// seq_len > original_len, else short_factor.
std::vector<double> LongRopeInvFreq(int64_t d, double base, const std::vector<double>& short_factor,
                                    const std::vector<double>& long_factor, int64_t original_len,
                                    int64_t seq_len);
// override if given; else 1 when f <= 1; else sqrt(1 + ln f / ln L0), where
// f = max_position_embeddings / L0 when max_position_embeddings > 0 (Phi-3
// configs), else factor.
double LongRopeAttentionFactor(double factor, int64_t original_len,
                               std::optional<double> override_factor,
                               int64_t max_position_embeddings = 0);

// Llama 3.1 wavelength-banded interpolation.
std::vector<double> Llama3InvFreq(int64_t d, double base, double factor, double low_freq_factor,
                                  double high_freq_factor, int64_t original_len);

// Rotation of a dense [batch, seq, heads, head_dim] array.
struct RotateRefParams {
  int64_t batch = 1;
  int64_t seq = 1;
  int64_t heads = 1;
  int64_t head_dim = 2;
  int64_t rotary_dim = 2;          // channels [rotary_dim, head_dim) pass through
  bool interleaved = false;        // false: pairs (i, i + d/2); true: (2i, 2i + 1)
  std::vector<int64_t> positions;  // [batch * seq], row-major [b][s]
  std::vector<double> inv_freq;    // rotary_dim / 2
  double attention_factor = 1.0;
  // Inverse: rotate by -angle and divide by the attention factor.
  bool inverse = false;
};
std::vector<double> Rotate(const RotateRefParams& params, const std::vector<double>& x);

}  // namespace ropeattn::ref

#endif  // ROPEATTN_TESTS_REFERENCE_ROPE_REF_H_
