// Metrics registry and its HTTP endpoint. The exposition is checked by a
// small parser of the Prometheus text format 0.0.4 (grammar, grouping,
// HELP/TYPE order, histogram invariants), so a formatting regression fails
// here rather than in a Prometheus scrape. The HTTP tests use a plain POSIX
// socket client on 127.0.0.1 with port 0.
#include "server/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/executor.h"
#include "server/server.h"
#include "tests/core/test_util.h"
#include "tests/server/server_test_util.h"

namespace ropeattn::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// ---------------------------------------------------------------------------
// Parser-lite for the text exposition format.

using Labels = std::map<std::string, std::string>;

struct Sample {
  std::string name;
  Labels labels;
  double value = 0;
};

struct Family {
  std::string help;
  std::string type;
  std::vector<Sample> samples;
};

struct Exposition {
  std::vector<std::string> order;  // family names as they appear
  std::map<std::string, Family> families;

  // The value of the sample with exactly this name and label set.
  std::optional<double> Get(const std::string& name, const Labels& labels = {}) const {
    for (const auto& [family_name, family] : families) {
      for (const Sample& s : family.samples) {
        if (s.name == name && s.labels == labels) return s.value;
      }
    }
    return std::nullopt;
  }
};

bool IsNameStart(char c, bool allow_colon) {
  return absl::ascii_isalpha(c) || c == '_' || (allow_colon && c == ':');
}
bool IsNameChar(char c, bool allow_colon) {
  return IsNameStart(c, allow_colon) || absl::ascii_isdigit(c);
}

// Consumes a metric name (colons allowed) or label name (not) from `s`.
bool ConsumeName(absl::string_view& s, bool allow_colon, std::string* name) {
  if (s.empty() || !IsNameStart(s[0], allow_colon)) return false;
  size_t n = 1;
  while (n < s.size() && IsNameChar(s[n], allow_colon)) ++n;
  *name = std::string(s.substr(0, n));
  s.remove_prefix(n);
  return true;
}

// Go's ParseFloat syntax as Prometheus accepts it, limited to what a
// correct renderer may produce: decimal/exponent numbers and +Inf/-Inf/NaN.
bool ParseValue(absl::string_view text, double* value) {
  if (text == "+Inf") {
    *value = INFINITY;
    return true;
  }
  if (text == "-Inf") {
    *value = -INFINITY;
    return true;
  }
  if (text == "NaN") {
    *value = NAN;
    return true;
  }
  if (text.empty()) return false;
  for (char c : text) {
    if (!absl::ascii_isdigit(c) && c != '.' && c != 'e' && c != 'E' && c != '-' && c != '+') {
      return false;
    }
  }
  const std::string str(text);
  char* end = nullptr;
  *value = std::strtod(str.c_str(), &end);
  return end == str.c_str() + str.size();
}

// Whether a sample may appear in the group of `family_name` (histograms
// only through their _bucket/_sum/_count series).
bool BelongsTo(const std::string& sample_name, const std::string& family_name,
               const Family& family) {
  if (sample_name == family_name) return family.type != "histogram";
  if (family.type == "histogram") {
    return sample_name == family_name + "_bucket" || sample_name == family_name + "_sum" ||
           sample_name == family_name + "_count";
  }
  return false;
}

// Parses `text`; on error returns false with a message naming the line.
bool ParseExposition(absl::string_view text, Exposition* out, std::string* error) {
  if (text.empty() || text.back() != '\n') {
    *error = "exposition must end with a newline";
    return false;
  }
  text.remove_suffix(1);
  int line_no = 0;
  std::string current;  // family whose lines are being read
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    const absl::string_view full_line = line;
    auto fail = [&](absl::string_view why) {
      *error = absl::StrCat("line ", line_no, " (", why, "): \"", full_line, "\"");
      return false;
    };
    if (line.empty()) return fail("empty line");
    if (absl::ConsumePrefix(&line, "# HELP ")) {
      std::string name;
      if (!ConsumeName(line, true, &name)) return fail("bad metric name");
      if (!absl::ConsumePrefix(&line, " ")) return fail("no space after name");
      if (out->families.count(name)) return fail("family repeated: lines must be grouped");
      // Docstring escapes: only \\ and \n.
      for (size_t i = 0; i < line.size(); ++i) {
        if (line[i] != '\\') continue;
        if (i + 1 >= line.size() || (line[i + 1] != '\\' && line[i + 1] != 'n')) {
          return fail("bad escape in HELP");
        }
        ++i;
      }
      if (line.empty()) return fail("empty HELP");
      out->families[name].help = std::string(line);
      out->order.push_back(name);
      current = name;
      continue;
    }
    if (absl::ConsumePrefix(&line, "# TYPE ")) {
      std::string name;
      if (!ConsumeName(line, true, &name)) return fail("bad metric name");
      if (!absl::ConsumePrefix(&line, " ")) return fail("no space after name");
      if (name != current) return fail("TYPE not directly after its HELP");
      Family& family = out->families[name];
      if (!family.type.empty()) return fail("second TYPE");
      if (!family.samples.empty()) return fail("TYPE after samples");
      static const std::set<std::string> kTypes = {"counter", "gauge", "histogram", "summary",
                                                   "untyped"};
      if (!kTypes.count(std::string(line))) return fail("unknown type");
      family.type = std::string(line);
      continue;
    }
    if (absl::StartsWith(line, "#")) return fail("unexpected comment");

    Sample sample;
    if (!ConsumeName(line, true, &sample.name)) return fail("bad sample name");
    if (current.empty()) return fail("sample before any HELP/TYPE");
    Family& family = out->families[current];
    if (family.type.empty()) return fail("sample before TYPE");
    if (!BelongsTo(sample.name, current, family)) return fail("sample outside its family group");
    if (absl::ConsumePrefix(&line, "{")) {
      while (!absl::ConsumePrefix(&line, "}")) {
        std::string label;
        if (!ConsumeName(line, false, &label)) return fail("bad label name");
        if (absl::StartsWith(label, "__")) return fail("reserved label name");
        if (!absl::ConsumePrefix(&line, "=\"")) return fail("expected =\"");
        std::string value;
        while (true) {
          if (line.empty()) return fail("unterminated label value");
          const char c = line[0];
          line.remove_prefix(1);
          if (c == '"') break;
          if (c == '\n') return fail("raw newline in label value");
          if (c == '\\') {
            if (line.empty()) return fail("dangling backslash");
            const char e = line[0];
            line.remove_prefix(1);
            if (e == '\\') {
              value += '\\';
            } else if (e == '"') {
              value += '"';
            } else if (e == 'n') {
              value += '\n';
            } else {
              return fail("bad escape in label value");
            }
            continue;
          }
          value += c;
        }
        if (!sample.labels.emplace(label, value).second) return fail("duplicate label");
        if (!absl::ConsumePrefix(&line, ",") && !absl::StartsWith(line, "}")) {
          return fail("expected , or } after label");
        }
      }
    }
    if (!absl::ConsumePrefix(&line, " ")) return fail("expected one space before value");
    // The renderer never writes timestamps, so anything after the value
    // is an error here.
    if (!ParseValue(line, &sample.value)) return fail("bad value");
    family.samples.push_back(std::move(sample));
  }
  for (const auto& [name, family] : out->families) {
    if (family.type.empty()) {
      *error = absl::StrCat("family ", name, " has no TYPE");
      return false;
    }
  }
  return true;
}

