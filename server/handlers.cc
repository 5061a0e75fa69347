// Each handler is a translator (TensorFlow Serving style): proto -> core types
// through convert.h, checks the core cannot make (request fields it never
// sees, work bounds), one or two core calls, core types -> proto.
#include "server/handlers.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "core/attention.h"
#include "core/encodings.h"
#include "core/limits.h"
#include "core/relative_bias.h"
#include "core/rope.h"
#include "core/status_macros.h"
#include "core/tensor.h"
#include "server/convert.h"
#include "server/cost.h"

namespace ropeattn::server {
namespace {

// RoPE cos/sin tables for Attend cover at most this many positions (64 pairs
// x 64K positions x 8 bytes = 32 MiB); later positions are computed on the
// fly by the rotator, with identical values.
constexpr int64_t kMaxRopeTablePositions = int64_t{1} << 16;
// RoPE head_dim in Encode ops, where it is a bare number rather than a
// tensor dim the message size bounds. Real models use <= 256.
constexpr int64_t kMaxRopeHeadDim = int64_t{1} << 16;

template <typename T>
absl::StatusOr<T> WithContext(absl::StatusOr<T> result, absl::string_view context) {
  if (!result.ok()) return Annotate(result.status(), context);
  return result;
}

int64_t Sum3(int64_t a, int64_t b, int64_t c) { return SatAdd(SatAdd(a, b), c); }

absl::Status CheckNonNegative(int64_t value, absl::string_view field) {
  if (value < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("%s must be >= 0, got %d", field, value));
  }
  return absl::OkStatus();
}

// --- Attend ---

// The shapes the spec implies: q [B, Sq, H, D], k [B, Sk, Hkv, D],
// v [B, Sk, Hkv, Dv]. Checked here, before the core, so the message can say
// which spec field disagrees with which tensor.
absl::Status CheckAttendShapes(const ResolvedSpec& spec, const WireShape& q, const WireShape& k,
                               const WireShape& v) {
  using Named = std::pair<const WireShape*, const char*>;
  const Named qkv[] = {{&q, "q"}, {&k, "k"}, {&v, "v"}};
  for (const auto& [t, name] : qkv) {
    if (t->rank() != 4) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s must have rank 4 [batch, seq, heads, dim], got shape %s", name,
                          DimsToString(t->dims)));
    }
  }
  // A [B, H, S, D] tensor (the transformers layout) shows as heads in dim 1.
  const auto layout_hint = [](const WireShape& t, int64_t heads) -> std::string {
    if (t.dim(1) != heads || t.dim(2) == heads) return "";
    return absl::StrFormat(
        "; it looks like [batch, heads, seq, dim] (the transformers layout): this API takes "
        "[batch, seq, heads, dim], i.e. %s (transpose dims 1 and 2)",
        DimsToString({t.dim(0), t.dim(2), t.dim(1), t.dim(3)}));
  };
  if (q.dim(2) != spec.heads) {
    return absl::InvalidArgumentError(
        absl::StrFormat("q has %d heads (shape %s) but spec.heads is %d%s", q.dim(2),
                        DimsToString(q.dims), spec.heads, layout_hint(q, spec.heads)));
  }
  if (q.dim(3) != spec.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("q has head_dim %d (shape %s) but spec.head_dim is %d", q.dim(3),
                        DimsToString(q.dims), spec.head_dim));
  }
  for (const auto& [t, name] : absl::MakeConstSpan(qkv).subspan(1)) {
    if (t->dim(0) != q.dim(0)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s has batch %d (shape %s) but q has batch %d (shape %s)", name,
                          t->dim(0), DimsToString(t->dims), q.dim(0), DimsToString(q.dims)));
    }
    if (t->dim(2) != spec.kv_heads) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s has %d kv heads (shape %s) but spec.kv_heads is %d (0 means spec.heads)%s", name,
          t->dim(2), DimsToString(t->dims), spec.kv_heads, layout_hint(*t, spec.kv_heads)));
    }
  }
  if (k.dim(3) != spec.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("k has head_dim %d (shape %s) but spec.head_dim is %d", k.dim(3),
                        DimsToString(k.dims), spec.head_dim));
  }
  if (v.dim(1) != k.dim(1)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("v has %d keys (shape %s) but k has %d (shape %s)", v.dim(1),
                        DimsToString(v.dims), k.dim(1), DimsToString(k.dims)));
  }
  if (k.dtype != v.dtype) {
    return absl::InvalidArgumentError(absl::StrFormat("k and v must share a dtype, got k %s, v %s",
                                                      DTypeName(k.dtype), DTypeName(v.dtype)));
  }
  return absl::OkStatus();
}

// Which features read absolute positions (for the message when they cannot
// be defaulted); empty when none does.
std::string PositionUsers(const ResolvedSpec& spec) {
  std::vector<std::string> users;
  if (spec.rope.has_value()) users.push_back("rope");
  if (spec.options.bias.kind == BiasKind::kAlibi) users.push_back("alibi");
  if (spec.options.bias.kind == BiasKind::kT5) users.push_back("t5");
  if (spec.options.causal) users.push_back("causal");
  if (spec.options.window > 0) users.push_back("window");
  std::string out;
  for (const std::string& u : users) absl::StrAppend(&out, out.empty() ? "" : ", ", u);
  return out;
}

}  // namespace

