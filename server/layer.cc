#include "server/layer.h"

#include <immintrin.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "core/encodings.h"
#include "core/limits.h"
#include "core/gemm.h"
#include "core/rope.h"
#include "core/status_macros.h"
#include "server/convert.h"

namespace ropeattn::server {
namespace {

constexpr int64_t kRopeTable = 8192;  // the most cos/sin rows precomputed per call

// The cos/sin rows a call over [b, s] tokens at positions below `len`
// precomputes: q and k each rotate b * s token rows (RopeTablePositionsFor).
int64_t LayerRopeTableRows(int64_t len, int64_t b, int64_t s) {
  return RopeTablePositionsFor(len, SatMul(SatMul(b, s), 2), kRopeTable);
}

// A dense [rows, cols] view of a dense tensor's memory.
ConstTensorView As2D(const ConstTensorView& t, int64_t rows, int64_t cols) {
  return ConstTensorView(t.raw(), t.dtype(), {rows, cols});
}

absl::StatusOr<Tensor> Project(const ConstTensorView& x2d, const ConstTensorView& w,
                               const ConstTensorView& b, Dims out_dims, int threads,
                               absl::string_view what) {
  RA_ASSIGN_OR_RETURN(Tensor y, Tensor::Create(DType::kF32, out_dims));
  TensorView y2d(y.data<float>(), DType::kF32, {x2d.dim(0), w.dim(0)});
  absl::Status st = Linear(x2d, w, b, y2d, threads);
  if (!st.ok()) return absl::Status(st.code(), absl::StrCat(what, ": ", st.message()));
  return y;
}

// Finite inputs times finite weights can still overflow: such a result is
// refused naming the tensor and the element, never answered.
absl::Status CheckProduct(const Tensor& t, absl::string_view what, absl::string_view cause,
                          absl::string_view advice = "; reduce the magnitude of the input") {
  absl::Status st = CheckFinite(t.cview(), what);
  if (st.ok()) return st;
  return absl::InvalidArgumentError(
      absl::StrCat(absl::StrReplaceAll(st.message(), {{": inputs must be finite", ""}}), ": ",
                   cause, " overflows the float range", advice));
}

// Per-head RMSNorm of x [B, S, heads, head_dim] (f32, dense) in place:
// x / sqrt(mean(x^2) + eps) times w (Qwen3) or 1 + w (Gemma 3), each row's
// sum of squares accumulated in fp64.
void NormHeads(Tensor& x, const ConstTensorView& w, QkNorm kind, double eps) {
  const int64_t d = x.dim(3);
  const int64_t rows = x.num_elements() / d;
  float* data = x.data<float>();
  std::vector<double> gain(static_cast<size_t>(d));
  for (int64_t i = 0; i < d; ++i) {
    const double wi = w.GetFloat({i});
    gain[static_cast<size_t>(i)] = kind == QkNorm::kRmsOnePlus ? 1.0 + wi : wi;
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* row = data + r * d;
    double ss = 0.0;
    for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(row[i]) * row[i];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(d) + eps);
    for (int64_t i = 0; i < d; ++i) {
      row[i] = static_cast<float>(row[i] * inv * gain[static_cast<size_t>(i)]);
    }
  }
}

}  // namespace

