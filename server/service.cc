#include "server/service.h"

#include <algorithm>
#include <array>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "core/cpu.h"
#include "core/rope.h"
#include "core/status_macros.h"
#include "google/protobuf/stubs/logging.h"
#include "grpc/compression.h"
#include "grpc/grpc.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "server/admission.h"
#include "server/auth.h"
#include "server/call_log.h"
#include "server/convert.h"
#include "server/decode_wire.h"
#include "server/handlers.h"
#include "server/layer.h"
#include "server/log.h"
#include "server/wire_bound.h"

// The algorithm a call's client declared for its messages (grpc-encoding),
// parsed by gRPC 1.51's call layer and kept from the application's
// metadata: exported by libgrpc, declared in its internal
// src/core/lib/surface/call_test_only.h, which is not installed.
grpc_compression_algorithm grpc_call_test_only_get_compression_algorithm(grpc_call* call);

namespace ropeattn::server {
namespace {

constexpr char kVersion[] = "0.2.0";

double SecondsSince(absl::Time t) { return absl::ToDoubleSeconds(absl::Now() - t); }

// `queue`: "compute" (the workers), or "control" (opens, forks, exports).
grpc::Status QueueFull(const Executor& executor, const char* method,
                       const char* queue = "compute") {
  return grpc::Status(
      grpc::StatusCode::RESOURCE_EXHAUSTED,
      absl::StrFormat("%s: the %s queue is full (%d of %d waiting; past three quarters of it, a "
                      "caller already holding an equal share of it is refused); retry with "
                      "backoff or raise --queue_depth",
                      method, queue, executor.queue_depth(), executor.capacity()));
}

}  // namespace

// ------------------------------------------------------------- unary --

namespace {
// Protobuf reports why a string field failed to parse (not UTF-8) through
// its log, naming the field; while a request is parsed on this thread its
// messages are kept here for the answer (and otherwise go to our log).
thread_local std::string* t_parse_errors = nullptr;

void ProtobufLogHandler(google::protobuf::LogLevel level, const char* file, int line,
                        const std::string& message) {
  if (t_parse_errors != nullptr) {
    if (!t_parse_errors->empty()) t_parse_errors->append("; ");
    t_parse_errors->append(message);
    return;
  }
  LogEvent(level >= google::protobuf::LOGLEVEL_ERROR ? LogLevel::kError : LogLevel::kWarning,
           "protobuf", {{"message", message}, {"file", file}, {"line", line}});
}

}  // namespace

AttentionServiceImpl::AttentionServiceImpl(const ServerOptions& options, Executor* executor,
                                           Executor* control, SessionManager* sessions,
                                           Metrics* metrics, const ModelRegistry* models,
                                           MemoryBudget* budget,
                                           const Authenticator* authenticator)
    : options_(options),
      executor_(executor),
      control_(control),
      sessions_(sessions),
      metrics_(metrics),
      models_(models),
      budget_(budget),
      info_overdraft_(SatMul(std::max<int64_t>(options.max_message_bytes, 0), 2)),
      limits_{options.max_message_bytes, options.max_request_compute},
      auth_configured_(AuthConfigured(options)),
      authenticator_(authenticator),
      admission_(options.compute_workers, absl::Seconds(options.max_queue_delay_seconds),
                 options.max_queue_slowdown),
      answer_watch_(absl::Seconds(options.answer_timeout_seconds)) {
  // Installed once, before any call: protobuf's messages (a request's
  // string field that is not UTF-8, while it is parsed) reach the answer or
  // the JSON log, never stderr as plain text.
  static absl::once_flag once;
  absl::call_once(once, [] { google::protobuf::SetLogHandler(&ProtobufLogHandler); });
}

AttentionServiceImpl::~AttentionServiceImpl() = default;

AttentionServiceImpl::ComputeScope::ComputeScope(AttentionServiceImpl* service, const char* method)
    : service_(service), method_(method), start_(absl::Now()) {
  service_->metrics_->SetRunning(service_->computing_.fetch_add(1) + 1);
}

AttentionServiceImpl::ComputeScope::~ComputeScope() {
  service_->metrics_->RecordComputeTime(method_, SecondsSince(start_));
  service_->metrics_->SetRunning(service_->computing_.fetch_sub(1) - 1);
}

std::string AttentionServiceImpl::FairShareKey(const grpc::ServerContextBase& ctx) const {
  if (auth_configured_) {
    absl::StatusOr<Principal> p = CallerOf(ctx);
    if (p.ok()) return absl::StrCat("principal:", p->name);
  }
  // Without authentication every caller is anonymous: one share per
  // connection.
  return absl::StrCat("peer:", ctx.peer());
}

absl::StatusOr<Principal> AttentionServiceImpl::CallerOf(const grpc::ServerContextBase& ctx) const {
  if (!auth_configured_) return Principal{};
  if (authenticator_ == nullptr) return absl::InternalError("no authenticator");
  return authenticator_->Identify(ctx);
}

absl::StatusOr<Principal> AttentionServiceImpl::AuthenticateCall(
    const grpc::ServerContextBase& ctx) const {
  if (!auth_configured_ || authenticator_ == nullptr) return CallerOf(ctx);
  const char* reason = "";
  absl::StatusOr<Principal> principal = authenticator_->Identify(ctx, &reason);
  if (!principal.ok()) CountAuthRefusal(principal.status(), reason);
  return principal;
}

void AttentionServiceImpl::CountAuthRefusal(const absl::Status& status, const char* reason) const {
  if (absl::IsUnauthenticated(status)) metrics_->RecordAuthRefused(reason);
}

namespace {

// The call's deadline as absl time (none: InfiniteFuture).
absl::Time DeadlineOf(const grpc::CallbackServerContext* ctx) {
  // The raw gpr_timespec: ctx->deadline() is a system_clock time in int64
  // nanoseconds, which wraps past the year 2262 (a grpc-timeout of 2562047H,
  // what grpc-go sends for the largest Go duration, came back as passed).
  const gpr_timespec raw = ctx->raw_deadline();
  if (gpr_time_cmp(raw, gpr_inf_future(raw.clock_type)) == 0) return absl::InfiniteFuture();
  const gpr_timespec real = gpr_convert_clock_type(raw, GPR_CLOCK_REALTIME);
  const absl::Time now = absl::Now();
  if (real.tv_sec >= absl::ToUnixSeconds(now) + int64_t{365} * 24 * 3600) {
    return absl::InfiniteFuture();  // a year or more away: no deadline to plan for
  }
  return absl::FromUnixSeconds(real.tv_sec) + absl::Nanoseconds(real.tv_nsec);
}

// The text of a call's or operation's end when its answer was not taken in
// time (its log line, a Decode stream's status).
std::string AnswerNotTaken(double timeout_seconds) {
  return absl::StrFormat(
      "the answer was not taken within --answer_timeout_seconds (%g s): the call was cancelled "
      "with the answer undelivered",
      timeout_seconds);
}

// The code a client saw for an answer that never reached it: its deadline
// (or its client's timer just before it), else a cancellation.
int UndeliveredCode(const StopToken& stop) {
  const absl::Status status = stop.status();
  return static_cast<int>(status.ok() ? absl::StatusCode::kCancelled : status.code());
}

// SetDecodeReadDoneHookForTest's hook; read_done_hook_set keeps the lock
// off every read when no test set one.
std::atomic<bool> read_done_hook_set{false};
absl::Mutex read_done_hook_mu(absl::kConstInit);
std::function<void(bool)>* read_done_hook ABSL_GUARDED_BY(read_done_hook_mu) = nullptr;

void RunReadDoneHookForTest(bool ok) {
  if (!read_done_hook_set.load(std::memory_order_acquire)) return;
  std::function<void(bool)> hook;
  {
    absl::MutexLock lock(&read_done_hook_mu);
    if (read_done_hook != nullptr) hook = *read_done_hook;
  }
  if (hook) hook(ok);
}

}  // namespace

void SetDecodeReadDoneHookForTest(std::function<void(bool ok)> hook) {
  absl::MutexLock lock(&read_done_hook_mu);
  delete read_done_hook;
  read_done_hook = hook ? new std::function<void(bool)>(std::move(hook)) : nullptr;
  read_done_hook_set.store(read_done_hook != nullptr, std::memory_order_release);
}

// One unary call: owns its typed request and response (parsed from and
// serialized to gRPC's buffers here), the call's stop token (cancelled by
// gRPC's OnCancel, or past the deadline) and its memory reservation, all
// alive until gRPC is done with the call, answer included.
class UnaryCall : public grpc::ServerUnaryReactor {
 public:
  UnaryCall(AttentionServiceImpl* service, grpc::CallbackServerContext* ctx, grpc::ByteBuffer* out,
            const char* method)
      : service_(service),
        ctx_(ctx),
        out_(out),
        method_(method),
        arrived_(absl::Now()),
        peer_(ctx->peer()),
        watch_(service->WatchAnswers()->Watch(ctx)) {
    stop_.set_deadline(DeadlineOf(ctx));
    service_->CallStarted();
  }
  void OnCancel() override {
    stop_.Cancel();
    // Still queued: abandoned now (answered, its memory released), not when
    // a worker would reach it.
    service_->DropStopped();
  }
  void OnDone() override {
    watch_->Ended();
    Count();
    AttentionServiceImpl* service = service_;
    delete this;  // the reservation goes before the call counts as ended
    service->CallEnded();
  }
  StopToken& stop() { return stop_; }
  void Hold(MemoryBudget::Reservation r) { reservation_ = std::move(r); }
  // A message living as long as the call.
  template <typename T>
  T* Own() {
    auto m = std::make_unique<T>();
    T* raw = m.get();
    messages_.push_back(std::move(m));
    return raw;
  }
  // The message answered on success.
  void SetResponse(const google::protobuf::MessageLite* response) { response_ = response; }
  // What parsing the request took beyond its wire bytes (ParseRequest),
  // held while the request is.
  MemoryBudget::Reservation* parse_reservation() { return &parse_held_; }
  // Finishes with `status`, and with the response when it is OK. Every
  // answer (computed, control call or refusal) is watched: a client that
  // does not take it within --answer_timeout_seconds has the call cancelled.
  // `seconds`: the request's latency (ropeattn_request_duration_seconds),
  // counted with the call's code when gRPC is done with it (OnDone).
  void Answer(const grpc::Status& status, double seconds) {
    service_->WatchAnswer(watch_);
    seconds_ = seconds;
    if (!status.ok() || response_ == nullptr) {
      // Nothing computes for this call any more (refused, or its compute
      // returned): what it held goes now, not when a slow client takes the
      // status.
      response_ = nullptr;
      messages_.clear();
      parse_held_.Release();
      reservation_.Release();
      FinishCounted(status);
      return;
    }
    bool own_buffer = false;
    grpc::Status written =
        grpc::SerializationTraits<google::protobuf::MessageLite>::Serialize(*response_, out_,
                                                                           &own_buffer);
    // Serialized: the typed messages go now, not when the answer is taken.
    response_ = nullptr;
    messages_.clear();
    parse_held_.Release();
    FinishCounted(written.ok() ? status
                               : grpc::Status(grpc::StatusCode::INTERNAL,
                                              absl::StrCat("the answer could not be serialized: ",
                                                           written.error_message())));
  }

