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
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "client/metrics_scrape.h"
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
  // Samples: only for the failing codes of the point, up to 3 distinct each.
  ASSERT_TRUE(r.error_samples.count(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(r.error_samples.count(absl::StatusCode::kOk), 0u);
  for (const auto& [code, messages] : r.error_samples) {
    EXPECT_TRUE(r.codes.count(code)) << absl::StatusCodeToString(code);
    EXPECT_GE(messages.size(), 1u);
    EXPECT_LE(messages.size(), 3u);
    EXPECT_EQ(std::set<std::string>(messages.begin(), messages.end()).size(), messages.size());
    for (const std::string& m : messages) EXPECT_FALSE(m.empty());
  }
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

// The documented CSV header (bench_command.cc, README).
constexpr char kCsvHeader[] =
    "mode,workload,concurrency,offered_rps,throughput_rps,tokens_per_s,p50_ms,p90_ms,p95_ms,"
    "p99_ms,p999_ms,mean_ms,max_ms,requests,ok,errors,late,codes,windows,stable,"
    "model,layer,hidden_size,batch,heads,kv_heads,head_dim,q_len,k_len,dtype,causal,rope,"
    "rope_factor,rope_original_max_positions,context,steps_per_session,tokens_per_step,kv_dtype,"
    "think_ms,step_rate,connections,max_outstanding,"
    "prefill_ok,prefill_p50_ms,prefill_p90_ms,prefill_p99_ms,prefill_mean_ms,step_ok,step_p50_ms,"
    "step_p90_ms,step_p99_ms,step_mean_ms,server_method,server_requests,queue_mean_ms,"
    "queue_p50_ms,queue_p99_ms,compute_mean_ms,compute_p50_ms,compute_p99_ms,search,"
    "error_samples";
constexpr size_t kCsvColumns = 62;

// One CSV line's fields (RFC 4180 quoting).
std::vector<std::string> SplitCsv(const std::string& line) {
  std::vector<std::string> fields(1);
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') {
        fields.back() += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        fields.back() += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields.emplace_back();
    } else {
      fields.back() += c;
    }
  }
  return fields;
}

