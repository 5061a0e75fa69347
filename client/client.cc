#include "client/client.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/credentials.h"
#include "client/ring.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace ropeattn::client {

namespace {

constexpr char kRoutingKeyHeader[] = "x-ropeattn-session-key";
constexpr absl::Duration kFirstBackoff = absl::Milliseconds(50);
constexpr absl::Duration kMaxBackoff = absl::Seconds(5);

// gRPC and absl share the canonical code numbers 0..16.
absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  const int code = static_cast<int>(s.error_code());
  return absl::Status(
      code > 0 && code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown,
      s.error_message());
}

// A message larger than the client may send is refused here, before gRPC
// sees it: gRPC answers RESOURCE_EXHAUSTED only below 2 GiB, and above that
// protobuf's serializer aborts the process.
absl::Status CheckSendSize(const google::protobuf::MessageLite& m, int64_t max_bytes,
                           absl::string_view what) {
  const size_t bytes = m.ByteSizeLong();
  if (bytes <= static_cast<size_t>(max_bytes)) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      what, " is ", bytes, " bytes, more than the client's max_message_bytes ", max_bytes,
      bytes > static_cast<size_t>(INT_MAX) ? " (and than gRPC's 2 GiB message limit)" : "",
      "; not sent"));
}

absl::Status FromStepError(const v1::StepError& e) {
  const int code = e.code();
  if (code == 0) {
    // A StepError always means failure; an OK code would hide it.
    return absl::UnknownError(
        absl::StrCat("the server reported an error with code 0: ", e.message()));
  }
  return absl::Status(
      code > 0 && code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown,
      e.message());
}

absl::StatusOr<absl::Duration> ResolveDeadline(std::optional<absl::Duration> deadline,
                                               absl::Duration fallback) {
  const absl::Duration d = deadline.value_or(fallback);
  if (d <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("deadline must be positive, got ", absl::FormatDuration(d)));
  }
  return d;
}

// One unary call with a deadline covering every attempt. Retries happen only
// on UNAVAILABLE (nothing was served: no connection, or the server is
// draining) and only for idempotent methods (max_retries > 0).
template <typename Response, typename Call>
absl::StatusOr<Response> CallUnary(absl::Duration deadline, int max_retries, Call call) {
  const absl::Time end = absl::Now() + deadline;
  absl::Duration backoff = kFirstBackoff;
  std::optional<absl::BitGen> gen;  // seeded only if a retry happens
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(end));
    Response response;
    const grpc::Status status = call(&ctx, &response);
    if (status.ok()) return response;
    absl::Status error = FromGrpc(status);
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE || attempt > max_retries) {
      if (attempt > 1) {
        error = absl::Status(error.code(),
                             absl::StrCat(error.message(), " (after ", attempt, " attempts)"));
      }
      return error;
    }
    if (!gen) gen.emplace();
    // +-20% jitter (as in gRPC's own connection backoff) keeps many clients
    // that failed together from retrying in lockstep.
    const absl::Duration sleep = backoff * absl::Uniform(*gen, 0.8, 1.2);
    if (absl::Now() + sleep >= end) {
      // The next attempt could not start before the deadline.
      return absl::Status(
          error.code(),
          absl::StrCat(error.message(), " (gave up after ", attempt, " attempts: the deadline of ",
                       absl::FormatDuration(deadline), " would pass)"));
    }
    absl::SleepFor(sleep);
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

HealthStatus FromHealthProto(grpc::health::v1::HealthCheckResponse::ServingStatus s) {
  switch (s) {
    case grpc::health::v1::HealthCheckResponse::SERVING:
      return HealthStatus::kServing;
    case grpc::health::v1::HealthCheckResponse::NOT_SERVING:
      return HealthStatus::kNotServing;
    case grpc::health::v1::HealthCheckResponse::SERVICE_UNKNOWN:
      return HealthStatus::kServiceUnknown;
    default:
      return HealthStatus::kUnknown;
  }
}

const char* OpName(v1::DecodeRequest::MsgCase c) {
  switch (c) {
    case v1::DecodeRequest::kOpen:
      return "open";
    case v1::DecodeRequest::kAttach:
      return "attach";
    case v1::DecodeRequest::kStep:
      return "step";
    case v1::DecodeRequest::kTruncate:
      return "truncate";
    case v1::DecodeRequest::kFork:
      return "fork";
    case v1::DecodeRequest::kClose:
      return "close";
    case v1::DecodeRequest::kExportKv:
      return "export_kv";
    default:
      return "request";
  }
}

// The answer each request must get (besides an in-band error).
v1::DecodeResponse::MsgCase ExpectedAnswer(v1::DecodeRequest::MsgCase c) {
  switch (c) {
    case v1::DecodeRequest::kOpen:
    case v1::DecodeRequest::kAttach:
      return v1::DecodeResponse::kOpened;
    case v1::DecodeRequest::kStep:
      return v1::DecodeResponse::kStep;
    case v1::DecodeRequest::kTruncate:
      return v1::DecodeResponse::kTruncated;
    case v1::DecodeRequest::kFork:
      return v1::DecodeResponse::kForked;
    case v1::DecodeRequest::kClose:
      return v1::DecodeResponse::kClosed;
    case v1::DecodeRequest::kExportKv:
      return v1::DecodeResponse::kExported;
    default:
      return v1::DecodeResponse::MSG_NOT_SET;
  }
}

