// A load generator for ropeattn (the library behind `ropeattn bench`), in the
// spirit of Triton's perf_analyzer.
//
// Workloads: unary Attend with a fixed shape, or Decode sessions (open, prefill
// a context, then a number of steps with an optional think time, close).
// Modes:
// - closed loop: C workers each issue requests back to back (sweep over C);
// - open loop: requests arrive on a schedule at rate R, constant or Poisson
//   (sweep over R), and the latency of each is measured from its INTENDED
//   send time. A server that stalls cannot hide its queueing behind a client
//   that stops sending (coordinated omission, perf_analyzer #3113): requests
//   that could not be sent on time (every worker busy) still count from their
//   scheduled time and are counted as `late`.
// Each sweep point runs a warm-up, then measurement windows until the last
// three windows' throughputs are within `stability` of their mean (or
// `max_windows` is reached: the point is then reported as not stable).
// Percentiles, mean and max come from every successful request that completed
// in those last windows (never averages of per-window percentiles).
//
// Layer mode (LoadSpec::model) runs the same workloads on a served model's
// attention layer, with hidden states as the inputs.
//
// What a "request" is:
// - attend: one Attend call; tokens are batch * q_len query tokens.
// - decode: one decode step (tokens_per_step tokens). Opening the session and
//   prefilling its context are part of the session's FIRST step (kind
//   "prefill"): its latency runs from the session's start (its scheduled
//   arrival in open loop), so it is a time to first token. A failed open or
//   prefill counts as one failed request of kind "prefill". The other steps
//   are kind "step"; PointResult reports the two kinds' latencies apart too.
//   In open loop, sessions arrive at rate / steps_per_session per second so
//   that the offered step rate is `rate`.
// - decode steps within a session: back to back (each sent when the previous
//   one answered, after think_time), or, with DecodeShape::step_rate > 0, on
//   the session's own schedule: step i is due at start + i / step_rate and
//   its latency runs from that time (a step due before the previous one
//   answered is sent at once and counted as late), in open and closed loop.
//
// Connections: every request and session goes through the Clients passed in
// (the load generator opens no channel of its own), round robin: each Attend
// takes the next Client, each session the next Client for its whole life.
// ConnectClients makes N Clients with N distinct TCP connections. Their
// ClientOptions apply to all requests with the same meaning: target(s), TLS
// (tls_ca_file, tls_cert_file, tls_key_file) and the bearer token. A server
// that refuses the token shows in ProbeWorkload as UNAUTHENTICATED, before
// any measurement.
//
// Server-side times: with LoadSpec::metrics_url, the server's Prometheus
// endpoint is scraped when the measurement starts and after every window;
// each point reports how ropeattn_queue_seconds and ropeattn_compute_seconds
// grew over its final windows (the ones its client-side numbers come from),
// per method.
//
// Thread-safety: RunLoad, RunPoint and SearchLoad block the calling thread and
// run their own worker threads; the Clients are shared by them (a Client is
// thread-safe).
#ifndef ROPEATTN_CLIENT_LOADGEN_H_
#define ROPEATTN_CLIENT_LOADGEN_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/client.h"

