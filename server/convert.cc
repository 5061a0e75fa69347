#include "server/convert.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "absl/base/config.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/limits.h"
#include "core/relative_bias.h"
#include "core/status_macros.h"

// The wire carries little-endian bytes (see attention.proto) and we copy them
// straight into core tensors. A big-endian port would need a byte swap here
// and in TensorToProto; refuse to build rather than answer garbage.
#if !defined(ABSL_IS_LITTLE_ENDIAN)
#error "ropeattn's wire format is little-endian; this host is not"
#endif

namespace ropeattn::server {
namespace {

constexpr double kDefaultTheta = 10000.0;
constexpr int kDefaultT5MaxDistance = 128;

// Copies `n` elements of `elem` bytes from a strided view into `dst`, walking
// the multi-index and copying the innermost axis as one run when it is packed.
void CopyStrided(const ConstTensorView& view, size_t elem, char* dst) {
  const int rank = view.rank();
  const char* src = static_cast<const char*>(view.raw());
  const int64_t inner = view.dim(rank - 1);
  const bool inner_packed = view.stride(rank - 1) == 1;
  Dims index(rank, 0);
  const int64_t rows = view.num_elements() / inner;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = view.Offset(index);
    if (inner_packed) {
      std::memcpy(dst, src + base * elem, inner * elem);
      dst += inner * elem;
    } else {
      for (int64_t i = 0; i < inner; ++i) {
        std::memcpy(dst, src + (base + i * view.stride(rank - 1)) * elem, elem);
        dst += elem;
      }
    }
    for (int a = rank - 2; a >= 0; --a) {
      if (++index[a] < view.dim(a)) break;
      index[a] = 0;
    }
  }
}

absl::Status CheckNonNegativeFinite(double value, double hi, absl::string_view field) {
  return CheckFiniteRange(value, 0.0, hi, field);
}

}  // namespace

std::string CapStatusMessage(absl::string_view message) {
  if (message.size() <= kMaxStatusMessageBytes) return std::string(message);
  return absl::StrCat(message.substr(0, kMaxStatusMessageBytes - 64), "... (message cut at ",
                      kMaxStatusMessageBytes - 64, " of ", message.size(), " bytes)");
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl::StatusCode and grpc::StatusCode both follow google.rpc.Code.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      CapStatusMessage(status.message()));
}

std::string QuoteForMessage(absl::string_view s) {
  constexpr size_t kShown = 64;
  std::string out = "\"";
  for (char ch : s.substr(0, kShown)) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(ch);
    } else if (c >= 0x20 && c < 0x7f) {
      out.push_back(ch);
    } else {
      absl::StrAppendFormat(&out, "\\x%02x", c);
    }
  }
  out.push_back('"');
  if (s.size() > kShown) absl::StrAppend(&out, "... (", s.size(), " bytes)");
  return out;
}

absl::Status CheckFiniteRange(double value, double lo, double hi, absl::string_view field) {
  if (!std::isfinite(value) || value < lo || value > hi) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s must be finite and in [%g, %g], got %g", field, lo, hi, value));
  }
  return absl::OkStatus();
}

absl::Status CheckSoftcap(double value, absl::string_view field) {
  if (value == 0.0) return absl::OkStatus();
  if (!std::isfinite(value) || value < kMinSoftcap || value > kMaxSoftcap) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s must be 0 (none) or finite and in [%g, %g], got %g", field,
                        kMinSoftcap, kMaxSoftcap, value));
  }
  return absl::OkStatus();
}

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

absl::StatusOr<DType> DTypeFromProto(int dtype, absl::string_view field,
                                     std::optional<DType> fallback) {
  switch (dtype) {
    case v1::DTYPE_F32:
      return DType::kF32;
    case v1::DTYPE_BF16:
      return DType::kBF16;
    case v1::DTYPE_UNSPECIFIED:
      if (fallback.has_value()) return *fallback;
      return absl::InvalidArgumentError(
          absl::StrCat(field, " is DTYPE_UNSPECIFIED; expected DTYPE_F32 or DTYPE_BF16"));
    case v1::DTYPE_INT8:
      return absl::InvalidArgumentError(absl::StrCat(
          field, " is DTYPE_INT8, a KV cache dtype only (OpenSession.kv_dtype); expected "
                 "DTYPE_F32 or DTYPE_BF16"));
    default:
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s has unknown value %d; expected DTYPE_F32 or DTYPE_BF16", field, dtype));
  }
}

