// Subcommands of the `ropeattn` CLI. Each takes the arguments after its name
// (argv[0] is the subcommand name), parses its own flags, prints its output
// and returns the process exit code: 0 on success, the gRPC status code of
// the failure otherwise (1 = CANCELLED ... 16 = UNAUTHENTICATED), 64 for a
// usage error. Errors are one line on stderr: "ropeattn <cmd>: <CODE>: <message>".
#ifndef ROPEATTN_CLIENT_CLI_COMMANDS_H_
#define ROPEATTN_CLIENT_CLI_COMMANDS_H_

namespace ropeattn::cli {

int HealthCommand(int argc, char** argv);
int InfoCommand(int argc, char** argv);
int SessionsCommand(int argc, char** argv);
int ModelsCommand(int argc, char** argv);
int EmbedCommand(int argc, char** argv);
int AttendCommand(int argc, char** argv);
int EncodeCommand(int argc, char** argv);
int DecodeCommand(int argc, char** argv);
int PlotCommand(int argc, char** argv);
int BenchCommand(int argc, char** argv);

}  // namespace ropeattn::cli

#endif  // ROPEATTN_CLIENT_CLI_COMMANDS_H_
