// Limits and settings of one server, with their defaults. The flags in
// main.cc fill this; tests build it directly.
#ifndef ROPEATTN_SERVER_OPTIONS_H_
#define ROPEATTN_SERVER_OPTIONS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ropeattn::server {

struct ServerOptions {
  // gRPC listen address "host:port", host an IPv4 literal, [IPv6] or
  // localhost; port 0 picks a free port (see Server::port()). A port another
  // server holds fails Start (the socket is bound without SO_REUSEPORT).
  std::string address = "127.0.0.1:50051";
  // Concurrent gRPC connections; one past it is closed at accept (see
  // server/listener.h for how live connections are estimated). 0 means the
  // fd soft limit (main() raises it to the hard limit first) minus a reserve
  // of 256 fds, so sessions, metrics, model files and gRPC's own fds still
  // have room; at least 16. A value above that lets accept() run out of fds:
  // the server survives it (it sheds connections) but it is not advised.
  int max_connections = 0;
  // A connection that has not completed its HTTP/2 start (the client's
  // preface and SETTINGS) within this many seconds is closed: an idle socket
  // that never speaks holds a connection slot no longer than this.
  double handshake_timeout_seconds = 10;
  // A connection with no call open for this long is closed (GOAWAY; gRPC
  // clients reconnect on their next call), so a peer that completed its
  // HTTP/2 start and went quiet holds a connection slot no longer than
  // this. 0: never.
  int max_connection_idle_seconds = 300;
  // Prometheus /metrics listen address; empty disables the endpoint.
  std::string metrics_address = "127.0.0.1:9464";
  // Compute workers of the executor (each runs one request at a time).
  int compute_workers = 1;
  // Threads one request's kernels may use (core num_threads).
  int threads_per_call = 2;
  // Requests waiting for a worker beyond the running ones; a full queue
  // answers RESOURCE_EXHAUSTED at once.
  int queue_depth = 64;
  // A request whose estimated wait for a worker (the priced compute ahead
  // of it at this server's measured rate, server/admission.h) is longer is
  // refused at once with RESOURCE_EXHAUSTED and a retry-after-ms hint; so
  // is one that cannot finish inside its deadline. 0: no wait limit.
  double max_queue_delay_seconds = 5;
  // A stateless request whose estimated wait is more than this many times
  // its own estimated compute (and more than 50 ms) is refused likewise
  // (decode steps are not: a session is not cut off for another caller's
  // long request; the deadline and max_queue_delay still apply): under
  // overload, admitted latency stays a small multiple of each request's
  // size. 0: no such limit.
  double max_queue_slowdown = 8;
  // Decode steps of different sessions computed together in one parallel
  // pass at most (continuous batching, docs/scheduler.md); 1 turns it off.
  int max_decode_batch = 64;
  // Nice value of the compute workers and their kernel threads (0..19): the
  // gRPC threads (control calls, health, I/O) run at the process's own
  // priority and preempt compute; 0 keeps them equal.
  int compute_nice = 10;
  // Health Watch and reflection streams open at once (not a flag; tests
  // lower it).
  int max_service_streams = 1024;
  // Largest message either way. 256 MiB holds a [1, 8192, 32, 128] f32
  // q, k and v prefill with room to spare.
  int64_t max_message_bytes = int64_t{256} << 20;
  int max_sessions = 1024;
  // Memory that session state (KV caches, linear states, RoPE tables, raw
  // keys kept for re-rotation) and in-flight requests' buffers (input
  // copies, work buffers, answers) may hold together (docs/cost-model.md).
  int64_t memory_budget_bytes = int64_t{4} << 30;
  // Compute one request (or decode step) may ask for, in multiply-adds with
  // element steps weighted (server/cost.h): 2^40 is about ten seconds of this
  // machine's two cores, twice a causal [1, 8192, 32, 128] prefill.
  int64_t max_request_compute = int64_t{1} << 40;
  // Tokens a session may hold when OpenSession.max_context is 0.
  int64_t default_max_context = 4096;
  int64_t max_context_limit = 1 << 20;
  uint32_t default_idle_ttl_seconds = 300;
  uint32_t max_idle_ttl_seconds = 3600;
  // How often the reaper looks for idle sessions.
  double reap_interval_seconds = 1.0;
  // Graceful shutdown: time in-flight work gets before the server cancels it.
  double shutdown_grace_seconds = 10.0;
  // An answer (a unary call's, a Decode stream's next) the client has not
  // taken this long after it was ready cancels its call, freeing what the
  // call held (gRPC has no write timeout of its own).
  double answer_timeout_seconds = 60.0;
  // TLS (docs/security.md): the server's certificate chain and private key,
  // PEM files, both or neither. Re-read when they change.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Mutual TLS: client certificates are required and verified against the
  // CA certificates in this PEM file (needs tls_cert_file). Without a tokens
  // file, a certificate's identity (URI SAN, else DNS SAN) is the principal.
  std::string tls_client_ca_file;
  // Bearer tokens, one per line "TOKEN PRINCIPAL [admin]", '#' starts a
  // comment; every call but health needs one. Needs TLS. Re-read on change.
  std::string auth_tokens_file;
  // How often the certificate, key, CA and tokens files are checked for
  // changes, in seconds (1 .. 3600).
  int credentials_reload_seconds = 10;
  // One "call" log line per call when it ends (method, code, time, peer,
  // request id); error answers are logged either way (docs/logging.md).
  bool access_log = false;
  // grpc.reflection.v1alpha.ServerReflection (grpcurl without .proto files).
  bool reflection = true;
  // Per-principal quotas, applied when authentication is configured (a
  // tokens file or a client CA): sessions held (reserved ones included) and
  // their held bytes (the memory budget's session part).
  int principal_max_sessions = 64;
  int64_t principal_memory_bytes = int64_t{1} << 30;
  // Models to serve: (name, checkpoint directory). Empty: the built-in demo
  // model, named "demo".
  std::vector<std::pair<std::string, std::string>> models;
};

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_OPTIONS_H_
