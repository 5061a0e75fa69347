// The client library end to end: every Client call against a real server on
// a loopback port (port 0), sessions, retries and deadlines, wire tensor
// helpers and .npy files. Failures a healthy server never produces (an
// UNAVAILABLE that clears, a server that hangs, a protocol violation) come
// from a small fake AttentionService on its own loopback port.
// Tolerance: f32 results within 1e-5 absolute of the fp64 reference (values
// are O(1)).
#include "client/client.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "google/protobuf/unknown_field_set.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"

namespace ropeattn::client {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int64_t kHeads = 2;
constexpr int64_t kDim = 4;

std::unique_ptr<Client> MustConnect(const std::string& target,
                                    absl::Duration deadline = absl::Seconds(30),
                                    int max_retries = 3, const std::string& routing_key = "") {
  ClientOptions options;
  options.target = target;
  options.deadline = deadline;
  options.max_retries = max_retries;
  options.routing_key = routing_key;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

std::string Local(int port) { return absl::StrCat("127.0.0.1:", port); }

// A loopback port nobody listens on: bound, read, and released.
int UnusedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(fd);
    return -1;
  }
  close(fd);
  return ntohs(addr.sin_port);
}

std::vector<float> Floats(const v1::Tensor& t) {
  absl::StatusOr<std::vector<float>> f = ToFloats(t);
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? *f : std::vector<float>();
}

// Rows [from, to) of a [1, S, H, D] token tensor held as floats.
std::vector<float> Rows(const std::vector<float>& x, int64_t from, int64_t to,
                        int64_t row = kHeads * kDim) {
  return std::vector<float>(x.begin() + from * row, x.begin() + to * row);
}

v1::Tensor Tokens(const std::vector<float>& values) {
  const int64_t t = static_cast<int64_t>(values.size()) / (kHeads * kDim);
  return MakeF32({1, t, kHeads, kDim}, values).value();
}

// Plain fp64 causal attention for batch 1, heads == kv heads, no positional
// encoding: query i sits at position sk - sq + i and sees keys 0..that.
std::vector<double> RefAttention(const std::vector<float>& q, const std::vector<float>& k,
                                 const std::vector<float>& v, int64_t h, int64_t d) {
  const int64_t sq = static_cast<int64_t>(q.size()) / (h * d);
  const int64_t sk = static_cast<int64_t>(k.size()) / (h * d);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> out(q.size(), 0.0);
  for (int64_t i = 0; i < sq; ++i) {
    const int64_t last = sk - sq + i;
    for (int64_t hh = 0; hh < h; ++hh) {
      std::vector<double> logits(last + 1);
      double max_logit = -1e300;
      for (int64_t j = 0; j <= last; ++j) {
        double dot = 0;
        for (int64_t c = 0; c < d; ++c) {
          dot += static_cast<double>(q[(i * h + hh) * d + c]) * k[(j * h + hh) * d + c];
        }
        logits[j] = dot * scale;
        max_logit = std::max(max_logit, logits[j]);
      }
      double sum = 0;
      for (double& l : logits) sum += (l = std::exp(l - max_logit));
      for (int64_t j = 0; j <= last; ++j) {
        for (int64_t c = 0; c < d; ++c) {
          out[(i * h + hh) * d + c] += logits[j] / sum * v[(j * h + hh) * d + c];
        }
      }
    }
  }
  return out;
}

void ExpectNear(const std::vector<float>& actual, const std::vector<double>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], 1e-5) << "element " << i;
  }
}

v1::OpenSession SmallOpen(bool resumable = false) {
  v1::OpenSession open;
  open.mutable_spec()->set_heads(kHeads);
  open.mutable_spec()->set_head_dim(kDim);
  open.set_max_context(64);
  open.set_resumable(resumable);
  return open;
}

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = testing::StartTestServer(testing::TestServerOptions());
    ASSERT_NE(server_, nullptr);
    client_ = MustConnect(Local(server_->port()));
    ASSERT_NE(client_, nullptr);
  }

  std::unique_ptr<server::Server> server_;
  std::unique_ptr<Client> client_;
};

// ------------------------------------------------------------- options --

TEST(ConnectTest, RejectsBadOptions) {
  auto with = [](auto change) {
    ClientOptions o;
    change(o);
    return Client::Connect(o).status();
  };
  absl::Status s = with([](ClientOptions& o) { o.target = ""; });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("target"));
  s = with([](ClientOptions& o) { o.deadline = absl::ZeroDuration(); });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("deadline"));
  s = with([](ClientOptions& o) { o.max_message_bytes = 0; });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("got 0"));
  s = with([](ClientOptions& o) { o.max_message_bytes = int64_t{1} << 32; });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  s = with([](ClientOptions& o) { o.max_retries = -1; });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("-1"));
  s = with([](ClientOptions& o) { o.routing_key = "a\nb"; });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("routing_key"));
  EXPECT_TRUE(with([](ClientOptions& o) { o.routing_key = "tenant-7"; }).ok());
}

TEST_F(ClientTest, RejectsNonPositiveCallDeadline) {
  absl::Status s = client_->GetServerInfo(absl::ZeroDuration()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("deadline"));
}

// --------------------------------------------------------- unary calls --

TEST_F(ClientTest, Health) {
  EXPECT_EQ(client_->Health().value(), HealthStatus::kServing);
  EXPECT_EQ(client_->Health("ropeattn.v1.AttentionService").value(), HealthStatus::kServing);
  EXPECT_EQ(client_->Health("no.such.Service").value(), HealthStatus::kServiceUnknown);
  server_->SetServingForTest(false);
  EXPECT_EQ(client_->Health().value(), HealthStatus::kNotServing);
  EXPECT_EQ(client_->Health("ropeattn.v1.AttentionService").value(), HealthStatus::kNotServing);
  EXPECT_STREQ(HealthStatusName(HealthStatus::kNotServing), "NOT_SERVING");
  EXPECT_STREQ(HealthStatusName(HealthStatus::kServiceUnknown), "SERVICE_UNKNOWN");
}

TEST_F(ClientTest, GetServerInfo) {
  absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  const server::ServerOptions& o = server_->options();
  EXPECT_FALSE(info->version().empty());
  EXPECT_EQ(info->max_sessions(), o.max_sessions);
  EXPECT_EQ(info->max_message_bytes(), o.max_message_bytes);
  EXPECT_EQ(info->kv_budget_bytes(), o.memory_budget_bytes);
  EXPECT_EQ(info->default_max_context(), o.default_max_context);
  EXPECT_EQ(info->open_sessions(), 0);
}

TEST_F(ClientTest, AttendMatchesDoubleReference) {
  const int64_t s = 3;
  const std::vector<float> q = Floats(RandomTensor(v1::DTYPE_F32, {1, s, kHeads, kDim}, 1).value());
  const std::vector<float> k = Floats(RandomTensor(v1::DTYPE_F32, {1, s, kHeads, kDim}, 2).value());
  const std::vector<float> v = Floats(RandomTensor(v1::DTYPE_F32, {1, s, kHeads, kDim}, 3).value());
  v1::AttendRequest request;
  request.mutable_spec()->set_heads(kHeads);
  request.mutable_spec()->set_head_dim(kDim);
  request.mutable_spec()->set_causal(true);
  *request.mutable_q() = Tokens(q);
  *request.mutable_k() = Tokens(k);
  *request.mutable_v() = Tokens(v);
  request.set_return_probs(true);
  absl::StatusOr<v1::AttendResponse> response = client_->Attend(request);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_THAT(response->out().shape(), ::testing::ElementsAre(1, s, kHeads, kDim));
  ExpectNear(Floats(response->out()), RefAttention(q, k, v, kHeads, kDim));
  // Causal: query 0 gives key 1 no weight.
  const std::vector<float> probs = Floats(response->probs());
  ASSERT_EQ(probs.size(), static_cast<size_t>(kHeads * s * s));
  EXPECT_EQ(probs[1], 0.0f);
  EXPECT_NEAR(probs[0], 1.0f, 1e-6);
}

