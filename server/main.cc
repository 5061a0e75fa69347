// ropeattn-server: serves ropeattn.v1.AttentionService, gRPC health and
// reflection, and Prometheus metrics. Runs with no arguments on built-in
// defaults; every limit has a flag (see --help).
#include <malloc.h>
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/cpu.h"
#include "nlohmann/json.hpp"
#include "server/auth.h"
#include "server/listener.h"
#include "server/log.h"
#include "server/options.h"
#include "server/server.h"

namespace {
const ropeattn::server::ServerOptions kDefaults;
}  // namespace

ABSL_FLAG(std::string, address, kDefaults.address,
          "gRPC listen address host:port, host an IPv4 literal, [IPv6] or localhost (port 0 "
          "picks a free port and prints it); a port in use fails start-up");
ABSL_FLAG(int, max_connections, kDefaults.max_connections,
          "Concurrent gRPC connections; more are closed at accept. 0: the fd soft limit (raised "
          "to the hard limit at start) minus 256, at least 16");
ABSL_FLAG(double, handshake_timeout_seconds, kDefaults.handshake_timeout_seconds,
          "A connection that has not started HTTP/2 (preface and SETTINGS) within this many "
          "seconds is closed, so silent sockets cannot hold connection slots");
ABSL_FLAG(int, max_connection_idle_seconds, kDefaults.max_connection_idle_seconds,
          "A connection with no call open for this many seconds is closed (GOAWAY; clients "
          "reconnect on their next call), so idle peers cannot hold connection slots; 0: never");
ABSL_FLAG(std::string, metrics_address, kDefaults.metrics_address,
          "Prometheus /metrics HTTP listen address host:port; empty disables it");
ABSL_FLAG(int, metrics_port, -1,
          "Shorthand for --metrics_address=127.0.0.1:PORT, in [0, 65535] (-1: unset); not with "
          "--metrics_address");
ABSL_FLAG(int, compute_workers, kDefaults.compute_workers,
          "Requests computed at once (each on its own worker thread), in [1, 256]");
ABSL_FLAG(int, threads_per_call, kDefaults.threads_per_call,
          "Kernel threads one request may use, in [1, 256]; keep compute_workers * "
          "threads_per_call <= the machine's cores");
ABSL_FLAG(int, queue_depth, kDefaults.queue_depth,
          "Requests that may wait for a worker; beyond it calls get RESOURCE_EXHAUSTED at once");
ABSL_FLAG(double, max_queue_delay_seconds, kDefaults.max_queue_delay_seconds,
          "A request whose estimated wait for a worker is longer, or that cannot finish inside "
          "its deadline, is refused at once with RESOURCE_EXHAUSTED and trailing metadata "
          "retry-after-ms; 0 turns the wait limit off");
ABSL_FLAG(double, max_queue_slowdown, kDefaults.max_queue_slowdown,
          "A stateless request (Attend, Encode, Embed) whose estimated wait is more than this "
          "many times its own estimated compute (and more than 50 ms) is refused at once with "
          "RESOURCE_EXHAUSTED and retry-after-ms; decode steps are exempt; 0 turns it off; "
          "[0, 1e6]");
ABSL_FLAG(int, max_decode_batch, kDefaults.max_decode_batch,
          "Decode steps of different sessions that are ready together run as one parallel pass, "
          "this many at most; 1 computes every step on its own; [1, 1024]");
ABSL_FLAG(int, compute_nice, kDefaults.compute_nice,
          "Nice value of the compute workers (0..19): gRPC threads answering health and control "
          "calls preempt compute; 0 gives them the same priority");
ABSL_FLAG(int64_t, max_message_bytes, kDefaults.max_message_bytes,
          "Largest gRPC message either way, in bytes (default 256 MiB: room for a "
          "[1, 8192, 32, 128] f32 prefill)");
