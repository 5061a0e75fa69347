// The reference C++ client for ropeattn.v1.AttentionService.
//
// Every call returns absl::Status / StatusOr with the server's gRPC status
// mapped one to one (same code, same message), carries a deadline, and is
// retried only where that is safe (UNAVAILABLE before the request reached
// the server, on idempotent calls). Channels use keepalive settings matched
// to the server's (pings every 60 s; the server accepts one per 30 s).
// This library does not link the core: it works on wire tensors (v1::Tensor)
// with small helpers to build and read them.
//
// Thread-safety: a Client may be used from many threads at once. A Session
// is one Decode stream: use it from one thread at a time. Every Session must
// be destroyed before the Client that opened it.
#ifndef ROPEATTN_CLIENT_CLIENT_H_
#define ROPEATTN_CLIENT_CLIENT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/ring.h"
#include "ropeattn/v1/attention.grpc.pb.h"

namespace ropeattn::client {

struct ClientOptions {
  // host:port, [IPv6]:port, or a gRPC target: dns:[//dns-server/]host[:port],
  // unix:path, unix-abstract:name, ipv4:a:p[,a:p...], ipv6:[a]:p[,...], or
  // another resolver's scheme:// (passed through). Connect refuses a port
  // outside 1..65535 (gRPC's resolver would wrap it modulo 65536) and a
  // missing port where one is needed (host:port, ipv4:, ipv6:).
  std::string target = "127.0.0.1:50051";
  // Deadline of calls that do not pass their own; must be positive. For a
  // unary call it covers every retry. Decode streams get it per operation
  // (open/attach, each step, truncate, fork, close, the final half-close),
  // not for the stream's whole life: the stream itself has no deadline and a
  // timer thread of the Client cancels it if one operation overruns, which
  // surfaces as DEADLINE_EXCEEDED and breaks the Session (the stream is gone;
  // a resumable session can be re-attached by id).
  absl::Duration deadline = absl::Seconds(30);
  // Must be at least what the server sends (server default 256 MiB); at most
  // INT_MAX (a gRPC channel argument is an int).
  int64_t max_message_bytes = int64_t{256} << 20;
  // A TCP connection (per target) of this Client's own. By default gRPC
  // shares one connection between channels of the process whose settings
  // are equal (its global subchannel pool); a load generator that wants N
  // connections sets this (gRPC's local subchannel pool).
  bool own_connection = false;
  // Retries of idempotent calls (Attend, Encode, GetServerInfo, GetSession,
  // ListSessions, ListModels, GetModel, Embed, Health) on UNAVAILABLE, with jittered exponential
  // backoff from 50 ms (doubling, +-20% jitter, capped at 5 s); no retry starts past the deadline.
  // A status after retries keeps its code and message, with " (after N attempts)" appended. Never
  // for Decode or CloseSession.
  int max_retries = 3;
  // Sent as metadata "x-ropeattn-session-key" when opening or attaching a
  // Decode stream, so a proxy can route it (empty: not sent). Printable ASCII.
  std::string routing_key;
  // Several replicas of the server (host:port each; none empty, no
  // duplicates). When non-empty, `target` is ignored and the Client opens a
  // channel per target:
  // - idempotent unary calls (and Health) go round robin over the targets,
  //   one target per attempt, so a retry after UNAVAILABLE (a dead or
  //   draining replica) lands on the next target;
  // - GetSession and CloseSession ask the targets in order until one knows
  //   the id (NOT_FOUND only if every target answered NOT_FOUND; UNAVAILABLE,
  //   naming the target, if one that could hold it did not answer); ListSessions merges every
  //   target's list (an error from any target fails it, naming the target);
  // - Decode sessions go to the owner of their routing key on a consistent
  //   hash ring of the targets (client/ring.h: FNV-1a 64 + splitmix64, 160
  //   virtual nodes per target, the same in every process and build). The
  //   key is the `routing_key` argument of OpenSession/AttachSession, else
  //   `routing_key` above (an empty key is a key like any other: every such
  //   session lands on one target). The ring is static: a dead replica keeps
  //   its keys until the caller fails them over (see "Recovering a session"
  //   below and RecoverableSession).
  // When empty, the Client talks to `target` alone, as it always did.
  std::vector<std::string> targets;