TEST_F(ClientTest, ServerErrorKeepsCodeAndMessage) {
  v1::AttendRequest request;
  request.mutable_spec()->set_heads(3);
  request.mutable_spec()->set_kv_heads(2);  // heads must be a multiple of kv_heads
  request.mutable_spec()->set_head_dim(kDim);
  *request.mutable_q() = RandomTensor(v1::DTYPE_F32, {1, 1, 3, kDim}, 1).value();
  *request.mutable_k() = RandomTensor(v1::DTYPE_F32, {1, 1, 2, kDim}, 2).value();
  *request.mutable_v() = RandomTensor(v1::DTYPE_F32, {1, 1, 2, kDim}, 3).value();
  // What the server says on the wire, through a plain stub.
  grpc::ClientContext ctx;
  v1::AttendResponse ignored;
  const grpc::Status wire = testing::TestStub(server_->port())->Attend(&ctx, request, &ignored);
  ASSERT_EQ(wire.error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  absl::Status s = client_->Attend(request).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), wire.error_message());  // not retried, nothing appended
}

TEST_F(ClientTest, EncodeAlibiSlopes) {
  v1::EncodeRequest request;
  request.mutable_alibi()->set_heads(8);
  absl::StatusOr<v1::EncodeResponse> response = client_->Encode(request);
  ASSERT_TRUE(response.ok()) << response.status();
  ASSERT_EQ(response->slopes_size(), 8);
  for (int h = 0; h < 8; ++h) {
    EXPECT_DOUBLE_EQ(response->slopes(h), std::ldexp(1.0, -(h + 1))) << "head " << h;
  }
}

TEST_F(ClientTest, OperatorSessionCalls) {
  absl::StatusOr<std::unique_ptr<Session>> session = client_->OpenSession(SmallOpen());
  ASSERT_TRUE(session.ok()) << session.status();
  const std::string id = (*session)->id();
  ASSERT_FALSE(id.empty());
  ASSERT_TRUE((*session)
                  ->Step(Tokens(std::vector<float>(kHeads * kDim, 0.5f)),
                         Tokens(std::vector<float>(kHeads * kDim, 0.25f)),
                         Tokens(std::vector<float>(kHeads * kDim, 1.0f)))
                  .ok());

  absl::StatusOr<v1::SessionInfo> info = client_->GetSession(id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->session_id(), id);
  EXPECT_EQ(info->position(), 1);
  EXPECT_TRUE(info->attached());
  EXPECT_EQ(info->steps(), 1u);

  absl::StatusOr<std::vector<v1::SessionInfo>> all = client_->ListSessions();
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 1u);
  EXPECT_EQ((*all)[0].session_id(), id);

  absl::StatusOr<v1::SessionInfo> closed = client_->CloseSession(id);
  ASSERT_TRUE(closed.ok()) << closed.status();
  EXPECT_EQ(closed->session_id(), id);
  EXPECT_EQ(closed->position(), 1);
  EXPECT_TRUE(client_->ListSessions()->empty());

  absl::Status unknown = client_->GetSession("no-such-session").status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(unknown.message(), HasSubstr("no-such-session"));
  EXPECT_EQ(client_->CloseSession("no-such-session").status().code(), absl::StatusCode::kNotFound);
}

// ------------------------------------------------------------ sessions --

TEST_F(ClientTest, SessionStepTruncateForkClose) {
  const std::vector<float> q =
      Floats(RandomTensor(v1::DTYPE_F32, {1, 4, kHeads, kDim}, 11).value());
  const std::vector<float> k =
      Floats(RandomTensor(v1::DTYPE_F32, {1, 4, kHeads, kDim}, 12).value());
  const std::vector<float> v =
      Floats(RandomTensor(v1::DTYPE_F32, {1, 4, kHeads, kDim}, 13).value());

  absl::StatusOr<std::unique_ptr<Session>> opened = client_->OpenSession(SmallOpen());
  ASSERT_TRUE(opened.ok()) << opened.status();
  Session& session = **opened;
  EXPECT_EQ(session.position(), 0);
  EXPECT_EQ(session.info().max_context(), 64);
  EXPECT_FALSE(session.info().resumable());

  // Two tokens at once, then one: each equals attention over the prefix.
  absl::StatusOr<v1::StepResult> r =
      session.Step(Tokens(Rows(q, 0, 2)), Tokens(Rows(k, 0, 2)), Tokens(Rows(v, 0, 2)));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->seq(), 1u);
  EXPECT_EQ(r->position(), 2);
  ExpectNear(Floats(r->out()),
             RefAttention(Rows(q, 0, 2), Rows(k, 0, 2), Rows(v, 0, 2), kHeads, kDim));
  r = session.Step(Tokens(Rows(q, 2, 3)), Tokens(Rows(k, 2, 3)), Tokens(Rows(v, 2, 3)));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->seq(), 2u);
  EXPECT_EQ(session.position(), 3);
  ExpectNear(Floats(r->out()),
             RefAttention(Rows(q, 2, 3), Rows(k, 0, 3), Rows(v, 0, 3), kHeads, kDim));

  // Roll back token 2, then append token 3 in its place.
  absl::StatusOr<v1::SessionInfo> truncated = session.Truncate(2);
  ASSERT_TRUE(truncated.ok()) << truncated.status();
  EXPECT_EQ(truncated->position(), 2);
  EXPECT_EQ(session.position(), 2);
  r = session.Step(Tokens(Rows(q, 3, 4)), Tokens(Rows(k, 3, 4)), Tokens(Rows(v, 3, 4)));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->seq(), 4u);  // truncate took seq 3
  EXPECT_EQ(r->position(), 3);
  std::vector<float> k013 = Rows(k, 0, 2), v013 = Rows(v, 0, 2);
  for (float x : Rows(k, 3, 4)) k013.push_back(x);
  for (float x : Rows(v, 3, 4)) v013.push_back(x);
  ExpectNear(Floats(r->out()), RefAttention(Rows(q, 3, 4), k013, v013, kHeads, kDim));

  // A fork is a detached resumable copy; attached from another client, it
  // continues exactly like the original.
  absl::StatusOr<v1::SessionInfo> fork = session.Fork(60);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_NE(fork->session_id(), session.id());
  EXPECT_TRUE(fork->resumable());
  EXPECT_FALSE(fork->attached());
  EXPECT_EQ(fork->position(), 3);
  std::unique_ptr<Client> other = MustConnect(Local(server_->port()));
  absl::StatusOr<std::unique_ptr<Session>> forked = other->AttachSession(fork->session_id());
  ASSERT_TRUE(forked.ok()) << forked.status();
  EXPECT_EQ((*forked)->position(), 3);
  EXPECT_TRUE((*forked)->info().attached());
  absl::StatusOr<v1::StepResult> a =
      session.Step(Tokens(Rows(q, 2, 3)), Tokens(Rows(k, 2, 3)), Tokens(Rows(v, 2, 3)));
  absl::StatusOr<v1::StepResult> b =
      (*forked)->Step(Tokens(Rows(q, 2, 3)), Tokens(Rows(k, 2, 3)), Tokens(Rows(v, 2, 3)));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->position(), 4);
  EXPECT_EQ(b->position(), 4);
  EXPECT_EQ(a->out().data(), b->out().data());
  EXPECT_EQ(b->seq(), 1u);  // its own stream numbers from 1

  // Its exported KV opens a session elsewhere (here: another client) that
  // continues like it.
  absl::StatusOr<v1::KvExport> kv = session.ExportKv();
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->position(), 4);
  v1::OpenSession moved_open = SmallOpen();
  *moved_open.mutable_prefix()->mutable_k() = kv->k();
  *moved_open.mutable_prefix()->mutable_v() = kv->v();
  moved_open.mutable_prefix()->set_key_form(kv->key_form());
  absl::StatusOr<std::unique_ptr<Session>> moved = other->OpenSession(moved_open);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ((*moved)->position(), 4);
  a = session.Step(Tokens(Rows(q, 0, 1)), Tokens(Rows(k, 0, 1)), Tokens(Rows(v, 0, 1)));
  b = (*moved)->Step(Tokens(Rows(q, 0, 1)), Tokens(Rows(k, 0, 1)), Tokens(Rows(v, 0, 1)));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->position(), 5);
  const std::vector<float> want = Floats(a->out());
  ExpectNear(Floats(b->out()), std::vector<double>(want.begin(), want.end()));
  ASSERT_TRUE((*moved)->Close().ok());

  // Close ends the session on the server; the Session is then unusable.
  const std::string id = session.id();
  ASSERT_TRUE(session.Close().ok());
  EXPECT_EQ(session.info().position(), 5);
  absl::Status after =
      session.Step(Tokens(Rows(q, 0, 1)), Tokens(Rows(k, 0, 1)), Tokens(Rows(v, 0, 1))).status();
  EXPECT_EQ(after.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(after.message(), HasSubstr(id));
  EXPECT_EQ(session.Close().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(client_->GetSession(id).ok());
  ASSERT_TRUE((*forked)->Close().ok());
  EXPECT_TRUE(client_->ListSessions()->empty());
}

TEST_F(ClientTest, ResumableSessionReattachesFromAnotherClient) {
  std::string id;
  {
    absl::StatusOr<std::unique_ptr<Session>> session = client_->OpenSession(SmallOpen(true));
    ASSERT_TRUE(session.ok()) << session.status();
    id = (*session)->id();
    EXPECT_TRUE((*session)->info().resumable());
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE((*session)
                      ->Step(RandomTensor(v1::DTYPE_F32, {1, 1, kHeads, kDim}, 20 + i).value(),
                             RandomTensor(v1::DTYPE_F32, {1, 1, kHeads, kDim}, 30 + i).value(),
                             RandomTensor(v1::DTYPE_F32, {1, 1, kHeads, kDim}, 40 + i).value())
                      .ok());
    }
  }  // the stream ends; a resumable session stays, detached
  // The server detaches in its stream's OnDone, which may run just after
  // this client has seen the stream's end: wait for it.
  absl::StatusOr<v1::SessionInfo> detached;
  for (absl::Time give_up = absl::Now() + absl::Seconds(5); absl::Now() < give_up;) {
    detached = client_->GetSession(id);
    if (!detached.ok() || !detached->attached()) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(detached.ok()) << detached.status();
  EXPECT_FALSE(detached->attached());
  EXPECT_EQ(detached->position(), 2);

  std::unique_ptr<Client> other = MustConnect(Local(server_->port()));
  absl::StatusOr<std::unique_ptr<Session>> again = other->AttachSession(id);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->id(), id);
  EXPECT_EQ((*again)->position(), 2);
  absl::StatusOr<v1::StepResult> r =
      (*again)->Step(RandomTensor(v1::DTYPE_F32, {1, 1, kHeads, kDim}, 22).value(),
                     RandomTensor(v1::DTYPE_F32, {1, 1, kHeads, kDim}, 32).value(),
                     RandomTensor(v1::DTYPE_F32, {1, 1, kHeads, kDim}, 42).value());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->position(), 3);

  // Only one stream may hold it: a second attach is refused at open.
  absl::Status twice = client_->AttachSession(id).status();
  EXPECT_EQ(twice.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(twice.message(), HasSubstr("attached"));
}

