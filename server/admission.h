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
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/executor.h"

namespace ropeattn::server {

class Admission {
 public:
  // `workers` compute in parallel; `max_queue_delay` (<= 0: no limit) caps
  // the estimated wait of an admitted request; `max_slowdown` (<= 0: no
  // limit) caps it relative to the request's own estimated compute: a
  // request may wait at most max_slowdown times its service time (but
  // always kMinSlowdownWait), so under overload a short request is not
  // queued behind seconds of work, and the latency of what is admitted
  // stays a small multiple of its size.
  Admission(int workers, absl::Duration max_queue_delay, double max_slowdown = 0);
  static constexpr double kMinSlowdownWaitSeconds = 0.05;

  // The decision for a request of `compute` units due by `deadline`
  // (InfiniteFuture: none). ResourceExhausted naming `method`, the
  // estimates and what to do, with *retry_after set to when a retry could
  // be admitted (InfiniteDuration: no retry with the same deadline can be,
  // the request alone outlasts it); OK otherwise (the request's compute then counts as pending
  // until Finished). The request's own compute is estimated only once its
  // method's rate is known (kMinSamples) and within kMaxExtrapolation of the
  // sizes it was measured on; otherwise it counts as nothing (the estimate
  // would be a guess): the wait ahead alone is still held against the
  // deadline and max_queue_delay, and the slowdown, which needs it, is
  // skipped. Work whose rate is not known adds nothing to the wait.
  // `slowdown_applies`: whether max_slowdown applies (stateless calls; a
  // decode step is not refused for another caller's long request).
  // `ahead` (optional): the compute running now and waiting to run before
  // this request (Executor::WorkAhead, which knows the fair-queueing order);
  // without it, all pending compute counts as ahead, spread over the
  // workers. With it, the wait is until a worker would be free for this
  // request: each worker is busy for what is left of its running pass (its
  // estimate less the time it has run; nothing once past it, so the wait and
  // the retry hint count down while it runs; an idle worker, not at all),
  // the queued work ahead goes, task by task in the fair-queueing order, to
  // the earliest free worker, and the request waits for the earliest free
  // worker after that. The deadline and max_queue_delay see all of it. The
  // slowdown sees the queued work, this
  // caller's running work, and another caller's running request only when
  // that is no more than max_slowdown times this request: a running request
  // cannot be preempted, so counting a far larger one refused every small
  // request of a light caller while a heavy caller kept the workers busy,
  // and admitted the heavy caller's, whose compute dwarfs the wait (the light
  // caller starved, though fair queueing puts its request next; its worker
  // counts as free). Behind a comparable request the wait is the overload
  // the slowdown is for. *retry_after is at least 1 ms (a hint of 0 had
  // clients retry at once).
  using Ahead = Executor::Ahead;
  absl::Status Admit(const char* method, int64_t compute, absl::Time deadline, absl::Time now,
                     absl::Duration* retry_after, bool slowdown_applies = true,
                     const Ahead* ahead = nullptr);
  // An admitted request of `method` left the queue without running, or
  // finished running for `seconds` (negative: it never ran); its compute is
  // no longer pending.
  void Finished(const char* method, int64_t compute, double seconds,
                absl::Time now = absl::Now());

  // The retry-after hint of a refusal because the queue is full: when the
  // first busy worker should be done with what it runs (what is left of its
  // running pass's estimate, so it counts down while the work runs; work
  // past its estimate counts a tenth of it; a worker whose work has no
  // known rate is left out), within [1 ms, 10 s]; 100 ms before any of the
  // running work's rates is known.
  absl::Duration QueueRetryHint(const Ahead& ahead) const;

  // Estimated seconds `compute` units of `method` take on one worker;
  // nullopt before its rate is known.
  std::optional<double> ServiceSeconds(const char* method, int64_t compute) const;
  int64_t pending_compute() const;

 private:
  // Requests shorter than this teach only the fixed per-request time; longer
  // ones teach the rate (short ones are all overhead, they would make the
  // rate look slow and long requests' estimates too pessimistic).
  static constexpr double kRateMinSeconds = 0.005;
  static constexpr int kMinSamples = 3;
  // A rate judges a request only up to this many times the largest one it
  // was measured on: past it, the request's own compute is not estimated,
  // as if the rate were unknown (an external test: a rate measured on small
  // requests while the CPU was taken by others priced a 0.3 s request at
  // 302 s and refused it with 30 s left). The wait ahead still judges it.
  static constexpr int64_t kMaxExtrapolation = 32;
  // A rate with no sample for this long may be stale (learned under load
  // that has passed): one request of its method that only its own estimated
  // compute refuses (the wait ahead fits its deadline and max_queue_delay,
  // and the slowdown admits it) is then admitted, at most once per this
  // interval, so the rate can learn again (otherwise every request the
  // stale rate refuses is one that could have corrected it). A refusal the
  // wait ahead or the slowdown makes is kept: the probe tests this request's
  // own estimate, the wait does not depend on it, and a faster rate would
  // only lower the wait the slowdown allows. A probe stopped at its deadline
  // teaches nothing (it only shows that the request needed more time than it
  // had, as estimated): the next comes kStaleRate later.
  static constexpr absl::Duration kStaleRate = absl::Seconds(30);

  // Each method learns its own rate: a decode step (memory-bound, small)
  // and a prefill Attend (compute-bound) turn priced units into seconds at
  // very different speeds, and a mixed average would misjudge both.
  struct Kind {
    double units_per_second = 0;  // EWMA over long requests
    int rate_samples = 0;
    double overhead_seconds = 0;  // EWMA over short requests
    int64_t pending = 0;          // queued + running compute
    int64_t largest_measured = 0;  // compute of the largest request the rate learned from
    absl::Time last_sample = absl::InfinitePast();  // the rate's newest sample
    absl::Time last_probe = absl::InfinitePast();   // the last admission past a stale rate
  };
  // Estimated seconds of `kind` for `compute` units; nullopt before known.
  static std::optional<double> Seconds(const Kind& kind, int64_t compute);

  const int workers_;
  const absl::Duration max_queue_delay_;
  const double max_slowdown_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Kind> kinds_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_ADMISSION_H_
