// Tensors of the core: f32 and bf16, owning buffers and strided views.
//
// Layout convention used by every attention and RoPE function:
//   q, k, v, out : [batch, seq, heads, head_dim], row-major.
// The innermost two axes ([heads, head_dim]) must be packed (stride(3) == 1,
// stride(2) == head_dim); batch and seq strides are free, so a view of the
// first n rows of a preallocated KV cache is valid without a copy. We keep
// tokens outermost (rather than [batch, heads, seq, dim]) because that is how
// projections produce them and how the wire carries them: appending a token
// to a cache is one contiguous write.
#ifndef ROPEATTN_CORE_TENSOR_H_
#define ROPEATTN_CORE_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace ropeattn {

enum class DType : uint8_t { kF32 = 0, kBF16 = 1 };

// Bytes per element.
size_t DTypeSize(DType dtype);
// "f32" or "bf16".
const char* DTypeName(DType dtype);

// bfloat16 storage: the top 16 bits of an IEEE float.
inline float BF16ToFloat(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest even; NaN stays NaN (quiet), infinities stay infinite.
inline uint16_t FloatToBF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

using Dims = absl::InlinedVector<int64_t, 4>;

// Product of dims; InvalidArgument for a negative dim or an overflowing
// product (the element count must also fit in bytes as int64 for f32).
absl::StatusOr<int64_t> NumElements(absl::Span<const int64_t> dims);

// "[2, 7, 8, 64]"
std::string DimsToString(absl::Span<const int64_t> dims);

template <typename VoidT>
class BasicTensorView;
using TensorView = BasicTensorView<void>;
using ConstTensorView = BasicTensorView<const void>;

// A non-owning view: data pointer, dtype, dims and strides (in elements).
// A default-constructed view is "absent" (data() == nullptr, rank 0).
// Views are cheap to copy. Thread-safety: as the memory they point to.
template <typename VoidT>
class BasicTensorView {
 public:
  BasicTensorView() = default;
  // Dense row-major view.
  BasicTensorView(VoidT* data, DType dtype, Dims dims);
  BasicTensorView(VoidT* data, DType dtype, Dims dims, Dims strides)
      : data_(data), dtype_(dtype), dims_(std::move(dims)), strides_(std::move(strides)) {}
  // A mutable view converts to a const one.
  template <typename U = VoidT, typename = std::enable_if_t<std::is_const_v<U>>>
  BasicTensorView(const BasicTensorView<void>& other)  // NOLINT: implicit on purpose
      : data_(other.raw()), dtype_(other.dtype()), dims_(other.dims()), strides_(other.strides()) {}

  bool empty_view() const { return data_ == nullptr && dims_.empty(); }
  VoidT* raw() const { return data_; }
  template <typename T>
  auto* data() const {
    if constexpr (std::is_const_v<VoidT>) {
      return static_cast<const T*>(data_);
    } else {
      return static_cast<T*>(data_);
    }
  }
  DType dtype() const { return dtype_; }
  int rank() const { return static_cast<int>(dims_.size()); }
  int64_t dim(int i) const { return dims_[i]; }
  int64_t stride(int i) const { return strides_[i]; }
  const Dims& dims() const { return dims_; }
  const Dims& strides() const { return strides_; }
  // Product of dims (dims were validated when the view was made).
  int64_t num_elements() const;
  bool IsContiguous() const;
  // Element offset of a multi-index (no bounds checks).
  int64_t Offset(absl::Span<const int64_t> index) const;
  // Sub-range [start, start + length) of one axis; no bounds checks beyond
  // a debug assert: callers validate first.
  BasicTensorView Slice(int axis, int64_t start, int64_t length) const;
  // Element read as float (f32 or bf16), at a multi-index.
  float GetFloat(absl::Span<const int64_t> index) const;

 private:
  VoidT* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Dims dims_;
  Dims strides_;
};

// An owning, dense, row-major, 64-byte aligned tensor. Move-only.
class Tensor {
 public:
  Tensor() = default;
  // InvalidArgument for negative dims or an overflowing size;
  // ResourceExhausted if the allocation fails. Memory is zero-filled.
  static absl::StatusOr<Tensor> Create(DType dtype, absl::Span<const int64_t> dims);
  // Deep copy of any view into a dense tensor of the same dtype.
  static absl::StatusOr<Tensor> CopyOf(const ConstTensorView& view);

  Tensor(Tensor&&) = default;
  Tensor& operator=(Tensor&&) = default;

  DType dtype() const { return dtype_; }
  const Dims& dims() const { return dims_; }
  int rank() const { return static_cast<int>(dims_.size()); }
  int64_t dim(int i) const { return dims_[i]; }
  int64_t num_elements() const { return num_elements_; }
  size_t byte_size() const { return num_elements_ * DTypeSize(dtype_); }
  template <typename T>
  T* data() {
    return reinterpret_cast<T*>(buffer_.get());
  }
  template <typename T>
  const T* data() const {
    return reinterpret_cast<const T*>(buffer_.get());
  }
  TensorView view();
  ConstTensorView view() const;
  ConstTensorView cview() const { return view(); }

 private:
  struct FreeDeleter {
    void operator()(void* p) const;
  };
  DType dtype_ = DType::kF32;
  Dims dims_;
  int64_t num_elements_ = 0;
  std::unique_ptr<void, FreeDeleter> buffer_;
};

// A dense copy of `view` in `dtype` (f32 <-> bf16 rounds to nearest even;
// the same dtype is a plain copy).
absl::StatusOr<Tensor> CastTensor(const ConstTensorView& view, DType dtype);

// Copies a [batch, seq, heads, dim] view into another of the same dims
// (both with packed innermost axes, any batch and seq strides), converting
// f32 <-> bf16 (round to nearest even). InvalidArgument if the dims differ
// or a view is not rank 4 with packed [heads, dim].
absl::Status CopyRows(const ConstTensorView& src, const TensorView& dst);

// Dense row-major strides for dims (saturating at int64 max: only an empty
// tensor can get there, and its strides are never used).
Dims RowMajorStrides(absl::Span<const int64_t> dims);

// --- Validation helpers: each returns InvalidArgument naming `name`. ---

// The view is present and has the given rank.
absl::Status CheckRank(const ConstTensorView& t, int rank, absl::string_view name);
// Present, rank 4, innermost two axes packed (see the layout note above).
absl::Status CheckBSHD(const ConstTensorView& t, absl::string_view name);
// Every element is finite; otherwise InvalidArgument such as
// "q[0, 3, 1, 17] is NaN: inputs must be finite". `why` replaces "inputs
// must be finite" for a tensor the call computed (a rotation, a product):
// its finite inputs overflowed, and the message says so.
absl::Status CheckFinite(const ConstTensorView& t, absl::string_view name,
                         absl::string_view why = "inputs must be finite");
// InvalidArgument naming `name` and the first element of an f32 tensor that
// rounds to Inf in bf16 (|x| at or past 0x1.fffp+127 rounded to nearest
// even); OK for bf16 tensors. Allocates nothing.
absl::Status CheckFitsBF16(const ConstTensorView& t, absl::string_view name);

}  // namespace ropeattn

#endif  // ROPEATTN_CORE_TENSOR_H_
