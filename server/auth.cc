#include "server/auth.h"

#include <sys/stat.h>

#include <cstdio>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "ropeattn/v1/attention.pb.h"
#include "server/call_log.h"
#include "server/log.h"
#include "server/metrics.h"
#include "server/tls_files.h"

namespace ropeattn::server {
namespace {

// Health is open to everyone: probes and load balancers carry no token.
constexpr absl::string_view kHealthPrefix = "/grpc.health.v1.Health/";
constexpr absl::string_view kServicePrefix = "/ropeattn.v1.AttentionService/";
constexpr size_t kMaxPrincipalChars = 128;
// A certificate's identity is its principal whole, never cut: one longer
// than this is refused.
constexpr size_t kMaxCertificateIdentityChars = 2048;

bool IsPrincipalChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) ||
         absl::string_view("._:/@+-").find(c) != absl::string_view::npos;
}

bool IsTokenChar(char c) { return c > 0x20 && c < 0x7f; }

// Whether `name` is a method of ropeattn.v1.AttentionService.
bool IsServiceMethod(absl::string_view name) {
  static const google::protobuf::ServiceDescriptor* const service =
      v1::AttendRequest::descriptor()->file()->FindServiceByName("AttentionService");
  return service != nullptr && service->FindMethodByName(std::string(name)) != nullptr;
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, const char* flag) {
  return ReadFlagFile(path, flag);
}

// inode, size and mtime (ns): a replaced or rewritten file gets a new one.
std::string FileIdentity(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return "";
  return absl::StrCat(st.st_dev, ":", st.st_ino, ":", st.st_size, ":", st.st_mtim.tv_sec, ".",
                      st.st_mtim.tv_nsec);
}

// Compares all of `stored`, whatever `given` holds: the time does not tell
// how many leading bytes matched.
bool ConstantTimeEquals(absl::string_view given, absl::string_view stored) {
  unsigned char diff = given.size() == stored.size() ? 0 : 1;
  for (size_t i = 0; i < stored.size(); ++i) {
    const unsigned char g = i < given.size() ? static_cast<unsigned char>(given[i]) : 0;
    diff |= g ^ static_cast<unsigned char>(stored[i]);
  }
  return diff == 0;
}

// RFC 3986's scheme ":" at the start.
bool HasUriScheme(absl::string_view uri) {
  if (uri.empty() || !absl::ascii_isalpha(static_cast<unsigned char>(uri[0]))) return false;
  for (size_t i = 1; i < uri.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(uri[i]);
    if (c == ':') return true;
    if (!absl::ascii_isalnum(c) && c != '+' && c != '-' && c != '.') return false;
  }
  return false;
}

}  // namespace

bool AuthConfigured(const ServerOptions& options) {
  return !options.auth_tokens_file.empty() || !options.tls_client_ca_file.empty();
}

absl::StatusOr<std::vector<TokenEntry>> ParseTokens(absl::string_view text,
                                                    absl::string_view file) {
  std::vector<TokenEntry> out;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    const size_t hash = line.find('#');
    if (hash != absl::string_view::npos) line = line.substr(0, hash);
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty()) continue;
    const auto bad = [&](absl::string_view what) {
      return absl::InvalidArgumentError(
          absl::StrCat("--auth_tokens_file: ", file, " line ", line_no, ": ", what));
    };
    if (fields.size() < 2 || fields.size() > 3) {
      return bad(absl::StrCat("expected TOKEN PRINCIPAL [admin], got ", fields.size(), " fields"));
    }
    for (char c : fields[0]) {
      if (!IsTokenChar(c)) return bad("the token has a character outside printable ASCII");
    }
    if (fields[1].size() > kMaxPrincipalChars) {
      return bad(absl::StrCat("the principal name is longer than ", kMaxPrincipalChars));
    }
    for (char c : fields[1]) {
      if (!IsPrincipalChar(c)) {
        return bad("the principal name may hold only letters, digits and ._:/@+-");
      }
    }
    // Not echoed: an operator may have put a second token there (the
    // line number names the line).
    if (fields.size() == 3 && fields[2] != "admin") {
      return bad("the third field must be \"admin\" or absent");
    }
    for (const TokenEntry& e : out) {
      if (e.token == fields[0]) return bad("this token is already listed on an earlier line");
    }
    TokenEntry entry;
    entry.token = std::string(fields[0]);
    entry.principal.name = std::string(fields[1]);
    entry.principal.admin = fields.size() == 3;
    entry.principal.authenticated = true;
    out.push_back(std::move(entry));
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_tokens_file: ", file, " lists no token"));
  }
  return out;
}

