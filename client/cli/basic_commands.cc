// health, info, sessions, models, attend, encode, embed and decode.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/cli/commands.h"
#include "client/cli/common.h"
#include "google/protobuf/util/json_util.h"

ABSL_FLAG(std::string, service, "", "Health service name to check; empty means the whole server.");
ABSL_FLAG(bool, json, false, "Print JSON (proto3 JSON mapping) instead of a table.");
ABSL_FLAG(std::string, close, "", "Close the session with this id instead of listing.");
ABSL_FLAG(std::string, name, "", "Show this model in detail (with its inverse frequencies).");
ABSL_FLAG(std::string, tokens, "", "embed: comma-separated token ids, B * S of them, row-major.");
ABSL_FLAG(std::string, shape, "", "embed: B,S of the token ids; empty means 1,<number of ids>.");

ABSL_FLAG(bool, return_probs, false, "Also return the attention probabilities [B, H, Sq, Sk].");
ABSL_FLAG(std::string, probs_out, "",
          "Write the probabilities to this .npy (implies --return_probs).");

ABSL_FLAG(std::string, op, "",
          "Encode op: sinusoidal, rope_frequencies, rope_cos_sin, rope_apply, alibi, t5.");
ABSL_FLAG(std::string, positions, "",
          "Comma-separated positions (rope_cos_sin: default 0..num_positions-1; rope_apply: "
          "B*S explicit positions).");
ABSL_FLAG(std::string, offsets, "",
          "Comma-separated per-row position offsets (encode rope_apply; embed and layer-mode "
          "attend: the position of each row's token 0, default 0).");
ABSL_FLAG(bool, inverse, false, "rope_apply: undo the rotation instead of applying it.");
ABSL_FLAG(std::string, x, "",
          "rope_apply: input .npy [B, S, H, D]; random [batch, q_len, heads, head_dim] if empty.");
ABSL_FLAG(int64_t, q_offset, 0, "alibi, t5: position of query 0.");
ABSL_FLAG(bool, bidirectional, false,
          "alibi, t5: bidirectional (encoder style) instead of causal.");
ABSL_FLAG(int32_t, num_buckets, 0, "t5: buckets; 0 means 32 (or the table's rows).");
ABSL_FLAG(int32_t, t5_max_distance, 0, "t5: distance of the last bucket; 0 means 128.");
ABSL_FLAG(std::string, t5_table, "",
          "t5: .npy bias table [num_buckets, heads]; also returns the bias.");

ABSL_FLAG(int64_t, steps, 8, "Decode steps after the prefill.");
ABSL_FLAG(int64_t, context, 0, "Tokens to prefill before the steps.");
ABSL_FLAG(int64_t, prefill_chunk, 256, "Tokens per prefill step.");
ABSL_FLAG(int64_t, tokens_per_step, 1, "New tokens per decode step.");
ABSL_FLAG(std::string, kv_dtype, "f32",
          "Session KV cache dtype: f32, bf16 or int8 (int8 rows with a scale per token and kv "
          "head; not with --linear or a dynamic/longrope rule).");
ABSL_FLAG(bool, linear, false, "Linear attention (elu+1 state) instead of a softmax KV cache.");
ABSL_FLAG(int64_t, max_context, 0,
          "Session max_context; 0 means context + steps * tokens_per_step.");

namespace ropeattn::cli {
namespace {

std::string HumanBytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (std::abs(value) >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  return unit == 0 ? absl::StrCat(bytes, " B") : absl::StrFormat("%.1f %s", value, units[unit]);
}

std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  if (!google::protobuf::util::MessageToJsonString(message, &json, options).ok()) return "{}";
  return json;
}

const char* KindName(v1::AttentionKind kind) {
  return kind == v1::ATTENTION_KIND_LINEAR ? "linear" : "softmax";
}

absl::Status WriteOut(const std::string& path, const v1::Tensor& tensor) {
  absl::Status status = client::WriteNpy(path, tensor);
  if (status.ok()) std::cout << "wrote " << path << " " << DescribeTensor(tensor) << "\n";
  return status;
}

// "out.npy" + "sin" -> "out_sin.npy".
std::string Suffixed(const std::string& path, absl::string_view suffix) {
  absl::string_view stem = path;
  const bool npy = absl::ConsumeSuffix(&stem, ".npy");
  return absl::StrCat(stem, "_", suffix, npy ? ".npy" : "");
}

absl::StatusOr<v1::Tensor> DoublesToF32(const std::vector<double>& values,
                                        std::vector<int64_t> shape) {
  std::vector<float> floats(values.begin(), values.end());
  return client::MakeF32(shape, floats);
}

void PrintTensorSummary(absl::string_view label, const v1::Tensor& tensor) {
  absl::StatusOr<std::vector<float>> values = client::ToFloats(tensor);
  std::cout << absl::StrFormat("%-8s %s", label, DescribeTensor(tensor));
  if (values.ok()) std::cout << "  " << DescribeStats(ComputeStats(*values));
  std::cout << "\n";
}

int NoPositional(absl::string_view command, const std::vector<std::string>& args) {
  if (args.empty()) return 0;
  return UsageFail(command, absl::StrCat("unexpected argument \"", args[0], "\""));
}

// A [1, S, ...] tensor's tokens [begin, end).
v1::Tensor SliceTokens(const v1::Tensor& tensor, int64_t begin, int64_t end) {
  int64_t per_token = 1;
  for (int i = 2; i < tensor.shape_size(); ++i) per_token *= tensor.shape(i);
  const int64_t elt = tensor.dtype() == v1::DTYPE_BF16 ? 2 : 4;
  v1::Tensor slice;
  slice.set_dtype(tensor.dtype());
  slice.add_shape(1);
  slice.add_shape(end - begin);
  for (int i = 2; i < tensor.shape_size(); ++i) slice.add_shape(tensor.shape(i));
  slice.set_data(tensor.data().substr(begin * per_token * elt, (end - begin) * per_token * elt));
  return slice;
}

double Percentile(std::vector<double> sorted, double p) {
  if (sorted.empty()) return 0;
  std::sort(sorted.begin(), sorted.end());
  size_t rank = static_cast<size_t>(std::ceil(p * sorted.size()));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

// Hidden states for layer mode: --hidden, else random [batch, seq, hidden_size]
// in --dtype from --seed.
// `one_message` as in ReadNpyFlag (attend: yes, decode: no).
absl::StatusOr<v1::Tensor> HiddenFromFlags(int64_t batch, int64_t seq, int64_t hidden_size,
                                           bool one_message) {
  if (const std::string path = absl::GetFlag(FLAGS_hidden); !path.empty()) {
    return ReadNpyFlag("hidden", path, one_message);
  }
  absl::StatusOr<v1::DType> dtype = ParseDType("dtype", absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return dtype.status();
  for (auto [name, value] : {std::pair{"batch", batch}, std::pair{"q_len", seq}}) {
    if (value <= 0 || value > (int64_t{1} << 24)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, " must be in [1, 2^24], got ", value));
    }
  }
  const int64_t shape[] = {batch, seq, hidden_size};
  return client::RandomTensor(*dtype, shape, absl::GetFlag(FLAGS_seed));
}

const char* PositionsName(v1::PositionKind kind) {
  switch (kind) {
    case v1::POSITION_KIND_NONE:
      return "none";
    case v1::POSITION_KIND_ROPE:
      return "rope";
    case v1::POSITION_KIND_LEARNED:
      return "learned";
    case v1::POSITION_KIND_SINUSOIDAL:
      return "sinusoidal";
    default:
      return "unspecified";
  }
}

// "llama3 x8 (af 1)" for RoPE models, "-" otherwise.
std::string RopeRule(const v1::ModelInfo& m) {
  if (m.positions() != v1::POSITION_KIND_ROPE) return "-";
  const std::string& type = m.rope().scaling().rope_type();
  std::string rule = type.empty() ? "default" : type;
  if (m.rope().scaling().factor() != 0 && m.rope().scaling().factor() != 1) {
    absl::StrAppend(&rule, " x", m.rope().scaling().factor());
  }
  absl::StrAppend(&rule, absl::StrFormat(" (af %.4g)", m.attention_factor()));
  return rule;
}

// The flags attend (or, `decode`, decode) reads in the mode its command
// line picks: layer mode (--model), .npy inputs (--q/--k/--v) or random
// inputs; `mode` gets the mode's name for a refusal. A flag of another mode
// was ignored (--hidden without --model attended random q, k, v).
ModeReads AttentionModeReads(bool decode, std::string* mode) {
  const absl::string_view command = decode ? "decode" : "attend";
  ModeReads reads;
  reads.Read({"out", "window", "softcap", "scale"});
  if (decode) {
    reads.Read({"steps", "context", "prefill_chunk", "tokens_per_step", "kv_dtype", "linear",
                "max_context"});
  } else {
    reads.Read({"return_probs", "probs_out", "offsets", "causal"});
  }
  if (!absl::GetFlag(FLAGS_model).empty()) {
    *mode = absl::StrCat(command, " in layer mode (--model)");
    reads.Read({"model", "layer", "hidden"});
    reads.ReadIf(/*absent=*/true, "hidden", {"seed", "dtype"});
    if (!decode) reads.ReadIf(/*absent=*/true, "hidden", {"batch", "q_len"});
    constexpr absl::string_view kModels[] = {"heads", "kv_heads", "head_dim", "v_dim", "alibi",
                                             "rope"};
    reads.NotRead(kModels, "(the heads, dims and RoPE are the model's)");
    reads.NotRead(RopeFlags(), "(the heads, dims and RoPE are the model's)");
    reads.NotRead({"q", "k", "v"}, "(its input is --hidden or random hidden states)");
    reads.NotRead({"k_len"}, "(self-attention: the keys are the hidden states' own)");
    return reads;
  }
  reads.Read({"heads", "kv_heads", "head_dim", "alibi", "rope"});
  reads.Read(RopeFlags());
  reads.NotRead({"layer", "hidden"}, "(only layer mode, --model, reads it)");
  if (!absl::GetFlag(FLAGS_q).empty() || !absl::GetFlag(FLAGS_k).empty() ||
      !absl::GetFlag(FLAGS_v).empty()) {
    *mode = absl::StrCat(command, " with --q/--k/--v");
    reads.Read({"q", "k", "v"});
    reads.NotRead({"batch", "q_len", "k_len", "dtype", "seed", "v_dim"},
                  "(the inputs' shapes and dtype come from the files)");
  } else {
    *mode = absl::StrCat(command, " with random q, k, v");
    reads.Read({"seed", "dtype", "v_dim"});
    if (!decode) reads.Read({"batch", "q_len", "k_len"});
  }
  return reads;
}

}  // namespace

