#include "server/sessions.h"

#include <cmath>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/limits.h"
#include "core/status_macros.h"
#include "server/layer.h"
#include "server/log.h"
#include "server/metrics.h"

namespace ropeattn::server {
namespace {

constexpr size_t kMaxEndedIds = 4096;

}  // namespace

bool LengthDependentRope(const SessionConfig& c) {
  return DecodeState::RopeIsLengthDependent(c.spec.rope);
}

DecodeStateConfig StateConfigOf(const SessionConfig& c) {
  DecodeStateConfig d;
  d.heads = c.spec.heads;
  d.kv_heads = c.spec.kv_heads;
  d.head_dim = c.spec.head_dim;
  d.v_dim = c.v_dim;
  d.max_context = c.max_context;
  d.start_position = c.start_position;
  d.kv_dtype = c.kv_dtype;
  d.int8_kv = c.int8_kv;
  d.linear = c.linear;
  d.rope = c.spec.rope;
  d.attention = c.spec.options;
  return d;
}

SessionDims SessionDimsOf(const SessionConfig& c) {
  SessionDims d;
  d.linear = c.linear;
  d.kv_cache_layout = DecodeState::IsTiles(DecodeState::StorageFor(StateConfigOf(c)));
  d.kv_heads = c.spec.kv_heads;
  d.head_dim = c.spec.head_dim;
  d.v_dim = c.v_dim;
  d.max_context = c.max_context;
  d.kv_dtype = c.kv_dtype;
  d.int8_kv = c.int8_kv;
  d.window = c.spec.options.window;
  d.start_position = c.start_position;
  if (c.spec.rope) {
    d.rope_rotary_dim = c.spec.rope->effective_rotary_dim();
    d.rope_length_dependent = LengthDependentRope(c);
  }
  return d;
}

int64_t StepRoomBytes(const SessionConfig& c, int threads) {
  StepDims d;
  d.tokens = 1;
  d.position = std::max<int64_t>(c.max_context - 1, 0);
  d.heads = c.spec.heads;
  d.out_dtype = c.out_dtype;
  d.threads = threads;
  if (c.model) {
    d.hidden = c.model->config().hidden_size;
    d.wire_bytes = SatMul(d.hidden, 4);
  } else {
    d.wire_bytes = SatMul(SatAdd(SatMul(c.spec.heads, c.spec.head_dim),
                                 SatMul(c.spec.kv_heads, SatAdd(c.spec.head_dim, c.v_dim))),
                          4);
  }
  return StepCost(SessionDimsOf(c), d).transient_bytes;
}

int64_t InfoCopyBytes(const SessionConfig& c) {
  return SatAdd(c.spec_memory_bytes, c.spec_wire_bytes);
}

int64_t CloseAnswerRoomBytes(const SessionConfig& c) {
  const int64_t bytes = InfoCopyBytes(c);
  return bytes > kInfoAnswerSlackBytes ? bytes : 0;
}

// ------------------------------------------------------------- Session --

// A session's reservation, which its KV pages are paid from
// (docs/kv-memory.md). `fixed` of it is the state's other parts (RoPE table,
// raw keys); the rest pays for pages. A page beyond it (a fork that rewrote
// the part it shared, a session whose old pages a fork still holds) is
// borrowed from the budget, and given back when freed. A freed page returns
// to the reservation while the session lives; once it has ended, the
// reservation shrinks to the pages still alive in forks.
class SessionPages final : public KvPageCharger {
 public:
  SessionPages(MemoryBudget::Reservation held, int64_t fixed)
      : floor_(held.bytes()), fixed_(std::min(fixed, held.bytes())), held_(std::move(held)) {}

  absl::Status Charge(int64_t bytes) override {
    absl::MutexLock lock(&mu_);
    const int64_t free = held_.bytes() - fixed_ - live_;
    if (bytes > free) {
      RA_RETURN_IF_ERROR(held_.Grow(
          bytes - free, "a KV page beyond the session's reservation (a fork rewriting pages it "
                        "shared, or a session whose earlier pages a fork still holds)"));
    }
    live_ += bytes;
    return absl::OkStatus();
  }
  void Refund(int64_t bytes) override {
    absl::MutexLock lock(&mu_);
    live_ -= bytes;
    Trim();
  }
  // The session ended: its state is freed; keep only its pages forks hold.
  void End() {
    absl::MutexLock lock(&mu_);
    ended_ = true;
    Trim();
  }

 private:
  void Trim() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t keep = ended_ ? live_ : std::max(floor_, fixed_ + live_);
    if (held_.bytes() > keep) held_.Shrink(held_.bytes() - keep);
  }

