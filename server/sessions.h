// Decoding sessions: a KV cache (or a linear-attention state) kept on the
// server between steps, with budgeted memory, random ids and idle reaping.
//
// Ownership and threading: the SessionManager owns sessions through
// shared_ptr; a stream or an operator call holds a reference while it works.
// Each Session has two locks (docs/scheduler.md): `mu_` serializes the
// operations on its state (a step holds it for the whole computation; a
// fork of the session holds it while copying), `meta_mu_` guards the
// metadata and is only ever held for a moment. Control calls (info, list,
// attach, detach, close, reaping) take `meta_mu_` only, so they never wait
// for a running step. Lock order: SessionManager::mu_ -> meta_mu_, and
// mu_ -> meta_mu_; never SessionManager::mu_ -> mu_.
// Nothing of one session is reachable from another: forks copy.
#ifndef ROPEATTN_SERVER_SESSIONS_H_
#define ROPEATTN_SERVER_SESSIONS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "core/decode_state.h"
#include "core/stop.h"
#include "core/tensor.h"
#include "ropeattn/v1/attention.pb.h"
#include "server/convert.h"
#include "server/cost.h"
#include "server/model.h"
#include "server/options.h"
#include "server/principal.h"

namespace ropeattn::server {

class Metrics;
struct SessionConfig;

// Bytes a SessionInfo of a session with this config and id takes in an
// answer (its spec, the id and every other field at its widest, and the
// repeated field's framing).
int64_t SessionInfoBytesBound(const SessionConfig& config, size_t id_size);
// Session ids are 32 hex digits.
inline constexpr size_t kMaxSessionIdBytes = 32;
// An answer's SessionInfo (its spec copied and serialized) up to this size
// is not held from the budget (as parsing's slack).
inline constexpr int64_t kInfoAnswerSlackBytes = int64_t{64} << 10;
// Memory an answer's SessionInfo about a session with this config takes:
// its spec copied (typed) and serialized.
int64_t InfoCopyBytes(const SessionConfig& config);
// The room a session reserves with its state for the answer to its close
// (InfoCopyBytes past kInfoAnswerSlackBytes, else 0): the close gives the
// session's memory back, so its answer cannot wait for free budget (a full
// budget must not keep a session from closing), and it may stay unread for
// up to --answer_timeout_seconds.
int64_t CloseAnswerRoomBytes(const SessionConfig& config);

// What a session is, resolved from OpenSession.
struct SessionConfig {
  ResolvedSpec spec;
  v1::AttentionSpec spec_proto;  // as opened, for SessionInfo
  int64_t spec_wire_bytes = 0;   // spec_proto's serialized size (SessionInfoBytesBound)
  // Charged with the session: spec_proto's SpaceUsedLong plus twice the
  // resolved spec's vectors (ResolvedHeapBytes: this config's and the
  // decode state's copy).
  int64_t spec_memory_bytes = 0;
  DType kv_dtype = DType::kF32;
  bool int8_kv = false;  // OpenSession.kv_dtype DTYPE_INT8 (kv_dtype is then f32)
  DType out_dtype = DType::kF32;
  bool linear = false;
  int64_t v_dim = 0;
  int64_t max_context = 0;
  int64_t start_position = 0;  // absolute position of the first token
  // Layer mode: steps carry hidden states for this model's layer.
  std::shared_ptr<const Model> model;
  int64_t layer = 0;
  // As asked at open; each session (a fork may differ) keeps its own copy.
  absl::Duration idle_ttl;
  bool resumable = false;
};

// The cost model's view of a session (server/cost.h): what it holds, and
// what a step of it costs.
SessionDims SessionDimsOf(const SessionConfig& config);
// The transient bytes of a one-token step at the session's last position
// (StepCost, f32 wire tensors), reserved with the session.
int64_t StepRoomBytes(const SessionConfig& config, int threads);
// The core's view of a session: what DecodeState computes with.
DecodeStateConfig StateConfigOf(const SessionConfig& config);
// Whether `config` can use length-dependent RoPE (dynamic NTK, LongRoPE).
bool LengthDependentRope(const SessionConfig& config);

class Session;

// One step of a session in core terms: the Decode handler translates the
// wire into these views (docs/scheduler.md, "The decode path").
struct StepInput {
  ConstTensorView q, k, v;  // sessions that take q/k/v
  ConstTensorView hidden;   // layer-mode sessions: [1, tokens, hidden_size]
};
// Where a step's answer goes: called at most once with the output's dtype
// and dims, returns the view the session writes it to (for the Decode
// handler, the answer message's own bytes).
using StepOutput = std::function<absl::StatusOr<TensorView>(DType, absl::Span<const int64_t>)>;

// The most tokens of a step that shares a batched pass with other sessions'
// steps (StepJoinsBatches, decode_wire.h). In layer mode such steps are
// projected by LinearRows, alone or together (the same bits either way);
// longer ones, which always run alone, by oneDNN's matmul.
inline constexpr int64_t kBatchStepMaxTokens = 16;

// One session's step in a pass of many (Session::StepMany).
struct SessionStep {
  Session* session = nullptr;
  StepInput in;
  StepOutput output;
  const StopToken* stop = nullptr;  // may be null; ends a long step between tiles
  absl::Status status;              // written
  int64_t position = 0;             // written: the session's length after an OK step
  int64_t tokens = 0;               // written: tokens appended by an OK step
};

class Session {
 public:
  ~Session();
  const std::string& id() const { return id_; }
  // The principal that opened (or forked) it: only it may use the session.
  const std::string& owner() const { return owner_; }
  const SessionConfig& config() const { return *config_; }
  bool resumable() const { return resumable_; }
  absl::Duration idle_ttl() const { return idle_ttl_; }

