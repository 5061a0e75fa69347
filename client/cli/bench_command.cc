// `ropeattn bench`: the load generator (client/loadgen.h) on the command line.
//
// The shape flags are the shared ones from common.h (--heads, --kv_heads,
// --head_dim, --batch, --q_len, --k_len, --dtype, --causal, --rope_type, ...).
// The bench-only flags are parsed here, from a table, and taken out of argv
// before the shared parser sees it: absl flags are process-wide, and names
// such as --json or --kv_dtype may belong to other subcommands with other
// types.
//
// CSV columns (one row per point; CsvHeader() below):
//   mode            closed, constant or poisson
//   workload        attend or decode
//   concurrency     closed loop: workers; 0 in open loop
//   offered_rps     open loop: scheduled requests/s; 0 in closed loop
//   throughput_rps  successful requests/s over the final windows
//   tokens_per_s    their tokens/s (attend: batch * q_len; decode: step tokens)
//   p50_ms .. p999_ms, mean_ms, max_ms
//                   latency of every successful request in the final windows
//                   (open loop: from its scheduled send time)
//   requests        requests completed in the final windows, any status
//   ok, errors      of which successful / failed
//   late            open loop: requests sent after their scheduled time
//   codes           requests per status, "OK=120;RESOURCE_EXHAUSTED=3"
//   windows         measurement windows run
//   stable          1 if the last three windows' throughputs were within
//                   --stability of their mean, else 0
// then the workload (client::WorkloadFieldNames(): model, layer, hidden_size,
// batch, heads, kv_heads, head_dim, q_len, k_len, dtype, causal, rope,
// rope_factor, rope_original_max_positions, context, steps_per_session,
// tokens_per_step, kv_dtype, think_ms, step_rate, connections,
// max_outstanding; empty where a field does not apply), then
//   prefill_ok, prefill_p50_ms .. prefill_mean_ms, step_ok, step_p50_ms ..
//                   decode: first steps (open + prefill + first step) and the
//                   other steps apart (empty for attend)
//   server_method, server_requests, queue_*_ms, compute_*_ms
//                   --metrics_url: the server's queue and compute time of
//                   the workload's main method (Attend, Decode.Step) over the
//                   final windows (the JSON has every method)
//   search          --latency_threshold: pass or fail (empty in a sweep)
//   error_samples   up to 3 messages per non-OK code, "CODE: m1 | m2; CODE: m3"
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/cli/commands.h"
#include "client/cli/common.h"
#include "client/loadgen.h"

