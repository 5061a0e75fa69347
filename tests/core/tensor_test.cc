// Tensor, views, validation helpers and bf16 rounding (core/tensor.h).
#include "core/tensor.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace ropeattn {
namespace {

using ::ropeattn::testing::RandomTensor;
using ::ropeattn::testing::ToDoubles;
using ::testing::HasSubstr;

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_STREQ(DTypeName(DType::kF32), "f32");
  EXPECT_STREQ(DTypeName(DType::kBF16), "bf16");
}

TEST(NumElementsTest, ProductOfDims) {
  EXPECT_EQ(NumElements({2, 3, 4}).value(), 24);
  EXPECT_EQ(NumElements({}).value(), 1);  // a scalar
  EXPECT_EQ(NumElements({5, 0, 7}).value(), 0);
}

TEST(NumElementsTest, NegativeDimIsInvalidArgument) {
  const absl::StatusOr<int64_t> n = NumElements({2, -3, 4});
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(n.status().message()), HasSubstr("-3"));
}

TEST(NumElementsTest, OverflowIsInvalidArgumentNotWrapped) {
  const int64_t big = int64_t{1} << 32;
  // 2^96 elements would wrap to 0 in int64 arithmetic.
  const absl::StatusOr<int64_t> n = NumElements({big, big, big});
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
  // Fits in int64 as a count, but not as f32 bytes.
  const absl::StatusOr<int64_t> m = NumElements({std::numeric_limits<int64_t>::max() / 4 + 1});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  const absl::StatusOr<int64_t> k = NumElements({int64_t{1} << 31, int64_t{1} << 31});
  ASSERT_FALSE(k.ok());
  EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(NumElementsTest, HugeDimsWithAZeroAreEmpty) {
  const int64_t big = int64_t{1} << 40;
  EXPECT_EQ(NumElements({big, big, 0}).value(), 0);
  EXPECT_EQ(NumElements({0, big, big}).value(), 0);
}

TEST(DimsToStringTest, Format) {
  EXPECT_EQ(DimsToString({2, 7, 8, 64}), "[2, 7, 8, 64]");
  EXPECT_EQ(DimsToString({}), "[]");
}

TEST(TensorTest, CreateIsZeroFilledAlignedAndSized) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    Tensor t = Tensor::Create(dtype, {3, 5, 7}).value();
    EXPECT_EQ(t.dtype(), dtype);
    EXPECT_EQ(t.rank(), 3);
    EXPECT_EQ(t.dim(1), 5);
    EXPECT_EQ(t.num_elements(), 105);
    EXPECT_EQ(t.byte_size(), 105 * DTypeSize(dtype));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data<char>()) % 64, 0u);
    for (size_t i = 0; i < t.byte_size(); ++i) ASSERT_EQ(t.data<char>()[i], 0);
  }
}

