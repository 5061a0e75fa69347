// The load generator against a real in-process server, and `ropeattn bench`
// end to end. Short windows keep the binary fast; assertions check structure,
// counts and consistency, never absolute speed.
#include "client/loadgen.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/tls_test_util.h"
#include "tests/server/server_test_util.h"

namespace ropeattn::client {
namespace {

std::unique_ptr<Client> ConnectTo(int port) {
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", port);
  auto client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

LoadSpec SmallAttend(LoadMode mode) {
  LoadSpec spec;
  spec.workload = Workload::kAttend;
  spec.attend.batch = 1;
  spec.attend.heads = 2;
  spec.attend.kv_heads = 1;
  spec.attend.head_dim = 16;
  spec.attend.q_len = 4;
  spec.attend.k_len = 32;
  spec.mode = mode;
  spec.warmup = absl::Milliseconds(100);
  spec.window = absl::Milliseconds(250);
  spec.max_windows = 4;
  return spec;
}

LoadSpec SmallDecode(LoadMode mode) {
  LoadSpec spec;
  spec.workload = Workload::kDecode;
  spec.decode.heads = 2;
  spec.decode.kv_heads = 2;
  spec.decode.head_dim = 16;
  spec.decode.steps_per_session = 4;
  spec.decode.context = 8;
  spec.decode.tokens_per_step = 2;
  spec.mode = mode;
  spec.warmup = absl::Milliseconds(100);
  spec.window = absl::Milliseconds(250);
  spec.max_windows = 4;
  return spec;
}

bool LastWindowsStable(const std::vector<double>& t, int n, double tolerance) {
  if (static_cast<int>(t.size()) < n) return false;
  double mean = 0;
  for (size_t i = t.size() - n; i < t.size(); ++i) mean += t[i];
  mean /= n;
  for (size_t i = t.size() - n; i < t.size(); ++i) {
    if (std::abs(t[i] - mean) > tolerance * mean) return false;
  }
  return true;
}

// Invariants every point must satisfy, whatever the machine's speed.
void CheckPoint(const LoadSpec& spec, const PointResult& r, int64_t tokens_per_request) {
  SCOPED_TRACE(absl::StrCat(LoadModeName(r.mode), " c=", r.concurrency, " rate=", r.offered_rps));
  EXPECT_EQ(r.workload, spec.workload);
  EXPECT_EQ(r.mode, spec.mode);
  EXPECT_GT(r.requests, 0);
  EXPECT_EQ(r.ok + r.errors, r.requests);
  int64_t sum = 0;
  for (const auto& [code, n] : r.codes) sum += n;
  EXPECT_EQ(sum, r.requests);
  const int64_t ok_code =
      r.codes.count(absl::StatusCode::kOk) ? r.codes.at(absl::StatusCode::kOk) : 0;
  EXPECT_EQ(ok_code, r.ok);

  // Windows and stability bookkeeping.
  EXPECT_GE(r.windows, spec.stable_windows);
  EXPECT_LE(r.windows, spec.max_windows);
  ASSERT_EQ(r.window_throughputs.size(), static_cast<size_t>(r.windows));
  EXPECT_EQ(r.stable, LastWindowsStable(r.window_throughputs, spec.stable_windows, spec.stability));
  EXPECT_DOUBLE_EQ(r.measured_seconds, spec.stable_windows * absl::ToDoubleSeconds(spec.window));
  // The reported throughput is over exactly the last windows.
  double last = 0;
  for (int i = r.windows - spec.stable_windows; i < r.windows; ++i) last += r.window_throughputs[i];
  EXPECT_NEAR(r.throughput_rps, last / spec.stable_windows, 1e-6 * (1 + r.throughput_rps));
  EXPECT_NEAR(r.throughput_rps, r.ok / r.measured_seconds, 1e-9 * (1 + r.throughput_rps));
  EXPECT_NEAR(r.tokens_per_s, r.throughput_rps * tokens_per_request, 1e-6 * (1 + r.tokens_per_s));

  // Percentiles from one sorted sample: ordered, and bounded by the max.
  if (r.ok > 0) {
    const LatencyStats& l = r.latency;
    EXPECT_GT(l.p50, 0);
    EXPECT_LE(l.p50, l.p90);
    EXPECT_LE(l.p90, l.p95);
    EXPECT_LE(l.p95, l.p99);
    EXPECT_LE(l.p99, l.p999);
    EXPECT_LE(l.p999, l.max);
    EXPECT_GT(l.mean, 0);
    EXPECT_LE(l.mean, l.max);
  }
}

TEST(LoadgenTest, AttendClosedLoopSweep) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  auto client = ConnectTo(server->port());
  ASSERT_NE(client, nullptr);
  LoadSpec spec = SmallAttend(LoadMode::kClosed);
  spec.concurrency = {1, 3};
  int progress_calls = 0;
  spec.on_window = [&](const WindowProgress& p) {
    EXPECT_EQ(p.points, 2);
    EXPECT_LE(p.window, spec.max_windows);
    ++progress_calls;
  };
  auto results = RunLoad(*client, spec);
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), 2u);
  int expected_calls = 0;
  for (size_t i = 0; i < 2; ++i) {
    const PointResult& r = (*results)[i];
    CheckPoint(spec, r, spec.attend.batch * spec.attend.q_len);
    EXPECT_EQ(r.concurrency, spec.concurrency[i]);
    EXPECT_EQ(r.offered_rps, 0);
    EXPECT_EQ(r.errors, 0) << FormatCodes(r.codes);
    EXPECT_EQ(r.ok, r.requests);
    EXPECT_EQ(r.late, 0);
    EXPECT_GT(r.throughput_rps, 0);
    expected_calls += 1 + r.windows;  // the warm-up, then each window
  }
  EXPECT_EQ(progress_calls, expected_calls);
}

