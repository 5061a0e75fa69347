// The one place where wire types become core types and back, and where core
// statuses become gRPC statuses.
#ifndef ROPEATTN_SERVER_CONVERT_H_
#define ROPEATTN_SERVER_CONVERT_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/attention.h"
#include "core/rope.h"
#include "core/tensor.h"
#include "server/param_limits.h"
#include "grpcpp/support/status.h"
#include "ropeattn/v1/attention.pb.h"

namespace ropeattn::server {

// absl and gRPC share their code numbering; the message is kept up to
// kMaxStatusMessageBytes (longer ones are cut, saying so): a status trailer
// must stay far below clients' metadata limits whatever went into it.
inline constexpr size_t kMaxStatusMessageBytes = 1024;
grpc::Status ToGrpcStatus(const absl::Status& status);
std::string CapStatusMessage(absl::string_view message);

// A client-supplied string for an error message: quoted, at most its first
// 64 bytes (then "..." and its full length), non-printable bytes escaped.
std::string QuoteForMessage(absl::string_view s);

// Documented ranges of the float parameters (server/param_limits.h, README
// "Limits"): a value outside [lo, hi], or not finite, is InvalidArgument
// naming `field`.
absl::Status CheckFiniteRange(double value, double lo, double hi, absl::string_view field);
// A soft-cap: 0 (none) or in [kMinSoftcap, kMaxSoftcap] (param_limits.h).
absl::Status CheckSoftcap(double value, absl::string_view field);

// A wire tensor's dtype and shape, validated like TensorFromProto (dtype,
// rank, non-negative dims, no overflow, byte length) without copying data.
struct WireShape {
  DType dtype = DType::kF32;
  Dims dims;
  int64_t elements = 0;
  int64_t bytes = 0;
  int rank() const { return static_cast<int>(dims.size()); }
  int64_t dim(int i) const { return dims[i]; }
};
absl::StatusOr<WireShape> ParseWireShape(const v1::Tensor& tensor, absl::string_view name);

// The same code with "<context>: " in front of the message, so an error from
// the core (which knows "rotary_dim", not "spec.rope.rotary_dim") names the
// request field it came from. OK stays OK.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

// kF32 / kBF16; UNSPECIFIED becomes `fallback` when given, otherwise
// InvalidArgument naming `field`. Unknown enum values: InvalidArgument.
absl::StatusOr<DType> DTypeFromProto(int dtype, absl::string_view field,
                                     std::optional<DType> fallback = std::nullopt);
v1::DType DTypeToProto(DType dtype);

// Wire tensor -> owned, aligned core tensor (copied: protobuf bytes carry no
// alignment guarantee). InvalidArgument naming `name` for an unspecified or
// unknown dtype, more than kMaxWireRank dims, a negative dim, a shape product
// that overflows, or a byte length that differs from product(shape) * dtype
// size (the message gives both numbers). The byte length is checked before
// anything is allocated, so a hostile shape costs no memory. The bytes are
// taken as little-endian: the build refuses big-endian hosts.
inline constexpr int kMaxWireRank = 8;
absl::StatusOr<Tensor> TensorFromProto(const v1::Tensor& tensor, absl::string_view name);
// A wire tensor as a core view without a copy: over the message's own bytes
// when they are aligned for the dtype (heap strings always are), else over
// a copy made into `copy`. Validated as TensorFromProto. The view lives as
// long as the message (and `copy`).
absl::StatusOr<ConstTensorView> ViewOfWireTensor(const v1::Tensor& tensor, absl::string_view name,
                                                 Tensor* copy);
// Sizes `out` for a dense tensor of `dtype` and `dims` and returns a view of
// its bytes to write the values into (little-endian, row-major).
absl::StatusOr<TensorView> WireTensorForWriting(DType dtype, absl::Span<const int64_t> dims,
                                                v1::Tensor* out);
// Core view (any strides) -> wire tensor (dense, little-endian).
void TensorToProto(const ConstTensorView& view, v1::Tensor* out);

// RoPE spec -> core config for head_dim (validated with ValidateRopeConfig;
// an unknown rope_type is InvalidArgument naming it). Defaults: empty
// rope_type is "default", factor 0 is 1, theta 0 is 10000, rotary_dim 0 is
// head_dim, unset optional fields keep the core's defaults. A scaling
// parameter the rule would not read (as the proto's RopeScaling says: present
// optional fields, non-empty lists, non-zero numbers; mscale 0 is not given)
// is InvalidArgument naming the field and the rule. Errors are prefixed with
// `field` (the spec's path in the request).
absl::StatusOr<RopeConfig> RopeConfigFromProto(const v1::RopeSpec& spec, int64_t head_dim,
                                               absl::string_view field = "spec.rope");

// An attention spec, validated and resolved into what the core takes.
struct ResolvedSpec {
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  AttentionOptions options;  // scale, causal, window, softcap, bias set
  std::optional<RopeConfig> rope;
  Tensor t5_table;  // owns the table options.bias.t5_table points into
};
// InvalidArgument naming the field for: heads <= 0, kv_heads < 0 or not
// dividing heads, head_dim <= 0, non-finite or negative scale / softcap,
// negative window, bad RoPE (odd head_dim with full rotary, ...), ALiBi slopes
// of the wrong count or not finite, a T5 table of the wrong shape, with
// non-finite entries, or a bucket config T5 cannot use. Defaults resolved:
// kv_heads 0 -> heads, empty ALiBi slopes -> the standard slopes for heads,
// T5 num_buckets 0 -> table.shape[0], max_distance 0 -> 128.
// The result owns everything options.bias points into: it may be moved, not
// copied.
absl::StatusOr<ResolvedSpec> ResolveSpec(const v1::AttentionSpec& spec);
// Heap bytes a ResolvedSpec's vectors hold (ALiBi slopes, longrope factor
// lists, the T5 table), for charging a session that keeps one.
int64_t ResolvedHeapBytes(const ResolvedSpec& spec);

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_CONVERT_H_
