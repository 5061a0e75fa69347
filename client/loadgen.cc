#include "client/loadgen.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/metrics_scrape.h"

namespace ropeattn::client {
namespace {

using Clock = std::chrono::steady_clock;

// Grace after a window's end before it is evaluated, so that requests that
// completed just before the boundary have been recorded.
constexpr auto kRecordGrace = std::chrono::milliseconds(20);
// Open-loop schedules start a little after the workers are launched, so the
// first arrivals are not late merely because threads were still starting.
constexpr auto kScheduleLead = std::chrono::milliseconds(20);

// Messages kept per error sample (longer ones are cut).
constexpr size_t kMaxSampleChars = 500;
constexpr size_t kSamplesPerCode = 3;

struct Record {
  Clock::time_point done;
  Clock::time_point intended;  // latency runs from here
  Clock::time_point sent;
  absl::StatusCode code = absl::StatusCode::kOk;
  int64_t tokens = 0;
  bool late = false;
  RequestKind kind = RequestKind::kAttend;
  int64_t step = 0;
  int connection = 0;
  std::string session_id;
  std::string message;  // non-OK only
  int64_t latency_ns() const {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(done - intended).count();
  }
};

// Successful and failed requests that completed in a span.
struct Counts {
  int64_t ok = 0, errors = 0;
};

class Recorder {
 public:
  void Add(Record record) {
    absl::MutexLock lock(&mu_);
    records_.push_back(std::move(record));
  }
  Counts Between(Clock::time_point begin, Clock::time_point end) const {
    absl::MutexLock lock(&mu_);
    Counts c;
    for (const Record& r : records_) {
      if (r.done >= begin && r.done < end) {
        (r.code == absl::StatusCode::kOk ? c.ok : c.errors) += 1;
      }
    }
    return c;
  }
  std::vector<Record> All() const {
    absl::MutexLock lock(&mu_);
    return records_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<Record> records_ ABSL_GUARDED_BY(mu_);
};

class StopFlag {
 public:
  void Stop() {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
  }
  bool stopped() const {
    absl::MutexLock lock(&mu_);
    return stopped_;
  }
  // Waits until `when` or a stop, whichever is first; true if stopped.
  bool WaitUntil(Clock::time_point when) const {
    const auto now = Clock::now();
    absl::MutexLock lock(&mu_);
    if (when > now) {
      const auto wait = std::chrono::duration_cast<std::chrono::nanoseconds>(when - now);
      mu_.AwaitWithTimeout(absl::Condition(&stopped_), absl::Nanoseconds(wait.count()));
    }
    return stopped_;
  }

 private:
  mutable absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

// Arrival times of an open-loop schedule; workers claim them in order.
class Schedule {
 public:
  Schedule(LoadMode mode, double rate, uint64_t seed, Clock::time_point start)
      : mode_(mode), rate_(rate), rng_(seed), next_(start) {}
  Clock::time_point Claim() {
    absl::MutexLock lock(&mu_);
    const Clock::time_point t = next_;
    double gap = 1.0 / rate_;
    if (mode_ == LoadMode::kPoisson) gap = std::exponential_distribution<double>(rate_)(rng_);
    next_ += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap));
    return t;
  }

