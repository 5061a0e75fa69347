#include "server/stream_charge.h"

#include <atomic>
#include <utility>

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
  StreamCharge(grpc::experimental::ServerRpcInfo* info, std::atomic<int>* open, int max)
      : info_(info), open_(open), max_(max) {}
  ~StreamCharge() override {
    if (counted_) open_->fetch_sub(1, std::memory_order_relaxed);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (!seen_ &&
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      seen_ = true;
      if (open_->fetch_add(1, std::memory_order_relaxed) < max_) {
        counted_ = true;
      } else {
        open_->fetch_sub(1, std::memory_order_relaxed);
        LogEvent(LogLevel::kWarning, "stream_refused",
                 {{"method", info_->method()},
                  {"message", absl::StrCat(max_, " health Watch and reflection streams are open "
                                                 "already (their limit)")}});
        info_->server_context()->TryCancel();
      }
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* const info_;
  std::atomic<int>* const open_;
  const int max_;
  bool seen_ = false;
  bool counted_ = false;  // until the call ends (this is deleted)
};

class StreamChargeFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit StreamChargeFactory(int max) : max_(max) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // gRPC takes a null interceptor as none for this call.
    if (!IsChargedStream(info->method())) return nullptr;
    return new StreamCharge(info, &open_, max_);
  }

 private:
  const int max_;
  std::atomic<int> open_{0};
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeStreamChargeFactory(
    int max_streams) {
  return std::make_unique<StreamChargeFactory>(max_streams);
}

}  // namespace ropeattn::server