absl::Status CheckRoutingKey(absl::string_view key) {
  for (char c : key) {
    // gRPC rejects (and fails the call on) non-printable metadata values.
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(
          absl::StrCat("routing_key must be printable ASCII, got \"", absl::CEscape(key), "\""));
    }
  }
  return absl::OkStatus();
}

// For calls that look a session up on every target in turn: whether to go
// on to the next target after `status` from `target` (NOT_FOUND: not there;
// UNAVAILABLE with several targets: unreachable, remembered in
// `*unreachable` so a final "not found" does not hide it).
bool SkipTarget(const absl::Status& status, size_t num_targets, absl::string_view target,
                absl::Status* unreachable) {
  if (status.code() == absl::StatusCode::kNotFound) return true;
  if (status.code() == absl::StatusCode::kUnavailable && num_targets > 1) {
    if (unreachable->ok()) {
      *unreachable = absl::UnavailableError(
          absl::StrCat("not found on the reachable targets; target ", target,
                       " (which may hold it) is unavailable: ", status.message()));
    }
    return true;
  }
  return false;
}

}  // namespace

// Cancels Decode streams whose current operation outlives its deadline. A
// stream has a single deadline for its whole life, which cannot bound each
// step of a long session, so each operation arms this timer instead and the
// timer TryCancel()s the stream if the operation is still blocked. One thread
// per Client (started on first use) serves all its sessions.
class Client::CancelTimer {
 public:
  ~CancelTimer() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    if (thread_.joinable()) thread_.join();
  }

  // After `deadline`, cancels `ctx` unless Disarm(ticket) came first.
  uint64_t Arm(absl::Time deadline, grpc::ClientContext* ctx) {
    absl::MutexLock lock(&mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
    const uint64_t ticket = next_ticket_++;
    pending_.emplace(std::make_pair(deadline, ticket), ctx);
    return ticket;
  }

  // Returns whether the timer fired (the context was cancelled). Once this
  // returns, the timer no longer touches the context.
  bool Disarm(uint64_t ticket) {
    absl::MutexLock lock(&mu_);
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {
      if (it->first.second == ticket) {
        pending_.erase(it);
        return false;
      }
    }
    return fired_.erase(ticket) > 0;
  }

 private:
  void Run() {
    absl::MutexLock lock(&mu_);
    while (!stop_) {
      const absl::Time now = absl::Now();
      while (!pending_.empty() && pending_.begin()->first.first <= now) {
        // Under the lock, so Disarm cannot return while a cancel is running
        // and the caller cannot destroy the context under it.
        pending_.begin()->second->TryCancel();
        fired_.insert(pending_.begin()->first.second);
        pending_.erase(pending_.begin());
      }
      const absl::Time wake =
          pending_.empty() ? absl::InfiniteFuture() : pending_.begin()->first.first;
      // Wakes early when an earlier deadline is armed or on stop.
      const absl::Time armed_first = wake;
      auto changed = [this, armed_first]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || (!pending_.empty() && pending_.begin()->first.first < armed_first);
      };
      mu_.AwaitWithDeadline(absl::Condition(&changed), wake);
    }
  }

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  // (deadline, ticket) -> context to cancel.
  std::map<std::pair<absl::Time, uint64_t>, grpc::ClientContext*> pending_ ABSL_GUARDED_BY(mu_);
  std::set<uint64_t> fired_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

const char* HealthStatusName(HealthStatus status) {
  switch (status) {
    case HealthStatus::kServing:
      return "SERVING";
    case HealthStatus::kNotServing:
      return "NOT_SERVING";
    case HealthStatus::kServiceUnknown:
      return "SERVICE_UNKNOWN";
    case HealthStatus::kUnknown:
      break;
  }
  return "UNKNOWN";
}

namespace {

// A port as gRPC's resolvers take it: decimal digits only, 1..65535. A
// larger number is not refused by gRPC's DNS resolver (getaddrinfo keeps its
// low 16 bits: 114146 dials 48610), and port 0 (a listener's "any free
// port") cannot be dialed.
bool ValidPort(absl::string_view port) {
  if (port.empty() || port.size() > 5) return false;
  for (char c : port) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  uint32_t value = 0;
  return absl::SimpleAtoi(port, &value) && value >= 1 && value <= 65535;
}

// host:port, [v6]:port or (port_required false) a host alone. `what` names
// the field and the target in messages.
absl::Status CheckHostPort(absl::string_view hostport, bool port_required,
                           absl::string_view what) {
  absl::string_view host;
  std::optional<absl::string_view> port;
  if (absl::StartsWith(hostport, "[")) {
    const size_t close = hostport.find(']');
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(what, " has no ']' after its IPv6 address"));
    }
    host = hostport.substr(1, close - 1);
    absl::string_view rest = hostport.substr(close + 1);
    if (!rest.empty()) {
      if (!absl::ConsumePrefix(&rest, ":")) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, " has \"", rest, "\" after its IPv6 address; give [address]:port"));
      }
      port = rest;
    }
  } else {
    const size_t colon = hostport.find(':');
    if (colon != absl::string_view::npos && hostport.find(':', colon + 1) != absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " has several ':'; write an IPv6 address in brackets, e.g. [::1]:50051"));
    }
    host = hostport.substr(0, colon);
    if (colon != absl::string_view::npos) port = hostport.substr(colon + 1);
  }
  if (host.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " has no host"));
  if (!port.has_value() || port->empty()) {
    if (!port_required && !port.has_value()) return absl::OkStatus();
    const std::string shown_host =
        absl::StrContains(host, ':') ? absl::StrCat("[", host, "]") : std::string(host);
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has no port; give host:port, e.g. ", shown_host, ":50051"));
  }
  if (!ValidPort(*port)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the port must be a number in 1..65535, got \"", *port, "\""));
  }
  return absl::OkStatus();
}

