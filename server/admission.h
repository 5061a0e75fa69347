// Admission by time (docs/scheduler.md, part 2): from a request's priced
// compute (server/cost.h) and the throughput this server has measured, the
// time it would wait for a worker and the time it would run. A request that
// cannot finish inside its deadline, or whose wait would pass
// --max_queue_delay_seconds, is refused at once instead of queued.
//
// Thread-safety: every method may be called from any thread.
#ifndef ROPEATTN_SERVER_ADMISSION_H_
#define ROPEATTN_SERVER_ADMISSION_H_

#include <cstdint>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ropeattn::server {

class Admission {
 public:
  // `workers` compute in parallel; `max_queue_delay` (<= 0: no limit) caps
  // the estimated wait of an admitted request.
  Admission(int workers, absl::Duration max_queue_delay);

  // The decision for a request of `compute` units due by `deadline`
  // (InfiniteFuture: none). ResourceExhausted naming `method`, the
  // estimates and what to do, with *retry_after set to when a retry could
  // be admitted; OK otherwise (the request's compute then counts as pending
  // until Finished). Before enough work has been measured, every request is
  // admitted (the estimate would be a guess).
  absl::Status Admit(const char* method, int64_t compute, absl::Time deadline, absl::Time now,
                     absl::Duration* retry_after);
  // An admitted request left the queue without running, or finished running
  // for `seconds` (negative: it never ran); its compute is no longer pending.
  void Finished(int64_t compute, double seconds);

  // Estimated seconds `compute` units take on one worker; nullopt before
  // the rate is known.
  std::optional<double> ServiceSeconds(int64_t compute) const;
  int64_t pending_compute() const;

 private:
  // Requests shorter than this teach only the fixed per-request time; longer
  // ones teach the rate (short ones are all overhead, they would make the
  // rate look slow and long requests' estimates too pessimistic).
  static constexpr double kRateMinSeconds = 0.005;
  static constexpr int kMinSamples = 3;

  const int workers_;
  const absl::Duration max_queue_delay_;
  mutable absl::Mutex mu_;
  double units_per_second_ ABSL_GUARDED_BY(mu_) = 0;  // EWMA over long requests
  int rate_samples_ ABSL_GUARDED_BY(mu_) = 0;
  double overhead_seconds_ ABSL_GUARDED_BY(mu_) = 0;  // EWMA over short requests
  int64_t pending_ ABSL_GUARDED_BY(mu_) = 0;          // queued + running compute
};

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_ADMISSION_H_