  absl::Mutex mu_;
  const int64_t floor_, fixed_;
  MemoryBudget::Reservation held_ ABSL_GUARDED_BY(mu_);
  int64_t live_ ABSL_GUARDED_BY(mu_) = 0;  // bytes of live pages paid from held_
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

namespace {

// The reserved bytes of a session's state that are not pages (the spec it
// keeps and the room for its close's answer are held apart).
int64_t FixedBytes(const SessionConfig& c) {
  const SessionDims d = SessionDimsOf(c);
  const int64_t per_page = std::max<int64_t>(1, KvPageTokens(d));
  const int64_t pages = (d.max_context + per_page - 1) / per_page;
  // Saturating: a priced size can be "more than int64" (KvPageBytes), which
  // only a budget of that size would have let open.
  return std::max<int64_t>(0, SessionOpenCost(d).held_bytes - SatMul(pages, KvPageBytes(d)));
}

// What a session holds beside its state: the spec it keeps and the room
// for its close's answer.
int64_t KeptBytes(const SessionConfig& c) {
  return SatAdd(c.spec_memory_bytes, CloseAnswerRoomBytes(c));
}

}  // namespace

Session::Session(std::string id, std::string owner, std::shared_ptr<const SessionConfig> config,
                 bool resumable, absl::Duration idle_ttl, MemoryBudget::Reservation held,
                 int64_t quota_bytes)
    : id_(std::move(id)),
      owner_(std::move(owner)),
      config_(std::move(config)),
      resumable_(resumable),
      idle_ttl_(idle_ttl),
      kv_bytes_(held.bytes()),
      quota_bytes_(quota_bytes) {
  // The reservation covers the state, the kept spec and the close's answer
  // room (ReserveRoom): the last two are held apart.
  spec_held_ = held.Split(config_->spec_memory_bytes);
  MemoryBudget::Reservation answer_room = held.Split(CloseAnswerRoomBytes(*config_));
  const int64_t fixed = FixedBytes(*config_);
  {
    absl::MutexLock lock(&mu_);
    pages_ = std::make_shared<SessionPages>(std::move(held), fixed);
  }
  absl::MutexLock lock(&meta_mu_);
  answer_room_ = std::move(answer_room);
  last_active_ = absl::Now();
}

absl::Status Session::Allocate() {
  absl::MutexLock lock(&mu_);
  RA_ASSIGN_OR_RETURN(DecodeState state, DecodeState::Create(StateConfigOf(*config_)));
  state_.emplace(std::move(state));
  state_->set_page_charger(pages_);
  return absl::OkStatus();
}

void Session::NoteStateLocked() {
  if (!state_) return;
  position_hint_.store(state_->position(), std::memory_order_relaxed);
  held_hint_.store(state_->byte_size(), std::memory_order_relaxed);
  shared_hint_.store(state_->shared_bytes(), std::memory_order_relaxed);
}

absl::Status Session::CopyStateFrom(Session& other) {
  // Either closed while this ran (or while the fork waited for its source):
  // the closer left its state to be freed here, once the locks are released.
  const absl::Cleanup free_if_ended = [this, &other] {
    other.FreeIfEndedAfterOperation();
    FreeIfEndedAfterOperation();
  };
  absl::MutexLock other_lock(&other.mu_);
  RA_RETURN_IF_ERROR(other.Ended());
  absl::MutexLock lock(&mu_);
  if (!state_ || !other.state_) return absl::InternalError("a fork found a freed session state");
  RA_RETURN_IF_ERROR(state_->CopyFrom(*other.state_));
  NoteStateLocked();
  other.NoteStateLocked();
  return absl::OkStatus();
}

void Session::End(absl::Status status) {
  MarkEnded(std::move(status));
  FreeIfIdle();
}

void Session::MarkEnded(absl::Status status) {
  absl::MutexLock lock(&meta_mu_);
  if (ended_.ok()) ended_ = std::move(status);
}

void Session::FreeIfIdle() {
  // Free the memory now if no operation holds the state; the object may
  // live on in a stream's reference. A running operation frees it as it
  // finishes (it checks Ended() once it released the lock:
  // FreeIfEndedAfterOperation).
  if (mu_.TryLock()) {
    FreeStateLocked();
    mu_.Unlock();
  }
}

void Session::FreeIfEndedAfterOperation() {
  if (Ended().ok()) return;
  // Blocking, but never for long: whoever holds mu_ now is a closer freeing
  // the state or another operation of this session (one at a time, from its
  // stream), which ends at once on an ended session.
  absl::MutexLock lock(&mu_);
  FreeStateLocked();
}

MemoryBudget::Reservation Session::LendStepRoom() {
  absl::MutexLock lock(&meta_mu_);
  if (!ended_.ok()) return MemoryBudget::Reservation();
  return std::move(step_room_);
}

void Session::ReturnStepRoom(MemoryBudget::Reservation room) {
  {
    absl::MutexLock lock(&meta_mu_);
    // Ended: the state was (or is being) freed, and the room with it.
    if (ended_.ok() && step_room_.bytes() == 0) {
      step_room_ = std::move(room);
      return;
    }
  }
  room.Release();
}

SessionManager::FreeAfterUnlock::~FreeAfterUnlock() {
  for (const std::shared_ptr<Session>& s : sessions_) s->FreeIfIdle();
}

// A session dropped without FreeStateLocked (the last reference went while
// an operation held the state): its reservation shrinks to the pages forks
// still hold. No lock: whoever held mu_ held a reference, so nobody does
// now (and the last reference may go under the manager's lock).
Session::~Session() ABSL_NO_THREAD_SAFETY_ANALYSIS { FreeStateLocked(); }

void Session::FreeStateLocked() {
  state_.reset();
  if (pages_) pages_->End();
  pages_.reset();
  MemoryBudget::Reservation room, answer;  // released once meta_mu_ is
  {
    absl::MutexLock lock(&meta_mu_);
    room = std::move(step_room_);
    answer = std::move(answer_room_);
  }
  held_hint_.store(0, std::memory_order_relaxed);
  shared_hint_.store(0, std::memory_order_relaxed);
}

absl::Status Session::Ended() const {
  absl::MutexLock lock(&meta_mu_);
  return ended_;
}

int64_t Session::position() const { return position_hint_.load(std::memory_order_relaxed); }

absl::Status Session::BeginStepLocked(SessionStep& step, DecodeState::Job* job) {
  {
    absl::MutexLock meta(&meta_mu_);
    RA_RETURN_IF_ERROR(ended_);
    last_active_ = absl::Now();
  }
  if (!state_) return absl::FailedPreconditionError("the session's state was freed");
  const SessionConfig& c = *config_;
  job->state = &*state_;
  job->stop = step.stop;
  job->names = "step.";
  if (c.model) {
    // Layer mode: the hidden states, checked here; StepMany projects them
    // with the layer's weights, together with the pass's other steps of
    // the same layer.
    const ConstTensorView& hidden = step.in.hidden;
    const int64_t hs = c.model->config().hidden_size;
    if (hidden.rank() != 3 || hidden.dim(0) != 1 || hidden.dim(1) < 1 || hidden.dim(2) != hs) {
      return absl::InvalidArgumentError(
          absl::StrFormat("step.hidden must have shape [1, tokens >= 1, %d], got %s", hs,
                          DimsToString(hidden.dims())));
    }
    RA_RETURN_IF_ERROR(CheckFinite(hidden, "step.hidden"));
    if (hidden.dim(1) > c.max_context - state_->position()) {
      return absl::OutOfRangeError(absl::StrFormat(
          "a step of %d tokens at position %d would exceed the session's max_context of %d",
          hidden.dim(1), state_->position(), c.max_context));
    }
    RA_RETURN_IF_ERROR(CheckTablePositions(c.model->config(),
                                           c.start_position + state_->position() + hidden.dim(1),
                                           "step.hidden"));
    return absl::OkStatus();
  }
  job->q = step.in.q;
  job->k = step.in.k;
  job->v = step.in.v;
  // The answer's own bytes, when the step can be computed at all (else the
  // core names what is wrong before it looks at the output).
  const ConstTensorView& q = step.in.q;
  if (q.rank() == 4 && q.dim(1) >= 1 && q.dim(1) <= c.max_context - state_->position()) {
    const int64_t dims[4] = {1, q.dim(1), c.spec.heads, c.v_dim};
    RA_ASSIGN_OR_RETURN(job->out, step.output(c.out_dtype, dims));
  }
  return absl::OkStatus();
}

absl::Status Session::EndStepLocked(SessionStep& step, const DecodeState::Job& job,
                                    absl::StatusOr<Tensor> projected) {
  RA_RETURN_IF_ERROR(job.status);
  const SessionConfig& c = *config_;
  if (c.model) {
    if (projected.ok() && c.out_dtype != DType::kF32) {
      projected = CastTensor(projected->cview(), c.out_dtype);
      if (projected.ok()) {
        if (absl::Status fin = CheckFinite(projected->cview(), "step output (rounded to bf16)");
            !fin.ok()) {
          projected = fin;
        }
      }
    }
    if (!projected.ok()) {
      // The step's keys and values are in the cache already: take them
      // back, so a refused step leaves the session as it was.
      const absl::Status undo = state_->Truncate(state_->position() - job.q.dim(1));
      NoteStateLocked();
      if (!undo.ok()) {
        return absl::Status(projected.status().code(),
                            absl::StrCat(projected.status().message(),
                                         "; the step's tokens stay in the session (",
                                         undo.message(), ")"));
      }
      return projected.status();
    }
    RA_ASSIGN_OR_RETURN(TensorView out, step.output(c.out_dtype, projected->dims()));
    std::memcpy(out.raw(), projected->data<char>(), projected->byte_size());  // `out` is dense
  }
  {
    absl::MutexLock meta(&meta_mu_);
    // Ended while computing: the answer would be of a session that is gone.
    RA_RETURN_IF_ERROR(ended_);
    ++steps_;
    last_active_ = absl::Now();
  }
  step.tokens = job.q.dim(1);
  step.position = state_->position();
  NoteStateLocked();
  return absl::OkStatus();
}

namespace {

// The layer-mode steps of a pass that share a projection: one model's layer,
// all of at most kBatchStepMaxTokens tokens (LinearRows), or one longer step
// (oneDNN). Calls fn(model, layer, rows_kernel, indices) per group.
template <typename Fn>
void ForEachProjectionGroup(absl::Span<SessionStep> steps, const std::vector<bool>& take,
                            absl::FunctionRef<int64_t(size_t)> tokens, Fn fn) {
  std::vector<bool> done(steps.size(), false);
  for (size_t i = 0; i < steps.size(); ++i) {
    if (!take[i] || done[i]) continue;
    const SessionConfig& c = steps[i].session->config();
    const bool rows = tokens(i) <= kBatchStepMaxTokens;
    std::vector<size_t> group = {i};
    done[i] = true;
    for (size_t j = i + 1; rows && j < steps.size(); ++j) {
      const SessionConfig& cj = steps[j].session->config();
      if (take[j] && !done[j] && cj.model == c.model && cj.layer == c.layer &&
          tokens(j) <= kBatchStepMaxTokens) {
        group.push_back(j);
        done[j] = true;
      }
    }
    fn(*c.model, c.layer, rows, group);
  }
}

}  // namespace

void Session::StepMany(absl::Span<SessionStep> steps, int threads) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  // Distinct sessions, locked in address order (a fork locks its parent
  // and then its new, unpublished self: no cycle).
  std::vector<size_t> order(steps.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return steps[a].session < steps[b].session; });
  for (size_t i : order) steps[i].session->mu_.Lock();
  std::vector<std::array<Tensor, 4>> owned(steps.size());
  std::vector<DecodeState::Job> begun(steps.size());
  std::vector<bool> layer(steps.size(), false);
  for (size_t i = 0; i < steps.size(); ++i) {
    steps[i].status = steps[i].session->BeginStepLocked(steps[i], &begun[i]);
    layer[i] = steps[i].status.ok() && steps[i].session->config().model != nullptr;
  }
  // Layer mode: q/k/v projected per group (each weight read once for the
  // group; each step's bits as if alone), then attended into f32.
  ForEachProjectionGroup(
      steps, layer, [&](size_t i) { return steps[i].in.hidden.dim(1); },
      [&](const Model& model, int64_t li, bool rows, const std::vector<size_t>& group) {
        std::vector<absl::StatusOr<Projections>> p;
        if (rows) {
          std::vector<ConstTensorView> hidden;
          for (size_t i : group) hidden.push_back(steps[i].in.hidden);
          p = ProjectQKVRows(model, li, hidden, threads);
        } else {
          p.push_back(ProjectQKV(model, li, steps[group[0]].in.hidden, threads));
        }
        for (size_t g = 0; g < group.size(); ++g) {
          const size_t i = group[g];
          absl::StatusOr<Tensor> out;
          if (p[g].ok()) {
            const SessionConfig& c = steps[i].session->config();
            out = Tensor::Create(DType::kF32,
                                 {1, steps[i].in.hidden.dim(1), c.spec.heads, c.v_dim});
          }
          if (!p[g].ok() || !out.ok()) {
            steps[i].status = p[g].ok() ? out.status() : p[g].status();
            continue;
          }
          owned[i][0] = std::move(p[g]->q);
          owned[i][1] = std::move(p[g]->k);
          owned[i][2] = std::move(p[g]->v);
          owned[i][3] = *std::move(out);
          begun[i].q = owned[i][0].cview();
          begun[i].k = owned[i][1].cview();
          begun[i].v = owned[i][2].cview();
          begun[i].out = owned[i][3].view();
        }
      });
  std::vector<DecodeState::Job> jobs;
  std::vector<size_t> job_of(steps.size(), SIZE_MAX);
  jobs.reserve(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    if (!steps[i].status.ok()) continue;
    job_of[i] = jobs.size();
    jobs.push_back(std::move(begun[i]));
  }
  DecodeState::StepMany(absl::MakeSpan(jobs), threads, threads);
  // Layer mode: the attended rows through o_proj, per group as above.
  std::vector<absl::StatusOr<Tensor>> projected(steps.size());
  std::vector<bool> to_project(steps.size(), false);
  for (size_t i = 0; i < steps.size(); ++i) {
    to_project[i] = layer[i] && job_of[i] != SIZE_MAX && jobs[job_of[i]].status.ok();
  }
  ForEachProjectionGroup(
      steps, to_project, [&](size_t i) { return steps[i].in.hidden.dim(1); },
      [&](const Model& model, int64_t li, bool rows, const std::vector<size_t>& group) {
        if (rows) {
          std::vector<ConstTensorView> attended;
          for (size_t i : group) attended.push_back(owned[i][3].cview());
          std::vector<absl::StatusOr<Tensor>> out = ProjectOutputRows(model, li, attended, threads);
          for (size_t g = 0; g < group.size(); ++g) projected[group[g]] = std::move(out[g]);
        } else {
          projected[group[0]] = ProjectOutput(model, li, owned[group[0]][3].cview(), threads);
        }
      });
  for (size_t i = 0; i < steps.size(); ++i) {
    if (job_of[i] == SIZE_MAX) continue;
    steps[i].status =
        steps[i].session->EndStepLocked(steps[i], jobs[job_of[i]], std::move(projected[i]));
  }
  for (size_t i : order) steps[i].session->mu_.Unlock();
  // Closed while a step ran: the closer could not free the state.
  for (const SessionStep& step : steps) step.session->FreeIfEndedAfterOperation();
}

