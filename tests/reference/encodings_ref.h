// Plain fp64 reference for absolute positional encodings. Written for
// reading, not speed: one loop per index, doubles everywhere, no core code.
#ifndef ROPEATTN_TESTS_REFERENCE_ENCODINGS_REF_H_
#define ROPEATTN_TESTS_REFERENCE_ENCODINGS_REF_H_

#include <cstdint>
#include <vector>

namespace ropeattn::ref {

// The sinusoidal table, row-major [num_positions][d_model], for positions
// first_position .. first_position + num_positions - 1.
//   interleaved:  PE[p][2i] = sin(p / base^(2i/d)),  PE[p][2i+1] = cos(...)
//   otherwise:    PE[p][i]  = sin(...),              PE[p][d/2 + i] = cos(...)
std::vector<double> SinusoidalTable(int64_t num_positions, int64_t d_model, double base,
                                    bool interleaved, int64_t first_position);

// x + table[position], x row-major [batch][seq][d_model], table row-major
// [max_positions][d_model], positions row-major [batch][seq] (all in range).
std::vector<double> AddLearnedPositions(const std::vector<double>& x, int64_t batch, int64_t seq,
                                        int64_t d_model, const std::vector<double>& table,
                                        const std::vector<int64_t>& positions);

}  // namespace ropeattn::ref

#endif  // ROPEATTN_TESTS_REFERENCE_ENCODINGS_REF_H_