 private:
  void FinishCounted(const grpc::Status& status) {
    code_ = static_cast<int>(status.error_code());
    Finish(status);
  }
  // Counted once, when gRPC is done with the call (its answer delivered or
  // not): under the code it was answered with, unless the answer timeout
  // cancelled it with its answer untaken, which the client never had: that
  // is CANCELLED (and logged: its status line said otherwise). Its latency
  // is the request's either way, to its answer.
  void Count() {
    if (code_ < 0) return;  // never answered (gRPC always runs Answer's Finish)
    Metrics* metrics = service_->metrics_;
    int code = code_;
    // The watch may fire as the answer leaves: only a call it did cancel
    // (its status undelivered) is the timeout's.
    const bool cancelled = ctx_->IsCancelled();
    if (cancelled && watch_->TimedOut()) {
      code = static_cast<int>(grpc::StatusCode::CANCELLED);
      metrics->RecordAnswerTimedOut(method_);
      LogAnswerTimedOut(
          *ctx_, absl::StrCat("/", v1::AttentionService::service_full_name(), "/", method_),
          AnswerNotTaken(service_->options_.answer_timeout_seconds), absl::Now() - arrived_,
          peer_);
    } else if (cancelled) {
      // Its status never reached the client: the deadline passed while the
      // answer was on its way, or the client cancelled. The client saw that.
      code = UndeliveredCode(stop_);
    }
    metrics->RecordRequest(method_, code, seconds_);
  }

  AttentionServiceImpl* const service_;
  grpc::CallbackServerContext* const ctx_;
  grpc::ByteBuffer* const out_;
  const char* const method_;
  const absl::Time arrived_;
  const std::string peer_;  // read now: a cancelled call's peer is "unknown"
  const std::shared_ptr<AnswerWatch::Handle> watch_;
  int code_ = -1;         // the status answered, -1 before
  double seconds_ = 0.0;  // the request's latency, to its answer
  StopToken stop_;
  MemoryBudget::Reservation reservation_;
  std::vector<std::unique_ptr<google::protobuf::MessageLite>> messages_;
  MemoryBudget::Reservation parse_held_;
  const google::protobuf::MessageLite* response_ = nullptr;
};

namespace {
// Parses one request message from gRPC's bytes; INVALID_ARGUMENT naming the
// message type (and the field, for a string that is not UTF-8) when the
// bytes are not one.
//
// Its cost is checked first: the memory protobuf may allocate beyond the
// wire bytes (repeated numbers widen 8x and more, unknown fields take an
// entry each: 32 MiB of one-byte token ids parsed into ~512 MiB) is
// reserved from `budget` into `*held` for as long as the message is kept,
// or the request is refused RESOURCE_EXHAUSTED before it is parsed.
absl::Status ParseRequest(const grpc::ByteBuffer& in, google::protobuf::Message* message,
                          MemoryBudget* budget, MemoryBudget::Reservation* held) {
  std::optional<int64_t> bound;
  {
    grpc::ByteBuffer scan(in);
    grpc::ProtoBufferReader reader(&scan);
    bound = ParsedBytesBound(&reader, message->GetDescriptor());
  }
  // Bytes the walk cannot follow are not parsed at all (protobuf would
  // refuse them too; parsing them unpriced is what must not happen).
  if (!bound.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the message is not a valid ", message->GetTypeName(),
        ": its bytes are not protobuf wire format for it (truncated or corrupt)"));
  }
  // A small request's object overhead is in the server's fixed allowance
  // (README "Limits"), not worth a reservation.
  constexpr int64_t kSlackBytes = int64_t{64} << 10;
  const int64_t beyond = *bound - static_cast<int64_t>(in.Length());
  if (beyond > kSlackBytes) {
    RA_ASSIGN_OR_RETURN(
        *held, budget->Reserve(beyond, absl::StrCat("parsing this ", message->GetTypeName(), " (",
                                                    in.Length(),
                                                    " wire bytes; its repeated numbers, nested "
                                                    "messages and unknown fields take more in "
                                                    "memory)")));
  }
  grpc::ByteBuffer copy(in);  // shares the slices; Deserialize consumes its buffer
  std::string errors;
  t_parse_errors = &errors;
  const absl::Cleanup stop_capture = [] { t_parse_errors = nullptr; };
  grpc::Status parsed;
  try {
    parsed = grpc::SerializationTraits<google::protobuf::MessageLite>::Deserialize(&copy, message);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the server ran out of memory parsing this ", message->GetTypeName()));
  }
  if (parsed.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the message is not a valid ", message->GetTypeName(), ": ",
      errors.empty() ? "its bytes are not protobuf wire format for it (truncated or corrupt)"
                     : errors));
}
}  // namespace

template <typename Req, typename Resp>
grpc::ServerUnaryReactor* AttentionServiceImpl::ServeUnary(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in, grpc::ByteBuffer* out,
    const char* method,
    void (AttentionServiceImpl::*handler)(UnaryCall*, grpc::CallbackServerContext*, const Req*,
                                          Resp*)) {
  auto* call = new UnaryCall(this, ctx, out, method);
  Req* request = call->Own<Req>();
  Resp* response = call->Own<Resp>();
  call->SetResponse(response);
  if (!in->Valid()) {
    // No message came: the call ended (deadline, cancellation) before its
    // request arrived, or the client half-closed without one.
    // A client that resets the call before its message is complete is by
    // far the common case; gRPC may not have marked it cancelled yet.
    absl::Status none = call->stop().status();
    if (none.ok()) {
      none = absl::CancelledError(
          "the call ended before its request message arrived (cancelled by the client, or "
          "closed without one)");
    }
    call->Answer(ToGrpcStatus(none), 0.0);
    return call;
  }
  const absl::Status parsed = ParseRequest(*in, request, budget_, call->parse_reservation());
  // The wire bytes are not needed once parsed: gRPC would keep them until
  // the call ends, beside the parsed request (twice a large request's size
  // for its whole compute). gRPC does not read them after this handler.
  const_cast<grpc::ByteBuffer*>(in)->Clear();
  if (!parsed.ok()) {
    call->Answer(ToGrpcStatus(parsed), 0.0);
    return call;
  }
  (this->*handler)(call, ctx, request, response);
  return call;
}

