#include "server/sessions.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/attention.h"
#include "core/status_macros.h"
#include "server/layer.h"
#include "server/metrics.h"

namespace ropeattn::server {
namespace {

constexpr size_t kMaxEndedIds = 4096;
// Precomputed cos/sin rows per session; positions past it are computed on
// the fly (exactly, in fp64), so this only trades memory for speed.
constexpr int64_t kRopeTablePositions = 8192;

// f32 softmax sessions keep K/V in a core KvCache where its decode is the
// faster one (AVX-512 machines, docs/core-design.md); bf16 caches, and all
// caches on AVX2-only machines, stay token-major. Decided once per session.
bool UsesKvCache(const SessionConfig& c) {
  return !c.linear && c.kv_dtype == DType::kF32 && KvCacheDecodeIsFaster();
}

bool LengthDependent(const RopeConfig& rope) {
  return rope.scaling.type == RopeScalingType::kDynamicNtk ||
         rope.scaling.type == RopeScalingType::kLongRope;
}

// A dense f32 copy of a [1, T, H, D] tensor (RoPE rotates in fp32).
absl::StatusOr<Tensor> ToF32(const Tensor& t) { return CastTensor(t.view(), DType::kF32); }

// Copies rows of a dense [1, T, H, D] f32 tensor into cache rows
// [first, first + T) of a [1, C, H, D] tensor of `dtype`.
void StoreRows(const Tensor& src, TensorView cache, int64_t first) {
  const int64_t row = src.dim(2) * src.dim(3);
  const int64_t n = src.dim(1) * row;
  const float* s = src.data<float>();
  if (cache.dtype() == DType::kF32) {
    std::memcpy(cache.data<float>() + first * row, s, n * sizeof(float));
  } else {
    uint16_t* d = cache.data<uint16_t>() + first * row;
    for (int64_t i = 0; i < n; ++i) d[i] = FloatToBF16(s[i]);
  }
}

absl::Status CheckStepTensor(const Tensor& t, absl::string_view name, int64_t tokens, int64_t heads,
                             int64_t dim) {
  if (t.rank() != 4 || t.dim(0) != 1 || t.dim(1) != tokens || t.dim(2) != heads ||
      t.dim(3) != dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s must have shape [1, %d, %d, %d] ([batch 1, tokens, heads, dim]), got %s", name, tokens,
        heads, dim, DimsToString(t.dims())));
  }
  return CheckFinite(t.view(), name);
}

}  // namespace

