// ropeattn-server-bench: round-trip latency of the service on a real server
// on a loopback port, through generated stubs.
//
//   rpc/health_check              grpc.health.v1 Check: gRPC's own floor
//   rpc/attend_small              Attend, [1, 16, 8, 64] q/k/v f32, causal RoPE
//   rpc/decode_step/ctx1024       one Decode step (1 token, 32 heads over 8 kv
//   rpc/decode_step/ctx4096       heads, head_dim 128, f32 KV) at that context
//   rpc/layer_decode_step/demo/ctx1024  one layer-mode step on the built-in
//                                 demo model (projections + RoPE + attention
//                                 + output projection) at 1k context
//   rpc/tls/health_check          the same round trips on a second server
//   rpc/tls/attend_small          with TLS and a bearer token (same options
//                                 otherwise): what TLS costs per call
//   rpc/connect/plaintext         a new channel's first health check: TCP,
//   rpc/connect/tls               HTTP/2 setup (and the TLS handshake with an
//                                 EC P-256 certificate) plus one round trip
//                                 (certificates made at start with openssl)
//
// Each iteration is one synchronous round trip; Google Benchmark reports the
// mean, and the p50/p99 counters come from every iteration's own timing.
// Threads: the server uses ROPEATTN_BENCH_THREADS kernel threads per call
// (default: all CPUs), one compute worker, at ROPEATTN_BENCH_COMPUTE_NICE
// (default: the server's --compute_nice default).
#include <algorithm>
#include <atomic>
#include <thread>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "benchmark/benchmark.h"
#include "bench/copy_ceiling.h"
#include "core/cpu.h"
#include "core/decode_state.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "ropeattn/v1/attention.grpc.pb.h"
#include "server/handlers.h"
#include "server/metrics.h"
#include "server/server.h"

namespace ropeattn {
namespace {

using Clock = std::chrono::steady_clock;

int Threads() {
  if (const char* env = std::getenv("ROPEATTN_BENCH_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  return AvailableCpus();
}

server::Server& TheServer() {
  static server::Server* s = [] {
    server::ServerOptions o;
    o.address = "127.0.0.1:0";
    o.metrics_address = "";
    o.compute_workers = 1;
    o.threads_per_call = Threads();
    o.default_max_context = 8192;
    if (const char* nice = std::getenv("ROPEATTN_BENCH_COMPUTE_NICE")) {
      o.compute_nice = std::atoi(nice);
    }
    auto started = server::Server::Start(o);
    if (!started.ok()) std::abort();
    return started->release();
  }();
  return *s;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A CA, a server certificate for localhost and a tokens file, made once with
// the openssl command line in a temporary directory.
struct TlsFiles {
  std::string dir, ca_pem;
  static constexpr char kToken[] = "bench-token-0123456789abcdef";
};
const TlsFiles& Tls() {
  static TlsFiles* files = [] {
    auto* f = new TlsFiles();
    char pattern[] = "/tmp/ropeattn_bench_tlsXXXXXX";
    if (mkdtemp(pattern) == nullptr) std::abort();
    f->dir = pattern;
    const std::string d = f->dir;
    const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    const std::string cmd =
        "set -e; cd " + d + "; openssl req -x509 " + ec +
        " -days 2 -subj /CN=bench-ca -keyout ca.key -out ca.pem; openssl req " + ec +
        " -subj /CN=localhost -keyout server.key -out server.csr; printf "
        "'subjectAltName=DNS:localhost\\n' > san.ext; openssl x509 -req -in server.csr -CA "
        "ca.pem -CAkey ca.key -set_serial 1 -days 2 -extfile san.ext -out server.pem; echo '" +
        std::string(TlsFiles::kToken) + " bench' > tokens";
    if (std::system(("(" + cmd + ") >/dev/null 2>&1").c_str()) != 0) std::abort();
    f->ca_pem = ReadAll(d + "/ca.pem");
    return f;
  }();
  return *files;
}

server::Server& TheTlsServer() {
  static server::Server* s = [] {
    server::ServerOptions o;
    o.address = "127.0.0.1:0";
    o.metrics_address = "";
    o.compute_workers = 1;
    o.threads_per_call = Threads();
    o.default_max_context = 8192;
    o.tls_cert_file = Tls().dir + "/server.pem";
    o.tls_key_file = Tls().dir + "/server.key";
    o.auth_tokens_file = Tls().dir + "/tokens";
    auto started = server::Server::Start(o);
    if (!started.ok()) std::abort();
    return started->release();
  }();
  return *s;
}

std::shared_ptr<grpc::Channel> NewChannel(bool tls) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(256 << 20);
  // Its own connection, never one another channel opened.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (!tls) {
    return grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(TheServer().port()),
                                     grpc::InsecureChannelCredentials(), args);
  }
  args.SetSslTargetNameOverride("localhost");
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = Tls().ca_pem;
  return grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(TheTlsServer().port()),
      grpc::CompositeChannelCredentials(grpc::SslCredentials(ssl),
                                        grpc::AccessTokenCredentials(TlsFiles::kToken)),
      args);
}

std::shared_ptr<grpc::Channel> Channel(bool tls = false) {
  static std::shared_ptr<grpc::Channel> plain = NewChannel(false);
  static std::shared_ptr<grpc::Channel> secure = NewChannel(true);
  return tls ? secure : plain;
}

v1::Tensor RandomWire(std::vector<int64_t> shape, uint32_t seed) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_F32);
  int64_t n = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::string data(n * 4, '\0');
  for (int64_t i = 0; i < n; ++i) {
    float f = dist(rng);
    std::memcpy(data.data() + 4 * i, &f, 4);
  }
  t.set_data(std::move(data));
  return t;
}

