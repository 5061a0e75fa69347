// The gRPC listening socket, owned by us instead of by gRPC, and the
// process's file-descriptor limit.
//
// Why not gRPC's own listener (gRPC 1.51):
// - it sets SO_REUSEPORT, so a second server binds an occupied port without
//   error and the kernel splits the connections between the two;
// - its accept loop can stop for good after accept() fails with EMFILE
//   (grpc/grpc#20418): once an idle-connection flood has used up the fds, new
//   connections stay refused even after every flood socket has closed.
// The Listener binds without SO_REUSEPORT, accepts on its own thread, caps
// concurrent connections below the fd limit and hands each accepted socket to
// gRPC through ServerBuilder's external connection acceptor; its accept loop
// never stops on an error.
#ifndef ROPEATTN_SERVER_LISTENER_H_
#define ROPEATTN_SERVER_LISTENER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server_builder.h"

namespace ropeattn::server {

// fds kept free beside the connections when the cap is derived from the fd
// limit: gRPC's own (epoll, wake-ups), the metrics endpoint and its clients,
// model files while they load, stdio.
inline constexpr int64_t kFdReserve = 256;
// The derived cap never goes below this, even under a tiny fd limit.
inline constexpr int kMinDerivedConnections = 16;
// ... nor above this: an idle HTTP/2 connection holds ~17 KiB (measured), so
// the default cap bounds connections' memory at ~68 MiB (README's memory
// paragraph); an fd limit of 1M alone would have allowed 16 GiB.
inline constexpr int kMaxDerivedConnections = 4096;

// Sets RLIMIT_NOFILE's soft limit to its hard limit (to fs.nr_open when the
// hard limit is unlimited) and returns the new soft limit. Internal if
// getrlimit/setrlimit fail (the limit is then unchanged).
absl::StatusOr<int64_t> RaiseFdLimitToHard();
// The current RLIMIT_NOFILE soft limit (INT64_MAX when unlimited).
absl::StatusOr<int64_t> FdSoftLimit();
// The connections the fds allow: the fd soft limit minus kFdReserve minus
// the fds open now (own or inherited), at least kMinDerivedConnections, not
// capped by kMaxDerivedConnections (what an operator's --max_connections
// may not exceed without accept() running out of fds).
absl::StatusOr<int64_t> FdDerivedConnections();
// The connection cap for a requested `max_connections`: itself when > 0;
// for 0, FdDerivedConnections at most kMaxDerivedConnections.
// InvalidArgument when negative.
absl::StatusOr<int> ResolveMaxConnections(int max_connections);

// A parsed listen address.
struct ListenAddress {
  std::string host;  // as written, without brackets
  int port = 0;
  bool ipv6 = false;
};
// "host:port": host an IPv4 literal, "[IPv6 literal]" or "localhost"
// (= 127.0.0.1; no DNS lookups, so start-up never depends on DNS), port
// 0..65535 (0 picks a free one). InvalidArgument naming the address otherwise.
absl::StatusOr<ListenAddress> ParseListenAddress(const std::string& address);
// Whether a parsed host is a loopback address: 127.0.0.0/8, ::1 (any
// spelling) or IPv4-mapped ::ffff:127.0.0.0/104.
bool IsLoopbackHost(const std::string& host);

// Thread-safety: port(), max_connections() and the counters may be called
// from any thread at any time; Start and Stop from one controlling thread.
class Listener {
 public:
  // Binds `address` (see ParseListenAddress; "[::]" listens dual-stack) with
  // SO_REUSEADDR but never SO_REUSEPORT, and listens. `max_connections` as
  // in ResolveMaxConnections. Errors:
  //   InvalidArgument  malformed address, negative max_connections;
  //   Unavailable      the port is taken ("cannot listen on ADDRESS: address
  //                    already in use (is another server running on this
  //                    port?)") or the address is not local;
  //   PermissionDenied a privileged port without the capability.
  // Nothing is accepted until Start.
  static absl::StatusOr<std::unique_ptr<Listener>> Listen(const std::string& address,
                                                          int max_connections);
  ~Listener();  // Stop()
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  // The bound port (the real one when the address asked for port 0).
  int port() const { return port_; }
  int max_connections() const { return max_connections_; }