// A CSV file as rows of column -> value (the first line is the header).
std::vector<std::map<std::string, std::string>> CsvRows(const std::string& text) {
  std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  std::vector<std::map<std::string, std::string>> rows;
  if (lines.empty()) return rows;
  const std::vector<std::string> header = SplitCsv(lines[0]);
  for (size_t i = 1; i < lines.size(); ++i) {
    const std::vector<std::string> fields = SplitCsv(lines[i]);
    EXPECT_EQ(fields.size(), header.size()) << lines[i];
    std::map<std::string, std::string> row;
    for (size_t j = 0; j < header.size() && j < fields.size(); ++j) row[header[j]] = fields[j];
    rows.push_back(std::move(row));
  }
  return rows;
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
  std::remove(out.c_str());
  std::remove(err.c_str());
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
      " --k_len 32 --causal --rope --csv ",
      csv, " --json ", json, " --plot ", svg));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.err, "");  // stderr is not a terminal: no progress line
  EXPECT_NE(run.out.find("p99 ms"), std::string::npos) << run.out;

  // CSV: the documented header, one row per concurrency, sane numbers.
  std::vector<std::string> lines = absl::StrSplit(ReadAll(csv), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << ReadAll(csv);
  const std::vector<std::string> header = absl::StrSplit(lines[0], ',');
  EXPECT_EQ(lines[0], kCsvHeader);
  for (int row = 1; row <= 2; ++row) {
    const std::vector<std::string> fields = SplitCsv(lines[row]);
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
    // The workload, in the row itself; decode-only columns empty.
    EXPECT_EQ(num("batch"), 1);
    EXPECT_EQ(num("heads"), 2);
    EXPECT_EQ(num("kv_heads"), 1);
    EXPECT_EQ(num("head_dim"), 16);
    EXPECT_EQ(num("q_len"), 4);
    EXPECT_EQ(num("k_len"), 32);
    EXPECT_EQ(num("causal"), 1);
    EXPECT_EQ(num("connections"), 1);
    auto text = [&](const std::string& column) {
      const size_t i = std::find(header.begin(), header.end(), column) - header.begin();
      return i < fields.size() ? fields[i] : "<missing>";
    };
    EXPECT_EQ(text("dtype"), "f32");
    EXPECT_EQ(text("rope"), "default");
    EXPECT_EQ(text("model"), "");
    EXPECT_EQ(text("context"), "");
    EXPECT_EQ(text("prefill_ok"), "");
    EXPECT_EQ(text("server_method"), "");  // no --metrics_url
    EXPECT_EQ(text("max_outstanding"), "");  // closed loop
  }

  const std::string json_text = ReadAll(json);
  EXPECT_TRUE(JsonChecker(json_text).Valid()) << json_text;
  for (const char* key :
       {"\"points\"", "\"throughput_rps\"", "\"latency_ms\"", "\"p99\"", "\"codes\"",
        "\"stable\"", "\"window_throughputs\"", "\"connections\": 1",
        "\"workload\": {\"mode\": \"closed\", \"workload\": \"attend\", \"concurrency\": 2, "
        "\"batch\": 1, \"heads\": 2, \"kv_heads\": 1, \"head_dim\": 16, \"q_len\": 4, "
        "\"k_len\": 32, \"dtype\": \"f32\", \"causal\": 1, \"rope\": \"default\", "
        "\"connections\": 1}"}) {
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
  // Every cache dtype the server has, int8 included (it was refused here).
  for (const std::string kv : {"bf16", "int8"}) {
    const std::string csv = ::testing::TempDir() + "/bench_decode_" + kv + ".csv";
    CliRun run =
        RunCli(absl::StrCat("--target=127.0.0.1:", server->port(),
                            " --workload=decode --mode=constant --rate=40 --window_seconds=0.25"
                            " --warmup_seconds=0.1 --max_windows=3 --heads=2 --head_dim=16"
                            " --steps_per_session=4 --context=8 --tokens_per_step=1"
                            " --kv_dtype=",
                            kv, " --csv=", csv));
    ASSERT_EQ(run.exit_code, 0) << kv << ": " << run.err;
    std::vector<std::string> lines = absl::StrSplit(ReadAll(csv), '\n', absl::SkipEmpty());
    ASSERT_EQ(lines.size(), 2u);
    EXPECT_EQ(lines[1].rfind("constant,decode,0,40.000,", 0), 0u) << lines[1];
    EXPECT_NE(lines[1].find("," + kv + ","), std::string::npos) << lines[1];
  }
}

TEST(BenchCliTest, ErrorsAreOneLineWithTheStatusCode) {
  CliRun usage = RunCli("--mode burst");
  EXPECT_EQ(usage.exit_code, 64);
  EXPECT_EQ(std::count(usage.err.begin(), usage.err.end(), '\n'), 1) << usage.err;

  // A flag the mode does not read, or a list with an empty element: usage
  // errors, not silently ignored.
  for (const char* args : {"--mode closed --rate 5", "--mode poisson --concurrency 2",
                           "--mode poisson --rate 5,,6", "--mode closed --concurrency 1,,2",
                           "--mode closed --max_outstanding 8", "--search_max 9",
                           "--search_resolution 0.1", "--search_max_points 3"}) {
    CliRun misuse = RunCli(absl::StrCat(args, " --target 127.0.0.1:1"));
    EXPECT_EQ(misuse.exit_code, 64) << args << ": " << misuse.err;
  }
  // A flag the workload does not read, likewise (an Attend load with
  // --kv_dtype int8 ran f32 and exited 0), naming the flag and the workload.
  for (const auto& [args, says] : std::vector<std::pair<std::string, std::string>>{
           {"--workload attend --kv_dtype int8", "--kv_dtype is not read by the attend workload"},
           {"--workload attend --steps_per_session 4", "--steps_per_session is not read by the "
                                                       "attend workload"},
           {"--workload attend --context 64", "--context is not read by the attend workload"},
           {"--workload attend --step_rate 5", "--step_rate is not read by the attend workload"},
           {"--workload decode --q_len 7", "--q_len is not read by the decode workload"},
           {"--workload decode --k_len 9", "--k_len is not read by the decode workload"},
           {"--workload decode --batch 3", "--batch is not read by the decode workload"},
           {"--workload decode --causal", "--causal is not read by the decode workload"},
           {"--model demo --layer 0 --heads 4", "--heads is not read by the attend workload in "
                                                "layer mode"},
           {"--model demo --workload decode --rope", "--rope is not read by the decode workload "
                                                     "in layer mode"},
           {"--layer 1", "--layer is read only with --model"}}) {
    CliRun misuse = RunCli(absl::StrCat(args, " --concurrency 1 --target 127.0.0.1:1"));
    EXPECT_EQ(misuse.exit_code, 64) << args << ": " << misuse.err;
    EXPECT_NE(misuse.err.find(absl::StrCat("ropeattn bench: USAGE: ", says)), std::string::npos)
        << args << ": " << misuse.err;
  }
  // The flags each workload reads are not refused (the target is unreachable).
  for (const char* args :
       {"--workload attend --batch 2 --q_len 4 --k_len 8 --causal --kv_heads 1 --heads 2 "
        "--head_dim 8 --rope_type yarn --rope_factor 2 --dtype bf16 --seed 3",
        "--workload decode --steps_per_session 2 --context 4 --tokens_per_step 1 --think_ms 1 "
        "--kv_dtype int8 --heads 2 --kv_heads 1 --head_dim 8 --rope --rope_type default "
        "--dtype bf16 --seed 3",
        "--latency_threshold 50 --search_max 9 --search_resolution 0.1 --search_max_points 3"}) {
    CliRun run = RunCli(absl::StrCat(args, " --concurrency 1 --window_seconds 0.1 "
                                           "--deadline_seconds 2 --target 127.0.0.1:1"));
    EXPECT_EQ(run.exit_code, 14) << args << ": " << run.err;  // UNAVAILABLE
  }

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
        " --mode closed --concurrency 1 --window_seconds 0.3 --warmup_seconds 0.1 --max_windows 3",
        workload == std::string("attend") ? " --q_len 4 --causal"
                                          : " --context 4 --steps_per_session 3",
        " --csv ", csv));
    ASSERT_EQ(run.exit_code, 0) << workload << ": " << run.err;
    std::vector<std::string> lines = absl::StrSplit(ReadAll(csv), '\n', absl::SkipEmpty());
    ASSERT_EQ(lines.size(), 2u) << ReadAll(csv);
    const std::vector<std::string> row = SplitCsv(lines[1]);
    ASSERT_EQ(row.size(), kCsvColumns) << lines[1];
    EXPECT_EQ(row[1], workload);
    int64_t ok = 0, errors = -1;
    ASSERT_TRUE(absl::SimpleAtoi(row[14], &ok)) << lines[1];
    ASSERT_TRUE(absl::SimpleAtoi(row[15], &errors)) << lines[1];
    EXPECT_GT(ok, 0) << lines[1];
    EXPECT_EQ(errors, 0) << lines[1];
    EXPECT_EQ(row[17], absl::StrCat("OK=", ok)) << lines[1];
    std::map<std::string, std::string> fields = CsvRows(ReadAll(csv))[0];
    EXPECT_EQ(fields["model"], "demo");
    EXPECT_EQ(fields["layer"], "0");
    EXPECT_EQ(fields["hidden_size"], "128");
    EXPECT_EQ(fields["heads"], "");  // the model's
    EXPECT_EQ(fields["q_len"], workload == std::string("attend") ? "4" : "");
    EXPECT_EQ(fields["context"], workload == std::string("attend") ? "" : "4");
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
    const std::vector<std::string> fields = SplitCsv(lines[row]);
    ASSERT_EQ(fields.size(), kCsvColumns) << lines[row];
    EXPECT_NE(fields[14], "0") << lines[row];  // ok
    EXPECT_EQ(fields[15], "0") << lines[row];  // errors
  }
  EXPECT_EQ(run.out.find(testing::kAliceToken), std::string::npos);

  // No token: the probe is refused before any measurement.
  run = RunCli(flags);
  EXPECT_EQ(run.exit_code, 16) << run.err;
  EXPECT_NE(run.err.find("UNAUTHENTICATED"), std::string::npos) << run.err;
}


