// Structural checks of the Kubernetes manifests in deploy/k8s: the properties
// the deployment relies on (probes, resources derived from the flags, the
// drain arithmetic, security context, ports, session-aware routing in Envoy,
// a complete kustomization) and its security (docs/security.md): TLS from
// callers to Envoy and mutual TLS from Envoy to the pods with certificates
// reloaded from mounted Secrets, the pods' TLS and token flags naming
// mounted Secret keys, exec probes that speak TLS, a NetworkPolicy that
// admits the gRPC port from Envoy only and the metrics port from the
// monitoring namespace only, no Service straight to the pods' gRPC port,
// cert-manager Certificates behind every mounted Secret, and no token in the
// repository. Each check is a function returning the list of
// problems it found; the tests run them on the real manifests (no problems
// expected) and on copies broken on purpose (the problem must be reported),
// so a manifest edit that breaks a property fails the suite.
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <sstream>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/options.h"

#ifndef ROPEATTN_DEPLOY_K8S_DIR
#error "define ROPEATTN_DEPLOY_K8S_DIR (the deploy/k8s directory)"
#endif

namespace {

namespace fs = std::filesystem;
using Problems = std::vector<std::string>;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr char kServiceName[] = "ropeattn.v1.AttentionService";
constexpr char kRoutingHeader[] = "x-ropeattn-session-key";
// The server accepts at most one keepalive ping per 30 s
// (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS in server/server.cc).
constexpr double kServerMinPingIntervalSeconds = 30;
// The server closes a connection with no call open for this long
// (--max_connection_idle_seconds, default; the Deployment keeps it).
constexpr double kServerIdleCloseSeconds = 300;
// Process base of the memory arithmetic in ropeattn-deployment.yaml.
constexpr int64_t kProcessBaseBytes = int64_t{256} << 20;

// ---------------------------------------------------------------------------
// Small helpers over yaml-cpp.

// n[k1][k2]... without ever inserting or throwing; undefined Node if absent.
YAML::Node Get(const YAML::Node& n, std::initializer_list<std::string> path) {
  YAML::Node cur = n;
  for (const std::string& key : path) {
    if (!cur.IsDefined() || !cur.IsMap()) return YAML::Node(YAML::NodeType::Undefined);
    const YAML::Node& const_cur = cur;  // const operator[]: never inserts
    YAML::Node next = const_cur[key];
    if (!next.IsDefined()) return YAML::Node(YAML::NodeType::Undefined);
    // reset() rebinds; operator= would overwrite the referenced node's value.
    cur.reset(next);
  }
  return cur;
}

std::string Str(const YAML::Node& n, const std::string& fallback = "") {
  return n.IsDefined() && n.IsScalar() ? n.Scalar() : fallback;
}

std::optional<double> Num(const YAML::Node& n) {
  if (!n.IsDefined() || !n.IsScalar()) return std::nullopt;
  try {
    size_t used = 0;
    const double v = std::stod(n.Scalar(), &used);
    if (used != n.Scalar().size()) return std::nullopt;
    return v;
  } catch (...) {
    return std::nullopt;
  }
}

bool IsTrue(const YAML::Node& n) { return Str(n) == "true"; }

// Kubernetes quantities: "6Gi", "6144Mi", "6442450944", "6G", "4", "4000m".
std::optional<double> Quantity(const YAML::Node& n) {
  if (!n.IsDefined() || !n.IsScalar()) return std::nullopt;
  const std::string s = n.Scalar();
  static const std::vector<std::pair<std::string, double>> kSuffixes = {
      {"Ki", 1024.0},  {"Mi", std::pow(1024.0, 2)}, {"Gi", std::pow(1024.0, 3)},
      {"Ti", std::pow(1024.0, 4)}, {"k", 1e3}, {"M", 1e6}, {"G", 1e9}, {"T", 1e12}, {"m", 1e-3}};
  double scale = 1;
  std::string digits = s;
  for (const auto& [suffix, factor] : kSuffixes) {
    if (s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0) {
      digits = s.substr(0, s.size() - suffix.size());
      scale = factor;
      break;
    }
  }
  try {
    size_t used = 0;
    const double v = std::stod(digits, &used);
    if (used != digits.size()) return std::nullopt;
    return v * scale;
  } catch (...) {
    return std::nullopt;
  }
}

// Envoy durations: "3600s", "0.25s", "0s".
std::optional<double> Seconds(const YAML::Node& n) {
  const std::string s = Str(n);
  if (s.empty() || s.back() != 's') return std::nullopt;
  try {
    size_t used = 0;
    const double v = std::stod(s.substr(0, s.size() - 1), &used);
    if (used != s.size() - 1) return std::nullopt;
    return v;
  } catch (...) {
    return std::nullopt;
  }
}

// "host:port" -> port, or -1.
int PortOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return -1;
  try {
    return std::stoi(address.substr(colon + 1));
  } catch (...) {
    return -1;
  }
}

bool Contains(const YAML::Node& seq, const std::string& value) {
  if (!seq.IsDefined() || !seq.IsSequence()) return false;
  for (const YAML::Node& v : seq) {
    if (Str(v) == value) return true;
  }
  return false;
}

// Finds the first element of a sequence whose `key` equals `value`.
YAML::Node FindBy(const YAML::Node& seq, const std::string& key, const std::string& value) {
  if (seq.IsDefined() && seq.IsSequence()) {
    for (const YAML::Node& item : seq) {
      if (Str(Get(item, {key})) == value) return item;
    }
  }
  return YAML::Node(YAML::NodeType::Undefined);
}

// ---------------------------------------------------------------------------
// Loading.

struct Manifests {
  YAML::Node kustomization;
  std::vector<std::string> listed_files;          // resources + generator files
  std::map<std::string, YAML::Node> objects;      // "Kind/name" -> object
  YAML::Node envoy;                               // envoy.yaml (generator file)
  std::string envoy_configmap_name;
  // Every file of Envoy's ConfigMap (envoy.yaml, the SDS files), by key.
  std::map<std::string, YAML::Node> envoy_files;
};

std::string FirstEnvoyConfigFile(const YAML::Node& kustomization, std::string* configmap_name) {
  const YAML::Node gens = Get(kustomization, {"configMapGenerator"});
  if (!gens.IsDefined() || !gens.IsSequence()) return "";
  for (const YAML::Node& g : gens) {
    const YAML::Node files = Get(g, {"files"});
    if (!files.IsDefined() || !files.IsSequence()) continue;
    for (const YAML::Node& f : files) {
      std::string file = Str(f);
      // "key=path" form.
      if (const size_t eq = file.find('='); eq != std::string::npos) file = file.substr(eq + 1);
      if (fs::path(file).filename() == "envoy.yaml") {
        *configmap_name = Str(Get(g, {"name"}));
        return file;
      }
    }
  }
  return "";
}

std::vector<std::string> ListedFiles(const YAML::Node& kustomization) {
  std::vector<std::string> out;
  const YAML::Node res = Get(kustomization, {"resources"});
  if (res.IsDefined() && res.IsSequence()) {
    for (const YAML::Node& r : res) out.push_back(Str(r));
  }
  const YAML::Node gens = Get(kustomization, {"configMapGenerator"});
  if (gens.IsDefined() && gens.IsSequence()) {
    for (const YAML::Node& g : gens) {
      const YAML::Node files = Get(g, {"files"});
      if (!files.IsDefined() || !files.IsSequence()) continue;
      for (const YAML::Node& f : files) {
        std::string file = Str(f);
        if (const size_t eq = file.find('='); eq != std::string::npos) file = file.substr(eq + 1);
        out.push_back(file);
      }
    }
  }
  return out;
}

const Manifests& Load() {
  static const Manifests* const m = [] {
    auto* out = new Manifests;
    const fs::path dir = ROPEATTN_DEPLOY_K8S_DIR;
    out->kustomization.reset(YAML::LoadFile((dir / "kustomization.yaml").string()));
    out->listed_files = ListedFiles(out->kustomization);
    const YAML::Node res = Get(out->kustomization, {"resources"});
    if (res.IsDefined() && res.IsSequence()) {
      for (const YAML::Node& r : res) {
        const fs::path file = dir / Str(r);
        if (!fs::exists(file)) continue;  // reported by CheckKustomization
        for (const YAML::Node& doc : YAML::LoadAllFromFile(file.string())) {
          if (!doc.IsDefined() || doc.IsNull()) continue;
          out->objects.emplace(Str(Get(doc, {"kind"})) + "/" + Str(Get(doc, {"metadata", "name"})), doc);
        }
      }
    }
    const std::string envoy_file = FirstEnvoyConfigFile(out->kustomization, &out->envoy_configmap_name);
    if (!envoy_file.empty() && fs::exists(dir / envoy_file)) {
      out->envoy.reset(YAML::LoadFile((dir / envoy_file).string()));
    }
    const YAML::Node gens = Get(out->kustomization, {"configMapGenerator"});
    if (gens.IsDefined() && gens.IsSequence()) {
      for (const YAML::Node& g : gens) {
        if (Str(Get(g, {"name"})) != out->envoy_configmap_name) continue;
        const YAML::Node files = Get(g, {"files"});
        if (!files.IsDefined() || !files.IsSequence()) continue;
        for (const YAML::Node& f : files) {
          std::string key = Str(f), file = Str(f);
          if (const size_t eq = file.find('='); eq != std::string::npos) {
            key = file.substr(0, eq);
            file = file.substr(eq + 1);
          } else {
            key = fs::path(file).filename().string();
          }
          if (fs::exists(dir / file)) out->envoy_files[key].reset(YAML::LoadFile((dir / file).string()));
        }
      }
    }
    return out;
  }();
  return *m;
}

YAML::Node Object(const std::string& kind_name) {
  const Manifests& m = Load();
  const auto it = m.objects.find(kind_name);
  return it == m.objects.end() ? YAML::Node(YAML::NodeType::Undefined) : YAML::Clone(it->second);
}

YAML::Node ServerDeployment() { return Object("Deployment/ropeattn"); }
YAML::Node HeadlessService() { return Object("Service/ropeattn-headless"); }
std::vector<YAML::Node> ObjectsOfKind(const std::string& kind) {
  std::vector<YAML::Node> out;
  for (const auto& [key, obj] : Load().objects) {
    if (key.rfind(kind + "/", 0) == 0) out.push_back(YAML::Clone(obj));
  }
  return out;
}
YAML::Node EnvoyDeployment() { return Object("Deployment/ropeattn-envoy"); }
YAML::Node EnvoyConfig() { return YAML::Clone(Load().envoy); }

// ---------------------------------------------------------------------------
// The server Deployment.

// "--name=value" args -> {name: value}.
std::map<std::string, std::string> Flags(const YAML::Node& container) {
  std::map<std::string, std::string> flags;
  const YAML::Node args = Get(container, {"args"});
  if (!args.IsDefined() || !args.IsSequence()) return flags;
  for (const YAML::Node& a : args) {
    const std::string s = Str(a);
    if (s.rfind("--", 0) != 0) continue;
    const size_t eq = s.find('=');
    if (eq == std::string::npos) {
      flags[s.substr(2)] = "true";
    } else {
      flags[s.substr(2, eq - 2)] = s.substr(eq + 1);
    }
  }
  return flags;
}

int64_t FlagInt(const std::map<std::string, std::string>& flags, const std::string& name,
                int64_t fallback) {
  const auto it = flags.find(name);
  if (it == flags.end()) return fallback;
  try {
    return std::stoll(it->second);
  } catch (...) {
    return -1;
  }
}

double FlagDouble(const std::map<std::string, std::string>& flags, const std::string& name,
                  double fallback) {
  const auto it = flags.find(name);
  if (it == flags.end()) return fallback;
  try {
    return std::stod(it->second);
  } catch (...) {
    return -1;
  }
}

YAML::Node MainContainer(const YAML::Node& deployment) {
  return FindBy(Get(deployment, {"spec", "template", "spec", "containers"}), "name", "ropeattn");
}

int ContainerPort(const YAML::Node& container, const std::string& name) {
  const YAML::Node p = FindBy(Get(container, {"ports"}), "name", name);
  const auto v = Num(Get(p, {"containerPort"}));
  return v ? static_cast<int>(*v) : -1;
}

// preStop sleep in seconds: the native sleep action or exec [.../sleep, N].
std::optional<double> PreStopSleep(const YAML::Node& container) {
  const YAML::Node pre = Get(container, {"lifecycle", "preStop"});
  if (auto s = Num(Get(pre, {"sleep", "seconds"}))) return s;
  const YAML::Node cmd = Get(pre, {"exec", "command"});
  if (cmd.IsDefined() && cmd.IsSequence() && cmd.size() >= 2) {
    const std::string prog = Str(cmd[0]);
    if (prog == "sleep" || (prog.size() >= 6 && prog.compare(prog.size() - 6, 6, "/sleep") == 0)) {
      return Num(cmd[1]);
    }
  }
  return std::nullopt;
}

// Flags of a command line from index `from` on: "--name=value" or
// "--name value"; a "--name" followed by another flag (or last) is "true".
std::map<std::string, std::string> CommandFlags(const YAML::Node& cmd, size_t from) {
  std::map<std::string, std::string> flags;
  if (!cmd.IsDefined() || !cmd.IsSequence()) return flags;
  for (size_t i = from; i < cmd.size(); ++i) {
    const std::string s = Str(cmd[i]);
    if (s.rfind("--", 0) != 0) continue;
    const size_t eq = s.find('=');
    if (eq != std::string::npos) {
      flags[s.substr(2, eq - 2)] = s.substr(eq + 1);
    } else if (i + 1 < cmd.size() && Str(cmd[i + 1]).rfind("--", 0) != 0) {
      flags[s.substr(2)] = Str(cmd[i + 1]);
      ++i;
    } else {
      flags[s.substr(2)] = "true";
    }
  }
  return flags;
}