namespace {

// Everything RunAttend decides before touching tensor data: the resolved
// spec, the wire shapes (validated against their byte lengths, not copied),
// the query positions and the request's dimensions for the cost model.
struct AttendPlan {
  ResolvedSpec spec;
  WireShape q, k, v;
  DType out_dtype = DType::kF32;
  std::vector<int64_t> offsets;  // per batch row; empty when nothing reads them
  // Explicit positions (AttendRequest.q_positions / k_positions), per token.
  std::vector<int64_t> q_positions, k_positions;
  int64_t rope_seq_len = 0;      // the length RoPE is planned for
  bool empty = false;            // no queries or no keys: zeros, no compute
  AttendDims dims;
};

absl::StatusOr<AttendPlan> PlanAttend(const v1::AttendRequest& request, int threads) {
  AttendPlan plan;
  RA_ASSIGN_OR_RETURN(plan.spec, ResolveSpec(request.spec()));
  RA_ASSIGN_OR_RETURN(plan.q, ParseWireShape(request.q(), "q"));
  RA_ASSIGN_OR_RETURN(plan.k, ParseWireShape(request.k(), "k"));
  RA_ASSIGN_OR_RETURN(plan.v, ParseWireShape(request.v(), "v"));
  const ResolvedSpec& spec = plan.spec;
  RA_RETURN_IF_ERROR(CheckAttendShapes(spec, plan.q, plan.k, plan.v));
  RA_ASSIGN_OR_RETURN(plan.out_dtype,
                      DTypeFromProto(request.out_dtype(), "out_dtype", DType::kF32));
  const int64_t batch = plan.q.dim(0);
  const int64_t q_len = plan.q.dim(1);
  const int64_t k_len = plan.k.dim(1);

  // Key lengths: checked here with the request's field names; the core
  // repeats the checks (cheaply) for its other callers.
  const auto& key_lengths = request.key_lengths();
  if (!key_lengths.empty() && key_lengths.size() != batch) {
    return absl::InvalidArgumentError(
        absl::StrFormat("key_lengths has %d entries, expected one per batch row (%d) or none",
                        key_lengths.size(), batch));
  }
  for (int b = 0; b < key_lengths.size(); ++b) {
    if (key_lengths[b] < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("key_lengths[%d] must be >= 0, got %d", b, key_lengths[b]));
    }
    if (key_lengths[b] > k_len) {
      return absl::OutOfRangeError(
          absl::StrFormat("key_lengths[%d] = %d exceeds the %d keys in k (shape %s)", b,
                          key_lengths[b], k_len, DimsToString(plan.k.dims)));
    }
  }
  // Query offsets as given: counts and ranges (defaults come below).
  const auto& in_offsets = request.q_offsets();
  if (!in_offsets.empty() && in_offsets.size() != batch) {
    return absl::InvalidArgumentError(
        absl::StrFormat("q_offsets has %d entries, expected one per batch row (%d) or none",
                        in_offsets.size(), batch));
  }
  for (int b = 0; b < in_offsets.size(); ++b) {
    RA_RETURN_IF_ERROR(
        CheckPositions(in_offsets[b], q_len, absl::StrFormat("q_offsets[%d]", b), "q.shape[1]"));
  }
  // Explicit positions: counts, ranges and the keys' order, named by field.
  if (!request.q_positions().empty()) {
    if (!in_offsets.empty()) {
      return absl::InvalidArgumentError("set q_offsets or q_positions, not both");
    }
    if (request.q_positions_size() != SatMul(batch, q_len)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "q_positions has %d entries, expected batch * Sq = %d * %d", request.q_positions_size(),
          batch, q_len));
    }
    for (int i = 0; i < request.q_positions_size(); ++i) {
      RA_RETURN_IF_ERROR(
          CheckPositions(request.q_positions(i), 1, absl::StrFormat("q_positions[%d]", i)));
    }
    plan.q_positions.assign(request.q_positions().begin(), request.q_positions().end());
  }
  if (!request.k_positions().empty()) {
    if (request.q_positions().empty() && in_offsets.empty()) {
      return absl::InvalidArgumentError(
          "k_positions needs q_positions or q_offsets: the queries' positions cannot be inferred "
          "from the keys'");
    }
    if (request.k_positions_size() != SatMul(batch, k_len)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "k_positions has %d entries, expected batch * Sk = %d * %d", request.k_positions_size(),
          batch, k_len));
    }
    for (int i = 0; i < request.k_positions_size(); ++i) {
      RA_RETURN_IF_ERROR(
          CheckPositions(request.k_positions(i), 1, absl::StrFormat("k_positions[%d]", i)));
      if (i % k_len != 0 && request.k_positions(i) < request.k_positions(i - 1)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "k_positions[%d] = %d is below the key before it (%d): keys must be in "
            "non-decreasing position order within each batch row",
            i, request.k_positions(i), request.k_positions(i - 1)));
      }
    }
    plan.k_positions.assign(request.k_positions().begin(), request.k_positions().end());
  }
  // No queries or no keys (an empty batch, query block or key set): every
  // output row sees no key, which the core defines as zeros. Answered
  // without the core because the other dims of an empty tensor are not
  // bounded by the message size (q [2^40, 0, H, D] is zero bytes), and
  // per-row or per-head loops and buffers must never be sized by them.
  plan.empty = plan.q.elements == 0 || plan.k.elements == 0;

  // Default query positions: the newest tokens, Sk - Sq ... Sk - 1. That is
  // negative when Sq > Sk, harmless to plain attention (nothing reads it)
  // but meaningless to RoPE, ALiBi, T5, causal masks and windows, so those
  // require Sk >= Sq or explicit q_offsets.
  if (!plan.empty && plan.q_positions.empty()) {
    plan.offsets.assign(in_offsets.begin(), in_offsets.end());
    if (in_offsets.empty()) {
      if (k_len >= q_len) {
        plan.offsets.assign(batch, k_len - q_len);
      } else if (const std::string users = PositionUsers(spec); !users.empty()) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "q has %d queries but k only %d keys, so with q_offsets empty query 0 would sit at "
            "position %d; %s need real positions: set q_offsets",
            q_len, k_len, k_len - q_len, users));
      }
    }
  }
  int64_t min_q_pos = 0, max_q_pos = -1;
  for (size_t b = 0; b < plan.offsets.size(); ++b) {
    if (b == 0 || plan.offsets[b] < min_q_pos) min_q_pos = plan.offsets[b];
    max_q_pos = std::max(max_q_pos, plan.offsets[b] + q_len - 1);
  }
  if (!plan.empty && !plan.q_positions.empty()) {
    min_q_pos = *std::min_element(plan.q_positions.begin(), plan.q_positions.end());
    max_q_pos = *std::max_element(plan.q_positions.begin(), plan.q_positions.end());
  }
  int64_t min_k_pos = 0, max_k_pos = k_len - 1;
  if (!plan.empty && !plan.k_positions.empty()) {
    min_k_pos = *std::min_element(plan.k_positions.begin(), plan.k_positions.end());
    max_k_pos = *std::max_element(plan.k_positions.begin(), plan.k_positions.end());
  }
  // Dynamic NTK and LongRoPE choose their frequencies from the length the
  // request spans (transformers: the largest position + 1), so q and k share
  // one rotator planned for all of it.
  plan.rope_seq_len = std::max(max_k_pos + 1, max_q_pos + 1);

  AttendDims& d = plan.dims;
  d.batch = batch;
  d.q_len = q_len;
  d.k_len = k_len;
  d.heads = spec.heads;
  d.kv_heads = spec.kv_heads;
  d.head_dim = spec.head_dim;
  d.v_dim = plan.v.dim(3);
  d.q_dtype = plan.q.dtype;
  d.kv_dtype = plan.k.dtype;
  d.out_dtype = plan.out_dtype;
  d.return_probs = request.return_probs();
  d.wire_bytes = Sum3(plan.q.bytes, plan.k.bytes, plan.v.bytes);
  d.input_elements = Sum3(plan.q.elements, plan.k.elements, plan.v.elements);
  d.max_position = std::max(max_q_pos, max_k_pos);
  d.threads = threads;
  d.causal = spec.options.causal;
  d.window = spec.options.window;
  d.q_offsets = plan.offsets;
  d.key_lengths.assign(request.key_lengths().begin(), request.key_lengths().end());
  d.explicit_positions = !plan.q_positions.empty() || !plan.k_positions.empty();
  if (!plan.empty) {
    if (spec.rope) {
      d.rope_rotary_dim = spec.rope->effective_rotary_dim();
      d.rope_table_rows = RopeTablePositionsFor(
          plan.rope_seq_len, SatMul(batch, SatAdd(q_len, k_len)), kMaxRopeTablePositions);
    }
    if (spec.options.bias.kind == BiasKind::kT5 && max_q_pos >= 0) {
      d.t5_rel_positions = std::max<int64_t>(0, (max_k_pos - min_q_pos) + (max_q_pos - min_k_pos) + 1);
      d.wire_bytes = SatAdd(d.wire_bytes, SatMul(spec.t5_table.num_elements(), 4));
    }
  }
  return plan;
}

}  // namespace

