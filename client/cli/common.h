// Shared plumbing of the `ropeattn` CLI subcommands.
//
// Flags: absl flags are process-wide, so a flag several subcommands use is
// defined once, here (common.cc), and each subcommand names the flags it
// accepts. The ones every server-talking subcommand shares:
//   --target (default 127.0.0.1:50051), --deadline_seconds (default 30),
//   --max_message_bytes (default 256 MiB, matching the server),
//   --tls_ca_file, --tls_cert_file, --tls_key_file, --token (ClientOptions'
//   TLS and token fields; --token defaults to $ROPEATTN_TOKEN).
// The attention / RoPE / input flags below are shared by attend, encode,
// decode and plot.
#ifndef ROPEATTN_CLIENT_CLI_COMMON_H_
#define ROPEATTN_CLIENT_CLI_COMMON_H_

#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "client/client.h"

ABSL_DECLARE_FLAG(std::string, target);
ABSL_DECLARE_FLAG(double, deadline_seconds);
ABSL_DECLARE_FLAG(int64_t, max_message_bytes);
ABSL_DECLARE_FLAG(std::string, tls_ca_file);
ABSL_DECLARE_FLAG(std::string, tls_cert_file);
ABSL_DECLARE_FLAG(std::string, tls_key_file);
ABSL_DECLARE_FLAG(std::string, token);

// Shapes and inputs (attend, decode, encode rope_apply, plot attention).
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(int64_t, batch);
ABSL_DECLARE_FLAG(int64_t, q_len);
ABSL_DECLARE_FLAG(int64_t, k_len);
ABSL_DECLARE_FLAG(int64_t, heads);
ABSL_DECLARE_FLAG(int64_t, kv_heads);
ABSL_DECLARE_FLAG(int64_t, head_dim);
ABSL_DECLARE_FLAG(int64_t, v_dim);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(std::string, q);
ABSL_DECLARE_FLAG(std::string, k);
ABSL_DECLARE_FLAG(std::string, v);
ABSL_DECLARE_FLAG(std::string, out);
// Attention spec.
ABSL_DECLARE_FLAG(double, scale);
ABSL_DECLARE_FLAG(bool, causal);
ABSL_DECLARE_FLAG(int64_t, window);
ABSL_DECLARE_FLAG(double, softcap);
ABSL_DECLARE_FLAG(bool, alibi);
// RoPE.
ABSL_DECLARE_FLAG(bool, rope);
ABSL_DECLARE_FLAG(std::string, rope_type);
ABSL_DECLARE_FLAG(double, rope_factor);
ABSL_DECLARE_FLAG(double, theta);
ABSL_DECLARE_FLAG(int64_t, original_max_positions);
ABSL_DECLARE_FLAG(std::string, rope_layout);
ABSL_DECLARE_FLAG(int64_t, rotary_dim);
ABSL_DECLARE_FLAG(int64_t, seq_len);
// Sinusoidal table (encode sinusoidal, plot sinusoidal).
ABSL_DECLARE_FLAG(int64_t, num_positions);
ABSL_DECLARE_FLAG(int64_t, d_model);
ABSL_DECLARE_FLAG(double, base);
ABSL_DECLARE_FLAG(std::string, sin_layout);
ABSL_DECLARE_FLAG(int64_t, first_position);
// Layer mode (attend, decode, bench): a served model's attention layer.
ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(int32_t, layer);
ABSL_DECLARE_FLAG(std::string, hidden);