std::string Basename(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// A file a container reads from a mounted volume.
struct MountedFile {
  std::string mount_path;   // the volumeMount's mountPath
  YAML::Node volume;        // the pod volume it mounts
  std::string secret;       // volume.secret.secretName, "" if not a Secret
  std::string configmap;    // volume.configMap.name, "" if not a ConfigMap
  std::string key;          // the Secret / ConfigMap key the file is
  bool sub_path = false;    // mounted with subPath (never updated)
};

// The volume mount of `container` (in pod spec `pod`) that holds `file` (an
// absolute path): the mount with the longest mountPath that is a parent of
// it. nullopt if no mount holds it.
std::optional<MountedFile> MountOf(const YAML::Node& pod, const YAML::Node& container,
                                   const std::string& file) {
  std::optional<MountedFile> best;
  const YAML::Node mounts = Get(container, {"volumeMounts"});
  if (!mounts.IsDefined() || !mounts.IsSequence()) return best;
  for (const YAML::Node& m : mounts) {
    std::string path = Str(Get(m, {"mountPath"}));
    while (path.size() > 1 && path.back() == '/') path.pop_back();
    const std::string sub_path = Str(Get(m, {"subPath"}));
    // A single file mounted with subPath: the mountPath is the file.
    const bool the_file = !sub_path.empty() && path == file;
    if (!the_file && (path.empty() || file.size() <= path.size() + 1 || file.compare(0, path.size(), path) != 0 ||
                      file[path.size()] != '/')) {
      continue;
    }
    if (best && best->mount_path.size() >= path.size()) continue;
    MountedFile mf;
    mf.mount_path = path;
    mf.volume.reset(FindBy(Get(pod, {"volumes"}), "name", Str(Get(m, {"name"}))));
    mf.secret = Str(Get(mf.volume, {"secret", "secretName"}));
    mf.configmap = Str(Get(mf.volume, {"configMap", "name"}));
    mf.sub_path = Get(m, {"subPath"}).IsDefined() || Get(m, {"subPathExpr"}).IsDefined();
    const std::string rel = the_file ? sub_path : file.substr(path.size() + 1);
    // With items, the file is an item's path and its key the item's key.
    const YAML::Node items = Get(mf.volume, {mf.secret.empty() ? "configMap" : "secret", "items"});
    if (items.IsDefined() && items.IsSequence()) {
      for (const YAML::Node& it : items) {
        if (Str(Get(it, {"path"})) == rel) mf.key = Str(Get(it, {"key"}));
      }
    } else if (rel.find('/') == std::string::npos) {
      mf.key = rel;
    }
    best = mf;
  }
  return best;
}

// Problems with a file that must come from key `want_key` of a mounted
// Secret that is updated in place (whole-volume mount, no subPath). `what`
// names the file in messages. Sets *secret to the Secret's name.
Problems CheckSecretFile(const YAML::Node& pod, const YAML::Node& container, const std::string& what,
                         const std::string& file, const std::string& want_key,
                         std::string* secret = nullptr) {
  if (file.empty() || file[0] != '/') return {what + " must be an absolute path, got \"" + file + "\""};
  const auto m = MountOf(pod, container, file);
  if (!m) return {what + " " + file + " is not under any volumeMount"};
  Problems p;
  if (m->secret.empty()) p.push_back(what + " " + file + " is not in a mounted Secret");
  if (m->sub_path) p.push_back(what + " " + file + " is mounted with subPath (never updated: rotation stops)");
  if (m->key.empty()) {
    p.push_back(what + " " + file + " is no key of the volume mounted at " + m->mount_path);
  } else if (!want_key.empty() && m->key != want_key) {
    p.push_back(what + " " + file + " is key " + m->key + " of Secret " + m->secret + ", want " + want_key);
  }
  if (secret != nullptr) *secret = m->secret;
  return p;
}

// The server's TLS and auth flags, the Secret key each must be, and the
// Secret each is expected in ("" = any).
struct SecretFlag {
  const char* flag;
  const char* key;
};
constexpr SecretFlag kServerSecretFlags[] = {{"tls_cert_file", "tls.crt"},
                                             {"tls_key_file", "tls.key"},
                                             {"tls_client_ca_file", "ca.crt"},
                                             {"auth_tokens_file", "tokens"}};
constexpr char kTokensSecret[] = "ropeattn-auth-tokens";

Problems CheckServerDeployment(const YAML::Node& deployment) {
  Problems p;
  if (!deployment.IsDefined()) return {"no Deployment named ropeattn"};
  const YAML::Node pod = Get(deployment, {"spec", "template", "spec"});
  const YAML::Node c = MainContainer(deployment);
  if (!c.IsDefined()) return {"Deployment ropeattn has no container named ropeattn"};
  const auto flags = Flags(c);
  const ropeattn::server::ServerOptions defaults;

  // Ports: args == container ports == the server's defaults.
  const auto address = flags.find("address");
  const auto metrics = flags.find("metrics_address");
  if (address == flags.end()) p.push_back("args lack --address (the default binds 127.0.0.1)");
  if (metrics == flags.end()) p.push_back("args lack --metrics_address");
  const int grpc_port = address == flags.end() ? -1 : PortOf(address->second);
  const int metrics_port = metrics == flags.end() ? -1 : PortOf(metrics->second);
  if (address != flags.end() && address->second.rfind("0.0.0.0:", 0) != 0) {
    p.push_back("--address must listen on 0.0.0.0 in a pod, got " + address->second);
  }
  if (metrics != flags.end() && metrics->second.rfind("0.0.0.0:", 0) != 0) {
    p.push_back("--metrics_address must listen on 0.0.0.0 in a pod, got " + metrics->second);
  }
  if (ContainerPort(c, "grpc") != grpc_port) {
    p.push_back("container port grpc (" + std::to_string(ContainerPort(c, "grpc")) +
                ") != --address port (" + std::to_string(grpc_port) + ")");
  }
  if (ContainerPort(c, "metrics") != metrics_port) {
    p.push_back("container port metrics (" + std::to_string(ContainerPort(c, "metrics")) +
                ") != --metrics_address port (" + std::to_string(metrics_port) + ")");
  }
  if (grpc_port != PortOf(defaults.address)) {
    p.push_back("gRPC port " + std::to_string(grpc_port) + " != the server's default " +
                std::to_string(PortOf(defaults.address)));
  }
  if (metrics_port != PortOf(defaults.metrics_address)) {
    p.push_back("metrics port " + std::to_string(metrics_port) + " != the server's default " +
                std::to_string(PortOf(defaults.metrics_address)));
  }

  // Probes: the kubelet's grpc: probe speaks plaintext only, so with TLS
  // on (--tls_cert_file) each probe must be an exec of the image's CLI,
  // `ropeattn health`, with TLS (and a client certificate under mTLS).
  const bool server_tls = flags.count("tls_cert_file") > 0;
  const bool server_mtls = flags.count("tls_client_ca_file") > 0;
  const auto probe_problem = [&](const std::string& kind, const std::string& want_service) {
    const YAML::Node probe = Get(c, {kind});
    if (!probe.IsDefined()) {
      p.push_back(kind + " missing");
      return;
    }
    const YAML::Node grpc = Get(probe, {"grpc"});
    const YAML::Node cmd = Get(probe, {"exec", "command"});
    int port = -1;
    std::string service;
    if (grpc.IsDefined()) {
      if (server_tls) {
        p.push_back(kind + " is a grpc: probe, which cannot speak TLS (use exec: ropeattn health)");
      }
      port = static_cast<int>(Num(Get(grpc, {"port"})).value_or(-1));
      service = Str(Get(grpc, {"service"}));  // absent == ""
    } else if (cmd.IsDefined() && cmd.IsSequence() && cmd.size() >= 2 &&
               Basename(Str(cmd[0])) == "ropeattn" && Str(cmd[1]) == "health") {
      const auto probe_flags = CommandFlags(cmd, 2);
      const auto flag = [&](const std::string& name, const std::string& fallback) {
        const auto it = probe_flags.find(name);
        return it == probe_flags.end() ? fallback : it->second;
      };
      const std::string target = flag("target", "127.0.0.1:50051");  // the CLI's default
      port = PortOf(target);
      const std::string host = target.substr(0, target.rfind(':'));
      if (host != "127.0.0.1" && host != "localhost") {
        p.push_back(kind + " --target " + target + " is not this pod's loopback");
      }
      service = flag("service", "");
      if (server_tls) {
        const std::string ca = flag("tls_ca_file", "");
        if (ca.empty()) {
          p.push_back(kind + " does not verify the server's certificate (--tls_ca_file)");
        } else {
          for (std::string& s : CheckSecretFile(pod, c, kind + " --tls_ca_file", ca, "ca.crt")) p.push_back(s);
        }
      }
      if (server_mtls) {
        const std::string cert = flag("tls_cert_file", "");
        const std::string key = flag("tls_key_file", "");
        if (cert.empty() || key.empty()) {
          p.push_back(kind + " presents no client certificate (--tls_cert_file, --tls_key_file), which "
                      "--tls_client_ca_file requires");
        } else {
          for (std::string& s : CheckSecretFile(pod, c, kind + " --tls_cert_file", cert, "tls.crt")) p.push_back(s);
          for (std::string& s : CheckSecretFile(pod, c, kind + " --tls_key_file", key, "tls.key")) p.push_back(s);
        }
      }
      if (probe_flags.count("token") > 0) {
        p.push_back(kind + " passes --token: health needs none, and a command line is visible to all");
      }
      // The CLI's own deadline (default 30 s) must end before the kubelet's
      // timeout, so a hung server is an answer, not a killed probe.
      const double deadline = std::atof(flag("deadline_seconds", "30").c_str());
      const double timeout = Num(Get(probe, {"timeoutSeconds"})).value_or(1);
      if (!(deadline > 0 && deadline < timeout)) {
        p.push_back(kind + " --deadline_seconds " + flag("deadline_seconds", "30") +
                    " must be > 0 and below timeoutSeconds " + std::to_string(timeout));
      }
    } else {
      p.push_back(kind + " is not a gRPC health probe (grpc:, or exec: ropeattn health)");
      return;
    }
    if (port != grpc_port) {
      p.push_back(kind + " port " + std::to_string(port) + " != gRPC port " + std::to_string(grpc_port));
    }
    if (service != want_service) {
      p.push_back(kind + " service \"" + service + "\", want \"" + want_service + "\"");
    }
  };
  probe_problem("startupProbe", "");
  probe_problem("livenessProbe", "");
  probe_problem("readinessProbe", kServiceName);

  // TLS and authentication: every flag names a key of a mounted Secret
  // (updated in place on rotation), tokens need TLS.
  for (const SecretFlag& f : kServerSecretFlags) {
    const auto it = flags.find(f.flag);
    if (it == flags.end()) {
      p.push_back(std::string("args lack --") + f.flag);
      continue;
    }
    std::string secret;
    for (std::string& s : CheckSecretFile(pod, c, std::string("--") + f.flag, it->second, f.key, &secret)) {
      p.push_back(s);
    }
    if (std::string(f.flag) == "auth_tokens_file" && !secret.empty() && secret != kTokensSecret) {
      p.push_back("--auth_tokens_file is in Secret " + secret + ", want " + kTokensSecret);
    }
  }
  {
    if (flags.count("tls_cert_file") && flags.count("tls_key_file")) {
      const auto cm = MountOf(pod, c, flags.at("tls_cert_file"));
      const auto km = MountOf(pod, c, flags.at("tls_key_file"));
      if (cm && km && cm->secret != km->secret) {
        p.push_back("--tls_cert_file and --tls_key_file come from different Secrets (" + cm->secret + ", " +
                    km->secret + "): a rotation would pair a new certificate with an old key");
      }
    }
  }

  // Drain arithmetic.
  const double grace = FlagDouble(flags, "shutdown_grace_seconds", defaults.shutdown_grace_seconds);
  const auto sleep = PreStopSleep(c);
  const auto tgps = Num(Get(pod, {"terminationGracePeriodSeconds"}));
  if (!sleep) p.push_back("preStop sleep missing");
  if (!tgps) p.push_back("terminationGracePeriodSeconds missing (default 30)");
  if (sleep && tgps && !(*tgps > *sleep + grace)) {
    p.push_back("terminationGracePeriodSeconds " + std::to_string(*tgps) +
                " must exceed preStop sleep + --shutdown_grace_seconds = " +
                std::to_string(*sleep + grace));
  }
  // Liveness must not fire during a drain ("" is NOT_SERVING then).
  {
    const YAML::Node live = Get(c, {"livenessProbe"});
    const double period = Num(Get(live, {"periodSeconds"})).value_or(10);
    const double failures = Num(Get(live, {"failureThreshold"})).value_or(3);
    if (sleep && period * failures <= *sleep + grace) {
      p.push_back("livenessProbe gives up after " + std::to_string(period * failures) +
                  " s, not longer than the drain (" + std::to_string(*sleep + grace) + " s)");
    }
  }

  // Resources.
  const auto cpu_req = Quantity(Get(c, {"resources", "requests", "cpu"}));
  const auto cpu_lim = Quantity(Get(c, {"resources", "limits", "cpu"}));
  const auto mem_req = Quantity(Get(c, {"resources", "requests", "memory"}));
  const auto mem_lim = Quantity(Get(c, {"resources", "limits", "memory"}));
  if (!cpu_req || !cpu_lim || !mem_req || !mem_lim) {
    p.push_back("resources need cpu and memory requests and limits");
  }
  const int64_t workers = FlagInt(flags, "compute_workers", defaults.compute_workers);
  const int64_t threads = FlagInt(flags, "threads_per_call", defaults.threads_per_call);
  const double want_cpu = static_cast<double>(workers * threads);
  if (cpu_req && std::abs(*cpu_req - want_cpu) > 1e-9) {
    p.push_back("cpu request " + std::to_string(*cpu_req) +
                " != compute_workers * threads_per_call = " + std::to_string(want_cpu));
  }
  if (cpu_lim && std::abs(*cpu_lim - want_cpu) > 1e-9) {
    p.push_back("cpu limit " + std::to_string(*cpu_lim) +
                " != compute_workers * threads_per_call = " + std::to_string(want_cpu));
  }
  const int64_t budget = FlagInt(flags, "memory_budget_bytes", defaults.memory_budget_bytes);
  const int64_t queue = FlagInt(flags, "queue_depth", defaults.queue_depth);
  const int64_t message = FlagInt(flags, "max_message_bytes", defaults.max_message_bytes);
  if (flags.find("memory_budget_bytes") == flags.end()) {
    p.push_back("args lack --memory_budget_bytes (the memory limit is derived from it)");
  }
  if (mem_lim && *mem_lim < static_cast<double>(budget)) {
    p.push_back("memory limit " + std::to_string(*mem_lim) + " < --memory_budget_bytes " +
                std::to_string(budget));
  }
  // The stated arithmetic: budget + base + (workers + queue) x 2 x message
  // + workers x message.
  const double need = static_cast<double>(budget) + static_cast<double>(kProcessBaseBytes) +
                      static_cast<double>((workers + queue) * 2 * message) +
                      static_cast<double>(workers * message);
  if (mem_lim && *mem_lim < need) {
    p.push_back("memory limit " + std::to_string(*mem_lim) +
                " < budget + overhead from the flags = " + std::to_string(need));
  }
  if (mem_req && mem_lim && *mem_req > *mem_lim) p.push_back("memory request > limit");

  // Security context: container level, or inherited from the pod for the
  // fields PodSecurityContext has.
  const YAML::Node csc = Get(c, {"securityContext"});
  const YAML::Node psc = Get(pod, {"securityContext"});
  const auto either = [&](const std::string& key) {
    const YAML::Node v = Get(csc, {key});
    return v.IsDefined() ? v : Get(psc, {key});
  };
  // Replicas spread across nodes: one node lost takes at most its share of
  // the sessions (a constraint on the pods' own labels, by hostname).
  {
    bool spread = false;
    const YAML::Node labels = Get(deployment, {"spec", "template", "metadata", "labels"});
    const YAML::Node constraints = Get(pod, {"topologySpreadConstraints"});
    if (constraints.IsDefined() && constraints.IsSequence()) {
      for (const YAML::Node& t : constraints) {
        if (Str(Get(t, {"topologyKey"})) != "kubernetes.io/hostname") continue;
        const YAML::Node match = Get(t, {"labelSelector", "matchLabels"});
        bool selects_pods = match.IsDefined() && match.IsMap() && match.size() > 0;
        if (selects_pods) {
          for (const auto& kv : match) {
            selects_pods = selects_pods && labels.IsDefined() &&
                           Str(Get(labels, {kv.first.as<std::string>()})) == Str(kv.second);
          }
        }
        const YAML::Node skew = Get(t, {"maxSkew"});
        spread |= selects_pods && skew.IsDefined() && skew.as<int>(0) == 1;
      }
    }
    if (!spread) {
      p.push_back("topologySpreadConstraints must spread the pods across kubernetes.io/hostname "
                  "(maxSkew 1, labelSelector matching the pod labels)");
    }
  }

  if (!IsTrue(either("runAsNonRoot"))) p.push_back("securityContext.runAsNonRoot must be true");
  if (Str(either("runAsUser")) != "10001") p.push_back("securityContext.runAsUser must be 10001");
  if (!IsTrue(Get(csc, {"readOnlyRootFilesystem"}))) {
    p.push_back("securityContext.readOnlyRootFilesystem must be true");
  }
  if (Str(Get(csc, {"allowPrivilegeEscalation"})) != "false") {
    p.push_back("securityContext.allowPrivilegeEscalation must be false");
  }
  {
    bool drops_all = false;
    const YAML::Node drop = Get(csc, {"capabilities", "drop"});
    if (drop.IsDefined() && drop.IsSequence()) {
      for (const YAML::Node& d : drop) drops_all |= Str(d) == "ALL";
    }
    if (!drops_all) p.push_back("securityContext.capabilities.drop must contain ALL");
  }
  {
    const YAML::Node seccomp = Get(csc, {"seccompProfile", "type"}).IsDefined()
                                   ? Get(csc, {"seccompProfile", "type"})
                                   : Get(psc, {"seccompProfile", "type"});
    if (Str(seccomp) != "RuntimeDefault") p.push_back("seccompProfile.type must be RuntimeDefault");
  }
  return p;
}

// ---------------------------------------------------------------------------
// Services, HPA, PDB.

bool SelectorMatchesPods(const YAML::Node& selector, const YAML::Node& deployment) {
  const YAML::Node labels = Get(deployment, {"spec", "template", "metadata", "labels"});
  if (!selector.IsDefined() || !selector.IsMap() || selector.size() == 0) return false;
  for (const auto& kv : selector) {
    if (Str(Get(labels, {kv.first.Scalar()})) != Str(kv.second)) return false;
  }
  return true;
}

// The Service port that reaches the gRPC container port (by name or number).
bool ServiceReachesGrpc(const YAML::Node& svc, const YAML::Node& deployment, int* port) {
  const YAML::Node ports = Get(svc, {"spec", "ports"});
  const int grpc = ContainerPort(MainContainer(deployment), "grpc");
  if (!ports.IsDefined() || !ports.IsSequence()) return false;
  for (const YAML::Node& sp : ports) {
    const std::string target = Str(Get(sp, {"targetPort"}), Str(Get(sp, {"port"})));
    if (target == "grpc" || target == std::to_string(grpc)) {
      *port = static_cast<int>(Num(Get(sp, {"port"})).value_or(-1));
      return true;
    }
  }
  return false;
}

// Every Service that selects the server pods. Only the headless one may
// reach their gRPC port (for Envoy, which the NetworkPolicy alone admits):
// no Service sends callers straight to the pods.
Problems CheckServices(const std::vector<YAML::Node>& services, const YAML::Node& deployment) {
  Problems p;
  YAML::Node headless(YAML::NodeType::Undefined);
  for (const YAML::Node& svc : services) {
    const std::string name = Str(Get(svc, {"metadata", "name"}));
    if (name == "ropeattn-headless") headless.reset(svc);
    if (!SelectorMatchesPods(Get(svc, {"spec", "selector"}), deployment)) continue;
    int port = -1;
    if (name != "ropeattn-headless" && ServiceReachesGrpc(svc, deployment, &port)) {
      p.push_back("Service " + name + " sends callers straight to the pods' gRPC port (" +
                  std::to_string(port) + "); only ropeattn-headless may, for Envoy");
    }
  }
  if (!headless.IsDefined()) {
    p.push_back("no Service ropeattn-headless");
    return p;
  }
  if (Str(Get(headless, {"spec", "clusterIP"})) != "None") {
    p.push_back("Service ropeattn-headless must have clusterIP: None");
  }
  const std::string type = Str(Get(headless, {"spec", "type"}), "ClusterIP");
  if (type != "ClusterIP") p.push_back("Service ropeattn-headless type " + type + ", want ClusterIP (headless)");
  if (IsTrue(Get(headless, {"spec", "publishNotReadyAddresses"}))) {
    p.push_back("headless Service must not publish not-ready pods (draining pods stay on the ring)");
  }
  if (!SelectorMatchesPods(Get(headless, {"spec", "selector"}), deployment)) {
    p.push_back("Service ropeattn-headless selector does not match the server pods");
  }
  int port = -1;
  if (!ServiceReachesGrpc(headless, deployment, &port)) {
    p.push_back("Service ropeattn-headless has no port to the gRPC container port");
  }
  return p;
}

Problems CheckHpaAndPdb(const YAML::Node& hpa, const YAML::Node& pdb, const YAML::Node& deployment) {
  Problems p;
  if (!hpa.IsDefined()) {
    p.push_back("no HorizontalPodAutoscaler ropeattn");
  } else {
    if (Str(Get(hpa, {"apiVersion"})) != "autoscaling/v2") p.push_back("HPA must be autoscaling/v2");
    if (Str(Get(hpa, {"spec", "scaleTargetRef", "kind"})) != "Deployment" ||
        Str(Get(hpa, {"spec", "scaleTargetRef", "name"})) != Str(Get(deployment, {"metadata", "name"}))) {
      p.push_back("HPA does not target Deployment ropeattn");
    }
    bool cpu = false;
    const YAML::Node metrics = Get(hpa, {"spec", "metrics"});
    if (metrics.IsDefined() && metrics.IsSequence()) {
      for (const YAML::Node& m : metrics) {
        cpu |= Str(Get(m, {"type"})) == "Resource" && Str(Get(m, {"resource", "name"})) == "cpu" &&
               Str(Get(m, {"resource", "target", "type"})) == "Utilization";
      }
    }
    if (!cpu) p.push_back("HPA has no CPU utilization metric");
    const auto min = Num(Get(hpa, {"spec", "minReplicas"}));
    if (!min || *min < 2) p.push_back("HPA minReplicas must be >= 2 (sessions need a replica to move to)");
  }
  if (!pdb.IsDefined()) {
    p.push_back("no PodDisruptionBudget ropeattn");
  } else {
    const YAML::Node selector = Get(pdb, {"spec", "selector", "matchLabels"});
    if (!SelectorMatchesPods(selector, deployment)) p.push_back("PDB selector does not match the server pods");
    const auto max_unavailable = Num(Get(pdb, {"spec", "maxUnavailable"}));
    const auto min_available = Num(Get(pdb, {"spec", "minAvailable"}));
    if (!(max_unavailable && *max_unavailable == 1) && !(min_available && *min_available >= 1)) {
      p.push_back("PDB needs maxUnavailable: 1 or minAvailable >= 1");
    }
  }
  return p;
}

// ---------------------------------------------------------------------------
// NetworkPolicy.

constexpr char kMonitoringNamespace[] = "monitoring";

// Whether a LabelSelector selects the pods of `deployment`. An empty
// selector ({}) selects every pod; matchExpressions are not evaluated and
// count as "does not select" (the checks below then report the rule).
bool LabelSelectorSelects(const YAML::Node& selector, const YAML::Node& deployment) {
  if (!selector.IsDefined()) return false;
  if (Get(selector, {"matchExpressions"}).IsDefined()) return false;
  const YAML::Node labels = Get(deployment, {"spec", "template", "metadata", "labels"});
  const YAML::Node ml = Get(selector, {"matchLabels"});
  if (!ml.IsDefined() || !ml.IsMap()) return true;
  for (const auto& kv : ml) {
    if (Str(Get(labels, {kv.first.Scalar()})) != Str(kv.second)) return false;
  }
  return true;
}

// A NetworkPolicyPeer: the Envoy pods of this namespace, the monitoring
// namespace, or something else (described).
enum class Peer { kEnvoy, kMonitoring, kOther };
Peer ClassifyPeer(const YAML::Node& peer, const YAML::Node& server, const YAML::Node& envoy,
                  std::string* what) {
  const YAML::Node pods = Get(peer, {"podSelector"});
  const YAML::Node ns = Get(peer, {"namespaceSelector"});
  if (Get(peer, {"ipBlock"}).IsDefined()) {
    *what = "an ipBlock";
    return Peer::kOther;
  }
  if (ns.IsDefined()) {
    const YAML::Node ml = Get(ns, {"matchLabels"});
    const bool monitoring = !Get(ns, {"matchExpressions"}).IsDefined() && ml.IsDefined() && ml.IsMap() &&
                            Str(Get(ml, {"kubernetes.io/metadata.name"})) == kMonitoringNamespace;
    *what = monitoring ? "the monitoring namespace" : "a namespaceSelector other than the monitoring namespace";
    return monitoring ? Peer::kMonitoring : Peer::kOther;
  }
  if (pods.IsDefined()) {
    const bool only_envoy = Get(pods, {"matchLabels"}).IsDefined() && LabelSelectorSelects(pods, envoy) &&
                            !LabelSelectorSelects(pods, server);
    *what = only_envoy ? "the Envoy pods" : "a podSelector that is not the Envoy pods alone";
    return only_envoy ? Peer::kEnvoy : Peer::kOther;
  }
  *what = "an empty peer";
  return Peer::kOther;
}

// Ingress to the server pods: isolated (some policy selects them for
// Ingress), the gRPC port admitted from the Envoy pods only, the metrics
// port from the monitoring namespace only, no other port at all.
Problems CheckNetworkPolicies(const std::vector<YAML::Node>& policies, const YAML::Node& server,
                              const YAML::Node& envoy) {
  Problems p;
  const YAML::Node c = MainContainer(server);
  const int grpc = ContainerPort(c, "grpc");
  const int metrics = ContainerPort(c, "metrics");
  bool isolated = false, grpc_from_envoy = false, metrics_from_monitoring = false;
  for (const YAML::Node& np : policies) {
    const std::string name = "NetworkPolicy " + Str(Get(np, {"metadata", "name"}));
    if (!LabelSelectorSelects(Get(np, {"spec", "podSelector"}), server)) continue;
    const YAML::Node types = Get(np, {"spec", "policyTypes"});
    bool ingress_type = !types.IsDefined();  // absent: Ingress is implied
    if (types.IsDefined() && types.IsSequence()) {
      for (const YAML::Node& t : types) ingress_type |= Str(t) == "Ingress";
    }
    if (!ingress_type) continue;
    isolated = true;
    const YAML::Node rules = Get(np, {"spec", "ingress"});
    if (!rules.IsDefined() || !rules.IsSequence()) continue;
    for (const YAML::Node& rule : rules) {
      // Ports the rule admits: all (no ports), or the listed TCP ports.
      bool all_ports = false, grpc_admitted = false, metrics_admitted = false, other = false;
      const YAML::Node ports = Get(rule, {"ports"});
      if (!ports.IsDefined() || !ports.IsSequence() || ports.size() == 0) {
        all_ports = true;
      } else {
        for (const YAML::Node& pe : ports) {
          const YAML::Node port = Get(pe, {"port"});
          if (!port.IsDefined() || Str(Get(pe, {"protocol"}), "TCP") != "TCP") {
            other = true;
            continue;
          }
          int lo = static_cast<int>(Num(port).value_or(-1));
          if (lo < 0) lo = ContainerPort(c, Str(port));  // a named port
          const int hi = static_cast<int>(Num(Get(pe, {"endPort"})).value_or(lo));
          grpc_admitted |= lo <= grpc && grpc <= hi;
          metrics_admitted |= lo <= metrics && metrics <= hi;
          other |= lo < 0 || hi > lo || (lo != grpc && lo != metrics);
        }
      }
      if (all_ports || other) p.push_back(name + " admits ports other than " + std::to_string(grpc) + " and " +
                                          std::to_string(metrics) + " to the server pods");
      grpc_admitted |= all_ports;
      metrics_admitted |= all_ports;
      std::vector<std::pair<Peer, std::string>> peers;
      const YAML::Node from = Get(rule, {"from"});
      if (!from.IsDefined() || !from.IsSequence() || from.size() == 0) {
        peers.emplace_back(Peer::kOther, "every source (no from)");
      } else {
        for (const YAML::Node& peer : from) {
          std::string what;
          const Peer kind = ClassifyPeer(peer, server, envoy, &what);
          peers.emplace_back(kind, what);
        }
      }
      for (const auto& [kind, what] : peers) {
        if (grpc_admitted) {
          if (kind == Peer::kEnvoy) {
            grpc_from_envoy = true;
          } else {
            p.push_back(name + " admits port " + std::to_string(grpc) + " from " + what);
          }
        }
        if (metrics_admitted) {
          if (kind == Peer::kMonitoring) {
            metrics_from_monitoring = true;
          } else {
            p.push_back(name + " admits port " + std::to_string(metrics) + " from " + what);
          }
        }
      }
    }
  }
  if (!isolated) p.push_back("no NetworkPolicy selects the server pods for Ingress (every source admitted)");
  if (!grpc_from_envoy) p.push_back("no NetworkPolicy admits port " + std::to_string(grpc) + " from the Envoy pods");
  if (!metrics_from_monitoring) {
    p.push_back("no NetworkPolicy admits port " + std::to_string(metrics) + " from the monitoring namespace");
  }
  return p;
}

// ---------------------------------------------------------------------------
// Envoy.

YAML::Node HttpConnectionManager(const YAML::Node& listener) {
  const YAML::Node chains = Get(listener, {"filter_chains"});
  if (!chains.IsDefined() || !chains.IsSequence()) return YAML::Node(YAML::NodeType::Undefined);
  for (const YAML::Node& chain : chains) {
    const YAML::Node hcm =
        FindBy(Get(chain, {"filters"}), "name", "envoy.filters.network.http_connection_manager");
    if (hcm.IsDefined()) return Get(hcm, {"typed_config"});
  }
  return YAML::Node(YAML::NodeType::Undefined);
}

YAML::Node ListenerOnPort(const YAML::Node& envoy, int port) {
  const YAML::Node listeners = Get(envoy, {"static_resources", "listeners"});
  if (listeners.IsDefined() && listeners.IsSequence()) {
    for (const YAML::Node& l : listeners) {
      if (Num(Get(l, {"address", "socket_address", "port_value"})).value_or(-1) == port) return l;
    }
  }
  return YAML::Node(YAML::NodeType::Undefined);
}

// Http2ProtocolOptions of a cluster: the typed upstream options or the
// deprecated cluster field.
YAML::Node ClusterHttp2(const YAML::Node& cluster) {
  const YAML::Node typed = Get(cluster, {"typed_extension_protocol_options",
                                         "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"});
  for (const auto& path : {std::initializer_list<std::string>{"explicit_http_config", "http2_protocol_options"},
                           {"use_downstream_protocol_config", "http2_protocol_options"},
                           {"auto_config", "http2_protocol_options"}}) {
    const YAML::Node h2 = Get(typed, path);
    if (h2.IsDefined()) return h2;
  }
  return Get(cluster, {"http2_protocol_options"});
}

Problems CheckEnvoy(const YAML::Node& envoy, const YAML::Node& headless, int listener_port) {
  Problems p;
  if (!envoy.IsDefined() || !envoy.IsMap()) return {"no envoy.yaml in the kustomization's configMapGenerator"};
  const YAML::Node listener = ListenerOnPort(envoy, listener_port);
  if (!listener.IsDefined()) return {"no Envoy listener on port " + std::to_string(listener_port)};
  if (!Num(Get(listener, {"per_connection_buffer_limit_bytes"}))) {
    p.push_back("listener lacks per_connection_buffer_limit_bytes");
  }
  const YAML::Node hcm = HttpConnectionManager(listener);
  if (!hcm.IsDefined()) return {"listener has no http_connection_manager"};

  // Downstream HTTP/2 hardening.
  const std::string codec = Str(Get(hcm, {"codec_type"}), "AUTO");
  if (codec != "AUTO" && codec != "HTTP2") p.push_back("codec_type must be AUTO or HTTP2, got " + codec);
  const YAML::Node h2 = Get(hcm, {"http2_protocol_options"});
  for (const char* key : {"max_concurrent_streams", "initial_stream_window_size",
                          "initial_connection_window_size"}) {
    if (!Num(Get(h2, {key}))) p.push_back(std::string("downstream http2_protocol_options lacks ") + key);
  }
  if (!Num(Get(hcm, {"max_request_headers_kb"}))) p.push_back("HCM lacks max_request_headers_kb");
  const YAML::Node common = Get(hcm, {"common_http_protocol_options"});
  if (Str(Get(common, {"headers_with_underscores_action"})) != "REJECT_REQUEST") {
    p.push_back("headers_with_underscores_action must be REJECT_REQUEST");
  }
  for (const char* key : {"idle_timeout", "max_connection_duration"}) {
    if (!Seconds(Get(common, {key}))) p.push_back(std::string("common_http_protocol_options lacks ") + key);
  }
  if (!Num(Get(common, {"max_requests_per_connection"}))) {
    p.push_back("common_http_protocol_options lacks max_requests_per_connection");
  }
  if (Seconds(Get(hcm, {"request_timeout"})).value_or(-1) != 0) {
    p.push_back("HCM request_timeout must be 0s (Decode streams)");
  }
  const auto stream_idle = Seconds(Get(hcm, {"stream_idle_timeout"}));
  if (!stream_idle || *stream_idle < 300) {
    p.push_back("stream_idle_timeout must be set and >= 300 s (the default session idle TTL)");
  }
  bool connection_monitor = false;
  const YAML::Node monitors = Get(envoy, {"overload_manager", "resource_monitors"});
  if (monitors.IsDefined() && monitors.IsSequence()) {
    for (const YAML::Node& m : monitors) {
      connection_monitor |=
          Str(Get(m, {"name"})) == "envoy.resource_monitors.global_downstream_max_connections" &&
          Num(Get(m, {"typed_config", "max_active_downstream_connections"})).value_or(0) > 0;
    }
  }
  if (!connection_monitor) p.push_back("overload_manager lacks global_downstream_max_connections");

  // Route: hash on the session header, no timeout.
  std::string cluster_name;
  const YAML::Node vhosts = Get(hcm, {"route_config", "virtual_hosts"});
  if (vhosts.IsDefined() && vhosts.IsSequence()) {
    for (const YAML::Node& vh : vhosts) {
      const YAML::Node routes = Get(vh, {"routes"});
      if (!routes.IsDefined() || !routes.IsSequence()) continue;
      for (const YAML::Node& r : routes) {
        const YAML::Node hp = Get(r, {"route", "hash_policy"});
        if (!hp.IsDefined() || !hp.IsSequence()) continue;
        for (const YAML::Node& h : hp) {
          std::string header = Str(Get(h, {"header", "header_name"}));
          std::transform(header.begin(), header.end(), header.begin(), ::tolower);
          if (header == kRoutingHeader) {
            cluster_name = Str(Get(r, {"route", "cluster"}));
            if (Seconds(Get(r, {"route", "timeout"})).value_or(-1) != 0) {
              p.push_back("the hashed route's timeout must be 0s (Decode streams)");
            }
          }
        }
      }
    }
  }
  if (cluster_name.empty()) {
    p.push_back(std::string("no route with hash_policy on header ") + kRoutingHeader);
    return p;
  }
  const YAML::Node cluster = FindBy(Get(envoy, {"static_resources", "clusters"}), "name", cluster_name);
  if (!cluster.IsDefined()) return p.push_back("no cluster " + cluster_name), p;
  const std::string lb = Str(Get(cluster, {"lb_policy"}));
  if (lb != "RING_HASH" && lb != "MAGLEV") {
    p.push_back("cluster " + cluster_name + " lb_policy " + lb + ", want RING_HASH or MAGLEV");
  }
  if (Str(Get(cluster, {"type"})) != "STRICT_DNS") p.push_back("cluster type must be STRICT_DNS");
  const YAML::Node up_h2 = ClusterHttp2(cluster);
  if (!up_h2.IsDefined()) p.push_back("cluster lacks http2_protocol_options (gRPC needs h2)");
  if (!Num(Get(cluster, {"per_connection_buffer_limit_bytes"}))) {
    p.push_back("cluster lacks per_connection_buffer_limit_bytes");
  }
  const auto ping = Seconds(Get(up_h2, {"connection_keepalive", "interval"}));
  if (!ping) {
    p.push_back("upstream connection_keepalive.interval missing");
  } else if (*ping < kServerMinPingIntervalSeconds) {
    p.push_back("upstream keepalive pings more often than the server accepts (30 s)");
  }
  // Envoy closes an idle upstream connection before the server does, so a
  // new request never races the server's GOAWAY.
  const auto upstream_idle = Seconds(Get(
      cluster, {"typed_extension_protocol_options",
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "common_http_protocol_options", "idle_timeout"}));
  if (!upstream_idle || *upstream_idle >= kServerIdleCloseSeconds) {
    p.push_back("upstream idle_timeout must be set and below the server's "
                "--max_connection_idle_seconds (300 s)");
  }
  // Endpoints: the headless Service's name and port.
  const std::string svc_name = Str(Get(headless, {"metadata", "name"}));
  int svc_port = -1;
  {
    const YAML::Node ports = Get(headless, {"spec", "ports"});
    if (ports.IsDefined() && ports.IsSequence() && ports.size() > 0) {
      svc_port = static_cast<int>(Num(Get(ports[0], {"port"})).value_or(-1));
    }
  }
  bool points_at_headless = false;
  const YAML::Node eps = Get(cluster, {"load_assignment", "endpoints"});
  if (eps.IsDefined() && eps.IsSequence()) {
    for (const YAML::Node& ep : eps) {
      const YAML::Node lbs = Get(ep, {"lb_endpoints"});
      if (!lbs.IsDefined() || !lbs.IsSequence()) continue;
      for (const YAML::Node& l : lbs) {
        const YAML::Node sa = Get(l, {"endpoint", "address", "socket_address"});
        const std::string addr = Str(Get(sa, {"address"}));
        const bool name_ok = !svc_name.empty() && (addr == svc_name || addr.rfind(svc_name + ".", 0) == 0);
        points_at_headless |= name_ok && Num(Get(sa, {"port_value"})).value_or(-2) == svc_port;
      }
    }
  }
  if (!points_at_headless) {
    p.push_back("cluster " + cluster_name + " does not point at " + svc_name + ":" + std::to_string(svc_port));
  }
  // Active gRPC health checks on the readiness service.
  bool grpc_hc = false;
  const YAML::Node hcs = Get(cluster, {"health_checks"});
  if (hcs.IsDefined() && hcs.IsSequence()) {
    for (const YAML::Node& hc : hcs) {
      grpc_hc |= Str(Get(hc, {"grpc_health_check", "service_name"})) == kServiceName;
    }
  }
  if (!grpc_hc) p.push_back(std::string("cluster lacks grpc_health_check on ") + kServiceName);
  return p;
}

// ---------------------------------------------------------------------------
// Envoy's TLS: downstream TLS on the listener, upstream mutual TLS to the
// pods, certificates through file-based SDS (reloaded on rotation) from
// mounted Secrets, the caller's authorization header left alone.

struct EnvoyTlsInputs {
  YAML::Node envoy;                               // envoy.yaml
  std::map<std::string, YAML::Node> files;        // ConfigMap keys -> content
  YAML::Node deployment;                          // Deployment ropeattn-envoy
  std::string configmap_name;
};

EnvoyTlsInputs RealEnvoyTlsInputs() {
  EnvoyTlsInputs in;
  in.envoy.reset(EnvoyConfig());
  for (const auto& [k, v] : Load().envoy_files) in.files[k].reset(YAML::Clone(v));
  in.deployment.reset(Object("Deployment/ropeattn-envoy"));
  in.configmap_name = Load().envoy_configmap_name;
  return in;
}

// The SDS Secret resource an SdsSecretConfig names, read from the file-based
// SDS file in Envoy's ConfigMap; problems (prefixed by `what`) if it is not
// file-based SDS, not in the mounted ConfigMap, or not that one resource.
YAML::Node SdsResource(const EnvoyTlsInputs& in, const YAML::Node& sds, const std::string& what, Problems* p) {
  const YAML::Node none(YAML::NodeType::Undefined);
  const std::string name = Str(Get(sds, {"name"}));
  const YAML::Node config = Get(sds, {"sds_config"});
  if (!config.IsDefined()) {
    p->push_back(what + " \"" + name + "\" is a static secret: read once, never reloaded (use file-based SDS)");
    return none;
  }
  std::string path = Str(Get(config, {"path_config_source", "path"}));
  if (path.empty()) path = Str(Get(config, {"path"}));
  if (path.empty()) {
    p->push_back(what + " \"" + name + "\" is not file-based SDS (sds_config.path_config_source.path)");
    return none;
  }
  const YAML::Node pod = Get(in.deployment, {"spec", "template", "spec"});
  const YAML::Node c = FindBy(Get(pod, {"containers"}), "name", "envoy");
  const auto m = MountOf(pod, c, path);
  if (!m || m->configmap != in.configmap_name || m->configmap.empty()) {
    p->push_back(what + " SDS file " + path + " is not in Envoy's mounted ConfigMap " + in.configmap_name);
    return none;
  }
  const auto it = in.files.find(m->key);
  if (it == in.files.end()) {
    p->push_back(what + " SDS file " + path + ": ConfigMap " + in.configmap_name + " has no key " + m->key);
    return none;
  }
  const YAML::Node resources = Get(it->second, {"resources"});
  if (!resources.IsDefined() || !resources.IsSequence() || resources.size() != 1) {
    p->push_back(what + " SDS file " + m->key + " must hold exactly one resource");
    return none;
  }
  const YAML::Node r = resources[0];
  if (Str(Get(r, {"@type"})) != "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret") {
    p->push_back(what + " SDS file " + m->key + " does not hold a tls.v3.Secret");
  }
  if (Str(Get(r, {"name"})) != name) {
    p->push_back(what + " SDS file " + m->key + " names secret \"" + Str(Get(r, {"name"})) + "\", want \"" +
                 name + "\" (Envoy rejects the update)");
  }
  return r;
}

// A file Envoy reads through SDS: in a mounted Secret as `key`; its watched
// directory (if set) is the Secret's mount, where the kubelet's atomic swap
// happens. Returns the Secret's name.
std::string CheckEnvoySecretFile(const EnvoyTlsInputs& in, const std::string& what, const std::string& file,
                                 const std::string& key, const YAML::Node& watched, Problems* p) {
  const YAML::Node pod = Get(in.deployment, {"spec", "template", "spec"});
  const YAML::Node c = FindBy(Get(pod, {"containers"}), "name", "envoy");
  std::string secret;
  for (std::string& s : CheckSecretFile(pod, c, what, file, key, &secret)) p->push_back(s);
  const auto m = MountOf(pod, c, file);
  const std::string dir = Str(Get(watched, {"path"}));
  if (m && !dir.empty() && dir != m->mount_path) {
    p->push_back(what + ": watched_directory " + dir + " is not the Secret's mount " + m->mount_path +
                 " (the kubelet's atomic swap would go unseen)");
  }
  return secret;
}

// A TlsCertificate delivered by SDS: chain and key from one mounted Secret.
void CheckSdsCertificate(const EnvoyTlsInputs& in, const YAML::Node& resource, const std::string& what,
                         Problems* p) {
  const YAML::Node cert = Get(resource, {"tls_certificate"});
  if (!cert.IsDefined()) {
    p->push_back(what + ": the SDS resource has no tls_certificate");
    return;
  }
  const YAML::Node watched = Get(cert, {"watched_directory"});
  const std::string a = CheckEnvoySecretFile(in, what + " certificate_chain",
                                             Str(Get(cert, {"certificate_chain", "filename"})), "tls.crt", watched, p);
  const std::string b = CheckEnvoySecretFile(in, what + " private_key",
                                             Str(Get(cert, {"private_key", "filename"})), "tls.key", watched, p);
  if (!a.empty() && !b.empty() && a != b) p->push_back(what + ": certificate and key from different Secrets");
}

// The certificates of a CommonTlsContext: at least one, each via file-based
// SDS (inline tls_certificates are read once and never reloaded).
void CheckTlsCertificates(const EnvoyTlsInputs& in, const YAML::Node& common, const std::string& what,
                          Problems* p) {
  if (Get(common, {"tls_certificates"}).IsDefined()) {
    p->push_back(what + ": inline tls_certificates are read once, never reloaded (use file-based SDS)");
  }
  const YAML::Node sds = Get(common, {"tls_certificate_sds_secret_configs"});
  if (!sds.IsDefined() || !sds.IsSequence() || sds.size() == 0) {
    p->push_back(what + " has no certificate (tls_certificate_sds_secret_configs)");
    return;
  }
  for (const YAML::Node& s : sds) {
    const YAML::Node r = SdsResource(in, s, what, p);
    if (r.IsDefined()) CheckSdsCertificate(in, r, what, p);
  }
}

// The transport socket's typed_config if it is Envoy's TLS socket of `type`.
YAML::Node TlsContext(const YAML::Node& holder, const std::string& type) {
  const YAML::Node ts = Get(holder, {"transport_socket"});
  if (Str(Get(ts, {"typed_config", "@type"})) != "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3." + type) {
    return YAML::Node(YAML::NodeType::Undefined);
  }
  return Get(ts, {"typed_config"});
}

// Every header removal or addition that touches `authorization`, anywhere
// in the config (route, virtual host, route config, filters).
void FindAuthorizationEdits(const YAML::Node& n, const std::string& where, Problems* p) {
  if (!n.IsDefined()) return;
  const auto is_auth = [](std::string h) {
    std::transform(h.begin(), h.end(), h.begin(), ::tolower);
    return h == "authorization";
  };
  if (n.IsMap()) {
    for (const auto& kv : n) {
      const std::string key = kv.first.Scalar();
      const YAML::Node v = kv.second;
      if (key == "request_headers_to_remove" && v.IsSequence()) {
        for (const YAML::Node& h : v) {
          if (is_auth(Str(h))) p->push_back("Envoy removes the caller's authorization header (" + where + ")");
        }
      }
      if (key == "request_headers_to_add" && v.IsSequence()) {
        for (const YAML::Node& h : v) {
          if (is_auth(Str(Get(h, {"header", "key"})))) {
            p->push_back("Envoy rewrites the caller's authorization header (" + where + ")");
          }
        }
      }
      FindAuthorizationEdits(v, where.empty() ? key : where + "." + key, p);
    }
  } else if (n.IsSequence()) {
    for (const YAML::Node& item : n) FindAuthorizationEdits(item, where, p);
  }
}

// SAN matchers Envoy applies to the pods' certificate: (san_type, exact).
std::vector<std::pair<std::string, std::string>> UpstreamSanMatchers(const EnvoyTlsInputs& in,
                                                                     const std::string& cluster_name) {
  std::vector<std::pair<std::string, std::string>> out;
  const YAML::Node cluster = FindBy(Get(in.envoy, {"static_resources", "clusters"}), "name", cluster_name);
  const YAML::Node common = Get(TlsContext(cluster, "UpstreamTlsContext"), {"common_tls_context"});
  std::vector<YAML::Node> contexts = {Get(common, {"validation_context"}),
                                      Get(common, {"combined_validation_context", "default_validation_context"})};
  Problems ignored;
  for (const YAML::Node& sds : {Get(common, {"validation_context_sds_secret_config"}),
                                Get(common, {"combined_validation_context", "validation_context_sds_secret_config"})}) {
    if (sds.IsDefined()) contexts.push_back(Get(SdsResource(in, sds, "", &ignored), {"validation_context"}));
  }
  for (const YAML::Node& vc : contexts) {
    const YAML::Node ms = Get(vc, {"match_typed_subject_alt_names"});
    if (!ms.IsDefined() || !ms.IsSequence()) continue;
    for (const YAML::Node& m : ms) {
      out.emplace_back(Str(Get(m, {"san_type"})), Str(Get(m, {"matcher", "exact"})));
    }
  }
  return out;
}

Problems CheckEnvoyTls(const EnvoyTlsInputs& in, int listener_port, const std::string& cluster_name) {
  Problems p;
  // Downstream: every filter chain of the callers' listener is TLS.
  const YAML::Node listener = ListenerOnPort(in.envoy, listener_port);
  const YAML::Node chains = Get(listener, {"filter_chains"});
  if (!chains.IsDefined() || !chains.IsSequence() || chains.size() == 0) {
    p.push_back("no Envoy listener with filter chains on port " + std::to_string(listener_port));
  } else {
    for (const YAML::Node& chain : chains) {
      const YAML::Node ctx = TlsContext(chain, "DownstreamTlsContext");
      if (!ctx.IsDefined()) {
        p.push_back("a filter chain of listener :" + std::to_string(listener_port) +
                    " has no downstream TLS transport socket (callers' traffic in plaintext)");
        continue;
      }
      CheckTlsCertificates(in, Get(ctx, {"common_tls_context"}), "downstream TLS", &p);
      if (!Contains(Get(ctx, {"common_tls_context", "alpn_protocols"}), "h2")) {
        p.push_back("downstream TLS does not offer ALPN h2 (gRPC clients refuse a TLS server without it)");
      }
    }
  }
  // Upstream: mutual TLS to the pods, the pods verified.
  const YAML::Node cluster = FindBy(Get(in.envoy, {"static_resources", "clusters"}), "name", cluster_name);
  const YAML::Node up = TlsContext(cluster, "UpstreamTlsContext");
  if (!up.IsDefined()) {
    p.push_back("cluster " + cluster_name + " has no upstream TLS transport socket (the pods require TLS)");
  } else {
    const YAML::Node common = Get(up, {"common_tls_context"});
    CheckTlsCertificates(in, common, "upstream client certificate", &p);
    if (!Contains(Get(common, {"alpn_protocols"}), "h2")) {
      p.push_back("upstream TLS does not offer ALPN h2 (the gRPC server refuses a TLS client without it)");
    }
    // The trusted CA: file-based SDS (it rotates too).
    YAML::Node sds = Get(common, {"combined_validation_context", "validation_context_sds_secret_config"});
    if (!sds.IsDefined()) sds.reset(Get(common, {"validation_context_sds_secret_config"}));
    if (Get(common, {"validation_context", "trusted_ca"}).IsDefined() ||
        Get(common, {"combined_validation_context", "default_validation_context", "trusted_ca"}).IsDefined()) {
      p.push_back("upstream validation context: an inline trusted_ca is read once, never reloaded (use SDS)");
    }
    if (!sds.IsDefined()) {
      p.push_back("cluster " + cluster_name + " has no validation context for the pods' certificate");
    } else {
      const YAML::Node r = SdsResource(in, sds, "upstream validation context", &p);
      const YAML::Node vc = Get(r, {"validation_context"});
      if (r.IsDefined() && !Get(vc, {"trusted_ca", "filename"}).IsDefined()) {
        p.push_back("upstream validation context has no trusted_ca file (the pods would not be verified)");
      } else if (r.IsDefined()) {
        CheckEnvoySecretFile(in, "upstream trusted_ca", Str(Get(vc, {"trusted_ca", "filename"})), "ca.crt",
                             Get(vc, {"watched_directory"}), &p);
      }
    }
    if (UpstreamSanMatchers(in, cluster_name).empty()) {
      p.push_back("upstream validation context has no match_typed_subject_alt_names (any certificate of the CA "
                  "would pass as a pod)");
    }
  }
  FindAuthorizationEdits(in.envoy, "", &p);
  return p;
}

// ---------------------------------------------------------------------------
// Certificates (cert-manager).

// The Secret holding the certificate chain of the first SDS certificate of
// a CommonTlsContext, "" if it cannot be resolved (CheckEnvoyTls reports).
std::string EnvoyCertificateSecret(const EnvoyTlsInputs& in, const YAML::Node& common) {
  const YAML::Node sds = Get(common, {"tls_certificate_sds_secret_configs"});
  if (!sds.IsDefined() || !sds.IsSequence() || sds.size() == 0) return "";
  Problems ignored;
  const YAML::Node r = SdsResource(in, sds[0], "", &ignored);
  const std::string file = Str(Get(r, {"tls_certificate", "certificate_chain", "filename"}));
  const YAML::Node pod = Get(in.deployment, {"spec", "template", "spec"});
  const auto m = MountOf(pod, FindBy(Get(pod, {"containers"}), "name", "envoy"), file);
  return m ? m->secret : "";
}

// Every mounted TLS Secret is issued by a Certificate of the kustomization;
// the pods' and Envoy's client certificates share one CA issuer (each side
// verifies the other with its ca.crt); the pods' certificate has the SANs
// the probes dial and Envoy checks, and the usages each side needs.
Problems CheckCertificates(const std::map<std::string, YAML::Node>& objects, const YAML::Node& server,
                           const EnvoyTlsInputs& envoy, int listener_port, const std::string& cluster_name) {
  Problems p;
  std::map<std::string, YAML::Node> by_secret;  // secretName -> Certificate
  for (const auto& [key, obj] : objects) {
    if (key.rfind("Certificate/", 0) == 0) by_secret[Str(Get(obj, {"spec", "secretName"}))].reset(obj);
  }
  const auto issuer = [&](const YAML::Node& cert) {
    const std::string kind = Str(Get(cert, {"spec", "issuerRef", "kind"}), "Issuer");
    return kind + "/" + Str(Get(cert, {"spec", "issuerRef", "name"}));
  };
  // Every certificate's issuer exists (a ClusterIssuer is cluster-wide: not
  // checked), and CA issuers sign with an isCA certificate's Secret.
  for (const auto& [secret, cert] : by_secret) {
    const std::string ref = issuer(cert);
    if (ref.rfind("Issuer/", 0) != 0) continue;
    const auto it = objects.find(ref);
    if (it == objects.end()) {
      p.push_back("Certificate " + Str(Get(cert, {"metadata", "name"})) + ": issuer " + ref + " is not in the manifests");
      continue;
    }
    const std::string ca_secret = Str(Get(it->second, {"spec", "ca", "secretName"}));
    if (!ca_secret.empty()) {
      const auto ca = by_secret.find(ca_secret);
      if (ca == by_secret.end() || !IsTrue(Get(ca->second, {"spec", "isCA"}))) {
        p.push_back(ref + " signs with Secret " + ca_secret + ", which no isCA Certificate issues");
      }
    }
  }
  // Every Secret mounted by the two Deployments, but the tokens, is issued.
  for (const YAML::Node& d : {server, envoy.deployment}) {
    const YAML::Node vols = Get(d, {"spec", "template", "spec", "volumes"});
    if (!vols.IsDefined() || !vols.IsSequence()) continue;
    for (const YAML::Node& v : vols) {
      const std::string secret = Str(Get(v, {"secret", "secretName"}));
      if (secret.empty() || secret == kTokensSecret) continue;
      if (by_secret.count(secret) == 0) {
        p.push_back("Secret " + secret + " (mounted by Deployment " + Str(Get(d, {"metadata", "name"})) +
                    ") is issued by no Certificate");
      }
    }
  }
  // The pods' certificate.
  const YAML::Node c = MainContainer(server);
  const YAML::Node pod = Get(server, {"spec", "template", "spec"});
  const auto flags = Flags(c);
  const auto cert_mount = flags.count("tls_cert_file") ? MountOf(pod, c, flags.at("tls_cert_file")) : std::nullopt;
  const auto server_cert = cert_mount ? by_secret.find(cert_mount->secret) : by_secret.end();
  const YAML::Node up_common =
      Get(TlsContext(FindBy(Get(envoy.envoy, {"static_resources", "clusters"}), "name", cluster_name),
                     "UpstreamTlsContext"),
          {"common_tls_context"});
  const std::string envoy_client_secret = EnvoyCertificateSecret(envoy, up_common);
  const auto envoy_client = by_secret.find(envoy_client_secret);
  if (server_cert == by_secret.end()) {
    p.push_back("the pods' certificate (--tls_cert_file) is issued by no Certificate");
  } else {
    const YAML::Node spec = Get(server_cert->second, {"spec"});
    const YAML::Node usages = Get(spec, {"usages"});
    if (usages.IsDefined() && !Contains(usages, "server auth")) {
      p.push_back("the pods' Certificate lacks usage \"server auth\"");
    }
    // The probes dial loopback with this certificate as their client cert.
    for (const char* kind : {"startupProbe", "livenessProbe", "readinessProbe"}) {
      const YAML::Node cmd = Get(c, {kind, "exec", "command"});
      if (!cmd.IsDefined()) continue;
      const auto pf = CommandFlags(cmd, 2);
      const std::string target = pf.count("target") ? pf.at("target") : "127.0.0.1:50051";
      const std::string host = target.substr(0, target.rfind(':'));
      const bool ip = !host.empty() && std::isdigit(static_cast<unsigned char>(host[0]));
      if (!Contains(Get(spec, {ip ? "ipAddresses" : "dnsNames"}), host)) {
        p.push_back(std::string(kind) + " dials " + host + ", which is no SAN of the pods' Certificate");
      }
      if (pf.count("tls_cert_file") && usages.IsDefined() && !Contains(usages, "client auth")) {
        p.push_back(std::string(kind) + " presents the pods' certificate as a client certificate: it needs "
                    "usage \"client auth\"");
      }
    }
    // Envoy accepts it: one of its SAN matchers is a SAN of the certificate.
    bool accepted = false;
    for (const auto& [type, value] : UpstreamSanMatchers(envoy, cluster_name)) {
      accepted |= (type == "URI" && Contains(Get(spec, {"uris"}), value)) ||
                  (type == "DNS" && Contains(Get(spec, {"dnsNames"}), value)) ||
                  (type == "IP_ADDRESS" && Contains(Get(spec, {"ipAddresses"}), value));
    }
    if (!accepted) p.push_back("no SAN of the pods' Certificate matches Envoy's upstream SAN matchers");
    if (envoy_client != by_secret.end() && issuer(envoy_client->second) != issuer(server_cert->second)) {
      p.push_back("the pods' certificate and Envoy's client certificate have different issuers: each side "
                  "verifies the other with its own ca.crt, so they must share the internal CA");
    }
  }
  if (envoy_client == by_secret.end()) {
    p.push_back("Envoy's upstream client certificate is issued by no Certificate");
  } else {
    const YAML::Node usages = Get(envoy_client->second, {"spec", "usages"});
    if (usages.IsDefined() && !Contains(usages, "client auth")) {
      p.push_back("Envoy's client Certificate lacks usage \"client auth\"");
    }
  }
  std::string down_secret;
  const YAML::Node chains = Get(ListenerOnPort(envoy.envoy, listener_port), {"filter_chains"});
  if (chains.IsDefined() && chains.IsSequence() && chains.size() > 0) {
    down_secret = EnvoyCertificateSecret(envoy, Get(TlsContext(chains[0], "DownstreamTlsContext"),
                                                    {"common_tls_context"}));
  }
  const auto down = by_secret.find(down_secret);
  if (down == by_secret.end()) {
    p.push_back("Envoy's serving certificate is issued by no Certificate");
  } else if (Get(down->second, {"spec", "usages"}).IsDefined() &&
             !Contains(Get(down->second, {"spec", "usages"}), "server auth")) {
    p.push_back("Envoy's serving Certificate lacks usage \"server auth\"");
  }
  return p;
}

// The example tokens Secret documents the layout and holds no token, and
// no Secret at all is applied from the repository (kubectl apply -k would
// overwrite the real tokens).
Problems CheckTokensExample(const fs::path& example, const std::map<std::string, YAML::Node>& objects) {
  Problems p;
  for (const auto& [key, obj] : objects) {
    if (key.rfind("Secret/", 0) == 0) p.push_back("kustomization applies " + key + ": secrets are never committed");
  }
  if (!fs::exists(example)) return {"missing " + example.string()};
  const YAML::Node s = YAML::LoadFile(example.string());
  if (Str(Get(s, {"kind"})) != "Secret" || Str(Get(s, {"metadata", "name"})) != kTokensSecret) {
    p.push_back(example.filename().string() + " is not Secret " + kTokensSecret);
  }
  const YAML::Node tokens = Get(s, {"stringData", "tokens"});
  if (!tokens.IsDefined()) p.push_back(example.filename().string() + " has no stringData key tokens");
  std::string text = Str(tokens);
  size_t start = 0;
  int line_no = 0;
  while (start <= text.size()) {
    const size_t nl = text.find('\n', start);
    std::string line = text.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
    ++line_no;
    const size_t first = line.find_first_not_of(" \t\r");
    if (first != std::string::npos && line[first] != '#') {
      p.push_back(example.filename().string() + " line " + std::to_string(line_no) +
                  " of tokens is not a comment: the example must hold no token");
    }
    if (nl == std::string::npos) break;
    start = nl + 1;
  }
  return p;
}

// The Envoy Deployment mounts the generated ConfigMap and exposes the
// listener port through its Service.
Problems CheckEnvoyWiring(const YAML::Node& envoy_deployment, const YAML::Node& envoy_service,
                          const std::string& configmap_name, int* listener_port) {
  Problems p;
  *listener_port = -1;
  if (!envoy_deployment.IsDefined()) return {"no Deployment ropeattn-envoy"};
  if (!envoy_service.IsDefined()) return {"no Service ropeattn-envoy"};
  const YAML::Node pod = Get(envoy_deployment, {"spec", "template", "spec"});
  bool mounted = false;
  const YAML::Node volumes = Get(pod, {"volumes"});
  if (volumes.IsDefined() && volumes.IsSequence()) {
    for (const YAML::Node& v : volumes) {
      mounted |= !configmap_name.empty() && Str(Get(v, {"configMap", "name"})) == configmap_name;
    }
  }
  if (!mounted) p.push_back("Envoy pods do not mount ConfigMap " + configmap_name);
  const YAML::Node c = FindBy(Get(pod, {"containers"}), "name", "envoy");
  const int grpc = ContainerPort(c, "grpc");
  if (grpc < 0) p.push_back("Envoy container has no port named grpc");
  if (!SelectorMatchesPods(Get(envoy_service, {"spec", "selector"}), envoy_deployment)) {
    p.push_back("Service ropeattn-envoy selector does not match the Envoy pods");
  }
  int svc_port = -1;
  const YAML::Node ports = Get(envoy_service, {"spec", "ports"});
  if (ports.IsDefined() && ports.IsSequence()) {
    for (const YAML::Node& sp : ports) {
      const std::string target = Str(Get(sp, {"targetPort"}));
      if (target == "grpc" || target == std::to_string(grpc)) {
        svc_port = static_cast<int>(Num(Get(sp, {"port"})).value_or(-1));
      }
    }
  }
  if (svc_port < 0) p.push_back("Service ropeattn-envoy has no port to Envoy's grpc port");
  const YAML::Node csc = Get(c, {"securityContext"});
  if (!IsTrue(Get(csc, {"readOnlyRootFilesystem"})) ||
      Str(Get(csc, {"allowPrivilegeEscalation"})) != "false") {
    p.push_back("Envoy container securityContext is not locked down");
  }
  *listener_port = grpc;
  return p;
}

// ---------------------------------------------------------------------------
// Kustomization.

Problems CheckKustomization(const std::vector<std::string>& listed, const fs::path& dir) {
  Problems p;
  const std::set<std::string> listed_set(listed.begin(), listed.end());
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const std::string name = entry.path().filename().string();
    const std::string ext = entry.path().extension().string();
    if (ext != ".yaml" && ext != ".yml") continue;
    if (name == "kustomization.yaml" || name == "kustomization.yml") continue;
    if (listed_set.count(name) == 0) p.push_back(name + " is not listed in kustomization.yaml");
  }
  for (const std::string& f : listed) {
    if (!fs::exists(dir / f)) p.push_back("kustomization.yaml lists missing file " + f);
  }
  return p;
}

