// Each handler is a translator (TensorFlow Serving style): proto -> core types
// through convert.h, checks the core cannot make (request fields it never
// sees, work bounds), one or two core calls, core types -> proto.
#include "server/handlers.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "core/attention.h"
#include "core/encodings.h"
#include "core/relative_bias.h"
#include "core/rope.h"
#include "core/status_macros.h"
#include "core/tensor.h"
#include "server/convert.h"

namespace ropeattn::server {
namespace {

// Positions above this lose all angle precision (the core's own bound).
constexpr int64_t kMaxPosition = int64_t{1} << 40;
// RoPE cos/sin tables for Attend cover at most this many positions (64 pairs
// x 64K positions x 8 bytes = 32 MiB); later positions are computed on the
// fly by the rotator, with identical values.
constexpr int64_t kMaxRopeTablePositions = int64_t{1} << 16;
// Encode outputs (tables, biases, bucket grids, cos/sin, frequencies): 64M
// elements is 256 MiB of f32, the server's default message limit, so nothing
// larger could be sent back anyway; refusing up front spares the work.
constexpr int64_t kMaxEncodeElements = int64_t{1} << 26;
// RoPE head_dim in Encode ops, where it is a bare number rather than a
// tensor dim the message size bounds. Real models use <= 256.
constexpr int64_t kMaxRopeHeadDim = int64_t{1} << 16;
// Attend's out and probs: 256M elements (1 GiB of f32). Legitimate requests
// stay far below (a [1, 8192, 32, 128] prefill output is 32M elements); the
// bound exists because out and probs sizes multiply dims of different
// inputs, so small messages could otherwise ask for terabytes.
constexpr int64_t kMaxAttendResultElements = int64_t{1} << 28;
// Query-key pairs (batch x heads x Sq x Sk) one Attend may score: 2^36 is
// ~8x a 32-head 16K-token prefill. Small inputs with a tiny head_dim could
// otherwise ask for hours of compute; deadlines remain the finer guard.
constexpr int64_t kMaxAttendPairs = int64_t{1} << 36;

// a * b for non-negative operands, saturating at int64 max instead of
// overflowing (a hostile shape must not wrap around under a limit).
int64_t SatMul(int64_t a, int64_t b) {
  if (a == 0 || b == 0) return 0;
  if (a > std::numeric_limits<int64_t>::max() / b) return std::numeric_limits<int64_t>::max();
  return a * b;
}

int64_t SatProduct(std::initializer_list<int64_t> dims) {
  int64_t n = 1;
  for (int64_t d : dims) n = SatMul(n, d);
  return n;
}

template <typename T>
absl::StatusOr<T> WithContext(absl::StatusOr<T> result, absl::string_view context) {
  if (!result.ok()) return Annotate(result.status(), context);
  return result;
}

absl::Status CheckLimit(int64_t elements, int64_t limit, absl::string_view what) {
  if (elements > limit) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s has %s elements, above the per-request limit of %d", what,
        elements == std::numeric_limits<int64_t>::max() ? std::string("more than 2^63")
                                                        : absl::StrCat(elements),
        limit));
  }
  return absl::OkStatus();
}

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
absl::Status CheckAttendShapes(const ResolvedSpec& spec, const Tensor& q, const Tensor& k,
                               const Tensor& v) {
  using Named = std::pair<const Tensor*, const char*>;
  const Named qkv[] = {{&q, "q"}, {&k, "k"}, {&v, "v"}};
  for (const auto& [t, name] : qkv) {
    if (t->rank() != 4) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s must have rank 4 [batch, seq, heads, dim], got shape %s", name,
                          DimsToString(t->dims())));
    }
  }
  if (q.dim(2) != spec.heads) {
    return absl::InvalidArgumentError(
        absl::StrFormat("q has %d heads (shape %s) but spec.heads is %d", q.dim(2),
                        DimsToString(q.dims()), spec.heads));
  }
  if (q.dim(3) != spec.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("q has head_dim %d (shape %s) but spec.head_dim is %d", q.dim(3),
                        DimsToString(q.dims()), spec.head_dim));
  }
  for (const auto& [t, name] : absl::MakeConstSpan(qkv).subspan(1)) {
    if (t->dim(0) != q.dim(0)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s has batch %d (shape %s) but q has batch %d (shape %s)", name,
                          t->dim(0), DimsToString(t->dims()), q.dim(0), DimsToString(q.dims())));
    }
    if (t->dim(2) != spec.kv_heads) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s has %d kv heads (shape %s) but spec.kv_heads is %d (0 means spec.heads)", name,
          t->dim(2), DimsToString(t->dims()), spec.kv_heads));
    }
  }
  if (k.dim(3) != spec.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("k has head_dim %d (shape %s) but spec.head_dim is %d", k.dim(3),
                        DimsToString(k.dims()), spec.head_dim));
  }
  if (v.dim(1) != k.dim(1)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("v has %d keys (shape %s) but k has %d (shape %s)", v.dim(1),
                        DimsToString(v.dims()), k.dim(1), DimsToString(k.dims())));
  }
  if (k.dtype() != v.dtype()) {
    return absl::InvalidArgumentError(absl::StrFormat("k and v must share a dtype, got k %s, v %s",
                                                      DTypeName(k.dtype()), DTypeName(v.dtype())));
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

absl::Status RunAttend(const v1::AttendRequest& request, v1::AttendResponse* response,
                       const ComputeOptions& options) {
  RA_ASSIGN_OR_RETURN(ResolvedSpec spec, ResolveSpec(request.spec()));
  RA_ASSIGN_OR_RETURN(Tensor q, TensorFromProto(request.q(), "q"));
  RA_ASSIGN_OR_RETURN(Tensor k, TensorFromProto(request.k(), "k"));
  RA_ASSIGN_OR_RETURN(Tensor v, TensorFromProto(request.v(), "v"));
  RA_RETURN_IF_ERROR(CheckAttendShapes(spec, q, k, v));
  RA_ASSIGN_OR_RETURN(const DType out_dtype,
                      DTypeFromProto(request.out_dtype(), "out_dtype", DType::kF32));
  const int64_t batch = q.dim(0);
  const int64_t q_len = q.dim(1);
  const int64_t k_len = k.dim(1);
  const int64_t heads = spec.heads;
  const int64_t v_dim = v.dim(3);

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
                          key_lengths[b], k_len, DimsToString(k.dims())));
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
    const int64_t off = in_offsets[b];
    if (off < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("q_offsets[%d] must be >= 0, got %d", b, off));
    }
    if (off > kMaxPosition || off + std::max<int64_t>(q_len - 1, 0) > kMaxPosition) {
      return absl::OutOfRangeError(absl::StrFormat(
          "q_offsets[%d] = %d puts the last of %d queries past the maximum position 2^40", b, off,
          q_len));
    }
  }

  // Work bounds, before any allocation or compute.
  const int64_t pairs = SatProduct({batch, heads, q_len, k_len});
  RA_RETURN_IF_ERROR(
      CheckLimit(pairs, kMaxAttendPairs,
                 absl::StrFormat("the attention [batch %d x heads %d x Sq %d x Sk %d]", batch,
                                 heads, q_len, k_len)));
  RA_RETURN_IF_ERROR(CheckLimit(SatProduct({batch, q_len, heads, v_dim}), kMaxAttendResultElements,
                                absl::StrCat("out ", DimsToString({batch, q_len, heads, v_dim}))));
  if (request.return_probs()) {
    RA_RETURN_IF_ERROR(
        CheckLimit(pairs, kMaxAttendResultElements,
                   absl::StrCat("probs ", DimsToString({batch, heads, q_len, k_len}))));
  }

  // No queries or no keys (an empty batch, query block or key set): every
  // output row sees no key, which the core defines as zeros. Answered here
  // because the other dims of an empty tensor are not bounded by the message
  // size (q [2^40, 0, H, D] is zero bytes), and per-row or per-head loops and
  // buffers must never be sized by them.
  if (q.num_elements() == 0 || k.num_elements() == 0) {
    RA_RETURN_IF_ERROR(CheckFinite(q.cview(), "q"));
    RA_RETURN_IF_ERROR(CheckFinite(v.cview(), "v"));
    RA_ASSIGN_OR_RETURN(const Tensor out, Tensor::Create(out_dtype, {batch, q_len, heads, v_dim}));
    TensorToProto(out.cview(), response->mutable_out());
    if (request.return_probs()) {
      RA_ASSIGN_OR_RETURN(const Tensor probs,
                          Tensor::Create(DType::kF32, {batch, heads, q_len, k_len}));
      TensorToProto(probs.cview(), response->mutable_probs());
    }
    return absl::OkStatus();
  }

  // Default query positions: the newest tokens, Sk - Sq ... Sk - 1. That is
  // negative when Sq > Sk, harmless to plain attention (nothing reads it)
  // but meaningless to RoPE, ALiBi, T5, causal masks and windows, so those
  // require Sk >= Sq or explicit q_offsets.
  std::vector<int64_t> offsets(in_offsets.begin(), in_offsets.end());
  if (in_offsets.empty()) {
    if (k_len >= q_len) {
      offsets.assign(batch, k_len - q_len);
    } else if (const std::string users = PositionUsers(spec); !users.empty()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "q has %d queries but k only %d keys, so with q_offsets empty query 0 would sit at "
          "position %d; %s need real positions: set q_offsets",
          q_len, k_len, k_len - q_len, users));
    }
  }

  const int threads = std::max(1, options.threads);
  if (spec.rope.has_value()) {
    // Rotation mixes each channel pair, so a NaN would afterwards also show
    // at its partner's index: report the input's own first bad element.
    RA_RETURN_IF_ERROR(CheckFinite(q.cview(), "q"));
    RA_RETURN_IF_ERROR(CheckFinite(k.cview(), "k"));
    int64_t max_q_pos = -1;
    if (q_len > 0) {
      for (int64_t off : offsets) max_q_pos = std::max(max_q_pos, off + q_len - 1);
    }
    // Dynamic NTK and LongRoPE choose their frequencies from the length the
    // request spans, so q and k share one rotator planned for all of it.
    const int64_t seq_len = std::max(k_len, max_q_pos + 1);
    RA_ASSIGN_OR_RETURN(const RopeRotator rotator,
                        WithContext(RopeRotator::Create(*spec.rope, seq_len,
                                                        std::min(seq_len, kMaxRopeTablePositions)),
                                    "spec.rope"));
    // q and k are already private copies of the wire bytes: rotate in place.
    // A bf16 k is rotated in f32 and rounded once, as a cache would hold it.
    Positions q_positions;
    q_positions.offsets = offsets;
    RA_RETURN_IF_ERROR(Annotate(
        rotator.Apply(q.view(), q_positions, RopeDirection::kForward, threads), "rotating q"));
    RA_RETURN_IF_ERROR(Annotate(
        rotator.Apply(k.view(), Positions(), RopeDirection::kForward, threads), "rotating k"));
  }

  AttentionOptions& o = spec.options;
  o.q_offsets = offsets;
  o.key_lengths = absl::MakeConstSpan(key_lengths.data(), key_lengths.size());
  o.check_finite = true;
  o.num_threads = threads;
  RA_ASSIGN_OR_RETURN(Tensor out, Tensor::Create(out_dtype, {batch, q_len, heads, v_dim}));
  Tensor probs;
  if (request.return_probs()) {
    RA_ASSIGN_OR_RETURN(probs, Tensor::Create(DType::kF32, {batch, heads, q_len, k_len}));
  }
  RA_RETURN_IF_ERROR(Attend(q.cview(), k.cview(), v.cview(), o, out.view(),
                            request.return_probs() ? probs.view() : TensorView()));
  TensorToProto(out.cview(), response->mutable_out());
  if (request.return_probs()) TensorToProto(probs.cview(), response->mutable_probs());
  return absl::OkStatus();
}