// Histogram invariants for every series of every histogram family, and
// counters being non-negative whole numbers.
bool CheckInvariants(const Exposition& e, std::string* error) {
  for (const auto& [name, family] : e.families) {
    if (family.type == "counter") {
      for (const Sample& s : family.samples) {
        if (!(s.value >= 0) || s.value != std::floor(s.value)) {
          *error = absl::StrCat(name, ": counter value ", s.value);
          return false;
        }
      }
    }
    if (family.type != "histogram") continue;
    struct Series {
      std::vector<std::pair<std::string, double>> buckets;  // le, value
      std::optional<double> sum, count;
    };
    std::map<Labels, Series> series;
    for (const Sample& s : family.samples) {
      Labels key = s.labels;
      if (s.name == name + "_bucket") {
        auto le = key.find("le");
        if (le == key.end()) {
          *error = absl::StrCat(name, ": bucket without le");
          return false;
        }
        const std::string le_value = le->second;
        key.erase(le);
        series[key].buckets.emplace_back(le_value, s.value);
      } else if (s.name == name + "_sum") {
        series[key].sum = s.value;
      } else {
        series[key].count = s.value;
      }
    }
    for (const auto& [labels, s] : series) {
      std::string where = name;
      for (const auto& [label, value] : labels) absl::StrAppend(&where, " ", label, "=", value);
      if (s.buckets.empty() || !s.sum || !s.count) {
        *error = absl::StrCat(where, ": needs buckets, _sum and _count");
        return false;
      }
      if (s.buckets.back().first != "+Inf") {
        *error = absl::StrCat(where, ": last bucket is le=", s.buckets.back().first);
        return false;
      }
      double prev_le = -INFINITY;
      double prev_value = 0;
      for (const auto& [le_text, value] : s.buckets) {
        double le;
        if (!ParseValue(le_text, &le) || !(le > prev_le)) {
          *error = absl::StrCat(where, ": le not increasing at ", le_text);
          return false;
        }
        if (value < prev_value) {
          *error = absl::StrCat(where, ": buckets not cumulative at le=", le_text);
          return false;
        }
        prev_le = le;
        prev_value = value;
      }
      if (s.buckets.back().second != *s.count) {
        *error =
            absl::StrCat(where, ": +Inf bucket ", s.buckets.back().second, " != _count ", *s.count);
        return false;
      }
    }
  }
  return true;
}

// Parses and checks, failing the test with the reason on error.
Exposition ParseValid(const std::string& text) {
  Exposition e;
  std::string error;
  EXPECT_TRUE(ParseExposition(text, &e, &error)) << error << "\n" << text;
  EXPECT_TRUE(CheckInvariants(e, &error)) << error << "\n" << text;
  return e;
}

const std::vector<std::string> kAllFamilies = {"ropeattn_requests_total",
                                               "ropeattn_request_duration_seconds",
                                               "ropeattn_queue_seconds",
                                               "ropeattn_compute_seconds",
                                               "ropeattn_rejected_total",
                                               "ropeattn_abandoned_total",
                                               "ropeattn_answers_timed_out_total",
                                               "ropeattn_queue_depth",
                                               "ropeattn_running",
                                               "ropeattn_sessions_open",
                                               "ropeattn_sessions_opened_total",
                                               "ropeattn_sessions_closed_total",
                                               "ropeattn_kv_bytes_used",
                                               "ropeattn_kv_bytes_budget",
                                               "ropeattn_decode_steps_total",
                                               "ropeattn_decode_tokens_total",
                                               "ropeattn_decode_batch_size",
                                               "ropeattn_connections_accepted_total",
                                               "ropeattn_connections_refused_total",
                                               "ropeattn_auth_refused_total",
                                               "ropeattn_quota_refused_total"};