// ---------------------------------------------------------------------------
// Tests on the real manifests.

// ---------------------------------------------------------------------------
// The image and the Deployment: Kubernetes runs the image's ENTRYPOINT with
// the container's `args` (a container `command` would replace the
// ENTRYPOINT). The Deployment gives only args, so the image must have an
// ENTRYPOINT that runs the server, and every arg (and every default in CMD)
// must be a flag.

struct ImageCommand {
  std::vector<std::string> entrypoint, cmd;  // exec form; empty when absent
};

// ENTRYPOINT / CMD of the Dockerfile's last stage (continuation lines
// joined, so HEALTHCHECK's own CMD is not taken for the image's).
ImageCommand ParseDockerfile(const std::string& text) {
  ImageCommand out;
  std::vector<std::string> lines;
  std::string cur;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\\') {
      cur += line.substr(0, line.size() - 1) + " ";
      continue;
    }
    lines.push_back(cur + line);
    cur.clear();
  }
  auto array = [](const std::string& rest) {
    std::vector<std::string> v;
    try {
      const YAML::Node n = YAML::Load(rest);  // a JSON array is YAML
      if (n.IsSequence()) {
        for (const YAML::Node& e : n) v.push_back(e.Scalar());
      }
    } catch (...) {
    }
    return v;
  };
  for (const std::string& l : lines) {
    const size_t start = l.find_first_not_of(" \t");
    if (start == std::string::npos) continue;
    const std::string t = l.substr(start);
    if (t.rfind("FROM ", 0) == 0) out = ImageCommand{};  // a new stage
    if (t.rfind("ENTRYPOINT ", 0) == 0) out.entrypoint = array(t.substr(11));
    if (t.rfind("CMD ", 0) == 0) out.cmd = array(t.substr(4));
  }
  return out;
}