TEST(LoadgenTest, AttendOpenLoopConstantAndPoisson) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  auto client = ConnectTo(server->port());
  ASSERT_NE(client, nullptr);
  for (LoadMode mode : {LoadMode::kConstant, LoadMode::kPoisson}) {
    LoadSpec spec = SmallAttend(mode);
    spec.rates = {120};
    auto results = RunLoad(*client, spec);
    ASSERT_TRUE(results.ok()) << results.status();
    ASSERT_EQ(results->size(), 1u);
    const PointResult& r = (*results)[0];
    CheckPoint(spec, r, spec.attend.batch * spec.attend.q_len);
    EXPECT_EQ(r.concurrency, 0);
    EXPECT_EQ(r.offered_rps, 120);
    EXPECT_EQ(r.ok, r.requests) << FormatCodes(r.codes);
    EXPECT_GT(r.throughput_rps, 0);
    // The schedule caps what can complete: a constant schedule puts at most
    // one extra arrival in a window (the slack covers requests delayed into
    // the final windows by a stall); Poisson arrivals fluctuate more.
    EXPECT_LE(r.throughput_rps, r.offered_rps * (mode == LoadMode::kConstant ? 1.3 : 1.7));
    EXPECT_LE(r.late, r.requests);
  }
}

// A single in-flight slot against a schedule far faster than the server:
// arrivals are sent late, and their latency counts from the schedule, so the
// backlog shows (no coordinated omission).
TEST(LoadgenTest, OpenLoopCountsLateSendsAndQueueingDelay) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  auto client = ConnectTo(server->port());
  ASSERT_NE(client, nullptr);
  LoadSpec spec = SmallAttend(LoadMode::kClosed);
  spec.attend.heads = 8;
  spec.attend.kv_heads = 8;
  spec.attend.head_dim = 64;
  spec.attend.q_len = 64;
  spec.attend.k_len = 512;  // ~1 MiB per k and v: milliseconds per request
  spec.concurrency = {1};
  spec.max_windows = 3;
  auto closed = RunLoad(*client, spec);
  ASSERT_TRUE(closed.ok()) << closed.status();

  spec.mode = LoadMode::kConstant;
  spec.rates = {5000};
  spec.max_outstanding = 1;
  auto open = RunLoad(*client, spec);
  ASSERT_TRUE(open.ok()) << open.status();
  const PointResult& c = (*closed)[0];
  const PointResult& o = (*open)[0];
  CheckPoint(spec, o, spec.attend.q_len);
  EXPECT_GT(o.late, 0);
  EXPECT_LT(o.throughput_rps, o.offered_rps);
  // Measured from the send, both would see the same service time; measured
  // from the schedule, the open loop also sees the backlog it built up.
  EXPECT_GT(o.latency.p50, 2 * c.latency.p50);
}

