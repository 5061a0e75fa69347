// AttentionService on gRPC's callback API. Every handler is a translator
// (proto -> core call -> proto, one status mapping at the edge); compute runs
// on the service's Executor, never on gRPC's threads.
#ifndef ROPEATTN_SERVER_SERVICE_H_
#define ROPEATTN_SERVER_SERVICE_H_

#include <atomic>
#include <functional>
#include <limits>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "ropeattn/v1/attention.grpc.pb.h"
#include "server/answer_watch.h"
#include "server/admission.h"
#include "server/cost.h"
#include "server/executor.h"
#include "server/metrics.h"
#include "server/model.h"
#include "server/options.h"
#include "server/principal.h"
#include "server/sessions.h"

namespace ropeattn::server {

// An open Decode stream's share of the memory budget, held from its start
// to its end (gRPC keeps ~20 KiB for a stream however idle; README
// "Limits").
inline constexpr int64_t kDecodeStreamBytes = int64_t{32} << 10;
// (kInfoAnswerSlackBytes, an answer's SessionInfo not held from the budget,
// is in server/sessions.h.)

class Authenticator;
class DecodeReactor;

class UnaryCall;

// Every method of the service raw (gRPC hands over the message bytes): the
// service parses each request itself, so a message that does not parse is
// answered INVALID_ARGUMENT naming its type and why. gRPC's own parsing
// answers a unary call UNIMPLEMENTED with no message and ends a Decode
// stream as if its client had half-closed (status OK, the step dropped).
using RawAttentionService = v1::AttentionService::WithRawCallbackMethod_Attend<
    v1::AttentionService::WithRawCallbackMethod_Encode<
        v1::AttentionService::WithRawCallbackMethod_Decode<
            v1::AttentionService::WithRawCallbackMethod_GetSession<
                v1::AttentionService::WithRawCallbackMethod_ListSessions<
                    v1::AttentionService::WithRawCallbackMethod_CloseSession<
                        v1::AttentionService::WithRawCallbackMethod_GetServerInfo<
                            v1::AttentionService::WithRawCallbackMethod_ListModels<
                                v1::AttentionService::WithRawCallbackMethod_GetModel<
                                    v1::AttentionService::WithRawCallbackMethod_Embed<
                                        v1::AttentionService::Service>>>>>>>>>>;

// For tests: `hook` runs at the start of every Decode stream's read end
// (OnReadDone, given its `ok`) on gRPC's thread, so a test can hold a read
// gRPC ended while it starts a shutdown. Null: none.
void SetDecodeReadDoneHookForTest(std::function<void(bool ok)> hook);

class AttentionServiceImpl final : public RawAttentionService {
 public:
  // `budget` (not owned) is the server-wide memory budget requests reserve
  // their transient bytes from (sessions reserve theirs through `sessions`).
  // `authenticator` (not owned, may be null when authentication is not
  // configured) names each call's principal.
  // `control` (not owned) runs a Decode stream's open, fork and export: they
  // allocate or copy session state, so they leave gRPC's threads, but they
  // never wait behind kernels on `executor`; those priced past
  // kInlineMaxCompute (a prefix import, a large export) are compute
  // themselves and run on `executor`, so they never hold the small ones.
  AttentionServiceImpl(const ServerOptions& options, Executor* executor, Executor* control,
                       SessionManager* sessions, Metrics* metrics, const ModelRegistry* models,
                       MemoryBudget* budget, const Authenticator* authenticator);
  ~AttentionServiceImpl() override;

  // The raw methods: parse the request (INVALID_ARGUMENT when it does not
  // parse), run the typed handler below, serialize its answer.
#define ROPEATTN_RAW_UNARY(Name)                                                        \
  grpc::ServerUnaryReactor* Name(grpc::CallbackServerContext* ctx,                      \
                                 const grpc::ByteBuffer* request, grpc::ByteBuffer* response) \
      override;
  ROPEATTN_RAW_UNARY(Attend)
  ROPEATTN_RAW_UNARY(Encode)
  ROPEATTN_RAW_UNARY(Embed)
  ROPEATTN_RAW_UNARY(GetSession)
  ROPEATTN_RAW_UNARY(ListSessions)
  ROPEATTN_RAW_UNARY(CloseSession)
  ROPEATTN_RAW_UNARY(GetServerInfo)
  ROPEATTN_RAW_UNARY(ListModels)
  ROPEATTN_RAW_UNARY(GetModel)
#undef ROPEATTN_RAW_UNARY
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Decode(
      grpc::CallbackServerContext* ctx) override;

