#include "server/server.h"

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "core/attention.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/impl/server_builder_plugin.h"
#include "server/auth.h"
#include "server/tls_files.h"
#include "server/cost.h"
#include "server/call_log.h"
#include "server/executor.h"
#include "server/listener.h"
#include "server/log.h"
#include "server/metrics.h"
#include "server/model.h"
#include "server/parse_refusal.h"
#include "server/service.h"
#include "server/sessions.h"
#include "server/stream_charge.h"

namespace ropeattn::server {
namespace {

constexpr char kServiceName[] = "ropeattn.v1.AttentionService";

// A tiny attention with a closed-form answer: every key equal, so the output
// is the mean of the values. If the compute path is broken (wrong numbers, or
// an executor that no longer runs work), health turns NOT_SERVING.
bool CanaryComputesCorrectly() {
  constexpr int64_t kKeys = 8, kDim = 16;
  auto q = Tensor::Create(DType::kF32, {1, 1, 2, kDim});
  auto k = Tensor::Create(DType::kF32, {1, kKeys, 1, kDim});
  auto v = Tensor::Create(DType::kF32, {1, kKeys, 1, kDim});
  auto out = Tensor::Create(DType::kF32, {1, 1, 2, kDim});
  if (!q.ok() || !k.ok() || !v.ok() || !out.ok()) return false;
  for (int64_t i = 0; i < q->num_elements(); ++i) q->data<float>()[i] = 0.25f * (i % 5);
  for (int64_t i = 0; i < k->num_elements(); ++i) k->data<float>()[i] = 0.5f * (i % kDim);
  for (int64_t i = 0; i < v->num_elements(); ++i)
    v->data<float>()[i] = static_cast<float>(i / kDim);
  AttentionOptions o;
  if (!Attend(q->view(), k->view(), v->view(), o, out->view()).ok()) return false;
  const float want = (kKeys - 1) / 2.0f;  // mean of 0..kKeys-1
  for (int64_t i = 0; i < out->num_elements(); ++i) {
    if (std::abs(out->data<float>()[i] - want) > 1e-4f) return false;
  }
  return true;
}

// Removes gRPC's reflection plugin from a ServerBuilder (--reflection=false).
class WithoutReflection : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments* /*args*/) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [](const std::unique_ptr<grpc::ServerBuilderPlugin>& p) {
                                    return absl::StrContains(p->name(), "reflection");
                                  }),
                   plugins->end());
  }
};

}  // namespace

struct Server::Impl {
  std::function<void()> before_grace_passed;  // SetBeforeGracePassedHookForTest
  std::unique_ptr<ModelRegistry> models;
  // Before the grpc::Server: its credentials hold a reference too.
  std::shared_ptr<Authenticator> authenticator;
  // The validated TLS copies its credentials read: they outlive it.
  std::unique_ptr<TlsFiles> tls_files;
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<MemoryBudget> budget;
  std::unique_ptr<Executor> executor;
  std::unique_ptr<Executor> control;  // opens and forks (service.h)
  std::unique_ptr<SessionManager> sessions;
  std::unique_ptr<AttentionServiceImpl> service;
  std::unique_ptr<grpc::Server> grpc_server;
  // Our own listening socket (listener.h): gRPC gets accepted connections
  // through `acceptor`. Declared after grpc_server: destroyed before it.
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor;
  std::unique_ptr<Listener> listener;
  std::unique_ptr<MetricsHttpServer> http;
  std::thread health_thread;
  absl::Notification stop_health;
  std::atomic<bool> forced_not_serving{false};
  absl::Mutex mu;
  bool shut_down ABSL_GUARDED_BY(mu) = false;
  absl::Notification done;

  // -1 before the first SetServing, then 0 or 1: changes are logged.
  std::atomic<int> serving_state{-1};
  absl::Mutex serving_mu;

