// Reading a ropeattn-server child process's log (JSON lines on stdout,
// docs/logging.md) in tests that start the real binary.
#ifndef ROPEATTN_TESTS_TOOLS_SERVER_OUTPUT_H_
#define ROPEATTN_TESTS_TOOLS_SERVER_OUTPUT_H_

#include <cstdio>
#include <cstdlib>
#include <string>

namespace ropeattn::testing {

// One whole line (with its '\n'), however long; "" at end of file.
inline std::string ReadWholeLine(FILE* in) {
  std::string line;
  int c;
  while ((c = std::fgetc(in)) != EOF) {
    line.push_back(static_cast<char>(c));
    if (c == '\n') break;
  }
  return line;
}

// The integer after `key` (e.g. "\"port\":") in `line`; 0 when absent.
inline int IntAfter(const std::string& line, const std::string& key) {
  const size_t at = line.find(key);
  return at == std::string::npos ? 0 : std::atoi(line.c_str() + at + key.size());
}

// The start-up lines, up to and including the "config" line (the last one
// the server writes before it waits for a signal).
struct ServerStartup {
  int port = 0;          // from the "listening" line; 0 if the server never listened
  int metrics_port = 0;  // 0 when the metrics endpoint is disabled
  std::string limits_line;
  std::string text;  // every line read
};

inline ServerStartup ReadServerStartup(FILE* out) {
  ServerStartup s;
  for (std::string line = ReadWholeLine(out); !line.empty(); line = ReadWholeLine(out)) {
    s.text += line;
    if (line.find("\"event\":\"listening\"") != std::string::npos) {
      s.port = IntAfter(line, "\"port\":");
      s.metrics_port = IntAfter(line, "\"metrics\":\"http://127.0.0.1:");
    } else if (line.find("\"event\":\"limits\"") != std::string::npos) {
      s.limits_line = line;
    } else if (line.find("\"event\":\"config\"") != std::string::npos) {
      break;
    }
  }
  return s;
}

}  // namespace ropeattn::testing

#endif  // ROPEATTN_TESTS_TOOLS_SERVER_OUTPUT_H_
