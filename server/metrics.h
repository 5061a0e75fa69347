// Service metrics in Prometheus text format, and the HTTP endpoint serving
// them. Thread-safe; recording is cheap (a mutex-protected map update).
#ifndef ROPEATTN_SERVER_METRICS_H_
#define ROPEATTN_SERVER_METRICS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ropeattn::server {

// All methods are thread-safe. Label values are escaped on output, so any
// string is safe to pass; the number of distinct methods (and close reasons)
// is capped (kMaxLabelValues), later ones are folded into "other" so a bug
// that records per-request names cannot grow memory or Prometheus series
// without bound.
class Metrics {
 public:
  static constexpr int kMaxLabelValues = 128;

  Metrics();
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Creates the series of `method` at zero (requests_total{code="OK"}, the
  // duration histogram and rejected_total) so the first real event is seen
  // as an increase by rate()/increase(). Call once per method at startup;
  // calling again is harmless.
  void RegisterMethod(absl::string_view method);

  // One finished RPC (or in-stream operation, method "Decode.Step" etc.):
  // ropeattn_requests_total{method,code} and the latency histogram
  // ropeattn_request_duration_seconds{method}. `grpc_code` is the numeric
  // gRPC (= absl::StatusCode) code, rendered by name ("OK",
  // "INVALID_ARGUMENT"); a number outside 0..16 counts as "UNKNOWN".
  // Negative or non-finite `seconds` are recorded as 0 (they would poison
  // _sum forever).
  void RecordRequest(absl::string_view method, int grpc_code, double seconds);
  // A request refused at once (queue full, or by admission):
  // ropeattn_rejected_total{method}.
  // Does not touch requests_total; the caller records that if it wants to.
  void RecordRejected(absl::string_view method);
  // A computed request's wait for a worker and its time on the worker:
  // ropeattn_queue_seconds{method} and ropeattn_compute_seconds{method}
  // (histograms, the same buckets as the latency one).
  void RecordQueueTime(absl::string_view method, double seconds);
  void RecordComputeTime(absl::string_view method, double seconds);
  // A request cancelled or past its deadline while it waited, so never
  // computed: ropeattn_abandoned_total{method}.
  void RecordAbandoned(absl::string_view method);
  // An answer (a unary call's, or a Decode operation's) its client did not
  // take within --answer_timeout_seconds, its call cancelled with it
  // undelivered: ropeattn_answers_timed_out_total{method}. Does not touch
  // requests_total: the caller counts the call there, under CANCELLED.
  void RecordAnswerTimedOut(absl::string_view method);
  // ropeattn_queue_depth and ropeattn_running (gauges): waiting for a
  // worker, and computing now.
  void SetQueueDepth(int64_t depth);
  // Reads the queue depth when /metrics is scraped instead (the value set
  // above is then unused): a gauge set only when requests arrive stayed at
  // its last value after the queue emptied. Must outlive every scrape.
  void SetQueueDepthSource(std::function<int64_t()> source);
  void SetRunning(int64_t running);
  // Sessions: ropeattn_sessions_open (gauge), ropeattn_sessions_opened_total,
  // ropeattn_sessions_closed_total{reason} with reason in
  // "closed" | "disconnected" | "reaped" | "shutdown" (these four are always
  // rendered, from 0).
  void SetSessionsOpen(int64_t open);
  void RecordSessionOpened();
  void RecordSessionClosed(absl::string_view reason);
  // ropeattn_kv_bytes_used and ropeattn_kv_bytes_budget (gauges).
  void SetKvBytes(int64_t used, int64_t budget);
  // ropeattn_decode_steps_total (+1) and ropeattn_decode_tokens_total
  // (+tokens; negative counts as 0 since counters never go down).
  void RecordStep(int64_t tokens);
  // One pass of the decode scheduler: ropeattn_decode_batch_size, a
  // histogram of how many sessions' steps ran together (buckets 1, 2, 4,
  // ..., 64). Sizes below 1 are ignored.
  void RecordDecodeBatch(int64_t steps);
  // Calls refused by authentication (ropeattn_auth_refused_total{reason}):
  // reason is one of kAuthRefusalReasons; others are ignored.
  static constexpr const char* kAuthRefusalReasons[] = {"invalid_token", "missing_token",
                                                        "no_identity", "identity_too_long"};
  void RecordAuthRefused(absl::string_view reason);
  // Session opens and forks refused by a per-principal quota
  // (ropeattn_quota_refused_total{quota}): "sessions" or "memory".
  void RecordQuotaRefused(absl::string_view quota);
  // The gRPC listener's connections: ropeattn_connections_accepted_total and
  // ropeattn_connections_refused_total{reason} with reason "over_cap" (the
  // connection cap) or "no_fd" (accept ran out of fds); always rendered, from
  // 0. `source` is called at each render, outside the lock, on the scraping
  // thread: it must be thread-safe and callable until replaced or until the
  // Metrics is destroyed.
  struct ConnectionCounts {
    int64_t accepted = 0;
    int64_t refused_over_cap = 0;
    int64_t refused_no_fd = 0;
  };
  void SetConnectionSource(std::function<ConnectionCounts()> source);

  // The whole registry in Prometheus text exposition format 0.0.4: every
  // family has # HELP and # TYPE, series are sorted by label values, the
  // histogram has cumulative buckets from 50 us to 10 s plus +Inf. Takes a
  // snapshot under the lock and formats outside it, so scrapes do not stall
  // recorders.
  std::string RenderPrometheus() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// A small HTTP/1.1 server (libmicrohttpd, one internal polling thread with
// non-blocking sockets, so one slow client cannot block the others):
// GET (or HEAD) /metrics -> 200 with Metrics::RenderPrometheus() as
// "text/plain; version=0.0.4; charset=utf-8"; other paths 404; other
// methods 405.
class MetricsHttpServer {
 public:
  struct Options {
    // Open connections at once; more are closed on accept. Default 32.
    unsigned int max_connections = 32;
    // Open connections from one IP address, so one client cannot take all
    // the slots. Default 8; 0 = no per-IP limit.
    unsigned int max_connections_per_ip = 8;
    // A connection idle (nothing sent or received) this long is closed.
    // Default 10 (Prometheus' default scrape timeout); must be >= 1.
    unsigned int idle_timeout_seconds = 10;
  };

  // address "host:port" where host is an IPv4 literal, a bracketed IPv6
  // literal ("[::1]:9464") or "localhost" (= 127.0.0.1; no DNS lookups);
  // port 0 picks a free one. InvalidArgument for a malformed address or
  // options, Unavailable if it cannot bind. `metrics` is not owned and must
  // outlive the server.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& address,
                                                                  const Metrics* metrics);
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& address,
                                                                  const Metrics* metrics,
                                                                  const Options& options);
  ~MetricsHttpServer();  // stops; blocks until the internal thread has exited
  // The bound port (the real one when started with port 0).
  int port() const;

 private:
  MetricsHttpServer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_METRICS_H_