Problems CheckImageCommand(const ImageCommand& image, const YAML::Node& deployment) {
  Problems p;
  const bool runs_server =
      !image.entrypoint.empty() && (image.entrypoint[0] == "ropeattn-server" ||
                                    image.entrypoint[0] == "/usr/local/bin/ropeattn-server");
  if (!runs_server) {
    p.push_back(
        "the image has no ENTRYPOINT running ropeattn-server: Kubernetes would run the "
        "Deployment's first arg as the program");
  }
  for (const std::string& c : image.cmd) {
    if (c.rfind("--", 0) != 0) {
      p.push_back("the image's CMD holds '" + c + "', not a flag of the ENTRYPOINT");
    }
  }
  for (const YAML::Node& c : Get(deployment, {"spec", "template", "spec", "containers"})) {
    if (Str(Get(c, {"name"})) != "ropeattn") continue;
    if (Get(c, {"command"}).IsDefined()) {
      p.push_back("the ropeattn container sets command, replacing the image's ENTRYPOINT");
    }
    for (const YAML::Node& a : Get(c, {"args"})) {
      if (Str(a).rfind("--", 0) != 0) {
        p.push_back("the ropeattn container's arg '" + Str(a) + "' is not a server flag");
      }
    }
  }
  return p;
}

std::string ReadWholeFile(const fs::path& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

ImageCommand RealImageCommand() {
  return ParseDockerfile(
      ReadWholeFile(fs::path(ROPEATTN_DEPLOY_K8S_DIR).parent_path().parent_path() / "Dockerfile"));
}

// ---------------------------------------------------------------------------
// Monitoring (deploy/k8s/monitoring): the ServiceMonitor scrapes the metrics
// Service, and every custom metric the HPA scales on is made by an adapter
// rule from gauges the server exports.

struct Monitoring {
  std::vector<std::string> listed_files;
  std::map<std::string, YAML::Node> objects;  // "Kind/name"
};

const Monitoring& LoadMonitoring() {
  static const Monitoring* const m = [] {
    auto* out = new Monitoring;
    const fs::path dir = fs::path(ROPEATTN_DEPLOY_K8S_DIR) / "monitoring";
    const YAML::Node k = YAML::LoadFile((dir / "kustomization.yaml").string());
    out->listed_files = ListedFiles(k);
    for (const std::string& f : out->listed_files) {
      if (!fs::exists(dir / f)) continue;
      for (const YAML::Node& doc : YAML::LoadAllFromFile((dir / f).string())) {
        if (!doc.IsDefined() || doc.IsNull()) continue;
        out->objects.emplace(Str(Get(doc, {"kind"})) + "/" + Str(Get(doc, {"metadata", "name"})), doc);
      }
    }
    return out;
  }();
  return *m;
}

// Metric names (ropeattn_...) in a PromQL text.
std::set<std::string> MetricNamesIn(const std::string& text) {
  std::set<std::string> out;
  for (size_t i = text.find("ropeattn_"); i != std::string::npos; i = text.find("ropeattn_", i)) {
    size_t j = i;
    while (j < text.size() && (std::isalnum(static_cast<unsigned char>(text[j])) || text[j] == '_')) ++j;
    out.insert(text.substr(i, j - i));
    i = j;
  }
  return out;
}

// `server_metrics` is the text of server/metrics.cc: a metric the rules
// read must be one the server writes.
Problems CheckMonitoring(const YAML::Node& service_monitor, const YAML::Node& adapter_config,
                         const YAML::Node& metrics_service, const YAML::Node& hpa,
                         const YAML::Node& deployment, const std::string& server_metrics) {
  Problems p;
  if (!service_monitor.IsDefined()) {
    p.push_back("no ServiceMonitor ropeattn");
  } else {
    const YAML::Node want = Get(service_monitor, {"spec", "selector", "matchLabels"});
    const YAML::Node labels = Get(metrics_service, {"metadata", "labels"});
    bool selects = want.IsDefined() && want.IsMap() && want.size() > 0;
    if (selects) {
      for (const auto& kv : want) {
        selects &= Str(Get(labels, {kv.first.Scalar()})) == kv.second.Scalar();
      }
    }
    if (!selects) p.push_back("the ServiceMonitor's selector does not select Service ropeattn-metrics");
    std::set<std::string> ports;
    for (const YAML::Node& port : Get(metrics_service, {"spec", "ports"})) ports.insert(Str(Get(port, {"name"})));
    for (const YAML::Node& e : Get(service_monitor, {"spec", "endpoints"})) {
      if (ports.count(Str(Get(e, {"port"}))) == 0) {
        p.push_back("the ServiceMonitor scrapes port '" + Str(Get(e, {"port"})) +
                    "', which Service ropeattn-metrics does not have");
      }
    }
  }
  // Custom metrics the adapter serves, and the server metrics they read.
  std::set<std::string> served;
  YAML::Node rules;
  try {
    rules = YAML::Load(Str(Get(adapter_config, {"data", "config.yaml"})))["rules"];
  } catch (...) {
  }
  for (const YAML::Node& r : rules) {
    served.insert(Str(Get(r, {"name", "as"})));
    for (const std::string& m :
         MetricNamesIn(Str(Get(r, {"seriesQuery"})) + " " + Str(Get(r, {"metricsQuery"})))) {
      if (server_metrics.find("\"" + m + "\"") == std::string::npos) {
        p.push_back("the adapter rule for " + Str(Get(r, {"name", "as"})) + " reads " + m +
                    ", which the server does not export");
      }
    }
  }
  const auto flags = Flags(MainContainer(deployment));
  const double capacity =
      FlagDouble(flags, "compute_workers", 1) + FlagDouble(flags, "queue_depth", 64);
  bool custom = false;
  for (const YAML::Node& m : Get(hpa, {"spec", "metrics"})) {
    if (Str(Get(m, {"type"})) != "Pods") continue;
    custom = true;
    const std::string name = Str(Get(m, {"pods", "metric", "name"}));
    if (served.count(name) == 0) {
      p.push_back("the HPA scales on " + name + ", which no adapter rule serves");
    }
    const auto target = Quantity(Get(m, {"pods", "target", "averageValue"}));
    if (!target || *target <= 0 || *target > capacity) {
      p.push_back("the HPA's " + name + " target must be in (0, compute_workers + queue_depth]");
    }
  }
  if (!custom) p.push_back("the HPA scales on no metric the server exports (only CPU)");
  return p;
}

std::string ServerMetricsSource() {
  return ReadWholeFile(fs::path(ROPEATTN_DEPLOY_K8S_DIR).parent_path().parent_path() / "server" /
                       "metrics.cc");
}

MATCHER_P(HasProblemContaining, text, "") {
  for (const std::string& s : arg) {
    if (s.find(text) != std::string::npos) return true;
  }
  *result_listener << "problems: ";
  for (const std::string& s : arg) *result_listener << "[" << s << "] ";
  return false;
}

int EnvoyListenerPort() {
  int port = -1;
  CheckEnvoyWiring(Object("Deployment/ropeattn-envoy"), Object("Service/ropeattn-envoy"),
                   Load().envoy_configmap_name, &port);
  return port;
}

TEST(Manifests, KustomizationListsEveryManifest) {
  EXPECT_THAT(CheckKustomization(Load().listed_files, ROPEATTN_DEPLOY_K8S_DIR), IsEmpty());
}

TEST(Manifests, ServerDeployment) { EXPECT_THAT(CheckServerDeployment(ServerDeployment()), IsEmpty()); }

TEST(Manifests, MonitoringAndLoadMetricScaling) {
  const Monitoring& m = LoadMonitoring();
  EXPECT_THAT(CheckKustomization(m.listed_files, fs::path(ROPEATTN_DEPLOY_K8S_DIR) / "monitoring"),
              IsEmpty());
  const auto get = [&](const std::string& key) {
    const auto it = m.objects.find(key);
    return it == m.objects.end() ? YAML::Node(YAML::NodeType::Undefined) : it->second;
  };
  EXPECT_THAT(CheckMonitoring(get("ServiceMonitor/ropeattn"), get("ConfigMap/adapter-config"),
                              Object("Service/ropeattn-metrics"), Object("HorizontalPodAutoscaler/ropeattn"),
                              ServerDeployment(), ServerMetricsSource()),
              IsEmpty());
}

TEST(Manifests, TheImageRunsAsTheDeploymentStartsIt) {
  const ImageCommand image = RealImageCommand();
  EXPECT_THAT(image.entrypoint, ::testing::ElementsAre("ropeattn-server"));
  EXPECT_FALSE(image.cmd.empty());
  EXPECT_THAT(CheckImageCommand(image, ServerDeployment()), IsEmpty());
}

TEST(Manifests, Services) { EXPECT_THAT(CheckServices(ObjectsOfKind("Service"), ServerDeployment()), IsEmpty()); }

TEST(Manifests, NetworkPolicy) {
  EXPECT_THAT(CheckNetworkPolicies(ObjectsOfKind("NetworkPolicy"), ServerDeployment(), EnvoyDeployment()),
              IsEmpty());
}

TEST(Manifests, EnvoyTls) { EXPECT_THAT(CheckEnvoyTls(RealEnvoyTlsInputs(), 50051, "ropeattn"), IsEmpty()); }

TEST(Manifests, Certificates) {
  EXPECT_THAT(CheckCertificates(Load().objects, ServerDeployment(), RealEnvoyTlsInputs(), 50051, "ropeattn"),
              IsEmpty());
}

TEST(Manifests, TokensSecretIsAnExampleOnly) {
  EXPECT_THAT(CheckTokensExample(fs::path(ROPEATTN_DEPLOY_K8S_DIR) / "examples" / "ropeattn-auth-tokens.example.yaml",
                                 Load().objects),
              IsEmpty());
}

TEST(Manifests, HpaAndPdb) {
  EXPECT_THAT(CheckHpaAndPdb(Object("HorizontalPodAutoscaler/ropeattn"),
                             Object("PodDisruptionBudget/ropeattn"), ServerDeployment()),
              IsEmpty());
}

TEST(Manifests, EnvoyWiring) {
  int port = -1;
  EXPECT_THAT(CheckEnvoyWiring(Object("Deployment/ropeattn-envoy"), Object("Service/ropeattn-envoy"),
                               Load().envoy_configmap_name, &port),
              IsEmpty());
  EXPECT_EQ(port, 50051);
}

TEST(Manifests, EnvoyConfig) {
  EXPECT_THAT(CheckEnvoy(EnvoyConfig(), HeadlessService(), EnvoyListenerPort()), IsEmpty());
}

// ---------------------------------------------------------------------------
// The checks catch broken manifests (each mutation breaks one property).

YAML::Node MainContainerOf(YAML::Node& deployment) {
  YAML::Node containers = deployment["spec"]["template"]["spec"]["containers"];
  for (YAML::Node c : containers) {
    if (c["name"].as<std::string>() == "ropeattn") return c;
  }
  ADD_FAILURE() << "no ropeattn container";
  return YAML::Node();
}

void ReplaceArg(YAML::Node container, const std::string& flag, const std::string& value) {
  YAML::Node args = container["args"];
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].as<std::string>().rfind("--" + flag + "=", 0) == 0) {
      args[i] = "--" + flag + "=" + value;
      return;
    }
  }
  args.push_back("--" + flag + "=" + value);
}

