#include "server/admission.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"

namespace ropeattn::server {
namespace {

// Weight of a new sample in the moving averages: recent enough to follow a
// change of load or of machine, smooth enough to ignore one odd request.
constexpr double kAlpha = 0.2;

}  // namespace

Admission::Admission(int workers, absl::Duration max_queue_delay, double max_slowdown)
    : workers_(std::max(1, workers)),
      max_queue_delay_(max_queue_delay),
      max_slowdown_(max_slowdown) {}

std::optional<double> Admission::Seconds(const Kind& k, int64_t compute) {
  if (k.rate_samples < kMinSamples || k.units_per_second <= 0) return std::nullopt;
  return k.overhead_seconds + static_cast<double>(std::max<int64_t>(0, compute)) /
                                  k.units_per_second;
}

std::optional<double> Admission::ServiceSeconds(const char* method, int64_t compute) const {
  absl::MutexLock lock(&mu_);
  auto it = kinds_.find(method);
  if (it == kinds_.end()) return std::nullopt;
  return Seconds(it->second, compute);
}

absl::Duration Admission::QueueRetryHint(const Ahead& ahead) const {
  double seconds = 0;
  bool known = false;
  {
    absl::MutexLock lock(&mu_);
    for (const Executor::Running& r : ahead.running) {
      auto it = kinds_.find(r.kind);
      if (it == kinds_.end()) continue;
      if (const std::optional<double> s = Seconds(it->second, r.compute); s.has_value()) {
        // What is left of it: the hint counts down while it runs. Work past
        // its estimate counts a tenth of it (it ends at some unknown time:
        // a hint of 1 ms invited clients to retry at once, over and over).
        seconds += std::max(0.1 * *s, *s - absl::ToDoubleSeconds(r.elapsed));
        known = true;
      }
    }
  }
  if (!known) return absl::Milliseconds(100);
  seconds /= workers_;
  return std::clamp(absl::Seconds(seconds), absl::Milliseconds(1), absl::Seconds(10));
}

int64_t Admission::pending_compute() const {
  absl::MutexLock lock(&mu_);
  int64_t total = 0;
  for (const auto& [name, k] : kinds_) total += k.pending;
  return total;
}

absl::Status Admission::Admit(const char* method, int64_t compute, absl::Time deadline,
                              absl::Time now, absl::Duration* retry_after,
                              bool slowdown_applies, const Ahead* ahead) {
  compute = std::max<int64_t>(0, compute);
  absl::MutexLock lock(&mu_);
  Kind& own = kinds_[method];
  // This request's own compute, judged only within the sizes its rate was
  // measured on (kMaxExtrapolation); nullopt (unknown rate, or past them):
  // counted as nothing, so only what needs it is skipped (the slowdown). The
  // wait ahead, the work before it at each kind's own rate, still judges the
  // deadline and max_queue_delay (skipping them let one oversized request
  // past the load shedding of a queue tens of seconds behind).
  const bool within = own.largest_measured > 0 &&
                      compute / kMaxExtrapolation <= own.largest_measured;
  const std::optional<double> own_service =
      within ? Seconds(own, compute) : std::optional<double>();
  // The work ahead spreads over every worker; this request then runs on
  // one. Kinds whose rate is not known yet add nothing (the estimate never
  // invents a wait).
  const auto seconds_of = [&](const char* name, int64_t units) {
    auto it = kinds_.find(name);
    if (it == kinds_.end()) return 0.0;
    const Kind& k = it->second;
    return units > 0 && k.rate_samples >= kMinSamples && k.units_per_second > 0
               ? static_cast<double>(units) / k.units_per_second
               : 0.0;
  };
  const auto seconds_of_all = [&](const UnitsByMethod& units) {
    double s = 0;
    for (const auto& [name, n] : units) s += seconds_of(name, n);
    return s;
  };
  double running_s = 0, queued_s = 0, slowdown_s = 0;
  if (ahead != nullptr) {
    // A running task counts what is left of it: its estimate less the time
    // it has run (none once past its estimate), so the wait, and the
    // retry-after hint made from it, count down while it runs.
    queued_s = seconds_of_all(ahead->queued);
    slowdown_s = queued_s;
    for (const Executor::Running& r : ahead->running) {
      const double whole = seconds_of(r.kind, r.compute);
      const double left = std::max(0.0, whole - absl::ToDoubleSeconds(r.elapsed));
      running_s += left;
      // Another caller's running request counts against the slowdown only
      // when it is comparable to this one (judged by its whole size).
      if (r.own || (own_service && whole <= max_slowdown_ * *own_service)) slowdown_s += left;
    }
  } else {
    for (const auto& [name, k] : kinds_) queued_s += seconds_of(name.c_str(), k.pending);
    slowdown_s = queued_s;
  }
  const double wait_s = (running_s + queued_s) / workers_;
  // What the slowdown holds against this request (see Admit's comment).
  const double queued_wait_s = slowdown_s / workers_;
  const double service_s = own_service.value_or(0.0);
  const absl::Duration wait = absl::Seconds(wait_s);
  const absl::Duration service = absl::Seconds(service_s);

  // The first refusal is the answer; every check is still made, because a
  // stale rate's probe (kStaleRate) lifts a refusal only when each one comes
  // from this request's own estimated compute: the wait ahead does not
  // depend on it and a faster rate only lowers the wait the slowdown allows,
  // so a probe spent on those admitted a request no rate could have. (Not
  // quite: work of this request's own method queued ahead is priced at the
  // same stale rate. Such a refusal lifts as that work runs and teaches the
  // rate again, so it is not spent on: no refusal outlasts the queue.)
  absl::Status refusal;
  absl::Duration refusal_retry;
  bool only_own_compute = true;
  const auto refuse = [&](bool by_own_compute, absl::Duration retry, auto message) {
    only_own_compute = only_own_compute && by_own_compute;
    if (!refusal.ok()) return;
    refusal = absl::ResourceExhaustedError(message());
    refusal_retry = retry;
  };
  if (deadline != absl::InfiniteFuture() && now + wait + service > deadline) {
    // If the request alone outlasts its deadline, waiting will not help:
    // no retry time (a hint of 0 had clients retry at once, forever).
    const bool alone = now + service > deadline;
    refuse(/*by_own_compute=*/now + wait <= deadline, alone ? absl::InfiniteDuration() : wait, [&] {
      const char* advice =
          alone ? "give it a longer deadline" : "retry later or give it a longer deadline";
      if (!own_service) {
        return absl::StrFormat(
            "%s cannot finish inside its deadline (%.0f ms left): about %.0f ms of wait "
            "for a worker before its own compute (not estimated: %s); %s",
            method, absl::ToDoubleMilliseconds(deadline - now), wait_s * 1e3,
            Seconds(own, compute)
                ? absl::StrFormat("more than %d times the largest request its rate was "
                                  "measured on",
                                  kMaxExtrapolation)
                : std::string("its rate is not measured yet"),
            advice);
      }
      return absl::StrFormat(
          "%s cannot finish inside its deadline (%.0f ms left): about %.0f ms of wait for a "
          "worker and %.0f ms of compute at this server's measured rate; %s",
          method, absl::ToDoubleMilliseconds(deadline - now), wait_s * 1e3, service_s * 1e3,
          advice);
    });
  }
  if (max_queue_delay_ > absl::ZeroDuration() && wait > max_queue_delay_) {
    refuse(/*by_own_compute=*/false, wait - max_queue_delay_, [&] {
      return absl::StrFormat(
          "%s: the estimated wait for a compute worker is %.0f ms, past "
          "--max_queue_delay_seconds (%.0f ms); retry after about %.0f ms",
          method, wait_s * 1e3, absl::ToDoubleMilliseconds(max_queue_delay_),
          absl::ToDoubleMilliseconds(wait - max_queue_delay_));
    });
  }
  if (own_service && slowdown_applies && max_slowdown_ > 0) {
    const double limit_s = std::max(kMinSlowdownWaitSeconds, max_slowdown_ * service_s);
    if (queued_wait_s > limit_s) {
      const absl::Duration retry = absl::Seconds(queued_wait_s - limit_s);
      refuse(/*by_own_compute=*/false, retry, [&] {
        return absl::StrFormat(
            "%s: the estimated wait for a compute worker is %.0f ms, more than "
            "--max_queue_slowdown (%g) times its own compute (%.1f ms); retry after about %.0f ms",
            method, queued_wait_s * 1e3, max_slowdown_, service_s * 1e3,
            absl::ToDoubleMilliseconds(retry));
      });
    }
  }
  if (!refusal.ok()) {
    const bool probe = now - own.last_sample > kStaleRate && now - own.last_probe > kStaleRate;
    if (!only_own_compute || !probe) {
      *retry_after = refusal_retry;
      return refusal;
    }
    own.last_probe = now;  // admitted all the same, to learn the rate again
  }
  own.pending += compute;
  return absl::OkStatus();
}

void Admission::Finished(const char* method, int64_t compute, double seconds, absl::Time now) {
  compute = std::max<int64_t>(0, compute);
  absl::MutexLock lock(&mu_);
  Kind& k = kinds_[method];
  k.pending = std::max<int64_t>(0, k.pending - compute);
  if (!(seconds >= 0) || !std::isfinite(seconds)) return;  // never ran
  if (seconds < kRateMinSeconds) {
    k.overhead_seconds = k.overhead_seconds == 0
                             ? seconds
                             : (1 - kAlpha) * k.overhead_seconds + kAlpha * seconds;
    return;
  }
  if (compute == 0) return;
  // The fixed per-request time is not throughput.
  const double busy = std::max(seconds - k.overhead_seconds, 0.5 * seconds);
  const double rate = static_cast<double>(compute) / busy;
  k.units_per_second =
      k.rate_samples == 0 ? rate : (1 - kAlpha) * k.units_per_second + kAlpha * rate;
  ++k.rate_samples;
  k.largest_measured = std::max(k.largest_measured, compute);
  k.last_sample = now;
}

}  // namespace ropeattn::server
