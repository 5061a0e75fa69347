// Wire tensor helpers: build and read v1::Tensor without the core library.
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "client/client.h"

// The wire format is little-endian and these helpers memcpy host floats into
// it, so a big-endian host would silently produce wrong bytes.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the ropeattn client assumes a little-endian host");

namespace ropeattn::client {
namespace {

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Product of `shape`, or -1 for a negative dimension or an int64 overflow.
int64_t SafeProduct(absl::Span<const int64_t> shape) {
  for (int64_t d : shape) {
    if (d < 0) return -1;
  }
  // Any zero makes the product 0, even if the dimensions before it overflow.
  for (int64_t d : shape) {
    if (d == 0) return 0;
  }
  int64_t n = 1;
  for (int64_t d : shape) {
    if (n > std::numeric_limits<int64_t>::max() / d) return -1;
    n *= d;
  }
  return n;
}

// Elements of a tensor whose bytes must fit in memory: the byte count (up to
// 4 per element) must not overflow either.
absl::StatusOr<int64_t> CheckedElements(absl::Span<const int64_t> shape) {
  const int64_t n = SafeProduct(shape);
  if (n < 0 || n > std::numeric_limits<int64_t>::max() / 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shape ", ShapeString(shape), " has a negative dimension or too many elements"));
  }
  return n;
}

uint16_t FloatToBF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  // Rounding would carry a NaN's payload into the exponent and could turn it
  // into infinity; keep it a (quiet) NaN instead.
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  // Round to nearest, ties to even: add 0x7fff plus the lowest kept bit.
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float BF16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// splitmix64 (Steele, Lea, Flood 2014): one add and a few multiplies, the
// same sequence on every platform and compiler, unlike std:: distributions.
uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

absl::Status CheckCount(absl::Span<const int64_t> shape, int64_t n, size_t values) {
  if (static_cast<uint64_t>(n) != values) {
    return absl::InvalidArgumentError(absl::StrCat("shape ", ShapeString(shape), " holds ", n,
                                                   " elements, got ", values, " values"));
  }
  return absl::OkStatus();
}

void SetShape(absl::Span<const int64_t> shape, v1::Tensor& t) {
  for (int64_t d : shape) t.add_shape(d);
}

}  // namespace

const char* WireDTypeName(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32:
      return "f32";
    case v1::DTYPE_BF16:
      return "bf16";
    case v1::DTYPE_INT8:
      return "int8";
    default:
      return "unspecified";
  }
}

absl::StatusOr<v1::Tensor> MakeF32(absl::Span<const int64_t> shape,
                                   absl::Span<const float> values) {
  absl::StatusOr<int64_t> n = CheckedElements(shape);
  if (!n.ok()) return n.status();
  if (absl::Status s = CheckCount(shape, *n, values.size()); !s.ok()) return s;
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_F32);
  SetShape(shape, t);
  t.set_data(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  return t;
}

absl::StatusOr<v1::Tensor> MakeBF16(absl::Span<const int64_t> shape,
                                    absl::Span<const float> values) {
  absl::StatusOr<int64_t> n = CheckedElements(shape);
  if (!n.ok()) return n.status();
  if (absl::Status s = CheckCount(shape, *n, values.size()); !s.ok()) return s;
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_BF16);
  SetShape(shape, t);
  std::string* data = t.mutable_data();
  data->resize(values.size() * 2);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t b = FloatToBF16(values[i]);
    std::memcpy(data->data() + 2 * i, &b, 2);
  }
  return t;
}

absl::StatusOr<v1::Tensor> RandomTensor(v1::DType dtype, absl::Span<const int64_t> shape,
                                        uint64_t seed) {
  if (dtype != v1::DTYPE_F32 && dtype != v1::DTYPE_BF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("RandomTensor needs dtype f32 or bf16, got ", v1::DType_Name(dtype)));
  }
  absl::StatusOr<int64_t> n = CheckedElements(shape);
  if (!n.ok()) return n.status();
  std::vector<float> values(static_cast<size_t>(*n));
  uint64_t state = seed;
  for (float& v : values) {
    // The top 24 bits give a float in [0, 1) exactly (24-bit significand).
    const float u = static_cast<float>(SplitMix64(state) >> 40) * 0x1.0p-24f;
    v = 2.0f * u - 1.0f;
  }
  if (dtype == v1::DTYPE_F32) return MakeF32(shape, values);
  // Rounding to bf16 can reach 1.0; clamp to the largest bf16 below 1 so the
  // documented half-open range [-1, 1) holds for both dtypes.
  constexpr float kBelowOne = 0x1.fep-1f;  // bf16 0x3f7f
  for (float& v : values) {
    if (FloatToBF16(v) == 0x3f80) v = kBelowOne;
  }
  return MakeBF16(shape, values);
}

absl::StatusOr<std::vector<float>> ToFloats(const v1::Tensor& tensor) {
  int64_t size;
  switch (tensor.dtype()) {
    case v1::DTYPE_F32:
      size = 4;
      break;
    case v1::DTYPE_BF16:
      size = 2;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("tensor dtype must be f32 or bf16, got ",
                                                     v1::DType_IsValid(tensor.dtype())
                                                         ? v1::DType_Name(tensor.dtype())
                                                         : absl::StrCat(tensor.dtype())));
  }
  absl::StatusOr<int64_t> n = CheckedElements(tensor.shape());
  if (!n.ok()) return n.status();
  const std::string& data = tensor.data();
  if (static_cast<uint64_t>(data.size()) != static_cast<uint64_t>(*n * size)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor data is ", data.size(), " bytes, but shape ", ShapeString(tensor.shape()), " of ",
        v1::DType_Name(tensor.dtype()), " needs ", *n * size));
  }
  std::vector<float> out(static_cast<size_t>(*n));
  if (size == 4) {
    std::memcpy(out.data(), data.data(), data.size());
  } else {
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t b;
      std::memcpy(&b, data.data() + 2 * i, 2);
      out[i] = BF16ToFloat(b);
    }
  }
  return out;
}

int64_t NumElements(const v1::Tensor& tensor) { return SafeProduct(tensor.shape()); }

}  // namespace ropeattn::client
