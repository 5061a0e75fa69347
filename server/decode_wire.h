// The Decode stream's wire, translated (docs/scheduler.md, "The decode
// path"): an OpenSession into a SessionConfig, a Step into core tensor views
// over the message's own bytes, and a step's answer written straight into
// the response message. Sessions (server/sessions.h) never see a Step.
#ifndef ROPEATTN_SERVER_DECODE_WIRE_H_
#define ROPEATTN_SERVER_DECODE_WIRE_H_

#include <array>
#include <cstdint>

#include "absl/status/statusor.h"
#include "core/tensor.h"
#include "ropeattn/v1/attention.pb.h"
#include "server/cost.h"
#include "server/model.h"
#include "server/options.h"
#include "server/sessions.h"

namespace ropeattn::server {

// Validates an OpenSession against the server's limits.
absl::StatusOr<SessionConfig> ResolveOpenSession(const v1::OpenSession& open,
                                                 const ServerOptions& options,
                                                 const ModelRegistry& models);

// An open's KV prefix as core views over the wire bytes (copied only when
// misaligned, into `copies`: the open's reservation counts one f32 copy of
// k and v, which the import's rotated keys need) and its key form;
// InvalidArgument naming open.prefix.k / .v for a malformed tensor. Shapes
// were checked by ResolveOpenSession. The views live as long as the
// message.
struct WirePrefix {
  ConstTensorView k, v;
  Tensor copies[2];
  DecodeState::KeyForm form = DecodeState::KeyForm::kRaw;
};
absl::StatusOr<WirePrefix> PrefixFromProto(const v1::KvPrefix& prefix);

// An open's (or attach's) cost: its answer, a SessionInfo echoing the spec
// (so every later answer carrying the session's SessionInfo fits too), and
// the compute of importing its KV prefix (copied to f32, keys rotated or
// un-rotated: a cos/sin row per token). InvalidArgument for a malformed
// prefix tensor.
absl::StatusOr<Cost> PriceOpen(const SessionConfig& config, const v1::OpenSession& open);

// An export's cost at `position` tokens: the answer's bytes (checked against
// the reply limit before anything is copied) and its transient copies.
Cost PriceExport(const SessionConfig& config, int64_t position);

// A step's cost from its wire tensors' shapes (InvalidArgument for a
// malformed tensor or shape, as the step itself would say), at `position`.
// The admission kind of a step (each kind learns its own rate): a step the
// decode kernel computes, memory-bound ("Decode.Step"; linear sessions too),
// or one the prefill computes, compute-bound ("Decode.Prefill"), as
// ChooseAttentionPath decides from its tokens (q's or, in layer mode,
// hidden's shape) and the session's heads.
const char* StepAdmissionKind(const SessionConfig& config, const v1::Step& step);
// Whether a step shares a batched pass with other sessions' steps: decode
// kernel steps of at most kBatchStepMaxTokens (sessions.h) tokens. Longer
// ones (prompts, prefill) run alone: every answer of a pass waits for all of
// it, so a one-token step must not wait for several callers' prompt-sized
// steps.
bool StepJoinsBatches(const SessionConfig& config, const v1::Step& step);

absl::StatusOr<Cost> PriceStep(const SessionConfig& config, const v1::Step& step, int64_t position,
                               int threads);

// The step's tensors as core views: over the message's bytes where they are
// aligned for their dtype (the usual case), else over copies kept in
// `copies`. InvalidArgument naming the field for a malformed tensor, or for
// a step of the wrong kind (hidden for a q/k/v session, or the reverse).
absl::StatusOr<StepInput> StepInputFromProto(const SessionConfig& config, const v1::Step& step,
                                             std::array<Tensor, 3>& copies);

// A StepOutput that sizes `out` (dtype, shape, bytes) once and hands back a
// view of its bytes, so the session writes its answer in place.
StepOutput StepOutputInto(v1::Tensor* out);

// One step of one session from the wire, alone (tests and fuzzers; the
// Decode handler batches steps through Session::StepMany): the answer's
// tensor, seq and position in `result`.
absl::Status StepFromProto(Session& session, const v1::Step& step, int threads,
                           const StopToken* stop, v1::StepResult* result);

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_DECODE_WIRE_H_
