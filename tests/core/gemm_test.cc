// MatMul (core/gemm.h) against a plain fp64 matrix product.
// Tolerances: 1e-5 relative norm-wise for f32 inputs, 1e-2 for bf16 inputs
// (the inputs are bf16-exact, so this bounds the accumulation error only).
#include "core/gemm.h"
#include "core/gemm_internal.h"

#include <atomic>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/reference/attention_ref.h"

namespace ropeattn {
namespace {

using ::ropeattn::testing::AllClose;
using ::ropeattn::testing::kBF16Tol;
using ::ropeattn::testing::kF32Tol;
using ::ropeattn::testing::RandomTensor;
using ::ropeattn::testing::ToDoubles;
using ::testing::HasSubstr;

double Tol(DType dtype) { return dtype == DType::kF32 ? kF32Tol : kBF16Tol; }

// A [rows, cols] view of a [cols, rows] dense tensor (its transpose).
ConstTensorView Transposed(const Tensor& t) {
  return ConstTensorView(t.cview().raw(), t.dtype(), Dims{t.dim(1), t.dim(0)}, Dims{1, t.dim(1)});
}

void Fill(Tensor& t, float value) {
  for (int64_t i = 0; i < t.num_elements(); ++i) t.data<float>()[i] = value;
}

struct Shape {
  int64_t m, k, n;
};

constexpr Shape kShapes[] = {{1, 1, 1},      {7, 13, 5},    {1, 128, 300},
                             {129, 80, 300}, {64, 128, 64}, {33, 1, 17}};

TEST(MatMulTest, DenseMatchesReference) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (const Shape& s : kShapes) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " m=", s.m, " k=", s.k, " n=", s.n));
      Tensor a = RandomTensor(dtype, {s.m, s.k}, 1 + s.m);
      Tensor b = RandomTensor(dtype, {s.k, s.n}, 2 + s.n);
      Tensor c = Tensor::Create(DType::kF32, {s.m, s.n}).value();
      Fill(c, 1234.0f);
      ASSERT_TRUE(MatMul(a.cview(), b.cview(), c.view(), 1).ok());
      EXPECT_TRUE(AllClose(ToDoubles(c.cview()),
                           ref::MatMul(ToDoubles(a.cview()), ToDoubles(b.cview()), s.m, s.k, s.n),
                           Tol(dtype)));
    }
  }
}

// b given as the transpose of a dense [n, k] tensor (how attention passes K),
// and a as the transpose of a dense [k, m] tensor.
TEST(MatMulTest, TransposedViewsMatchReference) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (const Shape& s : kShapes) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " m=", s.m, " k=", s.k, " n=", s.n));
      Tensor a = RandomTensor(dtype, {s.m, s.k}, 3 + s.m);
      Tensor bt = RandomTensor(dtype, {s.n, s.k}, 4 + s.n);
      const ConstTensorView b = Transposed(bt);
      const std::vector<double> want =
          ref::MatMul(ToDoubles(a.cview()), ToDoubles(b), s.m, s.k, s.n);
      Tensor c = Tensor::Create(DType::kF32, {s.m, s.n}).value();
      ASSERT_TRUE(MatMul(a.cview(), b, c.view(), 1).ok());
      EXPECT_TRUE(AllClose(ToDoubles(c.cview()), want, Tol(dtype)));

      Tensor at = RandomTensor(dtype, {s.k, s.m}, 5 + s.k);
      const ConstTensorView a2 = Transposed(at);
      Fill(c, 1234.0f);
      ASSERT_TRUE(MatMul(a2, b, c.view(), 1).ok());
      EXPECT_TRUE(AllClose(ToDoubles(c.cview()),
                           ref::MatMul(ToDoubles(a2), ToDoubles(b), s.m, s.k, s.n), Tol(dtype)));
    }
  }
}

