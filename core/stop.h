// Cooperative cancellation for long kernels: the server sets it when a call
// is cancelled or its deadline passes; kernels read it between tiles and
// stop. Reading it is one relaxed atomic load (and a clock read when a
// deadline is set), so it is cheap enough to read once per tile.
#ifndef ROPEATTN_CORE_STOP_H_
#define ROPEATTN_CORE_STOP_H_

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ropeattn {

class StopToken {
 public:
  StopToken() = default;
  StopToken(const StopToken&) = delete;
  StopToken& operator=(const StopToken&) = delete;

  // How close to its deadline a cancellation counts as the deadline's: a
  // client's own deadline timer cancels the call before the server's copy
  // of the deadline passes (that copy starts when the request arrives, later
  // than the client's), by the request's transit and the cancel's. At most
  // a quarter of the call's timeout (from set_deadline), so a client that
  // cancels a short call early (a hedged request) is still counted as
  // cancelling.
  static constexpr absl::Duration kDeadlineSlack = absl::Milliseconds(50);

  // Thread-safe; idempotent (the first cancellation's time is kept).
  void Cancel() {
    int64_t none = 0;
    cancelled_at_ns_.compare_exchange_strong(none, absl::ToUnixNanos(absl::Now()),
                                             std::memory_order_relaxed);
    cancelled_.store(true, std::memory_order_release);  // the time is seen with it
  }
  // Not thread-safe against ShouldStop: set it before the work starts.
  void set_deadline(absl::Time deadline) {
    deadline_ = deadline;
    deadline_set_at_ = absl::Now();
  }
  absl::Time deadline() const { return deadline_; }

  bool cancelled() const { return cancelled_.load(std::memory_order_relaxed); }
  bool ShouldStop() const {
    return cancelled() || (deadline_ != absl::InfiniteFuture() && absl::Now() >= deadline_);
  }
  // DeadlineExceeded once the deadline has passed, or when the call was
  // cancelled within kDeadlineSlack of it (gRPC cancels a call when its
  // deadline passes, the client's first: that call is counted as expired,
  // not cancelled), else Cancelled, or OK when neither.
  absl::Status status() const {
    const bool has_deadline = deadline_ != absl::InfiniteFuture();
    if (has_deadline && absl::Now() >= deadline_) {
      return absl::DeadlineExceededError("the call's deadline passed; computation stopped");
    }
    if (cancelled_.load(std::memory_order_acquire)) {
      const int64_t at = cancelled_at_ns_.load(std::memory_order_relaxed);
      const absl::Duration slack = std::min(kDeadlineSlack, (deadline_ - deadline_set_at_) / 4);
      if (has_deadline && at != 0 && absl::FromUnixNanos(at) >= deadline_ - slack) {
        return absl::DeadlineExceededError(
            "the call's deadline passed (its client's timer cancelled it first); computation "
            "stopped");
      }
      return absl::CancelledError("the call was cancelled; computation stopped");
    }
    return absl::OkStatus();
  }

 private:
  std::atomic<bool> cancelled_{false};
  std::atomic<int64_t> cancelled_at_ns_{0};  // Unix ns of the first Cancel, 0: none
  absl::Time deadline_ = absl::InfiniteFuture();
  absl::Time deadline_set_at_ = absl::InfinitePast();
};

// A null token never stops.
inline bool ShouldStop(const StopToken* token) { return token != nullptr && token->ShouldStop(); }

}  // namespace ropeattn

#endif  // ROPEATTN_CORE_STOP_H_