  // TLS (docs/security.md). TLS is on when any of the three tls_* fields is
  // set, and then every channel (each of `targets`) uses it; all empty (the
  // default): plaintext. The server's name is checked against the host of
  // the target, so a target written as an IP address needs an IP SAN.
  // Files are read once, by Connect (a rotated file needs a new Client).
  // Connect returns InvalidArgument, naming the field and the file, for a
  // file that cannot be read or holds no PEM block of the kind below.
  //
  // PEM CA certificates that verify the server (a bundle may hold several).
  // Empty with TLS on (a client certificate set): gRPC's default roots (the
  // system's, or the file in $GRPC_DEFAULT_SSL_ROOTS_FILE_PATH). For a
  // server with a public certificate and no client certificate, name the
  // system bundle here (Debian: /etc/ssl/certs/ca-certificates.crt).
  std::string tls_ca_file;
  // Mutual TLS: this client's PEM certificate chain and its unencrypted PEM
  // private key, both or neither (InvalidArgument otherwise). Without
  // tls_ca_file the server is verified against the default roots.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Bearer token, sent as "authorization: Bearer <token>" on every call
  // (unary calls, Decode streams, Health). Empty (the default): none. Needs
  // TLS (InvalidArgument otherwise: on plaintext anyone on the path could
  // read it), and must be printable ASCII without spaces (it is a header
  // value; InvalidArgument otherwise). No status or log of this library
  // contains it. A server that does not know it answers UNAUTHENTICATED
  // (never retried).
  std::string token;
};

// Recovering a session whose replica died (multi-target clients).
//
// Sessions live in one server process; replicas do not share them. When the
// replica holding a session dies, its stream ends with UNAVAILABLE (and a
// re-attach by id, on a restarted replica or on another one, is NOT_FOUND:
// no replica holds it any more). The session's state is the sequence of
// steps applied to it, so it is rebuilt, bit for bit, by replaying them:
//   1. keep the inputs (q/k/v, or hidden for layer mode) of every step the
//      server answered (not the ones answered with an in-band error: those
//      changed nothing);
//   2. on UNAVAILABLE on the stream, or NOT_FOUND on attach, open the same
//      OpenSession on the next target of the ring for that key
//      (ring().NextAfter(key, failed_index), then OpenSessionOn), so every
//      client of that key fails over to the same replica;
//   3. replay the kept steps in order, with the same split into steps (the
//      outputs depend on nothing else: they equal the originals bit for bit)
//      and discard their outputs;
//   4. resend the step that failed, and go on.
// RecoverableSession below does exactly this. A truncate must be replayed
// too (RecoverableSession does not offer it: use Session directly).

class HashRing;

enum class HealthStatus { kUnknown, kServing, kNotServing, kServiceUnknown };
const char* HealthStatusName(HealthStatus status);

class Session;

class Client {
 public:
  // Creates the channel (connection is lazy; use Health to probe).
  // InvalidArgument for an empty target, one without a port or with a port
  // outside 1..65535 (see ClientOptions.target), non-positive limits, negative
  // max_retries, a non-printable routing_key, or a TLS or token setting that
  // cannot work (see tls_ca_file .. token: a token without TLS, a certificate
  // without its key, an unreadable or non-PEM file). A server whose
  // certificate does not verify, or that refuses this client's certificate,
  // is not seen here: calls then fail with UNAVAILABLE (the handshake failed).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();

  // grpc.health.v1 Check for `service` ("" = the whole server). The server
  // answers NOT_FOUND for a service it does not know: that is returned as
  // kServiceUnknown, not as an error. Every other status is an error.
  // A `deadline` passed to any call must be positive (InvalidArgument).
  absl::StatusOr<HealthStatus> Health(absl::string_view service = "",
                                      std::optional<absl::Duration> deadline = std::nullopt);
  absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& request,
                                            std::optional<absl::Duration> deadline = std::nullopt);
  absl::StatusOr<v1::EncodeResponse> Encode(const v1::EncodeRequest& request,
                                            std::optional<absl::Duration> deadline = std::nullopt);
  absl::StatusOr<v1::ServerInfo> GetServerInfo(
      std::optional<absl::Duration> deadline = std::nullopt);
  absl::StatusOr<v1::SessionInfo> GetSession(const std::string& session_id,
                                             std::optional<absl::Duration> deadline = std::nullopt);
  absl::StatusOr<std::vector<v1::SessionInfo>> ListSessions(
      std::optional<absl::Duration> deadline = std::nullopt);
  absl::StatusOr<v1::SessionInfo> CloseSession(
      const std::string& session_id, std::optional<absl::Duration> deadline = std::nullopt);

