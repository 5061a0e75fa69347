#include "server/metrics.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"

namespace ropeattn::server {
namespace {

// Upper bounds (seconds, inclusive) of the latency histogram. A 1-2.5-5
// progression from 50 us (one decode step on a small cache) to 10 s (a long
// prefill); anything slower lands in +Inf and is still counted in _sum.
constexpr double kBucketBounds[] = {50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
                                    50e-3, 0.1,    0.25,   0.5,    1.0,  2.5,    5.0,  10.0};
constexpr int kNumBounds = sizeof(kBucketBounds) / sizeof(kBucketBounds[0]);
constexpr int64_t kBatchBounds[] = {1, 2, 4, 8, 16, 32, 64};
constexpr int kNumBatchBounds = sizeof(kBatchBounds) / sizeof(kBatchBounds[0]);

// Numbering as in grpc::StatusCode and absl::StatusCode (identical); kept
// here so the metrics library does not link gRPC.
constexpr const char* kCodeNames[] = {
    "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
    "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
    "DATA_LOSS", "UNAUTHENTICATED"};
constexpr int kNumCodes = sizeof(kCodeNames) / sizeof(kCodeNames[0]);
static_assert(kNumCodes == 17, "gRPC has codes 0..16");
constexpr int kUnknownCode = 2;

constexpr const char* kCloseReasons[] = {"closed", "disconnected", "stream_ended", "reaped",
                                         "shutdown"};
constexpr absl::string_view kOverflowLabel = "other";

struct Histogram {
  // Per-bucket (not cumulative) counts; the last entry is (10 s, +Inf).
  std::array<uint64_t, kNumBounds + 1> buckets{};
  double sum_seconds = 0;
  uint64_t count = 0;

  void Add(double seconds) {
    if (!std::isfinite(seconds) || seconds < 0) seconds = 0;
    // lower_bound finds the first bound >= seconds: le is inclusive, so
    // exactly 1 ms belongs in le="0.001".
    const int bucket = static_cast<int>(
        std::lower_bound(kBucketBounds, kBucketBounds + kNumBounds, seconds) - kBucketBounds);
    ++buckets[bucket];
    sum_seconds += seconds;
    ++count;
  }
};

struct MethodStats {
  std::array<uint64_t, kNumCodes> by_code{};
  Histogram latency;  // whole request
  Histogram queue;    // waiting for a compute worker
  Histogram compute;  // on the worker
  uint64_t rejected = 0;
  uint64_t abandoned = 0;
  uint64_t answers_timed_out = 0;
};

// Everything Metrics records; copied whole for a render so formatting runs
// outside the lock.
struct Data {
  absl::flat_hash_map<std::string, MethodStats> methods;
  absl::flat_hash_map<std::string, uint64_t> closed_by_reason;
  int64_t queue_depth = 0;
  int64_t running = 0;
  int64_t sessions_open = 0;
  int64_t kv_bytes_used = 0;
  int64_t kv_bytes_budget = 0;
  uint64_t sessions_opened = 0;
  uint64_t decode_steps = 0;
  uint64_t decode_tokens = 0;
  // Decode batch sizes: per-bucket counts for le 1, 2, 4, ..., 64, +Inf.
  std::array<uint64_t, kNumBatchBounds + 1> batch_buckets{};
  uint64_t batch_sum = 0;
  uint64_t batch_count = 0;
  std::array<uint64_t, std::size(Metrics::kAuthRefusalReasons)> auth_refused{};  // as those
  std::array<uint64_t, 2> quota_refused{};  // as kQuotas
};

constexpr const char* kQuotas[] = {"memory", "sessions"};

// Finds or creates the entry for `key`, folding new keys into "other" once
// the map is full so label cardinality stays bounded.
template <typename V>
V& BoundedEntry(absl::flat_hash_map<std::string, V>& map, absl::string_view key) {
  auto it = map.find(key);
  if (it != map.end()) return it->second;
  if (map.size() >= static_cast<size_t>(Metrics::kMaxLabelValues)) key = kOverflowLabel;
  return map.try_emplace(std::string(key)).first->second;
}

// Shortest text that parses back to the same double, laid out like Go's
// strconv.FormatFloat(v, 'g', -1, 64) as the official Prometheus clients
// write it ("5e-05", "0.0001", "2.5", "10"): le values are matched as
// strings, so ours should agree with what dashboards already use. The
// exposition format spells the special values +Inf, -Inf and NaN.
std::string FormatDouble(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  const std::to_chars_result sci_result =
      std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  if (sci_result.ec != std::errc()) return absl::StrCat(v);
  const std::string sci(buf, sci_result.ptr);
  int exponent = 0;
  const size_t e = sci.find('e');
  if (e == std::string::npos ||
      !absl::SimpleAtoi(absl::string_view(sci).substr(e + 1), &exponent)) {
    return sci;
  }
  // Go switches to exponent form below 1e-4 and from 1e21 (its shortest
  // 'g' uses precision 21 for the large side).
  if (exponent < -4 || exponent >= 21) return sci;
  const std::to_chars_result fixed =
      std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::fixed);
  if (fixed.ec != std::errc()) return sci;
  return std::string(buf, fixed.ptr);
}

// Label values may hold any UTF-8; the format requires exactly these three
// escapes inside the quotes.
std::string EscapeLabelValue(absl::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '"':
        out += "\\\"";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        out += c;
    }
  }
  return out;
}

