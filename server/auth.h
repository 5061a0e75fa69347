// Transport security and authentication (docs/security.md): the server's
// TLS credentials, the bearer-token table, and the gRPC metadata processor
// that gives every call (but health) a principal before any handler runs.
//
// Thread-safety: an Authenticator is called by gRPC on many threads at once
// and by its own reload thread; its token table is swapped under a mutex.
#ifndef ROPEATTN_SERVER_AUTH_H_
#define ROPEATTN_SERVER_AUTH_H_

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"
#include "server/log.h"
#include "server/options.h"
#include "server/principal.h"

namespace ropeattn::server {

class Metrics;

// Whether calls need a principal: a tokens file or a client CA is set.
bool AuthConfigured(const ServerOptions& options);
// Whether the server speaks TLS.
inline bool TlsConfigured(const ServerOptions& options) { return !options.tls_cert_file.empty(); }

// One line of the tokens file.
struct TokenEntry {
  std::string token;
  Principal principal;
};
// Parses a tokens file: lines "TOKEN PRINCIPAL [admin]", '#' starts a
// comment, blank lines skipped. A token is printable ASCII without spaces; a
// principal is 1..128 of [A-Za-z0-9._:/@+-]. InvalidArgument naming `file`
// and the line number (never what the line holds: any field may be a token)
// for anything else, a token listed twice, or a file with no token at all.
absl::StatusOr<std::vector<TokenEntry>> ParseTokens(absl::string_view text,
                                                    absl::string_view file);

// The security flags' values alone, no file read: cert and key both or
// neither, a client CA or tokens file only with TLS, the reload interval and
// the per-principal quotas in range. InvalidArgument naming the flag (--name).
absl::Status CheckSecurityFlags(const ServerOptions& options);

// Checks the security options before anything listens: CheckSecurityFlags,
// then each file readable and PEM, the key belonging to the certificate, the
// client CA parseable. InvalidArgument naming the flag and the file.
absl::Status CheckSecurityOptions(const ServerOptions& options);

// The AuthMetadataProcessor on the server's TLS credentials: every call but
// health without a principal is refused UNAUTHENTICATED before any handler
// (ours or reflection) runs, and before the call-log interceptor: a refusal
// is logged here (LogRefusedCall: error_answer, and call with --access_log)
// and counted in ropeattn_auth_refused_total and, for the service's
// methods, ropeattn_requests_total. It records nothing on the connection:
// the AuthContext gRPC 1.51 hands a processor belongs to the connection,
// shared by every call on it (behind Envoy, by every caller), so a property
// added there would leak one call's principal (or refusal) to the next.
// Handlers call Identify, which reads the call's own metadata.
class Authenticator : public grpc::AuthMetadataProcessor {
 public:
  // Reads the tokens file (if any) and starts the thread that re-reads it
  // every credentials_reload_seconds when it changed. `metrics` (not owned,
  // may be null) counts refusals; options.access_log: refusals get a
  // "call" line too.
  static absl::StatusOr<std::shared_ptr<Authenticator>> Create(const ServerOptions& options,
                                                               Metrics* metrics);
  ~Authenticator() override;
  // Stops the reload thread (idempotent).
  void Stop();

  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

  // The principal of one call: from its own bearer token (its client
  // metadata), else, with mutual TLS and no tokens file, from the
  // connection's client certificate. Unauthenticated otherwise, with
  // `*reason` (when given) set to its ropeattn_auth_refused_total reason.
  absl::StatusOr<Principal> Identify(const grpc::ServerContextBase& ctx,
                                     const char** reason = nullptr) const;
  // The principal an `authorization` metadata value names ("Bearer TOKEN"),
  // as Identify resolves it (tokens file only).
  absl::StatusOr<Principal> IdentifyAuthorization(absl::string_view authorization) const;

  // Re-reads the tokens file if its identity (inode, size, mtime) changed,
  // and uses it once two calls in a row read the same contents (a change
  // settles for one reload interval). A file that fails to parse keeps the
  // previous table (logged). Returns the parse status of a re-read, OK when
  // nothing (settled) changed.
  absl::Status ReloadIfChanged();

 private:
  Authenticator(const ServerOptions& options, Metrics* metrics);
  // The entry whose token equals `token`, compared in constant time against
  // every entry; nullptr if none.
  const TokenEntry* Find(absl::string_view token) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The principal for an `authorization` metadata value (`present` false:
  // none sent) or for a certificate identity; `reason` says why not.
  absl::StatusOr<Principal> Resolve(bool present, absl::string_view authorization,
                                    const grpc::AuthContext* context, const char** reason) const;

  const std::string tokens_file_;
  const bool certificate_identities_;  // mTLS without a tokens file
  const int reload_seconds_;
  const bool access_log_;  // refused calls get a "call" line too
  Metrics* const metrics_;
  // Log lines of refused calls: at most kRefusalLinesPerSecond a second.
  static constexpr int kRefusalLinesPerSecond = 10;
  LogLineBudget refusal_lines_{kRefusalLinesPerSecond};
  mutable absl::Mutex mu_;
  std::vector<TokenEntry> tokens_ ABSL_GUARDED_BY(mu_);
  std::string file_identity_ ABSL_GUARDED_BY(mu_);
  // A changed file's contents, read once and not yet settled.
  std::optional<std::string> pending_text_ ABSL_GUARDED_BY(mu_);
  absl::Notification stop_;
  std::thread reloader_;
};

class TlsFiles;

// The credentials the server listens with: plaintext without TLS; TLS from
// gRPC's FileWatcherCertificateProvider over `files`' validated copies
// (re-read every credentials_reload_seconds: new handshakes see a rotated
// certificate, open connections keep theirs) with client certificates
// required and verified when tls_client_ca_file is set; `authenticator`
// attached when authentication is configured. `files` must outlive the
// server.
std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(
    const ServerOptions& options, const std::shared_ptr<Authenticator>& authenticator,
    const TlsFiles* files);


}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_AUTH_H_
