// TLS and bearer tokens in the client library (ClientOptions tls_ca_file,
// tls_cert_file, tls_key_file, token): what Connect refuses, with which code
// and message (never the token). Certificates are made at test time
// (tests/tools/test_certs.h).
#include <sys/stat.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tools/test_certs.h"

namespace ropeattn::client {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

// Distinctive, so a message that leaks it is caught.
constexpr char kToken[] = "tok-7f3a9c1e5b";

// One CA, a server certificate and a client certificate for the suite.
class TlsOptionsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(ropeattn::testing::MakeTempDir("ropeattn_tls_client_"));
    ASSERT_FALSE(dir_->empty());
    absl::StatusOr<ropeattn::testing::TestCa> ca =
        ropeattn::testing::TestCa::Create(*dir_ + "/ca", "test-ca");
    ASSERT_TRUE(ca.ok()) << ca.status();
    ca_ = new ropeattn::testing::TestCa(*std::move(ca));
    absl::StatusOr<ropeattn::testing::CertFiles> client =
        ca_->Issue("client", "URI:spiffe://test/alice", /*client=*/true);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = new ropeattn::testing::CertFiles(*std::move(client));
  }
  static void TearDownTestSuite() {
    delete client_;
    delete ca_;
    delete dir_;
  }

  static std::string Path(const std::string& name) { return absl::StrCat(*dir_, "/", name); }
  static void Write(const std::string& path, const std::string& text) {
    ASSERT_TRUE(ropeattn::testing::WriteFileAtomically(path, text).ok()) << path;
  }

  static ClientOptions Options() {
    ClientOptions o;
    o.target = "127.0.0.1:1";  // never contacted: Connect is lazy
    return o;
  }

  static std::string* dir_;
  static ropeattn::testing::TestCa* ca_;
  static ropeattn::testing::CertFiles* client_;
};

std::string* TlsOptionsTest::dir_ = nullptr;
ropeattn::testing::TestCa* TlsOptionsTest::ca_ = nullptr;
ropeattn::testing::CertFiles* TlsOptionsTest::client_ = nullptr;

TEST_F(TlsOptionsTest, TokenWithoutTlsIsRefused) {
  ClientOptions o = Options();
  o.token = kToken;
  absl::Status s = Client::Connect(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "token needs TLS (tls_ca_file, tls_cert_file or tls_key_file): a bearer token on a "
            "plaintext channel can be read on the path");
  EXPECT_THAT(s.ToString(), Not(HasSubstr(kToken)));
}

TEST_F(TlsOptionsTest, CertificateAndKeyGoTogether) {
  ClientOptions o = Options();
  o.tls_ca_file = ca_->cert_file();
  o.tls_cert_file = client_->cert_file;
  absl::Status s = Client::Connect(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tls_cert_file is set, tls_key_file is empty"));

  o.tls_cert_file = "";
  o.tls_key_file = client_->key_file;
  s = Client::Connect(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tls_key_file is set, tls_cert_file is empty"));
  // The key's bytes never show.
  EXPECT_THAT(s.message(), Not(HasSubstr("PRIVATE KEY")));
}

TEST_F(TlsOptionsTest, UnreadableFilesAreNamed) {
  struct Case {
    const char* field;
    std::string ClientOptions::*member;
  };
  const Case cases[] = {{"tls_ca_file", &ClientOptions::tls_ca_file},
                        {"tls_cert_file", &ClientOptions::tls_cert_file},
                        {"tls_key_file", &ClientOptions::tls_key_file}};
  const std::string missing = Path("no-such-file.pem");
  for (const Case& c : cases) {
    ClientOptions o = Options();
    o.tls_ca_file = ca_->cert_file();
    o.tls_cert_file = client_->cert_file;
    o.tls_key_file = client_->key_file;
    o.token = kToken;
    o.*c.member = missing;
    absl::Status s = Client::Connect(o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(s.message(), AllOf(HasSubstr(absl::StrCat(c.field, " \"", missing, "\"")),
                                   HasSubstr("No such file or directory")))
        << c.field;
    EXPECT_THAT(s.ToString(), Not(HasSubstr(kToken))) << c.field;

    o.*c.member = *dir_;  // a directory: fopen succeeds, reading fails
    s = Client::Connect(o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(s.message(), HasSubstr(absl::StrCat(c.field, " \"", *dir_, "\""))) << c.field;
  }
}

TEST_F(TlsOptionsTest, FilesWithoutTheRightPemBlockAreNamed) {
  const std::string garbage = Path("garbage.pem");
  Write(garbage, "not a certificate\n");
  ClientOptions o = Options();
  o.tls_ca_file = garbage;
  absl::Status s = Client::Connect(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr(absl::StrCat("tls_ca_file \"", garbage, "\" holds no PEM certificate")));

  // Certificate and key swapped: the key file holds a certificate.
  o.tls_ca_file = ca_->cert_file();
  o.tls_cert_file = client_->cert_file;
  o.tls_key_file = client_->cert_file;
  s = Client::Connect(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("tls_key_file \"", client_->cert_file,
                                                  "\" holds no PEM private key")));
  o.tls_cert_file = client_->key_file;
  o.tls_key_file = client_->key_file;
  s = Client::Connect(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("tls_cert_file \"", client_->key_file,
                                                  "\" holds no PEM certificate")));
  EXPECT_THAT(s.message(), Not(HasSubstr(client_->key_pem.substr(40, 20))));

  // gRPC cannot ask for a passphrase.
  const std::string encrypted = Path("encrypted.key");
  Write(encrypted,
        "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIGk\n-----END ENCRYPTED PRIVATE KEY-----\n");
  o.tls_cert_file = client_->cert_file;
  o.tls_key_file = encrypted;
  s = Client::Connect(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("encrypted private key"));
}

TEST_F(TlsOptionsTest, TokenMustBePrintableAsciiWithoutSpaces) {
  for (const std::string& bad :
       {std::string("Bearer ") + kToken, std::string(kToken) + "\n", std::string(kToken) + " x",
        std::string(kToken) + "\x01", std::string(kToken) + "\xc3\xa9"}) {
    ClientOptions o = Options();
    o.tls_ca_file = ca_->cert_file();
    o.token = bad;
    absl::Status s = Client::Connect(o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("token must be printable ASCII without spaces"));
    EXPECT_THAT(s.ToString(), Not(HasSubstr(kToken)));
  }
  ClientOptions o = Options();
  o.tls_ca_file = ca_->cert_file();
  o.token = std::string("Bearer ") + kToken;
  EXPECT_THAT(Client::Connect(o).status().message(), HasSubstr("without \"Bearer \""));
}

TEST_F(TlsOptionsTest, ValidCombinationsConnect) {
  // Connect is lazy: these only check that the options are accepted.
  ClientOptions o = Options();
  o.tls_ca_file = ca_->cert_file();
  EXPECT_TRUE(Client::Connect(o).ok());
  o.token = kToken;
  EXPECT_TRUE(Client::Connect(o).ok());
  o.tls_cert_file = client_->cert_file;
  o.tls_key_file = client_->key_file;
  EXPECT_TRUE(Client::Connect(o).ok());
  o.targets = {"127.0.0.1:1", "127.0.0.1:2"};
  EXPECT_TRUE(Client::Connect(o).ok());
  // The system's roots: a client certificate alone, or a token over TLS with
  // no CA file, is a valid setup.
  o = Options();
  o.tls_cert_file = client_->cert_file;
  o.tls_key_file = client_->key_file;
  o.token = kToken;
  EXPECT_TRUE(Client::Connect(o).ok());
}

}  // namespace
}  // namespace ropeattn::client