v1::DType DTypeToProto(DType dtype) {
  return dtype == DType::kBF16 ? v1::DTYPE_BF16 : v1::DTYPE_F32;
}

absl::StatusOr<WireShape> ParseWireShape(const v1::Tensor& tensor, absl::string_view name) {
  WireShape w;
  if (tensor.f32_values_size() > 0 && tensor.dtype() == v1::DTYPE_UNSPECIFIED) {
    w.dtype = DType::kF32;  // typed values say their dtype
  } else {
    RA_ASSIGN_OR_RETURN(w.dtype, DTypeFromProto(tensor.dtype(), absl::StrCat(name, ".dtype")));
  }
  if (tensor.shape_size() > kMaxWireRank) {
    // Checked before formatting the shape: a million dims would make a
    // million-entry error message.
    return absl::InvalidArgumentError(absl::StrFormat("%s.shape has %d dims; at most %d allowed",
                                                      name, tensor.shape_size(), kMaxWireRank));
  }
  const absl::Span<const int64_t> dims(tensor.shape().data(), tensor.shape_size());
  for (size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] < 0) {
      return absl::InvalidArgumentError(absl::StrFormat("%s.shape[%d] is negative (%d) in %s", name,
                                                        i, dims[i], DimsToString(dims)));
    }
  }
  absl::StatusOr<int64_t> n = NumElements(dims);
  if (!n.ok()) return Annotate(n.status(), absl::StrCat(name, ".shape"));
  // n <= 2^60, so the byte count (at most 4 bytes each) fits in int64.
  const int64_t want = *n * static_cast<int64_t>(DTypeSize(w.dtype));
  if (tensor.f32_values_size() > 0) {
    // Typed values instead of bytes (hand-written JSON requests).
    if (!tensor.data().empty()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s sets both data (%d bytes) and f32_values (%d values); give one", name,
          tensor.data().size(), tensor.f32_values_size()));
    }
    if (w.dtype != DType::kF32) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s.f32_values needs dtype DTYPE_F32 (or unset), got %s", name,
                          DTypeName(w.dtype)));
    }
    if (tensor.f32_values_size() != *n) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s.f32_values has %d values, shape %s needs %d", name, tensor.f32_values_size(),
          DimsToString(dims), *n));
    }
    w.dims.assign(dims.begin(), dims.end());
    w.elements = *n;
    w.bytes = want;
    return w;
  }
  const int64_t have = static_cast<int64_t>(tensor.data().size());
  if (have != want) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.data has %d bytes, shape %s in %s needs %d", name, have,
                        DimsToString(dims), DTypeName(w.dtype), want));
  }
  w.dims.assign(dims.begin(), dims.end());
  w.elements = *n;
  w.bytes = want;
  return w;
}

absl::StatusOr<Tensor> TensorFromProto(const v1::Tensor& tensor, absl::string_view name) {
  RA_ASSIGN_OR_RETURN(const WireShape w, ParseWireShape(tensor, name));
  RA_ASSIGN_OR_RETURN(Tensor out, Tensor::Create(w.dtype, w.dims));
  const char* src = tensor.f32_values_size() > 0
                        ? reinterpret_cast<const char*>(tensor.f32_values().data())
                        : tensor.data().data();
  if (w.bytes > 0) std::memcpy(out.data<char>(), src, static_cast<size_t>(w.bytes));
  return out;
}

absl::StatusOr<ConstTensorView> ViewOfWireTensor(const v1::Tensor& tensor, absl::string_view name,
                                                 Tensor* copy) {
  RA_ASSIGN_OR_RETURN(const WireShape w, ParseWireShape(tensor, name));
  // Typed values are a float array already: viewed in place too.
  const char* data = tensor.f32_values_size() > 0
                         ? reinterpret_cast<const char*>(tensor.f32_values().data())
                         : tensor.data().data();
  if (reinterpret_cast<uintptr_t>(data) % DTypeSize(w.dtype) == 0) {
    return ConstTensorView(data, w.dtype, w.dims);
  }
  RA_ASSIGN_OR_RETURN(*copy, TensorFromProto(tensor, name));
  return copy->cview();
}

