#include "client/cli/common.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051",
          "Server address: host:port, [IPv6]:port, or a gRPC target (dns:///host:port, "
          "unix:/path, ipv4:a:port,...); port in 1..65535.");
ABSL_FLAG(double, deadline_seconds, 30, "Deadline of each call (each Decode operation), seconds.");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{256} << 20,
          "Largest message either way; at least what the server sends (server default 256 MiB).");
ABSL_FLAG(std::string, tls_ca_file, "",
          "TLS: PEM CA certificates that verify the server. Any --tls_* flag turns TLS on; with "
          "TLS on and this empty, the system's roots. A public server without mutual TLS: "
          "/etc/ssl/certs/ca-certificates.crt.");
ABSL_FLAG(std::string, tls_cert_file, "",
          "Mutual TLS: this client's PEM certificate chain (with --tls_key_file).");
ABSL_FLAG(std::string, tls_key_file, "",
          "Mutual TLS: the unencrypted PEM private key of --tls_cert_file.");
ABSL_FLAG(std::string, token, "",
          "Bearer token sent as `authorization: Bearer <token>` on every call; needs TLS. Not "
          "given: $ROPEATTN_TOKEN if set (preferred: a command line is visible to other users; "
          "--token= sends none). Not embed's --tokens (token ids).");

ABSL_FLAG(uint64_t, seed, 1, "Seed of the random inputs (q, k, v use seed, seed+1, seed+2).");
ABSL_FLAG(int64_t, batch, 1, "Batch size B of random inputs.");
ABSL_FLAG(int64_t, q_len, 16, "Query length Sq of random inputs.");
ABSL_FLAG(int64_t, k_len, 0, "Key length Sk of random inputs; 0 means q_len.");
ABSL_FLAG(int64_t, heads, 8, "Query heads H.");
ABSL_FLAG(int64_t, kv_heads, 0, "Key/value heads Hkv (grouped-query attention); 0 means heads.");
ABSL_FLAG(int64_t, head_dim, 64, "Head dimension D of q and k.");
ABSL_FLAG(int64_t, v_dim, 0, "Value dimension Dv; 0 means head_dim.");
ABSL_FLAG(std::string, dtype, "f32", "Dtype of random inputs: f32 or bf16.");
ABSL_FLAG(std::string, q, "", "Queries from this .npy file [B, Sq, H, D] (with --k and --v).");
ABSL_FLAG(std::string, k, "", "Keys from this .npy file [B, Sk, Hkv, D] (with --q and --v).");
ABSL_FLAG(std::string, v, "", "Values from this .npy file [B, Sk, Hkv, Dv] (with --q and --k).");
ABSL_FLAG(std::string, out, "", "Output file (.npy for attend/encode/decode, .svg for plot).");

ABSL_FLAG(double, scale, 0, "Logit scale; 0 means 1/sqrt(head_dim).");
ABSL_FLAG(bool, causal, false, "Causal mask (query i sees keys at positions <= its own).");
ABSL_FLAG(int64_t, window, 0, "Sliding window in tokens; 0 means none.");
ABSL_FLAG(double, softcap, 0, "Logit soft-cap; 0 means none.");
ABSL_FLAG(bool, alibi, false, "ALiBi biases (standard slopes) instead of RoPE.");

ABSL_FLAG(bool, rope, false,
          "Rotate q and k with RoPE. Off by default, as in the API (an AttentionSpec without "
          "`rope` has no positional scheme); any other RoPE flag the subcommand reads "
          "(--rope_type, ...) turns it on.");
ABSL_FLAG(std::string, rope_type, "default",
          "RoPE scaling rule: default, linear, ntk, dynamic, yarn, longrope, llama3.");
ABSL_FLAG(double, rope_factor, 0, "RoPE scaling factor; 0 means 1.");
ABSL_FLAG(double, theta, 0, "RoPE base; 0 means 10000.");
ABSL_FLAG(int64_t, original_max_positions, 0,
          "Trained context length L0 (required by dynamic, yarn, longrope, llama3).");
