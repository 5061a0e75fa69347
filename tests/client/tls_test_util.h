// TLS material for the client tests (client_test, cli_test, loadgen_test):
// certificates made at test time (tests/tools/test_certs.h), a tokens file,
// and options for a real ropeattn server that uses them.
#ifndef ROPEATTN_TESTS_CLIENT_TLS_TEST_UTIL_H_
#define ROPEATTN_TESTS_CLIENT_TLS_TEST_UTIL_H_

#include <string>

#include "absl/status/statusor.h"
#include "server/options.h"
#include "tests/tools/test_certs.h"

namespace ropeattn::testing {

// The tokens file's entries. Distinctive strings, so a message that leaks
// one is caught by a substring check.
inline constexpr char kAliceToken[] = "alice-tok-3b9f01c7";
inline constexpr char kAdminToken[] = "admin-tok-e2d45a90";
// Well formed, in no tokens file.
inline constexpr char kUnknownToken[] = "nobody-tok-77c2e8f1";

struct TlsMaterial {
  std::string dir;      // a fresh temporary directory holding all of it
  std::string ca_file;  // the CA that signed `server` and `client`
  CertFiles server;     // CN localhost, SAN DNS:localhost, IP:127.0.0.1
  CertFiles client;     // clientAuth, SAN URI:spiffe://test/alice
  // Another CA, and a client certificate it signed: trusted by nobody here.
  std::string other_ca_file;
  CertFiles stranger;
  // "kAliceToken alice" and "kAdminToken root admin".
  std::string tokens_file;
};

// Makes everything above in a new temporary directory whose name starts
// with `prefix` (openssl on the command line; well under a second).
absl::StatusOr<TlsMaterial> MakeTlsMaterial(const std::string& prefix);

// TestServerOptions() serving TLS with `m.server`; with `client_ca`, client
// certificates are required and verified against m.ca_file; with `tokens`,
// every call but health needs a token from m.tokens_file.
server::ServerOptions TlsServerOptions(const TlsMaterial& m, bool client_ca, bool tokens);

}  // namespace ropeattn::testing

#endif  // ROPEATTN_TESTS_CLIENT_TLS_TEST_UTIL_H_