namespace ropeattn::cli {
namespace {

constexpr char kCommand[] = "bench";

constexpr char kCsvBaseHeader[] =
    "mode,workload,concurrency,offered_rps,throughput_rps,tokens_per_s,p50_ms,p90_ms,p95_ms,"
    "p99_ms,p999_ms,mean_ms,max_ms,requests,ok,errors,late,codes,windows,stable";
constexpr char kCsvStatsHeader[] =
    "prefill_ok,prefill_p50_ms,prefill_p90_ms,prefill_p99_ms,prefill_mean_ms,step_ok,step_p50_ms,"
    "step_p90_ms,step_p99_ms,step_mean_ms,server_method,server_requests,queue_mean_ms,"
    "queue_p50_ms,queue_p99_ms,compute_mean_ms,compute_p50_ms,compute_p99_ms,search,"
    "error_samples";
constexpr char kRequestsHeader[] =
    "point,kind,session_id,step,connection,scheduled_ms,sent_ms,latency_ms,code,late,window,"
    "counted";

std::string CsvHeader() {
  return absl::StrCat(kCsvBaseHeader, ",", absl::StrJoin(client::WorkloadFieldNames(), ","), ",",
                      kCsvStatsHeader);
}

constexpr absl::string_view kSharedFlags[] = {"heads",
                                              "kv_heads",
                                              "head_dim",
                                              "batch",
                                              "q_len",
                                              "k_len",
                                              "dtype",
                                              "causal",
                                              "rope",
                                              "rope_type",
                                              "rope_factor",
                                              "original_max_positions",
                                              "seed",
                                              "model",
                                              "layer"};

struct BenchFlags {
  std::string workload = "attend";
  std::string mode = "closed";
  std::string concurrency = "1,2,4";
  std::string rate = "50,100";
  double window_seconds = 2;
  double warmup_seconds = 1;
  int64_t max_windows = 10;
  double stability = 0.10;
  int64_t max_outstanding = 64;
  int64_t steps_per_session = 32;
  int64_t context = 128;
  int64_t tokens_per_step = 1;
  double think_ms = 0;
  std::string kv_dtype = "f32";
  std::string csv;
  std::string json;
  std::string plot;
  int64_t connections = 1;
  std::string requests_out;
  double latency_threshold = 0;
  int64_t search_max_points = 10;
  double search_max = 0;
  double search_resolution = 0.05;
  double step_rate = 0;
  std::string metrics_url;
};

struct OwnFlag {
  const char* name;
  std::string default_value;
  const char* help;
  std::function<bool(absl::string_view)> set;  // false when the value does not parse
};

std::vector<OwnFlag> OwnFlags(BenchFlags* f) {
  auto str = [](std::string* out) {
    return [out](absl::string_view v) {
      *out = std::string(v);
      return true;
    };
  };
  auto num = [](auto* out) {
    return [out](absl::string_view v) {
      if constexpr (std::is_same_v<std::remove_pointer_t<decltype(out)>, double>) {
        return absl::SimpleAtod(v, out);
      } else {
        return absl::SimpleAtoi(v, out);
      }
    };
  };
  auto d = [](double x) { return absl::StrCat(x); };
  return {
      {"workload", f->workload, "attend (unary Attend) or decode (Decode sessions).",
       str(&f->workload)},
      {"mode", f->mode,
       "closed (C workers back to back), constant or poisson (open loop at a rate; latency "
       "from the scheduled send time).",
       str(&f->mode)},
      {"concurrency", f->concurrency, "Closed loop: comma-separated worker counts to sweep.",
       str(&f->concurrency)},
      {"rate", f->rate,
       "Open loop: comma-separated requests/s to sweep (decode: steps/s; sessions start at "
       "rate / steps_per_session).",
       str(&f->rate)},
      {"window_seconds", d(f->window_seconds), "Length of one measurement window.",
       num(&f->window_seconds)},
      {"warmup_seconds", d(f->warmup_seconds), "Warm-up before the first window (not measured).",
       num(&f->warmup_seconds)},
      {"max_windows", absl::StrCat(f->max_windows),
       "Windows per point at most (>= 3); stable once the last 3 throughputs are within "
       "--stability of their mean.",
       num(&f->max_windows)},
      {"stability", d(f->stability), "Relative tolerance of the stability check.",
       num(&f->stability)},
      {"max_outstanding", absl::StrCat(f->max_outstanding),
       "Open loop: requests (decode: sessions) in flight at most; arrivals that find none free "
       "are sent late and counted.",
       num(&f->max_outstanding)},
      {"steps_per_session", absl::StrCat(f->steps_per_session), "Decode: steps per session.",
       num(&f->steps_per_session)},
      {"context", absl::StrCat(f->context),
       "Decode: tokens prefilled when a session opens (part of its first step's latency).",
       num(&f->context)},
      {"tokens_per_step", absl::StrCat(f->tokens_per_step), "Decode: tokens per step.",
       num(&f->tokens_per_step)},
      {"think_ms", d(f->think_ms), "Decode: pause between a step's answer and the next step.",
       num(&f->think_ms)},
      {"step_rate", d(f->step_rate),
       "Decode: steps/s of each session (open or closed loop). Step i is due at the session's "
       "start + i / step_rate and its latency runs from then (a step due before the previous "
       "one answered is sent at once and counted late). 0: back to back (after --think_ms).",
       num(&f->step_rate)},
      {"connections", absl::StrCat(f->connections),
       "TCP connections (gRPC channels) to spread requests over, round robin (decode: per "
       "session), 1-256.",
       num(&f->connections)},
      {"latency_threshold", d(f->latency_threshold),
       "Search instead of sweeping: the highest concurrency (closed) or rate (open) whose p99 "
       "(ms) stays at or under this, with no failed request. Doubles from the first "
       "--concurrency/--rate value until a level fails, then bisects; 0: sweep.",
       num(&f->latency_threshold)},
      {"search_max_points", absl::StrCat(f->search_max_points),
       "Search: points to probe at most.", num(&f->search_max_points)},
      {"search_max", d(f->search_max),
       "Search: highest level to probe (0: concurrency 4096, rate unbounded).",
       num(&f->search_max)},
      {"search_resolution", d(f->search_resolution),
       "Search, open loop: stop bisecting when the failing rate is within this fraction above "
       "the passing one (closed loop: at adjacent concurrencies).",
       num(&f->search_resolution)},
      {"metrics_url", f->metrics_url,
       "The server's Prometheus endpoint, e.g. http://127.0.0.1:9464/metrics: scraped after the "
       "warm-up and each window; each point reports the server's queue and compute time "
       "(ropeattn_queue_seconds, ropeattn_compute_seconds: mean, p50, p99 from the buckets) "
       "over its final windows.",
       str(&f->metrics_url)},
      {"requests_out", f->requests_out,
       "Write one line per request (every point, warm-up included) to this file: CSV, or JSON "
       "lines if the name ends in .jsonl or .ndjson (fields below).",
       str(&f->requests_out)},
      {"kv_dtype", f->kv_dtype, "Decode: KV cache dtype, f32, bf16 or int8.", str(&f->kv_dtype)},
      {"csv", f->csv, "Write one CSV row per sweep point to this file (columns below).",
       str(&f->csv)},
      {"json", f->json, "Write the results as JSON to this file.", str(&f->json)},
      {"plot", f->plot, "Write an SVG plot of p50 and p99 latency vs throughput to this file.",
       str(&f->plot)},
  };
}

std::string Usage(const std::vector<OwnFlag>& flags) {
  std::string text =
      "Load generator in the spirit of perf_analyzer: closed-loop concurrency sweeps or\n"
      "open-loop constant / Poisson rate sweeps, for unary Attend or Decode sessions.\n"
      "Each point: a warm-up, then windows until the last three throughputs agree.\n"
      "Percentiles come from every successful request of the final windows. Prints a\n"
      "table on stdout (and a progress line on a terminal).\n\nBench flags:\n";
  for (const OwnFlag& flag : flags) {
    absl::StrAppend(&text, "  --", flag.name, "\n      ", flag.help, " (default: \"",
                    flag.default_value, "\")\n");
  }
  absl::StrAppend(&text, "\nCSV columns: ", CsvHeader(),
                  "\n  concurrency is 0 in open loop, offered_rps 0 in closed loop; latencies in "
                  "ms of successful\n  requests (open loop: from the scheduled send time); "
                  "late = sent after their scheduled\n  time; codes = \"OK=n;CODE=n\"; stable = "
                  "1 or 0. The workload columns (model .. max_outstanding)\n  are empty where they "
                  "do not apply. prefill_* = decode first steps (open + prefill + first\n  step), "
                  "step_* = the other steps. server_* / queue_* / compute_*: --metrics_url, the "
                  "main\n  method (Attend, Decode.Step). search: pass/fail with "
                  "--latency_threshold. error_samples:\n  up to 3 messages per non-OK code."
                  "\n\n--requests_out fields: ", kRequestsHeader,
                  "\n  kind = attend, prefill (a session's first step: open + prefill + first "
                  "step) or step;\n  times in ms since the point's start; latency from "
                  "scheduled_ms; window 0 = warm-up,\n  -1 = after the last window; counted = 1 "
                  "if in the point's numbers.\n\nShape flags (attend: q [batch, q_len, heads, head_dim], k/v "
                  "[batch, k_len, kv_heads, head_dim];\ndecode: heads, kv_heads, head_dim, "
                  "dtype of the step tensors) are the shared ones.\n\nLayer mode (--model NAME "
                  "--layer L): both workloads run on the model's attention\nlayer with random "
                  "hidden states of its hidden_size (asked with GetModel): attend\nsends [batch, "
                  "q_len, hidden_size] (self-attention, --causal), decode prefills\n[1, context, "
                  "hidden_size] and steps [1, tokens_per_step, hidden_size]. The model's\nheads, "
                  "head_dim and RoPE apply; --heads, --kv_heads, --head_dim, --k_len and the "
                  "RoPE flags are\nrefused.\n\nA flag the workload does not read is refused "
                  "(exit 64): attend does not read\n--steps_per_session, --context, "
                  "--tokens_per_step, --think_ms, --step_rate, --kv_dtype;\ndecode does not read "
                  "--batch, --q_len, --k_len, --causal (its sessions are causal).\n\nShared "
                  "flags:");
  return text;
}

// Takes the bench-only flags out of argv; the rest goes to ParseSubcommand.
// Returns false (with *error) for a bad or missing value.
bool ExtractOwnFlags(int argc, char** argv, std::vector<OwnFlag>& flags, std::vector<char*>* rest,
                     std::string* error, std::set<std::string>* given) {
  rest->push_back(argv[0]);
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") {
      for (; i < argc; ++i) rest->push_back(argv[i]);
      break;
    }
    absl::string_view body = arg;
    if (!absl::ConsumePrefix(&body, "--") && !absl::ConsumePrefix(&body, "-")) {
      rest->push_back(argv[i]);
      continue;
    }
    absl::string_view name = body;
    std::optional<absl::string_view> value;
    if (size_t eq = body.find('='); eq != absl::string_view::npos) {
      name = body.substr(0, eq);
      value = body.substr(eq + 1);
    }
    auto it =
        std::find_if(flags.begin(), flags.end(), [&](const OwnFlag& f) { return name == f.name; });
    if (it == flags.end()) {
      rest->push_back(argv[i]);
      continue;
    }
    if (!value.has_value()) {
      if (i + 1 >= argc) {
        *error = absl::StrCat("flag --", name, " needs a value");
        return false;
      }
      value = argv[++i];
    }
    if (!it->set(*value)) {
      *error = absl::StrCat("bad value for --", name, ": '", *value, "'");
      return false;
    }
    given->insert(std::string(name));
  }
  return true;
}

