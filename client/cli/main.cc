// `ropeattn`: command-line client of the ropeattn server.
//
//   ropeattn <subcommand> [flags]      ropeattn <subcommand> --help
//
// Exit codes: 0 on success, the gRPC status code of a failure (e.g. 3 for
// INVALID_ARGUMENT, 14 for UNAVAILABLE), 64 for a usage error.
#include <cstring>
#include <iostream>

#include "absl/strings/string_view.h"
#include "client/cli/commands.h"
#include "client/cli/common.h"

namespace {

struct Subcommand {
  const char* name;
  int (*run)(int argc, char** argv);
  const char* summary;
};

constexpr Subcommand kSubcommands[] = {
    {"health", ropeattn::cli::HealthCommand,
     "check the server's health (exit 0 only when SERVING)"},
    {"info", ropeattn::cli::InfoCommand,
     "server version, CPU, limits, KV memory and session counts (--json)"},
    {"sessions", ropeattn::cli::SessionsCommand, "list live decoding sessions; --close ID"},
    {"models", ropeattn::cli::ModelsCommand,
     "served models (--json); --name NAME for one in detail with its RoPE frequencies"},
    {"embed", ropeattn::cli::EmbedCommand,
     "token ids -> embeddings of a served model; summary and --out .npy"},
    {"attend", ropeattn::cli::AttendCommand,
     "one Attend call on random or .npy inputs (or a model's layer: --model); --out .npy"},
    {"encode", ropeattn::cli::EncodeCommand,
     "positional encodings (sinusoidal, RoPE frequencies/cos-sin/apply, ALiBi, T5)"},
    {"decode", ropeattn::cli::DecodeCommand,
     "a decoding session: prefill, N steps, per-step latency (--model: layer mode)"},
    {"plot", ropeattn::cli::PlotCommand,
     "SVG plots: RoPE decay, wavelengths, sinusoidal table, attention"},
    {"bench", ropeattn::cli::BenchCommand, "load generator (closed / open loop)"},
};

void PrintUsage(std::ostream& out) {
  out << "Usage: ropeattn <subcommand> [flags]\n\n"
         "Client of the ropeattn RoPE attention server.\n\nSubcommands:\n";
  for (const Subcommand& sub : kSubcommands) {
    out << "  " << sub.name << std::string(10 - std::strlen(sub.name), ' ') << sub.summary << "\n";
  }
  out << "\n'ropeattn <subcommand> --help' lists the subcommand's flags.\n"
         "Every subcommand that talks to a server takes --target, --deadline_seconds,\n"
         "--max_message_bytes and, for TLS, --tls_ca_file, --tls_cert_file, --tls_key_file\n"
         "and --token (a bearer token; default $ROPEATTN_TOKEN).\n"
         "Exit code: 0 on success, the gRPC status code of a failure, 64 for a usage error.\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    PrintUsage(std::cerr);
    return ropeattn::cli::kUsageError;
  }
  const absl::string_view name = argv[1];
  if (name == "--help" || name == "-help" || name == "-h" || name == "help") {
    PrintUsage(std::cout);
    return 0;
  }
  for (const Subcommand& sub : kSubcommands) {
    if (name == sub.name) return sub.run(argc - 1, argv + 1);
  }
  std::cerr << "ropeattn: USAGE: unknown subcommand \"" << name << "\" (see ropeattn --help)"
            << std::endl;
  return ropeattn::cli::kUsageError;
}