// --- Issue 15: workload in every row, per-request export, the threshold
// search, several connections, scheduled decode steps, prefill and step apart,
// server-side times, error samples. ---

std::string MetricsUrl(const server::Server& server) {
  return absl::StrCat("http://127.0.0.1:", server.metrics_port(), "/metrics");
}

// A counter or gauge without labels from the server's /metrics (-1 if absent).
double ScrapeValue(const server::Server& server, const std::string& name) {
  absl::StatusOr<std::string> body = HttpGet(MetricsUrl(server), absl::Seconds(5));
  EXPECT_TRUE(body.ok()) << body.status();
  if (!body.ok()) return -1;
  absl::StatusOr<std::vector<MetricSample>> samples = ParsePrometheusText(*body);
  EXPECT_TRUE(samples.ok()) << samples.status();
  if (!samples.ok()) return -1;
  for (const MetricSample& s : *samples) {
    if (s.name == name && s.labels.empty()) return s.value;
  }
  return -1;
}

std::vector<Client*> Pointers(const std::vector<std::unique_ptr<Client>>& owned) {
  std::vector<Client*> out;
  for (const auto& c : owned) out.push_back(c.get());
  return out;
}

TEST(MetricsScrapeTest, ParsesTheExpositionAndInterpolatesBuckets) {
  auto samples = ParsePrometheusText(
      "# HELP x_seconds help\n# TYPE x_seconds histogram\n"
      "x_seconds_bucket{method=\"A\",le=\"0.001\"} 5\n"
      "x_seconds_bucket{method=\"A\",le=\"0.01\"} 10\n"
      "x_seconds_bucket{method=\"A\",le=\"+Inf\"} 10\n"
      "x_seconds_sum{method=\"A\"} 0.05\nx_seconds_count{method=\"A\"} 10\n"
      "x_seconds_bucket{method=\"B\",le=\"0.001\"} 7\nplain_total 3\n");
  ASSERT_TRUE(samples.ok()) << samples.status();
  ASSERT_EQ(samples->size(), 7u);
  EXPECT_EQ((*samples)[0].name, "x_seconds_bucket");
  EXPECT_EQ((*samples)[0].labels.at("method"), "A");
  EXPECT_EQ((*samples)[0].labels.at("le"), "0.001");
  EXPECT_EQ((*samples)[6].value, 3);
  // Growth from nothing: the whole histogram of method A (B is not mixed in).
  HistogramGrowth g = GrowthOf({}, *samples, "x_seconds", "method", "A");
  EXPECT_EQ(g.count, 10);
  EXPECT_NEAR(g.mean_ms, 5, 1e-9);
  EXPECT_NEAR(g.p50_ms, 1, 1e-9);                          // rank 5: top of the first bucket
  EXPECT_NEAR(g.p99_ms, 1 + 9 * (9.9 - 5) / 5, 1e-9);      // inside (1 ms, 10 ms]
  // Growth between two scrapes: only what was added.
  auto later = ParsePrometheusText(
      "x_seconds_bucket{method=\"A\",le=\"0.001\"} 5\n"
      "x_seconds_bucket{method=\"A\",le=\"0.01\"} 12\n"
      "x_seconds_bucket{method=\"A\",le=\"+Inf\"} 14\n"
      "x_seconds_sum{method=\"A\"} 20.07\nx_seconds_count{method=\"A\"} 14\n");
  ASSERT_TRUE(later.ok());
  g = GrowthOf(*samples, *later, "x_seconds", "method", "A");
  EXPECT_EQ(g.count, 4);
  EXPECT_NEAR(g.mean_ms, 20.02 / 4 * 1e3, 1e-6);
  EXPECT_NEAR(g.p50_ms, 10, 1e-9);   // rank 2 of 2 in (1, 10] ms
  EXPECT_NEAR(g.p99_ms, 10, 1e-9);   // in +Inf: the highest finite bound
  EXPECT_FALSE(ParsePrometheusText("x{le=\"1\" 3\n").ok());
  EXPECT_EQ(HttpGet("ftp://127.0.0.1:1/metrics", absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Every request lands in the export once, with its kind, times and code, and
// the export's counted lines are exactly the point's numbers.
void CheckRequestLog(const PointResult& r, int point_index) {
  SCOPED_TRACE(absl::StrCat("point ", point_index));
  int64_t counted = 0, counted_ok = 0, prefill_ok = 0, step_ok = 0, late = 0;
  std::map<absl::StatusCode, int64_t> codes;
  double step_max = 0, prefill_max = 0;
  for (const RequestRecord& q : r.request_log) {
    EXPECT_EQ(q.point, point_index);
    EXPECT_GE(q.sent_ms, q.scheduled_ms - 1e-3);
    EXPECT_GE(q.latency_ms, q.sent_ms - q.scheduled_ms - 1e-3);  // from the schedule
    EXPECT_GE(q.window, -1);
    EXPECT_LE(q.window, r.windows);
    EXPECT_EQ(q.counted, q.window > r.windows - std::min(r.windows, 3));
    if (r.workload == Workload::kAttend) {
      EXPECT_EQ(q.kind, RequestKind::kAttend);
      EXPECT_EQ(q.session_id, "");
    } else {
      EXPECT_NE(q.kind, RequestKind::kAttend);
      EXPECT_EQ(q.kind == RequestKind::kPrefill, q.step == 0);
      if (q.code == absl::StatusCode::kOk) EXPECT_FALSE(q.session_id.empty());
    }
    if (!q.counted) continue;
    ++counted;
    ++codes[q.code];
    late += q.late;
    if (q.code != absl::StatusCode::kOk) continue;
    ++counted_ok;
    if (q.kind == RequestKind::kPrefill) {
      ++prefill_ok;
      prefill_max = std::max(prefill_max, q.latency_ms);
    }
    if (q.kind == RequestKind::kStep) {
      ++step_ok;
      step_max = std::max(step_max, q.latency_ms);
    }
  }
  EXPECT_EQ(counted, r.requests);
  EXPECT_EQ(counted_ok, r.ok);
  EXPECT_EQ(codes, r.codes);
  EXPECT_EQ(late, r.late);
  EXPECT_EQ(prefill_ok, r.prefill_ok);
  EXPECT_EQ(step_ok, r.step_ok);
  EXPECT_NEAR(prefill_max, r.prefill_latency.max, 1e-6);
  EXPECT_NEAR(step_max, r.step_latency.max, 1e-6);
}

TEST(LoadgenTest, RequestLogHasEveryRequestAndMatchesThePoint) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  auto client = ConnectTo(server->port());
  ASSERT_NE(client, nullptr);
  LoadSpec spec = SmallAttend(LoadMode::kClosed);
  spec.concurrency = {1, 2};
  spec.max_windows = 3;
  spec.record_requests = true;
  auto results = RunLoad(*client, spec);
  ASSERT_TRUE(results.ok()) << results.status();
  for (int i = 0; i < 2; ++i) {
    const PointResult& r = (*results)[i];
    EXPECT_GT(r.request_log.size(), static_cast<size_t>(r.requests));  // the warm-up too
    CheckRequestLog(r, i);
    EXPECT_EQ(r.prefill_ok + r.step_ok, 0);
  }
  // Off by default: no log.
  spec.record_requests = false;
  spec.concurrency = {1};
  results = RunLoad(*client, spec);
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_TRUE((*results)[0].request_log.empty());
}

// Decode: prefill (first step) and the other steps are reported apart, and
// with a step rate each step is due on its session's schedule.
TEST(LoadgenTest, OpenLoopDecodeStepsAreScheduledAtTheStepRate) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  auto client = ConnectTo(server->port());
  ASSERT_NE(client, nullptr);
  LoadSpec spec = SmallDecode(LoadMode::kConstant);
  spec.decode.steps_per_session = 4;
  spec.decode.step_rate = 25;  // a step every 40 ms within a session
  spec.rates = {40};           // 10 sessions/s: one every 100 ms
  spec.max_windows = 3;
  spec.record_requests = true;
  auto results = RunLoad(*client, spec);
  ASSERT_TRUE(results.ok()) << results.status();
  const PointResult& r = (*results)[0];
  CheckPoint(spec, r, spec.decode.tokens_per_step);
  CheckRequestLog(r, 0);
  EXPECT_EQ(r.errors, 0) << FormatCodes(r.codes);
  EXPECT_GT(r.prefill_ok, 0);
  EXPECT_GT(r.step_ok, 0);
  EXPECT_EQ(r.prefill_ok + r.step_ok, r.ok);
  EXPECT_LE(r.prefill_latency.p50, r.prefill_latency.p99);
  EXPECT_LE(r.step_latency.p50, r.step_latency.p99);

  // Per session: step i is due exactly i / step_rate after the session's
  // arrival, and is not sent before it.
  std::map<std::string, std::vector<const RequestRecord*>> sessions;
  std::vector<double> arrivals;
  for (const RequestRecord& q : r.request_log) {
    sessions[q.session_id].push_back(&q);
    if (q.kind == RequestKind::kPrefill) arrivals.push_back(q.scheduled_ms);
  }
  int complete = 0;
  for (auto& [id, steps] : sessions) {
    ASSERT_FALSE(id.empty());
    std::sort(steps.begin(), steps.end(),
              [](const RequestRecord* a, const RequestRecord* b) { return a->step < b->step; });
    ASSERT_EQ(steps[0]->kind, RequestKind::kPrefill) << id;
    for (size_t i = 0; i < steps.size(); ++i) {
      EXPECT_EQ(steps[i]->step, static_cast<int64_t>(i)) << id;
      EXPECT_NEAR(steps[i]->scheduled_ms - steps[0]->scheduled_ms, 40.0 * i, 0.01) << id;
      EXPECT_GE(steps[i]->sent_ms, steps[i]->scheduled_ms - 1e-3) << id;
    }
    // The steps of a session span its schedule, not back to back: the last
    // goes out 120 ms after the session's arrival (measured from its
    // schedule, since the first may itself leave a little late).
    if (steps.size() == 4) {
      ++complete;
      EXPECT_GE(steps[3]->sent_ms - steps[0]->scheduled_ms, 120.0 - 1e-3) << id;
    }
  }
  EXPECT_GT(complete, 0);
  // Sessions arrive on the constant schedule: 100 ms apart.
  std::sort(arrivals.begin(), arrivals.end());
  ASSERT_GE(arrivals.size(), 3u);
  for (size_t i = 1; i < arrivals.size(); ++i) {
    EXPECT_NEAR(arrivals[i] - arrivals[i - 1], 100.0, 0.01);
  }

  // A step rate and a think time exclude each other.
  spec.decode.think_time = absl::Milliseconds(1);
  EXPECT_EQ(ValidateLoadSpec(spec).code(), absl::StatusCode::kInvalidArgument);
  spec.decode.think_time = absl::ZeroDuration();
  spec.decode.step_rate = -1;
  EXPECT_EQ(ValidateLoadSpec(spec).code(), absl::StatusCode::kInvalidArgument);
}

// Back to back (no step rate): each step is due when the previous answered.
TEST(LoadgenTest, ClosedLoopDecodeStepsRunBackToBackWithoutAStepRate) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  auto client = ConnectTo(server->port());
  ASSERT_NE(client, nullptr);
  LoadSpec spec = SmallDecode(LoadMode::kClosed);
  spec.concurrency = {2};
  spec.max_windows = 3;
  spec.record_requests = true;
  auto results = RunLoad(*client, spec);
  ASSERT_TRUE(results.ok()) << results.status();
  const PointResult& r = (*results)[0];
  CheckPoint(spec, r, spec.decode.tokens_per_step);
  CheckRequestLog(r, 0);
  EXPECT_GT(r.prefill_ok, 0);
  EXPECT_GT(r.step_ok, 0);
  EXPECT_EQ(r.prefill_ok + r.step_ok, r.ok);
  for (const RequestRecord& q : r.request_log) {
    if (q.kind == RequestKind::kStep) EXPECT_FALSE(q.late);
  }
}

