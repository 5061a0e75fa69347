// Structural checks of the Kubernetes manifests in deploy/k8s: the properties
// the deployment relies on (probes, resources derived from the flags, the
// drain arithmetic, security context, ports, session-aware routing in Envoy,
// a complete kustomization). Each check is a function returning the list of
// problems it found; the tests run them on the real manifests (no problems
// expected) and on copies broken on purpose (the problem must be reported),
// so a manifest edit that breaks a property fails the suite.
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
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
YAML::Node ClusterIpService() { return Object("Service/ropeattn"); }
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

  // Probes.
  const auto probe_problem = [&](const std::string& kind, const std::string& want_service) {
    const YAML::Node probe = Get(c, {kind});
    if (!probe.IsDefined()) {
      p.push_back(kind + " missing");
      return;
    }
    const YAML::Node grpc = Get(probe, {"grpc"});
    if (!grpc.IsDefined()) {
      p.push_back(kind + " is not a gRPC probe");
      return;
    }
    const auto port = Num(Get(grpc, {"port"}));
    if (!port || static_cast<int>(*port) != grpc_port) {
      p.push_back(kind + " port " + Str(Get(grpc, {"port"}), "(none)") + " != gRPC port " +
                  std::to_string(grpc_port));
    }
    const std::string service = Str(Get(grpc, {"service"}));  // absent == ""
    if (service != want_service) {
      p.push_back(kind + " service \"" + service + "\", want \"" + want_service + "\"");
    }
  };
  probe_problem("startupProbe", "");
  probe_problem("livenessProbe", "");
  probe_problem("readinessProbe", kServiceName);

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

Problems CheckServices(const YAML::Node& cluster_ip, const YAML::Node& headless,
                       const YAML::Node& deployment) {
  Problems p;
  int port = -1;
  if (!cluster_ip.IsDefined()) {
    p.push_back("no Service ropeattn");
  } else {
    const std::string type = Str(Get(cluster_ip, {"spec", "type"}), "ClusterIP");
    if (type != "ClusterIP") p.push_back("Service ropeattn type " + type + ", want ClusterIP");
    if (Str(Get(cluster_ip, {"spec", "clusterIP"})) == "None") {
      p.push_back("Service ropeattn must not be headless");
    }
    if (!SelectorMatchesPods(Get(cluster_ip, {"spec", "selector"}), deployment)) {
      p.push_back("Service ropeattn selector does not match the server pods");
    }
    if (!ServiceReachesGrpc(cluster_ip, deployment, &port)) {
      p.push_back("Service ropeattn has no port to the gRPC container port");
    }
  }
  if (!headless.IsDefined()) {
    p.push_back("no Service ropeattn-headless");
  } else {
    if (Str(Get(headless, {"spec", "clusterIP"})) != "None") {
      p.push_back("Service ropeattn-headless must have clusterIP: None");
    }
    if (IsTrue(Get(headless, {"spec", "publishNotReadyAddresses"}))) {
      p.push_back("headless Service must not publish not-ready pods (draining pods stay on the ring)");
    }
    if (!SelectorMatchesPods(Get(headless, {"spec", "selector"}), deployment)) {
      p.push_back("Service ropeattn-headless selector does not match the server pods");
    }
    if (!ServiceReachesGrpc(headless, deployment, &port)) {
      p.push_back("Service ropeattn-headless has no port to the gRPC container port");
    }
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

TEST(Manifests, Services) {
  EXPECT_THAT(CheckServices(ClusterIpService(), HeadlessService(), ServerDeployment()), IsEmpty());
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

TEST(ChecksCatch, MissingOrWrongProbes) {
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { RemoveKey(c, "readinessProbe"); }),
              HasProblemContaining("readinessProbe missing"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { RemoveKey(c, "startupProbe"); }),
              HasProblemContaining("startupProbe missing"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                c["readinessProbe"]["grpc"]["service"] = "";
              }),
              HasProblemContaining("readinessProbe service"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                c["livenessProbe"]["grpc"]["service"] = kServiceName;
              }),
              HasProblemContaining("livenessProbe service"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { c["livenessProbe"]["grpc"]["port"] = 9464; }),
              HasProblemContaining("livenessProbe port"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) {
                RemoveKey(c["readinessProbe"], "grpc");
                c["readinessProbe"]["tcpSocket"]["port"] = 50051;
              }),
              HasProblemContaining("readinessProbe is not a gRPC probe"));
  EXPECT_THAT(MutateServer([](YAML::Node&, YAML::Node c) { c["livenessProbe"]["failureThreshold"] = 1; }),
              HasProblemContaining("livenessProbe gives up"));
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

TEST(ChecksCatch, Services) {
  YAML::Node headless = HeadlessService();
  RemoveKey(headless["spec"], "clusterIP");
  EXPECT_THAT(CheckServices(ClusterIpService(), headless, ServerDeployment()),
              HasProblemContaining("clusterIP: None"));
  YAML::Node svc = ClusterIpService();
  svc["spec"]["selector"]["app.kubernetes.io/component"] = "envoy";
  EXPECT_THAT(CheckServices(svc, HeadlessService(), ServerDeployment()),
              HasProblemContaining("selector does not match"));
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

}  // namespace