 private:
  const LoadMode mode_;
  const double rate_;
  absl::Mutex mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  Clock::time_point next_ ABSL_GUARDED_BY(mu_);
};

// Requests built once per run: the hot path only sends them.
struct Payload {
  v1::AttendRequest attend;
  int64_t attend_tokens = 0;
  v1::OpenSession open;
  v1::Tensor prefill_q, prefill_k, prefill_v;
  v1::Tensor step_q, step_k, step_v;
  // Layer mode: hidden states instead of q/k/v.
  bool layer_mode = false;
  v1::Tensor prefill_hidden, step_hidden;
};

void SetRope(const AttendShape& a, v1::AttentionSpec* spec) {
  if (a.rope_type.empty() || a.rope_type == "none") return;  // no positional encoding
  v1::RopeSpec* rope = spec->mutable_rope();
  if (a.rope_type == "default") return;
  v1::RopeScaling* s = rope->mutable_scaling();
  s->set_rope_type(a.rope_type);
  s->set_factor(a.rope_factor != 0 ? a.rope_factor : 2.0);
  // The server refuses parameters a rule does not read: only the rules with
  // a trained length get one.
  if (a.rope_type != "linear" && a.rope_type != "ntk") {
    s->set_original_max_position_embeddings(a.original_max_positions != 0
                                                ? a.original_max_positions
                                                : std::max<int64_t>(1, a.k_len / 2));
  }
  if (a.rope_type == "longrope" || a.rope_type == "su") {
    for (int64_t i = 0; i < a.head_dim / 2; ++i) {
      s->add_short_factor(1.0);
      s->add_long_factor(s->factor());
    }
  }
}

// Layer-mode payload: hidden states of spec.hidden_size (resolved already).
absl::StatusOr<Payload> BuildLayerPayload(const LoadSpec& spec) {
  Payload p;
  p.layer_mode = true;
  const int64_t hidden = spec.hidden_size;
  if (hidden < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden_size of model ", spec.model, " must be >= 1, got ", hidden));
  }
  if (spec.workload == Workload::kAttend) {
    const AttendShape& a = spec.attend;
    p.attend.mutable_spec()->set_causal(a.causal);
    v1::LayerInput* layer = p.attend.mutable_layer();
    layer->set_model(spec.model);
    layer->set_layer(spec.layer);
    absl::StatusOr<v1::Tensor> h = RandomTensor(a.dtype, {a.batch, a.q_len, hidden}, spec.seed);
    if (!h.ok()) return h.status();
    *layer->mutable_hidden() = *std::move(h);
    p.attend_tokens = a.batch * a.q_len;
    return p;
  }
  const DecodeShape& d = spec.decode;
  p.open.mutable_spec()->set_causal(true);
  p.open.set_model(spec.model);
  p.open.set_layer(spec.layer);
  p.open.set_kv_dtype(d.kv_dtype);
  p.open.set_max_context(d.context + d.steps_per_session * d.tokens_per_step);
  if (d.context > 0) {
    absl::StatusOr<v1::Tensor> h = RandomTensor(d.dtype, {1, d.context, hidden}, spec.seed);
    if (!h.ok()) return h.status();
    p.prefill_hidden = *std::move(h);
  }
  absl::StatusOr<v1::Tensor> h =
      RandomTensor(d.dtype, {1, d.tokens_per_step, hidden}, spec.seed + 10);
  if (!h.ok()) return h.status();
  p.step_hidden = *std::move(h);
  return p;
}

absl::StatusOr<Payload> BuildPayload(const LoadSpec& spec) {
  if (!spec.model.empty()) return BuildLayerPayload(spec);
  Payload p;
  if (spec.workload == Workload::kAttend) {
    const AttendShape& a = spec.attend;
    const int64_t kv_heads = a.kv_heads == 0 ? a.heads : a.kv_heads;
    v1::AttentionSpec* s = p.attend.mutable_spec();
    s->set_heads(a.heads);
    s->set_kv_heads(kv_heads);
    s->set_head_dim(a.head_dim);
    s->set_causal(a.causal);
    SetRope(a, s);
    auto q = RandomTensor(a.dtype, {a.batch, a.q_len, a.heads, a.head_dim}, spec.seed);
    auto k = RandomTensor(a.dtype, {a.batch, a.k_len, kv_heads, a.head_dim}, spec.seed + 1);
    auto v = RandomTensor(a.dtype, {a.batch, a.k_len, kv_heads, a.head_dim}, spec.seed + 2);
    for (const auto* t : {&q, &k, &v}) {
      if (!t->ok()) return t->status();
    }
    *p.attend.mutable_q() = *std::move(q);
    *p.attend.mutable_k() = *std::move(k);
    *p.attend.mutable_v() = *std::move(v);
    p.attend_tokens = a.batch * a.q_len;
    return p;
  }
  const DecodeShape& d = spec.decode;
  const int64_t kv_heads = d.kv_heads == 0 ? d.heads : d.kv_heads;
  v1::AttentionSpec* s = p.open.mutable_spec();
  s->set_heads(d.heads);
  s->set_kv_heads(kv_heads);
  s->set_head_dim(d.head_dim);
  s->set_causal(true);
  if (d.rope) s->mutable_rope();
  p.open.set_kv_dtype(d.kv_dtype);
  p.open.set_max_context(d.context + d.steps_per_session * d.tokens_per_step);
  auto make = [&](int64_t tokens, uint64_t seed, v1::Tensor* q, v1::Tensor* k,
                  v1::Tensor* v) -> absl::Status {
    auto tq = RandomTensor(d.dtype, {1, tokens, d.heads, d.head_dim}, seed);
    auto tk = RandomTensor(d.dtype, {1, tokens, kv_heads, d.head_dim}, seed + 1);
    auto tv = RandomTensor(d.dtype, {1, tokens, kv_heads, d.head_dim}, seed + 2);
    for (const auto* t : {&tq, &tk, &tv}) {
      if (!t->ok()) return t->status();
    }
    *q = *std::move(tq);
    *k = *std::move(tk);
    *v = *std::move(tv);
    return absl::OkStatus();
  };
  if (d.context > 0) {
    absl::Status st = make(d.context, spec.seed, &p.prefill_q, &p.prefill_k, &p.prefill_v);
    if (!st.ok()) return st;
  }
  absl::Status st = make(d.tokens_per_step, spec.seed + 10, &p.step_q, &p.step_k, &p.step_v);
  if (!st.ok()) return st;
  return p;
}

// A failed or successful request, recorded (when there is a recorder).
void Note(Recorder* recorder, RequestKind kind, int64_t step, int connection,
          const std::string& session_id, Clock::time_point intended, Clock::time_point sent,
          bool late, const absl::Status& status, int64_t tokens) {
  if (recorder == nullptr) return;
  Record r;
  r.done = Clock::now();
  r.intended = intended;
  r.sent = sent;
  r.code = status.code();
  r.tokens = status.ok() ? tokens : 0;
  r.late = late;
  r.kind = kind;
  r.step = step;
  r.connection = connection;
  r.session_id = session_id;
  if (!status.ok()) r.message = std::string(status.message().substr(0, kMaxSampleChars));
  recorder->Add(std::move(r));
}

// One Attend due at `intended`; records it.
void RunAttend(Client& client, int connection, const Payload& p, const LoadSpec& spec,
               Clock::time_point intended, bool late, Recorder& recorder) {
  const Clock::time_point sent = Clock::now();
  auto response = client.Attend(p.attend, spec.request_deadline);
  Note(&recorder, RequestKind::kAttend, 0, connection, "", intended, sent, late,
       response.status(), p.attend_tokens);
}

// One session started at `start` (its scheduled arrival in open loop). Ends
// early on a stop or on the first failure (recorded as one failed request).
// `steps` overrides the spec's steps per session (the probe runs one).
absl::Status RunSession(Client& client, int connection, const Payload& p, const LoadSpec& spec,
                        Clock::time_point start, bool late, Recorder* recorder,
                        const StopFlag* stop, int64_t steps) {
  const DecodeShape& d = spec.decode;
  std::string session_id;
  const Clock::time_point opened = Clock::now();
  auto session = client.OpenSession(p.open);
  if (!session.ok()) {
    Note(recorder, RequestKind::kPrefill, 0, connection, "", start, opened, late,
         session.status(), 0);
    return session.status();
  }
  session_id = (*session)->id();
  if (d.context > 0) {
    auto prefill = p.layer_mode ? (*session)->StepHidden(p.prefill_hidden)
                                : (*session)->Step(p.prefill_q, p.prefill_k, p.prefill_v);
    if (!prefill.ok()) {
      Note(recorder, RequestKind::kPrefill, 0, connection, session_id, start, opened, late,
           prefill.status(), 0);
      return prefill.status();
    }
  }
  Clock::time_point intended = start;
  Clock::time_point sent = opened;
  bool step_late = late;
  for (int64_t i = 0; i < steps; ++i) {
    if (i > 0) {
      if (d.step_rate > 0) {
        // Due on the session's schedule, whenever the previous step answered.
        intended = start + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(static_cast<double>(i) / d.step_rate));
        step_late = Clock::now() > intended;
      } else {
        intended = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      absl::ToChronoNanoseconds(d.think_time));
        step_late = false;
      }
      if (stop != nullptr) {
        if (stop->WaitUntil(intended)) return absl::OkStatus();
      } else {
        std::this_thread::sleep_until(intended);
      }
      sent = Clock::now();
    }
    const RequestKind kind = i == 0 ? RequestKind::kPrefill : RequestKind::kStep;
    auto result = p.layer_mode ? (*session)->StepHidden(p.step_hidden)
                               : (*session)->Step(p.step_q, p.step_k, p.step_v);
    Note(recorder, kind, i, connection, session_id, intended, sent, step_late, result.status(),
         d.tokens_per_step);
    if (!result.ok()) return result.status();
  }
  return (*session)->Close();
}

