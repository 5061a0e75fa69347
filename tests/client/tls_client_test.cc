// TLS and bearer tokens in the client library (ClientOptions tls_ca_file,
// tls_cert_file, tls_key_file, token): what Connect refuses, with which code
// and message (never the token), and the library end to end against real
// servers with TLS, mutual TLS and a tokens file. Certificates are made at
// test time (tests/client/tls_test_util.h).
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/tls_test_util.h"
#include "tests/server/server_test_util.h"

namespace ropeattn::client {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

using ::ropeattn::testing::kAdminToken;
using ::ropeattn::testing::kAliceToken;
using ::ropeattn::testing::kUnknownToken;
using ::ropeattn::testing::TlsMaterial;

constexpr const char* kToken = kAliceToken;

// Certificates and a tokens file for the whole binary (made once).
const TlsMaterial& Material() {
  static const TlsMaterial* m = [] {
    absl::StatusOr<TlsMaterial> made = ::ropeattn::testing::MakeTlsMaterial("ropeattn_tls_client_");
    if (!made.ok()) {
      ADD_FAILURE() << made.status();
      return new TlsMaterial();
    }
    return new TlsMaterial(*std::move(made));
  }();
  return *m;
}

class TlsOptionsTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_FALSE(m().ca_file.empty()); }
  static const TlsMaterial& m() { return Material(); }
  static const ::ropeattn::testing::CertFiles& client() { return m().client; }
  static std::string Path(const std::string& name) { return absl::StrCat(m().dir, "/", name); }
  static void Write(const std::string& path, const std::string& text) {
    ASSERT_TRUE(::ropeattn::testing::WriteFileAtomically(path, text).ok()) << path;
  }
  static ClientOptions Options() {
    ClientOptions o;
    o.target = "127.0.0.1:1";  // never contacted: Connect is lazy
    return o;
  }
};

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
  o.tls_ca_file = m().ca_file;
  o.tls_cert_file = client().cert_file;
  absl::Status s = Client::Connect(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tls_cert_file is set, tls_key_file is empty"));

  o.tls_cert_file = "";
  o.tls_key_file = client().key_file;
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
    o.tls_ca_file = m().ca_file;
    o.tls_cert_file = client().cert_file;
    o.tls_key_file = client().key_file;
    o.token = kToken;
    o.*c.member = missing;
    absl::Status s = Client::Connect(o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(s.message(), AllOf(HasSubstr(absl::StrCat(c.field, " \"", missing, "\"")),
                                   HasSubstr("No such file or directory")))
        << c.field;
    EXPECT_THAT(s.ToString(), Not(HasSubstr(kToken))) << c.field;

    o.*c.member = m().dir;  // a directory: fopen succeeds, reading fails
    s = Client::Connect(o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(s.message(), HasSubstr(absl::StrCat(c.field, " \"", m().dir, "\""))) << c.field;
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
  o.tls_ca_file = m().ca_file;
  o.tls_cert_file = client().cert_file;
  o.tls_key_file = client().cert_file;
  s = Client::Connect(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("tls_key_file \"", client().cert_file,
                                                  "\" holds no PEM private key")));
  o.tls_cert_file = client().key_file;
  o.tls_key_file = client().key_file;
  s = Client::Connect(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("tls_cert_file \"", client().key_file,
                                                  "\" holds no PEM certificate")));
  EXPECT_THAT(s.message(), Not(HasSubstr(client().key_pem.substr(40, 20))));

  // gRPC cannot ask for a passphrase.
  const std::string encrypted = Path("encrypted.key");
  Write(encrypted,
        "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIGk\n-----END ENCRYPTED PRIVATE KEY-----\n");
  o.tls_cert_file = client().cert_file;
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
    o.tls_ca_file = m().ca_file;
    o.token = bad;
    absl::Status s = Client::Connect(o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("token must be printable ASCII without spaces"));
    EXPECT_THAT(s.ToString(), Not(HasSubstr(kToken)));
  }
  ClientOptions o = Options();
  o.tls_ca_file = m().ca_file;
  o.token = std::string("Bearer ") + kToken;
  EXPECT_THAT(Client::Connect(o).status().message(), HasSubstr("without \"Bearer \""));
}

