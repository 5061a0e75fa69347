#include "server/log.h"

#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "spdlog/logger.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/dist_sink.h"
#include "spdlog/sinks/base_sink.h"
#include "spdlog/sinks/stdout_sinks.h"

namespace ropeattn::server {
namespace {

// The logger's only sink is a distributor (thread-safe add and remove), so a
// LogCapture can join and leave while other threads log.
struct Log {
  std::shared_ptr<spdlog::sinks::dist_sink_mt> sinks;
  std::shared_ptr<spdlog::logger> logger;
};

std::unique_ptr<spdlog::formatter> LineFormatter() {
  // Timestamp and level by spdlog, in UTC; the rest of the object is ours.
  return std::make_unique<spdlog::pattern_formatter>(
      R"({"ts":"%Y-%m-%dT%H:%M:%S.%fZ","level":"%l",%v})", spdlog::pattern_time_type::utc, "\n");
}

Log& TheLog() {
  static Log* log = [] {
    auto* l = new Log();
    l->sinks = std::make_shared<spdlog::sinks::dist_sink_mt>();
    l->sinks->add_sink(std::make_shared<spdlog::sinks::stdout_sink_mt>());
    l->sinks->set_formatter(LineFormatter());
    l->logger = std::make_shared<spdlog::logger>("ropeattn", l->sinks);
    l->logger->set_level(spdlog::level::info);
    l->logger->flush_on(spdlog::level::debug);
    return l;
  }();
  return *log;
}

spdlog::level::level_enum ToSpd(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return spdlog::level::debug;
    case LogLevel::kInfo:
      return spdlog::level::info;
    case LogLevel::kWarning:
      return spdlog::level::warn;
    case LogLevel::kError:
      return spdlog::level::err;
  }
  return spdlog::level::info;
}

// A JSON string literal; invalid UTF-8 becomes U+FFFD.
std::string Quote(absl::string_view s) {
  return nlohmann::json(std::string(s)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void AppendValue(std::string* out, const LogField::Value& value) {
  if (const auto* s = std::get_if<std::string>(&value)) {
    out->append(Quote(*s));
  } else if (const auto* i = std::get_if<int64_t>(&value)) {
    out->append(std::to_string(*i));
  } else if (const auto* d = std::get_if<double>(&value)) {
    out->append(nlohmann::json(*d).dump());  // null for NaN / Inf
  } else if (const auto* b = std::get_if<bool>(&value)) {
    out->append(*b ? "true" : "false");
  } else if (const auto* raw = std::get_if<RawJson>(&value)) {
    out->append(raw->text.empty() ? "null" : raw->text);
  }
}

}  // namespace

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name) {
  if (name == "debug") return LogLevel::kDebug;
  if (name == "info") return LogLevel::kInfo;
  if (name == "warning") return LogLevel::kWarning;
  if (name == "error") return LogLevel::kError;
  return absl::InvalidArgumentError(
      absl::StrCat("log level must be debug, info, warning or error, got \"", name, "\""));
}

void SetLogLevel(LogLevel level) { TheLog().logger->set_level(ToSpd(level)); }

bool LogEnabled(LogLevel level) { return TheLog().logger->should_log(ToSpd(level)); }

void LogEvent(LogLevel level, absl::string_view event, std::initializer_list<LogField> fields) {
  Log& log = TheLog();
  const spdlog::level::level_enum spd = ToSpd(level);
  if (!log.logger->should_log(spd)) return;
  std::string line = "\"event\":";
  line.append(Quote(event));
  for (const LogField& f : fields) {
    if (const auto* str = std::get_if<std::string>(&f.value); str != nullptr && str->empty()) {
      continue;
    }
    line.push_back(',');
    line.append(Quote(f.key));
    line.push_back(':');
    AppendValue(&line, f.value);
  }
  try {
    log.logger->log(spd, spdlog::string_view_t(line.data(), line.size()));
  } catch (...) {
    // A full disk or a closed stdout does not fail the call that logged.
  }
}

namespace {

// Keeps every formatted line, under the sink's own lock.
class CaptureSink : public spdlog::sinks::base_sink<std::mutex> {
 public:
  std::string Text() {
    std::lock_guard<std::mutex> lock(mutex_);
    return text_;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t buf;
    formatter_->format(msg, buf);
    text_.append(buf.data(), buf.size());
  }
  void flush_() override {}

 private:
  std::string text_;
};

}  // namespace

struct LogCapture::Impl {
  std::shared_ptr<CaptureSink> sink;
};

LogCapture::LogCapture() : impl_(new Impl()) {
  impl_->sink = std::make_shared<CaptureSink>();
  impl_->sink->set_formatter(LineFormatter());
  TheLog().sinks->add_sink(impl_->sink);
}

LogCapture::~LogCapture() {
  TheLog().sinks->remove_sink(impl_->sink);
  delete impl_;
}

std::string LogCapture::Text() const { return impl_->sink->Text(); }

}  // namespace ropeattn::server