// A target gRPC can dial, with a hint for the usual mistakes (a URL, no
// port, a port past 65535 that gRPC would silently wrap) instead of the
// resolver's later, rawer error, or a connection to another port.
absl::Status CheckTarget(absl::string_view target, absl::string_view field) {
  const std::string what = absl::StrCat(field, " \"", target, "\"");
  for (absl::string_view url : {"http://", "https://", "grpc://", "grpcs://"}) {
    if (absl::StartsWith(target, url)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " is a URL; give host:port (e.g. 127.0.0.1:50051), and ",
          "--tls_ca_file (TLS) instead of https://"));
    }
  }
  absl::string_view rest = target;
  // dns:[//authority/]host[:port]: gRPC's default port (443) when none.
  if (absl::ConsumePrefix(&rest, "dns:")) {
    if (absl::ConsumePrefix(&rest, "//")) {
      const size_t slash = rest.find('/');
      if (slash == absl::string_view::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, " has no host after its authority; give dns:///host:port"));
      }
      const absl::string_view authority = rest.substr(0, slash);
      if (!authority.empty()) {
        // The DNS server to ask, host[:port].
        if (absl::Status s = CheckHostPort(authority, /*port_required=*/false,
                                           absl::StrCat(what, " (its DNS server)"));
            !s.ok()) {
          return s;
        }
      }
      rest = rest.substr(slash + 1);
    }
    return CheckHostPort(rest, /*port_required=*/false, what);
  }
  // ipv4:a:p[,a:p...], ipv6:[a]:p[,...] (also ipv4:///...): a port each.
  for (absl::string_view scheme : {"ipv4:", "ipv6:"}) {
    if (!absl::ConsumePrefix(&rest, scheme)) continue;
    if (absl::ConsumePrefix(&rest, "//") && !absl::ConsumePrefix(&rest, "/")) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " has an authority; give ", scheme, "address:port"));
    }
    if (rest.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " has no address"));
    for (absl::string_view address : absl::StrSplit(rest, ',')) {
      if (absl::Status s = CheckHostPort(address, /*port_required=*/true,
                                         absl::StrCat(what, " address \"", address, "\""));
          !s.ok()) {
        return s;
      }
      const bool bracketed = absl::StartsWith(address, "[");
      if ((scheme == "ipv6:") != bracketed) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, " address \"", address, "\" is not ",
            scheme == "ipv6:" ? "[IPv6 address]:port" : "IPv4 address:port"));
      }
    }
    return absl::OkStatus();
  }
  if (absl::ConsumePrefix(&rest, "unix:")) {
    if (rest.empty() || rest == "//" || rest == "///") {
      return absl::InvalidArgumentError(absl::StrCat(what, " has no socket path"));
    }
    return absl::OkStatus();
  }
  // gRPC's other schemes (unix-abstract:, vsock:) and resolvers named as
  // scheme:// (e.g. xds:///name) are passed through as they are.
  for (absl::string_view scheme : {"unix-abstract:", "vsock:"}) {
    if (absl::StartsWith(target, scheme)) return absl::OkStatus();
  }
  const size_t scheme_end = target.find("://");
  if (scheme_end != absl::string_view::npos && scheme_end > 0 &&
      std::all_of(target.begin(), target.begin() + scheme_end, [](char c) {
        return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '-' ||
               c == '.';
      })) {
    return absl::OkStatus();
  }
  return CheckHostPort(target, /*port_required=*/true, what);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("target must not be empty");
  if (options.targets.empty()) {
    if (absl::Status s = CheckTarget(options.target, "target"); !s.ok()) return s;
  }
  if (options.deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("deadline must be positive, got ", absl::FormatDuration(options.deadline)));
  }
  if (options.max_message_bytes <= 0 || options.max_message_bytes > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("max_message_bytes must be in [1, ", INT_MAX,
                                                   "], got ", options.max_message_bytes));
  }
  if (options.max_retries < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_retries must be >= 0, got ", options.max_retries));
  }
  if (absl::Status s = CheckRoutingKey(options.routing_key); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      ChannelCredentialsFor(options);
  if (!credentials.ok()) return credentials.status();
  for (size_t i = 0; i < options.targets.size(); ++i) {
    if (options.targets[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("targets[", i, "] must not be empty"));
    }
    if (absl::Status s = CheckTarget(options.targets[i], absl::StrCat("targets[", i, "]"));
        !s.ok()) {
      return s;
    }
    for (size_t j = 0; j < i; ++j) {
      if (options.targets[j] == options.targets[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat("targets[", i, "] \"", options.targets[i], "\" repeats targets[", j, "]"));
      }
    }
  }

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  // Matched to the server's keepalive policy (it accepts a ping per 30 s, so
  // one per 60 s is never answered with GOAWAY "too_many_pings"); pings keep
  // idle Decode streams alive through NATs and proxies.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 60000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  if (options.own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);

  std::unique_ptr<Client> client(new Client());
  client->options_ = options;
  const std::vector<std::string> targets =
      options.targets.empty() ? std::vector<std::string>{options.target} : options.targets;
  for (const std::string& target : targets) {
    Replica replica;
    // The same credentials for every target: one TLS setup, one token.
    replica.channel = grpc::CreateCustomChannel(target, *credentials, args);
    replica.stub = v1::AttentionService::NewStub(replica.channel);
    client->replicas_.push_back(std::move(replica));
  }
  client->ring_ = std::make_unique<HashRing>(targets);
  client->channel_ = client->replicas_[0].channel;
  client->stub_ = v1::AttentionService::NewStub(client->channel_);
  client->timer_ = std::make_unique<CancelTimer>();
  return client;
}