// Sub-matrices of larger buffers: a and b with row strides wider than their
// rows, c written into the left part of a wider buffer, the rest untouched.
TEST(MatMulTest, StridedViewsMatchReferenceAndWriteOnlyC) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const int64_t m = 9, k = 70, n = 31;
    Tensor a_big = RandomTensor(dtype, {m, k + 10}, 6);
    Tensor b_big = RandomTensor(dtype, {k + 3, n + 5}, 7);
    const ConstTensorView a = a_big.cview().Slice(1, 4, k);
    const ConstTensorView b = b_big.cview().Slice(0, 2, k).Slice(1, 1, n);
    Tensor c_big = Tensor::Create(DType::kF32, {m, n + 8}).value();
    Fill(c_big, 1234.0f);
    const TensorView c = c_big.view().Slice(1, 0, n);
    ASSERT_TRUE(MatMul(a, b, c, 1).ok());
    EXPECT_TRUE(AllClose(ToDoubles(ConstTensorView(c)),
                         ref::MatMul(ToDoubles(a), ToDoubles(b), m, k, n), Tol(dtype)));
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = n; j < n + 8; ++j) {
        ASSERT_EQ(c_big.data<float>()[i * (n + 8) + j], 1234.0f) << i << ", " << j;
      }
    }
  }
}

TEST(MatMulTest, TwoThreadsMatchReference) {
  Tensor a = RandomTensor(DType::kF32, {200, 96}, 8);
  Tensor b = RandomTensor(DType::kF32, {96, 150}, 9);
  Tensor c = Tensor::Create(DType::kF32, {200, 150}).value();
  ASSERT_TRUE(MatMul(a.cview(), b.cview(), c.view(), 2).ok());
  EXPECT_TRUE(AllClose(ToDoubles(c.cview()),
                       ref::MatMul(ToDoubles(a.cview()), ToDoubles(b.cview()), 200, 96, 150),
                       kF32Tol));
}

// bf16 weights: a bf16 GEMM on AVX512-BF16 flushes subnormal products to
// zero, so hidden states near 1e-36 came out 0. Each output row is checked
// against fp64 relative to its own size (bf16 x bf16 products are exact in
// fp64; the f32 sums round).
TEST(LinearTest, TinyRowsWithBf16WeightsAreNotFlushed) {
  const int64_t in = 64, out = 24;
  const Tensor w = RandomTensor(DType::kBF16, {out, in}, 5, -1.0, 1.0);
  const double magnitudes[] = {1.0, 1e-36, 1e-20, 3e-38};
  const int64_t rows = 4;
  Tensor x = Tensor::Create(DType::kF32, {rows, in}).value();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < in; ++c) {
      x.data<float>()[r * in + c] =
          static_cast<float>(magnitudes[r] * (0.5 + static_cast<double>((r * 13 + c * 7) % 11) / 11.0));
    }
  }
  Tensor y = Tensor::Create(DType::kF32, {rows, out}).value();
  ASSERT_TRUE(Linear(x.cview(), w.cview(), ConstTensorView(), y.view(), 1).ok());
  for (int64_t r = 0; r < rows; ++r) {
    double worst = 0, size = 0;
    std::vector<double> want(out);
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0;
      for (int64_t c = 0; c < in; ++c) {
        const double xv = BF16ToFloat(FloatToBF16(x.data<float>()[r * in + c]));
        acc += xv * static_cast<double>(BF16ToFloat(w.data<uint16_t>()[o * in + c]));
      }
      want[o] = acc;
      size = std::max(size, std::abs(acc));
    }
    for (int64_t o = 0; o < out; ++o) {
      worst = std::max(worst, std::abs(y.data<float>()[r * out + o] - want[o]) / size);
    }
    EXPECT_LE(worst, 1e-5) << "row of magnitude " << magnitudes[r];
  }
}