// Longest random input a command generates, in tokens (as --q_len).
constexpr int64_t kMaxTokens = int64_t{1} << 24;

// The output flags' files, checked before any work (a run used to do all its
// work and then fail to write).
absl::Status CheckOutputs(std::initializer_list<absl::string_view> flags) {
  for (absl::string_view flag : flags) {
    if (const absl::CommandLineFlag* f = absl::FindCommandLineFlag(flag); f != nullptr) {
      if (absl::Status s = CheckOutputPath(flag, f->CurrentValue()); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

// --- health ---

int HealthCommand(int argc, char** argv) {
  static constexpr absl::string_view kFlags[] = {"service"};
  int exit_code = 0;
  auto args =
      ParseSubcommand(argc, argv,
                      "Checks grpc.health.v1 for the server (or --service) and prints\n"
                      "SERVING, NOT_SERVING, SERVICE_UNKNOWN or UNKNOWN. Exits 0 only when\n"
                      "SERVING; 14 (UNAVAILABLE) otherwise or when the server is down.",
                      kFlags, true, &exit_code);
  if (!args.has_value()) return exit_code;
  if (int code = NoPositional("health", *args); code != 0) return code;
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail("health", client.status());
  absl::StatusOr<client::HealthStatus> health = (*client)->Health(absl::GetFlag(FLAGS_service));
  if (!health.ok()) return Fail("health", health.status());
  std::cout << client::HealthStatusName(*health) << std::endl;
  if (*health != client::HealthStatus::kServing) {
    const std::string service = absl::GetFlag(FLAGS_service);
    return Fail("health",
                absl::UnavailableError(absl::StrCat(
                    "server at ", absl::GetFlag(FLAGS_target), " reports ",
                    client::HealthStatusName(*health),
                    service.empty() ? "" : absl::StrCat(" for service \"", service, "\""))));
  }
  return 0;
}

// --- info ---

int InfoCommand(int argc, char** argv) {
  static constexpr absl::string_view kFlags[] = {"json"};
  int exit_code = 0;
  auto args =
      ParseSubcommand(argc, argv,
                      "Prints the server's version, CPU, capabilities, limits, KV memory in\n"
                      "use and budget, and session counts.",
                      kFlags, true, &exit_code);
  if (!args.has_value()) return exit_code;
  if (int code = NoPositional("info", *args); code != 0) return code;
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail("info", client.status());
  absl::StatusOr<v1::ServerInfo> info = (*client)->GetServerInfo();
  if (!info.ok()) return Fail("info", info.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << ToJson(*info);
    return 0;
  }
  const double used_pct =
      info->kv_budget_bytes() > 0 ? 100.0 * info->kv_bytes_in_use() / info->kv_budget_bytes() : 0.0;
  std::cout << absl::StrFormat("%-16s %s\n", "server", absl::GetFlag(FLAGS_target))
            << absl::StrFormat("%-16s %s\n", "version", info->version())
            << absl::StrFormat("%-16s %s\n", "cpu", info->cpu())
            << absl::StrFormat("%-16s %s\n", "capabilities",
                               absl::StrJoin(info->capabilities(), ", "))
            << absl::StrFormat("%-16s %d threads, %d per call\n", "compute",
                               info->compute_threads(), info->threads_per_call())
            << absl::StrFormat("%-16s %d waiting of %d\n", "queue", info->queue_depth(),
                               info->queue_capacity())
            << absl::StrFormat("%-16s %s (%d bytes)\n", "max message",
                               HumanBytes(info->max_message_bytes()), info->max_message_bytes())
            << absl::StrFormat("%-16s %s of %s (%.1f%%; %d / %d bytes)\n", "KV memory",
                               HumanBytes(info->kv_bytes_in_use()),
                               HumanBytes(info->kv_budget_bytes()), used_pct,
                               info->kv_bytes_in_use(), info->kv_budget_bytes())
            << absl::StrFormat("%-16s %d open (%d attached) of max %d; %d reaped\n", "sessions",
                               info->open_sessions(), info->attached_sessions(),
                               info->max_sessions(), info->reaped_sessions())
            << absl::StrFormat("%-16s %d tokens\n", "default context", info->default_max_context())
            << absl::StrFormat("%-16s default %d s, max %d s\n", "idle TTL",
                               info->default_idle_ttl_seconds(), info->max_idle_ttl_seconds());
  return 0;
}

// --- sessions ---

int SessionsCommand(int argc, char** argv) {
  static constexpr absl::string_view kFlags[] = {"close", "json"};
  int exit_code = 0;
  auto args =
      ParseSubcommand(argc, argv,
                      "Lists the server's live decoding sessions (id, position, max context,\n"
                      "kind, KV dtype, attached, idle seconds, KV bytes), or closes one\n"
                      "with --close ID.",
                      kFlags, true, &exit_code);
  if (!args.has_value()) return exit_code;
  if (int code = NoPositional("sessions", *args); code != 0) return code;
  if (FlagGiven("close") && absl::GetFlag(FLAGS_close).empty()) {
    return UsageFail("sessions", "--close needs a session id");
  }
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail("sessions", client.status());
  if (const std::string id = absl::GetFlag(FLAGS_close); !id.empty()) {
    absl::StatusOr<v1::SessionInfo> closed = (*client)->CloseSession(id);
    if (!closed.ok()) return Fail("sessions", closed.status());
    if (absl::GetFlag(FLAGS_json)) {
      std::cout << ToJson(*closed);
    } else {
      std::cout << absl::StrFormat("closed %s (position %d, %d steps, %s freed)\n", id,
                                   closed->position(), closed->steps(),
                                   HumanBytes(closed->kv_bytes()));
    }
    return 0;
  }
  absl::StatusOr<std::vector<v1::SessionInfo>> sessions = (*client)->ListSessions();
  if (!sessions.ok()) return Fail("sessions", sessions.status());
  std::sort(sessions->begin(), sessions->end(),
            [](const auto& a, const auto& b) { return a.session_id() < b.session_id(); });
  if (absl::GetFlag(FLAGS_json)) {
    v1::ListSessionsResponse response;
    for (const auto& session : *sessions) *response.add_sessions() = session;
    std::cout << ToJson(response);
    return 0;
  }
  // KV_BYTES: charged to the budget; HELD: the pages held now; SHARED: of
  // those, shared with forks or a fork's source.
  std::cout << absl::StrFormat("%-32s %9s %11s %-7s %-8s %-8s %8s %12s %12s %12s\n", "ID",
                               "POSITION", "MAX_CONTEXT", "KIND", "KV_DTYPE", "ATTACHED", "IDLE_S",
                               "KV_BYTES", "HELD", "SHARED");
  for (const v1::SessionInfo& s : *sessions) {
    std::cout << absl::StrFormat(
        "%-32s %9d %11d %-7s %-8s %-8s %8.1f %12d %12d %12d\n", s.session_id(), s.position(),
        s.max_context(), KindName(s.kind()),
        DTypeName(s.kv_dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_F32 : s.kv_dtype()),
        s.attached() ? "yes" : "no", s.idle_seconds(), s.kv_bytes(), s.kv_bytes_held(),
        s.kv_bytes_shared());
  }
  std::cout << sessions->size() << " session" << (sessions->size() == 1 ? "" : "s") << "\n";
  return 0;
}

// --- attend ---

namespace {

int AttendLayerMode() {
  const std::string model = absl::GetFlag(FLAGS_model);
  if (absl::Status s = CheckOutputs({"out", "probs_out"}); !s.ok()) return Fail("attend", s);
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail("attend", client.status());
  v1::AttendRequest request;
  v1::AttentionSpec* spec = request.mutable_spec();
  spec->set_causal(absl::GetFlag(FLAGS_causal));
  spec->set_window(absl::GetFlag(FLAGS_window));
  spec->set_softcap(absl::GetFlag(FLAGS_softcap));
  spec->set_scale(absl::GetFlag(FLAGS_scale));
  v1::LayerInput* layer = request.mutable_layer();
  layer->set_model(model);
  layer->set_layer(absl::GetFlag(FLAGS_layer));
  int64_t hidden_size = 0;
  if (absl::GetFlag(FLAGS_hidden).empty()) {
    absl::StatusOr<v1::ModelInfo> info = (*client)->GetModel(model);
    if (!info.ok()) return Fail("attend", info.status());
    hidden_size = info->hidden_size();
  }
  absl::StatusOr<v1::Tensor> hidden =
      HiddenFromFlags(absl::GetFlag(FLAGS_batch), absl::GetFlag(FLAGS_q_len), hidden_size,
                      /*one_message=*/true);
  if (!hidden.ok()) return Fail("attend", hidden.status());
  *layer->mutable_hidden() = *std::move(hidden);
  auto offsets = ParseIntList("offsets", absl::GetFlag(FLAGS_offsets));
  if (!offsets.ok()) return UsageFail("attend", offsets.status().message());
  for (int64_t o : *offsets) request.add_q_offsets(o);
  const std::string probs_out = absl::GetFlag(FLAGS_probs_out);
  request.set_return_probs(absl::GetFlag(FLAGS_return_probs) || !probs_out.empty());

  const absl::Time start = absl::Now();
  absl::StatusOr<v1::AttendResponse> response = (*client)->Attend(request);
  const absl::Duration elapsed = absl::Now() - start;
  if (!response.ok()) return Fail("attend", response.status());
  // causal false asks for the model's masking (causal for decoders), not
  // for bidirectional attention: printed as what was computed.
  std::string flags_line = spec->causal() ? "causal" : "the model's masking";
  if (spec->window() != 0) absl::StrAppend(&flags_line, " window ", spec->window());
  if (spec->softcap() != 0) absl::StrAppend(&flags_line, " softcap ", spec->softcap());
  if (spec->scale() != 0) absl::StrAppend(&flags_line, " scale ", spec->scale());
  std::cout << absl::StrFormat("%-8s %s layer %d\n", "model", model, layer->layer())
            << absl::StrFormat("%-8s %s\n", "spec", flags_line);
  PrintTensorSummary("hidden", layer->hidden());
  std::cout << absl::StrFormat("%-8s %.3f ms\n", "time", absl::ToDoubleMilliseconds(elapsed));
  PrintTensorSummary("out", response->out());
  if (request.return_probs()) PrintTensorSummary("probs", response->probs());
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    if (absl::Status s = WriteOut(out, response->out()); !s.ok()) return Fail("attend", s);
  }
  if (!probs_out.empty()) {
    if (absl::Status s = WriteOut(probs_out, response->probs()); !s.ok()) {
      return Fail("attend", s);
    }
  }
  return 0;
}

}  // namespace

int AttendCommand(int argc, char** argv) {
  std::vector<absl::string_view> flags = {
      "seed", "batch", "q_len",        "k_len",     "v_dim", "dtype", "q",      "k",
      "v",    "out",   "return_probs", "probs_out", "model", "layer", "hidden", "offsets"};
  for (absl::string_view flag : AttentionSpecFlags()) flags.push_back(flag);
  int exit_code = 0;
  auto args = ParseSubcommand(
      argc, argv,
      "Runs one Attend call. Inputs are random (seeded: q, k, v from --seed, --seed+1,\n"
      "--seed+2, uniform in [-1, 1)) or read from .npy files (--q, --k, --v; heads and\n"
      "head_dim then come from their shapes unless given). No positional scheme unless\n"
      "asked for: --rope or any --rope_* flag turns RoPE on, --alibi ALiBi. --offsets gives\n"
      "each batch row's first query position\n"
      "(default: the queries are the last Sq of the Sk keys). Prints shapes, time and\n"
      "output statistics; --out writes the output [B, Sq, H, Dv] as .npy, --probs_out\n"
      "the probabilities [B, H, Sq, Sk].\n"
      "\n"
      "Layer mode (--model NAME --layer L): self-attention of the model's layer over\n"
      "hidden states [B, S, hidden_size], random ([--batch, --q_len, hidden_size] from\n"
      "--seed in --dtype) or from --hidden FILE.npy; the model's projections and RoPE\n"
      "apply, and only --causal, --window, --softcap and --scale are read from the spec\n"
      "flags (without --causal the model's masking applies: decoders are causal).\n"
      "--offsets sets each row's first position. --out gets [B, S, hidden_size].\n"
      "\n"
      "A flag the mode does not read is refused (exit 64): --layer and --hidden without\n"
      "--model, the random inputs' flags beside --q/--k/--v or --hidden.",
      flags, true, &exit_code);
  if (!args.has_value()) return exit_code;
  if (int code = NoPositional("attend", *args); code != 0) return code;
  std::string mode;
  const ModeReads reads = AttentionModeReads(/*decode=*/false, &mode);
  if (std::optional<std::string> unread = UnreadFlag(flags, {}, mode, reads); unread) {
    return UsageFail("attend", *unread);
  }
  if (std::optional<std::string> same = SameOutputFile({"out", "probs_out"}); same) {
    return UsageFail("attend", *same);
  }
  if (!absl::GetFlag(FLAGS_model).empty()) return AttendLayerMode();

  auto offsets = ParseIntList("offsets", absl::GetFlag(FLAGS_offsets));
  if (!offsets.ok()) return UsageFail("attend", offsets.status().message());
  if (absl::Status s = CheckOutputs({"out", "probs_out"}); !s.ok()) return Fail("attend", s);
  const int64_t q_len = absl::GetFlag(FLAGS_q_len);
  const int64_t k_len = absl::GetFlag(FLAGS_k_len) == 0 ? q_len : absl::GetFlag(FLAGS_k_len);
  absl::StatusOr<Inputs> inputs = InputsFromFlags(absl::GetFlag(FLAGS_batch), q_len, k_len);
  if (!inputs.ok()) return Fail("attend", inputs.status());
  absl::StatusOr<v1::AttentionSpec> spec = AttentionSpecFromFlags();
  if (!spec.ok()) return Fail("attend", spec.status());
  if (!absl::GetFlag(FLAGS_q).empty()) {
    // Shapes from the files, unless the flags say otherwise (the server then
    // reports the mismatch).
    if (inputs->q.shape_size() == 4 && !FlagGiven("heads")) spec->set_heads(inputs->q.shape(2));
    if (inputs->q.shape_size() == 4 && !FlagGiven("head_dim")) {
      spec->set_head_dim(inputs->q.shape(3));
    }
    if (inputs->k.shape_size() == 4 && !FlagGiven("kv_heads")) {
      spec->set_kv_heads(inputs->k.shape(2));
    }
  }
  v1::AttendRequest request;
  *request.mutable_spec() = *spec;
  *request.mutable_q() = inputs->q;
  *request.mutable_k() = inputs->k;
  *request.mutable_v() = inputs->v;
  for (int64_t o : *offsets) request.add_q_offsets(o);
  const std::string probs_out = absl::GetFlag(FLAGS_probs_out);
  request.set_return_probs(absl::GetFlag(FLAGS_return_probs) || !probs_out.empty());

  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail("attend", client.status());
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::AttendResponse> response = (*client)->Attend(request);
  const absl::Duration elapsed = absl::Now() - start;
  if (!response.ok()) return Fail("attend", response.status());

  std::cout << absl::StrFormat("%-8s %s\n", "q", DescribeTensor(request.q()))
            << absl::StrFormat("%-8s %s\n", "k", DescribeTensor(request.k()))
            << absl::StrFormat("%-8s %s\n", "v", DescribeTensor(request.v()))
            << absl::StrFormat("%-8s %s\n", "spec", DescribeSpec(*spec))
            << absl::StrFormat("%-8s %.3f ms\n", "time", absl::ToDoubleMilliseconds(elapsed));
  PrintTensorSummary("out", response->out());
  if (request.return_probs()) PrintTensorSummary("probs", response->probs());
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    if (absl::Status s = WriteOut(out, response->out()); !s.ok()) return Fail("attend", s);
  }
  if (!probs_out.empty()) {
    if (absl::Status s = WriteOut(probs_out, response->probs()); !s.ok()) {
      return Fail("attend", s);
    }
  }
  return 0;
}

// --- encode ---

namespace {

// The flags an Encode op reads, besides --op, --out and the connection flags.
absl::StatusOr<ModeReads> EncodeOpReads(absl::string_view op) {
  ModeReads reads;
  auto read = [&](std::initializer_list<absl::string_view> flags) { reads.Read(flags); };
  auto read_if = [&](bool absent, absl::string_view given,
                     std::initializer_list<absl::string_view> flags) {
    reads.ReadIf(absent, given, flags);
  };
  if (op == "sinusoidal") {
    read({"num_positions", "d_model", "base", "sin_layout", "first_position"});
  } else if (op == "rope_frequencies" || op == "rope_cos_sin" || op == "rope_apply") {
    reads.Read(RopeFlags());
    read({"seq_len"});
    if (op == "rope_frequencies") {
      read({"head_dim"});
    } else if (op == "rope_cos_sin") {
      read({"head_dim", "positions"});
      read_if(/*absent=*/true, "positions", {"num_positions"});
    } else {
      read({"positions", "offsets", "inverse", "x"});
      read_if(/*absent=*/true, "x", {"batch", "q_len", "heads", "head_dim", "dtype", "seed"});
    }
  } else if (op == "alibi") {
    read({"heads", "q_len"});
    read_if(/*absent=*/false, "q_len", {"k_len", "q_offset", "bidirectional"});
  } else if (op == "t5") {
    read({"q_len", "k_len", "q_offset", "bidirectional", "num_buckets", "t5_max_distance",
          "t5_table"});
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--op must be sinusoidal, rope_frequencies, rope_cos_sin, rope_apply, alibi or t5, "
        "got \"", op, "\""));
  }
  return reads;
}

}  // namespace

