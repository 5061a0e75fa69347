#include "server/call_log.h"

#include <cmath>
#include <map>
#include <string>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "grpcpp/support/interceptor.h"
#include "server/log.h"
#include "server/metrics.h"

namespace ropeattn::server {
namespace {

constexpr char kRequestIdKey[] = "x-request-id";
constexpr char kTraceparentKey[] = "traceparent";
constexpr char kHealthWatch[] = "/grpc.health.v1.Health/Watch";

bool IsRequestIdChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         c == '.' || c == '_' || c == ':' || c == '/' || c == '+' || c == '=' || c == '-';
}

bool ValidRequestId(absl::string_view id) {
  if (id.empty() || id.size() > 128) return false;
  for (char c : id) {
    if (!IsRequestIdChar(c)) return false;
  }
  return true;
}

bool IsLowerHex(absl::string_view s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

bool AllZero(absl::string_view s) { return s.find_first_not_of('0') == absl::string_view::npos; }

std::string NewRequestId() {
  thread_local absl::BitGen gen;
  return absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(gen), absl::Uniform<uint64_t>(gen));
}

absl::string_view Find(const std::multimap<grpc::string_ref, grpc::string_ref>& md,
                       absl::string_view key) {
  auto it = md.find(grpc::string_ref(key.data(), key.size()));
  if (it == md.end()) return {};
  return absl::string_view(it->second.data(), it->second.size());
}

std::string CodeName(int code) {
  return code >= 0 && code <= 16 ? absl::StatusCodeToString(static_cast<absl::StatusCode>(code))
                                 : std::string("UNKNOWN");
}

LogLevel LevelOf(int code) {
  switch (static_cast<grpc::StatusCode>(code)) {
    case grpc::StatusCode::INTERNAL:
    case grpc::StatusCode::UNKNOWN:
    case grpc::StatusCode::DATA_LOSS:
      return LogLevel::kError;  // ours to fix
    default:
      return LogLevel::kWarning;  // the caller's, or load
  }
}

double Milliseconds(absl::Duration d) { return std::round(absl::ToDoubleMilliseconds(d) * 1000) / 1000; }

// A line's count of lines not written before it (LogLineBudget), left out
// when none were.
LogField SuppressedField(int64_t suppressed) {
  return suppressed > 0 ? LogField("suppressed", suppressed) : LogField("suppressed", "");
}

class CallLog final : public grpc::experimental::Interceptor {
 public:
  CallLog(grpc::experimental::ServerRpcInfo* info, bool access_log, Metrics* metrics,
          LogLineBudget* health_lines)
      : info_(info),
        access_log_(access_log),
        metrics_(metrics),
        health_lines_(health_lines),
        start_(absl::Now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      std::multimap<grpc::string_ref, grpc::string_ref>* md = methods->GetRecvInitialMetadata();
      if (md != nullptr) {
        const absl::string_view given = Find(*md, kRequestIdKey);
        if (ValidRequestId(given)) {
          request_id_ = std::string(given);
        } else {
          request_id_ = NewRequestId();
          // The service reads the id from the call's metadata (RequestIdOf):
          // a missing or unusable one is replaced by ours, which this
          // interceptor keeps alive for the whole call.
          for (auto it = md->find(kRequestIdKey); it != md->end() && it->first == kRequestIdKey;) {
            it = md->erase(it);
          }
          md->emplace(grpc::string_ref(kRequestIdKey), grpc::string_ref(request_id_));
        }
        ParseTraceparent(Find(*md, kTraceparentKey), &trace_id_, &parent_id_);
      }
      // Now: once a call is cancelled (a timed-out answer's), gRPC 1.51
      // reports its peer as "unknown".
      peer_ = info_->server_context()->peer();
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_INITIAL_METADATA) &&
        !request_id_.empty()) {
      std::multimap<std::string, std::string>* md = methods->GetSendInitialMetadata();
      if (md != nullptr) md->emplace(kRequestIdKey, request_id_);
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      // Trailers too: an answer that is only trailers (an error before any
      // message) carries no initial metadata to the client.
      std::multimap<std::string, std::string>* trailers = methods->GetSendTrailingMetadata();
      if (trailers != nullptr && !request_id_.empty() && trailers->count(kRequestIdKey) == 0) {
        trailers->emplace(kRequestIdKey, request_id_);
      }
      Report(status);
    }
    methods->Proceed();
  }

 private:
  void Report(grpc::Status status) {
    // gRPC's own UNIMPLEMENTED, with no message (the service's methods are
    // raw and always reach their handler, which names its refusals): a call
    // gRPC ended before any handler, which the client never sees when it
    // had given up: logged as what it was (an expired deadline; a
    // cancellation, where gRPC has marked it by then).
    if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED && status.error_message().empty()) {
      const gpr_timespec deadline = info_->server_context()->raw_deadline();
      if (gpr_time_cmp(gpr_convert_clock_type(deadline, GPR_CLOCK_MONOTONIC),
                       gpr_now(GPR_CLOCK_MONOTONIC)) <= 0) {
        status = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                              "the call's deadline passed before its request arrived");
      } else if (info_->server_context()->IsCancelled()) {
        status = grpc::Status(grpc::StatusCode::CANCELLED,
                              "the call was cancelled before its request arrived");
      }
      // Counted here: its handler, which counts the others, never ran.
      absl::string_view method = info_->method();
      if (status.error_code() != grpc::StatusCode::UNIMPLEMENTED && metrics_ != nullptr &&
          absl::ConsumePrefix(&method, "/ropeattn.v1.AttentionService/")) {
        metrics_->RecordRequest(method, static_cast<int>(status.error_code()),
                                absl::ToDoubleSeconds(absl::Now() - start_));
      }
    }
    // A health Watch never ends by itself: its client cancels it (or the
    // server's shutdown does), and gRPC's health service then "answers"
    // UNKNOWN "OnCancel()", a status nobody receives. That is a watch's
    // normal end, not an error of ours: logged as what it was, CANCELLED,
    // and only by the access log.
    bool normal_end = false;
    if (info_->method() != nullptr && absl::string_view(info_->method()) == kHealthWatch &&
        ((status.error_code() == grpc::StatusCode::UNKNOWN &&
          status.error_message() == "OnCancel()") ||
         info_->server_context()->IsCancelled())) {
      status = grpc::Status(grpc::StatusCode::CANCELLED,
                            "the watch was cancelled (by its client, or by the server's shutdown)");
      normal_end = true;
    }
    const int code = static_cast<int>(status.error_code());
    if ((!status.ok() || access_log_) && peer_.empty()) {
      peer_ = info_->server_context()->peer();
    }
    const double ms = Milliseconds(absl::Now() - start_);
    // Health needs no token: a caller without one can make its calls fail
    // as fast as its connection carries them (a Check of an unknown service
    // is NOT_FOUND), so their error lines are limited as refused calls'
    // are (at most kHealthErrorLinesPerSecond; the next says how many were
    // not).
    int64_t suppressed = 0;
    const bool health = absl::StartsWith(
        info_->method() != nullptr ? absl::string_view(info_->method()) : absl::string_view(),
        "/grpc.health.v1.Health/");
    if (!status.ok() && !normal_end &&
        (!health || health_lines_->Admit(absl::Now(), &suppressed))) {
      LogEvent(LevelOf(code), "error_answer",
               {{"request_id", request_id_},
                {"method", info_->method()},
                {"code", CodeName(code)},
                {"message", status.error_message()},
                {"ms", ms},
                {"peer", peer_},
                {"trace_id", trace_id_},
                {"parent_id", parent_id_},
                SuppressedField(suppressed)});
    }
    if (access_log_) {
      LogEvent(LogLevel::kInfo, "call",
               {{"request_id", request_id_},
                {"method", info_->method()},
                {"code", CodeName(code)},
                {"ms", ms},
                {"peer", peer_},
                {"trace_id", trace_id_},
                {"parent_id", parent_id_}});
    }
  }

  grpc::experimental::ServerRpcInfo* const info_;
  const bool access_log_;
  Metrics* const metrics_;
  LogLineBudget* const health_lines_;
  const absl::Time start_;
  std::string request_id_;
  std::string trace_id_;
  std::string parent_id_;
  std::string peer_;
};

class CallLogFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  CallLogFactory(bool access_log, Metrics* metrics) : access_log_(access_log), metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new CallLog(info, access_log_, metrics_, &health_lines_);
  }

 private:
  static constexpr int kHealthErrorLinesPerSecond = 10;
  const bool access_log_;
  Metrics* const metrics_;
  LogLineBudget health_lines_{kHealthErrorLinesPerSecond};
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeCallLogFactory(
    bool access_log, Metrics* metrics) {
  return std::make_unique<CallLogFactory>(access_log, metrics);
}

std::string RequestIdOf(const grpc::ServerContextBase& ctx) {
  return std::string(Find(ctx.client_metadata(), kRequestIdKey));
}

bool ParseTraceparent(absl::string_view h, std::string* trace_id, std::string* parent_id) {
  // version "-" trace-id (32) "-" parent-id (16) "-" flags (2); a later
  // version may append "-..." after those 55 characters.
  if (h.size() < 55 || (h.size() > 55 && h[55] != '-')) return false;
  if (h[2] != '-' || h[35] != '-' || h[52] != '-') return false;
  const absl::string_view version = h.substr(0, 2), trace = h.substr(3, 32),
                          parent = h.substr(36, 16), flags = h.substr(53, 2);
  if (!IsLowerHex(version) || version == "ff" || (version == "00" && h.size() != 55)) return false;
  if (!IsLowerHex(trace) || !IsLowerHex(parent) || !IsLowerHex(flags)) return false;
  if (AllZero(trace) || AllZero(parent)) return false;
  *trace_id = std::string(trace);
  *parent_id = std::string(parent);
  return true;
}

