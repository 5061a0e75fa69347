// Several real ropeattn-server processes behind the client's consistent-hash
// ring (no proxy): sessions spread over the replicas, the loss of one
// replica (SIGKILL) leaves the others' sessions untouched, and
// RecoverableSession rebuilds the lost ones on the next replica of the ring
// by replaying their inputs, bit for bit. A SIGTERM'd replica drains.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/ring.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/tools/server_output.h"

namespace ropeattn::client {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// One ropeattn-server child process on a free loopback port.
class ServerProcess {
 public:
  ~ServerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_ != nullptr) fclose(out_);
  }

  // Starts the server and reads its start-up lines (the port); null
  // (with a test failure) if it does not come up.
  static std::unique_ptr<ServerProcess> Start(const std::vector<std::string>& extra = {}) {
    int out_pipe[2];
    if (pipe(out_pipe) != 0) {
      ADD_FAILURE() << "pipe failed";
      return nullptr;
    }
    std::vector<std::string> args = {"ropeattn-server", "--address=127.0.0.1:0",
                                     "--metrics_address="};
    args.insert(args.end(), extra.begin(), extra.end());
    const pid_t pid = fork();
    if (pid < 0) {
      ADD_FAILURE() << "fork failed";
      return nullptr;
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive a crashed test
      dup2(out_pipe[1], STDOUT_FILENO);
      close(out_pipe[0]);
      close(out_pipe[1]);
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(ROPEATTN_SERVER_PATH, argv.data());
      _exit(127);
    }
    close(out_pipe[1]);
    std::unique_ptr<ServerProcess> p(new ServerProcess());
    p->pid_ = pid;
    p->out_ = fdopen(out_pipe[0], "r");
    const testing::ServerStartup startup = testing::ReadServerStartup(p->out_);
    p->port_ = startup.port;
    if (p->port_ <= 0) {
      ADD_FAILURE() << "no port in: " << startup.text;
      return nullptr;
    }
    return p;
  }

  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }
  pid_t pid() const { return pid_; }

  // Sends `sig` and waits for the exit; returns the wait status.
  int SignalAndWait(int sig) {
    kill(pid_, sig);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }

  // Reaps the process if it has exited (then *status is its wait status).
  bool TryWait(int* status) {
    if (pid_ <= 0) return false;
    if (waitpid(pid_, status, WNOHANG) != pid_) return false;
    pid_ = -1;
    return true;
  }

  // What the server printed after its first line (call after it exited).
  std::string RestOfOutput() {
    std::string rest;
    char line[512];
    while (fgets(line, sizeof(line), out_) != nullptr) rest += line;
    return rest;
  }

 private:
  ServerProcess() = default;
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  int port_ = 0;
};

std::unique_ptr<Client> MustConnect(ClientOptions options) {
  options.deadline = absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? std::move(*client) : nullptr;
}

std::unique_ptr<Client> ConnectTo(const std::string& target) {
  ClientOptions options;
  options.target = target;
  return MustConnect(options);
}

constexpr int kHeads = 4;
constexpr int kKvHeads = 2;
constexpr int kDim = 16;
constexpr int kSessions = 12;
constexpr int kStepTokens[] = {3, 1, 2, 1, 1, 2};  // a prefill, then decode steps
constexpr int kSteps = sizeof(kStepTokens) / sizeof(kStepTokens[0]);
constexpr int kKillAfter = 3;  // steps done on every session before the replica dies

v1::OpenSession SmallOpen(bool resumable = false) {
  v1::OpenSession open;
  open.mutable_spec()->set_heads(kHeads);
  open.mutable_spec()->set_kv_heads(kKvHeads);
  open.mutable_spec()->set_head_dim(kDim);
  open.mutable_spec()->mutable_rope();  // standard RoPE, theta 10000
  open.set_max_context(64);
  open.set_resumable(resumable);
  return open;
}

struct StepInputs {
  v1::Tensor q, k, v;
};