namespace {

// n copies of one error (StatusOr of a move-only type is not copyable).
template <typename T>
std::vector<absl::StatusOr<T>> Failed(size_t n, const absl::Status& st) {
  std::vector<absl::StatusOr<T>> out;
  for (size_t i = 0; i < n; ++i) out.emplace_back(st);
  return out;
}

// The per-head norms and the finiteness checks of a step's projections.
absl::Status FinishQKV(const ModelConfig& c, const LayerWeights& w, int64_t layer, Projections& p) {
  if (c.qk_norm != QkNorm::kNone) {
    NormHeads(p.q, w.q_norm, c.qk_norm, c.rms_norm_eps);
    NormHeads(p.k, w.k_norm, c.qk_norm, c.rms_norm_eps);
  }
  const std::string cause = absl::StrCat("hidden times layer ", layer, "'s weights");
  RA_RETURN_IF_ERROR(CheckProduct(p.q, "q_proj output", cause));
  RA_RETURN_IF_ERROR(CheckProduct(p.k, "k_proj output", cause));
  return CheckProduct(p.v, "v_proj output", cause);
}

absl::Status CheckOutput(const Tensor& out, int64_t layer) {
  return CheckProduct(out, "o_proj output",
                      absl::StrCat("the attention times layer ", layer, "'s o_proj"));
}

// Several inputs' rows ([1, tokens, in] each, f32 or bf16) stacked into one
// f32 [rows, in] matrix (exact from bf16), with each input's first row.
absl::StatusOr<Tensor> StackRows(absl::Span<const ConstTensorView> xs, int64_t in,
                                 std::vector<int64_t>* first) {
  int64_t rows = 0;
  for (const ConstTensorView& x : xs) {
    first->push_back(rows);
    rows += x.num_elements() / std::max<int64_t>(1, in);
  }
  RA_ASSIGN_OR_RETURN(Tensor stacked, Tensor::Create(DType::kF32, {rows, in}));
  float* dst = stacked.data<float>();
  for (const ConstTensorView& x : xs) {
    const int64_t n = x.num_elements();
    if (x.dtype() == DType::kF32) {
      std::memcpy(dst, x.raw(), static_cast<size_t>(n) * sizeof(float));
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(x.raw());
      for (int64_t i = 0; i < n; ++i) dst[i] = BF16ToFloat(src[i]);
    }
    dst += n;
  }
  return stacked;
}

// y = LinearRows(x, w, b), then each input's rows copied out into a tensor
// of its own with `tail` trailing dims ({heads, head_dim} or {hidden}).
absl::StatusOr<std::vector<Tensor>> ProjectRowsSplit(const Tensor& x, const std::vector<int64_t>& first,
                                                     absl::Span<const ConstTensorView> xs,
                                                     const ConstTensorView& w, const ConstTensorView& b,
                                                     Dims tail, int threads, absl::string_view what) {
  RA_ASSIGN_OR_RETURN(Tensor y, Tensor::Create(DType::kF32, {x.dim(0), w.dim(0)}));
  absl::Status st = LinearRows(x.cview(), w, b, y.view(), threads);
  if (!st.ok()) return absl::Status(st.code(), absl::StrCat(what, ": ", st.message()));
  std::vector<Tensor> out;
  for (size_t i = 0; i < xs.size(); ++i) {
    const int64_t tokens = xs[i].dim(1);
    Dims dims = {1, tokens};
    for (int64_t d : tail) dims.push_back(d);
    RA_ASSIGN_OR_RETURN(Tensor t, Tensor::Create(DType::kF32, dims));
    std::memcpy(t.data<float>(), y.data<float>() + first[i] * w.dim(0), t.byte_size());
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace

absl::StatusOr<Projections> ProjectQKV(const Model& model, int64_t layer,
                                       const ConstTensorView& hidden, int threads) {
  RA_ASSIGN_OR_RETURN(const LayerWeights* w, model.layer(layer));
  const ModelConfig& c = model.config();
  const int64_t b = hidden.dim(0), s = hidden.dim(1);
  const ConstTensorView x = As2D(hidden, b * s, c.hidden_size);
  Projections p;
  RA_ASSIGN_OR_RETURN(
      p.q, Project(x, w->q_proj, w->q_bias, {b, s, c.num_heads, c.head_dim}, threads, "q_proj"));
  RA_ASSIGN_OR_RETURN(
      p.k, Project(x, w->k_proj, w->k_bias, {b, s, c.num_kv_heads, c.head_dim}, threads, "k_proj"));
  RA_ASSIGN_OR_RETURN(
      p.v, Project(x, w->v_proj, w->v_bias, {b, s, c.num_kv_heads, c.head_dim}, threads, "v_proj"));
  RA_RETURN_IF_ERROR(FinishQKV(c, *w, layer, p));
  return p;
}

absl::StatusOr<Tensor> ProjectOutput(const Model& model, int64_t layer, const ConstTensorView& attn,
                                     int threads) {
  RA_ASSIGN_OR_RETURN(const LayerWeights* w, model.layer(layer));
  const ModelConfig& c = model.config();
  const int64_t b = attn.dim(0), s = attn.dim(1);
  RA_ASSIGN_OR_RETURN(Tensor out, Project(As2D(attn, b * s, c.num_heads * c.head_dim), w->o_proj,
                                           w->o_bias, {b, s, c.hidden_size}, threads, "o_proj"));
  RA_RETURN_IF_ERROR(CheckOutput(out, layer));
  return out;
}

std::vector<absl::StatusOr<Projections>> ProjectQKVRows(const Model& model, int64_t layer,
                                                        absl::Span<const ConstTensorView> hidden,
                                                        int threads) {
  auto fail = [&](const absl::Status& st) { return Failed<Projections>(hidden.size(), st); };
  absl::StatusOr<const LayerWeights*> w = model.layer(layer);
  if (!w.ok()) return fail(w.status());
  const ModelConfig& c = model.config();
  std::vector<int64_t> first;
  const absl::StatusOr<Tensor> x = StackRows(hidden, c.hidden_size, &first);
  if (!x.ok()) return fail(x.status());
  absl::StatusOr<std::vector<Tensor>> q = ProjectRowsSplit(
      *x, first, hidden, (*w)->q_proj, (*w)->q_bias, {c.num_heads, c.head_dim}, threads, "q_proj");
  if (!q.ok()) return fail(q.status());
  absl::StatusOr<std::vector<Tensor>> k = ProjectRowsSplit(
      *x, first, hidden, (*w)->k_proj, (*w)->k_bias, {c.num_kv_heads, c.head_dim}, threads, "k_proj");
  if (!k.ok()) return fail(k.status());
  absl::StatusOr<std::vector<Tensor>> v = ProjectRowsSplit(
      *x, first, hidden, (*w)->v_proj, (*w)->v_bias, {c.num_kv_heads, c.head_dim}, threads, "v_proj");
  if (!v.ok()) return fail(v.status());
  std::vector<absl::StatusOr<Projections>> out;
  for (size_t i = 0; i < hidden.size(); ++i) {
    Projections p{std::move((*q)[i]), std::move((*k)[i]), std::move((*v)[i])};
    const absl::Status st = FinishQKV(c, **w, layer, p);
    if (st.ok()) {
      out.emplace_back(std::move(p));
    } else {
      out.emplace_back(st);
    }
  }
  return out;
}

std::vector<absl::StatusOr<Tensor>> ProjectOutputRows(const Model& model, int64_t layer,
                                                      absl::Span<const ConstTensorView> attn,
                                                      int threads) {
  absl::StatusOr<const LayerWeights*> w = model.layer(layer);
  if (!w.ok()) return Failed<Tensor>(attn.size(), w.status());
  const ModelConfig& c = model.config();
  std::vector<int64_t> first;
  const absl::StatusOr<Tensor> x = StackRows(attn, c.num_heads * c.head_dim, &first);
  if (!x.ok()) return Failed<Tensor>(attn.size(), x.status());
  absl::StatusOr<std::vector<Tensor>> y = ProjectRowsSplit(
      *x, first, attn, (*w)->o_proj, (*w)->o_bias, {c.hidden_size}, threads, "o_proj");
  if (!y.ok()) return Failed<Tensor>(attn.size(), y.status());
  std::vector<absl::StatusOr<Tensor>> out;
  for (Tensor& t : *y) {
    const absl::Status st = CheckOutput(t, layer);
    if (st.ok()) {
      out.emplace_back(std::move(t));
    } else {
      out.emplace_back(st);
    }
  }
  return out;
}

absl::StatusOr<Tensor> LayerForward(const Model& model, int64_t layer,
                                    const ConstTensorView& hidden, AttentionOptions options,
                                    absl::Span<const int64_t> offsets, int threads) {
  const ModelConfig& c = model.config();
  const int64_t b = hidden.dim(0), s = hidden.dim(1);
  RA_ASSIGN_OR_RETURN(Projections p, ProjectQKV(model, layer, hidden, threads));
  if (const RopeConfig* rope = RopeOfLayer(c, layer); rope != nullptr) {
    int64_t len = s;
    for (int64_t off : offsets) len = std::max(len, off + s);
    RA_ASSIGN_OR_RETURN(
        RopeRotator rot,
        RopeRotator::Create(*rope, len, LayerRopeTableRows(len, b, s)));
    const Positions at{{}, offsets};
    RA_RETURN_IF_ERROR(rot.Apply(p.q.view(), at, RopeDirection::kForward, threads));
    RA_RETURN_IF_ERROR(rot.Apply(p.k.view(), at, RopeDirection::kForward, threads));
    // The projections were finite (checked); rotated, values near the
    // float range can leave it: named as what they are, not as inputs.
    RA_RETURN_IF_ERROR(CheckProduct(p.q, "q (q_proj output rotated by RoPE)",
                                    absl::StrCat("hidden times layer ", layer,
                                                 "'s q_proj, rotated,")));
    RA_RETURN_IF_ERROR(CheckProduct(p.k, "k (k_proj output rotated by RoPE)",
                                    absl::StrCat("hidden times layer ", layer,
                                                 "'s k_proj, rotated,")));
  }
  // Keys sit at the same positions as the queries: shift the mask frame so
  // query i of row b (at offset + i) sees key j (at offset + j) for j <= i.
  // Attend places key j at position j, so the queries' offset is 0 here.
  options.q_offsets = {};
  options.num_threads = threads;
  RA_ASSIGN_OR_RETURN(Tensor attn, Tensor::Create(DType::kF32, {b, s, c.num_heads, c.head_dim}));
  RA_RETURN_IF_ERROR(Attend(p.q.view(), p.k.view(), p.v.view(), options, attn.view()));
  return ProjectOutput(model, layer, attn.view(), threads);
}

absl::Status ModelLayerOptions(const ModelConfig& c, int64_t layer, const v1::AttentionSpec& spec,
                               AttentionOptions* options) {
  // The geometry and the positional scheme are the model's: a spec that
  // sets them asks for something else, which layer mode does not compute.
  std::vector<std::string> set;
  if (spec.heads() != 0) set.push_back(absl::StrCat("spec.heads = ", spec.heads()));
  if (spec.kv_heads() != 0) set.push_back(absl::StrCat("spec.kv_heads = ", spec.kv_heads()));
  if (spec.head_dim() != 0) set.push_back(absl::StrCat("spec.head_dim = ", spec.head_dim()));
  switch (spec.positional_case()) {
    case v1::AttentionSpec::POSITIONAL_NOT_SET:
      break;
    case v1::AttentionSpec::kRope:
      set.push_back("spec.rope");
      break;
    case v1::AttentionSpec::kAlibi:
      set.push_back("spec.alibi");
      break;
    case v1::AttentionSpec::kT5:
      set.push_back("spec.t5");
      break;
  }
  if (!set.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        absl::StrJoin(set, ", "), ": heads, kv_heads, head_dim and the positional scheme come "
        "from the model (", FamilyName(c.family), ", ", c.num_heads, " heads over ",
        c.num_kv_heads, ", head_dim ", c.head_dim, ") in layer mode; leave them unset"));
  }
  RA_RETURN_IF_ERROR(CheckFiniteRange(spec.scale(), 0.0, kMaxLogitScale, "spec.scale"));
  RA_RETURN_IF_ERROR(CheckSoftcap(spec.softcap(), "spec.softcap"));
  if (spec.window() < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("spec.window must be >= 0 (0 means none), got %d", spec.window()));
  }
  const int64_t window = c.layers.empty() ? 0 : c.layers[static_cast<size_t>(layer)].window;
  // transformers' scaling: head_dim**-0.5 (or query_pre_attn_scalar**-0.5).
  const double scale = c.scale > 0.0 ? c.scale : std::pow(static_cast<double>(c.head_dim), -0.5);
  // The spec may restate the model's values, never change them. The kernels
  // scale in f32: a restated value that rounds to the same f32 is the same
  // computation (1/sqrt(x) and x**-0.5 differ in fp64's last bit for many x).
  if (spec.scale() != 0.0 && static_cast<float>(spec.scale()) != static_cast<float>(scale)) {
    // Shortest round-trip spellings: two values that differ show how.
    auto shortest = [](double v) {
      char buf[32];
      const auto r = std::to_chars(buf, buf + sizeof(buf), v);
      return std::string(buf, r.ptr);
    };
    return absl::InvalidArgumentError(absl::StrFormat(
        "spec.scale = %s differs from layer %d's own logit scale %s (%s); leave it 0 in "
        "layer mode",
        shortest(spec.scale()), layer, shortest(scale),
        c.scale > 0.0 ? "query_pre_attn_scalar^-0.5" : "head_dim^-0.5"));
  }
  if (spec.softcap() != 0.0 && spec.softcap() != c.softcap) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "spec.softcap = %g differs from the model's attn_logit_softcapping (%g, 0 meaning none); "
        "leave it 0 in layer mode",
        spec.softcap(), c.softcap));
  }
  if (spec.window() != 0 && spec.window() != window) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "spec.window = %d differs from layer %d's sliding window (%d, 0 meaning none); leave it 0 "
        "in layer mode",
        spec.window(), layer, window));
  }
  if (spec.causal() && !c.causal) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.causal is true, but ", FamilyName(c.family),
        " attends bidirectionally; leave it false in layer mode"));
  }
  options->scale = c.scale;
  options->softcap = c.softcap;
  options->window = window;
  options->causal = c.causal;
  return absl::OkStatus();
}