absl::Status FileError(const std::string& path) {
  const std::string message = absl::StrCat("cannot write ", path, ": ", std::strerror(errno));
  if (errno == ENOENT) return absl::NotFoundError(message);
  if (errno == EACCES || errno == EPERM || errno == EROFS) {
    return absl::PermissionDeniedError(message);
  }
  return absl::InternalError(message);
}

absl::Status WriteFile(const std::string& path, const std::string& contents) {
  errno = 0;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return FileError(path);
  out << contents;
  out.close();
  if (!out) return FileError(path);
  return absl::OkStatus();
}

// RFC 4180: quoted when it holds a comma, a quote or a line break.
std::string CsvField(absl::string_view value) {
  if (value.find_first_of(",\"\r\n") == absl::string_view::npos) return std::string(value);
  return absl::StrCat("\"", absl::StrReplaceAll(value, {{"\"", "\"\""}}), "\"");
}

std::string FormatSamples(const std::map<absl::StatusCode, std::vector<std::string>>& samples) {
  return absl::StrJoin(samples, "; ", [](std::string* out, const auto& entry) {
    absl::StrAppend(out, absl::StatusCodeToString(entry.first), ": ",
                    absl::StrJoin(entry.second, " | "));
  });
}

// The server time of the workload's main method, if scraped.
const client::ServerTime* MainServerTime(const client::PointResult& r) {
  const char* main = r.workload == client::Workload::kAttend ? "Attend" : "Decode.Step";
  for (const client::ServerTime& t : r.server) {
    if (t.method == main) return &t;
  }
  return nullptr;
}

// "" for a point outside a search; "pass" / "fail" in one.
using Verdicts = std::vector<std::string>;

std::string CsvRow(const client::PointResult& r, const std::string& verdict) {
  const client::LatencyStats& l = r.latency;
  std::string row = absl::StrFormat(
      "%s,%s,%d,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f,%d,%d,%d,%d,%s,%d,%d",
      client::LoadModeName(r.mode), client::WorkloadName(r.workload), r.concurrency, r.offered_rps,
      r.throughput_rps, r.tokens_per_s, l.p50, l.p90, l.p95, l.p99, l.p999, l.mean, l.max,
      r.requests, r.ok, r.errors, r.late, client::FormatCodes(r.codes), r.windows,
      r.stable ? 1 : 0);
  for (const client::WorkloadField& f : r.workload_fields) {
    absl::StrAppend(&row, ",", CsvField(f.value));
  }
  if (r.workload == client::Workload::kDecode) {
    const client::LatencyStats& p = r.prefill_latency;
    const client::LatencyStats& s = r.step_latency;
    absl::StrAppendFormat(&row, ",%d,%.3f,%.3f,%.3f,%.3f,%d,%.3f,%.3f,%.3f,%.3f", r.prefill_ok,
                          p.p50, p.p90, p.p99, p.mean, r.step_ok, s.p50, s.p90, s.p99, s.mean);
  } else {
    absl::StrAppend(&row, ",,,,,,,,,,");
  }
  if (const client::ServerTime* t = MainServerTime(r); t != nullptr) {
    absl::StrAppendFormat(&row, ",%s,%d,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f", t->method,
                          std::max(t->queue_count, t->compute_count), t->queue_mean_ms,
                          t->queue_p50_ms, t->queue_p99_ms, t->compute_mean_ms, t->compute_p50_ms,
                          t->compute_p99_ms);
  } else {
    absl::StrAppend(&row, ",,,,,,,,");
  }
  absl::StrAppend(&row, ",", verdict, ",", CsvField(FormatSamples(r.error_samples)));
  return row;
}

std::string Csv(const std::vector<client::PointResult>& results, const Verdicts& verdicts) {
  std::string text = absl::StrCat(CsvHeader(), "\n");
  for (size_t i = 0; i < results.size(); ++i) {
    absl::StrAppend(&text, CsvRow(results[i], i < verdicts.size() ? verdicts[i] : ""), "\n");
  }
  return text;
}