TEST_F(ClientTest, InBandErrorKeepsSessionUsable) {
  absl::StatusOr<std::unique_ptr<Session>> session = client_->OpenSession(SmallOpen());
  ASSERT_TRUE(session.ok()) << session.status();
  const v1::Tensor good = RandomTensor(v1::DTYPE_F32, {1, 1, kHeads, kDim}, 5).value();
  const v1::Tensor bad = RandomTensor(v1::DTYPE_F32, {1, 1, kHeads + 1, kDim}, 5).value();
  absl::Status s = (*session)->Step(bad, good, good).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("step.q"));
  EXPECT_EQ((*session)->position(), 0);
  // Past max_context: OUT_OF_RANGE, also in-band.
  EXPECT_EQ((*session)->Truncate(5).status().code(), absl::StatusCode::kOutOfRange);

  absl::StatusOr<v1::StepResult> r = (*session)->Step(good, good, good);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->position(), 1);
  EXPECT_EQ(r->seq(), 3u);
}

// A message larger than the client may send is refused before it is sent
// (above 2 GiB gRPC's serializer would abort the process instead), naming
// its size; a session's step refused so is never sent and the session goes
// on with the next seq.
TEST(ClientSendSizeTest, OversizedRequestsAreRefusedBeforeSending) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  ClientOptions o;
  o.target = Local(server->port());
  o.max_message_bytes = 64 << 10;
  absl::StatusOr<std::unique_ptr<Client>> connected = Client::Connect(o);
  ASSERT_TRUE(connected.ok()) << connected.status();
  Client* client = connected->get();
  v1::AttendRequest big;
  big.mutable_spec()->set_heads(kHeads);
  big.mutable_spec()->set_head_dim(kDim);
  for (v1::Tensor* t : {big.mutable_q(), big.mutable_k(), big.mutable_v()}) {
    *t = RandomTensor(v1::DTYPE_F32, {1, 2048, kHeads, kDim}, 1).value();
  }
  const size_t bytes = big.ByteSizeLong();
  ASSERT_GT(bytes, size_t{64} << 10);
  absl::Status s = client->Attend(big).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("the Attend request is ", bytes, " bytes")));
  EXPECT_THAT(s.message(), HasSubstr("max_message_bytes 65536"));

  absl::StatusOr<std::unique_ptr<Session>> session = client->OpenSession(SmallOpen());
  ASSERT_TRUE(session.ok()) << session.status();
  const v1::Tensor one = RandomTensor(v1::DTYPE_F32, {1, 1, kHeads, kDim}, 5).value();
  const v1::Tensor many = RandomTensor(v1::DTYPE_F32, {1, 3, kHeads, kDim}, 5).value();
  v1::Tensor huge = RandomTensor(v1::DTYPE_F32, {1, 3, kHeads, kDim}, 5).value();
  huge.mutable_data()->append(70 << 10, '\0');  // malformed too, but never sent
  s = (*session)->Step(huge, many, many).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("the Decode `step` is"));
  EXPECT_EQ((*session)->position(), 0);
  absl::StatusOr<v1::StepResult> r = (*session)->Step(one, one, one);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->position(), 1);
  EXPECT_EQ(r->seq(), 1u);
}

// A message whose parse the server's memory budget cannot hold is refused
// in band with seq 0 (the server never read its seq) and the stream stays
// open: the client took that for a desync (INTERNAL, the stream ended and a
// non-resumable session lost) instead of the request's retryable answer.
TEST(ClientInBandTest, TheRefusalOfAnUnreadMessageIsItsRequestsInBandAnswer) {
  server::ServerOptions o = testing::TestServerOptions();
  o.memory_budget_bytes = int64_t{1} << 20;
  auto server = testing::StartTestServer(o);
  ASSERT_NE(server, nullptr);
  std::unique_ptr<Client> client = MustConnect(Local(server->port()));
  ASSERT_NE(client, nullptr);
  absl::StatusOr<std::unique_ptr<Session>> session = client->OpenSession(SmallOpen());
  ASSERT_TRUE(session.ok()) << session.status();
  const v1::Tensor one = RandomTensor(v1::DTYPE_F32, {1, 1, kHeads, kDim}, 5).value();
  // ~600 KB on the wire, an unknown field's entry each in memory: past the
  // 1 MiB budget once parsed.
  v1::Tensor padded = one;
  google::protobuf::UnknownFieldSet* unknown =
      padded.GetReflection()->MutableUnknownFields(&padded);
  for (int i = 0; i < 200000; ++i) unknown->AddVarint(1000, 0);
  absl::Status s = (*session)->Step(padded, one, one).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("parsing this ropeattn.v1.DecodeRequest"));
  EXPECT_EQ((*session)->position(), 0);
  absl::StatusOr<v1::StepResult> r = (*session)->Step(one, one, one);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->position(), 1);
  EXPECT_EQ(r->seq(), 2u);
}