  // Steps of distinct sessions, computed as one parallel pass of `threads`
  // threads (each session's attention planned for `threads` as alone, so
  // its answer is bit-identical to a step run by itself). Each step appends
  // its tokens at the session's next positions and writes the attention
  // output (layer mode: projected). On error a session is unchanged:
  // FailedPrecondition if it was closed, OutOfRange past max_context,
  // InvalidArgument for malformed tensors.
  static void StepMany(absl::Span<SessionStep> steps, int threads);
  // Rolls back to `position` tokens (0 <= position <= current).
  absl::Status Truncate(int64_t position);
  // Fills the new, empty session with a KV prefix (DecodeState::Import;
  // `names` prefixes tensor names in errors). The session is unchanged on
  // error.
  absl::Status Import(ConstTensorView k, ConstTensorView v, DecodeState::KeyForm form,
                      const std::string& names);
  // Its keys (rotated) and values (DecodeState::Export).
  absl::StatusOr<DecodeState::Exported> Export();
  int64_t position() const;
  // The position without taking the session's lock (for pricing a step
  // while another operation may hold it); exact between operations.
  int64_t position_hint() const { return position_hint_.load(std::memory_order_relaxed); }
  // Budget held for the transient buffers of this session's one-token steps
  // (StepRoomBytes): a step needing no more is not charged again, so an
  // admitted session can always take a one-token step, however full the
  // budget is. A session runs one operation at a time.
  // The room is given back to the budget when the session ends (its state
  // is freed), even while a stream still holds the object; a room lent to
  // an operation goes back when the operation returns it.
  int64_t step_room() const { return step_room_bytes_; }
  // Lends the step room to the stream's operation for as long as its
  // buffers and its answer live (a step's answer may wait unread for
  // --answer_timeout_seconds, past a close of the session): empty if the
  // session has ended (its room was given back).
  MemoryBudget::Reservation LendStepRoom();
  // Takes a lent room back; released at once if the session ended
  // meanwhile.
  void ReturnStepRoom(MemoryBudget::Reservation room);
  // Bytes of session state charged to the memory budget.
  int64_t kv_bytes() const { return kv_bytes_; }
  void FillInfo(v1::SessionInfo* info) const;