ABSL_FLAG(std::string, rope_layout, "half_split", "RoPE pair layout: half_split or interleaved.");
ABSL_FLAG(int64_t, rotary_dim, 0, "Rotated channels (partial rotary); 0 means head_dim.");
ABSL_FLAG(int64_t, seq_len, 0, "Sequence length for length-dependent rules (dynamic, longrope).");

ABSL_FLAG(int64_t, num_positions, 64, "Positions of the sinusoidal table (rows).");
ABSL_FLAG(int64_t, d_model, 64, "Model dimension of the sinusoidal table (columns).");
ABSL_FLAG(double, base, 0, "Sinusoidal base; 0 means 10000.");
ABSL_FLAG(std::string, sin_layout, "interleaved",
          "Sinusoidal layout: interleaved (sin at 2i, cos at 2i+1) or sin_cos_half.");
ABSL_FLAG(int64_t, first_position, 0, "Position of the sinusoidal table's first row.");

ABSL_FLAG(std::string, model, "",
          "Layer mode: a served model (see `ropeattn models`); q/k/v are then the model's "
          "projections of hidden states [B, S, hidden_size].");
ABSL_FLAG(int32_t, layer, 0, "Layer mode: the model's attention layer, 0 .. num_layers - 1.");
ABSL_FLAG(std::string, hidden, "",
          "Layer mode: hidden states from this .npy file [B, S, hidden_size] (decode: "
          "[1, N, hidden_size]); random (--seed, --dtype) if empty.");