absl::StatusOr<TensorView> WireTensorForWriting(DType dtype, absl::Span<const int64_t> dims,
                                                v1::Tensor* out) {
  RA_ASSIGN_OR_RETURN(const int64_t n, NumElements(dims));
  out->Clear();
  out->set_dtype(DTypeToProto(dtype));
  for (int64_t d : dims) out->add_shape(d);
  std::string* data = out->mutable_data();
  data->resize(static_cast<size_t>(n) * DTypeSize(dtype));
  if (reinterpret_cast<uintptr_t>(data->data()) % DTypeSize(dtype) != 0) {
    return absl::InternalError("a response buffer is not aligned for its dtype");
  }
  return TensorView(data->data(), dtype, Dims(dims.begin(), dims.end()));
}

void TensorToProto(const ConstTensorView& view, v1::Tensor* out) {
  out->Clear();
  out->set_dtype(DTypeToProto(view.dtype()));
  for (int64_t d : view.dims()) out->add_shape(d);
  const int64_t n = view.num_elements();
  if (n == 0 || view.raw() == nullptr) return;
  const size_t elem = DTypeSize(view.dtype());
  std::string* data = out->mutable_data();
  data->resize(static_cast<size_t>(n) * elem);
  if (view.IsContiguous()) {
    std::memcpy(data->data(), view.raw(), data->size());
  } else {
    CopyStrided(view, elem, data->data());
  }
}