TEST(LoadgenTest, ConnectionsAreDistinctTcpConnectionsUsedRoundRobin) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  const double before = ScrapeValue(*server, "ropeattn_connections_accepted_total");
  ASSERT_GE(before, 0);
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", server->port());
  auto owned = ConnectClients(options, 3);
  ASSERT_TRUE(owned.ok()) << owned.status();
  ASSERT_EQ(owned->size(), 3u);
  for (const LoadSpec& base : {SmallAttend(LoadMode::kClosed), SmallDecode(LoadMode::kClosed)}) {
    LoadSpec spec = base;
    spec.concurrency = {2};
    spec.max_windows = 3;
    spec.record_requests = true;
    auto results = RunLoad(Pointers(*owned), spec);
    ASSERT_TRUE(results.ok()) << results.status();
    const PointResult& r = (*results)[0];
    EXPECT_EQ(r.connections, 3);
    EXPECT_EQ(r.errors, 0) << FormatCodes(r.codes);
    std::map<int, int> per_connection;
    std::map<std::string, std::set<int>> session_connections;
    for (const RequestRecord& q : r.request_log) {
      ++per_connection[q.connection];
      if (!q.session_id.empty()) session_connections[q.session_id].insert(q.connection);
    }
    EXPECT_EQ(per_connection.size(), 3u);  // every connection carried requests
    for (const auto& [id, connections] : session_connections) {
      EXPECT_EQ(connections.size(), 1u) << id;  // a session stays on its stream
    }
  }
  EXPECT_EQ(ScrapeValue(*server, "ropeattn_connections_accepted_total") - before, 3);
  EXPECT_EQ(ConnectClients(options, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LoadgenTest, SearchFindsTheHighestConcurrencyUnderTheThreshold) {
  // One worker and one queue slot: concurrency 1 never fails, 8 always does
  // (RESOURCE_EXHAUSTED), so the answer lies in between whatever the speed.
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
  spec.warmup = absl::Milliseconds(50);
  spec.window = absl::Milliseconds(150);
  spec.max_windows = 3;
  SearchSpec search;
  search.latency_threshold_ms = 1e6;  // only errors fail a point here
  search.start = 1;
  search.max_level = 8;
  search.max_points = 6;
  Client* clients[] = {client.get()};
  auto found = SearchLoad(clients, spec, search);
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_EQ(found->points.size(), found->passed.size());
  ASSERT_GE(found->points.size(), 2u);
  EXPECT_LE(found->points.size(), 6u);
  // Doubling first: 1, 2, 4, ... up to the first failure.
  EXPECT_EQ(found->points[0].concurrency, 1);
  EXPECT_TRUE(found->passed[0]);
  EXPECT_TRUE(found->found);
  double lowest_failed = 0;
  for (size_t i = 0; i < found->points.size(); ++i) {
    const PointResult& p = found->points[i];
    EXPECT_EQ(found->passed[i], MeetsThreshold(p, search.latency_threshold_ms));
    EXPECT_EQ(found->passed[i], p.errors == 0 && p.ok > 0);
    EXPECT_GE(p.concurrency, 1);
    EXPECT_LE(p.concurrency, 8);
    if (found->passed[i]) {
      EXPECT_LE(p.concurrency, found->best);  // the answer is the highest pass
    } else {
      EXPECT_GT(p.concurrency, found->best);  // every failure lies above it
      if (lowest_failed == 0 || p.concurrency < lowest_failed) lowest_failed = p.concurrency;
    }
  }
  EXPECT_GT(lowest_failed, 0);
  EXPECT_EQ(found->lowest_failed, lowest_failed);
  EXPECT_TRUE(std::any_of(found->points.begin(), found->points.end(),
                          [&](const PointResult& p) { return p.concurrency == found->best; }));
  // Bisection ends at adjacent concurrencies unless it ran out of points.
  if (found->stopped == "resolution") {
    EXPECT_EQ(found->lowest_failed - found->best, 1);
  } else {
    EXPECT_EQ(found->stopped, "max_points");
    EXPECT_EQ(found->points.size(), 6u);
  }
}

TEST(LoadgenTest, SearchStopsAtTheCapOrAtAFailingStart) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  auto client = ConnectTo(server->port());
  ASSERT_NE(client, nullptr);
  Client* clients[] = {client.get()};
  LoadSpec spec = SmallAttend(LoadMode::kConstant);
  spec.warmup = absl::Milliseconds(50);
  spec.window = absl::Milliseconds(150);
  spec.max_windows = 3;
  SearchSpec search;
  search.latency_threshold_ms = 1e6;  // everything passes: doubling up to the cap
  search.start = 20;
  search.max_level = 50;
  auto found = SearchLoad(clients, spec, search);
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_EQ(found->points.size(), 3u);
  EXPECT_EQ(found->points[0].offered_rps, 20);
  EXPECT_EQ(found->points[1].offered_rps, 40);
  EXPECT_EQ(found->points[2].offered_rps, 50);
  EXPECT_TRUE(found->found);
  EXPECT_EQ(found->best, 50);
  EXPECT_EQ(found->stopped, "max_level");

  search.latency_threshold_ms = 1e-6;  // nothing passes
  found = SearchLoad(clients, spec, search);
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_EQ(found->points.size(), 1u);
  EXPECT_FALSE(found->found);
  EXPECT_EQ(found->best, 0);
  EXPECT_EQ(found->lowest_failed, 20);
  EXPECT_EQ(found->stopped, "first level failed");

  search.latency_threshold_ms = 0;
  EXPECT_EQ(SearchLoad(clients, spec, search).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LoadgenTest, ServerQueueAndComputeTimesComeFromTheMetrics) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  auto client = ConnectTo(server->port());
  ASSERT_NE(client, nullptr);
  for (const LoadSpec& base : {SmallAttend(LoadMode::kClosed), SmallDecode(LoadMode::kClosed)}) {
    LoadSpec spec = base;
    spec.concurrency = {2};
    spec.max_windows = 3;
    spec.metrics_url = MetricsUrl(*server);
    auto results = RunLoad(*client, spec);
    ASSERT_TRUE(results.ok()) << results.status();
    const PointResult& r = (*results)[0];
    EXPECT_EQ(r.server_error, "");
    std::set<std::string> methods;
    for (const ServerTime& t : r.server) {
      SCOPED_TRACE(t.method);
      methods.insert(t.method);
      EXPECT_GT(t.compute_count, 0);
      EXPECT_GT(t.compute_mean_ms, 0);
      EXPECT_GT(t.compute_p99_ms, 0);
      EXPECT_LE(t.compute_p50_ms, t.compute_p99_ms);
      EXPECT_LE(t.queue_p50_ms, t.queue_p99_ms);
      EXPECT_GE(t.queue_mean_ms, 0);
    }
    if (spec.workload == Workload::kAttend) {
      EXPECT_EQ(methods, std::set<std::string>{"Attend"});
      // Over the final windows, as the client's numbers: about as many.
      EXPECT_GT(r.server[0].compute_count, r.requests / 2);
      EXPECT_LT(r.server[0].compute_count, r.requests * 2 + 4);
    } else {
      EXPECT_EQ(methods.count("Decode.Step"), 1u);
      EXPECT_EQ(methods.count("Decode.Open"), 1u);
    }
  }
  // Without a URL: nothing scraped.
  auto plain = RunLoad(*client, SmallAttend(LoadMode::kClosed));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE((*plain)[0].server.empty());
  // A URL nothing answers on fails the run before measuring.
  LoadSpec spec = SmallAttend(LoadMode::kClosed);
  spec.metrics_url = "http://127.0.0.1:1/metrics";
  spec.scrape_timeout = absl::Seconds(2);
  EXPECT_EQ(RunLoad(*client, spec).status().code(), absl::StatusCode::kUnavailable);
}