// Reports mean (by the framework) plus p50 / p99 of the per-iteration times.
template <typename Body>
void Timed(benchmark::State& state, Body&& body) {
  std::vector<double> us;
  for (auto _ : state) {
    auto t0 = Clock::now();
    if (!body()) {
      state.SkipWithError("call failed");
      return;
    }
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  std::sort(us.begin(), us.end());
  if (!us.empty()) {
    state.counters["p50_us"] = us[us.size() / 2];
    state.counters["p99_us"] = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  }
}

// grpc.health.v1.Health/Check with an empty request (an empty
// HealthCheckRequest is zero bytes on the wire) through the generic stub.
bool HealthCheck(grpc::GenericStub& generic) {
    grpc::ClientContext ctx;
    grpc::ByteBuffer req, resp;
    grpc::Slice empty;
    req = grpc::ByteBuffer(&empty, 1);
    grpc::Status status;
    bool done = false;
    std::mutex mu;
    std::condition_variable cv;
    generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                      [&](grpc::Status s) {
                        std::lock_guard<std::mutex> lock(mu);
                        status = s;
                        done = true;
                        cv.notify_one();
                      });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    return status.ok();
}

// `tls`: over TLS with a bearer token, on the TLS server.
void Health(benchmark::State& state, bool tls) {
  grpc::GenericStub generic(Channel(tls));
  Timed(state, [&] { return HealthCheck(generic); });
}
void BM_Health(benchmark::State& state) { Health(state, false); }
void BM_HealthTls(benchmark::State& state) { Health(state, true); }

// A new channel (its own connection) and its first call, each iteration.
void Connect(benchmark::State& state, bool tls) {
  Timed(state, [&] {
    grpc::GenericStub generic(NewChannel(tls));
    return HealthCheck(generic);
  });
}
void BM_ConnectPlaintext(benchmark::State& state) { Connect(state, false); }
void BM_ConnectTls(benchmark::State& state) { Connect(state, true); }

// The small Attend of the rpc/*attend_small* cases: causal, RoPE, q/k/v
// [1, 16, 8, 64] f32.
v1::AttendRequest SmallAttend() {
  v1::AttendRequest req;
  v1::AttentionSpec* spec = req.mutable_spec();
  spec->set_heads(8);
  spec->set_kv_heads(8);
  spec->set_head_dim(64);
  spec->set_causal(true);
  spec->mutable_rope();
  *req.mutable_q() = RandomWire({1, 16, 8, 64}, 1);
  *req.mutable_k() = RandomWire({1, 16, 8, 64}, 2);
  *req.mutable_v() = RandomWire({1, 16, 8, 64}, 3);
  return req;
}