// What row scaling cannot reach: products of tiny weights (1e-35 * 1e-3),
// rows mixing a 1.0 (whose weight column is 0) with values near 1e-37 and
// subnormal ones, and a weight row of zeros (an output that is exactly 0).
// Every output is checked against fp64 on the same bf16 values, relative to
// its row's largest output.
TEST(LinearTest, TinyProductsAndMixedRowsWithBf16WeightsAreExact) {
  const int64_t in = 64, out = 40, rows = 4;
  Tensor tiny_w = RandomTensor(DType::kBF16, {out, in}, 6, -1e-35f, 1e-35f);
  Tensor w = RandomTensor(DType::kBF16, {out, in}, 7, -1.0f, 1.0f);
  for (int64_t o = 0; o < out; ++o) w.data<uint16_t>()[o * in] = 0;         // column 0
  for (int64_t c = 0; c < in; ++c) w.data<uint16_t>()[3 * in + c] = 0;      // row 3
  Tensor x = Tensor::Create(DType::kF32, {rows, in}).value();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < in; ++c) {
      const double u = 0.5 + static_cast<double>((r * 13 + c * 7) % 11) / 11.0;
      // rows: 1e-3 (for the tiny weights); 1.0 then 1e-37; 1.0 then
      // subnormals; 1e-37 throughout.
      const double m = r == 0 ? 1e-3 : r == 1 ? 1e-37 : r == 2 ? 3e-40 : 1e-37;
      x.data<float>()[r * in + c] = static_cast<float>((c % 3 == 0 ? -u : u) * m);
    }
    if (r == 1 || r == 2) x.data<float>()[r * in] = 1.0f;
  }
  for (const Tensor* wt : {&tiny_w, &w}) {
    Tensor y = Tensor::Create(DType::kF32, {rows, out}).value();
    ASSERT_TRUE(Linear(x.cview(), wt->cview(), ConstTensorView(), y.view(), 2).ok());
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<double> want(out);
      double size = 0;
      for (int64_t o = 0; o < out; ++o) {
        double acc = 0;
        for (int64_t c = 0; c < in; ++c) {
          const double xv = BF16ToFloat(FloatToBF16(x.data<float>()[r * in + c]));
          acc += xv * static_cast<double>(BF16ToFloat(wt->data<uint16_t>()[o * in + c]));
        }
        want[o] = acc;
        size = std::max(size, std::abs(acc));
      }
      for (int64_t o = 0; o < out; ++o) {
        // Plus half the smallest subnormal: tiny weights times 1e-37 are
        // near 1e-72, whose float is 0.
        EXPECT_LE(std::abs(y.data<float>()[r * out + o] - want[o]), 1e-5 * size + 0x1p-150)
            << (wt == &tiny_w ? "tiny weights" : "normal weights") << ", row " << r << ", output "
            << o << ": got " << y.data<float>()[r * out + o] << ", want " << want[o];
      }
    }
  }
}

// fp64 products of Linear's bf16-rounded x and bf16 w (exact in fp64): the
// wanted [rows, out] outputs, and each one's sum of |products|, which bounds
// what f32 accumulation may lose.
void LinearReference(const Tensor& x, const Tensor& w, std::vector<double>* want,
                     std::vector<double>* magnitude) {
  const int64_t rows = x.dim(0), in = x.dim(1), out = w.dim(0);
  want->assign(rows * out, 0.0);
  magnitude->assign(rows * out, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0, abs = 0;
      for (int64_t c = 0; c < in; ++c) {
        const double p = static_cast<double>(BF16ToFloat(FloatToBF16(x.data<float>()[r * in + c]))) *
                         static_cast<double>(BF16ToFloat(w.data<uint16_t>()[o * in + c]));
        acc += p;
        abs += std::abs(p);
      }
      (*want)[r * out + o] = acc;
      (*magnitude)[r * out + o] = abs;
    }
  }
}