absl::Status Session::Truncate(int64_t position) {
  // Closed while this ran (End could not free the state): freed here, once
  // the lock is released.
  const absl::Cleanup free_if_ended = [this] { FreeIfEndedAfterOperation(); };
  absl::MutexLock lock(&mu_);
  {
    absl::MutexLock meta(&meta_mu_);
    RA_RETURN_IF_ERROR(ended_);
    last_active_ = absl::Now();
  }
  if (!state_) return absl::FailedPreconditionError("the session's state was freed");
  RA_RETURN_IF_ERROR(state_->Truncate(position));
  NoteStateLocked();
  return absl::OkStatus();
}

absl::Status Session::Import(ConstTensorView k, ConstTensorView v, DecodeState::KeyForm form,
                             const std::string& names) {
  // Closed while this ran (End could not free the state): freed here, once
  // the lock is released.
  const absl::Cleanup free_if_ended = [this] { FreeIfEndedAfterOperation(); };
  absl::MutexLock lock(&mu_);
  {
    absl::MutexLock meta(&meta_mu_);
    RA_RETURN_IF_ERROR(ended_);
    last_active_ = absl::Now();
  }
  if (!state_) return absl::FailedPreconditionError("the session's state was freed");
  RA_RETURN_IF_ERROR(state_->Import(std::move(k), std::move(v), form, names));
  NoteStateLocked();
  return absl::OkStatus();
}

