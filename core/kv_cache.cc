#include "core/kv_cache.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_format.h"
#include "core/attention_kernels.h"
#include "core/status_macros.h"

namespace ropeattn {
namespace {

// Accepts [n, heads, dim] or [1, n, heads, dim] f32 and returns n (or an error
// naming `name`). Strides are read per element, so any strided view works.
absl::StatusOr<int64_t> RowsOf(const ConstTensorView& t, int64_t heads, int64_t dim,
                               const char* name) {
  const bool r3 = t.rank() == 3 && t.dim(1) == heads && t.dim(2) == dim;
  const bool r4 = t.rank() == 4 && t.dim(0) == 1 && t.dim(2) == heads && t.dim(3) == dim;
  if (t.dtype() != DType::kF32 || (!r3 && !r4)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s must be f32 of shape [n, %d, %d] or [1, n, %d, %d], got %s %s", name,
                        heads, dim, heads, dim, DTypeName(t.dtype()), DimsToString(t.dims())));
  }
  return r3 ? t.dim(0) : t.dim(1);
}

// Pointer to element (pos, head, x) of such a view, and its channel stride.
template <typename View>
auto* ElemPtr(const View& t, int64_t pos, int64_t head) {
  const int o = t.rank() == 4 ? 1 : 0;
  return t.template data<float>() + pos * t.stride(o) + head * t.stride(o + 1);
}

absl::Status CheckRange(int64_t at, int64_t n, int64_t capacity, const char* what) {
  if (at < 0 || n < 0 || at > capacity - n) {
    return absl::OutOfRangeError(
        absl::StrFormat("%s positions [%d, %d) are outside the cache's capacity of %d", what, at,
                        at + n, capacity));
  }
  return absl::OkStatus();
}

}  // namespace

bool KvCacheDecodeIsFaster() { return internal::Avx512KernelsEnabled(); }

absl::StatusOr<KvCache> KvCache::Create(int64_t kv_heads, int64_t head_dim, int64_t v_dim,
                                        int64_t capacity) {
  if (kv_heads < 0 || head_dim < 0 || v_dim < 0 || capacity < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "KvCache sizes must be >= 0, got kv_heads %d, head_dim %d, v_dim %d, capacity %d", kv_heads,
        head_dim, v_dim, capacity));
  }
  KvCache c;
  c.kv_heads_ = kv_heads;
  c.head_dim_ = head_dim;
  c.v_dim_ = v_dim;
  c.tiles_ = (capacity + kTile - 1) / kTile;
  c.capacity_ = c.tiles_ * kTile;
  RA_ASSIGN_OR_RETURN(c.k_, Tensor::Create(DType::kF32, {kv_heads, c.tiles_, head_dim, kTile}));
  RA_ASSIGN_OR_RETURN(c.v_, Tensor::Create(DType::kF32, {kv_heads, c.capacity_, v_dim}));
  return c;
}

absl::Status KvCache::WriteK(int64_t at, ConstTensorView k) {
  RA_ASSIGN_OR_RETURN(const int64_t n, RowsOf(k, kv_heads_, head_dim_, "k"));
  RA_RETURN_IF_ERROR(CheckRange(at, n, capacity_, "k"));
  const int64_t xs = k.stride(k.rank() - 1);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < kv_heads_; ++j) {
      const float* src = ElemPtr(k, t, j);
      float* dst = KAt(j, at + t, 0);
      for (int64_t x = 0; x < head_dim_; ++x) dst[x * kTile] = src[x * xs];
    }
  }
  return absl::OkStatus();
}

absl::Status KvCache::WriteV(int64_t at, ConstTensorView v) {
  RA_ASSIGN_OR_RETURN(const int64_t n, RowsOf(v, kv_heads_, v_dim_, "v"));
  RA_RETURN_IF_ERROR(CheckRange(at, n, capacity_, "v"));
  const int64_t xs = v.stride(v.rank() - 1);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < kv_heads_; ++j) {
      const float* src = ElemPtr(v, t, j);
      float* dst = VAt(j, at + t);
      for (int64_t x = 0; x < v_dim_; ++x) dst[x] = src[x * xs];
    }
  }
  return absl::OkStatus();
}

absl::Status KvCache::ReadK(int64_t at, TensorView k) const {
  RA_ASSIGN_OR_RETURN(const int64_t n, RowsOf(k, kv_heads_, head_dim_, "k"));
  RA_RETURN_IF_ERROR(CheckRange(at, n, capacity_, "k"));
  const int64_t xs = k.stride(k.rank() - 1);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < kv_heads_; ++j) {
      const int64_t pos = at + t;
      const float* src = KTile(j, pos / kTile) + pos % kTile;
      float* dst = ElemPtr(k, t, j);
      for (int64_t x = 0; x < head_dim_; ++x) dst[x * xs] = src[x * kTile];
    }
  }
  return absl::OkStatus();
}

absl::Status KvCache::ReadV(int64_t at, TensorView v) const {
  RA_ASSIGN_OR_RETURN(const int64_t n, RowsOf(v, kv_heads_, v_dim_, "v"));
  RA_RETURN_IF_ERROR(CheckRange(at, n, capacity_, "v"));
  const int64_t xs = v.stride(v.rank() - 1);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < kv_heads_; ++j) {
      const float* src = VRow(j, at + t);
      float* dst = ElemPtr(v, t, j);
      for (int64_t x = 0; x < v_dim_; ++x) dst[x * xs] = src[x];
    }
  }
  return absl::OkStatus();
}

absl::Status KvCache::CopyFrom(const KvCache& other, int64_t length) {
  if (other.kv_heads_ != kv_heads_ || other.head_dim_ != head_dim_ || other.v_dim_ != v_dim_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cannot copy a cache of [kv_heads %d, head_dim %d, v_dim %d] into one of [%d, %d, %d]",
        other.kv_heads_, other.head_dim_, other.v_dim_, kv_heads_, head_dim_, v_dim_));
  }
  RA_RETURN_IF_ERROR(CheckRange(0, length, std::min(capacity_, other.capacity_), "copied"));
  const int64_t tiles = (length + kTile - 1) / kTile;
  for (int64_t j = 0; j < kv_heads_; ++j) {
    if (tiles > 0) {
      std::memcpy(KAt(j, 0, 0), other.KTile(j, 0), tiles * head_dim_ * kTile * sizeof(float));
    }
    if (length > 0) std::memcpy(VAt(j, 0), other.VRow(j, 0), length * v_dim_ * sizeof(float));
  }
  return absl::OkStatus();
}

}  // namespace ropeattn
