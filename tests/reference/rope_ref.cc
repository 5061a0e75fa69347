#include "tests/reference/rope_ref.h"

#include <algorithm>
#include <cmath>

namespace ropeattn::ref {
namespace {

const double kPi = 3.14159265358979323846;

// base^(2i/d) for i = 0 .. d/2 - 1 (the wavelength scale of pair i).
std::vector<double> PosFreq(int64_t d, double base) {
  std::vector<double> pos_freq;
  for (int64_t i = 0; i < d / 2; ++i) {
    pos_freq.push_back(std::pow(base, (2.0 * i) / d));
  }
  return pos_freq;
}

}  // namespace

std::vector<double> DefaultInvFreq(int64_t d, double base) {
  std::vector<double> inv_freq;
  for (double p : PosFreq(d, base)) inv_freq.push_back(1.0 / p);
  return inv_freq;
}

std::vector<double> LinearInvFreq(int64_t d, double base, double factor) {
  std::vector<double> inv_freq = DefaultInvFreq(d, base);
  for (double& x : inv_freq) x = x / factor;
  return inv_freq;
}

std::vector<double> NtkInvFreq(int64_t d, double base, double factor) {
  double exponent = static_cast<double>(d) / (d - 2);
  double new_base = base * std::pow(factor, exponent);
  return DefaultInvFreq(d, new_base);
}

std::vector<double> DynamicNtkInvFreq(int64_t d, double base, double factor, int64_t original_len,
                                      int64_t seq_len) {
  double length = static_cast<double>(std::max(seq_len, original_len));
  double exponent = static_cast<double>(d) / (d - 2);
  double grow = factor * length / original_len - (factor - 1.0);
  double new_base = base * std::pow(grow, exponent);
  return DefaultInvFreq(d, new_base);
}

std::vector<double> YarnInvFreq(int64_t d, double base, const YarnRefParams& params) {
  // Fractional pair index whose wavelength makes `rotations` full turns over
  // the original length.
  auto corr_dim = [&](double rotations) {
    return d * std::log(params.original_len / (rotations * 2.0 * kPi)) / (2.0 * std::log(base));
  };
  double low = corr_dim(params.beta_fast);
  double high = corr_dim(params.beta_slow);
  if (params.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  if (low < 0) low = 0;
  if (high > d - 1) high = d - 1;
  if (low == high) high = high + 0.001;

  std::vector<double> pos_freq = PosFreq(d, base);
  std::vector<double> inv_freq;
  for (int64_t j = 0; j < d / 2; ++j) {
    double extrapolation = 1.0 / pos_freq[j];
    double interpolation = 1.0 / (params.factor * pos_freq[j]);
    double ramp = (j - low) / (high - low);
    if (ramp < 0) ramp = 0;
    if (ramp > 1) ramp = 1;
    double extrapolation_weight = 1.0 - ramp;
    inv_freq.push_back(interpolation * (1.0 - extrapolation_weight) +
                       extrapolation * extrapolation_weight);
  }
  return inv_freq;
}

double YarnAttentionFactor(const YarnRefParams& params) {
  if (params.attention_factor.has_value()) return *params.attention_factor;
  // transformers' get_mscale(scale, mscale=1).
  const auto get_mscale = [](double scale, double mscale) {
    return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
  };
  const bool mscale = params.mscale.has_value() && *params.mscale != 0;
  const bool mscale_all_dim = params.mscale_all_dim.has_value() && *params.mscale_all_dim != 0;
  if (mscale && mscale_all_dim) {
    return get_mscale(params.factor, *params.mscale) /
           get_mscale(params.factor, *params.mscale_all_dim);
  }
  return get_mscale(params.factor, 1.0);
}

std::vector<double> LongRopeInvFreq(int64_t d, double base, const std::vector<double>& short_factor,
                                    const std::vector<double>& long_factor, int64_t original_len,
                                    int64_t seq_len) {
  const std::vector<double>& ext = seq_len > original_len ? long_factor : short_factor;
  std::vector<double> pos_freq = PosFreq(d, base);
  std::vector<double> inv_freq;
  for (int64_t i = 0; i < d / 2; ++i) inv_freq.push_back(1.0 / (ext[i] * pos_freq[i]));
  return inv_freq;
}

double LongRopeAttentionFactor(double factor, int64_t original_len,
                               std::optional<double> override_factor,
                               int64_t max_position_embeddings) {
  if (override_factor.has_value()) return *override_factor;
  double f = factor;
  if (max_position_embeddings > 0) f = static_cast<double>(max_position_embeddings) / original_len;
  if (f <= 1.0) return 1.0;
  return std::sqrt(1.0 + std::log(f) / std::log(static_cast<double>(original_len)));
}

std::vector<double> Llama3InvFreq(int64_t d, double base, double factor, double low_freq_factor,
                                  double high_freq_factor, int64_t original_len) {
  double low_freq_wavelen = original_len / low_freq_factor;
  double high_freq_wavelen = original_len / high_freq_factor;
  std::vector<double> inv_freq;
  for (double theta : DefaultInvFreq(d, base)) {
    double wavelen = 2.0 * kPi / theta;
    // transformers' order: torch.where(wavelen > low, theta / factor, theta),
    // then the smoothed values where !(wavelen < high) && !(wavelen > low).
    if (wavelen > low_freq_wavelen) {
      inv_freq.push_back(theta / factor);
    } else if (!(wavelen < high_freq_wavelen)) {
      double smooth =
          (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
      inv_freq.push_back((1.0 - smooth) * theta / factor + smooth * theta);
    } else {
      inv_freq.push_back(theta);
    }
  }
  return inv_freq;
}

std::vector<double> Rotate(const RotateRefParams& p, const std::vector<double>& x) {
  std::vector<double> out = x;
  const int64_t half = p.rotary_dim / 2;
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t s = 0; s < p.seq; ++s) {
      const double position = static_cast<double>(p.positions[b * p.seq + s]);
      for (int64_t h = 0; h < p.heads; ++h) {
        const int64_t row = ((b * p.seq + s) * p.heads + h) * p.head_dim;
        for (int64_t i = 0; i < half; ++i) {
          // Which two channels form pair i.
          int64_t first = p.interleaved ? 2 * i : i;
          int64_t second = p.interleaved ? 2 * i + 1 : i + half;
          // The angle of the fp64 frequency, taken exactly: long double
          // carries the product to 2^-64 of itself.
          const long double angle = static_cast<long double>(position) * p.inv_freq[i];
          double c = static_cast<double>(std::cos(angle));
          double sn = static_cast<double>(std::sin(angle));
          double a = p.attention_factor;
          if (p.inverse) {
            sn = -sn;
            a = 1.0 / a;
          }
          double xv = x[row + first];
          double yv = x[row + second];
          out[row + first] = a * (xv * c - yv * sn);
          out[row + second] = a * (xv * sn + yv * c);
        }
      }
    }
  }
  return out;
}

}  // namespace ropeattn::ref