absl::StatusOr<Cost> PriceAttend(const v1::AttendRequest& request, int threads) {
  RA_ASSIGN_OR_RETURN(const AttendPlan plan, PlanAttend(request, threads));
  Cost cost = AttendCost(plan.dims);
  if (plan.empty) {
    // No kernel runs: the answer and its copy are all it holds, and q and v
    // are still checked finite element by element (a 16-unit request with
    // a 224 MiB v took 10-15 ms of a worker, and taught the admission a
    // rate that refused every other caller's Attend).
    cost.compute = SatMul(Sum3(SatProduct({plan.dims.batch, plan.dims.q_len, plan.dims.heads}),
                               plan.dims.batch, plan.dims.input_elements),
                          kElementWeight);
  }
  return cost;
}

absl::Status RunAttend(const v1::AttendRequest& request, v1::AttendResponse* response,
                       const ComputeOptions& options) {
  const int threads = std::max(1, options.threads);
  RA_ASSIGN_OR_RETURN(AttendPlan plan, PlanAttend(request, threads));
  ResolvedSpec& spec = plan.spec;
  const AttendDims& d = plan.dims;
  // Read in place from the request's bytes; q and k are copied only to be
  // rotated.
  const bool rotate = spec.rope.has_value() && !plan.empty;
  Tensor q_own, k_own, v_copy;
  ConstTensorView q, k, v;
  if (rotate) {
    RA_ASSIGN_OR_RETURN(q_own, TensorFromProto(request.q(), "q"));
    RA_ASSIGN_OR_RETURN(k_own, TensorFromProto(request.k(), "k"));
    q = q_own.cview();
    k = k_own.cview();
  } else {
    RA_ASSIGN_OR_RETURN(q, ViewOfWireTensor(request.q(), "q", &q_own));
    RA_ASSIGN_OR_RETURN(k, ViewOfWireTensor(request.k(), "k", &k_own));
  }
  RA_ASSIGN_OR_RETURN(v, ViewOfWireTensor(request.v(), "v", &v_copy));
  if (plan.empty) {
    RA_RETURN_IF_ERROR(CheckFinite(q, "q"));
    RA_RETURN_IF_ERROR(CheckFinite(v, "v"));
    RA_ASSIGN_OR_RETURN(const Tensor out,
                        Tensor::Create(plan.out_dtype, {d.batch, d.q_len, d.heads, d.v_dim}));
    TensorToProto(out.cview(), response->mutable_out());
    if (request.return_probs()) {
      RA_ASSIGN_OR_RETURN(const Tensor probs,
                          Tensor::Create(DType::kF32, {d.batch, d.heads, d.q_len, d.k_len}));
      TensorToProto(probs.cview(), response->mutable_probs());
    }
    return absl::OkStatus();
  }
  if (spec.rope.has_value()) {
    RA_ASSIGN_OR_RETURN(
        const RopeRotator rotator,
        WithContext(RopeRotator::Create(*spec.rope, plan.rope_seq_len, d.rope_table_rows),
                    "spec.rope"));
    // q and k are already private copies of the wire bytes: rotate in place.
    // A bf16 k is rotated in f32 and rounded once, as a cache would hold it.
    Positions q_at, k_at;
    if (plan.q_positions.empty()) {
      q_at.offsets = plan.offsets;
    } else {
      q_at.explicit_positions = plan.q_positions;
    }
    k_at.explicit_positions = plan.k_positions;
    RA_RETURN_IF_ERROR(Annotate(
        rotator.Apply(q_own.view(), q_at, RopeDirection::kForward, threads),
        "spec.rope, rotating q"));
    RA_RETURN_IF_ERROR(Annotate(
        rotator.Apply(k_own.view(), k_at, RopeDirection::kForward, threads),
        "spec.rope, rotating k"));
    // One pass over each rotated tensor. A non-finite input stays non-finite
    // (and, rotation mixing each channel pair, shows at its partner's index
    // too), so the message names the input's own first bad element, read
    // from the untouched wire bytes; only if the input was finite did the
    // rotation (a huge attention factor, or values near the float range)
    // take it past the range.
    for (const auto& [rotated, wire, name] :
         {std::tuple(q, &request.q(), "q"), std::tuple(k, &request.k(), "k")}) {
      if (CheckFinite(rotated, name).ok()) continue;
      Tensor unused;
      RA_ASSIGN_OR_RETURN(const ConstTensorView in, ViewOfWireTensor(*wire, name, &unused));
      RA_RETURN_IF_ERROR(CheckFinite(in, name));
      return CheckFinite(rotated, absl::StrCat(name, " (rotated by spec.rope)"),
                         absl::StrCat("the finite ", name,
                                      " left the float range when rotated (values near the range "
                                      "limit, or times the rule's attention factor); reduce the "
                                      "magnitude of ", name));
    }
    // k is checked; the core need only check v (and q, which it always does).
    RA_RETURN_IF_ERROR(CheckFinite(v, "v"));
  }

  AttentionOptions& o = spec.options;
  o.q_offsets = plan.offsets;
  o.q_positions = plan.q_positions;
  o.k_positions = plan.k_positions;
  o.key_lengths = absl::MakeConstSpan(request.key_lengths().data(), request.key_lengths_size());
  o.check_finite = !spec.rope.has_value();
  o.num_threads = threads;
  o.plan_threads = options.plan_threads;
  o.stop = options.stop;
  // Written straight into the answer's bytes.
  const int64_t out_dims[4] = {d.batch, d.q_len, d.heads, d.v_dim};
  RA_ASSIGN_OR_RETURN(TensorView out,
                      WireTensorForWriting(plan.out_dtype, out_dims, response->mutable_out()));
  TensorView probs;
  if (request.return_probs()) {
    const int64_t probs_dims[4] = {d.batch, d.heads, d.q_len, d.k_len};
    RA_ASSIGN_OR_RETURN(probs,
                        WireTensorForWriting(DType::kF32, probs_dims, response->mutable_probs()));
  }
  RA_RETURN_IF_ERROR(Attend(q, k, v, o, out, probs));
  return absl::OkStatus();
}