void AppendFamilyHeader(std::string* out, absl::string_view name, absl::string_view help,
                        absl::string_view type) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

template <typename V>
std::vector<std::string> SortedKeys(const absl::flat_hash_map<std::string, V>& map) {
  std::vector<std::string> keys;
  keys.reserve(map.size());
  for (const auto& [key, value] : map) keys.push_back(key);
  std::sort(keys.begin(), keys.end());
  return keys;
}

}  // namespace

struct Metrics::State {
  mutable absl::Mutex mu;
  Data data ABSL_GUARDED_BY(mu);
  std::function<ConnectionCounts()> connections ABSL_GUARDED_BY(mu);
  std::function<int64_t()> queue_depth ABSL_GUARDED_BY(mu);
};

Metrics::Metrics() : state_(std::make_unique<State>()) {
  absl::MutexLock lock(&state_->mu);
  for (const char* reason : kCloseReasons) state_->data.closed_by_reason[reason] = 0;
}

Metrics::~Metrics() = default;

void Metrics::RegisterMethod(absl::string_view method) {
  absl::MutexLock lock(&state_->mu);
  BoundedEntry(state_->data.methods, method);
}

void Metrics::RecordRequest(absl::string_view method, int grpc_code, double seconds) {
  if (grpc_code < 0 || grpc_code >= kNumCodes) grpc_code = kUnknownCode;
  absl::MutexLock lock(&state_->mu);
  MethodStats& stats = BoundedEntry(state_->data.methods, method);
  ++stats.by_code[grpc_code];
  stats.latency.Add(seconds);
}

void Metrics::RecordQueueTime(absl::string_view method, double seconds) {
  absl::MutexLock lock(&state_->mu);
  BoundedEntry(state_->data.methods, method).queue.Add(seconds);
}

void Metrics::RecordComputeTime(absl::string_view method, double seconds) {
  absl::MutexLock lock(&state_->mu);
  BoundedEntry(state_->data.methods, method).compute.Add(seconds);
}

void Metrics::RecordAbandoned(absl::string_view method) {
  absl::MutexLock lock(&state_->mu);
  ++BoundedEntry(state_->data.methods, method).abandoned;
}

void Metrics::RecordAnswerTimedOut(absl::string_view method) {
  absl::MutexLock lock(&state_->mu);
  ++BoundedEntry(state_->data.methods, method).answers_timed_out;
}

void Metrics::SetRunning(int64_t running) {
  absl::MutexLock lock(&state_->mu);
  state_->data.running = running;
}

void Metrics::RecordRejected(absl::string_view method) {
  absl::MutexLock lock(&state_->mu);
  ++BoundedEntry(state_->data.methods, method).rejected;
}

void Metrics::RecordAuthRefused(absl::string_view reason) {
  absl::MutexLock lock(&state_->mu);
  for (size_t i = 0; i < state_->data.auth_refused.size(); ++i) {
    if (reason == kAuthRefusalReasons[i]) ++state_->data.auth_refused[i];
  }
}

