// Decode: a sequence of stream operations on one SessionManager, as the
// server's DecodeReactor runs them (server/service.cc: Admit prices and
// reserves on the gRPC thread, Process runs on the executor), without gRPC.
//
// Input: up to kMaxOps records, each
//   ctl      1 byte   bits 0-1: the stream (4 streams, one session each at
//                     most); bit 2: the client ends the stream after this
//                     operation (half-close), bit 3: ...by cancelling it;
//                     bit 4: the reaper runs afterwards, 2 h in the future;
//                     bit 5: an operator closes (CloseSession) the session of
//                     the next stream afterwards
//   length   2 bytes  little-endian
//   message  length bytes, a serialized ropeattn.v1.DecodeRequest (one that
//                     does not parse is skipped)
// A stream that ended starts afresh with its next record. An
// attach.session_id of one or two digits, k, names the k-th session this
// input opened or forked (ids are random). At the end every stream ends and
// the manager closes whatever is left. Each input gets a fresh SessionManager.
//
// Checked after every operation: no crash or sanitizer finding; refusals and
// failed operations never INTERNAL/UNKNOWN; a cost refusal is
// RESOURCE_EXHAUSTED; an OK step answer fits its priced reply size, is
// [1, T, H, Dv] (layer mode [1, T, hidden]) of the session's out dtype with
// finite values, and advances the position by T; heap growth stays within
// a step's priced transient bytes and an open's or fork's priced held bytes
// (plus a fixed slack); the memory budget in use equals the session state
// the manager holds, which equals the sum over its sessions; sessions never
// exceed max_sessions; the reaper never takes a session a stream holds, and
// takes every detached one idle past its TTL; at the end, nothing is left
// in the budget.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "core/status_macros.h"
#include "server/decode_wire.h"
#include "server/layer.h"
#include "server/sessions.h"
#include "tests/fuzz/fuzz_util.h"

namespace ropeattn::fuzz {
namespace {

using server::Session;
using server::SessionManager;
// One anonymous caller (ownership is exercised by tests/server/security_test.cc).
const server::Principal kCaller{};

constexpr int kStreams = 4;
constexpr int kMaxOps = 64;

struct World {
  server::ServerOptions options = FuzzServerOptions();
  server::CostLimits limits = FuzzLimits();
  server::MemoryBudget budget{kBudgetBytes};
  SessionManager sessions{options, nullptr, &budget};
};


// One Decode stream: DecodeReactor's state.
struct Stream {
  std::shared_ptr<Session> session;
  SessionManager::Ticket ticket;
  std::shared_ptr<const server::SessionConfig> open_config;  // what `ticket` is for
  server::MemoryBudget::Reservation op_memory;
  bool finished = false;
  bool close_after_write = false;
  bool cancelled = false;
};

class Driver {
 public:
  explicit Driver(World& w) : w_(w) {}

  void Run(const uint8_t* data, size_t size) {
    size_t pos = 0;
    for (int op = 0; op < kMaxOps && pos + 3 <= size; ++op) {
      const uint8_t ctl = data[pos];
      const size_t len = data[pos + 1] | (static_cast<size_t>(data[pos + 2]) << 8);
      pos += 3;
      const size_t take = std::min(len, size - pos);
      v1::DecodeRequest request;
      const bool parsed = request.ParseFromArray(data + pos, static_cast<int>(take));
      pos += take;
      Stream& s = streams_[ctl & 3];
      if (s.finished) s = Stream();  // a new stream
      if (parsed) {
        MapIds(&request);
        Operate(s, request);
        if ((ctl & 4) && !s.finished) {
          s.cancelled = (ctl & 8) != 0;
          FinishOnce(s);
        }
      }
      if (ctl & 32) OperatorClose(streams_[((ctl & 3) + 1) % kStreams]);
      if (ctl & 16) Reap();
      CheckBooks();
    }
    for (Stream& s : streams_) FinishOnce(s);
    w_.sessions.CloseAll();
    FUZZ_CHECK(w_.sessions.open_sessions() == 0, "sessions left after CloseAll");
    FUZZ_CHECK(w_.sessions.kv_bytes_in_use() == 0,
               std::to_string(w_.sessions.kv_bytes_in_use()) + " KV bytes left after CloseAll");
    FUZZ_CHECK(w_.budget.in_use() == 0,
               std::to_string(w_.budget.in_use()) + " budget bytes left after CloseAll");
  }