absl::Status CheckSecurityFlags(const ServerOptions& o) {
  if (o.credentials_reload_seconds < 1 || o.credentials_reload_seconds > 3600) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--credentials_reload_seconds must be in [1, 3600], got ", o.credentials_reload_seconds));
  }
  if (o.principal_max_sessions < 1 || o.principal_memory_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--principal_max_sessions must be >= 1 and --principal_memory_bytes >= 0, got ",
        o.principal_max_sessions, " and ", o.principal_memory_bytes));
  }
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        o.tls_cert_file.empty() ? "--tls_key_file needs --tls_cert_file (the server's certificate)"
                                : "--tls_cert_file needs --tls_key_file (its private key)");
  }
  if (!TlsConfigured(o)) {
    if (!o.tls_client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca_file needs --tls_cert_file and --tls_key_file (mutual TLS is TLS)");
    }
    if (!o.auth_tokens_file.empty()) {
      return absl::InvalidArgumentError(
          "--auth_tokens_file needs TLS (--tls_cert_file and --tls_key_file): a bearer token "
          "on a plaintext connection can be read by anyone on the path");
    }
  }
  return absl::OkStatus();
}

absl::Status CheckSecurityOptions(const ServerOptions& o) {
  if (absl::Status flags = CheckSecurityFlags(o); !flags.ok()) return flags;
  if (!TlsConfigured(o)) return absl::OkStatus();
  absl::StatusOr<TlsSet> set = ReadTlsSet(o);
  if (!set.ok()) return set.status();
  return ValidateTlsSet(*set, o);
}

Authenticator::Authenticator(const ServerOptions& options, Metrics* metrics)
    : tokens_file_(options.auth_tokens_file),
      certificate_identities_(options.auth_tokens_file.empty() &&
                              !options.tls_client_ca_file.empty()),
      reload_seconds_(options.credentials_reload_seconds),
      access_log_(options.access_log),
      metrics_(metrics) {}

absl::StatusOr<std::shared_ptr<Authenticator>> Authenticator::Create(const ServerOptions& options,
                                                                     Metrics* metrics) {
  std::shared_ptr<Authenticator> a(new Authenticator(options, metrics));
  if (!a->tokens_file_.empty()) {
    const std::string identity = FileIdentity(a->tokens_file_);
    absl::StatusOr<std::string> text = ReadWholeFile(a->tokens_file_, "auth_tokens_file");
    if (!text.ok()) return text.status();
    absl::StatusOr<std::vector<TokenEntry>> parsed = ParseTokens(*text, a->tokens_file_);
    if (!parsed.ok()) return parsed.status();
    {
      absl::MutexLock lock(&a->mu_);
      a->tokens_ = *std::move(parsed);
      a->file_identity_ = identity;
    }
    Authenticator* self = a.get();
    a->reloader_ = std::thread([self] {
      while (!self->stop_.WaitForNotificationWithTimeout(absl::Seconds(self->reload_seconds_))) {
        self->ReloadIfChanged().IgnoreError();
      }
    });
  }
  return a;
}

Authenticator::~Authenticator() { Stop(); }

void Authenticator::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (reloader_.joinable()) reloader_.join();
}