TEST(LoadgenTest, ErrorMessagesAreSampledPerCode) {
  // Every request over the compute limit is refused with the same message:
  // one distinct sample. RunPoint does not probe, so the point runs.
  server::ServerOptions options = testing::TestServerOptions();
  options.max_request_compute = 1000;
  auto server = testing::StartTestServer(options);
  ASSERT_NE(server, nullptr);
  auto client = ConnectTo(server->port());
  ASSERT_NE(client, nullptr);
  LoadSpec spec = SmallAttend(LoadMode::kClosed);
  spec.max_windows = 3;
  auto point = RunPoint(*client, spec, 2);
  ASSERT_TRUE(point.ok()) << point.status();
  EXPECT_EQ(point->ok, 0);
  EXPECT_GT(point->errors, 0);
  ASSERT_EQ(point->error_samples.size(), 1u) << FormatCodes(point->codes);
  const auto& [code, messages] = *point->error_samples.begin();
  EXPECT_EQ(code, absl::StatusCode::kResourceExhausted);
  EXPECT_GT(point->codes.at(code), 1);
  ASSERT_EQ(messages.size(), 1u);  // identical messages are kept once
  EXPECT_FALSE(messages[0].empty());
  EXPECT_EQ(RunLoad(*client, spec).status().message(), messages[0]);  // the server's own words
}