namespace ropeattn::cli {
namespace {

constexpr absl::string_view kConnectionFlags[] = {
    "target",      "deadline_seconds", "max_message_bytes",
    "tls_ca_file", "tls_cert_file",    "tls_key_file",
    "token"};
// Where --token comes from when it is not given.
constexpr char kTokenEnv[] = "ROPEATTN_TOKEN";
constexpr absl::string_view kRopeFlags[] = {
    "rope_type", "rope_factor", "theta", "original_max_positions", "rope_layout", "rotary_dim"};
constexpr absl::string_view kAttentionSpecFlags[] = {"heads",
                                                     "kv_heads",
                                                     "head_dim",
                                                     "scale",
                                                     "causal",
                                                     "window",
                                                     "softcap",
                                                     "alibi",
                                                     "rope",
                                                     "rope_type",
                                                     "rope_factor",
                                                     "theta",
                                                     "original_max_positions",
                                                     "rope_layout",
                                                     "rotary_dim"};

std::set<std::string>& GivenFlags() {
  static auto* given = new std::set<std::string>();
  return *given;
}

// Wraps `text` at `width` columns with `indent` spaces on continuation lines.
std::string Wrap(absl::string_view text, size_t width, size_t indent) {
  std::string result;
  size_t column = indent;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (column > indent && column + 1 + word.size() > width) {
      absl::StrAppend(&result, "\n", std::string(indent, ' '));
      column = indent;
    } else if (column > indent) {
      result += ' ';
      ++column;
    }
    absl::StrAppend(&result, word);
    column += word.size();
  }
  return result;
}

void PrintFlagHelp(const absl::CommandLineFlag& flag) {
  std::string line = absl::StrCat("  --", flag.Name());
  std::string def = flag.DefaultValue();
  if (flag.IsOfType<std::string>()) def = absl::StrCat("\"", def, "\"");
  std::cout << line << "\n      " << Wrap(absl::StrCat(flag.Help(), " (default: ", def, ")"), 78, 6)
            << "\n";
}

std::optional<std::vector<std::string>> ParseImpl(
    int argc, char** argv, absl::string_view usage,
    const std::function<bool(const absl::CommandLineFlag&)>& own, bool connection,
    absl::Span<const absl::string_view> order, int* exit_code) {
  const std::string command = argc > 0 ? argv[0] : "ropeattn";
  *exit_code = 0;
  auto accepted = [&](const absl::CommandLineFlag& flag) {
    if (connection && std::find(std::begin(kConnectionFlags), std::end(kConnectionFlags),
                                flag.Name()) != std::end(kConnectionFlags)) {
      return true;
    }
    return own(flag);
  };
  // Make absl's own usage machinery agree with ours, should anything call it.
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [own](absl::string_view file) {
    for (const auto& [name, flag] : absl::GetAllFlags()) {
      if (flag->Filename() == file && own(*flag)) return true;
    }
    return false;
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);

  std::vector<std::string> positional;
  bool flags_done = false;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (flags_done || arg.size() < 2 || arg[0] != '-') {
      positional.emplace_back(arg);
      continue;
    }
    if (arg == "--") {
      flags_done = true;
      continue;
    }
    absl::string_view body = arg;
    if (!absl::ConsumePrefix(&body, "--")) absl::ConsumePrefix(&body, "-");
    if (body == "help" || body == "helpfull" || body == "h" || body == "helpshort") {
      std::cout << "Usage: ropeattn " << command << " [flags]\n\n" << usage << "\n\nFlags:\n";
      std::vector<const absl::CommandLineFlag*> shown;
      auto all = absl::GetAllFlags();
      for (absl::string_view name : order) {
        auto it = all.find(name);
        if (it != all.end() && accepted(*it->second)) shown.push_back(it->second);
      }
      std::vector<const absl::CommandLineFlag*> rest;
      for (const auto& [name, flag] : all) {
        if (!accepted(*flag) || std::find(shown.begin(), shown.end(), flag) != shown.end() ||
            std::find(std::begin(kConnectionFlags), std::end(kConnectionFlags), name) !=
                std::end(kConnectionFlags)) {
          continue;
        }
        rest.push_back(flag);
      }
      std::sort(rest.begin(), rest.end(), [](auto* a, auto* b) { return a->Name() < b->Name(); });
      shown.insert(shown.end(), rest.begin(), rest.end());
      for (const auto* flag : shown) {
        if (std::find(std::begin(kConnectionFlags), std::end(kConnectionFlags), flag->Name()) ==
            std::end(kConnectionFlags)) {
          PrintFlagHelp(*flag);
        }
      }
      if (connection) {
        std::cout << "\nConnection flags:\n";
        for (absl::string_view name : kConnectionFlags) {
          PrintFlagHelp(*absl::FindCommandLineFlag(name));
        }
      }
      std::cout << std::flush;
      *exit_code = 0;
      return std::nullopt;
    }
    std::string name(body);
    std::optional<std::string> value;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && !value.has_value() && absl::StartsWith(name, "no")) {
      absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>()) {
        flag = negated;
        name = name.substr(2);
        value = "false";
      }
    }
    if (flag == nullptr || !accepted(*flag)) {
      *exit_code = UsageFail(
          command, absl::StrCat("unknown flag --", name, " (see ropeattn ", command, " --help)"));
      return std::nullopt;
    }
    if (!value.has_value()) {
      if (flag->IsOfType<bool>()) {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        *exit_code = UsageFail(command, absl::StrCat("flag --", name, " needs a value"));
        return std::nullopt;
      }
    }
    // A repeated list flag accumulates its values.
    if (flag->IsOfType<std::vector<std::string>>() && GivenFlags().count(name) > 0 &&
        !value->empty()) {
      std::string current = flag->CurrentValue();
      if (!current.empty()) value = absl::StrCat(current, ",", *value);
    }
    std::string error;
    if (!flag->ParseFrom(*value, &error)) {
      *exit_code = UsageFail(command, absl::StrCat("bad value for --", name, ": ", error));
      return std::nullopt;
    }
    GivenFlags().insert(name);
  }
  return positional;
}

}  // namespace

absl::Span<const absl::string_view> ConnectionFlags() { return kConnectionFlags; }
absl::Span<const absl::string_view> RopeFlags() { return kRopeFlags; }
absl::Span<const absl::string_view> AttentionSpecFlags() { return kAttentionSpecFlags; }

std::optional<std::vector<std::string>> ParseSubcommand(int argc, char** argv,
                                                        absl::string_view usage,
                                                        absl::string_view flags_file,
                                                        int* exit_code) {
  std::string file(flags_file);
  return ParseImpl(
      argc, argv, usage,
      [file](const absl::CommandLineFlag& flag) {
        return !file.empty() && absl::EndsWith(flag.Filename(), file);
      },
      /*connection=*/true, {}, exit_code);
}