TEST_F(ClientTest, OperatorCloseBreaksTheSession) {
  absl::StatusOr<std::unique_ptr<Session>> session = client_->OpenSession(SmallOpen());
  ASSERT_TRUE(session.ok()) << session.status();
  const std::string id = (*session)->id();
  ASSERT_TRUE(client_->CloseSession(id).ok());

  const v1::Tensor x = RandomTensor(v1::DTYPE_F32, {1, 1, kHeads, kDim}, 5).value();
  absl::Status first = (*session)->Step(x, x, x).status();
  EXPECT_EQ(first.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(first.message(), HasSubstr(absl::StrCat("session ", id, " was closed")));
  // The stream has ended: every later call reports the same status.
  EXPECT_EQ((*session)->Step(x, x, x).status(), first);
  EXPECT_EQ((*session)->Truncate(0).status(), first);
  EXPECT_EQ((*session)->Close(), first);
}

TEST_F(ClientTest, FailedOpenReturnsTheServerStatus) {
  v1::OpenSession open = SmallOpen();
  open.mutable_spec()->set_head_dim(0);
  absl::Status s = client_->OpenSession(open).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("head_dim"));

  s = client_->AttachSession("not-a-session").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("not-a-session"));

  open = SmallOpen();
  open.set_max_context(int64_t{1} << 30);  // past max_context_limit
  EXPECT_NE(client_->OpenSession(open).status().code(), absl::StatusCode::kOk);
}

// ------------------------------------------- retries, deadlines, faults --

TEST(ClientRetryTest, NoServerGivesUnavailableAfterRetries) {
  const int port = UnusedPort();
  ASSERT_GT(port, 0);
  // Backoff sleeps 50, 100, 200 ms, each at least 80% of that: >= 280 ms.
  std::unique_ptr<Client> client = MustConnect(Local(port), absl::Seconds(10), 3);
  absl::Time start = absl::Now();
  absl::Status s = client->GetServerInfo().status();
  absl::Duration took = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("(after 4 attempts)"));
  EXPECT_GE(took, absl::Milliseconds(280));
  EXPECT_LT(took, absl::Seconds(10));
  EXPECT_EQ(client->Health().status().code(), absl::StatusCode::kUnavailable);

  // The deadline bounds the retries: 100 allowed, but none may start past 400 ms.
  client = MustConnect(Local(port), absl::Milliseconds(400), 100);
  start = absl::Now();
  s = client->Attend(v1::AttendRequest()).status();
  took = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("gave up"));
  // 100 retries would sleep for minutes; the margin is for a loaded machine.
  EXPECT_LT(took, absl::Seconds(2));

  // Decode streams are never retried: 20 retries would sleep for over 20 s.
  client = MustConnect(Local(port), absl::Seconds(60), 20);
  start = absl::Now();
  s = client->OpenSession(SmallOpen()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

// Injects what a healthy server never does, counting calls.
class FakeService final : public v1::AttentionService::Service {
 public:
  enum class DecodeMode { kRejectOpen, kHangOnStep, kWrongSeq };

  std::atomic<int> info_calls{0};
  std::atomic<int> close_calls{0};
  std::atomic<int> attend_calls{0};
  std::atomic<int> unavailable_answers{2};  // GetServerInfo fails this many times first
  std::atomic<DecodeMode> mode{DecodeMode::kRejectOpen};

  std::string routing_key() {
    absl::MutexLock lock(&mu_);
    return routing_key_;
  }

  grpc::Status GetServerInfo(grpc::ServerContext*, const v1::GetServerInfoRequest*,
                             v1::ServerInfo* info) override {
    if (info_calls.fetch_add(1) < unavailable_answers.load()) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "warming up");
    }
    info->set_version("fake");
    return grpc::Status::OK;
  }

  grpc::Status CloseSession(grpc::ServerContext*, const v1::CloseSessionRequest*,
                            v1::CloseSessionResponse*) override {
    close_calls.fetch_add(1);
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "draining");
  }

  grpc::Status Attend(grpc::ServerContext* ctx, const v1::AttendRequest*,
                      v1::AttendResponse*) override {
    attend_calls.fetch_add(1);
    WaitForCancel(ctx);
    return grpc::Status(grpc::StatusCode::INTERNAL, "should have been cancelled");
  }

  grpc::Status Decode(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::DecodeResponse, v1::DecodeRequest>* stream) override {
    {
      absl::MutexLock lock(&mu_);
      auto it = ctx->client_metadata().find("x-ropeattn-session-key");
      routing_key_ = it == ctx->client_metadata().end()
                         ? "<none>"
                         : std::string(it->second.data(), it->second.size());
    }
    v1::DecodeRequest request;
    if (!stream->Read(&request)) return grpc::Status::OK;
    if (mode == DecodeMode::kRejectOpen) {
      return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "no sessions on this fake");
    }
    v1::DecodeResponse response;
    response.mutable_opened()->set_session_id("fake-session");
    if (!stream->Write(response)) return grpc::Status::OK;
    while (stream->Read(&request)) {
      if (mode == DecodeMode::kHangOnStep) {
        WaitForCancel(ctx);
        return grpc::Status(grpc::StatusCode::INTERNAL, "should have been cancelled");
      }
      response.Clear();
      response.set_seq(request.step().seq() + 7);
      response.mutable_step()->set_position(1);
      if (!stream->Write(response)) break;
    }
    return grpc::Status::OK;
  }

 private:
  static void WaitForCancel(grpc::ServerContext* ctx) {
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    while (!ctx->IsCancelled() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(2));
  }

  absl::Mutex mu_;
  std::string routing_key_ ABSL_GUARDED_BY(mu_);
};

class FakeServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }

  FakeService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(FakeServerTest, RetriesUnavailableOnIdempotentCallsOnly) {
  std::unique_ptr<Client> client = MustConnect(Local(port_), absl::Seconds(10), 3);
  absl::StatusOr<v1::ServerInfo> info = client->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->version(), "fake");
  EXPECT_EQ(service_.info_calls.load(), 3);  // two UNAVAILABLE, then served

  // More failures than retries: the last status, with the attempt count.
  service_.info_calls = 0;
  service_.unavailable_answers = 100;
  absl::Status s = client->GetServerInfo().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "warming up (after 4 attempts)");
  EXPECT_EQ(service_.info_calls.load(), 4);

  // CloseSession is not idempotent: one attempt, the message untouched.
  s = client->CloseSession("x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "draining");
  EXPECT_EQ(service_.close_calls.load(), 1);
}

TEST_F(FakeServerTest, UnaryDeadlineExceeded) {
  std::unique_ptr<Client> client = MustConnect(Local(port_), absl::Seconds(30), 3);
  const absl::Time start = absl::Now();
  absl::Status s = client->Attend(v1::AttendRequest(), absl::Milliseconds(300)).status();
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_GE(took, absl::Milliseconds(290));
  EXPECT_LT(took, absl::Seconds(5));
  EXPECT_EQ(service_.attend_calls.load(), 1);  // DEADLINE_EXCEEDED is not retried
}