  // Starts the accept thread, handing each accepted socket to `acceptor`
  // (not owned; must stay valid until Stop returns, and its gRPC server must
  // be started: gRPC 1.51 leaks, rather than closes, an fd handed to an
  // acceptor whose server is not running). FailedPrecondition if already
  // started or stopped, or if /proc/self/fd cannot be read (the cap needs
  // it); InvalidArgument for a null acceptor.
  absl::Status Start(grpc::experimental::ExternalConnectionAcceptor* acceptor);
  // Stops accepting: joins the accept thread (within one poll interval,
  // 50 ms) and closes the listening socket, so new connection attempts are
  // refused by the kernel. Connections already handed to gRPC are gRPC's.
  // Idempotent.
  void Stop();

  // Connections handed to gRPC since start.
  int64_t accepted() const { return accepted_.load(std::memory_order_relaxed); }
  // Connections closed at once because the cap was reached.
  int64_t refused_over_cap() const { return refused_over_cap_.load(std::memory_order_relaxed); }
  // Connections closed at once because accept() failed for lack of fds
  // (EMFILE/ENFILE; the spare-fd trick, see listener.cc).
  int64_t refused_no_fd() const { return refused_no_fd_.load(std::memory_order_relaxed); }

  // How live connections are estimated (gRPC owns a socket once handed over
  // and does not say when it closes it): the process's open fds, counted in
  // /proc/self/fd, minus those open when Start ran (the baseline), plus the
  // connections accepted since that count. The count is O(open fds), so it is
  // redone at most every max(50 ms, 10 x the last count's duration) and only
  // when a connection arrives. Error of the estimate:
  // - over: a connection gRPC closed since the last count still counts (for
  //   at most one recount interval), and any other fd the process opened
  //   after Start counts as a connection; both refuse early, the safe side;
  // - under: fds open at Start and closed later (a production server keeps
  //   those for its lifetime; a test process with other servers may not).
  // If /proc/self/fd cannot be read (e.g. no fd left for opendir), the last
  // count is kept and the accepts since it keep adding up.
  int64_t EstimatedConnections() const {
    return estimated_connections_.load(std::memory_order_relaxed);
  }

 private:
  Listener() = default;
  void AcceptLoop(grpc::experimental::ExternalConnectionAcceptor* acceptor);
  // Accepts what is pending (bounded per call so Stop stays prompt).
  void AcceptPending(grpc::experimental::ExternalConnectionAcceptor* acceptor);
  // accept() failed with EMFILE/ENFILE: frees the spare fd, accepts the
  // oldest pending connection and closes it, takes the spare back.
  void ShedOneWithSpareFd();
  bool OverCap();
  void LogError(const char* what, int err);

  int fd_ = -1;        // listening socket
  int spare_fd_ = -1;  // /dev/null, kept for ShedOneWithSpareFd
  int port_ = 0;
  int max_connections_ = 0;
  std::string address_;

  // Accept-thread state for the estimate (see EstimatedConnections).
  int64_t baseline_fds_ = 0;
  int64_t counted_fds_ = 0;
  int64_t accepted_since_count_ = 0;
  absl::Time counted_at_ = absl::InfinitePast();
  absl::Duration recount_interval_ = absl::Milliseconds(50);
  // Rate-limited error log.
  absl::Time logged_at_ = absl::InfinitePast();
  int64_t unlogged_errors_ = 0;

  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> accepted_{0};
  std::atomic<int64_t> refused_over_cap_{0};
  std::atomic<int64_t> refused_no_fd_{0};
  std::atomic<int64_t> estimated_connections_{0};

  absl::Mutex mu_;  // Start/Stop
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_LISTENER_H_