namespace {

// --- Encode, one function per op ---

// Each op validates its fields and describes its size in `dims`; with
// `response` null it stops there (pricing), otherwise it computes.

absl::Status EncodeSinusoidal(const v1::EncodeRequest::Sinusoidal& op, EncodeDims& dims,
                              v1::EncodeResponse* response) {
  RA_RETURN_IF_ERROR(CheckNonNegative(op.num_positions(), "sinusoidal.num_positions"));
  if (op.d_model() <= 0 || op.d_model() % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sinusoidal.d_model must be even and > 0, got %d", op.d_model()));
  }
  RA_RETURN_IF_ERROR(CheckPositions(op.first_position(), op.num_positions(),
                                    "sinusoidal.first_position", "sinusoidal.num_positions"));
  SinusoidalLayout layout;
  switch (op.layout()) {
    case v1::SINUSOIDAL_LAYOUT_UNSPECIFIED:
    case v1::SINUSOIDAL_LAYOUT_INTERLEAVED:
      layout = SinusoidalLayout::kInterleaved;
      break;
    case v1::SINUSOIDAL_LAYOUT_SIN_COS_HALF:
      layout = SinusoidalLayout::kSinCosHalf;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("sinusoidal.layout has unknown value %d", static_cast<int>(op.layout())));
  }
  RA_RETURN_IF_ERROR(CheckFiniteRange(op.base(), 0.0, kMaxTheta, "sinusoidal.base"));
  const double base = op.base() == 0.0 ? 10000.0 : op.base();
  dims.what = absl::StrCat("the sinusoidal table ", DimsToString({op.num_positions(), op.d_model()}));
  dims.out_bytes = SatProduct({op.num_positions(), op.d_model(), 4});
  // d_model alone sizes the frequency list, even for an empty table.
  dims.scratch_bytes = SatMul(op.d_model(), 8);
  dims.loop_steps = SatAdd(LoopSteps({op.num_positions(), op.d_model()}), op.d_model());
  dims.sincos = SatMul(op.num_positions(), op.d_model() / 2);
  if (response == nullptr) return absl::OkStatus();
  RA_ASSIGN_OR_RETURN(const Tensor table,
                      WithContext(SinusoidalTable(op.num_positions(), op.d_model(), base, layout,
                                                  op.first_position()),
                                  "sinusoidal"));
  TensorToProto(table.cview(), response->mutable_table());
  return absl::OkStatus();
}