Client::~Client() = default;

absl::StatusOr<HealthStatus> Client::Health(absl::string_view service,
                                            std::optional<absl::Duration> deadline) {
  absl::StatusOr<absl::Duration> d = ResolveDeadline(deadline, options_.deadline);
  if (!d.ok()) return d.status();
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(std::string(service));
  absl::StatusOr<grpc::health::v1::HealthCheckResponse> response =
      CallUnary<grpc::health::v1::HealthCheckResponse>(
          *d, options_.max_retries, [&](grpc::ClientContext* ctx, auto* r) {
            // One target per attempt (round robin when there are several).
            auto stub = grpc::health::v1::Health::NewStub(NextReplica().channel);
            return stub->Check(ctx, request, r);
          });
  // Check answers NOT_FOUND for a service it does not know (the health
  // protocol's way of saying SERVICE_UNKNOWN).
  if (!response.ok() && response.status().code() == absl::StatusCode::kNotFound) {
    return HealthStatus::kServiceUnknown;
  }
  if (!response.ok()) return response.status();
  return FromHealthProto(response->status());
}

absl::StatusOr<v1::AttendResponse> Client::Attend(const v1::AttendRequest& request,
                                                  std::optional<absl::Duration> deadline) {
  absl::StatusOr<absl::Duration> d = ResolveDeadline(deadline, options_.deadline);
  if (!d.ok()) return d.status();
  if (absl::Status size = CheckSendSize(request, options_.max_message_bytes, "the Attend request");
      !size.ok()) {
    return size;
  }
  return CallUnary<v1::AttendResponse>(*d, options_.max_retries,
                                       [&](grpc::ClientContext* ctx, auto* r) {
                                         return NextReplica().stub->Attend(ctx, request, r);
                                       });
}

absl::StatusOr<v1::EncodeResponse> Client::Encode(const v1::EncodeRequest& request,
                                                  std::optional<absl::Duration> deadline) {
  absl::StatusOr<absl::Duration> d = ResolveDeadline(deadline, options_.deadline);
  if (!d.ok()) return d.status();
  if (absl::Status size = CheckSendSize(request, options_.max_message_bytes, "the Encode request");
      !size.ok()) {
    return size;
  }
  return CallUnary<v1::EncodeResponse>(*d, options_.max_retries,
                                       [&](grpc::ClientContext* ctx, auto* r) {
                                         return NextReplica().stub->Encode(ctx, request, r);
                                       });
}

absl::StatusOr<v1::ServerInfo> Client::GetServerInfo(std::optional<absl::Duration> deadline) {
  absl::StatusOr<absl::Duration> d = ResolveDeadline(deadline, options_.deadline);
  if (!d.ok()) return d.status();
  const v1::GetServerInfoRequest request;
  return CallUnary<v1::ServerInfo>(*d, options_.max_retries,
                                   [&](grpc::ClientContext* ctx, auto* r) {
                                     return NextReplica().stub->GetServerInfo(ctx, request, r);
                                   });
}

absl::StatusOr<v1::SessionInfo> Client::GetSession(const std::string& session_id,
                                                   std::optional<absl::Duration> deadline) {
  absl::StatusOr<absl::Duration> d = ResolveDeadline(deadline, options_.deadline);
  if (!d.ok()) return d.status();
  v1::GetSessionRequest request;
  request.set_session_id(session_id);
  absl::StatusOr<v1::SessionInfo> answer;
  absl::Status unreachable;                        // a target that could not answer may hold the id
  for (size_t i = 0; i < replicas_.size(); ++i) {  // the first target that knows the id
    answer = CallUnary<v1::SessionInfo>(*d, options_.max_retries,
                                        [&](grpc::ClientContext* ctx, auto* r) {
                                          return replicas_[i].stub->GetSession(ctx, request, r);
                                        });
    if (answer.ok() || !SkipTarget(answer.status(), replicas_.size(), targets()[i], &unreachable)) {
      return answer;
    }
  }
  if (!unreachable.ok()) return unreachable;
  return answer;
}

absl::StatusOr<std::vector<v1::SessionInfo>> Client::ListSessions(
    std::optional<absl::Duration> deadline) {
  absl::StatusOr<absl::Duration> d = ResolveDeadline(deadline, options_.deadline);
  if (!d.ok()) return d.status();
  std::vector<v1::SessionInfo> sessions;
  for (size_t i = 0; i < replicas_.size(); ++i) {  // every target's list, merged
    v1::ListSessionsRequest request;
    do {  // page by page (each answer fits in one message)
      absl::StatusOr<v1::ListSessionsResponse> response = CallUnary<v1::ListSessionsResponse>(
          *d, options_.max_retries, [&](grpc::ClientContext* ctx, auto* r) {
            return replicas_[i].stub->ListSessions(ctx, request, r);
          });
      if (!response.ok()) {
        if (replicas_.size() == 1) return response.status();
        return absl::Status(
            response.status().code(),
            absl::StrCat("target ", targets()[i], ": ", response.status().message()));
      }
      sessions.insert(sessions.end(), response->sessions().begin(), response->sessions().end());
      request.set_page_token(response->next_page_token());
    } while (!request.page_token().empty());
  }
  return sessions;
}