void RunRequest(Client& client, int connection, const Payload& p, const LoadSpec& spec,
                Clock::time_point intended, bool late, Recorder& recorder, const StopFlag& stop) {
  if (spec.workload == Workload::kAttend) {
    RunAttend(client, connection, p, spec, intended, late, recorder);
  } else {
    RunSession(client, connection, p, spec, intended, late, &recorder, &stop,
               spec.decode.steps_per_session)
        .IgnoreError();
  }
}

double Percentile(const std::vector<int64_t>& sorted, double q) {
  if (sorted.empty()) return 0;
  // Nearest rank: the smallest value with at least q of the samples at or below it.
  size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(sorted.size())));
  rank = std::clamp<size_t>(rank, 1, sorted.size());
  return static_cast<double>(sorted[rank - 1]) / 1e6;
}

double OkPerSecond(const Counts& counts, double seconds) {
  return seconds > 0 ? static_cast<double>(counts.ok) / seconds : 0;
}

// Percentiles, mean and max of latencies in ns (sorted here).
LatencyStats StatsOf(std::vector<int64_t> latencies) {
  LatencyStats l;
  std::sort(latencies.begin(), latencies.end());
  l.p50 = Percentile(latencies, 0.50);
  l.p90 = Percentile(latencies, 0.90);
  l.p95 = Percentile(latencies, 0.95);
  l.p99 = Percentile(latencies, 0.99);
  l.p999 = Percentile(latencies, 0.999);
  if (!latencies.empty()) {
    double sum = 0;
    for (int64_t x : latencies) sum += static_cast<double>(x);
    l.mean = sum / static_cast<double>(latencies.size()) / 1e6;
    l.max = static_cast<double>(latencies.back()) / 1e6;
  }
  return l;
}

std::string Num(double x) { return absl::StrFormat("%g", x); }