absl::StatusOr<SessionConfig> ResolveOpenSession(const v1::OpenSession& open,
                                                 const ServerOptions& options,
                                                 const ModelRegistry& models) {
  SessionConfig c;
  if (!open.model().empty()) {
    // Layer mode: the model's attention geometry and RoPE; only the mask and
    // logit options come from the spec.
    RA_ASSIGN_OR_RETURN(ResolvedLayer r, ResolveLayer(models, open.model(), open.layer()));
    const v1::AttentionSpec& in = open.spec();
    if (in.heads() != 0 || in.kv_heads() != 0 || in.head_dim() != 0 ||
        in.positional_case() != v1::AttentionSpec::POSITIONAL_NOT_SET || open.v_dim() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "open.spec heads, kv_heads, head_dim, positional scheme and open.v_dim come from model ",
          open.model(), " in layer mode: leave them unset"));
    }
    if (open.kind() == v1::ATTENTION_KIND_LINEAR) {
      return absl::UnimplementedError("layer mode serves softmax attention only");
    }
    const ModelConfig& mc = r.model->config();
    v1::AttentionSpec spec = in;
    spec.set_heads(mc.num_heads);
    spec.set_kv_heads(mc.num_kv_heads);
    spec.set_head_dim(mc.head_dim);
    RA_ASSIGN_OR_RETURN(c.spec, ResolveSpec(spec));
    c.spec.rope = mc.rope;
    c.spec_proto = spec;
    c.model = r.model;
    c.layer = r.layer;
  } else {
    if (open.spec().has_t5()) {
      // As the proto says: a session has no T5 path. Refused, not computed
      // without its bias.
      return absl::UnimplementedError(
          "open.spec.t5: T5 relative biases are not supported in decoding sessions; use Attend");
    }
    RA_ASSIGN_OR_RETURN(c.spec, ResolveSpec(open.spec()));
    c.spec_proto = open.spec();
  }
  c.spec.options.causal = true;
  RA_ASSIGN_OR_RETURN(c.kv_dtype, DTypeFromProto(open.kv_dtype(), "open.kv_dtype", DType::kF32));
  RA_ASSIGN_OR_RETURN(c.out_dtype, DTypeFromProto(open.out_dtype(), "open.out_dtype", DType::kF32));
  switch (open.kind()) {
    case v1::ATTENTION_KIND_UNSPECIFIED:
    case v1::ATTENTION_KIND_SOFTMAX:
      c.linear = false;
      break;
    case v1::ATTENTION_KIND_LINEAR:
      c.linear = true;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("open.kind has unknown value %d", static_cast<int>(open.kind())));
  }
  if (open.v_dim() < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("open.v_dim must be >= 0, got %d", open.v_dim()));
  }
  c.v_dim = open.v_dim() == 0 || c.model ? c.spec.head_dim : open.v_dim();
  if (c.linear) {
    if (open.spec().has_alibi() || open.spec().has_t5() || open.spec().window() != 0 ||
        open.spec().softcap() != 0) {
      return absl::UnimplementedError(
          "linear-attention sessions support RoPE only: no ALiBi, T5, window or softcap");
    }
    if (c.spec.rope && LengthDependent(*c.spec.rope)) {
      return absl::UnimplementedError(absl::StrCat(
          "linear-attention sessions cannot use rope_type \"",
          RopeScalingTypeName(c.spec.rope->scaling.type),
          "\": its frequencies change with the length, and a running sum cannot be re-rotated"));
    }
  }
  if (open.max_context() < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("open.max_context must be >= 0, got %d", open.max_context()));
  }
  c.max_context = open.max_context() == 0 ? options.default_max_context : open.max_context();
  if (c.max_context > options.max_context_limit) {
    return absl::InvalidArgumentError(
        absl::StrFormat("open.max_context %d exceeds the server's limit of %d tokens",
                        c.max_context, options.max_context_limit));
  }
  const uint32_t ttl = open.idle_ttl_seconds() == 0
                           ? options.default_idle_ttl_seconds
                           : std::min(open.idle_ttl_seconds(), options.max_idle_ttl_seconds);
  c.idle_ttl = absl::Seconds(ttl);
  c.resumable = open.resumable();
  return c;
}

SessionDims SessionDimsOf(const SessionConfig& c) {
  SessionDims d;
  d.linear = c.linear;
  d.kv_cache_layout = UsesKvCache(c);
  d.kv_heads = c.spec.kv_heads;
  d.head_dim = c.spec.head_dim;
  d.v_dim = c.v_dim;
  d.max_context = c.max_context;
  d.kv_dtype = c.kv_dtype;
  if (c.spec.rope) {
    d.rope_rotary_dim = c.spec.rope->effective_rotary_dim();
    d.rope_length_dependent = LengthDependent(*c.spec.rope);
    d.rope_table_positions = kRopeTablePositions;
  }
  return d;
}

absl::StatusOr<Cost> PriceStep(const SessionConfig& c, const v1::Step& step, int64_t position,
                               int threads) {
  StepDims d;
  d.heads = c.spec.heads;
  d.position = position;
  d.out_dtype = c.out_dtype;
  d.threads = threads;
  if (c.model) {
    RA_ASSIGN_OR_RETURN(const WireShape h, ParseWireShape(step.hidden(), "step.hidden"));
    d.tokens = h.rank() == 3 ? h.dim(1) : 0;
    d.hidden = c.model->config().hidden_size;
    d.wire_bytes = h.bytes;
  } else {
    RA_ASSIGN_OR_RETURN(const WireShape q, ParseWireShape(step.q(), "step.q"));
    RA_ASSIGN_OR_RETURN(const WireShape k, ParseWireShape(step.k(), "step.k"));
    RA_ASSIGN_OR_RETURN(const WireShape v, ParseWireShape(step.v(), "step.v"));
    d.tokens = q.rank() >= 2 ? q.dim(1) : 0;
    d.wire_bytes = SatAdd(SatAdd(q.bytes, k.bytes), v.bytes);
  }
  // Past max_context the step is refused before any work (OutOfRange, by
  // the step itself); price it at the context it may reach.
  d.tokens = std::min(d.tokens, std::max<int64_t>(c.max_context - position, 0));
  return StepCost(SessionDimsOf(c), d);
}