 private:
  // "k" -> the k-th session id this input saw.
  void MapIds(v1::DecodeRequest* r) {
    if (!r->has_attach()) return;
    const std::string& id = r->attach().session_id();
    int k = 0;
    if (id.size() >= 1 && id.size() <= 2 && absl::ascii_isdigit(id[0]) &&
        absl::SimpleAtoi(id, &k) && k >= 0 && k < static_cast<int>(ids_.size())) {
      r->mutable_attach()->set_session_id(ids_[k]);
    }
  }

  // DecodeReactor::Admit.
  absl::Status Admit(Stream& s, const v1::DecodeRequest& r, server::Cost* step_cost) {
    if (r.has_open() && s.session == nullptr) {
      RA_ASSIGN_OR_RETURN(server::SessionConfig config,
                          server::ResolveOpenSession(r.open(), w_.options, DemoRegistry()));
      s.open_config = std::make_shared<const server::SessionConfig>(std::move(config));
      if (r.open().has_prefix()) {
        RA_ASSIGN_OR_RETURN(const server::WireShape k,
                            server::ParseWireShape(r.open().prefix().k(), "open.prefix.k"));
        RA_ASSIGN_OR_RETURN(const server::WireShape v,
                            server::ParseWireShape(r.open().prefix().v(), "open.prefix.v"));
        RA_ASSIGN_OR_RETURN(s.op_memory,
                            w_.budget.Reserve(SatMul(SatAdd(k.elements, v.elements), 8),
                                              "this session's KV prefix"));
      }
      RA_ASSIGN_OR_RETURN(s.ticket, w_.sessions.Reserve(s.open_config, kCaller));
      return absl::OkStatus();
    }
    if (r.has_export_kv() && s.session != nullptr) {
      *step_cost = server::PriceExport(s.session->config(), s.session->position_hint());
      if (absl::Status st = server::CheckCost(*step_cost, w_.limits, "Decode.Export"); !st.ok()) {
        CheckCostRefusal(st);
        return st;
      }
      RA_ASSIGN_OR_RETURN(s.op_memory,
                          w_.budget.Reserve(step_cost->transient_bytes, "this KV export"));
      return absl::OkStatus();
    }
    if (r.has_fork() && s.session != nullptr) {
      RA_ASSIGN_OR_RETURN(s.ticket, w_.sessions.ReserveFork(s.session, /*resumable=*/true,
                                                            r.fork().idle_ttl_seconds(),
                                                            kCaller));
      return absl::OkStatus();
    }
    if (r.has_step() && s.session != nullptr) {
      const server::SessionConfig& c = s.session->config();
      RA_ASSIGN_OR_RETURN(*step_cost, server::PriceStep(c, r.step(), s.session->position_hint(),
                                                        w_.options.threads_per_call));
      if (absl::Status st = server::CheckCost(*step_cost, w_.limits, "Decode.Step"); !st.ok()) {
        CheckCostRefusal(st);
        return st;
      }
      absl::StatusOr<server::MemoryBudget::Reservation> held =
          w_.budget.Reserve(step_cost->transient_bytes, "this decode step");
      if (!held.ok()) {
        CheckCostRefusal(held.status());
        return held.status();
      }
      s.op_memory = *std::move(held);
    }
    return absl::OkStatus();
  }

  void FinishOnce(Stream& s) {
    if (s.finished) return;
    s.finished = true;
    if (s.session != nullptr) {
      w_.sessions.Detach(s.session, s.cancelled ? SessionManager::StreamEnd::kCancelled
                                                : SessionManager::StreamEnd::kEnded);
      s.session.reset();
    }
    s.ticket.Release();
    s.op_memory.Release();
  }

  void Operate(Stream& s, const v1::DecodeRequest& r) {
    server::Cost step_cost;
    if (absl::Status admitted = Admit(s, r, &step_cost); !admitted.ok()) {
      CheckRefusal(admitted);
      // Refuse(): in-band for a stream with a session, the stream's status
      // otherwise.
      if (s.session == nullptr) FinishOnce(s);
      return;
    }
    Process(s, r, step_cost);
    s.op_memory.Release();  // OnWriteDone
    if (s.close_after_write) FinishOnce(s);
  }