// Normal inputs whose products are subnormal in only a few output columns:
// weight row 5 holds values near 3e-38 (normal in bf16) and row 17 values
// near 1e-30, against x in [-1, 1]. The bf16 GEMM on AVX512-BF16 flushes
// column 5's products (its outputs, near 1e-37, came back 0); column 17's
// outputs are normal but within the flush bound. Neither is numerous enough
// to redo whole rows: this exercises the column repair. Each output is
// checked against fp64 relative to its own sum of |products|.
TEST(LinearTest, FewTinyOutputColumnsWithBf16WeightsAreExact) {
  const int64_t rows = 48, in = 96, out = 80;
  const Tensor x = RandomTensor(DType::kF32, {rows, in}, 11, -1.0f, 1.0f);
  Tensor w = RandomTensor(DType::kBF16, {out, in}, 12, -1.0f, 1.0f);
  for (int64_t c = 0; c < in; ++c) {
    const double u = 1.0 + static_cast<double>((c * 7) % 13) / 13.0;
    w.data<uint16_t>()[5 * in + c] = FloatToBF16(static_cast<float>((c % 2 ? -2e-38 : 3e-38) * u));
    w.data<uint16_t>()[17 * in + c] = FloatToBF16(static_cast<float>((c % 3 ? -1e-30 : 1e-30) * u));
  }
  for (const int threads : {1, 2}) {
    Tensor y = Tensor::Create(DType::kF32, {rows, out}).value();
    ASSERT_TRUE(Linear(x.cview(), w.cview(), ConstTensorView(), y.view(), threads).ok());
    std::vector<double> want, magnitude;
    LinearReference(x, w, &want, &magnitude);
    int64_t bad = 0;
    for (int64_t e = 0; e < rows * out; ++e) {
      const double got = y.data<float>()[e];
      if (std::abs(got - want[e]) <= 1e-5 * magnitude[e] + 0x1p-149) continue;
      if (++bad <= 4) {
        ADD_FAILURE() << "threads " << threads << ", row " << e / out << ", output " << e % out
                      << ": got " << got << ", want " << want[e];
      }
    }
    EXPECT_EQ(bad, 0) << "threads " << threads;
  }
}

// Zero weight rows (pruned or padded outputs) give outputs that are exactly
// 0, and the other outputs are unaffected.
TEST(LinearTest, ZeroWeightRowsGiveExactZeros) {
  const int64_t rows = 64, in = 128, out = 96;
  const Tensor x = RandomTensor(DType::kF32, {rows, in}, 13, -1.0f, 1.0f);
  Tensor w = RandomTensor(DType::kBF16, {out, in}, 14, -1.0f, 1.0f);
  for (int64_t o = 0; o < out; o += 16) {
    for (int64_t c = 0; c < in; ++c) w.data<uint16_t>()[o * in + c] = 0;
  }
  for (int64_t c = 0; c < in; ++c) w.data<uint16_t>()[(out - 1) * in + c] = 0x8000;  // -0
  Tensor y = Tensor::Create(DType::kF32, {rows, out}).value();
  ASSERT_TRUE(Linear(x.cview(), w.cview(), ConstTensorView(), y.view(), 2).ok());
  std::vector<double> want, magnitude;
  LinearReference(x, w, &want, &magnitude);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      const double got = y.data<float>()[r * out + o];
      if (o % 16 == 0 || o == out - 1) {
        EXPECT_EQ(got, 0.0) << "row " << r << ", output " << o;
      } else {
        EXPECT_LE(std::abs(got - want[r * out + o]), 1e-5 * magnitude[r * out + o])
            << "row " << r << ", output " << o;
      }
    }
  }
}