void RemoveKey(YAML::Node map, const std::string& key) { map.remove(key); }

Problems MutateServer(const std::function<void(YAML::Node& deployment, YAML::Node container)>& f) {
  YAML::Node d = ServerDeployment();
  f(d, MainContainerOf(d));
  return CheckServerDeployment(d);
}

// The index of `--flag=` / `--flag` in an exec probe's command, or -1.
int ProbeArg(YAML::Node c, const std::string& probe, const std::string& flag) {
  YAML::Node cmd = c[probe]["exec"]["command"];
  for (size_t i = 0; i < cmd.size(); ++i) {
    const std::string a = cmd[i].as<std::string>();
    if (a == "--" + flag || a.rfind("--" + flag + "=", 0) == 0) return static_cast<int>(i);
  }
  return -1;
}

void SetProbeArg(YAML::Node c, const std::string& probe, const std::string& flag, const std::string& value) {
  YAML::Node cmd = c[probe]["exec"]["command"];
  const int i = ProbeArg(c, probe, flag);
  if (i >= 0) {
    cmd[i] = "--" + flag + "=" + value;
  } else {
    cmd.push_back("--" + flag + "=" + value);
  }
}

void RemoveProbeArg(YAML::Node c, const std::string& probe, const std::string& flag) {
  YAML::Node cmd = c[probe]["exec"]["command"];
  YAML::Node kept(YAML::NodeType::Sequence);
  for (size_t i = 0; i < cmd.size(); ++i) {
    const std::string a = cmd[i].as<std::string>();
    if (a == "--" + flag || a.rfind("--" + flag + "=", 0) == 0) continue;
    kept.push_back(a);
  }
  c[probe]["exec"]["command"] = kept;
}