ABSL_FLAG(int, max_sessions, kDefaults.max_sessions, "Decoding sessions held at once");
ABSL_FLAG(int64_t, memory_budget_bytes, kDefaults.memory_budget_bytes,
          "Memory, in bytes, that session state (KV caches, linear states, RoPE tables, raw keys) "
          "and in-flight requests' buffers may hold together; past it a request or open gets "
          "RESOURCE_EXHAUSTED before any allocation");
ABSL_FLAG(int64_t, kv_budget_bytes, -1,
          "Deprecated alias of --memory_budget_bytes (used when that flag is not given)");
ABSL_FLAG(int64_t, max_request_compute, kDefaults.max_request_compute,
          "Compute one request or decode step may ask for, in multiply-adds (element-wise "
          "steps count 16); past it RESOURCE_EXHAUSTED before any work");
ABSL_FLAG(int64_t, default_max_context, kDefaults.default_max_context,
          "Tokens a session holds when it does not ask for max_context");
ABSL_FLAG(int64_t, max_context_limit, kDefaults.max_context_limit,
          "Largest max_context a session may ask for");
ABSL_FLAG(uint32_t, default_idle_ttl_seconds, kDefaults.default_idle_ttl_seconds,
          "Idle time after which a session is reaped, when it does not ask for one");
ABSL_FLAG(uint32_t, max_idle_ttl_seconds, kDefaults.max_idle_ttl_seconds,
          "Cap on the idle TTL a session may ask for");
// --model is repeatable, which absl flags are not: main() takes every
// --model=NAME=DIR (or --model NAME=DIR) out of argv before parsing; this
// definition is for --help.
ABSL_FLAG(std::string, model, "",
          "NAME=DIR: serve the Hugging Face-style checkpoint in DIR (config.json + "
          "model.safetensors or a sharded set) as NAME; repeatable. Without any, the "
          "built-in demo model is served as \"demo\"");
ABSL_FLAG(double, shutdown_grace_seconds, kDefaults.shutdown_grace_seconds,
          "On SIGTERM/SIGINT: time in-flight calls get to finish before they are cancelled");
ABSL_FLAG(double, answer_timeout_seconds, kDefaults.answer_timeout_seconds,
          "An answer the client has not taken this long after it was ready cancels its call "
          "(and frees what the call held); [1, 3600]");
ABSL_FLAG(std::string, tls_cert_file, "",
          "TLS: the server's certificate chain (PEM); with --tls_key_file. Re-read when it "
          "changes (new handshakes see the new one); empty: plaintext");
ABSL_FLAG(std::string, tls_key_file, "", "TLS: the private key (PEM) of --tls_cert_file");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "Mutual TLS: client certificates are required and verified against these CA "
          "certificates (PEM). Without --auth_tokens_file a certificate's URI SAN (else DNS SAN) "
          "is the caller's principal");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "Bearer tokens: lines 'TOKEN PRINCIPAL [admin]', '#' comments; every call but health "
          "then needs 'authorization: Bearer TOKEN' metadata. Needs TLS. Re-read when it changes");
ABSL_FLAG(int, credentials_reload_seconds, kDefaults.credentials_reload_seconds,
          "How often the certificate, key, CA and tokens files are checked for changes (1..3600)");
ABSL_FLAG(bool, reflection, kDefaults.reflection,
          "Serve grpc.reflection.v1alpha.ServerReflection (what grpcurl uses without .proto files)");
ABSL_FLAG(int, principal_max_sessions, kDefaults.principal_max_sessions,
          "With authentication: sessions one principal may hold at once");
ABSL_FLAG(int64_t, principal_memory_bytes, kDefaults.principal_memory_bytes,
          "With authentication: bytes of session state one principal may hold");

ABSL_FLAG(std::string, log_level, "info",
          "Log lines below this level are not written: debug, info, warning or error. The log is "
          "JSON lines on stdout (docs/logging.md)");