namespace ropeattn::client {

enum class Workload { kAttend, kDecode };
enum class LoadMode { kClosed, kConstant, kPoisson };

const char* WorkloadName(Workload workload);  // "attend", "decode"
const char* LoadModeName(LoadMode mode);      // "closed", "constant", "poisson"
// Parses the names above; InvalidArgument naming the value otherwise.
absl::StatusOr<Workload> ParseWorkload(absl::string_view name);
absl::StatusOr<LoadMode> ParseLoadMode(absl::string_view name);

// The shape of each Attend request: q [batch, q_len, heads, head_dim],
// k and v [batch, k_len, kv_heads, head_dim], RoPE with `rope_type`.
struct AttendShape {
  int64_t batch = 1;                // >= 1
  int64_t heads = 8;                // >= 1
  int64_t kv_heads = 0;             // 0 means heads; heads must be a multiple
  int64_t head_dim = 64;            // >= 2, even
  int64_t q_len = 1;                // >= 1
  int64_t k_len = 512;              // >= q_len
  v1::DType dtype = v1::DTYPE_F32;  // of q, k and v
  bool causal = true;
  // A Hugging Face rope_type, or "none" (the default, as in the API: an
  // AttentionSpec without rope has no positional scheme).
  std::string rope_type = "none";
  // For scaled rules: 0 means 2; and the trained length L0, 0 means k_len / 2
  // (so that length-dependent rules do scale).
  double rope_factor = 0;
  int64_t original_max_positions = 0;
};

// Each Decode session: open (kv_dtype), prefill `context` tokens in one step,
// then `steps_per_session` steps of `tokens_per_step` tokens, `think_time`
// apart, then close. max_context is context + steps * tokens_per_step.
struct DecodeShape {
  int64_t heads = 8;                                 // >= 1
  int64_t kv_heads = 0;                              // 0 means heads
  int64_t head_dim = 64;                             // >= 2, even
  int64_t steps_per_session = 32;                    // >= 1
  int64_t context = 128;                             // >= 0 prefilled tokens
  int64_t tokens_per_step = 1;                       // >= 1
  absl::Duration think_time = absl::ZeroDuration();  // >= 0
  // Steps per second of each session (> 0: steps on a schedule, see above;
  // then think_time must be 0). 0: back to back.
  double step_rate = 0;
  v1::DType dtype = v1::DTYPE_F32;                   // of the step tensors
  v1::DType kv_dtype = v1::DTYPE_F32;                // of the server's KV cache
  bool rope = false;  // default RoPE on q and k (off, as in the API)
};

// Called on the caller's thread after the warm-up and after each window.
struct WindowProgress {
  int point = 0;   // index into the sweep
  int points = 0;  // sweep size
  LoadMode mode = LoadMode::kClosed;
  int concurrency = 0;     // closed loop
  double offered_rps = 0;  // open loop
  int window = 0;          // 0 after the warm-up, then 1, 2, ...
  int max_windows = 0;
  double throughput_rps = 0;  // successful requests / s in this window
  int64_t errors = 0;         // failed requests in this window
};

struct LoadSpec {
  Workload workload = Workload::kAttend;
  AttendShape attend;
  DecodeShape decode;

  // Layer mode: requests go to this served model's attention layer (empty:
  // plain q/k/v requests). Attend then sends hidden states [batch, q_len,
  // hidden_size] (self-attention: k_len is not used) with attend.causal;
  // Decode sessions open on the model's layer and their prefill and steps send
  // hidden [1, T, hidden_size]. Heads, head_dim and RoPE are the model's (the
  // shape fields for them are ignored); dtype and kv_dtype still apply.
  std::string model;
  int layer = 0;  // >= 0
  // The model's hidden_size; 0 means ask the server (GetModel) before running.
  int64_t hidden_size = 0;

  LoadMode mode = LoadMode::kClosed;
  // Closed loop: the sweep over the number of workers (each >= 1).
  std::vector<int> concurrency = {1};
  // Open loop: the sweep over requests per second (each > 0).
  std::vector<double> rates = {10};
  // Open loop: requests (attend) or sessions (decode) in flight at most; an
  // arrival that finds them all busy waits for one and is counted as late.
  int max_outstanding = 64;  // >= 1

  absl::Duration warmup = absl::Seconds(1);  // >= 0, not measured
  absl::Duration window = absl::Seconds(2);  // > 0
  // Windows per point at most; the point is stable once the last
  // `stable_windows` throughputs are each within `stability` of their mean.
  int max_windows = 10;     // >= stable_windows
  int stable_windows = 3;   // >= 1
  double stability = 0.10;  // > 0

  // Deadline of each Attend (Decode sessions use the Client's own deadline
  // per operation, ClientOptions::deadline).
  absl::Duration request_deadline = absl::Seconds(30);
  uint64_t seed = 1;                                     // tensors and Poisson arrivals
  std::function<void(const WindowProgress&)> on_window;  // optional