TEST_F(TlsOptionsTest, ValidCombinationsConnect) {
  // Connect is lazy: these only check that the options are accepted.
  ClientOptions o = Options();
  o.tls_ca_file = m().ca_file;
  EXPECT_TRUE(Client::Connect(o).ok());
  o.token = kToken;
  EXPECT_TRUE(Client::Connect(o).ok());
  o.tls_cert_file = client().cert_file;
  o.tls_key_file = client().key_file;
  EXPECT_TRUE(Client::Connect(o).ok());
  o.targets = {"127.0.0.1:1", "127.0.0.1:2"};
  EXPECT_TRUE(Client::Connect(o).ok());
  // The system's roots: a client certificate alone, or a token over TLS with
  // no CA file, is a valid setup.
  o = Options();
  o.tls_cert_file = client().cert_file;
  o.tls_key_file = client().key_file;
  o.token = kToken;
  EXPECT_TRUE(Client::Connect(o).ok());
}

// ------------------------------------------- against a real TLS server --

class TlsServerTest : public TlsOptionsTest {
 protected:
  static std::unique_ptr<server::Server> Start(bool client_ca, bool tokens) {
    return ::ropeattn::testing::StartTestServer(
        ::ropeattn::testing::TlsServerOptions(m(), client_ca, tokens));
  }
  static std::string Local(const server::Server& server) {
    return absl::StrCat("127.0.0.1:", server.port());
  }
  // A client of `target` that trusts `ca_file` (empty: plaintext). Failures
  // are not retried, so a refused handshake shows at once.
  static std::unique_ptr<Client> ConnectTo(const std::string& target, const std::string& ca_file,
                                           const std::string& token = "",
                                           const ::ropeattn::testing::CertFiles* cert = nullptr) {
    ClientOptions o;
    o.target = target;
    o.tls_ca_file = ca_file;
    o.token = token;
    if (cert != nullptr) {
      o.tls_cert_file = cert->cert_file;
      o.tls_key_file = cert->key_file;
    }
    o.max_retries = 0;
    o.deadline = absl::Seconds(10);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(o);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }
};

constexpr int64_t kHeads = 2;
constexpr int64_t kDim = 4;

// A small non-causal Attend (no positional encoding) and its fp64 answer.
struct SmallAttend {
  v1::AttendRequest request;
  std::vector<double> expected;  // [1, 1, kHeads, kDim]
};

SmallAttend MakeSmallAttend() {
  constexpr int64_t kKeys = 3;
  SmallAttend a;
  a.request.mutable_spec()->set_heads(kHeads);
  a.request.mutable_spec()->set_head_dim(kDim);
  *a.request.mutable_q() = RandomTensor(v1::DTYPE_F32, {1, 1, kHeads, kDim}, 11).value();
  *a.request.mutable_k() = RandomTensor(v1::DTYPE_F32, {1, kKeys, kHeads, kDim}, 12).value();
  *a.request.mutable_v() = RandomTensor(v1::DTYPE_F32, {1, kKeys, kHeads, kDim}, 13).value();
  const std::vector<float> q = ToFloats(a.request.q()).value();
  const std::vector<float> k = ToFloats(a.request.k()).value();
  const std::vector<float> v = ToFloats(a.request.v()).value();
  a.expected.assign(kHeads * kDim, 0.0);
  for (int64_t h = 0; h < kHeads; ++h) {
    double weights[kKeys], sum = 0;
    for (int64_t j = 0; j < kKeys; ++j) {
      double dot = 0;
      for (int64_t c = 0; c < kDim; ++c)
        dot += double{q[h * kDim + c]} * k[(j * kHeads + h) * kDim + c];
      sum += weights[j] = std::exp(dot / std::sqrt(double{kDim}));
    }
    for (int64_t j = 0; j < kKeys; ++j) {
      for (int64_t c = 0; c < kDim; ++c) {
        a.expected[h * kDim + c] += weights[j] / sum * v[(j * kHeads + h) * kDim + c];
      }
    }
  }
  return a;
}