  // DecodeReactor::Process, with the answer checked.
  void Process(Stream& s, const v1::DecodeRequest& r, const server::Cost& step_cost) {
    v1::DecodeResponse response;
    absl::Status status;
    bool stream_fatal = false;
    switch (r.msg_case()) {
      case v1::DecodeRequest::kOpen:
      case v1::DecodeRequest::kAttach: {
        if (s.session != nullptr) {
          status = absl::FailedPreconditionError("this stream already holds a session");
          break;
        }
        absl::StatusOr<std::shared_ptr<Session>> opened;
        if (r.has_open()) {
          const int64_t held = s.open_config ? HeldBytes(*s.open_config) : 0;
          s.open_config.reset();
          HeapMeter::Start();
          opened = w_.sessions.Open(std::move(s.ticket));
          HeapMeter::Check(held, "Decode.Open");
          if (opened.ok()) CheckHeld(**opened);
        } else {
          opened = w_.sessions.Attach(r.attach().session_id(), kCaller);
        }
        if (!opened.ok()) {
          status = opened.status();
          stream_fatal = true;
          break;
        }
        s.session = *std::move(opened);
        if (r.has_open() && r.open().has_prefix()) {
          absl::StatusOr<server::WirePrefix> prefix = server::PrefixFromProto(r.open().prefix());
          status = prefix.ok() ? s.session->Import(prefix->k, prefix->v, prefix->form,
                                                   "open.prefix.")
                               : prefix.status();
          if (!status.ok()) {
            (void)w_.sessions.Close(s.session->id(), "its prefix was refused", kCaller);
            stream_fatal = true;
            break;
          }
          FUZZ_CHECK(s.session->position() == r.open().prefix().k().shape(1),
                     "an imported prefix left another position");
        }
        if (r.has_open()) ids_.push_back(s.session->id());
        s.session->FillInfo(response.mutable_opened());
        FUZZ_CHECK(response.opened().attached(), "an opened or attached session is not attached");
        break;
      }
      case v1::DecodeRequest::kStep:
      case v1::DecodeRequest::kTruncate:
      case v1::DecodeRequest::kFork:
      case v1::DecodeRequest::kClose:
      case v1::DecodeRequest::kExportKv: {
        if (s.session == nullptr) {
          status = absl::InvalidArgumentError("the first message must be open or attach");
          stream_fatal = true;
          break;
        }
        if (r.has_step()) {
          const int64_t before = s.session->position();
          HeapMeter::Start();
          status = server::StepFromProto(*s.session, r.step(), w_.options.threads_per_call,
                                         nullptr, response.mutable_step());
          HeapMeter::Check(step_cost.transient_bytes, "Decode.Step");
          if (status.ok()) CheckStep(*s.session, r.step(), response, step_cost, before);
        } else if (r.has_truncate()) {
          status = s.session->Truncate(r.truncate().position());
          if (status.ok()) {
            s.session->FillInfo(response.mutable_truncated());
            FUZZ_CHECK(response.truncated().position() == r.truncate().position(),
                       "truncate left another position");
          }
        } else if (r.has_export_kv()) {
          HeapMeter::Start();
          absl::StatusOr<DecodeState::Exported> kv = s.session->Export();
          status = kv.status();
          if (kv.ok()) {
            server::TensorToProto(kv->k.cview(), response.mutable_exported()->mutable_k());
            server::TensorToProto(kv->v.cview(), response.mutable_exported()->mutable_v());
            FUZZ_CHECK(static_cast<int64_t>(response.ByteSizeLong()) <= step_cost.reply_bytes,
                       "an export's answer is larger than its price");
          }
          HeapMeter::Check(step_cost.transient_bytes, "Decode.Export");
        } else if (r.has_fork()) {
          const int64_t held = HeldBytes(s.session->config());
          const int64_t source_position = s.session->position();
          HeapMeter::Start();
          auto fork = w_.sessions.Fork(s.session, std::move(s.ticket));
          HeapMeter::Check(held, "Decode.Fork");
          status = fork.status();
          if (fork.ok()) {
            CheckHeld(**fork, source_position);
            FUZZ_CHECK((*fork)->position() == s.session->position(),
                       "a fork does not start at its parent's position");
            w_.sessions.Detach(*fork, SessionManager::StreamEnd::kEnded);
            (*fork)->FillInfo(response.mutable_forked());
            ids_.push_back((*fork)->id());
          }
        } else {
          auto info = w_.sessions.Close(s.session->id(), "closed", kCaller);
          status = info.status();
          if (info.ok()) s.close_after_write = true;
        }
        if (!status.ok() && s.session != nullptr &&
            (status.code() == absl::StatusCode::kNotFound ||
             status.code() == absl::StatusCode::kUnavailable ||
             (status.code() == absl::StatusCode::kFailedPrecondition &&
              absl::StrContains(status.message(), "was closed")))) {
          stream_fatal = true;
        }
        break;
      }
      default:
        status = absl::InvalidArgumentError("DecodeRequest.msg is not set");
        stream_fatal = s.session == nullptr;
        break;
    }
    if (!status.ok()) {
      CheckRefusal(status);
      if (stream_fatal) FinishOnce(s);
    } else {
      Note(v1::DecodeRequest::descriptor()->FindFieldByNumber(r.msg_case())->name().c_str(),
           status);
    }
  }

