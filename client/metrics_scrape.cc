#include "client/metrics_scrape.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace ropeattn::client {
namespace {

constexpr size_t kMaxBody = 64u << 20;

// Milliseconds left until `deadline` (at least 0).
int MsLeft(std::chrono::steady_clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  return static_cast<int>(std::max<int64_t>(0, left.count()));
}

// Connects (non-blocking, then blocking I/O under poll) to host:port.
absl::StatusOr<int> Dial(const std::string& host, const std::string& port,
                         std::chrono::steady_clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", host, ":", port, ": ", gai_strerror(rc)));
  }
  std::string last_error = "no address";
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      last_error = std::strerror(errno);
      close(fd);
      continue;
    }
    pollfd p{fd, POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof(err);
    if (poll(&p, 1, MsLeft(deadline)) != 1 ||
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
      last_error = err != 0 ? std::strerror(err) : "timed out";
      close(fd);
      continue;
    }
    freeaddrinfo(res);
    return fd;
  }
  freeaddrinfo(res);
  return absl::UnavailableError(absl::StrCat("cannot connect to ", host, ":", port, ": ",
                                             last_error));
}

// "a=\"x\",b=\"y\"" -> labels; false on a syntax error.
bool ParseLabels(absl::string_view text, std::map<std::string, std::string>* labels) {
  size_t i = 0;
  while (i < text.size()) {
    while (i < text.size() && (text[i] == ',' || text[i] == ' ')) ++i;
    if (i >= text.size()) break;
    const size_t eq = text.find('=', i);
    if (eq == absl::string_view::npos || eq + 1 >= text.size() || text[eq + 1] != '"') {
      return false;
    }
    const std::string key(absl::StripAsciiWhitespace(text.substr(i, eq - i)));
    std::string value;
    size_t j = eq + 2;
    for (; j < text.size() && text[j] != '"'; ++j) {
      if (text[j] == '\\' && j + 1 < text.size()) {
        ++j;
        value += text[j] == 'n' ? '\n' : text[j];
      } else {
        value += text[j];
      }
    }
    if (j >= text.size()) return false;
    (*labels)[key] = std::move(value);
    i = j + 1;
  }
  return true;
}

bool ParseValue(absl::string_view text, double* value) {
  if (text == "+Inf") {
    *value = std::numeric_limits<double>::infinity();
    return true;
  }
  if (text == "-Inf") {
    *value = -std::numeric_limits<double>::infinity();
    return true;
  }
  if (text == "NaN") {
    *value = std::numeric_limits<double>::quiet_NaN();
    return true;
  }
  return absl::SimpleAtod(text, value);
}

bool Matches(const MetricSample& s, absl::string_view name, absl::string_view label,
             absl::string_view value) {
  if (s.name != name) return false;
  auto it = s.labels.find(std::string(label));
  return it != s.labels.end() && it->second == value;
}

struct HistogramSnapshot {
  std::map<double, double> buckets;  // le -> cumulative count
  double sum = 0;
  double count = 0;
};

HistogramSnapshot Snapshot(const std::vector<MetricSample>& samples, absl::string_view family,
                           absl::string_view label, absl::string_view value) {
  HistogramSnapshot h;
  const std::string bucket = absl::StrCat(family, "_bucket");
  const std::string sum = absl::StrCat(family, "_sum");
  const std::string count = absl::StrCat(family, "_count");
  for (const MetricSample& s : samples) {
    if (Matches(s, bucket, label, value)) {
      auto le = s.labels.find("le");
      double bound;
      if (le != s.labels.end() && ParseValue(le->second, &bound)) h.buckets[bound] = s.value;
    } else if (Matches(s, sum, label, value)) {
      h.sum = s.value;
    } else if (Matches(s, count, label, value)) {
      h.count = s.value;
    }
  }
  return h;
}

}  // namespace