// The workload's fields, WorkloadFieldNames() order; "" where one does not apply.
std::vector<WorkloadField> DescribeWorkload(const LoadSpec& spec, int connections) {
  const bool layer = !spec.model.empty();
  const bool attend = spec.workload == Workload::kAttend;
  const AttendShape& a = spec.attend;
  const DecodeShape& d = spec.decode;
  std::map<std::string, std::string> v;
  if (layer) {
    v["model"] = spec.model;
    v["layer"] = absl::StrCat(spec.layer);
    v["hidden_size"] = absl::StrCat(spec.hidden_size);
  }
  if (attend) {
    v["batch"] = absl::StrCat(a.batch);
    v["q_len"] = absl::StrCat(a.q_len);
    v["dtype"] = WireDTypeName(a.dtype);
    v["causal"] = a.causal ? "1" : "0";
    if (!layer) {
      v["heads"] = absl::StrCat(a.heads);
      v["kv_heads"] = absl::StrCat(a.kv_heads == 0 ? a.heads : a.kv_heads);
      v["head_dim"] = absl::StrCat(a.head_dim);
      v["k_len"] = absl::StrCat(a.k_len);
      const std::string rope = a.rope_type.empty() ? "none" : a.rope_type;
      v["rope"] = rope;
      if (rope != "none" && rope != "default") {  // as SetRope sends it
        v["rope_factor"] = Num(a.rope_factor != 0 ? a.rope_factor : 2.0);
        if (rope != "linear" && rope != "ntk") {
          v["rope_original_max_positions"] = absl::StrCat(
              a.original_max_positions != 0 ? a.original_max_positions
                                            : std::max<int64_t>(1, a.k_len / 2));
        }
      }
    }
  } else {
    v["batch"] = "1";
    v["dtype"] = WireDTypeName(d.dtype);
    v["causal"] = "1";
    if (!layer) {
      v["heads"] = absl::StrCat(d.heads);
      v["kv_heads"] = absl::StrCat(d.kv_heads == 0 ? d.heads : d.kv_heads);
      v["head_dim"] = absl::StrCat(d.head_dim);
      v["rope"] = d.rope ? "default" : "none";
    }
    v["context"] = absl::StrCat(d.context);
    v["steps_per_session"] = absl::StrCat(d.steps_per_session);
    v["tokens_per_step"] = absl::StrCat(d.tokens_per_step);
    v["kv_dtype"] = WireDTypeName(d.kv_dtype);
    v["think_ms"] = Num(absl::ToDoubleMilliseconds(d.think_time));
    v["step_rate"] = Num(d.step_rate);
  }
  v["connections"] = absl::StrCat(connections);
  if (spec.mode != LoadMode::kClosed) v["max_outstanding"] = absl::StrCat(spec.max_outstanding);
  std::vector<WorkloadField> fields;
  for (const std::string& name : WorkloadFieldNames()) {
    const bool text = name == "model" || name == "dtype" || name == "kv_dtype" || name == "rope";
    auto it = v.find(name);
    fields.push_back({name, it == v.end() ? "" : it->second, !text});
  }
  return fields;
}

// The methods whose server-side times a workload exercises.
std::vector<std::string> MethodsOf(Workload workload) {
  if (workload == Workload::kAttend) return {"Attend"};
  return {"Decode.Open", "Decode.Step", "Decode.Close"};
}

absl::StatusOr<std::vector<MetricSample>> Scrape(const LoadSpec& spec) {
  absl::StatusOr<std::string> body = HttpGet(spec.metrics_url, spec.scrape_timeout);
  if (!body.ok()) return body.status();
  return ParsePrometheusText(*body);
}

bool IsStable(const std::vector<double>& throughputs, int n, double tolerance) {
  if (static_cast<int>(throughputs.size()) < n) return false;
  double mean = 0;
  for (int i = 0; i < n; ++i) mean += throughputs[throughputs.size() - 1 - i];
  mean /= n;
  // Windows where nothing completed (a server slower than the window) are
  // not a steady state, however alike they look.
  if (mean <= 0) return false;
  for (int i = 0; i < n; ++i) {
    if (std::abs(throughputs[throughputs.size() - 1 - i] - mean) > tolerance * mean) return false;
  }
  return true;
}

}  // namespace

const char* WorkloadName(Workload workload) {
  return workload == Workload::kAttend ? "attend" : "decode";
}

const char* LoadModeName(LoadMode mode) {
  switch (mode) {
    case LoadMode::kClosed:
      return "closed";
    case LoadMode::kConstant:
      return "constant";
    case LoadMode::kPoisson:
      return "poisson";
  }
  return "?";
}

const char* RequestKindName(RequestKind kind) {
  switch (kind) {
    case RequestKind::kAttend:
      return "attend";
    case RequestKind::kPrefill:
      return "prefill";
    case RequestKind::kStep:
      return "step";
  }
  return "?";
}

const std::vector<std::string>& WorkloadFieldNames() {
  static const auto* names = new std::vector<std::string>{
      "model",     "layer",       "hidden_size",
      "batch",     "heads",       "kv_heads",
      "head_dim",  "q_len",       "k_len",
      "dtype",     "causal",      "rope",
      "rope_factor", "rope_original_max_positions", "context",
      "steps_per_session", "tokens_per_step", "kv_dtype",
      "think_ms",  "step_rate",   "connections",
      "max_outstanding"};
  return *names;
}

absl::StatusOr<Workload> ParseWorkload(absl::string_view name) {
  if (name == "attend") return Workload::kAttend;
  if (name == "decode") return Workload::kDecode;
  return absl::InvalidArgumentError(
      absl::StrCat("workload must be attend or decode, got '", name, "'"));
}

absl::StatusOr<LoadMode> ParseLoadMode(absl::string_view name) {
  if (name == "closed") return LoadMode::kClosed;
  if (name == "constant") return LoadMode::kConstant;
  if (name == "poisson") return LoadMode::kPoisson;
  return absl::InvalidArgumentError(
      absl::StrCat("mode must be closed, constant or poisson, got '", name, "'"));
}

std::string FormatCodes(const std::map<absl::StatusCode, int64_t>& codes) {
  return absl::StrJoin(codes, ";", [](std::string* out, const auto& entry) {
    absl::StrAppend(out, absl::StatusCodeToString(entry.first), "=", entry.second);
  });
}

