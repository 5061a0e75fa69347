#include "server/stream_charge.h"

#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/server_context.h"
#include "server/log.h"

namespace ropeattn::server {

bool IsChargedStream(absl::string_view method) {
  return method == "/grpc.health.v1.Health/Watch" ||
         method == "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo" ||
         method == "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo";
}

namespace {

class StreamCharge final : public grpc::experimental::Interceptor {
 public:
  StreamCharge(grpc::experimental::ServerRpcInfo* info, MemoryBudget* budget, int64_t bytes)
      : info_(info), budget_(budget), bytes_(bytes) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (!charged_ &&
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      charged_ = true;
      absl::StatusOr<MemoryBudget::Reservation> held =
          budget_->Reserve(bytes_, absl::StrCat("an open ", info_->method(), " stream"));
      if (held.ok()) {
        held_ = *std::move(held);
      } else {
        LogEvent(LogLevel::kWarning, "stream_refused",
                 {{"method", info_->method()}, {"message", held.status().message()}});
        info_->server_context()->TryCancel();
      }
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* const info_;
  MemoryBudget* const budget_;
  const int64_t bytes_;
  bool charged_ = false;
  MemoryBudget::Reservation held_;  // until the call ends (this is deleted)
};

class StreamChargeFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  StreamChargeFactory(MemoryBudget* budget, int64_t bytes) : budget_(budget), bytes_(bytes) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // gRPC takes a null interceptor as none for this call.
    if (!IsChargedStream(info->method())) return nullptr;
    return new StreamCharge(info, budget_, bytes_);
  }

 private:
  MemoryBudget* const budget_;
  const int64_t bytes_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeStreamChargeFactory(
    MemoryBudget* budget, int64_t stream_bytes) {
  return std::make_unique<StreamChargeFactory>(budget, stream_bytes);
}

}  // namespace ropeattn::server
