// Bounds every part of the service shares, and overflow-proof arithmetic for
// sizes computed from untrusted fields. One place: the core, the server's
// cost model and its handlers all read these.
#ifndef ROPEATTN_CORE_LIMITS_H_
#define ROPEATTN_CORE_LIMITS_H_

#include <cstdint>
#include <initializer_list>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ropeattn {

// Largest absolute token position anywhere (RoPE, ALiBi, T5, masks, offsets).
// Past it an fp32 angle keeps no precision, and q_pos - k_pos of any two
// positions stays far inside int64.
inline constexpr int64_t kMaxPosition = int64_t{1} << 40;

inline constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// a + b and a * b for non-negative operands, saturating at int64 max: a
// hostile shape can push a size over a limit, never wrap it under one.
constexpr int64_t SatAdd(int64_t a, int64_t b) { return a > kInt64Max - b ? kInt64Max : a + b; }
constexpr int64_t SatMul(int64_t a, int64_t b) {
  if (a == 0 || b == 0) return 0;
  return a > kInt64Max / b ? kInt64Max : a * b;
}
constexpr int64_t SatProduct(std::initializer_list<int64_t> dims) {
  int64_t n = 1;
  for (int64_t d : dims) n = SatMul(n, d);
  return n;
}
// The steps of a loop nest with these extents, outermost first, counting
// every level: (a, b, c) -> a + ab + abc. An outer loop over a huge extent
// whose inner loop is empty still costs its own iterations.
constexpr int64_t LoopSteps(std::initializer_list<int64_t> extents) {
  int64_t total = 0, prefix = 1;
  for (int64_t e : extents) {
    prefix = SatMul(prefix, e);
    total = SatAdd(total, prefix);
  }
  return total;
}

// `first` .. `first + count - 1` must lie in [0, kMaxPosition]:
// InvalidArgument naming `first_field` for a negative first position,
// OutOfRange when the last one is past kMaxPosition, naming both fields and
// values (count_field names where `count` came from; needed when count > 1).
// An empty first_field means the positions start at an implicit 0. count 0
// checks `first` alone.
absl::Status CheckPositions(int64_t first, int64_t count, absl::string_view first_field,
                            absl::string_view count_field = {});

}  // namespace ropeattn

#endif  // ROPEATTN_CORE_LIMITS_H_
