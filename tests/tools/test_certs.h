// Certificates made at test time with the openssl command line (Debian's
// `openssl` package): a CA, a server certificate for localhost/127.0.0.1,
// client certificates, and deliberately bad ones. EC P-256 keys, so a whole
// set takes well under a second.
#ifndef ROPEATTN_TESTS_TOOLS_TEST_CERTS_H_
#define ROPEATTN_TESTS_TOOLS_TEST_CERTS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ropeattn::testing {

// A certificate and its key, as files and as PEM text.
struct CertFiles {
  std::string cert_file, key_file;
  std::string cert_pem, key_pem;
};

class TestCa {
 public:
  // A new self-signed CA in a fresh directory under `dir` (created if
  // missing), named `name` (also its CN).
  static absl::StatusOr<TestCa> Create(const std::string& dir, const std::string& name);

  const std::string& cert_file() const { return ca_.cert_file; }
  const std::string& cert_pem() const { return ca_.cert_pem; }

  // A leaf certificate signed by this CA. `san` is an openssl
  // subjectAltName value, e.g. "DNS:localhost,IP:127.0.0.1" or
  // "URI:spiffe://test/alice" (empty: no SAN). `days` < 0 makes one that
  // expired yesterday. `client` sets extendedKeyUsage clientAuth, else
  // serverAuth.
  absl::StatusOr<CertFiles> Issue(const std::string& name, const std::string& san, bool client,
                                  int days = 2) const;
  // The server certificate tests use: CN localhost, SAN DNS:localhost and
  // IP:127.0.0.1.
  absl::StatusOr<CertFiles> IssueServer(const std::string& name) const {
    return Issue(name, "DNS:localhost,IP:127.0.0.1", /*client=*/false);
  }

 private:
  std::string dir_;
  CertFiles ca_;
};

// A fresh temporary directory (mkdtemp under $TMPDIR or /tmp).
std::string MakeTempDir(const std::string& prefix);
// Whole-file helpers; Write replaces the file atomically (write + rename),
// the way a secret volume or cert-manager swaps files.
absl::StatusOr<std::string> ReadFileText(const std::string& path);
absl::Status WriteFileAtomically(const std::string& path, const std::string& text);

}  // namespace ropeattn::testing

#endif  // ROPEATTN_TESTS_TOOLS_TEST_CERTS_H_