// ------------------------------------------------------------- Session --

namespace {

}  // namespace

Session::Session(std::string id, std::string owner, std::shared_ptr<const SessionConfig> config,
                 bool resumable, absl::Duration idle_ttl, MemoryBudget::Reservation held)
    : id_(std::move(id)),
      owner_(std::move(owner)),
      config_(std::move(config)),
      resumable_(resumable),
      idle_ttl_(idle_ttl),
      kv_bytes_(held.bytes()),
      held_(std::move(held)) {
  absl::MutexLock lock(&meta_mu_);
  last_active_ = absl::Now();
}

absl::Status Session::Allocate() {
  absl::MutexLock lock(&mu_);
  const SessionConfig& c = *config_;
  const ResolvedSpec& s = c.spec;
  if (c.linear) {
    RA_ASSIGN_OR_RETURN(LinearAttentionState st,
                        LinearAttentionState::Create(1, s.kv_heads, s.head_dim, c.v_dim));
    linear_.emplace(std::move(st));
  } else {
    if (UsesKvCache(c)) {
      RA_ASSIGN_OR_RETURN(KvCache kv,
                          KvCache::Create(s.kv_heads, s.head_dim, c.v_dim, c.max_context));
      kv_.emplace(std::move(kv));
    } else {
      RA_ASSIGN_OR_RETURN(k_cache_,
                          Tensor::Create(c.kv_dtype, {1, c.max_context, s.kv_heads, s.head_dim}));
      RA_ASSIGN_OR_RETURN(v_cache_,
                          Tensor::Create(c.kv_dtype, {1, c.max_context, s.kv_heads, c.v_dim}));
    }
    if (s.rope && LengthDependent(*s.rope)) {
      RA_ASSIGN_OR_RETURN(k_raw_,
                          Tensor::Create(DType::kF32, {1, c.max_context, s.kv_heads, s.head_dim}));
    }
  }
  if (s.rope && !LengthDependent(*s.rope)) {
    RA_ASSIGN_OR_RETURN(
        RopeRotator r,
        RopeRotator::Create(*s.rope, c.max_context, std::min(c.max_context, kRopeTablePositions)));
    rotator_.emplace(std::move(r));
  }
  return absl::OkStatus();
}

absl::Status Session::CopyStateFrom(Session& other) {
  absl::MutexLock other_lock(&other.mu_);
  // Closed while this fork waited for it: the closer left its state for us
  // to free.
  absl::Cleanup free_other_if_ended = [&other]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (!other.Ended().ok()) other.FreeStateLocked();
  };
  RA_RETURN_IF_ERROR(other.Ended());
  absl::MutexLock lock(&mu_);
  position_ = other.position_;
  position_hint_.store(position_, std::memory_order_relaxed);
  if (config_->linear) {
    linear_ = other.linear_;
    return absl::OkStatus();
  }
  const auto copy_rows = [&](const Tensor& from, Tensor& to) {
    if (from.num_elements() == 0) return;
    const size_t row = from.dim(2) * from.dim(3) * DTypeSize(from.dtype());
    std::memcpy(to.data<char>(), from.data<char>(), position_ * row);
  };
  if (kv_.has_value() != other.kv_.has_value()) {
    return absl::InternalError("a fork and its parent hold different KV cache layouts");
  }
  if (kv_) RA_RETURN_IF_ERROR(kv_->CopyFrom(*other.kv_, position_));
  copy_rows(other.k_cache_, k_cache_);
  copy_rows(other.v_cache_, v_cache_);
  copy_rows(other.k_raw_, k_raw_);
  if (other.rotator_) rotator_ = other.rotator_;
  rotator_freqs_ = other.rotator_freqs_;
  return absl::OkStatus();
}

void Session::End(absl::Status status) {
  {
    absl::MutexLock lock(&meta_mu_);
    if (ended_.ok()) ended_ = std::move(status);
  }
  // Free the memory now if no operation holds the state; the object may
  // live on in a stream's reference. A running operation frees it as it
  // finishes (it checks Ended() on its way out).
  if (mu_.TryLock()) {
    FreeStateLocked();
    mu_.Unlock();
  }
}

