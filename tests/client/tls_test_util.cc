#include "tests/client/tls_test_util.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tests/server/server_test_util.h"

namespace ropeattn::testing {

absl::StatusOr<TlsMaterial> MakeTlsMaterial(const std::string& prefix) {
  TlsMaterial m;
  m.dir = MakeTempDir(prefix);
  if (m.dir.empty()) return absl::InternalError("mkdtemp failed");
  absl::StatusOr<TestCa> ca = TestCa::Create(m.dir + "/ca", "test-ca");
  if (!ca.ok()) return ca.status();
  m.ca_file = ca->cert_file();
  absl::StatusOr<CertFiles> server = ca->IssueServer("server");
  if (!server.ok()) return server.status();
  m.server = *std::move(server);
  absl::StatusOr<CertFiles> client = ca->Issue("client", "URI:spiffe://test/alice", true);
  if (!client.ok()) return client.status();
  m.client = *std::move(client);

  absl::StatusOr<TestCa> other = TestCa::Create(m.dir + "/other", "other-ca");
  if (!other.ok()) return other.status();
  m.other_ca_file = other->cert_file();
  absl::StatusOr<CertFiles> stranger =
      other->Issue("stranger", "URI:spiffe://test/alice", /*client=*/true);
  if (!stranger.ok()) return stranger.status();
  m.stranger = *std::move(stranger);

  m.tokens_file = m.dir + "/tokens";
  absl::Status written = WriteFileAtomically(
      m.tokens_file,
      absl::StrCat("# test tokens\n", kAliceToken, " alice\n", kAdminToken, " root admin\n"));
  if (!written.ok()) return written;
  return m;
}

server::ServerOptions TlsServerOptions(const TlsMaterial& m, bool client_ca, bool tokens) {
  server::ServerOptions o = TestServerOptions();
  o.tls_cert_file = m.server.cert_file;
  o.tls_key_file = m.server.key_file;
  if (client_ca) o.tls_client_ca_file = m.ca_file;
  if (tokens) o.auth_tokens_file = m.tokens_file;
  return o;
}

}  // namespace ropeattn::testing
