#include "core/decode_state.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/limits.h"
#include "core/status_macros.h"

namespace ropeattn {
namespace {

absl::Status CheckStepTensor(const ConstTensorView& t, const std::string& name, int64_t tokens,
                             int64_t heads, int64_t dim) {
  if (t.rank() != 4 || t.dim(0) != 1 || t.dim(1) != tokens || t.dim(2) != heads ||
      t.dim(3) != dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s must have shape [1, %d, %d, %d] ([batch 1, tokens, heads, dim]), got %s", name, tokens,
        heads, dim, DimsToString(t.dims())));
  }
  RA_RETURN_IF_ERROR(CheckBSHD(t, name));
  return CheckFinite(t, name);
}

}  // namespace

Int8KvView DecodeState::Int8View() {
  const DecodeStateConfig& c = config_;
  int8_view_ = Int8KvView{reinterpret_cast<const int8_t*>(k_q_.data<float>()),
                          k_scale_.data<float>(),
                          reinterpret_cast<const int8_t*>(v_q_.data<float>()),
                          v_scale_.data<float>(),
                          c.max_context,
                          c.kv_heads,
                          c.head_dim,
                          c.v_dim};
  return int8_view_;
}

void DecodeState::QuantizeInto(const Tensor& rows_f32, bool keys, int64_t at) {
  const DecodeStateConfig& c = config_;
  const int64_t dim = keys ? c.head_dim : c.v_dim;
  const int64_t n = rows_f32.dim(1) * c.kv_heads;  // [1, T, kv_heads, dim], contiguous
  int8_t* q = reinterpret_cast<int8_t*>(keys ? k_q_.data<float>() : v_q_.data<float>());
  float* scales = keys ? k_scale_.data<float>() : v_scale_.data<float>();
  QuantizeInt8Rows(rows_f32.data<float>(), dim, n, dim, q + at * c.kv_heads * dim,
                   scales + at * c.kv_heads);
}

DecodeState::Storage DecodeState::StorageFor(const DecodeStateConfig& c) {
  if (c.linear) return Storage::kLinear;
  if (c.int8_kv) return Storage::kInt8;
  if (c.kv_dtype == DType::kF32 && KvCacheDecodeIsFaster()) return Storage::kKvCache;
  return Storage::kTokenMajor;
}

bool DecodeState::RopeIsLengthDependent(const std::optional<RopeConfig>& rope) {
  return rope && RopeRuleOf(rope->scaling.type).length_dependent;
}

bool DecodeState::LengthDependent() const { return RopeIsLengthDependent(config_.rope); }