  // The session state a config holds, as the cost model prices it (what
  // its ticket reserved).
  static int64_t HeldBytes(const server::SessionConfig& config) {
    // The state, and the spec it keeps for its SessionInfo.
    return server::SessionOpenCost(server::SessionDimsOf(config)).held_bytes +
           config.spec_memory_bytes;
  }

  // `shared_tokens`: a fork's source position (its full pages are shared
  // and not charged again, except under a length-dependent rule).
  void CheckHeld(const Session& session, int64_t shared_tokens = 0) {
    const server::SessionDims d = server::SessionDimsOf(session.config());
    const server::Cost cost = server::SessionOpenCost(d);
    const int64_t page = server::KvPageBytes(d);
    const int64_t per_page = std::max<int64_t>(1, server::KvPageTokens(d));
    // The spec it keeps and the room for its close's answer.
    const int64_t spec = session.config().spec_memory_bytes +
                         server::CloseAnswerRoomBytes(session.config());
    const int64_t fixed =
        cost.held_bytes - (d.max_context + per_page - 1) / per_page * page + spec;
    const int64_t discount = d.rope_length_dependent ? 0 : shared_tokens / per_page * page;
    const int64_t want = std::max(fixed, cost.held_bytes + spec - discount);
    FUZZ_CHECK(session.kv_bytes() == want,
               "a session holds " + std::to_string(session.kv_bytes()) +
                   " budget bytes, its cost is " + std::to_string(want));
  }

  void CheckStep(const Session& session, const v1::Step& step, const v1::DecodeResponse& response,
                 const server::Cost& cost, int64_t before) {
    const server::SessionConfig& c = session.config();
    const v1::StepResult& result = response.step();
    CheckReplySize(response, cost);
    CheckAnswerTensor(result.out(), "step.out");
    const v1::Tensor& out = result.out();
    const int64_t tokens = c.model ? step.hidden().shape(1) : step.q().shape(1);
    FUZZ_CHECK(result.position() == before + tokens && session.position() == before + tokens,
               "a step did not advance the position by its tokens");
    FUZZ_CHECK(result.position() <= c.max_context, "a session past its max_context");
    FUZZ_CHECK(out.dtype() == DTypeToProtoOf(c.out_dtype), "step.out dtype");
    if (c.model) {
      FUZZ_CHECK(out.shape_size() == 3 && out.shape(0) == 1 && out.shape(1) == tokens &&
                     out.shape(2) == c.model->config().hidden_size,
                 "layer step.out is not [1, T, hidden]");
    } else {
      FUZZ_CHECK(out.shape_size() == 4 && out.shape(0) == 1 && out.shape(1) == tokens &&
                     out.shape(2) == c.spec.heads && out.shape(3) == c.v_dim,
                 "step.out is not [1, T, H, Dv]");
    }
  }

  static v1::DType DTypeToProtoOf(DType d) {
    return d == DType::kF32 ? v1::DTYPE_F32 : v1::DTYPE_BF16;
  }

  void OperatorClose(Stream& s) {
    if (s.session == nullptr) return;
    auto info = w_.sessions.Close(s.session->id(), "closed", kCaller);
    if (!info.ok()) CheckRefusal(info.status());
  }