TEST_F(FakeServerTest, OpenFailureIsTheStreamStatusAndRoutingKeyIsSent) {
  std::unique_ptr<Client> client = MustConnect(Local(port_), absl::Seconds(10), 3, "tenant-7");
  absl::Status s = client->OpenSession(SmallOpen()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(s.message(), "no sessions on this fake");
  EXPECT_EQ(service_.routing_key(), "tenant-7");

  client = MustConnect(Local(port_));
  EXPECT_EQ(client->AttachSession("x").status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(service_.routing_key(), "<none>");
}

TEST_F(FakeServerTest, SessionOperationDeadlineCancelsTheStream) {
  service_.mode = FakeService::DecodeMode::kHangOnStep;
  std::unique_ptr<Client> client = MustConnect(Local(port_), absl::Milliseconds(300));
  absl::StatusOr<std::unique_ptr<Session>> session = client->OpenSession(SmallOpen());
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->id(), "fake-session");
  const v1::Tensor x = RandomTensor(v1::DTYPE_F32, {1, 1, kHeads, kDim}, 5).value();
  const absl::Time start = absl::Now();
  absl::Status s = (*session)->Step(x, x, x).status();
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("step"));
  EXPECT_GE(took, absl::Milliseconds(290));
  EXPECT_LT(took, absl::Seconds(5));
  // The stream was cancelled: the session is broken.
  EXPECT_EQ((*session)->Step(x, x, x).status(), s);
}

TEST_F(FakeServerTest, ProtocolViolationIsInternal) {
  service_.mode = FakeService::DecodeMode::kWrongSeq;
  std::unique_ptr<Client> client = MustConnect(Local(port_));
  absl::StatusOr<std::unique_ptr<Session>> session = client->OpenSession(SmallOpen());
  ASSERT_TRUE(session.ok()) << session.status();
  const v1::Tensor x = RandomTensor(v1::DTYPE_F32, {1, 1, kHeads, kDim}, 5).value();
  absl::Status s = (*session)->Step(x, x, x).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("seq 1 has seq 8"));
  EXPECT_EQ((*session)->Step(x, x, x).status(), s);
}

// ------------------------------------------------------- wire tensors --

uint16_t Bits(const v1::Tensor& t, size_t i) {
  uint16_t b;
  std::memcpy(&b, t.data().data() + 2 * i, 2);
  return b;
}

TEST(TensorsTest, MakeBF16RoundsToNearestEven) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> values = {
      1.0f,
      1.0f + 0x1p-8f,             // halfway, 1.0 is even: down
      1.0f + 0x1p-7f + 0x1p-8f,   // halfway, 0x3f82 is even: up
      1.0f + 0x1p-8f + 0x1p-20f,  // above halfway: up
      -2.5f,
      std::numeric_limits<float>::max(),  // past bf16's largest + half ulp
      nan};
  v1::Tensor t = MakeBF16({7}, values).value();
  EXPECT_EQ(t.dtype(), v1::DTYPE_BF16);
  ASSERT_EQ(t.data().size(), 14u);
  EXPECT_EQ(Bits(t, 0), 0x3f80);
  EXPECT_EQ(Bits(t, 1), 0x3f80);
  EXPECT_EQ(Bits(t, 2), 0x3f82);
  EXPECT_EQ(Bits(t, 3), 0x3f81);
  EXPECT_EQ(Bits(t, 4), 0xc020);
  EXPECT_EQ(Bits(t, 5), 0x7f80);
  EXPECT_TRUE(std::isnan(Floats(t)[6]));
  EXPECT_EQ(Floats(t)[4], -2.5f);
}

TEST(TensorsTest, MakeChecksTheCount) {
  absl::Status s = MakeF32({2, 3}, std::vector<float>(5)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("[2, 3]"));
  EXPECT_EQ(MakeBF16({-1}, {}).status().code(), absl::StatusCode::kInvalidArgument);
  v1::Tensor scalar = MakeF32({}, {4.5f}).value();
  EXPECT_EQ(scalar.shape_size(), 0);
  EXPECT_EQ(Floats(scalar), std::vector<float>{4.5f});
}

TEST(TensorsTest, ToFloatsValidates) {
  v1::Tensor t = MakeF32({2}, {1.0f, 2.0f}).value();
  t.mutable_data()->pop_back();
  absl::Status s = ToFloats(t).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("7 bytes"));
  t = MakeF32({2}, {1.0f, 2.0f}).value();
  t.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(ToFloats(t).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorsTest, NumElementsIsOverflowSafe) {
  v1::Tensor t;
  EXPECT_EQ(NumElements(t), 1);  // a scalar
  for (int64_t d : {2, 3, 4}) t.add_shape(d);
  EXPECT_EQ(NumElements(t), 24);
  t.add_shape(-1);
  EXPECT_EQ(NumElements(t), -1);
  t.Clear();
  t.add_shape(int64_t{1} << 40);
  t.add_shape(int64_t{1} << 40);
  EXPECT_EQ(NumElements(t), -1);
  t.add_shape(0);
  EXPECT_EQ(NumElements(t), 0);
}