// --- `ropeattn bench`: the issue-15 flags end to end. ---

// The value of `column` in a CSV row as a number (fails the test otherwise).
double Num(const std::map<std::string, std::string>& row, const std::string& column) {
  double value = -1;
  auto it = row.find(column);
  EXPECT_TRUE(it != row.end() && absl::SimpleAtod(it->second, &value)) << column;
  return value;
}

TEST(BenchCliTest, HelpListsEveryNewFlag) {
  CliRun help = RunCli("--help");
  ASSERT_EQ(help.exit_code, 0) << help.err;
  for (const char* flag : {"--connections", "--requests_out", "--latency_threshold",
                           "--search_max_points", "--search_max", "--search_resolution",
                           "--step_rate", "--metrics_url"}) {
    EXPECT_NE(help.out.find(flag), std::string::npos) << flag;
  }
  EXPECT_NE(help.out.find(kCsvHeader), std::string::npos);
  EXPECT_NE(help.out.find("point,kind,session_id,step,connection,scheduled_ms,sent_ms,"
                          "latency_ms,code,late,window,counted"),
            std::string::npos);
}

TEST(BenchCliTest, DecodeWithStepRateConnectionsMetricsAndRequestExport) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  const double accepted = ScrapeValue(*server, "ropeattn_connections_accepted_total");
  const std::string dir = ::testing::TempDir();
  const std::string csv = dir + "/bench_new.csv", json = dir + "/bench_new.json",
                    requests = dir + "/bench_requests.jsonl";
  for (const std::string& f : {csv, json, requests}) std::remove(f.c_str());
  CliRun run = RunCli(absl::StrCat(
      "--target=127.0.0.1:", server->port(),
      " --workload=decode --mode=constant --rate=40 --step_rate=25 --steps_per_session=4"
      " --context=8 --tokens_per_step=1 --heads=2 --kv_heads=1 --head_dim=16 --kv_dtype=bf16"
      " --rope --window_seconds=0.25 --warmup_seconds=0.1 --max_windows=3 --connections=2"
      " --metrics_url=",
      MetricsUrl(*server), " --csv=", csv, " --json=", json, " --requests_out=", requests));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("prefill (first step):"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("server Decode.Step"), std::string::npos) << run.out;
  // Two connections, and no other (the Client made from the flags is not dialed).
  EXPECT_EQ(ScrapeValue(*server, "ropeattn_connections_accepted_total") - accepted, 2);

  // The row alone says what ran.
  std::vector<std::map<std::string, std::string>> rows = CsvRows(ReadAll(csv));
  ASSERT_EQ(rows.size(), 1u);
  std::map<std::string, std::string>& row = rows[0];
  const std::map<std::string, std::string> expected = {
      {"mode", "constant"}, {"workload", "decode"},   {"offered_rps", "40.000"},
      {"model", ""},        {"batch", "1"},           {"heads", "2"},
      {"kv_heads", "1"},    {"head_dim", "16"},       {"q_len", ""},
      {"k_len", ""},        {"dtype", "f32"},         {"causal", "1"},
      {"rope", "default"},  {"context", "8"},         {"steps_per_session", "4"},
      {"tokens_per_step", "1"}, {"kv_dtype", "bf16"}, {"think_ms", "0"},
      {"step_rate", "25"},  {"connections", "2"},     {"max_outstanding", "64"},
      {"server_method", "Decode.Step"}, {"search", ""}, {"error_samples", ""}};
  for (const auto& [column, value] : expected) EXPECT_EQ(row[column], value) << column;
  EXPECT_GT(Num(row, "prefill_ok"), 0);
  EXPECT_GT(Num(row, "step_ok"), 0);
  EXPECT_EQ(Num(row, "prefill_ok") + Num(row, "step_ok"), Num(row, "ok"));
  EXPECT_LE(Num(row, "step_p50_ms"), Num(row, "step_p99_ms"));
  EXPECT_GT(Num(row, "server_requests"), 0);
  EXPECT_GT(Num(row, "compute_mean_ms"), 0);
  EXPECT_LE(Num(row, "queue_p50_ms"), Num(row, "queue_p99_ms"));

  // JSON lines: one per request; the counted ones are the row's requests.
  std::vector<std::string> lines = absl::StrSplit(ReadAll(requests), '\n', absl::SkipEmpty());
  ASSERT_GT(lines.size(), 0u);
  int64_t counted = 0, prefill = 0, step = 0;
  std::set<std::string> connections;
  for (const std::string& line : lines) {
    ASSERT_TRUE(JsonChecker(line).Valid()) << line;
    for (const char* key : {"\"point\": 0", "\"session_id\": \"", "\"scheduled_ms\": ",
                            "\"sent_ms\": ", "\"latency_ms\": ", "\"code\": \"OK\""}) {
      EXPECT_NE(line.find(key), std::string::npos) << key << " in " << line;
    }
    counted += line.find("\"counted\": true") != std::string::npos;
    prefill += line.find("\"kind\": \"prefill\"") != std::string::npos;
    step += line.find("\"kind\": \"step\"") != std::string::npos;
    const size_t c = line.find("\"connection\": ");
    if (c != std::string::npos) connections.insert(line.substr(c + 14, 1));
  }
  EXPECT_EQ(counted, Num(row, "requests"));
  EXPECT_EQ(prefill + step, static_cast<int64_t>(lines.size()));
  EXPECT_GT(prefill, 0);
  EXPECT_GT(step, 0);
  EXPECT_EQ(connections, (std::set<std::string>{"0", "1"}));

  const std::string json_text = ReadAll(json);
  EXPECT_TRUE(JsonChecker(json_text).Valid()) << json_text;
  for (const char* key :
       {"\"workload\": {\"mode\": \"constant\", \"workload\": \"decode\", \"offered_rps\": 40, "
        "\"batch\": 1, \"heads\": 2, \"kv_heads\": 1, \"head_dim\": 16, \"dtype\": \"f32\", "
        "\"causal\": 1, \"rope\": \"default\", \"context\": 8, \"steps_per_session\": 4, "
        "\"tokens_per_step\": 1, \"kv_dtype\": \"bf16\", \"think_ms\": 0, \"step_rate\": 25, "
        "\"connections\": 2, \"max_outstanding\": 64}",
        "\"prefill_latency_ms\": {\"p50\": ", "\"step_latency_ms\": {\"p50\": ",
        "\"server\": [{\"method\": \"Decode.Open\"", "{\"method\": \"Decode.Step\", \"queue\": "
        "{\"count\": ", "\"compute\": {\"count\": ", "\"error_samples\": {}",
        "\"metrics_url\": "}) {
    EXPECT_NE(json_text.find(key), std::string::npos) << key << "\n" << json_text;
  }
}