void Session::FreeStateLocked() {
  k_cache_ = Tensor();
  v_cache_ = Tensor();
  kv_.reset();
  k_raw_ = Tensor();
  linear_.reset();
  rotator_.reset();
  held_.Release();
}

absl::Status Session::Ended() const {
  absl::MutexLock lock(&meta_mu_);
  return ended_;
}

int64_t Session::position() const { return position_hint_.load(std::memory_order_relaxed); }

absl::Status Session::PrepareRope(int64_t new_len) {
  const SessionConfig& c = *config_;
  if (!c.spec.rope || !LengthDependent(*c.spec.rope)) return absl::OkStatus();
  RA_ASSIGN_OR_RETURN(RopeFrequencies f, ComputeRopeFrequencies(*c.spec.rope, new_len));
  std::vector<double> key = f.inv_freq;
  key.push_back(f.attention_factor);
  if (rotator_ && key == rotator_freqs_) return absl::OkStatus();
  // Frequencies changed (dynamic NTK past L0, LongRoPE crossing its switch):
  // rotate every cached key again from its raw value, so the whole cache is
  // exactly what a one-shot pass over new_len tokens would hold. No table:
  // the rotator may change again next step.
  RA_ASSIGN_OR_RETURN(RopeRotator r, RopeRotator::FromFrequencies(*c.spec.rope, f, 0));
  if (position_ > 0) {
    const int64_t row = c.spec.kv_heads * c.spec.head_dim;
    RA_ASSIGN_OR_RETURN(
        Tensor keys, Tensor::Create(DType::kF32, {1, position_, c.spec.kv_heads, c.spec.head_dim}));
    std::memcpy(keys.data<float>(), k_raw_.data<float>(), position_ * row * sizeof(float));
    RA_RETURN_IF_ERROR(r.Apply(keys.view(), Positions{}, RopeDirection::kForward, 1));
    if (kv_) {
      RA_RETURN_IF_ERROR(kv_->WriteK(0, keys.cview()));
    } else {
      StoreRows(keys, k_cache_.view(), 0);
    }
  }
  rotator_.emplace(std::move(r));
  rotator_freqs_ = std::move(key);
  return absl::OkStatus();
}