void AttendSmall(benchmark::State& state, bool tls) {
  auto stub = v1::AttentionService::NewStub(Channel(tls));
  const v1::AttendRequest req = SmallAttend();
  Timed(state, [&] {
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    return stub->Attend(&ctx, req, &resp).ok();
  });
}
void BM_AttendSmall(benchmark::State& state) { AttendSmall(state, false); }
void BM_AttendSmallTls(benchmark::State& state) { AttendSmall(state, true); }

void BM_DecodeStep(benchmark::State& state) {
  const int64_t context = state.range(0);
  auto stub = v1::AttentionService::NewStub(Channel());
  grpc::ClientContext ctx;
  auto rw = stub->Decode(&ctx);
  v1::DecodeRequest open;
  v1::OpenSession* o = open.mutable_open();
  o->mutable_spec()->set_heads(32);
  o->mutable_spec()->set_kv_heads(8);
  o->mutable_spec()->set_head_dim(128);
  o->mutable_spec()->mutable_rope()->set_theta(500000);
  o->set_max_context(context + 1024 * 16);
  v1::DecodeResponse resp;
  if (!rw->Write(open) || !rw->Read(&resp) || !resp.has_opened()) {
    state.SkipWithError("open failed");
    return;
  }
  // Fill the cache to `context` tokens in chunks of 512.
  uint64_t seq = 0;
  for (int64_t pos = 0; pos < context; pos += 512) {
    v1::DecodeRequest step;
    v1::Step* s = step.mutable_step();
    s->set_seq(++seq);
    *s->mutable_q() = RandomWire({1, 512, 32, 128}, 10 + seq);
    *s->mutable_k() = RandomWire({1, 512, 8, 128}, 20 + seq);
    *s->mutable_v() = RandomWire({1, 512, 8, 128}, 30 + seq);
    if (!rw->Write(step) || !rw->Read(&resp) || !resp.has_step()) {
      state.SkipWithError("prefill failed");
      return;
    }
  }
  v1::DecodeRequest step;
  v1::Step* s = step.mutable_step();
  *s->mutable_q() = RandomWire({1, 1, 32, 128}, 4);
  *s->mutable_k() = RandomWire({1, 1, 8, 128}, 5);
  *s->mutable_v() = RandomWire({1, 1, 8, 128}, 6);
  v1::DecodeRequest trunc;
  int64_t steps = 0;
  Timed(state, [&] {
    // Keep the context fixed: every 1024 steps, roll back to `context`.
    if (++steps % 1024 == 0) {
      trunc.mutable_truncate()->set_position(context);
      if (!rw->Write(trunc) || !rw->Read(&resp)) return false;
    }
    s->set_seq(++seq);
    return rw->Write(step) && rw->Read(&resp) && resp.has_step();
  });
  rw->WritesDone();
  while (rw->Read(&resp)) {
  }
  rw->Finish();
}