  // Served models (layer mode and Embed). ListModels answers in the server's
  // order (sorted by name); GetModel is NOT_FOUND for an unknown name.
  absl::StatusOr<std::vector<v1::ModelInfo>> ListModels(
      std::optional<absl::Duration> deadline = std::nullopt);
  absl::StatusOr<v1::ModelInfo> GetModel(const std::string& name,
                                         std::optional<absl::Duration> deadline = std::nullopt);
  // Token ids -> embeddings [B, S, hidden_size]. INVALID_ARGUMENT naming the
  // id and its index for an id outside the vocabulary.
  absl::StatusOr<v1::EmbedResponse> Embed(const v1::EmbedRequest& request,
                                          std::optional<absl::Duration> deadline = std::nullopt);

  // Opens a Decode stream and a session on it. A failed open is the server's
  // status (e.g. RESOURCE_EXHAUSTED for a full KV budget); DEADLINE_EXCEEDED
  // if the server does not answer within options().deadline. For a
  // layer-mode session set open.model() (and open.layer()); its steps then
  // go through Session::StepHidden.
  absl::StatusOr<std::unique_ptr<Session>> OpenSession(const v1::OpenSession& open);
  // Opens a Decode stream re-attached to a resumable session.
  absl::StatusOr<std::unique_ptr<Session>> AttachSession(const std::string& session_id);

  // As above, with a per-session routing key instead of options().routing_key:
  // it picks the target (multi-target clients: ring().Lookup(routing_key))
  // and is sent as "x-ropeattn-session-key" (empty: not sent).
  // InvalidArgument for a non-printable key.
  absl::StatusOr<std::unique_ptr<Session>> OpenSession(const v1::OpenSession& open,
                                                       absl::string_view routing_key);
  absl::StatusOr<std::unique_ptr<Session>> AttachSession(const std::string& session_id,
                                                         absl::string_view routing_key);
  // On targets()[target_index] whatever the key says (failover; see
  // "Recovering a session"). InvalidArgument for an index out of range.
  absl::StatusOr<std::unique_ptr<Session>> OpenSessionOn(size_t target_index,
                                                         const v1::OpenSession& open,
                                                         absl::string_view routing_key);
  absl::StatusOr<std::unique_ptr<Session>> AttachSessionOn(size_t target_index,
                                                           const std::string& session_id,
                                                           absl::string_view routing_key);
  // grpc.health.v1 Check on one target (Health() goes round robin).
  absl::StatusOr<HealthStatus> HealthOf(size_t target_index, absl::string_view service = "",
                                        std::optional<absl::Duration> deadline = std::nullopt);

  // The targets in use: options().targets (duplicates were refused), or
  // options().target alone.
  const std::vector<std::string>& targets() const { return ring_->targets(); }
  // The ring over targets() (one target: it owns every key).
  const HashRing& ring() const { return *ring_; }
  // Index in targets() of the owner of `routing_key`.
  size_t TargetFor(absl::string_view routing_key) const;

  const ClientOptions& options() const { return options_; }
  v1::AttentionService::Stub* stub() { return stub_.get(); }

 private:
  Client() = default;
  class CancelTimer;  // bounds each Decode operation (see ClientOptions)
  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  std::unique_ptr<CancelTimer> timer_;
  friend class Session;

  struct Replica {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::AttentionService::Stub> stub;
  };
  // One per targets() entry; replicas_[0] shares channel_ and stub_.
  std::vector<Replica> replicas_;
  std::unique_ptr<HashRing> ring_;
  std::atomic<uint64_t> next_replica_{0};
  // The replica of the next unary attempt (round robin).
  Replica& NextReplica();
  absl::StatusOr<std::unique_ptr<Session>> StartSession(size_t target_index,
                                                        const v1::DecodeRequest& first,
                                                        absl::string_view routing_key);
};

// One Decode stream holding one session. Operations are sent one at a time
// and answered in order. An in-band error (a bad step) comes back as that
// status and the session stays usable; a stream-level error (the session
// expired, the server shut down) comes back as its status and the Session is
// then closed (every later call fails with that status). A server that breaks
// the protocol (wrong seq, wrong kind of answer) gives INTERNAL and the
// stream is cancelled. After Close() succeeds, later calls fail with
// FAILED_PRECONDITION.
class Session {
 public:
  // Ends the stream (half-close, then finish, bounded by the client's
  // deadline); the server frees a non-resumable session and detaches a
  // resumable one. The detach lands a moment after this returns, so an
  // immediate re-attach may still see FAILED_PRECONDITION "attached".
  ~Session();