  // Keep one RequestRecord per completed request in PointResult::request_log.
  bool record_requests = false;
  // The server's Prometheus endpoint, "http://host:port/metrics" (empty: no
  // server-side times). RunLoad and SearchLoad scrape it once before any
  // measurement: an unreachable URL fails them.
  std::string metrics_url;
  absl::Duration scrape_timeout = absl::Seconds(5);  // > 0
};

// What a recorded request was (decode: see "What a request is" above).
enum class RequestKind { kAttend, kPrefill, kStep };
const char* RequestKindName(RequestKind kind);  // "attend", "prefill", "step"

// One completed request (LoadSpec::record_requests). Times are in ms since
// the point started (PointResult::start_unix_ms).
struct RequestRecord {
  int point = 0;  // index of the point (in the sweep, or the search's probe order)
  RequestKind kind = RequestKind::kAttend;
  std::string session_id;  // decode: the session's id ("" if its open failed)
  int64_t step = 0;        // decode: the step's index in its session (0 = prefill); attend: 0
  int connection = 0;      // index of the Client it went through
  double scheduled_ms = 0;  // when it was due (closed loop, back to back: when it was sent)
  double sent_ms = 0;       // when it was sent
  double latency_ms = 0;    // from scheduled_ms to its answer
  absl::StatusCode code = absl::StatusCode::kOk;
  bool late = false;  // sent after it was due
  // 0: answered during the warm-up; 1, 2, ...: in that window; -1: after the
  // last window (in flight when the point stopped).
  int window = 0;
  bool counted = false;  // answered in the final windows: part of the point's numbers
};

// Latencies in milliseconds, over successful requests (0 when there are none).
struct LatencyStats {
  double p50 = 0, p90 = 0, p95 = 0, p99 = 0, p999 = 0, mean = 0, max = 0;
};

// Server-side time of one method over a point's final windows, from how its
// histograms grew between two scrapes (LoadSpec::metrics_url); ms.
struct ServerTime {
  std::string method;        // "Attend", "Decode.Open", "Decode.Step", "Decode.Close"
  int64_t queue_count = 0;   // ropeattn_queue_seconds{method} observations added
  double queue_mean_ms = 0, queue_p50_ms = 0, queue_p99_ms = 0;
  int64_t compute_count = 0;  // ropeattn_compute_seconds{method} observations added
  double compute_mean_ms = 0, compute_p50_ms = 0, compute_p99_ms = 0;
};

// One field of a point's workload: its name, its value as text, and whether
// it is a number (empty value: does not apply to this workload).
struct WorkloadField {
  std::string name;
  std::string value;
  bool numeric = true;
};

struct PointResult {
  Workload workload = Workload::kAttend;
  LoadMode mode = LoadMode::kClosed;
  int concurrency = 0;        // closed loop; 0 in open loop
  double offered_rps = 0;     // open loop; 0 in closed loop
  double throughput_rps = 0;  // successful requests / s in the final windows
  double tokens_per_s = 0;    // tokens of those requests / s
  LatencyStats latency;
  int64_t requests = 0;  // completed in the final windows, any status
  int64_t ok = 0;
  int64_t errors = 0;                         // requests - ok
  int64_t late = 0;                           // open loop: sent after their scheduled time
  std::map<absl::StatusCode, int64_t> codes;  // requests per status code
  int windows = 0;                            // measurement windows run
  bool stable = false;                        // the last stable_windows met the criterion
  std::vector<double> window_throughputs;     // every window, successful req/s
  double measured_seconds = 0;                // length of the final windows