absl::StatusOr<ResolvedLayer> ResolveLayer(const ModelRegistry& models, absl::string_view model,
                                           int64_t layer) {
  ResolvedLayer r;
  RA_ASSIGN_OR_RETURN(r.model, models.Get(model));
  if (layer < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "layer must be >= 0 (model %s has layers [0, %d)), got %d", model, r.model->num_layers(),
        layer));
  }
  if (layer >= r.model->num_layers()) {
    return absl::OutOfRangeError(absl::StrFormat("layer %d is outside model %s's layers [0, %d)",
                                                 layer, model, r.model->num_layers()));
  }
  r.layer = layer;
  return r;
}

namespace {

struct LayerPlan {
  ResolvedLayer layer;
  WireShape hidden;
  AttentionOptions options;
  std::vector<int64_t> offsets;
  DType out_dtype = DType::kF32;
  bool empty = false;  // no tokens: an empty answer, no compute
  LayerDims dims;
};

}  // namespace

absl::Status CheckTablePositions(const ModelConfig& config, int64_t end, absl::string_view what) {
  if (config.family == Family::kGptJ && end > config.max_positions) {
    return absl::OutOfRangeError(absl::StrFormat(
        "%s reaches position %d, past the end of model %s's sinusoid table (n_positions %d: "
        "transformers' GPT-J has no rotation beyond it)",
        what, end - 1, config.model_type, config.max_positions));
  }
  return absl::OkStatus();
}