// One Decode step in layer mode on the built-in demo model: the server
// projects the hidden state (q/k/v), rotates, attends over `context` cached
// tokens and applies the output projection.
void BM_LayerDecodeStep(benchmark::State& state) {
  const int64_t context = state.range(0);
  auto stub = v1::AttentionService::NewStub(Channel());
  v1::ModelInfo model;
  {
    grpc::ClientContext ctx;
    v1::GetModelRequest req;
    req.set_name("demo");
    if (!stub->GetModel(&ctx, req, &model).ok()) {
      state.SkipWithError("GetModel failed");
      return;
    }
  }
  const int64_t hidden = model.hidden_size();
  grpc::ClientContext ctx;
  auto rw = stub->Decode(&ctx);
  v1::DecodeRequest open;
  open.mutable_open()->set_model("demo");
  open.mutable_open()->set_layer(0);
  open.mutable_open()->set_max_context(context + 2048);
  v1::DecodeResponse resp;
  if (!rw->Write(open) || !rw->Read(&resp) || !resp.has_opened()) {
    state.SkipWithError("open failed");
    return;
  }
  uint64_t seq = 0;
  for (int64_t pos = 0; pos < context; pos += 512) {
    v1::DecodeRequest step;
    step.mutable_step()->set_seq(++seq);
    *step.mutable_step()->mutable_hidden() = RandomWire({1, 512, hidden}, 40 + seq);
    if (!rw->Write(step) || !rw->Read(&resp) || !resp.has_step()) {
      state.SkipWithError("prefill failed");
      return;
    }
  }
  v1::DecodeRequest step;
  *step.mutable_step()->mutable_hidden() = RandomWire({1, 1, hidden}, 7);
  v1::DecodeRequest trunc;
  int64_t steps = 0;
  Timed(state, [&] {
    if (++steps % 1024 == 0) {
      trunc.mutable_truncate()->set_position(context);
      if (!rw->Write(trunc) || !rw->Read(&resp)) return false;
    }
    step.mutable_step()->set_seq(++seq);
    return rw->Write(step) && rw->Read(&resp) && resp.has_step();
  });
  state.counters["model_resident_bytes"] = static_cast<double>(model.resident_bytes());
  rw->WritesDone();
  while (rw->Read(&resp)) {
  }
  rw->Finish();
}

// ------------------------------------------------ the figures --