absl::Status ValidateLoadSpec(const LoadSpec& spec) {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  auto check_heads = [&](int64_t heads, int64_t kv_heads, int64_t head_dim) -> absl::Status {
    if (heads < 1) return bad("heads must be >= 1, got ", heads);
    if (kv_heads < 0) return bad("kv_heads must be >= 0, got ", kv_heads);
    if (kv_heads > 0 && heads % kv_heads != 0) {
      return bad("heads must be a multiple of kv_heads, got ", heads, " and ", kv_heads);
    }
    if (head_dim < 2 || head_dim % 2 != 0) return bad("head_dim must be even, got ", head_dim);
    return absl::OkStatus();
  };
  // Tensors are f32 or bf16; a session's cache may also be int8.
  auto check_dtype = [&](v1::DType dtype, absl::string_view field,
                         bool cache = false) -> absl::Status {
    if (dtype == v1::DTYPE_F32 || dtype == v1::DTYPE_BF16 || (cache && dtype == v1::DTYPE_INT8)) {
      return absl::OkStatus();
    }
    return bad(field, cache ? " must be f32, bf16 or int8, got " : " must be f32 or bf16, got ",
               WireDTypeName(dtype), " (", static_cast<int>(dtype), ")");
  };
  const bool layer_mode = !spec.model.empty();
  if (layer_mode && spec.layer < 0) return bad("layer must be >= 0, got ", spec.layer);
  if (layer_mode && spec.hidden_size < 0) {
    return bad("hidden_size must be >= 0, got ", spec.hidden_size);
  }
  if (spec.workload == Workload::kAttend) {
    const AttendShape& a = spec.attend;
    if (!layer_mode) {
      if (absl::Status s = check_heads(a.heads, a.kv_heads, a.head_dim); !s.ok()) return s;
    }
    if (a.batch < 1) return bad("batch must be >= 1, got ", a.batch);
    if (a.q_len < 1) return bad("q_len must be >= 1, got ", a.q_len);
    if (!layer_mode && a.k_len < a.q_len) {
      return bad("k_len must be >= q_len (", a.q_len, "), got ", a.k_len);
    }
    if (absl::Status s = check_dtype(a.dtype, "dtype"); !s.ok()) return s;
  } else {
    const DecodeShape& d = spec.decode;
    if (!layer_mode) {
      if (absl::Status s = check_heads(d.heads, d.kv_heads, d.head_dim); !s.ok()) return s;
    }
    if (d.steps_per_session < 1) {
      return bad("steps_per_session must be >= 1, got ", d.steps_per_session);
    }
    if (d.context < 0) return bad("context must be >= 0, got ", d.context);
    if (d.tokens_per_step < 1) return bad("tokens_per_step must be >= 1, got ", d.tokens_per_step);
    if (d.think_time < absl::ZeroDuration()) {
      return bad("think time must be >= 0, got ", absl::FormatDuration(d.think_time));
    }
    if (!(d.step_rate >= 0) || !std::isfinite(d.step_rate)) {
      return bad("step_rate must be >= 0, got ", d.step_rate);
    }
    if (d.step_rate > 0 && d.think_time > absl::ZeroDuration()) {
      return bad("step_rate and think time exclude each other (a scheduled step has no think "
                 "time), got ",
                 d.step_rate, " steps/s and ", absl::FormatDuration(d.think_time));
    }
    if (absl::Status s = check_dtype(d.dtype, "dtype"); !s.ok()) return s;
    if (absl::Status s = check_dtype(d.kv_dtype, "kv_dtype", /*cache=*/true); !s.ok()) return s;
  }
  if (spec.mode == LoadMode::kClosed) {
    if (spec.concurrency.empty()) return bad("concurrency list is empty");
    for (int c : spec.concurrency) {
      if (c < 1) return bad("concurrency must be >= 1, got ", c);
    }
  } else {
    if (spec.rates.empty()) return bad("rate list is empty");
    for (double r : spec.rates) {
      if (!(r > 0) || !std::isfinite(r)) return bad("rate must be > 0, got ", r);
    }
    if (spec.max_outstanding < 1) {
      return bad("max_outstanding must be >= 1, got ", spec.max_outstanding);
    }
  }
  if (spec.warmup < absl::ZeroDuration()) {
    return bad("warmup must be >= 0, got ", absl::FormatDuration(spec.warmup));
  }
  if (spec.window <= absl::ZeroDuration()) {
    return bad("window must be > 0, got ", absl::FormatDuration(spec.window));
  }
  if (spec.stable_windows < 1) return bad("stable_windows must be >= 1, got ", spec.stable_windows);
  if (spec.max_windows < spec.stable_windows) {
    return bad("max_windows must be >= stable_windows (", spec.stable_windows, "), got ",
               spec.max_windows);
  }
  if (!(spec.stability > 0)) return bad("stability must be > 0, got ", spec.stability);
  if (spec.request_deadline <= absl::ZeroDuration()) {
    return bad("request deadline must be > 0, got ", absl::FormatDuration(spec.request_deadline));
  }
  if (spec.scrape_timeout <= absl::ZeroDuration()) {
    return bad("scrape timeout must be > 0, got ", absl::FormatDuration(spec.scrape_timeout));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::unique_ptr<Client>>> ConnectClients(const ClientOptions& options,
                                                                    int connections) {
  if (connections < 1 || connections > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("connections must be in [1, 256], got ", connections));
  }
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < connections; ++i) {
    ClientOptions o = options;
    o.own_connection = true;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(o);
    if (!client.ok()) return client.status();
    clients.push_back(*std::move(client));
  }
  return clients;
}