namespace {

// --- Encode, one function per op ---

absl::Status EncodeSinusoidal(const v1::EncodeRequest::Sinusoidal& op,
                              v1::EncodeResponse* response) {
  RA_RETURN_IF_ERROR(CheckNonNegative(op.num_positions(), "sinusoidal.num_positions"));
  if (op.d_model() <= 0 || op.d_model() % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sinusoidal.d_model must be even and > 0, got %d", op.d_model()));
  }
  RA_RETURN_IF_ERROR(CheckNonNegative(op.first_position(), "sinusoidal.first_position"));
  // d_model alone sizes the frequency list, even for an empty table.
  RA_RETURN_IF_ERROR(CheckLimit(op.d_model(), kMaxEncodeElements, "sinusoidal.d_model"));
  RA_RETURN_IF_ERROR(CheckLimit(
      SatMul(op.num_positions(), op.d_model()), kMaxEncodeElements,
      absl::StrCat("the sinusoidal table ", DimsToString({op.num_positions(), op.d_model()}))));
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
  const double base = op.base() == 0.0 ? 10000.0 : op.base();
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
    return absl::ResourceExhaustedError(absl::StrFormat("%s is %d; RoPE ops take at most %d",
                                                        head_dim_field, head_dim, kMaxRopeHeadDim));
  }
  return RopeConfigFromProto(rope, head_dim, absl::StrCat(op, ".rope"));
}