void Metrics::RecordQuotaRefused(absl::string_view quota) {
  absl::MutexLock lock(&state_->mu);
  for (size_t i = 0; i < state_->data.quota_refused.size(); ++i) {
    if (quota == kQuotas[i]) ++state_->data.quota_refused[i];
  }
}

void Metrics::SetConnectionSource(std::function<ConnectionCounts()> source) {
  absl::MutexLock lock(&state_->mu);
  state_->connections = std::move(source);
}

void Metrics::SetQueueDepthSource(std::function<int64_t()> source) {
  absl::MutexLock lock(&state_->mu);
  state_->queue_depth = std::move(source);
}

void Metrics::SetQueueDepth(int64_t depth) {
  absl::MutexLock lock(&state_->mu);
  state_->data.queue_depth = depth;
}

void Metrics::SetSessionsOpen(int64_t open) {
  absl::MutexLock lock(&state_->mu);
  state_->data.sessions_open = open;
}

void Metrics::RecordSessionOpened() {
  absl::MutexLock lock(&state_->mu);
  ++state_->data.sessions_opened;
}

void Metrics::RecordSessionClosed(absl::string_view reason) {
  absl::MutexLock lock(&state_->mu);
  ++BoundedEntry(state_->data.closed_by_reason, reason);
}

void Metrics::SetKvBytes(int64_t used, int64_t budget) {
  absl::MutexLock lock(&state_->mu);
  state_->data.kv_bytes_used = used;
  state_->data.kv_bytes_budget = budget;
}

void Metrics::RecordDecodeBatch(int64_t steps) {
  if (steps < 1) return;
  absl::MutexLock lock(&state_->mu);
  Data& d = state_->data;
  int b = 0;
  while (b < kNumBatchBounds && steps > kBatchBounds[b]) ++b;
  ++d.batch_buckets[b];
  d.batch_sum += static_cast<uint64_t>(steps);
  ++d.batch_count;
}

void Metrics::RecordStep(int64_t tokens) {
  absl::MutexLock lock(&state_->mu);
  ++state_->data.decode_steps;
  state_->data.decode_tokens += static_cast<uint64_t>(std::max<int64_t>(tokens, 0));
}