absl::StatusOr<std::string> HttpGet(absl::string_view url, absl::Duration timeout) {
  absl::string_view rest = url;
  if (!absl::ConsumePrefix(&rest, "http://")) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics URL must start with http://, got \"", url, "\""));
  }
  const size_t slash = rest.find('/');
  const absl::string_view authority = rest.substr(0, slash);
  const std::string path =
      slash == absl::string_view::npos ? "/metrics" : std::string(rest.substr(slash));
  std::string host, port;
  if (absl::StartsWith(authority, "[")) {  // [v6]:port
    const size_t close_bracket = authority.find(']');
    if (close_bracket == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("bad host in \"", url, "\""));
    }
    host = std::string(authority.substr(1, close_bracket - 1));
    absl::string_view after = authority.substr(close_bracket + 1);
    port = absl::ConsumePrefix(&after, ":") ? std::string(after) : "80";
  } else {
    const size_t colon = authority.rfind(':');
    host = std::string(authority.substr(0, colon));
    port = colon == absl::string_view::npos ? "80" : std::string(authority.substr(colon + 1));
  }
  int port_number = 0;
  if (host.empty() || !absl::SimpleAtoi(port, &port_number) || port_number < 1 ||
      port_number > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics URL must be http://host:port[/path], got \"", url, "\""));
  }
  const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
  absl::StatusOr<int> fd = Dial(host, port, deadline);
  if (!fd.ok()) return fd.status();
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", authority, "\r\n\r\n");
  std::string response;
  absl::Status status = absl::OkStatus();
  for (size_t sent = 0; sent < request.size() && status.ok();) {
    pollfd p{*fd, POLLOUT, 0};
    const ssize_t n = poll(&p, 1, MsLeft(deadline)) == 1
                          ? send(*fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL)
                          : -1;
    if (n <= 0) status = absl::UnavailableError(absl::StrCat("cannot send to ", url));
    else sent += static_cast<size_t>(n);
  }
  // HTTP/1.0: the server closes the connection after the body.
  while (status.ok()) {
    pollfd p{*fd, POLLIN, 0};
    if (poll(&p, 1, MsLeft(deadline)) != 1) {
      status = absl::UnavailableError(absl::StrCat("timed out reading ", url));
      break;
    }
    char buf[16384];
    const ssize_t n = recv(*fd, buf, sizeof(buf), 0);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n < 0) status = absl::UnavailableError(absl::StrCat("cannot read ", url, ": ",
                                                            std::strerror(errno)));
    if (n <= 0) break;
    response.append(buf, static_cast<size_t>(n));
    if (response.size() > kMaxBody) {
      status = absl::ResourceExhaustedError(absl::StrCat(url, " answered more than 64 MiB"));
    }
  }
  close(*fd);
  if (!status.ok()) return status;
  const size_t header_end = response.find("\r\n\r\n");
  const absl::string_view status_line =
      absl::string_view(response).substr(0, response.find("\r\n"));
  if (header_end == std::string::npos || !absl::StartsWith(status_line, "HTTP/1.") ||
      status_line.size() < 12 || status_line.substr(9, 3) != "200") {
    return absl::FailedPreconditionError(
        absl::StrCat(url, " answered \"", status_line.substr(0, 80), "\", not 200"));
  }
  return response.substr(header_end + 4);
}

absl::StatusOr<std::vector<MetricSample>> ParsePrometheusText(absl::string_view text) {
  std::vector<MetricSample> samples;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    MetricSample s;
    size_t name_end = line.find_first_of("{ ");
    if (name_end == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("bad metrics line \"", line, "\""));
    }
    s.name = std::string(line.substr(0, name_end));
    absl::string_view rest = line.substr(name_end);
    if (absl::StartsWith(rest, "{")) {
      // The closing brace: the first '}' outside a quoted value.
      size_t i = 1;
      bool quoted = false;
      for (; i < rest.size(); ++i) {
        if (quoted && rest[i] == '\\') {
          ++i;
        } else if (rest[i] == '"') {
          quoted = !quoted;
        } else if (!quoted && rest[i] == '}') {
          break;
        }
      }
      if (i >= rest.size() || !ParseLabels(rest.substr(1, i - 1), &s.labels)) {
        return absl::InvalidArgumentError(absl::StrCat("bad labels in metrics line \"", line, "\""));
      }
      rest = rest.substr(i + 1);
    }
    rest = absl::StripLeadingAsciiWhitespace(rest);
    const absl::string_view value = rest.substr(0, rest.find(' '));  // a timestamp may follow
    if (!ParseValue(value, &s.value)) {
      return absl::InvalidArgumentError(absl::StrCat("bad value in metrics line \"", line, "\""));
    }
    samples.push_back(std::move(s));
  }
  return samples;
}

double BucketQuantile(const std::map<double, double>& cumulative, double q) {
  if (cumulative.empty()) return 0;
  const double total = cumulative.rbegin()->second;
  if (!(total > 0)) return 0;
  const double rank = q * total;
  double lower = 0, below = 0;
  double highest_finite = 0;
  for (const auto& [bound, count] : cumulative) {
    if (std::isfinite(bound)) highest_finite = bound;
  }
  for (const auto& [bound, count] : cumulative) {
    if (count >= rank) {
      if (!std::isfinite(bound)) return highest_finite;
      const double in_bucket = count - below;
      if (!(in_bucket > 0)) return bound;
      return lower + (bound - lower) * (rank - below) / in_bucket;
    }
    lower = bound;
    below = count;
  }
  return highest_finite;
}

HistogramGrowth GrowthOf(const std::vector<MetricSample>& before,
                         const std::vector<MetricSample>& after, absl::string_view family,
                         absl::string_view label, absl::string_view value) {
  const HistogramSnapshot b = Snapshot(before, family, label, value);
  const HistogramSnapshot a = Snapshot(after, family, label, value);
  HistogramGrowth g;
  g.count = a.count - b.count;
  g.sum = a.sum - b.sum;
  if (!(g.count > 0)) return HistogramGrowth();
  g.mean_ms = g.sum / g.count * 1e3;
  std::map<double, double> delta;
  for (const auto& [bound, count] : a.buckets) {
    auto it = b.buckets.find(bound);
    delta[bound] = count - (it == b.buckets.end() ? 0 : it->second);
  }
  g.p50_ms = BucketQuantile(delta, 0.50) * 1e3;
  g.p99_ms = BucketQuantile(delta, 0.99) * 1e3;
  return g;
}

}  // namespace ropeattn::client