TEST(MatMulTest, ZeroSizes) {
  Tensor a = Tensor::Create(DType::kF32, {0, 5}).value();
  Tensor b = RandomTensor(DType::kF32, {5, 3}, 10);
  Tensor c = Tensor::Create(DType::kF32, {0, 3}).value();
  EXPECT_TRUE(MatMul(a.cview(), b.cview(), c.view(), 1).ok());
  // k = 0: an empty sum, so c is all zeros.
  Tensor a0 = Tensor::Create(DType::kF32, {4, 0}).value();
  Tensor b0 = Tensor::Create(DType::kF32, {0, 3}).value();
  Tensor c0 = Tensor::Create(DType::kF32, {4, 3}).value();
  Fill(c0, 1234.0f);
  ASSERT_TRUE(MatMul(a0.cview(), b0.cview(), c0.view(), 1).ok());
  for (double x : ToDoubles(c0.cview())) EXPECT_EQ(x, 0.0);
}

TEST(MatMulTest, ShapeAndDtypeErrors) {
  Tensor a = RandomTensor(DType::kF32, {4, 6}, 11);
  Tensor b = RandomTensor(DType::kF32, {6, 5}, 12);
  Tensor c = Tensor::Create(DType::kF32, {4, 5}).value();
  auto expect_invalid = [](const absl::Status& s, const char* substring) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(substring));
  };
  {  // inner dimensions differ
    Tensor b2 = RandomTensor(DType::kF32, {7, 5}, 13);
    expect_invalid(MatMul(a.cview(), b2.cview(), c.view(), 1), "[7, 5]");
  }
  {  // c has the wrong shape
    Tensor c2 = Tensor::Create(DType::kF32, {4, 6}).value();
    expect_invalid(MatMul(a.cview(), b.cview(), c2.view(), 1), "[4, 6]");
  }
  {  // rank 3
    Tensor a3 = RandomTensor(DType::kF32, {1, 4, 6}, 14);
    expect_invalid(MatMul(a3.cview(), b.cview(), c.view(), 1), "a");
  }
  {  // mixed input dtypes
    Tensor b16 = RandomTensor(DType::kBF16, {6, 5}, 15);
    expect_invalid(MatMul(a.cview(), b16.cview(), c.view(), 1), "bf16");
  }
  {  // bf16 output
    Tensor c16 = Tensor::Create(DType::kBF16, {4, 5}).value();
    expect_invalid(MatMul(a.cview(), b.cview(), c16.view(), 1), "c");
  }
  {  // no unit stride on either axis
    Tensor big = RandomTensor(DType::kF32, {8, 12}, 16);
    const ConstTensorView every_other(big.cview().raw(), DType::kF32, Dims{4, 6}, Dims{24, 2});
    expect_invalid(MatMul(every_other, b.cview(), c.view(), 1), "a");
  }
  expect_invalid(MatMul(a.cview(), b.cview(), c.view(), 0), "num_threads");
}

TEST(MatMulTest, PrimitivesAreCachedByShape) {
  Tensor a = RandomTensor(DType::kF32, {11, 23}, 17);
  Tensor b = RandomTensor(DType::kF32, {23, 19}, 18);
  Tensor c = Tensor::Create(DType::kF32, {11, 19}).value();
  ASSERT_TRUE(MatMul(a.cview(), b.cview(), c.view(), 1).ok());
  const int64_t after_first = MatMulPrimitivesBuilt();
  EXPECT_GE(MatMulCacheSize(), 1);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(MatMul(a.cview(), b.cview(), c.view(), 1).ok());
  EXPECT_EQ(MatMulPrimitivesBuilt(), after_first);
  Tensor b2 = RandomTensor(DType::kF32, {23, 20}, 19);
  Tensor c2 = Tensor::Create(DType::kF32, {11, 20}).value();
  ASSERT_TRUE(MatMul(a.cview(), b2.cview(), c2.view(), 1).ok());
  EXPECT_EQ(MatMulPrimitivesBuilt(), after_first + 1);
}

int64_t ResidentKiB() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