TEST(TensorTest, CreateRejectsBadDims) {
  EXPECT_EQ(Tensor::Create(DType::kF32, {2, -1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  const int64_t big = int64_t{1} << 32;
  EXPECT_EQ(Tensor::Create(DType::kF32, {big, big, big}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TensorTest, ZeroSizedTensorIsValid) {
  Tensor t = Tensor::Create(DType::kF32, {0, 4}).value();
  EXPECT_EQ(t.num_elements(), 0);
  EXPECT_EQ(t.byte_size(), 0u);
}

TEST(TensorTest, MoveTransfersTheBuffer) {
  Tensor a = Tensor::Create(DType::kF32, {4}).value();
  a.data<float>()[2] = 5.0f;
  const float* p = a.data<float>();
  Tensor b = std::move(a);
  EXPECT_EQ(b.data<float>(), p);
  EXPECT_EQ(b.data<float>()[2], 5.0f);
}

TEST(TensorViewTest, RowMajorStridesAndOffsets) {
  EXPECT_EQ(RowMajorStrides({2, 3, 4}), (Dims{12, 4, 1}));
  Tensor t = Tensor::Create(DType::kF32, {2, 3, 4}).value();
  const ConstTensorView v = t.cview();
  EXPECT_EQ(v.strides(), (Dims{12, 4, 1}));
  EXPECT_EQ(v.Offset({1, 2, 3}), 23);
  EXPECT_EQ(v.num_elements(), 24);
  EXPECT_TRUE(v.IsContiguous());
}

TEST(TensorViewTest, DefaultViewIsAbsent) {
  const ConstTensorView v;
  EXPECT_TRUE(v.empty_view());
  EXPECT_EQ(v.raw(), nullptr);
  EXPECT_EQ(v.rank(), 0);
}

TEST(TensorViewTest, MutableViewConvertsToConst) {
  Tensor t = RandomTensor(DType::kF32, {2, 3}, 1);
  const TensorView m = t.view();
  const ConstTensorView c = m;
  EXPECT_EQ(c.raw(), m.raw());
  EXPECT_EQ(c.dims(), m.dims());
  EXPECT_EQ(c.strides(), m.strides());
}

TEST(TensorViewTest, SliceSharesMemoryAndKeepsStrides) {
  Tensor t = RandomTensor(DType::kF32, {2, 10, 3, 4}, 7);
  const ConstTensorView s = t.cview().Slice(1, 2, 5);
  EXPECT_EQ(s.dims(), (Dims{2, 5, 3, 4}));
  EXPECT_EQ(s.strides(), t.cview().strides());
  EXPECT_FALSE(s.IsContiguous());
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t i = 0; i < 5; ++i) {
      EXPECT_EQ(s.GetFloat({b, i, 1, 3}), t.cview().GetFloat({b, i + 2, 1, 3}));
    }
  }
  // Slicing the outermost axis keeps a dense view.
  EXPECT_TRUE(t.cview().Slice(0, 1, 1).IsContiguous());
}

TEST(TensorViewTest, GetFloatReadsBf16) {
  Tensor t = Tensor::Create(DType::kBF16, {2, 2}).value();
  t.data<uint16_t>()[3] = FloatToBF16(-2.5f);
  EXPECT_EQ(t.cview().GetFloat({1, 1}), -2.5f);
  EXPECT_EQ(t.cview().GetFloat({0, 1}), 0.0f);
}

TEST(TensorTest, CopyOfStridedViewIsDense) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    Tensor t = RandomTensor(dtype, {3, 9, 2, 5}, 11);
    const ConstTensorView s = t.cview().Slice(1, 3, 4);
    Tensor c = Tensor::CopyOf(s).value();
    EXPECT_EQ(c.dims(), s.dims());
    EXPECT_EQ(c.dtype(), dtype);
    EXPECT_TRUE(c.cview().IsContiguous());
    EXPECT_EQ(ToDoubles(c.cview()), ToDoubles(s));
    EXPECT_NE(c.data<char>(), static_cast<const char*>(s.raw()));
  }
}

TEST(CheckTest, CheckRankAndBSHD) {
  Tensor t = Tensor::Create(DType::kF32, {2, 3, 4, 8}).value();
  EXPECT_TRUE(CheckRank(t.cview(), 4, "q").ok());
  EXPECT_TRUE(CheckBSHD(t.cview(), "q").ok());

  const absl::Status rank = CheckRank(t.cview(), 3, "q");
  EXPECT_EQ(rank.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(rank.message()), HasSubstr("q"));
  EXPECT_THAT(std::string(rank.message()), HasSubstr("[2, 3, 4, 8]"));

  const absl::Status absent = CheckBSHD(ConstTensorView(), "k");
  EXPECT_EQ(absent.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(absent.message()), HasSubstr("k"));

  // A slice of the seq axis is a valid BSHD view (free seq stride) ...
  EXPECT_TRUE(CheckBSHD(t.cview().Slice(1, 1, 2), "k").ok());
  // ... a slice of head_dim is not (rows of the [heads, head_dim] block have gaps) ...
  const absl::Status gaps = CheckBSHD(t.cview().Slice(3, 0, 4), "v");
  EXPECT_EQ(gaps.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(gaps.message()), HasSubstr("v"));
  // ... nor is a view with head_dim not innermost.
  const ConstTensorView swapped(t.cview().raw(), DType::kF32, Dims{2, 3, 8, 4}, Dims{96, 32, 1, 8});
  EXPECT_EQ(CheckBSHD(swapped, "v").code(), absl::StatusCode::kInvalidArgument);
}

TEST(CheckTest, CheckFiniteNamesTensorIndexAndKind) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    Tensor t = RandomTensor(dtype, {1, 4, 2, 20}, 3);
    EXPECT_TRUE(CheckFinite(t.cview(), "q").ok());
    const struct {
      float value;
      const char* kind;
    } bad[] = {{std::numeric_limits<float>::quiet_NaN(), "NaN"},
               {std::numeric_limits<float>::infinity(), "+inf"},
               {-std::numeric_limits<float>::infinity(), "-inf"}};
    for (const auto& b : bad) {
      Tensor u = Tensor::CopyOf(t.cview()).value();
      const int64_t off = u.cview().Offset({0, 3, 1, 17});
      if (dtype == DType::kF32) {
        u.data<float>()[off] = b.value;
      } else {
        u.data<uint16_t>()[off] = FloatToBF16(b.value);
      }
      const absl::Status s = CheckFinite(u.cview(), "q");
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(s.message()), HasSubstr(std::string("q[0, 3, 1, 17] is ") + b.kind))
          << s;
    }
  }
}