absl::Status Session::Step(const v1::Step& step, int threads, const StopToken* stop,
                           v1::StepResult* result) {
  absl::MutexLock lock(&mu_);
  // Closed while this step ran: the closer could not free the state.
  absl::Cleanup free_if_ended = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (!Ended().ok()) FreeStateLocked();
  };
  {
    absl::MutexLock meta(&meta_mu_);
    RA_RETURN_IF_ERROR(ended_);
    last_active_ = absl::Now();
  }
  const SessionConfig& c = *config_;
  const ResolvedSpec& s = c.spec;
  Tensor q, k, v;
  if (c.model) {
    // Layer mode: project the hidden states with the layer's weights.
    if (step.has_q() || step.has_k() || step.has_v()) {
      return absl::InvalidArgumentError(
          "this session is in layer mode: steps carry `hidden`, not q/k/v");
    }
    RA_ASSIGN_OR_RETURN(Tensor hidden, TensorFromProto(step.hidden(), "step.hidden"));
    const int64_t hs = c.model->config().hidden_size;
    if (hidden.rank() != 3 || hidden.dim(0) != 1 || hidden.dim(1) < 1 || hidden.dim(2) != hs) {
      return absl::InvalidArgumentError(
          absl::StrFormat("step.hidden must have shape [1, tokens >= 1, %d], got %s", hs,
                          DimsToString(hidden.dims())));
    }
    RA_RETURN_IF_ERROR(CheckFinite(hidden.view(), "step.hidden"));
    RA_ASSIGN_OR_RETURN(Projections p, ProjectQKV(*c.model, c.layer, hidden.view(), threads));
    q = std::move(p.q);
    k = std::move(p.k);
    v = std::move(p.v);
  } else {
    if (step.has_hidden()) {
      return absl::InvalidArgumentError(
          "step.hidden is for layer-mode sessions; this session takes q/k/v");
    }
    RA_ASSIGN_OR_RETURN(q, TensorFromProto(step.q(), "step.q"));
    RA_ASSIGN_OR_RETURN(k, TensorFromProto(step.k(), "step.k"));
    RA_ASSIGN_OR_RETURN(v, TensorFromProto(step.v(), "step.v"));
  }
  const int64_t tokens = q.rank() >= 2 ? q.dim(1) : 0;
  if (tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("step.q must have shape [1, tokens >= 1, %d, %d], got %s", s.heads,
                        s.head_dim, DimsToString(q.dims())));
  }
  RA_RETURN_IF_ERROR(CheckStepTensor(q, "step.q", tokens, s.heads, s.head_dim));
  RA_RETURN_IF_ERROR(CheckStepTensor(k, "step.k", tokens, s.kv_heads, s.head_dim));
  RA_RETURN_IF_ERROR(CheckStepTensor(v, "step.v", tokens, s.kv_heads, c.v_dim));
  if (position_ + tokens > c.max_context) {
    return absl::OutOfRangeError(absl::StrFormat(
        "a step of %d tokens at position %d would exceed the session's max_context of %d", tokens,
        position_, c.max_context));
  }
  const int64_t new_len = position_ + tokens;
  // Layer mode attends into f32 and projects afterwards.
  RA_ASSIGN_OR_RETURN(Tensor out, Tensor::Create(c.model ? DType::kF32 : c.out_dtype,
                                                 {1, tokens, s.heads, c.v_dim}));

  if (c.linear) {
    LinearAttentionOptions lo;
    lo.rope = rotator_ ? &*rotator_ : nullptr;
    lo.num_threads = threads;
    RA_RETURN_IF_ERROR(linear_->Step(q.view(), k.view(), v.view(), lo, out.view()));
  } else {
    RA_ASSIGN_OR_RETURN(Tensor qf, ToF32(q));
    RA_ASSIGN_OR_RETURN(Tensor kf, ToF32(k));
    RA_ASSIGN_OR_RETURN(Tensor vf, ToF32(v));
    const int64_t offsets[1] = {position_};
    const Positions at{{}, absl::MakeConstSpan(offsets)};
    if (s.rope) {
      RA_RETURN_IF_ERROR(PrepareRope(new_len));
      if (k_raw_.num_elements() > 0) StoreRows(kf, k_raw_.view(), position_);
      RA_RETURN_IF_ERROR(rotator_->Apply(qf.view(), at, RopeDirection::kForward, 1));
      RA_RETURN_IF_ERROR(rotator_->Apply(kf.view(), at, RopeDirection::kForward, 1));
    }
    // Rows past position_ are scratch until position_ moves, so writing them
    // before the attention succeeds loses nothing on error.
    AttentionOptions o = s.options;
    o.causal = true;
    o.q_offsets = absl::MakeConstSpan(offsets);
    o.check_finite = false;  // new rows were checked above, old ones when appended
    o.num_threads = threads;
    o.stop = stop;
    if (kv_) {
      RA_RETURN_IF_ERROR(kv_->WriteK(position_, kf.cview()));
      RA_RETURN_IF_ERROR(kv_->WriteV(position_, vf.cview()));
      RA_RETURN_IF_ERROR(AttendCache(qf.view(), *kv_, new_len, o, out.view()));
    } else {
      StoreRows(kf, k_cache_.view(), position_);
      StoreRows(vf, v_cache_.view(), position_);
      ConstTensorView kc = k_cache_.cview().Slice(1, 0, new_len);
      ConstTensorView vc = v_cache_.cview().Slice(1, 0, new_len);
      RA_RETURN_IF_ERROR(Attend(qf.view(), kc, vc, o, out.view()));
    }
  }
  if (c.model) {
    RA_ASSIGN_OR_RETURN(Tensor projected, ProjectOutput(*c.model, c.layer, out.view(), threads));
    RA_ASSIGN_OR_RETURN(out, CastTensor(projected.view(), c.out_dtype));
  }
  {
    absl::MutexLock meta(&meta_mu_);
    // Ended while computing: the answer would be of a session that is gone.
    RA_RETURN_IF_ERROR(ended_);
    ++steps_;
    last_active_ = absl::Now();
  }
  position_ = new_len;
  position_hint_.store(position_, std::memory_order_relaxed);
  result->set_seq(step.seq());
  result->set_position(position_);
  TensorToProto(out.view(), result->mutable_out());
  return absl::OkStatus();
}