 private:
  friend class SessionManager;
  Session(std::string id, std::string owner, std::shared_ptr<const SessionConfig> config,
          bool resumable, absl::Duration idle_ttl, MemoryBudget::Reservation held,
          int64_t quota_bytes);
  absl::Status Allocate();
  // Copies another session's history (a fork); both must share the config.
  absl::Status CopyStateFrom(Session& other);
  // Marks the session ended; later operations fail with `status`. Frees
  // the state (and gives its memory back to the budget) at once when no
  // operation runs, else the running one does so as it finishes. Never
  // waits for a step.
  void End(absl::Status status);
  // End's two halves: the mark (cheap, under the manager's lock) and the
  // freeing, which the manager does after releasing its lock (freeing a
  // 256 MiB cache takes milliseconds every control call would wait).
  void MarkEnded(absl::Status status);
  void FreeIfIdle();
  // An operation, once it released mu_: frees the state if the session was
  // ended meanwhile. A closer marks the session ended before it tries the
  // lock, so when its TryLock fails (the operation held mu_, or a spurious
  // failure because a thread was taking it), whoever held or took mu_ frees
  // the state here.
  void FreeIfEndedAfterOperation() ABSL_LOCKS_EXCLUDED(mu_);
  // Frees the state buffers and the budget hold.
  void FreeStateLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether End was called (the status it left).
  absl::Status Ended() const;
  // The parts of a step around the shared pass, under mu_.
  absl::Status BeginStepLocked(SessionStep& step, DecodeState::Job* job)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Layer mode: `projected` is the step's o_proj output (or its error).
  absl::Status EndStepLocked(SessionStep& step, const DecodeState::Job& job,
                             absl::StatusOr<Tensor> projected) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string id_;
  const std::string owner_;
  // The spec config_ keeps (for its SessionInfo), charged for as long as
  // this object holds the config (declared first: released after it): a
  // stream may hold a closed session's object, and with it the spec, until
  // the stream ends.
  MemoryBudget::Reservation spec_held_;
  const std::shared_ptr<const SessionConfig> config_;
  const bool resumable_;
  const absl::Duration idle_ttl_;
  const int64_t kv_bytes_;
  // Counted against the owner's quota: the full state, a fork's shared pages
  // included (a fork may come to hold all its pages alone, and every page is
  // paid by some session of the same owner), so the quota bounds what the
  // owner's sessions hold whatever they share.
  const int64_t quota_bytes_;
  // Set once, before the session is published; the reservation is released
  // with the state (FreeStateLocked), or by the operation it is lent to.
  int64_t step_room_bytes_ = 0;
  MemoryBudget::Reservation step_room_ ABSL_GUARDED_BY(meta_mu_);
  // CloseAnswerRoomBytes: taken by the close (SessionManager::Close), else
  // released with the state.
  MemoryBudget::Reservation answer_room_ ABSL_GUARDED_BY(meta_mu_);
  std::atomic<int64_t> position_hint_{0};
  // Bytes of the pages the state holds and of those shared with other
  // sessions, as of its last operation (read without the state's lock).
  std::atomic<int64_t> held_hint_{0}, shared_hint_{0};

  // The state's lock: held for a whole operation.
  mutable absl::Mutex mu_ ABSL_ACQUIRED_BEFORE(meta_mu_);
  // The session's reservation; its pages are paid from it (and outlive it
  // while a fork holds them). Released with the state.
  std::shared_ptr<class SessionPages> pages_ ABSL_GUARDED_BY(mu_);
  // Stores position_hint_, held_hint_ and shared_hint_ from the state.
  void NoteStateLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The computing state (KV or running sums, position, RoPE); empty once freed.
  std::optional<DecodeState> state_ ABSL_GUARDED_BY(mu_);
  // The metadata's lock: held for a moment, never while computing.
  mutable absl::Mutex meta_mu_;
  absl::Status ended_ ABSL_GUARDED_BY(meta_mu_);  // non-OK once closed or reaped
  bool attached_ ABSL_GUARDED_BY(meta_mu_) = false;
  absl::Time last_active_ ABSL_GUARDED_BY(meta_mu_);
  uint64_t steps_ ABSL_GUARDED_BY(meta_mu_) = 0;
};

// Ownership (docs/security.md): every call that names a session by id takes
// the caller's principal. A session of another principal answers exactly
// like an id that never existed (NotFound "unknown session id ..."), and the
// story of an ended session (expired, closed) is told to its owner only. An
// admin may Info, List and Close any session, never Attach another's.
// Per-principal quotas (options.principal_max_sessions and
// principal_memory_bytes) apply to authenticated principals.
class SessionManager {
 public:
  // `budget` (not owned) holds every session's state next to in-flight
  // requests' buffers.
  SessionManager(const ServerOptions& options, Metrics* metrics, MemoryBudget* budget);
  ~SessionManager();  // stops the reaper

  // A new session, attached to the calling stream. ResourceExhausted when
  // max_sessions are open or the memory budget cannot hold its state (the
  // message says how much it needs and how much is free); others keep
  // working.
  absl::StatusOr<std::shared_ptr<Session>> Open(std::shared_ptr<const SessionConfig> config,
                                                const Principal& owner);

  // The room a new session needs, a session slot and its held bytes (the
  // cost model's SessionOpenCost), reserved before anything is allocated or
  // queued: the stream reserves on the gRPC thread, then allocates on the
  // executor. A ticket dropped unused gives its room back.
  class Ticket {
   public:
    Ticket() = default;
    Ticket(Ticket&& other) noexcept { *this = std::move(other); }
    Ticket& operator=(Ticket&& other) noexcept;
    ~Ticket() { Release(); }
    bool valid() const { return manager_ != nullptr; }
    void Release();