  // Only a change is set: gRPC's health service sends every status set to
  // every Watch stream, so setting it each canary round sent each watcher
  // SERVING every 2 s. The lock keeps the order of changes and of their
  // statuses the same.
  void SetServing(bool serving, absl::string_view reason) ABSL_LOCKS_EXCLUDED(serving_mu) {
    grpc::HealthCheckServiceInterface* health = grpc_server->GetHealthCheckService();
    if (health == nullptr) return;
    absl::MutexLock lock(&serving_mu);
    if (serving_state.exchange(serving ? 1 : 0) == (serving ? 1 : 0)) return;
    health->SetServingStatus(serving);
    health->SetServingStatus(kServiceName, serving);
    // Draining is planned; a failed self-test is not.
    LogEvent(serving || reason == "draining" ? LogLevel::kInfo : LogLevel::kWarning, "health",
             {{"status", serving ? "SERVING" : "NOT_SERVING"}, {"reason", reason}});
  }

  // Every few seconds, run the canary through the executor. Not finishing in
  // time counts as broken; a full queue (overload) does not.
  void HealthLoop() {
    while (!stop_health.WaitForNotificationWithTimeout(absl::Seconds(2))) {
      auto result = std::make_shared<std::atomic<int>>(0);  // 0 pending, 1 ok, 2 bad
      // Queued work whose call ended without an OnCancel reaching the
      // service (every cancel drops its own at once) leaves the queues here
      // at the latest (a submit drops it too).
      executor->DropStopped();
      control->DropStopped();
      // Behind admitted work it waits as long as that work should take.
      const absl::Duration allowance = service->CanaryAllowance();
      const bool queued =
          executor->TrySubmit([result] { result->store(CanaryComputesCorrectly() ? 1 : 2); });
      if (!queued) continue;
      const absl::Time deadline = absl::Now() + allowance;
      while (result->load() == 0 && absl::Now() < deadline &&
             !stop_health.WaitForNotificationWithTimeout(absl::Milliseconds(20))) {
      }
      if (stop_health.HasBeenNotified()) return;
      const int outcome = result->load();
      const std::string late =
          absl::StrFormat("the compute self-test did not finish in %.0f s (20 s and twice "
                          "the estimated time of the work queued ahead of it)",
                          absl::ToDoubleSeconds(allowance));
      SetServing(outcome == 1 && !forced_not_serving.load(),
                 outcome == 0   ? absl::string_view(late)
                 : outcome == 2 ? "the compute self-test computed a wrong answer"
                 : forced_not_serving.load() ? "set by a test"
                                             : "the compute self-test passed");
      // Freed memory in the allocator's arenas (gRPC's message slices, small
      // per-call buffers) goes back to the system, not only to the budget.
      malloc_trim(0);
    }
  }
};

namespace {

void LogModelLoaded(const Model& model) {
  const ModelConfig& c = model.config();
  LogEvent(LogLevel::kInfo, "model_loaded",
           {{"model", model.name()},
            {"source", model.source()},
            {"model_type", c.model_type},
            {"layers", c.num_layers},
            {"hidden", c.hidden_size},
            {"heads", c.num_heads},
            {"kv_heads", c.num_kv_heads},
            {"head_dim", c.head_dim},
            {"resident_bytes", model.resident_bytes()}});
}

}  // namespace