absl::StatusOr<v1::SessionInfo> Client::CloseSession(const std::string& session_id,
                                                     std::optional<absl::Duration> deadline) {
  absl::StatusOr<absl::Duration> d = ResolveDeadline(deadline, options_.deadline);
  if (!d.ok()) return d.status();
  v1::CloseSessionRequest request;
  request.set_session_id(session_id);
  // Not retried: a retry after a lost answer would report NOT_FOUND or
  // FAILED_PRECONDITION for a close that in fact succeeded.
  absl::StatusOr<v1::CloseSessionResponse> response;
  absl::Status unreachable;                        // a target that could not answer may hold the id
  for (size_t i = 0; i < replicas_.size(); ++i) {  // the first target that knows the id
    response = CallUnary<v1::CloseSessionResponse>(
        *d, /*max_retries=*/0, [&](grpc::ClientContext* ctx, auto* r) {
          return replicas_[i].stub->CloseSession(ctx, request, r);
        });
    if (response.ok() ||
        !SkipTarget(response.status(), replicas_.size(), targets()[i], &unreachable)) {
      break;
    }
  }
  if (!response.ok() && !unreachable.ok()) return unreachable;
  if (!response.ok()) return response.status();
  return response->session();
}

absl::StatusOr<std::vector<v1::ModelInfo>> Client::ListModels(
    std::optional<absl::Duration> deadline) {
  absl::StatusOr<absl::Duration> d = ResolveDeadline(deadline, options_.deadline);
  if (!d.ok()) return d.status();
  const v1::ListModelsRequest request;
  absl::StatusOr<v1::ListModelsResponse> response = CallUnary<v1::ListModelsResponse>(
      *d, options_.max_retries, [&](grpc::ClientContext* ctx, auto* r) {
        return NextReplica().stub->ListModels(ctx, request, r);
      });
  if (!response.ok()) return response.status();
  return std::vector<v1::ModelInfo>(response->models().begin(), response->models().end());
}

absl::StatusOr<v1::ModelInfo> Client::GetModel(const std::string& name,
                                               std::optional<absl::Duration> deadline) {
  absl::StatusOr<absl::Duration> d = ResolveDeadline(deadline, options_.deadline);
  if (!d.ok()) return d.status();
  v1::GetModelRequest request;
  request.set_name(name);
  return CallUnary<v1::ModelInfo>(*d, options_.max_retries, [&](grpc::ClientContext* ctx, auto* r) {
    return NextReplica().stub->GetModel(ctx, request, r);
  });
}

absl::StatusOr<v1::EmbedResponse> Client::Embed(const v1::EmbedRequest& request,
                                                std::optional<absl::Duration> deadline) {
  absl::StatusOr<absl::Duration> d = ResolveDeadline(deadline, options_.deadline);
  if (!d.ok()) return d.status();
  if (absl::Status size = CheckSendSize(request, options_.max_message_bytes, "the Embed request");
      !size.ok()) {
    return size;
  }
  // A pure function of the request: safe to retry.
  return CallUnary<v1::EmbedResponse>(*d, options_.max_retries,
                                      [&](grpc::ClientContext* ctx, auto* r) {
                                        return NextReplica().stub->Embed(ctx, request, r);
                                      });
}

absl::StatusOr<std::unique_ptr<Session>> Client::OpenSession(const v1::OpenSession& open) {
  return OpenSession(open, options_.routing_key);
}

absl::StatusOr<std::unique_ptr<Session>> Client::AttachSession(const std::string& session_id) {
  return AttachSession(session_id, options_.routing_key);
}

absl::StatusOr<std::unique_ptr<Session>> Client::OpenSession(const v1::OpenSession& open,
                                                             absl::string_view routing_key) {
  return OpenSessionOn(TargetFor(routing_key), open, routing_key);
}

absl::StatusOr<std::unique_ptr<Session>> Client::AttachSession(const std::string& session_id,
                                                               absl::string_view routing_key) {
  return AttachSessionOn(TargetFor(routing_key), session_id, routing_key);
}

absl::StatusOr<std::unique_ptr<Session>> Client::OpenSessionOn(size_t target_index,
                                                               const v1::OpenSession& open,
                                                               absl::string_view routing_key) {
  v1::DecodeRequest first;
  *first.mutable_open() = open;
  return StartSession(target_index, first, routing_key);
}

absl::StatusOr<std::unique_ptr<Session>> Client::AttachSessionOn(size_t target_index,
                                                                 const std::string& session_id,
                                                                 absl::string_view routing_key) {
  v1::DecodeRequest first;
  first.mutable_attach()->set_session_id(session_id);
  return StartSession(target_index, first, routing_key);
}

