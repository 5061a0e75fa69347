// TLS, mutual TLS, bearer tokens, session ownership and per-principal quotas
// (docs/security.md), against a real server on a loopback port with real
// handshakes; every certificate is made at test time with openssl
// (tests/tools/test_certs.h).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "core/attention_kernels.h"
#include "core/decode_state.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "reflection_wire.grpc.pb.h"
#include "server/auth.h"
#include "server/log.h"
#include "server/metrics.h"
#include "server/sessions.h"
#include "server/tls_files.h"
#include "server/server.h"
#include "tests/server/server_test_util.h"
#include "tests/tools/server_output.h"
#include "tests/tools/test_certs.h"

namespace ropeattn {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::CertFiles;
using testing::TestCa;

constexpr char kAliceToken[] = "tok-alice-6f1d2c";
constexpr char kBobToken[] = "tok-bob-93ab07";
constexpr char kAdminToken[] = "tok-ops-5520ee";

// How a test client connects.
struct Creds {
  bool tls = true;
  std::string roots;        // PEM; the test CA
  std::string cert, key;    // client certificate (mutual TLS)
  std::string token;        // bearer token
};

std::shared_ptr<grpc::Channel> Channel(int port, const Creds& c) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  // A fresh connection per channel: no sharing of subchannels (and their
  // handshakes) between channels with different credentials.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  const std::string target = absl::StrCat("127.0.0.1:", port);
  if (!c.tls) return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  // The server certificate names localhost (and 127.0.0.1).
  args.SetSslTargetNameOverride("localhost");
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = c.roots;
  ssl.pem_cert_chain = c.cert;
  ssl.pem_private_key = c.key;
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::SslCredentials(ssl);
  if (!c.token.empty()) {
    creds = grpc::CompositeChannelCredentials(creds, grpc::AccessTokenCredentials(c.token));
  }
  return grpc::CreateCustomChannel(target, creds, args);
}

grpc::ClientContext* WithDeadline(grpc::ClientContext* ctx, int seconds = 5) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  return ctx;
}

grpc::Status Health(int port, const Creds& c) {
  auto stub = grpc::health::v1::Health::NewStub(Channel(port, c));
  grpc::ClientContext ctx;
  grpc::health::v1::HealthCheckResponse response;
  return stub->Check(WithDeadline(&ctx), {}, &response);
}

grpc::Status Info(int port, const Creds& c) {
  auto stub = v1::AttentionService::NewStub(Channel(port, c));
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  return stub->GetServerInfo(WithDeadline(&ctx), {}, &info);
}

// One query over two equal keys: out = mean of the value rows (2, 3, 2, 3).
grpc::Status SmallAttend(int port, const Creds& c, v1::AttendResponse* response) {
  auto stub = v1::AttentionService::NewStub(Channel(port, c));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return stub->Attend(&ctx, testing::SmallAttendRequest(), response);
}

// Reflection's list_services: the stream's status (OK only if it answered
// with the list).
grpc::Status ListServices(const std::shared_ptr<grpc::Channel>& channel) {
  auto refl = grpc::reflection::v1alpha::ServerReflection::NewStub(channel);
  grpc::ClientContext ctx;
  auto rw = refl->ServerReflectionInfo(WithDeadline(&ctx));
  grpc::reflection::v1alpha::ServerReflectionRequest req;
  req.set_list_services("");
  rw->Write(req);
  rw->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse resp;
  const bool answered = rw->Read(&resp) && resp.has_list_services_response();
  while (rw->Read(&resp)) {
  }
  const grpc::Status st = rw->Finish();
  if (st.ok() && !answered) return grpc::Status(grpc::StatusCode::UNKNOWN, "no list");
  return st;
}

v1::Tensor Ones(int64_t tokens, int64_t heads, int64_t dim, float value) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_F32);
  for (int64_t d : {int64_t{1}, tokens, heads, dim}) t.add_shape(d);
  std::vector<float> v(tokens * heads * dim, value);
  t.set_data(std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4));
  return t;
}

// A Decode stream: open or attach, then operations, each answered in order.
class Stream {
 public:
  Stream(int port, const Creds& c)
      : stub_(v1::AttentionService::NewStub(Channel(port, c))) {
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    rw_ = stub_->Decode(&ctx_);
  }
  // Sends `req` and reads one answer; false when the stream ended (then
  // Finish() has the status).
  bool Call(const v1::DecodeRequest& req, v1::DecodeResponse* resp) {
    return rw_->Write(req) && rw_->Read(resp);
  }
  bool Open(int64_t max_context, bool resumable, v1::DecodeResponse* resp) {
    v1::DecodeRequest req;
    v1::OpenSession* open = req.mutable_open();
    open->mutable_spec()->set_heads(2);
    open->mutable_spec()->set_head_dim(8);
    open->set_max_context(max_context);
    open->set_resumable(resumable);
    return Call(req, resp);
  }
  bool Attach(const std::string& id, v1::DecodeResponse* resp) {
    v1::DecodeRequest req;
    req.mutable_attach()->set_session_id(id);
    return Call(req, resp);
  }
  bool Step(uint64_t seq, float value, v1::DecodeResponse* resp) {
    v1::DecodeRequest req;
    v1::Step* step = req.mutable_step();
    step->set_seq(seq);
    *step->mutable_q() = Ones(1, 2, 8, value);
    *step->mutable_k() = Ones(1, 2, 8, value);
    *step->mutable_v() = Ones(1, 2, 8, value);
    return Call(req, resp);
  }
  grpc::Status Finish() {
    rw_->WritesDone();
    v1::DecodeResponse drain;
    while (rw_->Read(&drain)) {
    }
    return rw_->Finish();
  }

 private:
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> rw_;
};

// One series' value in a metrics text (-1: absent).
double MetricValue(const std::string& text, const std::string& series) {
  const size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::atof(text.c_str() + at + series.size() + 2);
}

// An id a principal does not own gets exactly the answer of an id that
// never existed; with the ids taken out, the messages must be equal.
std::string WithoutId(const std::string& message, const std::string& id) {
  return absl::StrReplaceAll(message, {{id, "<id>"}});
}
constexpr char kNeverExisted[] = "0123456789abcdef0123456789abcdef";

class SecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("ropeattn_security_");
    ASSERT_FALSE(dir_.empty());
    auto ca = TestCa::Create(dir_ + "/ca", "test-ca");
    ASSERT_TRUE(ca.ok()) << ca.status();
    ca_ = std::make_unique<TestCa>(*std::move(ca));
    auto server_cert = ca_->IssueServer("server");
    ASSERT_TRUE(server_cert.ok()) << server_cert.status();
    server_cert_ = *server_cert;
    tokens_file_ = dir_ + "/tokens";
    ASSERT_TRUE(testing::WriteFileAtomically(
                    tokens_file_, absl::StrCat("# principal tokens\n", kAliceToken, " alice\n",
                                               kBobToken, " bob   # a comment\n\n", kAdminToken,
                                               " ops admin\n"))
                    .ok());
  }
  void TearDown() override {
    server_.reset();
    if (!dir_.empty()) std::system(absl::StrCat("rm -rf ", dir_).c_str());
  }

  server::ServerOptions TlsOptions() const {
    server::ServerOptions o = testing::TestServerOptions();
    o.tls_cert_file = server_cert_.cert_file;
    o.tls_key_file = server_cert_.key_file;
    o.credentials_reload_seconds = 1;
    return o;
  }
  server::ServerOptions TokenOptions() const {
    server::ServerOptions o = TlsOptions();
    o.auth_tokens_file = tokens_file_;
    return o;
  }
  Creds As(const char* token) const {
    Creds c;
    c.roots = ca_->cert_pem();
    c.token = token;
    return c;
  }
  int Start(const server::ServerOptions& o) {
    server_ = testing::StartTestServer(o);
    return server_ == nullptr ? 0 : server_->port();
  }

  std::string dir_;
  std::unique_ptr<TestCa> ca_;
  CertFiles server_cert_;
  std::string tokens_file_;
  std::unique_ptr<server::Server> server_;
};

// ------------------------------------------------------------ handshakes --

