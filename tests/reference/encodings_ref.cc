#include "tests/reference/encodings_ref.h"

#include <cmath>

namespace ropeattn::ref {

std::vector<double> SinusoidalTable(int64_t num_positions, int64_t d_model, double base,
                                    bool interleaved, int64_t first_position) {
  std::vector<double> table(num_positions * d_model, 0.0);
  for (int64_t row = 0; row < num_positions; ++row) {
    const double p = static_cast<double>(first_position + row);
    for (int64_t i = 0; i < d_model / 2; ++i) {
      // p / base^(2i/d), spelled as in the paper.
      const double exponent = (2.0 * i) / d_model;
      const double angle = p / std::pow(base, exponent);
      int64_t sin_col;
      int64_t cos_col;
      if (interleaved) {
        sin_col = 2 * i;
        cos_col = 2 * i + 1;
      } else {
        sin_col = i;
        cos_col = d_model / 2 + i;
      }
      table[row * d_model + sin_col] = std::sin(angle);
      table[row * d_model + cos_col] = std::cos(angle);
    }
  }
  return table;
}

std::vector<double> AddLearnedPositions(const std::vector<double>& x, int64_t batch, int64_t seq,
                                        int64_t d_model, const std::vector<double>& table,
                                        const std::vector<int64_t>& positions) {
  std::vector<double> out = x;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t s = 0; s < seq; ++s) {
      const int64_t p = positions[b * seq + s];
      for (int64_t c = 0; c < d_model; ++c) {
        out[(b * seq + s) * d_model + c] += table[p * d_model + c];
      }
    }
  }
  return out;
}

}  // namespace ropeattn::ref