namespace ropeattn::cli {

inline constexpr int kUsageError = 64;

// Names of the connection flags (target, deadline_seconds, max_message_bytes,
// tls_ca_file, tls_cert_file, tls_key_file, token) every server-talking
// subcommand accepts.
absl::Span<const absl::string_view> ConnectionFlags();
// The flags built by RopeSpecFromFlags / AttentionSpecFromFlags.
absl::Span<const absl::string_view> RopeFlags();
absl::Span<const absl::string_view> AttentionSpecFlags();  // includes RopeFlags

// Parses argv (argv[0] = subcommand name) with absl flags. Prints `usage`
// and the subcommand's flags for --help (returns 0 in *exit_code), or a
// one-line error for a bad flag (kUsageError). Returns the positional
// arguments after the subcommand when the command should run.
// Accepted flags: those defined in a file whose path ends with `flags_file`,
// plus the connection flags.
std::optional<std::vector<std::string>> ParseSubcommand(int argc, char** argv,
                                                        absl::string_view usage,
                                                        absl::string_view flags_file,
                                                        int* exit_code);
// Same, accepting exactly the flags named in `flags` (plus the connection
// flags unless `connection` is false). Flags are --name=value, --name value,
// --bool_flag / --nobool_flag; a std::vector<std::string> flag may repeat and
// accumulates. An unknown flag, one another subcommand owns, or a value that
// does not parse is a usage error.
std::optional<std::vector<std::string>> ParseSubcommand(int argc, char** argv,
                                                        absl::string_view usage,
                                                        absl::Span<const absl::string_view> flags,
                                                        bool connection, int* exit_code);

// True when the flag was given on this command line.
bool FlagGiven(absl::string_view name);
// True when the flag was given with a value: an empty one (`--hidden=`,
// `--q=`) is not, as the commands read a path or list flag that is empty as
// one not given.
bool FlagSet(absl::string_view name);

// A client for --target with the connection flags applied; the token is
// --token if given (even empty), else $ROPEATTN_TOKEN. Connect's
// InvalidArgument for a bad TLS or token setting (a token without TLS names
// ROPEATTN_TOKEN when the token came from it).
absl::StatusOr<std::unique_ptr<client::Client>> ConnectFromFlags();

// Prints "ropeattn <cmd>: <CODE_NAME>: <message>" to stderr and returns the
// exit code for the status (its gRPC code number; OK is 0).
int Fail(absl::string_view command, const absl::Status& status);
// Prints "ropeattn <cmd>: USAGE: <message>" and returns kUsageError.
int UsageFail(absl::string_view command, absl::string_view message);
// gRPC code name ("INVALID_ARGUMENT").
const char* CodeName(absl::StatusCode code);

// --- Building requests from the shared flags. ---

// "f32" / "bf16" (InvalidArgument otherwise, naming `flag`).
absl::StatusOr<v1::DType> ParseDType(absl::string_view flag, absl::string_view value);
// A session's KV cache dtype: f32, bf16 or int8.
absl::StatusOr<v1::DType> ParseKvDType(absl::string_view flag, absl::string_view value);
const char* DTypeName(v1::DType dtype);
// RopeSpec from --rope_type, --rope_factor, --theta, --original_max_positions,
// --rope_layout, --rotary_dim.
absl::StatusOr<v1::RopeSpec> RopeSpecFromFlags();
// AttentionSpec from --heads, --kv_heads, --head_dim, --scale, --causal,
// --window, --softcap and the positional scheme: ALiBi with --alibi, RoPE
// unless --norope, none otherwise.
absl::StatusOr<v1::AttentionSpec> AttentionSpecFromFlags();
// One line describing a spec ("heads 8/8 head_dim 64 causal rope default ...").
std::string DescribeSpec(const v1::AttentionSpec& spec);

// q, k, v for Attend / Decode: read from --q/--k/--v when all three are
// given, else random [batch, q_len, heads, head_dim], [batch, k_len,
// kv_heads, head_dim], [batch, k_len, kv_heads, v_dim] in --dtype from
// RandomTensor with seeds --seed, --seed + 1, --seed + 2 (a file of another
// rank than 4 is InvalidArgument naming the flag and the file). (`q_len`,
// `k_len`, `batch` override the flags for callers that need other lengths.)
struct Inputs {
  v1::Tensor q, k, v;
};
// `one_message`: the three go out in one request, so shapes whose bytes
// exceed --max_message_bytes are refused before anything is generated
// (decode sends them in slices, each checked by the client as it is sent).
absl::StatusOr<Inputs> InputsFromFlags(int64_t batch, int64_t q_len, int64_t k_len,
                                       bool one_message = true);

// The .npy file of an input flag (`flag` without dashes: "q", "hidden", "x"):
// client::ReadNpy with every error prefixed "--<flag>: " (the message names
// the file). `one_message`: the tensor goes out in one request, so a file
// whose tensor is more than --max_message_bytes is refused
// (RESOURCE_EXHAUSTED) before its data is read; otherwise (decode, sent in
// slices) one larger than this machine's memory is.
absl::StatusOr<v1::Tensor> ReadNpyFlag(absl::string_view flag, const std::string& path,
                                       bool one_message);

// Checks, before any work, that the output file `path` (the value of
// --<flag>) can be written: an existing one must be a writable non-directory,
// a new one needs an existing, writable directory. Empty: OK (no output).
// The error names the flag and the path, with errno's code (NOT_FOUND for a
// missing directory, as the write itself would have failed afterwards).
absl::Status CheckOutputPath(absl::string_view flag, const std::string& path);

// The refusal of two of the output `flags` (names without dashes) that name
// the same file, the second written over the first: "--out and --probs_out
// name the same file PATH"; nullopt when they name different ones (or are
// empty). A path whose directory does not exist is compared as written.
std::optional<std::string> SameOutputFile(std::initializer_list<absl::string_view> flags);

// "[1, 16, 8, 64] f32".
std::string DescribeTensor(const v1::Tensor& tensor);

struct TensorStats {
  int64_t count = 0;
  double mean = 0, std = 0, min = 0, max = 0;
  int64_t non_finite = 0;  // NaN or Inf elements (left out of the others)
};
TensorStats ComputeStats(absl::Span<const float> values);
// "mean 0.0012 std 0.31 min -0.9 max 0.95 finite yes".
std::string DescribeStats(const TensorStats& stats);

// The flags a subcommand reads in one mode (an encode op, attend's or
// decode's inputs); `unless` names flags it reads only in other modes or
// cases, with why not in this one. A flag given that the mode does not read
// is refused (UnreadFlag), not ignored. A flag given empty counts as not
// given (FlagSet), here as in the commands. Used by attend, decode, encode
// and plot.
struct ModeReads {
  std::vector<absl::string_view> flags;
  std::map<absl::string_view, std::string> unless;

