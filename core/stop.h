// Cooperative cancellation for long kernels: the server sets it when a call
// is cancelled or its deadline passes; kernels read it between tiles and
// stop. Reading it is one relaxed atomic load (and a clock read when a
// deadline is set), so it is cheap enough to read once per tile.
#ifndef ROPEATTN_CORE_STOP_H_
#define ROPEATTN_CORE_STOP_H_

#include <atomic>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ropeattn {

class StopToken {
 public:
  StopToken() = default;
  StopToken(const StopToken&) = delete;
  StopToken& operator=(const StopToken&) = delete;

  // Thread-safe; idempotent.
  void Cancel() { cancelled_.store(true, std::memory_order_relaxed); }
  // Not thread-safe against ShouldStop: set it before the work starts.
  void set_deadline(absl::Time deadline) { deadline_ = deadline; }
  absl::Time deadline() const { return deadline_; }

  bool cancelled() const { return cancelled_.load(std::memory_order_relaxed); }
  bool ShouldStop() const {
    return cancelled() || (deadline_ != absl::InfiniteFuture() && absl::Now() >= deadline_);
  }
  // DeadlineExceeded once the deadline has passed (gRPC cancels a call when
  // its deadline passes: that call is counted as expired, not cancelled),
  // else Cancelled, or OK when neither.
  absl::Status status() const {
    if (deadline_ != absl::InfiniteFuture() && absl::Now() >= deadline_) {
      return absl::DeadlineExceededError("the call's deadline passed; computation stopped");
    }
    if (cancelled()) return absl::CancelledError("the call was cancelled; computation stopped");
    return absl::OkStatus();
  }

 private:
  std::atomic<bool> cancelled_{false};
  absl::Time deadline_ = absl::InfiniteFuture();
};

// A null token never stops.
inline bool ShouldStop(const StopToken* token) { return token != nullptr && token->ShouldStop(); }

}  // namespace ropeattn

#endif  // ROPEATTN_CORE_STOP_H_
