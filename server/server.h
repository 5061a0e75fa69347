// One running ropeattn server: gRPC (AttentionService, health, reflection),
// the compute executor, the session manager and the metrics endpoint.
#ifndef ROPEATTN_SERVER_SERVER_H_
#define ROPEATTN_SERVER_SERVER_H_

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/options.h"

namespace ropeattn::server {

class Executor;
class Metrics;
class MetricsHttpServer;
class SessionManager;
class AttentionServiceImpl;
class ModelRegistry;

// Largest header block (metadata) of one call, in bytes, as gRPC counts it
// (name + value + 32 per entry).
inline constexpr int kMaxMetadataBytes = 64 * 1024;

// Largest --compute_workers and --threads_per_call (a thread each).
inline constexpr int kMaxThreadsFlag = 256;

// The options' values alone, checked as flags (no file read, nothing bound):
// each in its range, and the defaults within their caps. InvalidArgument
// naming the flag as typed (--name) and its value; ropeattn-server exits 2
// (a usage error) on it. Start checks it first.
absl::Status ValidateServerOptions(const ServerOptions& options);

class Server {
 public:
  // Binds, starts every part and marks health SERVING. Unavailable if an
  // address cannot be bound; InvalidArgument for bad options.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options);
  ~Server();  // Shutdown(0) if still running

  int port() const { return port_; }
  int metrics_port() const;  // 0 when the endpoint is disabled

  // Graceful stop: health NOT_SERVING first, then no new calls, in-flight
  // work (and open streams) gets `grace` to finish before it is cancelled;
  // once gRPC has stopped, the TLS key copies (tls_files.h) are removed.
  // Idempotent and thread-safe.
  void Shutdown(absl::Duration grace);
  // Blocks until Shutdown has completed.
  void Wait();

  SessionManager& sessions();
  Metrics& metrics();
  // The compute workers' executor and the control one (opens, forks,
  // exports): tests occupy a worker with a task of their own to hold work in
  // the queue deterministically.
  Executor& executor();
  Executor& control_executor();
  // How long the health canary queued now may take (see CanaryAllowance).
  absl::Duration CanaryAllowance() const;
  const ServerOptions& options() const { return options_; }
  // For tests: marks health NOT_SERVING as if the compute path were broken.
  void SetServingForTest(bool serving);
  // For tests: runs in Shutdown once the grace has passed, before the
  // server marks it passed and cancels what still runs (gRPC's own
  // Shutdown may cancel calls meanwhile). Set before Shutdown.
  void SetBeforeGracePassedHookForTest(std::function<void()> hook);

 private:
  Server() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  ServerOptions options_;
  int port_ = 0;
};

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_SERVER_H_
