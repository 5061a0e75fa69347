#include "core/limits.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ropeattn {

absl::Status CheckPositions(int64_t first, int64_t count, absl::string_view field) {
  if (first < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("%s must be >= 0, got %d", field, first));
  }
  const int64_t last_step = count > 0 ? count - 1 : 0;
  if (first > kMaxPosition || last_step > kMaxPosition - first) {
    return absl::OutOfRangeError(absl::StrFormat(
        "%s = %d puts position %s past the maximum position 2^40 (%d)", field, first,
        count > 1 ? absl::StrFormat("%d + %d - 1", first, count) : absl::StrCat(first),
        kMaxPosition));
  }
  return absl::OkStatus();
}

}  // namespace ropeattn