  // Shutdown: streams waiting for their next message end at once with
  // UNAVAILABLE; streams in a step end right after answering it.
  // `grace_deadline`: when --shutdown_grace_seconds passes (grace_passed).
  void BeginShutdown(absl::Time grace_deadline);
  bool draining() const { return draining_.load(); }
  // The server cancels what still runs only once the grace has passed: a
  // cancel seen from then on is the drain's (UNAVAILABLE to its client),
  // one seen before is the client's own, draining or not. By the clock, not
  // only by GracePassed: gRPC's own Shutdown(deadline) cancels every call
  // at the same deadline, from its thread, and a cancel it runs before
  // GracePassed is called must still be taken for the drain's.
  void GracePassed() { grace_passed_ = true; }
  bool grace_passed() const {
    if (grace_passed_.load()) return true;
    if (!draining()) return false;
    return absl::Now() >= absl::FromUnixNanos(grace_deadline_ns_.load(std::memory_order_acquire));
  }

  // Waits until every call of this service (Decode streams and unary
  // compute calls, answers included) is done, or until `deadline`; true
  // when none is left. Calls of other services (health Watch, reflection)
  // are not counted: gRPC does not end those itself.
  bool WaitForCalls(absl::Time deadline);

  // A unary compute call's lifetime, reactor creation to OnDone.
  void CallStarted();
  // A unary answer handed to gRPC: cancelled if not taken in time.
  void WatchAnswer(const std::shared_ptr<AnswerWatch::Handle>& h) { answer_watch_.Arm(h); }
  AnswerWatch* WatchAnswers() { return &answer_watch_; }
  // Abandons the queued work of calls that were cancelled or expired
  // (Executor::DropStopped, both queues): called from every OnCancel.
  void DropStopped();
  void CallEnded();

  // One request or decode operation on a compute worker, start to end:
  // ropeattn_compute_seconds{method} and the ropeattn_running gauge.
  class ComputeScope {
   public:
    ComputeScope(AttentionServiceImpl* service, const char* method);
    ~ComputeScope();
    ComputeScope(const ComputeScope&) = delete;
    ComputeScope& operator=(const ComputeScope&) = delete;

   private:
    AttentionServiceImpl* const service_;
    const char* const method_;
    const absl::Time start_;
  };

  // The principal of a call (server/auth.h): anonymous when authentication
  // is not configured.
  absl::StatusOr<Principal> CallerOf(const grpc::ServerContextBase& ctx) const;
  // CallerOf for a call that is refused without a principal: a refusal
  // (UNAUTHENTICATED: a token revoked since gRPC's auth filter admitted the
  // call) is counted in ropeattn_auth_refused_total, as the filter's are.
  absl::StatusOr<Principal> AuthenticateCall(const grpc::ServerContextBase& ctx) const;
  // Counts a refusal `status` (if UNAUTHENTICATED) under `reason`.
  void CountAuthRefusal(const absl::Status& status, const char* reason) const;
  // The executor's fair-queueing key of a call: its principal when
  // authentication is configured, else its connection (peer address).
  std::string FairShareKey(const grpc::ServerContextBase& ctx) const;

  // The executor's batch runner: decode steps (of different sessions)
  // taken together, computed as one pass (docs/scheduler.md).
  void RunDecodeSteps(absl::Span<BatchTask* const> steps);

  // How long the health canary, queued now, may take before it counts as
  // failed: 20 s plus twice the estimated time of the work ahead of it
  // (at the measured rates; 1e9 units/s for a kind not measured yet),
  // at most an hour. An admitted request of 25 s made health NOT_SERVING.
  absl::Duration CanaryAllowance() const;