// The RoPE config of an Encode op, with its head_dim checked and bounded
// first so the message names the op's own field.
absl::StatusOr<RopeConfig> EncodeRopeConfig(const v1::RopeSpec& rope, int64_t head_dim,
                                            absl::string_view head_dim_field,
                                            absl::string_view op) {
  if (head_dim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s must be > 0, got %d", head_dim_field, head_dim));
  }
  if (head_dim > kMaxRopeHeadDim) {
    return absl::InvalidArgumentError(absl::StrFormat("%s is %d; RoPE ops take at most %d",
                                                      head_dim_field, head_dim, kMaxRopeHeadDim));
  }
  return RopeConfigFromProto(rope, head_dim, absl::StrCat(op, ".rope"));
}

// A RoPE plan's length: any count of positions 0 .. kMaxPosition.
absl::Status CheckSeqLen(int64_t seq_len, absl::string_view field) {
  RA_RETURN_IF_ERROR(CheckNonNegative(seq_len, field));
  if (seq_len > kMaxPosition + 1) {
    return absl::OutOfRangeError(absl::StrFormat(
        "%s = %d is past the maximum position 2^40 + 1 tokens", field, seq_len));
  }
  return absl::OkStatus();
}

void FillFrequencies(const RopeFrequencies& f, v1::EncodeResponse* response) {
  response->mutable_inv_freq()->Add(f.inv_freq.begin(), f.inv_freq.end());
  response->set_attention_factor(f.attention_factor);
}

absl::Status EncodeRopeFrequencies(const v1::EncodeRequest::RopeFrequencies& op, EncodeDims& dims,
                                   v1::EncodeResponse* response) {
  RA_ASSIGN_OR_RETURN(
      const RopeConfig config,
      EncodeRopeConfig(op.rope(), op.head_dim(), "rope_frequencies.head_dim", "rope_frequencies"));
  RA_RETURN_IF_ERROR(CheckSeqLen(op.seq_len(), "rope_frequencies.seq_len"));
  const int64_t half = config.effective_rotary_dim() / 2;
  dims.what = absl::StrFormat("the rope_frequencies of %d pairs", half);
  dims.out_bytes = SatMul(half, 8);
  dims.loop_steps = half;
  if (response == nullptr) return absl::OkStatus();
  RA_ASSIGN_OR_RETURN(
      const RopeFrequencies f,
      WithContext(ComputeRopeFrequencies(config, op.seq_len()), "rope_frequencies"));
  FillFrequencies(f, response);
  return absl::OkStatus();
}