void FillFrequencies(const RopeFrequencies& f, v1::EncodeResponse* response) {
  response->mutable_inv_freq()->Add(f.inv_freq.begin(), f.inv_freq.end());
  response->set_attention_factor(f.attention_factor);
}

absl::Status EncodeRopeFrequencies(const v1::EncodeRequest::RopeFrequencies& op,
                                   v1::EncodeResponse* response) {
  RA_ASSIGN_OR_RETURN(
      const RopeConfig config,
      EncodeRopeConfig(op.rope(), op.head_dim(), "rope_frequencies.head_dim", "rope_frequencies"));
  RA_RETURN_IF_ERROR(CheckNonNegative(op.seq_len(), "rope_frequencies.seq_len"));
  RA_ASSIGN_OR_RETURN(
      const RopeFrequencies f,
      WithContext(ComputeRopeFrequencies(config, op.seq_len()), "rope_frequencies"));
  FillFrequencies(f, response);
  return absl::OkStatus();
}

absl::Status EncodeRopeCosSin(const v1::EncodeRequest::RopeCosSin& op,
                              v1::EncodeResponse* response) {
  RA_ASSIGN_OR_RETURN(
      const RopeConfig config,
      EncodeRopeConfig(op.rope(), op.head_dim(), "rope_cos_sin.head_dim", "rope_cos_sin"));
  RA_RETURN_IF_ERROR(CheckNonNegative(op.seq_len(), "rope_cos_sin.seq_len"));
  const int64_t n = op.positions_size();
  const int64_t half = config.effective_rotary_dim() / 2;
  RA_RETURN_IF_ERROR(CheckLimit(SatMul(n, half), kMaxEncodeElements,
                                absl::StrCat("the cos/sin table ", DimsToString({n, half}))));
  // No table: every requested position is computed once, directly.
  RA_ASSIGN_OR_RETURN(const RopeRotator rotator,
                      WithContext(RopeRotator::Create(config, op.seq_len(), 0), "rope_cos_sin"));
  RA_ASSIGN_OR_RETURN(Tensor cos, Tensor::Create(DType::kF32, {n, half}));
  RA_ASSIGN_OR_RETURN(Tensor sin, Tensor::Create(DType::kF32, {n, half}));
  RA_RETURN_IF_ERROR(Annotate(rotator.CosSin(absl::MakeConstSpan(op.positions().data(), n),
                                             absl::MakeSpan(cos.data<float>(), n * half),
                                             absl::MakeSpan(sin.data<float>(), n * half)),
                              "rope_cos_sin"));
  FillFrequencies(rotator.frequencies(), response);
  TensorToProto(cos.cview(), response->mutable_cos());
  TensorToProto(sin.cview(), response->mutable_sin());
  return absl::OkStatus();
}