int EncodeCommand(int argc, char** argv) {
  std::vector<absl::string_view> flags = {"op",
                                          "out",
                                          "num_positions",
                                          "d_model",
                                          "base",
                                          "sin_layout",
                                          "first_position",
                                          "head_dim",
                                          "seq_len",
                                          "positions",
                                          "offsets",
                                          "inverse",
                                          "x",
                                          "seed",
                                          "batch",
                                          "q_len",
                                          "k_len",
                                          "heads",
                                          "dtype",
                                          "q_offset",
                                          "bidirectional",
                                          "num_buckets",
                                          "t5_max_distance",
                                          "t5_table"};
  for (absl::string_view flag : RopeFlags()) flags.push_back(flag);
  int exit_code = 0;
  auto args = ParseSubcommand(
      argc, argv,
      "Runs one Encode op (--op) and prints a summary; --out writes the result as .npy.\n"
      "  sinusoidal        table [num_positions, d_model] (--d_model, --base, --sin_layout,\n"
      "                    --first_position)\n"
      "  rope_frequencies  inverse frequencies of a RoPE rule (--head_dim, --rope_*,\n"
      "                    --seq_len); printed, --out as f32 [rotary_dim/2]\n"
      "  rope_cos_sin      cos and sin [n, rotary_dim/2] at --positions (default\n"
      "                    0..num_positions-1); --out gets cos, <out>_sin.npy gets sin\n"
      "  rope_apply        rotates --x (or random [batch, q_len, heads, head_dim] in\n"
      "                    --dtype from --seed) at --positions / --offsets; --inverse\n"
      "                    un-rotates\n"
      "  alibi             slopes for --heads, and with --q_len the bias [heads, q_len,\n"
      "                    k_len] (--k_len, --q_offset, --bidirectional)\n"
      "  t5                buckets [q_len, k_len] (--num_buckets, --t5_max_distance,\n"
      "                    --q_offset, --bidirectional); with --t5_table also the bias\n"
      "                    (<out>_bias.npy)\n"
      "A flag the op does not read is refused (exit 64); --batch, --q_len, --k_len,\n"
      "--heads and --head_dim, where read, are in [1, 2^24].",
      flags, true, &exit_code);
  if (!args.has_value()) return exit_code;
  if (int code = NoPositional("encode", *args); code != 0) return code;

  const std::string op = absl::GetFlag(FLAGS_op);
  absl::StatusOr<ModeReads> reads = EncodeOpReads(op);
  if (!reads.ok()) return UsageFail("encode", reads.status().message());
  if (std::optional<std::string> unread =
          UnreadFlag(flags, {"op", "out"}, absl::StrCat("--op ", op), *reads);
      unread.has_value()) {
    return UsageFail("encode", *unread);
  }
  // Size flags, by the CLI's ranges, before anything is built from them
  // (the server's errors name proto fields the user never typed).
  const int64_t q_len = absl::GetFlag(FLAGS_q_len);
  const int64_t k_len = absl::GetFlag(FLAGS_k_len) == 0 ? q_len : absl::GetFlag(FLAGS_k_len);
  for (const auto& [name, value] :
       {std::pair<absl::string_view, int64_t>{"batch", absl::GetFlag(FLAGS_batch)},
        {"q_len", q_len},
        {"k_len", k_len},
        {"heads", absl::GetFlag(FLAGS_heads)},
        {"head_dim", absl::GetFlag(FLAGS_head_dim)}}) {
    const bool read = std::find(reads->flags.begin(), reads->flags.end(), name) !=
                      reads->flags.end();
    // alibi's lengths shape the bias, asked for with --q_len.
    const bool optional_length = op == "alibi" && name != "heads" && !FlagGiven("q_len");
    if (read && !optional_length && (value < 1 || value > kMaxTokens)) {
      return Fail("encode", absl::InvalidArgumentError(absl::StrCat(
                                "--", name, " must be in [1, 2^24], got ", value)));
    }
  }
  v1::EncodeRequest request;
  auto positions = ParseIntList("positions", absl::GetFlag(FLAGS_positions));
  if (!positions.ok()) return UsageFail("encode", positions.status().message());
  if (op == "sinusoidal") {
    auto* s = request.mutable_sinusoidal();
    s->set_num_positions(absl::GetFlag(FLAGS_num_positions));
    s->set_d_model(absl::GetFlag(FLAGS_d_model));
    s->set_base(absl::GetFlag(FLAGS_base));
    s->set_first_position(absl::GetFlag(FLAGS_first_position));
    const std::string layout = absl::GetFlag(FLAGS_sin_layout);
    if (layout == "interleaved") {
      s->set_layout(v1::SINUSOIDAL_LAYOUT_INTERLEAVED);
    } else if (layout == "sin_cos_half") {
      s->set_layout(v1::SINUSOIDAL_LAYOUT_SIN_COS_HALF);
    } else {
      return Fail("encode",
                  absl::InvalidArgumentError(absl::StrCat(
                      "--sin_layout must be interleaved or sin_cos_half, got \"", layout, "\"")));
    }
  } else if (op == "rope_frequencies" || op == "rope_cos_sin" || op == "rope_apply") {
    absl::StatusOr<v1::RopeSpec> rope = RopeSpecFromFlags();
    if (!rope.ok()) return Fail("encode", rope.status());
    if (op == "rope_frequencies") {
      auto* f = request.mutable_rope_frequencies();
      *f->mutable_rope() = *rope;
      f->set_head_dim(absl::GetFlag(FLAGS_head_dim));
      f->set_seq_len(absl::GetFlag(FLAGS_seq_len));
    } else if (op == "rope_cos_sin") {
      auto* c = request.mutable_rope_cos_sin();
      *c->mutable_rope() = *rope;
      c->set_head_dim(absl::GetFlag(FLAGS_head_dim));
      c->set_seq_len(absl::GetFlag(FLAGS_seq_len));
      if (positions->empty()) {
        // Positions 0..num_positions-1 are sent: bounded before the loop.
        const int64_t num_positions = absl::GetFlag(FLAGS_num_positions);
        if (num_positions < 1 || num_positions > kMaxTokens) {
          return Fail("encode", absl::InvalidArgumentError(absl::StrCat(
                                    "--num_positions must be in [1, 2^24] (positions 0 .. "
                                    "num_positions - 1 are sent), got ",
                                    num_positions)));
        }
        for (int64_t p = 0; p < num_positions; ++p) c->add_positions(p);
      } else {
        for (int64_t p : *positions) c->add_positions(p);
      }
    } else {
      auto* a = request.mutable_rope_apply();
      *a->mutable_rope() = *rope;
      a->set_seq_len(absl::GetFlag(FLAGS_seq_len));
      a->set_inverse(absl::GetFlag(FLAGS_inverse));
      for (int64_t p : *positions) a->add_positions(p);
      auto offsets = ParseIntList("offsets", absl::GetFlag(FLAGS_offsets));
      if (!offsets.ok()) return UsageFail("encode", offsets.status().message());
      for (int64_t o : *offsets) a->add_offsets(o);
      if (const std::string path = absl::GetFlag(FLAGS_x); !path.empty()) {
        absl::StatusOr<v1::Tensor> x = ReadNpyFlag("x", path, /*one_message=*/true);
        if (!x.ok()) return Fail("encode", x.status());
        *a->mutable_x() = *std::move(x);
      } else {
        absl::StatusOr<v1::DType> dtype = ParseDType("dtype", absl::GetFlag(FLAGS_dtype));
        if (!dtype.ok()) return Fail("encode", dtype.status());
        const int64_t shape[] = {absl::GetFlag(FLAGS_batch), q_len, absl::GetFlag(FLAGS_heads),
                                 absl::GetFlag(FLAGS_head_dim)};
        // The bytes (each size flag is checked above) before anything is
        // generated.
        double bytes = *dtype == v1::DTYPE_BF16 ? 2 : 4;
        for (int64_t dim : shape) bytes *= static_cast<double>(dim);
        if (const int64_t max = absl::GetFlag(FLAGS_max_message_bytes);
            max > 0 && bytes > static_cast<double>(max)) {
          return Fail("encode", absl::ResourceExhaustedError(absl::StrFormat(
                                    "x of [--batch %d, --q_len %d, --heads %d, --head_dim %d] is "
                                    "%.0f bytes, more than --max_message_bytes %d; not sent",
                                    shape[0], shape[1], shape[2], shape[3], bytes, max)));
        }
        absl::StatusOr<v1::Tensor> x =
            client::RandomTensor(*dtype, shape, absl::GetFlag(FLAGS_seed));
        if (!x.ok()) return Fail("encode", x.status());
        *a->mutable_x() = *std::move(x);
      }
    }
  } else if (op == "alibi") {
    auto* a = request.mutable_alibi();
    a->set_heads(absl::GetFlag(FLAGS_heads));
    a->set_q_len(FlagGiven("q_len") ? q_len : 0);
    a->set_k_len(FlagGiven("q_len") ? k_len : 0);
    a->set_q_offset(absl::GetFlag(FLAGS_q_offset));
    a->set_bidirectional(absl::GetFlag(FLAGS_bidirectional));
  } else if (op == "t5") {
    auto* t = request.mutable_t5();
    t->set_num_buckets(absl::GetFlag(FLAGS_num_buckets));
    t->set_max_distance(absl::GetFlag(FLAGS_t5_max_distance));
    t->set_bidirectional(absl::GetFlag(FLAGS_bidirectional));
    t->set_q_len(q_len);
    t->set_k_len(k_len);
    t->set_q_offset(absl::GetFlag(FLAGS_q_offset));
    if (const std::string path = absl::GetFlag(FLAGS_t5_table); !path.empty()) {
      absl::StatusOr<v1::Tensor> table = ReadNpyFlag("t5_table", path, /*one_message=*/true);
      if (!table.ok()) return Fail("encode", table.status());
      *t->mutable_table() = *std::move(table);
    }
  }

  if (absl::Status s = CheckOutputs({"out"}); !s.ok()) return Fail("encode", s);
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail("encode", client.status());
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::EncodeResponse> response = (*client)->Encode(request);
  const absl::Duration elapsed = absl::Now() - start;
  if (!response.ok()) return Fail("encode", response.status());
  std::cout << absl::StrFormat("%-8s %s\n", "op", op)
            << absl::StrFormat("%-8s %.3f ms\n", "time", absl::ToDoubleMilliseconds(elapsed));

  // The results, first one to --out, a second one next to it. Lists printed
  // in full above (inverse frequencies, slopes) get no summary line.
  std::vector<std::pair<std::string, v1::Tensor>> results;
  bool printed_in_full = false;
  auto add_doubles = [&](absl::string_view name, const auto& values) -> absl::Status {
    std::vector<double> v(values.begin(), values.end());
    absl::StatusOr<v1::Tensor> t = DoublesToF32(v, {static_cast<int64_t>(v.size())});
    if (!t.ok()) return t.status();
    results.emplace_back(name, *std::move(t));
    printed_in_full = true;
    return absl::OkStatus();
  };
  absl::Status status;
  if (op == "sinusoidal") {
    results.emplace_back("table", response->table());
  } else if (op == "rope_frequencies" || op == "rope_cos_sin") {
    std::cout << absl::StrFormat("%-8s %.9g\n", "attention_factor", response->attention_factor());
    std::cout << "inv_freq";
    for (double f : response->inv_freq()) std::cout << absl::StrFormat(" %.9g", f);
    std::cout << "\n";
    if (op == "rope_frequencies") {
      status = add_doubles("inv_freq", response->inv_freq());
    } else {
      results.emplace_back("cos", response->cos());
      results.emplace_back("sin", response->sin());
    }
  } else if (op == "rope_apply") {
    std::cout << absl::StrFormat("%-8s %.9g\n", "attention_factor", response->attention_factor());
    PrintTensorSummary("in", request.rope_apply().x());
    results.emplace_back("x", response->x());
  } else if (op == "alibi") {
    std::cout << "slopes";
    for (double s : response->slopes()) std::cout << absl::StrFormat(" %.9g", s);
    std::cout << "\n";
    if (response->has_bias()) {
      results.emplace_back("bias", response->bias());
    } else {
      status = add_doubles("slopes", response->slopes());
    }
  } else if (op == "t5") {
    std::vector<double> buckets(response->buckets().begin(), response->buckets().end());
    absl::StatusOr<v1::Tensor> t = DoublesToF32(buckets, {q_len, k_len});
    if (!t.ok()) return Fail("encode", t.status());
    results.emplace_back("buckets", *std::move(t));
    if (response->has_bias()) results.emplace_back("bias", response->bias());
  }
  if (!status.ok()) return Fail("encode", status);
  if (!printed_in_full) {
    for (const auto& [name, tensor] : results) PrintTensorSummary(name, tensor);
  }
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    for (size_t i = 0; i < results.size(); ++i) {
      const std::string path = i == 0 ? out : Suffixed(out, results[i].first);
      if (absl::Status s = WriteOut(path, results[i].second); !s.ok()) return Fail("encode", s);
    }
  }
  return 0;
}