void LogRefusedCall(const std::multimap<grpc::string_ref, grpc::string_ref>& md,
                    const grpc::Status& status, absl::Duration took, bool access_log,
                    int64_t suppressed) {
  // The client's own `:path` (gRPC has not matched it to a method yet): cut
  // so a long one cannot fill the log.
  constexpr size_t kMaxMethodChars = 256;
  const absl::string_view method = Find(md, ":path").substr(0, kMaxMethodChars);
  const absl::string_view given = Find(md, kRequestIdKey);
  // The id the interceptor would have settled on; gRPC 1.51's auth filter
  // cannot add metadata to the answer, so a generated one is only here.
  const std::string request_id = ValidRequestId(given) ? std::string(given) : NewRequestId();
  std::string trace_id, parent_id;
  ParseTraceparent(Find(md, kTraceparentKey), &trace_id, &parent_id);
  const int code = static_cast<int>(status.error_code());
  const double ms = Milliseconds(took);
  if (!status.ok()) {
    LogEvent(LevelOf(code), "error_answer",
             {{"request_id", request_id},
              {"method", method},
              {"code", CodeName(code)},
              {"message", status.error_message()},
              {"ms", ms},
              {"trace_id", trace_id},
              {"parent_id", parent_id},
              SuppressedField(suppressed)});
  }
  if (access_log) {
    LogEvent(LogLevel::kInfo, "call",
             {{"request_id", request_id},
              {"method", method},
              {"code", CodeName(code)},
              {"ms", ms},
              {"trace_id", trace_id},
              {"parent_id", parent_id},
              SuppressedField(suppressed)});
  }
}

void LogAnswerTimedOut(const grpc::ServerContextBase& ctx, absl::string_view method,
                       absl::string_view message, absl::Duration took, absl::string_view peer) {
  std::string trace_id, parent_id;
  ParseTraceparent(Find(ctx.client_metadata(), kTraceparentKey), &trace_id, &parent_id);
  const int code = static_cast<int>(grpc::StatusCode::CANCELLED);
  LogEvent(LevelOf(code), "error_answer",
           {{"request_id", RequestIdOf(ctx)},
            {"method", method},
            {"code", CodeName(code)},
            {"message", message},
            {"ms", Milliseconds(took)},
            {"peer", peer},
            {"trace_id", trace_id},
            {"parent_id", parent_id}});
}

void LogStreamError(const grpc::ServerContextBase& ctx, absl::string_view method,
                    absl::string_view op, const absl::Status& status, absl::string_view session,
                    int64_t seq) {
  std::string trace_id, parent_id;
  ParseTraceparent(Find(ctx.client_metadata(), kTraceparentKey), &trace_id, &parent_id);
  const int code = static_cast<int>(status.code());
  LogEvent(LevelOf(code), "error_answer",
           {{"request_id", RequestIdOf(ctx)},
            {"method", method},
            {"op", op},
            {"code", CodeName(code)},
            {"message", status.message()},
            {"session", session},
            {"seq", seq},
            {"trace_id", trace_id},
            {"parent_id", parent_id}});
}

}  // namespace ropeattn::server