absl::StatusOr<LoadSpec> ResolveLayerMode(Client& client, const LoadSpec& spec) {
  LoadSpec resolved = spec;
  if (spec.model.empty() || spec.hidden_size > 0) return resolved;
  absl::StatusOr<v1::ModelInfo> info = client.GetModel(spec.model, spec.request_deadline);
  if (!info.ok()) return info.status();
  resolved.hidden_size = info->hidden_size();
  return resolved;
}

absl::Status ProbeWorkload(Client& client, const LoadSpec& spec_in) {
  absl::StatusOr<LoadSpec> resolved = ResolveLayerMode(client, spec_in);
  if (!resolved.ok()) return resolved.status();
  const LoadSpec& spec = *resolved;
  absl::StatusOr<Payload> payload = BuildPayload(spec);
  if (!payload.ok()) return payload.status();
  if (spec.workload == Workload::kAttend) {
    return client.Attend(payload->attend, spec.request_deadline).status();
  }
  return RunSession(client, 0, *payload, spec, Clock::now(), false, nullptr, nullptr, 1);
}

absl::StatusOr<PointResult> RunPoint(absl::Span<Client* const> clients,
                                     const LoadSpec& spec_in, double level, int point_index,
                                     int points) {
  if (clients.empty()) return absl::InvalidArgumentError("no client to send through");
  if (absl::Status s = ValidateLoadSpec(spec_in); !s.ok()) return s;
  absl::StatusOr<LoadSpec> resolved = ResolveLayerMode(*clients[0], spec_in);
  if (!resolved.ok()) return resolved.status();
  const LoadSpec& spec = *resolved;
  absl::StatusOr<Payload> payload_or = BuildPayload(spec);
  if (!payload_or.ok()) return payload_or.status();
  const Payload& payload = *payload_or;

  PointResult result;
  result.workload = spec.workload;
  result.mode = spec.mode;
  result.connections = static_cast<int>(clients.size());
  result.workload_fields = DescribeWorkload(spec, result.connections);
  const bool closed = spec.mode == LoadMode::kClosed;
  if (closed) {
    result.concurrency = static_cast<int>(level);
    if (result.concurrency < 1) {
      return absl::InvalidArgumentError(absl::StrCat("concurrency must be >= 1, got ", level));
    }
  } else {
    result.offered_rps = level;
    if (!(level > 0))
      return absl::InvalidArgumentError(absl::StrCat("rate must be > 0, got ", level));
  }

  Recorder recorder;
  StopFlag stop;
  // Requests (attend) and sessions (decode) take the Clients in turn.
  std::atomic<uint64_t> next_client{0};
  auto run_one = [&](Clock::time_point intended, bool late) {
    const int connection = static_cast<int>(next_client.fetch_add(1) % clients.size());
    RunRequest(*clients[connection], connection, payload, spec, intended, late, recorder, stop);
  };
  const Clock::time_point start = Clock::now();
  result.start_unix_ms = absl::ToUnixMillis(absl::Now());
  std::vector<std::thread> workers;
  if (closed) {
    for (int i = 0; i < result.concurrency; ++i) {
      workers.emplace_back([&] {
        while (!stop.stopped()) run_one(Clock::now(), false);
      });
    }
  } else {
    // Decode arrivals are sessions: their rate makes the offered step rate `level`.
    const double arrivals = spec.workload == Workload::kAttend
                                ? level
                                : level / static_cast<double>(spec.decode.steps_per_session);
    auto schedule = std::make_shared<Schedule>(spec.mode, arrivals, spec.seed + point_index,
                                               start + kScheduleLead);
    for (int i = 0; i < spec.max_outstanding; ++i) {
      workers.emplace_back([&, schedule] {
        while (true) {
          const Clock::time_point intended = schedule->Claim();
          // Claimed after its time: every worker was busy when it was due.
          const bool late = Clock::now() > intended;
          if (stop.WaitUntil(intended)) break;
          run_one(intended, late);
        }
      });
    }
  }

  const auto window =
      std::chrono::duration_cast<Clock::duration>(absl::ToChronoNanoseconds(spec.window));
  const double window_seconds = absl::ToDoubleSeconds(spec.window);
  const Clock::time_point measure_start =
      start + (closed ? Clock::duration::zero() : Clock::duration(kScheduleLead)) +
      std::chrono::duration_cast<Clock::duration>(absl::ToChronoNanoseconds(spec.warmup));
  WindowProgress progress;
  progress.point = point_index;
  progress.points = points;
  progress.mode = spec.mode;
  progress.concurrency = result.concurrency;
  progress.offered_rps = result.offered_rps;
  progress.max_windows = spec.max_windows;
  auto report = [&](int window_index, const Counts& counts, double seconds) {
    if (!spec.on_window) return;
    progress.window = window_index;
    progress.throughput_rps = OkPerSecond(counts, seconds);
    progress.errors = counts.errors;
    spec.on_window(progress);
  };
  // scrapes[k]: the server's metrics after window k (0: after the warm-up).
  std::vector<absl::StatusOr<std::vector<MetricSample>>> scrapes;
  auto scrape = [&] {
    if (!spec.metrics_url.empty()) scrapes.push_back(Scrape(spec));
  };

  std::this_thread::sleep_until(measure_start + kRecordGrace);
  scrape();
  report(0, recorder.Between(start, measure_start),
         std::chrono::duration<double>(measure_start - start).count());
  std::vector<double> live;
  int windows = 0;
  while (windows < spec.max_windows) {
    const Clock::time_point begin = measure_start + windows * window;
    const Clock::time_point end = begin + window;
    std::this_thread::sleep_until(end + kRecordGrace);
    scrape();
    ++windows;
    const Counts counts = recorder.Between(begin, end);
    live.push_back(OkPerSecond(counts, window_seconds));
    report(windows, counts, window_seconds);
    if (IsStable(live, spec.stable_windows, spec.stability)) break;
  }
  stop.Stop();
  for (std::thread& t : workers) t.join();

  // Final numbers from the complete record (requests finishing right at a
  // boundary may have been recorded after the live check).
  for (int w = 0; w < windows; ++w) {
    const Clock::time_point begin = measure_start + w * window;
    result.window_throughputs.push_back(
        OkPerSecond(recorder.Between(begin, begin + window), window_seconds));
  }
  result.windows = windows;
  result.stable = IsStable(result.window_throughputs, spec.stable_windows, spec.stability);
  const int used = std::min(windows, spec.stable_windows);
  const Clock::time_point final_begin = measure_start + (windows - used) * window;
  const Clock::time_point final_end = measure_start + windows * window;
  result.measured_seconds = used * window_seconds;
  std::vector<int64_t> latencies, prefill, steps;
  int64_t tokens = 0;
  std::vector<Record> records = recorder.All();
  auto ms_since_start = [&](Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(t - start).count();
  };
  for (const Record& r : records) {
    const bool counted = r.done >= final_begin && r.done < final_end;
    if (spec.record_requests) {
      RequestRecord out;
      out.point = point_index;
      out.kind = r.kind;
      out.session_id = r.session_id;
      out.step = r.step;
      out.connection = r.connection;
      out.scheduled_ms = ms_since_start(r.intended);
      out.sent_ms = ms_since_start(r.sent);
      out.latency_ms = static_cast<double>(r.latency_ns()) / 1e6;
      out.code = r.code;
      out.late = r.late;
      if (r.done < measure_start) {
        out.window = 0;
      } else if (r.done >= final_end) {
        out.window = -1;
      } else {
        out.window = 1 + static_cast<int>((r.done - measure_start) / window);
      }
      out.counted = counted;
      result.request_log.push_back(std::move(out));
    }
    if (!counted) continue;
    ++result.requests;
    ++result.codes[r.code];
    result.late += r.late;
    if (r.code == absl::StatusCode::kOk) {
      ++result.ok;
      tokens += r.tokens;
      latencies.push_back(r.latency_ns());
      if (r.kind == RequestKind::kPrefill) prefill.push_back(r.latency_ns());
      if (r.kind == RequestKind::kStep) steps.push_back(r.latency_ns());
    } else {
      std::vector<std::string>& samples = result.error_samples[r.code];
      if (samples.size() < kSamplesPerCode &&
          std::find(samples.begin(), samples.end(), r.message) == samples.end()) {
        samples.push_back(r.message);
      }
    }
  }
  result.errors = result.requests - result.ok;
  result.throughput_rps = static_cast<double>(result.ok) / result.measured_seconds;
  result.tokens_per_s = static_cast<double>(tokens) / result.measured_seconds;
  result.prefill_ok = static_cast<int64_t>(prefill.size());
  result.step_ok = static_cast<int64_t>(steps.size());
  result.latency = StatsOf(std::move(latencies));
  result.prefill_latency = StatsOf(std::move(prefill));
  result.step_latency = StatsOf(std::move(steps));

  if (!spec.metrics_url.empty()) {
    const size_t before = static_cast<size_t>(windows - used), after = static_cast<size_t>(windows);
    if (after >= scrapes.size()) {
      result.server_error = "missing scrape";
    } else if (!scrapes[before].ok() || !scrapes[after].ok()) {
      result.server_error = std::string(
          (scrapes[before].ok() ? scrapes[after] : scrapes[before]).status().message());
    } else {
      for (const std::string& method : MethodsOf(spec.workload)) {
        const HistogramGrowth queue =
            GrowthOf(*scrapes[before], *scrapes[after], "ropeattn_queue_seconds", "method", method);
        const HistogramGrowth compute = GrowthOf(*scrapes[before], *scrapes[after],
                                                 "ropeattn_compute_seconds", "method", method);
        if (queue.count <= 0 && compute.count <= 0) continue;
        ServerTime t;
        t.method = method;
        t.queue_count = static_cast<int64_t>(queue.count);
        t.queue_mean_ms = queue.mean_ms;
        t.queue_p50_ms = queue.p50_ms;
        t.queue_p99_ms = queue.p99_ms;
        t.compute_count = static_cast<int64_t>(compute.count);
        t.compute_mean_ms = compute.mean_ms;
        t.compute_p50_ms = compute.p50_ms;
        t.compute_p99_ms = compute.p99_ms;
        result.server.push_back(std::move(t));
      }
    }
  }
  return result;
}

