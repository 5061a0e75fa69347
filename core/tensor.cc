#include "core/tensor.h"

#include <sys/mman.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/limits.h"

namespace ropeattn {

size_t DTypeSize(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

const char* DTypeName(DType dtype) { return dtype == DType::kF32 ? "f32" : "bf16"; }

absl::StatusOr<int64_t> NumElements(absl::Span<const int64_t> dims) {
  // Keep byte counts of f32 tensors representable: at most 2^60 elements.
  constexpr int64_t kMax = int64_t{1} << 60;
  int64_t n = 1;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] < 0) {
      return absl::InvalidArgumentError(absl::StrFormat("dimension %d of shape %s is negative (%d)",
                                                        i, DimsToString(dims), dims[i]));
    }
    if (dims[i] != 0 && n > kMax / dims[i]) {
      // An overflow only matters if no later dim is zero.
      bool has_zero = false;
      for (int64_t d : dims) has_zero |= (d == 0);
      if (has_zero) return 0;
      return absl::InvalidArgumentError(
          absl::StrFormat("shape %s has more than 2^60 elements", DimsToString(dims)));
    }
    n *= dims[i];
  }
  return n;
}

std::string DimsToString(absl::Span<const int64_t> dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

Dims RowMajorStrides(absl::Span<const int64_t> dims) {
  Dims strides(dims.size());
  int64_t s = 1;
  for (int i = static_cast<int>(dims.size()) - 1; i >= 0; --i) {
    strides[i] = s;
    // Saturating: past a zero dim the other dims are not bounded by any byte
    // count ([0, 2^62, 128] holds no element), and no stride of an empty
    // tensor is ever used.
    s = SatMul(s, dims[i]);
  }
  return strides;
}

template <typename VoidT>
BasicTensorView<VoidT>::BasicTensorView(VoidT* data, DType dtype, Dims dims)
    : data_(data), dtype_(dtype), dims_(std::move(dims)) {
  strides_ = RowMajorStrides(dims_);
}

template <typename VoidT>
int64_t BasicTensorView<VoidT>::num_elements() const {
  // A zero dim first: [2^33, 2^31 + 1, 0, 8] has no elements, and the
  // product of its leading dims would overflow on the way (UBSan).
  for (int64_t d : dims_) {
    if (d == 0) return 0;
  }
  int64_t n = 1;
  for (int64_t d : dims_) n = SatMul(n, d);
  return n;
}

template <typename VoidT>
bool BasicTensorView<VoidT>::IsContiguous() const {
  int64_t s = 1;
  for (int i = rank() - 1; i >= 0; --i) {
    if (dims_[i] != 1 && strides_[i] != s) return false;
    s *= dims_[i];
  }
  return true;
}

template <typename VoidT>
int64_t BasicTensorView<VoidT>::Offset(absl::Span<const int64_t> index) const {
  int64_t off = 0;
  for (size_t i = 0; i < index.size(); ++i) off += index[i] * strides_[i];
  return off;
}

template <typename VoidT>
BasicTensorView<VoidT> BasicTensorView<VoidT>::Slice(int axis, int64_t start,
                                                     int64_t length) const {
  BasicTensorView out = *this;
  out.dims_[axis] = length;
  using BytePtr = std::conditional_t<std::is_const_v<VoidT>, const char*, char*>;
  out.data_ = static_cast<BytePtr>(data_) +
              start * strides_[axis] * static_cast<int64_t>(DTypeSize(dtype_));
  return out;
}

template <typename VoidT>
float BasicTensorView<VoidT>::GetFloat(absl::Span<const int64_t> index) const {
  const int64_t off = Offset(index);
  if (dtype_ == DType::kF32) return static_cast<const float*>(data_)[off];
  return BF16ToFloat(static_cast<const uint16_t*>(data_)[off]);
}

template class BasicTensorView<void>;
template class BasicTensorView<const void>;

void Tensor::FreeDeleter::operator()(void* p) const { std::free(p); }

absl::StatusOr<Tensor> Tensor::Create(DType dtype, absl::Span<const int64_t> dims) {
  absl::StatusOr<int64_t> n = NumElements(dims);
  if (!n.ok()) return n.status();
  Tensor t;
  t.dtype_ = dtype;
  t.dims_.assign(dims.begin(), dims.end());
  t.num_elements_ = *n;
  size_t bytes = static_cast<size_t>(*n) * DTypeSize(dtype);
  // Large tensors (KV caches, activations) are streamed: back them with
  // transparent huge pages where the kernel offers them, so a pass over them
  // does not take a TLB miss every 4 KiB.
  constexpr size_t kHugePage = size_t{2} << 20;
  const size_t align = bytes >= kHugePage ? kHugePage : 64;
  bytes = (bytes + align - 1) / align * align;
  if (bytes == 0) bytes = 64;
  void* p = std::aligned_alloc(align, bytes);
  if (p != nullptr && align == kHugePage) madvise(p, bytes, MADV_HUGEPAGE);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("cannot allocate %d bytes for a %s tensor of shape %s", bytes,
                        DTypeName(dtype), DimsToString(dims)));
  }
  std::memset(p, 0, bytes);
  t.buffer_.reset(p);
  return t;
}

