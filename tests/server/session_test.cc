// Decoding sessions, health, reflection, limits and shutdown, against a real
// server on a loopback port. Numerical checks compare each step with the fp64
// reference (tests/reference/) run over the session's whole prefix.
// Tolerances: f32 KV 1e-5 relative (norm-wise), bf16 KV 1e-2.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <sstream>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/attention_kernels.h"
#include "core/decode_state.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/util/json_util.h"
#include "reflection_wire.grpc.pb.h"
#include "server/decode_wire.h"
#include "server/log.h"
#include "server/model.h"
#include "server/service.h"
#include "server/sessions.h"
#include "tests/core/test_util.h"
#include "tests/reference/attention_ref.h"
#include "tests/reference/linear_attention_ref.h"
#include "tests/reference/rope_ref.h"
#include "tests/server/server_test_util.h"
#include "tests/tools/server_output.h"

namespace ropeattn::testing {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;

// ---------------------------------------------------------------- setup --

struct Config {
  std::string name;
  int64_t heads = 4, kv_heads = 4, head_dim = 16, v_dim = 16;
  std::string rope_type;  // empty: no RoPE
  double factor = 1;
  int64_t original = 0;
  bool interleaved = false;
  int64_t rotary_dim = 0;
  bool bf16_kv = false;
  bool linear = false;
  int64_t window = 0;
  bool alibi = false;
  int64_t start = 0;  // open.start_position
};

v1::OpenSession MakeOpen(const Config& c, int64_t max_context = 64, bool resumable = false) {
  v1::OpenSession o;
  v1::AttentionSpec* s = o.mutable_spec();
  s->set_heads(c.heads);
  s->set_kv_heads(c.kv_heads);
  s->set_head_dim(c.head_dim);
  s->set_window(c.window);
  if (c.alibi) s->mutable_alibi();
  if (!c.rope_type.empty()) {
    v1::RopeSpec* r = s->mutable_rope();
    r->set_layout(c.interleaved ? v1::ROPE_LAYOUT_INTERLEAVED : v1::ROPE_LAYOUT_HALF_SPLIT);
    r->set_rotary_dim(c.rotary_dim);
    r->mutable_scaling()->set_rope_type(c.rope_type);
    r->mutable_scaling()->set_factor(c.factor);
    r->mutable_scaling()->set_original_max_position_embeddings(c.original);
    if (c.rope_type == "longrope") {
      const int64_t half = (c.rotary_dim ? c.rotary_dim : c.head_dim) / 2;
      for (int64_t i = 0; i < half; ++i) {
        r->mutable_scaling()->add_short_factor(1.0 + 0.05 * i);
        r->mutable_scaling()->add_long_factor(1.5 + 0.3 * i);
      }
    }
  }
  o.set_kv_dtype(c.bf16_kv ? v1::DTYPE_BF16 : v1::DTYPE_F32);
  o.set_kind(c.linear ? v1::ATTENTION_KIND_LINEAR : v1::ATTENTION_KIND_SOFTMAX);
  o.set_max_context(max_context);
  o.set_v_dim(c.v_dim);
  o.set_resumable(resumable);
  o.set_start_position(c.start);
  return o;
}

// Inverse frequencies and attention factor the reference uses for a length.
std::pair<std::vector<double>, double> RefFreqs(const Config& c, int64_t len) {
  const int64_t d = c.rotary_dim ? c.rotary_dim : c.head_dim;
  const double base = 10000;
  if (c.rope_type == "yarn") {
    ref::YarnRefParams p;
    p.factor = c.factor;
    p.original_len = c.original;
    return {ref::YarnInvFreq(d, base, p), ref::YarnAttentionFactor(p)};
  }
  if (c.rope_type == "dynamic") {
    return {ref::DynamicNtkInvFreq(d, base, c.factor, c.original, len), 1.0};
  }
  if (c.rope_type == "llama3") {
    return {ref::Llama3InvFreq(d, base, c.factor, 1.0, 4.0, c.original), 1.0};
  }
  if (c.rope_type == "longrope") {
    std::vector<double> sf, lf;
    for (int64_t i = 0; i < d / 2; ++i) {
      sf.push_back(1.0 + 0.05 * i);
      lf.push_back(1.5 + 0.3 * i);
    }
    return {ref::LongRopeInvFreq(d, base, sf, lf, c.original, len),
            ref::LongRopeAttentionFactor(c.factor, c.original, std::nullopt)};
  }
  return {ref::DefaultInvFreq(d, base), 1.0};
}

// Random step inputs for a whole sequence: q [S, H, D], k [S, Hkv, D], v [S, Hkv, Dv].
struct Sequence {
  Tensor q, k, v;
};

Sequence MakeSequence(const Config& c, int64_t len, uint64_t seed) {
  const DType kv = c.bf16_kv ? DType::kBF16 : DType::kF32;
  return {RandomTensor(DType::kF32, {1, len, c.heads, c.head_dim}, seed),
          RandomTensor(kv, {1, len, c.kv_heads, c.head_dim}, seed + 1),
          RandomTensor(kv, {1, len, c.kv_heads, c.v_dim}, seed + 2)};
}

// Expected output rows [first, last) of a step that ends the session at
// length `last`: the reference over the whole prefix, rotated with the
// frequencies for that length.
std::vector<double> ExpectedStep(const Config& c, const Sequence& seq, int64_t first,
                                 int64_t last) {
  std::vector<double> q = ToDoubles(seq.q.cview().Slice(1, 0, last));
  std::vector<double> k = ToDoubles(seq.k.cview().Slice(1, 0, last));
  std::vector<double> v = ToDoubles(seq.v.cview().Slice(1, 0, last));
  std::vector<int64_t> positions(last);
  for (int64_t i = 0; i < last; ++i) positions[i] = c.start + i;
  std::vector<double> qr = q, kr = k;
  auto [inv, factor] = RefFreqs(c, c.start + last);
  if (!c.rope_type.empty()) {
    ref::RotateRefParams rp;
    rp.seq = last;
    rp.head_dim = c.head_dim;
    rp.rotary_dim = c.rotary_dim ? c.rotary_dim : c.head_dim;
    rp.interleaved = c.interleaved;
    rp.positions = positions;
    rp.inv_freq = inv;
    rp.attention_factor = factor;
    rp.heads = c.heads;
    qr = ref::Rotate(rp, q);
    rp.heads = c.kv_heads;
    kr = ref::Rotate(rp, k);
  }
  std::vector<double> all;
  if (c.linear) {
    ref::LinearAttentionRefParams lp;
    lp.seq = last;
    lp.heads = c.heads;
    lp.kv_heads = c.kv_heads;
    lp.head_dim = c.head_dim;
    lp.v_dim = c.v_dim;
    lp.use_rope = !c.rope_type.empty();
    lp.rotary_dim = c.rotary_dim ? c.rotary_dim : c.head_dim;
    lp.interleaved = c.interleaved;
    lp.inv_freq = inv;
    lp.attention_factor = factor;
    lp.positions = positions;
    all = ref::LinearAttention(lp, q, k, v);
  } else {
    ref::AttentionRefParams ap;
    ap.q_len = last;
    ap.k_len = last;
    ap.heads = c.heads;
    ap.kv_heads = c.kv_heads;
    ap.head_dim = c.head_dim;
    ap.v_dim = c.v_dim;
    ap.causal = true;
    ap.window = c.window;
    if (c.alibi) {
      ap.bias = ref::RefBias::kAlibi;
      // Standard slopes for a power-of-two head count: 2^(-8k/H).
      for (int64_t h = 1; h <= c.heads; ++h)
        ap.alibi_slopes.push_back(std::pow(2.0, -8.0 * h / c.heads));
    }
    all = ref::Attention(ap, qr, kr, v).out;
  }
  const int64_t row = c.heads * c.v_dim;
  return std::vector<double>(all.begin() + first * row, all.begin() + last * row);
}

// The server's memory budget in use, as GetServerInfo reports it.
int64_t MemoryInUse(v1::AttentionService::Stub* stub) {
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  EXPECT_TRUE(stub->GetServerInfo(&ctx, {}, &info).ok());
  return info.memory_bytes_in_use();
}

// A Decode stream.
class Stream {
 public:
  explicit Stream(v1::AttentionService::Stub* stub) {
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    rw_ = stub->Decode(&ctx_);
  }
  ~Stream() {
    if (!finished_) {
      ctx_.TryCancel();
      Finish();
    }
  }
  v1::DecodeResponse Send(const v1::DecodeRequest& req) {
    v1::DecodeResponse resp;
    EXPECT_TRUE(rw_->Write(req));
    EXPECT_TRUE(rw_->Read(&resp)) << "stream ended: " << Finish().error_message();
    return resp;
  }
  v1::SessionInfo Open(const v1::OpenSession& open) {
    v1::DecodeRequest req;
    *req.mutable_open() = open;
    v1::DecodeResponse r = Send(req);
    EXPECT_TRUE(r.has_opened()) << r.DebugString();
    return r.opened();
  }
  v1::SessionInfo Attach(const std::string& id) {
    v1::DecodeRequest req;
    req.mutable_attach()->set_session_id(id);
    v1::DecodeResponse r = Send(req);
    EXPECT_TRUE(r.has_opened()) << r.DebugString();
    return r.opened();
  }
  v1::DecodeResponse Step(const Sequence& s, int64_t first, int64_t last, uint64_t seq) {
    v1::DecodeRequest req;
    v1::Step* st = req.mutable_step();
    st->set_seq(seq);
    *st->mutable_q() = ToWire(s.q.cview().Slice(1, first, last - first));
    *st->mutable_k() = ToWire(s.k.cview().Slice(1, first, last - first));
    *st->mutable_v() = ToWire(s.v.cview().Slice(1, first, last - first));
    return Send(req);
  }
  // Waits for the server to end the stream (without half-closing it).
  grpc::Status AwaitServerEnd() {
    v1::DecodeResponse drain;
    while (rw_->Read(&drain)) {
    }
    status_ = rw_->Finish();
    finished_ = true;
    return status_;
  }
  grpc::Status Finish() {
    if (finished_) return status_;
    rw_->WritesDone();
    v1::DecodeResponse drain;
    while (rw_->Read(&drain)) {
    }
    status_ = rw_->Finish();
    finished_ = true;
    return status_;
  }
  grpc::ClientContext& context() { return ctx_; }
  grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>* rw() { return rw_.get(); }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> rw_;
  bool finished_ = false;
  grpc::Status status_;
};

class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = StartTestServer(TestServerOptions());
    ASSERT_NE(server_, nullptr);
    stub_ = TestStub(server_->port());
  }
  void TearDown() override {
    stub_.reset();
    if (server_) server_->Shutdown(absl::Seconds(1));
  }
  // Replaces the fixture's server with one started with `o` (null on error).
  void Restart(const server::ServerOptions& o) {
    server_->Shutdown(absl::Seconds(1));
    server_ = StartTestServer(o);
    if (server_ != nullptr) stub_ = TestStub(server_->port());
  }
  // A server with room for a step of seconds (LongStepConfig, 1 GiB budget,
  // 128 MiB messages) and, when `workers` > 0, that many compute workers.
  void RestartForLongSteps(int workers) {
    server::ServerOptions o = TestServerOptions();
    o.memory_budget_bytes = int64_t{1} << 30;
    o.max_message_bytes = 128 << 20;  // the step
    if (workers > 0) o.compute_workers = workers;
    Restart(o);
    ASSERT_NE(server_, nullptr);
  }
  static Config LongStepConfig() { return Config{"mha", 4, 4, 128, 128, "default"}; }
  // Opens `s` and sends it a 16384-token prefill (seconds on one thread);
  // returns once it computes.
  void StartLongStep(Stream& s) {
    constexpr int64_t kTokens = 16384;
    const Config c = LongStepConfig();
    const Sequence seq = MakeSequence(c, kTokens, 11);
    s.Open(MakeOpen(c, kTokens + 8));
    ASSERT_TRUE(s.rw()->Write(StepOf(seq, 1)));
    ASSERT_TRUE(Eventually([&] {
      return absl::StrContains(server_->metrics().RenderPrometheus(), "\nropeattn_running 1\n");
    }));
  }
  // Opens `s` and sends it a two-token step, which waits behind the long
  // one (one worker); returns once it is queued.
  void QueueSmallStep(Stream& s) {
    const Config c = LongStepConfig();
    const Sequence small = MakeSequence(c, 2, 12);
    s.Open(MakeOpen(c, 8));
    ASSERT_TRUE(s.rw()->Write(StepOf(small, 1)));
    ASSERT_TRUE(Eventually([&] {
      return absl::StrContains(server_->metrics().RenderPrometheus(),
                               "\nropeattn_queue_depth 1\n");
    }));
  }
  static v1::DecodeRequest StepOf(const Sequence& seq, int64_t n) {
    v1::DecodeRequest step;
    step.mutable_step()->set_seq(n);
    *step.mutable_step()->mutable_q() = ToWire(seq.q.cview());
    *step.mutable_step()->mutable_k() = ToWire(seq.k.cview());
    *step.mutable_step()->mutable_v() = ToWire(seq.v.cview());
    return step;
  }
  // Waits (up to 5 s) for a condition the server reaches asynchronously.
  template <typename F>
  bool Eventually(F f) {
    for (int i = 0; i < 500; ++i) {
      if (f()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return f();
  }
  std::unique_ptr<server::Server> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

// --------------------------------------------------- health, reflection --

TEST_F(SessionTest, HealthIsServingAndFollowsTheComputePath) {
  auto health = grpc::health::v1::Health::NewStub(TestChannel(server_->port()));
  for (const std::string service : {"", "ropeattn.v1.AttentionService"}) {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    ASSERT_TRUE(health->Check(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING) << service;
  }
  server_->SetServingForTest(false);
  grpc::ClientContext ctx;
  grpc::health::v1::HealthCheckResponse resp;
  ASSERT_TRUE(health->Check(&ctx, {}, &resp).ok());
  EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
}

// A health Watch gets a status when it starts and then only when the status
// changes: the canary's rounds (every 2 s) each set SERVING again, and gRPC's
// health service sent every one of them to every watcher.
TEST(HealthWatchTest, SendsAStatusOnlyWhenItChanges) {
  auto server = StartTestServer(TestServerOptions());
  ASSERT_NE(server, nullptr);
  auto health = grpc::health::v1::Health::NewStub(TestChannel(server->port()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(4500));
  auto reader = health->Watch(&ctx, {});
  grpc::health::v1::HealthCheckResponse r;
  ASSERT_TRUE(reader->Read(&r));
  EXPECT_EQ(r.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  int more = 0;
  while (reader->Read(&r)) ++more;  // two canary rounds pass before the deadline
  EXPECT_EQ(more, 0) << "last: " << r.ShortDebugString();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
}

// Health Watch streams (which need no token) and reflection streams are
// capped (14,000 idle ones took 260 MiB outside a 32 MiB budget), not
// charged to the memory budget (unauthenticated Watch streams would fill it
// and refuse everyone's work): one past the cap is cancelled at once, and
// its slot comes back when a stream ends.
TEST(StreamChargeTest, HealthWatchStreamsAreCappedOutsideTheBudget) {
  server::ServerOptions o = TestServerOptions();
  o.max_service_streams = 3;
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto channel = TestChannel(server->port());
  auto health = grpc::health::v1::Health::NewStub(channel);
  auto stub = TestStub(server->port());
  const auto in_use = [&] { return MemoryInUse(stub.get()); };
  struct Watch {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<grpc::health::v1::HealthCheckResponse>> reader;
  };
  auto start = [&](Watch& w) {
    w.ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    w.reader = health->Watch(&w.ctx, {});
    grpc::health::v1::HealthCheckResponse r;
    return w.reader->Read(&r) && r.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  };
  auto end = [](Watch& w) {
    w.ctx.TryCancel();
    grpc::health::v1::HealthCheckResponse r;
    while (w.reader->Read(&r)) {
    }
    return w.reader->Finish();
  };
  std::vector<std::unique_ptr<Watch>> watches;
  for (int i = 0; i < 3; ++i) {
    watches.push_back(std::make_unique<Watch>());
    ASSERT_TRUE(start(*watches.back()));
  }
  EXPECT_EQ(in_use(), 0);
  {
    Watch past;
    EXPECT_FALSE(start(past));
    EXPECT_EQ(end(past).error_code(), grpc::StatusCode::CANCELLED);
  }
  (void)end(*watches.back());
  watches.pop_back();
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  bool again = false;
  while (!again && absl::Now() < deadline) {  // the slot comes back as the call ends
    Watch w;
    again = start(w);
    (void)end(w);
  }
  EXPECT_TRUE(again);
  for (auto& w : watches) (void)end(*w);
  server->Shutdown(absl::Seconds(1));
}

// Reflection lists our service and health, and every listed service can be
// described (grpcurl describe / list methods): reflection finds the file
// that defines it.
void ExpectEveryListedServiceDescribable(int port) {
  auto refl = grpc::reflection::v1alpha::ServerReflection::NewStub(TestChannel(port));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto rw = refl->ServerReflectionInfo(&ctx);
  grpc::reflection::v1alpha::ServerReflectionRequest req;
  req.set_list_services("");
  ASSERT_TRUE(rw->Write(req));
  grpc::reflection::v1alpha::ServerReflectionResponse resp;
  ASSERT_TRUE(rw->Read(&resp));
  std::vector<std::string> names;
  for (const auto& s : resp.list_services_response().service()) names.push_back(s.name());
  EXPECT_THAT(names, ::testing::Contains("ropeattn.v1.AttentionService"));
  EXPECT_THAT(names, ::testing::Contains("grpc.health.v1.Health"));
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    grpc::reflection::v1alpha::ServerReflectionRequest file_req;
    file_req.set_file_containing_symbol(name);
    ASSERT_TRUE(rw->Write(file_req));
    grpc::reflection::v1alpha::ServerReflectionResponse file_resp;
    ASSERT_TRUE(rw->Read(&file_resp));
    ASSERT_TRUE(file_resp.has_file_descriptor_response()) << file_resp.DebugString();
    bool defines = false;
    for (const std::string& bytes : file_resp.file_descriptor_response().file_descriptor_proto()) {
      google::protobuf::FileDescriptorProto file;
      ASSERT_TRUE(file.ParseFromString(bytes));
      for (const auto& service : file.service()) {
        defines |= file.package() + "." + service.name() == name;
      }
    }
    EXPECT_TRUE(defines) << "no file descriptor defines " << name;
  }
  rw->WritesDone();
  EXPECT_TRUE(rw->Finish().ok());
}

TEST_F(SessionTest, ReflectionListsAndDescribesEveryService) {
  ExpectEveryListedServiceDescribable(server_->port());
}

// Every reflection answer on a stream holds what its own request asked:
// gRPC 1.51's service repeated every earlier answer of the stream in each
// new one (the 200th of 200 identical requests was 200 times the first).
TEST_F(SessionTest, ReflectionAnswersDoNotRepeatEarlierOnes) {
  auto refl = grpc::reflection::v1alpha::ServerReflection::NewStub(TestChannel(server_->port()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto rw = refl->ServerReflectionInfo(&ctx);
  std::string first_file, first_list;
  for (int i = 0; i < 12; ++i) {
    SCOPED_TRACE(i);
    grpc::reflection::v1alpha::ServerReflectionRequest req;
    if (i % 3 == 2) {
      req.set_list_services("");
    } else {
      req.set_file_containing_symbol("ropeattn.v1.AttentionService");
    }
    ASSERT_TRUE(rw->Write(req));
    grpc::reflection::v1alpha::ServerReflectionResponse resp;
    ASSERT_TRUE(rw->Read(&resp));
    if (i % 3 == 2) {
      ASSERT_TRUE(resp.has_list_services_response()) << resp.DebugString();
      const std::string list = resp.list_services_response().SerializeAsString();
      if (first_list.empty()) first_list = list;
      EXPECT_TRUE(list == first_list) << "the answer differs from the first";
    } else {
      ASSERT_TRUE(resp.has_file_descriptor_response()) << resp.DebugString();
      const std::string files = resp.file_descriptor_response().SerializeAsString();
      if (first_file.empty()) first_file = files;
      EXPECT_EQ(files.size(), first_file.size());
      EXPECT_TRUE(files == first_file) << "the answer differs from the first";
    }
  }
  rw->WritesDone();
  EXPECT_TRUE(rw->Finish().ok());
}

TEST_F(SessionTest, ServerInfoReportsLimits) {
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  ASSERT_TRUE(stub_->GetServerInfo(&ctx, {}, &info).ok());
  EXPECT_EQ(info.kv_budget_bytes(), TestServerOptions().memory_budget_bytes);
  EXPECT_EQ(info.max_sessions(), TestServerOptions().max_sessions);
  EXPECT_EQ(info.open_sessions(), 0);
  EXPECT_THAT(info.capabilities(), ::testing::Contains("rope:yarn"));
  EXPECT_FALSE(info.version().empty());
}

// ------------------------------------------------ decode vs reference --

std::vector<Config> AllConfigs() {
  return {Config{"default_rope", 4, 4, 16, 16, "default"},
          Config{"yarn_gqa", 8, 2, 16, 16, "yarn", 4.0, 8},
          Config{"llama3_interleaved", 4, 4, 32, 16, "llama3", 8.0, 8, true},
          // L0 = 8: steps cross the switch to the long factors at length 9.
          Config{"longrope_crossing", 4, 2, 16, 16, "longrope", 4.0, 8},
          Config{"dynamic_ntk_crossing", 4, 4, 16, 16, "dynamic", 2.0, 8},
          Config{"partial_rotary_window", 4, 4, 16, 8, "default", 1, 0, false, 8, false, false, 5,
                 false},
          Config{"mqa_bf16_kv", 8, 1, 16, 16, "default", 1, 0, false, 0, true},
          Config{"alibi_no_rope", 4, 4, 16, 16, "", 1, 0, false, 0, false, false, 0, true},
          Config{"linear_rope", 4, 2, 16, 16, "default", 1, 0, false, 0, false, true},
          Config{"linear_yarn", 4, 4, 16, 8, "yarn", 4.0, 8, false, 0, false, true}};
}

std::vector<Config> SoftmaxConfigs() {
  std::vector<Config> out;
  for (const Config& c : AllConfigs()) {
    if (!c.linear) out.push_back(c);
  }
  return out;
}

class DecodeReferenceTest : public SessionTest, public ::testing::WithParamInterface<Config> {};

TEST_P(DecodeReferenceTest, TokenByTokenAndChunkedMatchTheReference) {
  const Config c = GetParam();
  const int64_t len = 16;
  const Sequence seq = MakeSequence(c, len, 7);
  const double tol = c.bf16_kv ? kBF16Tol : kF32Tol;
  for (const std::vector<int64_t> chunks :
       {std::vector<int64_t>(len, 1), std::vector<int64_t>{3, 1, 5, 7}}) {
    Stream s(stub_.get());
    s.Open(MakeOpen(c));
    int64_t pos = 0;
    uint64_t n = 0;
    for (int64_t chunk : chunks) {
      v1::DecodeResponse r = s.Step(seq, pos, pos + chunk, ++n);
      ASSERT_TRUE(r.has_step()) << c.name << ": " << r.DebugString();
      EXPECT_EQ(r.step().seq(), n);
      EXPECT_EQ(r.step().position(), pos + chunk);
      EXPECT_TRUE(
          AllClose(WireToDoubles(r.step().out()), ExpectedStep(c, seq, pos, pos + chunk), tol))
          << c.name << " step ending at " << pos + chunk << " (chunk " << chunk << ")";
      pos += chunk;
    }
    EXPECT_TRUE(s.Finish().ok());
  }
}

INSTANTIATE_TEST_SUITE_P(Rules, DecodeReferenceTest, ::testing::ValuesIn(AllConfigs()),
                         [](const ::testing::TestParamInfo<Config>& info) {
                           return info.param.name;
                         });

// ---------------------------------------------------------- int8 KV --

// An int8 session (open.kv_dtype DTYPE_INT8): its answers, token by token
// and in chunks, stay within int8's error of the fp64 reference over the
// unquantized inputs (5e-2 of the largest output, the bound the core's
// error table asserts 8e-2 for on outlier data), while each answer is the
// exact attention over what the session holds (checked in the core tests);
// it reports DTYPE_INT8 and holds less than a bf16 session; export_kv is f32.
TEST_F(SessionTest, Int8SessionsAnswerWithinInt8ErrorAndHoldLess) {
  Config c{"int8", 8, 2, 32, 32, "default"};
  const int64_t len = 24;
  const Sequence seq = MakeSequence(c, len, 21);
  v1::OpenSession open = MakeOpen(c, 256);
  open.set_kv_dtype(v1::DTYPE_INT8);
  Stream s(stub_.get());
  const v1::SessionInfo info = s.Open(open);
  EXPECT_EQ(info.kv_dtype(), v1::DTYPE_INT8);
  int64_t pos = 0;
  uint64_t n = 0;
  for (int64_t chunk : {20, 1, 1, 2}) {  // a prefill, then decode steps
    v1::DecodeResponse r = s.Step(seq, pos, pos + chunk, ++n);
    ASSERT_TRUE(r.has_step()) << r.DebugString();
    const std::vector<double> got = WireToDoubles(r.step().out());
    const std::vector<double> want = ExpectedStep(c, seq, pos, pos + chunk);
    double err = 0, mag = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      err = std::max(err, std::fabs(got[i] - want[i]));
      mag = std::max(mag, std::fabs(want[i]));
    }
    EXPECT_LE(err, 5e-2 * mag) << "step ending at " << pos + chunk;
    EXPECT_GT(err, 0.0) << "an int8 cache that rounds nothing is not int8";
    pos += chunk;
  }
  v1::DecodeRequest exp;
  exp.mutable_export_kv();
  v1::DecodeResponse e = s.Send(exp);
  ASSERT_TRUE(e.has_exported()) << e.DebugString();
  EXPECT_EQ(e.exported().k().dtype(), v1::DTYPE_F32);
  EXPECT_EQ(e.exported().k().shape(1), len);
  EXPECT_TRUE(s.Finish().ok());

  // Held bytes: int8 < bf16 < f32 for the same session, with 8 kv heads so
  // that a page's parts are past the 16 KiB under which they take whole
  // 4 KiB pages (there int8 and bf16 both hold one page a part).
  const Config big{"int8", 8, 8, 32, 32, "default"};
  int64_t held[3];
  const v1::DType dtypes[3] = {v1::DTYPE_INT8, v1::DTYPE_BF16, v1::DTYPE_F32};
  for (int i = 0; i < 3; ++i) {
    Stream t(stub_.get());
    v1::OpenSession o = MakeOpen(big, 4096);
    o.set_kv_dtype(dtypes[i]);
    held[i] = t.Open(o).kv_bytes();
    EXPECT_TRUE(t.Finish().ok());
  }
  EXPECT_LT(held[0], held[1]);
  EXPECT_LT(held[1], held[2]);
  // The difference is the KV itself, page by page (P tokens a page: 32 in
  // tile pages, 16 otherwise): int8 codes + 4-byte scales per (token, kv
  // head) for K and for V against bf16's rows, each page charged what its
  // parts hold (KvPageHeldBytes).
  auto difference = [](int64_t P) {
    const int64_t bf16 = P * 8 * 32 * 2, int8 = P * 8 * 32 + P * 8 * 4;
    return 4096 / P * (KvPageHeldBytes(bf16, bf16) - KvPageHeldBytes(int8, int8));
  };
  EXPECT_TRUE(held[1] - held[0] == difference(32) || held[1] - held[0] == difference(16))
      << held[1] - held[0] << " is neither " << difference(32) << " nor " << difference(16);
}

TEST_F(SessionTest, Int8IsRefusedWhereItCannotBeExact) {
  {  // linear attention keeps running sums
    Config c{"lin", 4, 4, 16, 16, "default"};
    c.linear = true;
    v1::OpenSession o = MakeOpen(c);
    o.set_kv_dtype(v1::DTYPE_INT8);
    Stream s(stub_.get());
    v1::DecodeRequest req;
    *req.mutable_open() = o;
    EXPECT_TRUE(s.rw()->Write(req));
    const grpc::Status st = s.AwaitServerEnd();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("open.kv_dtype"));
  }
  {  // a length-dependent rule re-rotates its keys
    Config c{"dyn", 4, 4, 16, 16, "dynamic", 2.0, 8};
    v1::OpenSession o = MakeOpen(c);
    o.set_kv_dtype(v1::DTYPE_INT8);
    Stream s(stub_.get());
    v1::DecodeRequest req;
    *req.mutable_open() = o;
    EXPECT_TRUE(s.rw()->Write(req));
    const grpc::Status st = s.AwaitServerEnd();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNIMPLEMENTED);
    EXPECT_THAT(st.error_message(), HasSubstr("DTYPE_INT8"));
    EXPECT_THAT(st.error_message(), HasSubstr("dynamic"));
  }
  {  // int8 is a cache dtype, not a tensor dtype
    v1::AttendRequest req = SmallAttendRequest();
    req.mutable_q()->set_dtype(v1::DTYPE_INT8);
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    const grpc::Status st = stub_->Attend(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("DTYPE_INT8"));
    EXPECT_THAT(st.error_message(), HasSubstr("q"));
  }
}

// Sessions that fill the memory budget can still step: each holds the room
// of its one-token steps (SessionInfo.step_room_bytes). The landed server
// charged every step's buffers to the budget the opens had filled, so no
// admitted session could take a step ("needs 45088 bytes, 0 ... free").
TEST_F(SessionTest, SessionsThatFillTheBudgetCanStillStep) {
  server::ServerOptions o = TestServerOptions();
  o.memory_budget_bytes = int64_t{64} << 20;
  Restart(o);
  ASSERT_NE(server_, nullptr);
  const Config big{"mha", 8, 8, 64, 64, "default"};
  const Config small{"one_head", 1, 1, 64, 64, "default"};
  const Sequence seq_big = MakeSequence(big, 3, 5), seq_small = MakeSequence(small, 3, 6);
  std::vector<std::pair<std::unique_ptr<Stream>, const Sequence*>> streams;
  // Opens sessions of `c` until one is refused for memory.
  const auto fill = [&](const Config& c, int64_t max_context, const Sequence* seq) {
    for (int n = 0; n < 200; ++n) {
      auto s = std::make_unique<Stream>(stub_.get());
      v1::DecodeRequest req;
      *req.mutable_open() = MakeOpen(c, max_context);
      EXPECT_TRUE(s->rw()->Write(req));
      v1::DecodeResponse r;
      if (!s->rw()->Read(&r)) {
        const grpc::Status st = s->AwaitServerEnd();
        EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
        EXPECT_THAT(st.error_message(), HasSubstr("--memory_budget_bytes"));
        return;
      }
      EXPECT_TRUE(r.has_opened()) << r.DebugString();
      EXPECT_GT(r.opened().step_room_bytes(), 0);
      streams.emplace_back(std::move(s), seq);
    }
    ADD_FAILURE() << "200 sessions of " << c.name << " did not fill the budget";
  };
  fill(big, 1024, &seq_big);        // 4 MiB each
  fill(small, 1024, &seq_small);    // 512 KiB each
  fill(small, 16, &seq_small);      // 8 KiB each: less than a step's buffers stays free
  ASSERT_GE(streams.size(), 3u);
  // Every admitted session takes one-token steps.
  for (size_t k = 0; k < streams.size(); ++k) {
    for (int64_t t = 0; t < 3; ++t) {
      v1::DecodeResponse r = streams[k].first->Step(*streams[k].second, t, t + 1, t + 1);
      ASSERT_TRUE(r.has_step()) << "session " << k << " step " << t << ": " << r.DebugString();
    }
  }
  for (auto& s : streams) EXPECT_TRUE(s.first->Finish().ok());
}

// The spec a session keeps holds no unknown fields, nor their storage
// (protobuf's Clear keeps capacity: 2M unknown fields kept 31 MB per
// session, outside the budget), in layer mode too; what it keeps is what is
// charged.
TEST(StepRoomTest, AKeptSpecHoldsNoUnknownFieldsNorTheirStorage) {
  server::ModelRegistry models;
  ASSERT_TRUE(models.Add(server::Model::Demo("demo").value()).ok());
  const server::ServerOptions options = TestServerOptions();
  for (const bool layer : {false, true}) {
    SCOPED_TRACE(layer);
    v1::OpenSession open;
    if (layer) {
      open.set_model("demo");
    } else {
      open.mutable_spec()->set_heads(2);
      open.mutable_spec()->set_head_dim(8);
    }
    open.set_max_context(16);
    // The heap the config holds once the request is gone (glibc's count of
    // bytes in use, mapped blocks included), from before the request grew.
    const auto heap = [] {
      const struct mallinfo2 m = mallinfo2();
      return static_cast<int64_t>(m.uordblks + m.hblkhd);
    };
    const int64_t before = heap();
    std::optional<v1::OpenSession> request(std::move(open));
    google::protobuf::UnknownFieldSet* extra =
        request->mutable_spec()->GetReflection()->MutableUnknownFields(request->mutable_spec());
    for (int i = 0; i < 200000; ++i) extra->AddVarint(2000, 1);
    ASSERT_GT(request->spec().SpaceUsedLong(), 1000000u);
    absl::StatusOr<server::SessionConfig> config =
        server::ResolveOpenSession(*request, options, models);
    ASSERT_TRUE(config.ok()) << config.status();
    request.reset();
    EXPECT_LT(heap() - before, 256 << 10)
        << "the kept spec holds its unknown fields' storage";
    EXPECT_EQ(config->spec_proto.GetReflection()->GetUnknownFields(config->spec_proto).field_count(),
              0);
    EXPECT_LT(config->spec_proto.SpaceUsedLong(), 4096u);
    EXPECT_EQ(config->spec_memory_bytes,
              static_cast<int64_t>(config->spec_proto.SpaceUsedLong()) +
                  2 * server::ResolvedHeapBytes(config->spec));
  }
}

// What a spec resolves to is charged too, twice (the config's copy and the
// decode state's): `heads: 65536, alibi {}` is a few bytes of wire that
// resolve to 512 KiB of standard slopes (1200 idle streams each keeping a
// closed session held 650 MiB against a 256 MiB budget).
TEST(StepRoomTest, TheResolvedSpecIsCharged) {
  server::ModelRegistry models;
  const server::ServerOptions options = TestServerOptions();
  v1::OpenSession open;
  open.mutable_spec()->set_heads(65536);
  open.mutable_spec()->set_kv_heads(1);
  open.mutable_spec()->set_head_dim(1);
  open.mutable_spec()->mutable_alibi();
  open.set_max_context(1);
  absl::StatusOr<server::SessionConfig> config =
      server::ResolveOpenSession(open, options, models);
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_EQ(config->spec.options.bias.alibi_slopes.size(), 65536u);
  EXPECT_LT(config->spec_proto.SpaceUsedLong(), 4096u);
  EXPECT_GE(config->spec_memory_bytes, 2 * 65536 * int64_t{sizeof(double)});
}

// The step room covers every one-token step a session can take: a
// one-token step at any position is priced (PriceStep, whose transient
// bytes admission charges) at no more than StepRoomBytes, for every kind of
// session; a two-token step near the end needs more than it (the room is no
// larger than it must be).
TEST(StepRoomTest, CoversEveryOneTokenStep) {
  server::ModelRegistry models;
  ASSERT_TRUE(models.Add(server::Model::Demo("demo").value()).ok());
  const server::ServerOptions options = TestServerOptions();
  struct Case {
    std::string name;
    v1::OpenSession open;
  };
  std::vector<Case> cases;
  const auto spec = [](int heads, int kv_heads, int d) {
    v1::AttentionSpec s;
    s.set_heads(heads);
    s.set_kv_heads(kv_heads);
    s.set_head_dim(d);
    return s;
  };
  {
    Case c{"mha f32"};
    *c.open.mutable_spec() = spec(8, 8, 64);
    cases.push_back(c);
    c.name = "gqa bf16";
    *c.open.mutable_spec() = spec(32, 8, 128);
    c.open.set_kv_dtype(v1::DTYPE_BF16);
    cases.push_back(c);
    c.name = "mqa int8";
    *c.open.mutable_spec() = spec(32, 1, 128);
    c.open.set_kv_dtype(v1::DTYPE_INT8);
    cases.push_back(c);
    c.name = "dynamic rope";
    c.open.set_kv_dtype(v1::DTYPE_F32);
    *c.open.mutable_spec() = spec(8, 2, 64);
    c.open.mutable_spec()->mutable_rope()->mutable_scaling()->set_rope_type("dynamic");
    c.open.mutable_spec()->mutable_rope()->mutable_scaling()->set_factor(2.0);
    c.open.mutable_spec()->mutable_rope()->mutable_scaling()->set_original_max_position_embeddings(
        256);
    cases.push_back(c);
    c.name = "linear";
    *c.open.mutable_spec() = spec(4, 4, 32);
    c.open.set_kind(v1::ATTENTION_KIND_LINEAR);
    cases.push_back(c);
    c = Case{"layer"};
    c.open.set_model("demo");
    c.open.set_layer(1);
    cases.push_back(c);
  }
  for (Case& c : cases) {
    SCOPED_TRACE(c.name);
    c.open.set_max_context(1000);
    absl::StatusOr<server::SessionConfig> config = server::ResolveOpenSession(c.open, options, models);
    ASSERT_TRUE(config.ok()) << config.status();
    const int64_t room = server::StepRoomBytes(*config, options.threads_per_call);
    const auto price = [&](int64_t tokens, int64_t position) {
      v1::Step step;
      if (config->model) {
        *step.mutable_hidden() =
            ToWire(Tensor::Create(DType::kF32, {1, tokens, config->model->config().hidden_size})
                       .value()
                       .cview());
      } else {
        const v1::AttentionSpec& sp = c.open.spec();
        const int64_t kvh = sp.kv_heads() == 0 ? sp.heads() : sp.kv_heads();
        *step.mutable_q() =
            ToWire(Tensor::Create(DType::kF32, {1, tokens, sp.heads(), sp.head_dim()}).value().cview());
        *step.mutable_k() =
            ToWire(Tensor::Create(DType::kF32, {1, tokens, kvh, sp.head_dim()}).value().cview());
        *step.mutable_v() = *step.mutable_k();
      }
      absl::StatusOr<server::Cost> cost = server::PriceStep(*config, step, position, options.threads_per_call);
      EXPECT_TRUE(cost.ok()) << cost.status();
      return cost.ok() ? cost->transient_bytes : -1;
    };
    for (int64_t position : {0, 1, 500, 998, 999}) {
      EXPECT_LE(price(1, position), room) << "one token at " << position;
    }
    EXPECT_EQ(price(1, 999), room);
    if (!c.open.spec().has_rope() && c.open.kind() != v1::ATTENTION_KIND_LINEAR) {
      EXPECT_GT(price(2, 998), room);
    }
  }
}

// A session closed by CloseSession while its stream sits idle gives its
// whole charge back at once, step room included (the room stayed held by
// the stream's reference until the client next wrote or went away), all
// but the spec the stream's reference keeps (a few hundred bytes here),
// which goes with the stream.
TEST_F(SessionTest, ClosingAnAttachedSessionFreesAllItsMemory) {
  const auto memory_in_use = [&] { return MemoryInUse(stub_.get()); };
  ASSERT_TRUE(Eventually([&] { return memory_in_use() == 0; }));
  Stream s(stub_.get());
  const v1::SessionInfo opened = s.Open(MakeOpen(Config{"mha", 4, 4, 16, 16, "default"}, 256));
  // The open stream holds its own share too.
  EXPECT_EQ(memory_in_use(),
            opened.kv_bytes() + opened.step_room_bytes() + server::kDecodeStreamBytes);
  grpc::ClientContext ctx;
  v1::CloseSessionRequest close;
  close.set_session_id(opened.session_id());
  v1::CloseSessionResponse closed;
  ASSERT_TRUE(stub_->CloseSession(&ctx, close, &closed).ok());
  EXPECT_TRUE(Eventually([&] {
    const int64_t left = memory_in_use() - server::kDecodeStreamBytes;
    return left > 0 && left < 1024;  // the kept spec
  })) << memory_in_use();
  s.Finish();
  EXPECT_TRUE(Eventually([&] { return memory_in_use() == 0; })) << memory_in_use();
}

// A client whose receive window stays at 64 KiB unless it reads: answers
// larger than that wait in the server until it does.
std::unique_ptr<v1::AttentionService::Stub> LazyStub(int port) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 10);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(256 << 20);
  return v1::AttentionService::NewStub(grpc::CreateCustomChannel(
      absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials(), args));
}

// A close's answer echoes the session's spec (a typed copy and its
// serialized bytes), and may wait unread until --answer_timeout_seconds:
// it was paid by nothing once the close gave the session's memory back (a
// client that opened sessions with 2 MiB specs and closed them without
// reading grew RSS by 505 MiB on a 64 MiB budget that showed 1.9 MB in
// use). The session reserves the room for it with its state (so a close
// still needs no free budget), and the closed session's kept spec stays
// charged while its stream holds it.
// A refusal for lack of budget names a large spec's share and suggests a
// smaller spec (it said only "lower max_context" for an 8-byte state).
TEST(AnswerBudgetTest, ARefusalNamesALargeSpecsShare) {
  server::ServerOptions o = TestServerOptions();
  o.memory_budget_bytes = 1 << 20;
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());
  Config c;
  c.alibi = true;
  c.kv_heads = 1;
  c.head_dim = 1;
  c.v_dim = 1;
  v1::OpenSession big = MakeOpen(c, 1);
  big.mutable_spec()->set_heads(65536);  // standard slopes: 512 KiB, twice
  grpc::ClientContext ctx;
  auto rw = stub->Decode(&ctx);
  v1::DecodeRequest req;
  *req.mutable_open() = big;
  ASSERT_TRUE(rw->Write(req));
  rw->WritesDone();
  v1::DecodeResponse resp;
  while (rw->Read(&resp)) {
  }
  const grpc::Status st = rw->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("bytes for its spec"));
  EXPECT_THAT(st.error_message(), HasSubstr("send a smaller spec"));
}