std::string Metrics::RenderPrometheus() const {
  Data d;
  std::function<ConnectionCounts()> connections;
  std::function<int64_t()> queue_depth;
  {
    absl::ReaderMutexLock lock(&state_->mu);
    d = state_->data;
    connections = state_->connections;
    queue_depth = state_->queue_depth;
  }
  if (queue_depth) d.queue_depth = queue_depth();
  const ConnectionCounts conn = connections ? connections() : ConnectionCounts();
  const std::vector<std::string> methods = SortedKeys(d.methods);
  std::vector<std::string> escaped;
  escaped.reserve(methods.size());
  for (const std::string& m : methods) escaped.push_back(EscapeLabelValue(m));
  // le values are formatted once: Prometheus matches them as strings, so
  // they must be spelled identically on every scrape.
  std::array<std::string, kNumBounds> le;
  for (int i = 0; i < kNumBounds; ++i) le[i] = FormatDouble(kBucketBounds[i]);

  std::string out;
  out.reserve(1024 + methods.size() * 2048);

  AppendFamilyHeader(&out, "ropeattn_requests_total",
                     "Finished requests (RPCs and in-stream operations) by method and gRPC "
                     "status code.",
                     "counter");
  for (size_t i = 0; i < methods.size(); ++i) {
    const MethodStats& s = d.methods[methods[i]];
    for (int code = 0; code < kNumCodes; ++code) {
      // OK is always shown so every known method has a series from 0; the
      // error codes appear once they happen, which keeps series few.
      if (code != 0 && s.by_code[code] == 0) continue;
      absl::StrAppend(&out, "ropeattn_requests_total{method=\"", escaped[i], "\",code=\"",
                      kCodeNames[code], "\"} ", s.by_code[code], "\n");
    }
  }

  // One histogram family per method, cumulative buckets as the format wants.
  const auto append_histogram = [&](absl::string_view family, absl::string_view help,
                                    Histogram MethodStats::*which) {
    AppendFamilyHeader(&out, family, help, "histogram");
    for (size_t i = 0; i < methods.size(); ++i) {
      const Histogram& h = d.methods[methods[i]].*which;
      uint64_t cumulative = 0;
      for (int b = 0; b < kNumBounds; ++b) {
        cumulative += h.buckets[b];
        absl::StrAppend(&out, family, "_bucket{method=\"", escaped[i], "\",le=\"", le[b], "\"} ",
                        cumulative, "\n");
      }
      absl::StrAppend(&out, family, "_bucket{method=\"", escaped[i], "\",le=\"+Inf\"} ", h.count,
                      "\n");
      absl::StrAppend(&out, family, "_sum{method=\"", escaped[i], "\"} ",
                      FormatDouble(h.sum_seconds), "\n");
      absl::StrAppend(&out, family, "_count{method=\"", escaped[i], "\"} ", h.count, "\n");
    }
  };
  append_histogram("ropeattn_request_duration_seconds", "Request latency in seconds, by method.",
                   &MethodStats::latency);
  append_histogram("ropeattn_queue_seconds",
                   "Time requests waited for a compute worker, in seconds, by method (computed "
                   "requests and those abandoned while queued).",
                   &MethodStats::queue);
  append_histogram("ropeattn_compute_seconds",
                   "Time requests ran on a compute worker, in seconds, by method.",
                   &MethodStats::compute);

  AppendFamilyHeader(&out, "ropeattn_rejected_total",
                     "Requests refused at once (shed): the compute queue was full, or admission found they "
                     "could not finish inside their deadline or would wait past "
                     "--max_queue_delay_seconds; by method.",
                     "counter");
  for (size_t i = 0; i < methods.size(); ++i) {
    absl::StrAppend(&out, "ropeattn_rejected_total{method=\"", escaped[i], "\"} ",
                    d.methods[methods[i]].rejected, "\n");
  }

  AppendFamilyHeader(&out, "ropeattn_abandoned_total",
                     "Requests cancelled by their caller or past their deadline while queued: "
                     "never computed, by method.",
                     "counter");
  for (size_t i = 0; i < methods.size(); ++i) {
    absl::StrAppend(&out, "ropeattn_abandoned_total{method=\"", escaped[i], "\"} ",
                    d.methods[methods[i]].abandoned, "\n");
  }

  AppendFamilyHeader(&out, "ropeattn_answers_timed_out_total",
                     "Answers their client did not take within --answer_timeout_seconds: the "
                     "call was cancelled with the answer undelivered (counted CANCELLED in "
                     "ropeattn_requests_total); by method.",
                     "counter");
  for (size_t i = 0; i < methods.size(); ++i) {
    absl::StrAppend(&out, "ropeattn_answers_timed_out_total{method=\"", escaped[i], "\"} ",
                    d.methods[methods[i]].answers_timed_out, "\n");
  }

  AppendFamilyHeader(&out, "ropeattn_queue_depth", "Requests waiting for a compute worker.",
                     "gauge");
  absl::StrAppend(&out, "ropeattn_queue_depth ", d.queue_depth, "\n");

  AppendFamilyHeader(&out, "ropeattn_running", "Requests computing on a worker now.", "gauge");
  absl::StrAppend(&out, "ropeattn_running ", d.running, "\n");

  AppendFamilyHeader(&out, "ropeattn_sessions_open", "Sessions currently open.", "gauge");
  absl::StrAppend(&out, "ropeattn_sessions_open ", d.sessions_open, "\n");

  AppendFamilyHeader(&out, "ropeattn_sessions_opened_total", "Sessions opened since start.",
                     "counter");
  absl::StrAppend(&out, "ropeattn_sessions_opened_total ", d.sessions_opened, "\n");

  AppendFamilyHeader(&out, "ropeattn_sessions_closed_total",
                     "Sessions closed since start, by reason (closed, disconnected, stream_ended, "
                     "reaped, shutdown).",
                     "counter");
  for (const std::string& reason : SortedKeys(d.closed_by_reason)) {
    absl::StrAppend(&out, "ropeattn_sessions_closed_total{reason=\"", EscapeLabelValue(reason),
                    "\"} ", d.closed_by_reason[reason], "\n");
  }

  AppendFamilyHeader(&out, "ropeattn_kv_bytes_used",
                     "Bytes of KV cache (or linear attention state) held by open sessions.",
                     "gauge");
  absl::StrAppend(&out, "ropeattn_kv_bytes_used ", d.kv_bytes_used, "\n");

  AppendFamilyHeader(&out, "ropeattn_kv_bytes_budget",
                     "The memory budget: bytes session state (KV caches, linear states) and "
                     "in-flight requests' buffers may hold together.",
                     "gauge");
  absl::StrAppend(&out, "ropeattn_kv_bytes_budget ", d.kv_bytes_budget, "\n");

  AppendFamilyHeader(&out, "ropeattn_decode_steps_total", "Decode steps run.", "counter");
  absl::StrAppend(&out, "ropeattn_decode_steps_total ", d.decode_steps, "\n");

  AppendFamilyHeader(&out, "ropeattn_decode_tokens_total", "Tokens processed by decode steps.",
                     "counter");
  absl::StrAppend(&out, "ropeattn_decode_tokens_total ", d.decode_tokens, "\n");

  AppendFamilyHeader(&out, "ropeattn_decode_batch_size",
                     "Decode steps (of different sessions) computed together in one pass.",
                     "histogram");
  {
    uint64_t cumulative = 0;
    for (int b = 0; b < kNumBatchBounds; ++b) {
      cumulative += d.batch_buckets[b];
      absl::StrAppend(&out, "ropeattn_decode_batch_size_bucket{le=\"", kBatchBounds[b], "\"} ",
                      cumulative, "\n");
    }
    absl::StrAppend(&out, "ropeattn_decode_batch_size_bucket{le=\"+Inf\"} ", d.batch_count, "\n");
    absl::StrAppend(&out, "ropeattn_decode_batch_size_sum ", d.batch_sum, "\n");
    absl::StrAppend(&out, "ropeattn_decode_batch_size_count ", d.batch_count, "\n");
  }

  AppendFamilyHeader(&out, "ropeattn_connections_accepted_total",
                     "gRPC connections accepted and handed to gRPC since start.", "counter");
  absl::StrAppend(&out, "ropeattn_connections_accepted_total ", conn.accepted, "\n");

  AppendFamilyHeader(&out, "ropeattn_connections_refused_total",
                     "gRPC connections closed at accept, by reason (over_cap: the connection "
                     "cap; no_fd: accept ran out of file descriptors).",
                     "counter");
  absl::StrAppend(&out, "ropeattn_connections_refused_total{reason=\"no_fd\"} ", conn.refused_no_fd,
                  "\n");
  absl::StrAppend(&out, "ropeattn_connections_refused_total{reason=\"over_cap\"} ",
                  conn.refused_over_cap, "\n");

  AppendFamilyHeader(&out, "ropeattn_auth_refused_total",
                     "Calls refused UNAUTHENTICATED, by reason (missing_token, invalid_token, "
                     "no_identity: a client certificate without a URI (with a scheme) or DNS name, or whose "
                     "DNS name is not a host name, identity_too_long: one "
                     "whose name has more than 2048 characters).",
                     "counter");
  for (size_t i = 0; i < d.auth_refused.size(); ++i) {
    absl::StrAppend(&out, "ropeattn_auth_refused_total{reason=\"", kAuthRefusalReasons[i], "\"} ",
                    d.auth_refused[i], "\n");
  }
  AppendFamilyHeader(&out, "ropeattn_quota_refused_total",
                     "Session opens and forks refused by a per-principal quota, by quota.",
                     "counter");
  for (size_t i = 0; i < d.quota_refused.size(); ++i) {
    absl::StrAppend(&out, "ropeattn_quota_refused_total{quota=\"", kQuotas[i], "\"} ",
                    d.quota_refused[i], "\n");
  }
  return out;
}

