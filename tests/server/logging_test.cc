// The server's structured log (docs/logging.md): JSON lines, request ids in
// and out, W3C traceparent, error answers (call status and in-band Decode
// errors), the access log, reaped sessions, health and drain; and the real
// binary's start-up lines with its effective configuration.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/call_log.h"
#include "server/log.h"
#include "tests/server/server_test_util.h"
#include "tests/tools/server_output.h"

namespace ropeattn {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

using Json = nlohmann::json;

// Every line of `text` as JSON; a line that is not one fails the test.
std::vector<Json> ParseLines(const std::string& text) {
  std::vector<Json> out;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    EXPECT_TRUE(j.is_object()) << "not a JSON object: " << line;
    if (!j.is_object()) continue;
    EXPECT_TRUE(j.contains("ts") && j["ts"].is_string()) << line;
    EXPECT_TRUE(j.contains("level") && j["level"].is_string()) << line;
    EXPECT_TRUE(j.contains("event") && j["event"].is_string()) << line;
    out.push_back(std::move(j));
  }
  return out;
}

// The lines with `event` whose fields include every one of `fields`.
std::vector<Json> Find(const std::vector<Json>& lines, const std::string& event,
                       const Json& fields = Json::object()) {
  std::vector<Json> out;
  for (const Json& j : lines) {
    if (j["event"] != event) continue;
    bool all = true;
    for (const auto& [k, v] : fields.items()) all = all && j.contains(k) && j[k] == v;
    if (all) out.push_back(j);
  }
  return out;
}

TEST(LogTest, LinesAreJsonWithTimestampLevelAndEventAndLevelsFilter) {
  server::LogCapture capture;
  server::SetLogLevel(server::LogLevel::kWarning);
  server::LogEvent(server::LogLevel::kInfo, "not_written", {{"x", 1}});
  server::LogEvent(server::LogLevel::kWarning, "written",
                   {{"text", "quote \" newline \n and bad utf-8 \xff"},
                    {"n", int64_t{-3}},
                    {"f", 0.5},
                    {"b", true},
                    {"empty", ""},
                    {"raw", server::RawJson{R"({"a":[1,2]})"}}});
  server::SetLogLevel(server::LogLevel::kInfo);
  const std::vector<Json> lines = ParseLines(capture.Text());
  ASSERT_EQ(lines.size(), 1u) << capture.Text();
  const Json& j = lines[0];
  EXPECT_EQ(j["level"], "warning");
  EXPECT_EQ(j["event"], "written");
  EXPECT_EQ(j["text"], "quote \" newline \n and bad utf-8 \xef\xbf\xbd");
  EXPECT_EQ(j["n"], -3);
  EXPECT_EQ(j["f"], 0.5);
  EXPECT_EQ(j["b"], true);
  EXPECT_FALSE(j.contains("empty"));
  EXPECT_EQ(j["raw"]["a"][1], 2);
  // RFC 3339 UTC with microseconds: 2026-11-24T06:21:37.233170Z
  const std::string ts = j["ts"];
  ASSERT_EQ(ts.size(), 27u) << ts;
  EXPECT_EQ(ts[10], 'T');
  EXPECT_EQ(ts.back(), 'Z');
}

TEST(LogTest, TraceparentIsParsedAsW3cSays) {
  std::string trace, parent;
  EXPECT_TRUE(server::ParseTraceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                                       &trace, &parent));
  EXPECT_EQ(trace, "4bf92f3577b34da6a3ce929d0e0e4736");
  EXPECT_EQ(parent, "00f067aa0ba902b7");
  // A later version may carry more after the known fields.
  EXPECT_TRUE(server::ParseTraceparent(
      "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", &trace, &parent));
  for (const char* bad : {
           "",
           "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  // 00 is exact
           "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",        // invalid version
           "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",        // upper case
           "00-00000000000000000000000000000000-00f067aa0ba902b7-01",        // zero trace id
           "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",        // zero parent id
           "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",        // misplaced dash
           "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
       }) {
    EXPECT_FALSE(server::ParseTraceparent(bad, &trace, &parent)) << bad;
  }
}