TEST(AnswerBudgetTest, ACloseAnswerIsHeldFromTheBudgetUntilTaken) {
  server::ServerOptions o = TestServerOptions();
  o.memory_budget_bytes = 16 << 20;
  o.max_sessions = 10000;
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());
  auto lazy = LazyStub(server->port());
  const auto in_use = [&] { return MemoryInUse(stub.get()); };
  constexpr int64_t kSlopes = 65536;  // 256 KiB of slopes
  Config c;
  c.alibi = true;
  c.kv_heads = 1;
  c.head_dim = 1;
  c.v_dim = 1;
  v1::OpenSession big = MakeOpen(c, 1);
  big.mutable_spec()->set_heads(kSlopes);
  for (int h = 0; h < kSlopes; ++h) big.mutable_spec()->mutable_alibi()->add_slopes(0.5);
  Stream s(lazy.get());
  const v1::SessionInfo opened = s.Open(big);
  ASSERT_EQ(opened.spec().alibi().slopes_size(), kSlopes);
  // Small detached sessions fill the rest of the budget: the close must not
  // need any.
  for (int opens = 0;; ++opens) {
    ASSERT_LT(opens, 10000);
    Stream f(stub.get());
    v1::DecodeRequest req;
    *req.mutable_open() = MakeOpen(Config{}, 16, /*resumable=*/true);
    ASSERT_TRUE(f.rw()->Write(req));
    v1::DecodeResponse r;
    if (!f.rw()->Read(&r)) {
      EXPECT_EQ(f.AwaitServerEnd().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
      break;
    }
    ASSERT_TRUE(f.Finish().ok());
  }
  // What the budget holds once the session and what it paid for are gone
  // (read once the refused stream's share came back).
  int64_t settled = 0;
  ASSERT_TRUE(Eventually([&] {
    const int64_t before = in_use();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    settled = in_use();
    return settled == before;
  }));
  const int64_t without = settled - opened.kv_bytes() - opened.step_room_bytes();
  // The close, its answer not read.
  v1::DecodeRequest close;
  close.mutable_close()->set_seq(1);
  ASSERT_TRUE(s.rw()->Write(close));
  ASSERT_TRUE(Eventually([&] {
    grpc::ClientContext ctx;
    v1::GetSessionRequest req;
    req.set_session_id(opened.session_id());
    v1::SessionInfo info;
    return !stub->GetSession(&ctx, req, &info).ok();
  }));
  // Held while it waits: the answer's typed copy and bytes (2 x 256 KiB)
  // and the spec the stream's session object keeps (256 KiB).
  EXPECT_GE(in_use() - without, 3 * kSlopes * 4);
  // Taken: the answer, then the stream, give it all back.
  v1::DecodeResponse r;
  ASSERT_TRUE(s.rw()->Read(&r));
  ASSERT_TRUE(r.has_closed()) << r.DebugString();
  EXPECT_EQ(r.closed().spec().alibi().slopes_size(), kSlopes);
  EXPECT_TRUE(s.AwaitServerEnd().ok());
  EXPECT_TRUE(Eventually([&] { return in_use() == without - server::kDecodeStreamBytes; }))
      << in_use() << " " << without;
  server->Shutdown(absl::Seconds(1));
}