// "SERVING" etc., or the error: a failure shows why.
std::string Name(const absl::StatusOr<HealthStatus>& health) {
  return health.ok() ? HealthStatusName(*health) : health.status().ToString();
}

void ExpectCorrectAttend(Client& client) {
  const SmallAttend a = MakeSmallAttend();
  absl::StatusOr<v1::AttendResponse> response = client.Attend(a.request);
  ASSERT_TRUE(response.ok()) << response.status();
  const std::vector<float> out = ToFloats(response->out()).value();
  ASSERT_EQ(out.size(), a.expected.size());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], a.expected[i], 1e-5) << i;
}

v1::OpenSession SmallOpen() {
  v1::OpenSession open;
  open.mutable_spec()->set_heads(kHeads);
  open.mutable_spec()->set_head_dim(kDim);
  open.set_max_context(16);
  return open;
}

// One decode step of one token.
absl::StatusOr<v1::StepResult> StepOnce(Session& session) {
  return session.Step(RandomTensor(v1::DTYPE_F32, {1, 1, kHeads, kDim}, 21).value(),
                      RandomTensor(v1::DTYPE_F32, {1, 1, kHeads, kDim}, 22).value(),
                      RandomTensor(v1::DTYPE_F32, {1, 1, kHeads, kDim}, 23).value());
}

TEST_F(TlsServerTest, HealthAndAttendOverTls) {
  std::unique_ptr<server::Server> server = Start(/*client_ca=*/false, /*tokens=*/false);
  ASSERT_NE(server, nullptr);
  std::unique_ptr<Client> client = ConnectTo(Local(*server), m().ca_file);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<HealthStatus> health = client->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthStatus::kServing);
  ExpectCorrectAttend(*client);
  absl::StatusOr<std::unique_ptr<Session>> session = client->OpenSession(SmallOpen());
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_TRUE(StepOnce(**session).ok());
  EXPECT_TRUE((*session)->Close().ok());

  // The server really speaks TLS: a plaintext client, or one that trusts
  // another CA, fails the handshake.
  std::unique_ptr<Client> plaintext = ConnectTo(Local(*server), "");
  EXPECT_EQ(plaintext->Health().status().code(), absl::StatusCode::kUnavailable);
  std::unique_ptr<Client> wrong_ca = ConnectTo(Local(*server), m().other_ca_file);
  EXPECT_EQ(wrong_ca->Health().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(wrong_ca->GetServerInfo().status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(TlsServerTest, TokenIsSentOnEveryCall) {
  std::unique_ptr<server::Server> server = Start(/*client_ca=*/false, /*tokens=*/true);
  ASSERT_NE(server, nullptr);
  std::unique_ptr<Client> alice = ConnectTo(Local(*server), m().ca_file, kAliceToken);
  ASSERT_NE(alice, nullptr);
  EXPECT_EQ(Name(alice->Health()), "SERVING");
  absl::StatusOr<v1::ServerInfo> info = alice->GetServerInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  ExpectCorrectAttend(*alice);
  // A Decode stream carries it too, and the session is alice's.
  absl::StatusOr<std::unique_ptr<Session>> session = alice->OpenSession(SmallOpen());
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_TRUE(StepOnce(**session).ok());
  absl::StatusOr<std::vector<v1::SessionInfo>> listed = alice->ListSessions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].session_id(), (*session)->id());
  EXPECT_TRUE((*session)->Close().ok());

  for (const char* token : {kUnknownToken, ""}) {
    SCOPED_TRACE(*token == '\0' ? "no token" : "unknown token");
    std::unique_ptr<Client> client = ConnectTo(Local(*server), m().ca_file, token);
    ASSERT_NE(client, nullptr);
    absl::Status s = client->GetServerInfo().status();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
    EXPECT_THAT(s.ToString(), Not(HasSubstr(kUnknownToken)));
    EXPECT_EQ(client->Attend(MakeSmallAttend().request).status().code(),
              absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(client->OpenSession(SmallOpen()).status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(client->ListSessions().status().code(), absl::StatusCode::kUnauthenticated);
    // Health needs no token (probes carry none: docs/security.md).
    EXPECT_EQ(Name(client->Health()), "SERVING");
  }
}

TEST_F(TlsServerTest, EveryTargetGetsTheSameCredentials) {
  std::unique_ptr<server::Server> a = Start(/*client_ca=*/false, /*tokens=*/true);
  std::unique_ptr<server::Server> b = Start(/*client_ca=*/false, /*tokens=*/true);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ClientOptions o;
  o.targets = {Local(*a), Local(*b)};
  o.tls_ca_file = m().ca_file;
  o.token = kAdminToken;
  o.max_retries = 0;
  absl::StatusOr<std::unique_ptr<Client>> connected = Client::Connect(o);
  ASSERT_TRUE(connected.ok()) << connected.status();
  std::unique_ptr<Client> client = *std::move(connected);
  std::vector<std::unique_ptr<Session>> sessions;
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(Name(client->HealthOf(i)), "SERVING") << i;
    absl::StatusOr<std::unique_ptr<Session>> session = client->OpenSessionOn(i, SmallOpen(), "");
    ASSERT_TRUE(session.ok()) << i << ": " << session.status();
    sessions.push_back(*std::move(session));
    // Round robin: consecutive calls land on both targets.
    EXPECT_TRUE(client->GetServerInfo().ok()) << i;
  }
  // Every target's list, each asked with the token.
  absl::StatusOr<std::vector<v1::SessionInfo>> listed = client->ListSessions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->size(), 2u);
}