std::string JsonString(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      absl::StrAppend(&out, "\\", std::string(1, c));
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppend(&out, absl::StrFormat("\\u%04x", c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string JsonNumber(double x) { return std::isfinite(x) ? absl::StrFormat("%.6g", x) : "null"; }

std::string JsonLatency(const client::LatencyStats& l) {
  return absl::StrCat("{\"p50\": ", JsonNumber(l.p50), ", \"p90\": ", JsonNumber(l.p90),
                      ", \"p95\": ", JsonNumber(l.p95), ", \"p99\": ", JsonNumber(l.p99),
                      ", \"p999\": ", JsonNumber(l.p999), ", \"mean\": ", JsonNumber(l.mean),
                      ", \"max\": ", JsonNumber(l.max), "}");
}

// The point's workload, one object: mode, workload, load level and shapes.
std::string JsonWorkload(const client::PointResult& r) {
  std::vector<std::string> fields = {
      absl::StrCat("\"mode\": ", JsonString(client::LoadModeName(r.mode))),
      absl::StrCat("\"workload\": ", JsonString(client::WorkloadName(r.workload))),
      r.mode == client::LoadMode::kClosed
          ? absl::StrCat("\"concurrency\": ", r.concurrency)
          : absl::StrCat("\"offered_rps\": ", JsonNumber(r.offered_rps))};
  for (const client::WorkloadField& f : r.workload_fields) {
    if (f.value.empty()) continue;  // does not apply
    fields.push_back(absl::StrCat(JsonString(f.name), ": ",
                                  f.numeric ? f.value : JsonString(f.value)));
  }
  return absl::StrCat("{", absl::StrJoin(fields, ", "), "}");
}

struct SearchReport {
  client::SearchSpec spec;
  client::SearchResult result;
};

std::string Json(const client::LoadSpec& spec, const std::string& target,
                 const std::vector<client::PointResult>& results, const Verdicts& verdicts,
                 const SearchReport* search) {
  std::string text =
      absl::StrCat("{\n  \"target\": ", JsonString(target),
                   ",\n  \"workload\": ", JsonString(client::WorkloadName(spec.workload)),
                   ",\n  \"mode\": ", JsonString(client::LoadModeName(spec.mode)),
                   spec.model.empty() ? ""
                                      : absl::StrCat(",\n  \"model\": ", JsonString(spec.model),
                                                     ",\n  \"layer\": ", spec.layer),
                   ",\n  \"window_seconds\": ", JsonNumber(absl::ToDoubleSeconds(spec.window)),
                   ",\n  \"warmup_seconds\": ", JsonNumber(absl::ToDoubleSeconds(spec.warmup)),
                   ",\n  \"max_windows\": ", spec.max_windows);
  if (!spec.metrics_url.empty()) {
    absl::StrAppend(&text, ",\n  \"metrics_url\": ", JsonString(spec.metrics_url));
  }
  if (search != nullptr) {
    const client::SearchSpec& s = search->spec;
    const client::SearchResult& r = search->result;
    absl::StrAppend(
        &text, ",\n  \"search\": {\"latency_threshold_ms\": ", JsonNumber(s.latency_threshold_ms),
        ", \"start\": ", JsonNumber(s.start), ", \"max_level\": ", JsonNumber(s.max_level),
        ", \"max_points\": ", s.max_points, ", \"resolution\": ", JsonNumber(s.resolution),
        ", \"found\": ", r.found ? "true" : "false", ", \"best\": ", JsonNumber(r.best),
        ", \"lowest_failed\": ", JsonNumber(r.lowest_failed),
        ", \"stopped\": ", JsonString(r.stopped), "}");
  }
  absl::StrAppend(&text, ",\n  \"points\": [");
  for (size_t i = 0; i < results.size(); ++i) {
    const client::PointResult& r = results[i];
    std::vector<std::string> codes;
    for (const auto& [code, n] : r.codes) {
      codes.push_back(absl::StrCat(JsonString(absl::StatusCodeToString(code)), ": ", n));
    }
    std::vector<std::string> samples;
    for (const auto& [code, messages] : r.error_samples) {
      std::vector<std::string> quoted;
      for (const std::string& m : messages) quoted.push_back(JsonString(m));
      samples.push_back(absl::StrCat(JsonString(absl::StatusCodeToString(code)), ": [",
                                     absl::StrJoin(quoted, ", "), "]"));
    }
    std::vector<std::string> windows;
    for (double t : r.window_throughputs) windows.push_back(JsonNumber(t));
    absl::StrAppend(&text, i == 0 ? "\n" : ",\n", "    {\"workload\": ", JsonWorkload(r),
                    ",\n     \"concurrency\": ", r.concurrency,
                    ", \"offered_rps\": ", JsonNumber(r.offered_rps),
                    ", \"connections\": ", r.connections,
                    ", \"throughput_rps\": ", JsonNumber(r.throughput_rps),
                    ", \"tokens_per_s\": ", JsonNumber(r.tokens_per_s),
                    ",\n     \"latency_ms\": ", JsonLatency(r.latency));
    if (r.workload == client::Workload::kDecode) {
      absl::StrAppend(&text, ",\n     \"prefill_ok\": ", r.prefill_ok,
                      ", \"prefill_latency_ms\": ", JsonLatency(r.prefill_latency),
                      ",\n     \"step_ok\": ", r.step_ok,
                      ", \"step_latency_ms\": ", JsonLatency(r.step_latency));
    }
    absl::StrAppend(&text, ",\n     \"requests\": ", r.requests, ", \"ok\": ", r.ok,
                    ", \"errors\": ", r.errors, ", \"late\": ", r.late, ", \"codes\": {",
                    absl::StrJoin(codes, ", "), "}, \"error_samples\": {",
                    absl::StrJoin(samples, ", "), "}, \"windows\": ", r.windows,
                    ", \"stable\": ", r.stable ? "true" : "false");
    if (!spec.metrics_url.empty()) {
      std::vector<std::string> server;
      for (const client::ServerTime& t : r.server) {
        server.push_back(absl::StrCat(
            "{\"method\": ", JsonString(t.method), ", \"queue\": {\"count\": ", t.queue_count,
            ", \"mean_ms\": ", JsonNumber(t.queue_mean_ms), ", \"p50_ms\": ",
            JsonNumber(t.queue_p50_ms), ", \"p99_ms\": ", JsonNumber(t.queue_p99_ms),
            "}, \"compute\": {\"count\": ", t.compute_count, ", \"mean_ms\": ",
            JsonNumber(t.compute_mean_ms), ", \"p50_ms\": ", JsonNumber(t.compute_p50_ms),
            ", \"p99_ms\": ", JsonNumber(t.compute_p99_ms), "}}"));
      }
      absl::StrAppend(&text, ",\n     \"server\": [", absl::StrJoin(server, ",\n       "), "]");
      if (!r.server_error.empty()) {
        absl::StrAppend(&text, ", \"server_error\": ", JsonString(r.server_error));
      }
    }
    if (i < verdicts.size() && !verdicts[i].empty()) {
      absl::StrAppend(&text, ", \"search\": ", JsonString(verdicts[i]));
    }
    absl::StrAppend(&text, ",\n     \"window_throughputs\": [", absl::StrJoin(windows, ", "),
                    "]}");
  }
  absl::StrAppend(&text, results.empty() ? "]\n}\n" : "\n  ]\n}\n");
  return text;
}

// One line per request of every point (--requests_out): CSV or JSON lines.
std::string RequestLines(const std::vector<client::PointResult>& results, bool json_lines) {
  std::string text = json_lines ? "" : absl::StrCat(kRequestsHeader, "\n");
  for (const client::PointResult& point : results) {
    for (const client::RequestRecord& r : point.request_log) {
      const std::string code(absl::StatusCodeToString(r.code));
      if (json_lines) {
        absl::StrAppend(
            &text, "{\"point\": ", r.point, ", \"kind\": ", JsonString(client::RequestKindName(r.kind)),
            ", \"session_id\": ", JsonString(r.session_id), ", \"step\": ", r.step,
            ", \"connection\": ", r.connection, ", \"scheduled_ms\": ",
            absl::StrFormat("%.3f", r.scheduled_ms), ", \"sent_ms\": ",
            absl::StrFormat("%.3f", r.sent_ms), ", \"latency_ms\": ",
            absl::StrFormat("%.3f", r.latency_ms), ", \"code\": ", JsonString(code),
            ", \"late\": ", r.late ? "true" : "false", ", \"window\": ", r.window,
            ", \"counted\": ", r.counted ? "true" : "false", "}\n");
      } else {
        absl::StrAppendFormat(&text, "%d,%s,%s,%d,%d,%.3f,%.3f,%.3f,%s,%d,%d,%d\n", r.point,
                              client::RequestKindName(r.kind), CsvField(r.session_id), r.step,
                              r.connection, r.scheduled_ms, r.sent_ms, r.latency_ms, code,
                              r.late ? 1 : 0, r.window, r.counted ? 1 : 0);
      }
    }
  }
  return text;
}

// A "nice" tick step (1, 2 or 5 times a power of ten) for about `n` ticks.
double TickStep(double range, int n) {
  if (!(range > 0)) return 1;
  const double raw = range / n;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0}) {
    if (m * p >= raw) return m * p;
  }
  return 10 * p;
}

// Latency (p50, p99) vs achieved throughput, points joined in sweep order.
std::string Svg(const client::LoadSpec& spec, const std::vector<client::PointResult>& results) {
  constexpr double kW = 640, kH = 420, kLeft = 70, kRight = 20, kTop = 40, kBottom = 60;
  const double plot_w = kW - kLeft - kRight, plot_h = kH - kTop - kBottom;
  double x_max = 0, y_max = 0;
  for (const auto& r : results) {
    x_max = std::max(x_max, r.throughput_rps);
    y_max = std::max({y_max, r.latency.p99, r.latency.p50});
  }
  const double x_step = TickStep(x_max > 0 ? x_max * 1.05 : 1, 5);
  const double y_step = TickStep(y_max > 0 ? y_max * 1.05 : 1, 5);
  x_max = x_step * std::ceil((x_max > 0 ? x_max * 1.05 : 1) / x_step);
  y_max = y_step * std::ceil((y_max > 0 ? y_max * 1.05 : 1) / y_step);
  auto px = [&](double x) { return kLeft + plot_w * x / x_max; };
  auto py = [&](double y) { return kTop + plot_h * (1 - y / y_max); };

  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" "
      "viewBox=\"0 0 %g %g\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%g\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">ropeattn bench: %s, %s "
      "loop</text>\n",
      kW, kH, kW, kH, kW / 2, client::WorkloadName(spec.workload), client::LoadModeName(spec.mode));
  // Grid and ticks.
  for (double x = 0; x <= x_max + x_step / 2; x += x_step) {
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%.1f\" y1=\"%g\" x2=\"%.1f\" y2=\"%g\" stroke=\"#ddd\"/>\n"
                          "<text x=\"%.1f\" y=\"%g\" text-anchor=\"middle\">%g</text>\n",
                          px(x), kTop, px(x), kTop + plot_h, px(x), kTop + plot_h + 16, x);
  }
  for (double y = 0; y <= y_max + y_step / 2; y += y_step) {
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"#ddd\"/>\n"
                          "<text x=\"%g\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
                          kLeft, py(y), kLeft + plot_w, py(y), kLeft - 6, py(y) + 4, y);
  }
  absl::StrAppendFormat(&svg,
                        "<rect x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"none\" "
                        "stroke=\"black\"/>\n"
                        "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">achieved throughput "
                        "(%s/s)</text>\n"
                        "<text x=\"16\" y=\"%g\" text-anchor=\"middle\" "
                        "transform=\"rotate(-90 16 %g)\">latency (ms)</text>\n",
                        kLeft, kTop, plot_w, plot_h, kLeft + plot_w / 2, kH - 18,
                        spec.workload == client::Workload::kDecode ? "steps" : "requests",
                        kTop + plot_h / 2, kTop + plot_h / 2);
  struct Series {
    const char* name;
    const char* color;
    double client::LatencyStats::*field;
  };
  const Series series[] = {{"p50", "#1f77b4", &client::LatencyStats::p50},
                           {"p99", "#d62728", &client::LatencyStats::p99}};
  for (const Series& s : series) {
    std::vector<std::string> points;
    for (const auto& r : results) {
      points.push_back(absl::StrFormat("%.1f,%.1f", px(r.throughput_rps), py(r.latency.*s.field)));
    }
    absl::StrAppendFormat(&svg,
                          "<polyline class=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"2\" "
                          "points=\"%s\"/>\n",
                          s.name, s.color, absl::StrJoin(points, " "));
    for (const std::string& p : points) {
      std::vector<absl::string_view> xy = absl::StrSplit(p, ',');
      absl::StrAppendFormat(&svg, "<circle cx=\"%s\" cy=\"%s\" r=\"3.5\" fill=\"%s\"/>\n", xy[0],
                            xy[1], s.color);
    }
  }
  // Each point's load level, above its p99 marker.
  for (const auto& r : results) {
    const std::string label = r.mode == client::LoadMode::kClosed
                                  ? absl::StrCat("c=", r.concurrency)
                                  : absl::StrFormat("%g/s", r.offered_rps);
    absl::StrAppendFormat(&svg,
                          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" font-size=\"10\" "
                          "fill=\"#555\">%s</text>\n",
                          px(r.throughput_rps), py(r.latency.p99) - 8, label);
  }
  // Legend.
  const double lx = kLeft + 12, ly = kTop + 12;
  absl::StrAppendFormat(&svg,
                        "<rect x=\"%g\" y=\"%g\" width=\"70\" height=\"44\" fill=\"white\" "
                        "stroke=\"#999\"/>\n",
                        lx, ly);
  for (int i = 0; i < 2; ++i) {
    const double y = ly + 15 + 18 * i;
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"%s\" "
                          "stroke-width=\"2\"/>\n<text x=\"%g\" y=\"%g\">%s</text>\n",
                          lx + 8, y, lx + 32, y, series[i].color, lx + 38, y + 4, series[i].name);
  }
  svg += "</svg>\n";
  return svg;
}