// A step's answer is paid by its session's step room (or its own
// reservation when larger); closing the session (CloseSession, the reaper)
// gave the room back at once while the answer still waited unread (RSS
// +343 MiB on a 64 MiB budget that showed 1.3 MB in use). The room is lent
// to the step until its answer is written, then released if the session
// ended meanwhile.
TEST(AnswerBudgetTest, AStepAnswerKeepsItsRoomPastACloseUntilTaken) {
  server::ServerOptions o = TestServerOptions();
  o.memory_budget_bytes = 64 << 20;
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());
  auto lazy = LazyStub(server->port());
  const auto in_use = [&] { return MemoryInUse(stub.get()); };
  // One token's answer: [1, 1, 16, 65536] f32, 4 MiB.
  const Config c{"wide", 16, 1, 1, 65536};
  const Sequence seq = MakeSequence(c, 1, 3);
  Stream s(lazy.get());
  const v1::SessionInfo opened = s.Open(MakeOpen(c, 1));
  ASSERT_GE(opened.step_room_bytes(), int64_t{4} << 20);
  v1::DecodeRequest step;
  step.mutable_step()->set_seq(1);
  *step.mutable_step()->mutable_q() = ToWire(seq.q.cview());
  *step.mutable_step()->mutable_k() = ToWire(seq.k.cview());
  *step.mutable_step()->mutable_v() = ToWire(seq.v.cview());
  ASSERT_TRUE(s.rw()->Write(step));
  const auto info = [&](v1::SessionInfo* out) {
    grpc::ClientContext ctx;
    v1::GetSessionRequest req;
    req.set_session_id(opened.session_id());
    return stub->GetSession(&ctx, req, out).ok();
  };
  // Computed: its answer waits in the server.
  ASSERT_TRUE(Eventually([&] {
    v1::SessionInfo i;
    return info(&i) && i.steps() == 1;
  }));
  {
    grpc::ClientContext ctx;
    v1::CloseSessionRequest req;
    req.set_session_id(opened.session_id());
    v1::CloseSessionResponse closed;
    ASSERT_TRUE(stub->CloseSession(&ctx, req, &closed).ok());
  }
  // The session's memory is back, but not the room its unread answer uses.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_GE(in_use(), server::kDecodeStreamBytes + opened.step_room_bytes());
  v1::DecodeResponse r;
  ASSERT_TRUE(s.rw()->Read(&r));
  ASSERT_TRUE(r.has_step()) << r.DebugString();
  EXPECT_EQ(r.step().out().data().size(), size_t{4} << 20);
  // Written: the room goes back (its session ended), then the stream's share.
  EXPECT_TRUE(Eventually([&] { return in_use() < opened.step_room_bytes(); })) << in_use();
  s.Finish();
  EXPECT_TRUE(Eventually([&] { return in_use() == 0; })) << in_use();
  server->Shutdown(absl::Seconds(1));
}

// A Decode stream holds its share of the memory budget from its start,
// before it sends anything, until it ends: streams that never send a message
// cannot grow memory past the budget (gRPC keeps ~20 KiB for each), and one
// the budget cannot pay for is ended at once with RESOURCE_EXHAUSTED.
TEST(DecodeStreamBudgetTest, IdleStreamsHoldTheirShareOfTheBudget) {
  server::ServerOptions o = TestServerOptions();
  o.memory_budget_bytes = 3 * server::kDecodeStreamBytes;
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());
  const auto in_use = [&] { return MemoryInUse(stub.get()); };
  {
    std::vector<std::unique_ptr<Stream>> idle;
    for (int i = 0; i < 3; ++i) idle.push_back(std::make_unique<Stream>(stub.get()));
    EXPECT_TRUE(Eventually([&] { return in_use() == 3 * server::kDecodeStreamBytes; }))
        << in_use();
    Stream refused(stub.get());
    const grpc::Status st = refused.Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr("an open Decode stream"));
    // Counted under Decode with its code (it was missing from the metrics).
    EXPECT_THAT(server->metrics().RenderPrometheus(),
                HasSubstr("ropeattn_requests_total{method=\"Decode\",code=\"RESOURCE_EXHAUSTED\"} 1"));
  }
  EXPECT_TRUE(Eventually([&] { return in_use() == 0; })) << in_use();
  // With the streams gone, a new one opens a session as usual.
  Stream s(stub.get());
  v1::DecodeRequest open;
  open.mutable_open()->mutable_spec()->set_heads(1);
  open.mutable_open()->mutable_spec()->set_head_dim(4);
  open.mutable_open()->set_max_context(4);
  EXPECT_TRUE(s.Send(open).has_opened());
  server->Shutdown(absl::Seconds(1));
}

// Opens a session of 8 heads of 128 (max_context 2048) on `rw` and reads
// its answer: the answer-timeout tests' session, whose steps answer MiBs.
void OpenStepSession(grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>* rw) {
  v1::DecodeRequest open;
  open.mutable_open()->mutable_spec()->set_heads(8);
  open.mutable_open()->mutable_spec()->set_head_dim(128);
  open.mutable_open()->set_max_context(2048);
  ASSERT_TRUE(rw->Write(open));
  v1::DecodeResponse r;
  ASSERT_TRUE(rw->Read(&r));
  ASSERT_TRUE(r.has_opened()) << r.DebugString();
}

// A raw HTTP/2 client that sends one unary call (`path`, `body` the
// serialized request) after announcing a receive window of 0, which it never
// opens: no byte of the answer can leave the server. Returns the connected
// socket (the connection stays up while it is open), or -1.
int SendUnreadCall(int port, const std::string& path, const std::string& body,
                   const std::string& request_id = "", const std::string& grpc_timeout = "") {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  auto frame = [](uint8_t type, uint8_t flags, uint32_t stream, const std::string& payload) {
    std::string f(9, '\0');
    f[0] = static_cast<char>(payload.size() >> 16);
    f[1] = static_cast<char>(payload.size() >> 8);
    f[2] = static_cast<char>(payload.size());
    f[3] = static_cast<char>(type);
    f[4] = static_cast<char>(flags);
    for (int i = 0; i < 4; ++i) f[5 + i] = static_cast<char>(stream >> (24 - 8 * i));
    return f + payload;
  };
  // HPACK literals without indexing, plain strings (all under 127 bytes).
  std::vector<std::pair<std::string, std::string>> fields = {{":method", "POST"},
                                                             {":scheme", "http"},
                                                             {":path", path},
                                                             {":authority", "localhost"},
                                                             {"content-type", "application/grpc"},
                                                             {"te", "trailers"}};
  if (!request_id.empty()) fields.emplace_back("x-request-id", request_id);
  if (!grpc_timeout.empty()) fields.emplace_back("grpc-timeout", grpc_timeout);
  std::string headers;
  for (const auto& [name, value] : fields) {
    headers += '\0';
    headers += static_cast<char>(name.size());
    headers += name;
    headers += static_cast<char>(value.size());
    headers += value;
  }
  std::string message(5, '\0');
  for (int i = 0; i < 4; ++i) message[1 + i] = static_cast<char>(body.size() >> (24 - 8 * i));
  message += body;
  EXPECT_LT(message.size(), 16384u);  // one DATA frame
  const std::string out = std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") +
                          frame(4, 0, 0, std::string("\x00\x04\x00\x00\x00\x00", 6)) +
                          frame(1, 4, 1, headers) + frame(0, 1, 1, message);
  const auto send_all = [fd](const std::string& bytes) {
    return send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
  };
  if (!send_all(out)) {
    close(fd);
    return -1;
  }
  // Acknowledges the server's SETTINGS (a peer that never does is dropped).
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  if (!send_all(frame(4, 1, 0, ""))) {
    close(fd);
    return -1;
  }
  return fd;
}