absl::StatusOr<PointResult> RunPoint(Client& client, const LoadSpec& spec, double level,
                                     int point_index, int points) {
  Client* clients[] = {&client};
  return RunPoint(absl::MakeConstSpan(clients), spec, level, point_index, points);
}

namespace {

// What RunLoad and SearchLoad do before measuring: validate, resolve the
// layer mode once, probe the workload (on every connection) and the metrics URL.
absl::StatusOr<LoadSpec> Prepare(absl::Span<Client* const> clients, const LoadSpec& spec_in) {
  if (clients.empty()) return absl::InvalidArgumentError("no client to send through");
  if (absl::Status s = ValidateLoadSpec(spec_in); !s.ok()) return s;
  // The model's hidden_size is asked once for the whole run.
  absl::StatusOr<LoadSpec> resolved = ResolveLayerMode(*clients[0], spec_in);
  if (!resolved.ok()) return resolved.status();
  for (Client* client : clients) {
    if (absl::Status s = ProbeWorkload(*client, *resolved); !s.ok()) return s;
  }
  if (!resolved->metrics_url.empty()) {
    absl::StatusOr<std::vector<MetricSample>> samples = Scrape(*resolved);
    if (!samples.ok()) {
      return absl::Status(samples.status().code(),
                          absl::StrCat("metrics URL: ", samples.status().message()));
    }
  }
  return resolved;
}

}  // namespace