TEST(BenchCliTest, LatencyThresholdSearchReportsEveryPointAndTheAnswer) {
  auto server = testing::StartTestServer(testing::TestServerOptions());
  ASSERT_NE(server, nullptr);
  const std::string dir = ::testing::TempDir();
  const std::string csv = dir + "/bench_search.csv", json = dir + "/bench_search.json",
                    requests = dir + "/bench_search_requests.csv";
  for (const std::string& f : {csv, json, requests}) std::remove(f.c_str());
  const std::string flags = absl::StrCat(
      "--target=127.0.0.1:", server->port(),
      " --workload attend --mode closed --concurrency 1 --search_max 3 --window_seconds 0.15"
      " --warmup_seconds 0.05 --max_windows 3 --heads 2 --kv_heads 1 --head_dim 16 --q_len 4"
      " --k_len 32 --rope_type yarn --rope_factor 4 --csv ",
      csv, " --json ", json, " --requests_out ", requests);
  // Every level passes a huge threshold: 1, 2, then the cap 3.
  CliRun run = RunCli(flags + " --latency_threshold 1e6");
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("highest passing concurrency 3 (3 points, stopped: max_level)"),
            std::string::npos)
      << run.out;
  std::vector<std::map<std::string, std::string>> rows = CsvRows(ReadAll(csv));
  ASSERT_EQ(rows.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(Num(rows[i], "concurrency"), i + 1);
    EXPECT_EQ(rows[i]["search"], "pass");
    EXPECT_EQ(rows[i]["rope"], "yarn");
    EXPECT_EQ(rows[i]["rope_factor"], "4");
    EXPECT_EQ(rows[i]["rope_original_max_positions"], "16");  // k_len / 2, as sent
    EXPECT_EQ(rows[i]["k_len"], "32");
    EXPECT_EQ(rows[i]["context"], "");
  }
  const std::string json_text = ReadAll(json);
  EXPECT_TRUE(JsonChecker(json_text).Valid()) << json_text;
  EXPECT_NE(json_text.find("\"search\": {\"latency_threshold_ms\": 1e+06, \"start\": 1, "
                           "\"max_level\": 3, \"max_points\": 10, \"resolution\": 0.05, "
                           "\"found\": true, \"best\": 3, \"lowest_failed\": 0, "
                           "\"stopped\": \"max_level\"}"),
            std::string::npos)
      << json_text;
  // The CSV export has the requests of every probed point.
  std::vector<std::map<std::string, std::string>> lines = CsvRows(ReadAll(requests));
  std::map<std::string, int64_t> counted;
  for (auto& line : lines) {
    EXPECT_EQ(line["kind"], "attend");
    EXPECT_EQ(line["session_id"], "");
    counted[line["point"]] += line["counted"] == "1";
  }
  ASSERT_EQ(counted.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(counted[absl::StrCat(i)], Num(rows[i], "requests"));

  // Nothing passes a tiny threshold: one point, no answer.
  run = RunCli(flags + " --latency_threshold 1e-6");
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("no concurrency passed, lowest failing 1 (1 points, stopped: first "
                         "level failed)"),
            std::string::npos)
      << run.out;
  rows = CsvRows(ReadAll(csv));
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0]["search"], "fail");
}