  // The answer to open/attach, refreshed by Truncate and Close.
  const v1::SessionInfo& info() const { return info_; }
  const std::string& id() const { return info_.session_id(); }
  int64_t position() const { return position_; }
  // The target the stream runs on, and its index in the Client's targets().
  const std::string& target() const { return target_; }
  size_t target_index() const { return target_index_; }
  // OK while the stream is up; once it has ended, why (the status every
  // later call returns).
  const absl::Status& stream_status() const { return broken_; }

  // q [1, T, H, D], k [1, T, Hkv, D], v [1, T, Hkv, Dv].
  absl::StatusOr<v1::StepResult> Step(const v1::Tensor& q, const v1::Tensor& k,
                                      const v1::Tensor& v);
  // Layer-mode sessions (opened with a model): hidden [1, T, hidden_size];
  // the result's out is [1, T, hidden_size].
  absl::StatusOr<v1::StepResult> StepHidden(const v1::Tensor& hidden);
  absl::StatusOr<v1::SessionInfo> Truncate(int64_t position);
  // A resumable copy of the history, detached; attach it by its id.
  absl::StatusOr<v1::SessionInfo> Fork(uint32_t idle_ttl_seconds = 0);
  // The session's keys and values (open another session with them as
  // `open.prefix` with the export's key_form, ROTATED or, under dynamic /
  // longrope, RAW, and the same start_position).
  absl::StatusOr<v1::KvExport> ExportKv();
  // Closes the session on the server and ends the stream. Seq numbers of
  // step/truncate/fork/close count from 1 on each stream.
  absl::Status Close();

 private:
  friend class Client;
  Session() = default;
  // Starts the stream and sends `first` (open or attach); reads `opened`.
  absl::Status Start(const v1::DecodeRequest& first);
  // Sends a step and records the new position.
  absl::StatusOr<v1::StepResult> SendStep(v1::DecodeRequest& request);
  // Sets seq, sends, reads the answer; in-band errors become their status.
  absl::StatusOr<v1::DecodeResponse> RoundTrip(v1::DecodeRequest& request);
  // The stream failed during `op`: drains it, finishes it and records (and
  // returns) why in broken_.
  absl::Status EndStream(absl::string_view op, bool timed_out);
  // Cancels and finishes the stream, recording `why` in broken_.
  void Abandon(const absl::Status& why);

  Client* client_ = nullptr;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> stream_;
  v1::SessionInfo info_;
  int64_t position_ = 0;
  uint64_t seq_ = 0;
  absl::Status broken_;  // non-OK once the stream has ended (it is then finished)
  std::string target_;
  size_t target_index_ = 0;
  std::string routing_key_;  // sent as x-ropeattn-session-key when not empty
};

// A Session that survives the loss of its replica (see "Recovering a
// session"). It keeps the inputs of every step the server answered; when the
// stream ends with UNAVAILABLE or NOT_FOUND (its replica died or lost it), it
// opens the same session on the next target of the ring for its key, replays
// the kept steps (their outputs are not returned again), resends the failed
// step and returns its answer as if nothing had happened. It tries each other
// target at most once per failure; if none can take the session, the error
// names every target tried. Any other error (an in-band step error, an open
// refused with RESOURCE_EXHAUSTED, a DEADLINE_EXCEEDED) is returned as is and
// nothing is retried. Memory: every step's inputs stay in memory until Close
// or destruction. Use from one thread at a time; destroy before the Client.
class RecoverableSession {
 public:
  // Opens on the owner of `routing_key` (falling over along the ring if that
  // target is UNAVAILABLE).
  static absl::StatusOr<std::unique_ptr<RecoverableSession>> Open(Client* client,
                                                                  const v1::OpenSession& open,
                                                                  absl::string_view routing_key);

  absl::StatusOr<v1::StepResult> Step(const v1::Tensor& q, const v1::Tensor& k,
                                      const v1::Tensor& v);
  absl::StatusOr<v1::StepResult> StepHidden(const v1::Tensor& hidden);
  // Closes the current session; later calls fail with FAILED_PRECONDITION.
  absl::Status Close();