namespace {

// A parameter the rule would not read is refused, not ignored: whoever sent
// it expects it to change the result. `sc` is the scaling field's path with a
// trailing dot. Presence: optional fields when set, lists when non-empty,
// plain numbers when non-zero; mscale / mscale_all_dim of 0 mean not given
// (transformers' truthiness).
absl::Status CheckRuleReadsEveryField(const v1::RopeScaling& in, RopeScalingType type,
                                      absl::string_view sc) {
  const RopeRule& rule = RopeRuleOf(type);
  uint32_t given = 0;
  // default accepts a factor of 0 or 1 (both mean none).
  if (in.factor() != 0.0 && !(type == RopeScalingType::kDefault && in.factor() == 1.0)) {
    given |= kRopeFactor;
  }
  if (in.original_max_position_embeddings() != 0) given |= kRopeOriginalMax;
  if (in.has_beta_fast()) given |= kRopeBetaFast;
  if (in.has_beta_slow()) given |= kRopeBetaSlow;
  if (in.has_truncate()) given |= kRopeTruncate;
  if (in.has_attention_factor()) given |= kRopeAttentionFactor;
  if (in.has_mscale() && in.mscale() != 0.0) given |= kRopeMscale;
  if (in.has_mscale_all_dim() && in.mscale_all_dim() != 0.0) given |= kRopeMscaleAllDim;
  if (in.short_factor_size() > 0) given |= kRopeShortFactor;
  if (in.long_factor_size() > 0) given |= kRopeLongFactor;
  if (in.max_position_embeddings() != 0) given |= kRopeMaxPositionEmbeddings;
  if (in.has_low_freq_factor()) given |= kRopeLowFreqFactor;
  if (in.has_high_freq_factor()) given |= kRopeHighFreqFactor;
  const uint32_t unread = given & ~RopeFieldsRead(rule, given);
  for (uint32_t bit = 1; bit <= kRopeAllFields; bit <<= 1) {
    if ((unread & bit) == 0) continue;
    std::vector<std::string> readers;
    for (const RopeRule& r : RopeRules()) {
      if (r.reads & bit) readers.push_back(r.name);
    }
    return absl::InvalidArgumentError(absl::StrCat(
        sc, RopeFieldName(static_cast<RopeField>(bit)), " has no effect under rope_type \"",
        rule.name, "\" as given (read by ", readers.empty() ? "no rule" : absl::StrJoin(readers, ", "),
        bit == kRopeMscale || bit == kRopeMscaleAllDim
            ? "; mscale and mscale_all_dim only as a non-zero pair, without attention_factor"
            : bit == kRopeFactor && type == RopeScalingType::kLongRope
                  ? "; longrope reads factor only without attention_factor and "
                    "max_position_embeddings"
                  : "",
        "); remove it"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RopeConfig> RopeConfigFromProto(const v1::RopeSpec& spec, int64_t head_dim,
                                               absl::string_view field) {
  RopeConfig config;
  config.head_dim = head_dim;
  config.rotary_dim = spec.rotary_dim();
  config.theta = spec.theta() == 0.0 ? kDefaultTheta : spec.theta();
  switch (spec.layout()) {
    case v1::ROPE_LAYOUT_UNSPECIFIED:
    case v1::ROPE_LAYOUT_HALF_SPLIT:
      config.layout = RopeLayout::kHalfSplit;
      break;
    case v1::ROPE_LAYOUT_INTERLEAVED:
      config.layout = RopeLayout::kInterleaved;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrFormat("%s.layout has unknown value %d", field,
                                                        static_cast<int>(spec.layout())));
  }

  const v1::RopeScaling& in = spec.scaling();
  RopeScaling& s = config.scaling;
  if (!in.rope_type().empty()) {
    absl::StatusOr<RopeScalingType> type = ParseRopeScalingType(in.rope_type());
    if (!type.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".scaling.rope_type ", QuoteForMessage(in.rope_type()),
          " is unknown; expected one of default, linear, ntk, dynamic, yarn, longrope (or su), "
          "llama3"));
    }
    s.type = *type;
  }
  s.factor = in.factor() == 0.0 ? 1.0 : in.factor();
  s.original_max_positions = in.original_max_position_embeddings();
  // transformers: `get("beta_fast") or 32`, so 0 means the default.
  if (in.has_beta_fast() && in.beta_fast() != 0.0) s.beta_fast = in.beta_fast();
  if (in.has_beta_slow() && in.beta_slow() != 0.0) s.beta_slow = in.beta_slow();
  if (in.has_attention_factor()) s.attention_factor = in.attention_factor();
  if (in.has_mscale()) s.mscale = in.mscale();
  if (in.has_mscale_all_dim()) s.mscale_all_dim = in.mscale_all_dim();
  if (in.has_truncate()) s.truncate = in.truncate();
  s.max_position_embeddings = in.max_position_embeddings();
  s.short_factor.assign(in.short_factor().begin(), in.short_factor().end());
  s.long_factor.assign(in.long_factor().begin(), in.long_factor().end());
  if (in.has_low_freq_factor()) s.low_freq_factor = in.low_freq_factor();
  if (in.has_high_freq_factor()) s.high_freq_factor = in.high_freq_factor();

  // Upper bounds the core does not set: each keeps every derived number
  // (frequencies, attention factors, rotated values) finite.
  const std::string sc = absl::StrCat(field, ".scaling.");
  RA_RETURN_IF_ERROR(CheckFiniteRange(spec.theta(), 0.0, kMaxTheta, absl::StrCat(field, ".theta")));
  RA_RETURN_IF_ERROR(
      CheckFiniteRange(in.factor(), 0.0, kMaxScalingFactor, absl::StrCat(sc, "factor")));
  if (in.original_max_position_embeddings() < 0 ||
      in.original_max_position_embeddings() > kMaxPosition) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%soriginal_max_position_embeddings must be in [0, 2^40], got %d", sc,
        in.original_max_position_embeddings()));
  }
  if (in.max_position_embeddings() < 0 || in.max_position_embeddings() > kMaxPosition) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%smax_position_embeddings must be in [0, 2^40], got %d", sc,
                        in.max_position_embeddings()));
  }
  const std::pair<const char*, std::optional<double>> betas[] = {
      {"beta_fast", in.has_beta_fast() ? std::optional<double>(in.beta_fast()) : std::nullopt},
      {"beta_slow", in.has_beta_slow() ? std::optional<double>(in.beta_slow()) : std::nullopt},
      {"low_freq_factor",
       in.has_low_freq_factor() ? std::optional<double>(in.low_freq_factor()) : std::nullopt},
      {"high_freq_factor",
       in.has_high_freq_factor() ? std::optional<double>(in.high_freq_factor()) : std::nullopt}};
  for (const auto& [name, value] : betas) {
    if (value) {
      RA_RETURN_IF_ERROR(CheckFiniteRange(*value, -kMaxScalingFactor, kMaxScalingFactor,
                                          absl::StrCat(sc, name)));
    }
  }
  const std::pair<const char*, std::optional<double>> attention[] = {
      {"attention_factor",
       in.has_attention_factor() ? std::optional<double>(in.attention_factor()) : std::nullopt},
      {"mscale", in.has_mscale() ? std::optional<double>(in.mscale()) : std::nullopt},
      {"mscale_all_dim",
       in.has_mscale_all_dim() ? std::optional<double>(in.mscale_all_dim()) : std::nullopt}};
  for (const auto& [name, value] : attention) {
    if (value) {
      RA_RETURN_IF_ERROR(CheckFiniteRange(*value, -kMaxAttentionFactor, kMaxAttentionFactor,
                                          absl::StrCat(sc, name)));
    }
  }
  for (int i = 0; i < in.short_factor_size(); ++i) {
    RA_RETURN_IF_ERROR(CheckFiniteRange(in.short_factor(i), 0.0, kMaxScalingFactor,
                                        absl::StrFormat("%sshort_factor[%d]", sc, i)));
  }
  for (int i = 0; i < in.long_factor_size(); ++i) {
    RA_RETURN_IF_ERROR(CheckFiniteRange(in.long_factor(i), 0.0, kMaxScalingFactor,
                                        absl::StrFormat("%slong_factor[%d]", sc, i)));
  }
  RA_RETURN_IF_ERROR(CheckRuleReadsEveryField(in, s.type, sc));
  RA_RETURN_IF_ERROR(Annotate(ValidateRopeConfig(config), field));
  return config;
}