void PrintTable(const std::vector<client::PointResult>& results, const Verdicts& verdicts) {
  std::cout << absl::StrFormat(
      "%-8s %-8s %6s %9s %10s %10s %9s %9s %9s %9s %9s %8s %7s %6s %4s %s\n", "mode", "workload",
      "conc", "offered", "req/s", "tokens/s", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "max ms",
      "ok", "errors", "late", "win", "stable");
  for (size_t i = 0; i < results.size(); ++i) {
    const client::PointResult& r = results[i];
    const bool closed = r.mode == client::LoadMode::kClosed;
    std::cout << absl::StrFormat(
        "%-8s %-8s %6s %9s %10.1f %10.1f %9.3f %9.3f %9.3f %9.3f %9.3f %8d %7d %6d %4d %s%s\n",
        client::LoadModeName(r.mode), client::WorkloadName(r.workload),
        closed ? absl::StrCat(r.concurrency) : "-",
        closed ? "-" : absl::StrFormat("%.1f", r.offered_rps), r.throughput_rps, r.tokens_per_s,
        r.latency.p50, r.latency.p90, r.latency.p99, r.latency.p999, r.latency.max, r.ok, r.errors,
        r.late, r.windows, r.stable ? "yes" : "no",
        i < verdicts.size() && !verdicts[i].empty() ? absl::StrCat("  ", verdicts[i]) : "");
    if (r.workload == client::Workload::kDecode) {
      std::cout << absl::StrFormat(
          "         prefill (first step): %d ok, p50 %.3f p99 %.3f ms;  steps: %d ok, p50 %.3f "
          "p99 %.3f ms\n",
          r.prefill_ok, r.prefill_latency.p50, r.prefill_latency.p99, r.step_ok,
          r.step_latency.p50, r.step_latency.p99);
    }
    for (const client::ServerTime& t : r.server) {
      std::cout << absl::StrFormat(
          "         server %-12s queue mean %.3f p50 %.3f p99 %.3f ms;  compute mean %.3f p50 "
          "%.3f p99 %.3f ms  (%d)\n",
          t.method, t.queue_mean_ms, t.queue_p50_ms, t.queue_p99_ms, t.compute_mean_ms,
          t.compute_p50_ms, t.compute_p99_ms, std::max(t.queue_count, t.compute_count));
    }
    if (!r.server_error.empty()) std::cout << "         server: " << r.server_error << "\n";
    if (r.errors > 0) std::cout << "         codes: " << client::FormatCodes(r.codes) << "\n";
    for (const auto& [code, messages] : r.error_samples) {
      for (const std::string& m : messages) {
        std::cout << "         " << absl::StatusCodeToString(code) << ": " << m << "\n";
      }
    }
  }
  std::cout << std::flush;
}

