// Reading a ropeattn server's Prometheus endpoint from the load generator:
// a plain HTTP/1.0 GET over a socket (no TLS, no redirects, no chunked
// bodies: what the server's /metrics endpoint speaks), a parser of the text
// exposition format, and the growth of a histogram between two scrapes.
#ifndef ROPEATTN_CLIENT_METRICS_SCRAPE_H_
#define ROPEATTN_CLIENT_METRICS_SCRAPE_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace ropeattn::client {

// GET `url` ("http://host:port/path"; the path defaults to /metrics) and
// return the body of a 200 answer. InvalidArgument for a URL that is not
// http://host:port[/path]; Unavailable for a connection or read failure (or
// `timeout` passing); FailedPrecondition naming the status line otherwise.
absl::StatusOr<std::string> HttpGet(absl::string_view url, absl::Duration timeout);

struct MetricSample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// Every sample of a text exposition (comments skipped). InvalidArgument,
// naming the line, for a sample line that does not parse.
absl::StatusOr<std::vector<MetricSample>> ParsePrometheusText(absl::string_view text);

// How a histogram family (e.g. ropeattn_queue_seconds) grew for one label
// value (method="Attend") between two scrapes.
struct HistogramGrowth {
  double count = 0;        // observations added
  double sum = 0;          // their sum (seconds)
  double mean_ms = 0;      // sum / count, in ms (0 when count is 0)
  // Approximate quantiles in ms from the bucket counts, interpolated linearly
  // inside the bucket as Prometheus's histogram_quantile does (a quantile in
  // the +Inf bucket is the highest finite bound). 0 when count is 0.
  double p50_ms = 0;
  double p99_ms = 0;
};
HistogramGrowth GrowthOf(const std::vector<MetricSample>& before,
                         const std::vector<MetricSample>& after, absl::string_view family,
                         absl::string_view label, absl::string_view value);

// The quantile q (0..1) of cumulative buckets (upper bound -> cumulative
// count, +Inf as infinity), as above; in the bounds' unit.
double BucketQuantile(const std::map<double, double>& cumulative, double q);

}  // namespace ropeattn::client

#endif  // ROPEATTN_CLIENT_METRICS_SCRAPE_H_