// --- decode ---

int DecodeCommand(int argc, char** argv) {
  std::vector<absl::string_view> flags = {
      "steps",       "context", "prefill_chunk", "tokens_per_step", "kv_dtype", "linear",
      "max_context", "seed",    "v_dim",         "dtype",           "q",        "k",
      "v",           "out",     "model",         "layer",           "hidden"};
  for (absl::string_view flag : AttentionSpecFlags()) {
    if (flag != "causal") flags.push_back(flag);
  }
  int exit_code = 0;
  auto args = ParseSubcommand(
      argc, argv,
      "Opens a decoding session, prefills --context tokens in chunks of --prefill_chunk,\n"
      "then runs --steps steps of --tokens_per_step tokens, printing each step's\n"
      "latency and p50/p99 at the end. Inputs: random q, k, v of [1, N, ...] with\n"
      "N = context + steps * tokens_per_step (seeds --seed, +1, +2), or .npy files\n"
      "(--q, --k, --v) holding at least N tokens; token t is the same token whether\n"
      "sent in the prefill or a step, so the last step equals a causal Attend over\n"
      "all N tokens. --out writes the last step's output [1, T, H, Dv] as .npy.\n"
      "\n"
      "Layer mode (--model NAME --layer L): the session belongs to the model's layer and\n"
      "steps carry hidden states [1, T, hidden_size]: random [1, N, hidden_size] (--seed,\n"
      "--dtype) or --hidden FILE.npy with at least N tokens. The last step then equals\n"
      "the last rows of a causal layer-mode Attend over all N tokens; --out gets\n"
      "[1, T, hidden_size]. --window, --softcap and --scale still apply.\n"
      "\n"
      "A flag the mode does not read is refused (exit 64): --layer and --hidden without\n"
      "--model, the random inputs' flags beside --q/--k/--v or --hidden.",
      flags, true, &exit_code);
  if (!args.has_value()) return exit_code;
  if (int code = NoPositional("decode", *args); code != 0) return code;
  std::string mode;
  const ModeReads reads = AttentionModeReads(/*decode=*/true, &mode);
  if (std::optional<std::string> unread = UnreadFlag(flags, {}, mode, reads); unread) {
    return UsageFail("decode", *unread);
  }

  const int64_t steps = absl::GetFlag(FLAGS_steps);
  const int64_t context = absl::GetFlag(FLAGS_context);
  const int64_t chunk = absl::GetFlag(FLAGS_prefill_chunk);
  const int64_t per_step = absl::GetFlag(FLAGS_tokens_per_step);
  // Each flag is checked, and named with the value given, before any
  // arithmetic on it: N = context + steps * tokens_per_step then fits int64
  // (it overflowed, and was reported as --q_len, a flag decode has not).
  for (const auto& [name, value, least] :
       {std::tuple{"steps", steps, int64_t{1}}, std::tuple{"context", context, int64_t{0}},
        std::tuple{"prefill_chunk", chunk, int64_t{1}},
        std::tuple{"tokens_per_step", per_step, int64_t{1}}}) {
    if (value < least || value > kMaxTokens) {
      return Fail("decode", absl::InvalidArgumentError(absl::StrCat(
                                "--", name, " must be in [", least, ", 2^24], got ", value)));
    }
  }
  const int64_t total = context + steps * per_step;
  const bool layer_mode = !absl::GetFlag(FLAGS_model).empty();
  const bool from_files =
      layer_mode ? !absl::GetFlag(FLAGS_hidden).empty() : !absl::GetFlag(FLAGS_q).empty();
  if (!from_files && total > kMaxTokens) {
    return Fail("decode", absl::InvalidArgumentError(absl::StrCat(
                              "--context + --steps * --tokens_per_step (the random inputs' ",
                              "tokens) must be at most 2^24, got ", context, " + ", steps, " * ",
                              per_step, " = ", total)));
  }
  absl::StatusOr<v1::DType> kv_dtype = ParseKvDType("kv_dtype", absl::GetFlag(FLAGS_kv_dtype));
  if (!kv_dtype.ok()) return Fail("decode", kv_dtype.status());
  v1::OpenSession open;
  open.set_kv_dtype(*kv_dtype);
  open.set_kind(absl::GetFlag(FLAGS_linear) ? v1::ATTENTION_KIND_LINEAR
                                            : v1::ATTENTION_KIND_SOFTMAX);
  open.set_max_context(FlagGiven("max_context") ? absl::GetFlag(FLAGS_max_context) : total);

  if (absl::Status s = CheckOutputs({"out"}); !s.ok()) return Fail("decode", s);
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail("decode", client.status());
  Inputs inputs;
  v1::Tensor hidden;
  std::string spec_line;
  if (layer_mode) {
    const std::string model = absl::GetFlag(FLAGS_model);
    int64_t hidden_size = 0;
    if (absl::GetFlag(FLAGS_hidden).empty()) {
      absl::StatusOr<v1::ModelInfo> info = (*client)->GetModel(model);
      if (!info.ok()) return Fail("decode", info.status());
      hidden_size = info->hidden_size();
    }
    absl::StatusOr<v1::Tensor> h = HiddenFromFlags(1, total, hidden_size, /*one_message=*/false);
    if (!h.ok()) return Fail("decode", h.status());
    hidden = *std::move(h);
    if (hidden.shape_size() != 3 || hidden.shape(0) != 1 || hidden.shape(1) < total) {
      return Fail("decode", absl::InvalidArgumentError(
                                absl::StrCat("--hidden must be [1, >= ", total,
                                             ", hidden_size], got ", DescribeTensor(hidden))));
    }
    v1::AttentionSpec* spec = open.mutable_spec();
    spec->set_causal(true);
    spec->set_window(absl::GetFlag(FLAGS_window));
    spec->set_softcap(absl::GetFlag(FLAGS_softcap));
    spec->set_scale(absl::GetFlag(FLAGS_scale));
    open.set_model(model);
    open.set_layer(absl::GetFlag(FLAGS_layer));
    spec_line = absl::StrCat("model ", model, " layer ", open.layer(), " causal");
    if (spec->window() != 0) absl::StrAppend(&spec_line, " window ", spec->window());
    if (spec->softcap() != 0) absl::StrAppend(&spec_line, " softcap ", spec->softcap());
    if (spec->scale() != 0) absl::StrAppend(&spec_line, " scale ", spec->scale());
  } else {
    absl::StatusOr<Inputs> read = InputsFromFlags(1, total, total, /*one_message=*/false);
    if (!read.ok()) return Fail("decode", read.status());
    inputs = *std::move(read);
    // Only files can be of another shape: the error names the flag and the file.
    for (auto [flag, t, path] : {std::tuple{"q", &inputs.q, absl::GetFlag(FLAGS_q)},
                                 std::tuple{"k", &inputs.k, absl::GetFlag(FLAGS_k)},
                                 std::tuple{"v", &inputs.v, absl::GetFlag(FLAGS_v)}}) {
      if (t->shape_size() != 4 || t->shape(0) != 1 || t->shape(1) < total) {
        return Fail("decode", absl::InvalidArgumentError(
                                  absl::StrCat("--", flag, ": ", path, ": must be [1, >= ", total,
                                               ", heads, dim], got ", DescribeTensor(*t))));
      }
    }
    absl::StatusOr<v1::AttentionSpec> spec = AttentionSpecFromFlags();
    if (!spec.ok()) return Fail("decode", spec.status());
    if (!absl::GetFlag(FLAGS_q).empty()) {
      if (!FlagGiven("heads")) spec->set_heads(inputs.q.shape(2));
      if (!FlagGiven("head_dim")) spec->set_head_dim(inputs.q.shape(3));
      if (!FlagGiven("kv_heads")) spec->set_kv_heads(inputs.k.shape(2));
    }
    spec->set_causal(true);
    *open.mutable_spec() = *spec;
    open.set_v_dim(inputs.v.shape(3));
    spec_line = DescribeSpec(*spec);
  }

  absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<client::Session>> session = (*client)->OpenSession(open);
  if (!session.ok()) return Fail("decode", session.status());
  std::cout << absl::StrFormat("session  %s (%s, kv %s, max_context %d) opened in %.3f ms\n",
                               (*session)->id(), KindName(open.kind()), DTypeName(*kv_dtype),
                               (*session)->info().max_context(),
                               absl::ToDoubleMilliseconds(absl::Now() - start));
  std::cout << absl::StrFormat("spec     %s\n", spec_line);

  auto step = [&](int64_t begin, int64_t end) {
    if (layer_mode) return (*session)->StepHidden(SliceTokens(hidden, begin, end));
    return (*session)->Step(SliceTokens(inputs.q, begin, end), SliceTokens(inputs.k, begin, end),
                            SliceTokens(inputs.v, begin, end));
  };
  if (context > 0) {
    start = absl::Now();
    int64_t chunks = 0;
    for (int64_t begin = 0; begin < context; begin += chunk, ++chunks) {
      absl::StatusOr<v1::StepResult> result = step(begin, std::min(context, begin + chunk));
      if (!result.ok()) return Fail("decode", result.status());
    }
    std::cout << absl::StrFormat("prefill  %d tokens in %d chunks, %.3f ms\n", context, chunks,
                                 absl::ToDoubleMilliseconds(absl::Now() - start));
  }
  std::vector<double> latencies;
  v1::Tensor last;
  for (int64_t i = 0; i < steps; ++i) {
    const int64_t begin = context + i * per_step;
    start = absl::Now();
    absl::StatusOr<v1::StepResult> result = step(begin, begin + per_step);
    const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
    if (!result.ok()) return Fail("decode", result.status());
    latencies.push_back(ms);
    std::cout << absl::StrFormat("step %4d  position %6d  %9.3f ms\n", i + 1, result->position(),
                                 ms);
    last = std::move(*result->mutable_out());
  }
  double sum = 0;
  for (double ms : latencies) sum += ms;
  std::cout << absl::StrFormat("steps %d  p50 %.3f ms  p99 %.3f ms  mean %.3f ms  max %.3f ms\n",
                               steps, Percentile(latencies, 0.5), Percentile(latencies, 0.99),
                               sum / steps, *std::max_element(latencies.begin(), latencies.end()));
  PrintTensorSummary("last", last);
  if (absl::Status s = (*session)->Close(); !s.ok()) return Fail("decode", s);
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    if (absl::Status s = WriteOut(out, last); !s.ok()) return Fail("decode", s);
  }
  return 0;
}