// The flags the workload reads (in layer mode or not), from the bench
// flags (`own`, `given` those on the command line) and the shared ones; a
// refusal naming the first other flag given, if any: an Attend load with
// --kv_dtype int8 ran f32 and exited 0.
std::optional<std::string> UnreadFlag(client::Workload workload, const std::vector<OwnFlag>& own,
                                      const std::set<std::string>& given) {
  const bool attend = workload == client::Workload::kAttend;
  const bool layer_mode = !absl::GetFlag(FLAGS_model).empty();
  constexpr absl::string_view kDecodeOnly[] = {"steps_per_session", "context", "tokens_per_step",
                                               "think_ms",          "step_rate", "kv_dtype"};
  std::vector<absl::string_view> reads = {"seed", "dtype", "model"};
  for (const OwnFlag& flag : own) {
    const bool decode_only =
        std::find(std::begin(kDecodeOnly), std::end(kDecodeOnly), flag.name) !=
        std::end(kDecodeOnly);
    if (!attend || !decode_only) reads.push_back(flag.name);
  }
  if (attend) reads.insert(reads.end(), {"batch", "q_len", "causal"});
  if (layer_mode) {
    reads.push_back("layer");  // the model's heads, head_dim and RoPE
  } else if (attend) {
    reads.insert(reads.end(), {"heads", "kv_heads", "head_dim", "k_len", "rope", "rope_type",
                               "rope_factor", "original_max_positions"});
  } else {
    // The default rule or none (a --rope_type other than default is refused
    // before this).
    reads.insert(reads.end(), {"heads", "kv_heads", "head_dim", "rope", "rope_type"});
  }
  std::vector<absl::string_view> all;
  for (const OwnFlag& flag : own) all.push_back(flag.name);
  all.insert(all.end(), std::begin(kSharedFlags), std::end(kSharedFlags));
  for (absl::string_view flag : all) {
    const bool is_given = given.count(std::string(flag)) > 0 || FlagGiven(flag);
    if (!is_given || std::find(reads.begin(), reads.end(), flag) != reads.end()) continue;
    if (flag == "layer") return "--layer is read only with --model (layer mode)";
    return absl::StrCat("--", flag, " is not read by the ", attend ? "attend" : "decode",
                        " workload",
                        layer_mode ? " in layer mode (the model's heads, head_dim and RoPE apply)"
                                   : "");
  }
  return std::nullopt;
}

}  // namespace