// A client that keeps its connection but never takes an answer (its
// flow-control window stays shut) held the call, and all the call held,
// forever: gRPC has no write timeout. Past --answer_timeout_seconds the call
// is cancelled and what it held goes back: a unary Attend's reservation, a
// Decode stream's session and budget share.
TEST(AnswerTimeoutTest, AnswersNotTakenCancelTheirCalls) {
  server::ServerOptions o = TestServerOptions();
  o.answer_timeout_seconds = 1;
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());
  // A client whose receive window stays at 64 KiB unless it reads.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 10);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(256 << 20);
  auto lazy = v1::AttentionService::NewStub(grpc::CreateCustomChannel(
      absl::StrCat("127.0.0.1:", server->port()), grpc::InsecureChannelCredentials(), args));
  const auto in_use = [&] { return MemoryInUse(stub.get()); };
  // Unary: an Attend from a raw HTTP/2 client that announces a receive
  // window of 0 and never opens it: the answer cannot leave the server.
  {
    v1::AttendRequest req;
    req.mutable_spec()->set_heads(1);
    req.mutable_spec()->set_head_dim(4);
    const int64_t shape[] = {1, 2, 1, 4};
    const Tensor q = RandomTensor(DType::kF32, shape, 1);
    *req.mutable_q() = ToWire(q.cview());
    *req.mutable_k() = ToWire(q.cview());
    *req.mutable_v() = ToWire(q.cview());
    const int fd = SendUnreadCall(server->port(), "/ropeattn.v1.AttentionService/Attend",
                                  req.SerializeAsString());
    ASSERT_GE(fd, 0);
    // Computed, its reservation held while the answer waits...
    EXPECT_TRUE(Eventually([&] { return in_use() > 0; }, absl::Milliseconds(3000))) << in_use();
    // ...and given back once the server cancels the call.
    EXPECT_TRUE(Eventually([&] { return in_use() == 0; }, absl::Milliseconds(5000))) << in_use();
    close(fd);
  }
  // Decode: a step whose 8 MiB output is never read; the session (not
  // resumable) closes with its stream.
  {
    grpc::ClientContext ctx;
    auto rw = lazy->Decode(&ctx);
    ASSERT_NO_FATAL_FAILURE(OpenStepSession(rw.get()));
    EXPECT_GT(in_use(), 0);
    v1::DecodeRequest step;
    const int64_t shape[] = {1, 2048, 8, 128};
    const Tensor x = RandomTensor(DType::kF32, shape, 2);
    *step.mutable_step()->mutable_q() = ToWire(x.cview());
    *step.mutable_step()->mutable_k() = ToWire(x.cview());
    *step.mutable_step()->mutable_v() = ToWire(x.cview());
    ASSERT_TRUE(rw->Write(step));
    EXPECT_TRUE(Eventually([&] { return in_use() == 0; }, absl::Milliseconds(8000))) << in_use();
    rw->WritesDone();
    for (v1::DecodeResponse r; rw->Read(&r);) {
    }
    EXPECT_EQ(rw->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  server->Shutdown(absl::Seconds(1));
}

// An answer cancelled unread by --answer_timeout_seconds was counted under
// the code it was computed with (4 Encode calls whose client never got a
// byte: code="OK") and logged nowhere. It is counted CANCELLED (once: its
// computed code never), in ropeattn_answers_timed_out_total, and logged as
// an error answer naming the timeout; a Decode operation likewise (its
// stream's status says which answer was not taken).
TEST(AnswerTimeoutTest, AnswersNotTakenCountAndLogAsCancelled) {
  server::LogCapture capture;
  server::ServerOptions o = TestServerOptions();
  o.answer_timeout_seconds = 1;
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());
  const auto metric = [&](const std::string& series) -> double {
    const std::string m = server->metrics().RenderPrometheus();
    const size_t at = m.find("\n" + series + " ");
    return at == std::string::npos ? -1 : std::atof(m.c_str() + at + series.size() + 2);
  };
  // The error_answer line of the call with `request_id`, "" if none.
  const auto error_line = [&](const std::string& request_id) {
    std::istringstream lines(capture.Text());
    for (std::string line; std::getline(lines, line);) {
      if (absl::StrContains(line, "\"event\":\"error_answer\"") &&
          absl::StrContains(line, absl::StrCat("\"request_id\":\"", request_id, "\""))) {
        return line;
      }
    }
    return std::string();
  };
  const std::string encode_ok = R"(ropeattn_requests_total{method="Encode",code="OK"})";
  const std::string encode_cancelled =
      R"(ropeattn_requests_total{method="Encode",code="CANCELLED"})";
  // Unary: an Encode whose answer cannot leave the server.
  {
    v1::EncodeRequest req;
    req.mutable_sinusoidal()->set_num_positions(16);
    req.mutable_sinusoidal()->set_d_model(8);
    const int fd = SendUnreadCall(server->port(), "/ropeattn.v1.AttentionService/Encode",
                                  req.SerializeAsString(), "unread-encode");
    ASSERT_GE(fd, 0);
    EXPECT_TRUE(Eventually([&] { return metric(encode_cancelled) == 1; }, absl::Seconds(10)))
        << server->metrics().RenderPrometheus();
    close(fd);
    EXPECT_EQ(metric(encode_ok), 0);
    EXPECT_EQ(metric(R"(ropeattn_answers_timed_out_total{method="Encode"})"), 1);
    // Its latency is the request's, to its answer: not the second it waited.
    EXPECT_EQ(metric(R"(ropeattn_request_duration_seconds_count{method="Encode"})"), 1);
    EXPECT_LT(metric(R"(ropeattn_request_duration_seconds_sum{method="Encode"})"), 0.5);
    const std::string line = error_line("unread-encode");
    EXPECT_THAT(line, HasSubstr("\"method\":\"/ropeattn.v1.AttentionService/Encode\""))
        << capture.Text();
    EXPECT_THAT(line, HasSubstr("\"code\":\"CANCELLED\""));
    EXPECT_THAT(line, HasSubstr("not taken within --answer_timeout_seconds (1 s)"));
    EXPECT_THAT(line, HasSubstr("\"peer\":\"ipv4:127.0.0.1:"));
  }
  // A call whose answer is taken still counts OK, once.
  {
    grpc::ClientContext ctx;
    v1::EncodeRequest req;
    req.mutable_sinusoidal()->set_num_positions(16);
    req.mutable_sinusoidal()->set_d_model(8);
    v1::EncodeResponse out;
    ASSERT_TRUE(stub->Encode(&ctx, req, &out).ok());
    EXPECT_TRUE(Eventually([&] { return metric(encode_ok) == 1; }, absl::Seconds(5)));
    EXPECT_EQ(metric(encode_cancelled), 1);
    EXPECT_EQ(metric(R"(ropeattn_answers_timed_out_total{method="Encode"})"), 1);
  }
  // An answer whose call's deadline (300 ms) passes before it leaves, well
  // inside the answer timeout: the client saw DEADLINE_EXCEEDED, and so is
  // it counted (it was counted OK, the code it was answered with).
  {
    v1::EncodeRequest req;
    req.mutable_sinusoidal()->set_num_positions(16);
    req.mutable_sinusoidal()->set_d_model(8);
    const int fd = SendUnreadCall(server->port(), "/ropeattn.v1.AttentionService/Encode",
                                  req.SerializeAsString(), "late-encode", "300m");
    ASSERT_GE(fd, 0);
    const std::string expired = R"(ropeattn_requests_total{method="Encode",code="DEADLINE_EXCEEDED"})";
    EXPECT_TRUE(Eventually([&] { return metric(expired) == 1; }, absl::Seconds(5)))
        << server->metrics().RenderPrometheus();
    close(fd);
    EXPECT_EQ(metric(encode_ok), 1);
    EXPECT_EQ(metric(encode_cancelled), 1);
    EXPECT_EQ(metric(R"(ropeattn_answers_timed_out_total{method="Encode"})"), 1);
  }
  // Decode: the open's answer is read, the step's 8 MiB answer is not.
  {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 10);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetMaxReceiveMessageSize(256 << 20);
    args.SetMaxSendMessageSize(256 << 20);
    auto lazy = v1::AttentionService::NewStub(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", server->port()), grpc::InsecureChannelCredentials(), args));
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-request-id", "unread-decode");
    auto rw = lazy->Decode(&ctx);
    ASSERT_NO_FATAL_FAILURE(OpenStepSession(rw.get()));
    v1::DecodeRequest step;
    step.mutable_step()->set_seq(7);
    const int64_t shape[] = {1, 2048, 8, 128};
    const Tensor x = RandomTensor(DType::kF32, shape, 2);
    *step.mutable_step()->mutable_q() = ToWire(x.cview());
    *step.mutable_step()->mutable_k() = ToWire(x.cview());
    *step.mutable_step()->mutable_v() = ToWire(x.cview());
    ASSERT_TRUE(rw->Write(step));
    const std::string step_cancelled =
        R"(ropeattn_requests_total{method="Decode.Step",code="CANCELLED"})";
    EXPECT_TRUE(Eventually([&] { return metric(step_cancelled) == 1; }, absl::Seconds(15)))
        << server->metrics().RenderPrometheus();
    rw->WritesDone();
    for (v1::DecodeResponse r; rw->Read(&r);) {
    }
    EXPECT_EQ(rw->Finish().error_code(), grpc::StatusCode::CANCELLED);
    EXPECT_EQ(metric(R"(ropeattn_requests_total{method="Decode.Step",code="OK"})"), 0);
    EXPECT_EQ(metric(R"(ropeattn_requests_total{method="Decode.Open",code="OK"})"), 1);
    EXPECT_EQ(metric(R"(ropeattn_answers_timed_out_total{method="Decode.Step"})"), 1);
    EXPECT_EQ(metric(R"(ropeattn_answers_timed_out_total{method="Decode.Open"})"), 0);
    EXPECT_EQ(metric(R"(ropeattn_request_duration_seconds_count{method="Decode.Step"})"), 1);
    std::string line;
    EXPECT_TRUE(
        Eventually([&] { return !(line = error_line("unread-decode")).empty(); }, absl::Seconds(5)))
        << capture.Text();
    EXPECT_THAT(line, HasSubstr("\"method\":\"/ropeattn.v1.AttentionService/Decode\""));
    EXPECT_THAT(line, HasSubstr("\"code\":\"CANCELLED\""));
    EXPECT_THAT(line, HasSubstr("Decode.Step seq 7: the answer was not taken within "
                                "--answer_timeout_seconds (1 s)"));
    EXPECT_THAT(line, HasSubstr("\"peer\":\"ipv"));  // as it was, not "unknown"
  }
  server->Shutdown(absl::Seconds(1));
}

// --------------------------------------------------- truncate and fork --

TEST_F(SessionTest, TruncateThenContinueEqualsAFreshSession) {
  const Config c{"gqa", 8, 2, 16, 16, "default"};
  const Sequence seq = MakeSequence(c, 12, 11);
  const Sequence other = MakeSequence(c, 12, 99);  // a rejected speculative branch
  Stream s(stub_.get());
  s.Open(MakeOpen(c));
  ASSERT_TRUE(s.Step(seq, 0, 6, 1).has_step());
  ASSERT_TRUE(s.Step(other, 6, 10, 2).has_step());
  v1::DecodeRequest trunc;
  trunc.mutable_truncate()->set_seq(3);
  trunc.mutable_truncate()->set_position(6);
  v1::DecodeResponse tr = s.Send(trunc);
  ASSERT_TRUE(tr.has_truncated()) << tr.DebugString();
  EXPECT_EQ(tr.truncated().position(), 6);
  v1::DecodeResponse after = s.Step(seq, 6, 12, 4);

  Stream fresh(stub_.get());
  fresh.Open(MakeOpen(c));
  ASSERT_TRUE(fresh.Step(seq, 0, 6, 1).has_step());
  v1::DecodeResponse want = fresh.Step(seq, 6, 12, 2);
  ASSERT_TRUE(after.has_step());
  EXPECT_EQ(after.step().out().data(), want.step().out().data());  // bit-identical
  EXPECT_TRUE(AllClose(WireToDoubles(after.step().out()), ExpectedStep(c, seq, 6, 12), kF32Tol));
}

// f32 sessions keep a core KvCache where its AVX-512 decode runs, token-major
// tensors otherwise (and for bf16): forking copies either. The last case
// turns the AVX-512 kernels off, as on an AVX2-only machine.
TEST_F(SessionTest, ForksDivergeIndependently) {
  struct ForkCase {
    Config c;
    bool avx512;
  };
  for (const ForkCase& fc :
       {ForkCase{Config{"mha", 4, 4, 16, 16, "default"}, true},
        ForkCase{Config{"gqa", 4, 2, 16, 16, "default"}, true},
        ForkCase{Config{"gqa_bf16_kv", 4, 2, 16, 16, "default", 1, 0, false, 0, true}, true},
        ForkCase{Config{"gqa_f32_token_major", 4, 2, 16, 16, "default"}, false}}) {
    const Config& c = fc.c;
    SCOPED_TRACE(c.name);
    const bool previous = internal::SetAvx512KernelsForTesting(fc.avx512);
    absl::Cleanup restore = [previous] { internal::SetAvx512KernelsForTesting(previous); };
    const size_t kv_row = c.kv_heads * 16 * DTypeSize(c.bf16_kv ? DType::kBF16 : DType::kF32);
    const double tol = c.bf16_kv ? kBF16Tol : kF32Tol;
    const Sequence a = MakeSequence(c, 10, 21);
    Sequence b = MakeSequence(c, 10, 22);
    // b shares a's first 5 tokens.
    std::memcpy(b.q.data<float>(), a.q.data<float>(), 5 * 4 * 16 * sizeof(float));
    std::memcpy(b.k.data<char>(), a.k.data<char>(), 5 * kv_row);
    std::memcpy(b.v.data<char>(), a.v.data<char>(), 5 * kv_row);

    Stream parent(stub_.get());
    parent.Open(MakeOpen(c));
    ASSERT_TRUE(parent.Step(a, 0, 5, 1).has_step());
    v1::DecodeRequest fork;
    fork.mutable_fork()->set_seq(2);
    v1::DecodeResponse fr = parent.Send(fork);
    ASSERT_TRUE(fr.has_forked()) << fr.DebugString();
    EXPECT_EQ(fr.forked().position(), 5);
    EXPECT_FALSE(fr.forked().session_id().empty());
    EXPECT_FALSE(fr.forked().attached());

    Stream child(stub_.get());
    child.Attach(fr.forked().session_id());
    v1::DecodeResponse from_parent = parent.Step(a, 5, 10, 3);
    v1::DecodeResponse from_child = child.Step(b, 5, 10, 1);
    ASSERT_TRUE(from_parent.has_step()) << from_parent.DebugString();
    ASSERT_TRUE(from_child.has_step()) << from_child.DebugString();
    EXPECT_TRUE(AllClose(WireToDoubles(from_parent.step().out()), ExpectedStep(c, a, 5, 10), tol));
    EXPECT_TRUE(AllClose(WireToDoubles(from_child.step().out()), ExpectedStep(c, b, 5, 10), tol));
  }
}

// A fork of a session CloseSession ended from another call (its stream
// still holds it) is refused before anything is allocated: no session is
// counted as opened, and only the real close as closed.
TEST_F(SessionTest, AForkOfAClosedSessionIsRefusedAndNotCounted) {
  const Config c{"mha", 2, 2, 8, 8, "default"};
  const auto counter = [&](const std::string& series) {
    return MetricValue(server_->metrics().RenderPrometheus(), series);
  };
  const std::string opened_total = "ropeattn_sessions_opened_total";
  const std::string closed_total = "ropeattn_sessions_closed_total{reason=\"closed\"}";
  Stream parent(stub_.get());
  v1::OpenSession open = MakeOpen(c);
  open.set_resumable(true);
  const v1::SessionInfo opened = parent.Open(open);
  ASSERT_TRUE(parent.Step(MakeSequence(c, 3, 5), 0, 3, 1).has_step());
  const double opened0 = counter(opened_total);
  const double closed0 = std::max(0.0, counter(closed_total));
  ASSERT_EQ(opened0, 1.0);
  grpc::ClientContext ctx;
  v1::CloseSessionRequest close;
  close.set_session_id(opened.session_id());
  v1::CloseSessionResponse closed;
  ASSERT_TRUE(stub_->CloseSession(&ctx, close, &closed).ok());
  v1::DecodeRequest fork;
  fork.mutable_fork()->set_seq(2);
  EXPECT_TRUE(parent.rw()->Write(fork));
  const grpc::Status st = parent.AwaitServerEnd();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("was closed"));
  EXPECT_EQ(counter(opened_total), opened0);
  EXPECT_EQ(counter(closed_total), closed0 + 1);
  grpc::ClientContext list_ctx;
  v1::ListSessionsResponse list;
  ASSERT_TRUE(stub_->ListSessions(&list_ctx, {}, &list).ok());
  EXPECT_EQ(list.sessions_size(), 0);
}

// A fork whose source CloseSession ends while the copy runs was checked
// only before the copy: it was answered `forked`, listed and counted as
// opened. It is refused with the source's status, counted neither opened
// nor closed. (The close lands at a fraction of an uncontended fork's time,
// under dynamic NTK, whose fork copies every page and the raw keys.)
TEST_F(SessionTest, AForkWhoseSourceClosesDuringTheCopyIsRefusedAndNotCounted) {
  server::ServerOptions o = TestServerOptions();
  o.memory_budget_bytes = int64_t{1} << 30;
  o.max_message_bytes = 128 << 20;  // the prefix
  Restart(o);
  ASSERT_NE(server_, nullptr);
  Config c{"dynamic", 8, 8, 128, 128, "dynamic"};
  c.factor = 2;
  c.original = 2048;
  constexpr int64_t kPrefix = 8192;
  const Sequence seq = MakeSequence(c, kPrefix, 5);
  v1::OpenSession open = MakeOpen(c, kPrefix + 64);
  *open.mutable_prefix()->mutable_k() = ToWire(seq.k.cview());
  *open.mutable_prefix()->mutable_v() = ToWire(seq.v.cview());
  open.mutable_prefix()->set_key_form(v1::KEY_FORM_RAW);
  const auto counter = [&](const std::string& series) {
    return std::max(0.0, MetricValue(server_->metrics().RenderPrometheus(), series));  // absent: 0
  };
  v1::DecodeRequest fork;
  fork.mutable_fork()->set_seq(1);
  fork.mutable_fork()->set_idle_ttl_seconds(60);
  absl::Duration uncontended;
  {
    Stream s(stub_.get());
    s.Open(open);
    const absl::Time t0 = absl::Now();
    ASSERT_TRUE(s.Send(fork).has_forked());
    uncontended = absl::Now() - t0;
  }
  ASSERT_TRUE(Eventually([&] { return server_->sessions().open_sessions() == 1; }));  // the fork
  bool refused = false;
  for (const double frac : {0.3, 0.2, 0.4, 0.15, 0.3}) {
    SCOPED_TRACE(absl::StrCat("close at ", frac, " of ", absl::FormatDuration(uncontended)));
    Stream s(stub_.get());
    const std::string id = s.Open(open).session_id();
    // Listed now: this source, the uncontended fork, and the forks of earlier
    // tries whose close came after the copy.
    const int listed0 = server_->sessions().open_sessions();
    const double opened0 = counter("ropeattn_sessions_opened_total");
    const double closed0 = counter("ropeattn_sessions_closed_total{reason=\"closed\"}");
    const absl::Time t0 = absl::Now();
    ASSERT_TRUE(s.rw()->Write(fork));
    absl::SleepFor(uncontended * frac);
    grpc::ClientContext ctx;
    v1::CloseSessionRequest close;
    close.set_session_id(id);
    v1::CloseSessionResponse closed;
    ASSERT_TRUE(stub_->CloseSession(&ctx, close, &closed).ok());
    const absl::Time closed_at = absl::Now();
    v1::DecodeResponse resp;
    if (s.rw()->Read(&resp)) {
      ASSERT_TRUE(resp.has_forked()) << resp.DebugString();
      // Answered well after the source was closed: the copy was running
      // (a margin for a loaded machine; a fork never refused fails below).
      EXPECT_LT(absl::Now() - closed_at, absl::Milliseconds(200))
          << "forked " << absl::FormatDuration(absl::Now() - t0) << " after the fork was sent";
      if (HasFailure()) return;
      continue;  // the close came after the copy: try an earlier one
    }
    const grpc::Status st = s.AwaitServerEnd();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr("was closed"));
    EXPECT_EQ(counter("ropeattn_sessions_opened_total"), opened0);
    EXPECT_EQ(counter("ropeattn_sessions_closed_total{reason=\"closed\"}"), closed0 + 1);
    grpc::ClientContext list_ctx;
    v1::ListSessionsResponse list;
    ASSERT_TRUE(stub_->ListSessions(&list_ctx, {}, &list).ok());
    EXPECT_EQ(list.sessions_size(), listed0 - 1);  // the source gone, no fork added
    refused = true;
    break;
  }
  EXPECT_TRUE(refused) << "every close landed after the copy";
}