std::optional<std::vector<std::string>> ParseSubcommand(int argc, char** argv,
                                                        absl::string_view usage,
                                                        absl::Span<const absl::string_view> flags,
                                                        bool connection, int* exit_code) {
  std::vector<std::string> names(flags.begin(), flags.end());
  return ParseImpl(
      argc, argv, usage,
      [names](const absl::CommandLineFlag& flag) {
        return std::find(names.begin(), names.end(), flag.Name()) != names.end();
      },
      connection, flags, exit_code);
}

bool FlagGiven(absl::string_view name) { return GivenFlags().count(std::string(name)) > 0; }

bool FlagSet(absl::string_view name) {
  if (!FlagGiven(name)) return false;
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  return flag == nullptr || !flag->CurrentValue().empty();
}

absl::StatusOr<std::unique_ptr<client::Client>> ConnectFromFlags() {
  client::ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  const double deadline = absl::GetFlag(FLAGS_deadline_seconds);
  if (!(deadline > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--deadline_seconds must be positive, got ", deadline));
  }
  options.deadline = absl::Seconds(deadline);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key_file);
  // --token wins even when empty, so `--token=` sends none whatever the
  // environment holds.
  const char* env_token = std::getenv(kTokenEnv);
  const bool token_from_env = !FlagGiven("token") && env_token != nullptr && *env_token != '\0';
  options.token = token_from_env ? env_token : absl::GetFlag(FLAGS_token);
  absl::StatusOr<std::unique_ptr<client::Client>> client = client::Client::Connect(options);
  if (!client.ok() && absl::StartsWith(client.status().message(), "target ")) {
    // The option is the flag: name it as the user wrote it.
    return absl::Status(client.status().code(), absl::StrCat("--", client.status().message()));
  }
  if (!client.ok() && token_from_env && absl::StartsWith(client.status().message(), "token")) {
    // The user may not know the variable is set; the message still never
    // shows its value.
    return absl::Status(client.status().code(),
                        absl::StrCat(client.status().message(), " (the token is $", kTokenEnv,
                                     " from the environment; --token= sends none)"));
  }
  return client;
}

const char* CodeName(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return "OK";
    case absl::StatusCode::kCancelled:
      return "CANCELLED";
    case absl::StatusCode::kUnknown:
      return "UNKNOWN";
    case absl::StatusCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case absl::StatusCode::kDeadlineExceeded:
      return "DEADLINE_EXCEEDED";
    case absl::StatusCode::kNotFound:
      return "NOT_FOUND";
    case absl::StatusCode::kAlreadyExists:
      return "ALREADY_EXISTS";
    case absl::StatusCode::kPermissionDenied:
      return "PERMISSION_DENIED";
    case absl::StatusCode::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case absl::StatusCode::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case absl::StatusCode::kAborted:
      return "ABORTED";
    case absl::StatusCode::kOutOfRange:
      return "OUT_OF_RANGE";
    case absl::StatusCode::kUnimplemented:
      return "UNIMPLEMENTED";
    case absl::StatusCode::kInternal:
      return "INTERNAL";
    case absl::StatusCode::kUnavailable:
      return "UNAVAILABLE";
    case absl::StatusCode::kDataLoss:
      return "DATA_LOSS";
    case absl::StatusCode::kUnauthenticated:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

int Fail(absl::string_view command, const absl::Status& status) {
  if (status.ok()) return 0;
  // One line, whatever the message holds.
  std::string message(status.message());
  std::replace(message.begin(), message.end(), '\n', ' ');
  std::cout << std::flush;
  std::cerr << "ropeattn " << command << ": " << CodeName(status.code()) << ": " << message
            << std::endl;
  const int code = static_cast<int>(status.code());
  return code >= 1 && code <= 16 ? code : static_cast<int>(absl::StatusCode::kUnknown);
}

int UsageFail(absl::string_view command, absl::string_view message) {
  std::cout << std::flush;
  std::cerr << "ropeattn " << command << ": USAGE: " << message << std::endl;
  return kUsageError;
}

absl::StatusOr<v1::DType> ParseDType(absl::string_view flag, absl::string_view value) {
  const std::string lower = absl::AsciiStrToLower(value);
  if (lower == "f32" || lower == "float32") return v1::DTYPE_F32;
  if (lower == "bf16" || lower == "bfloat16") return v1::DTYPE_BF16;
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be f32 or bf16, got \"", value, "\""));
}