// ---------------------------------------------------------------------------
// The parser itself must reject what Prometheus would, or the format tests
// below prove nothing.

TEST(ExpositionParserTest, RejectsMalformedInput) {
  const std::string good =
      "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\"} 3\n"
      "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\n"
      "h_sum 3.5\nh_count 2\n";
  Exposition e;
  std::string error;
  ASSERT_TRUE(ParseExposition(good, &e, &error)) << error;
  ASSERT_TRUE(CheckInvariants(e, &error)) << error;

  const std::vector<std::string> bad = {
      "a 1\n",                                                                // no HELP/TYPE
      "# HELP a A.\na 1\n",                                                   // no TYPE
      "# HELP a A.\n# TYPE a counter\na{x=\"\\t\"} 1\n",                      // bad escape
      "# HELP a A.\n# TYPE a counter\na{x=\"1\"}  1\n",                       // two spaces
      "# HELP a A.\n# TYPE a counter\na 1\n# HELP a A.\n# TYPE a counter\n",  // repeated
      "# HELP a A.\n# TYPE a counter\na{x=\"1\"} 1\n# HELP b B.\n# TYPE b counter\n"
      "a{x=\"2\"} 1\n",                                         // a's lines not grouped
      "# HELP a A.\n# TYPE a counter\na{x=\"1\",x=\"2\"} 1\n",  // duplicate label
      "# HELP h H.\n# TYPE h histogram\nh 1\n",                 // histogram sample without suffix
      "# HELP a A.\n# TYPE a counter\nb 1\n",                   // wrong family
      "# HELP a A.\n# TYPE a counter\na 1",                     // no final newline
      "# HELP a A.\n# TYPE a counter\na one\n",                 // bad value
  };
  for (const std::string& text : bad) {
    Exposition x;
    EXPECT_FALSE(ParseExposition(text, &x, &error)) << text;
  }
  const std::vector<std::string> bad_histograms = {
      // Not cumulative.
      "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\n"
      "h_sum 1\nh_count 1\n",
      // +Inf != _count.
      "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 1\n"
      "h_sum 1\nh_count 2\n",
      // No +Inf bucket.
      "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n",
  };
  for (const std::string& text : bad_histograms) {
    Exposition x;
    ASSERT_TRUE(ParseExposition(text, &x, &error)) << error;
    EXPECT_FALSE(CheckInvariants(x, &error)) << text;
  }
}

// ---------------------------------------------------------------------------
// Rendering

TEST(MetricsRenderTest, EmptyRegistryHasEveryFamilyInOrder) {
  Metrics metrics;
  const Exposition e = ParseValid(metrics.RenderPrometheus());
  EXPECT_EQ(e.order, kAllFamilies);
  EXPECT_EQ(e.families.at("ropeattn_request_duration_seconds").type, "histogram");
  EXPECT_EQ(e.families.at("ropeattn_queue_depth").type, "gauge");
  EXPECT_EQ(e.families.at("ropeattn_requests_total").type, "counter");
  for (const char* reason : {"closed", "disconnected", "stream_ended", "reaped", "shutdown"}) {
    EXPECT_EQ(e.Get("ropeattn_sessions_closed_total", {{"reason", reason}}), 0.0) << reason;
  }
  EXPECT_EQ(e.Get("ropeattn_decode_steps_total"), 0.0);
  EXPECT_EQ(e.Get("ropeattn_connections_accepted_total"), 0.0);
  for (const char* reason : {"over_cap", "no_fd"}) {
    EXPECT_EQ(e.Get("ropeattn_connections_refused_total", {{"reason", reason}}), 0.0) << reason;
  }
  for (const char* reason : {"invalid_token", "missing_token", "no_identity", "identity_too_long"}) {
    EXPECT_EQ(e.Get("ropeattn_auth_refused_total", {{"reason", reason}}), 0.0) << reason;
  }
  for (const char* quota : {"memory", "sessions"}) {
    EXPECT_EQ(e.Get("ropeattn_quota_refused_total", {{"quota", quota}}), 0.0) << quota;
  }
}

TEST(MetricsRenderTest, RegisteredMethodStartsAtZero) {
  Metrics metrics;
  metrics.RegisterMethod("Attend");
  metrics.RegisterMethod("Attend");  // idempotent
  const Exposition e = ParseValid(metrics.RenderPrometheus());
  EXPECT_EQ(e.Get("ropeattn_requests_total", {{"method", "Attend"}, {"code", "OK"}}), 0.0);
  EXPECT_EQ(e.Get("ropeattn_rejected_total", {{"method", "Attend"}}), 0.0);
  EXPECT_EQ(e.Get("ropeattn_answers_timed_out_total", {{"method", "Attend"}}), 0.0);
  EXPECT_EQ(e.Get("ropeattn_request_duration_seconds_count", {{"method", "Attend"}}), 0.0);
  EXPECT_EQ(
      e.Get("ropeattn_request_duration_seconds_bucket", {{"method", "Attend"}, {"le", "+Inf"}}),
      0.0);
  EXPECT_EQ(e.families.at("ropeattn_rejected_total").samples.size(), 1u);
}