absl::Status EncodeRopeCosSin(const v1::EncodeRequest::RopeCosSin& op, EncodeDims& dims,
                              v1::EncodeResponse* response) {
  RA_ASSIGN_OR_RETURN(
      const RopeConfig config,
      EncodeRopeConfig(op.rope(), op.head_dim(), "rope_cos_sin.head_dim", "rope_cos_sin"));
  RA_RETURN_IF_ERROR(CheckSeqLen(op.seq_len(), "rope_cos_sin.seq_len"));
  const int64_t n = op.positions_size();
  const int64_t half = config.effective_rotary_dim() / 2;
  for (int i = 0; i < op.positions_size(); ++i) {
    RA_RETURN_IF_ERROR(
        CheckPositions(op.positions(i), 1, absl::StrFormat("rope_cos_sin.positions[%d]", i)));
  }
  dims.what = absl::StrCat("the cos/sin tables ", DimsToString({n, half}), " x 2");
  dims.out_bytes = SatAdd(SatProduct({n, half, 8}), SatMul(half, 8));
  dims.loop_steps = LoopSteps({n, half});
  dims.sincos = SatMul(n, half);
  if (response == nullptr) return absl::OkStatus();
  // No table: every requested position is computed once, directly.
  // 0: planned for the largest position + 1, as transformers plans its
  // cos/sin for max(position_ids) + 1 (dynamic NTK, LongRoPE).
  int64_t cos_sin_len = op.seq_len();
  if (cos_sin_len == 0) {
    for (int64_t p : op.positions()) cos_sin_len = std::max(cos_sin_len, p + 1);
  }
  RA_ASSIGN_OR_RETURN(const RopeRotator rotator,
                      WithContext(RopeRotator::Create(config, cos_sin_len, 0), "rope_cos_sin.rope"));
  RA_ASSIGN_OR_RETURN(Tensor cos, Tensor::Create(DType::kF32, {n, half}));
  RA_ASSIGN_OR_RETURN(Tensor sin, Tensor::Create(DType::kF32, {n, half}));
  RA_RETURN_IF_ERROR(Annotate(rotator.CosSin(absl::MakeConstSpan(op.positions().data(), n),
                                             absl::MakeSpan(cos.data<float>(), n * half),
                                             absl::MakeSpan(sin.data<float>(), n * half)),
                              "rope_cos_sin.rope"));
  RA_RETURN_IF_ERROR(CheckFinite(cos.cview(), "rope_cos_sin cos (times the attention factor)"));
  RA_RETURN_IF_ERROR(CheckFinite(sin.cview(), "rope_cos_sin sin (times the attention factor)"));
  FillFrequencies(rotator.frequencies(), response);
  TensorToProto(cos.cview(), response->mutable_cos());
  TensorToProto(sin.cview(), response->mutable_sin());
  return absl::OkStatus();
}

absl::Status EncodeRopeApply(const v1::EncodeRequest::RopeApply& op, EncodeDims& dims,
                             v1::EncodeResponse* response, int threads) {
  RA_ASSIGN_OR_RETURN(const WireShape xs, ParseWireShape(op.x(), "rope_apply.x"));
  if (xs.rank() != 4) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rope_apply.x must have rank 4 [batch, seq, heads, head_dim], got shape %s",
                        DimsToString(xs.dims)));
  }
  RA_ASSIGN_OR_RETURN(
      const RopeConfig config,
      EncodeRopeConfig(op.rope(), xs.dim(3), "rope_apply.x.shape[3] (head_dim)", "rope_apply"));
  RA_RETURN_IF_ERROR(CheckSeqLen(op.seq_len(), "rope_apply.seq_len"));
  const int64_t batch = xs.dim(0);
  const int64_t seq = xs.dim(1);
  if (op.positions_size() > 0 && op.offsets_size() > 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rope_apply: set at most one of positions (%d given) and offsets (%d given)",
        op.positions_size(), op.offsets_size()));
  }
  if (op.positions_size() > 0) {
    if (op.positions_size() != SatMul(batch, seq)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("rope_apply.positions has %d entries, expected batch * seq = %d * %d",
                          op.positions_size(), batch, seq));
    }
    for (int i = 0; i < op.positions_size(); ++i) {
      RA_RETURN_IF_ERROR(
          CheckPositions(op.positions(i), 1, absl::StrFormat("rope_apply.positions[%d]", i)));
    }
  }
  if (op.offsets_size() > 0) {
    if (op.offsets_size() != batch) {
      return absl::InvalidArgumentError(
          absl::StrFormat("rope_apply.offsets has %d entries, expected one per batch row (%d)",
                          op.offsets_size(), batch));
    }
    for (int b = 0; b < op.offsets_size(); ++b) {
      RA_RETURN_IF_ERROR(
          CheckPositions(op.offsets(b), seq, absl::StrFormat("rope_apply.offsets[%d]", b),
                         "rope_apply.x.shape[1]"));
    }
  } else if (op.positions_size() == 0) {
    RA_RETURN_IF_ERROR(CheckPositions(0, seq, "", "rope_apply.x.shape[1]"));
  }
  // Unless given, the length-dependent rules are planned for the largest
  // position rotated + 1, as transformers plans them from max(position_ids):
  // a token at 5000 is rotated as in a sequence of 5001, whatever x's length.
  int64_t seq_len = op.seq_len();
  if (seq_len == 0) {
    for (int64_t p : op.positions()) seq_len = std::max(seq_len, p + 1);
    if (seq > 0) {
      for (int64_t off : op.offsets()) seq_len = std::max(seq_len, off + seq);
    }
    if (op.positions_size() == 0 && op.offsets_size() == 0) seq_len = seq;
  }
  dims.what = absl::StrCat("rope_apply.x ", DimsToString(xs.dims));
  dims.in_bytes = xs.bytes;
  dims.out_bytes = xs.bytes;
  // Rows are walked even when a row is empty; no table (see below).
  dims.loop_steps = xs.elements == 0 ? 0 : LoopSteps({batch, seq, xs.dim(2), xs.dim(3)});
  // Each token's cos/sin row, once (no table).
  dims.sincos = xs.elements == 0 ? 0 : SatProduct({batch, seq, config.effective_rotary_dim() / 2});
  if (response == nullptr) return absl::OkStatus();

  RA_ASSIGN_OR_RETURN(Tensor x, TensorFromProto(op.x(), "rope_apply.x"));
  // The rotation has no check of its own: a NaN in would be a NaN out.
  RA_RETURN_IF_ERROR(CheckFinite(x.cview(), "rope_apply.x"));
  // No table: Apply computes each token's row once; a table would only pay
  // off for rows sharing positions, and costs a row per position up front.
  RA_ASSIGN_OR_RETURN(const RopeRotator rotator,
                      WithContext(RopeRotator::Create(config, seq_len, 0), "rope_apply.rope"));
  response->set_attention_factor(rotator.frequencies().attention_factor);
  if (x.num_elements() == 0) {
    // Nothing to rotate; the dims of an empty x are not bounded by the
    // message size, so no position grid is built from them.
    TensorToProto(x.cview(), response->mutable_x());
    return absl::OkStatus();
  }
  Positions positions;
  positions.explicit_positions = absl::MakeConstSpan(op.positions().data(), op.positions_size());
  positions.offsets = absl::MakeConstSpan(op.offsets().data(), op.offsets_size());
  RA_RETURN_IF_ERROR(Annotate(
      rotator.Apply(x.view(), positions,
                    op.inverse() ? RopeDirection::kInverse : RopeDirection::kForward, threads),
      "rope_apply.rope"));
  // Finite inputs near the float limit can overflow once scaled by the
  // attention factor (or its inverse); never answer with inf.
  RA_RETURN_IF_ERROR(CheckFinite(x.cview(), "rope_apply.x (rotated)",
                                 "the finite rope_apply.x left the float range when rotated "
                                 "(values near the range limit, or times the rule's attention "
                                 "factor); reduce its magnitude"));
  TensorToProto(x.cview(), response->mutable_x());
  return absl::OkStatus();
}