absl::StatusOr<v1::DType> ParseKvDType(absl::string_view flag, absl::string_view value) {
  const std::string lower = absl::AsciiStrToLower(value);
  if (lower == "int8") return v1::DTYPE_INT8;
  if (lower == "f32" || lower == "float32" || lower == "bf16" || lower == "bfloat16") {
    return ParseDType(flag, value);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be f32, bf16 or int8, got \"", value, "\""));
}

const char* DTypeName(v1::DType dtype) { return client::WireDTypeName(dtype); }

absl::StatusOr<v1::RopeSpec> RopeSpecFromFlags() {
  v1::RopeSpec rope;
  const std::string layout = absl::AsciiStrToLower(absl::GetFlag(FLAGS_rope_layout));
  if (layout == "half_split" || layout == "neox") {
    rope.set_layout(v1::ROPE_LAYOUT_HALF_SPLIT);
  } else if (layout == "interleaved" || layout == "gptj") {
    rope.set_layout(v1::ROPE_LAYOUT_INTERLEAVED);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--rope_layout must be half_split or interleaved, got \"", layout, "\""));
  }
  rope.set_rotary_dim(absl::GetFlag(FLAGS_rotary_dim));
  rope.set_theta(absl::GetFlag(FLAGS_theta));
  v1::RopeScaling* scaling = rope.mutable_scaling();
  scaling->set_rope_type(absl::GetFlag(FLAGS_rope_type));
  scaling->set_factor(absl::GetFlag(FLAGS_rope_factor));
  scaling->set_original_max_position_embeddings(absl::GetFlag(FLAGS_original_max_positions));
  return rope;
}

absl::StatusOr<v1::AttentionSpec> AttentionSpecFromFlags() {
  v1::AttentionSpec spec;
  spec.set_heads(absl::GetFlag(FLAGS_heads));
  spec.set_kv_heads(absl::GetFlag(FLAGS_kv_heads));
  spec.set_head_dim(absl::GetFlag(FLAGS_head_dim));
  spec.set_scale(absl::GetFlag(FLAGS_scale));
  spec.set_causal(absl::GetFlag(FLAGS_causal));
  spec.set_window(absl::GetFlag(FLAGS_window));
  spec.set_softcap(absl::GetFlag(FLAGS_softcap));
  bool rope_flag_given = false;
  for (absl::string_view name : kRopeFlags) rope_flag_given = rope_flag_given || FlagGiven(name);
  if (FlagGiven("rope") && !absl::GetFlag(FLAGS_rope) && rope_flag_given) {
    return absl::InvalidArgumentError(
        "--norope conflicts with the RoPE flags given (--rope_type, --rope_factor, --theta, "
        "--original_max_positions, --rope_layout, --rotary_dim)");
  }
  if (absl::GetFlag(FLAGS_alibi)) {
    if (absl::GetFlag(FLAGS_rope) || rope_flag_given) {
      return absl::InvalidArgumentError(
          "--alibi and RoPE are two positional schemes; a spec has at most one");
    }
    spec.mutable_alibi();
  } else if (absl::GetFlag(FLAGS_rope) || rope_flag_given) {
    absl::StatusOr<v1::RopeSpec> rope = RopeSpecFromFlags();
    if (!rope.ok()) return rope.status();
    *spec.mutable_rope() = *std::move(rope);
  }
  return spec;
}