int64_t ResolvedHeapBytes(const ResolvedSpec& spec) {
  int64_t bytes = static_cast<int64_t>(spec.options.bias.alibi_slopes.capacity() * sizeof(double));
  if (spec.rope) {
    bytes += static_cast<int64_t>(
        (spec.rope->scaling.short_factor.capacity() + spec.rope->scaling.long_factor.capacity()) *
        sizeof(double));
  }
  return SatAdd(bytes, static_cast<int64_t>(spec.t5_table.byte_size()));
}

absl::StatusOr<ResolvedSpec> ResolveSpec(const v1::AttentionSpec& spec) {
  ResolvedSpec r;
  if (spec.heads() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("spec.heads must be > 0, got %d", spec.heads()));
  }
  if (spec.kv_heads() < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("spec.kv_heads must be >= 0 (0 means heads), got %d", spec.kv_heads()));
  }
  if (spec.head_dim() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("spec.head_dim must be > 0, got %d", spec.head_dim()));
  }
  r.heads = spec.heads();
  r.kv_heads = spec.kv_heads() == 0 ? spec.heads() : spec.kv_heads();
  r.head_dim = spec.head_dim();
  if (r.heads % r.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "spec.heads (%d) must be a multiple of spec.kv_heads (%d)", r.heads, r.kv_heads));
  }
  RA_RETURN_IF_ERROR(CheckNonNegativeFinite(spec.scale(), kMaxLogitScale, "spec.scale"));
  RA_RETURN_IF_ERROR(CheckSoftcap(spec.softcap(), "spec.softcap"));
  if (spec.window() < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("spec.window must be >= 0 (0 means none), got %d", spec.window()));
  }
  AttentionOptions& o = r.options;
  o.scale = spec.scale();
  o.causal = spec.causal();
  o.window = spec.window();
  o.softcap = spec.softcap();

  switch (spec.positional_case()) {
    case v1::AttentionSpec::POSITIONAL_NOT_SET:
      break;
    case v1::AttentionSpec::kRope: {
      const v1::RopeSpec& rope = spec.rope();
      // Say which field is at fault: with rotary_dim 0 the odd number is
      // head_dim, which the core can only call "rotary_dim".
      if (rope.rotary_dim() == 0 && r.head_dim % 2 != 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "spec.head_dim must be even for RoPE over the whole head (spec.rope.rotary_dim 0), "
            "got %d",
            r.head_dim));
      }
      RA_ASSIGN_OR_RETURN(RopeConfig config, RopeConfigFromProto(rope, r.head_dim, "spec.rope"));
      r.rope = std::move(config);
      break;
    }
    case v1::AttentionSpec::kAlibi: {
      o.bias.kind = BiasKind::kAlibi;
      const auto& slopes = spec.alibi().slopes();
      if (slopes.empty()) {
        absl::StatusOr<std::vector<double>> standard = AlibiSlopes(r.heads);
        if (!standard.ok()) return Annotate(standard.status(), "spec.alibi (standard slopes)");
        o.bias.alibi_slopes = *std::move(standard);
      } else {
        if (slopes.size() != r.heads) {
          return absl::InvalidArgumentError(
              absl::StrFormat("spec.alibi.slopes has %d entries, expected one per head (%d)",
                              slopes.size(), r.heads));
        }
        for (int h = 0; h < slopes.size(); ++h) {
          RA_RETURN_IF_ERROR(CheckFiniteRange(slopes[h], -kMaxAlibiSlope, kMaxAlibiSlope,
                                              absl::StrFormat("spec.alibi.slopes[%d]", h)));
        }
        o.bias.alibi_slopes.assign(slopes.begin(), slopes.end());
      }
      break;
    }
    case v1::AttentionSpec::kT5: {
      const v1::T5Spec& t5 = spec.t5();
      RA_ASSIGN_OR_RETURN(r.t5_table, TensorFromProto(t5.table(), "spec.t5.table"));
      if (r.t5_table.rank() != 2) {
        return absl::InvalidArgumentError(
            absl::StrFormat("spec.t5.table must have rank 2 [num_buckets, heads], got shape %s",
                            DimsToString(r.t5_table.dims())));
      }
      if (t5.num_buckets() < 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "spec.t5.num_buckets must be >= 0 (0 means table.shape[0]), got %d", t5.num_buckets()));
      }
      if (t5.max_distance() < 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "spec.t5.max_distance must be >= 0 (0 means 128), got %d", t5.max_distance()));
      }
      T5BucketConfig& c = o.bias.t5_config;
      if (t5.num_buckets() != 0) {
        c.num_buckets = t5.num_buckets();
      } else if (r.t5_table.dim(0) <= std::numeric_limits<int>::max()) {
        c.num_buckets = static_cast<int>(r.t5_table.dim(0));
      } else {
        return absl::InvalidArgumentError(absl::StrFormat(
            "spec.t5.table has %d buckets, more than an int32 num_buckets", r.t5_table.dim(0)));
      }
      c.max_distance = t5.max_distance() == 0 ? kDefaultT5MaxDistance : t5.max_distance();
      c.bidirectional = t5.bidirectional();
      RA_RETURN_IF_ERROR(Annotate(ValidateT5BucketConfig(c), "spec.t5"));
      if (r.t5_table.dim(0) != c.num_buckets || r.t5_table.dim(1) != r.heads) {
        return absl::InvalidArgumentError(
            absl::StrFormat("spec.t5.table must have shape [num_buckets=%d, heads=%d], got %s",
                            c.num_buckets, r.heads, DimsToString(r.t5_table.dims())));
      }
      RA_RETURN_IF_ERROR(CheckFinite(r.t5_table.cview(), "spec.t5.table"));
      o.bias.kind = BiasKind::kT5;
      o.bias.t5_table = r.t5_table.cview();
      break;
    }
    default:
      return absl::InvalidArgumentError(absl::StrFormat("spec.positional has unknown case %d",
                                                        static_cast<int>(spec.positional_case())));
  }
  return r;
}

}  // namespace ropeattn::server