TEST(LoadgenTest, DecodeClosedAndOpenLoop) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  auto client = ConnectTo(server->port());
  ASSERT_NE(client, nullptr);
  {
    LoadSpec spec = SmallDecode(LoadMode::kClosed);
    spec.concurrency = {1, 2};
    spec.decode.think_time = absl::Milliseconds(1);
    auto results = RunLoad(*client, spec);
    ASSERT_TRUE(results.ok()) << results.status();
    ASSERT_EQ(results->size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      const PointResult& r = (*results)[i];
      CheckPoint(spec, r, spec.decode.tokens_per_step);
      EXPECT_EQ(r.concurrency, spec.concurrency[i]);
      EXPECT_EQ(r.errors, 0) << FormatCodes(r.codes);
      EXPECT_GT(r.tokens_per_s, 0);
    }
  }
  {
    LoadSpec spec = SmallDecode(LoadMode::kPoisson);
    spec.rates = {200};  // steps/s: 50 sessions/s of 4 steps
    auto results = RunLoad(*client, spec);
    ASSERT_TRUE(results.ok()) << results.status();
    const PointResult& r = (*results)[0];
    CheckPoint(spec, r, spec.decode.tokens_per_step);
    EXPECT_EQ(r.errors, 0) << FormatCodes(r.codes);
    EXPECT_GT(r.throughput_rps, 0);
    EXPECT_LE(r.throughput_rps, r.offered_rps * 1.8);  // Poisson sessions of 4 steps: bursty
  }
  // Every session ends with its stream (closed, or dropped at the stop): none
  // is left open. Stream ends reach the server asynchronously: poll.
  int open_sessions = -1;
  for (int i = 0; i < 100 && open_sessions != 0; ++i) {
    auto info = client->GetServerInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    open_sessions = info->open_sessions();
    if (open_sessions != 0) absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(open_sessions, 0);
}

TEST(LoadgenTest, FullServerQueueIsCountedAsResourceExhausted) {
  server::ServerOptions options = testing::TestServerOptions();
  options.compute_workers = 1;
  options.queue_depth = 1;
  auto server = testing::StartTestServer(options);
  ASSERT_NE(server, nullptr);
  auto client = ConnectTo(server->port());
  ASSERT_NE(client, nullptr);
  LoadSpec spec = SmallAttend(LoadMode::kClosed);
  spec.attend.heads = 8;
  spec.attend.kv_heads = 8;
  spec.attend.head_dim = 64;
  spec.attend.q_len = 64;
  spec.attend.k_len = 512;
  spec.concurrency = {8};  // one running, one waiting, the rest rejected
  spec.max_windows = 3;
  auto results = RunLoad(*client, spec);
  ASSERT_TRUE(results.ok()) << results.status();
  const PointResult& r = (*results)[0];
  CheckPoint(spec, r, spec.attend.q_len);
  ASSERT_TRUE(r.codes.count(absl::StatusCode::kResourceExhausted)) << FormatCodes(r.codes);
  EXPECT_GT(r.codes.at(absl::StatusCode::kResourceExhausted), 0);
  EXPECT_GT(r.errors, 0);
  EXPECT_GT(r.ok, 0);
  EXPECT_NE(FormatCodes(r.codes).find("RESOURCE_EXHAUSTED="), std::string::npos);
}