// --- models ---

namespace {

void PrintModelDetail(const v1::ModelInfo& m) {
  auto line = [](absl::string_view key, const std::string& value) {
    std::cout << absl::StrFormat("%-18s %s\n", key, value);
  };
  line("name", m.name());
  line("source", m.source());
  line("architecture", m.architecture());
  line("model_type", m.model_type());
  line("hidden_size", absl::StrCat(m.hidden_size()));
  line("heads", absl::StrCat(m.heads(), " query, ", m.kv_heads(), " kv (group ",
                             m.kv_heads() > 0 ? m.heads() / m.kv_heads() : 0, ")"));
  line("head_dim", absl::StrCat(m.head_dim()));
  line("vocab_size", absl::StrCat(m.vocab_size()));
  line("layers", absl::StrCat(m.num_layers()));
  line("max_positions", absl::StrCat(m.max_positions()));
  line("positions", PositionsName(m.positions()));
  if (m.positions() == v1::POSITION_KIND_ROPE) {
    const v1::RopeSpec& rope = m.rope();
    const v1::RopeScaling& sc = rope.scaling();
    line("rope",
         absl::StrCat(sc.rope_type().empty() ? "default" : sc.rope_type(),
                      sc.factor() != 0 ? absl::StrCat(" factor ", sc.factor()) : "", " theta ",
                      rope.theta() == 0 ? 10000.0 : rope.theta(),
                      rope.layout() == v1::ROPE_LAYOUT_INTERLEAVED ? " interleaved" : " half_split",
                      " rotary_dim ", rope.rotary_dim() == 0 ? m.head_dim() : rope.rotary_dim()));
    std::vector<std::string> extra;
    if (sc.original_max_position_embeddings() != 0) {
      extra.push_back(absl::StrCat("L0 ", sc.original_max_position_embeddings()));
    }
    if (sc.has_low_freq_factor()) extra.push_back(absl::StrCat("low_freq ", sc.low_freq_factor()));
    if (sc.has_high_freq_factor()) {
      extra.push_back(absl::StrCat("high_freq ", sc.high_freq_factor()));
    }
    if (sc.has_beta_fast()) extra.push_back(absl::StrCat("beta_fast ", sc.beta_fast()));
    if (sc.has_beta_slow()) extra.push_back(absl::StrCat("beta_slow ", sc.beta_slow()));
    if (sc.has_mscale()) extra.push_back(absl::StrCat("mscale ", sc.mscale()));
    if (sc.has_mscale_all_dim())
      extra.push_back(absl::StrCat("mscale_all_dim ", sc.mscale_all_dim()));
    if (sc.has_attention_factor()) {
      extra.push_back(absl::StrCat("attention_factor ", sc.attention_factor()));
    }
    if (sc.short_factor_size() > 0) {
      extra.push_back(absl::StrCat("short/long factors ", sc.short_factor_size()));
    }
    if (!extra.empty()) line("rope scaling", absl::StrJoin(extra, ", "));
    line("attention_factor", absl::StrFormat("%.9g", m.attention_factor()));
    const int n = m.inv_freq_size();
    if (n > 0) {
      double lo = m.inv_freq(0), hi = m.inv_freq(0);
      for (double f : m.inv_freq()) {
        lo = std::min(lo, f);
        hi = std::max(hi, f);
      }
      line("inv_freq", absl::StrFormat("%d pairs  first %.9g  last %.9g  min %.9g  max %.9g", n,
                                       m.inv_freq(0), m.inv_freq(n - 1), lo, hi));
      std::vector<std::string> shown;
      for (int i = 0; i < n; ++i) {
        if (n > 8 && i == 4) {
          shown.push_back("...");
          i = n - 4;
        }
        shown.push_back(absl::StrFormat("%.6g", m.inv_freq(i)));
      }
      line("inv_freq values", absl::StrJoin(shown, " "));
      const double two_pi = 2 * M_PI;
      line("wavelengths", absl::StrFormat("%.6g .. %.6g tokens", lo > 0 ? two_pi / hi : 0,
                                          lo > 0 ? two_pi / lo : 0));
    }
  }
  line("memory", absl::StrFormat("%s of weights", HumanBytes(m.resident_bytes())));
}

}  // namespace