namespace {

absl::StatusOr<LayerPlan> PlanLayerAttend(const ModelRegistry& models,
                                          const v1::AttendRequest& request, int threads) {
  if (request.has_q() || request.has_k() || request.has_v()) {
    return absl::InvalidArgumentError(
        "AttendRequest: set either q/k/v or layer, not both (layer mode projects q/k/v itself)");
  }
  if (request.return_probs()) {
    return absl::UnimplementedError("return_probs is not supported in layer mode");
  }
  if (!request.q_positions().empty() || !request.k_positions().empty()) {
    return absl::InvalidArgumentError(
        "q_positions and k_positions are for q/k/v requests; layer mode places its tokens with "
        "q_offsets");
  }
  LayerPlan plan;
  const v1::LayerInput& in = request.layer();
  RA_ASSIGN_OR_RETURN(plan.layer, ResolveLayer(models, in.model(), in.layer()));
  const ModelConfig& c = plan.layer.model->config();
  RA_ASSIGN_OR_RETURN(plan.hidden, ParseWireShape(in.hidden(), "layer.hidden"));
  if (plan.hidden.rank() != 3 || plan.hidden.dim(2) != c.hidden_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "layer.hidden must have shape [batch, seq, %d] (model %s's hidden_size), got %s",
        c.hidden_size, in.model(), DimsToString(plan.hidden.dims)));
  }
  const int64_t b = plan.hidden.dim(0), s = plan.hidden.dim(1);
  RA_RETURN_IF_ERROR(
      ModelLayerOptions(c, plan.layer.layer, request.spec(), &plan.options));
  if (!request.q_offsets().empty() && request.q_offsets_size() != b) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "q_offsets has %d entries, expected one per batch row (%d)", request.q_offsets_size(), b));
  }
  for (int i = 0; i < request.q_offsets_size(); ++i) {
    RA_RETURN_IF_ERROR(
        CheckPositions(request.q_offsets(i), s, absl::StrFormat("q_offsets[%d]", i),
                       "layer.hidden.shape[1]"));
  }
  if (!request.key_lengths().empty() && request.key_lengths_size() != b) {
    return absl::InvalidArgumentError(
        absl::StrFormat("key_lengths has %d entries, expected one per batch row (%d) or none",
                        request.key_lengths_size(), b));
  }
  for (int i = 0; i < request.key_lengths_size(); ++i) {
    if (request.key_lengths(i) < 0 || request.key_lengths(i) > s) {
      return absl::OutOfRangeError(absl::StrFormat(
          "key_lengths[%d] = %d is outside [0, %d] (the hidden states' seq length)", i,
          request.key_lengths(i), s));
    }
  }
  RA_ASSIGN_OR_RETURN(plan.out_dtype,
                      DTypeFromProto(request.out_dtype(), "out_dtype", DType::kF32));
  // No tokens (a zero batch or seq): the answer is empty, and the other dim
  // (up to 2^63 for zero bytes) must not size any buffer or loop.
  plan.empty = plan.hidden.elements == 0;
  plan.offsets.assign(request.q_offsets().begin(), request.q_offsets().end());
  int64_t len = s;
  for (int64_t off : plan.offsets) len = std::max(len, off + s);
  RA_RETURN_IF_ERROR(CheckTablePositions(
      c, len, plan.offsets.empty() ? "layer.hidden" : "layer.hidden at its q_offsets"));
  LayerDims& d = plan.dims;
  d.batch = b;
  d.seq = s;
  d.hidden = c.hidden_size;
  d.heads = c.num_heads;
  d.kv_heads = c.num_kv_heads;
  d.head_dim = c.head_dim;
  d.hidden_dtype = plan.hidden.dtype;
  d.out_dtype = plan.out_dtype;
  d.threads = threads;
  if (const RopeConfig* rope = RopeOfLayer(c, plan.layer.layer); rope != nullptr && !plan.empty) {
    d.rope_rotary_dim = rope->effective_rotary_dim();
    d.rope_table_rows = LayerRopeTableRows(len, b, s);
  }
  return plan;
}

}  // namespace