TEST(TensorsTest, RandomTensorIsDeterministicSplitMix64) {
  v1::Tensor a = RandomTensor(v1::DTYPE_F32, {3, 5}, 0).value();
  EXPECT_EQ(a.data(), RandomTensor(v1::DTYPE_F32, {3, 5}, 0).value().data());
  EXPECT_NE(a.data(), RandomTensor(v1::DTYPE_F32, {3, 5}, 1).value().data());
  // splitmix64 from state 0 first yields 0xe220a8397b1dcdaf (the reference
  // implementation's published value); its top 24 bits make element 0.
  const std::vector<float> f = Floats(a);
  EXPECT_EQ(f[0], 2.0f * (0xe220a8 * 0x1p-24f) - 1.0f);
  for (float x : f) {
    EXPECT_GE(x, -1.0f);
    EXPECT_LT(x, 1.0f);
  }
  v1::Tensor b = RandomTensor(v1::DTYPE_BF16, {3, 5}, 0).value();
  EXPECT_EQ(b.dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(b.data(), MakeBF16({3, 5}, f).value().data());
  EXPECT_EQ(RandomTensor(v1::DTYPE_UNSPECIFIED, {1}, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ------------------------------------------------------------ .npy files --

class NpyTest : public ::testing::Test {
 protected:
  std::string Path(const std::string& name) {
    const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
    return absl::StrCat(::testing::TempDir(), "/client_test_", info->name(), "_", name);
  }
  std::string WriteBytes(const std::string& name, const std::string& bytes) {
    const std::string path = Path(name);
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }
  static std::string ReadBytes(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
};

// A file laid out as numpy's np.save writes it: magic, version, little-endian
// header length (2 bytes for 1.0, 4 for 2.0), the dict padded with spaces and
// a newline so the data starts at a multiple of 64.
std::string NpyFile(int major, const std::string& dict, const std::string& data) {
  const size_t prefix = major == 1 ? 10 : 12;
  std::string header = dict;
  const size_t total = (prefix + header.size() + 1 + 63) / 64 * 64;
  header.append(total - prefix - header.size() - 1, ' ');
  header.push_back('\n');
  std::string out = "\x93NUMPY";
  out.push_back(static_cast<char>(major));
  out.push_back(0);
  for (size_t i = 0; i < prefix - 8; ++i)
    out.push_back(static_cast<char>(header.size() >> (8 * i)));
  return out + header + data;
}

template <typename T>
std::string RawBytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

TEST_F(NpyTest, F32RoundTripIsBitExactAndLooksLikeNumpy) {
  const v1::Tensor t = RandomTensor(v1::DTYPE_F32, {2, 3, 4}, 9).value();
  const std::string path = Path("f32.npy");
  ASSERT_TRUE(WriteNpy(path, t).ok());
  const std::string bytes = ReadBytes(path);
  ASSERT_GE(bytes.size(), 10u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  const size_t header_len =
      static_cast<unsigned char>(bytes[8]) | static_cast<unsigned char>(bytes[9]) << 8;
  EXPECT_EQ((10 + header_len) % 64, 0u);
  EXPECT_EQ(bytes[10 + header_len - 1], '\n');
  EXPECT_THAT(bytes.substr(10, header_len),
              HasSubstr("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3, 4), }"));
  EXPECT_EQ(bytes.size(), 10 + header_len + t.data().size());

  absl::StatusOr<v1::Tensor> back = ReadNpy(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->dtype(), v1::DTYPE_F32);
  EXPECT_THAT(back->shape(), ::testing::ElementsAre(2, 3, 4));
  EXPECT_EQ(back->data(), t.data());
}

TEST_F(NpyTest, BF16RoundTripIsBitExact) {
  const v1::Tensor t = RandomTensor(v1::DTYPE_BF16, {5}, 3).value();
  const std::string path = Path("bf16.npy");
  ASSERT_TRUE(WriteNpy(path, t).ok());
  EXPECT_THAT(ReadBytes(path), HasSubstr("'descr': '<u2'"));
  EXPECT_THAT(ReadBytes(path), HasSubstr("'shape': (5,)"));
  absl::StatusOr<v1::Tensor> back = ReadNpy(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->dtype(), v1::DTYPE_BF16);
  EXPECT_THAT(back->shape(), ::testing::ElementsAre(5));
  EXPECT_EQ(back->data(), t.data());

  const v1::Tensor scalar = MakeF32({}, {7.25f}).value();
  ASSERT_TRUE(WriteNpy(Path("scalar.npy"), scalar).ok());
  EXPECT_THAT(ReadBytes(Path("scalar.npy")), HasSubstr("'shape': ()"));
  back = ReadNpy(Path("scalar.npy"));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->shape_size(), 0);
  EXPECT_EQ(Floats(*back), std::vector<float>{7.25f});
}

TEST_F(NpyTest, ReadsNumpyFilesVersion1And2) {
  const std::vector<float> six = {0, 1, 2, 3, 4, 5};
  for (int major : {1, 2}) {
    const std::string path =
        WriteBytes(absl::StrCat("v", major, ".npy"),
                   NpyFile(major, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
                           RawBytes(six)));
    absl::StatusOr<v1::Tensor> t = ReadNpy(path);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->dtype(), v1::DTYPE_F32);
    EXPECT_THAT(t->shape(), ::testing::ElementsAre(2, 3));
    EXPECT_EQ(Floats(*t), six);
  }
  // np.save of np.float32(3.5): shape (); Python 2 style "L" longs and
  // double quotes are read too.
  absl::StatusOr<v1::Tensor> t = ReadNpy(
      WriteBytes("scalar.npy", NpyFile(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (), }",
                                       RawBytes(std::vector<float>{3.5f}))));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->shape_size(), 0);
  EXPECT_EQ(Floats(*t), std::vector<float>{3.5f});
  t = ReadNpy(WriteBytes("py2.npy", NpyFile(1,
                                            "{\"descr\": \"<f4\", \"fortran_order\": False, "
                                            "\"shape\": (1L, 2L)}",
                                            RawBytes(std::vector<float>{1, 2}))));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(t->shape(), ::testing::ElementsAre(1, 2));
}

TEST_F(NpyTest, ConvertsF8AndF2AndReadsBF16Void) {
  const std::vector<double> d = {0.1, -2.25, 1e300, 1e-300};
  absl::StatusOr<v1::Tensor> t = ReadNpy(WriteBytes(
      "f8.npy",
      NpyFile(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (4,), }", RawBytes(d))));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->dtype(), v1::DTYPE_F32);
  const std::vector<float> f = Floats(*t);
  ASSERT_EQ(f.size(), 4u);
  EXPECT_EQ(f[0], 0.1f);
  EXPECT_EQ(f[1], -2.25f);
  EXPECT_EQ(f[2], std::numeric_limits<float>::infinity());
  EXPECT_EQ(f[3], 0.0f);

  // half: 1, -2, the smallest subnormal 2^-24, 65504, +inf.
  const std::vector<uint16_t> h = {0x3c00, 0xc000, 0x0001, 0x7bff, 0x7c00};
  t = ReadNpy(WriteBytes(
      "f2.npy",
      NpyFile(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (5,), }", RawBytes(h))));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(Floats(*t), (std::vector<float>{1.0f, -2.0f, 0x1p-24f, 65504.0f,
                                            std::numeric_limits<float>::infinity()}));

  const std::vector<uint16_t> bf = {0x3f80, 0xc020};
  t = ReadNpy(WriteBytes(
      "v2.npy",
      NpyFile(1, "{'descr': '|V2', 'fortran_order': False, 'shape': (2,), }", RawBytes(bf))));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(Floats(*t), (std::vector<float>{1.0f, -2.5f}));
}

TEST_F(NpyTest, RejectsBadFilesNamingFileAndProblem) {
  const std::string f4 = RawBytes(std::vector<float>{0, 1, 2, 3, 4, 5});
  const std::string good_dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  const std::string good = NpyFile(1, good_dict, f4);
  struct Case {
    std::string name, bytes, problem;
  };
  std::string past_end = good.substr(0, 10);
  past_end[8] = '\xff';
  past_end[9] = '\x7f';
  const std::vector<Case> cases = {
      {"magic", std::string("\x93NUMPX\x01\x00", 8) + good.substr(8), "magic"},
      {"empty", "", "magic"},
      {"version", std::string("\x93NUMPY\x04\x00", 8) + good.substr(8), "version 4.0"},
      {"short_len", good.substr(0, 9), "header length"},
      {"past_end", past_end, "runs past the end"},
      {"truncated_header", good.substr(0, 40), "runs past the end"},
      {"no_brace", NpyFile(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), ", f4),
       "malformed header"},
      {"not_dict", NpyFile(1, "['descr', '<f4']", f4), "not a dict"},
      {"missing_key", NpyFile(1, "{'descr': '<f4', 'shape': (2, 3)}", f4), "must have the keys"},
      {"extra_key",
       NpyFile(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (6,), 'x': 1}", f4),
       "unexpected key 'x'"},
      {"bad_shape", NpyFile(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3)}", f4),
       "non-negative integers"},
      {"bad_bool", NpyFile(1, "{'descr': '<f4', 'fortran_order': 0, 'shape': (6,)}", f4),
       "True or False"},
      {"unknown_descr", NpyFile(1, "{'descr': '<i4', 'fortran_order': False, 'shape': (6,)}", f4),
       "unsupported dtype '<i4'"},
      {"structured",
       NpyFile(1, "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (6,)}", f4),
       "structured"},
      {"big_endian", NpyFile(1, "{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3)}", f4),
       "big-endian"},
      {"fortran", NpyFile(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3)}", f4),
       "Fortran order"},
      {"overflow",
       NpyFile(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296)}",
               f4),
       "too large"},
      {"huge_dim",
       NpyFile(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}", f4),
       "64 bits"},
      {"short_data", NpyFile(1, good_dict, f4.substr(0, 20)), "truncated: shape (2, 3)"},
      {"long_data", NpyFile(1, good_dict, f4 + "xx"), "trailing bytes"},
  };
  for (const Case& c : cases) {
    const std::string path = WriteBytes(c.name + ".npy", c.bytes);
    absl::Status s = ReadNpy(path).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(path)) << c.name;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.problem)) << c.name;
  }
  // The good file itself reads, so each case fails for its own reason.
  EXPECT_TRUE(ReadNpy(WriteBytes("good.npy", good)).ok());
}