absl::StatusOr<DecodeState::Exported> Session::Export() {
  const absl::Cleanup free_if_ended = [this] { FreeIfEndedAfterOperation(); };
  absl::MutexLock lock(&mu_);
  {
    absl::MutexLock meta(&meta_mu_);
    RA_RETURN_IF_ERROR(ended_);
    last_active_ = absl::Now();
  }
  if (!state_) return absl::FailedPreconditionError("the session's state was freed");
  return state_->Export();
}

void Session::FillInfo(v1::SessionInfo* info) const {
  absl::MutexLock lock(&meta_mu_);
  const SessionConfig& c = *config_;
  info->set_session_id(id_);
  info->set_position(position_hint_.load(std::memory_order_relaxed));
  info->set_max_context(c.max_context);
  info->set_kind(c.linear ? v1::ATTENTION_KIND_LINEAR : v1::ATTENTION_KIND_SOFTMAX);
  info->set_kv_dtype(c.int8_kv ? v1::DTYPE_INT8 : DTypeToProto(c.kv_dtype));
  info->set_resumable(resumable_);
  info->set_attached(attached_);
  info->set_idle_ttl_seconds(static_cast<uint32_t>(absl::ToInt64Seconds(idle_ttl_)));
  info->set_kv_bytes(kv_bytes_);
  info->set_step_room_bytes(step_room_bytes_);
  info->set_kv_bytes_held(held_hint_.load(std::memory_order_relaxed));
  info->set_kv_bytes_shared(shared_hint_.load(std::memory_order_relaxed));
  info->set_steps(steps_);
  info->set_idle_seconds(absl::ToDoubleSeconds(absl::Now() - last_active_));
  *info->mutable_spec() = c.spec_proto;
  info->set_start_position(c.start_position);
}

// ------------------------------------------------------ SessionManager --