absl::StatusOr<Cost> PriceLayerAttend(const ModelRegistry& models, const v1::AttendRequest& request,
                                      int threads) {
  RA_ASSIGN_OR_RETURN(const LayerPlan plan, PlanLayerAttend(models, request, threads));
  if (plan.empty) {
    Cost c;
    c.reply_bytes = kReplyOverheadBytes;
    c.transient_bytes = kReplyOverheadBytes;
    return c;
  }
  return LayerAttendCost(plan.dims);
}

absl::Status RunLayerAttend(const ModelRegistry& models, const v1::AttendRequest& request,
                            v1::AttendResponse* response, const ComputeOptions& options) {
  const int threads = std::max(1, options.threads);
  RA_ASSIGN_OR_RETURN(LayerPlan plan, PlanLayerAttend(models, request, threads));
  const LayerDims& d = plan.dims;
  if (plan.empty) {
    v1::Tensor* out = response->mutable_out();
    out->set_dtype(DTypeToProto(plan.out_dtype));
    for (int64_t x : {d.batch, d.seq, d.hidden}) out->add_shape(x);
    return absl::OkStatus();
  }
  RA_ASSIGN_OR_RETURN(Tensor hidden, TensorFromProto(request.layer().hidden(), "layer.hidden"));
  RA_RETURN_IF_ERROR(CheckFinite(hidden.view(), "layer.hidden"));
  plan.options.key_lengths =
      absl::MakeConstSpan(request.key_lengths().data(), request.key_lengths_size());
  plan.options.stop = options.stop;
  RA_ASSIGN_OR_RETURN(Tensor out, LayerForward(*plan.layer.model, plan.layer.layer, hidden.view(),
                                               plan.options, plan.offsets, threads));
  if (plan.out_dtype != DType::kF32) {
    RA_ASSIGN_OR_RETURN(out, CastTensor(out.view(), plan.out_dtype));
    RA_RETURN_IF_ERROR(CheckProduct(out, "out", "rounding to bf16", "; ask for f32"));
  }
  TensorToProto(out.view(), response->mutable_out());
  return absl::OkStatus();
}