TEST(MetricsRenderTest, RequestsByCodeNameAndHistogramBuckets) {
  Metrics metrics;
  metrics.RecordRequest("Attend", 0, 200e-6);
  metrics.RecordRequest("Attend", 0, 200e-6);
  metrics.RecordRequest("Attend", 3, 3e-3);
  metrics.RecordRequest("Attend", 0, 1e-3);  // exactly on a bound: le is inclusive
  metrics.RecordRequest("Attend", 8, 60.0);  // beyond the last bound
  metrics.RecordRequest("Decode.Step", 5, 40e-6);
  metrics.RecordRequest("Decode.Step", 99, 40e-6);  // not a gRPC code
  const std::string text = metrics.RenderPrometheus();
  const Exposition e = ParseValid(text);

  auto requests = [&](const std::string& method, const std::string& code) {
    return e.Get("ropeattn_requests_total", {{"method", method}, {"code", code}});
  };
  EXPECT_EQ(requests("Attend", "OK"), 3.0);
  EXPECT_EQ(requests("Attend", "INVALID_ARGUMENT"), 1.0);
  EXPECT_EQ(requests("Attend", "RESOURCE_EXHAUSTED"), 1.0);
  EXPECT_EQ(requests("Attend", "NOT_FOUND"), std::nullopt);  // never happened
  EXPECT_EQ(requests("Decode.Step", "NOT_FOUND"), 1.0);
  EXPECT_EQ(requests("Decode.Step", "UNKNOWN"), 1.0);
  EXPECT_EQ(requests("Decode.Step", "OK"), 0.0);  // OK is always present

  auto bucket = [&](const std::string& method, const std::string& le) {
    return e.Get("ropeattn_request_duration_seconds_bucket", {{"method", method}, {"le", le}});
  };
  // The bounds the dashboards rely on, spelled as Prometheus clients do.
  EXPECT_EQ(bucket("Attend", "5e-05"), 0.0);
  EXPECT_EQ(bucket("Attend", "0.0001"), 0.0);
  EXPECT_EQ(bucket("Attend", "0.00025"), 2.0);
  EXPECT_EQ(bucket("Attend", "0.0005"), 2.0);
  EXPECT_EQ(bucket("Attend", "0.001"), 3.0);
  EXPECT_EQ(bucket("Attend", "0.0025"), 3.0);
  EXPECT_EQ(bucket("Attend", "0.005"), 4.0);
  EXPECT_EQ(bucket("Attend", "10"), 4.0);
  EXPECT_EQ(bucket("Attend", "+Inf"), 5.0);
  EXPECT_EQ(bucket("Decode.Step", "5e-05"), 2.0);
  EXPECT_EQ(e.Get("ropeattn_request_duration_seconds_count", {{"method", "Attend"}}), 5.0);
  const std::optional<double> sum =
      e.Get("ropeattn_request_duration_seconds_sum", {{"method", "Attend"}});
  ASSERT_TRUE(sum.has_value());
  EXPECT_NEAR(*sum, 200e-6 + 200e-6 + 3e-3 + 1e-3 + 60.0, 1e-12);

  // 17 bounds from 50 us to 10 s, then +Inf.
  int attend_buckets = 0;
  for (const Sample& s : e.families.at("ropeattn_request_duration_seconds").samples) {
    if (s.name == "ropeattn_request_duration_seconds_bucket" && s.labels.at("method") == "Attend")
      ++attend_buckets;
  }
  EXPECT_EQ(attend_buckets, 18);
  // Series are sorted by method, so output is stable between scrapes.
  EXPECT_LT(text.find("method=\"Attend\""), text.find("method=\"Decode.Step\""));
}

TEST(MetricsRenderTest, BadDurationsDoNotPoisonTheSum) {
  Metrics metrics;
  metrics.RecordRequest("Attend", 0, -1.0);
  metrics.RecordRequest("Attend", 0, NAN);
  metrics.RecordRequest("Attend", 0, INFINITY);
  const Exposition e = ParseValid(metrics.RenderPrometheus());
  EXPECT_EQ(e.Get("ropeattn_request_duration_seconds_sum", {{"method", "Attend"}}), 0.0);
  EXPECT_EQ(e.Get("ropeattn_request_duration_seconds_count", {{"method", "Attend"}}), 3.0);
  EXPECT_EQ(
      e.Get("ropeattn_request_duration_seconds_bucket", {{"method", "Attend"}, {"le", "5e-05"}}),
      3.0);
}