  // The reaper, far in the future: every detached session is past its TTL
  // (at most max_idle_ttl_seconds); no session a stream holds may go.
  void Reap() {
    std::vector<std::string> held;
    for (const Stream& s : streams_) {
      if (s.session != nullptr && w_.sessions.Info(s.session->id(), kCaller).ok()) {
        held.push_back(s.session->id());
      }
    }
    w_.sessions.ReapIdle(absl::Now() + absl::Hours(2));
    for (const std::string& id : held) {
      absl::StatusOr<v1::SessionInfo> info = w_.sessions.Info(id, kCaller);
      FUZZ_CHECK(info.ok(), "the reaper took a session a stream holds: " + info.status().ToString());
      FUZZ_CHECK(info->attached(), "a session a stream holds is not attached");
    }
    FUZZ_CHECK(w_.sessions.open_sessions() == static_cast<int>(held.size()),
               "detached sessions past their TTL survived the reaper");
  }

  // The budget holds the admitted sessions' reservations and step rooms
  // (nothing else is outstanding between operations), their sum over
  // sessions, plus at most
  // the pages alive past those reservations (borrowed by a fork that
  // rewrote what it shared, or a closed session's pages a fork still
  // holds): never more than the pages the open sessions hold, and, once
  // every session is closed, only the specs of closed sessions a stream
  // still holds (the object keeps its config, charged until it goes).
  void CheckBooks() {
    const int64_t kv = w_.sessions.kv_bytes_in_use();
    const int64_t in_use = w_.budget.in_use();
    FUZZ_CHECK(in_use <= w_.budget.budget(), "budget overdrawn");
    int64_t sum = 0, held = 0, rooms = 0, kept = 0;
    const std::vector<v1::SessionInfo> list = w_.sessions.List(kCaller);
    for (const Stream& s : streams_) {
      if (s.session == nullptr) continue;
      const bool listed = std::any_of(list.begin(), list.end(), [&](const v1::SessionInfo& i) {
        return i.session_id() == s.session->id();
      });
      if (!listed) kept += s.session->config().spec_memory_bytes;
    }
    for (const v1::SessionInfo& info : list) {
      sum += info.kv_bytes();
      held += info.kv_bytes_held();
      rooms += info.step_room_bytes();
      FUZZ_CHECK(info.step_room_bytes() > 0, "a session without a step room");
      FUZZ_CHECK(info.position() >= 0 && info.position() <= info.max_context(),
                 "a session's position outside [0, max_context]");
      FUZZ_CHECK(info.kv_bytes_shared() >= 0 && info.kv_bytes_shared() <= info.kv_bytes_held(),
                 "a session shares more than it holds");
    }
    FUZZ_CHECK(sum == kv, "kv_bytes_in_use " + std::to_string(kv) + " != sum over sessions " +
                              std::to_string(sum));
    FUZZ_CHECK(in_use >= kv + rooms, "budget in use " + std::to_string(in_use) +
                                         " < session state " + std::to_string(kv) +
                                         " + step rooms " + std::to_string(rooms));
    FUZZ_CHECK(in_use <= kv + rooms + held + kept,
               "budget in use " + std::to_string(in_use) + " > reservations " +
                   std::to_string(kv) + " + step rooms " + std::to_string(rooms) +
                   " + pages held " + std::to_string(held) + " + closed sessions' specs " +
                   std::to_string(kept));
    if (list.empty()) {
      FUZZ_CHECK(in_use == kept, "the budget kept bytes after every session closed");
    }
    FUZZ_CHECK(static_cast<int>(list.size()) <= w_.options.max_sessions, "past max_sessions");
  }

  World& w_;
  Stream streams_[kStreams];
  std::vector<std::string> ids_;
};

}  // namespace
}  // namespace ropeattn::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ropeattn::fuzz::InitTarget();
  ropeattn::fuzz::DemoRegistry();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A fresh manager per input: inputs do not see each other's sessions, and
  // everything an input allocated is freed when it ends (libFuzzer runs a
  // leak scan after any input that frees less than it allocated).
  ropeattn::fuzz::World world;
  ropeattn::fuzz::Driver(world).Run(data, size);
  return 0;
}