absl::StatusOr<std::unique_ptr<Session>> Client::StartSession(size_t target_index,
                                                              const v1::DecodeRequest& first,
                                                              absl::string_view routing_key) {
  if (target_index >= replicas_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("target index ", target_index,
                                                   " is out of range: the client has ",
                                                   replicas_.size(), " target(s)"));
  }
  if (absl::Status s = CheckRoutingKey(routing_key); !s.ok()) return s;
  if (absl::Status size =
          CheckSendSize(first, options_.max_message_bytes,
                        absl::StrCat("the Decode `", OpName(first.msg_case()), "`"));
      !size.ok()) {
    return size;
  }
  std::unique_ptr<Session> session(new Session());
  session->client_ = this;
  session->target_ = targets()[target_index];
  session->target_index_ = target_index;
  session->routing_key_ = std::string(routing_key);
  if (absl::Status s = session->Start(first); !s.ok()) return s;
  return session;
}

Client::Replica& Client::NextReplica() {
  if (replicas_.size() == 1) return replicas_[0];
  return replicas_[next_replica_.fetch_add(1, std::memory_order_relaxed) % replicas_.size()];
}

size_t Client::TargetFor(absl::string_view routing_key) const {
  const int owner = ring_->Lookup(routing_key);
  return owner < 0 ? 0 : static_cast<size_t>(owner);
}

absl::StatusOr<HealthStatus> Client::HealthOf(size_t target_index, absl::string_view service,
                                              std::optional<absl::Duration> deadline) {
  if (target_index >= replicas_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("target index ", target_index,
                                                   " is out of range: the client has ",
                                                   replicas_.size(), " target(s)"));
  }
  absl::StatusOr<absl::Duration> d = ResolveDeadline(deadline, options_.deadline);
  if (!d.ok()) return d.status();
  auto stub = grpc::health::v1::Health::NewStub(replicas_[target_index].channel);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(std::string(service));
  absl::StatusOr<grpc::health::v1::HealthCheckResponse> response =
      CallUnary<grpc::health::v1::HealthCheckResponse>(
          *d, options_.max_retries,
          [&](grpc::ClientContext* ctx, auto* r) { return stub->Check(ctx, request, r); });
  if (!response.ok() && response.status().code() == absl::StatusCode::kNotFound) {
    return HealthStatus::kServiceUnknown;
  }
  if (!response.ok()) return response.status();
  return FromHealthProto(response->status());
}

// ------------------------------------------------------------ Session --

absl::Status Session::Start(const v1::DecodeRequest& first) {
  ctx_ = std::make_unique<grpc::ClientContext>();
  // No stream deadline: the stream lives as long as the session is used.
  // Each operation is bounded by the CancelTimer instead.
  if (!routing_key_.empty()) ctx_->AddMetadata(kRoutingKeyHeader, routing_key_);
  // Armed before the call starts: creating the stream can itself block
  // while the channel connects.
  const uint64_t ticket =
      client_->timer_->Arm(absl::Now() + client_->options_.deadline, ctx_.get());
  stream_ = client_->replicas_[target_index_].stub->Decode(ctx_.get());
  v1::DecodeResponse response;
  const bool ok = stream_->Write(first) && stream_->Read(&response);
  const bool timed_out = client_->timer_->Disarm(ticket);
  const char* op = OpName(first.msg_case());
  if (!ok || timed_out) return EndStream(op, timed_out);
  if (response.msg_case() == v1::DecodeResponse::kError) {
    // The server ends the stream after a failed open; its status is the
    // same error, so report the in-band one and close quietly.
    absl::Status error = FromStepError(response.error());
    Abandon(error);
    return error;
  }
  if (response.msg_case() != v1::DecodeResponse::kOpened) {
    absl::Status error = absl::InternalError(
        absl::StrCat("Decode protocol error: the answer to `", op, "` is not `opened` (case ",
                     static_cast<int>(response.msg_case()), ")"));
    Abandon(error);
    return error;
  }
  info_ = response.opened();
  position_ = info_.position();
  return absl::OkStatus();
}

absl::Status Session::EndStream(absl::string_view op, bool timed_out) {
  v1::DecodeResponse ignored;
  while (stream_->Read(&ignored)) {
  }
  const grpc::Status final_status = stream_->Finish();
  if (timed_out) {
    broken_ = absl::DeadlineExceededError(absl::StrCat(
        "Decode `", op, "` did not complete within ",
        absl::FormatDuration(client_->options_.deadline), "; the stream was cancelled",
        info_.session_id().empty()
            ? ""
            : absl::StrCat(" (session ", info_.session_id(),
                           info_.resumable() ? " is resumable: re-attach it by id)" : ")")));
  } else if (final_status.ok()) {
    broken_ = absl::InternalError(absl::StrCat(
        "Decode protocol error: the server ended the stream without answering `", op, "`"));
  } else {
    broken_ = FromGrpc(final_status);
  }
  return broken_;
}

void Session::Abandon(const absl::Status& why) {
  ctx_->TryCancel();
  v1::DecodeResponse ignored;
  while (stream_->Read(&ignored)) {
  }
  stream_->Finish().ok();  // cancelled by us: its status says nothing new
  broken_ = why;
}