TEST(MetricsRenderTest, GaugesAndCounters) {
  Metrics metrics;
  metrics.SetQueueDepth(7);
  metrics.SetQueueDepth(5);  // gauges replace
  metrics.SetSessionsOpen(3);
  metrics.RecordSessionOpened();
  metrics.RecordSessionOpened();
  metrics.RecordSessionClosed("reaped");
  metrics.RecordSessionClosed("reaped");
  metrics.RecordSessionClosed("disconnected");
  metrics.SetKvBytes(int64_t{3} << 30, int64_t{4} << 30);
  metrics.RecordStep(4);
  metrics.RecordStep(1);
  metrics.RecordStep(-3);  // counts the step, not negative tokens
  metrics.RecordDecodeBatch(1);
  metrics.RecordDecodeBatch(3);
  metrics.RecordDecodeBatch(100);
  metrics.RecordDecodeBatch(0);  // ignored
  metrics.RecordRejected("Attend");
  metrics.RecordRejected("Attend");
  int64_t accepted = 0;  // read at render time, not when the source is set
  metrics.SetConnectionSource([&accepted] { return Metrics::ConnectionCounts{accepted, 4, 5}; });
  accepted = 9;
  const Exposition e = ParseValid(metrics.RenderPrometheus());
  EXPECT_EQ(e.Get("ropeattn_connections_accepted_total"), 9.0);
  EXPECT_EQ(e.Get("ropeattn_connections_refused_total", {{"reason", "over_cap"}}), 4.0);
  EXPECT_EQ(e.Get("ropeattn_connections_refused_total", {{"reason", "no_fd"}}), 5.0);
  EXPECT_EQ(e.Get("ropeattn_queue_depth"), 5.0);
  EXPECT_EQ(e.Get("ropeattn_sessions_open"), 3.0);
  EXPECT_EQ(e.Get("ropeattn_sessions_opened_total"), 2.0);
  EXPECT_EQ(e.Get("ropeattn_sessions_closed_total", {{"reason", "reaped"}}), 2.0);
  EXPECT_EQ(e.Get("ropeattn_sessions_closed_total", {{"reason", "disconnected"}}), 1.0);
  EXPECT_EQ(e.Get("ropeattn_sessions_closed_total", {{"reason", "closed"}}), 0.0);
  EXPECT_EQ(e.Get("ropeattn_kv_bytes_used"), static_cast<double>(int64_t{3} << 30));
  EXPECT_EQ(e.Get("ropeattn_kv_bytes_budget"), static_cast<double>(int64_t{4} << 30));
  EXPECT_EQ(e.Get("ropeattn_decode_steps_total"), 3.0);
  EXPECT_EQ(e.Get("ropeattn_decode_tokens_total"), 5.0);
  EXPECT_EQ(e.Get("ropeattn_decode_batch_size_bucket", {{"le", "1"}}), 1.0);
  EXPECT_EQ(e.Get("ropeattn_decode_batch_size_bucket", {{"le", "2"}}), 1.0);
  EXPECT_EQ(e.Get("ropeattn_decode_batch_size_bucket", {{"le", "4"}}), 2.0);
  EXPECT_EQ(e.Get("ropeattn_decode_batch_size_bucket", {{"le", "64"}}), 2.0);
  EXPECT_EQ(e.Get("ropeattn_decode_batch_size_bucket", {{"le", "+Inf"}}), 3.0);
  EXPECT_EQ(e.Get("ropeattn_decode_batch_size_sum"), 104.0);
  EXPECT_EQ(e.Get("ropeattn_decode_batch_size_count"), 3.0);
  EXPECT_EQ(e.Get("ropeattn_rejected_total", {{"method", "Attend"}}), 2.0);
}

TEST(MetricsRenderTest, LabelValuesAreEscaped) {
  Metrics metrics;
  const std::string weird = "we\"ird\\name\nx";
  metrics.RecordRequest(weird, 0, 1e-3);
  metrics.RecordSessionClosed(weird);
  const std::string text = metrics.RenderPrometheus();
  EXPECT_THAT(text, HasSubstr("method=\"we\\\"ird\\\\name\\nx\""));
  const Exposition e = ParseValid(text);
  // Round trip: unescaping gives back the original value.
  EXPECT_EQ(e.Get("ropeattn_requests_total", {{"method", weird}, {"code", "OK"}}), 1.0);
  EXPECT_EQ(e.Get("ropeattn_sessions_closed_total", {{"reason", weird}}), 1.0);
}

TEST(MetricsRenderTest, LabelCardinalityIsBounded) {
  Metrics metrics;
  const int n = Metrics::kMaxLabelValues + 50;
  for (int i = 0; i < n; ++i) metrics.RecordRequest(absl::StrCat("m", i), 0, 1e-3);
  const Exposition e = ParseValid(metrics.RenderPrometheus());
  const auto& samples = e.families.at("ropeattn_requests_total").samples;
  EXPECT_EQ(samples.size(), static_cast<size_t>(Metrics::kMaxLabelValues) + 1);
  EXPECT_EQ(e.Get("ropeattn_requests_total", {{"method", "other"}, {"code", "OK"}}), 50.0);
  double total = 0;
  for (const Sample& s : samples) total += s.value;
  EXPECT_EQ(total, n);  // nothing is lost, only folded
}