absl::StatusOr<DecodeState> DecodeState::Create(DecodeStateConfig config) {
  const DecodeStateConfig& c = config;
  RA_RETURN_IF_ERROR(CheckPositions(c.start_position, 1, "start_position"));
  if (c.heads <= 0 || c.kv_heads <= 0 || c.heads % c.kv_heads != 0 || c.head_dim <= 0 ||
      c.v_dim <= 0 || c.max_context < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a decode state needs heads (%d) a positive multiple of kv_heads (%d), positive head_dim "
        "(%d) and v_dim (%d), max_context >= 0 (%d)",
        c.heads, c.kv_heads, c.head_dim, c.v_dim, c.max_context));
  }
  if (c.int8_kv) {
    if (c.linear) {
      return absl::InvalidArgumentError(
          "an int8 KV cache is for softmax attention; a linear state keeps running sums");
    }
    if (c.kv_dtype != DType::kF32) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "an int8 KV cache computes in f32: kv_dtype must be f32, got %s", DTypeName(c.kv_dtype)));
    }
    if (RopeIsLengthDependent(c.rope)) {
      return absl::UnimplementedError(absl::StrFormat(
          "an int8 KV cache under the length-dependent RoPE rule \"%s\": its keys are rotated "
          "again when the length crosses the trained length, and quantizing them again would "
          "round them twice; use an f32 or bf16 cache",
          RopeRuleOf(c.rope->scaling.type).name));
    }
  }
  DecodeState s(std::move(config));
  const DecodeStateConfig& k = s.config_;
  s.storage_ = StorageFor(k);
  switch (s.storage_) {
    case Storage::kLinear: {
      RA_ASSIGN_OR_RETURN(LinearAttentionState st,
                          LinearAttentionState::Create(1, k.kv_heads, k.head_dim, k.v_dim));
      s.linear_.emplace(std::move(st));
      break;
    }
    case Storage::kKvCache: {
      RA_ASSIGN_OR_RETURN(KvCache kv, KvCache::Create(k.kv_heads, k.head_dim, k.v_dim,
                                                      k.max_context));
      s.kv_.emplace(std::move(kv));
      break;
    }
    case Storage::kInt8: {
      const int64_t rows = k.max_context * k.kv_heads;
      RA_ASSIGN_OR_RETURN(s.k_q_, Tensor::Create(DType::kF32, {(rows * k.head_dim + 3) / 4}));
      RA_ASSIGN_OR_RETURN(s.v_q_, Tensor::Create(DType::kF32, {(rows * k.v_dim + 3) / 4}));
      RA_ASSIGN_OR_RETURN(s.k_scale_, Tensor::Create(DType::kF32, {rows}));
      RA_ASSIGN_OR_RETURN(s.v_scale_, Tensor::Create(DType::kF32, {rows}));
      break;
    }
    case Storage::kTokenMajor:
      RA_ASSIGN_OR_RETURN(s.k_cache_, Tensor::Create(k.kv_dtype, {1, k.max_context, k.kv_heads,
                                                                  k.head_dim}));
      RA_ASSIGN_OR_RETURN(s.v_cache_,
                          Tensor::Create(k.kv_dtype, {1, k.max_context, k.kv_heads, k.v_dim}));
      break;
  }
  if (s.LengthDependent() && !k.linear) {
    RA_ASSIGN_OR_RETURN(s.k_raw_, Tensor::Create(DType::kF32, {1, k.max_context, k.kv_heads,
                                                               k.head_dim}));
  }
  if (k.rope && !s.LengthDependent()) {
    RA_ASSIGN_OR_RETURN(RopeRotator r,
                        RopeRotator::Create(*k.rope, k.max_context,
                                            std::min(k.max_context, k.rope_table_positions)));
    s.rotator_.emplace(std::move(r));
  }
  return s;
}

int64_t DecodeState::byte_size() const {
  int64_t bytes = static_cast<int64_t>(k_cache_.byte_size() + v_cache_.byte_size() +
                                       k_raw_.byte_size() + k_q_.byte_size() + v_q_.byte_size() +
                                       k_scale_.byte_size() + v_scale_.byte_size());
  if (kv_) bytes += static_cast<int64_t>(kv_->byte_size());
  if (linear_) bytes += linear_->byte_size();
  return bytes;
}

absl::Status DecodeState::PrepareRope(int64_t new_len) {
  if (!LengthDependent()) return absl::OkStatus();
  const DecodeStateConfig& c = config_;
  // Planned as transformers does, for the largest position + 1.
  RA_ASSIGN_OR_RETURN(RopeFrequencies f, ComputeRopeFrequencies(*c.rope, c.start_position + new_len));
  std::vector<double> key = f.inv_freq;
  key.push_back(f.attention_factor);
  if (rotator_ && key == rotator_freqs_) return absl::OkStatus();
  // Frequencies changed (dynamic NTK past L0, LongRoPE crossing its switch):
  // rotate every cached key again from its raw value, so the whole cache is
  // exactly what a one-shot pass over new_len tokens would hold. No table:
  // the rotator may change again next step.
  RA_ASSIGN_OR_RETURN(RopeRotator r, RopeRotator::FromFrequencies(*c.rope, f, 0));
  if (position_ > 0 && !c.linear) {
    RA_ASSIGN_OR_RETURN(Tensor keys,
                        Tensor::CopyOf(k_raw_.cview().Slice(1, 0, position_)));
    const int64_t start = c.start_position;
    RA_RETURN_IF_ERROR(r.Apply(keys.view(), Positions{{}, absl::MakeConstSpan(&start, 1)},
                               RopeDirection::kForward, 1));
    if (kv_) {
      RA_RETURN_IF_ERROR(kv_->WriteK(0, keys.cview()));
    } else {
      RA_RETURN_IF_ERROR(CopyRows(keys.cview(), k_cache_.view().Slice(1, 0, position_)));
    }
  }
  rotator_.emplace(std::move(r));
  rotator_freqs_ = std::move(key);
  return absl::OkStatus();
}