TEST_F(TlsServerTest, MutualTlsNeedsTheClientCertificate) {
  std::unique_ptr<server::Server> server = Start(/*client_ca=*/true, /*tokens=*/false);
  ASSERT_NE(server, nullptr);
  std::unique_ptr<Client> with_cert = ConnectTo(Local(*server), m().ca_file, "", &client());
  ASSERT_NE(with_cert, nullptr);
  EXPECT_EQ(Name(with_cert->Health()), "SERVING");
  absl::StatusOr<v1::ServerInfo> info = with_cert->GetServerInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  ExpectCorrectAttend(*with_cert);

  // No certificate, or one from a CA the server does not trust: the
  // handshake fails.
  std::unique_ptr<Client> without = ConnectTo(Local(*server), m().ca_file);
  EXPECT_EQ(without->GetServerInfo().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(without->Health().status().code(), absl::StatusCode::kUnavailable);
  std::unique_ptr<Client> stranger = ConnectTo(Local(*server), m().ca_file, "", &m().stranger);
  EXPECT_EQ(stranger->GetServerInfo().status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(TlsServerTest, MutualTlsWithTokensNeedsBoth) {
  std::unique_ptr<server::Server> server = Start(/*client_ca=*/true, /*tokens=*/true);
  ASSERT_NE(server, nullptr);
  std::unique_ptr<Client> both = ConnectTo(Local(*server), m().ca_file, kAliceToken, &client());
  absl::StatusOr<v1::ServerInfo> info = both->GetServerInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  // The certificate only admits the connection; the token names the caller.
  std::unique_ptr<Client> cert_only = ConnectTo(Local(*server), m().ca_file, "", &client());
  EXPECT_EQ(cert_only->GetServerInfo().status().code(), absl::StatusCode::kUnauthenticated);
  std::unique_ptr<Client> token_only = ConnectTo(Local(*server), m().ca_file, kAliceToken);
  EXPECT_EQ(token_only->GetServerInfo().status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace ropeattn::client
