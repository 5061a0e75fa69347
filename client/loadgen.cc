#include "client/loadgen.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <random>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"

namespace ropeattn::client {
namespace {

using Clock = std::chrono::steady_clock;

// Grace after a window's end before it is evaluated, so that requests that
// completed just before the boundary have been recorded.
constexpr auto kRecordGrace = std::chrono::milliseconds(20);
// Open-loop schedules start a little after the workers are launched, so the
// first arrivals are not late merely because threads were still starting.
constexpr auto kScheduleLead = std::chrono::milliseconds(20);

struct Record {
  Clock::time_point done;
  int64_t latency_ns = 0;
  absl::StatusCode code = absl::StatusCode::kOk;
  int64_t tokens = 0;
  bool late = false;
};

class Recorder {
 public:
  void Add(const Record& record) {
    absl::MutexLock lock(&mu_);
    records_.push_back(record);
  }
  // Records that completed in [begin, end).
  std::vector<Record> Between(Clock::time_point begin, Clock::time_point end) const {
    absl::MutexLock lock(&mu_);
    std::vector<Record> out;
    for (const Record& r : records_) {
      if (r.done >= begin && r.done < end) out.push_back(r);
    }
    return out;
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
  if (a.rope_type == "none") return;  // no positional encoding
  v1::RopeSpec* rope = spec->mutable_rope();
  if (a.rope_type.empty() || a.rope_type == "default") return;
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
  s->mutable_rope();
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

int64_t Nanos(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
}

// One Attend from `intended`; records it.
void RunAttend(Client& client, const Payload& p, const LoadSpec& spec, Clock::time_point intended,
               bool late, Recorder& recorder) {
  auto response = client.Attend(p.attend, spec.request_deadline);
  const auto done = Clock::now();
  recorder.Add({done, Nanos(done - intended), response.status().code(),
                response.ok() ? p.attend_tokens : 0, late});
}

// One session started at `start` (its scheduled arrival in open loop). Ends
// early on a stop or on the first failure (recorded as one failed request).
// `steps` overrides the spec's steps per session (the probe runs one).
absl::Status RunSession(Client& client, const Payload& p, const LoadSpec& spec,
                        Clock::time_point start, bool late, Recorder* recorder,
                        const StopFlag* stop, int64_t steps) {
  const DecodeShape& d = spec.decode;
  auto fail = [&](const absl::Status& status, Clock::time_point intended, bool is_late) {
    const auto done = Clock::now();
    if (recorder != nullptr) {
      recorder->Add({done, Nanos(done - intended), status.code(), 0, is_late});
    }
    return status;
  };
  auto session = client.OpenSession(p.open);
  if (!session.ok()) return fail(session.status(), start, late);
  if (d.context > 0) {
    auto prefill = p.layer_mode ? (*session)->StepHidden(p.prefill_hidden)
                                : (*session)->Step(p.prefill_q, p.prefill_k, p.prefill_v);
    if (!prefill.ok()) return fail(prefill.status(), start, late);
  }
  Clock::time_point intended = start;
  for (int64_t i = 0; i < steps; ++i) {
    if (i > 0) {
      intended = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                    absl::ToChronoNanoseconds(d.think_time));
      if (stop != nullptr && stop->WaitUntil(intended)) return absl::OkStatus();
    } else if (stop != nullptr && stop->stopped()) {
      return absl::OkStatus();
    }
    auto result = p.layer_mode ? (*session)->StepHidden(p.step_hidden)
                               : (*session)->Step(p.step_q, p.step_k, p.step_v);
    if (!result.ok()) return fail(result.status(), intended, i == 0 && late);
    const auto done = Clock::now();
    if (recorder != nullptr) {
      recorder->Add(
          {done, Nanos(done - intended), absl::StatusCode::kOk, d.tokens_per_step, i == 0 && late});
    }
  }
  return (*session)->Close();
}

void RunRequest(Client& client, const Payload& p, const LoadSpec& spec, Clock::time_point intended,
                bool late, Recorder& recorder, const StopFlag& stop) {
  if (spec.workload == Workload::kAttend) {
    RunAttend(client, p, spec, intended, late, recorder);
  } else {
    RunSession(client, p, spec, intended, late, &recorder, &stop, spec.decode.steps_per_session)
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

double OkPerSecond(const std::vector<Record>& records, double seconds) {
  int64_t ok = 0;
  for (const Record& r : records) ok += r.code == absl::StatusCode::kOk;
  return seconds > 0 ? static_cast<double>(ok) / seconds : 0;
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
  auto check_dtype = [&](v1::DType dtype, absl::string_view field) -> absl::Status {
    if (dtype != v1::DTYPE_F32 && dtype != v1::DTYPE_BF16) {
      return bad(field, " must be f32 or bf16, got ", static_cast<int>(dtype));
    }
    return absl::OkStatus();
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
    if (absl::Status s = check_dtype(d.dtype, "dtype"); !s.ok()) return s;
    if (absl::Status s = check_dtype(d.kv_dtype, "kv_dtype"); !s.ok()) return s;
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
  return absl::OkStatus();
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
  return RunSession(client, *payload, spec, Clock::now(), false, nullptr, nullptr, 1);
}

absl::StatusOr<PointResult> RunPoint(Client& client, const LoadSpec& spec_in, double level,
                                     int point_index, int points) {
  if (absl::Status s = ValidateLoadSpec(spec_in); !s.ok()) return s;
  absl::StatusOr<LoadSpec> resolved = ResolveLayerMode(client, spec_in);
  if (!resolved.ok()) return resolved.status();
  const LoadSpec& spec = *resolved;
  absl::StatusOr<Payload> payload_or = BuildPayload(spec);
  if (!payload_or.ok()) return payload_or.status();
  const Payload& payload = *payload_or;

  PointResult result;
  result.workload = spec.workload;
  result.mode = spec.mode;
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
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> workers;
  if (closed) {
    for (int i = 0; i < result.concurrency; ++i) {
      workers.emplace_back([&] {
        while (!stop.stopped()) {
          RunRequest(client, payload, spec, Clock::now(), false, recorder, stop);
        }
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
          RunRequest(client, payload, spec, intended, late, recorder, stop);
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
  auto report = [&](int window_index, const std::vector<Record>& records, double seconds) {
    if (!spec.on_window) return;
    progress.window = window_index;
    progress.throughput_rps = OkPerSecond(records, seconds);
    progress.errors = 0;
    for (const Record& r : records) progress.errors += r.code != absl::StatusCode::kOk;
    spec.on_window(progress);
  };

  std::this_thread::sleep_until(measure_start + kRecordGrace);
  report(0, recorder.Between(start, measure_start),
         std::chrono::duration<double>(measure_start - start).count());
  std::vector<double> live;
  int windows = 0;
  while (windows < spec.max_windows) {
    const Clock::time_point begin = measure_start + windows * window;
    const Clock::time_point end = begin + window;
    std::this_thread::sleep_until(end + kRecordGrace);
    ++windows;
    std::vector<Record> records = recorder.Between(begin, end);
    live.push_back(OkPerSecond(records, window_seconds));
    report(windows, records, window_seconds);
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
  std::vector<int64_t> latencies;
  int64_t tokens = 0;
  for (const Record& r : recorder.Between(final_begin, final_end)) {
    ++result.requests;
    ++result.codes[r.code];
    result.late += r.late;
    if (r.code == absl::StatusCode::kOk) {
      ++result.ok;
      tokens += r.tokens;
      latencies.push_back(r.latency_ns);
    }
  }
  result.errors = result.requests - result.ok;
  result.throughput_rps = static_cast<double>(result.ok) / result.measured_seconds;
  result.tokens_per_s = static_cast<double>(tokens) / result.measured_seconds;
  std::sort(latencies.begin(), latencies.end());
  LatencyStats& l = result.latency;
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
  return result;
}

absl::StatusOr<std::vector<PointResult>> RunLoad(Client& client, const LoadSpec& spec_in) {
  if (absl::Status s = ValidateLoadSpec(spec_in); !s.ok()) return s;
  // The model's hidden_size is asked once for the whole sweep.
  absl::StatusOr<LoadSpec> resolved = ResolveLayerMode(client, spec_in);
  if (!resolved.ok()) return resolved.status();
  const LoadSpec& spec = *resolved;
  if (absl::Status s = ProbeWorkload(client, spec); !s.ok()) return s;
  std::vector<double> levels;
  if (spec.mode == LoadMode::kClosed) {
    levels.assign(spec.concurrency.begin(), spec.concurrency.end());
  } else {
    levels = spec.rates;
  }
  std::vector<PointResult> results;
  for (size_t i = 0; i < levels.size(); ++i) {
    absl::StatusOr<PointResult> point =
        RunPoint(client, spec, levels[i], static_cast<int>(i), static_cast<int>(levels.size()));
    if (!point.ok()) return point.status();
    results.push_back(*std::move(point));
  }
  return results;
}

}  // namespace ropeattn::client