absl::StatusOr<v1::DecodeResponse> Session::RoundTrip(v1::DecodeRequest& request) {
  if (!broken_.ok()) return broken_;
  const char* op = OpName(request.msg_case());
  const uint64_t seq = ++seq_;
  switch (request.msg_case()) {
    case v1::DecodeRequest::kStep:
      request.mutable_step()->set_seq(seq);
      break;
    case v1::DecodeRequest::kTruncate:
      request.mutable_truncate()->set_seq(seq);
      break;
    case v1::DecodeRequest::kFork:
      request.mutable_fork()->set_seq(seq);
      break;
    case v1::DecodeRequest::kClose:
      request.mutable_close()->set_seq(seq);
      break;
    case v1::DecodeRequest::kExportKv:
      request.mutable_export_kv()->set_seq(seq);
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("`", op, "` is not a session operation"));
  }
  // Not sent: the session is unchanged and goes on.
  if (absl::Status size = CheckSendSize(request, client_->options_.max_message_bytes,
                                       absl::StrCat("the Decode `", op, "`"));
      !size.ok()) {
    --seq_;  // never sent: the next operation takes its seq
    return size;
  }
  const uint64_t ticket =
      client_->timer_->Arm(absl::Now() + client_->options_.deadline, ctx_.get());
  v1::DecodeResponse response;
  const bool ok = stream_->Write(request) && stream_->Read(&response);
  // Even if the answer arrived, a fired timer has cancelled the stream, so
  // the session cannot go on; report the timeout rather than a result whose
  // stream is already dead.
  const bool timed_out = client_->timer_->Disarm(ticket);
  if (!ok || timed_out) return EndStream(op, timed_out);
  // An error with seq 0 is the in-band answer to this request (answers come
  // in order): the server refuses a message it could not read (its parse
  // did not fit the memory budget) without knowing its seq.
  const bool unread_refusal = response.seq() == 0 &&
                              response.msg_case() == v1::DecodeResponse::kError &&
                              response.error().seq() == 0;
  if (response.seq() != seq && !unread_refusal) {
    absl::Status error = absl::InternalError(absl::StrCat(
        "Decode protocol error: the answer to `", op, "` seq ", seq, " has seq ", response.seq()));
    Abandon(error);
    return error;
  }
  if (response.msg_case() == v1::DecodeResponse::kError) {
    return FromStepError(response.error());  // in-band: the session is unchanged
  }
  if (response.msg_case() != ExpectedAnswer(request.msg_case())) {
    absl::Status error =
        absl::InternalError(absl::StrCat("Decode protocol error: unexpected answer (case ",
                                         static_cast<int>(response.msg_case()), ") to `", op, "`"));
    Abandon(error);
    return error;
  }
  return response;
}

absl::StatusOr<v1::StepResult> Session::Step(const v1::Tensor& q, const v1::Tensor& k,
                                             const v1::Tensor& v) {
  v1::DecodeRequest request;
  v1::Step* step = request.mutable_step();
  *step->mutable_q() = q;
  *step->mutable_k() = k;
  *step->mutable_v() = v;
  return SendStep(request);
}

absl::StatusOr<v1::StepResult> Session::StepHidden(const v1::Tensor& hidden) {
  v1::DecodeRequest request;
  *request.mutable_step()->mutable_hidden() = hidden;
  return SendStep(request);
}

absl::StatusOr<v1::StepResult> Session::SendStep(v1::DecodeRequest& request) {
  absl::StatusOr<v1::DecodeResponse> response = RoundTrip(request);
  if (!response.ok()) return response.status();
  position_ = response->step().position();
  return std::move(*response->mutable_step());
}

absl::StatusOr<v1::SessionInfo> Session::Truncate(int64_t position) {
  v1::DecodeRequest request;
  request.mutable_truncate()->set_position(position);
  absl::StatusOr<v1::DecodeResponse> response = RoundTrip(request);
  if (!response.ok()) return response.status();
  info_ = response->truncated();
  position_ = info_.position();
  return info_;
}

absl::StatusOr<v1::SessionInfo> Session::Fork(uint32_t idle_ttl_seconds) {
  v1::DecodeRequest request;
  request.mutable_fork()->set_idle_ttl_seconds(idle_ttl_seconds);
  absl::StatusOr<v1::DecodeResponse> response = RoundTrip(request);
  if (!response.ok()) return response.status();
  return std::move(*response->mutable_forked());
}

absl::StatusOr<v1::KvExport> Session::ExportKv() {
  v1::DecodeRequest request;
  request.mutable_export_kv();
  absl::StatusOr<v1::DecodeResponse> response = RoundTrip(request);
  if (!response.ok()) return response.status();
  return std::move(*response->mutable_exported());
}

absl::Status Session::Close() {
  v1::DecodeRequest request;
  request.mutable_close();
  absl::StatusOr<v1::DecodeResponse> response = RoundTrip(request);
  if (!response.ok()) return response.status();
  info_ = response->closed();
  position_ = info_.position();
  // The server ends the stream after `closed`; collect its status.
  const uint64_t ticket =
      client_->timer_->Arm(absl::Now() + client_->options_.deadline, ctx_.get());
  stream_->WritesDone();
  v1::DecodeResponse ignored;
  while (stream_->Read(&ignored)) {
  }
  const grpc::Status final_status = stream_->Finish();
  const bool timed_out = client_->timer_->Disarm(ticket);
  broken_ = absl::FailedPreconditionError(
      absl::StrCat("session ", info_.session_id(), " was closed by this client"));
  if (timed_out) {
    return absl::DeadlineExceededError(absl::StrCat(
        "session ", info_.session_id(), " was closed but its stream did not end within ",
        absl::FormatDuration(client_->options_.deadline)));
  }
  return FromGrpc(final_status);
}