TEST(LoadgenTest, InvalidSpecsAreRejected) {
  LoadSpec spec = SmallAttend(LoadMode::kClosed);
  spec.concurrency = {};
  EXPECT_EQ(ValidateLoadSpec(spec).code(), absl::StatusCode::kInvalidArgument);
  spec = SmallAttend(LoadMode::kPoisson);
  spec.rates = {10, -1};
  EXPECT_EQ(ValidateLoadSpec(spec).code(), absl::StatusCode::kInvalidArgument);
  spec = SmallAttend(LoadMode::kClosed);
  spec.max_windows = 2;
  EXPECT_EQ(ValidateLoadSpec(spec).code(), absl::StatusCode::kInvalidArgument);
  spec = SmallAttend(LoadMode::kClosed);
  spec.attend.head_dim = 15;
  EXPECT_EQ(ValidateLoadSpec(spec).code(), absl::StatusCode::kInvalidArgument);
  spec = SmallDecode(LoadMode::kClosed);
  spec.decode.steps_per_session = 0;
  EXPECT_EQ(ValidateLoadSpec(spec).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseLoadMode("burst").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseWorkload("encode").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FormatCodes({{absl::StatusCode::kOk, 3}, {absl::StatusCode::kResourceExhausted, 2}}),
            "OK=3;RESOURCE_EXHAUSTED=2");
}

TEST(LoadgenTest, ProbeReportsTheServersStatus) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  auto client = ConnectTo(server->port());
  ASSERT_NE(client, nullptr);
  LoadSpec spec = SmallAttend(LoadMode::kClosed);
  spec.attend.rope_type = "no_such_rule";  // valid for the client, rejected by the server
  EXPECT_EQ(RunLoad(*client, spec).status().code(), absl::StatusCode::kInvalidArgument);
}

// --- `ropeattn bench` end to end. ---

struct CliRun {
  int exit_code = -1;
  std::string out, err;
};

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// `env`: "NAME=value ..." set for the child.
CliRun RunCli(const std::string& args, const std::string& env = "") {
  // Names of this process's own: ctest runs other tests' processes at the
  // same time, and a shared file let one test read another's output.
  const std::string dir = ::testing::TempDir();
  const std::string tag = std::to_string(getpid());
  const std::string out = dir + "/bench_stdout_" + tag + ".txt",
                    err = dir + "/bench_stderr_" + tag + ".txt";
  // No ROPEATTN_TOKEN from the runner's environment: tests set their own.
  const std::string command = absl::StrCat("env -u ROPEATTN_TOKEN ", env, " ", ROPEATTN_CLI_PATH,
                                           " bench ", args, " >", out, " 2>", err, " </dev/null");
  CliRun run;
  const int status = std::system(command.c_str());
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  run.out = ReadAll(out);
  run.err = ReadAll(err);
  return run;
}

// A minimal JSON checker: true when `text` is exactly one valid JSON value.
class JsonChecker {
 public:
  explicit JsonChecker(const std::string& text) : s_(text) {}
  bool Valid() {
    if (!Value()) return false;
    Space();
    return i_ == s_.size();
  }

 private:
  void Space() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  bool Literal(const char* word) {
    const std::string w(word);
    if (s_.compare(i_, w.size(), w) != 0) return false;
    i_ += w.size();
    return true;
  }
  bool String() {
    if (s_[i_] != '"') return false;
    for (++i_; i_ < s_.size(); ++i_) {
      if (s_[i_] == '\\') {
        ++i_;
      } else if (s_[i_] == '"') {
        ++i_;
        return true;
      }
    }
    return false;
  }
  bool Number() {
    const size_t start = i_;
    while (i_ < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[i_])) ||
                              std::string("+-.eE").find(s_[i_]) != std::string::npos)) {
      ++i_;
    }
    double unused;
    return i_ > start && absl::SimpleAtod(s_.substr(start, i_ - start), &unused);
  }
  bool Value() {
    Space();
    if (i_ >= s_.size()) return false;
    const char c = s_[i_];
    if (c == '{' || c == '[') {
      const char close = c == '{' ? '}' : ']';
      ++i_;
      Space();
      if (i_ < s_.size() && s_[i_] == close) return ++i_, true;
      while (true) {
        if (c == '{') {
          Space();
          if (i_ >= s_.size() || !String()) return false;
          Space();
          if (i_ >= s_.size() || s_[i_++] != ':') return false;
        }
        if (!Value()) return false;
        Space();
        if (i_ >= s_.size()) return false;
        if (s_[i_] == ',') {
          ++i_;
          continue;
        }
        return s_[i_++] == close;
      }
    }
    if (c == '"') return String();
    if (c == 't') return Literal("true");
    if (c == 'f') return Literal("false");
    if (c == 'n') return Literal("null");
    return Number();
  }
  const std::string& s_;
  size_t i_ = 0;
};

