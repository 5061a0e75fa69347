// Memory budget for the streams of gRPC's own services (docs/cost-model.md).
//
// A health Watch or a reflection stream stays open as long as its client
// likes, and gRPC keeps some 18-30 KiB for each: 14,000 idle Watch streams
// took 260 MiB outside a 32 MiB budget. At most `max_streams` are open at
// once (ServerOptions::max_service_streams, 1024: some 32 MiB); one past it
// is cancelled at once.
// They are not charged to the memory budget: health needs no token, and
// unauthenticated Watch streams filling the budget refused everyone's work.
#ifndef ROPEATTN_SERVER_STREAM_CHARGE_H_
#define ROPEATTN_SERVER_STREAM_CHARGE_H_

#include <cstdint>
#include <memory>

#include "absl/strings/string_view.h"
#include "grpcpp/support/server_interceptor.h"

namespace ropeattn::server {

// Whether `method` ("/package.Service/Method") is a streaming method of
// gRPC's health or reflection service, which the charge applies to.
bool IsChargedStream(absl::string_view method);

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeStreamChargeFactory(
    int max_streams);

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_STREAM_CHARGE_H_
