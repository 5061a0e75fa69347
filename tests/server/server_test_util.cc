#include "tests/server/server_test_util.h"

#include <malloc.h>

#include <cstdlib>
#include <cstring>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace ropeattn::testing {

server::ServerOptions TestServerOptions() {
  server::ServerOptions o;
  o.address = "127.0.0.1:0";
  o.metrics_address = "127.0.0.1:0";
  o.compute_workers = 2;
  o.threads_per_call = 1;
  o.queue_depth = 64;
  o.max_message_bytes = 64 << 20;
  o.max_sessions = 64;
  o.memory_budget_bytes = int64_t{256} << 20;
  o.default_max_context = 512;
  o.reap_interval_seconds = 0.05;
  o.shutdown_grace_seconds = 2;
  return o;
}

std::unique_ptr<server::Server> StartTestServer(const server::ServerOptions& options) {
  // As the server binary sets it (server/main.cc): large buffers are mapped
  // on their own and unmapped when freed. Without it glibc's threshold grows
  // with the largest buffer freed, and the tests that measure this process's
  // RSS saw other tests' freed buffers (an idle-stream test: 62 MiB once
  // in four runs).
  mallopt(M_MMAP_THRESHOLD, 4 << 20);
  auto server = server::Server::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return nullptr;
  return *std::move(server);
}

std::shared_ptr<grpc::Channel> TestChannel(int port, int64_t max_message_bytes) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(max_message_bytes));
  // Each test channel is its own connection: sessions on one channel must not
  // share a subchannel with another test's.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                   grpc::InsecureChannelCredentials(), args);
}

std::unique_ptr<v1::AttentionService::Stub> TestStub(int port) {
  return v1::AttentionService::NewStub(TestChannel(port));
}

v1::Tensor ToWire(const ConstTensorView& t) {
  v1::Tensor out;
  out.set_dtype(t.dtype() == DType::kF32 ? v1::DTYPE_F32 : v1::DTYPE_BF16);
  for (int64_t d : t.dims()) out.add_shape(d);
  Tensor dense = Tensor::CopyOf(t).value();
  out.set_data(std::string(dense.data<char>(), dense.byte_size()));
  return out;
}

std::vector<double> WireToDoubles(const v1::Tensor& t) {
  std::vector<double> out;
  const size_t n = t.dtype() == v1::DTYPE_F32 ? t.data().size() / 4 : t.data().size() / 2;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (t.dtype() == v1::DTYPE_F32) {
      float f;
      std::memcpy(&f, t.data().data() + 4 * i, 4);
      out.push_back(f);
    } else {
      uint16_t b;
      std::memcpy(&b, t.data().data() + 2 * i, 2);
      out.push_back(BF16ToFloat(b));
    }
  }
  return out;
}

v1::AttendRequest SmallAttendRequest() {
  v1::AttendRequest req;
  req.mutable_spec()->set_heads(1);
  req.mutable_spec()->set_head_dim(4);
  const auto set = [](v1::Tensor* t, std::vector<int64_t> shape, std::vector<float> values) {
    t->set_dtype(v1::DTYPE_F32);
    for (int64_t d : shape) t->add_shape(d);
    t->set_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4));
  };
  set(req.mutable_q(), {1, 1, 1, 4}, {1, 0, 1, 0});
  set(req.mutable_k(), {1, 2, 1, 4}, {0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5});
  set(req.mutable_v(), {1, 2, 1, 4}, {1, 2, 1, 2, 3, 4, 3, 4});
  return req;
}

bool Eventually(const std::function<bool()>& done, absl::Duration limit) {
  const absl::Time deadline = absl::Now() + limit;
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

double MetricValue(const std::string& text, const std::string& series) {
  const size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::atof(text.c_str() + at + series.size() + 2);
}

}  // namespace ropeattn::testing