Session::~Session() {
  if (stream_ == nullptr || !broken_.ok()) return;  // never started, or already finished
  // Half-close: the server answers by ending the stream (and freeing a
  // non-resumable session). The timer bounds the wait on a stuck server.
  const uint64_t ticket =
      client_->timer_->Arm(absl::Now() + client_->options_.deadline, ctx_.get());
  stream_->WritesDone();
  v1::DecodeResponse ignored;
  while (stream_->Read(&ignored)) {
  }
  stream_->Finish().ok();  // nobody is left to report it to
  client_->timer_->Disarm(ticket);
}

// ------------------------------------------------- RecoverableSession --

bool RecoverableSession::IsRecoverable(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable ||
         status.code() == absl::StatusCode::kNotFound;
}

absl::StatusOr<std::unique_ptr<RecoverableSession>> RecoverableSession::Open(
    Client* client, const v1::OpenSession& open, absl::string_view routing_key) {
  std::unique_ptr<RecoverableSession> r(new RecoverableSession());
  r->client_ = client;
  r->open_ = open;
  r->routing_key_ = std::string(routing_key);
  const size_t owner = client->TargetFor(routing_key);
  absl::StatusOr<std::unique_ptr<Session>> session =
      client->OpenSessionOn(owner, open, routing_key);
  if (session.ok()) {
    r->session_ = std::move(*session);
    return r;
  }
  if (!IsRecoverable(session.status()) || client->targets().size() < 2) return session.status();
  // The owner is down: start on the next target of the ring (nothing to replay).
  if (absl::Status s = r->Recover(owner, session.status()); !s.ok()) return s;
  return r;
}

absl::StatusOr<v1::StepResult> RecoverableSession::Step(const v1::Tensor& q, const v1::Tensor& k,
                                                        const v1::Tensor& v) {
  v1::Step step;
  *step.mutable_q() = q;
  *step.mutable_k() = k;
  *step.mutable_v() = v;
  return Send(std::move(step));
}

absl::StatusOr<v1::StepResult> RecoverableSession::StepHidden(const v1::Tensor& hidden) {
  v1::Step step;
  *step.mutable_hidden() = hidden;
  return Send(std::move(step));
}

absl::StatusOr<v1::StepResult> RecoverableSession::SendOn(Session& session, const v1::Step& step) {
  if (step.has_hidden()) return session.StepHidden(step.hidden());
  return session.Step(step.q(), step.k(), step.v());
}

absl::StatusOr<v1::StepResult> RecoverableSession::Send(v1::Step step) {
  if (closed_) return absl::FailedPreconditionError("the session was closed by this client");
  // Each recovery moves to a target not tried for this step; a step that
  // fails on every target is returned as the last failure.
  for (size_t attempt = 0;; ++attempt) {
    absl::StatusOr<v1::StepResult> result = SendOn(*session_, step);
    if (result.ok()) {
      retained_.push_back(std::move(step));
      return result;
    }
    // In-band errors leave the stream up and the session unchanged.
    if (session_->stream_status().ok() || !IsRecoverable(result.status())) return result;
    if (attempt + 1 >= client_->targets().size() && attempt > 0) return result;
    if (absl::Status s = Recover(session_->target_index(), result.status()); !s.ok()) return s;
  }
}

absl::Status RecoverableSession::Recover(size_t failed, const absl::Status& why) {
  last_failure_ = why;
  const HashRing& ring = client_->ring();
  std::string tried = absl::StrCat(ring.targets()[failed], " (", why.ToString(), ")");
  absl::Status last = why;
  int candidate = static_cast<int>(failed);
  const size_t others = ring.size() > 1 ? ring.size() - 1 : 1;
  for (size_t n = 0; n < others; ++n) {
    candidate = ring.NextAfter(routing_key_, candidate);
    if (candidate < 0) break;
    absl::StatusOr<std::unique_ptr<Session>> session =
        client_->OpenSessionOn(static_cast<size_t>(candidate), open_, routing_key_);
    absl::Status s = session.status();
    for (size_t i = 0; s.ok() && i < retained_.size(); ++i) {
      absl::StatusOr<v1::StepResult> replayed = SendOn(**session, retained_[i]);
      if (!replayed.ok()) {
        s = absl::Status(replayed.status().code(),
                         absl::StrCat("replaying step ", i + 1, " of ", retained_.size(), ": ",
                                      replayed.status().message()));
      }
    }
    if (s.ok()) {
      session_ = std::move(*session);
      ++recoveries_;
      return absl::OkStatus();
    }
    absl::StrAppend(&tried, ", ", ring.targets()[candidate], " (", s.ToString(), ")");
    last = s;
    if (!IsRecoverable(s)) break;  // e.g. RESOURCE_EXHAUSTED: another replica would not help
  }
  return absl::Status(
      last.code() == absl::StatusCode::kOk ? absl::StatusCode::kUnavailable : last.code(),
      absl::StrCat("session with routing key \"", routing_key_, "\" could not be recovered after ",
                   retained_.size(), " step(s); targets tried: ", tried));
}

absl::Status RecoverableSession::Close() {
  if (closed_) return absl::FailedPreconditionError("the session was closed by this client");
  closed_ = true;
  retained_.clear();
  return session_->Close();
}

}  // namespace ropeattn::client
