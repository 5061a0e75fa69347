#include "server/parse_refusal.h"

#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace ropeattn::server {
namespace {

constexpr absl::string_view kHealthWatch = "/grpc.health.v1.Health/Watch";
// What gRPC 1.51's health service says of a request it could not parse
// (Check says it with INVALID_ARGUMENT, Watch with INTERNAL).
constexpr absl::string_view kHealthUnparsed = "could not parse request";

class HealthWatchRefusal final : public grpc::experimental::Interceptor {
 public:
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      if (status.error_code() == grpc::StatusCode::INTERNAL &&
          status.error_message() == kHealthUnparsed) {
        methods->ModifySendStatus(
            grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, status.error_message()));
      }
    }
    methods->Proceed();
  }
};

class ParseRefusalFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // gRPC takes a null interceptor as none for this call.
    if (info->method() != nullptr && info->method() == kHealthWatch) {
      return new HealthWatchRefusal();
    }
    return nullptr;
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeParseRefusalFactory() {
  return std::make_unique<ParseRefusalFactory>();
}

}  // namespace ropeattn::server
