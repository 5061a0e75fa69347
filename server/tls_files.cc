#include "server/tls_files.h"

#include <fcntl.h>
#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/log.h"

namespace ropeattn::server {
namespace {

constexpr int64_t kMaxFlagFileBytes = 16 << 20;

}  // namespace

absl::StatusOr<std::string> ReadFlagFile(const std::string& path, const char* flag) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  // A FIFO (or a device) would block the read, and start-up or a reload
  // with it.
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": ", path, " is not a regular file"));
  }
  if (st.st_size > kMaxFlagFileBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": ", path, " is ", st.st_size, " bytes, too large"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

namespace {

struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};

std::unique_ptr<BIO, BioDeleter> MemBio(const std::string& pem) {
  return std::unique_ptr<BIO, BioDeleter>(
      BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

std::unique_ptr<X509, X509Deleter> ParseCert(const std::string& pem) {
  auto bio = MemBio(pem);
  if (bio == nullptr) return nullptr;
  return std::unique_ptr<X509, X509Deleter>(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
}

// Writes `contents` to `path` (mode 0600) with modification time `mtime`.
absl::Status WriteStaged(const std::string& path, const std::string& contents, time_t mtime) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("cannot write ", path, ": ", std::strerror(errno)));
  }
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat("cannot write ", path, ": ", std::strerror(err)));
    }
    done += static_cast<size_t>(n);
  }
  const struct timespec times[2] = {{mtime, 0}, {mtime, 0}};
  const bool timed = ::futimens(fd, times) == 0;
  ::close(fd);
  if (!timed) return absl::InternalError(absl::StrCat("cannot set the time of ", path));
  return absl::OkStatus();
}

// Where the copies go: memory (/dev/shm) when it is there, so the private
// key never lands on disk (a Kubernetes Secret volume is tmpfs for the same
// reason; an emptyDir /tmp may be node disk); else $TMPDIR, else /tmp.
std::string StagingBase() {
  struct stat st {};
  if (::stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && ::access("/dev/shm", W_OK | X_OK) == 0) {
    return "/dev/shm";
  }
  const char* tmp = std::getenv("TMPDIR");
  return tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
}

// Directories "ropeattn-tls-PID-XXXXXX" of processes that are gone (killed
// before their destructor removed them): their key copies are deleted.
void RemoveStaleDirectories(const std::string& base) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(base, ec)) {
    const std::string name = entry.path().filename().string();
    constexpr std::string_view kPrefix = "ropeattn-tls-";
    if (name.rfind(kPrefix, 0) != 0) continue;
    const long pid = std::strtol(name.c_str() + kPrefix.size(), nullptr, 10);
    if (pid <= 0 || (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)) {
      std::error_code ignored;
      std::filesystem::remove_all(entry.path(), ignored);
    }
  }
}

}  // namespace

absl::StatusOr<TlsSet> ReadTlsSet(const ServerOptions& o) {
  TlsSet set;
  absl::StatusOr<std::string> cert = ReadFlagFile(o.tls_cert_file, "tls_cert_file");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadFlagFile(o.tls_key_file, "tls_key_file");
  if (!key.ok()) return key.status();
  set.cert = *std::move(cert);
  set.key = *std::move(key);
  if (!o.tls_client_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadFlagFile(o.tls_client_ca_file, "tls_client_ca_file");
    if (!ca.ok()) return ca.status();
    set.ca = *std::move(ca);
  }
  return set;
}

absl::Status ValidateTlsSet(const TlsSet& set, const ServerOptions& o) {
  auto x509 = ParseCert(set.cert);
  if (x509 == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_cert_file: ", o.tls_cert_file, " holds no PEM certificate"));
  }
  auto bio = MemBio(set.key);
  std::unique_ptr<EVP_PKEY, KeyDeleter> pkey(
      bio == nullptr ? nullptr : PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  if (pkey == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_key_file: ", o.tls_key_file, " holds no PEM private key (or it is encrypted)"));
  }
  if (X509_check_private_key(x509.get(), pkey.get()) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("--tls_key_file: the key in ", o.tls_key_file,
                                                   " does not belong to the certificate in ",
                                                   o.tls_cert_file));
  }
  if (!o.tls_client_ca_file.empty() && ParseCert(set.ca) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_client_ca_file: ", o.tls_client_ca_file, " holds no PEM certificate"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TlsFiles>> TlsFiles::Create(const ServerOptions& options) {
  absl::StatusOr<TlsSet> set = ReadTlsSet(options);
  if (!set.ok()) return set.status();
  if (absl::Status valid = ValidateTlsSet(*set, options); !valid.ok()) return valid;
  const std::string base = StagingBase();
  RemoveStaleDirectories(base);
  std::string pattern = absl::StrCat(base, "/ropeattn-tls-", ::getpid(), "-XXXXXX");
  if (::mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("cannot create a directory for the TLS files (",
                                            pattern, "): ", std::strerror(errno)));
  }
  std::unique_ptr<TlsFiles> files(new TlsFiles(options, pattern));
  {
    absl::MutexLock lock(&files->mu_);
    if (absl::Status st = files->Stage(*set); !st.ok()) return st;
  }
  TlsFiles* self = files.get();
  files->reloader_ = std::thread([self] {
    while (!self->stop_.WaitForNotificationWithTimeout(
        absl::Seconds(self->options_.credentials_reload_seconds))) {
      self->Refresh().IgnoreError();
    }
  });
  return files;
}