   private:
    friend class SessionManager;
    SessionManager* manager_ = nullptr;
    std::shared_ptr<const SessionConfig> config_;
    bool resumable_ = false;
    absl::Duration ttl_;
    std::string owner_;
    MemoryBudget::Reservation held_;
    MemoryBudget::Reservation step_room_;  // becomes the session's step_room
    int64_t quota_bytes_ = 0;  // counted against the owner's quota
  };
  // ResourceExhausted (naming max_sessions, the memory budget, or the
  // owner's quota) when the room is not there. The new session will belong
  // to `owner`.
  absl::StatusOr<Ticket> Reserve(std::shared_ptr<const SessionConfig> config,
                                 const Principal& owner);
  absl::StatusOr<Ticket> ReserveFork(const std::shared_ptr<Session>& source, bool resumable,
                                     uint32_t idle_ttl_seconds, const Principal& owner);
  // Allocates a reserved session, attached to the caller.
  absl::StatusOr<std::shared_ptr<Session>> Open(Ticket ticket);
  // As above, but `prepare` (an open's KV prefix import) runs on the new
  // session before it is listed: no other call can see it, and nothing is
  // counted, until `prepare` succeeds. If it fails the session is discarded
  // (counted neither opened nor closed) and its status returned.
  absl::StatusOr<std::shared_ptr<Session>> Open(Ticket ticket,
                                                absl::FunctionRef<absl::Status(Session&)> prepare);
  absl::StatusOr<std::shared_ptr<Session>> Fork(const std::shared_ptr<Session>& source,
                                                Ticket ticket);
  // Re-attaches a resumable session. NotFound for an unknown id or one that
  // expired or was closed (the message says which); FailedPrecondition if it
  // is not resumable or another stream holds it.
  absl::StatusOr<std::shared_ptr<Session>> Attach(const std::string& id, const Principal& caller);
  // How the stream holding a session ended: a non-resumable session's
  // reason in ropeattn_sessions_closed_total.
  enum class StreamEnd {
    kEnded,      // "stream_ended": the stream ended normally
    kCancelled,  // "disconnected": cancelled or lost
    kShutdown,   // "shutdown": the server's drain ended it
  };
  // The stream holding the session ended (`end`): a non-resumable session is
  // freed at once, a resumable one stays until its idle TTL.
  void Detach(const std::shared_ptr<Session>& session, StreamEnd end);
  // Closes and frees a session (from the stream or an operator). The
  // answer's copies of `info` are paid from `answer`, room the session
  // reserved for them (CloseAnswerRoomBytes): the caller holds it until its
  // answer is written or dropped. A close never needs free budget.
  struct Closed {
    v1::SessionInfo info;
    MemoryBudget::Reservation answer;
  };
  absl::StatusOr<Closed> Close(const std::string& id, const std::string& reason,
                               const Principal& caller);
  // A copy of `source`'s history as a new session (attached to the caller).
  // The status `source` ended with (FailedPrecondition once closed, ...) if
  // it ended before or during the copy; the fork is listed and counted as
  // opened only once it holds the copy, so a refused one is neither.
  absl::StatusOr<std::shared_ptr<Session>> Fork(const std::shared_ptr<Session>& source,
                                                bool resumable, uint32_t idle_ttl_seconds,
                                                const Principal& owner);
  absl::StatusOr<v1::SessionInfo> Info(const std::string& id, const Principal& caller) const;
  // The caller's sessions (an admin: all), sorted by id.
  std::vector<v1::SessionInfo> List(const Principal& caller) const;
  // One page of ListSessions, planned before anything is copied: the ids of
  // the caller's sessions (an admin: all) after `after` in id order, at most
  // `max_count` of them (0: any number) whose SessionInfoBytesBound sum to at
  // most `max_bytes` (one at least), that sum, and whether more follow.
  struct ListPage {
    std::vector<std::string> ids;
    int64_t bytes = 0;   // serialized, at most (SessionInfoBytesBound)
    int64_t memory = 0;  // the typed copies of their SessionInfo
    bool more = false;
  };
  ListPage PlanList(const Principal& caller, const std::string& after, int64_t max_count,
                    int64_t max_bytes) const;
  // Memory a SessionInfo answer about session `id` takes (its spec copied and
  // serialized); 0 when the caller cannot see it.
  int64_t InfoAnswerBytes(const std::string& id, const Principal& caller) const;
  // The SessionInfo of those of `ids` that still exist, in order.
  std::vector<v1::SessionInfo> FillList(const std::vector<std::string>& ids,
                                        const Principal& caller) const;
  // Reaps detached sessions idle past their TTL now (the reaper thread calls
  // this). A session attached to a stream never expires; its TTL counts from
  // its detach or its last accepted operation, whichever is later.
  int ReapIdle(absl::Time now);
  // Frees every session (server shutdown).
  void CloseAll();

