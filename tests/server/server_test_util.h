// A real server on a loopback port for tests, and stubs to call it.
#ifndef ROPEATTN_TESTS_SERVER_SERVER_TEST_UTIL_H_
#define ROPEATTN_TESTS_SERVER_SERVER_TEST_UTIL_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "core/tensor.h"
#include "grpcpp/grpcpp.h"
#include "ropeattn/v1/attention.grpc.pb.h"
#include "server/server.h"

namespace ropeattn::testing {

// Options for a test server: gRPC and metrics on 127.0.0.1 port 0, small
// limits suited to tests (override fields as needed before starting).
server::ServerOptions TestServerOptions();

// Starts a server (fails the test on error).
std::unique_ptr<server::Server> StartTestServer(const server::ServerOptions& options);

// A channel to 127.0.0.1:port with message limits matching the server's.
std::shared_ptr<grpc::Channel> TestChannel(int port, int64_t max_message_bytes = 256 << 20);
std::unique_ptr<v1::AttentionService::Stub> TestStub(int port);

// One query over two keys with equal scores (1 head, head_dim 4): the
// answer is the mean of the two value rows, (2, 3, 2, 3).
v1::AttendRequest SmallAttendRequest();

// Fills a wire tensor from a core tensor.
v1::Tensor ToWire(const ConstTensorView& t);
// Reads a wire tensor into doubles (row-major).
std::vector<double> WireToDoubles(const v1::Tensor& t);

// One series' value in a metrics text (-1: absent).
double MetricValue(const std::string& text, const std::string& series);

// Polls `done` every 5 ms until it holds; false after `limit`.
bool Eventually(const std::function<bool()>& done, absl::Duration limit = absl::Seconds(30));

}  // namespace ropeattn::testing

#endif  // ROPEATTN_TESTS_SERVER_SERVER_TEST_UTIL_H_
