// Memory budget for the streams of gRPC's own services (docs/cost-model.md).
//
// A health Watch or a reflection stream stays open as long as its client
// likes, and gRPC keeps some 18-30 KiB for each: 14,000 idle Watch streams
// took 260 MiB outside a 32 MiB budget. Like an open Decode stream, each is
// charged kStreamBytes from the memory budget from its start to its end; one
// the budget cannot pay for is cancelled at once.
#ifndef ROPEATTN_SERVER_STREAM_CHARGE_H_
#define ROPEATTN_SERVER_STREAM_CHARGE_H_

#include <cstdint>
#include <memory>

#include "absl/strings/string_view.h"
#include "grpcpp/support/server_interceptor.h"
#include "server/cost.h"

namespace ropeattn::server {

// Whether `method` ("/package.Service/Method") is a streaming method of
// gRPC's health or reflection service, which the charge applies to.
bool IsChargedStream(absl::string_view method);

// `budget` (not owned) outlives the server.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeStreamChargeFactory(
    MemoryBudget* budget, int64_t stream_bytes);

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_STREAM_CHARGE_H_
