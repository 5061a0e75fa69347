#include "server/parse_refusal.h"

#include <string>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"
#include "google/protobuf/unknown_field_set.h"
#include "grpcpp/support/status.h"

namespace ropeattn::server {
namespace {

using grpc::experimental::InterceptionHookPoints;

constexpr absl::string_view kHealthWatch = "/grpc.health.v1.Health/Watch";
// What gRPC 1.51's health service says of a request it could not parse
// (Check says it with INVALID_ARGUMENT, Watch with INTERNAL).
constexpr absl::string_view kHealthUnparsed = "could not parse request";

class HealthWatchRefusal final : public grpc::experimental::Interceptor {
 public:
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
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

// gRPC 1.51's reflection service is generated code: gRPC parses its
// requests, and a message that does not parse ends its read loop as the
// client's half-close does, so the stream ended OK with the requests behind
// it unanswered. An interceptor sees both as a receive with no message.
// They differ in the service's request object: parsing reinitialises it
// first (protobuf's Parse*, even when it then fails), the end of the stream
// leaves it untouched. So the object is marked before each receive with an
// unknown field (which a parse clears and the service never reads); a
// receive with no message that took the mark away was a failed parse, and
// the stream's OK becomes INVALID_ARGUMENT.
class ReflectionRefusal final : public grpc::experimental::Interceptor {
 public:
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    // A cancellation's batch has no messages (GetRecvMessage aborts there).
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_CANCEL)) {
      methods->Proceed();
      return;
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      if (methods->GetRecvMessage() == nullptr && receiving_ != nullptr) {
        if (!Unmark(receiving_, mark_)) unparsed_ = receiving_->GetTypeName();
      }
      receiving_ = nullptr;
    } else if (methods->GetRecvMessage() != nullptr) {
      // gRPC 1.51 calls a server's interceptors before each receive too,
      // with no hook point set but the object it receives into.
      auto* request = static_cast<google::protobuf::Message*>(methods->GetRecvMessage());
      if (absl::EndsWith(request->GetDescriptor()->full_name(), ".ServerReflectionRequest")) {
        request->GetReflection()->MutableUnknownFields(request)->AddFixed64(kMarkField, mark_);
        receiving_ = request;
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS) &&
        !unparsed_.empty() && methods->GetSendStatus().ok()) {
      methods->ModifySendStatus(grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("the message is not a valid ", unparsed_,
                       ": its bytes do not parse (truncated, corrupt, or a string that is not "
                       "UTF-8)")));
    }
    methods->Proceed();
  }

 private:
  // The largest field number protobuf allows; no reflection message uses it.
  static constexpr int kMarkField = (1 << 29) - 1;

  // Removes the mark; false if it was gone (a parse cleared the object).
  // The mark is this call's random value, not just its field number: a
  // message that sets that field and then fails to parse leaves its own
  // value there, which must not pass for the mark (a client's spoof ended
  // its stream OK again).
  static bool Unmark(google::protobuf::Message* request, uint64_t mark) {
    google::protobuf::UnknownFieldSet* unknown =
        request->GetReflection()->MutableUnknownFields(request);
    bool found = false;
    for (int i = 0; i < unknown->field_count(); ++i) {
      const google::protobuf::UnknownField& f = unknown->field(i);
      if (f.number() == kMarkField && f.type() == google::protobuf::UnknownField::TYPE_FIXED64 &&
          f.fixed64() == mark) {
        found = true;
      }
    }
    if (found) unknown->DeleteByNumber(kMarkField);
    return found;
  }

  // This call's mark: random, so a client cannot send it.
  const uint64_t mark_ = absl::Uniform<uint64_t>(absl::BitGen());

  // The service's request object while a receive into it runs (marked).
  google::protobuf::Message* receiving_ = nullptr;
  std::string unparsed_;  // the type of a message that did not parse
};

class ParseRefusalFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // gRPC takes a null interceptor as none for this call.
    if (info->method() == nullptr) return nullptr;
    const absl::string_view method = info->method();
    if (method == kHealthWatch) return new HealthWatchRefusal();
    if (absl::StartsWith(method, "/grpc.reflection.")) return new ReflectionRefusal();
    return nullptr;
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeParseRefusalFactory() {
  return std::make_unique<ParseRefusalFactory>();
}

}  // namespace ropeattn::server