absl::Status Authenticator::ReloadIfChanged() {
  if (tokens_file_.empty()) return absl::OkStatus();
  const std::string identity = FileIdentity(tokens_file_);
  {
    absl::MutexLock lock(&mu_);
    if (identity == file_identity_) {
      pending_text_.reset();  // back to the version in use: a change starts over
      return absl::OkStatus();
    }
  }
  absl::StatusOr<std::string> text = ReadWholeFile(tokens_file_, "auth_tokens_file");
  absl::MutexLock lock(&mu_);
  if (text.ok()) {
    // Used only once it has settled: the same contents read a whole interval
    // apart. A file caught mid-write, "tokB bo" of "tokB bob", would
    // otherwise give a token to the wrong principal (the contents, not the
    // identity, are compared: the file can change between stat and read).
    if (!pending_text_.has_value() || *pending_text_ != *text) {
      pending_text_ = *text;
      return absl::OkStatus();
    }
    pending_text_.reset();
  }
  absl::StatusOr<std::vector<TokenEntry>> parsed =
      text.ok() ? ParseTokens(*text, tokens_file_) : text.status();
  file_identity_ = identity;  // a broken file is reported once, not every interval
  if (!parsed.ok()) {
    LogEvent(LogLevel::kError, "tokens_reload_failed",
             {{"file", tokens_file_}, {"message", parsed.status().message()},
              {"kept_tokens", tokens_.size()}});
    return parsed.status();
  }
  tokens_ = *std::move(parsed);
  LogEvent(LogLevel::kInfo, "tokens_loaded", {{"file", tokens_file_}, {"tokens", tokens_.size()}});
  return absl::OkStatus();
}

const TokenEntry* Authenticator::Find(absl::string_view token) const {
  const TokenEntry* found = nullptr;
  for (const TokenEntry& e : tokens_) {
    const bool equal = ConstantTimeEquals(token, e.token);
    if (equal) found = &e;
  }
  return found;
}

absl::StatusOr<Principal> Authenticator::IdentifyAuthorization(
    absl::string_view authorization) const {
  const char* reason = "";
  return Resolve(true, authorization, nullptr, &reason);
}

absl::StatusOr<Principal> Authenticator::Resolve(bool present, absl::string_view value,
                                                 const grpc::AuthContext* context,
                                                 const char** reason) const {
  Principal principal;
  principal.authenticated = true;
  if (certificate_identities_) {
    // The first URI SAN (a SPIFFE id, say), else the first DNS SAN: set at
    // the handshake, the same for every call on the connection.
    std::string identity;
    bool dns = false;
    for (const char* property : {"peer_uri", "peer_dns"}) {
      std::vector<grpc::string_ref> values =
          context == nullptr ? std::vector<grpc::string_ref>{}
                             : context->FindPropertyValues(property);
      if (!values.empty()) {
        identity.assign(values.front().data(), values.front().size());
        dns = absl::string_view(property) == "peer_dns";
        break;
      }
    }
    // A host name has no ':' or '/': a DNS name that does could pass for a
    // URI name (a DNS SAN "spiffe://td/alice" was the principal of the URI
    // SAN spiffe://td/alice).
    if (dns && identity.find_first_of(":/") != std::string::npos) {
      *reason = "no_identity";
      return absl::UnauthenticatedError(
          "the client certificate's DNS subjectAltName is not a host name (it has ':' or '/')");
    }
    // A URI name starts with its scheme (RFC 3986: a letter, then letters,
    // digits, '+', '-' or '.', then ':'); without one, URI:alice was the
    // principal of DNS:alice.
    if (!dns && !identity.empty() && !HasUriScheme(identity)) {
      *reason = "no_identity";
      return absl::UnauthenticatedError(
          "the client certificate's URI subjectAltName has no scheme (such as spiffe:)");
    }
    if (identity.empty()) {
      *reason = "no_identity";
      return absl::UnauthenticatedError(
          "the client certificate names no principal: it needs a URI or DNS subjectAltName");
    }
    // The whole identity: two SPIFFE ids sharing their first 128 characters
    // were one principal (and reached each other's sessions) when it was cut.
    if (identity.size() > kMaxCertificateIdentityChars) {
      *reason = "identity_too_long";
      return absl::UnauthenticatedError(absl::StrFormat(
          "the client certificate's principal (its first URI or DNS subjectAltName) has %d "
          "characters, more than %d",
          identity.size(), kMaxCertificateIdentityChars));
    }
    principal.name = std::move(identity);
    return principal;
  }
  if (!present) {
    *reason = "missing_token";
    return absl::UnauthenticatedError("this server needs authorization: Bearer <token> metadata");
  }
  constexpr absl::string_view kScheme = "bearer ";
  if (value.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(value.substr(0, kScheme.size()), kScheme)) {
    *reason = "invalid_token";
    return absl::UnauthenticatedError("the authorization metadata must be \"Bearer <token>\"");
  }
  const absl::string_view token = absl::StripAsciiWhitespace(value.substr(kScheme.size()));
  absl::ReaderMutexLock lock(&mu_);
  const TokenEntry* entry = Find(token);
  if (entry == nullptr) {
    *reason = "invalid_token";
    return absl::UnauthenticatedError("the bearer token is not valid");
  }
  return entry->principal;
}