TEST(BenchCliTest, WritesCsvJsonAndSvg) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  const std::string dir = ::testing::TempDir();
  const std::string csv = dir + "/bench.csv", json = dir + "/bench.json", svg = dir + "/bench.svg";
  std::remove(csv.c_str());
  std::remove(json.c_str());
  std::remove(svg.c_str());
  CliRun run = RunCli(absl::StrCat(
      "--target=127.0.0.1:", server->port(),
      " --workload attend --mode closed --concurrency 1,2 --window_seconds 0.3"
      " --warmup_seconds 0.1 --max_windows 3 --heads 2 --kv_heads 1 --head_dim 16 --q_len 4"
      " --k_len 32 --causal --csv ",
      csv, " --json ", json, " --plot ", svg));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.err, "");  // stderr is not a terminal: no progress line
  EXPECT_NE(run.out.find("p99 ms"), std::string::npos) << run.out;

  // CSV: the documented header, one row per concurrency, sane numbers.
  std::vector<std::string> lines = absl::StrSplit(ReadAll(csv), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << ReadAll(csv);
  const std::vector<std::string> header = absl::StrSplit(lines[0], ',');
  EXPECT_EQ(lines[0],
            "mode,workload,concurrency,offered_rps,throughput_rps,tokens_per_s,p50_ms,p90_ms,"
            "p95_ms,p99_ms,p999_ms,mean_ms,max_ms,requests,ok,errors,late,codes,windows,stable");
  for (int row = 1; row <= 2; ++row) {
    const std::vector<std::string> fields = absl::StrSplit(lines[row], ',');
    ASSERT_EQ(fields.size(), header.size()) << lines[row];
    auto num = [&](const std::string& column) {
      const size_t i = std::find(header.begin(), header.end(), column) - header.begin();
      double value = -1;
      EXPECT_TRUE(i < fields.size() && absl::SimpleAtod(fields[i], &value))
          << column << " in " << lines[row];
      return value;
    };
    EXPECT_EQ(fields[0], "closed");
    EXPECT_EQ(fields[1], "attend");
    EXPECT_EQ(num("concurrency"), row);
    EXPECT_EQ(num("offered_rps"), 0);
    EXPECT_GT(num("throughput_rps"), 0);
    EXPECT_NEAR(num("tokens_per_s"), 4 * num("throughput_rps"), 0.01 + 1e-3 * num("tokens_per_s"));
    EXPECT_GT(num("p50_ms"), 0);
    EXPECT_LE(num("p50_ms"), num("p90_ms"));
    EXPECT_LE(num("p90_ms"), num("p95_ms"));
    EXPECT_LE(num("p95_ms"), num("p99_ms"));
    EXPECT_LE(num("p99_ms"), num("p999_ms"));
    EXPECT_LE(num("p999_ms"), num("max_ms"));
    EXPECT_LE(num("mean_ms"), num("max_ms"));
    EXPECT_GT(num("requests"), 0);
    EXPECT_EQ(num("ok"), num("requests"));
    EXPECT_EQ(num("errors"), 0);
    EXPECT_EQ(num("late"), 0);
    EXPECT_EQ(fields[17], absl::StrCat("OK=", fields[14]));
    EXPECT_EQ(num("windows"), 3);
    EXPECT_TRUE(fields[19] == "0" || fields[19] == "1") << fields[19];
  }

  const std::string json_text = ReadAll(json);
  EXPECT_TRUE(JsonChecker(json_text).Valid()) << json_text;
  for (const char* key : {"\"points\"", "\"throughput_rps\"", "\"latency_ms\"", "\"p99\"",
                          "\"codes\"", "\"stable\"", "\"window_throughputs\""}) {
    EXPECT_NE(json_text.find(key), std::string::npos) << key;
  }

  const std::string svg_text = ReadAll(svg);
  EXPECT_EQ(svg_text.rfind("<svg", 0), 0u) << svg_text.substr(0, 100);
  EXPECT_NE(svg_text.find("</svg>"), std::string::npos);
  EXPECT_NE(svg_text.find("class=\"p50\""), std::string::npos);
  EXPECT_NE(svg_text.find("class=\"p99\""), std::string::npos);
  EXPECT_NE(svg_text.find("latency (ms)"), std::string::npos);
  EXPECT_NE(svg_text.find("achieved throughput"), std::string::npos);
}