absl::StatusOr<Tensor> Tensor::CopyOf(const ConstTensorView& view) {
  absl::StatusOr<Tensor> t = Create(view.dtype(), view.dims());
  if (!t.ok()) return t.status();
  const int64_t n = view.num_elements();
  if (n == 0) return t;
  const size_t es = DTypeSize(view.dtype());
  if (view.IsContiguous()) {
    std::memcpy(t->buffer_.get(), view.raw(), n * es);
    return t;
  }
  Dims index(view.rank(), 0);
  char* dst = static_cast<char*>(t->buffer_.get());
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(dst + i * es, static_cast<const char*>(view.raw()) + view.Offset(index) * es, es);
    for (int a = view.rank() - 1; a >= 0; --a) {
      if (++index[a] < view.dim(a)) break;
      index[a] = 0;
    }
  }
  return t;
}

absl::StatusOr<Tensor> CastTensor(const ConstTensorView& view, DType dtype) {
  if (view.dtype() == dtype) return Tensor::CopyOf(view);
  absl::StatusOr<Tensor> dense = Tensor::CopyOf(view);
  if (!dense.ok()) return dense.status();
  absl::StatusOr<Tensor> out = Tensor::Create(dtype, view.dims());
  if (!out.ok()) return out.status();
  const int64_t n = dense->num_elements();
  if (dtype == DType::kBF16) {
    const float* src = dense->data<float>();
    uint16_t* dst = out->data<uint16_t>();
    for (int64_t i = 0; i < n; ++i) dst[i] = FloatToBF16(src[i]);
  } else {
    const uint16_t* src = dense->data<uint16_t>();
    float* dst = out->data<float>();
    for (int64_t i = 0; i < n; ++i) dst[i] = BF16ToFloat(src[i]);
  }
  return out;
}

absl::Status CopyRows(const ConstTensorView& src, const TensorView& dst) {
  if (absl::Status s = CheckBSHD(src, "source"); !s.ok()) return s;
  if (absl::Status s = CheckBSHD(dst, "destination"); !s.ok()) return s;
  if (src.dims() != dst.dims()) {
    return absl::InvalidArgumentError(absl::StrFormat("cannot copy %s rows into %s",
                                                      DimsToString(src.dims()),
                                                      DimsToString(dst.dims())));
  }
  const int64_t row = src.dim(2) * src.dim(3);
  for (int64_t b = 0; b < src.dim(0); ++b) {
    for (int64_t t = 0; t < src.dim(1); ++t) {
      const int64_t so = b * src.stride(0) + t * src.stride(1);
      const int64_t d_o = b * dst.stride(0) + t * dst.stride(1);
      if (src.dtype() == dst.dtype()) {
        const size_t es = DTypeSize(src.dtype());
        std::memcpy(static_cast<char*>(dst.raw()) + d_o * es,
                    static_cast<const char*>(src.raw()) + so * es, row * es);
      } else if (dst.dtype() == DType::kBF16) {
        const float* s = src.data<float>() + so;
        uint16_t* d = dst.data<uint16_t>() + d_o;
        for (int64_t i = 0; i < row; ++i) d[i] = FloatToBF16(s[i]);
      } else {
        const uint16_t* s = src.data<uint16_t>() + so;
        float* d = dst.data<float>() + d_o;
        for (int64_t i = 0; i < row; ++i) d[i] = BF16ToFloat(s[i]);
      }
    }
  }
  return absl::OkStatus();
}

TensorView Tensor::view() { return TensorView(buffer_.get(), dtype_, dims_); }
ConstTensorView Tensor::view() const { return ConstTensorView(buffer_.get(), dtype_, dims_); }