#define ROPEATTN_SERVE_UNARY(Name, Req, Resp)                                            \
  grpc::ServerUnaryReactor* AttentionServiceImpl::Name(                                  \
      grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in, grpc::ByteBuffer* out) { \
    return ServeUnary<Req, Resp>(ctx, in, out, #Name, &AttentionServiceImpl::Do##Name);   \
  }
ROPEATTN_SERVE_UNARY(Attend, v1::AttendRequest, v1::AttendResponse)
ROPEATTN_SERVE_UNARY(Encode, v1::EncodeRequest, v1::EncodeResponse)
ROPEATTN_SERVE_UNARY(Embed, v1::EmbedRequest, v1::EmbedResponse)
ROPEATTN_SERVE_UNARY(GetSession, v1::GetSessionRequest, v1::SessionInfo)
ROPEATTN_SERVE_UNARY(ListSessions, v1::ListSessionsRequest, v1::ListSessionsResponse)
ROPEATTN_SERVE_UNARY(CloseSession, v1::CloseSessionRequest, v1::CloseSessionResponse)
ROPEATTN_SERVE_UNARY(GetServerInfo, v1::GetServerInfoRequest, v1::ServerInfo)
ROPEATTN_SERVE_UNARY(ListModels, v1::ListModelsRequest, v1::ListModelsResponse)
ROPEATTN_SERVE_UNARY(GetModel, v1::GetModelRequest, v1::ModelInfo)
#undef ROPEATTN_SERVE_UNARY

absl::Duration AttentionServiceImpl::QueueRetryHint(const Executor::Ahead& ahead) const {
  return admission_.QueueRetryHint(ahead);
}

absl::StatusOr<MemoryBudget::Reservation> AttentionServiceImpl::ReserveInfoCopy(
    int64_t bytes, const std::string& what, bool fallback) {
  absl::StatusOr<MemoryBudget::Reservation> held = budget_->Reserve(bytes, what);
  if (held.ok() || !fallback) return held;
  absl::StatusOr<MemoryBudget::Reservation> over = info_overdraft_.Reserve(bytes, what);
  if (over.ok()) return over;
  return held;
}

absl::Duration AttentionServiceImpl::CanaryAllowance() const {
  constexpr double kUnmeasuredUnitsPerSecond = 1e9;
  const Executor::Ahead ahead = executor_->WorkAhead("", 1);
  double seconds = 0;
  const auto estimate = [&](const char* kind, int64_t units) {
    const std::optional<double> s = admission_.ServiceSeconds(kind, units);
    seconds += s.has_value() ? *s : static_cast<double>(units) / kUnmeasuredUnitsPerSecond;
  };
  // Running work counts whole (an upper bound: the canary must not take a
  // replica out of rotation for work that ran past its estimate).
  for (const Executor::Running& r : ahead.running) estimate(r.kind, r.compute);
  for (const Executor::Queued& q : ahead.queued) estimate(q.kind, q.compute);
  seconds /= std::max(1, executor_->workers());
  return std::min(absl::Seconds(20) + absl::Seconds(2 * seconds), absl::Hours(1));
}

template <typename PriceFn, typename RunFn>
void AttentionServiceImpl::RunOnExecutor(UnaryCall* call, grpc::CallbackServerContext* ctx,
                                         const char* method, PriceFn price, RunFn run,
                                         bool may_inline) {
  const absl::Time start = absl::Now();
  auto refuse = [&](const absl::Status& status) {
    call->Answer(ToGrpcStatus(status), SecondsSince(start));
  };
  // Priced and checked on this thread, before anything is allocated or queued.
  absl::StatusOr<Cost> cost = price();
  if (!cost.ok()) return refuse(cost.status());
  if (absl::Status st = CheckCost(*cost, limits_, method); !st.ok()) return refuse(st);
  // Can it finish inside its deadline, and is the wait for a worker short
  // enough? Refused now rather than computed for a caller who gave up.
  const std::string share = FairShareKey(*ctx);
  absl::Duration retry_after;
  const auto ahead = executor_->WorkAhead(share, cost->compute);
  if (absl::Status st = admission_.Admit(method, cost->compute, DeadlineOf(ctx), absl::Now(),
                                         &retry_after, /*slowdown_applies=*/true, &ahead);
      !st.ok()) {
    if (retry_after != absl::InfiniteDuration()) {  // else no retry can be admitted
      ctx->AddTrailingMetadata("retry-after-ms",
                               absl::StrCat(absl::ToInt64Milliseconds(retry_after)));
    }
    metrics_->RecordRejected(method);
    return refuse(st);
  }
  const int64_t compute = cost->compute;
  absl::StatusOr<MemoryBudget::Reservation> held =
      budget_->Reserve(cost->transient_bytes, absl::StrCat("this ", method, " request"));
  if (!held.ok()) {
    admission_.Finished(method, compute, -1);
    return refuse(held.status());
  }
  call->Hold(*std::move(held));
  const absl::Time queued_at = absl::Now();
  // The request on `threads` kernel threads, its answer planned for
  // threads_per_call either way (the same bytes inline or on a worker).
  auto body = [this, call, method, start, queued_at, compute, run](int threads) mutable {
    metrics_->RecordQueueTime(method, SecondsSince(queued_at));
    // A call cancelled or past its deadline while it waited is not started.
    absl::Status status = call->stop().status();
    if (!status.ok()) {
      metrics_->RecordAbandoned(method);
      admission_.Finished(method, compute, -1);
    } else {
      ComputeScope computing(this, method);
      const absl::Time ran = absl::Now();
      status = run(&call->stop(), threads);
      // Only a request run to its end teaches the rate.
      admission_.Finished(method, compute, status.ok() ? SecondsSince(ran) : -1);
    }
    Executor::ComputeDone();  // before the caller can have the answer
    // Stopped mid-way: the stop's own code, not the kernel's.
    if (!status.ok() && call->stop().ShouldStop()) status = call->stop().status();
    call->Answer(ToGrpcStatus(status), SecondsSince(start));
  };
  // A small request finding a worker idle runs here, on one thread: two
  // thread hand-offs would cost more than its compute (docs/scheduler.md).
  if (may_inline && compute <= kInlineMaxCompute &&
      executor_->TryRunInline([&body] { body(1); })) {
    return;
  }
  // With the call's stop token: cancelled or expired while it waits, it
  // leaves the queue at once (Executor, "Dead entries").
  const bool queued = executor_->TrySubmit(
      share, compute, [body, threads = options_.threads_per_call]() mutable { body(threads); },
      method, &call->stop());
  if (!queued) {
    admission_.Finished(method, compute, -1);
    metrics_->RecordRejected(method);
    ctx->AddTrailingMetadata(
        "retry-after-ms",
        absl::StrCat(absl::ToInt64Milliseconds(QueueRetryHint(executor_->WorkAhead(share, compute)))));
    call->Answer(QueueFull(*executor_, method), SecondsSince(start));
  }
  metrics_->SetQueueDepth(executor_->queue_depth());
}

void AttentionServiceImpl::DoAttend(UnaryCall* call, grpc::CallbackServerContext* ctx,
                                   const v1::AttendRequest* request, v1::AttendResponse* response) {
  const int threads = options_.threads_per_call;
  const ModelRegistry* models = models_;
  RunOnExecutor(
      call, ctx, "Attend",
      [&]() -> absl::StatusOr<Cost> {
        if (request->has_layer()) return PriceLayerAttend(*models, *request, threads);
        return PriceAttend(*request, threads);
      },
      [request, response, plan = threads, models](const StopToken* stop, int threads) {
        const ComputeOptions o{threads, stop, plan};
        if (request->has_layer()) return RunLayerAttend(*models, *request, response, o);
        return RunAttend(*request, response, o);
      },
      /*may_inline=*/!request->has_layer());
}

void AttentionServiceImpl::DoEncode(UnaryCall* call, grpc::CallbackServerContext* ctx,
                                   const v1::EncodeRequest* request, v1::EncodeResponse* response) {
  const int threads = options_.threads_per_call;
  RunOnExecutor(
      call, ctx, "Encode", [&] { return PriceEncode(*request); },
      [request, response, plan = threads](const StopToken* stop, int threads) {
        return RunEncode(*request, response, ComputeOptions{threads, stop, plan});
      },
      /*may_inline=*/true);
}

void AttentionServiceImpl::DoEmbed(UnaryCall* call, grpc::CallbackServerContext* ctx,
                                   const v1::EmbedRequest* request, v1::EmbedResponse* response) {
  const ModelRegistry* models = models_;
  RunOnExecutor(
      call, ctx, "Embed", [&] { return PriceEmbed(*models, *request); },
      [request, response, models](const StopToken*, int) {
        return RunEmbed(*models, *request, response);
      },
      /*may_inline=*/true);
}

void AttentionServiceImpl::DoListModels(UnaryCall* call, grpc::CallbackServerContext* ctx,
                                     const v1::ListModelsRequest* request, v1::ListModelsResponse* response) {
  const absl::Time start = absl::Now();
  for (const auto& m : models_->List()) FillModelInfo(*m, response->add_models());
  call->Answer(grpc::Status::OK, SecondsSince(start));
}

void AttentionServiceImpl::DoGetModel(UnaryCall* call, grpc::CallbackServerContext* ctx,
                                     const v1::GetModelRequest* request, v1::ModelInfo* response) {
  const absl::Time start = absl::Now();
  auto model = models_->Get(request->name());
  absl::Status status = model.status();
  if (model.ok()) FillModelInfo(**model, response);
  call->Answer(ToGrpcStatus(status), SecondsSince(start));
}

absl::Status AttentionServiceImpl::HoldInfoAnswer(UnaryCall* call, const std::string& id,
                                                  const Principal& caller, const char* method) {
  // The answer copies the session's spec and serializes it: past a 64 KiB
  // slack, held from the budget until the call ends.
  const int64_t bytes = sessions_->InfoAnswerBytes(id, caller);
  if (bytes <= kInfoAnswerSlackBytes) return absl::OkStatus();
  RA_ASSIGN_OR_RETURN(MemoryBudget::Reservation held,
                      ReserveInfoCopy(bytes,
                                      absl::StrCat("this ", method,
                                                   " answer's SessionInfo (its spec)"),
                                      /*fallback=*/true));
  call->Hold(std::move(held));
  return absl::OkStatus();
}

// Operator calls are cheap bookkeeping: answered inline, so an overloaded
// compute queue never hides the server's state from its operators.
void AttentionServiceImpl::DoGetSession(UnaryCall* call, grpc::CallbackServerContext* ctx,
                                     const v1::GetSessionRequest* request, v1::SessionInfo* response) {
  const absl::Time start = absl::Now();
  absl::StatusOr<Principal> caller = AuthenticateCall(*ctx);
  absl::Status held = caller.ok() ? HoldInfoAnswer(call, request->session_id(), *caller, "GetSession")
                                  : caller.status();
  absl::StatusOr<v1::SessionInfo> info =
      held.ok() ? sessions_->Info(request->session_id(), *caller) : held;
  absl::Status status = info.status();
  if (info.ok()) *response = *std::move(info);
  call->Answer(ToGrpcStatus(status), SecondsSince(start));
}

void AttentionServiceImpl::DoListSessions(UnaryCall* call, grpc::CallbackServerContext* ctx,
                                     const v1::ListSessionsRequest* request, v1::ListSessionsResponse* response) {
  const absl::Time start = absl::Now();
  absl::Status status = [&]() -> absl::Status {
    RA_ASSIGN_OR_RETURN(const Principal caller, AuthenticateCall(*ctx));
    if (request->page_size() < 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "page_size = %d: must be >= 0 (0: as many sessions as fit in one answer)",
          request->page_size()));
    }
    // A token is an earlier answer's next_page_token: a session id. Anything
    // else (a typo, another server's token) would end the listing silently.
    const std::string& token = request->page_token();
    if (!token.empty() && (token.size() != kMaxSessionIdBytes ||
                           !std::all_of(token.begin(), token.end(), [](char c) {
                             return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
                           }))) {
      return absl::InvalidArgumentError(
          absl::StrCat("page_token ", QuoteForMessage(token),
                       " is not a next_page_token of this server (32 hex digits)"));
    }
    // The page is planned from the sessions' sizes before anything is
    // copied: it fits in one message (its token too), and its typed and
    // serialized copies are held from the memory budget while it is built
    // and sent.
    const int64_t room = limits_.max_message_bytes - kReplyOverheadBytes;
    SessionManager::ListPage page =
        sessions_->PlanList(caller, request->page_token(), request->page_size(), room);
    // Its typed copies and its serialized bytes, held from the budget; a
    // page the budget cannot hold is cut (halved, with next_page_token set)
    // down to one whose copies fit in a 64 KiB slack (as a small parse's),
    // so an operator can list when sessions fill the budget.
    for (;;) {
      const int64_t answer_memory = SatAdd(page.memory, page.bytes);
      if (answer_memory <= kInfoAnswerSlackBytes) break;
      // A page of one session may take the overdraft: a listing never
      // stops for good at a session with a large spec.
      absl::StatusOr<MemoryBudget::Reservation> held = ReserveInfoCopy(
          answer_memory,
          absl::StrFormat("this ListSessions answer (%d sessions, up to %d bytes)",
                          page.ids.size(), page.bytes),
          /*fallback=*/page.ids.size() <= 1);
      if (held.ok()) {
        call->Hold(*std::move(held));
        break;
      }
      if (page.ids.size() <= 1) return held.status();
      page = sessions_->PlanList(caller, request->page_token(),
                                 static_cast<int64_t>(page.ids.size() / 2), room);
    }
    for (v1::SessionInfo& info : sessions_->FillList(page.ids, caller)) {
      *response->add_sessions() = std::move(info);
    }
    if (page.more) response->set_next_page_token(page.ids.back());
    return absl::OkStatus();
  }();
  call->Answer(ToGrpcStatus(status), SecondsSince(start));
}