namespace {

struct EmbedPlan {
  std::shared_ptr<const Model> model;
  int64_t batch = 1, seq = 0, tokens = 0;
  DType out_dtype = DType::kF32;
};

absl::StatusOr<EmbedPlan> PlanEmbed(const ModelRegistry& models, const v1::EmbedRequest& request) {
  EmbedPlan plan;
  RA_ASSIGN_OR_RETURN(plan.model, models.Get(request.model()));
  const ModelConfig& c = plan.model->config();
  const int64_t n = request.token_ids_size();
  int64_t b = 1, s = n;
  if (request.shape_size() != 0) {
    if (request.shape_size() != 2 || request.shape(0) < 0 || request.shape(1) < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shape must be [batch, seq] with dims >= 0, got ",
          request.shape_size() > 8 ? absl::StrCat(request.shape_size(), " dims")
                                   : absl::StrCat("[", absl::StrJoin(request.shape(), ", "), "]")));
    }
    b = request.shape(0);
    s = request.shape(1);
    if (SatMul(b, s) != n) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "shape [%d, %d] does not hold the %d token ids", request.shape(0), request.shape(1), n));
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = request.token_ids(static_cast<int>(i));
    if (id < 0 || id >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrFormat("token_ids[%d] = %d is outside model %s's vocabulary [0, %d)", i, id,
                          request.model(), c.vocab_size));
    }
  }
  if (!request.q_offsets().empty() && request.q_offsets_size() != b) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "q_offsets has %d entries, expected one per batch row (%d)", request.q_offsets_size(), b));
  }
  for (int i = 0; i < request.q_offsets_size(); ++i) {
    RA_RETURN_IF_ERROR(
        CheckPositions(request.q_offsets(i), s, absl::StrFormat("q_offsets[%d]", i),
                       "the sequence length (shape[1], or the token_ids count)"));
  }
  RA_ASSIGN_OR_RETURN(plan.out_dtype,
                      DTypeFromProto(request.out_dtype(), "out_dtype", DType::kF32));
  plan.batch = b;
  plan.seq = s;
  plan.tokens = n;
  return plan;
}

bool AddsPositions(const ModelConfig& c) {
  return c.positions == PositionKind::kLearned || c.positions == PositionKind::kSinusoidal;
}

}  // namespace