absl::Status CheckRank(const ConstTensorView& t, int rank, absl::string_view name) {
  if (t.raw() == nullptr && t.num_elements() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is missing"));
  }
  if (t.rank() != rank) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s must have rank %d, got shape %s", name, rank, DimsToString(t.dims())));
  }
  for (int i = 0; i < t.rank(); ++i) {
    if (t.dim(i) < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s has a negative dimension: shape %s", name, DimsToString(t.dims())));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckBSHD(const ConstTensorView& t, absl::string_view name) {
  absl::Status s = CheckRank(t, 4, name);
  if (!s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(s.message(), " (layout is [batch, seq, heads, head_dim])"));
  }
  if (t.num_elements() == 0) return absl::OkStatus();
  if (t.stride(3) != 1 || (t.dim(2) > 1 && t.stride(2) != t.dim(3))) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s must have packed [heads, head_dim] axes (strides %s)", name,
                        DimsToString(t.strides())));
  }
  return absl::OkStatus();
}

namespace {

// True if any element of the run is NaN or infinite: all exponent bits set.
// Branch-free over the run so it vectorizes; the caller locates the culprit.
bool AnyNonFinite(const void* data, DType dtype, int64_t n) {
  uint32_t bad = 0;
  if (dtype == DType::kF32) {
    const uint32_t* u = static_cast<const uint32_t*>(data);
#pragma omp simd reduction(| : bad)
    for (int64_t i = 0; i < n; ++i) bad |= ((u[i] & 0x7f800000u) == 0x7f800000u);
  } else {
    const uint16_t* u = static_cast<const uint16_t*>(data);
#pragma omp simd reduction(| : bad)
    for (int64_t i = 0; i < n; ++i) bad |= ((u[i] & 0x7f80u) == 0x7f80u);
  }
  return bad != 0;
}

}  // namespace

absl::Status CheckFinite(const ConstTensorView& t, absl::string_view name,
                         absl::string_view why) {
  const int64_t n = t.num_elements();
  if (n == 0) return absl::OkStatus();
  const int rank = t.rank();
  // The longest suffix of axes that is one contiguous run.
  int64_t run = 1;
  int split = rank;
  while (split > 0 && (t.dim(split - 1) == 1 || t.stride(split - 1) == run)) {
    run *= t.dim(split - 1);
    --split;
  }
  const size_t es = DTypeSize(t.dtype());
  Dims index(rank, 0);
  for (int64_t start = 0; start < n; start += run) {
    const char* p = static_cast<const char*>(t.raw()) + t.Offset(index) * es;
    if (AnyNonFinite(p, t.dtype(), run)) {
      for (int64_t i = 0; i < run; ++i) {
        float v = t.dtype() == DType::kF32 ? reinterpret_cast<const float*>(p)[i]
                                           : BF16ToFloat(reinterpret_cast<const uint16_t*>(p)[i]);
        if (std::isfinite(v)) continue;
        Dims idx = index;
        int64_t rem = i;
        for (int a = rank - 1; a >= split; --a) {
          idx[a] = rem % t.dim(a);
          rem /= t.dim(a);
        }
        const char* what = std::isnan(v) ? "NaN" : (v > 0 ? "+inf" : "-inf");
        return absl::InvalidArgumentError(
            absl::StrFormat("%s%s is %s: %s", name, DimsToString(idx), what, why));
      }
    }
    for (int a = split - 1; a >= 0; --a) {
      if (++index[a] < t.dim(a)) break;
      index[a] = 0;
    }
  }
  return absl::OkStatus();
}

absl::Status CheckFitsBF16(const ConstTensorView& t, absl::string_view name) {
  if (t.dtype() != DType::kF32) return absl::OkStatus();
  const int64_t n = t.num_elements();
  const int rank = t.rank();
  Dims index(rank, 0);
  for (int64_t i = 0; i < n; ++i) {
    const float x = reinterpret_cast<const float*>(t.raw())[t.Offset(index)];
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    // Finite values from 0x7f7f8000 up round (to nearest even) to Inf.
    if ((bits & 0x7fffffffu) >= 0x7f7f8000u && std::isfinite(x)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s%s is %g, beyond bf16's range: stored as bf16 it would be Inf", name,
          DimsToString(index), x));
    }
    for (int a = rank - 1; a >= 0; --a) {
      if (++index[a] < t.dim(a)) break;
      index[a] = 0;
    }
  }
  return absl::OkStatus();
}

}  // namespace ropeattn