void AttentionServiceImpl::DoCloseSession(UnaryCall* call, grpc::CallbackServerContext* ctx,
                                     const v1::CloseSessionRequest* request, v1::CloseSessionResponse* response) {
  const absl::Time start = absl::Now();
  absl::StatusOr<Principal> caller = AuthenticateCall(*ctx);
  // Its answer's copies are paid from the room the session reserved for
  // them (a close must work on a full budget), held until the call ends:
  // the answer may wait unread for --answer_timeout_seconds.
  absl::StatusOr<SessionManager::Closed> closed =
      caller.ok() ? sessions_->Close(request->session_id(), "closed", *caller) : caller.status();
  absl::Status status = closed.status();
  if (closed.ok()) {
    call->Hold(std::move(closed->answer));
    *response->mutable_session() = std::move(closed->info);
  }
  call->Answer(ToGrpcStatus(status), SecondsSince(start));
}

void AttentionServiceImpl::DoGetServerInfo(UnaryCall* call, grpc::CallbackServerContext* ctx,
                                          const v1::GetServerInfoRequest* request,
                                          v1::ServerInfo* r) {
  const absl::Time start = absl::Now();
  r->set_version(kVersion);
  r->set_cpu(CpuDescription());
  for (const char* c : {"attend",
                        "encode",
                        "decode",
                        "softmax",
                        "linear",
                        "gqa",
                        "f32",
                        "bf16",
                        "rope:half_split",
                        "rope:interleaved",
                        "alibi",
                        "t5",
                        "causal",
                        "window",
                        "softcap",
                        "padding",
                        "truncate",
                        "fork",
                        "resumable",
                        "int8",
                        "prefix",
                        "export_kv",
                        "layer",
                        "embed"}) {
    r->add_capabilities(c);
  }
  // One entry per RoPE rule of the core's registry.
  for (const RopeRule& rule : RopeRules()) r->add_capabilities(absl::StrCat("rope:", rule.name));
  r->set_compute_threads(executor_->workers());
  r->set_threads_per_call(options_.threads_per_call);
  r->set_max_message_bytes(options_.max_message_bytes);
  r->set_max_sessions(options_.max_sessions);
  r->set_kv_budget_bytes(options_.memory_budget_bytes);
  r->set_memory_budget_bytes(budget_->budget());
  r->set_memory_bytes_in_use(budget_->in_use());
  r->set_max_request_compute(options_.max_request_compute);
  // Session figures: the caller's own under authentication (an admin's:
  // all); the budget and the queue are the server's.
  absl::StatusOr<Principal> caller = CallerOf(*ctx);
  const SessionManager::Counts counts =
      caller.ok() ? sessions_->CountsFor(*caller) : SessionManager::Counts{};
  r->set_kv_bytes_in_use(counts.kv_bytes);
  r->set_open_sessions(counts.open);
  r->set_attached_sessions(counts.attached);
  r->set_default_idle_ttl_seconds(options_.default_idle_ttl_seconds);
  r->set_max_idle_ttl_seconds(options_.max_idle_ttl_seconds);
  r->set_default_max_context(options_.default_max_context);
  r->set_queue_depth(static_cast<int32_t>(executor_->queue_depth()));
  r->set_queue_capacity(executor_->capacity());
  r->set_reaped_sessions(counts.reaped);
  call->Answer(grpc::Status::OK, SecondsSince(start));
}

// ------------------------------------------------------------ Decode --

// One Decode stream. Strictly one operation at a time: read a message, run it
// (on the executor; attach, truncate and close inline), write the answer,
// only then read the next. So steps are
// answered in order, at most one write is ever queued (a slow reader cannot
// grow server memory), and a session is never used by two steps at once.
class DecodeReactor : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                      public BatchTask {
 public:
  DecodeReactor(AttentionServiceImpl* service, grpc::CallbackServerContext* ctx)
      : service_(service),
        ctx_(ctx),
        principal_(service->AuthenticateCall(*ctx)),
        share_(service->FairShareKey(*ctx)),
        watch_(service->WatchAnswers()->Watch(ctx)) {
    stop_.set_deadline(DeadlineOf(ctx));
    const bool drained_without_it = !service_->Register(this);
    // A caller the server cannot authenticate is answered now, not after
    // its first message: an open stream costs memory however idle it is.
    // Refused as it starts: counted under Decode with its code, as a stream
    // ended by a message that does not parse is.
    if (!principal_.ok()) {
      service_->metrics_->RecordRequest("Decode", static_cast<int>(principal_.status().code()),
                                        0.0);
      FinishOnce(ToGrpcStatus(principal_.status()));
      return;
    }
    // What gRPC keeps for an open stream (~20 KiB measured: buffers, call
    // and reactor state) is held from the budget while it is open, so
    // streams that never send anything cannot grow memory past it.
    absl::StatusOr<MemoryBudget::Reservation> overhead =
        service_->budget_->Reserve(kDecodeStreamBytes, "an open Decode stream");
    if (!overhead.ok()) {
      service_->metrics_->RecordRequest("Decode", static_cast<int>(overhead.status().code()),
                                        0.0);
      FinishOnce(ToGrpcStatus(overhead.status()));
      return;
    }
    overhead_ = *std::move(overhead);
    // Started after the shutdown's drain took its list of streams (gRPC
    // still starts streams until its own Shutdown, after the listener
    // stops): ended now as the drain ends an idle stream, not left to wait
    // for the whole grace.
    if (drained_without_it) {
      FinishShuttingDown();
      return;
    }
    StartRead(&read_buf_);
  }

  void OnReadDone(bool ok) override {
    RunReadDoneHookForTest(ok);
    if (!ok) {  // the client half-closed, the call is gone, or gRPC refused a message
      if (const std::optional<absl::Status> refused = RefusalByGrpc(); refused.has_value()) {
        FinishRefused(*refused);
        return;
      }
      // A client that died (killed, connection lost) fails the read before
      // gRPC runs OnCancel: the call's own state tells the two apart.
      if (ctx_->IsCancelled()) cancelled_ = true;
      FinishOnce(grpc::Status::OK);
      return;
    }
    // The operation's latency (ropeattn_request_duration_seconds) starts
    // here, before its admission and its wait for a worker, as a unary
    // call's does.
    read_at_ = absl::Now();
    // Busy from here to the answer's write: a Drain (shutdown) that runs
    // now leaves the stream to end after this operation, and one that ran
    // before finished it (and may have reset session_): seen below, before
    // session_ is touched.
    {
      absl::MutexLock lock(&mu_);
      busy_ = true;
    }
    if (service_->draining()) {
      read_buf_.Clear();
      // Not parsed: counted as the stream's (FinishShuttingDown), as a
      // message that does not parse.
      FinishShuttingDown();
      return;
    }
    // Parsed here, not by gRPC, which would end the stream with OK as if
    // the client had half-closed. A message that does not parse has no seq
    // to answer in band: the stream ends, naming why.
    if (absl::Status parsed =
            ParseRequest(read_buf_, &request_, service_->budget_, &parse_held_);
        !parsed.ok()) {
      read_buf_.Clear();
      if (absl::IsResourceExhausted(parsed) && session_ != nullptr) {
        // Well-formed, but the budget cannot hold its parse now: refused in
        // band (seq 0: the message was not read), the stream stays open.
        request_.Clear();
        Refuse("Decode", parsed);
        return;
      }
      service_->metrics_->RecordRequest("Decode", static_cast<int>(parsed.code()), 0.0);
      FinishOnce(ToGrpcStatus(parsed));
      return;
    }
    read_buf_.Clear();
    if (!principal_.ok()) {
      FinishOnce(ToGrpcStatus(principal_.status()));
      return;
    }
    // The tokens file is re-read while streams stay open: a token revoked
    // (or given to another principal) since the stream started ends it at
    // its next message, as the token's new calls are refused.
    // Refused like any call: counted in ropeattn_auth_refused_total (a
    // token now unknown: invalid_token; one that names another principal
    // is not valid for this stream either) and under the operation's method.
    if (principal_->authenticated) {
      const absl::StatusOr<Principal> now = service_->CallerOf(*ctx_);
      if (!now.ok() || now->name != principal_->name || now->admin != principal_->admin) {
        const absl::Status refused = absl::UnauthenticatedError(
            "this stream's credentials are no longer accepted (its token was revoked or now "
            "names another principal); open a new stream");
        service_->CountAuthRefusal(refused, "invalid_token");
        service_->metrics_->RecordRequest(MethodOf(request_), static_cast<int>(refused.code()),
                                          0.0);
        FinishOnce(ToGrpcStatus(refused));
        return;
      }
    }
    // Priced and checked here, before anything is allocated or queued.
    if (absl::Status admitted = Admit(); !admitted.ok()) {
      Refuse(MethodOf(request_), admitted);
      return;
    }
    queued_at_ = absl::Now();
    // Bookkeeping that never waits for compute (attach, truncate, close take
    // only the manager's lock and session metadata, or this stream's own
    // idle session) is answered here, not queued behind running steps.
    if (request_.has_attach() || request_.has_truncate() || request_.has_close()) {
      Process();
      return;
    }
    // A step joins whatever other sessions' steps are ready when a worker
    // takes it (AttentionServiceImpl::RunDecodeSteps); the rest run alone.
    const int64_t compute =
        std::max<int64_t>(1, request_.has_step() ? op_compute_ : op_queue_compute_);
    // An open or a fork allocates or copies: off gRPC's threads, and, when
    // small, not behind the kernels (the control thread). One that is compute
    // itself (a prefix import, an export) past what a call runs inline goes
    // to the compute workers, admitted (AdmitIfCompute) and fair-queued with
    // the kernels: on the one control thread a 30000-token import held every
    // other caller's opens for 0.2-0.6 s, an export for up to 1.1 s.
    const bool heavy =
        !request_.has_step() && compute > AttentionServiceImpl::kInlineMaxCompute;
    Executor* control = heavy ? service_->executor_ : service_->control_;
    const bool queued =
        request_.has_step()
            ? service_->executor_->TrySubmitBatch(share_, compute, this, op_kind_, op_joins_,
                                                  &stop_)
            : control->TrySubmit(share_, compute, [this] { Process(); }, MethodOf(request_),
                                 &stop_);
    if (!queued) {
      AdmittedDone(-1);
      ReleaseOpMemory();
      ticket_.Release();
      const char* method = MethodOf(request_);
      service_->metrics_->RecordRejected(method);
      const grpc::Status full = request_.has_step() || heavy
                                    ? QueueFull(*service_->executor_, method)
                                    : QueueFull(*control, method, "control");
      Refuse(method, absl::ResourceExhaustedError(full.error_message()));
    }
  }