TlsFiles::TlsFiles(const ServerOptions& options, std::string dir)
    : options_(options),
      dir_(std::move(dir)),
      has_ca_(!options.tls_client_ca_file.empty()),
      first_mtime_(static_cast<int64_t>(std::time(nullptr))) {}

TlsFiles::~TlsFiles() { RemoveDirectory(); }

void TlsFiles::RemoveDirectory() {
  Stop();
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

void TlsFiles::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (reloader_.joinable()) reloader_.join();
}

std::string TlsFiles::key_path() const { return dir_ + "/current/key.pem"; }
std::string TlsFiles::cert_path() const { return dir_ + "/current/cert.pem"; }
std::string TlsFiles::ca_path() const { return has_ca_ ? dir_ + "/current/ca.pem" : ""; }

absl::Status TlsFiles::Refresh() {
  absl::StatusOr<TlsSet> set = ReadTlsSet(options_);
  absl::MutexLock lock(&mu_);
  absl::Status why = set.status();
  if (set.ok()) {
    if (*set == staged_) {
      pending_ = staged_;  // back to the set in use: a change starts over
      return absl::OkStatus();
    }
    // Taken only once it has settled (the same contents a whole interval
    // apart): a chain caught mid-write can still validate on its first
    // certificate.
    if (!(*set == pending_)) {
      pending_ = *set;
      return absl::OkStatus();
    }
    why = ValidateTlsSet(*set, options_);
    if (why.ok()) {
      why = Stage(*set);
      if (why.ok()) {
        last_refused_ = TlsSet();
        last_failure_.clear();
        LogEvent(LogLevel::kInfo, "tls_reloaded", {{"generation", generation_}});
        return absl::OkStatus();
      }
    } else if (*set == last_refused_) {
      return why;  // logged when first seen
    } else {
      last_refused_ = *set;
    }
  } else if (why.message() == last_failure_) {
    return why;  // an unreadable file: logged once per message
  }
  last_failure_ = std::string(why.message());
  LogEvent(LogLevel::kWarning, "tls_reload_failed",
           {{"message", std::string(why.message())}, {"kept_generation", generation_}});
  return why;
}

absl::Status TlsFiles::Stage(const TlsSet& set) {
  const int64_t gen = generation_ + 1;
  const std::string gen_dir = absl::StrCat(dir_, "/gen-", gen);
  if (::mkdir(gen_dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::InternalError(absl::StrCat("cannot create ", gen_dir, ": ", std::strerror(errno)));
  }
  const auto mtime = static_cast<time_t>(first_mtime_ + gen);
  for (const auto& [name, contents] : {std::pair<const char*, const std::string*>{"key.pem", &set.key},
                                       {"cert.pem", &set.cert},
                                       {"ca.pem", &set.ca}}) {
    if (std::string(name) == "ca.pem" && !has_ca_) continue;
    if (absl::Status st = WriteStaged(absl::StrCat(gen_dir, "/", name), *contents, mtime);
        !st.ok()) {
      return st;
    }
  }
  // `current` -> gen-N, swapped in one rename.
  const std::string link = dir_ + "/current";
  const std::string next = absl::StrCat(dir_, "/current.", gen);
  ::unlink(next.c_str());
  if (::symlink(absl::StrCat("gen-", gen).c_str(), next.c_str()) != 0 ||
      ::rename(next.c_str(), link.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot point ", link, " at ", gen_dir, ": ", std::strerror(errno)));
  }
  // The generation before stays: gRPC may be reading it right now.
  if (gen >= 3) {
    std::error_code ignored;
    std::filesystem::remove_all(absl::StrCat(dir_, "/gen-", gen - 2), ignored);
  }
  generation_ = gen;
  staged_ = set;
  return absl::OkStatus();
}

}  // namespace ropeattn::server