// ropeattn-server as a child process; a thread collects its log.
class LoggedServer {
 public:
  // keep_reading false: after start-up the log's read end is closed, as when
  // a log shipper reading the server's stdout dies.
  explicit LoggedServer(std::vector<std::string> flags, bool keep_reading = true) {
    std::vector<std::string> args = {"ropeattn-server", "--address=127.0.0.1:0",
                                     "--metrics_address=", "--shutdown_grace_seconds=2"};
    args.insert(args.end(), flags.begin(), flags.end());
    int out_pipe[2];
    if (pipe(out_pipe) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      dup2(out_pipe[1], STDOUT_FILENO);
      close(out_pipe[0]);
      close(out_pipe[1]);
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(ROPEATTN_SERVER_PATH, argv.data());
      _exit(127);
    }
    close(out_pipe[1]);
    out_ = fdopen(out_pipe[0], "r");
    const testing::ServerStartup startup = testing::ReadServerStartup(out_);
    port_ = startup.port;
    {
      absl::MutexLock lock(&mu_);
      text_ = startup.text;
    }
    if (!keep_reading) {
      fclose(out_);
      out_ = nullptr;
      return;
    }
    reader_ = std::thread([this] {
      for (std::string line = testing::ReadWholeLine(out_); !line.empty();
           line = testing::ReadWholeLine(out_)) {
        absl::MutexLock lock(&mu_);
        text_ += line;
      }
    });
  }

  ~LoggedServer() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (reader_.joinable()) reader_.join();
    if (out_ != nullptr) fclose(out_);
  }

  int port() const { return port_; }
  std::string Text() const {
    absl::MutexLock lock(&mu_);
    return text_;
  }
  // Waits (up to `timeout`) until the log has a line that satisfies `found`.
  std::vector<Json> WaitFor(const std::function<bool(const std::vector<Json>&)>& found,
                            absl::Duration timeout = absl::Seconds(10)) {
    const absl::Time deadline = absl::Now() + timeout;
    std::vector<Json> lines = ParseLines(Text());
    while (!found(lines) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
      lines = ParseLines(Text());
    }
    return lines;
  }
  // SIGTERM, then the exit status.
  int Terminate() {
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    if (reader_.joinable()) reader_.join();
    return status;
  }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  FILE* out_ = nullptr;
  std::thread reader_;
  mutable absl::Mutex mu_;
  std::string text_ ABSL_GUARDED_BY(mu_);
};

std::string MetadataValue(const std::multimap<grpc::string_ref, grpc::string_ref>& md,
                          const std::string& key) {
  auto it = md.find(key);
  return it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
}

void Deadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
}