  void OnWriteDone(bool ok) override {
    watch_->Disarm();
    const std::optional<std::string> timed_out = CountWritten(ok);
    // The answer is on its way: its buffers go, and then what paid for them.
    ReleaseMessageMemory();
    ReleaseOpMemory();
    if (!ok) {
      // The stream is broken (lost, or cancelled, e.g. its answer not taken
      // in time): its session was disconnected, whether or not gRPC has run
      // OnCancel yet.
      cancelled_ = true;
      if (!timed_out.has_value() && service_->grace_passed()) {
        // The drain's cancel of what still runs past the grace
        // (grpc_server_cancel_all_calls: UNAVAILABLE to the client), not
        // its client leaving (a client that cancels inside the grace is).
        FinishCancelledByDrain();
        return;
      }
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED,
                              timed_out.has_value() ? *timed_out : "the client went away"));
      return;
    }
    if (close_after_write_) {
      FinishOnce(grpc::Status::OK);
      return;
    }
    // Idle again, or drained, in one step under mu_: a shutdown's Drain
    // either sees the stream busy, and then draining() is seen here, or
    // sees it idle and finishes it (a check of draining() before taking the
    // lock let a Drain pass a busy stream that then waited for a read and
    // was never drained).
    bool drain;
    {
      absl::MutexLock lock(&mu_);
      drain = service_->draining();
      if (!drain) busy_ = false;
    }
    if (drain) {
      FinishShuttingDown();
      return;
    }
    StartRead(&read_buf_);
  }

  void OnCancel() override {
    // Once the shutdown's grace has passed, the cancel is taken for the
    // drain's: see EndOfCancelled.
    cancelled_ = true;
    stop_.Cancel();
    // An operation still queued is abandoned now: its session (a
    // non-resumable one is freed) and memory go at once, not when a worker
    // would reach it.
    service_->DropStopped();
  }

  void OnDone() override {
    watch_->Ended();
    // gRPC reports every started write before OnDone: nothing is left
    // uncounted here but an answer that never reached OnWriteDone.
    CountWritten(/*ok=*/false);
    // Normally released in FinishOnce; this covers a stream gRPC ends itself.
    if (session_ != nullptr) {
      GiveBackStepRoom();
      service_->sessions_->Detach(session_, EndOfStream());
    }
    service_->Unregister(this);
    Unref();
  }

  // Between operations a stream keeps nothing of its last messages beyond a
  // small allowance: protobuf keeps a cleared field's capacity (and gRPC
  // parses each message into request_ after clearing it), so a stream that
  // once carried a 256 MiB step, answered or refused, would otherwise hold
  // that much, outside the memory budget, for as long as it stayed open.
  void ReleaseMessageMemory() {
    write_buf_.Clear();
    parse_held_.Release();
    constexpr size_t kKeepBytes = size_t{64} << 10;
    if (request_.SpaceUsedLong() > kKeepBytes) request_ = v1::DecodeRequest();
    if (response_.SpaceUsedLong() > kKeepBytes) response_ = v1::DecodeResponse();
    for (Tensor& t : wire_copies_) t = Tensor();
  }

  // What the operation held (its buffers, its answer's SessionInfo copy,
  // the step room lent to it) goes back.
  void ReleaseOpMemory() {
    op_memory_.Release();
    info_memory_.Release();
    GiveBackStepRoom();
  }
  // The step room lent to the operation (Admit) goes back to the session,
  // or to the budget if the session ended meanwhile.
  void GiveBackStepRoom() {
    if (lent_room_.bytes() == 0) return;
    if (session_ != nullptr) {
      session_->ReturnStepRoom(std::move(lent_room_));
    } else {
      lent_room_.Release();
    }
  }

  // BeginShutdown pins a reactor while it drains it outside the service lock.
  void Ref() { refs_.fetch_add(1); }
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  // gRPC 1.51 ends a read alike (OnReadDone(false)) when the client
  // half-closed, when the call is gone, and when its message-size check
  // refused a message larger than --max_message_bytes (RESOURCE_EXHAUSTED to
  // the client; no interceptor or handler sees the message). The refusal is
  // the one end where gRPC's call layer cancels the call itself before it
  // completes the read, and that cancel (FilterStackCall::CancelWithError)
  // clears the call's peer, which then reads "unknown". A gone call
  // (cancelled or reset by its client, lost, past its deadline, the server's
  // shutdown) reaches the read through the transport instead, which marks
  // it failed (grpc_call_failed_before_recv_message) and leaves the peer; a
  // half-close's read is unmarked and its call not cancelled. The call
  // layer's other cancel of a Decode call is ours, of an answer not taken in
  // time (AnswerWatch), which the watch knows. Compressed messages, the
  // other refusal past the transport, are refused from their headers, and
  // gRPC's cancel for them clears the peer alike: told apart first
  // (RefusedEncoding).
  bool RefusedByGrpc() const {
    return !grpc_call_failed_before_recv_message(ctx_->c_call()) && ctx_->peer() == "unknown" &&
           !watch_->TimedOut();
  }

  // The compression the client declared for its messages, as gRPC parsed
  // its grpc-encoding: gzip or deflate (gRPC 1.51 reads a value it does not
  // know, such as snappy, as identity). Both are disabled on this server: gRPC
  // cancels such a stream as it starts (UNIMPLEMENTED to the client) and
  // fails its read as it does an oversized message's, whether or not a
  // message was sent.
  // gRPC keeps the header from the handler's metadata (it parses it into
  // the call's incoming algorithm), so it is read from the call.
  std::optional<std::string> RefusedEncoding() const {
    const grpc_compression_algorithm algorithm =
        grpc_call_test_only_get_compression_algorithm(ctx_->c_call());
    if (algorithm == GRPC_COMPRESS_NONE) return std::nullopt;
    const char* name = nullptr;
    if (grpc_compression_algorithm_name(algorithm, &name) == 0 || name == nullptr) {
      return absl::StrCat("#", static_cast<int>(algorithm));
    }
    return std::string(name);
  }

  // gRPC's refusal of this stream (RefusedEncoding, RefusedByGrpc), with
  // the code its client got from gRPC; nullopt when gRPC did not refuse it.
  std::optional<absl::Status> RefusalByGrpc() const {
    if (const std::optional<std::string> encoding = RefusedEncoding(); encoding.has_value()) {
      // gRPC cancelled the stream as it started (UNIMPLEMENTED to the
      // client), before any message: a refusal, not an oversized message.
      return absl::UnimplementedError(absl::StrCat(
          "this stream's messages are compressed (grpc-encoding ", QuoteForMessage(*encoding),
          "), which this server does not accept: gRPC refused the stream; send them "
          "uncompressed"));
    }
    if (RefusedByGrpc()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "a message of this stream was larger than --max_message_bytes (",
          service_->options_.max_message_bytes, " bytes): gRPC refused it and ended the stream"));
    }
    return std::nullopt;
  }

  // Answers (logged by the call log, counted under Decode) a stream gRPC
  // refused with the code the client saw; the status itself cannot reach
  // it, gRPC sent its own. Ended by the server's refusal, not by its client
  // (gRPC's cancel runs OnCancel too). Counted only by the call that ends
  // the stream: the refused read's end or a shutdown's Drain, whichever
  // comes first, so once either way.
  void FinishRefused(const absl::Status& refused) {
    if (FinishOnce(ToGrpcStatus(refused), SessionManager::StreamEnd::kEnded)) {
      service_->metrics_->RecordRequest("Decode", static_cast<int>(refused.code()), 0.0);
    }
  }

  // From BeginShutdown: a stream waiting for its client ends now.
  void Drain() {
    // Under mu_: OnReadDone marks the stream busy under the same lock before
    // handing work to the executor, so an idle stream cannot start a step
    // (and use session_) while it is being finished here.
    absl::MutexLock lock(&mu_);
    if (busy_) return;
    // A read gRPC refused (its cancel is done: the client has gRPC's code)
    // whose OnReadDone has not run yet is ended as that refusal, not as
    // the drain's: the drain was not what the client saw.
    if (const std::optional<absl::Status> refused = RefusalByGrpc(); refused.has_value()) {
      FinishRefused(*refused);
      return;
    }
    FinishShuttingDown();
  }

 private:
  static uint64_t SeqOf(const v1::DecodeRequest& r) {
    switch (r.msg_case()) {
      case v1::DecodeRequest::kStep:
        return r.step().seq();
      case v1::DecodeRequest::kTruncate:
        return r.truncate().seq();
      case v1::DecodeRequest::kFork:
        return r.fork().seq();
      case v1::DecodeRequest::kClose:
        return r.close().seq();
      case v1::DecodeRequest::kExportKv:
        return r.export_kv().seq();
      default:
        return 0;
    }
  }

  static const char* MethodOf(const v1::DecodeRequest& r) {
    switch (r.msg_case()) {
      case v1::DecodeRequest::kOpen:
        return "Decode.Open";
      case v1::DecodeRequest::kAttach:
        return "Decode.Attach";
      case v1::DecodeRequest::kTruncate:
        return "Decode.Truncate";
      case v1::DecodeRequest::kFork:
        return "Decode.Fork";
      case v1::DecodeRequest::kClose:
        return "Decode.Close";
      case v1::DecodeRequest::kExportKv:
        return "Decode.Export";
      default:
        return "Decode.Step";
    }
  }

  // Prices the operation just read and reserves its transient memory (a
  // step: inputs, conversions, attention buffers, answer) until its answer
  // is written. An open's state is reserved by the session manager before
  // it allocates; a fork's likewise.
  absl::Status Admit() {
    op_queue_compute_ = 1;
    // An open's session state (and a fork's) is reserved here: a slot and
    // its held bytes, before the allocation is queued.
    if (request_.has_open() && session_ == nullptr) {
      RA_ASSIGN_OR_RETURN(SessionConfig config,
                          ResolveOpenSession(request_.open(), service_->options_,
                                             *service_->models_));
      // Its answer echoes the spec (as every later answer carrying the
      // session's SessionInfo does) and its prefix is imported: both are
      // checked against the limits before anything is reserved.
      RA_ASSIGN_OR_RETURN(const Cost open_cost, PriceOpen(config, request_.open()));
      RA_RETURN_IF_ERROR(CheckCost(open_cost, service_->limits_, "Decode.Open"));
      op_queue_compute_ = open_cost.compute;
      RA_RETURN_IF_ERROR(AdmitIfCompute("Decode.Open", open_cost.compute));
      absl::Cleanup unadmit = [this] { AdmittedDone(-1); };  // refused below
      RA_RETURN_IF_ERROR(HoldInfoAnswer(config));
      if (request_.open().has_prefix()) {
        // Filling it copies the prefix to f32 (and rotates it): its
        // transient bytes, at 4 bytes an element, twice.
        const v1::KvPrefix& pre = request_.open().prefix();
        RA_ASSIGN_OR_RETURN(const WireShape k, ParseWireShape(pre.k(), "open.prefix.k"));
        RA_ASSIGN_OR_RETURN(const WireShape v, ParseWireShape(pre.v(), "open.prefix.v"));
        const int64_t bytes = SatMul(SatAdd(k.elements, v.elements), 8);
        RA_ASSIGN_OR_RETURN(op_memory_,
                            service_->budget_->Reserve(bytes, "this session's KV prefix"));
      }
      RA_ASSIGN_OR_RETURN(ticket_, service_->sessions_->Reserve(
                                       std::make_shared<const SessionConfig>(std::move(config)),
                                       *principal_));
      std::move(unadmit).Cancel();
      return absl::OkStatus();
    }
    // (A close's answer is paid from the room its session reserved for it
    // (SessionManager::Close): a close must work on a full budget.)
    if ((request_.has_fork() || request_.has_truncate()) && session_ != nullptr) {
      RA_RETURN_IF_ERROR(HoldInfoAnswer(session_->config()));
    }
    if (request_.has_fork() && session_ != nullptr) {
      RA_ASSIGN_OR_RETURN(ticket_, service_->sessions_->ReserveFork(
                                       session_, /*resumable=*/true,
                                       request_.fork().idle_ttl_seconds(), *principal_));
      return absl::OkStatus();
    }
    if (request_.has_export_kv() && session_ != nullptr) {
      // The answer's size is known from the session's length: checked
      // against the reply limit before anything is copied.
      const Cost cost = PriceExport(session_->config(), session_->position_hint());
      RA_RETURN_IF_ERROR(CheckCost(cost, service_->limits_, "Decode.Export"));
      op_queue_compute_ = cost.compute;
      RA_RETURN_IF_ERROR(AdmitIfCompute("Decode.Export", cost.compute));
      absl::Cleanup unadmit = [this] { AdmittedDone(-1); };  // refused below
      RA_ASSIGN_OR_RETURN(op_memory_,
                          service_->budget_->Reserve(cost.transient_bytes, "this KV export"));
      std::move(unadmit).Cancel();
      return absl::OkStatus();
    }
    if (request_.has_step() && session_ != nullptr) {
      const SessionConfig& c = session_->config();
      RA_ASSIGN_OR_RETURN(const Cost cost,
                          PriceStep(c, request_.step(), session_->position_hint(),
                                    service_->options_.threads_per_call));
      RA_RETURN_IF_ERROR(CheckCost(cost, service_->limits_, "Decode.Step"));
      // A step of a few tokens runs the decode kernel (memory-bound), a
      // longer one the prefill (compute-bound): priced units take 10-100x
      // different times on the two, so the admission learns each rate
      // apart. One shared rate, taught by a one-token step slowed past 5 ms,
      // made queued 300-token steps look like seconds of work and refused
      // the steps behind them.
      op_kind_ = StepAdmissionKind(c, request_.step());
      op_joins_ = StepJoinsBatches(c, request_.step());
      absl::Duration retry_after;
      const auto ahead = service_->executor_->WorkAhead(share_, cost.compute);
      if (absl::Status admitted = service_->admission_.Admit(
              op_kind_, cost.compute, stop_.deadline(), absl::Now(), &retry_after,
              /*slowdown_applies=*/false, &ahead);
          !admitted.ok()) {
        service_->metrics_->RecordRejected(MethodOf(request_));  // shed by admission
        return admitted;
      }
      // The session's step room pays for a step of up to its size (every
      // one-token step); a larger one takes the rest from the free budget.
      // The room is lent to this operation until its answer is written: a
      // close of the session meanwhile (CloseSession, the reaper) gives the
      // session's memory back, but not the room the unread answer uses.
      lent_room_ = session_->LendStepRoom();
      const int64_t extra = cost.transient_bytes - lent_room_.bytes();
      if (extra > 0) {
        absl::StatusOr<MemoryBudget::Reservation> held =
            service_->budget_->Reserve(extra, "this decode step (beyond its session's step room)");
        if (!held.ok()) {
          service_->admission_.Finished(op_kind_, cost.compute, -1);
          return held.status();
        }
        op_memory_ = *std::move(held);
      }
      op_compute_ = cost.compute;
    }
    return absl::OkStatus();
  }

  // An open importing a large prefix, or a large export, is compute: past
  // kInlineMaxCompute it runs on the compute workers (OnReadDone), and is
  // admitted as a step is (its deadline, --max_queue_delay_seconds, its
  // caller's fair share of the queue), its rate learned apart. Queued
  // unadmitted, one caller's imports filled the compute queue and others'
  // calls were refused "the compute queue is full".
  absl::Status AdmitIfCompute(const char* kind, int64_t compute) {
    if (compute <= AttentionServiceImpl::kInlineMaxCompute) return absl::OkStatus();
    absl::Duration retry_after;
    const auto ahead = service_->executor_->WorkAhead(share_, compute);
    if (absl::Status admitted = service_->admission_.Admit(
            kind, compute, stop_.deadline(), absl::Now(), &retry_after,
            /*slowdown_applies=*/false, &ahead);
        !admitted.ok()) {
      service_->metrics_->RecordRejected(MethodOf(request_));  // shed by admission
      return admitted;
    }
    op_kind_ = kind;
    op_compute_ = compute;
    return absl::OkStatus();
  }

  // An answer carrying a session's SessionInfo copies its spec and
  // serializes it: past a 64 KiB slack (as parsing), held from the budget
  // until it is written.
  absl::Status HoldInfoAnswer(const SessionConfig& c) {
    const int64_t bytes = InfoCopyBytes(c);
    if (bytes <= kInfoAnswerSlackBytes) return absl::OkStatus();
    RA_ASSIGN_OR_RETURN(info_memory_,
                        service_->ReserveInfoCopy(bytes, "this answer's SessionInfo (its spec)",
                                                  /*fallback=*/true));
    return absl::OkStatus();
  }

  // Sends response_ (serialized here: the stream's messages are raw bytes).
  void Write() {
    bool own_buffer = false;
    const grpc::Status written =
        grpc::SerializationTraits<v1::DecodeResponse>::Serialize(response_, &write_buf_, &own_buffer);
    if (!written.ok()) {
      watch_->Disarm();
      ReleaseOpMemory();
      const grpc::Status failed(
          grpc::StatusCode::INTERNAL,
          absl::StrCat("the answer could not be serialized: ", written.error_message()));
      if (unwritten_.method != nullptr) {  // the operation ends with the stream, unanswered
        const Unwritten u = std::exchange(unwritten_, Unwritten{});
        service_->metrics_->RecordRequest(u.method, static_cast<int>(failed.error_code()),
                                          u.seconds);
      }
      FinishOnce(failed);
      return;
    }
    StartWrite(&write_buf_);
  }

  // The answer about to be written is counted when its write is done
  // (OnWriteDone): ropeattn_requests_total under `code`, or CANCELLED if
  // the answer timeout cancels the stream with it untaken.
  void CountWhenWritten(const char* method, absl::StatusCode code, double seconds) {
    unwritten_ = Unwritten{method, static_cast<int>(code), seconds, SeqOf(request_)};
  }
  // Counts the answer whose write is done (`ok`: sent). When the answer
  // timeout cancelled the stream with it untaken: counted CANCELLED and
  // timed out, and the stream's status message (why) is returned.
  std::optional<std::string> CountWritten(bool ok) {
    if (unwritten_.method == nullptr) return std::nullopt;
    const Unwritten u = std::exchange(unwritten_, Unwritten{});
    std::optional<std::string> timed_out;
    int code = u.code;
    if (!ok && watch_->TimedOut()) {
      code = static_cast<int>(grpc::StatusCode::CANCELLED);
      service_->metrics_->RecordAnswerTimedOut(u.method);
      timed_out = absl::StrCat(u.method, " seq ", u.seq, ": ",
                               AnswerNotTaken(service_->options_.answer_timeout_seconds));
    } else if (!ok && service_->grace_passed()) {
      // Not delivered: the drain cancelled the stream (UNAVAILABLE to its
      // client), as OnWriteDone takes it (OnCancel may not have run yet).
      code = static_cast<int>(grpc::StatusCode::UNAVAILABLE);
    } else if (!ok) {
      // Not delivered: the stream's deadline passed or it was cancelled.
      code = UndeliveredCode(stop_);
    }
    service_->metrics_->RecordRequest(u.method, code, u.seconds);
    return timed_out;
  }

  // An operation refused before it ran: in-band for a stream with a session
  // (the stream stays open), the stream's status otherwise; counted under
  // `method`.
  void Refuse(const char* method, const absl::Status& status) {
    if (session_ == nullptr) {
      service_->metrics_->RecordRequest(method, static_cast<int>(status.code()), 0.0);
      FinishOnce(ToGrpcStatus(status));
      return;
    }
    response_.Clear();
    const uint64_t seq = SeqOf(request_);
    response_.set_seq(seq);
    v1::StepError* e = response_.mutable_error();
    e->set_seq(seq);
    e->set_code(static_cast<int>(status.code()));
    e->set_message(CapStatusMessage(status.message()));
    LogInBand(MethodOf(request_), status);
    CountWhenWritten(method, status.code(), 0.0);
    service_->answer_watch_.Arm(watch_);
    Write();
  }

  // An error answered inside the stream (the call's own status, logged by
  // the call log, comes at its end).
  void LogInBand(absl::string_view method, const absl::Status& status) const {
    absl::ConsumePrefix(&method, "Decode.");
    LogStreamError(*ctx_, "/ropeattn.v1.AttentionService/Decode", method, status,
                   session_ != nullptr ? session_->id() : std::string(), SeqOf(request_));
  }

  grpc::Status ShuttingDown() const {
    return grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        session_ != nullptr && session_->resumable()
            ? absl::StrCat("the server is shutting down; re-attach session ", session_->id(),
                           " on another replica only if it holds the session")
            : std::string("the server is shutting down"));
  }

  // The server's drain ends the stream: a non-resumable session it frees
  // is closed for "shutdown", not as a stream that ended normally. Counted
  // under Decode (UNAVAILABLE) if this ends it, however it was drained
  // (idle, started after the drain took its list, its next message or
  // answer seen draining).
  void FinishShuttingDown() {
    if (FinishOnce(ShuttingDown(),
                   cancelled_.load() ? EndOfCancelled() : SessionManager::StreamEnd::kShutdown)) {
      service_->metrics_->RecordRequest("Decode", grpc::StatusCode::UNAVAILABLE, 0.0);
    }
  }
  // The drain's cancel past the grace ends the stream (CancelledByDrain):
  // counted under Decode as the other streams the drain ends.
  void FinishCancelledByDrain() {
    if (FinishOnce(CancelledByDrain())) {
      service_->metrics_->RecordRequest("Decode", grpc::StatusCode::UNAVAILABLE, 0.0);
    }
  }

  // A stream cancelled once --shutdown_grace_seconds passed was cancelled
  // by the drain (grpc_server_cancel_all_calls) for its session: closed for
  // "shutdown", not "disconnected". A client that cancels before (during
  // the grace too) is its client's cancel.
  SessionManager::StreamEnd EndOfCancelled() const {
    return service_->grace_passed() ? SessionManager::StreamEnd::kShutdown
                                    : SessionManager::StreamEnd::kCancelled;
  }
  // How the stream ended for its session when nobody said otherwise.
  SessionManager::StreamEnd EndOfStream() const {
    return cancelled_.load() ? EndOfCancelled() : SessionManager::StreamEnd::kEnded;
  }
  // The stream was cancelled once the grace passed: by the drain.
  bool CancelledByDrainNow() const { return stop_.cancelled() && service_->grace_passed(); }
  // The status of a stream the drain cancelled: the code its client got
  // from gRPC (UNAVAILABLE), the reason the server's.
  grpc::Status CancelledByDrain() const {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "the server is shutting down: the stream was still running when "
                        "--shutdown_grace_seconds passed and was cancelled");
  }

  // `end`: how the stream ended for its session; by default as its client
  // left it (cancelled or lost, or not).
  // Returns whether this call finished the stream (false: it was already).
  bool FinishOnce(const grpc::Status& status,
                  std::optional<SessionManager::StreamEnd> end = std::nullopt) {
    if (finished_.exchange(true)) return false;
    // Release the session before the client can see the stream end, so a
    // client may re-attach a resumable session as soon as its stream is over.
    if (session_ != nullptr) {
      GiveBackStepRoom();  // before the detach, which may free the session
      service_->sessions_->Detach(session_, end.value_or(EndOfStream()));
      session_.reset();
    }
    Finish(status);
    return true;
  }

  // Runs on the executor.
  // Cancelled, or past its deadline, while it waited: not started, and
  // answered here (true).
  bool AbandonIfStopped() {
    if (!stop_.ShouldStop()) return false;
    AdmittedDone(-1);
    service_->metrics_->RecordAbandoned(MethodOf(request_));
    ticket_.Release();
    // Cancelled once the grace passed: by the drain (UNAVAILABLE to the
    // client), counted and logged so; before, by its client (CANCELLED), or
    // past its deadline. Its whole latency: queued until now (as an
    // abandoned unary call's), from when it was read.
    const bool by_drain = CancelledByDrainNow();
    const grpc::Status status = by_drain ? CancelledByDrain() : ToGrpcStatus(stop_.status());
    service_->metrics_->RecordRequest(MethodOf(request_), static_cast<int>(status.error_code()),
                                      SecondsSince(read_at_));
    if (by_drain) {
      FinishCancelledByDrain();
    } else {
      FinishOnce(status);
    }
    return true;
  }

  // Writes the answer to the operation in response_ (or its error), or
  // ends the stream when nothing is left to serve.
  void Answer(const char* method, const absl::Status& status, absl::Time start,
              bool stream_fatal) {
    // The session itself is gone (closed by an operator, reaped): the
    // stream has nothing left to serve.
    if (!status.ok() && session_ != nullptr &&
        (status.code() == absl::StatusCode::kNotFound ||
         status.code() == absl::StatusCode::kUnavailable ||
         (status.code() == absl::StatusCode::kFailedPrecondition &&
          absl::StrContains(status.message(), "was closed")))) {
      stream_fatal = true;
    }
    AdmittedDone(-1);  // a step that never reached its session
    if (!status.ok()) {
      if (stream_fatal) {
        service_->metrics_->RecordRequest(method, static_cast<int>(status.code()),
                                          SecondsSince(start));
        FinishOnce(ToGrpcStatus(status));
        return;
      }
      response_.clear_msg();
      v1::StepError* e = response_.mutable_error();
      e->set_seq(SeqOf(request_));
      e->set_code(static_cast<int>(status.code()));
      e->set_message(CapStatusMessage(status.message()));
      LogInBand(method, status);
    }
    CountWhenWritten(method, status.code(), SecondsSince(start));
    service_->answer_watch_.Arm(watch_);
    Write();
  }

 public:
  // A queued step, on the executor (RunDecodeSteps): the wire translated
  // into `step`, or answered here (false: abandoned, or refused before it
  // computes).
  bool BeginStep(SessionStep* step) {
    service_->metrics_->RecordQueueTime("Decode.Step", SecondsSince(queued_at_));
    if (AbandonIfStopped()) return false;
    response_.Clear();
    response_.set_seq(SeqOf(request_));
    if (session_ == nullptr) {
      Answer("Decode.Step",
             absl::InvalidArgumentError(
                 "the first message of a Decode stream must be `open` or `attach`"),
             read_at_, /*stream_fatal=*/true);
      return false;
    }
    absl::StatusOr<StepInput> in =
        StepInputFromProto(session_->config(), request_.step(), wire_copies_);
    if (!in.ok()) {
      Answer("Decode.Step", in.status(), read_at_, /*stream_fatal=*/false);
      return false;
    }
    step->session = session_.get();
    step->in = *std::move(in);
    step->output = StepOutputInto(response_.mutable_step()->mutable_out());
    step->stop = &stop_;
    return true;
  }
  // The step computed (`seconds`: its share of the pass).
  void EndStep(const SessionStep& step, double seconds) {
    AdmittedDone(step.status.ok() ? seconds : -1);
    absl::Status status = step.status;
    // Stopped mid-way by the drain past the grace: UNAVAILABLE, what its
    // client gets, counted and logged so (as AbandonIfStopped does for an
    // operation still queued); nothing is left to answer.
    if (!status.ok() && stop_.ShouldStop() && CancelledByDrainNow()) {
      for (Tensor& t : wire_copies_) t = Tensor();
      service_->metrics_->RecordRequest("Decode.Step",
                                        static_cast<int>(grpc::StatusCode::UNAVAILABLE),
                                        SecondsSince(read_at_));
      FinishCancelledByDrain();
      return;
    }
    // Stopped mid-way: the stop's own code, not the kernel's.
    if (!status.ok() && stop_.ShouldStop()) status = stop_.status();
    if (status.ok()) {
      service_->metrics_->RecordStep(step.tokens);
      response_.mutable_step()->set_seq(SeqOf(request_));
      response_.mutable_step()->set_position(step.position);
    }
    for (Tensor& t : wire_copies_) t = Tensor();
    Answer("Decode.Step", status, read_at_, /*stream_fatal=*/false);
  }
  int64_t op_compute() const { return op_compute_; }

 private:
  void Process() {
    service_->metrics_->RecordQueueTime(MethodOf(request_), SecondsSince(queued_at_));
    if (AbandonIfStopped()) return;
    const absl::Time start = absl::Now();
    AttentionServiceImpl::ComputeScope computing(service_, MethodOf(request_));
    response_.Clear();
    const uint64_t seq = SeqOf(request_);
    response_.set_seq(seq);
    const char* method = "Decode.Step";
    absl::Status status;
    bool stream_fatal = false;
    switch (request_.msg_case()) {
      case v1::DecodeRequest::kOpen:
      case v1::DecodeRequest::kAttach: {
        method = request_.has_open() ? "Decode.Open" : "Decode.Attach";
        if (session_ != nullptr) {
          status = absl::FailedPreconditionError(
              absl::StrCat("this stream already holds session ", session_->id(),
                           "; open or attach another session on a new stream"));
          break;
        }
        absl::StatusOr<std::shared_ptr<Session>> s;
        if (request_.has_open()) {
          // The new session starts from the caller's KV, imported before it
          // is listed or counted: if the import fails, the open fails and
          // the session was never opened.
          s = service_->sessions_->Open(
              std::move(ticket_), [this](Session& session) -> absl::Status {
                if (!request_.open().has_prefix()) return absl::OkStatus();
                absl::StatusOr<WirePrefix> prefix = PrefixFromProto(request_.open().prefix());
                if (!prefix.ok()) return prefix.status();
                return session.Import(prefix->k, prefix->v, prefix->form, "open.prefix.");
              });  // reserved in Admit
        } else {
          s = service_->sessions_->Attach(request_.attach().session_id(), *principal_);
        }
        if (!s.ok()) {
          status = s.status();
          stream_fatal = true;  // no session: nothing to continue
          break;
        }
        session_ = *std::move(s);
        if (request_.has_attach()) {
          // Its answer copies the spec, held from the budget as an open's
          // is (an attach is known only now); if it cannot be, the session
          // is let go again, as it was.
          status = HoldInfoAnswer(session_->config());
          if (!status.ok()) {
            service_->sessions_->Detach(session_, SessionManager::StreamEnd::kEnded);
            session_ = nullptr;
            stream_fatal = true;
            break;
          }
        }
        session_->FillInfo(response_.mutable_opened());
        AdmittedDone(SecondsSince(start));  // an admitted import: its rate
        break;
      }
      case v1::DecodeRequest::kStep:
      case v1::DecodeRequest::kTruncate:
      case v1::DecodeRequest::kFork:
      case v1::DecodeRequest::kClose:
      case v1::DecodeRequest::kExportKv: {
        if (session_ == nullptr) {
          status = absl::InvalidArgumentError(
              "the first message of a Decode stream must be `open` or `attach`");
          stream_fatal = true;
          break;
        }
        if (request_.has_truncate()) {
          method = "Decode.Truncate";
          status = session_->Truncate(request_.truncate().position());
          if (status.ok()) session_->FillInfo(response_.mutable_truncated());
        } else if (request_.has_fork()) {
          method = "Decode.Fork";
          auto fork = service_->sessions_->Fork(session_, std::move(ticket_));  // reserved in Admit
          status = fork.status();
          if (fork.ok()) {
            service_->sessions_->Detach(*fork, SessionManager::StreamEnd::kEnded);
            (*fork)->FillInfo(response_.mutable_forked());
          }
        } else if (request_.has_export_kv()) {
          method = "Decode.Export";
          absl::StatusOr<DecodeState::Exported> kv = session_->Export();
          status = kv.status();
          if (kv.ok()) {
            v1::KvExport* e = response_.mutable_exported();
            TensorToProto(kv->k.cview(), e->mutable_k());
            TensorToProto(kv->v.cview(), e->mutable_v());
            e->set_key_form(kv->key_form == DecodeState::KeyForm::kRaw ? v1::KEY_FORM_RAW
                                                                       : v1::KEY_FORM_ROTATED);
            e->set_start_position(session_->config().start_position);
            e->set_position(kv->k.dim(1));
            AdmittedDone(SecondsSince(start));  // an admitted export: its rate
          }
        } else if (request_.has_step()) {
          status = absl::InternalError("a decode step reached the control path");
        } else {
          method = "Decode.Close";
          auto closed = service_->sessions_->Close(session_->id(), "closed", *principal_);
          status = closed.status();
          if (closed.ok()) {
            // Its copies are paid from the room the session reserved for
            // them, until the answer is written.
            info_memory_ = std::move(closed->answer);
            *response_.mutable_closed() = std::move(closed->info);
            close_after_write_ = true;
          }
        }
        break;
      }
      default:
        status = absl::InvalidArgumentError("DecodeRequest.msg is not set");
        stream_fatal = session_ == nullptr;
        break;
    }
    Answer(method, status, read_at_, stream_fatal);
  }

  AttentionServiceImpl* const service_;
  grpc::CallbackServerContext* const ctx_;
  // Who opened the stream: its sessions belong to this principal.
  const absl::StatusOr<Principal> principal_;
  const std::string share_;  // the executor's fair-queueing key
  absl::Time read_at_;    // when the current operation was read (its latency's start)
  absl::Time queued_at_;  // when the current operation was queued
  int64_t op_compute_ = -1;  // the current operation's admitted compute, -1: none
  // The current open's (prefix import) or export's priced compute: past
  // kInlineMaxCompute it runs on the compute workers, not the control thread.
  int64_t op_queue_compute_ = 1;
  // The admission kind (and executor WorkAhead kind) of the current step.
  const char* op_kind_ = "Decode.Step";
  bool op_joins_ = true;  // a step that may share a batched pass
  // The admitted step left the queue (ran for `seconds`, or -1: did not run
  // to its end).
  void AdmittedDone(double seconds) {
    if (op_compute_ < 0) return;
    service_->admission_.Finished(op_kind_, op_compute_, seconds);
    op_compute_ = -1;
  }
  v1::DecodeRequest request_;
  v1::DecodeResponse response_;
  grpc::ByteBuffer read_buf_;   // the next message's bytes, parsed into request_
  MemoryBudget::Reservation parse_held_;  // request_'s memory beyond its wire bytes
  grpc::ByteBuffer write_buf_;  // response_ serialized, until its write is done
  std::array<Tensor, 3> wire_copies_;    // a step's misaligned wire tensors, copied
  std::shared_ptr<Session> session_;
  bool close_after_write_ = false;
  // The answer being written, counted when its write is done (CountWritten).
  struct Unwritten {
    const char* method = nullptr;  // none
    int code = 0;
    double seconds = 0.0;
    uint64_t seq = 0;
  };
  Unwritten unwritten_;
  StopToken stop_;                        // the stream's: cancel or deadline
  // Armed while an answer is being written (--answer_timeout_seconds).
  const std::shared_ptr<AnswerWatch::Handle> watch_;
  // Held from the budget while the stream is open (kDecodeStreamBytes).
  MemoryBudget::Reservation overhead_;
  MemoryBudget::Reservation op_memory_;  // the current operation's buffers
  MemoryBudget::Reservation info_memory_;  // its answer's SessionInfo copy (HoldInfoAnswer)
  // A step's: its session's step room, lent until the answer is written.
  MemoryBudget::Reservation lent_room_;
  // An open's or fork's reserved session room (Admit), used by Process.
  SessionManager::Ticket ticket_;
  std::atomic<int> refs_{1};  // gRPC's, released in OnDone
  std::atomic<bool> finished_{false};
  std::atomic<bool> cancelled_{false};
  absl::Mutex mu_;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
};

