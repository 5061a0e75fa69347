#include "core/encodings.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/limits.h"
#include "core/status_macros.h"
#include "core/trig.h"

namespace ropeattn {
namespace {


// A private copy of ResolvePositions' rules: ropeattn_encodings must not
// depend on ropeattn_rope. Positions come back row-major [batch][seq].
absl::StatusOr<std::vector<int64_t>> ResolveTokenPositions(const Positions& positions,
                                                           int64_t batch, int64_t seq) {
  const bool has_explicit = !positions.explicit_positions.empty();
  const bool has_offsets = !positions.offsets.empty();
  if (has_explicit && has_offsets) {
    return absl::InvalidArgumentError(
        "positions: set at most one of explicit_positions and offsets, got both");
  }
  std::vector<int64_t> out(static_cast<size_t>(batch * seq));
  if (has_explicit) {
    const int64_t n = static_cast<int64_t>(positions.explicit_positions.size());
    if (n != batch * seq) {
      return absl::InvalidArgumentError(
          absl::StrFormat("explicit_positions has %d entries, expected batch * seq = %d * %d = %d",
                          n, batch, seq, batch * seq));
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = positions.explicit_positions[i];
      if (p < 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "explicit_positions[%d] (batch %d, seq %d) is negative (%d)", i, i / seq, i % seq, p));
      }
      out[i] = p;
    }
    return out;
  }
  if (has_offsets) {
    const int64_t n = static_cast<int64_t>(positions.offsets.size());
    if (n != batch) {
      return absl::InvalidArgumentError(
          absl::StrFormat("offsets has %d entries, expected batch = %d", n, batch));
    }
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t offset = positions.offsets[b];
      if (offset < 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("offsets[%d] is negative (%d)", b, offset));
      }
      // offset + seq - 1 must not overflow; such a position is past any table.
      if (seq > 0 && offset > std::numeric_limits<int64_t>::max() - (seq - 1)) {
        return absl::OutOfRangeError(absl::StrFormat(
            "offsets[%d] = %d plus seq %d overflows int64 positions", b, offset, seq));
      }
      for (int64_t s = 0; s < seq; ++s) out[b * seq + s] = offset + s;
    }
    return out;
  }
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t s = 0; s < seq; ++s) out[b * seq + s] = s;
  }
  return out;
}

inline float LoadFloat(const void* base, DType dtype, int64_t offset) {
  if (dtype == DType::kF32) return static_cast<const float*>(base)[offset];
  return BF16ToFloat(static_cast<const uint16_t*>(base)[offset]);
}

}  // namespace

const char* SinusoidalLayoutName(SinusoidalLayout layout) {
  switch (layout) {
    case SinusoidalLayout::kInterleaved:
      return "interleaved";
    case SinusoidalLayout::kSinCosHalf:
      return "sin_cos_half";
  }
  return "unknown";
}

absl::StatusOr<Tensor> SinusoidalTable(int64_t num_positions, int64_t d_model, double base,
                                       SinusoidalLayout layout, int64_t first_position) {
  if (d_model <= 0 || d_model % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("d_model must be even and positive, got %d", d_model));
  }
  if (num_positions < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_positions must be >= 0, got %d", num_positions));
  }
  if (first_position < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("first_position must be >= 0, got %d", first_position));
  }
  if (!std::isfinite(base) || base <= 1.0) {
    return absl::InvalidArgumentError(absl::StrFormat("base must be finite and > 1, got %g", base));
  }
  if (layout != SinusoidalLayout::kInterleaved && layout != SinusoidalLayout::kSinCosHalf) {
    return absl::InvalidArgumentError(
        absl::StrFormat("unknown sinusoidal layout %d", static_cast<int>(layout)));
  }
  // Written so it cannot overflow: both terms are already known to be >= 0.
  if (num_positions > 0 && first_position > kMaxPosition - (num_positions - 1)) {
    return absl::OutOfRangeError(absl::StrFormat(
        "last position first_position + num_positions - 1 = %d + %d - 1 exceeds 2^40",
        first_position, num_positions));
  }
  RA_ASSIGN_OR_RETURN(Tensor table, Tensor::Create(DType::kF32, {num_positions, d_model}));
  if (table.num_elements() == 0) return table;

  const int64_t half = d_model / 2;
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    inv_freq[i] = std::pow(base, -static_cast<double>(2 * i) / static_cast<double>(d_model));
  }
  // Positions stay exact in fp64 up to 2^53; the product p * w_i's own
  // rounding is corrected (core/trig.h).
  // The interleaved layout writes sin/cos of pair i to columns 2i, 2i+1; the
  // half layout to columns i, half + i.
  const bool interleaved = layout == SinusoidalLayout::kInterleaved;
  const int64_t sin_stride = interleaved ? 2 : 1;
  const int64_t cos_start = interleaved ? 1 : half;
  float* out = table.data<float>();
  for (int64_t row = 0; row < num_positions; ++row) {
    const double p = static_cast<double>(first_position + row);
    float* r = out + row * d_model;
    for (int64_t i = 0; i < half; ++i) {
      double sn, cs;
      internal::SinCosOfProduct(p, inv_freq[i], &sn, &cs);
      r[i * sin_stride] = static_cast<float>(sn);
      r[cos_start + i * sin_stride] = static_cast<float>(cs);
    }
  }
  return table;
}

absl::Status AddLearnedPositions(TensorView x, ConstTensorView table, const Positions& positions) {
  RA_RETURN_IF_ERROR(CheckRank(x, 3, "x"));
  RA_RETURN_IF_ERROR(CheckRank(table, 2, "table"));
  const int64_t batch = x.dim(0);
  const int64_t seq = x.dim(1);
  const int64_t d_model = x.dim(2);
  const int64_t max_positions = table.dim(0);
  if (table.dim(1) != d_model) {
    return absl::InvalidArgumentError(
        absl::StrFormat("table d_model %d does not match x d_model %d (x %s, table %s)",
                        table.dim(1), d_model, DimsToString(x.dims()), DimsToString(table.dims())));
  }
  RA_ASSIGN_OR_RETURN(std::vector<int64_t> pos, ResolveTokenPositions(positions, batch, seq));
  // Every position is checked before x is touched, so an error leaves x as it was.
  for (size_t i = 0; i < pos.size(); ++i) {
    if (pos[i] >= max_positions) {
      const int64_t idx = static_cast<int64_t>(i);
      return absl::OutOfRangeError(absl::StrFormat(
          "position %d at index %d (batch %d, seq %d) is past the table (max_positions %d)", pos[i],
          idx, idx / seq, idx % seq, max_positions));
    }
  }
  RA_RETURN_IF_ERROR(CheckFinite(table, "table"));
  RA_RETURN_IF_ERROR(CheckFinite(x, "x"));

  const DType xt = x.dtype();
  const DType tt = table.dtype();
  const void* tdata = table.raw();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t s = 0; s < seq; ++s) {
      const int64_t x_row = b * x.stride(0) + s * x.stride(1);
      const int64_t t_row = pos[b * seq + s] * table.stride(0);
      for (int64_t c = 0; c < d_model; ++c) {
        const int64_t xo = x_row + c * x.stride(2);
        const float sum =
            LoadFloat(x.raw(), xt, xo) + LoadFloat(tdata, tt, t_row + c * table.stride(1));
        if (xt == DType::kF32) {
          x.data<float>()[xo] = sum;
        } else {
          x.data<uint16_t>()[xo] = FloatToBF16(sum);
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace ropeattn