// ---------------------------------------------------------------------------
// MetricsHttpServer

namespace {

constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

struct ListenAddress {
  bool ipv6 = false;
  sockaddr_in v4{};
  sockaddr_in6 v6{};
};

absl::StatusOr<ListenAddress> ParseListenAddress(const std::string& address) {
  absl::string_view host;
  absl::string_view port_text;
  const absl::string_view text = address;
  if (absl::StartsWith(text, "[")) {
    const size_t close = text.find(']');
    if (close == absl::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics address must be \"[ipv6]:port\" when it starts with '[', got \"",
                       address, "\""));
    }
    host = text.substr(1, close - 1);
    port_text = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics address must be \"host:port\", got \"", address, "\""));
    }
    host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
  }
  // SimpleAtoi alone would accept "+80" and surrounding spaces.
  uint32_t port = 0;
  if (port_text.empty() || port_text.size() > 5 ||
      !std::all_of(port_text.begin(), port_text.end(),
                   [](char c) { return absl::ascii_isdigit(c); }) ||
      !absl::SimpleAtoi(port_text, &port) || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address port must be a number in 0..65535, got \"", port_text,
                     "\" in \"", address, "\""));
  }

  ListenAddress out;
  const std::string host_str(host);
  if (absl::StartsWith(text, "[")) {
    out.ipv6 = true;
    out.v6.sin6_family = AF_INET6;
    out.v6.sin6_port = htons(static_cast<uint16_t>(port));
    if (inet_pton(AF_INET6, host_str.c_str(), &out.v6.sin6_addr) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics address host is not an IPv6 literal: \"", host, "\""));
    }
    return out;
  }
  out.v4.sin_family = AF_INET;
  out.v4.sin_port = htons(static_cast<uint16_t>(port));
  // "localhost" is the one name accepted: resolving others would make
  // startup depend on DNS.
  const std::string literal = host_str == "localhost" ? "127.0.0.1" : host_str;
  if (inet_pton(AF_INET, literal.c_str(), &out.v4.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics address host must be an IPv4 literal, [IPv6] or localhost, got \"", host, "\""));
  }
  return out;
}

}  // namespace