SessionManager::SessionManager(const ServerOptions& options, Metrics* metrics,
                               MemoryBudget* budget)
    : options_(options), metrics_(metrics), budget_(budget) {
  reaper_ = std::thread([this] {
    const absl::Duration every = absl::Seconds(std::max(0.01, options_.reap_interval_seconds));
    while (!stop_.WaitForNotificationWithTimeout(every)) ReapIdle(absl::Now());
  });
  absl::MutexLock lock(&mu_);
  PublishLocked();
}

SessionManager::~SessionManager() {
  stop_.Notify();
  if (reaper_.joinable()) reaper_.join();
  CloseAll();
}

std::string SessionManager::NewId() {
  thread_local absl::BitGen gen;
  const uint64_t hi = absl::Uniform<uint64_t>(gen), lo = absl::Uniform<uint64_t>(gen);
  return absl::StrFormat("%016x%016x", hi, lo);
}

void SessionManager::PublishLocked() {
  if (metrics_ == nullptr) return;
  metrics_->SetSessionsOpen(static_cast<int64_t>(sessions_.size()));
  metrics_->SetKvBytes(kv_in_use_, budget_->budget());
}

SessionManager::Ticket& SessionManager::Ticket::operator=(Ticket&& other) noexcept {
  if (this != &other) {
    Release();
    manager_ = std::exchange(other.manager_, nullptr);
    config_ = std::move(other.config_);
    resumable_ = other.resumable_;
    ttl_ = other.ttl_;
    owner_ = std::move(other.owner_);
    held_ = std::move(other.held_);
    step_room_ = std::move(other.step_room_);
    quota_bytes_ = other.quota_bytes_;
  }
  return *this;
}

void SessionManager::Ticket::Release() {
  if (manager_ != nullptr) manager_->ReleaseTicket(this);
}

void SessionManager::ReleaseTicket(Ticket* ticket) {
  {
    absl::MutexLock lock(&mu_);
    --reserved_sessions_;
    kv_in_use_ -= ticket->held_.bytes();
    UncountLocked(ticket->owner_, ticket->quota_bytes_);
    PublishLocked();
  }
  ticket->manager_ = nullptr;
  ticket->held_.Release();
  ticket->step_room_.Release();
  ticket->config_.reset();
}

void SessionManager::UncountLocked(const std::string& owner, int64_t bytes) {
  auto it = usage_.find(owner);
  if (it == usage_.end()) return;
  --it->second.sessions;
  it->second.bytes -= bytes;
  if (it->second.sessions <= 0) usage_.erase(it);
}

absl::StatusOr<SessionManager::Ticket> SessionManager::ReserveRoom(
    std::shared_ptr<const SessionConfig> config, bool resumable, absl::Duration ttl,
    const Principal& owner, int64_t discount) {
  Cost cost = SessionOpenCost(SessionDimsOf(*config));
  // The spec it keeps (as opened, for its SessionInfo) is its memory too,
  // and so is the room for its close's answer (which copies that spec).
  const int64_t kept = KeptBytes(*config);
  // The owner's quota counts the whole state; the budget, less the pages a
  // fork shares (they are held, and paid, once).
  // With the state, room for the buffers of its one-token steps, so that
  // filling the budget with sessions never leaves the admitted ones unable
  // to step; the owner's quota counts both.
  const int64_t room_bytes = StepRoomBytes(*config, options_.threads_per_call);
  const int64_t quota_bytes = SatAdd(SatAdd(cost.held_bytes, kept), room_bytes);
  cost.held_bytes =
      SatAdd(std::max<int64_t>(FixedBytes(*config), cost.held_bytes - discount), kept);
  // A large spec is named in a refusal: "lower max_context" alone misled a
  // caller whose 8-byte state came with a 2 MiB spec.
  std::string what = absl::StrCat("the session's ", cost.held_what);
  std::string advice = "lower max_context or close sessions";
  if (kept >= kInfoAnswerSlackBytes) {
    absl::StrAppend(&what, " with ", kept,
                    " bytes for its spec (kept, and room for its close's answer)");
    advice = "send a smaller spec, lower max_context or close sessions";
  }
  Ticket ticket;
  absl::MutexLock lock(&mu_);
  const int open = static_cast<int>(sessions_.size()) + reserved_sessions_;
  if (open >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "the server already holds its maximum of %d sessions (--max_sessions); close one or "
        "retry later",
        options_.max_sessions));
  }
  // Quotas bind authenticated principals (without authentication every
  // caller is the one anonymous principal, bound by the server's limits).
  const auto used = usage_.find(owner.name);
  const Usage usage = used == usage_.end() ? Usage{} : used->second;
  if (owner.authenticated) {
    if (usage.sessions >= options_.principal_max_sessions) {
      if (metrics_ != nullptr) metrics_->RecordQuotaRefused("sessions");
      return absl::ResourceExhaustedError(absl::StrFormat(
          "principal %s already holds its quota of %d sessions (--principal_max_sessions); "
          "close one first",
          QuoteForMessage(owner.name), options_.principal_max_sessions));
    }
    if (quota_bytes > options_.principal_memory_bytes - usage.bytes) {
      if (metrics_ != nullptr) metrics_->RecordQuotaRefused("memory");
      return absl::ResourceExhaustedError(absl::StrFormat(
          "principal %s: %s and its step room need %d bytes, but only %d of its "
          "quota of %d "
          "(--principal_memory_bytes) are free; %s",
          QuoteForMessage(owner.name), what, quota_bytes,
          std::max<int64_t>(0, options_.principal_memory_bytes - usage.bytes),
          options_.principal_memory_bytes, advice));
    }
  }
  absl::StatusOr<MemoryBudget::Reservation> r =
      budget_->Reserve(cost.held_bytes, what);
  if (!r.ok()) {
    return absl::Status(r.status().code(), absl::StrCat(r.status().message(), "; ", advice));
  }
  absl::StatusOr<MemoryBudget::Reservation> room =
      budget_->Reserve(room_bytes, "the session's step room (its one-token steps' buffers)");
  if (!room.ok()) {
    return absl::Status(room.status().code(), absl::StrCat(room.status().message(),
                                                           "; lower max_context or close sessions"));
  }
  ticket.held_ = *std::move(r);
  ticket.step_room_ = *std::move(room);
  kv_in_use_ += ticket.held_.bytes();
  ++reserved_sessions_;
  Usage& counted = usage_[owner.name];
  ++counted.sessions;
  counted.bytes += quota_bytes;
  ticket.quota_bytes_ = quota_bytes;
  ticket.owner_ = owner.name;
  ticket.manager_ = this;
  ticket.config_ = std::move(config);
  ticket.resumable_ = resumable;
  ticket.ttl_ = ttl;
  PublishLocked();
  return ticket;
}