// Forks share their source's pages (docs/kv-memory.md): 8 forks of a
// 1024-token session are charged only for the pages they may write (not
// the 64 full pages they share), each answers exactly from the shared prefix
// and its own 16 tokens, holds one page of its own, and the source goes on
// untouched. A fork that truncates into the shared part and grows again
// borrows the page past its reservation from the budget; when every
// session is closed the budget holds nothing.
TEST_F(SessionTest, ForksShareTheirSourcesPagesAndPayOnlyForTheirOwn) {
  const Config c{"gqa", 8, 2, 32, 32, "default"};
  const bool previous = internal::SetAvx512KernelsForTesting(false);  // pages, not tiles
  absl::Cleanup restore = [previous] { internal::SetAvx512KernelsForTesting(previous); };
  constexpr int64_t kPrefix = 1024, kMax = kPrefix + 64, kForks = 8, kNew = 16;
  // A 16-token page's charge: what its K and V parts hold resident.
  const int64_t page =
      KvPageHeldBytes(16 * c.kv_heads * c.head_dim * 4, 16 * c.kv_heads * c.v_dim * 4);
  auto server_info = [&] {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    EXPECT_TRUE(stub_->GetServerInfo(&ctx, {}, &info).ok());
    return info;
  };
  auto session_info = [&](const std::string& id) {
    grpc::ClientContext ctx;
    v1::GetSessionRequest req;
    req.set_session_id(id);
    v1::SessionInfo info;
    EXPECT_TRUE(stub_->GetSession(&ctx, req, &info).ok());
    return info;
  };
  const Sequence parent_seq = MakeSequence(c, kPrefix + 1, 31);
  Stream parent(stub_.get());
  const v1::SessionInfo opened = parent.Open(MakeOpen(c, kMax));
  ASSERT_TRUE(parent.Step(parent_seq, 0, kPrefix, 1).has_step());
  EXPECT_EQ(session_info(opened.session_id()).kv_bytes_held(), 64 * page);

  std::vector<std::string> forks;
  for (int f = 0; f < kForks; ++f) {
    v1::DecodeRequest fork;
    fork.mutable_fork()->set_seq(2 + f);
    v1::DecodeResponse fr = parent.Send(fork);
    ASSERT_TRUE(fr.has_forked()) << fr.DebugString();
    // Charged for max_context less the 64 full pages it shares.
    EXPECT_EQ(fr.forked().kv_bytes(), opened.kv_bytes() - 64 * page);
    EXPECT_EQ(fr.forked().step_room_bytes(), opened.step_room_bytes());
    forks.push_back(fr.forked().session_id());
  }
  // Each session also holds the room of its one-token steps.
  const int64_t room = opened.step_room_bytes();
  EXPECT_GT(room, 0);
  // (And the parent's open stream its share.)
  const int64_t charged = opened.kv_bytes() + kForks * (opened.kv_bytes() - 64 * page) +
                          (kForks + 1) * room + server::kDecodeStreamBytes;
  EXPECT_TRUE(Eventually([&] { return server_info().memory_bytes_in_use() == charged; }))
      << server_info().memory_bytes_in_use() << " != " << charged;
  for (int f = 0; f < kForks; ++f) {
    SCOPED_TRACE(f);
    // The fork's sequence: the parent's prefix, then its own tokens.
    Sequence seq = MakeSequence(c, kPrefix + kNew, 100 + 3 * f);
    for (Tensor* t : {&seq.q, &seq.k, &seq.v}) {
      const Tensor& from = t == &seq.q ? parent_seq.q : t == &seq.k ? parent_seq.k : parent_seq.v;
      std::memcpy(t->data<char>(), from.data<char>(), kPrefix * t->byte_size() / (kPrefix + kNew));
    }
    Stream child(stub_.get());
    child.Attach(forks[f]);
    v1::DecodeResponse r = child.Step(seq, kPrefix, kPrefix + kNew, 1);
    ASSERT_TRUE(r.has_step()) << r.DebugString();
    EXPECT_TRUE(AllClose(WireToDoubles(r.step().out()), ExpectedStep(c, seq, kPrefix, kPrefix + kNew),
                         kF32Tol));
    EXPECT_TRUE(child.Finish().ok());  // a fork is resumable: it stays
    const v1::SessionInfo info = session_info(forks[f]);
    EXPECT_EQ(info.kv_bytes_held(), 65 * page);
    EXPECT_EQ(info.kv_bytes_shared(), 64 * page);
  }
  // The source answers from its own pages.
  v1::DecodeResponse pr = parent.Step(parent_seq, kPrefix, kPrefix + 1, 20);
  ASSERT_TRUE(pr.has_step()) << pr.DebugString();
  EXPECT_TRUE(AllClose(WireToDoubles(pr.step().out()),
                       ExpectedStep(c, parent_seq, kPrefix, kPrefix + 1), kF32Tol));
  // Fork 0 rewrites the shared part: 80 tokens need 5 pages, its
  // reservation has room for 4; the fifth is borrowed.
  {
    const Sequence fresh = MakeSequence(c, 80, 400);
    Stream child(stub_.get());
    child.Attach(forks[0]);
    v1::DecodeRequest tr;
    tr.mutable_truncate()->set_seq(1);
    tr.mutable_truncate()->set_position(0);
    ASSERT_TRUE(child.Send(tr).has_truncated());
    // Only the sessions' charges are held now (nothing in flight), and the
    // two open streams' shares.
    const int64_t before = charged + server::kDecodeStreamBytes;
    EXPECT_TRUE(Eventually([&] { return server_info().memory_bytes_in_use() == before; }))
        << server_info().memory_bytes_in_use() << " != " << before;
    v1::DecodeResponse r = child.Step(fresh, 0, 80, 2);
    ASSERT_TRUE(r.has_step()) << r.DebugString();
    EXPECT_TRUE(AllClose(WireToDoubles(r.step().out()), ExpectedStep(c, fresh, 0, 80), kF32Tol));
    // The step's transient bytes are released just after its answer.
    EXPECT_TRUE(Eventually([&] { return server_info().memory_bytes_in_use() == before + page; }))
        << server_info().memory_bytes_in_use() << " != " << before + page;
    EXPECT_TRUE(child.Finish().ok());
  }
  for (const std::string& id : forks) {
    grpc::ClientContext ctx;
    v1::CloseSessionRequest req;
    req.set_session_id(id);
    v1::CloseSessionResponse resp;
    EXPECT_TRUE(stub_->CloseSession(&ctx, req, &resp).ok());
  }
  EXPECT_TRUE(parent.Finish().ok());
  EXPECT_TRUE(Eventually([&] { return server_info().memory_bytes_in_use() == 0; }))
      << server_info().memory_bytes_in_use();
}

// ---------------------------------------------------------- isolation --

TEST_F(SessionTest, ConcurrentSessionsEachGetTheirSoloOutputs) {
  const Config c{"gqa", 8, 2, 16, 16, "yarn", 4.0, 8};
  constexpr int kSessions = 12;
  constexpr int64_t kLen = 10;
  std::vector<Sequence> seqs;
  for (int i = 0; i < kSessions; ++i) seqs.push_back(MakeSequence(c, kLen, 100 + 7 * i));
  auto run = [&](int i) {
    std::vector<std::string> outs;
    Stream s(stub_.get());
    s.Open(MakeOpen(c));
    for (int64_t t = 0; t < kLen; ++t) {
      v1::DecodeResponse r = s.Step(seqs[i], t, t + 1, t + 1);
      outs.push_back(r.step().out().data());
    }
    s.Finish();
    return outs;
  };
  std::vector<std::vector<std::string>> solo(kSessions), together(kSessions);
  for (int i = 0; i < kSessions; ++i) solo[i] = run(i);
  std::vector<std::thread> threads;
  for (int i = 0; i < kSessions; ++i) threads.emplace_back([&, i] { together[i] = run(i); });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kSessions; ++i) EXPECT_EQ(together[i], solo[i]) << "session " << i;
}

// ------------------------------------------------------------- limits --

TEST_F(SessionTest, BudgetExhaustionRefusesOnlyTheNewSession) {
  const Config c{"mha", 4, 4, 16, 16, "default"};
  const Sequence seq = MakeSequence(c, 4, 5);
  Stream ok(stub_.get());
  ok.Open(MakeOpen(c));
  ASSERT_TRUE(ok.Step(seq, 0, 2, 1).has_step());
  // 256 MiB budget; this asks for 2^20 tokens * 4 heads * 32 dims * 4 bytes = 512 MiB.
  Stream big(stub_.get());
  v1::DecodeRequest req;
  *req.mutable_open() = MakeOpen(c, 1 << 20);
  ASSERT_TRUE(big.rw()->Write(req));
  v1::DecodeResponse resp;
  EXPECT_FALSE(big.rw()->Read(&resp));
  grpc::Status st = big.Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(st.error_message(), HasSubstr("memory budget exhausted"));
  // The first session keeps working.
  v1::DecodeResponse r = ok.Step(seq, 2, 4, 2);
  ASSERT_TRUE(r.has_step());
  EXPECT_TRUE(AllClose(WireToDoubles(r.step().out()), ExpectedStep(c, seq, 2, 4), kF32Tol));
}

TEST_F(SessionTest, IdleSessionsAreReapedWithASpecificError) {
  const Config c{"mha", 4, 4, 16, 16, "default"};
  v1::OpenSession open = MakeOpen(c, 64, /*resumable=*/true);
  open.set_idle_ttl_seconds(1);
  std::string id;
  {
    Stream s(stub_.get());
    id = s.Open(open).session_id();
    EXPECT_TRUE(s.Finish().ok());
  }
  // Detached (once the server has seen the stream end) but resumable: still there.
  EXPECT_TRUE(Eventually([&] {
    grpc::ClientContext ctx;
    v1::GetSessionRequest req;
    req.set_session_id(id);
    v1::SessionInfo info;
    return stub_->GetSession(&ctx, req, &info).ok() && !info.attached();
  }));
  ASSERT_TRUE(Eventually([&] { return server_->sessions().reaped_total() >= 1; }));
  Stream late(stub_.get());
  v1::DecodeRequest req;
  req.mutable_attach()->set_session_id(id);
  ASSERT_TRUE(late.rw()->Write(req));
  grpc::Status st = late.Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(st.error_message(), HasSubstr("expired"));
  EXPECT_EQ(server_->sessions().kv_bytes_in_use(), 0);
}

TEST_F(SessionTest, CancelMidStreamFreesTheSessionAtOnce) {
  const Config c{"mha", 4, 4, 16, 16, "default"};
  const Sequence seq = MakeSequence(c, 4, 5);
  const int64_t baseline = server_->sessions().kv_bytes_in_use();
  auto s = std::make_unique<Stream>(stub_.get());
  s->Open(MakeOpen(c));
  ASSERT_TRUE(s->Step(seq, 0, 2, 1).has_step());
  EXPECT_GT(server_->sessions().kv_bytes_in_use(), baseline);
  s->context().TryCancel();
  s->Finish();
  EXPECT_TRUE(Eventually([&] { return server_->sessions().kv_bytes_in_use() == baseline; }));
  EXPECT_EQ(server_->sessions().open_sessions(), 0);
}

// ---------------------------------------------------------- bad input --