absl::Status DecodeState::Prepare(Job& job, int plan_threads, AttentionJob* attention,
                                  Tensor* q_scratch, bool* done) {
  const DecodeStateConfig& c = config_;
  const std::string& n = job.names;
  const int64_t tokens = job.q.rank() >= 2 ? job.q.dim(1) : 0;
  if (tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%sq must have shape [1, tokens >= 1, %d, %d], got %s", n, c.heads,
                        c.head_dim, DimsToString(job.q.dims())));
  }
  RA_RETURN_IF_ERROR(CheckStepTensor(job.q, n + "q", tokens, c.heads, c.head_dim));
  RA_RETURN_IF_ERROR(CheckStepTensor(job.k, n + "k", tokens, c.kv_heads, c.head_dim));
  RA_RETURN_IF_ERROR(CheckStepTensor(job.v, n + "v", tokens, c.kv_heads, c.v_dim));
  if (position_ + tokens > c.max_context) {
    return absl::OutOfRangeError(absl::StrFormat(
        "a step of %d tokens at position %d would exceed the session's max_context of %d", tokens,
        position_, c.max_context));
  }
  if (job.out.rank() != 4 || job.out.dim(0) != 1 || job.out.dim(1) != tokens ||
      job.out.dim(2) != c.heads || job.out.dim(3) != c.v_dim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the step's output must have shape [1, %d, %d, %d], got %s", tokens,
                        c.heads, c.v_dim, DimsToString(job.out.dims())));
  }
  const int64_t new_len = position_ + tokens;
  if (storage_ == Storage::kLinear) {
    LinearAttentionOptions lo;
    lo.rope = rotator_ ? &*rotator_ : nullptr;
    lo.num_threads = plan_threads;
    lo.check_finite = false;  // checked above
    *done = true;
    RA_RETURN_IF_ERROR(linear_->Step(job.q, job.k, job.v, lo, job.out));
    position_ = linear_->position();
    return absl::OkStatus();
  }
  // The queries, rotated in f32: the one copy a step needs of them.
  RA_ASSIGN_OR_RETURN(*q_scratch, CastTensor(job.q, DType::kF32));
  step_offset_ = position_;
  rope_offset_ = c.start_position + position_;
  const Positions at{{}, absl::MakeConstSpan(&rope_offset_, 1)};
  if (c.rope) {
    RA_RETURN_IF_ERROR(PrepareRope(new_len));
    RA_RETURN_IF_ERROR(rotator_->Apply(q_scratch->view(), at, RopeDirection::kForward, 1));
  }
  // Rows past position_ are scratch until position_ moves, so writing them
  // before the attention succeeds loses nothing on error.
  if (k_raw_.num_elements() > 0) {
    RA_RETURN_IF_ERROR(CopyRows(job.k, k_raw_.view().Slice(1, position_, tokens)));
  }
  if (storage_ == Storage::kInt8) {
    // Rotated in f32, then quantized once per (token, kv head).
    RA_ASSIGN_OR_RETURN(Tensor kf, CastTensor(job.k, DType::kF32));
    if (c.rope) RA_RETURN_IF_ERROR(rotator_->Apply(kf.view(), at, RopeDirection::kForward, 1));
    RA_ASSIGN_OR_RETURN(Tensor vf, CastTensor(job.v, DType::kF32));
    QuantizeInto(kf, /*keys=*/true, position_);
    QuantizeInto(vf, /*keys=*/false, position_);
  } else if (storage_ == Storage::kTokenMajor && c.kv_dtype == DType::kF32) {
    // Straight into the cache rows, rotated there.
    const TensorView rows = k_cache_.view().Slice(1, position_, tokens);
    RA_RETURN_IF_ERROR(CopyRows(job.k, rows));
    if (c.rope) RA_RETURN_IF_ERROR(rotator_->Apply(rows, at, RopeDirection::kForward, 1));
  } else {
    // Rotated in f32 first, rounded once into a bf16 cache.
    RA_ASSIGN_OR_RETURN(Tensor kf, CastTensor(job.k, DType::kF32));
    if (c.rope) RA_RETURN_IF_ERROR(rotator_->Apply(kf.view(), at, RopeDirection::kForward, 1));
    if (kv_) {
      RA_RETURN_IF_ERROR(kv_->WriteK(position_, kf.cview()));
    } else {
      RA_RETURN_IF_ERROR(CopyRows(kf.cview(), k_cache_.view().Slice(1, position_, tokens)));
    }
  }
  if (storage_ == Storage::kInt8) {
    // Written above.
  } else if (kv_) {
    if (job.v.dtype() == DType::kF32) {
      RA_RETURN_IF_ERROR(kv_->WriteV(position_, job.v));
    } else {
      RA_ASSIGN_OR_RETURN(Tensor vf, CastTensor(job.v, DType::kF32));
      RA_RETURN_IF_ERROR(kv_->WriteV(position_, vf.cview()));
    }
  } else {
    RA_RETURN_IF_ERROR(CopyRows(job.v, v_cache_.view().Slice(1, position_, tokens)));
  }
  attention->q = q_scratch->cview();
  if (storage_ == Storage::kInt8) {
    Int8View();
    attention->int8 = &int8_view_;
    attention->cache_length = new_len;
  } else if (kv_) {
    attention->cache = &*kv_;
    attention->cache_length = new_len;
  } else {
    attention->k = k_cache_.cview().Slice(1, 0, new_len);
    attention->v = v_cache_.cview().Slice(1, 0, new_len);
  }
  AttentionOptions& o = attention->options;
  o = c.attention;
  o.causal = true;
  o.q_offsets = absl::MakeConstSpan(&step_offset_, 1);
  o.key_lengths = {};
  o.check_finite = false;  // new rows were checked above, old ones when appended
  o.num_threads = plan_threads;  // a prompt's prefill; the decode pass has its own threads
  o.plan_threads = plan_threads;
  o.stop = job.stop;
  attention->out = job.out;
  return absl::OkStatus();
}

