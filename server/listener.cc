#include "server/listener.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/log.h"

namespace ropeattn::server {
namespace {

// How long the accept thread sleeps in poll() at most: the bound on Stop().
constexpr int kPollTimeoutMs = 50;
// Accepts per poll wake-up before Stop is checked again.
constexpr int kMaxAcceptsPerWakeup = 256;
// Pause after an error that a retry cannot fix at once (no fds, no buffers),
// so the loop does not spin while gRPC closes sockets.
constexpr absl::Duration kErrorBackoff = absl::Milliseconds(5);
constexpr absl::Duration kMinRecountInterval = absl::Milliseconds(50);
// Errors are logged at most this often; the rest are counted in the next line.
constexpr absl::Duration kLogInterval = absl::Seconds(1);

std::string ErrnoText(int err) {
  char buf[256];
  // GNU strerror_r: returns the message, which may or may not be in buf.
  return strerror_r(err, buf, sizeof(buf));
}

// Open fds of this process, not counting the one opendir uses; -1 when
// /proc/self/fd cannot be read.
int64_t CountOpenFds() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int64_t n = 0;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++n;
  }
  closedir(dir);
  return n - 1;
}

// Closes with an RST rather than a FIN: the peer learns at once that it was
// refused, and a flood leaves no TIME_WAIT sockets behind on our side.
void CloseAtOnce(int fd) {
  const linger abort_on_close{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &abort_on_close, sizeof(abort_on_close));
  close(fd);
}

// Errors accept() reports for one pending connection (man 2 accept, Linux
// notes): retrying serves the next one.
bool IsPerConnectionError(int err) {
  switch (err) {
    case EINTR:
    case ECONNABORTED:
    case EPROTO:
    case EPERM:  // a firewall rule refused it
    case ENETDOWN:
    case ENOPROTOOPT:
    case EHOSTDOWN:
    case ENONET:
    case EHOSTUNREACH:
    case EOPNOTSUPP:
    case ENETUNREACH:
      return true;
    default:
      return false;
  }
}

}  // namespace

absl::StatusOr<int64_t> FdSoftLimit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) {
    return absl::InternalError(absl::StrCat("getrlimit(RLIMIT_NOFILE): ", ErrnoText(errno)));
  }
  if (lim.rlim_cur == RLIM_INFINITY ||
      lim.rlim_cur > static_cast<rlim_t>(std::numeric_limits<int64_t>::max())) {
    return std::numeric_limits<int64_t>::max();
  }
  return static_cast<int64_t>(lim.rlim_cur);
}

absl::StatusOr<int64_t> RaiseFdLimitToHard() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) {
    return absl::InternalError(absl::StrCat("getrlimit(RLIMIT_NOFILE): ", ErrnoText(errno)));
  }
  rlim_t target = lim.rlim_max;
  if (target == RLIM_INFINITY) {
    // The kernel refuses an unlimited soft limit for fds; fs.nr_open is the
    // real ceiling.
    target = rlim_t{1} << 20;
    std::ifstream nr_open("/proc/sys/fs/nr_open");
    uint64_t value = 0;
    if (nr_open >> value && value > 0) target = static_cast<rlim_t>(value);
  }
  if (lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < target) {
    const rlim_t before = lim.rlim_cur;
    lim.rlim_cur = target;
    if (setrlimit(RLIMIT_NOFILE, &lim) != 0) {
      return absl::InternalError(absl::StrCat("setrlimit(RLIMIT_NOFILE) from ", before, " to ",
                                              target, ": ", ErrnoText(errno)));
    }
  }
  return FdSoftLimit();
}

absl::StatusOr<int> ResolveMaxConnections(int max_connections) {
  if (max_connections < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_connections must be >= 0 (0 = derived from the fd limit), got ", max_connections));
  }
  if (max_connections > 0) return max_connections;
  absl::StatusOr<int64_t> derived = FdDerivedConnections();
  if (!derived.ok()) return derived.status();
  return static_cast<int>(std::min<int64_t>(*derived, kMaxDerivedConnections));
}

absl::StatusOr<int64_t> FdDerivedConnections() {
  absl::StatusOr<int64_t> soft = FdSoftLimit();
  if (!soft.ok()) return soft.status();
  // fds already open (inherited from whoever started us, or our own) are not
  // free for connections.
  const int64_t open_fds = std::max<int64_t>(0, CountOpenFds());
  return std::max<int64_t>(kMinDerivedConnections, *soft - kFdReserve - open_fds);
}

bool IsLoopbackHost(const std::string& host) {
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    // ::1 in any spelling (inet_pton parses them all to the same bytes), or
    // an IPv4-mapped 127/8 (::ffff:127.0.0.1: a dual-stack socket bound there
    // takes only IPv4 loopback connections).
    return IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
  }
  return host == "localhost";
}