// One series' value in the in-process server's own metrics text (-1: absent).
double Metric(const std::string& text, const std::string& series) {
  const size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::atof(text.c_str() + at + series.size() + 2);
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

double Micros(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

// The machine's copy bandwidth, measured once in this run (bench/copy_ceiling.h).
double CopyCeiling() {
  static const double ceiling = bench::BestCopyBandwidth(Threads());
  return ceiling;
}

// Health and a small Attend alternately on one channel, so both see the
// same moment of a noisy machine: the ratio of their medians, and the
// server's own time for the Attend (handler entry to answer).
void BM_PairedAttendSmall(benchmark::State& state) {
  auto stub = v1::AttentionService::NewStub(Channel());
  grpc::GenericStub generic(Channel());
  const v1::AttendRequest req = SmallAttend();
  std::vector<double> health, attend;
  const std::string before = TheServer().metrics().RenderPrometheus();
  for (auto _ : state) {
    const auto t0 = Clock::now();
    if (!HealthCheck(generic)) return state.SkipWithError("health failed");
    const auto t1 = Clock::now();
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    if (!stub->Attend(&ctx, req, &resp).ok()) return state.SkipWithError("Attend failed");
    const auto t2 = Clock::now();
    health.push_back(Micros(t0, t1));
    attend.push_back(Micros(t1, t2));
  }
  const std::string after = TheServer().metrics().RenderPrometheus();
  const std::string sum = "ropeattn_request_duration_seconds_sum{method=\"Attend\"}";
  const std::string count = "ropeattn_request_duration_seconds_count{method=\"Attend\"}";
  const double n = Metric(after, count) - Metric(before, count);
  state.counters["health_p50_us"] = Percentile(health, 0.5);
  state.counters["attend_p50_us"] = Percentile(attend, 0.5);
  state.counters["ratio_p50"] = Percentile(attend, 0.5) / Percentile(health, 0.5);
  state.counters["server_attend_us"] =
      n > 0 ? (Metric(after, sum) - Metric(before, sum)) / n * 1e6 : 0;
}

// The same small Attend as rpc/paired/attend_small_vs_health through the
// handler alone (pricing and the compute, proto in and out, no RPC), on one
// kernel thread as an inline call runs it: what of its round trip is ours.
void BM_HandlerAttendSmall(benchmark::State& state) {
  const v1::AttendRequest req = SmallAttend();
  const server::ComputeOptions o{1, nullptr, 2};
  for (auto _ : state) {
    v1::AttendResponse resp;
    if (!server::PriceAttend(req, 2).ok() || !server::RunAttend(req, &resp, o).ok()) {
      return state.SkipWithError("RunAttend failed");
    }
    benchmark::DoNotOptimize(resp);
  }
}

// A session's cache filled to `context` tokens of [32 heads over 8, d 128]
// in chunks of 512 (the same random tokens for the RPC and the local copy).
constexpr int64_t kHeads = 32, kKvHeads = 8, kHeadDim = 128;

bool OpenFilled(grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>* rw,
                int64_t context, uint32_t seed) {
  v1::DecodeRequest open;
  v1::OpenSession* o = open.mutable_open();
  o->mutable_spec()->set_heads(kHeads);
  o->mutable_spec()->set_kv_heads(kKvHeads);
  o->mutable_spec()->set_head_dim(kHeadDim);
  o->mutable_spec()->mutable_rope()->set_theta(500000);
  o->set_max_context(context + 1024);
  v1::DecodeResponse resp;
  if (!rw->Write(open) || !rw->Read(&resp) || !resp.has_opened()) {
    std::fprintf(stderr, "open: %s\n", resp.ShortDebugString().c_str());
    return false;
  }
  for (int64_t pos = 0; pos < context; pos += 512) {
    const int64_t n = std::min<int64_t>(512, context - pos);
    v1::DecodeRequest step;
    v1::Step* s = step.mutable_step();
    *s->mutable_q() = RandomWire({1, n, kHeads, kHeadDim}, seed + 1);
    *s->mutable_k() = RandomWire({1, n, kKvHeads, kHeadDim}, seed + 2);
    *s->mutable_v() = RandomWire({1, n, kKvHeads, kHeadDim}, seed + 3);
    if (!rw->Write(step) || !rw->Read(&resp) || !resp.has_step()) {
      std::fprintf(stderr, "prefill: %s\n", resp.ShortDebugString().c_str());
      return false;
    }
  }
  return true;
}

Tensor WireToTensor(const v1::Tensor& t) {
  Dims dims(t.shape().begin(), t.shape().end());
  Tensor out = Tensor::Create(DType::kF32, dims).value();
  std::memcpy(out.data<char>(), t.data().data(), t.data().size());
  return out;
}

// Health, a one-token Decode step at `context`, and the same step computed
// in this process on a DecodeState of the same shape (the kernel alone,
// same thread count), alternately: what the service adds to a step, in
// health round trips.
void BM_PairedDecodeStep(benchmark::State& state) {
  const int64_t context = state.range(0);
  auto stub = v1::AttentionService::NewStub(Channel());
  grpc::GenericStub generic(Channel());
  grpc::ClientContext ctx;
  auto rw = stub->Decode(&ctx);
  if (!OpenFilled(rw.get(), context, 10)) return state.SkipWithError("open failed");
  DecodeStateConfig c;
  c.heads = kHeads;
  c.kv_heads = kKvHeads;
  c.head_dim = c.v_dim = kHeadDim;
  c.max_context = context + 1024;
  RopeConfig rope;
  rope.head_dim = kHeadDim;
  rope.theta = 500000;
  c.rope = rope;
  DecodeState local = DecodeState::Create(c).value();
  for (int64_t pos = 0; pos < context; pos += 512) {
    const int64_t n = std::min<int64_t>(512, context - pos);
    Tensor q = WireToTensor(RandomWire({1, n, kHeads, kHeadDim}, 11));
    Tensor k = WireToTensor(RandomWire({1, n, kKvHeads, kHeadDim}, 12));
    Tensor v = WireToTensor(RandomWire({1, n, kKvHeads, kHeadDim}, 13));
    Tensor o = Tensor::Create(DType::kF32, {1, n, kHeads, kHeadDim}).value();
    if (!local.Step(q.cview(), k.cview(), v.cview(), o.view(), Threads()).ok()) std::abort();
  }
  v1::DecodeRequest step;
  v1::Step* s = step.mutable_step();
  *s->mutable_q() = RandomWire({1, 1, kHeads, kHeadDim}, 4);
  *s->mutable_k() = RandomWire({1, 1, kKvHeads, kHeadDim}, 5);
  *s->mutable_v() = RandomWire({1, 1, kKvHeads, kHeadDim}, 6);
  Tensor q = WireToTensor(s->q()), k = WireToTensor(s->k()), v = WireToTensor(s->v());
  Tensor o = Tensor::Create(DType::kF32, {1, 1, kHeads, kHeadDim}).value();
  v1::DecodeRequest trunc;
  trunc.mutable_truncate()->set_position(context);
  v1::DecodeResponse resp;
  std::vector<double> health, rpc, kernel;
  int64_t steps = 0;
  for (auto _ : state) {
    // Both caches grow by one token a step and are cut back to `context`
    // together, so the RPC's step and the local one always see the same
    // number of keys.
    if (++steps % 512 == 0) {
      if (!rw->Write(trunc) || !rw->Read(&resp)) return state.SkipWithError("truncate failed");
      if (!local.Truncate(context).ok()) std::abort();
    }
    const auto t0 = Clock::now();
    if (!HealthCheck(generic)) return state.SkipWithError("health failed");
    const auto t1 = Clock::now();
    if (!rw->Write(step) || !rw->Read(&resp) || !resp.has_step()) {
      return state.SkipWithError("step failed");
    }
    const auto t2 = Clock::now();
    if (!local.Step(q.cview(), k.cview(), v.cview(), o.view(), Threads()).ok()) std::abort();
    const auto t3 = Clock::now();
    health.push_back(Micros(t0, t1));
    rpc.push_back(Micros(t1, t2));
    kernel.push_back(Micros(t2, t3));
  }
  rw->WritesDone();
  while (rw->Read(&resp)) {
  }
  rw->Finish();
  const double h = Percentile(health, 0.5), r = Percentile(rpc, 0.5), k50 = Percentile(kernel, 0.5);
  state.counters["health_p50_us"] = h;
  state.counters["step_p50_us"] = r;
  state.counters["kernel_p50_us"] = k50;
  state.counters["overhead_over_health"] = (r - k50) / h;
}

// Every benchmark thread drives its own session (32 heads over 8, d 128,
// f32) filled to `context`, one-token steps back to back: the aggregate
// steps/s, and that times the K/V bytes a step reads, as a fraction of the
// copy bandwidth measured in this run. The server batches the steps that
// wait together.
void BM_DecodeSessions(benchmark::State& state) {
  const int64_t context = state.range(0);
  const double ceiling = CopyCeiling();
  auto stub = v1::AttentionService::NewStub(Channel());
  grpc::ClientContext ctx;
  auto rw = stub->Decode(&ctx);
  const uint32_t seed = 100 + 10 * static_cast<uint32_t>(state.thread_index());
  if (!OpenFilled(rw.get(), context, seed)) return state.SkipWithError("open failed");
  v1::DecodeRequest step;
  v1::Step* s = step.mutable_step();
  *s->mutable_q() = RandomWire({1, 1, kHeads, kHeadDim}, seed + 4);
  *s->mutable_k() = RandomWire({1, 1, kKvHeads, kHeadDim}, seed + 5);
  *s->mutable_v() = RandomWire({1, 1, kKvHeads, kHeadDim}, seed + 6);
  v1::DecodeRequest trunc;
  trunc.mutable_truncate()->set_position(context);
  v1::DecodeResponse resp;
  const std::string before = state.thread_index() == 0 ? TheServer().metrics().RenderPrometheus()
                                                       : std::string();
  int64_t steps = 0;
  for (auto _ : state) {
    if (++steps % 512 == 0) {
      state.PauseTiming();
      const bool ok = rw->Write(trunc) && rw->Read(&resp);
      state.ResumeTiming();
      if (!ok) return state.SkipWithError("truncate failed");
    }
    if (!rw->Write(step) || !rw->Read(&resp) || !resp.has_step()) {
      return state.SkipWithError("step failed");
    }
  }
  rw->WritesDone();
  while (rw->Read(&resp)) {
  }
  rw->Finish();
  const double kv_bytes = static_cast<double>(context * kKvHeads * kHeadDim * 2 * 4);
  const double n = static_cast<double>(state.iterations());
  state.counters["steps_per_s"] = benchmark::Counter(n, benchmark::Counter::kIsRate);
  state.counters["fraction_of_copy"] =
      benchmark::Counter(n * kv_bytes / ceiling, benchmark::Counter::kIsRate);
  if (state.thread_index() == 0) {
    const std::string after = TheServer().metrics().RenderPrometheus();
    const std::string sum = "ropeattn_decode_batch_size_sum", count = "ropeattn_decode_batch_size_count";
    const double passes = Metric(after, count) - Metric(before, count);
    state.counters["mean_batch"] = passes > 0 ? (Metric(after, sum) - Metric(before, sum)) / passes : 0;
    state.counters["copy_ceiling"] = ceiling;
  }
}

// Control calls while compute is saturated: two callers keep the worker
// busy with 2048-token causal Attends (tens of ms each) and four sessions
// step at 4k context; the measured thread's call's p50 / p99.
class Saturation {
 public:
  Saturation() {
    for (int i = 0; i < 2; ++i) {
      threads_.emplace_back([this] {
        auto stub = v1::AttentionService::NewStub(NewChannel(false));
        v1::AttendRequest big;
        big.mutable_spec()->set_heads(8);
        big.mutable_spec()->set_head_dim(64);
        big.mutable_spec()->set_causal(true);
        *big.mutable_q() = RandomWire({1, 2048, 8, 64}, 21);
        *big.mutable_k() = RandomWire({1, 2048, 8, 64}, 22);
        *big.mutable_v() = RandomWire({1, 2048, 8, 64}, 23);
        while (!stop_.load()) {
          grpc::ClientContext ctx;
          v1::AttendResponse out;
          stub->Attend(&ctx, big, &out);
          attends_.fetch_add(1);
        }
      });
    }
    for (int i = 0; i < 4; ++i) {
      threads_.emplace_back([this, i] {
        auto stub = v1::AttentionService::NewStub(NewChannel(false));
        grpc::ClientContext ctx;
        auto rw = stub->Decode(&ctx);
        if (!OpenFilled(rw.get(), 4096, 200 + 10 * i)) return;
        v1::DecodeRequest step;
        v1::Step* s = step.mutable_step();
        *s->mutable_q() = RandomWire({1, 1, kHeads, kHeadDim}, 7);
        *s->mutable_k() = RandomWire({1, 1, kKvHeads, kHeadDim}, 8);
        *s->mutable_v() = RandomWire({1, 1, kKvHeads, kHeadDim}, 9);
        v1::DecodeRequest trunc;
        trunc.mutable_truncate()->set_position(4096);
        v1::DecodeResponse resp;
        for (int64_t n = 1; !stop_.load(); ++n) {
          if (!rw->Write(n % 512 == 0 ? trunc : step) || !rw->Read(&resp)) break;
          steps_.fetch_add(1);
        }
        rw->WritesDone();
        while (rw->Read(&resp)) {
        }
        rw->Finish();
      });
    }
    // Saturated once the sessions are filled and stepping.
    while (steps_.load() < 40) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ~Saturation() {
    stop_.store(true);
    for (std::thread& t : threads_) t.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> attends_{0}, steps_{0};
  std::vector<std::thread> threads_;
};

template <typename Call>
void UnderLoad(benchmark::State& state, Call call) {
  Saturation load;
  std::vector<double> us;
  const std::string before = TheServer().metrics().RenderPrometheus();
  for (auto _ : state) {
    const auto t0 = Clock::now();
    if (!call()) return state.SkipWithError("call failed");
    us.push_back(Micros(t0, Clock::now()));
  }
  const std::string after = TheServer().metrics().RenderPrometheus();
  state.counters["p50_us"] = Percentile(us, 0.5);
  state.counters["p99_us"] = Percentile(us, 0.99);
  state.counters["running"] = Metric(after, "ropeattn_running");
}

void BM_HealthUnderLoad(benchmark::State& state) {
  grpc::GenericStub generic(NewChannel(false));
  UnderLoad(state, [&] { return HealthCheck(generic); });
}
void BM_ServerInfoUnderLoad(benchmark::State& state) {
  auto stub = v1::AttentionService::NewStub(NewChannel(false));
  UnderLoad(state, [&] {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    return stub->GetServerInfo(&ctx, {}, &info).ok();
  });
}
void BM_ListSessionsUnderLoad(benchmark::State& state) {
  auto stub = v1::AttentionService::NewStub(NewChannel(false));
  UnderLoad(state, [&] {
    grpc::ClientContext ctx;
    v1::ListSessionsResponse out;
    return stub->ListSessions(&ctx, {}, &out).ok();
  });
}
// Open, attach-free: a new stream opens a small session and closes it. The
// sample (p50_us, p99_us) is the whole stream, three round trips; the open
// and the close, each one control call, are also timed on their own
// (open_p99_us: stream start and open; close_p99_us).
void BM_OpenCloseUnderLoad(benchmark::State& state) {
  auto stub = v1::AttentionService::NewStub(NewChannel(false));
  std::vector<double> open_us, close_us;
  UnderLoad(state, [&] {
    grpc::ClientContext ctx;
    const auto t0 = Clock::now();
    auto rw = stub->Decode(&ctx);
    v1::DecodeRequest open;
    open.mutable_open()->mutable_spec()->set_heads(4);
    open.mutable_open()->mutable_spec()->set_head_dim(16);
    open.mutable_open()->set_max_context(64);
    v1::DecodeResponse resp;
    if (!rw->Write(open) || !rw->Read(&resp) || !resp.has_opened()) return false;
    const auto t1 = Clock::now();
    v1::DecodeRequest close;
    close.mutable_close();
    if (!rw->Write(close) || !rw->Read(&resp) || !resp.has_closed()) return false;
    open_us.push_back(Micros(t0, t1));
    close_us.push_back(Micros(t1, Clock::now()));
    rw->WritesDone();
    while (rw->Read(&resp)) {
    }
    return rw->Finish().ok();
  });
  state.counters["open_p99_us"] = Percentile(open_us, 0.99);
  state.counters["close_p99_us"] = Percentile(close_us, 0.99);
}

}  // namespace
}  // namespace ropeattn

BENCHMARK(ropeattn::BM_LayerDecodeStep)
    ->Name("rpc/layer_decode_step/demo/ctx")
    ->Arg(1024)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(ropeattn::BM_Health)
    ->Name("rpc/health_check")
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(ropeattn::BM_AttendSmall)
    ->Name("rpc/attend_small")
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(ropeattn::BM_HealthTls)
    ->Name("rpc/tls/health_check")
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(ropeattn::BM_AttendSmallTls)
    ->Name("rpc/tls/attend_small")
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(ropeattn::BM_ConnectPlaintext)
    ->Name("rpc/connect/plaintext")
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(ropeattn::BM_ConnectTls)
    ->Name("rpc/connect/tls")
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(ropeattn::BM_DecodeStep)
    ->Name("rpc/decode_step/ctx")
    ->Arg(1024)
    ->Arg(4096)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK(ropeattn::BM_HandlerAttendSmall)
    ->Name("rpc/handler/attend_small")
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(ropeattn::BM_PairedAttendSmall)
    ->Name("rpc/paired/attend_small_vs_health")
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(ropeattn::BM_PairedDecodeStep)
    ->Name("rpc/paired/decode_step_vs_kernel/ctx")
    ->Arg(4096)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(ropeattn::BM_DecodeSessions)
    ->Name("rpc/decode_sessions/ctx")
    ->Arg(1024)
    ->Threads(1)
    ->Threads(16)
    ->Iterations(400)  // per thread; one run, so the sessions are filled once
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(ropeattn::BM_HealthUnderLoad)
    ->Name("rpc/under_load/health_check")
    ->MinTime(3.0)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(ropeattn::BM_ServerInfoUnderLoad)
    ->Name("rpc/under_load/get_server_info")
    ->MinTime(3.0)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(ropeattn::BM_ListSessionsUnderLoad)
    ->Name("rpc/under_load/list_sessions")
    ->MinTime(3.0)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(ropeattn::BM_OpenCloseUnderLoad)
    ->Name("rpc/under_load/open_close_session")
    ->MinTime(3.0)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  // As the server binary does (server/main.cc).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("cpu", ropeattn::CpuDescription());
  benchmark::AddCustomContext("kernel_threads", std::to_string(ropeattn::Threads()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