absl::StatusOr<SessionManager::Ticket> SessionManager::Reserve(
    std::shared_ptr<const SessionConfig> config, const Principal& owner) {
  const bool resumable = config->resumable;
  const absl::Duration ttl = config->idle_ttl;
  return ReserveRoom(std::move(config), resumable, ttl, owner);
}

absl::Duration SessionManager::ForkTtl(uint32_t idle_ttl_seconds) const {
  return absl::Seconds(idle_ttl_seconds == 0
                           ? options_.default_idle_ttl_seconds
                           : std::min(idle_ttl_seconds, options_.max_idle_ttl_seconds));
}

absl::StatusOr<SessionManager::Ticket> SessionManager::ReserveFork(
    const std::shared_ptr<Session>& source, bool resumable, uint32_t idle_ttl_seconds,
    const Principal& owner) {
  // The full pages the fork will share are not charged again: it holds
  // room for the rest of max_context (a partly filled last page is copied
  // on its first write, so it is charged).
  // (Under a length-dependent RoPE rule a fork copies every page: no
  // discount.)
  const SessionDims d = SessionDimsOf(*source->config_);
  const int64_t discount =
      d.rope_length_dependent ? 0
                              : source->position_hint() / std::max<int64_t>(1, KvPageTokens(d)) *
                                    KvPageBytes(d);
  return ReserveRoom(source->config_, resumable, ForkTtl(idle_ttl_seconds), owner, discount);
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Open(Ticket ticket) {
  return Open(std::move(ticket), [](Session&) { return absl::OkStatus(); });
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Open(
    Ticket ticket, absl::FunctionRef<absl::Status(Session&)> prepare) {
  RA_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Allocate(std::move(ticket)));
  if (absl::Status st = prepare(*session); !st.ok()) {
    Discard(session);
    return st;  // its state is freed with the last reference, here
  }
  RA_RETURN_IF_ERROR(Enlist(session));
  return session;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Allocate(Ticket ticket) {
  if (!ticket.valid()) return absl::FailedPreconditionError("no room reserved for the session");
  const int64_t bytes = ticket.held_.bytes();
  auto session =
      std::shared_ptr<Session>(new Session(NewId(), ticket.owner_, ticket.config_,
                                           ticket.resumable_, ticket.ttl_, std::move(ticket.held_),
                                           ticket.quota_bytes_));
  session->step_room_bytes_ = ticket.step_room_.bytes();
  {
    absl::MutexLock meta_lock(&session->meta_mu_);
    session->step_room_ = std::move(ticket.step_room_);
  }
  // The slot now belongs to the session (or is freed below); the bytes
  // moved with the reservation.
  ticket.manager_ = nullptr;
  absl::Status st = session->Allocate();
  absl::MutexLock lock(&mu_);
  if (!st.ok()) {
    --reserved_sessions_;
    kv_in_use_ -= bytes;
    UncountLocked(session->owner_, session->quota_bytes_);
    PublishLocked();
    return st;  // the session (and its reservation) is released here
  }
  PublishLocked();
  return session;
}

absl::Status SessionManager::Enlist(const std::shared_ptr<Session>& session,
                                    const Session* source) {
  absl::MutexLock lock(&mu_);
  if (source != nullptr) {
    // Closed after the copy checked it: Close ends a session under mu_, so
    // a source not ended here stays listed at least until the fork is.
    if (absl::Status ended = source->Ended(); !ended.ok()) {
      DiscardLocked(*session);
      return ended;
    }
  }
  {
    absl::MutexLock slock(&session->meta_mu_);
    session->attached_ = true;
  }
  // Its slot stays reserved until it is listed (or discarded), so the
  // session count never drops while a fork copies.
  --reserved_sessions_;
  sessions_.emplace(session->id(), session);
  if (metrics_ != nullptr) metrics_->RecordSessionOpened();
  PublishLocked();
  return absl::OkStatus();
}

void SessionManager::Discard(const std::shared_ptr<Session>& session) {
  absl::MutexLock lock(&mu_);
  DiscardLocked(*session);
}

void SessionManager::DiscardLocked(const Session& session) {
  --reserved_sessions_;
  kv_in_use_ -= session.kv_bytes_;
  UncountLocked(session.owner_, session.quota_bytes_);
  PublishLocked();
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Open(
    std::shared_ptr<const SessionConfig> config, const Principal& owner) {
  RA_ASSIGN_OR_RETURN(Ticket ticket, Reserve(std::move(config), owner));
  return Open(std::move(ticket));
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::FindLocked(const std::string& id,
                                                                    const Principal& caller,
                                                                    bool admin_may) const {
  const auto visible = [&](const std::string& owner) {
    return owner == caller.name || (admin_may && caller.admin);
  };
  auto it = sessions_.find(id);
  if (it != sessions_.end() && visible(it->second->owner_)) return it->second;
  // A recently ended id gets its own story (expired, closed, freed), told to
  // its owner only.
  auto ended = ended_.find(id);
  if (it == sessions_.end() && ended != ended_.end() && ended->second.owner == caller.name) {
    return ended->second.status;
  }
  // The same words whether the id never existed or belongs to someone else.
  return absl::NotFoundError(absl::StrCat("unknown session id ", QuoteForMessage(id)));
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Attach(const std::string& id,
                                                                const Principal& caller) {
  absl::MutexLock lock(&mu_);
  RA_ASSIGN_OR_RETURN(std::shared_ptr<Session> found, FindLocked(id, caller, /*admin_may=*/false));
  Session& s = *found;
  absl::MutexLock slock(&s.meta_mu_);
  if (!s.resumable_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", id, " is not resumable: only resumable sessions can be re-attached"));
  }
  if (s.attached_) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", id, " is attached to another stream"));
  }
  s.attached_ = true;
  s.last_active_ = absl::Now();
  return found;
}

void SessionManager::Detach(const std::shared_ptr<Session>& session, StreamEnd end) {
  FreeAfterUnlock freed;
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session->id());
  if (it == sessions_.end() || it->second != session) return;
  if (!session->resumable_) {
    EraseLocked(
        session->id(),
        end == StreamEnd::kCancelled  ? "disconnected"
        : end == StreamEnd::kShutdown ? "shutdown"
                                      : "stream_ended",
        absl::NotFoundError(absl::StrCat(
            "session ", session->id(), " was freed when its stream ended (it was not resumable)")),
        &freed);
    return;
  }
  absl::MutexLock slock(&session->meta_mu_);
  session->attached_ = false;
  session->last_active_ = absl::Now();
}

void SessionManager::EraseLocked(const std::string& id, absl::string_view reason,
                                 const absl::Status& ended, FreeAfterUnlock* freed) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  std::shared_ptr<Session> s = it->second;
  sessions_.erase(it);
  kv_in_use_ -= s->kv_bytes_;
  UncountLocked(s->owner_, s->quota_bytes_);
  // Its memory is freed once the lock is released (or as its running step
  // ends), and so is this reference, which may be the last.
  s->MarkEnded(ended);
  ended_[id] = Ended{ended, s->owner_};
  freed->Add(std::move(s));
  ended_order_.push_back(id);
  while (ended_order_.size() > kMaxEndedIds) {
    ended_.erase(ended_order_.front());
    ended_order_.pop_front();
  }
  if (metrics_ != nullptr) metrics_->RecordSessionClosed(reason);
  PublishLocked();
}

absl::StatusOr<SessionManager::Closed> SessionManager::Close(const std::string& id,
                                                             const std::string& reason,
                                                             const Principal& caller) {
  FreeAfterUnlock freed;  // frees the state last, after the info is filled
  Closed closed;
  std::shared_ptr<Session> found;
  {
    absl::MutexLock lock(&mu_);
    RA_ASSIGN_OR_RETURN(found, FindLocked(id, caller, /*admin_may=*/true));
    {
      // Not ended (it is still listed): its answer room is there.
      absl::MutexLock slock(&found->meta_mu_);
      closed.answer = std::move(found->answer_room_);
    }
    EraseLocked(id, reason,
                absl::FailedPreconditionError(absl::StrCat("session ", id, " was closed")), &freed);
  }
  // Outside the manager's lock: the copy of a large spec never holds up the
  // control calls that take it.
  found->FillInfo(&closed.info);
  return closed;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Fork(
    const std::shared_ptr<Session>& source, bool resumable, uint32_t idle_ttl_seconds,
    const Principal& owner) {
  RA_ASSIGN_OR_RETURN(Ticket ticket, ReserveFork(source, resumable, idle_ttl_seconds, owner));
  return Fork(source, std::move(ticket));
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Fork(
    const std::shared_ptr<Session>& source, Ticket ticket) {
  if (ticket.valid() && ticket.config_ != source->config_) {
    return absl::FailedPreconditionError("the reserved room is for another session's fork");
  }
  // A source already ended (closed by another call, reaped) is refused
  // before anything is allocated. One that ends while the copy runs is
  // refused by the copy, or, ended after it, by Enlist, under the lock
  // Close ends it under: the fork is listed (and counted as opened) only
  // once it holds the copy of a source still open, so a refused fork is
  // never opened or closed in the metrics, and no other call can see its id.
  RA_RETURN_IF_ERROR(source->Ended());
  RA_ASSIGN_OR_RETURN(std::shared_ptr<Session> fork, Allocate(std::move(ticket)));
  if (absl::Status st = fork->CopyStateFrom(*source); !st.ok()) {
    Discard(fork);
    return st;  // its state is freed with the last reference, here
  }
  RA_RETURN_IF_ERROR(Enlist(fork, source.get()));  // or discarded: freed here
  return fork;
}

absl::StatusOr<v1::SessionInfo> SessionManager::Info(const std::string& id,
                                                     const Principal& caller) const {
  std::shared_ptr<Session> found;
  {
    absl::MutexLock lock(&mu_);
    RA_ASSIGN_OR_RETURN(found, FindLocked(id, caller, /*admin_may=*/true));
  }
  // Copied outside the manager's lock (a spec can be large; it is immutable).
  v1::SessionInfo info;
  found->FillInfo(&info);
  return info;
}

int64_t SessionInfoBytesBound(const SessionConfig& config, size_t id_size) {
  // 14 scalar fields at 12 bytes at most each, the id's and the spec's tags
  // and lengths, and this entry's own tag and length in the answer.
  return config.spec_wire_bytes + static_cast<int64_t>(id_size) + 14 * 12 + 2 * 6 + 6;
}

SessionManager::ListPage SessionManager::PlanList(const Principal& caller,
                                                  const std::string& after, int64_t max_count,
                                                  int64_t max_bytes) const {
  absl::MutexLock lock(&mu_);
  struct Entry {
    const std::string* id;
    int64_t bytes, memory;
  };
  std::vector<Entry> mine;
  for (const auto& [id, s] : sessions_) {
    if (s->owner_ != caller.name && !caller.admin) continue;
    if (id <= after) continue;
    const SessionConfig& c = s->config();
    mine.push_back({&id, SessionInfoBytesBound(c, id.size()),
                    SatAdd(c.spec_memory_bytes, int64_t{sizeof(v1::SessionInfo)} + 64)});
  }
  std::sort(mine.begin(), mine.end(), [](const Entry& a, const Entry& b) { return *a.id < *b.id; });
  ListPage page;
  for (const Entry& e : mine) {
    const bool full = (max_count > 0 && static_cast<int64_t>(page.ids.size()) >= max_count) ||
                      (!page.ids.empty() && page.bytes + e.bytes > max_bytes);
    if (full) {
      page.more = true;
      break;
    }
    page.ids.push_back(*e.id);
    page.bytes += e.bytes;
    page.memory += e.memory;
  }
  return page;
}

int64_t SessionManager::InfoAnswerBytes(const std::string& id, const Principal& caller) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || (it->second->owner_ != caller.name && !caller.admin)) return 0;
  return InfoCopyBytes(it->second->config());
}

std::vector<v1::SessionInfo> SessionManager::FillList(const std::vector<std::string>& ids,
                                                      const Principal& caller) const {
  std::vector<std::shared_ptr<Session>> found;
  found.reserve(ids.size());
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& id : ids) {
      auto it = sessions_.find(id);
      if (it == sessions_.end()) continue;
      if (it->second->owner_ != caller.name && !caller.admin) continue;
      found.push_back(it->second);
    }
  }
  // Copied outside the manager's lock: a page holds up to --max_message_bytes
  // of specs, and every open, attach, detach, close and reap takes that lock.
  std::vector<v1::SessionInfo> out(found.size());
  for (size_t i = 0; i < found.size(); ++i) found[i]->FillInfo(&out[i]);
  return out;
}