bool IsHex32(const std::string& s) {
  return s.size() == 32 && s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

// The listening line's metrics URL names the host the endpoint is bound to
// (it said 127.0.0.1 for --metrics_address=0.0.0.0:PORT) and the port bound.
TEST(ServerLogTest, TheListeningLineNamesTheMetricsAddressAsBound) {
  for (const std::string host : {"0.0.0.0", "127.0.0.1", "localhost"}) {
    LoggedServer server({"--metrics_address=" + host + ":0"});
    ASSERT_GT(server.port(), 0) << server.Text();
    const std::vector<Json> lines = ParseLines(server.Text());
    const std::vector<Json> listening = Find(lines, "listening");
    ASSERT_EQ(listening.size(), 1u) << server.Text();
    const std::string url = listening[0]["metrics"].get<std::string>();
    EXPECT_THAT(url, ::testing::MatchesRegex("http://" + host + ":[1-9][0-9]*/metrics")) << url;
  }
}

TEST(ServerLogTest, TheBinaryLogsItsConfigErrorsCallsSessionsAndDrain) {
  LoggedServer server({"--access_log", "--default_idle_ttl_seconds=1"});
  ASSERT_GT(server.port(), 0) << server.Text();

  // Start-up: the model, health, where it listens, the effective config.
  {
    const std::vector<Json> lines = ParseLines(server.Text());
    EXPECT_EQ(Find(lines, "model_loaded", {{"model", "demo"}, {"layers", 2}}).size(), 1u);
    EXPECT_EQ(Find(lines, "health", {{"status", "SERVING"}}).size(), 1u);
    EXPECT_EQ(Find(lines, "listening", {{"port", server.port()}}).size(), 1u);
    const std::vector<Json> config = Find(lines, "config");
    ASSERT_EQ(config.size(), 1u) << server.Text();
    EXPECT_EQ(config[0]["config"]["access_log"], true);
    EXPECT_EQ(config[0]["config"]["default_idle_ttl_seconds"], 1);
    EXPECT_EQ(config[0]["config"]["address"], "127.0.0.1:0");
    EXPECT_EQ(config[0]["config"]["shutdown_grace_seconds"], 2.0);
  }

  auto stub = testing::TestStub(server.port());
  constexpr char kTrace[] = "4bf92f3577b34da6a3ce929d0e0e4736";
  constexpr char kParent[] = "00f067aa0ba902b7";

  // A failing call: its request id comes back, its error is logged with
  // method, code and message, and the trace context is carried.
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    ctx.AddMetadata("x-request-id", "req-failing-1");
    ctx.AddMetadata("traceparent", absl::StrCat("00-", kTrace, "-", kParent, "-01"));
    v1::AttendRequest req;  // no spec: refused
    v1::AttendResponse resp;
    const grpc::Status s = stub->Attend(&ctx, req, &resp);
    ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(MetadataValue(ctx.GetServerTrailingMetadata(), "x-request-id"), "req-failing-1");
    const Json want = {{"request_id", "req-failing-1"},
                       {"method", "/ropeattn.v1.AttentionService/Attend"},
                       {"code", "INVALID_ARGUMENT"},
                       {"message", s.error_message()},
                       {"trace_id", kTrace},
                       {"parent_id", kParent}};
    const std::vector<Json> lines =
        server.WaitFor([&](const auto& l) { return !Find(l, "error_answer", want).empty(); });
    const std::vector<Json> errors = Find(lines, "error_answer", want);
    ASSERT_EQ(errors.size(), 1u) << server.Text();
    EXPECT_EQ(errors[0]["level"], "warning");
    EXPECT_THAT(errors[0]["peer"].get<std::string>(), HasSubstr("127.0.0.1"));
    // The access log has the same call.
    EXPECT_EQ(Find(lines, "call", {{"request_id", "req-failing-1"}, {"code", "INVALID_ARGUMENT"}})
                  .size(),
              1u);
  }

  // No id (or one that is not usable): one is generated, returned in the
  // initial metadata of a successful answer, and used in the log.
  for (const std::string given : {std::string(), std::string("has space"), std::string(200, 'a')}) {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    if (!given.empty()) ctx.AddMetadata("x-request-id", given);
    v1::ServerInfo info;
    ASSERT_TRUE(stub->GetServerInfo(&ctx, {}, &info).ok());
    const std::string id = MetadataValue(ctx.GetServerInitialMetadata(), "x-request-id");
    EXPECT_TRUE(IsHex32(id)) << "given \"" << given << "\", got \"" << id << "\"";
    const std::vector<Json> lines = server.WaitFor(
        [&](const auto& l) { return !Find(l, "call", {{"request_id", id}}).empty(); });
    const std::vector<Json> calls = Find(lines, "call", {{"request_id", id}});
    ASSERT_EQ(calls.size(), 1u) << server.Text();
    EXPECT_EQ(calls[0]["method"], "/ropeattn.v1.AttentionService/GetServerInfo");
    EXPECT_EQ(calls[0]["code"], "OK");
    EXPECT_TRUE(calls[0]["ms"].is_number());
    // A successful call is no error.
    EXPECT_TRUE(Find(lines, "error_answer", {{"request_id", id}}).empty());
  }

  // A Decode stream: an in-band error (the stream goes on) is logged with
  // the stream's request id, the operation, the session and the seq; the
  // resumable session left idle is reaped, and that is logged too.
  std::string session_id;
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    ctx.AddMetadata("x-request-id", "decode-stream-1");
    auto stream = stub->Decode(&ctx);
    v1::DecodeRequest open;
    open.mutable_open()->mutable_spec()->set_heads(4);
    open.mutable_open()->mutable_spec()->set_head_dim(8);
    open.mutable_open()->set_resumable(true);
    open.mutable_open()->set_idle_ttl_seconds(1);
    ASSERT_TRUE(stream->Write(open));
    v1::DecodeResponse resp;
    ASSERT_TRUE(stream->Read(&resp));
    ASSERT_TRUE(resp.has_opened()) << resp.DebugString();
    session_id = resp.opened().session_id();
    v1::DecodeRequest step;
    step.mutable_step()->set_seq(7);
    step.mutable_step()->mutable_q()->add_shape(1);  // no data: refused in-band
    ASSERT_TRUE(stream->Write(step));
    ASSERT_TRUE(stream->Read(&resp));
    ASSERT_TRUE(resp.has_error()) << resp.DebugString();
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
    const Json want = {{"request_id", "decode-stream-1"},
                       {"method", "/ropeattn.v1.AttentionService/Decode"},
                       {"op", "Step"},
                       {"session", session_id},
                       {"seq", 7},
                       {"message", resp.error().message()}};
    const std::vector<Json> lines =
        server.WaitFor([&](const auto& l) { return !Find(l, "error_answer", want).empty(); });
    EXPECT_EQ(Find(lines, "error_answer", want).size(), 1u) << server.Text();
  }
  {
    // Idle TTL 1 s, the reaper looks every second.
    const std::vector<Json> lines = server.WaitFor(
        [&](const auto& l) { return !Find(l, "session_reaped", {{"session", session_id}}).empty(); });
    const std::vector<Json> reaped = Find(lines, "session_reaped", {{"session", session_id}});
    ASSERT_EQ(reaped.size(), 1u) << server.Text();
    EXPECT_EQ(reaped[0]["idle_ttl_s"], 1);
    EXPECT_GE(reaped[0]["idle_s"].get<double>(), 1.0);
  }

  // Drain: the signal, NOT_SERVING, start and end, stopped; exit 0.
  const int status = server.Terminate();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  const std::vector<Json> lines = ParseLines(server.Text());
  EXPECT_EQ(Find(lines, "signal", {{"signal", "SIGTERM"}}).size(), 1u);
  EXPECT_EQ(Find(lines, "drain_start", {{"grace_s", 2.0}}).size(), 1u);
  EXPECT_EQ(Find(lines, "health", {{"status", "NOT_SERVING"}, {"reason", "draining"}}).size(), 1u);
  EXPECT_EQ(Find(lines, "drain_end", {{"calls_answered_in_grace", true}}).size(), 1u);
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines.back()["event"], "stopped");
  // Nothing but JSON lines, in time order.
  for (size_t i = 1; i < lines.size(); ++i) {
    EXPECT_LE(lines[i - 1]["ts"].get<std::string>(), lines[i]["ts"].get<std::string>());
  }
}