TEST(ChecksCatch, AnImageAndADeploymentThatDisagree) {
  // The image as it was: the server named in CMD, no ENTRYPOINT, and the
  // HEALTHCHECK's CMD on a continuation line.
  const ImageCommand old = ParseDockerfile(
      "FROM debian AS build\nENTRYPOINT [\"sh\"]\nFROM debian\n"
      "HEALTHCHECK --interval=30s \\\n    CMD [\"ropeattn\", \"health\"]\n"
      "CMD [\"ropeattn-server\", \"--address=0.0.0.0:50051\"]\n");
  EXPECT_TRUE(old.entrypoint.empty());
  EXPECT_THAT(old.cmd, ::testing::ElementsAre("ropeattn-server", "--address=0.0.0.0:50051"));
  EXPECT_THAT(CheckImageCommand(old, ServerDeployment()), HasProblemContaining("no ENTRYPOINT"));
  EXPECT_THAT(CheckImageCommand(old, ServerDeployment()), HasProblemContaining("CMD holds"));
  YAML::Node d = ServerDeployment();
  YAML::Node c = MainContainerOf(d);
  c["command"].push_back("/bin/sh");
  EXPECT_THAT(CheckImageCommand(RealImageCommand(), d), HasProblemContaining("sets command"));
}

TEST(ChecksCatch, MonitoringThatDoesNotConnect) {
  const Monitoring& m = LoadMonitoring();
  YAML::Node sm = YAML::Clone(m.objects.at("ServiceMonitor/ropeattn"));
  YAML::Node adapter = YAML::Clone(m.objects.at("ConfigMap/adapter-config"));
  const YAML::Node svc = Object("Service/ropeattn-metrics");
  YAML::Node hpa = Object("HorizontalPodAutoscaler/ropeattn");
  const std::string src = ServerMetricsSource();
  YAML::Node bad_sm = YAML::Clone(sm);
  bad_sm["spec"]["endpoints"][0]["port"] = "grpc";
  bad_sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "proxy";
  EXPECT_THAT(CheckMonitoring(bad_sm, adapter, svc, hpa, ServerDeployment(), src),
              HasProblemContaining("does not select"));
  EXPECT_THAT(CheckMonitoring(bad_sm, adapter, svc, hpa, ServerDeployment(), src),
              HasProblemContaining("port 'grpc'"));
  // A rule reading a metric the server does not write.
  std::string cfg = adapter["data"]["config.yaml"].as<std::string>();
  const size_t at = cfg.find("ropeattn_queue_depth");
  ASSERT_NE(at, std::string::npos);
  cfg.replace(at, std::string("ropeattn_queue_depth").size(), "ropeattn_queue_length");
  YAML::Node bad_adapter = YAML::Clone(adapter);
  bad_adapter["data"]["config.yaml"] = cfg;
  EXPECT_THAT(CheckMonitoring(sm, bad_adapter, svc, hpa, ServerDeployment(), src),
              HasProblemContaining("ropeattn_queue_length, which the server does not export"));
  // An HPA metric no rule serves, then none at all.
  YAML::Node renamed = YAML::Clone(hpa);
  for (YAML::Node metric : renamed["spec"]["metrics"]) {
    if (metric["type"].as<std::string>() == "Pods") metric["pods"]["metric"]["name"] = "ropeattn_busy";
  }
  EXPECT_THAT(CheckMonitoring(sm, adapter, svc, renamed, ServerDeployment(), src),
              HasProblemContaining("no adapter rule serves"));
  YAML::Node cpu_only = YAML::Clone(hpa);
  YAML::Node kept(YAML::NodeType::Sequence);
  for (const YAML::Node& metric : cpu_only["spec"]["metrics"]) {
    if (metric["type"].as<std::string>() != "Pods") kept.push_back(metric);
  }
  cpu_only["spec"]["metrics"] = kept;
  EXPECT_THAT(CheckMonitoring(sm, adapter, svc, cpu_only, ServerDeployment(), src),
              HasProblemContaining("only CPU"));
}

TEST(ChecksCatch, MissingOrWrongProbes) {
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { RemoveKey(c, "readinessProbe"); }),
              HasProblemContaining("readinessProbe missing"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { RemoveKey(c, "startupProbe"); }),
              HasProblemContaining("startupProbe missing"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { RemoveProbeArg(c, "readinessProbe", "service"); }),
              HasProblemContaining("readinessProbe service"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { SetProbeArg(c, "livenessProbe", "service", kServiceName); }),
              HasProblemContaining("livenessProbe service"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                SetProbeArg(c, "livenessProbe", "target", "127.0.0.1:9464");
              }),
              HasProblemContaining("livenessProbe port"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                SetProbeArg(c, "livenessProbe", "target", "ropeattn-headless:50051");
              }),
              HasProblemContaining("is not this pod's loopback"));
  // The "--flag value" spelling is understood too.
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                RemoveProbeArg(c, "livenessProbe", "target");
                c["livenessProbe"]["exec"]["command"].push_back("--target");
                c["livenessProbe"]["exec"]["command"].push_back("127.0.0.1:50052");
              }),
              HasProblemContaining("livenessProbe port"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                RemoveKey(c["readinessProbe"], "exec");
                c["readinessProbe"]["tcpSocket"]["port"] = 50051;
              }),
              HasProblemContaining("readinessProbe is not a gRPC health probe"));
  // With TLS on, the kubelet's plaintext grpc: probe cannot work.
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                RemoveKey(c["readinessProbe"], "exec");
                c["readinessProbe"]["grpc"]["port"] = 50051;
                c["readinessProbe"]["grpc"]["service"] = kServiceName;
              }),
              HasProblemContaining("readinessProbe is a grpc: probe, which cannot speak TLS"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { RemoveProbeArg(c, "livenessProbe", "tls_ca_file"); }),
              HasProblemContaining("livenessProbe does not verify the server's certificate"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { RemoveProbeArg(c, "startupProbe", "tls_key_file"); }),
              HasProblemContaining("startupProbe presents no client certificate"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                SetProbeArg(c, "readinessProbe", "tls_ca_file", "/etc/ssl/certs/ca-certificates.crt");
              }),
              HasProblemContaining("readinessProbe --tls_ca_file /etc/ssl/certs/ca-certificates.crt is not under"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { SetProbeArg(c, "readinessProbe", "token", "x"); }),
              HasProblemContaining("passes --token"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { RemoveProbeArg(c, "livenessProbe", "deadline_seconds"); }),
              HasProblemContaining("livenessProbe --deadline_seconds 30 must be > 0 and below timeoutSeconds"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { c["readinessProbe"]["timeoutSeconds"] = 2; }),
              HasProblemContaining("below timeoutSeconds"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { c["livenessProbe"]["failureThreshold"] = 1; }),
              HasProblemContaining("livenessProbe gives up"));
  // Without TLS (flags and mounts gone), a grpc: probe is fine again.
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                for (const char* flag : {"tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_tokens_file"}) {
                  YAML::Node kept(YAML::NodeType::Sequence);
                  for (YAML::Node a : c["args"]) {
                    if (a.as<std::string>().rfind(std::string("--") + flag + "=", 0) != 0) kept.push_back(a);
                  }
                  c["args"] = kept;
                }
                RemoveKey(c["readinessProbe"], "exec");
                c["readinessProbe"]["grpc"]["port"] = 50051;
                c["readinessProbe"]["grpc"]["service"] = kServiceName;
              }),
              ::testing::Not(HasProblemContaining("readinessProbe")));
}