std::string DescribeSpec(const v1::AttentionSpec& spec) {
  std::string text = absl::StrCat("heads ", spec.heads(), " kv_heads ",
                                  spec.kv_heads() == 0 ? spec.heads() : spec.kv_heads(),
                                  " head_dim ", spec.head_dim());
  if (spec.scale() != 0) absl::StrAppend(&text, " scale ", spec.scale());
  if (spec.causal()) absl::StrAppend(&text, " causal");
  if (spec.window() != 0) absl::StrAppend(&text, " window ", spec.window());
  if (spec.softcap() != 0) absl::StrAppend(&text, " softcap ", spec.softcap());
  switch (spec.positional_case()) {
    case v1::AttentionSpec::kRope: {
      const v1::RopeSpec& rope = spec.rope();
      const std::string& type = rope.scaling().rope_type();
      absl::StrAppend(&text, " rope ", type.empty() ? "default" : type);
      if (rope.scaling().factor() != 0) absl::StrAppend(&text, " x", rope.scaling().factor());
      absl::StrAppend(&text, " theta ", rope.theta() == 0 ? 10000.0 : rope.theta());
      absl::StrAppend(
          &text, rope.layout() == v1::ROPE_LAYOUT_INTERLEAVED ? " interleaved" : " half_split");
      if (rope.rotary_dim() != 0) absl::StrAppend(&text, " rotary_dim ", rope.rotary_dim());
      if (rope.scaling().original_max_position_embeddings() != 0) {
        absl::StrAppend(&text, " L0 ", rope.scaling().original_max_position_embeddings());
      }
      break;
    }
    case v1::AttentionSpec::kAlibi:
      absl::StrAppend(&text, " alibi");
      break;
    case v1::AttentionSpec::kT5:
      absl::StrAppend(&text, " t5");
      break;
    default:
      absl::StrAppend(&text, " no positional encoding");
  }
  return text;
}

namespace {

// The directory of `path`, whose last '/' is at `slash` (npos: none).
std::string DirectoryOf(const std::string& path, size_t slash) {
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

// What identifies the file `path` names: its device and inode when it
// exists, else its directory's real path and its name.
std::string FileIdentity(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) return absl::StrCat("inode ", st.st_dev, ":", st.st_ino);
  const size_t slash = path.rfind('/');
  const std::string dir = DirectoryOf(path, slash);
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  char* real = ::realpath(dir.c_str(), nullptr);
  if (real == nullptr) return absl::StrCat("path ", path);
  std::string identity = absl::StrCat("path ", real, "/", name);
  std::free(real);
  return identity;
}

}  // namespace

absl::Status CheckOutputPath(absl::string_view flag, const std::string& path) {
  if (path.empty()) return absl::OkStatus();
  auto error = [&](int err, absl::string_view detail) {
    return absl::ErrnoToStatus(err, absl::StrCat("--", flag, ": cannot write ", path, detail));
  };
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return error(EISDIR, "");
    if (::access(path.c_str(), W_OK) != 0) return error(errno, "");
    return absl::OkStatus();
  }
  if (errno != ENOENT) return error(errno, "");
  const size_t slash = path.rfind('/');
  const std::string dir = DirectoryOf(path, slash);
  if (::stat(dir.c_str(), &st) != 0) return error(errno, absl::StrCat(" (directory ", dir, ")"));
  if (!S_ISDIR(st.st_mode)) return error(ENOTDIR, absl::StrCat(" (", dir, " is not a directory)"));
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return error(errno, absl::StrCat(" (directory ", dir, ")"));
  }
  return absl::OkStatus();
}

std::optional<std::string> SameOutputFile(std::initializer_list<absl::string_view> flags) {
  std::vector<std::pair<absl::string_view, std::string>> seen;  // flag, identity
  for (absl::string_view flag : flags) {
    const absl::CommandLineFlag* f = absl::FindCommandLineFlag(flag);
    if (f == nullptr) continue;
    const std::string path = f->CurrentValue();
    if (path.empty()) continue;
    const std::string identity = FileIdentity(path);
    for (const auto& [other, other_identity] : seen) {
      if (other_identity == identity) {
        return absl::StrCat("--", other, " and --", flag, " name the same file ", path,
                            "; one would overwrite the other");
      }
    }
    seen.emplace_back(flag, identity);
  }
  return std::nullopt;
}