int ModelsCommand(int argc, char** argv) {
  static constexpr absl::string_view kFlags[] = {"json", "name"};
  int exit_code = 0;
  auto args = ParseSubcommand(
      argc, argv,
      "Lists the models the server serves (name, source, architecture, hidden size,\n"
      "query/kv heads, head_dim, vocabulary, layers, position scheme, RoPE rule with\n"
      "its attention factor, memory), or shows one in detail with --name NAME (RoPE\n"
      "scaling parameters and a summary of its inverse frequencies). Models are used\n"
      "by `embed` and by layer mode (--model) of attend, decode and bench.",
      kFlags, true, &exit_code);
  if (!args.has_value()) return exit_code;
  if (int code = NoPositional("models", *args); code != 0) return code;
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail("models", client.status());
  if (const std::string name = absl::GetFlag(FLAGS_name); !name.empty()) {
    absl::StatusOr<v1::ModelInfo> info = (*client)->GetModel(name);
    if (!info.ok()) return Fail("models", info.status());
    if (absl::GetFlag(FLAGS_json)) {
      std::cout << ToJson(*info);
    } else {
      PrintModelDetail(*info);
    }
    return 0;
  }
  absl::StatusOr<std::vector<v1::ModelInfo>> models = (*client)->ListModels();
  if (!models.ok()) return Fail("models", models.status());
  if (absl::GetFlag(FLAGS_json)) {
    v1::ListModelsResponse response;
    for (const auto& m : *models) *response.add_models() = m;
    std::cout << ToJson(response);
    return 0;
  }
  std::cout << absl::StrFormat("%-16s %-10s %-16s %6s %7s %4s %6s %6s %9s %-10s %-22s %s\n", "NAME",
                               "SOURCE", "ARCHITECTURE", "HIDDEN", "HEADS", "HDIM", "VOCAB",
                               "LAYERS", "MAX_POS", "POSITIONS", "ROPE", "MEMORY");
  for (const v1::ModelInfo& m : *models) {
    std::cout << absl::StrFormat("%-16s %-10s %-16s %6d %7s %4d %6d %6d %9d %-10s %-22s %s\n",
                                 m.name(), m.source(), m.architecture(), m.hidden_size(),
                                 absl::StrCat(m.heads(), "/", m.kv_heads()), m.head_dim(),
                                 m.vocab_size(), m.num_layers(), m.max_positions(),
                                 PositionsName(m.positions()), RopeRule(m),
                                 HumanBytes(m.resident_bytes()));
  }
  std::cout << models->size() << " model" << (models->size() == 1 ? "" : "s") << "\n";
  return 0;
}