// Distinct, deterministic inputs per (session, step).
std::vector<StepInputs> MakeInputs(int session) {
  std::vector<StepInputs> steps;
  for (int i = 0; i < kSteps; ++i) {
    const int64_t t = kStepTokens[i];
    const uint64_t seed = 1000 * static_cast<uint64_t>(session + 1) + 10 * i;
    StepInputs in;
    in.q = *RandomTensor(v1::DTYPE_F32, {1, t, kHeads, kDim}, seed + 1);
    in.k = *RandomTensor(v1::DTYPE_F32, {1, t, kKvHeads, kDim}, seed + 2);
    in.v = *RandomTensor(v1::DTYPE_F32, {1, t, kKvHeads, kDim}, seed + 3);
    steps.push_back(std::move(in));
  }
  return steps;
}

std::string Key(int session) { return absl::StrCat("user-", session, "/conversation"); }

// ------------------------------------------------------------------ ring --

TEST(HashRingTest, IsDeterministicBalancedAndFailsOverToADistinctTarget) {
  // Fixed values: the hash must not change across builds or processes.
  EXPECT_EQ(Fnv1a64(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(Fnv1a64("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(Fnv1a64("foobar"), 0x85944171f73967e8ULL);

  const std::vector<std::string> targets = {"10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"};
  const HashRing ring(targets);
  const HashRing shuffled({targets[2], targets[0], targets[1]});
  std::map<int, int> owners;
  for (int i = 0; i < 3000; ++i) {
    const std::string key = absl::StrCat("key-", i);
    const int owner = ring.Lookup(key);
    ASSERT_GE(owner, 0);
    ++owners[owner];
    // The order of the target list does not matter.
    EXPECT_EQ(ring.targets()[owner], shuffled.targets()[shuffled.Lookup(key)]);
    const std::vector<int> pref = ring.Preference(key);
    ASSERT_EQ(pref.size(), 3u);
    EXPECT_EQ(pref[0], owner);
    EXPECT_EQ(std::set<int>(pref.begin(), pref.end()).size(), 3u);
    EXPECT_EQ(ring.NextAfter(key, owner), pref[1]);
    EXPECT_EQ(ring.NextAfter(key, pref[2]), pref[0]);
  }
  // 160 virtual nodes: each target gets a fair share (expected 1000 each).
  for (int t = 0; t < 3; ++t) {
    EXPECT_GT(owners[t], 600) << ring.targets()[t];
    EXPECT_LT(owners[t], 1400) << ring.targets()[t];
  }
  // Removing a target moves only its keys.
  const HashRing two({targets[0], targets[1]});
  for (int i = 0; i < 3000; ++i) {
    const std::string key = absl::StrCat("key-", i);
    const int owner = ring.Lookup(key);
    if (owner != 2) EXPECT_EQ(two.targets()[two.Lookup(key)], ring.targets()[owner]) << key;
    // ...to where the 3-target ring fails them over.
    if (owner == 2) {
      EXPECT_EQ(two.targets()[two.Lookup(key)], ring.targets()[ring.NextAfter(key, 2)]) << key;
    }
  }
  EXPECT_EQ(HashRing({}).Lookup("x"), -1);
  EXPECT_EQ(HashRing({"only:1"}).NextAfter("x", 0), 0);
}

TEST(ConnectTest, RejectsBadTargets) {
  ClientOptions o;
  o.targets = {"127.0.0.1:1", ""};
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.targets = {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:1"};
  absl::Status s = Client::Connect(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("repeats"));
}

// ----------------------------------------------------------- replicas --

TEST(MultiReplicaTest, ReplicaLossLeavesOthersUntouchedAndRecoveryReplaysBitIdentically) {
  std::vector<std::vector<StepInputs>> inputs;
  for (int s = 0; s < kSessions; ++s) inputs.push_back(MakeInputs(s));

  // Solo outputs: every session alone, on a fresh server of its own.
  std::vector<std::vector<std::string>> solo(kSessions);
  {
    std::unique_ptr<ServerProcess> server = ServerProcess::Start();
    ASSERT_NE(server, nullptr);
    std::unique_ptr<Client> client = ConnectTo(server->target());
    ASSERT_NE(client, nullptr);
    for (int s = 0; s < kSessions; ++s) {
      absl::StatusOr<std::unique_ptr<Session>> session = client->OpenSession(SmallOpen());
      ASSERT_TRUE(session.ok()) << session.status();
      for (int i = 0; i < kSteps; ++i) {
        absl::StatusOr<v1::StepResult> r =
            (*session)->Step(inputs[s][i].q, inputs[s][i].k, inputs[s][i].v);
        ASSERT_TRUE(r.ok()) << r.status();
        solo[s].push_back(r->out().SerializeAsString());
      }
      ASSERT_TRUE((*session)->Close().ok());
    }
  }

  std::vector<std::unique_ptr<ServerProcess>> replicas;
  ClientOptions options;
  for (int r = 0; r < 3; ++r) {
    replicas.push_back(ServerProcess::Start());
    ASSERT_NE(replicas.back(), nullptr);
    options.targets.push_back(replicas.back()->target());
  }
  std::unique_ptr<Client> client = MustConnect(options);
  ASSERT_NE(client, nullptr);
  ASSERT_EQ(client->targets(), options.targets);

  // Open: each session on the ring owner of its key.
  std::vector<std::unique_ptr<RecoverableSession>> sessions;
  std::map<size_t, std::set<std::string>> ids_by_replica;
  std::vector<size_t> first_target(kSessions);
  std::vector<std::string> first_id(kSessions);
  for (int s = 0; s < kSessions; ++s) {
    absl::StatusOr<std::unique_ptr<RecoverableSession>> rs =
        RecoverableSession::Open(client.get(), SmallOpen(), Key(s));
    ASSERT_TRUE(rs.ok()) << rs.status();
    first_target[s] = (*rs)->target_index();
    first_id[s] = (*rs)->session().id();
    EXPECT_EQ(static_cast<int>(first_target[s]), client->ring().Lookup(Key(s)));
    EXPECT_EQ((*rs)->target(), options.targets[first_target[s]]);
    ids_by_replica[first_target[s]].insert(first_id[s]);
    sessions.push_back(std::move(*rs));
  }
  EXPECT_GE(ids_by_replica.size(), 2u) << "12 keys should spread over the 3 replicas";
  // The servers agree: each replica holds exactly the sessions routed to it.
  for (size_t r = 0; r < replicas.size(); ++r) {
    std::unique_ptr<Client> direct = ConnectTo(options.targets[r]);
    absl::StatusOr<std::vector<v1::SessionInfo>> listed = direct->ListSessions();
    ASSERT_TRUE(listed.ok()) << listed.status();
    std::set<std::string> held;
    for (const v1::SessionInfo& info : *listed) held.insert(info.session_id());
    EXPECT_EQ(held, ids_by_replica[r]) << "replica " << r;
  }
  // The merged view of the multi-target client sees all of them.
  absl::StatusOr<std::vector<v1::SessionInfo>> all = client->ListSessions();
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->size(), static_cast<size_t>(kSessions));

  // The victim: the replica holding the most sessions.
  size_t victim = 0;
  for (const auto& [r, ids] : ids_by_replica) {
    if (ids.size() > ids_by_replica[victim].size()) victim = r;
  }
  int on_victim = 0;
  for (int s = 0; s < kSessions; ++s) on_victim += first_target[s] == victim;
  ASSERT_GT(on_victim, 0);

  // Plain Sessions on the victim, to see the raw failure: one per victim
  // key fed the same steps, and a resumable one to re-attach later.
  std::vector<std::unique_ptr<Session>> witnesses;
  std::string witness_key;
  for (int s = 0; s < kSessions; ++s) {
    if (first_target[s] != victim) continue;
    absl::StatusOr<std::unique_ptr<Session>> w = client->OpenSession(SmallOpen(), Key(s));
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ((*w)->target_index(), victim);
    witnesses.push_back(std::move(*w));
    witness_key = Key(s);
  }
  absl::StatusOr<std::unique_ptr<Session>> resumable =
      client->OpenSession(SmallOpen(/*resumable=*/true), witness_key);
  ASSERT_TRUE(resumable.ok()) << resumable.status();
  ASSERT_EQ((*resumable)->target_index(), victim);
  const std::string resumable_id = (*resumable)->id();

  // A few steps everywhere, equal to the solo run.
  for (int i = 0; i < kKillAfter; ++i) {
    for (int s = 0; s < kSessions; ++s) {
      absl::StatusOr<v1::StepResult> r =
          sessions[s]->Step(inputs[s][i].q, inputs[s][i].k, inputs[s][i].v);
      ASSERT_TRUE(r.ok()) << "session " << s << " step " << i << ": " << r.status();
      EXPECT_EQ(r->out().SerializeAsString(), solo[s][i]) << "session " << s << " step " << i;
    }
    for (auto& w : witnesses) {
      ASSERT_TRUE(w->Step(inputs[0][i].q, inputs[0][i].k, inputs[0][i].v).ok());
    }
  }
  ASSERT_TRUE((*resumable)->Step(inputs[0][0].q, inputs[0][0].k, inputs[0][0].v).ok());
  resumable->reset();  // detaches it: it stays on the victim until the victim dies

  // SIGKILL the victim mid-run.
  const int wait_status = replicas[victim]->SignalAndWait(SIGKILL);
  ASSERT_TRUE(WIFSIGNALED(wait_status));

  // The raw failure: the stream ends with UNAVAILABLE, saying why.
  for (auto& w : witnesses) {
    absl::StatusOr<v1::StepResult> r =
        w->Step(inputs[0][kKillAfter].q, inputs[0][kKillAfter].k, inputs[0][kKillAfter].v);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
    EXPECT_FALSE(r.status().message().empty());
    EXPECT_EQ(w->stream_status().code(), absl::StatusCode::kUnavailable);
  }
  // Re-attaching: the ring still routes the key to the dead replica
  // (UNAVAILABLE), and the next replica does not hold the session (NOT_FOUND
  // naming it): its state is gone with the process.
  const size_t next = static_cast<size_t>(client->ring().NextAfter(witness_key, victim));
  ASSERT_NE(next, victim);
  {
    absl::Status s = client->AttachSession(resumable_id, witness_key).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    s = client->AttachSessionOn(next, resumable_id, witness_key).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_THAT(s.message(), HasSubstr(resumable_id));
  }

  // The rest of the run: every session answers, bit-identical to solo. The
  // victim's sessions were re-opened on the next replica of their key's ring
  // order and replayed; the others never noticed.
  for (int i = kKillAfter; i < kSteps; ++i) {
    for (int s = 0; s < kSessions; ++s) {
      absl::StatusOr<v1::StepResult> r =
          sessions[s]->Step(inputs[s][i].q, inputs[s][i].k, inputs[s][i].v);
      ASSERT_TRUE(r.ok()) << "session " << s << " step " << i << ": " << r.status();
      EXPECT_EQ(r->out().SerializeAsString(), solo[s][i]) << "session " << s << " step " << i;
    }
  }
  int total_tokens = 0;
  for (int t : kStepTokens) total_tokens += t;
  std::map<size_t, std::set<std::string>> now_by_replica;
  for (int s = 0; s < kSessions; ++s) {
    RecoverableSession& rs = *sessions[s];
    EXPECT_EQ(rs.position(), total_tokens) << "session " << s;
    EXPECT_EQ(rs.retained_steps(), static_cast<size_t>(kSteps));
    if (first_target[s] == victim) {
      EXPECT_EQ(rs.recoveries(), 1) << "session " << s;
      EXPECT_EQ(rs.last_failure().code(), absl::StatusCode::kUnavailable) << rs.last_failure();
      EXPECT_EQ(static_cast<int>(rs.target_index()), client->ring().NextAfter(Key(s), victim));
      EXPECT_NE(rs.session().id(), first_id[s]);
    } else {
      EXPECT_EQ(rs.recoveries(), 0) << "session " << s;
      EXPECT_TRUE(rs.last_failure().ok());
      EXPECT_EQ(rs.target_index(), first_target[s]);
      EXPECT_EQ(rs.session().id(), first_id[s]);  // the same session, untouched
    }
    now_by_replica[rs.target_index()].insert(rs.session().id());
  }
  EXPECT_EQ(now_by_replica.count(victim), 0u);
  // The survivors hold exactly the sessions now routed to them.
  for (size_t r = 0; r < replicas.size(); ++r) {
    if (r == victim) continue;
    std::unique_ptr<Client> direct = ConnectTo(options.targets[r]);
    absl::StatusOr<std::vector<v1::SessionInfo>> listed = direct->ListSessions();
    ASSERT_TRUE(listed.ok()) << listed.status();
    std::set<std::string> held;
    for (const v1::SessionInfo& info : *listed) {
      held.insert(info.session_id());
      EXPECT_EQ(info.position(), total_tokens) << info.session_id();
    }
    EXPECT_EQ(held, now_by_replica[r]) << "replica " << r;
  }
  // GetSession looks on every target and finds the moved session; a session
  // that only the dead replica could hold is UNAVAILABLE, not NOT_FOUND.
  for (int s = 0; s < kSessions; ++s) {
    absl::StatusOr<v1::SessionInfo> info = client->GetSession(sessions[s]->session().id());
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->position(), total_tokens);
  }
  {
    absl::Status s = client->GetSession(resumable_id).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_THAT(s.message(), HasSubstr(options.targets[victim]));
  }

  // Unary calls keep working: round robin moves past the dead replica.
  v1::AttendRequest attend;
  attend.mutable_spec()->set_heads(kHeads);
  attend.mutable_spec()->set_head_dim(kDim);
  attend.mutable_spec()->set_causal(true);
  *attend.mutable_q() = *RandomTensor(v1::DTYPE_F32, {1, 4, kHeads, kDim}, 7);
  *attend.mutable_k() = *RandomTensor(v1::DTYPE_F32, {1, 4, kHeads, kDim}, 8);
  *attend.mutable_v() = *RandomTensor(v1::DTYPE_F32, {1, 4, kHeads, kDim}, 9);
  for (int i = 0; i < 6; ++i) {
    absl::StatusOr<v1::AttendResponse> r = client->Attend(attend);
    EXPECT_TRUE(r.ok()) << "call " << i << ": " << r.status();
  }
  EXPECT_EQ(client->HealthOf(victim).status().code(), absl::StatusCode::kUnavailable);

  for (auto& rs : sessions) EXPECT_TRUE(rs->Close().ok());
  witnesses.clear();
}

// Watches grpc.health.v1 (the client-side mirror has Check only, so the
// server-streaming Watch is called through gRPC's reader factory).
std::unique_ptr<grpc::ClientReader<grpc::health::v1::HealthCheckResponse>> Watch(
    grpc::Channel* channel, grpc::ClientContext* ctx) {
  static const grpc::internal::RpcMethod kWatch("/grpc.health.v1.Health/Watch",
                                                grpc::internal::RpcMethod::SERVER_STREAMING);
  grpc::health::v1::HealthCheckRequest request;
  return std::unique_ptr<grpc::ClientReader<grpc::health::v1::HealthCheckResponse>>(
      grpc::internal::ClientReaderFactory<grpc::health::v1::HealthCheckResponse>::Create(
          channel, kWatch, ctx, request));
}

TEST(MultiReplicaTest, SigtermedReplicaAnswersItsInFlightStepTurnsNotServingAndExitsZero) {
  constexpr int kGraceSeconds = 10;
  std::unique_ptr<ServerProcess> server =
      ServerProcess::Start({absl::StrCat("--shutdown_grace_seconds=", kGraceSeconds)});
  ASSERT_NE(server, nullptr);
  std::unique_ptr<Client> client = ConnectTo(server->target());
  ASSERT_NE(client, nullptr);

  grpc::ClientContext watch_ctx;
  watch_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::ChannelArguments args;
  auto channel =
      grpc::CreateCustomChannel(server->target(), grpc::InsecureChannelCredentials(), args);
  auto watch = Watch(channel.get(), &watch_ctx);
  grpc::health::v1::HealthCheckResponse health;
  ASSERT_TRUE(watch->Read(&health));
  // The compute canary may not have passed yet.
  while (health.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    ASSERT_TRUE(watch->Read(&health));
  }

  // A step big enough to be still computing when SIGTERM lands: a causal
  // prefill of 4096 tokens, 8 heads of 64 (8 MiB per tensor: quick to send,
  // about a second of compute).
  constexpr int64_t kT = 4096, kH = 8, kD = 64;
  v1::OpenSession open;
  open.mutable_spec()->set_heads(kH);
  open.mutable_spec()->set_head_dim(kD);
  open.mutable_spec()->mutable_rope();
  open.set_max_context(kT);
  absl::StatusOr<std::unique_ptr<Session>> session = client->OpenSession(open);
  ASSERT_TRUE(session.ok()) << session.status();
  const v1::Tensor q = *RandomTensor(v1::DTYPE_F32, {1, kT, kH, kD}, 1);
  const v1::Tensor k = *RandomTensor(v1::DTYPE_F32, {1, kT, kH, kD}, 2);
  const v1::Tensor v = *RandomTensor(v1::DTYPE_F32, {1, kT, kH, kD}, 3);

  const absl::StatusOr<v1::ServerInfo> before = client->GetServerInfo();
  ASSERT_TRUE(before.ok()) << before.status();
  std::atomic<bool> answered{false};
  std::chrono::steady_clock::time_point answered_at;
  absl::StatusOr<v1::StepResult> result;
  std::thread stepper([&] {
    result = (*session)->Step(q, k, v);
    answered_at = std::chrono::steady_clock::now();
    answered = true;
  });
  struct Joiner {
    std::thread& t;
    ~Joiner() {
      if (t.joinable()) t.join();
    }
  } joiner{stepper};
  // In flight means admitted: the server has the whole message and has
  // reserved the step's transient memory (ServerInfo.memory_bytes_in_use
  // grows past the session's own bytes). Before that the 24 MiB may still be
  // on the wire, and a stream still receiving is drained like an idle one.
  const auto admit_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (;;) {
    absl::StatusOr<v1::ServerInfo> info = client->GetServerInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    if (info->memory_bytes_in_use() > before->memory_bytes_in_use()) break;
    ASSERT_FALSE(answered.load()) << "the step finished before it was seen admitted";
    ASSERT_LT(std::chrono::steady_clock::now(), admit_deadline) << "the step was never admitted";
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_FALSE(answered.load()) << "the step finished before SIGTERM; make it bigger";
  const auto killed_at = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(server->pid(), SIGTERM), 0);

  // Load balancers watching see NOT_SERVING.
  bool saw_not_serving = false;
  while (watch->Read(&health)) {
    if (health.status() == grpc::health::v1::HealthCheckResponse::NOT_SERVING) {
      saw_not_serving = true;
      break;
    }
  }
  EXPECT_TRUE(saw_not_serving);
  // An open Watch is an in-flight call too: gRPC's health service does not
  // end it at shutdown, so it would hold the server for the whole grace
  // period. A load balancer drops the replica on NOT_SERVING; do the same.
  watch_ctx.TryCancel();
  watch->Finish();

  // The in-flight step is answered, after SIGTERM, in full.
  stepper.join();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_GT(answered_at, killed_at);
  EXPECT_EQ(result->position(), kT);
  EXPECT_EQ(NumElements(result->out()), kT * kH * kD);
  // The stream ends after that answer: the server is draining.
  absl::StatusOr<v1::StepResult> after = (*session)->Step(q, k, v);
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable) << after.status();

  // It exits 0 within its grace period.
  int status = 0;
  bool exited = false;
  for (int i = 0; i < (kGraceSeconds + 5) * 20 && !exited; ++i) {
    exited = server->TryWait(&status);
    if (!exited) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(exited) << "still running " << kGraceSeconds + 5 << " s after SIGTERM";
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - killed_at, std::chrono::seconds(kGraceSeconds));
  const std::string said = server->RestOfOutput();
  EXPECT_THAT(said, HasSubstr("SIGTERM received, draining"));
  EXPECT_THAT(said, HasSubstr("stopped"));
  session->reset();
}

// ------------------------------------------------------------- memory --

// The server process's resident set, from /proc (0 if unreadable).
int64_t RssBytes(pid_t pid) {
  FILE* f = std::fopen(absl::StrCat("/proc/", pid, "/status").c_str(), "r");
  if (f == nullptr) return 0;
  char line[256];
  int64_t kb = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "VmRSS: %ld kB", &kb) == 1) break;
  }
  std::fclose(f);
  return kb * 1024;
}