absl::StatusOr<Cost> PriceEmbed(const ModelRegistry& models, const v1::EmbedRequest& request) {
  RA_ASSIGN_OR_RETURN(const EmbedPlan plan, PlanEmbed(models, request));
  const ModelConfig& c = plan.model->config();
  return EmbedCost(plan.tokens, c.hidden_size, plan.out_dtype, AddsPositions(c));
}

absl::Status RunEmbed(const ModelRegistry& models, const v1::EmbedRequest& request,
                      v1::EmbedResponse* response) {
  RA_ASSIGN_OR_RETURN(const EmbedPlan plan, PlanEmbed(models, request));
  const ModelConfig& c = plan.model->config();
  const int64_t b = plan.batch, s = plan.seq, n = plan.tokens;
  RA_ASSIGN_OR_RETURN(Tensor out, Tensor::Create(DType::kF32, {b, s, c.hidden_size}));
  const ConstTensorView table = plan.model->embed_tokens();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = request.token_ids(static_cast<int>(i));
    float* dst = out.data<float>() + i * c.hidden_size;
    for (int64_t h = 0; h < c.hidden_size; ++h) dst[h] = table.GetFloat({id, h});
  }
  if (AddsPositions(c) && n > 0) {
    std::vector<int64_t> positions(n);
    for (int64_t bi = 0; bi < b; ++bi) {
      const int64_t off = request.q_offsets().empty() ? 0 : request.q_offsets(static_cast<int>(bi));
      for (int64_t si = 0; si < s; ++si) positions[bi * s + si] = off + si;
    }
    if (c.positions == PositionKind::kLearned) {
      RA_RETURN_IF_ERROR(AddLearnedPositions(out.view(), plan.model->position_table(),
                                             Positions{positions, {}}));
    } else {
      for (int64_t i = 0; i < n; ++i) {
        RA_ASSIGN_OR_RETURN(
            Tensor row,
            SinusoidalTable(1, c.hidden_size, 10000, SinusoidalLayout::kInterleaved, positions[i]));
        float* dst = out.data<float>() + i * c.hidden_size;
        for (int64_t h = 0; h < c.hidden_size; ++h) dst[h] += row.data<float>()[h];
      }
    }
  }
  if (c.embed_scale != 1.0) {
    // Gemma: embeddings * sqrt(hidden_size), the factor rounded to the
    // table's dtype as transformers casts it; the product rounded to f32.
    // An F16 table (held as F32) rounds it to f16, nearest even (F16C).
    const ConstTensorView t = plan.model->embed_tokens();
    const float scale = static_cast<float>(c.embed_scale);
    const float normalizer =
        t.dtype() == DType::kBF16      ? BF16ToFloat(FloatToBF16(scale))
        : plan.model->embed_tokens_f16() ? _cvtsh_ss(_cvtss_sh(scale, _MM_FROUND_TO_NEAREST_INT))
                                         : scale;
    float* data = out.data<float>();
    for (int64_t i = 0; i < n * c.hidden_size; ++i) data[i] *= normalizer;
  }
  if (!plan.model->embed_norm_weight().empty_view() && n > 0) {
    // BERT: + token type 0's row, then LayerNorm over hidden (fp64 per row).
    const ConstTensorView type_row = plan.model->token_type_row();
    const ConstTensorView gamma = plan.model->embed_norm_weight();
    const ConstTensorView beta = plan.model->embed_norm_bias();
    const int64_t hs = c.hidden_size;
    std::vector<double> row(static_cast<size_t>(hs));
    for (int64_t i = 0; i < n; ++i) {
      float* dst = out.data<float>() + i * hs;
      double mean = 0.0;
      for (int64_t h = 0; h < hs; ++h) {
        row[h] = static_cast<double>(dst[h]) + (type_row.empty_view() ? 0.0 : type_row.GetFloat({0, h}));
        mean += row[h];
      }
      mean /= static_cast<double>(hs);
      double var = 0.0;
      for (int64_t h = 0; h < hs; ++h) var += (row[h] - mean) * (row[h] - mean);
      var /= static_cast<double>(hs);
      const double inv = 1.0 / std::sqrt(var + c.layer_norm_eps);
      for (int64_t h = 0; h < hs; ++h) {
        dst[h] = static_cast<float>((row[h] - mean) * inv * gamma.GetFloat({h}) + beta.GetFloat({h}));
      }
    }
  }
  RA_RETURN_IF_ERROR(CheckProduct(out, "embeddings",
                                  "this token's row of the model's embedding table (times the "
                                  "model's scale, plus positions)",
                                  " (the model's weights, not the request, are the cause)"));
  if (plan.out_dtype != DType::kF32) {
    RA_ASSIGN_OR_RETURN(out, CastTensor(out.view(), plan.out_dtype));
    RA_RETURN_IF_ERROR(CheckProduct(out, "embeddings", "rounding to bf16", "; ask for f32"));
  }
  TensorToProto(out.view(), response->mutable_embeddings());
  return absl::OkStatus();
}