TEST(BenchCliTest, DecodeOpenLoopRuns) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  const std::string csv = ::testing::TempDir() + "/bench_decode.csv";
  CliRun run =
      RunCli(absl::StrCat("--target=127.0.0.1:", server->port(),
                          " --workload=decode --mode=constant --rate=40 --window_seconds=0.25"
                          " --warmup_seconds=0.1 --max_windows=3 --heads=2 --head_dim=16"
                          " --steps_per_session=4 --context=8 --tokens_per_step=1"
                          " --kv_dtype=bf16 --csv=",
                          csv));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  std::vector<std::string> lines = absl::StrSplit(ReadAll(csv), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[1].rfind("constant,decode,0,40.000,", 0), 0u) << lines[1];
}

TEST(BenchCliTest, ErrorsAreOneLineWithTheStatusCode) {
  CliRun usage = RunCli("--mode burst");
  EXPECT_EQ(usage.exit_code, 64);
  EXPECT_EQ(std::count(usage.err.begin(), usage.err.end(), '\n'), 1) << usage.err;

  CliRun invalid = RunCli("--head_dim 15 --target 127.0.0.1:1");
  EXPECT_EQ(invalid.exit_code, 3) << invalid.err;  // INVALID_ARGUMENT, before connecting
  EXPECT_NE(invalid.err.find("INVALID_ARGUMENT"), std::string::npos) << invalid.err;

  CliRun unreachable = RunCli("--target 127.0.0.1:1 --window_seconds 0.1 --deadline_seconds 2");
  EXPECT_EQ(unreachable.exit_code, 14) << unreachable.err;  // UNAVAILABLE
  EXPECT_EQ(std::count(unreachable.err.begin(), unreachable.err.end(), '\n'), 1) << unreachable.err;

  CliRun help = RunCli("--help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("mode,workload,concurrency,offered_rps"), std::string::npos);
  EXPECT_NE(help.out.find("--window_seconds"), std::string::npos);
}

TEST(LoadgenTest, LayerModeAttendAndDecode) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  auto client = ConnectTo(server->port());
  ASSERT_NE(client, nullptr);
  {
    LoadSpec spec = SmallAttend(LoadMode::kClosed);
    spec.model = "demo";
    spec.layer = 1;
    spec.attend.heads = 3;  // not the model's (nor valid with kv_heads 2): unused
    spec.attend.kv_heads = 2;
    spec.attend.k_len = 1;  // self-attention: k_len is not used
    spec.attend.causal = true;
    spec.concurrency = {1};
    auto resolved = ResolveLayerMode(*client, spec);
    ASSERT_TRUE(resolved.ok()) << resolved.status();
    EXPECT_EQ(resolved->hidden_size, 128);
    auto results = RunLoad(*client, spec);
    ASSERT_TRUE(results.ok()) << results.status();
    ASSERT_EQ(results->size(), 1u);
    const PointResult& r = (*results)[0];
    CheckPoint(spec, r, spec.attend.batch * spec.attend.q_len);
    EXPECT_GT(r.ok, 0);
    EXPECT_EQ(r.errors, 0) << FormatCodes(r.codes);
  }
  {
    LoadSpec spec = SmallDecode(LoadMode::kClosed);
    spec.model = "demo";
    spec.layer = 0;
    spec.concurrency = {2};
    auto results = RunLoad(*client, spec);
    ASSERT_TRUE(results.ok()) << results.status();
    const PointResult& r = (*results)[0];
    CheckPoint(spec, r, spec.decode.tokens_per_step);
    EXPECT_GT(r.ok, 0);
    EXPECT_EQ(r.errors, 0) << FormatCodes(r.codes);
  }
  // The model and layer reach the server: an unknown model and a layer past
  // the model's are its errors.
  LoadSpec spec = SmallAttend(LoadMode::kClosed);
  spec.model = "no-such-model";
  EXPECT_EQ(RunLoad(*client, spec).status().code(), absl::StatusCode::kNotFound);
  spec.model = "demo";
  spec.layer = 2;
  EXPECT_EQ(ProbeWorkload(*client, spec).code(), absl::StatusCode::kOutOfRange);
  spec.workload = Workload::kDecode;
  EXPECT_EQ(ProbeWorkload(*client, spec).code(), absl::StatusCode::kOutOfRange);
  spec.layer = -1;
  EXPECT_EQ(ValidateLoadSpec(spec).code(), absl::StatusCode::kInvalidArgument);
}