absl::Status EncodeRopeApply(const v1::EncodeRequest::RopeApply& op, v1::EncodeResponse* response,
                             int threads) {
  RA_ASSIGN_OR_RETURN(Tensor x, TensorFromProto(op.x(), "rope_apply.x"));
  if (x.rank() != 4) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rope_apply.x must have rank 4 [batch, seq, heads, head_dim], got shape %s",
                        DimsToString(x.dims())));
  }
  RA_ASSIGN_OR_RETURN(
      const RopeConfig config,
      EncodeRopeConfig(op.rope(), x.dim(3), "rope_apply.x.shape[3] (head_dim)", "rope_apply"));
  RA_RETURN_IF_ERROR(CheckNonNegative(op.seq_len(), "rope_apply.seq_len"));
  const int64_t batch = x.dim(0);
  const int64_t seq = x.dim(1);
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
      if (op.positions(i) < 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("rope_apply.positions[%d] must be >= 0, got %d", i, op.positions(i)));
      }
      if (op.positions(i) > kMaxPosition) {
        return absl::OutOfRangeError(
            absl::StrFormat("rope_apply.positions[%d] = %d is above the maximum position 2^40", i,
                            op.positions(i)));
      }
    }
  }
  if (op.offsets_size() > 0 && op.offsets_size() != batch) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rope_apply.offsets has %d entries, expected one per batch row (%d)",
                        op.offsets_size(), batch));
  }
  // The rotation has no check of its own: a NaN in would be a NaN out.
  RA_RETURN_IF_ERROR(CheckFinite(x.cview(), "rope_apply.x"));

  const int64_t seq_len = op.seq_len() == 0 ? seq : op.seq_len();
  // No table: Apply computes each token's row once; a table would only pay
  // off for rows sharing positions, and costs a row per position up front.
  RA_ASSIGN_OR_RETURN(const RopeRotator rotator,
                      WithContext(RopeRotator::Create(config, seq_len, 0), "rope_apply"));
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
      "rope_apply"));
  // Finite inputs near the float limit can overflow once scaled by the
  // attention factor (or its inverse); never answer with inf.
  RA_RETURN_IF_ERROR(CheckFinite(x.cview(), "rotated rope_apply.x"));
  TensorToProto(x.cview(), response->mutable_x());
  return absl::OkStatus();
}