struct MetricsHttpServer::Impl {
  const Metrics* metrics = nullptr;
  MHD_Daemon* daemon = nullptr;
  int port = 0;

  // Messages libmicrohttpd logs while starting, for the error status. Later
  // messages (mostly about misbehaving clients) are dropped so a client
  // cannot flood the server's log.
  absl::Mutex log_mu;
  bool capturing ABSL_GUARDED_BY(log_mu) = true;
  std::string start_log ABSL_GUARDED_BY(log_mu);

  static void Log(void* cls, const char* fmt, va_list ap) {
    auto* impl = static_cast<Impl*>(cls);
    char buf[512];
    std::vsnprintf(buf, sizeof(buf), fmt, ap);
    absl::MutexLock lock(&impl->log_mu);
    if (!impl->capturing) return;
    if (!impl->start_log.empty()) impl->start_log += "; ";
    impl->start_log += std::string(absl::StripTrailingAsciiWhitespace(buf));
  }

  static MHD_Result Respond(MHD_Connection* connection, unsigned int status,
                            const std::string& body, const char* content_type, const char* allow) {
    // MUST_COPY: body is a temporary; a scrape is small, the copy is cheap.
    MHD_Response* response = MHD_create_response_from_buffer(
        body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
    if (response == nullptr) return MHD_NO;
    MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    if (allow != nullptr) MHD_add_response_header(response, MHD_HTTP_HEADER_ALLOW, allow);
    const MHD_Result result = MHD_queue_response(connection, status, response);
    MHD_destroy_response(response);
    return result;
  }

  static bool HasBody(MHD_Connection* connection) {
    const char* length =
        MHD_lookup_connection_value(connection, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    return (length != nullptr && absl::string_view(length) != "0") ||
           MHD_lookup_connection_value(connection, MHD_HEADER_KIND,
                                       MHD_HTTP_HEADER_TRANSFER_ENCODING) != nullptr;
  }

  // Called first when the headers are in, again when the request is
  // complete. A body-less GET/HEAD is answered on the second call: an answer
  // before the request is complete makes libmicrohttpd close the connection,
  // and Prometheus reuses its connection between scrapes. Everything else is
  // answered on the first call, precisely so that its body is never read
  // (it is discarded with the connection) and an upload cannot occupy us.
  static MHD_Result Handle(void* cls, MHD_Connection* connection, const char* url,
                           const char* method, const char* version, const char* upload_data,
                           size_t* upload_data_size, void** request_state) {
    auto* impl = static_cast<Impl*>(cls);
    const absl::string_view m = method;
    const bool get = m == MHD_HTTP_METHOD_GET || m == MHD_HTTP_METHOD_HEAD;
    if (*request_state == nullptr && get && !HasBody(connection)) {
      *request_state = impl;  // any non-null marker: "headers seen"
      return MHD_YES;
    }
    if (!get) {
      return Respond(connection, MHD_HTTP_METHOD_NOT_ALLOWED, "method not allowed\n",
                     "text/plain; charset=utf-8", "GET, HEAD");
    }
    if (absl::string_view(url) != "/metrics") {
      return Respond(connection, MHD_HTTP_NOT_FOUND, "not found; try /metrics\n",
                     "text/plain; charset=utf-8", nullptr);
    }
    return Respond(connection, MHD_HTTP_OK, impl->metrics->RenderPrometheus(), kContentType,
                   nullptr);
  }
};

MetricsHttpServer::MetricsHttpServer() = default;

MetricsHttpServer::~MetricsHttpServer() {
  // Joins the polling thread, so no handler runs after this returns.
  if (impl_ != nullptr && impl_->daemon != nullptr) MHD_stop_daemon(impl_->daemon);
}

int MetricsHttpServer::port() const { return impl_->port; }

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, const Metrics* metrics) {
  return Start(address, metrics, Options());
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, const Metrics* metrics, const Options& options) {
  if (metrics == nullptr) return absl::InvalidArgumentError("metrics must not be null");
  if (options.max_connections < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_connections must be >= 1, got ", options.max_connections));
  }
  // 0 would mean "never time out" to libmicrohttpd: exactly what lets a
  // slow client hold a slot forever.
  if (options.idle_timeout_seconds < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("idle_timeout_seconds must be >= 1, got ", options.idle_timeout_seconds));
  }
  absl::StatusOr<ListenAddress> listen = ParseListenAddress(address);
  if (!listen.ok()) return listen.status();

  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->impl_ = std::make_unique<Impl>();
  Impl* impl = server->impl_.get();
  impl->metrics = metrics;