absl::Status EncodeAlibi(const v1::EncodeRequest::Alibi& op, EncodeDims& dims,
                         v1::EncodeResponse* response) {
  if (op.heads() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("alibi.heads must be > 0, got %d", op.heads()));
  }
  RA_RETURN_IF_ERROR(CheckNonNegative(op.q_len(), "alibi.q_len"));
  RA_RETURN_IF_ERROR(CheckNonNegative(op.k_len(), "alibi.k_len"));
  RA_RETURN_IF_ERROR(CheckPositions(op.q_offset(), op.q_len(), "alibi.q_offset", "alibi.q_len"));
  RA_RETURN_IF_ERROR(CheckPositions(0, op.k_len(), "", "alibi.k_len"));
  // AlibiSlopes validates the head count (its own bound) before anything
  // is sized by it.
  RA_ASSIGN_OR_RETURN(const std::vector<double> slopes,
                      WithContext(AlibiSlopes(op.heads()), "alibi.heads"));
  dims.what = op.q_len() == 0
                  ? absl::StrFormat("the alibi slopes of %d heads", op.heads())
                  : absl::StrCat("the alibi bias ",
                                 DimsToString({op.heads(), op.q_len(), op.k_len()}));
  dims.out_bytes = SatAdd(SatMul(op.heads(), 8),
                          op.q_len() == 0 ? 0 : SatProduct({op.heads(), op.q_len(), op.k_len(), 4}));
  dims.loop_steps = op.q_len() == 0 ? op.heads() : LoopSteps({op.heads(), op.q_len(), op.k_len()});
  if (response == nullptr) return absl::OkStatus();
  response->mutable_slopes()->Add(slopes.begin(), slopes.end());
  if (op.q_len() == 0) return absl::OkStatus();  // slopes only
  RA_ASSIGN_OR_RETURN(const Tensor bias, WithContext(AlibiBias(slopes, op.q_len(), op.k_len(),
                                                               op.q_offset(), op.bidirectional()),
                                                     "alibi"));
  TensorToProto(bias.cview(), response->mutable_bias());
  return absl::OkStatus();
}

