#include "tests/tools/test_certs.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <ctime>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace ropeattn::testing {
namespace {

// Runs a shell command; its output goes to `log` so a failure can show it.
absl::Status Run(const std::string& command, const std::string& log) {
  const std::string full = absl::StrCat(command, " >", log, " 2>&1");
  const int rc = std::system(full.c_str());
  if (rc != 0) {
    absl::StatusOr<std::string> out = ReadFileText(log);
    return absl::InternalError(absl::StrCat("`", command, "` failed (", rc,
                                            "): ", out.ok() ? *out : std::string("")));
  }
  return absl::OkStatus();
}

// Distinct serials within a process (and most likely across processes).
uint64_t NextSerial() {
  static std::atomic<uint64_t> next{(static_cast<uint64_t>(getpid()) << 24) ^
                                    static_cast<uint64_t>(time(nullptr))};
  return next.fetch_add(1) & 0x7fffffffffffULL;
}

absl::Status Fill(CertFiles* files) {
  absl::StatusOr<std::string> cert = ReadFileText(files->cert_file);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadFileText(files->key_file);
  if (!key.ok()) return key.status();
  files->cert_pem = *cert;
  files->key_pem = *key;
  return absl::OkStatus();
}

}  // namespace

std::string MakeTempDir(const std::string& prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/", prefix,
                                     "XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) return "";
  return pattern;
}

absl::StatusOr<std::string> ReadFileText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", tmp));
    out << text;
    if (!out.flush()) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

absl::StatusOr<TestCa> TestCa::Create(const std::string& dir, const std::string& name) {
  mkdir(dir.c_str(), 0700);
  TestCa ca;
  ca.dir_ = dir;
  ca.ca_.cert_file = absl::StrCat(dir, "/", name, ".pem");
  ca.ca_.key_file = absl::StrCat(dir, "/", name, ".key");
  absl::Status made = Run(
      absl::StrCat("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes",
                   " -keyout ", ca.ca_.key_file, " -out ", ca.ca_.cert_file, " -days 2 -subj /CN=",
                   name, " -addext basicConstraints=critical,CA:TRUE",
                   " -addext keyUsage=critical,keyCertSign,cRLSign"),
      absl::StrCat(dir, "/", name, ".log"));
  if (!made.ok()) return made;
  absl::Status filled = Fill(&ca.ca_);
  if (!filled.ok()) return filled;
  return ca;
}

absl::StatusOr<CertFiles> TestCa::Issue(const std::string& name, const std::string& san,
                                        bool client, int days) const {
  CertFiles files;
  files.cert_file = absl::StrCat(dir_, "/", name, ".pem");
  files.key_file = absl::StrCat(dir_, "/", name, ".key");
  const std::string csr = absl::StrCat(dir_, "/", name, ".csr");
  const std::string ext = absl::StrCat(dir_, "/", name, ".ext");
  const std::string log = absl::StrCat(dir_, "/", name, ".log");
  {
    std::ofstream out(ext);
    out << "basicConstraints=CA:FALSE\n"
        << "keyUsage=critical,digitalSignature,keyEncipherment\n"
        << "extendedKeyUsage=" << (client ? "clientAuth" : "serverAuth") << "\n";
    if (!san.empty()) out << "subjectAltName=" << san << "\n";
  }
  absl::Status made =
      Run(absl::StrCat("openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes",
                       " -keyout ", files.key_file, " -out ", csr, " -subj /CN=", name),
          log);
  if (!made.ok()) return made;
  made = Run(absl::StrCat("openssl x509 -req -in ", csr, " -CA ", ca_.cert_file, " -CAkey ",
                          ca_.key_file, " -set_serial 0x", absl::Hex(NextSerial()), " -out ",
                          files.cert_file, " -days ", days, " -extfile ", ext),
             log);
  if (!made.ok()) return made;
  absl::Status filled = Fill(&files);
  if (!filled.ok()) return filled;
  return files;
}

}  // namespace ropeattn::testing