// Shapes come from requests, and each primitive holds ~60 KiB the memory
// budget does not see: the cache keeps the 256 most recently used, and
// oneDNN's own cache none. It kept 2048 (and oneDNN 1024 more): a client's
// Attends of 2100 key lengths held 125 MiB. 1400 shapes in a row: the
// cache's size stays at its bound, and memory stops growing once it is full
// (it grew ~36 MiB over the last 600 shapes before). A shape still cached
// is found again, one evicted is built again.
TEST(MatMulTest, TheCacheKeepsTheMostRecentlyUsedShapes) {
  Tensor a = RandomTensor(DType::kF32, {17, 1500}, 20);
  Tensor b = RandomTensor(DType::kF32, {1500, 8}, 21);
  const auto shape = [&](int64_t n) {
    Tensor c = Tensor::Create(DType::kF32, {17, 8}).value();
    const ConstTensorView an(a.cview().raw(), DType::kF32, Dims{17, n}, Dims{1500, 1});
    const ConstTensorView bn(b.cview().raw(), DType::kF32, Dims{n, 8}, Dims{8, 1});
    ASSERT_TRUE(MatMul(an, bn, c.view(), 1).ok());
  };
  for (int64_t n = 1; n <= 800; ++n) shape(n);
  EXPECT_LE(MatMulCacheSize(), 256);
  const int64_t middle = ResidentKiB();
  for (int64_t n = 801; n <= 1400; ++n) shape(n);
  EXPECT_LE(MatMulCacheSize(), 256);
  EXPECT_LT(ResidentKiB() - middle, 16 * 1024) << "KiB grew over 600 new shapes";
  // Least recently used first: shape 1400, touched after each new shape,
  // outlives 300 others (first in, first out would evict it).
  const int64_t built = MatMulPrimitivesBuilt();
  for (int64_t n = 1; n <= 300; ++n) {
    shape(n);  // long evicted: built again
    shape(1400);
  }
  EXPECT_EQ(MatMulPrimitivesBuilt(), built + 300);
}