void DecodeState::StepMany(absl::Span<Job> jobs, int threads, int plan_threads) {
  std::vector<AttentionJob> attention;
  std::vector<Tensor> q_scratch(jobs.size());
  std::vector<Job*> waiting;
  attention.reserve(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    Job& job = jobs[i];
    AttentionJob a;
    bool done = false;
    job.status = job.state->Prepare(job, plan_threads, &a, &q_scratch[i], &done);
    if (!job.status.ok() || done) continue;
    attention.push_back(std::move(a));
    waiting.push_back(&job);
  }
  AttendBatch(absl::MakeSpan(attention), threads);
  for (size_t i = 0; i < waiting.size(); ++i) {
    Job& job = *waiting[i];
    job.status = attention[i].status;
    if (!job.status.ok() && job.stop != nullptr && job.stop->ShouldStop()) {
      job.status = job.stop->status();  // stopped mid-way: the stop's own code
    }
    if (job.status.ok()) job.state->position_ += job.q.dim(1);
  }
}

absl::Status DecodeState::Step(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                               TensorView out, int threads, const StopToken* stop,
                               std::string names) {
  Job job;
  job.state = this;
  job.q = std::move(q);
  job.k = std::move(k);
  job.v = std::move(v);
  job.out = std::move(out);
  job.stop = stop;
  job.names = std::move(names);
  StepMany(absl::MakeSpan(&job, 1), threads, threads);
  return job.status;
}

absl::Status DecodeState::Truncate(int64_t position) {
  if (storage_ == Storage::kLinear) {
    return absl::UnimplementedError(
        "linear-attention sessions cannot be truncated: their state is a running sum");
  }
  if (position < 0 || position > position_) {
    return absl::OutOfRangeError(absl::StrFormat(
        "truncate position %d is outside [0, %d] (the session's length)", position, position_));
  }
  position_ = position;
  return absl::OkStatus();
}