TEST(BenchCliTest, LayerModeCountsOkRequests) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  const std::string csv = ::testing::TempDir() + "/bench_layer.csv";
  for (const char* workload : {"attend", "decode"}) {
    std::remove(csv.c_str());
    CliRun run = RunCli(absl::StrCat(
        "--target=127.0.0.1:", server->port(), " --model demo --layer 0 --workload ", workload,
        " --mode closed --concurrency 1 --window_seconds 0.3 --warmup_seconds 0.1 --max_windows 3"
        " --q_len 4 --causal --context 4 --steps_per_session 3 --csv ",
        csv));
    ASSERT_EQ(run.exit_code, 0) << workload << ": " << run.err;
    std::vector<std::string> lines = absl::StrSplit(ReadAll(csv), '\n', absl::SkipEmpty());
    ASSERT_EQ(lines.size(), 2u) << ReadAll(csv);
    const std::vector<std::string> row = absl::StrSplit(lines[1], ',');
    ASSERT_EQ(row.size(), 20u) << lines[1];
    EXPECT_EQ(row[1], workload);
    int64_t ok = 0, errors = -1;
    ASSERT_TRUE(absl::SimpleAtoi(row[14], &ok)) << lines[1];
    ASSERT_TRUE(absl::SimpleAtoi(row[15], &errors)) << lines[1];
    EXPECT_GT(ok, 0) << lines[1];
    EXPECT_EQ(errors, 0) << lines[1];
    EXPECT_EQ(row[17], absl::StrCat("OK=", ok)) << lines[1];
  }
  CliRun run = RunCli(absl::StrCat("--target=127.0.0.1:", server->port(),
                                   " --model demo --layer 7 --window_seconds 0.3"));
  EXPECT_EQ(run.exit_code, 11) << run.err;
  EXPECT_NE(run.err.find("ropeattn bench: OUT_OF_RANGE: "), std::string::npos) << run.err;
}

// --- Over TLS with a bearer token (docs/security.md). ---

// A server with TLS and a tokens file, and a client of it with `token`.
struct TlsSetup {
  testing::TlsMaterial material;
  std::unique_ptr<server::Server> server;
  std::unique_ptr<Client> client;
};