absl::Status ValidateServerOptions(const ServerOptions& options) {
  if (!(options.handshake_timeout_seconds > 0 && options.handshake_timeout_seconds <= 3600)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--handshake_timeout_seconds must be in (0, 3600], got %g",
                        options.handshake_timeout_seconds));
  }
  if (options.max_connection_idle_seconds < 0 || options.max_connection_idle_seconds > 86400) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--max_connection_idle_seconds must be in [0, 86400], got %d",
                        options.max_connection_idle_seconds));
  }
  if (!(options.max_queue_delay_seconds >= 0 && options.max_queue_delay_seconds <= 3600)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--max_queue_delay_seconds must be in [0, 3600], got %g", options.max_queue_delay_seconds));
  }
  if (!(options.max_queue_slowdown >= 0 && options.max_queue_slowdown <= 1e6)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--max_queue_slowdown must be in [0, 1e6], got %g", options.max_queue_slowdown));
  }
  if (options.compute_nice < 0 || options.compute_nice > 19) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--compute_nice must be in [0, 19], got %d", options.compute_nice));
  }
  if (options.max_decode_batch < 1 || options.max_decode_batch > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--max_decode_batch must be in [1, 1024], got %d", options.max_decode_batch));
  }
  // A thread each: a worker count or a call's threads past what any
  // machine has only exhaust the process's threads (std::system_error at
  // start) or price every request past the budget.
  for (const auto& [name, value] : {std::pair<const char*, int>{"--compute_workers",
                                                                  options.compute_workers},
                                    {"--threads_per_call", options.threads_per_call}}) {
    if (value < 1 || value > kMaxThreadsFlag) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s must be in [1, %d], got %d", name, kMaxThreadsFlag, value));
    }
  }
  // Addresses are checked here too, so a bad one is a usage error before
  // anything starts, named as typed.
  if (absl::StatusOr<ListenAddress> a = ParseListenAddress(options.address); !a.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--address: ", a.status().message()));
  }
  if (!options.metrics_address.empty()) {
    if (absl::StatusOr<ListenAddress> a = ParseListenAddress(options.metrics_address); !a.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics_address: ", a.status().message()));
    }
  }
  // Each flag named with its valid range and the value given.
  auto at_least = [](const char* name, int64_t value, int64_t min) {
    return value >= min ? absl::OkStatus()
                        : absl::InvalidArgumentError(
                              absl::StrFormat("%s must be >= %d, got %d", name, min, value));
  };
  for (absl::Status st : {
           at_least("--queue_depth", options.queue_depth, 1),
           at_least("--max_sessions", options.max_sessions, 1),
           at_least("--memory_budget_bytes", options.memory_budget_bytes, 0),
           at_least("--max_request_compute", options.max_request_compute, 1),
           at_least("--max_context_limit", options.max_context_limit, 1),
           at_least("--default_max_context", options.default_max_context, 1),
           at_least("--max_idle_ttl_seconds", options.max_idle_ttl_seconds, 1),
           at_least("--default_idle_ttl_seconds", options.default_idle_ttl_seconds, 1),
       }) {
    if (!st.ok()) return st;
  }
  if (options.max_message_bytes < 1024 || options.max_message_bytes > (int64_t{2} << 30) - 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--max_message_bytes must be in [1024, 2^31 - 1], got %d", options.max_message_bytes));
  }
  // The defaults a session gets without asking must be ones it could ask for.
  if (options.default_max_context > options.max_context_limit) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--default_max_context %d exceeds --max_context_limit %d: a session that does not ask for "
        "max_context would be refused",
        options.default_max_context, options.max_context_limit));
  }
  if (options.default_idle_ttl_seconds > options.max_idle_ttl_seconds) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--default_idle_ttl_seconds %d exceeds --max_idle_ttl_seconds %d",
                        options.default_idle_ttl_seconds, options.max_idle_ttl_seconds));
  }
  if (!(options.answer_timeout_seconds >= 1 && options.answer_timeout_seconds <= 3600)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--answer_timeout_seconds must be in [1, 3600], got %g", options.answer_timeout_seconds));
  }
  if (!(options.shutdown_grace_seconds >= 0 && options.shutdown_grace_seconds <= 3600)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--shutdown_grace_seconds must be in [0, 3600], got %g", options.shutdown_grace_seconds));
  }
  return CheckSecurityFlags(options);
}

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  if (absl::Status flags = ValidateServerOptions(options); !flags.ok()) return flags;
  absl::Status security = CheckSecurityOptions(options);
  if (!security.ok()) return security;
  if (!CanaryComputesCorrectly()) {
    return absl::InternalError("the compute self-test failed at start-up; not serving");
  }
  // Models first: a broken checkpoint stops start-up before anything listens.
  auto models = std::make_unique<ModelRegistry>();
  if (options.models.empty()) {
    absl::StatusOr<std::shared_ptr<const Model>> demo = Model::Demo("demo");
    if (!demo.ok()) return demo.status();
    LogModelLoaded(**demo);
    absl::Status added = models->Add(*std::move(demo));
    if (!added.ok()) return added;
  }
  for (const auto& [name, dir] : options.models) {
    absl::StatusOr<std::shared_ptr<const Model>> model = Model::Load(name, dir);
    if (!model.ok()) {
      return absl::Status(model.status().code(),
                          absl::StrCat("model ", name, " (", dir, "): ", model.status().message()));
    }
    LogModelLoaded(**model);
    absl::Status added = models->Add(*std::move(model));
    if (!added.ok()) return added;
  }
  // Bind before anything runs: an occupied port fails start-up here, with its
  // own message. Nothing is accepted until everything below has started.
  absl::StatusOr<std::unique_ptr<Listener>> listener =
      Listener::Listen(options.address, options.max_connections);
  if (!listener.ok()) return listener.status();
  auto server = std::unique_ptr<Server>(new Server());
  server->options_ = options;
  server->impl_ = std::make_unique<Impl>();
  Impl& m = *server->impl_;
  m.models = std::move(models);
  m.metrics = std::make_unique<Metrics>();
  // Every series exists from 0, so rate() sees the first request as growth.
  for (const char* method :
       {"Attend", "Encode", "Decode.Open", "Decode.Attach", "Decode.Step", "Decode.Truncate",
        "Decode.Fork", "Decode.Close", "Decode.Export", "GetSession", "ListSessions", "CloseSession",
        "GetServerInfo", "ListModels", "GetModel", "Embed"}) {
    m.metrics->RegisterMethod(method);
  }
  // Decode steps reach the service's batch runner; the service exists
  // before anything is queued.
  m.executor = std::make_unique<Executor>(
      options.compute_workers, options.queue_depth, options.max_decode_batch,
      [&m](absl::Span<BatchTask* const> steps) { m.service->RunDecodeSteps(steps); },
      options.compute_nice);
  m.budget = std::make_unique<MemoryBudget>(options.memory_budget_bytes);
  m.sessions = std::make_unique<SessionManager>(options, m.metrics.get(), m.budget.get());
  absl::StatusOr<std::shared_ptr<Authenticator>> authenticator =
      Authenticator::Create(options, m.metrics.get());
  if (!authenticator.ok()) return authenticator.status();
  m.authenticator = *std::move(authenticator);
  m.control = std::make_unique<Executor>(1, options.queue_depth);
  m.service = std::make_unique<AttentionServiceImpl>(options, m.executor.get(), m.control.get(),
                                                     m.sessions.get(),
                                                     m.metrics.get(), m.models.get(),
                                                     m.budget.get(), m.authenticator.get());
  grpc::EnableDefaultHealthCheckService(true);
  // gRPC's default health service speaks raw bytes and registers no
  // descriptor: reflection would list grpc.health.v1.Health but could not
  // describe it (grpcurl describe / list methods). Touching the generated
  // descriptor puts health.proto into the pool reflection reads.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  m.listener = *std::move(listener);
  server->port_ = m.listener->port();
  m.metrics->SetQueueDepthSource([e = m.executor.get()] { return e->queue_depth(); });
  m.metrics->SetConnectionSource([l = m.listener.get()] {
    return Metrics::ConnectionCounts{l->accepted(), l->refused_over_cap(), l->refused_no_fd()};
  });
  grpc::ServerBuilder builder;
  // Plaintext, TLS or mutual TLS, with the token / certificate
  // authenticator attached when authentication is configured.
  if (TlsConfigured(options)) {
    absl::StatusOr<std::unique_ptr<TlsFiles>> files = TlsFiles::Create(options);
    if (!files.ok()) return files.status();
    m.tls_files = *std::move(files);
  }
  std::shared_ptr<grpc::ServerCredentials> credentials =
      MakeServerCredentials(options, m.authenticator, m.tls_files.get());
  m.acceptor = builder.experimental().AddExternalConnectionAcceptor(
      grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD, credentials);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  // Keepalive matched with the reference client (grpc/grpc issue #33661):
  // pings every 60 s are allowed, even without calls; anything more eager
  // is answered with GOAWAY.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60 * 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20 * 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 30 * 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 3);
  // HTTP/2 hardening for gRPC 1.51's known weaknesses (the CVEs in deploy/README.md).
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 256);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 4 << 20);
  // No compressed requests: gRPC 1.51 inflates a whole message before it
  // checks the size limit (a 0.5 MiB gzip body inflated to 512 MiB). With
  // gzip and deflate disabled a compressed call is refused from its headers
  // (UNIMPLEMENTED), before its message is read.
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
  // Metadata: gRPC 1.51 cannot fail one call whose header block is past this
  // limit without failing every call on its connection (its HPACK parser
  // stops mid-block: CVE-2023-32731), so the limit sits well above what a
  // proxy forwards (deploy/'s Envoy takes 16 KiB from a client), and one
  // caller's large headers never reach the calls a proxy multiplexes with it.
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, kMaxMetadataBytes);
  if (options.max_connection_idle_seconds > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                               options.max_connection_idle_seconds * 1000);
  }
  // gRPC's default gives a silent connection 120 s to send its preface.
  builder.AddChannelArgument(
      GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
      static_cast<int>(std::lround(options.handshake_timeout_seconds * 1000)));
  // The reflection plugin, once initialised, is offered to every builder in
  // the process; this one drops it when reflection is off.
  if (!options.reflection) builder.SetOption(std::make_unique<WithoutReflection>());
  builder.RegisterService(m.service.get());
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  // Health Watch and reflection requests that do not parse: INVALID_ARGUMENT.
  // First, so the call log records the status the client receives.
  interceptors.push_back(MakeParseRefusalFactory());
  // Request ids, error answers and the access log, for every method.
  interceptors.push_back(MakeCallLogFactory(options.access_log, m.metrics.get()));
  // Health Watch and reflection streams: at most max_service_streams at once.
  interceptors.push_back(MakeStreamChargeFactory(options.max_service_streams));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  m.grpc_server = builder.BuildAndStart();
  if (m.grpc_server == nullptr) {
    return absl::InternalError(absl::StrCat("gRPC server for ", options.address, " did not start"));
  }
  if (!options.metrics_address.empty()) {
    auto http = MetricsHttpServer::Start(options.metrics_address, m.metrics.get());
    if (!http.ok()) {
      m.grpc_server->Shutdown(std::chrono::system_clock::now());
      return absl::Status(http.status().code(),
                          absl::StrCat("metrics endpoint: ", http.status().message()));
    }
    m.http = *std::move(http);
  }
  absl::Status accepting = m.listener->Start(m.acceptor.get());
  if (!accepting.ok()) return accepting;
  m.SetServing(true, "started");
  m.health_thread = std::thread([&m] { m.HealthLoop(); });
  return server;
}