absl::StatusOr<v1::Tensor> ReadNpyFlag(absl::string_view flag, const std::string& path,
                                       bool one_message) {
  int64_t max_bytes;
  std::string limit_name;
  if (one_message) {
    max_bytes = absl::GetFlag(FLAGS_max_message_bytes);
    if (max_bytes <= 0 || max_bytes > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat("--max_message_bytes must be in [1, ",
                                                     std::numeric_limits<int32_t>::max(),
                                                     "], got ", max_bytes));
    }
    limit_name = "--max_message_bytes";
  } else {
    const long pages = sysconf(_SC_PHYS_PAGES);
    const long page_size = sysconf(_SC_PAGESIZE);
    max_bytes = pages > 0 && page_size > 0 &&
                        pages <= std::numeric_limits<int64_t>::max() / page_size
                    ? int64_t{pages} * page_size
                    : std::numeric_limits<int64_t>::max();
    limit_name = "this machine's memory";
  }
  absl::StatusOr<v1::Tensor> read = client::ReadNpy(path, max_bytes, limit_name);
  if (!read.ok()) {
    return absl::Status(read.status().code(),
                        absl::StrCat("--", flag, ": ", read.status().message()));
  }
  return read;
}

absl::StatusOr<Inputs> InputsFromFlags(int64_t batch, int64_t q_len, int64_t k_len,
                                       bool one_message) {
  const std::string q_path = absl::GetFlag(FLAGS_q);
  const std::string k_path = absl::GetFlag(FLAGS_k);
  const std::string v_path = absl::GetFlag(FLAGS_v);
  Inputs inputs;
  if (!q_path.empty() || !k_path.empty() || !v_path.empty()) {
    if (q_path.empty() || k_path.empty() || v_path.empty()) {
      return absl::InvalidArgumentError("--q, --k and --v must be given together");
    }
    for (auto [flag, path, tensor] :
         {std::tuple{"q", &q_path, &inputs.q}, std::tuple{"k", &k_path, &inputs.k},
          std::tuple{"v", &v_path, &inputs.v}}) {
      absl::StatusOr<v1::Tensor> read = ReadNpyFlag(flag, *path, one_message);
      if (!read.ok()) return read.status();
      // Here, where the flag and the file are known: the server's refusal
      // named neither.
      if (read->shape_size() != 4) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--", flag, ": ", *path, ": must have rank 4 [batch, seq, heads, dim], got ",
            DescribeTensor(*read)));
      }
      *tensor = *std::move(read);
    }
    return inputs;
  }
  absl::StatusOr<v1::DType> dtype = ParseDType("dtype", absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return dtype.status();
  const int64_t heads = absl::GetFlag(FLAGS_heads);
  const int64_t kv_heads =
      absl::GetFlag(FLAGS_kv_heads) == 0 ? heads : absl::GetFlag(FLAGS_kv_heads);
  const int64_t head_dim = absl::GetFlag(FLAGS_head_dim);
  const int64_t v_dim = absl::GetFlag(FLAGS_v_dim) == 0 ? head_dim : absl::GetFlag(FLAGS_v_dim);
  for (auto [name, value] :
       {std::pair{"batch", batch}, std::pair{"q_len", q_len}, std::pair{"k_len", k_len},
        std::pair{"heads", heads}, std::pair{"kv_heads", kv_heads}, std::pair{"head_dim", head_dim},
        std::pair{"v_dim", v_dim}}) {
    if (value <= 0 || value > (int64_t{1} << 24)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, " must be in [1, 2^24], got ", value));
    }
  }
  // Refused before generating gigabytes that could never be sent.
  const int64_t elem = *dtype == v1::DTYPE_BF16 ? 2 : 4;
  const double bytes = static_cast<double>(elem) * batch *
                       (static_cast<double>(q_len) * heads * head_dim +
                        static_cast<double>(k_len) * kv_heads * (head_dim + v_dim));
  const int64_t max = absl::GetFlag(FLAGS_max_message_bytes);
  if (max <= 0 || max > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("--max_message_bytes must be in [1, ",
                                                   std::numeric_limits<int32_t>::max(),
                                                   "], got ", max));
  }
  if (one_message && bytes > max) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "q, k and v of these shapes are %.0f bytes, more than --max_message_bytes %d; not sent",
        bytes, max));
  }
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const int64_t q_shape[] = {batch, q_len, heads, head_dim};
  const int64_t k_shape[] = {batch, k_len, kv_heads, head_dim};
  const int64_t v_shape[] = {batch, k_len, kv_heads, v_dim};
  absl::StatusOr<v1::Tensor> q = client::RandomTensor(*dtype, q_shape, seed);
  if (!q.ok()) return q.status();
  absl::StatusOr<v1::Tensor> k = client::RandomTensor(*dtype, k_shape, seed + 1);
  if (!k.ok()) return k.status();
  absl::StatusOr<v1::Tensor> v = client::RandomTensor(*dtype, v_shape, seed + 2);
  if (!v.ok()) return v.status();
  inputs.q = *std::move(q);
  inputs.k = *std::move(k);
  inputs.v = *std::move(v);
  return inputs;
}