std::unique_ptr<TlsSetup> StartTls(const std::string& token) {
  auto setup = std::make_unique<TlsSetup>();
  absl::StatusOr<testing::TlsMaterial> m = testing::MakeTlsMaterial("ropeattn_loadgen_tls_");
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return nullptr;
  setup->material = *std::move(m);
  setup->server = testing::StartTestServer(
      testing::TlsServerOptions(setup->material, /*client_ca=*/false, /*tokens=*/true));
  if (setup->server == nullptr) return nullptr;
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", setup->server->port());
  options.tls_ca_file = setup->material.ca_file;
  options.token = token;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return nullptr;
  setup->client = *std::move(client);
  return setup;
}

TEST(LoadgenTest, ClosedLoopOverTlsWithATokenHasNoErrors) {
  std::unique_ptr<TlsSetup> tls = StartTls(testing::kAliceToken);
  ASSERT_NE(tls, nullptr);
  LoadSpec spec = SmallAttend(LoadMode::kClosed);
  spec.concurrency = {1, 2};
  auto results = RunLoad(*tls->client, spec);
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), 2u);
  for (const PointResult& r : *results) {
    CheckPoint(spec, r, spec.attend.batch * spec.attend.q_len);
    EXPECT_GT(r.ok, 0);
    EXPECT_EQ(r.errors, 0) << FormatCodes(r.codes);
  }
  // Decode sessions (streams) carry the token too.
  spec = SmallDecode(LoadMode::kClosed);
  spec.concurrency = {2};
  results = RunLoad(*tls->client, spec);
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), 1u);
  EXPECT_GT((*results)[0].ok, 0);
  EXPECT_EQ((*results)[0].errors, 0) << FormatCodes((*results)[0].codes);
}

TEST(LoadgenTest, AnUnknownTokenFailsTheProbe) {
  std::unique_ptr<TlsSetup> tls = StartTls(testing::kUnknownToken);
  ASSERT_NE(tls, nullptr);
  auto results = RunLoad(*tls->client, SmallAttend(LoadMode::kClosed));
  EXPECT_EQ(results.status().code(), absl::StatusCode::kUnauthenticated) << results.status();
  EXPECT_THAT(results.status().ToString(),
              ::testing::Not(::testing::HasSubstr(testing::kUnknownToken)));
}

TEST(BenchCliTest, OverTlsWithTheTokenFromTheEnvironment) {
  std::unique_ptr<TlsSetup> tls = StartTls(testing::kAliceToken);
  ASSERT_NE(tls, nullptr);
  const std::string csv = ::testing::TempDir() + "/bench_tls.csv";
  std::remove(csv.c_str());
  const std::string flags = absl::StrCat(
      "--target=127.0.0.1:", tls->server->port(), " --tls_ca_file=", tls->material.ca_file,
      " --workload attend --mode closed --concurrency 1,2 --window_seconds 0.25"
      " --warmup_seconds 0.1 --max_windows 3 --heads 2 --kv_heads 1 --head_dim 16 --q_len 4"
      " --k_len 32 --csv ",
      csv);
  CliRun run = RunCli(flags, absl::StrCat("ROPEATTN_TOKEN=", testing::kAliceToken));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  std::vector<std::string> lines = absl::StrSplit(ReadAll(csv), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << ReadAll(csv);
  for (int row = 1; row <= 2; ++row) {
    const std::vector<std::string> fields = absl::StrSplit(lines[row], ',');
    ASSERT_EQ(fields.size(), 20u) << lines[row];
    EXPECT_NE(fields[14], "0") << lines[row];  // ok
    EXPECT_EQ(fields[15], "0") << lines[row];  // errors
  }
  EXPECT_EQ(run.out.find(testing::kAliceToken), std::string::npos);

  // No token: the probe is refused before any measurement.
  run = RunCli(flags);
  EXPECT_EQ(run.exit_code, 16) << run.err;
  EXPECT_NE(run.err.find("UNAUTHENTICATED"), std::string::npos) << run.err;
}

}  // namespace
}  // namespace ropeattn::client
