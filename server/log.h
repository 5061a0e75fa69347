// The server's log: one JSON object per line on stdout, through spdlog
// (Debian's libspdlog: thread-safe sinks, levels and UTC timestamps; the
// line's fields are ours). Every line starts with
//   {"ts":"2026-11-24T06:30:01.123456Z","level":"info","event":"...",
// followed by the event's own fields (docs/logging.md lists the events).
//
// Logging never throws and never fails a call: a field that cannot be
// encoded (invalid UTF-8) is replaced, not dropped; a line stdout cannot
// take (full disk, closed pipe: main ignores SIGPIPE) is dropped.
#ifndef ROPEATTN_SERVER_LOG_H_
#define ROPEATTN_SERVER_LOG_H_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <variant>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ropeattn::server {

enum class LogLevel { kDebug, kInfo, kWarning, kError };

// "debug", "info", "warning", "error"; InvalidArgument naming the value
// otherwise.
absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name);
// Lines below `level` are not written (default: info).
void SetLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);

// A JSON text written as is (an object or array built elsewhere).
struct RawJson {
  std::string text;
};

// One field of a line: a string, a number, a boolean or raw JSON.
struct LogField {
  using Value = std::variant<std::string, int64_t, double, bool, RawJson>;

  LogField(absl::string_view k, absl::string_view v) : key(k), value(std::string(v)) {}
  LogField(absl::string_view k, const std::string& v) : key(k), value(v) {}
  LogField(absl::string_view k, const char* v) : key(k), value(std::string(v == nullptr ? "" : v)) {}
  LogField(absl::string_view k, bool v) : key(k), value(v) {}
  LogField(absl::string_view k, double v) : key(k), value(v) {}
  LogField(absl::string_view k, RawJson v) : key(k), value(std::move(v)) {}
  template <typename T, typename = std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>>>
  LogField(absl::string_view k, T v) : key(k), value(static_cast<int64_t>(v)) {}

  absl::string_view key;
  Value value;
};

// Writes one line: `event` and `fields` after the timestamp and level. A
// field whose value is an empty string is left out.
void LogEvent(LogLevel level, absl::string_view event, std::initializer_list<LogField> fields);

// At most `per_second` lines a second of one kind that a caller without a
// token can cause (refused calls, health answers): the rest are counted,
// and the next line written says how many were not. Thread-safe.
class LogLineBudget {
 public:
  explicit LogLineBudget(int per_second) : per_second_(per_second) {}
  // Whether a line may be written at `now`; if so, `suppressed` is how
  // many were not since the last one.
  bool Admit(absl::Time now, int64_t* suppressed) {
    absl::MutexLock lock(&mu_);
    if (now - window_ >= absl::Seconds(1)) {
      window_ = now;
      lines_ = 0;
    }
    if (lines_ >= per_second_) {
      ++dropped_;
      return false;
    }
    ++lines_;
    *suppressed = dropped_;
    dropped_ = 0;
    return true;
  }

 private:
  const int per_second_;
  absl::Mutex mu_;
  absl::Time window_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int lines_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
};

// For tests in this process: while one exists, lines also go to it.
class LogCapture {
 public:
  LogCapture();
  ~LogCapture();
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;
  // Every line written since construction, in order.
  std::string Text() const;

 private:
  struct Impl;
  Impl* impl_;
};

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_LOG_H_