grpc::Status Authenticator::Process(const InputMetadata& md, grpc::AuthContext* context,
                                    OutputMetadata* /*consumed*/, OutputMetadata* /*response*/) {
  const absl::Time start = absl::Now();
  const auto path = md.find(":path");
  const absl::string_view method =
      path == md.end() ? absl::string_view()
                       : absl::string_view(path->second.data(), path->second.size());
  // Only health's own methods skip authentication: any other path under its
  // prefix is refused as every other call is (a 4,000-character made-up
  // method under it was logged whole, once per call, without a token).
  if (absl::StartsWith(method, kHealthPrefix)) {
    const absl::string_view name = method.substr(kHealthPrefix.size());
    if (name == "Check" || name == "Watch") return grpc::Status::OK;
  }
  const auto auth = md.find("authorization");
  const char* reason = "";
  absl::StatusOr<Principal> principal =
      Resolve(auth != md.end(),
              auth == md.end() ? absl::string_view()
                               : absl::string_view(auth->second.data(), auth->second.size()),
              context, &reason);
  if (principal.ok()) return grpc::Status::OK;
  grpc::Status refused(grpc::StatusCode::UNAUTHENTICATED,
                       std::string(principal.status().message()));
  // Refused here, in gRPC's auth filter: before the call-log interceptor
  // and any handler, which never see the call. So it is logged and counted
  // here, as they would have (docs/logging.md): its lines from its
  // metadata, and ropeattn_requests_total under its method when that is one
  // of the service's (a fixed set of labels; reflection and unknown paths
  // are only logged).
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (metrics_ != nullptr) {
    metrics_->RecordAuthRefused(reason);
    absl::string_view name = method;
    if (absl::ConsumePrefix(&name, kServicePrefix) && IsServiceMethod(name)) {
      metrics_->RecordRequest(name, static_cast<int>(refused.error_code()), seconds);
    }
  }
  // At most kRefusalLinesPerSecond a second: a client without a token can
  // send refused calls as fast as its connection carries them (an external
  // test: 15,000 a second, 3.6-6.4 MB/s of log); the rest are counted (the
  // metrics above, and the next line's "suppressed").
  int64_t suppressed = 0;
  if (refusal_lines_.Admit(absl::Now(), &suppressed)) {
    LogRefusedCall(md, refused, absl::Now() - start, access_log_, suppressed);
  }
  return refused;
}

absl::StatusOr<Principal> Authenticator::Identify(const grpc::ServerContextBase& ctx,
                                                  const char** reason_out) const {
  // The call's own metadata (never a property of the shared connection).
  const std::multimap<grpc::string_ref, grpc::string_ref>& md = ctx.client_metadata();
  const auto auth = md.find("authorization");
  std::shared_ptr<const grpc::AuthContext> context;
  if (certificate_identities_) context = ctx.auth_context();
  const char* reason = "";
  absl::StatusOr<Principal> principal =
      Resolve(auth != md.end(),
              auth == md.end() ? absl::string_view()
                               : absl::string_view(auth->second.data(), auth->second.size()),
              context.get(), &reason);
  if (reason_out != nullptr) *reason_out = reason;
  return principal;
}

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(
    const ServerOptions& options, const std::shared_ptr<Authenticator>& authenticator,
    const TlsFiles* files) {
  if (!TlsConfigured(options) || files == nullptr) return grpc::InsecureServerCredentials();
  const unsigned refresh = static_cast<unsigned>(options.credentials_reload_seconds);
  // The staged copies (tls_files.h), never the operator's files themselves.
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      files->key_path(), files->cert_path(), files->ca_path(), refresh);
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  if (!options.tls_client_ca_file.empty()) {
    tls.watch_root_certs();
    tls.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::experimental::TlsServerCredentials(tls);
  if (authenticator != nullptr && AuthConfigured(options)) {
    creds->SetAuthMetadataProcessor(authenticator);
  }
  return creds;
}


}  // namespace ropeattn::server
