// Documented ranges of the float parameters a request (or a checkpoint's
// config.json, for the values a session carries through the same checks)
// may give (README "Limits"). No protobuf here: the model loader reads them.
#ifndef ROPEATTN_SERVER_PARAM_LIMITS_H_
#define ROPEATTN_SERVER_PARAM_LIMITS_H_

namespace ropeattn::server {

inline constexpr double kMaxTheta = 1e12;           // RoPE theta, sinusoidal base
inline constexpr double kMaxScalingFactor = 1e6;    // factor, long/short factors, freq factors, betas
inline constexpr double kMaxAttentionFactor = 1e3;  // attention_factor, |mscale|, |mscale_all_dim|
inline constexpr double kMaxLogitScale = 1e4;       // spec.scale
inline constexpr double kMaxSoftcap = 1e6;          // spec.softcap
// Smallest soft-cap other than 0 (none): the kernels cap in f32, where a
// value below ~7e-46 rounds to 0 and would silently mean no cap at all.
inline constexpr double kMinSoftcap = 1e-30;
inline constexpr double kMaxAlibiSlope = 1e3;       // |spec.alibi.slopes[h]|

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_PARAM_LIMITS_H_