ABSL_FLAG(bool, access_log, kDefaults.access_log,
          "Also log one \"call\" line per call when it ends (method, code, ms, peer, request "
          "id); error answers are logged either way");

namespace {

// A bad flag value (README, "Exit codes"): one code whichever check finds
// it; a start-up that fails otherwise (a port taken, a model that does not
// load, a TLS file) exits 1.
constexpr int kExitUsage = 2;

// The effective configuration, as the start-up log line carries it.
std::string ConfigJson(const ropeattn::server::ServerOptions& o, int max_connections) {
  nlohmann::ordered_json j;
  j["address"] = o.address;
  j["metrics_address"] = o.metrics_address;
  j["max_connections"] = max_connections;
  j["handshake_timeout_seconds"] = o.handshake_timeout_seconds;
  j["max_connection_idle_seconds"] = o.max_connection_idle_seconds;
  j["compute_workers"] = o.compute_workers;
  j["threads_per_call"] = o.threads_per_call;
  j["queue_depth"] = o.queue_depth;
  j["max_queue_delay_seconds"] = o.max_queue_delay_seconds;
  j["max_queue_slowdown"] = o.max_queue_slowdown;
  j["max_decode_batch"] = o.max_decode_batch;
  j["compute_nice"] = o.compute_nice;
  j["max_message_bytes"] = o.max_message_bytes;
  j["max_sessions"] = o.max_sessions;
  j["memory_budget_bytes"] = o.memory_budget_bytes;
  j["max_request_compute"] = o.max_request_compute;
  j["default_max_context"] = o.default_max_context;
  j["max_context_limit"] = o.max_context_limit;
  j["default_idle_ttl_seconds"] = o.default_idle_ttl_seconds;
  j["max_idle_ttl_seconds"] = o.max_idle_ttl_seconds;
  j["shutdown_grace_seconds"] = o.shutdown_grace_seconds;
  j["answer_timeout_seconds"] = o.answer_timeout_seconds;
  j["tls_cert_file"] = o.tls_cert_file;
  j["tls_key_file"] = o.tls_key_file;
  j["tls_client_ca_file"] = o.tls_client_ca_file;
  j["auth_tokens_file"] = o.auth_tokens_file;
  j["credentials_reload_seconds"] = o.credentials_reload_seconds;
  j["reflection"] = o.reflection;
  j["principal_max_sessions"] = o.principal_max_sessions;
  j["principal_memory_bytes"] = o.principal_memory_bytes;
  j["access_log"] = o.access_log;
  j["log_level"] = absl::GetFlag(FLAGS_log_level);
  nlohmann::ordered_json models = nlohmann::ordered_json::object();
  for (const auto& [name, dir] : o.models) models[name] = dir;
  j["models"] = std::move(models);
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace

int main(int argc, char** argv) {
  // A log reader that goes away (a shipper or `| tee` that died) must not
  // kill the server on its next line: writes to the closed pipe fail with
  // EPIPE instead, and the lines are dropped (log.h). Sockets are gRPC's,
  // which sends with MSG_NOSIGNAL either way.
  signal(SIGPIPE, SIG_IGN);
  // A hangup (the terminal or session that started the server went away)
  // is not a reason to drop every session without a drain: ignored.
  // Certificates and tokens are reloaded by polling their files.
  signal(SIGHUP, SIG_IGN);
  // Buffers of 4 MiB and more (KV caches, RoPE tables, request tensors) are
  // mapped on their own and unmapped when freed, so a closed session or a
  // finished large request gives its memory back to the system at once.
  // glibc's default threshold grows with the largest buffer freed (up to
  // 32 MiB); past it such buffers come from the heap, fragment it, and the
  // process holds its high-water mark (measured: peak RSS 100+ MiB higher
  // under the memory test's load, and RSS near the budget after every
  // session closed).
  mallopt(M_MMAP_THRESHOLD, 4 << 20);
  // Abseil's debug-build deadlock detection (on in Debian's build) records
  // every lock in a graph: a few percent of a small call's time. Tests keep it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // --help lists this file's flags (absl's default looks for a file named
  // after the binary).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view path) {
    return absl::EndsWith(path, "server/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  // Collect the repeatable --model flags.
  std::vector<std::pair<std::string, std::string>> models;
  std::vector<char*> args;
  // Whether --memory_budget_bytes was given (its deprecated alias yields to
  // it whatever its value, the default's included).
  bool memory_budget_given = false;
  bool metrics_address_given = false;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    for (const char* name : {"--memory_budget_bytes", "-memory_budget_bytes"}) {
      if (a == name || absl::StartsWith(a, absl::StrCat(name, "="))) memory_budget_given = true;
    }
    for (const char* name : {"--metrics_address", "-metrics_address"}) {
      if (a == name || absl::StartsWith(a, absl::StrCat(name, "="))) metrics_address_given = true;
    }
    std::string value;
    if (a.rfind("--model=", 0) == 0) {
      value = a.substr(8);
    } else if ((a == "--model" || a == "-model") && i + 1 < argc) {
      value = argv[++i];
    } else {
      args.push_back(argv[i]);
      continue;
    }
    const size_t eq = value.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == value.size()) {
      std::fprintf(stderr, "ropeattn-server: --model wants NAME=DIR, got \"%s\"\n", value.c_str());
      return kExitUsage;
    }
    models.emplace_back(value.substr(0, eq), value.substr(eq + 1));
  }
  argc = static_cast<int>(args.size());
  argv = args.data();
  absl::SetProgramUsageMessage(
      "ropeattn gRPC server.\n"
      "Usage: ropeattn-server [--address=127.0.0.1:50051] [--metrics_address=127.0.0.1:9464] "
      "[flags]\n"
      "Serves ropeattn.v1.AttentionService, grpc.health.v1.Health and server reflection.");
  absl::ParseCommandLine(argc, argv);

  using ropeattn::server::LogEvent;
  using ropeattn::server::LogLevel;
  const absl::StatusOr<LogLevel> log_level =
      ropeattn::server::ParseLogLevel(absl::GetFlag(FLAGS_log_level));
  if (!log_level.ok()) {
    std::fprintf(stderr, "ropeattn-server: --log_level: %s\n",
                 std::string(log_level.status().message()).c_str());
    return kExitUsage;
  }
  ropeattn::server::SetLogLevel(*log_level);

  ropeattn::server::ServerOptions o;
  o.access_log = absl::GetFlag(FLAGS_access_log);
  o.address = absl::GetFlag(FLAGS_address);
  o.max_connections = absl::GetFlag(FLAGS_max_connections);
  o.handshake_timeout_seconds = absl::GetFlag(FLAGS_handshake_timeout_seconds);
  o.max_connection_idle_seconds = absl::GetFlag(FLAGS_max_connection_idle_seconds);
  o.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  if (const int port = absl::GetFlag(FLAGS_metrics_port); port < -1 || port > 65535) {
    std::fprintf(stderr,
                 "ropeattn-server: --metrics_port must be in [0, 65535] (or -1: unset), got %d\n",
                 port);
    return kExitUsage;
  } else if (port >= 0) {
    if (metrics_address_given) {
      std::fprintf(stderr,
                   "ropeattn-server: --metrics_port and --metrics_address both given: "
                   "--metrics_port=%d is a shorthand for --metrics_address=127.0.0.1:%d; give one\n",
                   port, port);
      return kExitUsage;
    }
    o.metrics_address = absl::StrCat("127.0.0.1:", port);
  }
  o.compute_workers = absl::GetFlag(FLAGS_compute_workers);
  o.threads_per_call = absl::GetFlag(FLAGS_threads_per_call);
  o.queue_depth = absl::GetFlag(FLAGS_queue_depth);
  o.max_queue_delay_seconds = absl::GetFlag(FLAGS_max_queue_delay_seconds);
  o.max_decode_batch = absl::GetFlag(FLAGS_max_decode_batch);
  o.max_queue_slowdown = absl::GetFlag(FLAGS_max_queue_slowdown);
  o.compute_nice = absl::GetFlag(FLAGS_compute_nice);
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  o.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  o.memory_budget_bytes = absl::GetFlag(FLAGS_memory_budget_bytes);
  if (const int64_t alias = absl::GetFlag(FLAGS_kv_budget_bytes); alias != -1) {
    if (alias < 0) {
      std::fprintf(stderr, "ropeattn-server: --kv_budget_bytes must be >= 0, got %lld\n",
                   static_cast<long long>(alias));
      return kExitUsage;
    }
    if (!memory_budget_given) o.memory_budget_bytes = alias;
  }
  o.max_request_compute = absl::GetFlag(FLAGS_max_request_compute);
  o.default_max_context = absl::GetFlag(FLAGS_default_max_context);
  o.max_context_limit = absl::GetFlag(FLAGS_max_context_limit);
  o.default_idle_ttl_seconds = absl::GetFlag(FLAGS_default_idle_ttl_seconds);
  o.max_idle_ttl_seconds = absl::GetFlag(FLAGS_max_idle_ttl_seconds);
  o.shutdown_grace_seconds = absl::GetFlag(FLAGS_shutdown_grace_seconds);
  o.answer_timeout_seconds = absl::GetFlag(FLAGS_answer_timeout_seconds);
  o.models = models;
  o.tls_cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  o.tls_key_file = absl::GetFlag(FLAGS_tls_key_file);
  o.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file);
  o.auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens_file);
  o.credentials_reload_seconds = absl::GetFlag(FLAGS_credentials_reload_seconds);
  o.reflection = absl::GetFlag(FLAGS_reflection);
  o.principal_max_sessions = absl::GetFlag(FLAGS_principal_max_sessions);
  o.principal_memory_bytes = absl::GetFlag(FLAGS_principal_memory_bytes);
  // Every flag value checked before anything starts, so a bad one is a usage
  // error (exit 2) like the checks above, not a start-up failure (exit 1).
  if (const absl::Status flags = ropeattn::server::ValidateServerOptions(o); !flags.ok()) {
    LogEvent(LogLevel::kError, "start_failed", {{"message", flags.ToString()}});
    return kExitUsage;
  }

  // Block the shutdown signals in every thread (they inherit this mask), then
  // take them synchronously here.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // Idle connections hold fds; the more the limit allows, the later a flood
  // bites. The connection cap below is derived from the raised limit.
  const absl::StatusOr<int64_t> fd_limit_before = ropeattn::server::FdSoftLimit();
  const absl::StatusOr<int64_t> fd_limit = ropeattn::server::RaiseFdLimitToHard();
  if (!fd_limit.ok()) {
    LogEvent(LogLevel::kWarning, "fd_limit_not_raised", {{"message", fd_limit.status().ToString()}});
  }
  const absl::StatusOr<int> max_connections =
      ropeattn::server::ResolveMaxConnections(o.max_connections);
  if (!max_connections.ok()) {
    LogEvent(LogLevel::kError, "start_failed",
             {{"flag", "max_connections"}, {"message", max_connections.status().ToString()}});
    return kExitUsage;
  }

  auto server = ropeattn::server::Server::Start(o);
  if (!server.ok()) {
    LogEvent(LogLevel::kError, "start_failed", {{"message", server.status().ToString()}});
    return 1;
  }
  // The host as given ("0.0.0.0", "[::1]", "localhost"; validated at start)
  // and the port bound (port 0 picks one).
  const std::string metrics_url =
      o.metrics_address.empty()
          ? std::string()
          : absl::StrCat("http://", o.metrics_address.substr(0, o.metrics_address.rfind(':')),
                         ":", (*server)->metrics_port(), "/metrics");
  LogEvent(LogLevel::kInfo, "listening",
           {{"address", o.address},
            {"port", (*server)->port()},
            {"metrics", metrics_url},
            {"cpu", ropeattn::CpuDescription()}});
  const absl::StatusOr<int64_t> fd_limit_now = ropeattn::server::FdSoftLimit();
  LogEvent(LogLevel::kInfo, "limits",
           {{"fd_limit", fd_limit_now.ok() ? *fd_limit_now : -1},
            {"fd_limit_at_start", fd_limit_before.ok() ? *fd_limit_before : -1},
            {"max_connections", *max_connections}});
  // What the fds allow, not the derived cap (kMaxDerivedConnections stops
  // that short of it for memory, not fds).
  const absl::StatusOr<int64_t> derived = ropeattn::server::FdDerivedConnections();
  // Only a cap the operator chose can be too high (the derived one was
  // taken before gRPC opened its own fds, so it differs from this by those).
  if (o.max_connections > 0 && derived.ok() && *max_connections > *derived) {
    LogEvent(LogLevel::kWarning, "max_connections_above_fd_limit",
             {{"max_connections", *max_connections},
              {"derived", *derived},
              {"message",
               absl::StrCat("--max_connections=", *max_connections, " is above ", *derived,
                            " (the fd limit minus a reserve of ",
                            static_cast<int>(ropeattn::server::kFdReserve),
                            " fds): a connection flood can make accept() run out of fds (the "
                            "server sheds connections then)")}});
  }
  const absl::StatusOr<ropeattn::server::ListenAddress> listen =
      ropeattn::server::ParseListenAddress(o.address);
  const bool on_network = listen.ok() && !ropeattn::server::IsLoopbackHost(listen->host);
  if (on_network && !ropeattn::server::AuthConfigured(o)) {
    // With TLS the traffic is private, but every caller is still the one
    // anonymous principal (docs/security.md, "Principals").
    const bool tls = ropeattn::server::TlsConfigured(o);
    LogEvent(LogLevel::kWarning, tls ? "no_authentication_on_network" : "plaintext_on_network",
             {{"address", o.address},
              {"message",
               absl::StrCat("listening on ", o.address,
                            tls ? " with TLS but no authentication: anyone who can reach this "
                                  "port can use, list and close every session. Set "
                                  "--auth_tokens_file (or --tls_client_ca_file)"
                                : " with no TLS and no authentication: anyone who can reach this "
                                  "port can read traffic, and use, list and close every session. "
                                  "Set --tls_cert_file/--tls_key_file and --auth_tokens_file (or "
                                  "--tls_client_ca_file)",
                            "; see docs/security.md")}});
  }
  LogEvent(LogLevel::kInfo, "config",
           {{"config", ropeattn::server::RawJson{ConfigJson(o, *max_connections)}}});

  int sig = 0;
  sigwait(&signals, &sig);
  LogEvent(LogLevel::kInfo, "signal",
           {{"signal", sig == SIGTERM ? "SIGTERM" : "SIGINT"},
            {"message", absl::StrFormat("%s received, draining (grace %.1f s)",
                                        sig == SIGTERM ? "SIGTERM" : "SIGINT",
                                        o.shutdown_grace_seconds)}});
  (*server)->Shutdown(absl::Seconds(o.shutdown_grace_seconds));
  LogEvent(LogLevel::kInfo, "stopped", {});
  std::fflush(stdout);
  std::fflush(stderr);
  // Every call is answered and every session closed, and Shutdown removed
  // the TLS key copies (tls_files.h): nothing of ours is left to release
  // or delete. gRPC 1.51's library teardown (~grpc::Server joining its
  // default executor) can still block for up to ~10 s on an internal poll
  // after a large answer, past a pod's grace period, so the process ends
  // here instead of running destructors.
  std::_Exit(0);
}