  // The current stream (replaced by each recovery).
  Session& session() { return *session_; }
  const std::string& target() const { return session_->target(); }
  size_t target_index() const { return session_->target_index(); }
  int64_t position() const { return session_->position(); }
  const std::string& routing_key() const { return routing_key_; }
  // Recoveries so far, the failure that caused the last one (OK if none),
  // and the steps kept for replay.
  int recoveries() const { return recoveries_; }
  const absl::Status& last_failure() const { return last_failure_; }
  size_t retained_steps() const { return retained_.size(); }
  // Whether `status`, ending a stream, is one a recovery handles.
  static bool IsRecoverable(const absl::Status& status);

 private:
  RecoverableSession() = default;
  absl::StatusOr<v1::StepResult> Send(v1::Step step);
  static absl::StatusOr<v1::StepResult> SendOn(Session& session, const v1::Step& step);
  // Re-opens on the targets after `failed` in ring order and replays.
  absl::Status Recover(size_t failed, const absl::Status& why);

  Client* client_ = nullptr;
  v1::OpenSession open_;
  std::string routing_key_;
  std::unique_ptr<Session> session_;
  std::vector<v1::Step> retained_;
  int recoveries_ = 0;
  absl::Status last_failure_;
  bool closed_ = false;
};

// --- Wire tensor helpers (little-endian hosts). ---

// "f32", "bf16", "int8" (a KV cache dtype), else "unspecified".
const char* WireDTypeName(v1::DType dtype);

// f32 tensor from values (values.size() must equal the shape's product).
absl::StatusOr<v1::Tensor> MakeF32(absl::Span<const int64_t> shape, absl::Span<const float> values);
// bf16 tensor from f32 values, rounded to nearest even.
absl::StatusOr<v1::Tensor> MakeBF16(absl::Span<const int64_t> shape,
                                    absl::Span<const float> values);
// Seeded uniform [-1, 1) values (deterministic across platforms: splitmix64
// from `seed`, the top 24 bits of each draw; bf16 values are the f32 ones
// rounded to nearest even, kept below 1).
absl::StatusOr<v1::Tensor> RandomTensor(v1::DType dtype, absl::Span<const int64_t> shape,
                                        uint64_t seed);
// Every element as float (f32 or bf16); InvalidArgument for a byte length
// that does not match the shape or an unknown dtype.
absl::StatusOr<std::vector<float>> ToFloats(const v1::Tensor& tensor);
// Product of the shape (1 for a scalar); -1 if a dimension is negative or
// the product overflows int64.
int64_t NumElements(const v1::Tensor& tensor);

// --- .npy files (NumPy format 1.0 / 2.0, C order, little-endian). ---
// f32 is '<f4'. NumPy has no bfloat16, so bf16 is written as '<u2' holding
// the bfloat16 bit patterns (load it in NumPy and `.view(ml_dtypes.bfloat16)`,
// or shift left by 16 into uint32 and view as float32); on reading, '<u2'
// and 2-byte void ('|V2', what ml_dtypes' bfloat16 saves as) are bf16 bits.
// '<f2' and '<f8' are converted to f32. Anything else (big-endian, Fortran
// order, other dtypes, a truncated or malformed file) is InvalidArgument
// naming the file and the problem; a missing file is NotFound (other I/O
// errors map from errno). Format 3.0 (2.0 with a UTF-8 header) is read too.
// The header is read and checked before the data, and then exactly the data
// it describes is read: a file that is not .npy costs a few bytes whatever
// its size (a header is at most 1 MiB), and a regular file whose size does
// not match its header is refused unread.
absl::StatusOr<v1::Tensor> ReadNpy(const std::string& path);
// Same, refusing with ResourceExhausted (naming the file, its shape and
// `limit_name`, e.g. "max_message_bytes") a file whose tensor (f16 and f64
// read as f32) is more than `max_bytes` bytes, before reading it (its data,
// read whole, is at most twice that: f64).
absl::StatusOr<v1::Tensor> ReadNpy(const std::string& path, int64_t max_bytes,
                                   absl::string_view limit_name);
// Writes format 1.0 (2.0 only for a header over 64 KiB), header padded so the
// data starts at a multiple of 64 bytes. InvalidArgument for a tensor whose
// bytes do not match its shape or dtype; I/O errors map from errno (NotFound
// for a missing directory), and no partial file is left behind.
absl::Status WriteNpy(const std::string& path, const v1::Tensor& tensor);

}  // namespace ropeattn::client

#endif  // ROPEATTN_CLIENT_CLIENT_H_