// Without --access_log only error answers are logged per call.
// A server whose stdout reader went away (a log shipper or `| tee` that
// died) goes on serving: log lines are dropped, the process is not killed
// by SIGPIPE on its next line, and it still drains and exits 0.
TEST(ServerLogTest, AClosedLogDoesNotStopTheServer) {
  LoggedServer server({"--access_log"}, /*keep_reading=*/false);
  ASSERT_GT(server.port(), 0) << server.Text();
  auto stub = testing::TestStub(server.port());
  for (int i = 0; i < 200; ++i) {  // error answers are logged: many lines
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::AttendRequest req;  // no spec: refused
    v1::AttendResponse resp;
    ASSERT_EQ(stub->Attend(&ctx, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << "call " << i;
  }
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::ServerInfo info;
  ASSERT_TRUE(stub->GetServerInfo(&ctx, {}, &info).ok());
  const int status = server.Terminate();
  EXPECT_TRUE(WIFEXITED(status)) << "killed by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 0);
}

TEST(ServerLogTest, WithoutTheAccessLogOnlyErrorsAreLogged) {
  LoggedServer server({});
  ASSERT_GT(server.port(), 0) << server.Text();
  auto stub = testing::TestStub(server.port());
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    ctx.AddMetadata("x-request-id", "ok-call");
    v1::ServerInfo info;
    ASSERT_TRUE(stub->GetServerInfo(&ctx, {}, &info).ok());
  }
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    ctx.AddMetadata("x-request-id", "bad-call");
    v1::GetSessionRequest req;
    req.set_session_id("no-such-session");
    v1::SessionInfo info;
    ASSERT_EQ(stub->GetSession(&ctx, req, &info).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  const std::vector<Json> lines = server.WaitFor(
      [](const auto& l) { return !Find(l, "error_answer", {{"request_id", "bad-call"}}).empty(); });
  EXPECT_EQ(Find(lines, "error_answer", {{"request_id", "bad-call"}, {"code", "NOT_FOUND"}}).size(),
            1u)
      << server.Text();
  EXPECT_TRUE(Find(lines, "call").empty()) << server.Text();
  EXPECT_THAT(server.Text(), Not(HasSubstr("ok-call")));
}

// A health Watch never ends by itself: its client cancels it, or the
// server's shutdown does, and gRPC's health service then sets a status
// nobody receives, UNKNOWN "OnCancel()". That was logged as an error_answer
// at level error for every watch (every load balancer's, at every drain).
// It is a watch's normal end: no error_answer; the access log says
// CANCELLED.
TEST(ServerLogTest, AHealthWatchEndedByItsClientOrTheShutdownIsNoError) {
  LoggedServer server({"--access_log"});
  ASSERT_GT(server.port(), 0) << server.Text();
  auto health = grpc::health::v1::Health::NewStub(testing::TestChannel(server.port()));
  struct Watch {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<grpc::health::v1::HealthCheckResponse>> reader;
  };
  const auto start = [&](Watch& w, const char* id) {
    w.ctx.AddMetadata("x-request-id", id);
    w.reader = health->Watch(&w.ctx, {});
    grpc::health::v1::HealthCheckResponse r;
    return w.reader->Read(&r);
  };
  Watch by_client, by_shutdown;
  ASSERT_TRUE(start(by_client, "watch-cancelled"));
  ASSERT_TRUE(start(by_shutdown, "watch-at-shutdown"));
  by_client.ctx.TryCancel();
  grpc::health::v1::HealthCheckResponse r;
  while (by_client.reader->Read(&r)) {
  }
  (void)by_client.reader->Finish();
  std::vector<Json> lines = server.WaitFor(
      [](const auto& l) { return !Find(l, "call", {{"request_id", "watch-cancelled"}}).empty(); });
  EXPECT_EQ(Find(lines, "call", {{"request_id", "watch-cancelled"}, {"code", "CANCELLED"}}).size(),
            1u)
      << server.Text();
  std::thread ending([&] {
    while (by_shutdown.reader->Read(&r)) {
    }
    (void)by_shutdown.reader->Finish();
  });
  EXPECT_EQ(server.Terminate(), 0);
  ending.join();
  lines = ParseLines(server.Text());
  EXPECT_EQ(Find(lines, "call", {{"request_id", "watch-at-shutdown"}, {"code", "CANCELLED"}}).size(),
            1u)
      << server.Text();
  EXPECT_TRUE(Find(lines, "error_answer", {{"method", "/grpc.health.v1.Health/Watch"}}).empty())
      << server.Text();
  EXPECT_THAT(server.Text(), Not(HasSubstr("OnCancel()")));
}

}  // namespace
}  // namespace ropeattn
