// Channel credentials from ClientOptions' TLS and token fields (private to
// the client library: Client::Connect is its one caller).
//
// One credentials object serves every channel of a Client (each of
// `targets`), so every connection verifies the server the same way and every
// call, Decode streams and health included, carries the same token.
#ifndef ROPEATTN_CLIENT_CREDENTIALS_H_
#define ROPEATTN_CLIENT_CREDENTIALS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "grpcpp/security/credentials.h"

namespace ropeattn::client {

// Whether `options` asks for TLS (any of tls_ca_file, tls_cert_file,
// tls_key_file is set).
bool TlsRequested(const ClientOptions& options);

// Checks the TLS and token fields and reads the PEM files (see ClientOptions
// for what each means). InvalidArgument for: a token that is not printable
// ASCII without spaces, a token without TLS, a certificate without its key
// (or a key without its certificate), a file that cannot be read or holds no
// PEM block of the expected kind (naming the field and the file). Messages
// never contain the token or a key's bytes. Without TLS:
// InsecureChannelCredentials.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ClientOptions& options);

}  // namespace ropeattn::client

#endif  // ROPEATTN_CLIENT_CREDENTIALS_H_