absl::StatusOr<std::vector<PointResult>> RunLoad(absl::Span<Client* const> clients,
                                                 const LoadSpec& spec_in) {
  absl::StatusOr<LoadSpec> prepared = Prepare(clients, spec_in);
  if (!prepared.ok()) return prepared.status();
  const LoadSpec& spec = *prepared;
  std::vector<double> levels;
  if (spec.mode == LoadMode::kClosed) {
    levels.assign(spec.concurrency.begin(), spec.concurrency.end());
  } else {
    levels = spec.rates;
  }
  std::vector<PointResult> results;
  for (size_t i = 0; i < levels.size(); ++i) {
    absl::StatusOr<PointResult> point =
        RunPoint(clients, spec, levels[i], static_cast<int>(i), static_cast<int>(levels.size()));
    if (!point.ok()) return point.status();
    results.push_back(*std::move(point));
  }
  return results;
}

absl::StatusOr<std::vector<PointResult>> RunLoad(Client& client, const LoadSpec& spec) {
  Client* clients[] = {&client};
  return RunLoad(absl::MakeConstSpan(clients), spec);
}

bool MeetsThreshold(const PointResult& point, double latency_threshold_ms) {
  return point.ok > 0 && point.errors == 0 && point.latency.p99 <= latency_threshold_ms;
}

absl::StatusOr<SearchResult> SearchLoad(absl::Span<Client* const> clients,
                                        const LoadSpec& spec_in, const SearchSpec& search) {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  const bool closed = spec_in.mode == LoadMode::kClosed;
  const double cap = search.max_level > 0 ? search.max_level
                     : closed             ? 4096
                                          : std::numeric_limits<double>::infinity();
  if (!(search.latency_threshold_ms > 0) || !std::isfinite(search.latency_threshold_ms)) {
    return bad("latency threshold must be > 0 ms, got ", search.latency_threshold_ms);
  }
  if (!(search.start > 0) || !std::isfinite(search.start) ||
      (closed && search.start != std::floor(search.start))) {
    return bad("search start must be ", closed ? "an integer >= 1" : "> 0", ", got ",
               search.start);
  }
  if (!(search.max_level >= 0) || cap < search.start) {
    return bad("search max level must be >= its start (", search.start, "), got ",
               search.max_level);
  }
  if (search.max_points < 1) return bad("search max points must be >= 1, got ", search.max_points);
  if (!closed && !(search.resolution > 0)) {
    return bad("search resolution must be > 0, got ", search.resolution);
  }
  absl::StatusOr<LoadSpec> prepared = Prepare(clients, spec_in);
  if (!prepared.ok()) return prepared.status();
  const LoadSpec& spec = *prepared;

  SearchResult out;
  auto probe = [&](double level) -> absl::StatusOr<bool> {
    absl::StatusOr<PointResult> point = RunPoint(
        clients, spec, level, static_cast<int>(out.points.size()), search.max_points);
    if (!point.ok()) return point.status();
    const bool passed = MeetsThreshold(*point, search.latency_threshold_ms);
    out.points.push_back(*std::move(point));
    out.passed.push_back(passed);
    return passed;
  };
  double lo = 0, hi = 0;  // highest passing, lowest failing (0: none yet)
  // 1. Doubling until a level fails or the cap was probed.
  for (double level = search.start;;) {
    if (static_cast<int>(out.points.size()) >= search.max_points) {
      out.stopped = "max_points";
      break;
    }
    absl::StatusOr<bool> passed = probe(level);
    if (!passed.ok()) return passed.status();
    if (!*passed) {
      hi = level;
      break;
    }
    lo = level;
    if (level >= cap) {
      out.stopped = "max_level";
      break;
    }
    level = std::min(level * 2, cap);
  }
  if (hi > 0 && lo == 0) out.stopped = "first level failed";
  // 2. Bisection between the highest pass and the lowest failure.
  while (out.stopped.empty()) {
    if (closed ? hi - lo <= 1 : hi - lo <= search.resolution * lo) {
      out.stopped = "resolution";
      break;
    }
    if (static_cast<int>(out.points.size()) >= search.max_points) {
      out.stopped = "max_points";
      break;
    }
    const double mid = closed ? std::floor((lo + hi) / 2) : (lo + hi) / 2;
    absl::StatusOr<bool> passed = probe(mid);
    if (!passed.ok()) return passed.status();
    (*passed ? lo : hi) = mid;
  }
  out.found = lo > 0;
  out.best = lo;
  out.lowest_failed = hi;
  return out;
}

}  // namespace ropeattn::client