absl::Status EncodeAlibi(const v1::EncodeRequest::Alibi& op, v1::EncodeResponse* response) {
  if (op.heads() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("alibi.heads must be > 0, got %d", op.heads()));
  }
  RA_ASSIGN_OR_RETURN(const std::vector<double> slopes,
                      WithContext(AlibiSlopes(op.heads()), "alibi.heads"));
  RA_RETURN_IF_ERROR(CheckNonNegative(op.q_len(), "alibi.q_len"));
  RA_RETURN_IF_ERROR(CheckNonNegative(op.k_len(), "alibi.k_len"));
  RA_RETURN_IF_ERROR(CheckNonNegative(op.q_offset(), "alibi.q_offset"));
  response->mutable_slopes()->Add(slopes.begin(), slopes.end());
  if (op.q_len() == 0) return absl::OkStatus();  // slopes only
  RA_RETURN_IF_ERROR(CheckLimit(
      SatProduct({op.heads(), op.q_len(), op.k_len()}), kMaxEncodeElements,
      absl::StrCat("the alibi bias ", DimsToString({op.heads(), op.q_len(), op.k_len()}))));
  RA_ASSIGN_OR_RETURN(const Tensor bias, WithContext(AlibiBias(slopes, op.q_len(), op.k_len(),
                                                               op.q_offset(), op.bidirectional()),
                                                     "alibi"));
  TensorToProto(bias.cview(), response->mutable_bias());
  return absl::OkStatus();
}