// The header is read and checked before the data: a file that is not .npy
// was read whole first (a 3 GiB file cost 4.2 GB of RSS, /dev/zero grew
// until killed). A pipe that sends a few bad bytes and stays open is refused
// at once (the whole-file read waited for its end), and a file larger than
// the limit is refused from its header.
TEST_F(NpyTest, ReadsTheHeaderBeforeTheData) {
  const std::string fifo = Path("pipe.npy");
  std::remove(fifo.c_str());  // from an earlier run
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0) << errno;
  absl::Notification done;
  std::thread writer([&] {
    const int fd = open(fifo.c_str(), O_WRONLY);
    if (fd < 0) return;
    const char junk[] = "not a .npy file at all";
    (void)!write(fd, junk, sizeof(junk));
    done.WaitForNotificationWithTimeout(absl::Seconds(10));  // held open, no end of file
    close(fd);
  });
  const absl::Time start = absl::Now();
  absl::Status s = ReadNpy(fifo).status();
  const absl::Duration took = absl::Now() - start;
  done.Notify();
  writer.join();
  std::remove(fifo.c_str());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr(fifo), HasSubstr("magic")));
  EXPECT_LT(took, absl::Seconds(5));

  // 1 GiB of f32 as the header says, sparse (no disk): refused unread.
  const std::string big =
      WriteBytes("big.npy", NpyFile(1, "{'descr': '<f4', 'fortran_order': False, "
                                       "'shape': (268435456,), }", ""));
  const int64_t header_bytes = static_cast<int64_t>(ReadBytes(big).size());
  ASSERT_EQ(truncate(big.c_str(), header_bytes + (int64_t{1} << 30)), 0) << errno;
  s = ReadNpy(big, int64_t{256} << 20, "max_message_bytes").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(),
              HasSubstr(absl::StrCat(big, ": shape (268435456,) of '<f4' is 1073741824 bytes, "
                                          "more than max_message_bytes 268435456; not read")));
  // Its size is checked against the header before its data is read too.
  ASSERT_EQ(truncate(big.c_str(), header_bytes + (int64_t{1} << 30) + 1), 0) << errno;
  s = ReadNpy(big).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("trailing bytes"));
  std::remove(big.c_str());
  // f16 and f64 count as the f32 tensor they become (what a request
  // carries), not their data: an f64 file of 800 bytes is a 400-byte tensor.
  const std::string f2 = WriteBytes(
      "f2.npy", NpyFile(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (100,), }",
                        std::string(200, '\0')));
  s = ReadNpy(f2, 300, "the limit").status();
  EXPECT_THAT(s.message(), HasSubstr("is 400 bytes as f32, more than the limit 300"));
  EXPECT_TRUE(ReadNpy(f2, 400, "the limit").ok());
  const std::string f8 = WriteBytes(
      "f8.npy", NpyFile(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (100,), }",
                        std::string(800, '\0')));
  EXPECT_TRUE(ReadNpy(f8, 400, "the limit").ok());
  s = ReadNpy(f8, 399, "the limit").status();
  EXPECT_THAT(s.message(), HasSubstr("is 400 bytes as f32, more than the limit 399"));
  // A header length past 1 MiB is refused before it is read.
  std::string huge_header("\x93NUMPY\x02\x00\x00\x00\x00\x40", 12);  // 1 GiB header
  huge_header.append(64, ' ');
  const std::string huge = WriteBytes("huge_header.npy", huge_header);
  ASSERT_EQ(truncate(huge.c_str(), 12 + (int64_t{1} << 30)), 0) << errno;  // sparse
  s = ReadNpy(huge).status();
  EXPECT_THAT(s.message(), HasSubstr("header length 1073741824 is more than 1048576 bytes"));
  std::remove(huge.c_str());
}

TEST_F(NpyTest, FileErrors) {
  const std::string missing = Path("does_not_exist.npy");
  absl::Status s = ReadNpy(missing).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr(missing));

  const std::string no_dir = Path("no_such_dir/x.npy");
  s = WriteNpy(no_dir, MakeF32({1}, {1.0f}).value());
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr(no_dir));

  v1::Tensor bad = MakeF32({2}, {1.0f, 2.0f}).value();
  bad.mutable_data()->append("x");
  const std::string path = Path("bad.npy");
  s = WriteNpy(path, bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(path));
  EXPECT_EQ(ReadNpy(path).status().code(), absl::StatusCode::kNotFound);  // nothing written
}

// -------------------------------------------------------------- models --

// Norm-wise relative error ||a - b|| / ||b||.
double RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

TEST_F(ClientTest, ListModelsAndGetModelDescribeTheDemoModel) {
  auto models = client_->ListModels();
  ASSERT_TRUE(models.ok()) << models.status();
  ASSERT_EQ(models->size(), 1u);
  const v1::ModelInfo& m = (*models)[0];
  EXPECT_EQ(m.name(), "demo");
  EXPECT_EQ(m.source(), "built-in");
  EXPECT_EQ(m.hidden_size(), 128);
  EXPECT_EQ(m.heads(), 8);
  EXPECT_EQ(m.kv_heads(), 2);
  // The deprecated config.json names carry the same values.
  EXPECT_EQ(m.num_heads(), 8);
  EXPECT_EQ(m.num_kv_heads(), 2);
  EXPECT_EQ(m.head_dim(), 16);
  EXPECT_EQ(m.vocab_size(), 256);
  EXPECT_EQ(m.num_layers(), 2);
  EXPECT_EQ(m.positions(), v1::POSITION_KIND_ROPE);
  EXPECT_EQ(m.rope().scaling().rope_type(), "llama3");
  EXPECT_EQ(m.rope().scaling().factor(), 8);
  ASSERT_EQ(m.inv_freq_size(), 8);  // head_dim / 2 pairs
  EXPECT_DOUBLE_EQ(m.inv_freq(0), 1.0);
  for (int i = 1; i < 8; ++i) EXPECT_LT(m.inv_freq(i), m.inv_freq(i - 1)) << i;
  EXPECT_GT(m.resident_bytes(), 0);

  auto one = client_->GetModel("demo");
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->SerializeAsString(), m.SerializeAsString());

  // The inverse frequencies are those of the model's RoPE rule.
  v1::EncodeRequest encode;
  *encode.mutable_rope_frequencies()->mutable_rope() = m.rope();
  encode.mutable_rope_frequencies()->set_head_dim(m.head_dim());
  encode.mutable_rope_frequencies()->set_seq_len(m.max_positions());
  auto freqs = client_->Encode(encode);
  ASSERT_TRUE(freqs.ok()) << freqs.status();
  ASSERT_EQ(freqs->inv_freq_size(), 8);
  for (int i = 0; i < 8; ++i) EXPECT_DOUBLE_EQ(freqs->inv_freq(i), m.inv_freq(i)) << i;
  EXPECT_DOUBLE_EQ(freqs->attention_factor(), m.attention_factor());

  auto missing = client_->GetModel("no-such-model");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("no-such-model"));
}

TEST_F(ClientTest, EmbedRowsDependOnTheIdOnly) {
  v1::EmbedRequest request;
  request.set_model("demo");
  for (int64_t id : {5, 7, 5, 9, 7, 5}) request.add_token_ids(id);
  request.add_shape(2);
  request.add_shape(3);
  auto response = client_->Embed(request);
  ASSERT_TRUE(response.ok()) << response.status();
  const v1::Tensor& e = response->embeddings();
  EXPECT_EQ(e.dtype(), v1::DTYPE_F32);
  ASSERT_THAT(e.shape(), ::testing::ElementsAre(2, 3, 128));
  const std::vector<float> v = Floats(e);
  auto row = [&](int r) {
    return std::vector<float>(v.begin() + r * 128, v.begin() + r * 128 + 128);
  };
  // The same id gives the same row, at any position and in any batch row.
  EXPECT_EQ(row(0), row(2));
  EXPECT_EQ(row(0), row(5));
  EXPECT_EQ(row(1), row(4));
  // Different ids differ.
  EXPECT_NE(row(0), row(1));
  EXPECT_NE(row(0), row(3));
  EXPECT_NE(row(1), row(3));

  // Embedding the same id again (another call, default shape [1, N]) gives
  // identical rows.
  v1::EmbedRequest again;
  again.set_model("demo");
  again.add_token_ids(7);
  again.add_token_ids(5);
  auto second = client_->Embed(again);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_THAT(second->embeddings().shape(), ::testing::ElementsAre(1, 2, 128));
  const std::vector<float> w = Floats(second->embeddings());
  EXPECT_EQ(std::vector<float>(w.begin(), w.begin() + 128), row(1));
  EXPECT_EQ(std::vector<float>(w.begin() + 128, w.end()), row(0));
}

