// Stateless request handlers: a translator from proto to core calls and back.
// They run on the service's compute executor, never on gRPC threads.
#ifndef ROPEATTN_SERVER_HANDLERS_H_
#define ROPEATTN_SERVER_HANDLERS_H_

#include "absl/status/status.h"
#include "ropeattn/v1/attention.pb.h"

namespace ropeattn::server {

struct ComputeOptions {
  int threads = 1;  // core num_threads for this request
};

// Attend: validates every field (shapes against the spec, dtypes, byte
// lengths, offsets, key lengths), rotates q at q_offsets[b] + i and k at j
// when the spec has RoPE (frequencies for the length max(Sk, last q pos + 1);
// q and k are checked for NaN/inf before rotation, so the index reported is
// the one sent), runs core Attend and fills the response.
// - Without q_offsets, queries are the last Sq tokens (offset Sk - Sq); when
//   Sq > Sk that is negative, so RoPE, ALiBi, T5, causal or window then need
//   explicit q_offsets (InvalidArgument naming which).
// - Work is bounded: at most 2^36 query-key pairs (B*H*Sq*Sk) and 2^28
//   elements in out or probs, else ResourceExhausted naming the size.
// - Zero-size q or k: the answer is zeros, without calling the core.
absl::Status RunAttend(const v1::AttendRequest& request, v1::AttendResponse* response,
                       const ComputeOptions& options);

// Encode: one positional-encoding operation (see EncodeRequest). Outputs are
// bounded to 2^26 elements (ResourceExhausted beyond).
absl::Status RunEncode(const v1::EncodeRequest& request, v1::EncodeResponse* response,
                       const ComputeOptions& options);

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_HANDLERS_H_