TEST(BenchCliTest, ErrorSamplesAppearInTheTableCsvAndJson) {
  server::ServerOptions options = testing::TestServerOptions();
  options.compute_workers = 1;
  options.queue_depth = 1;
  auto server = testing::StartTestServer(options);
  ASSERT_NE(server, nullptr);
  const std::string dir = ::testing::TempDir();
  const std::string csv = dir + "/bench_errors.csv", json = dir + "/bench_errors.json";
  CliRun run = RunCli(absl::StrCat(
      "--target=127.0.0.1:", server->port(),
      " --workload attend --mode closed --concurrency 8 --window_seconds 0.25"
      " --warmup_seconds 0.1 --max_windows 3 --heads 8 --head_dim 64 --q_len 64 --k_len 512"
      " --csv ",
      csv, " --json ", json));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("         RESOURCE_EXHAUSTED: "), std::string::npos) << run.out;
  std::vector<std::map<std::string, std::string>> rows = CsvRows(ReadAll(csv));
  ASSERT_EQ(rows.size(), 1u);
  // No RoPE flag: no positional scheme, as in the API.
  EXPECT_EQ(rows[0]["rope"], "none");
  EXPECT_EQ(rows[0]["error_samples"].rfind("RESOURCE_EXHAUSTED: ", 0), 0u)
      << rows[0]["error_samples"];
  const std::string json_text = ReadAll(json);
  EXPECT_TRUE(JsonChecker(json_text).Valid()) << json_text;
  EXPECT_NE(json_text.find("\"error_samples\": {\"RESOURCE_EXHAUSTED\": [\""), std::string::npos)
      << json_text;
}

}  // namespace
}  // namespace ropeattn::client
