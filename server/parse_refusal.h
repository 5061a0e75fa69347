// Requests to gRPC's own services whose bytes do not parse are answered
// INVALID_ARGUMENT, as the server's own service answers them (README,
// "A message whose bytes do not parse"). gRPC 1.51's health service ended
// such a Watch INTERNAL "could not parse request" (its Check answers the
// same bytes INVALID_ARGUMENT); its reflection service ended such a stream
// OK, as if its client had half-closed.
//
// Registered before the call log (server.cc), so the status it logs is the
// one the client receives.
#ifndef ROPEATTN_SERVER_PARSE_REFUSAL_H_
#define ROPEATTN_SERVER_PARSE_REFUSAL_H_

#include <memory>

#include "grpcpp/support/server_interceptor.h"

namespace ropeattn::server {

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeParseRefusalFactory();

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_PARSE_REFUSAL_H_