absl::Status Session::Truncate(int64_t position) {
  absl::MutexLock lock(&mu_);
  absl::Cleanup free_if_ended = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (!Ended().ok()) FreeStateLocked();
  };
  {
    absl::MutexLock meta(&meta_mu_);
    RA_RETURN_IF_ERROR(ended_);
    last_active_ = absl::Now();
  }
  if (config_->linear) {
    return absl::UnimplementedError(
        "linear-attention sessions cannot be truncated: their state is a running sum");
  }
  if (position < 0 || position > position_) {
    return absl::OutOfRangeError(absl::StrFormat(
        "truncate position %d is outside [0, %d] (the session's length)", position, position_));
  }
  position_ = position;
  position_hint_.store(position_, std::memory_order_relaxed);
  return absl::OkStatus();
}

void Session::FillInfo(v1::SessionInfo* info) const {
  absl::MutexLock lock(&meta_mu_);
  const SessionConfig& c = *config_;
  info->set_session_id(id_);
  info->set_position(position_hint_.load(std::memory_order_relaxed));
  info->set_max_context(c.max_context);
  info->set_kind(c.linear ? v1::ATTENTION_KIND_LINEAR : v1::ATTENTION_KIND_SOFTMAX);
  info->set_kv_dtype(DTypeToProto(c.kv_dtype));
  info->set_resumable(resumable_);
  info->set_attached(attached_);
  info->set_idle_ttl_seconds(static_cast<uint32_t>(absl::ToInt64Seconds(idle_ttl_)));
  info->set_kv_bytes(kv_bytes_);
  info->set_steps(steps_);
  info->set_idle_seconds(absl::ToDoubleSeconds(absl::Now() - last_active_));
  *info->mutable_spec() = c.spec_proto;
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
    UncountLocked(ticket->owner_, ticket->held_.bytes());
    PublishLocked();
  }
  ticket->manager_ = nullptr;
  ticket->held_.Release();
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
    const Principal& owner) {
  const Cost cost = SessionOpenCost(SessionDimsOf(*config));
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
    if (cost.held_bytes > options_.principal_memory_bytes - usage.bytes) {
      if (metrics_ != nullptr) metrics_->RecordQuotaRefused("memory");
      return absl::ResourceExhaustedError(absl::StrFormat(
          "principal %s: the session's %s needs %d bytes, but only %d of its quota of %d "
          "(--principal_memory_bytes) are free; lower max_context or close sessions",
          QuoteForMessage(owner.name), cost.held_what, cost.held_bytes,
          std::max<int64_t>(0, options_.principal_memory_bytes - usage.bytes),
          options_.principal_memory_bytes));
    }
  }
  absl::StatusOr<MemoryBudget::Reservation> r =
      budget_->Reserve(cost.held_bytes, absl::StrCat("the session's ", cost.held_what));
  if (!r.ok()) {
    return absl::Status(r.status().code(),
                        absl::StrCat(r.status().message(), "; lower max_context or close sessions"));
  }
  ticket.held_ = *std::move(r);
  kv_in_use_ += ticket.held_.bytes();
  ++reserved_sessions_;
  Usage& counted = usage_[owner.name];
  ++counted.sessions;
  counted.bytes += ticket.held_.bytes();
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
  return ReserveRoom(source->config_, resumable, ForkTtl(idle_ttl_seconds), owner);
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Open(Ticket ticket) {
  if (!ticket.valid()) return absl::FailedPreconditionError("no room reserved for the session");
  const int64_t bytes = ticket.held_.bytes();
  auto session =
      std::shared_ptr<Session>(new Session(NewId(), ticket.owner_, ticket.config_,
                                           ticket.resumable_, ticket.ttl_, std::move(ticket.held_)));
  // The slot now belongs to the session (or is freed below); the bytes
  // moved with the reservation.
  ticket.manager_ = nullptr;
  absl::Status st = session->Allocate();
  absl::MutexLock lock(&mu_);
  --reserved_sessions_;
  if (!st.ok()) {
    kv_in_use_ -= bytes;
    UncountLocked(session->owner_, bytes);
    PublishLocked();
    return st;  // the session (and its reservation) is released here
  }
  {
    absl::MutexLock slock(&session->meta_mu_);
    session->attached_ = true;
  }
  sessions_.emplace(session->id(), session);
  if (metrics_ != nullptr) metrics_->RecordSessionOpened();
  PublishLocked();
  return session;
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
  if (it == sessions_.end() && ended != ended_.end() && visible(ended->second.owner)) {
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

void SessionManager::Detach(const std::shared_ptr<Session>& session, bool stream_cancelled) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session->id());
  if (it == sessions_.end() || it->second != session) return;
  if (!session->resumable_) {
    EraseLocked(
        session->id(), stream_cancelled ? "disconnected" : "stream_ended",
        absl::NotFoundError(absl::StrCat(
            "session ", session->id(), " was freed when its stream ended (it was not resumable)")));
    return;
  }
  absl::MutexLock slock(&session->meta_mu_);
  session->attached_ = false;
  session->last_active_ = absl::Now();
}