// Issue 11: the memory budget is what the process holds, not an estimate.
// The server runs as a process with a 256 MiB budget; sessions are opened
// and filled until the budget refuses one, while four threads send large
// Attends (many refused for memory) and large Encode/Embed answers are
// asked for. RSS, sampled every 5 ms, must stay under
//   budget + baseline (the idle server after a warm-up call)
//          + the requests gRPC holds before any pricing (the 4 senders' and
//            this thread's, 24 MiB each on the wire)
//          + 96 MiB of slack: per-thread buffers the kernels keep (at most
//            16 MiB each, the second worker's not yet in the baseline),
//            gRPC's own buffers and allocator rounding.
TEST(MemoryTest, ResidentSetStaysUnderBudgetPlusStatedOverhead) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  constexpr int64_t kBudget = 256 * kMiB;
  std::unique_ptr<ServerProcess> server = ServerProcess::Start(
      {absl::StrCat("--memory_budget_bytes=", kBudget), "--compute_workers=2",
       "--max_sessions=64"});
  ASSERT_NE(server, nullptr);
  std::unique_ptr<Client> client = ConnectTo(server->target());
  ASSERT_NE(client, nullptr);

  constexpr int64_t kT = 2048, kH = 8, kD = 128;
  v1::AttendRequest big;
  big.mutable_spec()->set_heads(kH);
  big.mutable_spec()->set_head_dim(kD);
  big.mutable_spec()->set_causal(true);
  big.mutable_spec()->mutable_rope();
  *big.mutable_q() = *RandomTensor(v1::DTYPE_F32, {1, kT, kH, kD}, 11);
  *big.mutable_k() = *RandomTensor(v1::DTYPE_F32, {1, kT, kH, kD}, 12);
  *big.mutable_v() = *RandomTensor(v1::DTYPE_F32, {1, kT, kH, kD}, 13);
  const int64_t wire = static_cast<int64_t>(big.ByteSizeLong());
  // Warm-up: kernels, thread pools and the allocator's first arenas.
  ASSERT_TRUE(client->Attend(big).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const int64_t baseline = RssBytes(server->pid());
  ASSERT_GT(baseline, 0);

  std::atomic<bool> done{false};
  std::atomic<int64_t> peak{0};
  std::thread sampler([&] {
    while (!done.load()) {
      const int64_t rss = RssBytes(server->pid());
      int64_t seen = peak.load();
      while (rss > seen && !peak.compare_exchange_weak(seen, rss)) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });

  constexpr int kSenders = 4;
  std::atomic<int> attends_ok{0}, attends_refused{0}, other_errors{0};
  std::vector<std::thread> senders;
  for (int t = 0; t < kSenders; ++t) {
    senders.emplace_back([&, t] {
      std::unique_ptr<Client> c = ConnectTo(server->target());
      if (c == nullptr) return;
      for (int i = 0; i < 6; ++i) {
        absl::StatusOr<v1::AttendResponse> r = c->Attend(big);
        if (r.ok()) {
          ++attends_ok;
        } else if (r.status().code() == absl::StatusCode::kResourceExhausted) {
          ++attends_refused;
        } else {
          ++other_errors;
          ADD_FAILURE() << "Attend " << t << "/" << i << ": " << r.status();
        }
      }
    });
  }

  // Sessions of 8 kv heads x 128 x 4096 tokens (32 MiB of KV each, plus
  // their RoPE tables), filled with prefill steps, until one is refused.
  std::vector<std::unique_ptr<Session>> sessions;
  int refused_sessions = 0;
  const v1::Tensor q = *RandomTensor(v1::DTYPE_F32, {1, 1024, kH, kD}, 21);
  for (int i = 0; i < 64 && refused_sessions == 0; ++i) {
    v1::OpenSession open;
    open.mutable_spec()->set_heads(kH);
    open.mutable_spec()->set_head_dim(kD);
    open.mutable_spec()->mutable_rope();
    open.set_max_context(4096);
    absl::StatusOr<std::unique_ptr<Session>> s = client->OpenSession(open);
    if (!s.ok()) {
      EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted) << s.status();
      EXPECT_THAT(std::string(s.status().message()), HasSubstr("memory budget"));
      ++refused_sessions;
      break;
    }
    for (int chunk = 0; chunk < 4; ++chunk) {
      absl::StatusOr<v1::StepResult> r = (*s)->Step(q, q, q);
      if (!r.ok()) {
        // A step's transient buffers may not fit while Attends hold the rest.
        EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
      }
    }
    sessions.push_back(*std::move(s));
  }
  EXPECT_EQ(refused_sessions, 1) << "the budget never refused a session";
  EXPECT_GE(sessions.size(), 2u);

  // Large answers: a sinusoidal table and an Embed near the message limit
  // are priced and either answered or refused before they are built.
  for (int i = 0; i < 4; ++i) {
    v1::EncodeRequest e;
    e.mutable_sinusoidal()->set_num_positions(16384);
    e.mutable_sinusoidal()->set_d_model(1024);  // 64 MiB answer
    absl::StatusOr<v1::EncodeResponse> r = client->Encode(e);
    if (!r.ok()) EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  }
  for (auto& t : senders) t.join();

  const int64_t held_peak = peak.load();
  const size_t held_sessions = sessions.size();
  for (auto& s : sessions) EXPECT_TRUE(s->Close().ok());
  sessions.clear();
  // The server trims its allocator's free memory every health pass (2 s).
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  const int64_t after = RssBytes(server->pid());
  done = true;
  sampler.join();

  const int64_t gRPC_held = (kSenders + 1) * wire;
  const int64_t slack = 96 * kMiB;
  const int64_t bound = kBudget + baseline + gRPC_held + slack;
  std::printf(
      "memory: budget %.1f MiB, baseline RSS %.1f MiB, peak RSS %.1f MiB, after close %.1f MiB, "
      "bound %.1f MiB (budget + baseline + %d x %.1f MiB requests on the wire + %.0f MiB slack); "
      "%d Attends answered, %d refused, %zu sessions held\n",
      kBudget / double(kMiB), baseline / double(kMiB), held_peak / double(kMiB),
      after / double(kMiB), bound / double(kMiB), kSenders + 1, wire / double(kMiB),
      slack / double(kMiB), attends_ok.load(), attends_refused.load(), held_sessions);
  EXPECT_EQ(other_errors.load(), 0);
  EXPECT_GT(attends_ok.load(), 0);
  EXPECT_LE(held_peak, bound);
  // Closed sessions give their memory back to the system, not only to the
  // budget: within the slack of the baseline plus what the allocator keeps.
  EXPECT_LE(after, baseline + gRPC_held + slack);
  absl::StatusOr<v1::ServerInfo> info = client->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->memory_bytes_in_use(), 0);
  EXPECT_EQ(info->open_sessions(), 0);
}

}  // namespace
}  // namespace ropeattn::client