  // One internal thread polling non-blocking sockets (epoll where
  // available): a scrape is a few microseconds of work, and a stalled client
  // only occupies a connection slot, never the thread.
  unsigned int flags = MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_ERROR_LOG;
  const sockaddr* sockaddr_ptr = reinterpret_cast<const sockaddr*>(&listen->v4);
  if (listen->ipv6) {
    flags |= MHD_USE_IPv6;
    sockaddr_ptr = reinterpret_cast<const sockaddr*>(&listen->v6);
  }
  // Variadic options: every value must have exactly the type
  // libmicrohttpd reads with va_arg.
  impl->daemon = MHD_start_daemon(
      flags, /*port=*/0, /*apc=*/nullptr, /*apc_cls=*/nullptr, &Impl::Handle, impl,
      // The logger goes first: options parsed before it log to stderr.
      MHD_OPTION_EXTERNAL_LOGGER, static_cast<MHD_LogCallback>(&Impl::Log),
      static_cast<void*>(impl), MHD_OPTION_SOCK_ADDR, sockaddr_ptr, MHD_OPTION_CONNECTION_LIMIT,
      static_cast<unsigned int>(options.max_connections), MHD_OPTION_PER_IP_CONNECTION_LIMIT,
      static_cast<unsigned int>(options.max_connections_per_ip), MHD_OPTION_CONNECTION_TIMEOUT,
      static_cast<unsigned int>(options.idle_timeout_seconds), MHD_OPTION_END);
  std::string start_log;
  {
    absl::MutexLock lock(&impl->log_mu);
    impl->capturing = false;
    start_log = std::move(impl->start_log);
  }
  if (impl->daemon == nullptr) {
    // libmicrohttpd names the port it was given (0: the address carries
    // the real one).
    return absl::UnavailableError(absl::StrCat(
        "cannot serve metrics on ", address, ": ",
        start_log.empty() ? "bind failed"
                          : absl::StrReplaceAll(start_log, {{"Failed to bind to port 0: ",
                                                             "cannot bind: "}})));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(impl->daemon, MHD_DAEMON_INFO_BIND_PORT);
  if (info == nullptr || info->port == 0) {
    return absl::InternalError(
        absl::StrCat("metrics server on ", address, " started but reports no bound port"));
  }
  impl->port = info->port;
  return server;
}

}  // namespace ropeattn::server
