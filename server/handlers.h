// Stateless request handlers: a translator from proto to core calls and back.
// Each has two halves: Price* validates the request's structure (shapes, byte
// lengths, enums, ranges, positions; no tensor data is copied or scanned) and
// returns its Cost (server/cost.h); Run* validates again, reads the data and
// computes. The service prices on the gRPC thread, checks the cost against
// its limits and the memory budget, and only then queues Run* on its
// executor. Callers must price (and check) before they run: Run* trusts that
// the request's size was accepted.
#ifndef ROPEATTN_SERVER_HANDLERS_H_
#define ROPEATTN_SERVER_HANDLERS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/stop.h"
#include "ropeattn/v1/attention.pb.h"
#include "server/cost.h"

namespace ropeattn::server {

struct ComputeOptions {
  int threads = 1;                  // core num_threads for this request
  const StopToken* stop = nullptr;  // long kernels stop between tiles when it fires
  // The thread count results are planned for (core plan_threads; 0: threads):
  // a request run on fewer threads than planned still answers the same bytes.
  int plan_threads = 0;
};

// Attend (q/k/v given; layer mode is RunLayerAttend in layer.h): validates
// every field (shapes against the spec, dtypes, byte lengths, offsets, key
// lengths), rotates q at q_offsets[b] + i and k at j when the spec has RoPE
// (frequencies for the length max(Sk, last q pos + 1); q and k are checked
// for NaN/inf before rotation, so the index reported is the one sent), runs
// core Attend and fills the response.
// - Without q_offsets, queries are the last Sq tokens (offset Sk - Sq); when
//   Sq > Sk that is negative, so RoPE, ALiBi, T5, causal or window then need
//   explicit q_offsets (InvalidArgument naming which).
// - Zero-size q or k: the answer is zeros, without calling the core.
absl::StatusOr<Cost> PriceAttend(const v1::AttendRequest& request, int threads);
absl::Status RunAttend(const v1::AttendRequest& request, v1::AttendResponse* response,
                       const ComputeOptions& options);

// Encode: one positional-encoding operation (see EncodeRequest).
absl::StatusOr<Cost> PriceEncode(const v1::EncodeRequest& request);
absl::Status RunEncode(const v1::EncodeRequest& request, v1::EncodeResponse* response,
                       const ComputeOptions& options);

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_HANDLERS_H_