  int64_t kv_bytes_in_use() const;
  // What GetServerInfo reports to `caller`: every session for an admin or
  // without authentication, else only the caller's own (another
  // principal's sessions, their number and size, are not its business).
  struct Counts {
    int open = 0, attached = 0;
    int64_t kv_bytes = 0;
    uint64_t reaped = 0;  // sessions reaped since start
  };
  Counts CountsFor(const Principal& caller) const;
  int open_sessions() const;
  int attached_sessions() const;
  uint64_t reaped_total() const;

 private:
  // Reserves room for a session and creates it (allocating its memory
  // outside the manager's lock), attached to the caller.
  // `discount`: bytes of pages the new session will share (a fork's).
  absl::StatusOr<Ticket> ReserveRoom(std::shared_ptr<const SessionConfig> config, bool resumable,
                                     absl::Duration ttl, const Principal& owner,
                                     int64_t discount = 0);
  // Gives back a ticket's slot and bytes (a ticket not turned into a session).
  void ReleaseTicket(Ticket* ticket);
  absl::Duration ForkTtl(uint32_t idle_ttl_seconds) const;
  // Open in two halves: Allocate turns a ticket into a session with its
  // state, not yet listed (no other call can find it, nothing is counted as
  // opened, its slot still counts as reserved against --max_sessions); Enlist
  // lists it, attached, and counts it as opened; Discard gives back the slot
  // and the bytes of one allocated and never listed.
  // A fork's Enlist is given its `source`: if the source has ended (a
  // CloseSession during the copy), the fork is discarded instead and the
  // source's status returned, decided under the lock Close erases under.
  absl::StatusOr<std::shared_ptr<Session>> Allocate(Ticket ticket);
  absl::Status Enlist(const std::shared_ptr<Session>& session, const Session* source = nullptr);
  void Discard(const std::shared_ptr<Session>& session);
  void DiscardLocked(const Session& session) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The session with `id`, or NotFound for an unknown id, or the status an
  // ended one left behind (expired, closed, freed).
  // Another principal's session (unless `admin_may` and the caller is an
  // admin) is reported as unknown.
  absl::StatusOr<std::shared_ptr<Session>> FindLocked(const std::string& id,
                                                      const Principal& caller,
                                                      bool admin_may) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives back one session and `bytes` of an owner's quota usage.
  void UncountLocked(const std::string& owner, int64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes a session; `reason` is the metrics label, `ended` what later
  // callers of the id are told.
  // The session is marked ended and handed to `freed`, whose destructor
  // (run after the caller releases mu_: declare it before the lock) frees
  // its memory.
  class FreeAfterUnlock {
   public:
    FreeAfterUnlock() = default;
    FreeAfterUnlock(const FreeAfterUnlock&) = delete;
    FreeAfterUnlock& operator=(const FreeAfterUnlock&) = delete;
    ~FreeAfterUnlock();
    void Add(std::shared_ptr<Session> s) { sessions_.push_back(std::move(s)); }

   private:
    std::vector<std::shared_ptr<Session>> sessions_;
  };
  void EraseLocked(const std::string& id, absl::string_view reason, const absl::Status& ended,
                   FreeAfterUnlock* freed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string NewId();
  void PublishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ServerOptions options_;
  Metrics* const metrics_;
  MemoryBudget* const budget_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  int64_t kv_in_use_ ABSL_GUARDED_BY(mu_) = 0;  // held bytes of admitted sessions
  int reserved_sessions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reaped_ ABSL_GUARDED_BY(mu_) = 0;
  // Per owner (one entry per principal that ever had a session reaped).
  absl::flat_hash_map<std::string, uint64_t> reaped_by_owner_ ABSL_GUARDED_BY(mu_);
  // Recently ended ids, so a late caller learns "expired" or "closed" rather
  // than "unknown". Bounded.
  struct Ended {
    absl::Status status;
    std::string owner;
  };
  absl::flat_hash_map<std::string, Ended> ended_ ABSL_GUARDED_BY(mu_);
  // Sessions (reserved ones included) and held bytes per authenticated
  // owner, for the per-principal quotas.
  struct Usage {
    int sessions = 0;
    int64_t bytes = 0;
  };
  absl::flat_hash_map<std::string, Usage> usage_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> ended_order_ ABSL_GUARDED_BY(mu_);
  absl::Notification stop_;
  std::thread reaper_;
};

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_SESSIONS_H_