// One cached primitive used by many threads at once gives each the result it
// gets alone, bit for bit.
TEST(MatMulTest, ConcurrentCallsAreBitIdenticalToSoloCalls) {
  constexpr int kThreads = 8;
  const int64_t m = 48, k = 64, n = 40;
  std::vector<Tensor> as, bs, solo;
  for (int i = 0; i < kThreads; ++i) {
    const DType dtype = i % 2 == 0 ? DType::kF32 : DType::kBF16;
    as.push_back(RandomTensor(dtype, {m, k}, 100 + i));
    bs.push_back(RandomTensor(dtype, {k, n}, 200 + i));
    solo.push_back(Tensor::Create(DType::kF32, {m, n}).value());
    ASSERT_TRUE(MatMul(as[i].cview(), bs[i].cview(), solo[i].view(), 1).ok());
  }
  std::atomic<int> ready{0};
  std::vector<int> bad(kThreads, 0);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      Tensor c = Tensor::Create(DType::kF32, {m, n}).value();
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      for (int rep = 0; rep < 20; ++rep) {
        if (!MatMul(as[i].cview(), bs[i].cview(), c.view(), 1).ok() ||
            std::memcmp(c.data<float>(), solo[i].data<float>(), c.byte_size()) != 0) {
          ++bad[i];
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(bad[i], 0) << "thread " << i;
}

// LinearRows against fp64 on the values it computes with (x rounded to bf16
// for bf16 weights; products exact in fp64), each output within 1e-5 of its
// sum of |products| (f32 accumulation over at most a few hundred terms),
// plus the bias. Shapes cover `in` below, at and off multiples of 16 and
// `out` off multiples of the 4-column block.
struct RowsCase {
  int64_t rows, in, out;
};
constexpr RowsCase kRowsCases[] = {{1, 1, 1},   {1, 16, 4},   {3, 15, 5},   {4, 17, 7},
                                   {5, 64, 9},  {7, 100, 33}, {16, 128, 64}, {17, 80, 300}};

double BiasAt(const ConstTensorView& b, int64_t o) {
  if (b.empty_view()) return 0.0;
  return b.dtype() == DType::kF32 ? b.data<float>()[o] : BF16ToFloat(b.data<uint16_t>()[o]);
}

void ExpectRowsMatchReference(const Tensor& x, const Tensor& w, const ConstTensorView& bias,
                              const Tensor& y) {
  const int64_t rows = x.dim(0), in = x.dim(1), out = w.dim(0);
  auto at = [](const Tensor& t, int64_t i) -> double {
    return t.dtype() == DType::kF32 ? t.data<float>()[i] : BF16ToFloat(t.data<uint16_t>()[i]);
  };
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0, abs = 0;
      for (int64_t c = 0; c < in; ++c) {
        double xv = at(x, r * in + c);
        if (w.dtype() == DType::kBF16) xv = BF16ToFloat(FloatToBF16(static_cast<float>(xv)));
        const double p = xv * at(w, o * in + c);
        acc += p;
        abs += std::abs(p);
      }
      const double want = acc + BiasAt(bias, o), got = y.data<float>()[r * out + o];
      if (std::abs(got - want) <= 1e-5 * (abs + std::abs(BiasAt(bias, o))) + 0x1p-149) continue;
      if (++bad <= 4) ADD_FAILURE() << "row " << r << ", output " << o << ": got " << got
                                    << ", want " << want;
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST(LinearRowsTest, MatchesReference) {
  for (DType wd : {DType::kF32, DType::kBF16}) {
    for (DType xd : {DType::kF32, DType::kBF16}) {
      for (const RowsCase& s : kRowsCases) {
        for (bool with_bias : {false, true}) {
          SCOPED_TRACE(absl::StrCat("w ", DTypeName(wd), " x ", DTypeName(xd), " rows ", s.rows,
                                    " in ", s.in, " out ", s.out, with_bias ? " bias" : ""));
          const Tensor x = RandomTensor(xd, {s.rows, s.in}, 21 + s.in);
          const Tensor w = RandomTensor(wd, {s.out, s.in}, 22 + s.out);
          const Tensor b = RandomTensor(wd, {s.out}, 23);
          const ConstTensorView bias = with_bias ? b.cview() : ConstTensorView();
          Tensor y = Tensor::Create(DType::kF32, {s.rows, s.out}).value();
          Fill(y, 1234.0f);
          ASSERT_TRUE(LinearRows(x.cview(), w.cview(), bias, y.view(), 2).ok());
          ExpectRowsMatchReference(x, w, bias, y);
        }
      }
    }
  }
}

// The point of LinearRows: a row's outputs have the same bits whether it is
// computed alone or with 1..19 other rows, on 1 or 2 threads, on the AVX-512
// or the AVX2 path (steps of sessions projected together answer as if each
// ran alone). A kernel whose order depended on the row block would fail.
TEST(LinearRowsTest, ARowsBitsDoNotDependOnTheOtherRowsOrThreads) {
  for (DType wd : {DType::kF32, DType::kBF16}) {
    const int64_t rows = 20, in = 200, out = 131;
    const Tensor x = RandomTensor(DType::kF32, {rows, in}, 31, -3.0f, 3.0f);
    const Tensor w = RandomTensor(wd, {out, in}, 32);
    const Tensor b = RandomTensor(DType::kF32, {out}, 33);
    std::vector<float> alone(rows * out);
    for (int64_t r = 0; r < rows; ++r) {
      const ConstTensorView xr(x.data<float>() + r * in, DType::kF32, {1, in});
      TensorView yr(alone.data() + r * out, DType::kF32, {1, out});
      ASSERT_TRUE(LinearRows(xr, w.cview(), b.cview(), yr, 1).ok());
    }
    for (const bool avx512 : {true, false}) {
      const bool saved = internal::SetLinearRowsAvx512ForTesting(avx512);
      for (const int threads : {1, 2}) {
        for (int64_t n = 1; n <= rows; n += 3) {
          SCOPED_TRACE(absl::StrCat(DTypeName(wd), avx512 ? " avx512" : " avx2", " threads ",
                                    threads, " rows ", n));
          const ConstTensorView xs(x.data<float>(), DType::kF32, {n, in});
          Tensor y = Tensor::Create(DType::kF32, {n, out}).value();
          ASSERT_TRUE(LinearRows(xs, w.cview(), b.cview(), y.view(), threads).ok());
          EXPECT_EQ(std::memcmp(y.data<float>(), alone.data(), n * out * sizeof(float)), 0);
        }
      }
      internal::SetLinearRowsAvx512ForTesting(saved);
    }
  }
}

// Nothing is flushed: tiny and subnormal rows, and tiny products, against
// bf16 weights, each output within 1e-5 of its row's largest |output| plus
// half the smallest subnormal (what f32 cannot hold).
TEST(LinearRowsTest, TinyRowsAndProductsAreNotFlushed) {
  const int64_t in = 64, out = 24, rows = 5;
  const double magnitudes[] = {1.0, 1e-36, 1e-20, 3e-38, 3e-40};
  Tensor x = Tensor::Create(DType::kF32, {rows, in}).value();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < in; ++c) {
      const double u = 0.5 + static_cast<double>((r * 13 + c * 7) % 11) / 11.0;
      x.data<float>()[r * in + c] = static_cast<float>((c % 3 == 0 ? -u : u) * magnitudes[r]);
    }
  }
  for (const float scale : {1.0f, 1e-35f}) {
    const Tensor w = RandomTensor(DType::kBF16, {out, in}, 35, -scale, scale);
    Tensor y = Tensor::Create(DType::kF32, {rows, out}).value();
    ASSERT_TRUE(LinearRows(x.cview(), w.cview(), ConstTensorView(), y.view(), 1).ok());
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<double> want(out);
      double size = 0;
      for (int64_t o = 0; o < out; ++o) {
        double acc = 0;
        for (int64_t c = 0; c < in; ++c) {
          acc += static_cast<double>(BF16ToFloat(FloatToBF16(x.data<float>()[r * in + c]))) *
                 BF16ToFloat(w.data<uint16_t>()[o * in + c]);
        }
        want[o] = acc;
        size = std::max(size, std::abs(acc));
      }
      for (int64_t o = 0; o < out; ++o) {
        EXPECT_LE(std::abs(y.data<float>()[r * out + o] - want[o]), 1e-5 * size + 0x1p-150)
            << "weights of scale " << scale << ", row of magnitude " << magnitudes[r]
            << ", output " << o;
      }
    }
  }
}

TEST(LinearRowsTest, ChecksItsOperandsAsLinearDoes) {
  const Tensor x = RandomTensor(DType::kF32, {2, 8}, 41);
  const Tensor w = RandomTensor(DType::kF32, {3, 9}, 42);
  Tensor y = Tensor::Create(DType::kF32, {2, 3}).value();
  const absl::Status st = LinearRows(x.cview(), w.cview(), ConstTensorView(), y.view(), 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("linear weight is [3, 9] but the input has 8 features"));
  // in = 0: empty sums, so the outputs are the bias.
  const Tensor x0 = Tensor::Create(DType::kF32, {2, 0}).value();
  const Tensor w0 = Tensor::Create(DType::kF32, {3, 0}).value();
  const Tensor b = RandomTensor(DType::kF32, {3}, 43);
  Fill(y, 1234.0f);
  ASSERT_TRUE(LinearRows(x0.cview(), w0.cview(), b.cview(), y.view(), 1).ok());
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(y.data<float>()[i], b.data<float>()[i % 3]);
}

}  // namespace
}  // namespace ropeattn