absl::Status DecodeState::Import(ConstTensorView k, ConstTensorView v, KeyForm form,
                                 const std::string& names) {
  const DecodeStateConfig& c = config_;
  if (storage_ == Storage::kLinear) {
    return absl::UnimplementedError(
        "a linear-attention state has no KV to import: its state is a running sum");
  }
  if (position_ != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "a KV prefix can only be imported into an empty state; this one holds %d tokens",
        position_));
  }
  const int64_t tokens = k.rank() >= 2 ? k.dim(1) : -1;
  RA_RETURN_IF_ERROR(CheckStepTensor(k, names + "k", tokens, c.kv_heads, c.head_dim));
  RA_RETURN_IF_ERROR(CheckStepTensor(v, names + "v", tokens, c.kv_heads, c.v_dim));
  if (tokens > c.max_context) {
    return absl::OutOfRangeError(absl::StrFormat(
        "a prefix of %d tokens exceeds the session's max_context of %d", tokens, c.max_context));
  }
  if (tokens == 0) return absl::OkStatus();
  const int64_t start = c.start_position;
  const Positions at{{}, absl::MakeConstSpan(&start, 1)};
  // Keys in f32, raw (unrotated).
  RA_ASSIGN_OR_RETURN(Tensor raw, CastTensor(k, DType::kF32));
  if (c.rope && form == KeyForm::kRotated && LengthDependent()) {
    // Undo the rotation they were given with (this length's frequencies):
    // the state re-rotates from raw keys when the frequencies change.
    RA_ASSIGN_OR_RETURN(RopeRotator given,
                        RopeRotator::Create(*c.rope, start + tokens, 0));
    RA_RETURN_IF_ERROR(given.Apply(raw.view(), at, RopeDirection::kInverse, 1));
  }
  if (k_raw_.num_elements() > 0) {
    RA_RETURN_IF_ERROR(CopyRows(raw.cview(), k_raw_.view().Slice(1, 0, tokens)));
  }
  Tensor rotated;
  if (c.rope && form == KeyForm::kRotated && !LengthDependent()) {
    // Stored exactly as given.
    RA_ASSIGN_OR_RETURN(rotated, CastTensor(k, DType::kF32));
  } else {
    rotated = std::move(raw);
    if (c.rope) {
      if (LengthDependent()) {
        RA_RETURN_IF_ERROR(PrepareRope(tokens));  // position_ is 0: nothing re-rotated
      }
      RA_RETURN_IF_ERROR(rotator_->Apply(rotated.view(), at, RopeDirection::kForward, 1));
    }
  }
  if (storage_ == Storage::kInt8) {
    RA_ASSIGN_OR_RETURN(Tensor vf, CastTensor(v, DType::kF32));
    QuantizeInto(rotated, /*keys=*/true, 0);
    QuantizeInto(vf, /*keys=*/false, 0);
  } else if (kv_) {
    RA_RETURN_IF_ERROR(kv_->WriteK(0, rotated.cview()));
    RA_ASSIGN_OR_RETURN(Tensor vf, CastTensor(v, DType::kF32));
    RA_RETURN_IF_ERROR(kv_->WriteV(0, vf.cview()));
  } else {
    RA_RETURN_IF_ERROR(CopyRows(rotated.cview(), k_cache_.view().Slice(1, 0, tokens)));
    RA_RETURN_IF_ERROR(CopyRows(v, v_cache_.view().Slice(1, 0, tokens)));
  }
  position_ = tokens;
  return absl::OkStatus();
}