TEST_F(SessionTest, BadStepIsAnsweredInBandAndLosesNothing) {
  const Config c{"mha", 4, 4, 16, 16, "default"};
  const Sequence seq = MakeSequence(c, 6, 5);
  Stream s(stub_.get());
  s.Open(MakeOpen(c));
  ASSERT_TRUE(s.Step(seq, 0, 3, 1).has_step());

  struct Bad {
    std::string what;
    std::function<void(v1::Step*)> mutate;
    grpc::StatusCode code;
    std::string message;
  };
  const std::vector<Bad> bad = {
      {"wrong byte length", [](v1::Step* st) { st->mutable_q()->mutable_data()->resize(10); },
       grpc::StatusCode::INVALID_ARGUMENT, "step.q"},
      {"shape mismatch", [](v1::Step* st) { st->mutable_k()->set_shape(2, 3); },
       grpc::StatusCode::INVALID_ARGUMENT, "step.k"},
      {"overflowing shape",
       [](v1::Step* st) {
         st->mutable_q()->clear_shape();
         for (int64_t d : {int64_t{1} << 40, int64_t{1} << 40, int64_t{1}, int64_t{1}}) {
           st->mutable_q()->add_shape(d);
         }
       },
       grpc::StatusCode::INVALID_ARGUMENT, "step.q"},
      {"NaN input",
       [](v1::Step* st) {
         const float nan = std::nanf("");
         std::memcpy(st->mutable_v()->mutable_data()->data() + 4 * 5, &nan, 4);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "step.v[0, 0, 0, 5] is NaN"},
      {"unspecified dtype", [](v1::Step* st) { st->mutable_q()->set_dtype(v1::DTYPE_UNSPECIFIED); },
       grpc::StatusCode::INVALID_ARGUMENT, "step.q"},
      {"hidden states instead of q/k/v",
       [](v1::Step* st) {
         *st->mutable_hidden() = st->q();
         st->clear_q();
         st->clear_k();
         st->clear_v();
       },
       grpc::StatusCode::INVALID_ARGUMENT, "step.hidden is for layer-mode sessions"},
  };
  uint64_t n = 10;
  for (const Bad& b : bad) {
    v1::DecodeRequest req;
    v1::Step* st = req.mutable_step();
    st->set_seq(++n);
    *st->mutable_q() = ToWire(seq.q.cview().Slice(1, 3, 1));
    *st->mutable_k() = ToWire(seq.k.cview().Slice(1, 3, 1));
    *st->mutable_v() = ToWire(seq.v.cview().Slice(1, 3, 1));
    b.mutate(st);
    v1::DecodeResponse r = s.Send(req);
    ASSERT_TRUE(r.has_error()) << b.what << ": " << r.DebugString();
    EXPECT_EQ(r.error().seq(), n) << b.what;
    EXPECT_EQ(r.error().code(), b.code) << b.what << ": " << r.error().message();
    EXPECT_THAT(r.error().message(), HasSubstr(b.message)) << b.what;
  }
  // Past max_context is OUT_OF_RANGE.
  {
    Stream small(stub_.get());
    small.Open(MakeOpen(c, /*max_context=*/4));
    v1::DecodeResponse r = small.Step(seq, 0, 6, 1);
    ASSERT_TRUE(r.has_error());
    EXPECT_EQ(r.error().code(), grpc::StatusCode::OUT_OF_RANGE);
    EXPECT_THAT(r.error().message(), HasSubstr("max_context of 4"));
  }
  // The session lost nothing: the next good step matches the reference.
  v1::DecodeResponse r = s.Step(seq, 3, 6, 99);
  ASSERT_TRUE(r.has_step()) << r.DebugString();
  EXPECT_EQ(r.step().position(), 6);
  EXPECT_TRUE(AllClose(WireToDoubles(r.step().out()), ExpectedStep(c, seq, 3, 6), kF32Tol));
}

TEST_F(SessionTest, StreamLevelErrorsEndTheStreamWithTheRightCode) {
  const Config c{"mha", 4, 4, 16, 16, "default"};
  const Sequence seq = MakeSequence(c, 2, 5);
  auto first_message_fails = [&](const v1::DecodeRequest& req) {
    Stream s(stub_.get());
    EXPECT_TRUE(s.rw()->Write(req));
    return s.Finish();
  };
  v1::DecodeRequest step;
  *step.mutable_step()->mutable_q() = ToWire(seq.q.cview());
  EXPECT_EQ(first_message_fails(step).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  v1::DecodeRequest unknown;
  unknown.mutable_attach()->set_session_id("0123456789abcdef0123456789abcdef");
  grpc::Status st = first_message_fails(unknown);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(st.error_message(), HasSubstr("unknown session id"));

  v1::DecodeRequest bad_spec;
  *bad_spec.mutable_open() = MakeOpen(Config{"x", 6, 4, 16, 16, "default"});
  st = first_message_fails(bad_spec);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  v1::DecodeRequest odd_dim;
  *odd_dim.mutable_open() = MakeOpen(Config{"x", 4, 4, 15, 16, "default"});
  EXPECT_EQ(first_message_fails(odd_dim).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  v1::DecodeRequest unknown_rule;
  *unknown_rule.mutable_open() = MakeOpen(Config{"x", 4, 4, 16, 16, "foo"});
  st = first_message_fails(unknown_rule);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("foo"));

  // A closed session: the stream ends after answering the close; attaching
  // its id later is FAILED_PRECONDITION ("was closed"), GetSession too.
  Stream s(stub_.get());
  v1::OpenSession open = MakeOpen(c, 64, /*resumable=*/true);
  const std::string id = s.Open(open).session_id();
  v1::DecodeRequest close;
  close.mutable_close()->set_seq(5);
  v1::DecodeResponse closed = s.Send(close);
  EXPECT_TRUE(closed.has_closed());
  EXPECT_TRUE(s.Finish().ok());
  v1::DecodeRequest again;
  again.mutable_attach()->set_session_id(id);
  st = first_message_fails(again);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(st.error_message(), HasSubstr("was closed"));
}

TEST_F(SessionTest, OperatorCloseEndsTheSessionsStream) {
  const Config c{"mha", 4, 4, 16, 16, "default"};
  const Sequence seq = MakeSequence(c, 4, 5);
  Stream s(stub_.get());
  const std::string id = s.Open(MakeOpen(c)).session_id();
  {
    grpc::ClientContext ctx;
    v1::ListSessionsResponse list;
    ASSERT_TRUE(stub_->ListSessions(&ctx, {}, &list).ok());
    ASSERT_EQ(list.sessions_size(), 1);
    EXPECT_EQ(list.sessions(0).session_id(), id);
  }
  grpc::ClientContext ctx;
  v1::CloseSessionRequest req;
  req.set_session_id(id);
  v1::CloseSessionResponse resp;
  ASSERT_TRUE(stub_->CloseSession(&ctx, req, &resp).ok());
  v1::DecodeRequest step;
  v1::Step* st = step.mutable_step();
  *st->mutable_q() = ToWire(seq.q.cview().Slice(1, 0, 1));
  *st->mutable_k() = ToWire(seq.k.cview().Slice(1, 0, 1));
  *st->mutable_v() = ToWire(seq.v.cview().Slice(1, 0, 1));
  ASSERT_TRUE(s.rw()->Write(step));
  grpc::Status status = s.Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(server_->sessions().kv_bytes_in_use(), 0);
}

// Control calls take only a session's metadata lock: while a long step
// holds the session's state, GetSession of that very session, ListSessions,
// CloseSession of another session and GetServerInfo all answer before the
// step does; a CloseSession of the stepping session itself answers at once
// too, the step's stream then ends FAILED_PRECONDITION and the session's
// memory is back in the budget.
TEST_F(SessionTest, ControlCallsAnswerWhileAStepRuns) {
  // One step of 2048 tokens, 32 heads over 8, head_dim 128, on one kernel
  // thread: about a second of compute, priced at ~0.6 GiB of buffers.
  server::ServerOptions o = TestServerOptions();
  o.memory_budget_bytes = int64_t{2} << 30;
  o.compute_workers = 1;  // the step holds the only worker
  Restart(o);
  ASSERT_NE(server_, nullptr);
  const Config c{"gqa_long", 32, 8, 128, 128, "default"};
  constexpr int64_t kTokens = 2048;
  const Sequence seq = MakeSequence(c, 2 * kTokens, 11);
  Stream busy(stub_.get());
  const std::string busy_id = busy.Open(MakeOpen(c, 2 * kTokens)).session_id();
  Stream other(stub_.get());
  const std::string other_id = other.Open(MakeOpen(Config{"small"}, 16, true)).session_id();
  ASSERT_TRUE(other.Finish().ok());  // detached, resumable
  const int64_t baseline = server_->sessions().kv_bytes_in_use();

  using SteadyClock = std::chrono::steady_clock;
  const auto step_async = [&](int64_t first, uint64_t seq_no, SteadyClock::time_point* done,
                              v1::DecodeResponse* resp) {
    return std::thread([&, first, seq_no, done, resp] {
      v1::DecodeRequest req;
      v1::Step* st = req.mutable_step();
      st->set_seq(seq_no);
      *st->mutable_q() = ToWire(seq.q.cview().Slice(1, first, kTokens));
      *st->mutable_k() = ToWire(seq.k.cview().Slice(1, first, kTokens));
      *st->mutable_v() = ToWire(seq.v.cview().Slice(1, first, kTokens));
      if (busy.rw()->Write(req) && busy.rw()->Read(resp)) {
        *done = SteadyClock::now();
      } else {
        *done = SteadyClock::now();
        resp->Clear();
      }
    });
  };
  const auto memory_in_use = [&] {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    return stub_->GetServerInfo(&ctx, {}, &info).ok() ? info.memory_bytes_in_use() : -1;
  };
  const int64_t idle_memory = memory_in_use();
  // Waits until the server has admitted the step (its buffers reserved).
  const auto await_running = [&] {
    return Eventually([&] { return memory_in_use() > idle_memory; });
  };

  SteadyClock::time_point step_done{};
  v1::DecodeResponse step_resp;
  std::thread stepping = step_async(0, 1, &step_done, &step_resp);
  if (!await_running()) {
    stepping.join();
    FAIL() << "the step was never seen running: " << step_resp.DebugString().substr(0, 400);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // well inside the step
  std::vector<std::pair<std::string, SteadyClock::time_point>> answered;
  // The step publishes its position when its computation ends: a position
  // of 0 right after a control call's answer means that call did not wait.
  std::vector<std::string> still_computing;
  const auto check_still_computing = [&] {
    grpc::ClientContext ctx;
    v1::GetSessionRequest req;
    req.set_session_id(busy_id);
    v1::SessionInfo info;
    if (stub_->GetSession(&ctx, req, &info).ok() && info.position() == 0) {
      still_computing.push_back(answered.back().first);
    } else {
      ADD_FAILURE() << answered.back().first << " was answered only after the step computed";
    }
  };
  {
    grpc::ClientContext ctx;
    v1::GetSessionRequest req;
    req.set_session_id(busy_id);
    v1::SessionInfo info;
    EXPECT_TRUE(stub_->GetSession(&ctx, req, &info).ok());
    EXPECT_EQ(info.position(), 0) << "the step is still running";
    answered.emplace_back("GetSession(stepping session)", SteadyClock::now());
    check_still_computing();
  }
  {
    grpc::ClientContext ctx;
    v1::ListSessionsResponse list;
    EXPECT_TRUE(stub_->ListSessions(&ctx, {}, &list).ok());
    EXPECT_EQ(list.sessions_size(), 2);
    answered.emplace_back("ListSessions", SteadyClock::now());
    check_still_computing();
  }
  {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    EXPECT_TRUE(stub_->GetServerInfo(&ctx, {}, &info).ok());
    answered.emplace_back("GetServerInfo", SteadyClock::now());
    check_still_computing();
  }
  {
    // A Decode attach (and the stream's own close) with the only worker busy.
    Stream attach(stub_.get());
    EXPECT_EQ(attach.Attach(other_id).session_id(), other_id);
    answered.emplace_back("Decode attach", SteadyClock::now());
    check_still_computing();
    v1::DecodeRequest close;
    close.mutable_close()->set_seq(1);
    EXPECT_TRUE(attach.Send(close).has_closed());
    answered.emplace_back("Decode close", SteadyClock::now());
    check_still_computing();
    EXPECT_TRUE(attach.Finish().ok());
  }
  {
    grpc::ClientContext ctx;
    v1::CloseSessionRequest req;
    req.set_session_id(other_id);
    v1::CloseSessionResponse resp;
    // Closed already by its stream: the operator hears it was closed.
    EXPECT_EQ(stub_->CloseSession(&ctx, req, &resp).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
    answered.emplace_back("CloseSession(another session)", SteadyClock::now());
    check_still_computing();
  }
  stepping.join();
  ASSERT_TRUE(step_resp.has_step()) << step_resp.DebugString();
  EXPECT_EQ(step_resp.step().position(), kTokens);
  for (const auto& [what, when] : answered) {
    EXPECT_LT(when, step_done) << what << " waited for the step";
  }
  EXPECT_EQ(still_computing.size(), answered.size());

  // Now close the stepping session in the middle of its next step.
  SteadyClock::time_point second_done{};
  v1::DecodeResponse second_resp;
  std::thread second = step_async(kTokens, 2, &second_done, &second_resp);
  if (!await_running()) {
    second.join();
    FAIL() << "the second step was never seen running: "
           << second_resp.DebugString().substr(0, 400);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  SteadyClock::time_point closed_at;
  {
    grpc::ClientContext ctx;
    v1::CloseSessionRequest req;
    req.set_session_id(busy_id);
    v1::CloseSessionResponse resp;
    EXPECT_TRUE(stub_->CloseSession(&ctx, req, &resp).ok());
    closed_at = SteadyClock::now();
  }
  second.join();
  EXPECT_LT(closed_at, second_done) << "CloseSession waited for the step";
  EXPECT_FALSE(second_resp.has_step()) << "a step of a closed session answered";
  EXPECT_EQ(busy.AwaitServerEnd().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(Eventually([&] { return server_->sessions().kv_bytes_in_use() == 0; }));
  EXPECT_LE(server_->sessions().kv_bytes_in_use(), baseline);
}

TEST_F(SessionTest, OversizeMessageIsRefusedAndTheServerStaysUp) {
  // The test server allows 64 MiB; the client allows more, so the server is
  // the one that refuses.
  auto big_stub = v1::AttentionService::NewStub(TestChannel(server_->port(), 256 << 20));
  v1::AttendRequest req;
  req.mutable_spec()->set_heads(1);
  req.mutable_spec()->set_head_dim(64);
  req.mutable_q()->set_dtype(v1::DTYPE_F32);
  for (int64_t d : {1, 1 << 19, 1, 64}) req.mutable_q()->add_shape(d);
  req.mutable_q()->mutable_data()->resize(size_t{128} << 20);
  grpc::ClientContext ctx;
  v1::AttendResponse resp;
  grpc::Status st = big_stub->Attend(&ctx, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  // Still serving.
  grpc::ClientContext ctx2;
  v1::ServerInfo info;
  EXPECT_TRUE(stub_->GetServerInfo(&ctx2, {}, &info).ok());
}

// GET http://127.0.0.1:port/metrics over a plain socket.
std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string req =
      "GET " + path + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
  if (send(fd, req.data(), req.size(), 0) < 0) {
    close(fd);
    return "";
  }
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, n);
  close(fd);
  return out;
}

TEST_F(SessionTest, MetricsEndpointReflectsTraffic) {
  const Config c{"mha", 4, 4, 16, 16, "default"};
  const Sequence seq = MakeSequence(c, 3, 5);
  {
    Stream s(stub_.get());
    s.Open(MakeOpen(c));
    ASSERT_TRUE(s.Step(seq, 0, 3, 1).has_step());
    v1::DecodeRequest bad;
    bad.mutable_step()->set_seq(2);
    EXPECT_TRUE(s.Send(bad).has_error());
    EXPECT_TRUE(s.Finish().ok());
  }
  ASSERT_TRUE(Eventually([&] { return server_->sessions().open_sessions() == 0; }));
  const std::string text = HttpGet(server_->metrics_port(), "/metrics");
  EXPECT_THAT(text, HasSubstr("200 OK"));
  EXPECT_THAT(text, HasSubstr("ropeattn_decode_steps_total 1\n"));
  EXPECT_THAT(text, HasSubstr("ropeattn_decode_tokens_total 3\n"));
  EXPECT_THAT(text, HasSubstr("ropeattn_requests_total{method=\"Decode.Step\",code=\"OK\"} 1\n"));
  EXPECT_THAT(
      text,
      HasSubstr("ropeattn_requests_total{method=\"Decode.Step\",code=\"INVALID_ARGUMENT\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("ropeattn_sessions_opened_total 1\n"));
  EXPECT_THAT(text, HasSubstr("ropeattn_sessions_closed_total{reason=\"stream_ended\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("ropeattn_kv_bytes_used 0\n"));
  EXPECT_THAT(text, HasSubstr("ropeattn_decode_steps_total"));
}

// ropeattn_queue_depth is read when /metrics is scraped: the landed gauge
// was set only when a request arrived, so after a burst it stayed at the
// depth the last arrival saw (8 or 9 after 10 concurrent calls) for good.
TEST(ServerMetricsTest, QueueDepthFallsToZeroOnceTheQueueEmpties) {
  server::ServerOptions o = TestServerOptions();
  o.compute_workers = 1;
  o.max_queue_slowdown = 0;  // nothing shed: every call queues
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());
  v1::AttendRequest req;
  req.mutable_spec()->set_heads(8);
  req.mutable_spec()->set_head_dim(64);
  *req.mutable_q() = ToWire(RandomTensor(DType::kF32, {1, 256, 8, 64}, 1).cview());
  *req.mutable_k() = ToWire(RandomTensor(DType::kF32, {1, 1024, 8, 64}, 2).cview());
  *req.mutable_v() = ToWire(RandomTensor(DType::kF32, {1, 1024, 8, 64}, 3).cview());
  std::vector<std::thread> callers;
  std::atomic<int> ok{0};
  for (int i = 0; i < 6; ++i) {
    callers.emplace_back([&] {
      grpc::ClientContext ctx;
      v1::AttendResponse resp;
      if (stub->Attend(&ctx, req, &resp).ok()) ok.fetch_add(1);
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(ok.load(), 6);
  const std::string text = HttpGet(server->metrics_port(), "/metrics");
  EXPECT_THAT(text, HasSubstr("ropeattn_queue_depth 0\n"));
  EXPECT_THAT(text, HasSubstr("ropeattn_running 0\n"));
  server->Shutdown(absl::Seconds(1));
}

// The same sequence through the unary Attend RPC: for rules that do not
// depend on the length, every decode step equals the matching rows of one
// Attend over the whole sequence; for dynamic NTK and LongRoPE, each step
// equals an Attend over its prefix (frequencies for that length).
// (Attend is softmax attention: linear sessions are checked against the
// linear reference above.)
void ExpectStepsEqualAttend(v1::AttentionService::Stub* stub, const Config& c) {
  const int64_t len = 12;
  const Sequence seq = MakeSequence(c, len, 31);
  const bool length_dependent = c.rope_type == "dynamic" || c.rope_type == "longrope";
  auto attend = [&](int64_t first, int64_t last) {
    v1::AttendRequest req;
    *req.mutable_spec() = MakeOpen(c).spec();
    req.mutable_spec()->set_causal(true);
    *req.mutable_q() = ToWire(seq.q.cview().Slice(1, first, last - first));
    *req.mutable_k() = ToWire(seq.k.cview().Slice(1, 0, last));
    *req.mutable_v() = ToWire(seq.v.cview().Slice(1, 0, last));
    req.add_q_offsets(first);
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    grpc::Status st = stub->Attend(&ctx, req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return WireToDoubles(resp.out());
  };
  const std::vector<double> whole = attend(0, len);
  const int64_t row = c.heads * c.v_dim;
  const double tol = c.bf16_kv ? kBF16Tol : kF32Tol;
  Stream s(stub);
  s.Open(MakeOpen(c));
  for (int64_t t = 0; t < len; ++t) {
    v1::DecodeResponse r = s.Step(seq, t, t + 1, t + 1);
    ASSERT_TRUE(r.has_step()) << r.DebugString();
    const std::vector<double> want =
        length_dependent
            ? attend(t, t + 1)
            : std::vector<double>(whole.begin() + t * row, whole.begin() + (t + 1) * row);
    EXPECT_TRUE(AllClose(WireToDoubles(r.step().out()), want, tol)) << c.name << " step " << t;
  }
}

TEST_F(SessionTest, DecodeStepsEqualAttendOverThePrefix) {
  for (const Config& c : SoftmaxConfigs()) {
    SCOPED_TRACE(c.name);
    ExpectStepsEqualAttend(stub_.get(), c);
  }
}

TEST(ServerLimitsTest, FullQueueAnswersResourceExhaustedAtOnce) {
  server::ServerOptions o = TestServerOptions();
  o.compute_workers = 1;
  o.queue_depth = 1;
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());
  // A request heavy enough to keep the single worker busy for a while.
  v1::AttendRequest req;
  req.mutable_spec()->set_heads(8);
  req.mutable_spec()->set_head_dim(64);
  req.mutable_spec()->set_causal(true);
  const Tensor q = RandomTensor(DType::kF32, {1, 512, 8, 64}, 1);
  *req.mutable_q() = ToWire(q.view());
  *req.mutable_k() = ToWire(q.view());
  *req.mutable_v() = ToWire(q.view());
  constexpr int kCalls = 16;
  std::vector<grpc::Status> results(kCalls);
  std::vector<std::string> hints(kCalls);  // trailing retry-after-ms
  std::vector<std::thread> threads;
  for (int i = 0; i < kCalls; ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext ctx;
      v1::AttendResponse resp;
      results[i] = stub->Attend(&ctx, req, &resp);
      const auto hint = ctx.GetServerTrailingMetadata().find("retry-after-ms");
      if (hint != ctx.GetServerTrailingMetadata().end()) {
        hints[i] = std::string(hint->second.data(), hint->second.size());
      }
    });
  }
  for (auto& t : threads) t.join();
  int ok = 0, exhausted = 0;
  for (int i = 0; i < kCalls; ++i) {
    const grpc::Status& st = results[i];
    if (st.ok()) ++ok;
    if (st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++exhausted;
      EXPECT_THAT(st.error_message(), HasSubstr("queue is full"));
      // Shed with a hint of when to retry, as admission's refusals are.
      int64_t ms = 0;
      EXPECT_TRUE(absl::SimpleAtoi(hints[i], &ms)) << "retry-after-ms: '" << hints[i] << "'";
      EXPECT_GE(ms, 1);
      EXPECT_LE(ms, 10000);
    }
  }
  EXPECT_EQ(ok + exhausted, kCalls);
  EXPECT_GE(ok, 1);
  EXPECT_GE(exhausted, 1);
  // Not stuck: the next call is served.
  grpc::ClientContext ctx;
  v1::AttendResponse resp;
  EXPECT_TRUE(stub->Attend(&ctx, req, &resp).ok());
}

// The real binary: started on port 0, it prints its port; SIGTERM turns
// health NOT_SERVING, ends, and exits 0 within the grace period.
TEST(ServerProcessTest, SigtermDrainsAndExits) {
  int out_pipe[2];
  ASSERT_EQ(pipe(out_pipe), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    dup2(out_pipe[1], STDOUT_FILENO);
    close(out_pipe[0]);
    execl(ROPEATTN_SERVER_PATH, "ropeattn-server", "--address=127.0.0.1:0",
          "--metrics_address=", "--shutdown_grace_seconds=2", static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out_pipe[1]);
  FILE* out = fdopen(out_pipe[0], "r");
  const testing::ServerStartup startup = testing::ReadServerStartup(out);
  const int port = startup.port;
  ASSERT_GT(port, 0) << startup.text;
  auto health = grpc::health::v1::Health::NewStub(TestChannel(port));
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckResponse resp;
    ASSERT_TRUE(health->Check(&ctx, {}, &resp).ok());
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
  // The binary itself (not this test's process, which links the health
  // proto anyway) answers reflection for every service it lists.
  ExpectEveryListedServiceDescribable(port);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  std::string rest;
  for (std::string line = testing::ReadWholeLine(out); !line.empty();
       line = testing::ReadWholeLine(out)) {
    rest += line;
  }
  fclose(out);
  EXPECT_THAT(rest, HasSubstr("SIGTERM received, draining"));
  EXPECT_THAT(rest, HasSubstr("\"event\":\"drain_start\""));
  EXPECT_THAT(rest, HasSubstr("\"event\":\"drain_end\""));
  EXPECT_THAT(rest, HasSubstr("\"event\":\"stopped\""));
}

// ----------------------------------------------------------- shutdown --

TEST_F(SessionTest, GracefulShutdownEndsOpenStreamsWithinTheDeadline) {
  const Config c{"mha", 4, 4, 16, 16, "default"};
  const Sequence seq = MakeSequence(c, 4, 5);
  Stream s(stub_.get());
  s.Open(MakeOpen(c));
  ASSERT_TRUE(s.Step(seq, 0, 2, 1).has_step());
  auto health = grpc::health::v1::Health::NewStub(TestChannel(server_->port()));
  const auto start = std::chrono::steady_clock::now();
  std::thread stopper([&] { server_->Shutdown(absl::Seconds(2)); });
  // The open stream, idle between steps, is ended promptly with UNAVAILABLE.
  grpc::Status st = s.AwaitServerEnd();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("shutting down"));
  stopper.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  EXPECT_EQ(server_->sessions().open_sessions(), 0);
  // Its non-resumable session ended with the drain, not as a stream that
  // ended normally.
  const std::string text = server_->metrics().RenderPrometheus();
  EXPECT_THAT(text, HasSubstr("ropeattn_sessions_closed_total{reason=\"shutdown\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("ropeattn_sessions_closed_total{reason=\"stream_ended\"} 0\n"));
  // Counted under Decode, as a stream that starts as the drain begins is
  // (it was counted nowhere).
  EXPECT_THAT(text, HasSubstr(
                        "ropeattn_requests_total{method=\"Decode\",code=\"UNAVAILABLE\"} 1\n"));
}

// Streams keep starting after the drain took its list of streams (gRPC
// accepts them until its own Shutdown, which the listener's stop comes
// before): one waiting for its first message was never drained, and the
// shutdown waited its whole grace (8 s here). Each ends UNAVAILABLE at once.
TEST_F(SessionTest, GracefulShutdownEndsStreamsThatStartWhileItDrains) {
  struct Started {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> rw;
  };
  std::vector<std::unique_ptr<Started>> streams;
  std::atomic<bool> stop{false};
  std::thread starter([&] {
    while (!stop.load()) {
      auto s = std::make_unique<Started>();
      s->rw = stub_->Decode(&s->ctx);  // sends nothing
      streams.push_back(std::move(s));
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto start = std::chrono::steady_clock::now();
  server_->Shutdown(absl::Seconds(8));
  const auto took = std::chrono::steady_clock::now() - start;
  stop = true;
  starter.join();
  EXPECT_LT(took, std::chrono::seconds(3));
  // Each has its status: the server has stopped. Ours is UNAVAILABLE; gRPC
  // cancels a stream that reaches it as it stops.
  for (auto& s : streams) {
    const grpc::Status st = s->rw->Finish();
    EXPECT_TRUE(st.error_code() == grpc::StatusCode::UNAVAILABLE ||
                st.error_code() == grpc::StatusCode::CANCELLED)
        << st.error_code() << " " << st.error_message();
  }
}

// A step still computing when the grace passes is cancelled by the drain
// (grpc_server_cancel_all_calls: UNAVAILABLE to the client). Its stream was
// logged CANCELLED "the client went away" and its non-resumable session
// counted disconnected; the session is closed for "shutdown" and the log
// names the shutdown. The step it stopped was counted and logged CANCELLED
// "the call was cancelled"; it is UNAVAILABLE.
TEST_F(SessionTest, AStreamTheDrainCancelsPastTheGraceIsCountedShutdown) {
  ASSERT_NO_FATAL_FAILURE(RestartForLongSteps(0));
  server::LogCapture capture;  // this server's lines only
  Stream s(stub_.get());
  ASSERT_NO_FATAL_FAILURE(StartLongStep(s));
  server_->Shutdown(absl::Milliseconds(100));
  v1::DecodeResponse resp;
  ASSERT_FALSE(s.rw()->Read(&resp)) << "the step ended inside the grace: " << resp.DebugString();
  EXPECT_EQ(s.AwaitServerEnd().error_code(), grpc::StatusCode::UNAVAILABLE);
  const std::string text = server_->metrics().RenderPrometheus();
  EXPECT_THAT(text, HasSubstr("ropeattn_sessions_closed_total{reason=\"shutdown\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("ropeattn_sessions_closed_total{reason=\"disconnected\"} 0\n"));
  EXPECT_THAT(capture.Text(), Not(HasSubstr("went away")));
  EXPECT_THAT(capture.Text(), HasSubstr("--shutdown_grace_seconds passed"));
  // The stream the drain ended counts under Decode, as an idle one does.
  EXPECT_THAT(text, HasSubstr(
                        "ropeattn_requests_total{method=\"Decode\",code=\"UNAVAILABLE\"} 1\n"));
  // The step it stopped counts and logs what its client got (UNAVAILABLE),
  // not CANCELLED "the call was cancelled".
  EXPECT_THAT(text, HasSubstr("ropeattn_requests_total{method=\"Decode.Step\",code="
                              "\"UNAVAILABLE\"} 1\n"));
  EXPECT_THAT(text, Not(HasSubstr("code=\"CANCELLED\"")));
  EXPECT_THAT(capture.Text(), Not(HasSubstr("\"code\":\"CANCELLED\"")));
}

// gRPC's own Shutdown cancels every call at the grace's deadline from its
// thread, racing the drain's mark that the grace passed: a queued step whose
// cancel came first was counted the client's (CANCELLED, its session
// disconnected). Here the mark waits until gRPC's cancel has abandoned the
// queued step; the grace is passed by the clock.
TEST_F(SessionTest, AStepQueuedWhenANoGraceDrainCancelsItIsCountedShutdown) {
  ASSERT_NO_FATAL_FAILURE(RestartForLongSteps(1));  // the second step waits for the first
  server::LogCapture capture;  // this server's lines only
  Stream running(stub_.get());
  ASSERT_NO_FATAL_FAILURE(StartLongStep(running));
  Stream queued(stub_.get());
  ASSERT_NO_FATAL_FAILURE(QueueSmallStep(queued));
  server_->SetBeforeGracePassedHookForTest([this] {
    EXPECT_TRUE(Eventually([this] {
      return absl::StrContains(server_->metrics().RenderPrometheus(),
                               "ropeattn_abandoned_total{method=\"Decode.Step\"} 1\n");
    })) << "gRPC's Shutdown did not cancel the queued step";
  });
  server_->Shutdown(absl::ZeroDuration());
  EXPECT_EQ(queued.AwaitServerEnd().error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(running.AwaitServerEnd().error_code(), grpc::StatusCode::UNAVAILABLE);
  const std::string text = server_->metrics().RenderPrometheus();
  EXPECT_THAT(text, HasSubstr("ropeattn_sessions_closed_total{reason=\"shutdown\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("ropeattn_sessions_closed_total{reason=\"disconnected\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("ropeattn_requests_total{method=\"Decode.Step\",code="
                              "\"UNAVAILABLE\"} 2\n"));
  EXPECT_THAT(text, Not(HasSubstr("code=\"CANCELLED\"")));
  EXPECT_THAT(capture.Text(), Not(HasSubstr("\"code\":\"CANCELLED\"")));
  EXPECT_THAT(capture.Text(), Not(HasSubstr("went away")));
}

// A client that cancels its streams 0.2 s into a 10 s grace, one computing a
// step, one with a step queued behind it: both were logged UNAVAILABLE "the
// stream was still running when --shutdown_grace_seconds passed", their
// sessions closed for shutdown, and the queued step counted CANCELLED
// beside that line. They are the client's cancels: CANCELLED in the log and
// the counts, the sessions disconnected.
TEST_F(SessionTest, AStreamItsClientCancelsDuringTheGraceIsTheClientsCancel) {
  ASSERT_NO_FATAL_FAILURE(RestartForLongSteps(1));  // the second step waits for the first
  server::LogCapture capture;  // this server's lines only
  Stream running(stub_.get());
  ASSERT_NO_FATAL_FAILURE(StartLongStep(running));
  Stream queued(stub_.get());
  ASSERT_NO_FATAL_FAILURE(QueueSmallStep(queued));
  auto health = grpc::health::v1::Health::NewStub(TestChannel(server_->port()));
  std::thread stopper([&] { server_->Shutdown(absl::Seconds(10)); });
  // Health turns NOT_SERVING right before the drain begins.
  ASSERT_TRUE(Eventually([&] {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckResponse resp;
    return !health->Check(&ctx, {}, &resp).ok() ||
           resp.status() == grpc::health::v1::HealthCheckResponse::NOT_SERVING;
  }));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  queued.context().TryCancel();
  running.context().TryCancel();
  EXPECT_EQ(queued.AwaitServerEnd().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(running.AwaitServerEnd().error_code(), grpc::StatusCode::CANCELLED);
  stopper.join();
  const std::string text = server_->metrics().RenderPrometheus();
  EXPECT_THAT(text, HasSubstr("ropeattn_sessions_closed_total{reason=\"disconnected\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("ropeattn_sessions_closed_total{reason=\"shutdown\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("ropeattn_requests_total{method=\"Decode.Step\",code="
                              "\"CANCELLED\"} 2\n"));
  EXPECT_THAT(text, Not(HasSubstr("code=\"UNAVAILABLE\"} 1")));
  EXPECT_THAT(capture.Text(), Not(HasSubstr("--shutdown_grace_seconds passed")));
  EXPECT_THAT(capture.Text(), Not(HasSubstr("\"code\":\"UNAVAILABLE\"")));
  EXPECT_THAT(capture.Text(), HasSubstr("\"code\":\"CANCELLED\""));
}

// --------------------------------------- start position, KV import/export --

v1::DecodeRequest ExportRequest(uint64_t seq) {
  v1::DecodeRequest req;
  req.mutable_export_kv()->set_seq(seq);
  return req;
}

// A session far from position 0 moves to another session (as to another
// replica) by its exported, rotated KV, or starts from raw keys another
// engine computed; every step, before and after the move, matches the fp64
// chain at the absolute positions (1e-5 relative in f32, 1e-2 with a bf16
// cache), for a fixed and a length-dependent rule and ALiBi.
TEST_F(SessionTest, StartPositionAndKvPrefixMoveASessionExactly) {
  std::vector<Config> configs(4);
  configs[0].name = "rope";
  configs[0].rope_type = "default";
  configs[0].kv_heads = 2;
  configs[1].name = "dynamic crossing L0";
  configs[1].rope_type = "dynamic";
  configs[1].factor = 2;
  configs[1].original = 999990 + 7;
  configs[2].name = "bf16 cache";
  configs[2].rope_type = "default";
  configs[2].bf16_kv = true;
  configs[3].name = "alibi";
  configs[3].alibi = true;
  for (Config& c : configs) {
    SCOPED_TRACE(c.name);
    c.start = 999990;
    const double tol = c.bf16_kv ? kBF16Tol : kF32Tol;
    const Sequence seq = MakeSequence(c, 9, 500);
    const int64_t prefix = 5;
    Stream a(stub_.get());
    const v1::SessionInfo opened = a.Open(MakeOpen(c));
    EXPECT_EQ(opened.start_position(), c.start);
    v1::DecodeResponse r = a.Step(seq, 0, prefix, 1);
    ASSERT_TRUE(r.has_step()) << r.DebugString();
    EXPECT_TRUE(AllClose(WireToDoubles(r.step().out()), ExpectedStep(c, seq, 0, prefix), tol));
    r = a.Send(ExportRequest(2));
    ASSERT_TRUE(r.has_exported()) << r.DebugString();
    const v1::KvExport exported = r.exported();
    EXPECT_EQ(exported.position(), prefix);
    EXPECT_EQ(exported.start_position(), c.start);
    // Under dynamic NTK the export carries the raw keys the session keeps.
    EXPECT_EQ(exported.key_form(),
              c.rope_type == "dynamic" ? v1::KEY_FORM_RAW : v1::KEY_FORM_ROTATED);
    EXPECT_THAT(exported.k().shape(), ::testing::ElementsAre(1, prefix, c.kv_heads, c.head_dim));

    Stream moved(stub_.get());
    v1::OpenSession open = MakeOpen(c);
    *open.mutable_prefix()->mutable_k() = exported.k();
    *open.mutable_prefix()->mutable_v() = exported.v();
    open.mutable_prefix()->set_key_form(exported.key_form());
    EXPECT_EQ(moved.Open(open).position(), prefix);

    Stream raw(stub_.get());
    open = MakeOpen(c);
    *open.mutable_prefix()->mutable_k() = ToWire(seq.k.cview().Slice(1, 0, prefix));
    *open.mutable_prefix()->mutable_v() = ToWire(seq.v.cview().Slice(1, 0, prefix));
    open.mutable_prefix()->set_key_form(v1::KEY_FORM_RAW);
    EXPECT_EQ(raw.Open(open).position(), prefix);

    for (int64_t t = prefix; t < 9; ++t) {
      const std::vector<double> want = ExpectedStep(c, seq, t, t + 1);
      for (Stream* s : {&a, &moved, &raw}) {
        r = s->Step(seq, t, t + 1, 10 + t);
        ASSERT_TRUE(r.has_step()) << r.DebugString();
        EXPECT_EQ(r.step().position(), t + 1);
        EXPECT_TRUE(AllClose(WireToDoubles(r.step().out()), want, tol)) << "token " << t;
      }
    }
  }
}

TEST_F(SessionTest, APrefixOrExportThatCannotBeExactIsRefused) {
  Config c;
  c.rope_type = "default";
  const Sequence seq = MakeSequence(c, 4, 7);
  auto open_with = [&](const Config& cfg, std::function<void(v1::OpenSession&)> edit) {
    Stream s(stub_.get());
    v1::OpenSession open = MakeOpen(cfg);
    *open.mutable_prefix()->mutable_k() = ToWire(seq.k.cview());
    *open.mutable_prefix()->mutable_v() = ToWire(seq.v.cview());
    open.mutable_prefix()->set_key_form(v1::KEY_FORM_RAW);
    edit(open);
    v1::DecodeRequest req;
    *req.mutable_open() = open;
    EXPECT_TRUE(s.rw()->Write(req));
    return s.AwaitServerEnd();
  };
  grpc::Status st = open_with(c, [](v1::OpenSession& o) {
    o.mutable_prefix()->set_key_form(v1::KEY_FORM_UNSPECIFIED);
  });
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("open.prefix.key_form"));
  st = open_with(c, [&](v1::OpenSession& o) {
    *o.mutable_prefix()->mutable_v() = ToWire(seq.v.cview().Slice(1, 0, 3));  // 3 of 4 tokens
  });
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("open.prefix.v"));
  st = open_with(c, [](v1::OpenSession& o) { o.set_max_context(2); });
  EXPECT_EQ(st.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  st = open_with(c, [](v1::OpenSession& o) { o.set_start_position(int64_t{1} << 41); });
  EXPECT_EQ(st.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_THAT(st.error_message(), HasSubstr("open.start_position"));
  Config linear = c;
  linear.linear = true;
  st = open_with(linear, [](v1::OpenSession&) {});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  // A non-finite prefix fails the open naming the tensor and index; no
  // session is left behind.
  Tensor bad = Tensor::CopyOf(seq.k.cview()).value();
  bad.data<float>()[3] = NAN;
  st = open_with(c, [&](v1::OpenSession& o) { *o.mutable_prefix()->mutable_k() = ToWire(bad.cview()); });
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("open.prefix.k"));
  grpc::ClientContext ctx;
  v1::ListSessionsResponse list;
  ASSERT_TRUE(stub_->ListSessions(&ctx, {}, &list).ok());
  EXPECT_EQ(list.sessions_size(), 0);
  // Its session is imported before it is listed or counted: never opened,
  // so neither counted opened nor closed (it was listed for the import,
  // counted opened, then closed for "closed").
  const std::string metrics = server_->metrics().RenderPrometheus();
  EXPECT_THAT(metrics, HasSubstr("ropeattn_sessions_opened_total 0\n"));
  EXPECT_THAT(metrics, HasSubstr("ropeattn_sessions_closed_total{reason=\"closed\"} 0\n"));
  EXPECT_THAT(metrics, Not(HasSubstr("prefix was refused")));

  // Linear sessions have no KV to export: an in-band error, the stream stays.
  Stream s(stub_.get());
  s.Open(MakeOpen(linear));
  v1::DecodeResponse r = s.Send(ExportRequest(3));
  ASSERT_TRUE(r.has_error()) << r.DebugString();
  EXPECT_EQ(r.error().code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(r.error().seq(), 3u);
}

// An export larger than the reply limit is refused before anything is
// copied, naming the bytes; the session goes on.
TEST(SessionLimitTest, AnExportPastTheReplyLimitIsRefusedFirst) {
  server::ServerOptions o = TestServerOptions();
  o.max_message_bytes = 64 << 10;
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());
  Config c;
  c.kv_heads = 4;
  c.head_dim = 64;
  c.v_dim = 64;
  const Sequence seq = MakeSequence(c, 40, 3);
  {
    Stream s(stub.get());
    s.Open(MakeOpen(c, 64));
    for (int64_t t = 0; t < 40; t += 8) ASSERT_TRUE(s.Step(seq, t, t + 8, 1).has_step());
    v1::DecodeResponse r = s.Send(ExportRequest(9));
    ASSERT_TRUE(r.has_error()) << r.DebugString();
    EXPECT_EQ(r.error().code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(r.error().message(), HasSubstr("KV of 40 tokens"));
    EXPECT_TRUE(s.Step(seq, 0, 1, 10).has_step());
  }
  server->Shutdown(absl::Seconds(1));
}

// A Decode message larger than --max_message_bytes is refused by gRPC
// (RESOURCE_EXHAUSTED to the client) before the stream's reactor or the
// call log see it: the stream was logged `call` code OK, counted nowhere,
// and its session counted disconnected. It is logged (error_answer, call)
// and counted under Decode as RESOURCE_EXHAUSTED, naming the flag, and its
// session as stream_ended; streams their client half-closes, cancels, or
// cancels after half-closing are no refusals.
TEST(SessionLimitTest, ADecodeMessageGrpcRefusesForItsSizeIsLoggedAndCounted) {
  server::LogCapture capture;
  server::ServerOptions o = TestServerOptions();
  o.max_message_bytes = 64 << 10;
  o.access_log = true;
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());  // sends up to 256 MiB
  const auto metric = [&](const std::string& series) -> double {
    const std::string m = server->metrics().RenderPrometheus();
    const size_t at = m.find("\n" + series + " ");
    return at == std::string::npos ? -1 : std::atof(m.c_str() + at + series.size() + 2);
  };
  const auto lines_of = [&](const std::string& event, const std::string& request_id) {
    std::vector<std::string> out;
    std::istringstream lines(capture.Text());
    for (std::string line; std::getline(lines, line);) {
      if (absl::StrContains(line, absl::StrCat("\"event\":\"", event, "\"")) &&
          absl::StrContains(line, absl::StrCat("\"request_id\":\"", request_id, "\""))) {
        out.push_back(line);
      }
    }
    return out;
  };
  const std::string refused =
      R"(ropeattn_requests_total{method="Decode",code="RESOURCE_EXHAUSTED"})";
  v1::DecodeRequest open;
  open.mutable_open()->mutable_spec()->set_heads(4);
  open.mutable_open()->mutable_spec()->set_head_dim(8);
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-request-id", "oversize-decode");
    auto rw = stub->Decode(&ctx);
    v1::DecodeResponse resp;
    ASSERT_TRUE(rw->Write(open));
    ASSERT_TRUE(rw->Read(&resp));
    ASSERT_TRUE(resp.has_opened()) << resp.DebugString();
    v1::DecodeRequest step;
    step.mutable_step()->set_seq(1);
    step.mutable_step()->mutable_q()->set_data(std::string(100 << 10, '\0'));
    rw->Write(step);
    EXPECT_FALSE(rw->Read(&resp));
    const grpc::Status st = rw->Finish();
    ASSERT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr("larger than max"));
  }
  ASSERT_TRUE(Eventually([&] { return !lines_of("call", "oversize-decode").empty(); }))
      << capture.Text();
  const std::vector<std::string> errors = lines_of("error_answer", "oversize-decode");
  ASSERT_EQ(errors.size(), 1u) << capture.Text();
  EXPECT_THAT(errors[0], HasSubstr("\"code\":\"RESOURCE_EXHAUSTED\""));
  EXPECT_THAT(errors[0], HasSubstr("larger than --max_message_bytes (65536 bytes)"));
  const std::vector<std::string> calls = lines_of("call", "oversize-decode");
  ASSERT_EQ(calls.size(), 1u) << capture.Text();
  EXPECT_THAT(calls[0], HasSubstr("\"code\":\"RESOURCE_EXHAUSTED\""));
  EXPECT_EQ(metric(refused), 1);
  EXPECT_EQ(metric(R"(ropeattn_sessions_closed_total{reason="stream_ended"})"), 1);
  EXPECT_EQ(metric(R"(ropeattn_sessions_closed_total{reason="disconnected"})"), 0);

  // Ends by the client: each as before, never a refusal (repeated: the
  // client's cancel races the server's read of its half-close).
  for (int i = 0; i < 20; ++i) {
    for (const char* end : {"half-close", "cancel", "half-close then cancel"}) {
      SCOPED_TRACE(absl::StrCat(end, " ", i));
      grpc::ClientContext ctx;
      ctx.AddMetadata("x-request-id", absl::StrCat("ended-", i));
      auto rw = stub->Decode(&ctx);
      v1::DecodeResponse resp;
      ASSERT_TRUE(rw->Write(open));
      ASSERT_TRUE(rw->Read(&resp));
      if (absl::string_view(end) != "cancel") rw->WritesDone();
      if (absl::string_view(end) != "half-close") ctx.TryCancel();
      const grpc::StatusCode code = rw->Finish().error_code();
      if (absl::string_view(end) == "half-close") {
        EXPECT_EQ(code, grpc::StatusCode::OK);
      } else if (absl::string_view(end) == "cancel") {
        EXPECT_EQ(code, grpc::StatusCode::CANCELLED);
      } else {  // the server's OK may come before the cancel
        EXPECT_TRUE(code == grpc::StatusCode::CANCELLED || code == grpc::StatusCode::OK) << code;
      }
    }
  }
  ASSERT_TRUE(Eventually([&] { return server->sessions().open_sessions() == 0; }));
  EXPECT_EQ(metric(refused), 1);
  std::istringstream lines(capture.Text());
  int refused_lines = 0;
  for (std::string line; std::getline(lines, line);) {
    refused_lines += absl::StrContains(line, "\"code\":\"RESOURCE_EXHAUSTED\"");
  }
  EXPECT_EQ(refused_lines, 2) << capture.Text();  // the refused stream's two
  server->Shutdown(absl::Seconds(1));
}

// A Decode stream whose client compresses (grpc-encoding gzip or deflate,
// disabled on the server) is cancelled by gRPC as it starts (UNIMPLEMENTED
// to the client); its read fails as an oversized message's does, and it
// was logged and counted RESOURCE_EXHAUSTED "larger than
// --max_message_bytes". It is logged and counted UNIMPLEMENTED, naming the
// algorithm, with a message sent or none at all.
TEST(SessionLimitTest, ACompressedDecodeStreamIsCountedUnimplementedNotOversized) {
  server::LogCapture capture;
  server::ServerOptions o = TestServerOptions();
  o.access_log = true;
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());
  const auto metric = [&](const std::string& series) -> double {
    const std::string m = server->metrics().RenderPrometheus();
    const size_t at = m.find("\n" + series + " ");
    return at == std::string::npos ? 0 : std::atof(m.c_str() + at + series.size() + 2);
  };
  v1::DecodeRequest open;
  open.mutable_open()->mutable_spec()->set_heads(2);
  open.mutable_open()->mutable_spec()->set_head_dim(8);
  int streams = 0;
  for (const grpc_compression_algorithm algorithm : {GRPC_COMPRESS_GZIP, GRPC_COMPRESS_DEFLATE}) {
    for (const bool send : {true, false}) {
      SCOPED_TRACE(absl::StrCat(algorithm, send ? " with a message" : " without a message"));
      grpc::ClientContext ctx;
      ctx.set_compression_algorithm(algorithm);
      ctx.AddMetadata("x-request-id", absl::StrCat("compressed-", streams++));
      auto rw = stub->Decode(&ctx);
      if (send) rw->Write(open);
      rw->WritesDone();
      v1::DecodeResponse resp;
      EXPECT_FALSE(rw->Read(&resp));
      EXPECT_EQ(rw->Finish().error_code(), grpc::StatusCode::UNIMPLEMENTED);
    }
  }
  const std::string unimplemented =
      R"(ropeattn_requests_total{method="Decode",code="UNIMPLEMENTED"})";
  ASSERT_TRUE(Eventually([&] { return metric(unimplemented) == streams; }))
      << server->metrics().RenderPrometheus();
  EXPECT_EQ(metric(R"(ropeattn_requests_total{method="Decode",code="RESOURCE_EXHAUSTED"})"), 0);
  ASSERT_TRUE(Eventually(
      [&] { return absl::StrContains(capture.Text(), absl::StrCat("compressed-", streams - 1)); }));
  int errors = 0, calls = 0;
  std::istringstream lines(capture.Text());
  for (std::string line; std::getline(lines, line);) {
    if (!absl::StrContains(line, "\"request_id\":\"compressed-")) continue;
    EXPECT_THAT(line, HasSubstr("\"code\":\"UNIMPLEMENTED\""));
    EXPECT_THAT(line, Not(HasSubstr("max_message_bytes")));
    if (absl::StrContains(line, "\"event\":\"error_answer\"")) {
      ++errors;
      EXPECT_THAT(line, AnyOf(HasSubstr("grpc-encoding \\\"gzip\\\""),
                              HasSubstr("grpc-encoding \\\"deflate\\\"")));
    }
    calls += absl::StrContains(line, "\"event\":\"call\"");
  }
  EXPECT_EQ(errors, streams) << capture.Text();
  EXPECT_EQ(calls, streams) << capture.Text();
  server->Shutdown(absl::Seconds(1));
}

// A Decode stream gRPC refused (an oversized message, a compressed stream)
// as the shutdown's drain begins: the drain ended it UNAVAILABLE before its
// read's end ran, which then counted nothing, so the stream was counted
// nowhere and logged UNAVAILABLE while its client had gRPC's code. Held
// here at the start of that read's end until the drain has ended the
// stream: logged and counted once, with gRPC's code.
TEST(SessionLimitTest, AStreamGrpcRefusesAsTheDrainBeginsIsCountedWithGrpcsCode) {
  for (const bool compressed : {false, true}) {
    SCOPED_TRACE(compressed ? "compressed" : "oversized");
    server::LogCapture capture;
    server::ServerOptions o = TestServerOptions();
    o.max_message_bytes = 64 << 10;
    o.access_log = true;
    auto server = StartTestServer(o);
    ASSERT_NE(server, nullptr);
    auto stub = TestStub(server->port());
    absl::Notification reached, release;
    std::atomic<bool> armed{true};
    server::SetDecodeReadDoneHookForTest([&](bool ok) {
      if (ok || !armed.exchange(false)) return;
      reached.Notify();
      release.WaitForNotification();
    });
    absl::Cleanup unhook = [&release] {
      if (!release.HasBeenNotified()) release.Notify();
      server::SetDecodeReadDoneHookForTest(nullptr);
    };
    const grpc::StatusCode code = compressed ? grpc::StatusCode::UNIMPLEMENTED
                                             : grpc::StatusCode::RESOURCE_EXHAUSTED;
    const std::string code_name = compressed ? "UNIMPLEMENTED" : "RESOURCE_EXHAUSTED";
    {
      grpc::ClientContext ctx;
      ctx.AddMetadata("x-request-id", "refused-while-draining");
      v1::DecodeRequest open;
      open.mutable_open()->mutable_spec()->set_heads(4);
      open.mutable_open()->mutable_spec()->set_head_dim(8);
      v1::DecodeResponse resp;
      if (compressed) ctx.set_compression_algorithm(GRPC_COMPRESS_GZIP);
      auto rw = stub->Decode(&ctx);
      if (compressed) {
        rw->Write(open);
      } else {
        ASSERT_TRUE(rw->Write(open));
        ASSERT_TRUE(rw->Read(&resp));
        v1::DecodeRequest step;
        step.mutable_step()->set_seq(1);
        step.mutable_step()->mutable_q()->set_data(std::string(100 << 10, '\0'));
        rw->Write(step);
      }
      EXPECT_FALSE(rw->Read(&resp));
      EXPECT_EQ(rw->Finish().error_code(), code);
    }
    ASSERT_TRUE(reached.WaitForNotificationWithTimeout(absl::Seconds(30)));
    std::thread stopper([&] { server->Shutdown(absl::Seconds(5)); });
    // The drain has ended the stream (its status is logged) while the
    // read's end waits.
    ASSERT_TRUE(Eventually([&] {
      return absl::StrContains(capture.Text(), "\"event\":\"error_answer\"");
    })) << capture.Text();
    release.Notify();
    stopper.join();
    const auto metric = [&](const std::string& series) -> double {
      const std::string m = server->metrics().RenderPrometheus();
      const size_t at = m.find("\n" + series + " ");
      return at == std::string::npos ? 0 : std::atof(m.c_str() + at + series.size() + 2);
    };
    EXPECT_EQ(metric(absl::StrCat(R"(ropeattn_requests_total{method="Decode",code=")", code_name,
                                  R"("})")),
              1);
    EXPECT_EQ(metric(R"(ropeattn_requests_total{method="Decode",code="UNAVAILABLE"})"), 0);
    int errors = 0, calls = 0;
    std::istringstream lines(capture.Text());
    for (std::string line; std::getline(lines, line);) {
      if (!absl::StrContains(line, "\"request_id\":\"refused-while-draining\"")) continue;
      if (absl::StrContains(line, "\"event\":\"open\"")) continue;
      EXPECT_THAT(line, HasSubstr(absl::StrCat("\"code\":\"", code_name, "\""))) << line;
      errors += absl::StrContains(line, "\"event\":\"error_answer\"");
      calls += absl::StrContains(line, "\"event\":\"call\"");
    }
    EXPECT_EQ(errors, 1) << capture.Text();
    EXPECT_EQ(calls, 1) << capture.Text();
  }
}

// Every answer carrying a SessionInfo echoes the session's spec: an open
// whose answer could not fit in one message is refused before anything is
// reserved, and ListSessions answers in pages that each fit, planned from
// the sessions' sizes before anything is copied (a list of large specs was
// built whole and then refused by gRPC: 159 MB against a 32 MiB limit).
TEST(SessionLimitTest, ListSessionsPagesFitAndOpensWhoseAnswerCannotAreRefused) {
  server::ServerOptions o = TestServerOptions();
  o.max_message_bytes = 64 << 10;
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());
  Config c;
  c.heads = 2048;
  c.kv_heads = 1;
  c.head_dim = 4;
  c.v_dim = 4;
  c.alibi = true;
  auto open_with_slopes = [&](int count) {
    v1::OpenSession open = MakeOpen(c, 16, /*resumable=*/true);
    c.heads = count;
    open.mutable_spec()->set_heads(count);
    for (int h = 0; h < count; ++h) open.mutable_spec()->mutable_alibi()->add_slopes(1e-3 * (h + 1));
    return open;
  };
  std::set<std::string> opened;
  for (int i = 0; i < 7; ++i) {  // 16 KiB of slopes each
    Stream s(stub.get());
    opened.insert(s.Open(open_with_slopes(2048)).session_id());
    ASSERT_TRUE(s.Finish().ok());  // detached: resumable sessions stay
  }
  for (const int page_size : {0, 2}) {
    SCOPED_TRACE(page_size);
    std::vector<std::string> listed;
    v1::ListSessionsRequest req;
    req.set_page_size(page_size);
    int pages = 0;
    do {
      grpc::ClientContext ctx;
      v1::ListSessionsResponse list;
      ASSERT_TRUE(stub->ListSessions(&ctx, req, &list).ok());
      EXPECT_LE(list.ByteSizeLong(), size_t{64} << 10);
      EXPECT_GE(list.sessions_size(), 1);
      if (page_size > 0) {
        EXPECT_LE(list.sessions_size(), page_size);
      }
      for (const auto& info : list.sessions()) {
        listed.push_back(info.session_id());
        EXPECT_EQ(info.spec().alibi().slopes_size(), 2048);
      }
      req.set_page_token(list.next_page_token());
      ++pages;
    } while (!req.page_token().empty());
    EXPECT_GT(pages, 1);
    EXPECT_TRUE(std::is_sorted(listed.begin(), listed.end()));
    EXPECT_EQ(std::set<std::string>(listed.begin(), listed.end()), opened);
    EXPECT_EQ(listed.size(), opened.size());
  }
  {
    grpc::ClientContext ctx;
    v1::ListSessionsRequest req;
    req.set_page_size(-1);
    v1::ListSessionsResponse list;
    const grpc::Status st = stub->ListSessions(&ctx, req, &list);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("page_size = -1"));
  }
  {  // 62 KiB of slopes: the open fits, its answer would not
    Stream s(stub.get());
    v1::DecodeRequest req;
    *req.mutable_open() = open_with_slopes(7900);
    ASSERT_LT(req.ByteSizeLong(), size_t{64} << 10);
    ASSERT_TRUE(s.rw()->Write(req));
    const grpc::Status st = s.AwaitServerEnd();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(st.error_message(), HasSubstr("SessionInfo"));
  }
  server->Shutdown(absl::Seconds(1));
}

// A session keeps its spec for its SessionInfo: unknown fields in it are
// dropped (they took 5x their wire bytes, outside the budget), and what it
// keeps is charged with the session. A page_token that is not a session id
// is refused rather than ending the listing silently.
TEST(SessionLimitTest, SpecsAreChargedWithoutUnknownFieldsAndPageTokensAreChecked) {
  auto server = StartTestServer(TestServerOptions());
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());
  Config c;
  c.alibi = true;
  auto open_kv_bytes = [&](int slopes, int unknown, v1::SessionInfo* info, int heads = 4) {
    Stream s(stub.get());
    v1::OpenSession open = MakeOpen(c, 16, /*resumable=*/true);
    open.mutable_spec()->set_heads(std::max(slopes, heads));
    open.mutable_spec()->set_kv_heads(1);
    for (int h = 0; h < slopes; ++h) open.mutable_spec()->mutable_alibi()->add_slopes(0.5);
    google::protobuf::UnknownFieldSet* extra =
        open.mutable_spec()->GetReflection()->MutableUnknownFields(open.mutable_spec());
    for (int i = 0; i < unknown; ++i) extra->AddVarint(1000 + i % 100, i);
    *info = s.Open(open);
    EXPECT_TRUE(s.Finish().ok());
    return info->kv_bytes();
  };
  v1::SessionInfo plain, sloped, noisy;
  const int64_t base = open_kv_bytes(0, 0, &plain);
  // 16384 heads' slopes (128 KiB) are charged: against the same heads with
  // the standard slopes (none given).
  const int64_t with_slopes = open_kv_bytes(16384, 0, &sloped);
  v1::SessionInfo same_heads;
  const int64_t without_slopes = open_kv_bytes(0, 0, &same_heads, 16384);
  EXPECT_GE(with_slopes - without_slopes, 16384 * 8);
  const int64_t with_unknown = open_kv_bytes(0, 100000, &noisy);
  EXPECT_LT(with_unknown - base, 1024) << "unknown fields are not kept";
  for (const v1::SessionInfo* info : {&sloped, &noisy}) {
    grpc::ClientContext ctx;
    v1::GetSessionRequest req;
    req.set_session_id(info->session_id());
    v1::SessionInfo got;
    ASSERT_TRUE(stub->GetSession(&ctx, req, &got).ok());
    EXPECT_EQ(got.spec().GetReflection()->GetUnknownFields(got.spec()).field_count(), 0);
    EXPECT_EQ(got.spec().alibi().slopes_size(), info == &sloped ? 16384 : 0);
  }
  for (const std::string& token :
       std::vector<std::string>{"nope", std::string(32, 'g'), std::string(31, 'a')}) {
    grpc::ClientContext ctx;
    v1::ListSessionsRequest req;
    req.set_page_token(token);
    v1::ListSessionsResponse list;
    const grpc::Status st = stub->ListSessions(&ctx, req, &list);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << token;
    EXPECT_THAT(st.error_message(), HasSubstr("page_token"));
  }
  grpc::ClientContext ctx;
  v1::ListSessionsRequest req;
  req.set_page_token(std::string(32, '0'));  // a well-formed token: the listing after it
  v1::ListSessionsResponse list;
  ASSERT_TRUE(stub->ListSessions(&ctx, req, &list).ok());
  EXPECT_EQ(list.sessions_size(), 4);
  server->Shutdown(absl::Seconds(1));
}

// On a budget that sessions fill: ListSessions cuts its page to what the
// budget can hold (down to a page whose copies fit the 64 KiB slack) rather
// than refusing, and a session with a large spec can still be closed (the
// close gives its memory back; its answer was held first and refused).
TEST(SessionLimitTest, AFullBudgetStillListsAndCloses) {
  server::ServerOptions o = TestServerOptions();
  o.memory_budget_bytes = 8 << 20;
  o.max_sessions = 10000;
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());
  Config c;
  c.alibi = true;
  c.heads = 4;
  c.kv_heads = 1;
  c.head_dim = 4;
  c.v_dim = 4;
  std::string big;
  {
    Stream s(stub.get());
    v1::OpenSession open = MakeOpen(c, 16, /*resumable=*/true);
    open.mutable_spec()->set_heads(16384);  // 128 KiB of slopes
    for (int h = 0; h < 16384; ++h) open.mutable_spec()->mutable_alibi()->add_slopes(0.5);
    big = s.Open(open).session_id();
    ASSERT_TRUE(s.Finish().ok());
  }
  int opened = 1;
  // Small sessions until the budget refuses one.
  const auto fill = [&] {
    for (;;) {
      Stream s(stub.get());
      v1::DecodeRequest req;
      *req.mutable_open() = MakeOpen(c, 16, /*resumable=*/true);
      EXPECT_TRUE(s.rw()->Write(req));
      v1::DecodeResponse r;
      if (!s.rw()->Read(&r)) {
        EXPECT_EQ(s.AwaitServerEnd().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
        return;
      }
      ++opened;
      EXPECT_TRUE(s.Finish().ok());
      if (opened >= 10000) return;
    }
  };
  fill();
  ASSERT_LT(opened, 10000);
  // Listed whole on the full budget, the session with the large spec too
  // (a one-session page takes the overdraft: the walk stopped there for
  // good).
  const auto list_all = [&] {
    std::set<std::string> listed;
    v1::ListSessionsRequest req;
    int pages = 0;
    do {
      grpc::ClientContext ctx;
      v1::ListSessionsResponse list;
      const grpc::Status st = stub->ListSessions(&ctx, req, &list);
      EXPECT_TRUE(st.ok()) << st.error_message();
      if (!st.ok()) break;
      for (const auto& info : list.sessions()) listed.insert(info.session_id());
      req.set_page_token(list.next_page_token());
      ++pages;
    } while (!req.page_token().empty());
    return std::make_pair(listed, pages);
  };
  {
    const auto [listed, pages] = list_all();
    EXPECT_EQ(static_cast<int>(listed.size()), opened);
    EXPECT_EQ(listed.count(big), 1u);
  }
  {
    grpc::ClientContext ctx;
    v1::CloseSessionRequest close;
    close.set_session_id(big);
    v1::CloseSessionResponse closed;
    const grpc::Status st = stub->CloseSession(&ctx, close, &closed);
    EXPECT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(closed.session().spec().alibi().slopes_size(), 16384);
  }
  // Fill what the close freed, then list: every page fits what is left.
  fill();
  ASSERT_LT(opened, 10000);
  const auto [listed, pages] = list_all();
  EXPECT_EQ(static_cast<int>(listed.size()), opened - 1);
  EXPECT_GT(pages, 1) << "the budget held the whole list: the page was never cut";
  server->Shutdown(absl::Seconds(1));
}

// Importing a KV prefix is compute (copies, a cos/sin row per token): an
// open past --max_request_compute is refused before anything is reserved.
TEST(SessionLimitTest, AnOpensPrefixIsPricedAgainstTheComputeLimit) {
  server::ServerOptions o = TestServerOptions();
  o.max_request_compute = 1000000;
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());
  Config c;
  c.rope_type = "default";
  const Sequence seq = MakeSequence(c, 1024, 11);
  for (const int64_t tokens : {int64_t{16}, int64_t{1024}}) {
    Stream s(stub.get());
    v1::DecodeRequest req;
    *req.mutable_open() = MakeOpen(c, 2048);
    *req.mutable_open()->mutable_prefix()->mutable_k() = ToWire(seq.k.cview().Slice(1, 0, tokens));
    *req.mutable_open()->mutable_prefix()->mutable_v() = ToWire(seq.v.cview().Slice(1, 0, tokens));
    req.mutable_open()->mutable_prefix()->set_key_form(v1::KEY_FORM_RAW);
    ASSERT_TRUE(s.rw()->Write(req));
    v1::DecodeResponse r;
    if (tokens == 16) {
      ASSERT_TRUE(s.rw()->Read(&r));
      EXPECT_EQ(r.opened().position(), 16);
      continue;
    }
    const grpc::Status st = s.AwaitServerEnd();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(st.error_message(), HasSubstr("importing a KV prefix"));
  }
  server->Shutdown(absl::Seconds(1));
}

// ------------------------------------------------------------- grpcurl --

// The README's grpcurl requests (docs/grpcurl/), parsed with protobuf's JSON
// mapping as grpcurl parses them, against a real server: the Attend answers,
// and equals the same request sent as raw bytes; the Decode stream (one JSON
// message per line) opens, steps twice and closes.
std::string ReadDoc(const std::string& name) {
  std::ifstream f(std::string(ROPEATTN_DOCS_DIR) + "/grpcurl/" + name);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void ValuesToBytes(v1::Tensor* t) {
  std::string bytes(t->f32_values_size() * sizeof(float), '\0');
  std::memcpy(bytes.data(), t->f32_values().data(), bytes.size());
  t->clear_f32_values();
  t->set_data(bytes);
  t->set_dtype(v1::DTYPE_F32);
}

TEST_F(SessionTest, TheReadmesGrpcurlRequestsWork) {
  v1::AttendRequest req;
  const std::string attend_json = ReadDoc("attend.json");
  ASSERT_FALSE(attend_json.empty());
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(attend_json, &req).ok());
  ASSERT_GT(req.q().f32_values_size(), 0);
  v1::AttendResponse typed, raw;
  {
    grpc::ClientContext ctx;
    const grpc::Status st = stub_->Attend(&ctx, req, &typed);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  ValuesToBytes(req.mutable_q());
  ValuesToBytes(req.mutable_k());
  ValuesToBytes(req.mutable_v());
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Attend(&ctx, req, &raw).ok());
  }
  EXPECT_THAT(typed.out().shape(), ::testing::ElementsAre(1, 2, 2, 4));
  EXPECT_EQ(typed.out().data(), raw.out().data());

  Stream s(stub_.get());
  std::istringstream lines(ReadDoc("decode.json"));
  std::vector<v1::DecodeResponse::MsgCase> got;
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    v1::DecodeRequest r;
    ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(line, &r).ok()) << line;
    const v1::DecodeResponse resp = s.Send(r);
    EXPECT_FALSE(resp.has_error()) << resp.DebugString();
    got.push_back(resp.msg_case());
  }
  EXPECT_THAT(got, ::testing::ElementsAre(v1::DecodeResponse::kOpened, v1::DecodeResponse::kStep,
                                          v1::DecodeResponse::kStep, v1::DecodeResponse::kClosed));
  s.AwaitServerEnd();
}

}  // namespace
}  // namespace ropeattn::testing
