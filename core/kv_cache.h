// A decoding session's keys and values (f32), stored in the layout the decode
// kernel streams fastest (docs/core-design.md, "A cache layout that streams"):
//
//   K: per kv head, tiles of kTile keys stored channel-major,
//      [kv_heads][capacity / kTile][head_dim][kTile]
//   V: per kv head, [kv_heads][capacity][v_dim]
//
// Each tile is one contiguous block, so scoring a tile for the query rows of
// its kv head reads memory once, in address order, with no horizontal sums.
// Rows are written by position; AttendCache (attention.h) reads the first
// `length` of them. Not thread-safe for concurrent writes; concurrent reads
// are fine.
#ifndef ROPEATTN_CORE_KV_CACHE_H_
#define ROPEATTN_CORE_KV_CACHE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/tensor.h"

namespace ropeattn {

// Whether decoding from a KvCache beats decoding from token-major tensors on
// this machine: true where its AVX-512 kernels run. Their AVX2 versions were
// measured 8-15% slower than the token-major AVX2 decode, so a caller choosing
// a cache layout should keep token-major tensors when this is false.
bool KvCacheDecodeIsFaster();

class KvCache {
 public:
  static constexpr int64_t kTile = 32;  // keys per K tile

  // Room for `capacity` positions (rounded up to a whole tile), zero-filled.
  // InvalidArgument for negative sizes, ResourceExhausted if memory runs out.
  static absl::StatusOr<KvCache> Create(int64_t kv_heads, int64_t head_dim, int64_t v_dim,
                                        int64_t capacity);

  KvCache() = default;
  KvCache(KvCache&&) = default;
  KvCache& operator=(KvCache&&) = default;

  int64_t kv_heads() const { return kv_heads_; }
  int64_t head_dim() const { return head_dim_; }
  int64_t v_dim() const { return v_dim_; }
  int64_t capacity() const { return capacity_; }
  size_t byte_size() const { return k_.byte_size() + v_.byte_size(); }

  // Writes positions [at, at + n) from an f32 view [n, kv_heads, dim] or
  // [1, n, kv_heads, dim] (any strides). InvalidArgument for a wrong shape or
  // dtype, OutOfRange past the capacity.
  absl::Status WriteK(int64_t at, ConstTensorView k);
  absl::Status WriteV(int64_t at, ConstTensorView v);
  // Reads positions [at, at + n) into [n, kv_heads, dim] or [1, n, kv_heads, dim].
  absl::Status ReadK(int64_t at, TensorView k) const;
  absl::Status ReadV(int64_t at, TensorView v) const;
  // Copies positions [0, length) of `other` (same shape, capacity >= length).
  absl::Status CopyFrom(const KvCache& other, int64_t length);

  // Kernel access.
  const float* KTile(int64_t head, int64_t tile) const {
    return k_.data<float>() + (head * tiles_ + tile) * head_dim_ * kTile;
  }
  const float* VRow(int64_t head, int64_t pos) const {
    return v_.data<float>() + (head * capacity_ + pos) * v_dim_;
  }

 private:
  float* KAt(int64_t head, int64_t pos, int64_t x) {
    return k_.data<float>() + ((head * tiles_ + pos / kTile) * head_dim_ + x) * kTile + pos % kTile;
  }
  float* VAt(int64_t head, int64_t pos) {
    return v_.data<float>() + (head * capacity_ + pos) * v_dim_;
  }

  int64_t kv_heads_ = 0, head_dim_ = 0, v_dim_ = 0, capacity_ = 0, tiles_ = 0;
  Tensor k_, v_;
};

}  // namespace ropeattn

#endif  // ROPEATTN_CORE_KV_CACHE_H_