absl::StatusOr<DecodeState::Exported> DecodeState::Export() const {
  const DecodeStateConfig& c = config_;
  if (storage_ == Storage::kLinear) {
    return absl::UnimplementedError(
        "a linear-attention state has no KV to export: its state is a running sum");
  }
  Exported e;
  const int64_t n = position_;
  if (storage_ == Storage::kInt8) {
    // The stored values, dequantized: scale * q.
    RA_ASSIGN_OR_RETURN(e.k, Tensor::Create(DType::kF32, {1, n, c.kv_heads, c.head_dim}));
    RA_ASSIGN_OR_RETURN(e.v, Tensor::Create(DType::kF32, {1, n, c.kv_heads, c.v_dim}));
    const int8_t* kq = reinterpret_cast<const int8_t*>(k_q_.data<float>());
    const int8_t* vq = reinterpret_cast<const int8_t*>(v_q_.data<float>());
    const float* ks = k_scale_.data<float>();
    const float* vs = v_scale_.data<float>();
    float* kd = e.k.data<float>();
    float* vd = e.v.data<float>();
    for (int64_t r = 0; r < n * c.kv_heads; ++r) {
      for (int64_t x = 0; x < c.head_dim; ++x) {
        kd[r * c.head_dim + x] = ks[r] * static_cast<float>(kq[r * c.head_dim + x]);
      }
      for (int64_t x = 0; x < c.v_dim; ++x) {
        vd[r * c.v_dim + x] = vs[r] * static_cast<float>(vq[r * c.v_dim + x]);
      }
    }
  } else if (kv_) {
    RA_ASSIGN_OR_RETURN(e.k, Tensor::Create(DType::kF32, {1, n, c.kv_heads, c.head_dim}));
    RA_ASSIGN_OR_RETURN(e.v, Tensor::Create(DType::kF32, {1, n, c.kv_heads, c.v_dim}));
    RA_RETURN_IF_ERROR(kv_->ReadK(0, e.k.view()));
    RA_RETURN_IF_ERROR(kv_->ReadV(0, e.v.view()));
  } else {
    RA_ASSIGN_OR_RETURN(e.k, Tensor::CopyOf(k_cache_.cview().Slice(1, 0, n)));
    RA_ASSIGN_OR_RETURN(e.v, Tensor::CopyOf(v_cache_.cview().Slice(1, 0, n)));
  }
  return e;
}

absl::Status DecodeState::CopyFrom(const DecodeState& other) {
  const DecodeStateConfig& a = config_;
  const DecodeStateConfig& b = other.config_;
  if (storage_ != other.storage_ || a.kv_heads != b.kv_heads || a.head_dim != b.head_dim ||
      a.v_dim != b.v_dim || a.kv_dtype != b.kv_dtype || other.position_ > a.max_context ||
      (k_raw_.num_elements() > 0) != (other.k_raw_.num_elements() > 0)) {
    return absl::InvalidArgumentError("a decode state can only copy one of its own kind");
  }
  const int64_t n = other.position_;
  if (linear_) {
    linear_ = other.linear_;
  } else if (storage_ == Storage::kInt8) {
    const int64_t rows = n * a.kv_heads;
    std::memcpy(k_q_.data<float>(), other.k_q_.data<float>(), rows * a.head_dim);
    std::memcpy(v_q_.data<float>(), other.v_q_.data<float>(), rows * a.v_dim);
    std::memcpy(k_scale_.data<float>(), other.k_scale_.data<float>(), rows * sizeof(float));
    std::memcpy(v_scale_.data<float>(), other.v_scale_.data<float>(), rows * sizeof(float));
  } else if (kv_) {
    RA_RETURN_IF_ERROR(kv_->CopyFrom(*other.kv_, n));
  } else {
    RA_RETURN_IF_ERROR(CopyRows(other.k_cache_.cview().Slice(1, 0, n),
                                k_cache_.view().Slice(1, 0, n)));
    RA_RETURN_IF_ERROR(CopyRows(other.v_cache_.cview().Slice(1, 0, n),
                                v_cache_.view().Slice(1, 0, n)));
  }
  if (k_raw_.num_elements() > 0) {
    RA_RETURN_IF_ERROR(CopyRows(other.k_raw_.cview().Slice(1, 0, n),
                                k_raw_.view().Slice(1, 0, n)));
  }
  rotator_ = other.rotator_;
  rotator_freqs_ = other.rotator_freqs_;
  position_ = n;
  return absl::OkStatus();
}

}  // namespace ropeattn
