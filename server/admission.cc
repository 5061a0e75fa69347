#include "server/admission.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_format.h"

namespace ropeattn::server {
namespace {

// Weight of a new sample in the moving averages: recent enough to follow a
// change of load or of machine, smooth enough to ignore one odd request.
constexpr double kAlpha = 0.2;

// The running tasks of `running` by worker: a pass's tasks (a batch) run
// together on one worker.
std::vector<std::vector<const Executor::Running*>> Passes(
    const std::vector<Executor::Running>& running) {
  std::vector<std::vector<const Executor::Running*>> passes;
  for (const Executor::Running& r : running) {
    if (!r.same_pass || passes.empty()) passes.emplace_back();
    passes.back().push_back(&r);
  }
  return passes;
}

// Seconds until each of `workers` is free of `busy` (a pass's seconds each,
// at most one a worker; more, which the executor never runs, are added to
// the earliest free worker as if they waited), then of `queued` (each to the
// earliest free worker, in the order given: the workers take the queue in
// the fair-queueing order). An idle worker is free at 0.
std::vector<double> FreeTimes(int workers, const std::vector<double>& busy,
                              const std::vector<double>& queued) {
  std::vector<double> free_at(static_cast<size_t>(std::max(1, workers)), 0.0);
  const auto earliest = [&] { return std::min_element(free_at.begin(), free_at.end()); };
  for (size_t i = 0; i < busy.size(); ++i) {
    if (i < free_at.size()) {
      free_at[i] = busy[i];
    } else {
      *earliest() += busy[i];
    }
  }
  for (const double s : queued) *earliest() += s;
  return free_at;
}

// A retry hint is at least 1 ms: 0 (a wait rounded down to whole
// milliseconds) had clients retry at once.
absl::Duration AtLeast1ms(absl::Duration d) { return std::max(d, absl::Milliseconds(1)); }

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
  // A place in the queue opens when a worker takes a task from it: when
  // the first busy worker is done with what it runs (what is left of its
  // pass's estimate, so the hint counts down while it runs). A worker whose
  // work has no known rate does not say when.
  std::vector<double> busy;
  bool known = false;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& pass : Passes(ahead.running)) {
      double whole = 0;
      bool pass_known = false;
      for (const Executor::Running* r : pass) {
        auto it = kinds_.find(r->kind);
        if (it == kinds_.end()) continue;
        if (const std::optional<double> s = Seconds(it->second, r->compute); s.has_value()) {
          whole += *s;
          pass_known = true;
        }
      }
      if (!pass_known) continue;
      known = true;
      // Work past its estimate counts a tenth of it (it ends at some
      // unknown time: a hint of 1 ms invited clients to retry at once, over
      // and over).
      busy.push_back(
          std::max(0.1 * whole, whole - absl::ToDoubleSeconds(pass.front()->elapsed)));
    }
  }
  if (!known) return absl::Milliseconds(100);
  // Workers running work of unknown rate are left out (free at an unknown
  // time); the idle ones (none, with a full queue, but for a moment) are
  // free now.
  const int unknown = static_cast<int>(Passes(ahead.running).size() - busy.size());
  const std::vector<double> free_at = FreeTimes(std::max(1, workers_ - unknown), busy, {});
  const double seconds = *std::min_element(free_at.begin(), free_at.end());
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
  // Kinds whose rate is not known yet add nothing (the estimate never
  // invents a wait).
  const auto seconds_of = [&](const char* name, int64_t units) {
    auto it = kinds_.find(name);
    if (it == kinds_.end()) return 0.0;
    const Kind& k = it->second;
    return units > 0 && k.rate_samples >= kMinSamples && k.units_per_second > 0
               ? static_cast<double>(units) / k.units_per_second
               : 0.0;
  };
  // The wait is until a worker would be free for this request: each
  // worker's running pass counts what is left of it (its estimate less the
  // time it has run, none once past it, so the wait and the retry hint made
  // from it count down while it runs; an idle worker: nothing), the queued
  // work ahead goes to the earliest free worker in the fair-queueing order,
  // and this request to the earliest free after that. (Spreading the running
  // work over every worker made a request wait for a busy worker while
  // another was idle: an external test's 24 ms Attend was refused "about
  // 1115 ms of wait" beside an idle worker.)
  double wait_s = 0, queued_wait_s = 0;
  if (ahead != nullptr) {
    std::vector<double> queued;
    queued.reserve(ahead->queued.size());
    for (const Executor::Queued& q : ahead->queued) queued.push_back(seconds_of(q.kind, q.compute));
    // `all`: the running work the deadline and max_queue_delay see; `slow`:
    // the part the slowdown sees (this caller's, and another caller's
    // running request only when it is comparable to this one, judged by its
    // whole size; the rest as if its worker were free).
    std::vector<double> all, slow;
    for (const auto& pass : Passes(ahead->running)) {
      double whole = 0, counted = 0;
      for (const Executor::Running* r : pass) {
        const double s = seconds_of(r->kind, r->compute);
        whole += s;
        if (r->own || (own_service && s <= max_slowdown_ * *own_service)) counted += s;
      }
      const double elapsed = absl::ToDoubleSeconds(pass.front()->elapsed);
      all.push_back(std::max(0.0, whole - elapsed));
      slow.push_back(std::max(0.0, counted - elapsed));
    }
    const auto earliest = [](const std::vector<double>& free_at) {
      return *std::min_element(free_at.begin(), free_at.end());
    };
    wait_s = earliest(FreeTimes(workers_, all, queued));
    // What the slowdown holds against this request (see Admit's comment).
    queued_wait_s = earliest(FreeTimes(workers_, slow, queued));
  } else {
    // Without the executor's view all pending compute is ahead, spread over
    // the workers (which of it runs, and where, is not known).
    for (const auto& [name, k] : kinds_) wait_s += seconds_of(name.c_str(), k.pending);
    wait_s /= workers_;
    queued_wait_s = wait_s;
  }
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
      *retry_after = AtLeast1ms(refusal_retry);
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
