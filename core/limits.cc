#include "core/limits.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ropeattn {

absl::Status CheckPositions(int64_t first, int64_t count, absl::string_view first_field,
                            absl::string_view count_field) {
  if (first < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s must be >= 0, got %d", first_field, first));
  }
  const int64_t last_step = count > 0 ? count - 1 : 0;
  if (first <= kMaxPosition && last_step <= kMaxPosition - first) return absl::OkStatus();
  const std::string limit = absl::StrFormat("the maximum position 2^40 (%d)", kMaxPosition);
  if (count <= 1) {
    return absl::OutOfRangeError(
        absl::StrFormat("%s = %d is past %s", first_field, first, limit));
  }
  const std::string counted =
      count_field.empty() ? absl::StrFormat("%d positions", count)
                          : absl::StrFormat("%s = %d", count_field, count);
  if (first_field.empty()) {
    return absl::OutOfRangeError(absl::StrFormat(
        "%s puts the last position at %d, past %s", counted, count - 1, limit));
  }
  return absl::OutOfRangeError(
      absl::StrFormat("%s = %d with %s puts the last position at %d + %d - 1, past %s",
                      first_field, first, counted, first, count, limit));
}

}  // namespace ropeattn