absl::StatusOr<ListenAddress> ParseListenAddress(const std::string& address) {
  const absl::string_view text = address;
  ListenAddress out;
  absl::string_view host;
  absl::string_view port_text;
  if (absl::StartsWith(text, "[")) {
    const size_t close = text.find(']');
    if (close == absl::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return absl::InvalidArgumentError(absl::StrCat(
          "listen address must be \"[ipv6]:port\" when it starts with '[', got \"", address, "\""));
    }
    out.ipv6 = true;
    host = text.substr(1, close - 1);
    port_text = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("listen address must be \"host:port\", got \"", address, "\""));
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
        absl::StrCat("listen address port must be a number in 0..65535, got \"", address, "\""));
  }
  out.port = static_cast<int>(port);
  out.host = std::string(host);
  if (out.ipv6) {
    in6_addr a6{};
    if (inet_pton(AF_INET6, out.host.c_str(), &a6) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("listen address host is not an IPv6 literal: \"", address, "\""));
    }
    return out;
  }
  // "localhost" is the one name accepted: resolving others would make
  // start-up depend on DNS.
  if (out.host == "localhost") out.host = "127.0.0.1";
  in_addr a4{};
  if (inet_pton(AF_INET, out.host.c_str(), &a4) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "listen address host must be an IPv4 literal, [IPv6] or localhost, got \"", address, "\""));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Listener>> Listener::Listen(const std::string& address,
                                                           int max_connections) {
  absl::StatusOr<int> cap = ResolveMaxConnections(max_connections);
  if (!cap.ok()) return cap.status();
  absl::StatusOr<ListenAddress> parsed = ParseListenAddress(address);
  if (!parsed.ok()) return parsed.status();

  sockaddr_storage storage{};
  socklen_t length = 0;
  if (parsed->ipv6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&storage);
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(static_cast<uint16_t>(parsed->port));
    inet_pton(AF_INET6, parsed->host.c_str(), &a->sin6_addr);
    length = sizeof(sockaddr_in6);
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&storage);
    a->sin_family = AF_INET;
    a->sin_port = htons(static_cast<uint16_t>(parsed->port));
    inet_pton(AF_INET, parsed->host.c_str(), &a->sin_addr);
    length = sizeof(sockaddr_in);
  }

  std::unique_ptr<Listener> listener(new Listener());
  listener->address_ = address;
  listener->max_connections_ = *cap;
  const auto fail = [&address](absl::StatusCode code, absl::string_view what) {
    return absl::Status(code, absl::StrCat("cannot listen on ", address, ": ", what));
  };
  listener->fd_ =
      socket(storage.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, IPPROTO_TCP);
  if (listener->fd_ < 0) {
    return fail(absl::StatusCode::kUnavailable, absl::StrCat("socket: ", ErrnoText(errno)));
  }
  // SO_REUSEADDR only lets us rebind past our own TIME_WAIT sockets after a
  // restart; it never shares a port with a listening socket. SO_REUSEPORT,
  // which would, is deliberately not set.
  const int one = 1;
  setsockopt(listener->fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (parsed->ipv6) {
    // "[::]" takes IPv4 clients too, as gRPC's own listener does.
    const int zero = 0;
    setsockopt(listener->fd_, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
  }
  if (bind(listener->fd_, reinterpret_cast<const sockaddr*>(&storage), length) != 0 ||
      listen(listener->fd_, SOMAXCONN) != 0) {
    const int err = errno;
    switch (err) {
      case EADDRINUSE:
        return fail(absl::StatusCode::kUnavailable,
                    "address already in use (is another server running on this port?)");
      case EACCES:
        return fail(absl::StatusCode::kPermissionDenied,
                    "permission denied (a port below 1024 needs CAP_NET_BIND_SERVICE)");
      case EADDRNOTAVAIL:
        return fail(absl::StatusCode::kUnavailable, "not an address of this machine");
      default:
        return fail(absl::StatusCode::kUnavailable, ErrnoText(err));
    }
  }
  getsockname(listener->fd_, reinterpret_cast<sockaddr*>(&storage), &length);
  listener->port_ = ntohs(parsed->ipv6 ? reinterpret_cast<sockaddr_in6*>(&storage)->sin6_port
                                       : reinterpret_cast<sockaddr_in*>(&storage)->sin_port);
  listener->spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  return listener;
}

Listener::~Listener() { Stop(); }

absl::Status Listener::Start(grpc::experimental::ExternalConnectionAcceptor* acceptor) {
  absl::MutexLock lock(&mu_);
  if (started_ || stopped_) {
    return absl::FailedPreconditionError(
        absl::StrCat("listener on ", address_, " was already ", stopped_ ? "stopped" : "started"));
  }
  if (acceptor == nullptr) return absl::InvalidArgumentError("acceptor must not be null");
  const int64_t fds = CountOpenFds();
  if (fds < 0) {
    // Without the count the cap cannot be kept; refusing to start is more
    // honest than serving without it.
    return absl::FailedPreconditionError(
        absl::StrCat("cannot count open fds in /proc/self/fd (needed for the connection cap): ",
                     ErrnoText(errno)));
  }
  baseline_fds_ = fds;
  counted_fds_ = fds;
  accepted_since_count_ = 0;
  counted_at_ = absl::Now();
  started_ = true;
  thread_ = std::thread([this, acceptor] { AcceptLoop(acceptor); });
  return absl::OkStatus();
}

void Listener::Stop() {
  absl::MutexLock lock(&mu_);
  if (stopped_) return;
  stopped_ = true;
  stopping_.store(true);
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  if (spare_fd_ >= 0) close(spare_fd_);
  spare_fd_ = -1;
}

void Listener::AcceptLoop(grpc::experimental::ExternalConnectionAcceptor* acceptor) {
  while (!stopping_.load()) {
    pollfd p{fd_, POLLIN, 0};
    const int ready = poll(&p, 1, kPollTimeoutMs);
    if (ready < 0) {
      if (errno != EINTR) {
        LogError("poll", errno);
        absl::SleepFor(kErrorBackoff);
      }
      continue;
    }
    if (ready > 0) AcceptPending(acceptor);
  }
}

void Listener::AcceptPending(grpc::experimental::ExternalConnectionAcceptor* acceptor) {
  for (int i = 0; i < kMaxAcceptsPerWakeup && !stopping_.load(); ++i) {
    const int fd = accept4(fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      if (IsPerConnectionError(err)) continue;
      if (err == EMFILE || err == ENFILE) {
        ShedOneWithSpareFd();
      } else {
        LogError("accept", err);  // ENOBUFS, ENOMEM, or a bug: never stop
      }
      absl::SleepFor(kErrorBackoff);
      return;
    }
    if (OverCap()) {
      // Counted before the close, so a client that sees the reset also sees
      // the count.
      refused_over_cap_.fetch_add(1, std::memory_order_relaxed);
      CloseAtOnce(fd);
      continue;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ++accepted_since_count_;
    accepted_.fetch_add(1, std::memory_order_relaxed);
    estimated_connections_.fetch_add(1, std::memory_order_relaxed);
    // gRPC owns the fd from here.
    grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters params;
    params.listener_fd = fd_;
    params.fd = fd;
    acceptor->HandleNewConnection(&params);
  }
}

// The classic answer to EMFILE (libev's documentation, among others): the
// pending connection cannot be accepted, and left in the backlog it keeps the
// socket readable, so poll() would spin and the client would wait with no
// answer. One fd kept in reserve lets us accept it and close it at once.
void Listener::ShedOneWithSpareFd() {
  LogError("accept (shedding connections until fds free up)", EMFILE);
  if (spare_fd_ >= 0) {
    close(spare_fd_);
    spare_fd_ = -1;
  }
  const int fd = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd >= 0) {
    refused_no_fd_.fetch_add(1, std::memory_order_relaxed);
    CloseAtOnce(fd);
  }
  // May fail while fds are still short; the next shed tries again.
  spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
}

bool Listener::OverCap() {
  const absl::Time now = absl::Now();
  if (now - counted_at_ >= recount_interval_) {
    const int64_t fds = CountOpenFds();
    const absl::Time done = absl::Now();
    if (fds >= 0) {
      counted_fds_ = fds - 1;  // not the connection being decided on
      accepted_since_count_ = 0;
    }
    counted_at_ = done;
    recount_interval_ = std::max(kMinRecountInterval, 10 * (done - now));
  }
  const int64_t live = std::max<int64_t>(0, counted_fds_ - baseline_fds_) + accepted_since_count_;
  estimated_connections_.store(live, std::memory_order_relaxed);
  return live >= max_connections_;
}

void Listener::LogError(const char* what, int err) {
  const absl::Time now = absl::Now();
  if (now - logged_at_ < kLogInterval) {
    ++unlogged_errors_;
    return;
  }
  LogEvent(LogLevel::kError, "listener_error",
           {{"address", address_},
            {"port", port_},
            {"what", what},
            {"message", ErrnoText(err)},
            {"suppressed_since_last", unlogged_errors_}});
  logged_at_ = now;
  unlogged_errors_ = 0;
}

}  // namespace ropeattn::server