 private:
  friend class DecodeReactor;
  friend class UnaryCall;
  // The typed handlers: each answers through `call` (UnaryCall::Answer).
  void DoAttend(UnaryCall* call, grpc::CallbackServerContext* ctx,
                const v1::AttendRequest* request, v1::AttendResponse* response);
  void DoEncode(UnaryCall* call, grpc::CallbackServerContext* ctx,
                const v1::EncodeRequest* request, v1::EncodeResponse* response);
  void DoEmbed(UnaryCall* call, grpc::CallbackServerContext* ctx,
               const v1::EmbedRequest* request, v1::EmbedResponse* response);
  // Holds, for `call`, the memory of a SessionInfo answer about `id` (its
  // spec copied and serialized) past kInfoAnswerSlackBytes.
  absl::Status HoldInfoAnswer(UnaryCall* call, const std::string& id, const Principal& caller,
                              const char* method);
  void DoGetSession(UnaryCall* call, grpc::CallbackServerContext* ctx,
                    const v1::GetSessionRequest* request, v1::SessionInfo* response);
  void DoListSessions(UnaryCall* call, grpc::CallbackServerContext* ctx,
                      const v1::ListSessionsRequest* request,
                      v1::ListSessionsResponse* response);
  void DoCloseSession(UnaryCall* call, grpc::CallbackServerContext* ctx,
                      const v1::CloseSessionRequest* request,
                      v1::CloseSessionResponse* response);
  void DoGetServerInfo(UnaryCall* call, grpc::CallbackServerContext* ctx,
                       const v1::GetServerInfoRequest* request, v1::ServerInfo* response);
  void DoListModels(UnaryCall* call, grpc::CallbackServerContext* ctx,
                    const v1::ListModelsRequest* request, v1::ListModelsResponse* response);
  void DoGetModel(UnaryCall* call, grpc::CallbackServerContext* ctx,
                  const v1::GetModelRequest* request, v1::ModelInfo* response);
  // Parses `in` into a Req owned by a new UnaryCall and runs `handler`, or
  // answers INVALID_ARGUMENT when it does not parse.
  template <typename Req, typename Resp>
  grpc::ServerUnaryReactor* ServeUnary(
      grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in, grpc::ByteBuffer* out,
      const char* method,
      void (AttentionServiceImpl::*handler)(UnaryCall*, grpc::CallbackServerContext*,
                                            const Req*, Resp*));
  // Prices the request (`price`), checks the cost against the limits and
  // reserves its transient bytes, then queues `run` (given the call's stop
  // token) on the executor. Refusals answer at once, nothing allocated.
  // `run(stop, threads)` computes on `threads` kernel threads. With
  // `may_inline`, a request priced at most kInlineMaxCompute that finds a
  // worker idle and nobody waiting runs on the gRPC thread, on one kernel
  // thread (its answer planned for threads_per_call all the same).
  template <typename PriceFn, typename RunFn>
  void RunOnExecutor(UnaryCall* call, grpc::CallbackServerContext* ctx, const char* method,
                     PriceFn price, RunFn run, bool may_inline);
  // About 100 us of one core (at the ~0.03 ns a unit small Attends run at
  // since every input element and cos/sin pair is priced at its cost):
  // below it, two thread hand-offs cost more than the compute. (At 2 Mi
  // units, where it stood before those prices rose, the [1, 16, 8, 64]
  // RoPE Attend of the paired bench, 2.66 Mi units and ~20 us of compute,
  // went to a worker and its round trip grew by ~30 us.)
  static constexpr int64_t kInlineMaxCompute = int64_t{4} << 20;
  // The retry-after-ms hint of a refusal because the queue is full
  // (Admission::QueueRetryHint: what is left of the running work).
  absl::Duration QueueRetryHint(const Executor::Ahead& ahead) const;
  // A SessionInfo copy of `bytes`: from the budget, else (when `fallback`)
  // from info_overdraft_; the budget's refusal when neither can.
  absl::StatusOr<MemoryBudget::Reservation> ReserveInfoCopy(int64_t bytes, const std::string& what,
                                                            bool fallback);
  // Lists a new stream for BeginShutdown's drain. False when the drain
  // began before (the stream is listed, but the drain's list was taken
  // without it: it must end itself). Decided under mu_, which BeginShutdown
  // sets draining_ under, so a stream is either drained or told here.
  bool Register(DecodeReactor* r);
  void Unregister(DecodeReactor* r);

  const ServerOptions options_;
  Executor* const executor_;
  Executor* const control_;
  SessionManager* const sessions_;
  Metrics* const metrics_;
  const ModelRegistry* const models_;
  MemoryBudget* const budget_;
  // SessionInfo copies the budget cannot hold: a one-session ListSessions
  // page, a GetSession or an attach of a session with a large spec on a
  // full budget would otherwise be refused for good (an operator could not
  // list past it). At most twice --max_message_bytes of such copies at once.
  MemoryBudget info_overdraft_;
  const CostLimits limits_;
  const bool auth_configured_;
  const Authenticator* const authenticator_;
  Admission admission_;  // by time: deadline and --max_queue_delay_seconds
  // Cancels calls whose answers stay untaken (--answer_timeout_seconds).
  AnswerWatch answer_watch_;
  std::atomic<bool> draining_{false};  // set under mu_ (Register)
  std::atomic<bool> grace_passed_{false};
  // BeginShutdown's grace_deadline, set before draining_.
  std::atomic<int64_t> grace_deadline_ns_{std::numeric_limits<int64_t>::max()};
  std::atomic<int64_t> computing_{0};
  absl::Mutex mu_;
  absl::flat_hash_set<DecodeReactor*> streams_ ABSL_GUARDED_BY(mu_);
  int64_t unary_calls_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_SERVICE_H_