TEST(MetricsConcurrencyTest, TotalsAreExactUnderContention) {
  Metrics metrics;
  constexpr int kThreads = 8;
  constexpr int kIters = 4000;
  std::atomic<bool> done{false};
  std::atomic<int> renders{0};
  // A scraper running throughout: every snapshot must be internally
  // consistent (+Inf == _count), which fails if rendering read state
  // without the lock.
  std::thread scraper([&] {
    while (!done.load()) {
      Exposition e;
      std::string error;
      const std::string text = metrics.RenderPrometheus();
      if (!ParseExposition(text, &e, &error) || !CheckInvariants(e, &error)) {
        ADD_FAILURE() << error;
        return;
      }
      renders.fetch_add(1);
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&metrics, t] {
      const std::string method = t % 2 == 0 ? "Attend" : "Decode.Step";
      for (int i = 0; i < kIters; ++i) {
        metrics.RecordRequest(method, i % 4 == 0 ? 8 : 0, 1e-4 * (i % 7));
        metrics.RecordStep(3);
        metrics.RecordSessionOpened();
        metrics.RecordSessionClosed(i % 2 == 0 ? "closed" : "reaped");
        if (i % 10 == 0) metrics.RecordRejected(method);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  done.store(true);
  scraper.join();
  EXPECT_GT(renders.load(), 0);

  const Exposition e = ParseValid(metrics.RenderPrometheus());
  const double per_method = kThreads / 2 * kIters;
  for (const std::string method : {"Attend", "Decode.Step"}) {
    EXPECT_EQ(e.Get("ropeattn_requests_total", {{"method", method}, {"code", "OK"}}),
              per_method * 3 / 4);
    EXPECT_EQ(
        e.Get("ropeattn_requests_total", {{"method", method}, {"code", "RESOURCE_EXHAUSTED"}}),
        per_method / 4);
    EXPECT_EQ(e.Get("ropeattn_request_duration_seconds_count", {{"method", method}}), per_method);
    EXPECT_EQ(e.Get("ropeattn_rejected_total", {{"method", method}}), kThreads / 2 * kIters / 10);
  }
  EXPECT_EQ(e.Get("ropeattn_decode_steps_total"), kThreads * kIters);
  EXPECT_EQ(e.Get("ropeattn_decode_tokens_total"), 3.0 * kThreads * kIters);
  EXPECT_EQ(e.Get("ropeattn_sessions_opened_total"), kThreads * kIters);
  EXPECT_EQ(e.Get("ropeattn_sessions_closed_total", {{"reason", "closed"}}), kThreads * kIters / 2);
  EXPECT_EQ(e.Get("ropeattn_sessions_closed_total", {{"reason", "reaped"}}), kThreads * kIters / 2);
}

// ---------------------------------------------------------------------------
// HTTP endpoint, through a plain socket client.

struct HttpResponse {
  int status = 0;
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;

  std::string Header(const std::string& lower_name) const {
    auto it = headers.find(lower_name);
    return it == headers.end() ? "" : it->second;
  }
};

// A connected socket to 127.0.0.1:port (-1 on failure), with a receive
// timeout so a server that never answers fails the test instead of hanging.
int Connect(int port, int recv_timeout_ms = 5000) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  timeval tv{recv_timeout_ms / 1000, (recv_timeout_ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool SendAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    const ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n <= 0) return false;
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

// Reads one response (headers, then Content-Length bytes of body, or up to
// EOF without one; no body for HEAD). nullopt if the connection ends or
// times out first.
std::optional<HttpResponse> ReadResponse(int fd, bool head = false) {
  std::string raw;
  char buf[4096];
  size_t header_end = std::string::npos;
  std::optional<size_t> content_length;
  HttpResponse response;
  while (true) {
    if (header_end == std::string::npos) {
      header_end = raw.find("\r\n\r\n");
      if (header_end != std::string::npos) {
        const std::vector<absl::string_view> lines =
            absl::StrSplit(absl::string_view(raw).substr(0, header_end), "\r\n");
        const std::vector<absl::string_view> status_line = absl::StrSplit(lines[0], ' ');
        if (status_line.size() < 2 || !absl::StartsWith(status_line[0], "HTTP/1.") ||
            !absl::SimpleAtoi(status_line[1], &response.status)) {
          return std::nullopt;
        }
        for (size_t i = 1; i < lines.size(); ++i) {
          const size_t colon = lines[i].find(':');
          if (colon == absl::string_view::npos) return std::nullopt;
          response.headers[absl::AsciiStrToLower(lines[i].substr(0, colon))] =
              std::string(absl::StripAsciiWhitespace(lines[i].substr(colon + 1)));
        }
        auto it = response.headers.find("content-length");
        size_t length = 0;
        if (it != response.headers.end() && absl::SimpleAtoi(it->second, &length)) {
          content_length = head ? 0 : length;
        }
      }
    }
    if (header_end != std::string::npos && content_length &&
        raw.size() >= header_end + 4 + *content_length) {
      break;
    }
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0) return std::nullopt;  // error or timeout
    if (n == 0) {
      if (header_end == std::string::npos || content_length) return std::nullopt;
      break;  // body delimited by EOF
    }
    raw.append(buf, static_cast<size_t>(n));
  }
  response.body = raw.substr(header_end + 4, content_length.value_or(std::string::npos));
  return response;
}

std::optional<HttpResponse> Request(int port, absl::string_view method, absl::string_view path) {
  const int fd = Connect(port);
  if (fd < 0) return std::nullopt;
  const std::string request =
      absl::StrCat(method, " ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  std::optional<HttpResponse> response;
  if (SendAll(fd, request)) response = ReadResponse(fd, method == "HEAD");
  close(fd);
  return response;
}

// True if the server closes `fd` (EOF or reset) before `limit` passes,
// without having sent anything.
bool ClosedWithoutReply(int fd, std::chrono::milliseconds limit, std::string* received) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  char buf[256];
  while (std::chrono::steady_clock::now() < deadline) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0) return received->empty();
    if (n < 0) {
      if (errno == ECONNRESET) return received->empty();
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      return false;
    }
    received->append(buf, static_cast<size_t>(n));
  }
  return false;
}

std::unique_ptr<MetricsHttpServer> StartOrDie(const Metrics& metrics,
                                              const MetricsHttpServer::Options& options = {}) {
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start("127.0.0.1:0", &metrics, options);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return nullptr;
  EXPECT_GT((*server)->port(), 0);
  return *std::move(server);
}

TEST(MetricsHttpServerTest, GetMetricsReturnsTheRenderedText) {
  Metrics metrics;
  metrics.RecordRequest("Attend", 0, 1e-3);
  metrics.SetQueueDepth(2);
  std::unique_ptr<MetricsHttpServer> server = StartOrDie(metrics);
  ASSERT_NE(server, nullptr);

  const std::optional<HttpResponse> response = Request(server->port(), "GET", "/metrics");
  ASSERT_TRUE(response.has_value());
  EXPECT_EQ(response->status, 200);
  EXPECT_EQ(response->Header("content-type"), "text/plain; version=0.0.4; charset=utf-8");
  // Nothing was recorded in between, so the scrape equals a local render.
  EXPECT_EQ(response->body, metrics.RenderPrometheus());
  const Exposition e = ParseValid(response->body);
  EXPECT_EQ(e.Get("ropeattn_queue_depth"), 2.0);

  // Scrapes are live, not cached.
  metrics.SetQueueDepth(9);
  const std::optional<HttpResponse> again = Request(server->port(), "GET", "/metrics");
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(ParseValid(again->body).Get("ropeattn_queue_depth"), 9.0);
}

TEST(MetricsHttpServerTest, KeepAliveConnectionServesSeveralScrapes) {
  Metrics metrics;
  std::unique_ptr<MetricsHttpServer> server = StartOrDie(metrics);
  ASSERT_NE(server, nullptr);
  const int fd = Connect(server->port());
  ASSERT_GE(fd, 0);
  for (int i = 0; i < 3; ++i) {
    metrics.RecordStep(1);
    ASSERT_TRUE(SendAll(fd, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"));
    const std::optional<HttpResponse> response = ReadResponse(fd);
    ASSERT_TRUE(response.has_value()) << "request " << i << " on the same connection";
    EXPECT_EQ(response->status, 200);
    EXPECT_NE(absl::AsciiStrToLower(response->Header("connection")), "close");
    EXPECT_EQ(ParseValid(response->body).Get("ropeattn_decode_steps_total"), i + 1.0);
  }
  close(fd);
}

TEST(MetricsHttpServerTest, OtherPathsAre404AndOtherMethods405) {
  Metrics metrics;
  std::unique_ptr<MetricsHttpServer> server = StartOrDie(metrics);
  ASSERT_NE(server, nullptr);
  for (const std::string path : {"/", "/metricsx", "/metrics/", "/health"}) {
    const std::optional<HttpResponse> response = Request(server->port(), "GET", path);
    ASSERT_TRUE(response.has_value()) << path;
    EXPECT_EQ(response->status, 404) << path;
    EXPECT_THAT(response->body, Not(HasSubstr("ropeattn_"))) << path;
  }
  for (const std::string method : {"POST", "PUT", "DELETE"}) {
    const std::optional<HttpResponse> response = Request(server->port(), method, "/metrics");
    ASSERT_TRUE(response.has_value()) << method;
    EXPECT_EQ(response->status, 405) << method;
    EXPECT_EQ(response->Header("allow"), "GET, HEAD") << method;
  }
  {
    // An upload is refused without being read.
    const int fd = Connect(server->port());
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendAll(fd,
                        "POST /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n\r\n"
                        "hello"));
    const std::optional<HttpResponse> response = ReadResponse(fd);
    close(fd);
    ASSERT_TRUE(response.has_value());
    EXPECT_EQ(response->status, 405);
  }
  const std::optional<HttpResponse> head = Request(server->port(), "HEAD", "/metrics");
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->status, 200);
  EXPECT_TRUE(head->body.empty());
}

TEST(MetricsHttpServerTest, SlowClientDoesNotBlockOthersAndTimesOut) {
  Metrics metrics;
  MetricsHttpServer::Options options;
  options.idle_timeout_seconds = 2;
  std::unique_ptr<MetricsHttpServer> server = StartOrDie(metrics, options);
  ASSERT_NE(server, nullptr);

  // A client that sends half a request line and then stalls.
  const int slow = Connect(server->port());
  ASSERT_GE(slow, 0);
  ASSERT_TRUE(SendAll(slow, "GET /metr"));

  // Another client is served while the stalled one is still connected (a
  // server blocked on the stalled read would only answer after the 2 s
  // timeout dropped it).
  const auto start = std::chrono::steady_clock::now();
  const std::optional<HttpResponse> response = Request(server->port(), "GET", "/metrics");
  ASSERT_TRUE(response.has_value());
  EXPECT_EQ(response->status, 200);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(1500));

  // The stalled connection is dropped after the idle timeout (allowing for
  // the server's timer granularity and a loaded machine), unanswered.
  std::string received;
  EXPECT_TRUE(ClosedWithoutReply(slow, std::chrono::seconds(8), &received)) << received;
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(1500));
  close(slow);
}

