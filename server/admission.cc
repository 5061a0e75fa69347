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

Admission::Admission(int workers, absl::Duration max_queue_delay)
    : workers_(std::max(1, workers)), max_queue_delay_(max_queue_delay) {}

std::optional<double> Admission::ServiceSeconds(int64_t compute) const {
  absl::MutexLock lock(&mu_);
  if (rate_samples_ < kMinSamples || units_per_second_ <= 0) return std::nullopt;
  return overhead_seconds_ + static_cast<double>(std::max<int64_t>(0, compute)) / units_per_second_;
}

int64_t Admission::pending_compute() const {
  absl::MutexLock lock(&mu_);
  return pending_;
}

absl::Status Admission::Admit(const char* method, int64_t compute, absl::Time deadline,
                              absl::Time now, absl::Duration* retry_after) {
  compute = std::max<int64_t>(0, compute);
  absl::MutexLock lock(&mu_);
  if (rate_samples_ >= kMinSamples && units_per_second_ > 0) {
    // The work ahead spreads over every worker; this request then runs on one.
    const double wait_s = static_cast<double>(pending_) / units_per_second_ / workers_;
    const double service_s = overhead_seconds_ + static_cast<double>(compute) / units_per_second_;
    const absl::Duration wait = absl::Seconds(wait_s);
    const absl::Duration service = absl::Seconds(service_s);
    if (deadline != absl::InfiniteFuture() && now + wait + service > deadline) {
      // If the request alone outlasts its deadline, waiting will not help.
      *retry_after = now + service > deadline ? absl::ZeroDuration() : wait;
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%s cannot finish inside its deadline (%.0f ms left): about %.0f ms of wait for a "
          "worker and %.0f ms of compute at this server's measured rate; %s",
          method, absl::ToDoubleMilliseconds(deadline - now), wait_s * 1e3, service_s * 1e3,
          now + service > deadline ? "give it a longer deadline"
                                   : "retry later or give it a longer deadline"));
    }
    if (max_queue_delay_ > absl::ZeroDuration() && wait > max_queue_delay_) {
      *retry_after = wait - max_queue_delay_;
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%s: the estimated wait for a compute worker is %.0f ms, past "
          "--max_queue_delay_seconds (%.0f ms); retry after about %.0f ms",
          method, wait_s * 1e3, absl::ToDoubleMilliseconds(max_queue_delay_),
          absl::ToDoubleMilliseconds(*retry_after)));
    }
  }
  pending_ += compute;
  return absl::OkStatus();
}

void Admission::Finished(int64_t compute, double seconds) {
  compute = std::max<int64_t>(0, compute);
  absl::MutexLock lock(&mu_);
  pending_ = std::max<int64_t>(0, pending_ - compute);
  if (!(seconds >= 0) || !std::isfinite(seconds)) return;  // never ran
  if (seconds < kRateMinSeconds) {
    overhead_seconds_ = overhead_seconds_ == 0 ? seconds
                                               : (1 - kAlpha) * overhead_seconds_ + kAlpha * seconds;
    return;
  }
  if (compute == 0) return;
  const double rate = static_cast<double>(compute) / seconds;
  units_per_second_ = rate_samples_ == 0 ? rate : (1 - kAlpha) * units_per_second_ + kAlpha * rate;
  ++rate_samples_;
}

}  // namespace ropeattn::server