std::vector<v1::SessionInfo> SessionManager::List(const Principal& caller) const {
  std::vector<std::shared_ptr<Session>> found;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, s] : sessions_) {
      if (s->owner_ != caller.name && !caller.admin) continue;
      found.push_back(s);
    }
  }
  std::vector<v1::SessionInfo> out(found.size());
  for (size_t i = 0; i < found.size(); ++i) found[i]->FillInfo(&out[i]);
  std::sort(out.begin(), out.end(), [](const v1::SessionInfo& a, const v1::SessionInfo& b) {
    return a.session_id() < b.session_id();
  });
  return out;
}

int SessionManager::ReapIdle(absl::Time now) {
  struct Reaped {
    std::string id, owner;
    double idle_s;
    int64_t ttl_s, tokens;
  };
  std::vector<Reaped> reaped;
  {
    FreeAfterUnlock freed;
    absl::MutexLock lock(&mu_);
    std::vector<std::pair<std::string, absl::Status>> expired;
    for (const auto& [id, s] : sessions_) {
      absl::Duration idle;
      bool attached;
      {
        absl::MutexLock slock(&s->meta_mu_);
        idle = now - s->last_active_;
        attached = s->attached_;
      }
      // A stream holds it: it is in use however long its client thinks.
      if (attached) continue;
      if (idle > s->idle_ttl_) {
        reaped.push_back({id, s->owner(), std::round(absl::ToDoubleSeconds(idle) * 10) / 10,
                          absl::ToInt64Seconds(s->idle_ttl_), s->position_hint()});
        expired.emplace_back(id, absl::NotFoundError(absl::StrFormat(
                                     "session %s expired: idle for %.0f s, past its idle TTL of "
                                     "%d s",
                                     id, absl::ToDoubleSeconds(idle),
                                     absl::ToInt64Seconds(s->idle_ttl_))));
      }
    }
    for (const auto& [id, status] : expired) EraseLocked(id, "reaped", status, &freed);
    reaped_ += expired.size();
    for (const Reaped& r : reaped) ++reaped_by_owner_[r.owner];
  }
  // Logged outside the manager's lock: a slow log never holds up sessions.
  for (const Reaped& r : reaped) {
    LogEvent(LogLevel::kInfo, "session_reaped",
             {{"session", r.id},
              {"idle_s", r.idle_s},
              {"idle_ttl_s", r.ttl_s},
              {"owner", r.owner},
              {"tokens", r.tokens}});
  }
  return static_cast<int>(reaped.size());
}