void SessionManager::EraseLocked(const std::string& id, absl::string_view reason,
                                 const absl::Status& ended) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  std::shared_ptr<Session> s = it->second;
  sessions_.erase(it);
  kv_in_use_ -= s->kv_bytes_;
  UncountLocked(s->owner_, s->kv_bytes_);
  s->End(ended);  // frees its memory now, or as its running step ends
  ended_[id] = Ended{ended, s->owner_};
  ended_order_.push_back(id);
  while (ended_order_.size() > kMaxEndedIds) {
    ended_.erase(ended_order_.front());
    ended_order_.pop_front();
  }
  if (metrics_ != nullptr) metrics_->RecordSessionClosed(reason);
  PublishLocked();
}

absl::StatusOr<v1::SessionInfo> SessionManager::Close(const std::string& id,
                                                      const std::string& reason,
                                                      const Principal& caller) {
  absl::MutexLock lock(&mu_);
  RA_ASSIGN_OR_RETURN(std::shared_ptr<Session> found, FindLocked(id, caller, /*admin_may=*/true));
  v1::SessionInfo info;
  found->FillInfo(&info);
  EraseLocked(id, reason,
              absl::FailedPreconditionError(absl::StrCat("session ", id, " was closed")));
  return info;
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
  RA_ASSIGN_OR_RETURN(std::shared_ptr<Session> fork, Open(std::move(ticket)));
  absl::Status st = fork->CopyStateFrom(*source);
  if (!st.ok()) {
    absl::MutexLock lock(&mu_);
    EraseLocked(fork->id(), "closed", absl::AbortedError("fork failed"));
    return st;
  }
  return fork;
}

absl::StatusOr<v1::SessionInfo> SessionManager::Info(const std::string& id,
                                                     const Principal& caller) const {
  absl::MutexLock lock(&mu_);
  RA_ASSIGN_OR_RETURN(std::shared_ptr<Session> found, FindLocked(id, caller, /*admin_may=*/true));
  v1::SessionInfo info;
  found->FillInfo(&info);
  return info;
}

std::vector<v1::SessionInfo> SessionManager::List(const Principal& caller) const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::SessionInfo> out;
  for (const auto& [id, s] : sessions_) {
    if (s->owner_ != caller.name && !caller.admin) continue;
    out.emplace_back();
    s->FillInfo(&out.back());
  }
  std::sort(out.begin(), out.end(), [](const v1::SessionInfo& a, const v1::SessionInfo& b) {
    return a.session_id() < b.session_id();
  });
  return out;
}

int SessionManager::ReapIdle(absl::Time now) {
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
      expired.emplace_back(id,
                           absl::NotFoundError(absl::StrFormat(
                               "session %s expired: idle for %.0f s, past its idle TTL of %d s", id,
                               absl::ToDoubleSeconds(idle), absl::ToInt64Seconds(s->idle_ttl_))));
    }
  }
  for (const auto& [id, status] : expired) EraseLocked(id, "reaped", status);
  reaped_ += expired.size();
  return static_cast<int>(expired.size());
}

void SessionManager::CloseAll() {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> ids;
  for (const auto& [id, s] : sessions_) ids.push_back(id);
  for (const std::string& id : ids) {
    EraseLocked(
        id, "shutdown",
        absl::UnavailableError(absl::StrCat("session ", id, " ended: the server shut down")));
  }
}

int64_t SessionManager::kv_bytes_in_use() const {
  absl::MutexLock lock(&mu_);
  return kv_in_use_;
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
