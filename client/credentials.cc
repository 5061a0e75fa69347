#include "client/credentials.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/credentials.h"

namespace ropeattn::client {
namespace {

// A CA bundle is a few hundred KiB (Debian's ca-certificates.crt: ~200 KiB);
// anything near this is the wrong file, and reading on would only use memory.
constexpr size_t kMaxPemBytes = size_t{16} << 20;

constexpr absl::string_view kBeginCertificate = "-----BEGIN CERTIFICATE-----";

// The whole file, or InvalidArgument naming `field` and `path`.
absl::StatusOr<std::string> ReadPem(absl::string_view field, const std::string& path) {
  std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (file == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " \"", path, "\" cannot be read: ", std::strerror(errno)));
  }
  std::string text;
  char buffer[64 << 10];
  while (true) {
    const size_t n = std::fread(buffer, 1, sizeof(buffer), file.get());
    text.append(buffer, n);
    if (text.size() > kMaxPemBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " \"", path, "\" is over ", kMaxPemBytes, " bytes: not a PEM file"));
    }
    if (n < sizeof(buffer)) break;
  }
  if (std::ferror(file.get())) {
    // e.g. EISDIR: fopen opens a directory, reading it fails.
    return absl::InvalidArgumentError(
        absl::StrCat(field, " \"", path, "\" cannot be read: ", std::strerror(errno)));
  }
  return text;
}

absl::StatusOr<std::string> ReadCertificates(absl::string_view field, const std::string& path) {
  absl::StatusOr<std::string> pem = ReadPem(field, path);
  if (!pem.ok()) return pem.status();
  // gRPC would accept anything here and fail every handshake later with a
  // bare UNAVAILABLE; a wrong file is clearer now.
  if (!absl::StrContains(*pem, kBeginCertificate)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " \"", path, "\" holds no PEM certificate (", kBeginCertificate, ")"));
  }
  return pem;
}

absl::StatusOr<std::string> ReadPrivateKey(absl::string_view field, const std::string& path) {
  absl::StatusOr<std::string> pem = ReadPem(field, path);
  if (!pem.ok()) return pem.status();
  // PKCS#8 ("PRIVATE KEY"), SEC1 ("EC PRIVATE KEY") and PKCS#1 ("RSA PRIVATE
  // KEY") all end their BEGIN line this way.
  if (!absl::StrContains(*pem, "-----BEGIN ") || !absl::StrContains(*pem, "PRIVATE KEY-----")) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " \"", path, "\" holds no PEM private key (-----BEGIN ... PRIVATE KEY-----)"));
  }
  // gRPC has no way to ask for a passphrase.
  if (absl::StrContains(*pem, "-----BEGIN ENCRYPTED PRIVATE KEY-----") ||
      absl::StrContains(*pem, "Proc-Type: 4,ENCRYPTED")) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " \"", path, "\" holds an encrypted private key; gRPC needs it unencrypted"));
  }
  return pem;
}

// The token goes in a header value after "Bearer ": gRPC fails every call
// whose metadata is not printable ASCII, and a space would split the value.
// The message names the offending index, never the token or its characters.
absl::Status CheckToken(absl::string_view token) {
  for (size_t i = 0; i < token.size(); ++i) {
    const char c = token[i];
    if (c <= 0x20 || c > 0x7e) {
      std::string hint;
      if (absl::StartsWithIgnoreCase(token, "Bearer ")) {
        hint = "; pass the token alone, without \"Bearer \"";
      }
      return absl::InvalidArgumentError(
          absl::StrCat("token must be printable ASCII without spaces (it is sent as "
                       "\"authorization: Bearer <token>\"); character ",
                       i, " of ", token.size(), " is not", hint));
    }
  }
  return absl::OkStatus();
}

}  // namespace

bool TlsRequested(const ClientOptions& options) {
  return !options.tls_ca_file.empty() || !options.tls_cert_file.empty() ||
         !options.tls_key_file.empty();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ClientOptions& options) {
  if (absl::Status s = CheckToken(options.token); !s.ok()) return s;
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls_cert_file and tls_key_file go together (a client certificate and its key): ",
        options.tls_cert_file.empty() ? "tls_key_file" : "tls_cert_file", " is set, ",
        options.tls_cert_file.empty() ? "tls_cert_file" : "tls_key_file", " is empty"));
  }
  if (!TlsRequested(options)) {
    if (!options.token.empty()) {
      return absl::InvalidArgumentError(
          "token needs TLS (tls_ca_file, tls_cert_file or tls_key_file): a bearer token on a "
          "plaintext channel can be read on the path");
    }
    return grpc::InsecureChannelCredentials();
  }

  grpc::SslCredentialsOptions ssl;
  if (!options.tls_ca_file.empty()) {
    absl::StatusOr<std::string> roots = ReadCertificates("tls_ca_file", options.tls_ca_file);
    if (!roots.ok()) return roots.status();
    ssl.pem_root_certs = *std::move(roots);
  }  // else empty: gRPC's default roots (the system's, or GRPC_DEFAULT_SSL_ROOTS_FILE_PATH)
  if (!options.tls_cert_file.empty()) {
    absl::StatusOr<std::string> chain = ReadCertificates("tls_cert_file", options.tls_cert_file);
    if (!chain.ok()) return chain.status();
    absl::StatusOr<std::string> key = ReadPrivateKey("tls_key_file", options.tls_key_file);
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(chain);
    ssl.pem_private_key = *std::move(key);
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::SslCredentials(ssl);
  if (credentials == nullptr) {
    return absl::InternalError("gRPC could not create TLS channel credentials");
  }
  if (options.token.empty()) return credentials;
  // Sends "authorization: Bearer <token>" on every call of the channel; gRPC
  // sends call credentials only over a channel that is private (TLS).
  return grpc::CompositeChannelCredentials(credentials,
                                           grpc::AccessTokenCredentials(options.token));
}

}  // namespace ropeattn::client
