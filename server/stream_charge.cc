#include "server/stream_charge.h"

#include <atomic>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/message.h"
#include "grpcpp/server_context.h"
#include "server/log.h"

namespace ropeattn::server {

bool IsChargedStream(absl::string_view method) {
  return method == "/grpc.health.v1.Health/Watch" ||
         method == "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo" ||
         method == "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo";
}

namespace {

bool IsReflection(absl::string_view method) {
  return absl::StartsWith(method, "/grpc.reflection.");
}

class StreamCharge final : public grpc::experimental::Interceptor {
 public:
  StreamCharge(grpc::experimental::ServerRpcInfo* info, std::atomic<int>* open, int max)
      : info_(info), open_(open), max_(max), reflection_(IsReflection(info->method())) {}
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
    // gRPC 1.51's reflection service builds every answer of a stream into
    // one response object it never clears (grpc/grpc#18009): the n-th
    // answer repeated the n-1 before it (200 requests of 20 bytes drew
    // 165 MB, each answer built and sent whole). The object is cleared once
    // each answer is sent, so every answer holds what its request asked.
    if (reflection_) {
      if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) {
        sending_ = methods->GetSendMessage();  // null if already serialized
      }
      if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_SEND_MESSAGE) &&
          sending_ != nullptr) {
        // The service's own (non-const) response, a generated message: the
        // Message base sits at its address.
        auto* response =
            static_cast<google::protobuf::Message*>(const_cast<void*>(sending_));
        if (absl::EndsWith(response->GetDescriptor()->full_name(), ".ServerReflectionResponse")) {
          response->Clear();
        }
        sending_ = nullptr;
      }
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* const info_;
  std::atomic<int>* const open_;
  const int max_;
  const bool reflection_;
  bool seen_ = false;
  bool counted_ = false;  // until the call ends (this is deleted)
  const void* sending_ = nullptr;  // reflection: the answer being sent
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