void AttentionServiceImpl::RunDecodeSteps(absl::Span<BatchTask* const> tasks) {
  std::vector<DecodeReactor*> streams;
  std::vector<SessionStep> steps;
  streams.reserve(tasks.size());
  steps.reserve(tasks.size());
  for (BatchTask* task : tasks) {
    auto* stream = static_cast<DecodeReactor*>(task);
    SessionStep step;
    if (!stream->BeginStep(&step)) continue;
    streams.push_back(stream);
    steps.push_back(std::move(step));
  }
  if (steps.empty()) return;
  metrics_->RecordDecodeBatch(static_cast<int64_t>(steps.size()));
  double seconds = 0;
  {
    std::deque<ComputeScope> computing;
    for (size_t i = 0; i < steps.size(); ++i) computing.emplace_back(this, "Decode.Step");
    const absl::Time start = absl::Now();
    Session::StepMany(absl::MakeSpan(steps), options_.threads_per_call);
    seconds = SecondsSince(start);
  }
  Executor::ComputeDone();  // before any stream can have its answer
  // Each step's share of the pass, by its priced compute, teaches the
  // admission its rate.
  int64_t total = 0;
  for (DecodeReactor* s : streams) total += std::max<int64_t>(1, s->op_compute());
  for (size_t i = 0; i < steps.size(); ++i) {
    const double share = static_cast<double>(std::max<int64_t>(1, streams[i]->op_compute())) /
                         static_cast<double>(std::max<int64_t>(1, total));
    streams[i]->EndStep(steps[i], seconds * share);
  }
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionServiceImpl::Decode(
    grpc::CallbackServerContext* ctx) {
  return new DecodeReactor(this, ctx);
}

void AttentionServiceImpl::DropStopped() {
  executor_->DropStopped();
  control_->DropStopped();
}

bool AttentionServiceImpl::Register(DecodeReactor* r) {
  absl::MutexLock lock(&mu_);
  streams_.insert(r);
  return !draining_.load();
}

void AttentionServiceImpl::Unregister(DecodeReactor* r) {
  absl::MutexLock lock(&mu_);
  streams_.erase(r);
}

void AttentionServiceImpl::CallStarted() {
  absl::MutexLock lock(&mu_);
  ++unary_calls_;
}

void AttentionServiceImpl::CallEnded() {
  absl::MutexLock lock(&mu_);
  --unary_calls_;
}

bool AttentionServiceImpl::WaitForCalls(absl::Time deadline) {
  auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return streams_.empty() && unary_calls_ == 0;
  };
  const bool done = mu_.LockWhenWithDeadline(absl::Condition(&idle), deadline);
  mu_.Unlock();
  return done;
}

void AttentionServiceImpl::BeginShutdown(absl::Time grace_deadline) {
  grace_deadline_ns_.store(absl::ToUnixNanos(grace_deadline), std::memory_order_release);
  std::vector<DecodeReactor*> streams;
  {
    // Under mu_ with the list taken: a stream that starts later learns it
    // in Register and ends itself.
    absl::MutexLock lock(&mu_);
    draining_ = true;
    for (DecodeReactor* r : streams_) {
      r->Ref();
      streams.push_back(r);
    }
  }
  for (DecodeReactor* r : streams) {
    r->Drain();
    r->Unref();
  }
}

}  // namespace ropeattn::server