absl::Status EncodeT5(const v1::EncodeRequest::T5& op, v1::EncodeResponse* response) {
  T5BucketConfig config;
  config.num_buckets = op.num_buckets() == 0 ? 32 : op.num_buckets();
  config.max_distance = op.max_distance() == 0 ? 128 : op.max_distance();
  config.bidirectional = op.bidirectional();
  RA_RETURN_IF_ERROR(Annotate(ValidateT5BucketConfig(config), "t5"));
  RA_RETURN_IF_ERROR(CheckNonNegative(op.q_len(), "t5.q_len"));
  RA_RETURN_IF_ERROR(CheckNonNegative(op.k_len(), "t5.k_len"));
  RA_RETURN_IF_ERROR(CheckNonNegative(op.q_offset(), "t5.q_offset"));
  // Keeps every q_offset + i and j - q_pos inside int64, as the core does.
  if (op.q_offset() > kMaxPosition || op.q_len() > kMaxPosition - op.q_offset() ||
      op.k_len() > kMaxPosition) {
    return absl::OutOfRangeError(
        absl::StrFormat("t5: positions past 2^40 (q_offset %d + q_len %d, k_len %d)", op.q_offset(),
                        op.q_len(), op.k_len()));
  }
  const int64_t q_len = op.q_len();
  const int64_t k_len = op.k_len();
  RA_RETURN_IF_ERROR(CheckLimit(SatMul(q_len, k_len), kMaxEncodeElements,
                                absl::StrCat("the t5 bucket grid ", DimsToString({q_len, k_len}))));

  // Parse and check the optional table before filling anything.
  Tensor table;
  if (op.has_table()) {
    RA_ASSIGN_OR_RETURN(table, TensorFromProto(op.table(), "t5.table"));
    if (table.rank() != 2) {
      return absl::InvalidArgumentError(
          absl::StrFormat("t5.table must have rank 2 [num_buckets, heads], got shape %s",
                          DimsToString(table.dims())));
    }
    if (table.dim(0) != config.num_buckets || table.dim(1) < 1) {
      return absl::InvalidArgumentError(
          absl::StrFormat("t5.table must have shape [num_buckets=%d, heads >= 1], got %s",
                          config.num_buckets, DimsToString(table.dims())));
    }
    RA_RETURN_IF_ERROR(CheckFinite(table.cview(), "t5.table"));
    RA_RETURN_IF_ERROR(
        CheckLimit(SatProduct({table.dim(1), q_len, k_len}), kMaxEncodeElements,
                   absl::StrCat("the t5 bias ", DimsToString({table.dim(1), q_len, k_len}))));
  }

  auto* buckets = response->mutable_buckets();
  buckets->Resize(static_cast<int>(q_len * k_len), 0);
  int32_t* out = buckets->mutable_data();
  for (int64_t i = 0; i < q_len; ++i) {
    const int64_t q_pos = op.q_offset() + i;
    for (int64_t j = 0; j < k_len; ++j) out[i * k_len + j] = T5RelativeBucket(j - q_pos, config);
  }
  if (op.has_table()) {
    RA_ASSIGN_OR_RETURN(
        const Tensor bias,
        WithContext(T5Bias(table.cview(), config, q_len, k_len, op.q_offset()), "t5"));
    TensorToProto(bias.cview(), response->mutable_bias());
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunEncode(const v1::EncodeRequest& request, v1::EncodeResponse* response,
                       const ComputeOptions& options) {
  const int threads = std::max(1, options.threads);
  switch (request.op_case()) {
    case v1::EncodeRequest::kSinusoidal:
      return EncodeSinusoidal(request.sinusoidal(), response);
    case v1::EncodeRequest::kRopeFrequencies:
      return EncodeRopeFrequencies(request.rope_frequencies(), response);
    case v1::EncodeRequest::kRopeCosSin:
      return EncodeRopeCosSin(request.rope_cos_sin(), response);
    case v1::EncodeRequest::kRopeApply:
      return EncodeRopeApply(request.rope_apply(), response, threads);
    case v1::EncodeRequest::kAlibi:
      return EncodeAlibi(request.alibi(), response);
    case v1::EncodeRequest::kT5:
      return EncodeT5(request.t5(), response);
    case v1::EncodeRequest::OP_NOT_SET:
      return absl::InvalidArgumentError("EncodeRequest.op is not set");
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("EncodeRequest.op has unknown case %d", static_cast<int>(request.op_case())));
}

}  // namespace ropeattn::server