TEST(ChecksCatch, TlsAndTokenFlagsAndMounts) {
  for (const char* flag : {"tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_tokens_file"}) {
    EXPECT_THAT(MutateServer([&](YAML::Node&, YAML::Node c) {
                  YAML::Node kept(YAML::NodeType::Sequence);
                  for (YAML::Node a : c["args"]) {
                    if (a.as<std::string>().rfind(std::string("--") + flag + "=", 0) != 0) kept.push_back(a);
                  }
                  c["args"] = kept;
                }),
                HasProblemContaining(std::string("args lack --") + flag))
        << flag;
  }
  // A path no volume holds, or the wrong key of the Secret.
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { ReplaceArg(c, "tls_cert_file", "/etc/tls/tls.crt"); }),
              HasProblemContaining("--tls_cert_file /etc/tls/tls.crt is not under any volumeMount"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                ReplaceArg(c, "tls_client_ca_file", "/etc/ropeattn/tls/tls.crt");
              }),
              HasProblemContaining("is key tls.crt of Secret ropeattn-server-tls, want ca.crt"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { ReplaceArg(c, "auth_tokens_file", "/etc/ropeattn/auth/t"); }),
              HasProblemContaining("is no key of the volume mounted at /etc/ropeattn/auth"));
  // Mounted from a ConfigMap, or with subPath (never updated).
  EXPECT_THAT(MutateServer([](YAML::Node& d, YAML::Node) {
                for (YAML::Node v : d["spec"]["template"]["spec"]["volumes"]) {
                  if (v["name"].as<std::string>() == "auth-tokens") {
                    v.remove("secret");
                    v["configMap"]["name"] = "tokens";
                  }
                }
              }),
              HasProblemContaining("--auth_tokens_file /etc/ropeattn/auth/tokens is not in a mounted Secret"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                for (YAML::Node m : c["volumeMounts"]) {
                  if (m["name"].as<std::string>() == "server-tls") {
                    m["mountPath"] = "/etc/ropeattn/tls/tls.key";
                    m["subPath"] = "tls.key";
                  }
                }
                ReplaceArg(c, "tls_key_file", "/etc/ropeattn/tls/tls.key");
              }),
              HasProblemContaining("subPath"));
  EXPECT_THAT(MutateServer([](YAML::Node& d, YAML::Node) {
                for (YAML::Node v : d["spec"]["template"]["spec"]["volumes"]) {
                  if (v["name"].as<std::string>() == "auth-tokens") v["secret"]["secretName"] = "other";
                }
              }),
              HasProblemContaining("--auth_tokens_file is in Secret other, want ropeattn-auth-tokens"));
}

TEST(ChecksCatch, ResourcesNotMatchingTheFlags) {
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { RemoveKey(c, "resources"); }),
              HasProblemContaining("resources need"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { ReplaceArg(c, "memory_budget_bytes", "8589934592"); }),
              HasProblemContaining("< --memory_budget_bytes"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { c["resources"]["limits"]["memory"] = "4200Mi"; }),
              HasProblemContaining("budget + overhead"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { ReplaceArg(c, "queue_depth", "64"); }),
              HasProblemContaining("budget + overhead"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { ReplaceArg(c, "compute_workers", "3"); }),
              HasProblemContaining("cpu request"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { c["resources"]["limits"]["cpu"] = "3500m"; }),
              HasProblemContaining("cpu limit"));
  // Equivalent spellings are accepted.
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                c["resources"]["limits"]["cpu"] = "4000m";
                c["resources"]["limits"]["memory"] = "6144Mi";
              }),
              IsEmpty());
}

TEST(ChecksCatch, DrainArithmetic) {
  EXPECT_THAT(MutateServer([](YAML::Node& d, YAML::Node) {
                d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 35;
              }),
              HasProblemContaining("terminationGracePeriodSeconds"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { ReplaceArg(c, "shutdown_grace_seconds", "40"); }),
              HasProblemContaining("must exceed preStop sleep"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { RemoveKey(c, "lifecycle"); }),
              HasProblemContaining("preStop sleep missing"));
  // The exec form counts too.
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                RemoveKey(c["lifecycle"]["preStop"], "sleep");
                YAML::Node cmd;
                cmd.push_back("/bin/sleep");
                cmd.push_back("30");
                c["lifecycle"]["preStop"]["exec"]["command"] = cmd;
              }),
              HasProblemContaining("must exceed preStop sleep"));
  // Without the flag the server's default grace (10 s) applies.
  const ropeattn::server::ServerOptions defaults;
  EXPECT_EQ(defaults.shutdown_grace_seconds, 10.0);
}

TEST(ChecksCatch, PodsNotSpreadAcrossNodes) {
  EXPECT_THAT(MutateServer([](YAML::Node& d, YAML::Node) {
                RemoveKey(d["spec"]["template"]["spec"], "topologySpreadConstraints");
              }),
              HasProblemContaining("topologySpreadConstraints"));
  EXPECT_THAT(MutateServer([](YAML::Node& d, YAML::Node) {
                d["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["labelSelector"]
                 ["matchLabels"]["app.kubernetes.io/name"] = "other";
              }),
              HasProblemContaining("topologySpreadConstraints"));
  EXPECT_THAT(MutateServer([](YAML::Node& d, YAML::Node) {
                d["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["topologyKey"] =
                    "topology.kubernetes.io/zone";
              }),
              HasProblemContaining("topologySpreadConstraints"));
}

TEST(ChecksCatch, SecurityContext) {
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                c["securityContext"]["readOnlyRootFilesystem"] = false;
              }),
              HasProblemContaining("readOnlyRootFilesystem"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                c["securityContext"]["allowPrivilegeEscalation"] = true;
              }),
              HasProblemContaining("allowPrivilegeEscalation"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                RemoveKey(c["securityContext"], "capabilities");
              }),
              HasProblemContaining("capabilities.drop"));
  EXPECT_THAT(MutateServer([](YAML::Node& d, YAML::Node c) {
                RemoveKey(c["securityContext"], "runAsUser");
                RemoveKey(d["spec"]["template"]["spec"]["securityContext"], "runAsUser");
              }),
              HasProblemContaining("runAsUser"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                c["securityContext"]["runAsNonRoot"] = false;
              }),
              HasProblemContaining("runAsNonRoot"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                c["securityContext"]["seccompProfile"]["type"] = "Unconfined";
              }),
              HasProblemContaining("seccompProfile"));
}

TEST(ChecksCatch, PortsDisagreeing) {
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { ReplaceArg(c, "address", "0.0.0.0:50052"); }),
              HasProblemContaining("container port grpc"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { c["ports"][1]["containerPort"] = 9000; }),
              HasProblemContaining("container port metrics"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { ReplaceArg(c, "address", "127.0.0.1:50051"); }),
              HasProblemContaining("0.0.0.0"));
}

std::vector<YAML::Node> WithService(std::vector<YAML::Node> services, const std::string& name,
                                    const std::function<void(YAML::Node svc)>& f) {
  for (YAML::Node& svc : services) {
    if (svc["metadata"]["name"].as<std::string>() == name) f(svc);
  }
  return services;
}

TEST(ChecksCatch, Services) {
  const auto deployment = ServerDeployment();
  EXPECT_THAT(CheckServices(WithService(ObjectsOfKind("Service"), "ropeattn-headless",
                                        [](YAML::Node svc) { RemoveKey(svc["spec"], "clusterIP"); }),
                            deployment),
              HasProblemContaining("clusterIP: None"));
  EXPECT_THAT(CheckServices(WithService(ObjectsOfKind("Service"), "ropeattn-headless",
                                        [](YAML::Node svc) {
                                          svc["spec"]["selector"]["app.kubernetes.io/component"] = "envoy";
                                        }),
                            deployment),
              HasProblemContaining("selector does not match"));
  // The old ClusterIP Service with its gRPC port, by name or by number.
  EXPECT_THAT(CheckServices(WithService(ObjectsOfKind("Service"), "ropeattn-metrics",
                                        [](YAML::Node svc) {
                                          YAML::Node port;
                                          port["name"] = "grpc";
                                          port["port"] = 50051;
                                          port["targetPort"] = "grpc";
                                          svc["spec"]["ports"].push_back(port);
                                        }),
                            deployment),
              HasProblemContaining("Service ropeattn-metrics sends callers straight to the pods' gRPC port"));
  EXPECT_THAT(CheckServices(WithService(ObjectsOfKind("Service"), "ropeattn-metrics",
                                        [](YAML::Node svc) {
                                          YAML::Node port;
                                          port["port"] = 443;
                                          port["targetPort"] = 50051;
                                          svc["spec"]["ports"].push_back(port);
                                        }),
                            deployment),
              HasProblemContaining("sends callers straight"));
  // A Service of Envoy's pods is none of this check's business.
  EXPECT_THAT(CheckServices(ObjectsOfKind("Service"), deployment), IsEmpty());
}

YAML::Node ServerPolicy(std::vector<YAML::Node>& policies) {
  for (YAML::Node& np : policies) {
    if (np["metadata"]["name"].as<std::string>() == "ropeattn-server") return np;
  }
  ADD_FAILURE() << "no NetworkPolicy ropeattn-server";
  return YAML::Node();
}

Problems MutatePolicies(const std::function<void(std::vector<YAML::Node>& policies)>& f) {
  std::vector<YAML::Node> policies = ObjectsOfKind("NetworkPolicy");
  f(policies);
  return CheckNetworkPolicies(policies, ServerDeployment(), EnvoyDeployment());
}