  // What was run, field by field (WorkloadFieldNames() order): the shapes,
  // the spec, the connections and the load level. Filled by RunPoint.
  std::vector<WorkloadField> workload_fields;
  int connections = 1;
  // Decode: the first steps (open + prefill + first step) and the other
  // steps of the final windows, apart; prefill_ok + step_ok == ok.
  int64_t prefill_ok = 0, step_ok = 0;
  LatencyStats prefill_latency, step_latency;
  // Up to 3 distinct messages per non-OK code of the final windows.
  std::map<absl::StatusCode, std::vector<std::string>> error_samples;
  // LoadSpec::metrics_url: methods whose queue or compute histogram grew
  // (empty without a URL); a failed scrape leaves it empty and says why here.
  std::vector<ServerTime> server;
  std::string server_error;
  // LoadSpec::record_requests: every request that completed, in completion order.
  std::vector<RequestRecord> request_log;
  int64_t start_unix_ms = 0;  // wall clock at the point's start
};

// Names of PointResult::workload_fields, in order.
const std::vector<std::string>& WorkloadFieldNames();

// The highest load whose p99 stays under a threshold (SearchLoad).
//
// A level (a concurrency in closed loop, a rate in open loop) PASSES when its
// point had successful requests, no failed ones, and a p99 latency (of every
// request kind together) at or under latency_threshold_ms. The search:
// 1. doubles the level from `start` (capped at `max_level`) until a point
//    fails or the cap has been probed;
// 2. then bisects between the highest passing and the lowest failing level
//    until they are within `resolution` (closed loop: adjacent integers; open
//    loop: hi - lo <= resolution * lo),
// and stops after max_points points in any case. The answer is the highest
// level that passed; every probed level above it failed.
struct SearchSpec {
  double latency_threshold_ms = 0;  // > 0
  double start = 0;                 // > 0 (closed loop: an integer >= 1)
  double max_level = 0;             // >= start; 0: 4096 (closed loop), unbounded (open loop)
  int max_points = 10;              // >= 1
  double resolution = 0.05;         // open loop: > 0
};

struct SearchResult {
  std::vector<PointResult> points;  // in probe order
  std::vector<bool> passed;         // per point
  bool found = false;               // some level passed
  double best = 0;                  // the highest level that passed (0 if none)
  double lowest_failed = 0;         // the lowest level that failed (0 if none)
  // Why it stopped: "resolution", "max_points", "max_level", "first level failed".
  std::string stopped;
};

bool MeetsThreshold(const PointResult& point, double latency_threshold_ms);

// Checks a spec (InvalidArgument naming the field and value).
absl::Status ValidateLoadSpec(const LoadSpec& spec);

// Sends one request (attend) or runs one short session (decode) and returns
// its status: a wrong shape or an unreachable server shows here, before any
// measurement.
absl::Status ProbeWorkload(Client& client, const LoadSpec& spec);

// N Clients with `options`, each with a TCP connection of its own
// (ClientOptions::own_connection). `connections` in [1, 256].
absl::StatusOr<std::vector<std::unique_ptr<Client>>> ConnectClients(const ClientOptions& options,
                                                                    int connections);

// Layer mode with hidden_size 0: a copy of `spec` with the model's
// hidden_size from GetModel (NOT_FOUND for an unknown model). Otherwise `spec`.
// ProbeWorkload, RunPoint and RunLoad call it themselves.
absl::StatusOr<LoadSpec> ResolveLayerMode(Client& client, const LoadSpec& spec);

// Runs one sweep point: `level` is a concurrency (closed) or a rate (open).
// Requests go round robin over `clients` (at least one).
absl::StatusOr<PointResult> RunPoint(absl::Span<Client* const> clients, const LoadSpec& spec,
                                     double level, int point_index = 0, int points = 1);
absl::StatusOr<PointResult> RunPoint(Client& client, const LoadSpec& spec, double level,
                                     int point_index = 0, int points = 1);

// Validates, probes, then runs every point of the sweep in order.
absl::StatusOr<std::vector<PointResult>> RunLoad(absl::Span<Client* const> clients,
                                                 const LoadSpec& spec);
absl::StatusOr<std::vector<PointResult>> RunLoad(Client& client, const LoadSpec& spec);

// Validates, probes, then searches (SearchSpec); the spec's concurrency and
// rate lists are not used.
absl::StatusOr<SearchResult> SearchLoad(absl::Span<Client* const> clients, const LoadSpec& spec,
                                        const SearchSpec& search);

// "OK=120;RESOURCE_EXHAUSTED=3" (code names as absl::StatusCodeToString).
std::string FormatCodes(const std::map<absl::StatusCode, int64_t>& codes);

}  // namespace ropeattn::client

#endif  // ROPEATTN_CLIENT_LOADGEN_H_