Server::~Server() { Shutdown(absl::ZeroDuration()); }

int Server::metrics_port() const { return impl_->http ? impl_->http->port() : 0; }

SessionManager& Server::sessions() { return *impl_->sessions; }
Metrics& Server::metrics() { return *impl_->metrics; }
Executor& Server::executor() { return *impl_->executor; }
Executor& Server::control_executor() { return *impl_->control; }
absl::Duration Server::CanaryAllowance() const { return impl_->service->CanaryAllowance(); }

void Server::SetServingForTest(bool serving) {
  impl_->forced_not_serving = !serving;
  impl_->SetServing(serving, "set by a test");
}

void Server::SetBeforeGracePassedHookForTest(std::function<void()> hook) {
  impl_->before_grace_passed = std::move(hook);
}

void Server::Shutdown(absl::Duration grace) {
  Impl& m = *impl_;
  {
    absl::MutexLock lock(&m.mu);
    if (m.shut_down) return;
    m.shut_down = true;
  }
  if (m.grpc_server == nullptr) {  // Start failed before gRPC started
    if (m.listener) m.listener->Stop();
    if (m.executor) m.executor->Shutdown();
    if (m.control) m.control->Shutdown();
    if (m.sessions) m.sessions->CloseAll();
    if (m.tls_files != nullptr) m.tls_files->RemoveDirectory();
    m.done.Notify();
    return;
  }
  const absl::Time drain_start = absl::Now();
  LogEvent(LogLevel::kInfo, "drain_start",
           {{"grace_s", absl::ToDoubleSeconds(grace)},
            {"sessions_open", m.sessions->open_sessions()}});
  // Load balancers see NOT_SERVING before anything stops.
  m.stop_health.Notify();
  if (m.health_thread.joinable()) m.health_thread.join();
  m.SetServing(false, "draining");
  const absl::Time deadline = absl::Now() + grace;
  m.service->BeginShutdown(deadline);
  // No new connections (the kernel refuses them once the socket is closed).
  m.listener->Stop();
  // In-flight calls get `grace`. gRPC's own Shutdown (GOAWAY, then wait)
  // also waits for calls it never ends itself (a client's health Watch) and,
  // after a large answer, for connections to finish the GOAWAY exchange:
  // seconds, often the whole grace. So it runs beside a wait for this
  // service's own calls; once those are answered, gRPC gets kFlushTime to
  // deliver the last bytes and end the rest gracefully, then whatever is
  // left is cancelled. (Cancelling at once would reset connections whose
  // final answer is still in the socket.) Cancelling repeats until gRPC's
  // Shutdown returns: one that lands before that Shutdown began is lost.
  constexpr absl::Duration kFlushTime = absl::Seconds(1);
  absl::Notification stopped;
  std::thread stopping([&m, &stopped, deadline] {
    m.grpc_server->Shutdown(absl::ToChronoTime(deadline));
    stopped.Notify();
  });
  const bool answered_in_time = m.service->WaitForCalls(deadline);
  stopped.WaitForNotificationWithDeadline(std::min(deadline, absl::Now() + kFlushTime));
  if (m.before_grace_passed) m.before_grace_passed();
  // A call cancelled from now on is cancelled by the drain, not its client
  // (also when every call was answered before the deadline: what is left
  // is cancelled now).
  m.service->GracePassed();
  while (!stopped.WaitForNotificationWithTimeout(absl::Milliseconds(50))) {
    grpc_server_cancel_all_calls(m.grpc_server->c_server());
  }
  stopping.join();
  m.executor->Shutdown();
  m.control->Shutdown();
  const int64_t sessions_closed = m.sessions->open_sessions();
  m.sessions->CloseAll();
  m.http.reset();
  m.authenticator->Stop();
  // gRPC has stopped: no handshake reads the key copies any more (its
  // certificate provider keeps what it read). They go now, not in
  // ~TlsFiles: the binary ends with std::_Exit, which runs no destructor.
  if (m.tls_files != nullptr) m.tls_files->RemoveDirectory();
  LogEvent(LogLevel::kInfo, "drain_end",
           {{"ms", std::round(absl::ToDoubleMilliseconds(absl::Now() - drain_start))},
            {"calls_answered_in_grace", answered_in_time},
            {"sessions_closed", sessions_closed}});
  m.done.Notify();
}

void Server::Wait() { impl_->done.WaitForNotification(); }

}  // namespace ropeattn::server