// --- embed ---

int EmbedCommand(int argc, char** argv) {
  static constexpr absl::string_view kFlags[] = {"model",   "tokens", "shape",
                                                 "offsets", "dtype",  "out"};
  int exit_code = 0;
  auto args = ParseSubcommand(
      argc, argv,
      "Embeds token ids with a served model: --model NAME --tokens 1,2,3 [--shape B,S]\n"
      "(default 1,<number of ids>). Models with learned or sinusoidal absolute\n"
      "positions add them (--offsets: each row's first position). Prints the shape,\n"
      "time and statistics of the embeddings [B, S, hidden_size] in --dtype; --out\n"
      "writes them as .npy.",
      kFlags, true, &exit_code);
  if (!args.has_value()) return exit_code;
  if (int code = NoPositional("embed", *args); code != 0) return code;
  const std::string model = absl::GetFlag(FLAGS_model);
  if (model.empty()) return UsageFail("embed", "--model is required (see ropeattn models)");
  if (absl::GetFlag(FLAGS_tokens).empty()) return UsageFail("embed", "--tokens is required");
  auto tokens = ParseIntList("tokens", absl::GetFlag(FLAGS_tokens));
  if (!tokens.ok()) return UsageFail("embed", tokens.status().message());
  auto shape = ParseIntList("shape", absl::GetFlag(FLAGS_shape));
  if (!shape.ok()) return UsageFail("embed", shape.status().message());
  auto offsets = ParseIntList("offsets", absl::GetFlag(FLAGS_offsets));
  if (!offsets.ok()) return UsageFail("embed", offsets.status().message());
  absl::StatusOr<v1::DType> dtype = ParseDType("dtype", absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return Fail("embed", dtype.status());
  v1::EmbedRequest request;
  request.set_model(model);
  for (int64_t id : *tokens) request.add_token_ids(id);
  for (int64_t d : *shape) request.add_shape(d);
  for (int64_t o : *offsets) request.add_q_offsets(o);
  request.set_out_dtype(*dtype);

  if (absl::Status s = CheckOutputs({"out"}); !s.ok()) return Fail("embed", s);
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail("embed", client.status());
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::EmbedResponse> response = (*client)->Embed(request);
  const absl::Duration elapsed = absl::Now() - start;
  if (!response.ok()) return Fail("embed", response.status());
  std::cout << absl::StrFormat("%-8s %s\n", "model", model)
            << absl::StrFormat("%-8s %d ids\n", "tokens", request.token_ids_size())
            << absl::StrFormat("%-8s %.3f ms\n", "time", absl::ToDoubleMilliseconds(elapsed));
  PrintTensorSummary("out", response->embeddings());
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    if (absl::Status s = WriteOut(out, response->embeddings()); !s.ok()) return Fail("embed", s);
  }
  return 0;
}

}  // namespace ropeattn::cli