TEST_F(SecurityTest, TokensRightOnesAcceptedWrongOrMissingRefused) {
  const int port = Start(TokenOptions());
  ASSERT_GT(port, 0);
  v1::AttendResponse attend;
  const grpc::Status ok = SmallAttend(port, As(kAliceToken), &attend);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  ASSERT_EQ(attend.out().data().size(), 16u);
  float out[4];
  std::memcpy(out, attend.out().data().data(), 16);
  EXPECT_FLOAT_EQ(out[0], 2.0f);
  EXPECT_FLOAT_EQ(out[1], 3.0f);
  EXPECT_TRUE(Info(port, As(kAdminToken)).ok());

  const grpc::Status wrong = Info(port, As("tok-alice-6f1d2d"));  // one byte off
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED) << wrong.error_message();
  EXPECT_THAT(wrong.error_message(), Not(HasSubstr("tok-")));
  const grpc::Status prefix = Info(port, As("tok-alice"));
  EXPECT_EQ(prefix.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  const grpc::Status missing = Info(port, As(""));
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(missing.error_message(), HasSubstr("Bearer"));
  // Compute calls and streams are refused the same way.
  EXPECT_EQ(SmallAttend(port, As(""), &attend).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  {
    Stream s(port, As("nope"));
    v1::DecodeResponse r;
    EXPECT_FALSE(s.Open(16, false, &r));
    EXPECT_EQ(s.Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    // Refused as it starts, not after a first message: a stream that sends
    // nothing holds nothing.
    Stream s(port, As("nope"));
    EXPECT_EQ(s.Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  // Health needs no token (probes and load balancers carry none).
  EXPECT_TRUE(Health(port, As("")).ok());
  // Reflection is a call like any other.
  EXPECT_EQ(ListServices(Channel(port, As(""))).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(ListServices(Channel(port, As(kBobToken))).ok());
  // A plaintext client cannot talk to a TLS server at all.
  Creds plain;
  plain.tls = false;
  EXPECT_EQ(Health(port, plain).error_code(), grpc::StatusCode::UNAVAILABLE);
  // Refusals are counted; the metrics never show a token.
  const std::string metrics = server_->metrics().RenderPrometheus();
  EXPECT_THAT(metrics, Not(HasSubstr("tok-")));
  EXPECT_THAT(metrics, Not(HasSubstr("alice")));
  EXPECT_THAT(metrics, HasSubstr("ropeattn_auth_refused_total{reason=\"missing_token\"} 3"));
  EXPECT_THAT(metrics, HasSubstr("ropeattn_auth_refused_total{reason=\"invalid_token\"} 4"));
}

// A call refused by the authenticator (in gRPC's auth filter, before the
// call-log interceptor and any handler) is logged as every error answer is,
// with its request id, method and trace context (and a `call` line with
// --access_log), and counted under its method; never with its token.
TEST_F(SecurityTest, RefusedCallsAreLoggedAndCountedWithoutTheirToken) {
  server::ServerOptions o = TokenOptions();
  o.access_log = true;
  const int port = Start(o);
  ASSERT_GT(port, 0);
  server::LogCapture capture;
  const auto info = [&](const char* token, const char* request_id) {
    auto stub = v1::AttentionService::NewStub(Channel(port, As(token)));
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-request-id", request_id);
    ctx.AddMetadata("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    v1::ServerInfo response;
    return stub->GetServerInfo(WithDeadline(&ctx), {}, &response);
  };
  const grpc::Status guessed = info("tok-guessed-0042", "probe-guessed");
  EXPECT_EQ(guessed.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(guessed.error_message(), "the bearer token is not valid");
  const grpc::Status missing = info("", "probe-missing");
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(missing.error_message(), HasSubstr("Bearer"));
  {
    Stream s(port, As("tok-stream-guess"));
    EXPECT_EQ(s.Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(ListServices(Channel(port, As(""))).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  ASSERT_TRUE(info(kAliceToken, "probe-good").ok());
  const std::string log = capture.Text();
  const auto line_of = [&](const std::string& event, const std::string& request_id) {
    for (absl::string_view line : absl::StrSplit(log, '\n')) {
      if (absl::StrContains(line, absl::StrCat("\"event\":\"", event, "\"")) &&
          absl::StrContains(line, absl::StrCat("\"request_id\":\"", request_id, "\""))) {
        return std::string(line);
      }
    }
    return std::string();
  };
  for (const char* id : {"probe-guessed", "probe-missing"}) {
    const std::string error = line_of("error_answer", id);
    EXPECT_THAT(error, HasSubstr("\"level\":\"warning\"")) << log;
    EXPECT_THAT(error, HasSubstr("\"method\":\"/ropeattn.v1.AttentionService/GetServerInfo\""));
    EXPECT_THAT(error, HasSubstr("\"code\":\"UNAUTHENTICATED\""));
    EXPECT_THAT(error, HasSubstr("\"trace_id\":\"4bf92f3577b34da6a3ce929d0e0e4736\""));
    EXPECT_THAT(error, HasSubstr("\"parent_id\":\"00f067aa0ba902b7\""));
    const std::string call = line_of("call", id);
    EXPECT_THAT(call, HasSubstr("\"code\":\"UNAUTHENTICATED\"")) << log;
    EXPECT_THAT(call, HasSubstr("\"method\":\"/ropeattn.v1.AttentionService/GetServerInfo\""));
  }
  EXPECT_THAT(line_of("error_answer", "probe-guessed"),
              HasSubstr("\"message\":\"the bearer token is not valid\""));
  EXPECT_THAT(log, HasSubstr("\"method\":\"/ropeattn.v1.AttentionService/Decode\""));
  EXPECT_THAT(log,
              HasSubstr("\"method\":\"/grpc.reflection.v1alpha.ServerReflection/"
                        "ServerReflectionInfo\",\"code\":\"UNAUTHENTICATED\""));
  EXPECT_THAT(line_of("call", "probe-good"), HasSubstr("\"code\":\"OK\""));
  EXPECT_THAT(log, Not(HasSubstr("tok-")));
  EXPECT_THAT(log, Not(HasSubstr("Bearer tok")));
  // Counted under their methods (reflection is not a method of ours), and
  // once each by reason.
  const std::string metrics = server_->metrics().RenderPrometheus();
  EXPECT_EQ(MetricValue(metrics, "ropeattn_requests_total{method=\"GetServerInfo\","
                                 "code=\"UNAUTHENTICATED\"}"),
            2);
  EXPECT_EQ(MetricValue(metrics, "ropeattn_requests_total{method=\"Decode\","
                                 "code=\"UNAUTHENTICATED\"}"),
            1);
  EXPECT_EQ(MetricValue(metrics, "ropeattn_auth_refused_total{reason=\"invalid_token\"}"), 2);
  EXPECT_EQ(MetricValue(metrics, "ropeattn_auth_refused_total{reason=\"missing_token\"}"), 2);
  EXPECT_THAT(metrics, Not(HasSubstr("tok-")));
}

// A flood of refused calls writes at most 10 lines a second (a client
// without a token sent 15,000 a second, 3.6-6.4 MB/s of log); every refusal
// is still counted, and a later line says how many were not logged.
TEST_F(SecurityTest, RefusedCallLinesAreLimitedAndTheRestCounted) {
  const int port = Start(TokenOptions());
  ASSERT_GT(port, 0);
  server::LogCapture capture;
  auto stub = v1::AttentionService::NewStub(Channel(port, As("tok-flood")));
  constexpr int kCalls = 60;
  for (int i = 0; i < kCalls; ++i) {
    grpc::ClientContext ctx;
    v1::ServerInfo response;
    EXPECT_EQ(stub->GetServerInfo(WithDeadline(&ctx), {}, &response).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  absl::SleepFor(absl::Milliseconds(1100));  // a new second: the next line is written
  {
    grpc::ClientContext ctx;
    v1::ServerInfo response;
    EXPECT_EQ(stub->GetServerInfo(WithDeadline(&ctx), {}, &response).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  const std::string log = capture.Text();
  int lines = 0;
  int64_t suppressed = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (!absl::StrContains(line, "\"event\":\"error_answer\"")) continue;
    ++lines;
    const size_t at = line.find("\"suppressed\":");
    if (at != absl::string_view::npos) {
      int64_t n = 0;
      if (absl::SimpleAtoi(line.substr(at + 13, line.find_first_of(",}", at) - at - 13), &n)) {
        suppressed += n;
      }
    }
  }
  // kCalls + 1 refusals over at most a few seconds: 10 lines a second.
  EXPECT_LE(lines, 31) << log;
  EXPECT_GE(lines, 2);
  EXPECT_EQ(lines + suppressed, kCalls + 1) << log;
  const std::string metrics = server_->metrics().RenderPrometheus();
  EXPECT_EQ(MetricValue(metrics, "ropeattn_auth_refused_total{reason=\"invalid_token\"}"),
            kCalls + 1);
}

// Health needs no token, so only its own methods skip authentication: a
// made-up method under its prefix is refused as any call is (it was answered
// UNIMPLEMENTED and logged whole, once per call); and the error lines of
// health calls (a Check of an unknown service is NOT_FOUND) are limited to
// 10 a second, the next line counting the rest.
TEST_F(SecurityTest, HealthPathsCannotFloodTheLogWithoutAToken) {
  const int port = Start(TokenOptions());
  ASSERT_GT(port, 0);
  server::LogCapture capture;
  grpc::GenericStub generic(Channel(port, As("")));
  {
    grpc::ClientContext ctx;
    grpc::Slice empty("", 0);
    grpc::ByteBuffer in(&empty, 1), out;
    grpc::Status st;
    absl::Notification done;
    generic.UnaryCall(WithDeadline(&ctx), "/grpc.health.v1.Health/" + std::string(4000, 'Z'), {},
                      &in, &out, [&](grpc::Status s) {
                        st = s;
                        done.Notify();
                      });
    done.WaitForNotification();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED) << st.error_message();
  }
  auto stub = grpc::health::v1::Health::NewStub(Channel(port, As("")));
  constexpr int kCalls = 40;
  for (int i = 0; i < kCalls; ++i) {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest request;
    request.set_service("no.such.Service");
    grpc::health::v1::HealthCheckResponse response;
    EXPECT_EQ(stub->Check(WithDeadline(&ctx), request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  const std::string log = capture.Text();
  int health_lines = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StrContains(line, "\"event\":\"error_answer\"") &&
        absl::StrContains(line, "/grpc.health.v1.Health/Check")) {
      ++health_lines;
    }
  }
  EXPECT_GE(health_lines, 1);
  EXPECT_LE(health_lines, 30) << "40 failed Checks within a few seconds";
  EXPECT_THAT(log, Not(HasSubstr(std::string(300, 'Z'))));
}

TEST_F(SecurityTest, MutualTlsAcceptsOnlyCertificatesOfTheClientCa) {
  auto other_ca = TestCa::Create(dir_ + "/other", "other-ca");
  ASSERT_TRUE(other_ca.ok()) << other_ca.status();
  auto alice = ca_->Issue("alice", "URI:spiffe://test/alice", /*client=*/true);
  auto bob = ca_->Issue("bob", "DNS:bob.test", /*client=*/true);
  auto stranger = other_ca->Issue("stranger", "URI:spiffe://test/alice", /*client=*/true);
  auto expired = ca_->Issue("expired", "URI:spiffe://test/alice", /*client=*/true, /*days=*/-1);
  auto nameless = ca_->Issue("nameless", "", /*client=*/true);
  ASSERT_TRUE(alice.ok() && bob.ok() && stranger.ok() && expired.ok() && nameless.ok());
  server::ServerOptions o = TlsOptions();
  o.tls_client_ca_file = ca_->cert_file();
  o.default_idle_ttl_seconds = 1;  // alice's detached session is reaped at the end
  const int port = Start(o);
  ASSERT_GT(port, 0);
  const auto with = [&](const CertFiles* cert) {
    Creds c = As("");
    if (cert != nullptr) {
      c.cert = cert->cert_pem;
      c.key = cert->key_pem;
    }
    return c;
  };
  EXPECT_TRUE(Info(port, with(&*alice)).ok());
  EXPECT_TRUE(Info(port, with(&*bob)).ok());
  // The handshake itself fails: no call reaches the server.
  for (const auto& [what, cert] :
       std::vector<std::pair<std::string, const CertFiles*>>{
           {"another CA", &*stranger}, {"expired", &*expired}, {"none", nullptr}}) {
    const grpc::Status st = Info(port, with(cert));
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << what << ": " << st.error_message();
    EXPECT_EQ(Health(port, with(cert)).error_code(), grpc::StatusCode::UNAVAILABLE) << what;
  }
  // A certificate of the right CA that names nobody.
  const grpc::Status no_name = Info(port, with(&*nameless));
  EXPECT_EQ(no_name.error_code(), grpc::StatusCode::UNAUTHENTICATED) << no_name.error_message();

  // The certificate's identity is the principal: alice's session is not
  // bob's to see.
  Stream mine(port, with(&*alice));
  v1::DecodeResponse opened;
  ASSERT_TRUE(mine.Open(16, true, &opened));
  ASSERT_TRUE(opened.has_opened()) << opened.DebugString();
  const std::string id = opened.opened().session_id();
  auto as_alice = v1::AttentionService::NewStub(Channel(port, with(&*alice)));
  auto as_bob = v1::AttentionService::NewStub(Channel(port, with(&*bob)));
  v1::ListSessionsResponse list;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(as_alice->ListSessions(WithDeadline(&ctx), {}, &list).ok());
    ASSERT_EQ(list.sessions_size(), 1);
    EXPECT_EQ(list.sessions(0).session_id(), id);
  }
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(as_bob->ListSessions(WithDeadline(&ctx), {}, &list).ok());
    EXPECT_EQ(list.sessions_size(), 0);
  }
  {
    grpc::ClientContext ctx;
    v1::GetSessionRequest req;
    req.set_session_id(id);
    v1::SessionInfo info;
    EXPECT_EQ(as_bob->GetSession(WithDeadline(&ctx), req, &info).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  // GetServerInfo's session figures are the caller's own: bob does not see
  // that alice holds a session, nor its size (a side channel: he did).
  for (const auto& [who, stub, sessions] :
       std::vector<std::tuple<std::string, v1::AttentionService::Stub*, int>>{
           {"alice", as_alice.get(), 1}, {"bob", as_bob.get(), 0}}) {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    ASSERT_TRUE(stub->GetServerInfo(WithDeadline(&ctx), {}, &info).ok()) << who;
    EXPECT_EQ(info.open_sessions(), sessions) << who;
    EXPECT_EQ(info.attached_sessions(), sessions) << who;
    EXPECT_EQ(info.kv_bytes_in_use() > 0, sessions > 0) << who << ": " << info.kv_bytes_in_use();
  }
  EXPECT_TRUE(mine.Finish().ok());
  // Detached, it is reaped after its 1 s TTL: counted for alice, not bob.
  const auto reaped = [&](v1::AttentionService::Stub* stub) {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    EXPECT_TRUE(stub->GetServerInfo(WithDeadline(&ctx), {}, &info).ok());
    return info.reaped_sessions();
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (reaped(as_alice.get()) == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(reaped(as_alice.get()), 1u);
  EXPECT_EQ(reaped(as_bob.get()), 0u);
}

// A certificate's identity is its principal whole: two SPIFFE ids sharing
// their first 128 characters were one principal when it was cut there (and
// reached each other's sessions); one past 2048 characters is refused.
TEST_F(SecurityTest, LongCertificateIdentitiesAreWholePrincipals) {
  const std::string stem = "URI:spiffe://example.org/ns/" + std::string(100, 'n') + "/sa/";
  auto front = ca_->Issue("front", stem + "frontend", /*client=*/true);
  auto batch = ca_->Issue("batch", stem + "batch-jobs", /*client=*/true);
  auto huge = ca_->Issue("huge", "URI:spiffe://example.org/" + std::string(2100, 'x'),
                         /*client=*/true);
  ASSERT_TRUE(front.ok() && batch.ok() && huge.ok());
  server::ServerOptions o = TlsOptions();
  o.tls_client_ca_file = ca_->cert_file();
  const int port = Start(o);
  ASSERT_GT(port, 0);
  const auto with = [&](const CertFiles& cert) {
    Creds c = As("");
    c.cert = cert.cert_pem;
    c.key = cert.key_pem;
    return c;
  };
  Stream mine(port, with(*front));
  v1::DecodeResponse opened;
  ASSERT_TRUE(mine.Open(16, true, &opened));
  ASSERT_TRUE(opened.has_opened()) << opened.DebugString();
  auto as_batch = v1::AttentionService::NewStub(Channel(port, with(*batch)));
  {
    grpc::ClientContext ctx;
    v1::ListSessionsResponse list;
    ASSERT_TRUE(as_batch->ListSessions(WithDeadline(&ctx), {}, &list).ok());
    EXPECT_EQ(list.sessions_size(), 0);
  }
  {
    grpc::ClientContext ctx;
    v1::GetSessionRequest req;
    req.set_session_id(opened.opened().session_id());
    v1::SessionInfo info;
    EXPECT_EQ(as_batch->GetSession(WithDeadline(&ctx), req, &info).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  // A DNS name is a host name: one with ':' or '/' could pass for a URI
  // name (a DNS SAN "spiffe://..." was the URI SAN's principal).
  auto dns_uri = ca_->Issue("dnsuri", "DNS:spiffe://example.org/alice", /*client=*/true);
  ASSERT_TRUE(dns_uri.ok()) << dns_uri.status();
  const grpc::Status not_host = Info(port, with(*dns_uri));
  EXPECT_EQ(not_host.error_code(), grpc::StatusCode::UNAUTHENTICATED) << not_host.error_message();
  EXPECT_THAT(not_host.error_message(), HasSubstr("not a host name"));
  const grpc::Status too_long = Info(port, with(*huge));
  EXPECT_EQ(too_long.error_code(), grpc::StatusCode::UNAUTHENTICATED) << too_long.error_message();
  EXPECT_THAT(too_long.error_message(), HasSubstr("more than 2048"));
  // A URI name has a scheme: URI:alice (none) was the principal of
  // DNS:alice, and reached its sessions.
  auto dns_alice = ca_->Issue("dnsalice", "DNS:alice", /*client=*/true);
  auto uri_alice = ca_->Issue("urialice", "URI:alice", /*client=*/true);
  ASSERT_TRUE(dns_alice.ok() && uri_alice.ok());
  EXPECT_TRUE(Info(port, with(*dns_alice)).ok());
  const grpc::Status no_scheme = Info(port, with(*uri_alice));
  EXPECT_EQ(no_scheme.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << no_scheme.error_message();
  EXPECT_THAT(no_scheme.error_message(), HasSubstr("has no scheme"));
  // Each refusal counted under its reason.
  const std::string metrics = server_->metrics().RenderPrometheus();
  EXPECT_THAT(metrics, HasSubstr("ropeattn_auth_refused_total{reason=\"identity_too_long\"} 1\n"));
  EXPECT_THAT(metrics, HasSubstr("ropeattn_auth_refused_total{reason=\"no_identity\"} 2\n"));
  EXPECT_TRUE(mine.Finish().ok());
}

// ------------------------------------------------------- ownership matrix --

// Every session operation by bob on alice's sessions, attached and
// detached: 0 successes, each NOT_FOUND with the words of an unknown id.
TEST_F(SecurityTest, AnotherPrincipalGetsNotFoundForEveryOperation) {
  const int port = Start(TokenOptions());
  ASSERT_GT(port, 0);
  // Alice: one session attached to a live stream, one detached (resumable,
  // its stream ended).
  Stream attached(port, As(kAliceToken));
  v1::DecodeResponse r;
  ASSERT_TRUE(attached.Open(16, true, &r));
  ASSERT_TRUE(r.has_opened()) << r.DebugString();
  const std::string attached_id = r.opened().session_id();
  ASSERT_TRUE(attached.Step(1, 0.5f, &r));
  ASSERT_TRUE(r.has_step()) << r.DebugString();
  std::string detached_id;
  {
    Stream s(port, As(kAliceToken));
    ASSERT_TRUE(s.Open(16, true, &r));
    detached_id = r.opened().session_id();
    ASSERT_TRUE(s.Step(1, 0.25f, &r));
    ASSERT_TRUE(s.Finish().ok());
  }
  // What an id that never existed gets, per operation.
  auto as_bob = v1::AttentionService::NewStub(Channel(port, As(kBobToken)));
  const auto get = [&](const std::string& id) {
    grpc::ClientContext ctx;
    v1::GetSessionRequest req;
    req.set_session_id(id);
    v1::SessionInfo info;
    return as_bob->GetSession(WithDeadline(&ctx), req, &info);
  };
  const auto close = [&](const std::string& id) {
    grpc::ClientContext ctx;
    v1::CloseSessionRequest req;
    req.set_session_id(id);
    v1::CloseSessionResponse resp;
    return as_bob->CloseSession(WithDeadline(&ctx), req, &resp);
  };
  const auto attach = [&](const std::string& id) {
    Stream s(port, As(kBobToken));
    v1::DecodeResponse resp;
    if (s.Attach(id, &resp)) {
      ADD_FAILURE() << "bob attached to " << id << ": " << resp.DebugString();
      // Any operation would then read alice's keys and values.
      s.Step(1, 0.0f, &resp);
    }
    return s.Finish();
  };
  int operations = 0, successes = 0;
  for (const auto& [name, op] :
       std::vector<std::pair<std::string, std::function<grpc::Status(const std::string&)>>>{
           {"GetSession", get}, {"CloseSession", close}, {"Decode.Attach", attach}}) {
    const grpc::Status unknown = op(kNeverExisted);
    ASSERT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND) << name;
    for (const std::string& id : {attached_id, detached_id}) {
      const grpc::Status st = op(id);
      ++operations;
      successes += st.ok() ? 1 : 0;
      EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << name << " " << id;
      EXPECT_EQ(WithoutId(st.error_message(), id),
                WithoutId(unknown.error_message(), kNeverExisted))
          << name << ": the answer must not tell that the id exists";
    }
  }
  EXPECT_EQ(operations, 6);
  EXPECT_EQ(successes, 0);
  // The metrics name no session and no principal.
  const std::string metrics = server_->metrics().RenderPrometheus();
  for (const std::string& secret : {attached_id, detached_id, std::string("alice"),
                                    std::string("bob"), std::string(kAliceToken)}) {
    EXPECT_THAT(metrics, Not(HasSubstr(secret)));
  }
  // Bob's list has nothing of alice's.
  {
    grpc::ClientContext ctx;
    v1::ListSessionsResponse list;
    ASSERT_TRUE(as_bob->ListSessions(WithDeadline(&ctx), {}, &list).ok());
    EXPECT_EQ(list.sessions_size(), 0);
  }
  // Alice's sessions are untouched: her stream steps on, the detached one
  // re-attaches at its position.
  ASSERT_TRUE(attached.Step(2, 0.5f, &r));
  ASSERT_TRUE(r.has_step()) << r.DebugString();
  EXPECT_EQ(r.step().position(), 2);
  {
    Stream s(port, As(kAliceToken));
    ASSERT_TRUE(s.Attach(detached_id, &r));
    ASSERT_TRUE(r.has_opened()) << r.DebugString();
    EXPECT_EQ(r.opened().position(), 1);
    EXPECT_TRUE(s.Finish().ok());
  }
  // A session alice closed: alice hears "closed", bob still hears "unknown".
  auto as_alice = v1::AttentionService::NewStub(Channel(port, As(kAliceToken)));
  {
    grpc::ClientContext ctx;
    v1::CloseSessionRequest req;
    req.set_session_id(detached_id);
    v1::CloseSessionResponse resp;
    ASSERT_TRUE(as_alice->CloseSession(WithDeadline(&ctx), req, &resp).ok());
  }
  {
    grpc::ClientContext ctx;
    v1::GetSessionRequest req;
    req.set_session_id(detached_id);
    v1::SessionInfo info;
    const grpc::Status st = as_alice->GetSession(WithDeadline(&ctx), req, &info);
    EXPECT_THAT(st.error_message(), HasSubstr("closed"));
  }
  const grpc::Status bob_closed = get(detached_id);
  EXPECT_EQ(bob_closed.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(bob_closed.error_message(), Not(HasSubstr("closed")));
  EXPECT_TRUE(attached.Finish().ok());
}

// Behind a proxy, calls of many principals share one connection. Each call
// is its own principal (gRPC's AuthContext belongs to the connection, so
// nothing about a caller may be stored there), also under concurrency.
TEST_F(SecurityTest, PrincipalsSharingOneConnectionStaySeparate) {
  const int port = Start(TokenOptions());
  ASSERT_GT(port, 0);
  // One channel with TLS only; each call brings its own token.
  auto stub = v1::AttentionService::NewStub(Channel(port, As("")));
  const auto as = [](grpc::ClientContext* ctx, const char* token) {
    ctx->set_credentials(grpc::AccessTokenCredentials(token));
    return WithDeadline(ctx);
  };
  grpc::ClientContext open_ctx;
  auto rw = stub->Decode(as(&open_ctx, kAliceToken));
  v1::DecodeRequest open;
  open.mutable_open()->mutable_spec()->set_heads(2);
  open.mutable_open()->mutable_spec()->set_head_dim(8);
  open.mutable_open()->set_max_context(16);
  v1::DecodeResponse opened;
  ASSERT_TRUE(rw->Write(open) && rw->Read(&opened));
  ASSERT_TRUE(opened.has_opened()) << opened.DebugString();
  const std::string id = opened.opened().session_id();
  const auto listed = [&](const char* token) {
    grpc::ClientContext ctx;
    v1::ListSessionsResponse list;
    const grpc::Status st = stub->ListSessions(as(&ctx, token), {}, &list);
    return st.ok() ? list.sessions_size() : -1;
  };
  EXPECT_EQ(listed(kAliceToken), 1);
  EXPECT_EQ(listed(kBobToken), 0);
  {
    grpc::ClientContext ctx;
    v1::GetSessionRequest req;
    req.set_session_id(id);
    v1::SessionInfo info;
    EXPECT_EQ(stub->GetSession(as(&ctx, kBobToken), req, &info).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  // Many calls of both at once over the same connection.
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 40; ++i) {
        const bool alice = (i + t) % 2 == 0;
        if (listed(alice ? kAliceToken : kBobToken) != (alice ? 1 : 0)) ++wrong;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  rw->WritesDone();
  v1::DecodeResponse drain;
  while (rw->Read(&drain)) {
  }
  EXPECT_TRUE(rw->Finish().ok());
}

TEST_F(SecurityTest, AdminListsAndClosesAllButCannotAttach) {
  const int port = Start(TokenOptions());
  ASSERT_GT(port, 0);
  std::vector<std::string> ids;
  for (const char* token : {kAliceToken, kBobToken}) {
    Stream s(port, As(token));
    v1::DecodeResponse r;
    ASSERT_TRUE(s.Open(16, true, &r));
    ids.push_back(r.opened().session_id());
    ASSERT_TRUE(s.Finish().ok());
  }
  auto as_admin = v1::AttentionService::NewStub(Channel(port, As(kAdminToken)));
  {
    grpc::ClientContext ctx;
    v1::ListSessionsResponse list;
    ASSERT_TRUE(as_admin->ListSessions(WithDeadline(&ctx), {}, &list).ok());
    EXPECT_EQ(list.sessions_size(), 2);
  }
  {
    grpc::ClientContext ctx;
    v1::GetSessionRequest req;
    req.set_session_id(ids[0]);
    v1::SessionInfo info;
    EXPECT_TRUE(as_admin->GetSession(WithDeadline(&ctx), req, &info).ok());
  }
  {
    Stream s(port, As(kAdminToken));
    v1::DecodeResponse r;
    EXPECT_FALSE(s.Attach(ids[0], &r)) << r.DebugString();
    EXPECT_EQ(s.Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  }
  for (const std::string& id : ids) {
    grpc::ClientContext ctx;
    v1::CloseSessionRequest req;
    req.set_session_id(id);
    v1::CloseSessionResponse resp;
    EXPECT_TRUE(as_admin->CloseSession(WithDeadline(&ctx), req, &resp).ok());
  }
  EXPECT_EQ(server_->sessions().open_sessions(), 0);
  // How a session ended is its owner's to hear: the admin who closed
  // alice's gets the words of an unknown id, alice "was closed".
  for (const auto& [token, code, words] :
       std::vector<std::tuple<const char*, grpc::StatusCode, std::string>>{
           {kAdminToken, grpc::StatusCode::NOT_FOUND, "unknown session id"},
           {kAliceToken, grpc::StatusCode::FAILED_PRECONDITION, "was closed"}}) {
    auto stub = v1::AttentionService::NewStub(Channel(port, As(token)));
    grpc::ClientContext ctx;
    v1::GetSessionRequest req;
    req.set_session_id(ids[0]);
    v1::SessionInfo info;
    const grpc::Status st = stub->GetSession(WithDeadline(&ctx), req, &info);
    EXPECT_EQ(st.error_code(), code) << token;
    EXPECT_THAT(st.error_message(), HasSubstr(words)) << token;
  }
}

// --------------------------------------------------------------- quotas --

TEST_F(SecurityTest, QuotasBindOnePrincipalAndNotAnother) {
  server::ServerOptions o = TokenOptions();
  o.principal_max_sessions = 2;
  // A 16-token session of 2 heads x 8 dims is a few KiB; a 100000-token one
  // is several MiB: past a 1 MiB quota, well inside the server's budget.
  o.principal_memory_bytes = 1 << 20;
  const int port = Start(o);
  ASSERT_GT(port, 0);
  v1::DecodeResponse r;
  {
    Stream big(port, As(kAliceToken));
    EXPECT_FALSE(big.Open(100000, true, &r)) << r.DebugString();
    const grpc::Status st = big.Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr("principal_memory_bytes"));
  }
  std::vector<std::unique_ptr<Stream>> alice;
  for (int i = 0; i < 2; ++i) {
    alice.push_back(std::make_unique<Stream>(port, As(kAliceToken)));
    ASSERT_TRUE(alice.back()->Open(16, false, &r));
    ASSERT_TRUE(r.has_opened()) << r.DebugString();
  }
  {
    Stream third(port, As(kAliceToken));
    EXPECT_FALSE(third.Open(16, false, &r));
    const grpc::Status st = third.Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(st.error_message(), HasSubstr("principal_max_sessions"));
    EXPECT_THAT(st.error_message(), HasSubstr("alice"));
  }
  // Bob is unaffected by alice's quota.
  std::vector<std::unique_ptr<Stream>> bob;
  for (int i = 0; i < 2; ++i) {
    bob.push_back(std::make_unique<Stream>(port, As(kBobToken)));
    ASSERT_TRUE(bob.back()->Open(16, false, &r));
    ASSERT_TRUE(r.has_opened()) << r.DebugString();
  }
  // One of alice's ends: she has room again.
  EXPECT_TRUE(alice.back()->Finish().ok());
  alice.pop_back();
  {
    Stream again(port, As(kAliceToken));
    ASSERT_TRUE(again.Open(16, false, &r));
    EXPECT_TRUE(r.has_opened()) << r.DebugString();
    EXPECT_TRUE(again.Finish().ok());
  }
  const std::string metrics = server_->metrics().RenderPrometheus();
  EXPECT_THAT(metrics, HasSubstr("ropeattn_quota_refused_total{quota=\"sessions\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("ropeattn_quota_refused_total{quota=\"memory\"} 1"));
  for (auto& s : alice) EXPECT_TRUE(s->Finish().ok());
  for (auto& s : bob) EXPECT_TRUE(s->Finish().ok());
}

// A fork counts its whole state against its owner's quota, though the
// budget is charged only for what it does not share: a fork may come to hold
// all its pages alone (truncating into the shared part and writing), and a
// quota must bound that.
TEST_F(SecurityTest, AForkCountsItsWholeStateAgainstTheQuota) {
  // 16-token pages (not the 32-token tiles of AVX-512 machines), each
  // charged what its two parts of 16 x 2 x 8 f32 hold (KvPageHeldBytes).
  const bool previous = internal::SetAvx512KernelsForTesting(false);
  absl::Cleanup restore = [previous] { internal::SetAvx512KernelsForTesting(previous); };
  server::ServerOptions o = TokenOptions();
  const int64_t session = (5000 + 15) / 16 * KvPageHeldBytes(16 * 2 * 8 * 4, 16 * 2 * 8 * 4);
  o.principal_memory_bytes = session * 5 / 3;
  const int port = Start(o);
  ASSERT_GT(port, 0);
  v1::DecodeResponse r;
  // 5000 tokens x 2 heads x (8 + 8) dims: 0.6 of the quota, opened holding
  // 4992 tokens (312 full pages a fork would share, so the budget would
  // charge a fork only 8 tokens' page).
  Stream s(port, As(kAliceToken));
  {
    v1::DecodeRequest open;
    open.mutable_open()->mutable_spec()->set_heads(2);
    open.mutable_open()->mutable_spec()->set_head_dim(8);
    open.mutable_open()->set_max_context(5000);
    v1::KvPrefix* prefix = open.mutable_open()->mutable_prefix();
    *prefix->mutable_k() = Ones(4992, 2, 8, 0.25f);
    *prefix->mutable_v() = Ones(4992, 2, 8, 0.5f);
    prefix->set_key_form(v1::KEY_FORM_RAW);
    ASSERT_TRUE(s.Call(open, &r));
    ASSERT_TRUE(r.has_opened()) << r.DebugString();
    EXPECT_EQ(r.opened().position(), 4992);
  }
  ASSERT_TRUE(s.Step(1, 0.25f, &r));
  ASSERT_TRUE(r.has_step()) << r.DebugString();
  v1::DecodeRequest fork;
  fork.mutable_fork()->set_seq(2);
  ASSERT_TRUE(s.Call(fork, &r));
  ASSERT_TRUE(r.has_error()) << r.DebugString();
  EXPECT_EQ(r.error().code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED));
  EXPECT_THAT(r.error().message(), HasSubstr("principal_memory_bytes"));
  // Bob, who holds nothing, forks his own session of the same size.
  Stream b(port, As(kBobToken));
  ASSERT_TRUE(b.Open(1000, false, &r));
  ASSERT_TRUE(b.Step(1, 0.5f, &r));
  fork.mutable_fork()->set_seq(2);
  ASSERT_TRUE(b.Call(fork, &r));
  EXPECT_TRUE(r.has_forked()) << r.DebugString();
  EXPECT_TRUE(s.Finish().ok());
  EXPECT_TRUE(b.Finish().ok());
}

// ------------------------------------------------------------- rotation --

// The certificate files are replaced (a new CA, a new key) while a stream
// is open: the stream continues; new handshakes see the new certificate.
// Tokens added and revoked in the file take effect without a restart.
TEST_F(SecurityTest, RotationKeepsOpenStreamsAndNewHandshakesSeeTheNewCertificate) {
  const int port = Start(TokenOptions());
  ASSERT_GT(port, 0);
  // Bob's token stays in the new tokens file (a revoked token ends its
  // streams: ARevokedTokenEndsItsOpenStreams).
  Stream open(port, As(kBobToken));
  v1::DecodeResponse r;
  ASSERT_TRUE(open.Open(64, false, &r));
  ASSERT_TRUE(open.Step(1, 0.5f, &r));
  ASSERT_TRUE(r.has_step());

  auto new_ca = TestCa::Create(dir_ + "/ca2", "test-ca-2");
  ASSERT_TRUE(new_ca.ok()) << new_ca.status();
  auto new_cert = new_ca->IssueServer("server2");
  ASSERT_TRUE(new_cert.ok()) << new_cert.status();
  // Key first, then certificate, each replaced atomically (a key/cert pair
  // that does not match in between is skipped by gRPC's watcher).
  ASSERT_TRUE(testing::WriteFileAtomically(server_cert_.key_file, new_cert->key_pem).ok());
  ASSERT_TRUE(testing::WriteFileAtomically(server_cert_.cert_file, new_cert->cert_pem).ok());
  ASSERT_TRUE(testing::WriteFileAtomically(
                  tokens_file_, absl::StrCat(kBobToken, " bob\ntok-carol-new carol\n"))
                  .ok());
  Creds new_roots = As(kBobToken);
  new_roots.roots = new_ca->cert_pem();
  bool rotated = false;
  for (const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
       !rotated && std::chrono::steady_clock::now() < end;) {
    rotated = Info(port, new_roots).ok();
    if (!rotated) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  ASSERT_TRUE(rotated) << "no handshake with the new certificate within 10 s";
  // Old roots no longer verify the server.
  EXPECT_EQ(Info(port, As(kBobToken)).error_code(), grpc::StatusCode::UNAVAILABLE);
  // The stream opened before the rotation still steps.
  for (uint64_t seq = 2; seq <= 4; ++seq) {
    ASSERT_TRUE(open.Step(seq, 0.5f, &r));
    ASSERT_TRUE(r.has_step()) << r.DebugString();
    EXPECT_EQ(r.step().position(), static_cast<int64_t>(seq));
  }
  EXPECT_TRUE(open.Finish().ok());
  // The token file changed too: carol is in, alice is out.
  bool carol = false;
  Creds as_carol = new_roots;
  as_carol.token = "tok-carol-new";
  for (const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
       !carol && std::chrono::steady_clock::now() < end;) {
    carol = Info(port, as_carol).ok();
    if (!carol) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_TRUE(carol);
  Creds as_alice = new_roots;
  as_alice.token = kAliceToken;
  EXPECT_EQ(Info(port, as_alice).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // A broken file keeps the last good table (a typo locks nobody out).
  ASSERT_TRUE(testing::WriteFileAtomically(tokens_file_, "only-one-field\n").ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  EXPECT_TRUE(Info(port, as_carol).ok());
}

// Overwrites `path` in place (truncate, then write), as `cp` or an editor
// does: a reader can catch it empty.
void WriteInPlace(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

// The staged copies gRPC reads only ever hold a set that validated: an
// empty, garbage or mismatched file keeps the set in use (it once crashed
// the server on an empty key, and locked out every new client on the
// others); a good set is staged with modification times no earlier set had.
TEST_F(SecurityTest, TlsFilesStageOnlyValidatedSets) {
  auto other = ca_->IssueServer("other");
  ASSERT_TRUE(other.ok()) << other.status();
  server::ServerOptions o = TlsOptions();
  o.tls_cert_file = dir_ + "/stage-cert.pem";
  o.tls_key_file = dir_ + "/stage-key.pem";
  o.tls_client_ca_file = dir_ + "/stage-ca.pem";
  WriteInPlace(o.tls_cert_file, server_cert_.cert_pem);
  WriteInPlace(o.tls_key_file, server_cert_.key_pem);
  WriteInPlace(o.tls_client_ca_file, ca_->cert_pem());
  auto files = server::TlsFiles::Create(o);
  ASSERT_TRUE(files.ok()) << files.status();
  const auto staged = [&] {
    return std::make_tuple(*testing::ReadFileText((*files)->cert_path()),
                           *testing::ReadFileText((*files)->key_path()),
                           *testing::ReadFileText((*files)->ca_path()));
  };
  const auto first = std::make_tuple(server_cert_.cert_pem, server_cert_.key_pem, ca_->cert_pem());
  ASSERT_EQ(staged(), first);
  // The key copy is kept in memory when /dev/shm is there, and a directory
  // left by a server that died is removed by the next one; a live one's is
  // kept.
  const std::string base = std::filesystem::path((*files)->directory()).parent_path().string();
  struct stat shm {};
  if (::stat("/dev/shm", &shm) == 0 && ::access("/dev/shm", W_OK) == 0) EXPECT_EQ(base, "/dev/shm");
  const std::string dead = base + "/ropeattn-tls-2147483646-test";  // no such pid
  const std::string alive = absl::StrCat(base, "/ropeattn-tls-", ::getpid(), "-test");
  ASSERT_TRUE(std::filesystem::create_directories(dead + "/gen-1"));
  ASSERT_TRUE(std::filesystem::create_directories(alive));
  {
    auto another = server::TlsFiles::Create(o);
    ASSERT_TRUE(another.ok()) << another.status();
  }
  EXPECT_FALSE(std::filesystem::exists(dead));
  EXPECT_TRUE(std::filesystem::exists(alive));
  std::filesystem::remove_all(alive);
  struct stat before {};
  ASSERT_EQ(::stat((*files)->key_path().c_str(), &before), 0);

  // Two reads: a change is taken once it has settled for an interval.
  const auto refresh = [&] {
    (*files)->Refresh().IgnoreError();
    return (*files)->Refresh();
  };
  const std::vector<std::tuple<std::string, std::string, std::string>> bad = {
      {"empty key", o.tls_key_file, ""},
      {"empty certificate", o.tls_cert_file, ""},
      {"garbage certificate", o.tls_cert_file, "not a pem"},
      {"another certificate's key", o.tls_key_file, other->key_pem},
      {"garbage CA", o.tls_client_ca_file, "garbage"},
      {"empty CA", o.tls_client_ca_file, ""},
  };
  for (const auto& [what, path, text] : bad) {
    const std::string good = *testing::ReadFileText(path);
    WriteInPlace(path, text);
    EXPECT_TRUE((*files)->Refresh().ok()) << what;  // not settled yet: nothing done
    EXPECT_EQ(staged(), first) << what;
    const absl::Status st = refresh();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(st.message(), HasSubstr(path)) << what;
    EXPECT_EQ(staged(), first) << what;
    ::unlink(path.c_str());  // a deleted file too
    EXPECT_FALSE(refresh().ok()) << what;
    EXPECT_EQ(staged(), first) << what;
    WriteInPlace(path, good);
    EXPECT_TRUE(refresh().ok()) << what;
  }
  // A good new pair is taken, with a later modification time, once it has
  // settled: seen, then the old files back (a change starts over), then
  // seen again is one read, not two.
  WriteInPlace(o.tls_cert_file, other->cert_pem);
  WriteInPlace(o.tls_key_file, other->key_pem);
  ASSERT_TRUE((*files)->Refresh().ok());
  WriteInPlace(o.tls_cert_file, server_cert_.cert_pem);
  WriteInPlace(o.tls_key_file, server_cert_.key_pem);
  ASSERT_TRUE((*files)->Refresh().ok());
  WriteInPlace(o.tls_cert_file, other->cert_pem);
  WriteInPlace(o.tls_key_file, other->key_pem);
  ASSERT_TRUE((*files)->Refresh().ok());
  EXPECT_EQ(staged(), first);  // not before it settled
  ASSERT_TRUE((*files)->Refresh().ok());
  EXPECT_EQ(staged(), std::make_tuple(other->cert_pem, other->key_pem, ca_->cert_pem()));
  struct stat after {};
  ASSERT_EQ(::stat((*files)->key_path().c_str(), &after), 0);
  EXPECT_GT(after.st_mtime, before.st_mtime);
}

// The directories of key copies ("ropeattn-tls-PID-*") process `pid` has in
// any place they may go (/dev/shm, $TMPDIR, /tmp).
std::vector<std::string> KeyCopyDirs(pid_t pid) {
  const char* tmp = std::getenv("TMPDIR");
  const std::string prefix = absl::StrCat("ropeattn-tls-", pid, "-");
  std::vector<std::string> out;
  for (const std::string& base : {std::string("/dev/shm"),
                                  std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp"),
                                  std::string("/tmp")}) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(base, ec)) {
      if (entry.path().filename().string().rfind(prefix, 0) == 0) {
        out.push_back(std::filesystem::weakly_canonical(entry.path()).string());
      }
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// A server that stops (its drain) or fails to start removes its private
// directory of key copies then, not in a destructor: the binary ends with
// std::_Exit, which runs none, and the key copy stayed until a later start.
TEST_F(SecurityTest, TheKeyCopiesAreRemovedWhenTheServerStopsOrFailsToStart) {
  const std::vector<std::string> before = KeyCopyDirs(::getpid());
  server::ServerOptions o = TlsOptions();
  ASSERT_GT(Start(o), 0);
  std::vector<std::string> made;
  for (const std::string& d : KeyCopyDirs(::getpid())) {
    if (std::find(before.begin(), before.end(), d) == before.end()) made.push_back(d);
  }
  ASSERT_EQ(made.size(), 1u);
  EXPECT_TRUE(std::filesystem::exists(made[0] + "/current/key.pem"));
  server_->Shutdown(absl::ZeroDuration());  // the server object (and ~TlsFiles) stays
  EXPECT_FALSE(std::filesystem::exists(made[0]));
  // Start-up failing after the copies were made: the metrics port is taken.
  const int taken = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(taken, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(taken, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(taken, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(taken, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  o.metrics_address = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  auto failed = server::Server::Start(o);
  ::close(taken);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(KeyCopyDirs(::getpid()), before);
}

// The binary: SIGTERM, a drain, exit 0, and no key copy left behind.
TEST_F(SecurityTest, TheBinaryRemovesItsKeyCopiesWhenItStops) {
  int out[2];
  ASSERT_EQ(::pipe(out), 0);
  std::vector<std::string> args = {"ropeattn-server", "--address=127.0.0.1:0",
                                   "--metrics_address=", "--shutdown_grace_seconds=2",
                                   "--tls_cert_file=" + server_cert_.cert_file,
                                   "--tls_key_file=" + server_cert_.key_file};
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::dup2(out[1], STDOUT_FILENO);
    ::close(out[0]);
    ::close(out[1]);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(ROPEATTN_SERVER_PATH, argv.data());
    ::_exit(127);
  }
  ::close(out[1]);
  FILE* log = ::fdopen(out[0], "r");
  ASSERT_NE(log, nullptr);
  const testing::ServerStartup startup = testing::ReadServerStartup(log);
  const std::vector<std::string> dirs = KeyCopyDirs(pid);
  ::kill(pid, SIGTERM);
  std::string rest;
  for (std::string line = testing::ReadWholeLine(log); !line.empty();
       line = testing::ReadWholeLine(log)) {
    rest += line;
  }
  std::fclose(log);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  const std::vector<std::string> left = KeyCopyDirs(pid);
  for (const std::string& d : left) std::filesystem::remove_all(d);
  ASSERT_GT(startup.port, 0) << startup.text;
  ASSERT_EQ(dirs.size(), 1u);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_THAT(rest, HasSubstr("\"event\":\"stopped\""));
  EXPECT_TRUE(left.empty()) << left.front();
}

// A tokens file that changes is read only once it has stayed the same for
// a reload interval: a write caught half-way ("tok-bob-2 bo" of
// "tok-bob-2 bob") never gives a token to the wrong principal.
// A token taken out of the tokens file ends the streams it opened at their
// next message (they kept stepping, and forking sessions charged to it),
// as its new calls are refused.
TEST_F(SecurityTest, ARevokedTokenEndsItsOpenStreams) {
  const int port = Start(TokenOptions());
  ASSERT_GT(port, 0);
  Stream alice(port, As(kAliceToken));
  v1::DecodeResponse r;
  ASSERT_TRUE(alice.Open(64, false, &r));
  ASSERT_TRUE(r.has_opened()) << r.DebugString();
  Stream bob(port, As(kBobToken));
  ASSERT_TRUE(bob.Open(64, false, &r));
  ASSERT_TRUE(r.has_opened()) << r.DebugString();
  WriteInPlace(tokens_file_, absl::StrCat(kBobToken, " bob\n", kAdminToken, " ops admin\n"));
  bool refused = false;
  for (int i = 0; i < 100 && !refused; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    refused = Info(port, As(kAliceToken)).error_code() == grpc::StatusCode::UNAUTHENTICATED;
  }
  ASSERT_TRUE(refused) << "the tokens file was not reloaded";
  const auto count = [&](const std::string& series) {
    return MetricValue(server_->metrics().RenderPrometheus(), series);
  };
  constexpr char kInvalid[] = "ropeattn_auth_refused_total{reason=\"invalid_token\"}";
  constexpr char kTruncateRefused[] =
      "ropeattn_requests_total{method=\"Decode.Truncate\",code=\"UNAUTHENTICATED\"}";
  const double invalid_before = count(kInvalid);
  ASSERT_GE(invalid_before, 1);  // the Info calls above
  v1::DecodeRequest truncate;
  truncate.mutable_truncate()->set_seq(1);
  truncate.mutable_truncate()->set_position(0);
  EXPECT_FALSE(alice.Call(truncate, &r)) << r.DebugString();
  const grpc::Status st = alice.Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("no longer accepted"));
  // Counted as every refusal is: by reason, and under its operation.
  EXPECT_EQ(count(kInvalid), invalid_before + 1);
  EXPECT_EQ(count(kTruncateRefused), 1);
  // Bob's token stays: his stream goes on.
  ASSERT_TRUE(bob.Call(truncate, &r));
  EXPECT_TRUE(r.has_truncated()) << r.DebugString();
}

TEST_F(SecurityTest, TokensAreReadOnlyOnceTheFileHasSettled) {
  auto auth = server::Authenticator::Create(TokenOptions(), nullptr);
  ASSERT_TRUE(auth.ok()) << auth.status();
  (*auth)->Stop();  // this test drives the reloads
  const auto principal = [&](const std::string& token) {
    absl::StatusOr<server::Principal> p =
        (*auth)->IdentifyAuthorization(absl::StrCat("Bearer ", token));
    return p.ok() ? p->name : std::string("(none)");
  };
  ASSERT_EQ(principal(kBobToken), "bob");
  const std::string full = absl::StrCat(kBobToken, " bob\ntok-bob-2 bob\n");
  WriteInPlace(tokens_file_, full.substr(0, full.size() - 2));  // "... tok-bob-2 bo"
  EXPECT_TRUE((*auth)->ReloadIfChanged().ok());
  EXPECT_EQ(principal("tok-bob-2"), "(none)");  // changed: not read before it settles
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a new mtime
  WriteInPlace(tokens_file_, full);
  EXPECT_TRUE((*auth)->ReloadIfChanged().ok());
  EXPECT_EQ(principal("tok-bob-2"), "(none)");  // changed again since
  EXPECT_TRUE((*auth)->ReloadIfChanged().ok());  // settled: read
  EXPECT_EQ(principal("tok-bob-2"), "bob");
  EXPECT_EQ(principal(kAliceToken), "(none)");
}

// End to end: with the server running, an empty key written in place (which
// aborted the process in gRPC's TLS stack) and a key of another certificate
// (which failed every new handshake) are skipped; new clients still connect
// with the certificate in use, through three reload intervals each.
TEST_F(SecurityTest, ABadRotationKeepsServingTheCertificateInUse) {
  auto other = ca_->IssueServer("other");
  ASSERT_TRUE(other.ok()) << other.status();
  server::ServerOptions o = TokenOptions();
  o.tls_cert_file = dir_ + "/live-cert.pem";
  o.tls_key_file = dir_ + "/live-key.pem";
  WriteInPlace(o.tls_cert_file, server_cert_.cert_pem);
  WriteInPlace(o.tls_key_file, server_cert_.key_pem);
  const int port = Start(o);
  ASSERT_GT(port, 0);
  ASSERT_TRUE(Info(port, As(kAliceToken)).ok());
  for (const std::string& key : {std::string(), other->key_pem}) {
    WriteInPlace(o.tls_key_file, key);
    std::this_thread::sleep_for(std::chrono::milliseconds(3200));
    const grpc::Status st = Info(port, As(kAliceToken));
    EXPECT_TRUE(st.ok()) << (key.empty() ? "empty key: " : "mismatched key: ")
                         << st.error_message();
  }
}

// ------------------------------------------------------------- start-up --

TEST_F(SecurityTest, BadSecurityOptionsFailStartNamingTheFlagAndFile) {
  auto other = ca_->IssueServer("other");
  ASSERT_TRUE(other.ok());
  const auto start_error = [](const server::ServerOptions& o) {
    auto s = server::Server::Start(o);
    return s.ok() ? absl::OkStatus() : s.status();
  };
  server::ServerOptions o = TlsOptions();
  o.tls_key_file = other->key_file;  // not this certificate's key
  absl::Status st = start_error(o);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("does not belong"));
  EXPECT_THAT(st.message(), HasSubstr(other->key_file));

  o = TlsOptions();
  o.tls_cert_file = dir_ + "/missing.pem";
  st = start_error(o);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("--tls_cert_file"));

  o = testing::TestServerOptions();
  o.auth_tokens_file = tokens_file_;  // tokens on plaintext
  st = start_error(o);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("needs TLS"));

  o = testing::TestServerOptions();
  o.tls_client_ca_file = ca_->cert_file();
  EXPECT_EQ(start_error(o).code(), absl::StatusCode::kInvalidArgument);

  o = TokenOptions();
  ASSERT_TRUE(testing::WriteFileAtomically(tokens_file_, "secret-1 alice\nsecret-2 bob root\n").ok());
  st = start_error(o);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("line 2"));
  EXPECT_THAT(st.message(), Not(HasSubstr("secret-")));
  ASSERT_TRUE(testing::WriteFileAtomically(tokens_file_, "same alice\nsame bob\n").ok());
  EXPECT_EQ(start_error(o).code(), absl::StatusCode::kInvalidArgument);
}

TEST(TokenFileTest, ParsesPrincipalsRolesAndComments) {
  auto parsed = server::ParseTokens("# c\n\n a1 alice\nb2\tbob admin # ops\n", "f");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->size(), 2u);
  EXPECT_EQ((*parsed)[0].token, "a1");
  EXPECT_EQ((*parsed)[0].principal.name, "alice");
  EXPECT_FALSE((*parsed)[0].principal.admin);
  EXPECT_EQ((*parsed)[1].principal.name, "bob");
  EXPECT_TRUE((*parsed)[1].principal.admin);
  for (const char* bad : {"", "# only a comment\n", "tok\n", "t p admin extra\n", "t p root\n",
                          "t bad\"name\n", "t\x01x p\n"}) {
    EXPECT_EQ(server::ParseTokens(bad, "f").status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  // A bad line is named by its number, never by what it holds: a third
  // field may be a second token put there by mistake.
  const absl::Status third =
      server::ParseTokens("a1 alice\nb2 bob tok-second-7f3e\n", "f").status();
  EXPECT_EQ(third.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(third.message(), HasSubstr("line 2"));
  EXPECT_THAT(third.message(), Not(HasSubstr("tok-second")));
  EXPECT_THAT(third.message(), Not(HasSubstr("b2")));
  const absl::Status four = server::ParseTokens("a1 alice admin tok-4\n", "f").status();
  EXPECT_THAT(four.message(), HasSubstr("got 4 fields"));
  EXPECT_THAT(four.message(), Not(HasSubstr("tok-4")));
}

// ----------------------------------------------------------- reflection --

TEST_F(SecurityTest, ReflectionCanBeTurnedOff) {
  server::ServerOptions o = testing::TestServerOptions();
  o.reflection = false;
  const int port = Start(o);
  ASSERT_GT(port, 0);
  EXPECT_EQ(ListServices(testing::TestChannel(port)).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  // The service itself still answers.
  auto stub = testing::TestStub(port);
  grpc::ClientContext info_ctx;
  v1::ServerInfo info;
  EXPECT_TRUE(stub->GetServerInfo(WithDeadline(&info_ctx), {}, &info).ok());
}

// A server on a non-loopback address with no TLS and no authentication
// says so at start; on loopback it does not.
TEST(SecurityWarningTest, PlaintextOnANonLoopbackAddressWarns) {
  const auto first_lines = [](const std::string& address) {
    const std::string cmd = absl::StrCat("timeout -s KILL 3 ", ROPEATTN_SERVER_PATH,
                                         " --address=", address, " --metrics_address= 2>&1");
    FILE* p = popen(cmd.c_str(), "r");
    // The warning comes among the start-up lines, before "config".
    std::string out = p != nullptr ? testing::ReadServerStartup(p).text : std::string();
    if (p != nullptr) pclose(p);
    return out;
  };
  EXPECT_THAT(first_lines("0.0.0.0:0"),
              HasSubstr("\"level\":\"warning\",\"event\":\"plaintext_on_network\""));
  EXPECT_THAT(first_lines("0.0.0.0:0"), HasSubstr("no TLS and no authentication"));
  EXPECT_THAT(first_lines("127.0.0.1:0"), Not(HasSubstr("no TLS and no authentication")));
}

// With TLS but no authentication every caller is still the one anonymous
// principal: a non-loopback address warns about that; with tokens it does
// not, nor on loopback.
TEST(SecurityWarningTest, TlsWithoutAuthenticationOnANonLoopbackAddressWarns) {
  const std::string dir = testing::MakeTempDir("ropeattn_tls_warning_");
  ASSERT_FALSE(dir.empty());
  absl::Cleanup remove = [&dir] { std::system(absl::StrCat("rm -rf ", dir).c_str()); };
  auto ca = TestCa::Create(dir + "/ca", "test-ca");
  ASSERT_TRUE(ca.ok()) << ca.status();
  auto cert = ca->IssueServer("server");
  ASSERT_TRUE(cert.ok()) << cert.status();
  ASSERT_TRUE(testing::WriteFileAtomically(dir + "/tokens", "warning-test-token-0123456789 alice\n")
                  .ok());
  const auto first_lines = [&](const std::string& address, bool tokens) {
    const std::string cmd = absl::StrCat(
        "timeout -s KILL 3 ", ROPEATTN_SERVER_PATH, " --address=", address,
        " --metrics_address= --tls_cert_file=", cert->cert_file, " --tls_key_file=", cert->key_file,
        tokens ? absl::StrCat(" --auth_tokens_file=", dir, "/tokens") : std::string(), " 2>&1");
    FILE* p = popen(cmd.c_str(), "r");
    std::string out = p != nullptr ? testing::ReadServerStartup(p).text : std::string();
    if (p != nullptr) pclose(p);
    return out;
  };
  const std::string network = first_lines("0.0.0.0:0", false);
  EXPECT_THAT(network,
              HasSubstr("\"level\":\"warning\",\"event\":\"no_authentication_on_network\""));
  EXPECT_THAT(network, HasSubstr("with TLS but no authentication"));
  EXPECT_THAT(network, Not(HasSubstr("plaintext_on_network")));
  EXPECT_THAT(first_lines("127.0.0.1:0", false), Not(HasSubstr("no_authentication_on_network")));
  // IPv4-mapped loopback is loopback too (it warned: only ::1 was).
  const std::string mapped = first_lines("[::ffff:127.0.0.1]:0", false);
  EXPECT_THAT(mapped, HasSubstr("\"event\":\"listening\""));
  EXPECT_THAT(mapped, Not(HasSubstr("no_authentication_on_network")));
  EXPECT_THAT(first_lines("0.0.0.0:0", true), Not(HasSubstr("no_authentication_on_network")));
}

}  // namespace
}  // namespace ropeattn