TEST_F(ClientTest, EmbedOutOfVocabularyIsInvalidArgumentNamingIdAndIndex) {
  v1::EmbedRequest request;
  request.set_model("demo");
  for (int64_t id : {1, 2, 3, 256, 4}) request.add_token_ids(id);
  auto response = client_->Embed(request);
  EXPECT_EQ(response.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(response.status().message()),
              ::testing::AllOf(HasSubstr("256"), HasSubstr("token_ids[3]")));

  request.set_token_ids(3, -1);
  response = client_->Embed(request);
  EXPECT_EQ(response.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(response.status().message()),
              ::testing::AllOf(HasSubstr("-1"), HasSubstr("token_ids[3]")));

  request.set_model("no-such-model");
  request.set_token_ids(3, 0);
  EXPECT_EQ(client_->Embed(request).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ClientTest, LayerModeDecodeTokenByTokenMatchesOneShotAttend) {
  constexpr int64_t kTokens = 7, kHidden = 128;
  const int64_t shape[] = {1, kTokens, kHidden};
  auto hidden = RandomTensor(v1::DTYPE_F32, shape, 21);
  ASSERT_TRUE(hidden.ok()) << hidden.status();

  v1::AttendRequest request;
  request.mutable_spec()->set_causal(true);
  request.mutable_layer()->set_model("demo");
  request.mutable_layer()->set_layer(1);
  *request.mutable_layer()->mutable_hidden() = *hidden;
  auto one_shot = client_->Attend(request);
  ASSERT_TRUE(one_shot.ok()) << one_shot.status();
  ASSERT_THAT(one_shot->out().shape(), ::testing::ElementsAre(1, kTokens, kHidden));
  const std::vector<float> want = Floats(one_shot->out());

  v1::OpenSession open;
  open.mutable_spec()->set_causal(true);
  open.set_model("demo");
  open.set_layer(1);
  open.set_max_context(kTokens);
  auto session = client_->OpenSession(open);
  ASSERT_TRUE(session.ok()) << session.status();
  const std::vector<float> all = Floats(*hidden);
  std::vector<float> last;
  for (int64_t t = 0; t < kTokens; ++t) {
    const int64_t step_shape[] = {1, 1, kHidden};
    auto token = MakeF32(step_shape, absl::MakeConstSpan(all).subspan(t * kHidden, kHidden));
    ASSERT_TRUE(token.ok()) << token.status();
    auto result = (*session)->StepHidden(*token);
    ASSERT_TRUE(result.ok()) << "token " << t << ": " << result.status();
    EXPECT_EQ(result->position(), t + 1);
    ASSERT_THAT(result->out().shape(), ::testing::ElementsAre(1, 1, kHidden));
    last = Floats(result->out());
    // Every step equals its row of the one-shot causal attention.
    const std::vector<float> row(want.begin() + t * kHidden, want.begin() + (t + 1) * kHidden);
    EXPECT_LT(RelativeError(last, row), 1e-5) << "token " << t;
  }
  EXPECT_EQ((*session)->position(), kTokens);
  // A q/k/v step has no place in a layer-mode session.
  const int64_t q_shape[] = {1, 1, 8, 16};
  auto q = RandomTensor(v1::DTYPE_F32, q_shape, 1);
  EXPECT_FALSE((*session)->Step(*q, *q, *q).ok());
  EXPECT_TRUE((*session)->Close().ok());
}


// Connect refuses `target` with INVALID_ARGUMENT, saying `says`.
void ExpectTargetRefused(const char* target, const char* says) {
  ClientOptions o;
  o.target = target;
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
  ASSERT_FALSE(c.ok()) << target;
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << target;
  EXPECT_THAT(c.status().message(), HasSubstr(says)) << target;
}

// A target the resolver would choke on later gets a hint at once.
TEST(ClientOptionsTest, TargetsWithoutPortOrAsUrlsGetAHint) {
  const std::pair<const char*, const char*> bad[] = {
      {"127.0.0.1", "has no port; give host:port, e.g. 127.0.0.1:50051"},
      {"localhost:", "has no port"},
      {"[::1]", "has no port"},
      {"http://127.0.0.1:50051", "is a URL; give host:port"},
      {"https://ropeattn.example.com", "--tls_ca_file"},
  };
  for (const auto& [target, says] : bad) ExpectTargetRefused(target, says);
  for (const char* good : {"127.0.0.1:50051", "[::1]:50051", "dns:///ropeattn:50051",
                           "unix:/tmp/ropeattn.sock"}) {
    ClientOptions o;
    o.target = good;
    EXPECT_TRUE(Client::Connect(o).ok()) << good;
  }
  ClientOptions many;
  many.targets = {"127.0.0.1:50051", "10.0.0.2"};
  EXPECT_THAT(Client::Connect(many).status().message(), HasSubstr("targets[1] \"10.0.0.2\" has no port"));
}

// A port past 65535 was passed through: gRPC's resolver keeps its low 16
// bits, so 127.0.0.1:114146 dialed port 48610 (and would have sent the
// token there). Every target form with a port is checked; a port is 1..65535.
TEST(ClientOptionsTest, TargetPortsOutsideTheRangeAreRefusedInEveryForm) {
  const std::pair<const char*, const char*> bad[] = {
      {"127.0.0.1:114146", "target \"127.0.0.1:114146\": the port must be a number in 1..65535, "
                           "got \"114146\""},
      {"127.0.0.1:65536", "got \"65536\""},
      {"127.0.0.1:0", "got \"0\""},
      {"127.0.0.1:+80", "got \"+80\""},
      {"127.0.0.1:80x", "got \"80x\""},
      {"[::1]:99999", "got \"99999\""},
      {"[::1]x", "after its IPv6 address"},
      {"::1:50051", "write an IPv6 address in brackets"},
      {":50051", "has no host"},
      {"dns:///localhost:70000", "got \"70000\""},
      {"dns://8.8.8.8:99999/localhost:50051", "(its DNS server)"},
      {"dns:///localhost:", "has no port"},
      {"ipv4:127.0.0.1:50051,127.0.0.1:114146", "address \"127.0.0.1:114146\": the port"},
      {"ipv4:127.0.0.1", "has no port"},
      {"ipv4:///127.0.0.1:0", "got \"0\""},
      {"ipv6:[::1]:65536", "got \"65536\""},
      {"ipv6:[::1]", "has no port"},
      {"ipv4:[::1]:50051", "is not IPv4 address:port"},
      {"unix:", "has no socket path"},
  };
  for (const auto& [target, says] : bad) ExpectTargetRefused(target, says);
  for (const char* good :
       {"127.0.0.1:1", "localhost:65535", "[::1]:65535", "dns:///localhost", "dns:localhost:80",
        "dns://8.8.8.8:53/localhost:50051", "ipv4:127.0.0.1:50051,127.0.0.2:50052",
        "ipv4:///127.0.0.1:50051", "ipv6:[::1]:50051", "unix:///tmp/ropeattn.sock",
        "unix-abstract:ropeattn", "xds:///ropeattn"}) {
    ClientOptions o;
    o.target = good;
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
    EXPECT_TRUE(c.ok()) << good << ": " << c.status();
  }
  ClientOptions many;
  many.targets = {"127.0.0.1:50051", "127.0.0.1:114146"};
  EXPECT_THAT(Client::Connect(many).status().message(),
              HasSubstr("targets[1] \"127.0.0.1:114146\": the port must be a number in 1..65535"));
}

}  // namespace
}  // namespace ropeattn::client
