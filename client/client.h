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
#include "ropeattn/v1/attention.grpc.pb.h"

namespace ropeattn::client {

struct ClientOptions {
  std::string target = "127.0.0.1:50051";  // host:port
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
  // Retries of idempotent calls (Attend, Encode, GetServerInfo, GetSession,
  // ListSessions, ListModels, GetModel, Embed, Health) on UNAVAILABLE, with jittered exponential
  // backoff from 50 ms (doubling, +-20% jitter, capped at 5 s); no retry starts past the deadline.
  // A status after retries keeps its code and message, with " (after N attempts)" appended. Never
  // for Decode or CloseSession.
  int max_retries = 3;
  // Sent as metadata "x-ropeattn-session-key" when opening or attaching a
  // Decode stream, so a proxy can route it (empty: not sent). Printable ASCII.
  std::string routing_key;
};

enum class HealthStatus { kUnknown, kServing, kNotServing, kServiceUnknown };
const char* HealthStatusName(HealthStatus status);

class Session;

class Client {
 public:
  // Creates the channel (connection is lazy; use Health to probe).
  // InvalidArgument for an empty target, non-positive limits, negative
  // max_retries or a non-printable routing_key.
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

  // q [1, T, H, D], k [1, T, Hkv, D], v [1, T, Hkv, Dv].
  absl::StatusOr<v1::StepResult> Step(const v1::Tensor& q, const v1::Tensor& k,
                                      const v1::Tensor& v);
  // Layer-mode sessions (opened with a model): hidden [1, T, hidden_size];
  // the result's out is [1, T, hidden_size].
  absl::StatusOr<v1::StepResult> StepHidden(const v1::Tensor& hidden);
  absl::StatusOr<v1::SessionInfo> Truncate(int64_t position);
  // A resumable copy of the history, detached; attach it by its id.
  absl::StatusOr<v1::SessionInfo> Fork(uint32_t idle_ttl_seconds = 0);
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
};

// --- Wire tensor helpers (little-endian hosts). ---

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
absl::StatusOr<v1::Tensor> ReadNpy(const std::string& path);
// Writes format 1.0 (2.0 only for a header over 64 KiB), header padded so the
// data starts at a multiple of 64 bytes. InvalidArgument for a tensor whose
// bytes do not match its shape or dtype; I/O errors map from errno (NotFound
// for a missing directory), and no partial file is left behind.
absl::Status WriteNpy(const std::string& path, const v1::Tensor& tensor);

}  // namespace ropeattn::client

#endif  // ROPEATTN_CLIENT_CLIENT_H_