namespace {

// The model's RoPE as a spec a client can send back unchanged: only the
// fields its rule reads (the server refuses the others).
v1::RopeSpec RopeSpecToProto(const RopeConfig& r) {
  v1::RopeSpec spec;
  spec.set_layout(r.layout == RopeLayout::kInterleaved ? v1::ROPE_LAYOUT_INTERLEAVED
                                                       : v1::ROPE_LAYOUT_HALF_SPLIT);
  spec.set_rotary_dim(r.effective_rotary_dim());
  spec.set_theta(r.theta);
  v1::RopeScaling* sc = spec.mutable_scaling();
  const RopeScaling& s = r.scaling;
  const RopeRule& rule = RopeRuleOf(s.type);
  sc->set_rope_type(rule.name);
  uint32_t given = kRopeFactor | kRopeOriginalMax | kRopeBetaFast | kRopeBetaSlow | kRopeTruncate |
                   kRopeShortFactor | kRopeLongFactor | kRopeLowFreqFactor | kRopeHighFreqFactor;
  if (s.attention_factor) given |= kRopeAttentionFactor;
  if (s.mscale.value_or(0.0) != 0.0) given |= kRopeMscale;
  if (s.mscale_all_dim.value_or(0.0) != 0.0) given |= kRopeMscaleAllDim;
  if (s.max_position_embeddings > 0) given |= kRopeMaxPositionEmbeddings;
  const uint32_t send = RopeFieldsRead(rule, given);
  if (send & kRopeFactor) sc->set_factor(s.factor);
  if (send & kRopeOriginalMax) sc->set_original_max_position_embeddings(s.original_max_positions);
  if (send & kRopeBetaFast) sc->set_beta_fast(s.beta_fast);
  if (send & kRopeBetaSlow) sc->set_beta_slow(s.beta_slow);
  if (send & kRopeTruncate) sc->set_truncate(s.truncate);
  if (send & kRopeAttentionFactor) sc->set_attention_factor(*s.attention_factor);
  if (send & kRopeMscale) sc->set_mscale(*s.mscale);
  if (send & kRopeMscaleAllDim) sc->set_mscale_all_dim(*s.mscale_all_dim);
  if (send & kRopeMaxPositionEmbeddings) sc->set_max_position_embeddings(s.max_position_embeddings);
  if (send & kRopeShortFactor) {
    for (double f : s.short_factor) sc->add_short_factor(f);
  }
  if (send & kRopeLongFactor) {
    for (double f : s.long_factor) sc->add_long_factor(f);
  }
  if (send & kRopeLowFreqFactor) sc->set_low_freq_factor(s.low_freq_factor);
  if (send & kRopeHighFreqFactor) sc->set_high_freq_factor(s.high_freq_factor);
  return spec;
}

}  // namespace

void FillModelInfo(const Model& model, v1::ModelInfo* info) {
  const ModelConfig& c = model.config();
  info->set_name(model.name());
  info->set_source(model.source());
  info->set_architecture(c.architecture);
  info->set_model_type(c.model_type);
  info->set_hidden_size(c.hidden_size);
  info->set_heads(c.num_heads);
  info->set_kv_heads(c.num_kv_heads);
  info->set_num_heads(c.num_heads);  // deprecated names, still filled
  info->set_num_kv_heads(c.num_kv_heads);
  info->set_head_dim(c.head_dim);
  info->set_vocab_size(c.vocab_size);
  info->set_max_positions(c.max_positions);
  info->set_num_layers(model.num_layers());
  switch (c.positions) {
    case PositionKind::kNone:
      info->set_positions(v1::POSITION_KIND_NONE);
      break;
    case PositionKind::kRope:
      info->set_positions(v1::POSITION_KIND_ROPE);
      break;
    case PositionKind::kLearned:
      info->set_positions(v1::POSITION_KIND_LEARNED);
      break;
    case PositionKind::kSinusoidal:
      info->set_positions(v1::POSITION_KIND_SINUSOIDAL);
      break;
  }
  if (c.rope) {
    *info->mutable_rope() = RopeSpecToProto(*c.rope);
    absl::StatusOr<RopeFrequencies> f = ComputeRopeFrequencies(*c.rope, c.max_positions);
    if (f.ok()) {
      for (double x : f->inv_freq) info->add_inv_freq(x);
      info->set_attention_factor(f->attention_factor);
    }
  }
  info->set_resident_bytes(model.resident_bytes());
}

}  // namespace ropeattn::server