int BenchCommand(int argc, char** argv) {
  BenchFlags f;
  std::vector<OwnFlag> own = OwnFlags(&f);
  std::vector<char*> rest;
  std::string error;
  std::set<std::string> given;
  if (!ExtractOwnFlags(argc, argv, own, &rest, &error, &given)) return UsageFail(kCommand, error);
  int exit_code = 0;
  std::optional<std::vector<std::string>> positional =
      ParseSubcommand(static_cast<int>(rest.size()), rest.data(), Usage(own), kSharedFlags,
                      /*connection=*/true, &exit_code);
  if (!positional.has_value()) return exit_code;
  if (!positional->empty()) {
    return UsageFail(kCommand, absl::StrCat("unexpected argument \"", (*positional)[0], "\""));
  }

  client::LoadSpec spec;
  absl::StatusOr<client::Workload> workload = client::ParseWorkload(f.workload);
  if (!workload.ok()) return UsageFail(kCommand, workload.status().message());
  absl::StatusOr<client::LoadMode> mode = client::ParseLoadMode(f.mode);
  if (!mode.ok()) return UsageFail(kCommand, mode.status().message());
  spec.workload = *workload;
  spec.mode = *mode;
  // A flag the chosen mode does not read is refused, not ignored.
  if (spec.mode == client::LoadMode::kClosed && given.count("rate") > 0) {
    return UsageFail(kCommand, "--rate is for --mode constant or poisson; closed loop takes "
                               "--concurrency");
  }
  if (spec.mode != client::LoadMode::kClosed && given.count("concurrency") > 0) {
    return UsageFail(kCommand, "--concurrency is for --mode closed; open loop takes --rate");
  }
  if (spec.mode == client::LoadMode::kClosed && given.count("max_outstanding") > 0) {
    return UsageFail(kCommand, "--max_outstanding is for --mode constant or poisson (open loop); "
                               "closed loop has --concurrency requests outstanding");
  }
  // The search flags are read only by a search (--latency_threshold).
  if (f.latency_threshold == 0) {
    for (const char* name : {"search_max_points", "search_max", "search_resolution"}) {
      if (given.count(name) > 0) {
        return UsageFail(kCommand, absl::StrCat("--", name,
                                                " is read only with --latency_threshold (a "
                                                "search); without it the levels are swept"));
      }
    }
  }
  if (spec.mode == client::LoadMode::kClosed) {
    absl::StatusOr<std::vector<int64_t>> list = ParseIntList("concurrency", f.concurrency);
    if (!list.ok()) return UsageFail(kCommand, list.status().message());
    spec.concurrency.clear();
    for (int64_t c : *list) {
      if (c < 1 || c > 4096) {
        return Fail(kCommand, absl::InvalidArgumentError(
                                  absl::StrCat("--concurrency must be in [1, 4096], got ", c)));
      }
      spec.concurrency.push_back(static_cast<int>(c));
    }
  } else {
    spec.rates.clear();
    // Every element a number: "50,,100" is a typo, not [50, 100].
    for (absl::string_view part : absl::StrSplit(f.rate, ',')) {
      double r;
      if (!absl::SimpleAtod(part, &r)) {
        return UsageFail(
            kCommand, absl::StrCat("--rate must be comma-separated numbers, got \"", part, "\""));
      }
      spec.rates.push_back(r);
    }
  }
  spec.max_outstanding = static_cast<int>(std::clamp<int64_t>(f.max_outstanding, -1, 1 << 16));
  auto seconds = [](double s) {
    return std::isfinite(s) ? absl::Seconds(s) : absl::InfiniteDuration();
  };
  spec.window = seconds(f.window_seconds);
  spec.warmup = seconds(f.warmup_seconds);
  spec.max_windows = static_cast<int>(std::clamp<int64_t>(f.max_windows, -1, 1 << 20));
  spec.stability = f.stability;
  spec.request_deadline = seconds(absl::GetFlag(FLAGS_deadline_seconds));
  spec.seed = absl::GetFlag(FLAGS_seed);

  absl::StatusOr<v1::DType> dtype = ParseDType("dtype", absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return Fail(kCommand, dtype.status());
  client::AttendShape& a = spec.attend;
  a.batch = absl::GetFlag(FLAGS_batch);
  a.heads = absl::GetFlag(FLAGS_heads);
  a.kv_heads = absl::GetFlag(FLAGS_kv_heads);
  a.head_dim = absl::GetFlag(FLAGS_head_dim);
  a.q_len = absl::GetFlag(FLAGS_q_len);
  a.k_len = absl::GetFlag(FLAGS_k_len) == 0 ? a.q_len : absl::GetFlag(FLAGS_k_len);
  a.dtype = *dtype;
  a.causal = absl::GetFlag(FLAGS_causal);
  // RoPE as in the other commands: off unless --rope or a RoPE flag.
  const bool rope_flags = FlagGiven("rope_type") || FlagGiven("rope_factor") ||
                          FlagGiven("original_max_positions");
  const bool rope = absl::GetFlag(FLAGS_rope) || rope_flags;
  if (FlagGiven("rope") && !absl::GetFlag(FLAGS_rope) && rope_flags) {
    return UsageFail(kCommand, "--norope conflicts with the RoPE flags given");
  }
  a.rope_type = rope ? absl::GetFlag(FLAGS_rope_type) : "none";
  if (*workload == client::Workload::kDecode &&
      ((FlagGiven("rope_type") && absl::GetFlag(FLAGS_rope_type) != "default") ||
       FlagGiven("rope_factor") || FlagGiven("original_max_positions"))) {
    return UsageFail(kCommand,
                     "the decode workload runs the default RoPE rule (--rope) or none; "
                     "--rope_type, --rope_factor and --original_max_positions are for "
                     "--workload attend");
  }
  if (std::optional<std::string> unread = UnreadFlag(*workload, own, given); unread.has_value()) {
    return UsageFail(kCommand, *unread);
  }
  a.rope_factor = absl::GetFlag(FLAGS_rope_factor);
  a.original_max_positions = absl::GetFlag(FLAGS_original_max_positions);
  client::DecodeShape& d = spec.decode;
  d.heads = a.heads;
  d.kv_heads = a.kv_heads;
  d.head_dim = a.head_dim;
  d.steps_per_session = f.steps_per_session;
  d.context = f.context;
  d.tokens_per_step = f.tokens_per_step;
  d.think_time = seconds(f.think_ms / 1000);
  d.step_rate = f.step_rate;
  d.dtype = *dtype;
  absl::StatusOr<v1::DType> kv_dtype = ParseKvDType("kv_dtype", f.kv_dtype);
  if (!kv_dtype.ok()) return Fail(kCommand, kv_dtype.status());
  d.kv_dtype = *kv_dtype;
  d.rope = rope;
  spec.model = absl::GetFlag(FLAGS_model);
  spec.layer = absl::GetFlag(FLAGS_layer);
  spec.metrics_url = f.metrics_url;
  spec.record_requests = !f.requests_out.empty();
  // Sizes are checked, naming the flag and the value given, before any
  // arithmetic on them (context + steps_per_session * tokens_per_step
  // overflowed int64) or any tensor is generated from them.
  {
    constexpr int64_t kMax = int64_t{1} << 24;
    const bool attend = *workload == client::Workload::kAttend;
    std::vector<std::tuple<const char*, int64_t, int64_t>> sizes = {
        {"heads", a.heads, 1}, {"kv_heads", a.kv_heads, 0}, {"head_dim", a.head_dim, 1}};
    if (attend) {
      sizes.insert(sizes.end(), {{"batch", a.batch, 1}, {"q_len", a.q_len, 1},
                                 {"k_len", a.k_len, 1}});
    } else {
      sizes.insert(sizes.end(), {{"steps_per_session", d.steps_per_session, 1},
                                 {"context", d.context, 0},
                                 {"tokens_per_step", d.tokens_per_step, 1}});
    }
    for (const auto& [name, value, least] : sizes) {
      if (value < least || value > kMax) {
        return Fail(kCommand, absl::InvalidArgumentError(absl::StrCat(
                                  "--", name, " must be in [", least, ", 2^24], got ", value)));
      }
    }
    // Random payloads that could never be sent are refused before they are
    // generated (layer mode: the model's hidden size is not known yet).
    const int64_t max_bytes = absl::GetFlag(FLAGS_max_message_bytes);
    if (spec.model.empty() && max_bytes > 0) {
      const double elem = *dtype == v1::DTYPE_BF16 ? 2 : 4;
      const double kv = static_cast<double>(a.kv_heads == 0 ? a.heads : a.kv_heads);
      const double per_token = elem * (static_cast<double>(a.heads) + 2 * kv) * a.head_dim;
      auto too_big = [&](double bytes, const std::string& what) -> std::optional<absl::Status> {
        if (bytes <= static_cast<double>(max_bytes)) return std::nullopt;
        return absl::ResourceExhaustedError(
            absl::StrFormat("%s is %.0f bytes of q, k and v, more than --max_message_bytes %d; "
                            "not generated",
                            what, bytes, max_bytes));
      };
      std::optional<absl::Status> refused;
      if (attend) {
        refused = too_big(elem * a.batch *
                              (static_cast<double>(a.q_len) * a.heads * a.head_dim +
                               2 * static_cast<double>(a.k_len) * kv * a.head_dim),
                          absl::StrCat("an Attend of --batch ", a.batch, ", --q_len ", a.q_len,
                                       ", --k_len ", a.k_len));
      } else {
        refused = too_big(per_token * static_cast<double>(d.context),
                          absl::StrCat("the prefill of --context ", d.context));
        if (!refused.has_value()) {
          refused = too_big(per_token * static_cast<double>(d.tokens_per_step),
                            absl::StrCat("a step of --tokens_per_step ", d.tokens_per_step));
        }
      }
      if (refused.has_value()) return Fail(kCommand, *refused);
    }
  }
  if (absl::Status s = client::ValidateLoadSpec(spec); !s.ok()) return Fail(kCommand, s);
  if (f.connections < 1 || f.connections > 256) {
    return Fail(kCommand, absl::InvalidArgumentError(absl::StrCat(
                              "--connections must be in [1, 256], got ", f.connections)));
  }
  const bool searching = f.latency_threshold != 0;
  client::SearchSpec search;
  if (searching) {
    search.latency_threshold_ms = f.latency_threshold;
    search.start = spec.mode == client::LoadMode::kClosed ? spec.concurrency[0] : spec.rates[0];
    search.max_level = f.search_max;
    search.max_points = static_cast<int>(std::clamp<int64_t>(f.search_max_points, -1, 1 << 16));
    search.resolution = f.search_resolution;
  }

  const bool tty = isatty(STDERR_FILENO) == 1;
  if (tty) {
    spec.on_window = [](const client::WindowProgress& p) {
      const std::string load = p.mode == client::LoadMode::kClosed
                                   ? absl::StrCat("concurrency ", p.concurrency)
                                   : absl::StrFormat("rate %.1f/s", p.offered_rps);
      const std::string stage = p.window == 0
                                    ? std::string("warm-up")
                                    : absl::StrCat("window ", p.window, "/", p.max_windows);
      std::cerr << absl::StrFormat("\r\033[K[%d/%d] %s  %s  %.1f req/s  %d errors", p.point + 1,
                                   p.points, load, stage, p.throughput_rps, p.errors)
                << std::flush;
    };
  }

  // Output files are checked before the run, not after it.
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"csv", f.csv},
                                   {"json", f.json},
                                   {"plot", f.plot},
                                   {"requests_out", f.requests_out}}) {
    if (absl::Status s = CheckOutputPath(flag, path); !s.ok()) return Fail(kCommand, s);
  }

  // The flags make one Client (its options: target, TLS, token, limits);
  // --connections N makes N with those options, each on its own connection.
  absl::StatusOr<std::unique_ptr<client::Client>> first = ConnectFromFlags();
  if (!first.ok()) return Fail(kCommand, first.status());
  absl::StatusOr<std::vector<std::unique_ptr<client::Client>>> owned =
      client::ConnectClients((*first)->options(), static_cast<int>(f.connections));
  if (!owned.ok()) return Fail(kCommand, owned.status());
  std::vector<client::Client*> clients;
  for (const auto& c : *owned) clients.push_back(c.get());

  std::vector<client::PointResult> results;
  Verdicts verdicts;
  std::optional<SearchReport> report;
  if (searching) {
    absl::StatusOr<client::SearchResult> found = client::SearchLoad(clients, spec, search);
    if (tty) std::cerr << "\r\033[K" << std::flush;
    if (!found.ok()) return Fail(kCommand, found.status());
    report = SearchReport{search, *found};
    results = found->points;
    for (bool passed : found->passed) verdicts.push_back(passed ? "pass" : "fail");
  } else {
    absl::StatusOr<std::vector<client::PointResult>> swept = client::RunLoad(clients, spec);
    if (tty) std::cerr << "\r\033[K" << std::flush;
    if (!swept.ok()) return Fail(kCommand, swept.status());
    results = *std::move(swept);
  }

  PrintTable(results, verdicts);
  if (report.has_value()) {
    const bool closed = spec.mode == client::LoadMode::kClosed;
    const client::SearchResult& r = report->result;
    const std::string unit = closed ? "concurrency" : "rate";
    std::cout << absl::StrFormat("search: p99 <= %g ms with no errors: ", search.latency_threshold_ms)
              << (r.found ? absl::StrFormat("highest passing %s %g", unit, r.best)
                          : absl::StrCat("no ", unit, " passed"))
              << (r.lowest_failed > 0
                      ? absl::StrFormat(", lowest failing %g", r.lowest_failed)
                      : std::string())
              << absl::StrFormat(" (%d points, stopped: %s)\n", results.size(), r.stopped);
  }
  const std::string target = absl::GetFlag(FLAGS_target);
  if (!f.csv.empty()) {
    if (absl::Status s = WriteFile(f.csv, Csv(results, verdicts)); !s.ok()) {
      return Fail(kCommand, s);
    }
  }
  if (!f.json.empty()) {
    if (absl::Status s = WriteFile(
            f.json, Json(spec, target, results, verdicts, report.has_value() ? &*report : nullptr));
        !s.ok()) {
      return Fail(kCommand, s);
    }
  }
  if (!f.requests_out.empty()) {
    const bool json_lines =
        absl::EndsWith(f.requests_out, ".jsonl") || absl::EndsWith(f.requests_out, ".ndjson");
    if (absl::Status s = WriteFile(f.requests_out, RequestLines(results, json_lines)); !s.ok()) {
      return Fail(kCommand, s);
    }
  }
  if (!f.plot.empty()) {
    if (absl::Status s = WriteFile(f.plot, Svg(spec, results)); !s.ok()) {
      return Fail(kCommand, s);
    }
  }
  return 0;
}

}  // namespace ropeattn::cli