absl::Status EncodeT5(const v1::EncodeRequest::T5& op, EncodeDims& dims,
                      v1::EncodeResponse* response) {
  T5BucketConfig config;
  config.num_buckets = op.num_buckets() == 0 ? 32 : op.num_buckets();
  config.max_distance = op.max_distance() == 0 ? 128 : op.max_distance();
  config.bidirectional = op.bidirectional();
  RA_RETURN_IF_ERROR(Annotate(ValidateT5BucketConfig(config), "t5"));
  RA_RETURN_IF_ERROR(CheckNonNegative(op.q_len(), "t5.q_len"));
  RA_RETURN_IF_ERROR(CheckNonNegative(op.k_len(), "t5.k_len"));
  // Keeps every q_offset + i and j - q_pos inside int64, as the core does.
  RA_RETURN_IF_ERROR(CheckPositions(op.q_offset(), op.q_len(), "t5.q_offset", "t5.q_len"));
  RA_RETURN_IF_ERROR(CheckPositions(0, op.k_len(), "", "t5.k_len"));
  const int64_t q_len = op.q_len();
  const int64_t k_len = op.k_len();
  int64_t table_heads = 0;
  WireShape table_shape;
  if (op.has_table()) {
    RA_ASSIGN_OR_RETURN(table_shape, ParseWireShape(op.table(), "t5.table"));
    if (table_shape.rank() != 2) {
      return absl::InvalidArgumentError(
          absl::StrFormat("t5.table must have rank 2 [num_buckets, heads], got shape %s",
                          DimsToString(table_shape.dims)));
    }
    if (table_shape.dim(0) != config.num_buckets || table_shape.dim(1) < 1) {
      return absl::InvalidArgumentError(
          absl::StrFormat("t5.table must have shape [num_buckets=%d, heads >= 1], got %s",
                          config.num_buckets, DimsToString(table_shape.dims)));
    }
    table_heads = table_shape.dim(1);
  }
  dims.what = absl::StrCat("the t5 bucket grid ", DimsToString({q_len, k_len}),
                           table_heads > 0
                               ? absl::StrCat(" and bias ", DimsToString({table_heads, q_len, k_len}))
                               : std::string());
  // Buckets travel as packed varints: at most 5 bytes each.
  dims.out_bytes = SatAdd(SatProduct({q_len, k_len, 5}), SatProduct({table_heads, q_len, k_len, 4}));
  dims.in_bytes = table_shape.bytes;
  // An empty grid builds nothing and runs no loop, however long its other
  // side (up to 2^40).
  const bool grid = q_len > 0 && k_len > 0;
  dims.scratch_bytes =
      grid ? SatAdd(SatProduct({q_len, k_len, 4}), SatMul(SatAdd(q_len, k_len), 4)) : 0;
  dims.loop_steps =
      grid ? SatAdd(LoopSteps({q_len, k_len}), LoopSteps({table_heads, q_len, k_len})) : 0;
  // One bucket (two fp64 logs) per distinct relative position, priced as
  // an angle; the grid then only looks them up.
  dims.sincos = q_len > 0 && k_len > 0 ? SatAdd(q_len, k_len) : 0;
  if (response == nullptr) return absl::OkStatus();

  Tensor table;
  if (op.has_table()) {
    RA_ASSIGN_OR_RETURN(table, TensorFromProto(op.table(), "t5.table"));
    RA_RETURN_IF_ERROR(CheckFinite(table.cview(), "t5.table"));
  }
  if (q_len > 0 && k_len > 0) {
    auto* buckets = response->mutable_buckets();
    buckets->Resize(static_cast<int>(q_len * k_len), 0);
    int32_t* out = buckets->mutable_data();
    // Relative positions j - (q_offset + i) span [min_rel, k_len - 1 - q_offset]:
    // q_len + k_len - 1 buckets, each computed once (a bucket costs two logs;
    // per grid cell it was 25x the cell's price).
    const int64_t min_rel = -(op.q_offset() + q_len - 1);
    std::vector<int32_t> bucket_of(static_cast<size_t>(q_len + k_len - 1));
    for (size_t r = 0; r < bucket_of.size(); ++r) {
      bucket_of[r] = T5RelativeBucket(min_rel + static_cast<int64_t>(r), config);
    }
    for (int64_t i = 0; i < q_len; ++i) {
      // Cell (i, j) is relative position j - q_offset - i: index j + q_len - 1 - i.
      const int32_t* row = bucket_of.data() + (q_len - 1 - i);
      for (int64_t j = 0; j < k_len; ++j) out[i * k_len + j] = row[j];
    }
  }
  if (op.has_table()) {
    RA_ASSIGN_OR_RETURN(
        const Tensor bias,
        WithContext(T5Bias(table.cview(), config, q_len, k_len, op.q_offset()), "t5"));
    TensorToProto(bias.cview(), response->mutable_bias());
  }
  return absl::OkStatus();
}

// Validates and describes the op; computes into `response` when non-null.
absl::Status EncodeOp(const v1::EncodeRequest& request, EncodeDims& dims,
                      v1::EncodeResponse* response, int threads) {
  switch (request.op_case()) {
    case v1::EncodeRequest::kSinusoidal:
      return EncodeSinusoidal(request.sinusoidal(), dims, response);
    case v1::EncodeRequest::kRopeFrequencies:
      return EncodeRopeFrequencies(request.rope_frequencies(), dims, response);
    case v1::EncodeRequest::kRopeCosSin:
      return EncodeRopeCosSin(request.rope_cos_sin(), dims, response);
    case v1::EncodeRequest::kRopeApply:
      return EncodeRopeApply(request.rope_apply(), dims, response, threads);
    case v1::EncodeRequest::kAlibi:
      return EncodeAlibi(request.alibi(), dims, response);
    case v1::EncodeRequest::kT5:
      return EncodeT5(request.t5(), dims, response);
    case v1::EncodeRequest::OP_NOT_SET:
      return absl::InvalidArgumentError("EncodeRequest.op is not set");
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("EncodeRequest.op has unknown case %d", static_cast<int>(request.op_case())));
}

}  // namespace

absl::StatusOr<Cost> PriceEncode(const v1::EncodeRequest& request) {
  EncodeDims dims;
  RA_RETURN_IF_ERROR(EncodeOp(request, dims, nullptr, 1));
  return EncodeCost(dims);
}

absl::Status RunEncode(const v1::EncodeRequest& request, v1::EncodeResponse* response,
                       const ComputeOptions& options) {
  EncodeDims dims;
  return EncodeOp(request, dims, response, std::max(1, options.threads));
}

}  // namespace ropeattn::server