TEST(ChecksCatch, NetworkPolicy) {
  EXPECT_THAT(MutatePolicies([](std::vector<YAML::Node>& ps) { ps.clear(); }),
              HasProblemContaining("no NetworkPolicy selects the server pods"));
  EXPECT_THAT(MutatePolicies([](std::vector<YAML::Node>& ps) {
                ServerPolicy(ps)["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] = "envoy";
              }),
              HasProblemContaining("no NetworkPolicy selects the server pods"));
  // gRPC from anyone in the namespace, or from every pod of the app.
  EXPECT_THAT(MutatePolicies([](std::vector<YAML::Node>& ps) {
                ServerPolicy(ps)["spec"]["ingress"][0]["from"][0]["podSelector"] = YAML::Node(YAML::NodeType::Map);
              }),
              HasProblemContaining("admits port 50051 from a podSelector that is not the Envoy pods alone"));
  EXPECT_THAT(MutatePolicies([](std::vector<YAML::Node>& ps) {
                ServerPolicy(ps)["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"].remove(
                    "app.kubernetes.io/component");
              }),
              HasProblemContaining("admits port 50051 from a podSelector"));
  EXPECT_THAT(MutatePolicies([](std::vector<YAML::Node>& ps) {
                ServerPolicy(ps)["spec"]["ingress"][0].remove("from");
              }),
              HasProblemContaining("admits port 50051 from every source"));
  EXPECT_THAT(MutatePolicies([](std::vector<YAML::Node>& ps) {
                YAML::Node peer;
                peer["ipBlock"]["cidr"] = "0.0.0.0/0";
                ServerPolicy(ps)["spec"]["ingress"][0]["from"].push_back(peer);
              }),
              HasProblemContaining("admits port 50051 from an ipBlock"));
  // gRPC from the monitoring namespace; metrics from Envoy.
  EXPECT_THAT(MutatePolicies([](std::vector<YAML::Node>& ps) {
                ServerPolicy(ps)["spec"]["ingress"][1]["ports"][0]["port"] = 50051;
              }),
              HasProblemContaining("admits port 50051 from the monitoring namespace"));
  EXPECT_THAT(MutatePolicies([](std::vector<YAML::Node>& ps) {
                ServerPolicy(ps)["spec"]["ingress"][0]["ports"][0]["port"] = "metrics";
              }),
              HasProblemContaining("admits port 9464 from the Envoy pods"));
  EXPECT_THAT(MutatePolicies([](std::vector<YAML::Node>& ps) {
                ServerPolicy(ps)["spec"]["ingress"][1]["from"][0]["namespaceSelector"]["matchLabels"]
                                ["kubernetes.io/metadata.name"] = "default";
              }),
              HasProblemContaining("no NetworkPolicy admits port 9464 from the monitoring namespace"));
  // A rule without ports admits every port.
  EXPECT_THAT(MutatePolicies([](std::vector<YAML::Node>& ps) { ServerPolicy(ps)["spec"]["ingress"][0].remove("ports"); }),
              HasProblemContaining("admits ports other than 50051 and 9464"));
  EXPECT_THAT(MutatePolicies([](std::vector<YAML::Node>& ps) {
                ServerPolicy(ps)["spec"]["ingress"][0]["ports"][0]["port"] = 8080;
              }),
              HasProblemContaining("no NetworkPolicy admits port 50051 from the Envoy pods"));
  // A second policy that opens the gRPC port to everyone is caught too.
  EXPECT_THAT(MutatePolicies([](std::vector<YAML::Node>& ps) {
                YAML::Node extra = YAML::Clone(ServerPolicy(ps));
                extra["metadata"]["name"] = "allow-all";
                extra["spec"]["ingress"][0].remove("from");
                ps.push_back(extra);
              }),
              HasProblemContaining("NetworkPolicy allow-all admits port 50051 from every source"));
  // Named ports are resolved against the container's.
  EXPECT_THAT(MutatePolicies([](std::vector<YAML::Node>& ps) {
                ServerPolicy(ps)["spec"]["ingress"][0]["ports"][0]["port"] = "grpc";
                ServerPolicy(ps)["spec"]["ingress"][1]["ports"][0]["port"] = "metrics";
              }),
              IsEmpty());
}

TEST(ChecksCatch, HpaAndPdb) {
  YAML::Node hpa = Object("HorizontalPodAutoscaler/ropeattn");
  hpa["spec"]["metrics"][0]["resource"]["name"] = "memory";
  EXPECT_THAT(CheckHpaAndPdb(hpa, Object("PodDisruptionBudget/ropeattn"), ServerDeployment()),
              HasProblemContaining("CPU utilization"));
  YAML::Node pdb = Object("PodDisruptionBudget/ropeattn");
  RemoveKey(pdb["spec"], "maxUnavailable");
  EXPECT_THAT(CheckHpaAndPdb(Object("HorizontalPodAutoscaler/ropeattn"), pdb, ServerDeployment()),
              HasProblemContaining("PDB needs"));
}

YAML::Node EnvoyCluster(YAML::Node envoy) {
  for (YAML::Node c : envoy["static_resources"]["clusters"]) {
    if (c["name"].as<std::string>() == "ropeattn") return c;
  }
  ADD_FAILURE() << "no cluster ropeattn";
  return YAML::Node();
}

YAML::Node EnvoyHcm(YAML::Node envoy) {
  for (YAML::Node l : envoy["static_resources"]["listeners"]) {
    if (l["address"]["socket_address"]["port_value"].as<int>() == 50051) {
      return l["filter_chains"][0]["filters"][0]["typed_config"];
    }
  }
  ADD_FAILURE() << "no listener on 50051";
  return YAML::Node();
}

Problems MutateEnvoy(const std::function<void(YAML::Node envoy)>& f) {
  YAML::Node envoy = EnvoyConfig();
  f(envoy);
  return CheckEnvoy(envoy, HeadlessService(), 50051);
}

TEST(ChecksCatch, EnvoyRouting) {
  EXPECT_THAT(MutateEnvoy([](YAML::Node e) {
                EnvoyHcm(e)["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["hash_policy"][0]
                           ["header"]["header_name"] = "x-session";
              }),
              HasProblemContaining("no route with hash_policy"));
  EXPECT_THAT(MutateEnvoy([](YAML::Node e) { EnvoyCluster(e)["lb_policy"] = "ROUND_ROBIN"; }),
              HasProblemContaining("want RING_HASH or MAGLEV"));
  EXPECT_THAT(MutateEnvoy([](YAML::Node e) { EnvoyCluster(e)["lb_policy"] = "MAGLEV"; }), IsEmpty());
  EXPECT_THAT(MutateEnvoy([](YAML::Node e) {
                EnvoyCluster(e)["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
                               ["socket_address"]["address"] = "ropeattn";
              }),
              HasProblemContaining("does not point at ropeattn-headless"));
  EXPECT_THAT(MutateEnvoy([](YAML::Node e) {
                EnvoyCluster(e)["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
                               ["socket_address"]["port_value"] = 9464;
              }),
              HasProblemContaining("does not point at"));
  EXPECT_THAT(MutateEnvoy([](YAML::Node e) {
                EnvoyCluster(e)["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
                               ["socket_address"]["address"] = "ropeattn-headless.default.svc.cluster.local";
              }),
              IsEmpty());
  EXPECT_THAT(MutateEnvoy([](YAML::Node e) { EnvoyCluster(e)["type"] = "LOGICAL_DNS"; }),
              HasProblemContaining("STRICT_DNS"));
  EXPECT_THAT(MutateEnvoy([](YAML::Node e) {
                EnvoyCluster(e)["health_checks"][0]["grpc_health_check"]["service_name"] = "";
              }),
              HasProblemContaining("grpc_health_check"));
  EXPECT_THAT(MutateEnvoy([](YAML::Node e) {
                EnvoyHcm(e)["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["timeout"] = "15s";
              }),
              HasProblemContaining("timeout must be 0s"));
}

TEST(ChecksCatch, EnvoyHardening) {
  EXPECT_THAT(MutateEnvoy([](YAML::Node e) { RemoveKey(EnvoyHcm(e)["http2_protocol_options"], "max_concurrent_streams"); }),
              HasProblemContaining("max_concurrent_streams"));
  EXPECT_THAT(MutateEnvoy([](YAML::Node e) {
                EnvoyHcm(e)["common_http_protocol_options"]["headers_with_underscores_action"] = "ALLOW";
              }),
              HasProblemContaining("headers_with_underscores_action"));
  EXPECT_THAT(MutateEnvoy([](YAML::Node e) { RemoveKey(EnvoyHcm(e), "max_request_headers_kb"); }),
              HasProblemContaining("max_request_headers_kb"));
  EXPECT_THAT(MutateEnvoy([](YAML::Node e) { RemoveKey(e, "overload_manager"); }),
              HasProblemContaining("global_downstream_max_connections"));
  EXPECT_THAT(MutateEnvoy([](YAML::Node e) { EnvoyHcm(e)["stream_idle_timeout"] = "60s"; }),
              HasProblemContaining("stream_idle_timeout"));
  EXPECT_THAT(MutateEnvoy([](YAML::Node e) {
                EnvoyCluster(e)["typed_extension_protocol_options"]
                               ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
                               ["common_http_protocol_options"]["idle_timeout"] = "3600s";
              }),
              HasProblemContaining("upstream idle_timeout"));
  EXPECT_THAT(MutateEnvoy([](YAML::Node e) {
                EnvoyCluster(e)["typed_extension_protocol_options"]
                               ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
                               ["http2_protocol_options"]["connection_keepalive"]["interval"] = "10s";
              }),
              HasProblemContaining("keepalive"));
  EXPECT_THAT(MutateEnvoy([](YAML::Node e) { RemoveKey(EnvoyCluster(e), "typed_extension_protocol_options"); }),
              HasProblemContaining("http2_protocol_options"));
}

TEST(ChecksCatch, Kustomization) {
  std::vector<std::string> listed = Load().listed_files;
  const auto it = std::find(listed.begin(), listed.end(), "ropeattn-hpa.yaml");
  ASSERT_NE(it, listed.end());
  listed.erase(it);
  EXPECT_THAT(CheckKustomization(listed, ROPEATTN_DEPLOY_K8S_DIR),
              HasProblemContaining("ropeattn-hpa.yaml is not listed"));
  listed.push_back("gone.yaml");
  EXPECT_THAT(CheckKustomization(listed, ROPEATTN_DEPLOY_K8S_DIR), HasProblemContaining("missing file gone.yaml"));
  // A manifest dropped into the directory without listing it is caught too.
  const fs::path scratch = fs::temp_directory_path() / "ropeattn_manifest_test_k8s";
  fs::remove_all(scratch);
  fs::copy(ROPEATTN_DEPLOY_K8S_DIR, scratch);
  {
    std::FILE* f = std::fopen((scratch / "extra.yaml").c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: extra\n", f);
    std::fclose(f);
  }
  EXPECT_THAT(CheckKustomization(Load().listed_files, scratch),
              HasProblemContaining("extra.yaml is not listed"));
  fs::remove_all(scratch);
}

TEST(ChecksCatch, EnvoyWiring) {
  YAML::Node d = Object("Deployment/ropeattn-envoy");
  d["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] = "other";
  int port = -1;
  EXPECT_THAT(CheckEnvoyWiring(d, Object("Service/ropeattn-envoy"), Load().envoy_configmap_name, &port),
              HasProblemContaining("do not mount ConfigMap"));
}

Problems MutateEnvoyTls(const std::function<void(EnvoyTlsInputs& in)>& f) {
  EnvoyTlsInputs in = RealEnvoyTlsInputs();
  f(in);
  return CheckEnvoyTls(in, 50051, "ropeattn");
}

YAML::Node Listener50051(YAML::Node envoy) {
  for (YAML::Node l : envoy["static_resources"]["listeners"]) {
    if (l["address"]["socket_address"]["port_value"].as<int>() == 50051) return l;
  }
  ADD_FAILURE() << "no listener on 50051";
  return YAML::Node();
}

YAML::Node UpstreamCommon(YAML::Node envoy) {
  return EnvoyCluster(envoy)["transport_socket"]["typed_config"]["common_tls_context"];
}

TEST(ChecksCatch, EnvoyDownstreamTls) {
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) {
                Listener50051(in.envoy)["filter_chains"][0].remove("transport_socket");
              }),
              HasProblemContaining("has no downstream TLS transport socket"));
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) {
                Listener50051(in.envoy)["filter_chains"][0]["transport_socket"]["typed_config"]["@type"] =
                    "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer";
              }),
              HasProblemContaining("has no downstream TLS transport socket"));
  // Inline certificates are never reloaded.
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) {
                YAML::Node common =
                    Listener50051(in.envoy)["filter_chains"][0]["transport_socket"]["typed_config"]["common_tls_context"];
                common.remove("tls_certificate_sds_secret_configs");
                YAML::Node cert;
                cert["certificate_chain"]["filename"] = "/etc/envoy-tls/downstream/tls.crt";
                cert["private_key"]["filename"] = "/etc/envoy-tls/downstream/tls.key";
                common["tls_certificates"].push_back(cert);
              }),
              HasProblemContaining("downstream TLS: inline tls_certificates are read once"));
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) {
                Listener50051(in.envoy)["filter_chains"][0]["transport_socket"]["typed_config"]["common_tls_context"]
                                       ["tls_certificate_sds_secret_configs"][0]
                                           .remove("sds_config");
              }),
              HasProblemContaining("is a static secret"));
  // The SDS file: not in the ConfigMap, another secret's name, a file not
  // in a mounted Secret, a watched directory that is not the mount.
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) { in.files.erase("envoy-sds-downstream-cert.yaml"); }),
              HasProblemContaining("has no key envoy-sds-downstream-cert.yaml"));
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) {
                in.files["envoy-sds-downstream-cert.yaml"]["resources"][0]["name"] = "server_cert";
              }),
              HasProblemContaining("names secret \"server_cert\", want \"downstream_cert\""));
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) {
                in.files["envoy-sds-downstream-cert.yaml"]["resources"][0]["tls_certificate"]["private_key"]
                        ["filename"] = "/etc/envoy/key.pem";
              }),
              HasProblemContaining("downstream TLS private_key /etc/envoy/key.pem is not in a mounted Secret"));
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) {
                in.files["envoy-sds-downstream-cert.yaml"]["resources"][0]["tls_certificate"]["watched_directory"]
                        ["path"] = "/etc/envoy-tls";
              }),
              HasProblemContaining("is not the Secret's mount /etc/envoy-tls/downstream"));
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) {
                for (YAML::Node m : in.deployment["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]) {
                  if (m["name"].as<std::string>() == "downstream-tls") m["mountPath"] = "/etc/tls";
                }
              }),
              HasProblemContaining("certificate_chain /etc/envoy-tls/downstream/tls.crt is not under any volumeMount"));
}

TEST(ChecksCatch, EnvoyAlpn) {
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) { UpstreamCommon(in.envoy).remove("alpn_protocols"); }),
              HasProblemContaining("upstream TLS does not offer ALPN h2"));
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) {
                Listener50051(in.envoy)["filter_chains"][0]["transport_socket"]["typed_config"]["common_tls_context"]
                                       ["alpn_protocols"][0] = "http/1.1";
              }),
              HasProblemContaining("downstream TLS does not offer ALPN h2"));
}

TEST(ChecksCatch, EnvoyUpstreamMutualTls) {
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) { EnvoyCluster(in.envoy).remove("transport_socket"); }),
              HasProblemContaining("cluster ropeattn has no upstream TLS transport socket"));
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) {
                UpstreamCommon(in.envoy).remove("tls_certificate_sds_secret_configs");
              }),
              HasProblemContaining("upstream client certificate has no certificate"));
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) { UpstreamCommon(in.envoy).remove("combined_validation_context"); }),
              HasProblemContaining("has no validation context"));
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) {
                UpstreamCommon(in.envoy)["combined_validation_context"]["default_validation_context"].remove(
                    "match_typed_subject_alt_names");
              }),
              HasProblemContaining("no match_typed_subject_alt_names"));
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) {
                in.files["envoy-sds-internal-ca.yaml"]["resources"][0]["validation_context"].remove("trusted_ca");
              }),
              HasProblemContaining("has no trusted_ca file"));
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) {
                in.files["envoy-sds-internal-ca.yaml"]["resources"][0]["validation_context"]["trusted_ca"]
                        ["filename"] = "/etc/envoy-tls/upstream/tls.crt";
              }),
              HasProblemContaining("is key tls.crt of Secret ropeattn-envoy-upstream-tls, want ca.crt"));
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) {
                YAML::Node dvc = UpstreamCommon(in.envoy)["combined_validation_context"]["default_validation_context"];
                dvc["trusted_ca"]["filename"] = "/etc/envoy-tls/upstream/ca.crt";
              }),
              HasProblemContaining("an inline trusted_ca is read once"));
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) {
                for (YAML::Node v : in.deployment["spec"]["template"]["spec"]["volumes"]) {
                  if (v["name"].as<std::string>() == "upstream-tls") {
                    v.remove("secret");
                    v["emptyDir"] = YAML::Node(YAML::NodeType::Map);
                  }
                }
              }),
              HasProblemContaining("upstream client certificate certificate_chain /etc/envoy-tls/upstream/tls.crt is "
                                   "not in a mounted Secret"));
}

TEST(ChecksCatch, EnvoyForwardsAuthorization) {
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) {
                EnvoyHcm(in.envoy)["route_config"]["request_headers_to_remove"].push_back("Authorization");
              }),
              HasProblemContaining("Envoy removes the caller's authorization header (static_resources."));
  EXPECT_THAT(MutateEnvoyTls([](EnvoyTlsInputs& in) {
                YAML::Node h;
                h["header"]["key"] = "authorization";
                h["header"]["value"] = "Bearer shared";
                EnvoyHcm(in.envoy)["route_config"]["virtual_hosts"][0]["request_headers_to_add"].push_back(h);
              }),
              HasProblemContaining("Envoy rewrites the caller's authorization header"));
}

Problems MutateCertificates(const std::function<void(std::map<std::string, YAML::Node>& objects)>& f) {
  std::map<std::string, YAML::Node> objects;
  for (const auto& [k, v] : Load().objects) objects[k].reset(YAML::Clone(v));
  f(objects);
  return CheckCertificates(objects, objects["Deployment/ropeattn"], RealEnvoyTlsInputs(), 50051, "ropeattn");
}

TEST(ChecksCatch, Certificates) {
  EXPECT_THAT(MutateCertificates([](auto& o) { o.erase("Certificate/ropeattn-server-tls"); }),
              HasProblemContaining("Secret ropeattn-server-tls (mounted by Deployment ropeattn) is issued by no "
                                   "Certificate"));
  EXPECT_THAT(MutateCertificates([](auto& o) { o.erase("Certificate/ropeattn-envoy-tls"); }),
              HasProblemContaining("Envoy's serving certificate is issued by no Certificate"));
  EXPECT_THAT(MutateCertificates([](auto& o) { o.erase("Issuer/ropeattn-ca"); }),
              HasProblemContaining("issuer Issuer/ropeattn-ca is not in the manifests"));
  EXPECT_THAT(MutateCertificates([](auto& o) { o["Certificate/ropeattn-ca"]["spec"].remove("isCA"); }),
              HasProblemContaining("Issuer/ropeattn-ca signs with Secret ropeattn-ca, which no isCA Certificate"));
  EXPECT_THAT(MutateCertificates([](auto& o) {
                o["Certificate/ropeattn-envoy-upstream-tls"]["spec"]["issuerRef"]["name"] = "ropeattn-selfsigned";
              }),
              HasProblemContaining("different issuers"));
  EXPECT_THAT(MutateCertificates([](auto& o) { o["Certificate/ropeattn-server-tls"]["spec"].remove("ipAddresses"); }),
              HasProblemContaining("readinessProbe dials 127.0.0.1, which is no SAN of the pods' Certificate"));
  EXPECT_THAT(MutateCertificates([](auto& o) {
                o["Certificate/ropeattn-server-tls"]["spec"]["uris"][0] = "spiffe://ropeattn/other";
              }),
              HasProblemContaining("no SAN of the pods' Certificate matches Envoy's upstream SAN matchers"));
  EXPECT_THAT(MutateCertificates([](auto& o) {
                YAML::Node usages(YAML::NodeType::Sequence);
                usages.push_back("digital signature");
                usages.push_back("server auth");
                o["Certificate/ropeattn-server-tls"]["spec"]["usages"] = usages;
              }),
              HasProblemContaining("needs usage \"client auth\""));
  EXPECT_THAT(MutateCertificates([](auto& o) {
                YAML::Node usages(YAML::NodeType::Sequence);
                usages.push_back("server auth");
                o["Certificate/ropeattn-envoy-upstream-tls"]["spec"]["usages"] = usages;
              }),
              HasProblemContaining("Envoy's client Certificate lacks usage \"client auth\""));
}

TEST(ChecksCatch, TokensNeverCommitted) {
  const fs::path dir = fs::temp_directory_path() / "ropeattn_manifest_test_tokens";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path example = dir / "example.yaml";
  const auto write = [&](const std::string& text) {
    std::FILE* f = std::fopen(example.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(text.c_str(), f);
    std::fclose(f);
  };
  write("apiVersion: v1\nkind: Secret\nmetadata:\n  name: ropeattn-auth-tokens\nstringData:\n"
        "  tokens: |\n    # a comment\n\n    0123456789abcdef alice\n");
  EXPECT_THAT(CheckTokensExample(example, {}), HasProblemContaining("line 3 of tokens is not a comment"));
  write("apiVersion: v1\nkind: Secret\nmetadata:\n  name: ropeattn-auth-tokens\nstringData:\n"
        "  tokens: |\n    # only comments\n");
  EXPECT_THAT(CheckTokensExample(example, {}), IsEmpty());
  std::map<std::string, YAML::Node> objects;
  objects["Secret/ropeattn-auth-tokens"] = YAML::Load("kind: Secret");
  EXPECT_THAT(CheckTokensExample(example, objects),
              HasProblemContaining("kustomization applies Secret/ropeattn-auth-tokens"));
  fs::remove_all(dir);
}

}  // namespace
