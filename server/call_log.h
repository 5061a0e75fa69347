// Request ids and per-call log lines, for every method of the server
// (ours, health, reflection), as a gRPC server interceptor.
//
// - Request id: the client's `x-request-id` metadata when it is 1..128
//   characters of [A-Za-z0-9._:/+=-], else one generated here (32 hex
//   digits). It is returned in the response's initial and trailing metadata
//   (`x-request-id`) and written in every log line about the call.
// - W3C trace context: a valid `traceparent` (version 00) is carried into
//   the call's log lines as trace_id and parent_id.
// - Every answer with a non-OK status is logged (event "error_answer":
//   method, code, message, ms, peer); with `access_log`, every call also
//   gets one "call" line when it ends.
// - A call refused by gRPC's auth filter (Authenticator::Process) never
//   reaches this interceptor: LogRefusedCall writes its lines instead.
#ifndef ROPEATTN_SERVER_CALL_LOG_H_
#define ROPEATTN_SERVER_CALL_LOG_H_

#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/server_interceptor.h"

namespace ropeattn::server {

class Metrics;

// `metrics` (not owned, may be null): a call of the service that gRPC ended
// before its handler ran (deadline passed or cancelled before the request
// arrived) is counted there under its real code, as handlers count theirs.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeCallLogFactory(
    bool access_log, Metrics* metrics = nullptr);

// The request id of a call (see above); "" before the interceptor ran.
std::string RequestIdOf(const grpc::ServerContextBase& ctx);

// Logs an error answered inside a stream (a Decode operation's StepError),
// with the call's request id and trace context.
void LogStreamError(const grpc::ServerContextBase& ctx, absl::string_view method,
                    absl::string_view op, const absl::Status& status, absl::string_view session,
                    int64_t seq);

// Logs a unary call cancelled because its answer was not taken within
// --answer_timeout_seconds (AnswerWatch), as an error answer: "error_answer"
// with code CANCELLED, `message` (why), `took` (from the call's arrival to
// the cancellation), the call's request id, `peer` (read before the
// cancellation: gRPC reports a cancelled call's peer as "unknown") and trace
// context. Its status line was written when it was answered, before anyone
// knew the answer would stay untaken.
void LogAnswerTimedOut(const grpc::ServerContextBase& ctx, absl::string_view method,
                       absl::string_view message, absl::Duration took, absl::string_view peer);

// The lines of a call refused by the authenticator in gRPC's auth filter,
// before any interceptor or handler: no interceptor sees it, so they are
// written from its request metadata `md` (the method from `:path`, the
// request id and trace context as the interceptor would settle them; no
// peer: the filter is not told it). "error_answer" always, "call" too with
// `access_log`; `took` is the time the refusal took. Never logs the
// `authorization` value.
// `suppressed`: refusals not logged since the last line (a "suppressed"
// field in this one).
void LogRefusedCall(const std::multimap<grpc::string_ref, grpc::string_ref>& md,
                    const grpc::Status& status, absl::Duration took, bool access_log,
                    int64_t suppressed = 0);

// The trace and parent ids of a W3C traceparent header; false when it is
// not one (unknown version ff, wrong lengths, non-hex, all-zero ids).
bool ParseTraceparent(absl::string_view header, std::string* trace_id, std::string* parent_id);

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_CALL_LOG_H_