std::string DescribeTensor(const v1::Tensor& tensor) {
  return absl::StrCat("[", absl::StrJoin(tensor.shape(), ", "), "] ", DTypeName(tensor.dtype()));
}

TensorStats ComputeStats(absl::Span<const float> values) {
  TensorStats stats;
  double sum = 0, sum_sq = 0;
  stats.min = std::numeric_limits<double>::infinity();
  stats.max = -std::numeric_limits<double>::infinity();
  for (float value : values) {
    if (!std::isfinite(value)) {
      ++stats.non_finite;
      continue;
    }
    ++stats.count;
    sum += value;
    sum_sq += static_cast<double>(value) * value;
    stats.min = std::min<double>(stats.min, value);
    stats.max = std::max<double>(stats.max, value);
  }
  if (stats.count > 0) {
    stats.mean = sum / stats.count;
    stats.std = std::sqrt(std::max(0.0, sum_sq / stats.count - stats.mean * stats.mean));
  } else {
    stats.min = stats.max = 0;
  }
  return stats;
}

std::string DescribeStats(const TensorStats& stats) {
  return absl::StrFormat(
      "mean %.6g std %.6g min %.6g max %.6g finite %s", stats.mean, stats.std, stats.min, stats.max,
      stats.non_finite == 0 ? std::string("yes")
                            : absl::StrCat("no (", stats.non_finite, " NaN/Inf)"));
}

std::optional<std::string> UnreadFlag(absl::Span<const absl::string_view> flags,
                                      std::initializer_list<absl::string_view> always,
                                      absl::string_view mode, const ModeReads& reads) {
  for (absl::string_view flag : flags) {
    if (!FlagSet(flag) || std::find(always.begin(), always.end(), flag) != always.end() ||
        std::find(reads.flags.begin(), reads.flags.end(), flag) != reads.flags.end()) {
      continue;
    }
    std::string refusal = absl::StrCat("--", flag, " is not read by ", mode);
    if (auto it = reads.unless.find(flag); it != reads.unless.end()) {
      absl::StrAppend(&refusal, " ", it->second);
    } else {
      absl::StrAppend(&refusal, " (it reads --", absl::StrJoin(reads.flags, ", --"), ")");
    }
    return refusal;
  }
  return std::nullopt;
}

absl::StatusOr<std::vector<int64_t>> ParseIntList(absl::string_view flag, absl::string_view value) {
  std::vector<int64_t> result;
  if (absl::StripAsciiWhitespace(value).empty()) return result;
  // Every element must be a number: "1,,2" is a typo, not [1, 2].
  for (absl::string_view part : absl::StrSplit(value, ',')) {
    int64_t number;
    if (!absl::SimpleAtoi(part, &number)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " must be comma-separated integers, got \"", part, "\""));
    }
    result.push_back(number);
  }
  return result;
}

}  // namespace ropeattn::cli