TEST(MetricsHttpServerTest, PerIpConnectionLimit) {
  Metrics metrics;
  MetricsHttpServer::Options options;
  options.max_connections_per_ip = 2;
  std::unique_ptr<MetricsHttpServer> server = StartOrDie(metrics, options);
  ASSERT_NE(server, nullptr);

  // Two keep-alive connections, each proven accepted by a full exchange.
  std::vector<int> held;
  for (int i = 0; i < 2; ++i) {
    const int fd = Connect(server->port());
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendAll(fd, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"));
    const std::optional<HttpResponse> response = ReadResponse(fd);
    ASSERT_TRUE(response.has_value());
    EXPECT_EQ(response->status, 200);
    held.push_back(fd);
  }
  // A third from the same address is closed without an answer.
  const int third = Connect(server->port());
  ASSERT_GE(third, 0);
  SendAll(third, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
  std::string received;
  EXPECT_TRUE(ClosedWithoutReply(third, std::chrono::seconds(3), &received)) << received;
  close(third);

  // Freeing a slot lets a new client in (the server notices the close
  // asynchronously, so retry briefly).
  close(held[0]);
  bool served = false;
  for (int attempt = 0; attempt < 50 && !served; ++attempt) {
    const std::optional<HttpResponse> response = Request(server->port(), "GET", "/metrics");
    served = response.has_value() && response->status == 200;
    if (!served) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(served);
  close(held[1]);
}

TEST(MetricsHttpServerTest, StopsListeningWhenDestroyed) {
  Metrics metrics;
  std::unique_ptr<MetricsHttpServer> server = StartOrDie(metrics);
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  server.reset();
  const int fd = Connect(port);
  EXPECT_LT(fd, 0) << "still accepting on port " << port;
  if (fd >= 0) close(fd);
}

TEST(MetricsHttpServerTest, MalformedAddressIsInvalidArgument) {
  Metrics metrics;
  for (const std::string address :
       {"", "127.0.0.1", "127.0.0.1:", ":9464", "127.0.0.1:65536", "127.0.0.1:99999999",
        "127.0.0.1:+80", "127.0.0.1: 80", "127.0.0.1:80x", "300.0.0.1:80", "example.com:80",
        "[::1:80", "[::1]80", "[not-ipv6]:80", "::1:80"}) {
    const absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
        MetricsHttpServer::Start(address, &metrics);
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument)
        << "\"" << address << "\"";
  }
  MetricsHttpServer::Options options;
  options.idle_timeout_seconds = 0;
  EXPECT_EQ(MetricsHttpServer::Start("127.0.0.1:0", &metrics, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricsHttpServer::Start("127.0.0.1:0", nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MetricsHttpServerTest, PortInUseIsUnavailable) {
  Metrics metrics;
  std::unique_ptr<MetricsHttpServer> first = StartOrDie(metrics);
  ASSERT_NE(first, nullptr);
  const absl::StatusOr<std::unique_ptr<MetricsHttpServer>> second =
      MetricsHttpServer::Start(absl::StrCat("127.0.0.1:", first->port()), &metrics);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr(absl::StrCat(first->port())));
}

TEST(MetricsHttpServerTest, LocalhostAndIpv6Loopback) {
  Metrics metrics;
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> local =
      MetricsHttpServer::Start("localhost:0", &metrics);
  ASSERT_TRUE(local.ok()) << local.status();
  const std::optional<HttpResponse> response = Request((*local)->port(), "GET", "/metrics");
  ASSERT_TRUE(response.has_value());
  EXPECT_EQ(response->status, 200);

  // Containers may have no IPv6 loopback; then binding fails with
  // Unavailable, never with a parse error.
  const absl::StatusOr<std::unique_ptr<MetricsHttpServer>> v6 =
      MetricsHttpServer::Start("[::1]:0", &metrics);
  if (!v6.ok()) {
    EXPECT_EQ(v6.status().code(), absl::StatusCode::kUnavailable) << v6.status();
  } else {
    EXPECT_GT((*v6)->port(), 0);
  }
}

// A decode step's ropeattn_request_duration_seconds is its whole latency, as
// a unary call's is: from when it was read, through its wait for a compute
// worker, to its answer. It started when the step left the queue, so the
// wait (ropeattn_queue_seconds) was left out.
TEST(MetricsServerTest, ADecodeStepsDurationIncludesItsWaitForAWorker) {
  ServerOptions o = ropeattn::testing::TestServerOptions();
  o.compute_workers = 1;
  std::unique_ptr<Server> server = ropeattn::testing::StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = ropeattn::testing::TestStub(server->port());
  grpc::ClientContext ctx;
  auto rw = stub->Decode(&ctx);
  v1::DecodeRequest open;
  open.mutable_open()->mutable_spec()->set_heads(1);
  open.mutable_open()->mutable_spec()->set_head_dim(4);
  open.mutable_open()->set_max_context(16);
  ASSERT_TRUE(rw->Write(open));
  v1::DecodeResponse r;
  ASSERT_TRUE(rw->Read(&r));
  ASSERT_TRUE(r.has_opened()) << r.DebugString();
  // The only worker held: the step waits in the queue until it is let go.
  absl::Notification started, release;
  ASSERT_TRUE(server->executor().TrySubmit("test:held", 1, [&] {
    started.Notify();
    release.WaitForNotification();
  }));
  started.WaitForNotification();
  v1::DecodeRequest step;
  step.mutable_step()->set_seq(1);
  const int64_t shape[] = {1, 1, 1, 4};
  const Tensor x = ropeattn::testing::RandomTensor(DType::kF32, shape, 1);
  *step.mutable_step()->mutable_q() = ropeattn::testing::ToWire(x.cview());
  *step.mutable_step()->mutable_k() = ropeattn::testing::ToWire(x.cview());
  *step.mutable_step()->mutable_v() = ropeattn::testing::ToWire(x.cview());
  ASSERT_TRUE(rw->Write(step));
  ASSERT_TRUE(ropeattn::testing::Eventually([&] { return server->executor().queue_depth() == 1; }));
  absl::SleepFor(absl::Milliseconds(50));
  release.Notify();
  ASSERT_TRUE(rw->Read(&r));
  ASSERT_TRUE(r.has_step()) << r.DebugString();
  const auto metric = [&](const std::string& family) {
    return ropeattn::testing::MetricValue(server->metrics().RenderPrometheus(),
                                          family + "{method=\"Decode.Step\"}");
  };
  // Counted once its answer's write is done.
  ASSERT_TRUE(ropeattn::testing::Eventually(
      [&] { return metric("ropeattn_request_duration_seconds_count") == 1; }));
  const double queue = metric("ropeattn_queue_seconds_sum");
  const double compute = metric("ropeattn_compute_seconds_sum");
  EXPECT_GE(queue, 0.05);
  EXPECT_GE(metric("ropeattn_request_duration_seconds_sum"), queue + compute);
  rw->WritesDone();
  while (rw->Read(&r)) {
  }
  EXPECT_TRUE(rw->Finish().ok());
}

}  // namespace
}  // namespace ropeattn::server
