// The TLS files gRPC reads: validated copies of the operator's.
//
// gRPC 1.51's FileWatcherCertificateProvider hands whatever its files hold to
// the TLS stack: an empty key or certificate aborts the process (an assertion
// in its security connector), and a garbage or mismatched pair, or a garbage
// client CA, makes every new handshake fail until the files are fixed. A
// rotation caught half-written (`cp`, an editor, a non-atomic write) would do
// either. So the provider watches copies in a private directory that only
// ever holds a set that validated, and the operator's files are re-read every
// credentials_reload_seconds: a changed set that has stayed the same for one
// interval (not caught mid-write) and validates (the certificate
// and key PEM, the key belonging to the certificate, the CA PEM) is staged;
// anything else (unreadable, empty, garbage, mismatched) keeps the set in
// use and is logged once per distinct content (`tls_reload_failed`).
//
// Staging: gen-N/{key,cert,ca}.pem written, their modification times set to a
// second no earlier generation had, then the `current` symlink swapped by
// rename(2). The provider reads key and certificate through `current` and
// reads again when their modification times changed while it read, so it
// never pairs one generation's key with another's certificate.
#ifndef ROPEATTN_SERVER_TLS_FILES_H_
#define ROPEATTN_SERVER_TLS_FILES_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "server/options.h"

namespace ropeattn::server {

// The whole of the file a flag names (`flag` without dashes), at most
// 16 MiB: InvalidArgument naming the flag and the file otherwise.
absl::StatusOr<std::string> ReadFlagFile(const std::string& path, const char* flag);

// The contents of the files named by --tls_cert_file, --tls_key_file and
// --tls_client_ca_file (ca empty when none is configured).
struct TlsSet {
  std::string cert, key, ca;
  bool operator==(const TlsSet& o) const { return cert == o.cert && key == o.key && ca == o.ca; }
};

// Reads the configured files. InvalidArgument naming the flag and the file
// when one cannot be read or is over 16 MiB.
absl::StatusOr<TlsSet> ReadTlsSet(const ServerOptions& options);

// InvalidArgument naming the flag and file unless the certificate is PEM,
// the key is a PEM private key (not encrypted) belonging to it, and the CA
// (when configured) holds a PEM certificate.
absl::Status ValidateTlsSet(const TlsSet& set, const ServerOptions& options);

class TlsFiles {
 public:
  // Reads and validates the configured files, stages them under a new
  // private directory (mode 0700) in /dev/shm (memory: the key copy never
  // lands on disk), else $TMPDIR, else /tmp, and starts the thread that
  // re-reads them every credentials_reload_seconds. Directories left there
  // by servers that died without cleaning up are removed.
  static absl::StatusOr<std::unique_ptr<TlsFiles>> Create(const ServerOptions& options);
  ~TlsFiles();  // RemoveDirectory()
  TlsFiles(const TlsFiles&) = delete;
  TlsFiles& operator=(const TlsFiles&) = delete;

  // The private directory (under /dev/shm, $TMPDIR or /tmp).
  const std::string& directory() const { return dir_; }
  // The paths gRPC's provider watches (ca_path empty without a client CA).
  std::string key_path() const;
  std::string cert_path() const;
  std::string ca_path() const;

  // Re-reads the operator's files now. A changed set is considered once
  // the previous call read the same contents (it has settled for an
  // interval): OK when nothing (settled) changed or the new set was staged;
  // otherwise why it was refused (the set in use stays).
  absl::Status Refresh();
  // Stops the reload thread (idempotent).
  void Stop();
  // Stops the reload thread and removes the directory with the key copies
  // (idempotent). Server::Shutdown calls it once gRPC has stopped: the
  // server's binary ends with std::_Exit, which runs no destructor, and a
  // cleanly stopped server must not leave its key copy behind.
  void RemoveDirectory();

 private:
  TlsFiles(const ServerOptions& options, std::string dir);
  absl::Status Stage(const TlsSet& set) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ServerOptions options_;
  const std::string dir_;
  const bool has_ca_;
  absl::Mutex mu_;
  TlsSet staged_ ABSL_GUARDED_BY(mu_);
  TlsSet last_refused_ ABSL_GUARDED_BY(mu_);
  TlsSet pending_ ABSL_GUARDED_BY(mu_);  // read changed, not yet settled
  std::string last_failure_ ABSL_GUARDED_BY(mu_);  // the message logged last
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t first_mtime_ = 0;  // seconds; generation g gets first_mtime_ + g
  absl::Notification stop_;
  std::thread reloader_;
};

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_TLS_FILES_H_