TEST(CheckTest, CheckFiniteReportsTheFirstBadElementInViewCoordinates) {
  Tensor t = RandomTensor(DType::kF32, {2, 10, 2, 4}, 5);
  t.data<float>()[t.cview().Offset({1, 6, 0, 2})] = std::numeric_limits<float>::infinity();
  t.data<float>()[t.cview().Offset({1, 7, 1, 0})] = std::numeric_limits<float>::quiet_NaN();
  // Outside the slice: must be ignored.
  t.data<float>()[t.cview().Offset({0, 9, 0, 0})] = std::numeric_limits<float>::quiet_NaN();
  const ConstTensorView s = t.cview().Slice(1, 5, 4);  // seq 5..8
  const absl::Status st = CheckFinite(s, "k");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("k[1, 1, 0, 2] is +inf"));
  EXPECT_TRUE(CheckFinite(t.cview().Slice(1, 0, 5).Slice(0, 1, 1), "k").ok());
}

TEST(BF16Test, RoundsToNearestEven) {
  // 1 + 2^-8 is halfway between 1 (even mantissa) and 1 + 2^-7: stays at 1.
  EXPECT_EQ(FloatToBF16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: goes up.
  EXPECT_EQ(FloatToBF16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  // Just above halfway rounds up; just below rounds down.
  EXPECT_EQ(FloatToBF16(BitsToFloat(0x3F808001u)), 0x3F81);
  EXPECT_EQ(FloatToBF16(BitsToFloat(0x3F807FFFu)), 0x3F80);
  // Sign is symmetric.
  EXPECT_EQ(FloatToBF16(-(1.0f + 3 * std::ldexp(1.0f, -8))), 0xBF82);
  EXPECT_EQ(FloatToBF16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBF16(-0.0f), 0x8000);
}

TEST(BF16Test, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToBF16(inf), 0x7F80);
  EXPECT_EQ(FloatToBF16(-inf), 0xFF80);
  // The largest float rounds up to infinity, as IEEE round-to-nearest does.
  EXPECT_EQ(FloatToBF16(std::numeric_limits<float>::max()), 0x7F80);
  // A NaN whose payload sits in the low bits must stay NaN, not become inf.
  for (uint32_t bits : {0x7F800001u, 0x7FC00000u, 0xFF800001u, 0x7FFFFFFFu}) {
    const float back = BF16ToFloat(FloatToBF16(BitsToFloat(bits)));
    EXPECT_TRUE(std::isnan(back)) << std::hex << bits;
  }
  // Denormals survive the trip at bf16 precision.
  const float tiny = std::numeric_limits<float>::denorm_min() * (1 << 20);
  EXPECT_EQ(BF16ToFloat(FloatToBF16(tiny)), tiny);
}

TEST(BF16Test, EveryNonNaNPatternRoundTrips) {
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    const float f = BF16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBF16(f), b) << std::hex << b;
    ASSERT_EQ(FloatBits(f) & 0xFFFFu, 0u);
  }
}

TEST(BF16Test, RoundingErrorIsAtMostHalfAnUlp) {
  Tensor t = RandomTensor(DType::kF32, {4096}, 9, -1000.0f, 1000.0f);
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    const float x = t.data<float>()[i];
    const float r = BF16ToFloat(FloatToBF16(x));
    // bf16 keeps 8 significant bits: the half-ulp is 2^-8 relative (at most).
    ASSERT_LE(std::abs(r - x), std::ldexp(std::abs(x), -8)) << x;
  }
}

}  // namespace
}  // namespace ropeattn

namespace ropeattn {
namespace {

TEST(CastTensorTest, ConvertsEachElementOnceAndCopiesStridedViews) {
  Tensor src = Tensor::Create(DType::kF32, {3, 4}).value();
  for (int i = 0; i < 12; ++i) src.data<float>()[i] = 1.0f + i / 3.0f;  // not bf16-exact
  // A strided view: rows 0 and 2.
  ConstTensorView strided(src.data<float>(), DType::kF32, {2, 4}, {8, 1});
  Tensor bf = CastTensor(strided, DType::kBF16).value();
  ASSERT_EQ(bf.dtype(), DType::kBF16);
  ASSERT_EQ(bf.dims(), (Dims{2, 4}));
  for (int r = 0; r < 2; ++r) {
    for (int c = 0; c < 4; ++c) {
      EXPECT_EQ(bf.data<uint16_t>()[r * 4 + c], FloatToBF16(src.data<float>()[2 * r * 4 + c]));
    }
  }
  Tensor back = CastTensor(bf.view(), DType::kF32).value();
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(back.data<float>()[i], BF16ToFloat(bf.data<uint16_t>()[i]));
  }
  Tensor same = CastTensor(strided, DType::kF32).value();
  EXPECT_EQ(same.data<float>()[4], src.data<float>()[8]);
}

}  // namespace
}  // namespace ropeattn