void SessionManager::CloseAll() {
  FreeAfterUnlock freed;
  absl::MutexLock lock(&mu_);
  std::vector<std::string> ids;
  for (const auto& [id, s] : sessions_) ids.push_back(id);
  for (const std::string& id : ids) {
    EraseLocked(
        id, "shutdown",
        absl::UnavailableError(absl::StrCat("session ", id, " ended: the server shut down")),
        &freed);
  }
}

int64_t SessionManager::kv_bytes_in_use() const {
  absl::MutexLock lock(&mu_);
  return kv_in_use_;
}

SessionManager::Counts SessionManager::CountsFor(const Principal& caller) const {
  const bool everyone = !caller.authenticated || caller.admin;
  absl::MutexLock lock(&mu_);
  Counts c;
  for (const auto& [id, s] : sessions_) {
    if (!everyone && s->owner_ != caller.name) continue;
    ++c.open;
    c.kv_bytes += s->kv_bytes();
    absl::MutexLock slock(&s->meta_mu_);
    c.attached += s->attached_ ? 1 : 0;
  }
  if (everyone) c.kv_bytes = kv_in_use_;  // reserved (opening) sessions too
  if (everyone) {
    c.reaped = reaped_;
  } else if (auto it = reaped_by_owner_.find(caller.name); it != reaped_by_owner_.end()) {
    c.reaped = it->second;
  }
  return c;
}

int SessionManager::open_sessions() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(sessions_.size());
}

int SessionManager::attached_sessions() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [id, s] : sessions_) {
    absl::MutexLock slock(&s->meta_mu_);
    n += s->attached_ ? 1 : 0;
  }
  return n;
}

uint64_t SessionManager::reaped_total() const {
  absl::MutexLock lock(&mu_);
  return reaped_;
}

}  // namespace ropeattn::server