  void Read(absl::Span<const absl::string_view> names) {
    flags.insert(flags.end(), names.begin(), names.end());
  }
  void Read(std::initializer_list<absl::string_view> names) {
    Read(absl::Span<const absl::string_view>(names.begin(), names.size()));
  }
  // Read only when `given` is (or, `absent`, is not) on the command line
  // with a value.
  void ReadIf(bool absent, absl::string_view given,
              std::initializer_list<absl::string_view> names) {
    if (FlagSet(given) != absent) {
      Read(names);
      return;
    }
    for (absl::string_view name : names) {
      unless[name] = absl::StrCat(absent ? "with --" : "without --", given);
    }
  }
  // Not read in this mode, for `why`.
  void NotRead(absl::Span<const absl::string_view> names, absl::string_view why) {
    for (absl::string_view name : names) unless[name] = std::string(why);
  }
  void NotRead(std::initializer_list<absl::string_view> names, absl::string_view why) {
    NotRead(absl::Span<const absl::string_view>(names.begin(), names.size()), why);
  }
};

// The refusal of the first of `flags` given on the command line (`always`
// are read in every mode) that `reads` does not read: "--seed is not read by
// <mode> <why>", or the flags it does read; nullopt when there is none.
std::optional<std::string> UnreadFlag(absl::Span<const absl::string_view> flags,
                                      std::initializer_list<absl::string_view> always,
                                      absl::string_view mode, const ModeReads& reads);

// Comma-separated integers ("0,5,9"); InvalidArgument naming `flag`.
absl::StatusOr<std::vector<int64_t>> ParseIntList(absl::string_view flag, absl::string_view value);

}  // namespace ropeattn::cli

#endif  // ROPEATTN_CLIENT_CLI_COMMON_H_
