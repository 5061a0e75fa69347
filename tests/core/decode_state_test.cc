// DecodeState (core/decode_state.h) and AttendBatch (core/attention.h): a
// session's steps against the fp64 reference, and the batched pass against
// solo calls, bit for bit.
#include "core/decode_state.h"

#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <fstream>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/attention.h"
#include "core/attention_kernels.h"
#include "core/kv_cache.h"
#include "core/stop.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/reference/attention_ref.h"
#include "tests/reference/rope_ref.h"

namespace ropeattn {
namespace {

// f32 and bf16 states keep token-major pages only where the tile layout
// decodes no faster (its AVX-512 kernels off): the page tests turn them off
// for their lifetime, so they test those pages on every machine.
class F32Paged {
 public:
  F32Paged() : previous_(internal::SetAvx512KernelsForTesting(false)) {}
  ~F32Paged() { internal::SetAvx512KernelsForTesting(previous_); }

 private:
  const bool previous_;
};

using ::ropeattn::testing::AllClose;
using ::ropeattn::testing::RandomTensor;
using ::ropeattn::testing::ToDoubles;
using ::testing::HasSubstr;

// The fp64 reference's parameters for a step of `tokens` tokens at
// position `pos` of a state of config `c`: causal, the state's window.
ref::AttentionRefParams StepRefParams(const DecodeStateConfig& c, int64_t pos, int64_t tokens) {
  ref::AttentionRefParams p;
  p.q_len = tokens;
  p.k_len = pos + tokens;
  p.heads = c.heads;
  p.kv_heads = c.kv_heads;
  p.head_dim = c.head_dim;
  p.v_dim = c.v_dim;
  p.causal = true;
  p.window = c.attention.window;
  p.q_offsets = {pos};
  return p;
}

bool SameBytes(const Tensor& a, const Tensor& b) {
  return a.byte_size() == b.byte_size() &&
         std::memcmp(a.data<char>(), b.data<char>(), a.byte_size()) == 0;
}

// ------------------------------------------------------------ AttendBatch --

struct BatchCase {
  DType kv = DType::kF32;
  int64_t q_len = 1, k_len = 100, heads = 8, kv_heads = 2, d = 64;
  bool cache = false;  // keys from a KvCache
  int64_t window = 0;
  double softcap = 0;
  bool alibi = false;
};

struct BatchInputs {
  Tensor q, k, v;
  KvCache cache;
  AttentionOptions options;
  std::vector<double> slopes;
};

BatchInputs MakeBatchInputs(const BatchCase& c, uint64_t seed) {
  BatchInputs in;
  in.q = RandomTensor(DType::kF32, {1, c.q_len, c.heads, c.d}, seed);
  in.k = RandomTensor(c.kv, {1, c.k_len, c.kv_heads, c.d}, seed + 1);
  in.v = RandomTensor(c.kv, {1, c.k_len, c.kv_heads, c.d}, seed + 2);
  if (c.cache) {
    in.cache = KvCache::Create(c.kv_heads, c.d, c.d, c.k_len).value();
    EXPECT_TRUE(in.cache.WriteK(0, in.k.cview()).ok());
    EXPECT_TRUE(in.cache.WriteV(0, in.v.cview()).ok());
  }
  in.options.causal = true;
  in.options.window = c.window;
  in.options.softcap = c.softcap;
  in.options.num_threads = 2;
  if (c.alibi) {
    in.options.bias.kind = BiasKind::kAlibi;
    for (int64_t h = 0; h < c.heads; ++h) in.options.bias.alibi_slopes.push_back(0.05 * (h + 1));
  }
  return in;
}

absl::Status Solo(const BatchCase& c, BatchInputs& in, Tensor& out) {
  if (c.cache) return AttendCache(in.q.cview(), in.cache, c.k_len, in.options, out.view());
  return Attend(in.q.cview(), in.k.cview(), in.v.cview(), in.options, out.view());
}

// Jobs of every kind - token-major f32 and bf16 keys, a KvCache, GQA and
// MHA, windows, soft-caps, ALiBi, and a prompt long enough for the prefill
// path - give in one pass exactly the bytes each gives alone, whatever the
// pass's thread count.
// The tile kernels over bf16 tiles give the bits they give over f32 tiles
// holding the same (widened) values, for every row count and a partial
// last vector of V, with the AVX-512 kernels on and off.
// A cancellation within StopToken::kDeadlineSlack (at most a quarter of the
// call's timeout) of the deadline is the deadline's (the client's timer
// cancels before the server's copy of the deadline passes); an earlier one,
// or one without a deadline, is a cancellation.
TEST(StopTokenTest, ACancelJustBeforeTheDeadlineCountsAsTheDeadlines) {
  {
    StopToken t;
    t.set_deadline(absl::Now() + absl::Seconds(30));
    EXPECT_TRUE(t.status().ok());
    t.Cancel();
    EXPECT_EQ(t.status().code(), absl::StatusCode::kCancelled);
  }
  {
    // 20 ms before a 200 ms call's deadline: the deadline's.
    StopToken t;
    t.set_deadline(absl::Now() + absl::Milliseconds(200));
    absl::SleepFor(absl::Milliseconds(180));
    t.Cancel();
    EXPECT_EQ(t.status().code(), absl::StatusCode::kDeadlineExceeded) << t.status();
  }
  {
    // A 40 ms call cancelled at once (a hedged request): more than a
    // quarter of its timeout before the deadline, a cancellation.
    StopToken t;
    t.set_deadline(absl::Now() + absl::Milliseconds(40));
    t.Cancel();
    EXPECT_EQ(t.status().code(), absl::StatusCode::kCancelled) << t.status();
  }
  {
    StopToken t;
    t.Cancel();
    EXPECT_EQ(t.status().code(), absl::StatusCode::kCancelled);
  }
  {
    StopToken t;
    t.set_deadline(absl::Now() - absl::Milliseconds(1));
    EXPECT_EQ(t.status().code(), absl::StatusCode::kDeadlineExceeded);
  }
}

// The softmax's exp on 16 lanes (AVX-512) gives every weight the bits the
// 8-lane one gives (the same operations lane by lane), the scalar tail
// included, and sums them to f32 rounding (a different order); both within
// 2 ulp of fp64's exp (the polynomial's error), and 0 below e^-104. (On a
// machine without AVX-512 both runs take the 8-lane path.)
TEST(TileKernelsTest, TheSoftmaxExpGivesTheSameWeightsOnEveryPath) {
  uint64_t seed = 11;
  auto next = [&seed] {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<int64_t>(seed >> 33) % 2000001) / 2000000.0f;
  };
  for (const int64_t n : {1, 7, 31, 32, 33, 1023, 1024, 1025, 3000}) {
    std::vector<float> x(n);
    for (float& v : x) v = -120.0f * next();  // logits minus their max, [-120, 0]
    x[0] = 0.0f;
    std::vector<float> a = x, b = x;
    const bool previous = internal::SetAvx512KernelsForTesting(false);
    const float sa = internal::ExpSubMaxSum(a.data(), n, 0.0f);
    internal::SetAvx512KernelsForTesting(true);
    const float sb = internal::ExpSubMaxSum(b.data(), n, 0.0f);
    internal::SetAvx512KernelsForTesting(previous);
    double want_sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(a[i], b[i]) << "n " << n << " i " << i << " x " << x[i];
      const double want = x[i] < -104.0f ? 0.0 : std::exp(static_cast<double>(x[i]));
      want_sum += static_cast<double>(b[i]);
      EXPECT_LE(std::fabs(b[i] - want), 2.5e-7 * want + 1e-45) << "x " << x[i];
    }
    EXPECT_NEAR(sa, want_sum, 1e-6 * want_sum) << n;
    EXPECT_NEAR(sb, want_sum, 1e-6 * want_sum) << n;
  }
  // The edges of the contract, in every lane and the tail: a masked logit
  // (-inf), -0 and denormal differences (weight 1), the cut to 0 at -104
  // (either side of it) and the underflow to denormal weights at
  // ln(FLT_MIN) = -87.3365.
  const float kInf = std::numeric_limits<float>::infinity();
  const float kMin = std::numeric_limits<float>::min();
  const float kTrueMin = std::numeric_limits<float>::denorm_min();
  const std::vector<float> edges = {
      -kInf, -0.0f, 0.0f, -kTrueMin, -1e-40f, -kMin / 2, -kMin,
      -104.0f, std::nextafter(-104.0f, 0.0f), std::nextafter(-104.0f, -kInf), -103.9f,
      -104.1f, -103.0f, -105.0f, -87.3f, -87.33654f, std::nextafter(-87.33654f, 0.0f),
      std::nextafter(-87.33654f, -kInf), -87.4f, -87.2f, -88.0f, -100.0f};
  for (const int64_t n : {1, 7, 16, 23, 33, 1025}) {
    for (size_t shift = 0; shift < edges.size(); ++shift) {
      std::vector<float> x(n);
      for (int64_t i = 0; i < n; ++i) x[i] = edges[(i + shift) % edges.size()];
      std::vector<float> a = x, b = x;
      const bool previous = internal::SetAvx512KernelsForTesting(false);
      const float sa = internal::ExpSubMaxSum(a.data(), n, 0.0f);
      internal::SetAvx512KernelsForTesting(true);
      const float sb = internal::ExpSubMaxSum(b.data(), n, 0.0f);
      internal::SetAvx512KernelsForTesting(previous);
      double want_sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(a[i], b[i]) << "n " << n << " i " << i << " x " << x[i];
        const double want = x[i] < -104.0f ? 0.0 : std::exp(static_cast<double>(x[i]));
        want_sum += static_cast<double>(b[i]);
        EXPECT_GE(b[i], 0.0f) << "x " << x[i];
        EXPECT_LE(std::fabs(b[i] - want), 2.5e-7 * want + 1e-45) << "x " << x[i];
      }
      EXPECT_NEAR(sa, want_sum, 1e-6 * want_sum + 1e-45) << n;
      EXPECT_NEAR(sb, want_sum, 1e-6 * want_sum + 1e-45) << n;
    }
  }
}

TEST(TileKernelsTest, Bf16AndInt8TilesGiveTheBitsOfF32TilesOfTheSameValues) {
  constexpr int64_t kT = KvCache::kTile;
  uint64_t seed = 7;
  auto next = [&seed] {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<int64_t>(seed >> 33) % 2001 - 1000) / 337.0f;
  };
  for (const bool avx512 : {false, true}) {
    const bool previous = internal::SetAvx512KernelsForTesting(avx512);
    absl::Cleanup restore = [previous] { internal::SetAvx512KernelsForTesting(previous); };
    for (const int64_t d : {37, 128}) {
      for (const int64_t dv : {20, 128, 148}) {
        for (int64_t rows = 1; rows <= 5; ++rows) {
          SCOPED_TRACE(absl::StrCat("d ", d, " dv ", dv, " rows ", rows, avx512 ? " avx512" : ""));
          std::vector<uint16_t> kb(d * kT), vb(kT * dv);
          std::vector<float> kf(d * kT), vf(kT * dv), q(rows * d), w(rows * kT);
          for (size_t i = 0; i < kb.size(); ++i) kf[i] = BF16ToFloat(kb[i] = FloatToBF16(next()));
          for (size_t i = 0; i < vb.size(); ++i) vf[i] = BF16ToFloat(vb[i] = FloatToBF16(next()));
          for (float& x : q) x = next();
          for (float& x : w) x = next();
          std::vector<float> s16(rows * kT), s32(rows * kT);
          internal::DotTileRows(q.data(), d, rows, kb.data(), d, s16.data());
          internal::DotTileRows(q.data(), d, rows, kf.data(), d, s32.data());
          EXPECT_EQ(0, std::memcmp(s16.data(), s32.data(), s16.size() * sizeof(float)));
          // int8 codes (-127..127) widen exactly too.
          std::vector<int8_t> k8(d * kT), v8(kT * dv);
          std::vector<float> k8f(d * kT), v8f(kT * dv);
          for (size_t i = 0; i < k8.size(); ++i) {
            k8f[i] = k8[i] = static_cast<int8_t>(static_cast<int>(next() * 33.0f) % 128);
          }
          for (size_t i = 0; i < v8.size(); ++i) {
            v8f[i] = v8[i] = static_cast<int8_t>(static_cast<int>(next() * 33.0f) % 128);
          }
          std::vector<float> s8(rows * kT), s8f(rows * kT);
          internal::DotTileRows(q.data(), d, rows, k8.data(), d, s8.data());
          internal::DotTileRows(q.data(), d, rows, k8f.data(), d, s8f.data());
          EXPECT_EQ(0, std::memcmp(s8.data(), s8f.data(), s8.size() * sizeof(float)));
          for (int64_t u = 0; u < kT; ++u) {
            double want = 0, mag = 0;
            for (int64_t x = 0; x < d; ++x) {
              want += static_cast<double>(q[x]) * k8f[x * kT + u];
              mag += std::abs(static_cast<double>(q[x]) * k8f[x * kT + u]);
            }
            ASSERT_NEAR(s8[u], want, 1e-5 * mag + 1e-30) << "int8 key " << u;
          }
          for (const int64_t count : {int64_t{1}, int64_t{19}, kT}) {
            // The sums over narrow rows and over the same values as f32.
            const auto sums = [&](const auto* narrow, const float* wide, const char* what) {
              std::vector<float> a(rows * dv, 0.5f), b(rows * dv, 0.5f);
              internal::WeightedSumDenseRows(w.data(), kT, rows, narrow, count, dv, a.data(), dv);
              internal::WeightedSumDenseRows(w.data(), kT, rows, wide, count, dv, b.data(), dv);
              EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)))
                  << what << " count " << count;
              return a;
            };
            const std::vector<float> a16 = sums(vb.data(), vf.data(), "bf16");
            sums(v8.data(), v8f.data(), "int8");
            // And the sums are right (fp64, relative 1e-5 of the magnitudes).
            for (int64_t r = 0; r < rows; ++r) {
              for (int64_t x = 0; x < dv; ++x) {
                double want = 0.5, mag = 0.5;
                for (int64_t u = 0; u < count; ++u) {
                  want += static_cast<double>(w[r * kT + u]) * vf[u * dv + x];
                  mag += std::abs(static_cast<double>(w[r * kT + u]) * vf[u * dv + x]);
                }
                ASSERT_NEAR(a16[r * dv + x], want, 1e-5 * mag) << r << " " << x;
              }
            }
          }
        }
      }
    }
  }
}

TEST(AttendBatchTest, EveryJobIsBitIdenticalToItsSoloCall) {
  std::vector<BatchCase> cases(8);
  cases[1].kv = DType::kBF16;
  cases[2].cache = true;
  cases[2].k_len = 300;
  cases[3].kv_heads = 8;
  cases[3].window = 17;
  cases[4].softcap = 5.0;
  cases[4].alibi = true;
  cases[5].q_len = 40;  // prefill
  cases[5].k_len = 90;
  cases[6].q_len = 3;
  cases[6].k_len = 1000;
  cases[7].cache = true;
  cases[7].q_len = 2;
  cases[7].k_len = 64;
  std::vector<BatchInputs> inputs;
  std::vector<Tensor> solo;
  for (size_t i = 0; i < cases.size(); ++i) {
    inputs.push_back(MakeBatchInputs(cases[i], 100 + 10 * i));
    solo.push_back(Tensor::Create(DType::kF32, {1, cases[i].q_len, cases[i].heads, cases[i].d})
                       .value());
    ASSERT_TRUE(Solo(cases[i], inputs[i], solo[i]).ok()) << i;
  }
  for (int threads : {1, 2, 3}) {
    std::vector<Tensor> outs;
    std::vector<AttentionJob> jobs(cases.size());
    for (size_t i = 0; i < cases.size(); ++i) {
      outs.push_back(Tensor::Create(DType::kF32, solo[i].dims()).value());
      AttentionJob& j = jobs[i];
      j.q = inputs[i].q.cview();
      if (cases[i].cache) {
        j.cache = &inputs[i].cache;
        j.cache_length = cases[i].k_len;
      } else {
        j.k = inputs[i].k.cview();
        j.v = inputs[i].v.cview();
      }
      j.options = inputs[i].options;
      j.out = outs[i].view();
    }
    AttendBatch(absl::MakeSpan(jobs), threads);
    for (size_t i = 0; i < cases.size(); ++i) {
      ASSERT_TRUE(jobs[i].status.ok()) << i << ": " << jobs[i].status;
      EXPECT_TRUE(SameBytes(outs[i], solo[i])) << "job " << i << " with " << threads << " threads";
    }
  }
}

// A call planned for 2 threads answers the same bytes run on 1 (the key cut
// follows plan_threads); planned for 1, it may differ in the last bits.
TEST(AttendBatchTest, PlanThreadsFixTheBytesWhateverThreadsRun) {
  for (bool cache : {false, true}) {
    BatchCase c;
    c.k_len = 1000;
    c.cache = cache;
    BatchInputs in = MakeBatchInputs(c, 31);
    Tensor two = Tensor::Create(DType::kF32, {1, 1, 8, 64}).value();
    ASSERT_TRUE(Solo(c, in, two).ok());  // num_threads 2
    in.options.num_threads = 1;
    in.options.plan_threads = 2;
    Tensor one = Tensor::Create(DType::kF32, {1, 1, 8, 64}).value();
    ASSERT_TRUE(Solo(c, in, one).ok());
    EXPECT_TRUE(SameBytes(one, two)) << (cache ? "cache" : "tensors");
  }
  BatchCase c;
  BatchInputs in = MakeBatchInputs(c, 32);
  in.options.plan_threads = -1;
  Tensor out = Tensor::Create(DType::kF32, {1, 1, 8, 64}).value();
  const absl::Status s = Solo(c, in, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("plan_threads"));
}

// A bad job reports its own error; the others are computed as usual.
TEST(AttendBatchTest, ABadJobFailsAloneNamingWhatIsWrong) {
  BatchCase c;
  BatchInputs good = MakeBatchInputs(c, 7);
  Tensor want = Tensor::Create(DType::kF32, {1, 1, 8, 64}).value();
  ASSERT_TRUE(Solo(c, good, want).ok());
  Tensor bad_q = RandomTensor(DType::kF32, {1, 1, 6, 64}, 9);  // 6 heads over 2 kv heads: fine
  Tensor bad_out = Tensor::Create(DType::kF32, {1, 1, 8, 64}).value();  // but out has 8
  Tensor out = Tensor::Create(DType::kF32, {1, 1, 8, 64}).value();
  std::vector<AttentionJob> jobs(2);
  jobs[0].q = bad_q.cview();
  jobs[0].k = good.k.cview();
  jobs[0].v = good.v.cview();
  jobs[0].options = good.options;
  jobs[0].out = bad_out.view();
  jobs[1].q = good.q.cview();
  jobs[1].k = good.k.cview();
  jobs[1].v = good.v.cview();
  jobs[1].options = good.options;
  jobs[1].out = out.view();
  AttendBatch(absl::MakeSpan(jobs), 2);
  EXPECT_EQ(jobs[0].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(jobs[0].status.message()), HasSubstr("out"));
  ASSERT_TRUE(jobs[1].status.ok()) << jobs[1].status;
  EXPECT_TRUE(SameBytes(out, want));
}

// ------------------------------------------------------------ DecodeState --

DecodeStateConfig BaseConfig() {
  DecodeStateConfig c;
  c.heads = 8;
  c.kv_heads = 2;
  c.head_dim = 32;
  c.v_dim = 32;
  c.max_context = 64;
  RopeConfig rope;
  rope.head_dim = 32;
  c.rope = rope;
  return c;
}

struct StepTensors {
  Tensor q, k, v;
};
StepTensors RandomStep(const DecodeStateConfig& c, int64_t tokens, uint64_t seed,
                       DType dtype = DType::kF32) {
  return {RandomTensor(dtype, {1, tokens, c.heads, c.head_dim}, seed),
          RandomTensor(dtype, {1, tokens, c.kv_heads, c.head_dim}, seed + 1),
          RandomTensor(dtype, {1, tokens, c.kv_heads, c.v_dim}, seed + 2)};
}

// Steps of 1, 5, 2, 40 (a prefill over the pages) and 1 tokens, crossing
// page boundaries, each against the fp64 reference of RoPE at the absolute
// positions followed by causal attention over every token so far (relative
// tolerance 1e-5 in f32). f32 and bf16, in token-major pages (AVX-512
// kernels off) and, where the machine has AVX-512, in tile pages (on).
TEST(DecodeStateTest, StepsMatchTheFp64Reference) {
  for (const bool avx512 : {false, true})
  for (DType kv : {DType::kF32, DType::kBF16})
  for (const int64_t v_dim : {32, 20}) {  // 20: a partial last vector of V
    const bool previous = internal::SetAvx512KernelsForTesting(avx512);
    absl::Cleanup restore = [previous] { internal::SetAvx512KernelsForTesting(previous); };
    DecodeStateConfig c = BaseConfig();
    c.kv_dtype = kv;
    c.v_dim = v_dim;
    DecodeState state = DecodeState::Create(c).value();
    EXPECT_EQ(state.storage(), avx512 && KvCacheDecodeIsFaster() ? DecodeState::Storage::kTiles
                                                                 : DecodeState::Storage::kTokenMajor);
    std::vector<double> keys, values;  // rotated keys and values so far, as stored
    int64_t pos = 0;
    uint64_t seed = 40;
    for (int64_t tokens : {1, 5, 2, 40, 1}) {
      StepTensors s = RandomStep(c, tokens, seed += 3);
      Tensor out = Tensor::Create(DType::kF32, {1, tokens, c.heads, c.v_dim}).value();
      ASSERT_TRUE(state.Step(s.q.cview(), s.k.cview(), s.v.cview(), out.view(), 2).ok());
      ref::RotateRefParams r;
      r.seq = tokens;
      r.head_dim = r.rotary_dim = c.head_dim;
      r.inv_freq = ref::DefaultInvFreq(c.head_dim, 10000.0);
      for (int64_t t = 0; t < tokens; ++t) r.positions.push_back(pos + t);
      r.heads = c.heads;
      const std::vector<double> q = ref::Rotate(r, ToDoubles(s.q.cview()));
      r.heads = c.kv_heads;
      std::vector<double> k = ref::Rotate(r, ToDoubles(s.k.cview()));
      std::vector<double> v = ToDoubles(s.v.cview());
      if (kv == DType::kBF16) {  // the cache holds keys and values rounded once
        for (double& x : k) x = BF16ToFloat(FloatToBF16(static_cast<float>(x)));
        for (double& x : v) x = BF16ToFloat(FloatToBF16(static_cast<float>(x)));
      }
      keys.insert(keys.end(), k.begin(), k.end());
      values.insert(values.end(), v.begin(), v.end());
      const ref::AttentionRefParams p = StepRefParams(c, pos, tokens);
      const ref::AttentionRefResult want = ref::Attention(p, q, keys, values);
      EXPECT_TRUE(AllClose(ToDoubles(out.cview()), want.out,
                           kv == DType::kF32 ? testing::kF32Tol : testing::kBF16Tol))
          << DTypeName(kv) << " step at " << pos << (avx512 ? " (AVX-512 on)" : "");
      pos += tokens;
      EXPECT_EQ(state.position(), pos);
    }
  }
}

// Distinct states of every kind stepped together give exactly what each
// gives stepped alone, step after step.
TEST(DecodeStateTest, StepManyIsBitIdenticalToStepAlone) {
  std::vector<DecodeStateConfig> configs;
  configs.push_back(BaseConfig());
  configs.push_back(BaseConfig());
  configs.back().kv_dtype = DType::kBF16;
  configs.push_back(BaseConfig());
  configs.back().linear = true;
  configs.push_back(BaseConfig());
  configs.back().rope->scaling.type = RopeScalingType::kDynamicNtk;
  configs.back().rope->scaling.factor = 2.0;
  configs.back().rope->scaling.original_max_positions = 4;  // re-rotates as it grows
  configs.push_back(BaseConfig());
  configs.back().attention.window = 3;
  configs.back().kv_heads = 8;
  configs.push_back(BaseConfig());
  configs.back().rope.reset();
  configs.back().attention.softcap = 2.0;
  std::vector<DecodeState> alone, together;
  for (const DecodeStateConfig& c : configs) {
    alone.push_back(DecodeState::Create(c).value());
    together.push_back(DecodeState::Create(c).value());
  }
  for (int round = 0; round < 4; ++round) {
    const int64_t tokens = round == 1 ? 3 : 1;
    std::vector<StepTensors> in;
    std::vector<Tensor> solo_out, batch_out;
    std::vector<DecodeState::Job> jobs(configs.size());
    for (size_t i = 0; i < configs.size(); ++i) {
      in.push_back(RandomStep(configs[i], tokens, 500 + 10 * i + 100 * round));
      const Dims dims = {1, tokens, configs[i].heads, configs[i].v_dim};
      solo_out.push_back(Tensor::Create(DType::kF32, dims).value());
      batch_out.push_back(Tensor::Create(DType::kF32, dims).value());
      ASSERT_TRUE(alone[i]
                      .Step(in[i].q.cview(), in[i].k.cview(), in[i].v.cview(),
                            solo_out[i].view(), 2)
                      .ok());
      jobs[i].state = &together[i];
      jobs[i].q = in[i].q.cview();
      jobs[i].k = in[i].k.cview();
      jobs[i].v = in[i].v.cview();
      jobs[i].out = batch_out[i].view();
    }
    DecodeState::StepMany(absl::MakeSpan(jobs), 2, 2);
    for (size_t i = 0; i < configs.size(); ++i) {
      ASSERT_TRUE(jobs[i].status.ok()) << i << ": " << jobs[i].status;
      EXPECT_TRUE(SameBytes(batch_out[i], solo_out[i])) << "state " << i << ", round " << round;
      EXPECT_EQ(together[i].position(), alone[i].position());
    }
  }
}

// A refused step changes nothing: the next good step answers as on a state
// that never saw the bad one. Errors name the tensor (with the caller's
// prefix) and the index of a non-finite value.
TEST(DecodeStateTest, RefusedStepsLeaveTheStateUnchanged) {
  const DecodeStateConfig c = BaseConfig();
  DecodeState state = DecodeState::Create(c).value();
  DecodeState fresh = DecodeState::Create(c).value();
  StepTensors first = RandomStep(c, 2, 1);
  Tensor out = Tensor::Create(DType::kF32, {1, 2, 8, 32}).value();
  ASSERT_TRUE(state.Step(first.q.cview(), first.k.cview(), first.v.cview(), out.view(), 2).ok());
  ASSERT_TRUE(fresh.Step(first.q.cview(), first.k.cview(), first.v.cview(), out.view(), 2).ok());

  StepTensors bad = RandomStep(c, 1, 2);
  bad.v.data<float>()[5] = std::nanf("");
  Tensor out1 = Tensor::Create(DType::kF32, {1, 1, 8, 32}).value();
  absl::Status s = state.Step(bad.q.cview(), bad.k.cview(), bad.v.cview(), out1.view(), 2,
                              nullptr, "step.");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("step.v[0, 0, 0, 5] is NaN"));
  Tensor wrong_k = RandomTensor(DType::kF32, {1, 1, 3, 32}, 3);
  s = state.Step(bad.q.cview(), wrong_k.cview(), bad.q.cview(), out1.view(), 2, nullptr, "step.");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  // Dimension 2 of k and v is kv_heads (2 here, of 8 query heads), not heads.
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("step.k must have shape [1, 1, 2, 32] ([batch 1, tokens, kv_heads, "
                        "head_dim]), got [1, 1, 3, 32]"));
  s = state.Step(bad.q.cview(), bad.k.cview(), wrong_k.cview(), out1.view(), 2, nullptr, "step.");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("step.v must have shape [1, 1, 2, 32] ([batch 1, tokens, kv_heads, "
                        "v_dim]), got [1, 1, 3, 32]"));
  s = state.Step(wrong_k.cview(), bad.k.cview(), bad.v.cview(), out1.view(), 2, nullptr, "step.");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("step.q must have shape [1, 1, 8, 32] ([batch 1, tokens, heads, "
                        "head_dim]), got [1, 1, 3, 32]"));
  StepTensors too_long = RandomStep(c, 63, 4);
  Tensor out63 = Tensor::Create(DType::kF32, {1, 63, 8, 32}).value();
  s = state.Step(too_long.q.cview(), too_long.k.cview(), too_long.v.cview(), out63.view(), 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(state.position(), 2);

  StepTensors next = RandomStep(c, 1, 5);
  Tensor a = Tensor::Create(DType::kF32, {1, 1, 8, 32}).value();
  Tensor b = Tensor::Create(DType::kF32, {1, 1, 8, 32}).value();
  ASSERT_TRUE(state.Step(next.q.cview(), next.k.cview(), next.v.cview(), a.view(), 2).ok());
  ASSERT_TRUE(fresh.Step(next.q.cview(), next.k.cview(), next.v.cview(), b.view(), 2).ok());
  EXPECT_TRUE(SameBytes(a, b));
}

// Truncate rolls back; a copy (a fork) continues exactly like its source.
TEST(DecodeStateTest, TruncateAndCopyContinueExactly) {
  DecodeStateConfig c = BaseConfig();
  c.rope->scaling.type = RopeScalingType::kDynamicNtk;  // the raw keys are copied too
  c.rope->scaling.factor = 2.0;
  c.rope->scaling.original_max_positions = 3;
  DecodeState a = DecodeState::Create(c).value();
  StepTensors s1 = RandomStep(c, 4, 11), s2 = RandomStep(c, 2, 12), s3 = RandomStep(c, 1, 13);
  Tensor o4 = Tensor::Create(DType::kF32, {1, 4, 8, 32}).value();
  Tensor o2 = Tensor::Create(DType::kF32, {1, 2, 8, 32}).value();
  ASSERT_TRUE(a.Step(s1.q.cview(), s1.k.cview(), s1.v.cview(), o4.view(), 2).ok());
  DecodeState b = DecodeState::Create(c).value();
  ASSERT_TRUE(b.CopyFrom(a).ok());
  EXPECT_EQ(b.position(), 4);
  // a goes on with s2 and is truncated back; b never saw s2.
  ASSERT_TRUE(a.Step(s2.q.cview(), s2.k.cview(), s2.v.cview(), o2.view(), 2).ok());
  ASSERT_TRUE(a.Truncate(4).ok());
  EXPECT_EQ(a.Truncate(5).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(a.Truncate(-1).code(), absl::StatusCode::kInvalidArgument);  // as any negative position
  Tensor x = Tensor::Create(DType::kF32, {1, 1, 8, 32}).value();
  Tensor y = Tensor::Create(DType::kF32, {1, 1, 8, 32}).value();
  ASSERT_TRUE(a.Step(s3.q.cview(), s3.k.cview(), s3.v.cview(), x.view(), 2).ok());
  ASSERT_TRUE(b.Step(s3.q.cview(), s3.k.cview(), s3.v.cview(), y.view(), 2).ok());
  EXPECT_TRUE(SameBytes(x, y));

  DecodeStateConfig linear = BaseConfig();
  linear.linear = true;
  DecodeState l = DecodeState::Create(linear).value();
  EXPECT_EQ(l.Truncate(0).code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(l.CopyFrom(a).code(), absl::StatusCode::kInvalidArgument);
}

// Counts what a state's pages are charged and refunded; refuses beyond `limit`.
class CountingCharger : public KvPageCharger {
 public:
  absl::Status Charge(int64_t bytes) override {
    if (live + bytes > limit) return absl::ResourceExhaustedError("the test's page limit");
    live += bytes;
    ++charged;
    return absl::OkStatus();
  }
  void Refund(int64_t bytes) override { live -= bytes; }
  int64_t live = 0, charged = 0, limit = int64_t{1} << 40;
};

// Forks share pages: 8 forks of a 100-token state, 3 new tokens each, hold
// the parent's 7 pages once plus one page each (the partly filled last
// page, copied by each fork as it forks, so the parent never copies it);
// a fork that cannot pay for that copy fails and holds nothing; every fork
// and the parent go on
// exactly (bit for bit) as states that never shared anything; truncating
// into a shared page and writing there leaves the others untouched; pages
// are refunded when their last holder drops them; a charge that fails
// refuses the step and leaves the state as it was. f32, bf16 and int8.
TEST(DecodeStateTest, ForksSharePagesCopyOnWriteAndStayExact) {
  // f32 and bf16 in token-major pages of 16 tokens (AVX-512 kernels off)
  // and, where the machine has AVX-512, in tile pages of 32 (on); int8.
  for (int run = 0; run < 6; ++run) {
    const bool avx512 = run >= 3;
    const int kind = run % 3;
    SCOPED_TRACE(absl::StrCat("kind ", kind, avx512 ? " avx512" : ""));
    const bool previous = internal::SetAvx512KernelsForTesting(avx512);
    struct Restore {
      bool previous;
      ~Restore() { internal::SetAvx512KernelsForTesting(previous); }
    } restore{previous};
    DecodeStateConfig c = BaseConfig();
    c.max_context = 256;
    c.kv_dtype = kind == 1 ? DType::kBF16 : DType::kF32;
    c.int8_kv = kind == 2;
    auto charger = std::make_shared<CountingCharger>();
    // The parent and, for each fork, a twin that replays the same steps.
    auto replay = [&](const std::vector<StepTensors*>& steps, DecodeState& s) {
      for (StepTensors* st : steps) {
        Tensor o = Tensor::Create(DType::kF32, {1, st->q.dim(1), c.heads, c.v_dim}).value();
        ASSERT_TRUE(s.Step(st->q.cview(), st->k.cview(), st->v.cview(), o.view(), 2).ok());
      }
    };
    DecodeState parent = DecodeState::Create(c).value();
    parent.set_page_charger(charger);
    StepTensors prompt = RandomStep(c, 99, 500), one = RandomStep(c, 1, 510);
    replay({&prompt, &one}, parent);
    ASSERT_EQ(parent.position(), 100);
    const int64_t page = parent.page_bytes();
    const int64_t P = DecodeState::PageTokensOf(parent.storage());
    const int64_t total = (100 + P - 1) / P, full = 100 / P;  // 7 and 6, or 2 and 1
    const bool tiles = avx512 && KvCacheDecodeIsFaster();
    EXPECT_EQ(parent.storage(), kind == 2 ? (tiles ? DecodeState::Storage::kInt8Tiles
                                                   : DecodeState::Storage::kInt8)
                                : tiles   ? DecodeState::Storage::kTiles
                                          : DecodeState::Storage::kTokenMajor);
    EXPECT_EQ(parent.byte_size(), total * page);
    EXPECT_EQ(charger->live, total * page);
    std::vector<DecodeState> forks;
    std::vector<StepTensors> news;
    for (int f = 0; f < 8; ++f) {
      forks.push_back(DecodeState::Create(c).value());
      forks.back().set_page_charger(charger);
      ASSERT_TRUE(forks.back().CopyFrom(parent).ok());
      news.push_back(RandomStep(c, 3, 600 + 10 * f));
    }
    // Each fork copied the partly filled last page; the full ones are shared.
    EXPECT_EQ(charger->live, (total + 8) * page);
    EXPECT_EQ(forks[0].shared_bytes(), full * page);
    {
      auto poor = std::make_shared<CountingCharger>();
      poor->limit = 0;
      DecodeState refused = DecodeState::Create(c).value();
      refused.set_page_charger(poor);
      EXPECT_EQ(refused.CopyFrom(parent).code(), absl::StatusCode::kResourceExhausted);
      EXPECT_EQ(refused.byte_size(), 0);
      EXPECT_EQ(poor->live, 0);
    }
    for (int f = 0; f < 8; ++f) {
      Tensor got = Tensor::Create(DType::kF32, {1, 3, c.heads, c.v_dim}).value();
      ASSERT_TRUE(forks[f].Step(news[f].q.cview(), news[f].k.cview(), news[f].v.cview(),
                                got.view(), 2)
                      .ok());
      DecodeState twin = DecodeState::Create(c).value();
      replay({&prompt, &one}, twin);
      Tensor want = Tensor::Create(DType::kF32, {1, 3, c.heads, c.v_dim}).value();
      ASSERT_TRUE(
          twin.Step(news[f].q.cview(), news[f].k.cview(), news[f].v.cview(), want.view(), 2).ok());
      EXPECT_TRUE(SameBytes(got, want)) << "fork " << f;
    }
    // The parent's pages + one copied page per fork, for 9 states.
    EXPECT_EQ(charger->live, (total + 8) * page);
    EXPECT_EQ(forks[0].byte_size(), total * page);
    EXPECT_EQ(forks[0].shared_bytes(), full * page);
    // The parent's next step reads its own (never written) pages.
    StepTensors next = RandomStep(c, 2, 700);
    Tensor got = Tensor::Create(DType::kF32, {1, 2, c.heads, c.v_dim}).value();
    ASSERT_TRUE(parent.Step(next.q.cview(), next.k.cview(), next.v.cview(), got.view(), 2).ok());
    DecodeState twin = DecodeState::Create(c).value();
    replay({&prompt, &one}, twin);
    Tensor want = Tensor::Create(DType::kF32, {1, 2, c.heads, c.v_dim}).value();
    ASSERT_TRUE(twin.Step(next.q.cview(), next.k.cview(), next.v.cview(), want.view(), 2).ok());
    EXPECT_TRUE(SameBytes(got, want));
    // The parent holds its last page alone and writes into it without a copy.
    EXPECT_EQ(charger->live, (total + 8) * page);
    // A fork truncated into a shared page writes its own copy.
    ASSERT_TRUE(forks[1].Truncate(40).ok());
    EXPECT_EQ(forks[1].byte_size(), (40 + P - 1) / P * page);
    StepTensors mid = RandomStep(c, 5, 800);
    replay({&mid}, forks[1]);
    ASSERT_TRUE(parent.Truncate(100).ok());
    Tensor again = Tensor::Create(DType::kF32, {1, 2, c.heads, c.v_dim}).value();
    ASSERT_TRUE(parent.Step(next.q.cview(), next.k.cview(), next.v.cview(), again.view(), 2).ok());
    EXPECT_TRUE(SameBytes(again, want));
    // Export of a fork: the parent's first 40 tokens, then its own 5.
    DecodeState::Exported pe = parent.Export().value();
    DecodeState::Exported fe = forks[1].Export().value();
    const int64_t row = c.kv_heads * c.head_dim * (pe.k.byte_size() / pe.k.num_elements());
    EXPECT_EQ(std::memcmp(pe.k.data<char>(), fe.k.data<char>(), 40 * row), 0);
    EXPECT_NE(std::memcmp(pe.k.data<char>() + 40 * row, fe.k.data<char>() + 40 * row, 5 * row),
              0);
    // A refused charge refuses the step; the state is as it was.
    const int64_t live = charger->live;
    charger->limit = live;
    // 30 tokens from 103 need a new page at either page size.
    StepTensors far = RandomStep(c, 30, 900);
    Tensor o20 = Tensor::Create(DType::kF32, {1, 30, c.heads, c.v_dim}).value();
    const absl::Status refused =
        forks[2].Step(far.q.cview(), far.k.cview(), far.v.cview(), o20.view(), 2);
    EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
    EXPECT_EQ(forks[2].position(), 103);
    charger->limit = int64_t{1} << 40;
    ASSERT_TRUE(forks[2].Step(far.q.cview(), far.k.cview(), far.v.cview(), o20.view(), 2).ok());
    DecodeState twin2 = DecodeState::Create(c).value();
    replay({&prompt, &one, &news[2]}, twin2);
    Tensor w20 = Tensor::Create(DType::kF32, {1, 30, c.heads, c.v_dim}).value();
    ASSERT_TRUE(twin2.Step(far.q.cview(), far.k.cview(), far.v.cview(), w20.view(), 2).ok());
    EXPECT_TRUE(SameBytes(o20, w20));
    // Every page is refunded when its last holder goes.
    forks.clear();
    parent = DecodeState::Create(c).value();
    EXPECT_EQ(charger->live, 0);
  }
}

// A state that starts at an absolute position: RoPE at start + index, and a
// length-dependent rule planned for start + length (transformers' largest
// position + 1), every cached key re-rotated when that changes. Against the
// fp64 chain; 1e-5 relative in f32.
TEST(DecodeStateTest, StartPositionRotatesAtAbsolutePositions) {
  const int64_t start = 999990;
  for (bool dynamic : {false, true}) {
    SCOPED_TRACE(dynamic ? "dynamic NTK" : "default");
    DecodeStateConfig c = BaseConfig();
    c.start_position = start;
    if (dynamic) {
      c.rope->scaling.type = RopeScalingType::kDynamicNtk;
      c.rope->scaling.factor = 2.0;
      c.rope->scaling.original_max_positions = 16;
    }
    DecodeState state = DecodeState::Create(c).value();
    std::vector<double> raw_keys, values;
    int64_t pos = 0;
    uint64_t seed = 70;
    for (int64_t tokens : {3, 1, 2}) {
      StepTensors s = RandomStep(c, tokens, seed += 3);
      Tensor out = Tensor::Create(DType::kF32, {1, tokens, c.heads, c.v_dim}).value();
      ASSERT_TRUE(state.Step(s.q.cview(), s.k.cview(), s.v.cview(), out.view(), 2).ok());
      const std::vector<double> k = ToDoubles(s.k.cview()), v = ToDoubles(s.v.cview());
      raw_keys.insert(raw_keys.end(), k.begin(), k.end());
      values.insert(values.end(), v.begin(), v.end());
      const int64_t len = pos + tokens;
      ref::RotateRefParams r;
      r.head_dim = r.rotary_dim = c.head_dim;
      r.inv_freq = dynamic ? ref::DynamicNtkInvFreq(c.head_dim, 10000.0, 2.0, 16, start + len)
                           : ref::DefaultInvFreq(c.head_dim, 10000.0);
      r.seq = tokens;
      r.heads = c.heads;
      for (int64_t t = 0; t < tokens; ++t) r.positions.push_back(start + pos + t);
      const std::vector<double> q = ref::Rotate(r, ToDoubles(s.q.cview()));
      r.seq = len;
      r.heads = c.kv_heads;
      r.positions.clear();
      for (int64_t t = 0; t < len; ++t) r.positions.push_back(start + t);
      const std::vector<double> keys = ref::Rotate(r, raw_keys);
      const ref::AttentionRefParams p = StepRefParams(c, pos, tokens);
      const ref::AttentionRefResult want = ref::Attention(p, q, keys, values);
      EXPECT_TRUE(AllClose(ToDoubles(out.cview()), want.out, testing::kF32Tol)) << "at " << pos;
      pos = len;
    }
  }
}

// A prefix imported as raw keys, or as the rotated keys another state
// exported, continues exactly as the steps that built it: the next steps'
// answers agree (1e-5 relative in f32, 1e-2 with a bf16 cache), for a fixed
// and a length-dependent rule, on both storages.
TEST(DecodeStateTest, ImportedPrefixContinuesLikeTheStepsThatMadeIt) {
  for (DType kv : {DType::kF32, DType::kBF16}) {
    for (bool dynamic : {false, true}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(kv) << (dynamic ? " dynamic" : " default"));
      DecodeStateConfig c = BaseConfig();
      c.kv_dtype = kv;
      c.start_position = 1000;
      if (dynamic) {
        c.rope->scaling.type = RopeScalingType::kDynamicNtk;
        c.rope->scaling.factor = 4.0;
        c.rope->scaling.original_max_positions = 1004;  // crossed while stepping
      }
      DecodeState a = DecodeState::Create(c).value();
      const int64_t prefix = 7;
      StepTensors pre = RandomStep(c, prefix, 90);
      Tensor pre_out = Tensor::Create(DType::kF32, {1, prefix, c.heads, c.v_dim}).value();
      ASSERT_TRUE(a.Step(pre.q.cview(), pre.k.cview(), pre.v.cview(), pre_out.view(), 1).ok());
      absl::StatusOr<DecodeState::Exported> e = a.Export();
      ASSERT_TRUE(e.ok()) << e.status();
      ASSERT_EQ(e->k.dim(1), prefix);
      DecodeState raw = DecodeState::Create(c).value();
      ASSERT_TRUE(raw.Import(pre.k.cview(), pre.v.cview(), DecodeState::KeyForm::kRaw).ok());
      // Under dynamic NTK the export carries the raw keys the state keeps.
      EXPECT_EQ(e->key_form,
                dynamic ? DecodeState::KeyForm::kRaw : DecodeState::KeyForm::kRotated);
      DecodeState rotated = DecodeState::Create(c).value();
      absl::Status st = rotated.Import(e->k.cview(), e->v.cview(), e->key_form, "prefix.");
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_EQ(raw.position(), prefix);
      const double tol = kv == DType::kF32 ? testing::kF32Tol : testing::kBF16Tol;
      for (int step = 0; step < 3; ++step) {
        StepTensors s = RandomStep(c, 1, 200 + 3 * step);
        std::vector<std::vector<double>> outs;
        for (DecodeState* d : {&a, &raw, &rotated}) {
          Tensor out = Tensor::Create(DType::kF32, {1, 1, c.heads, c.v_dim}).value();
          ASSERT_TRUE(d->Step(s.q.cview(), s.k.cview(), s.v.cview(), out.view(), 1).ok());
          outs.push_back(ToDoubles(out.cview()));
        }
        EXPECT_TRUE(AllClose(outs[1], outs[0], tol)) << "raw import, step " << step;
        // The export moves the same cache: the same answers, bit for bit
        // (bf16 under dynamic NTK differed by ~2e-3 when the export carried
        // rounded rotated keys).
        EXPECT_EQ(outs[2], outs[0]) << "import of the export, step " << step;
      }
    }
  }
}

TEST(DecodeStateTest, ImportIsRefusedWhereItCannotBeExact) {
  DecodeStateConfig c = BaseConfig();
  DecodeState s = DecodeState::Create(c).value();
  StepTensors t = RandomStep(c, 2, 5);
  Tensor out = Tensor::Create(DType::kF32, {1, 2, c.heads, c.v_dim}).value();
  ASSERT_TRUE(s.Step(t.q.cview(), t.k.cview(), t.v.cview(), out.view(), 1).ok());
  EXPECT_EQ(s.Import(t.k.cview(), t.v.cview(), DecodeState::KeyForm::kRaw).code(),
            absl::StatusCode::kFailedPrecondition);
  DecodeState empty = DecodeState::Create(c).value();
  absl::Status st = empty.Import(t.k.cview(), t.q.cview(), DecodeState::KeyForm::kRaw, "prefix.");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("prefix.v"));
  EXPECT_EQ(empty.position(), 0);
  c.max_context = 1;
  DecodeState small = DecodeState::Create(c).value();
  EXPECT_EQ(small.Import(t.k.cview(), t.v.cview(), DecodeState::KeyForm::kRaw).code(),
            absl::StatusCode::kOutOfRange);
  DecodeStateConfig lc = BaseConfig();
  lc.linear = true;
  DecodeState linear = DecodeState::Create(lc).value();
  EXPECT_EQ(linear.Import(t.k.cview(), t.v.cview(), DecodeState::KeyForm::kRaw).code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(linear.Export().status().code(), absl::StatusCode::kUnimplemented);
  c.start_position = -1;
  EXPECT_EQ(DecodeState::Create(c).status().code(), absl::StatusCode::kInvalidArgument);
}

int64_t ResidentBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

// States holding one page each, of 24 different part sizes (each size its
// own arena): resident memory grows by about their parts, not by a 2 MiB
// huge page per arena (measured before: +48 MiB where madvise'd huge pages
// are on, uncharged by the memory budget).
TEST(DecodeStateTest, SmallStatesDoNotPinHugePages) {
  const F32Paged paged;
  std::vector<DecodeState> states;
  const int64_t before = ResidentBytes();
  int64_t parts = 0;
  for (int i = 0; i < 24; ++i) {
    DecodeStateConfig c;
    c.heads = 1;
    c.kv_heads = 1;
    c.head_dim = 1000 + 8 * i;  // parts of 16 tokens x ~4 KiB: sizes no other test uses
    c.v_dim = c.head_dim;
    c.max_context = 16;
    states.push_back(DecodeState::Create(c).value());
    StepTensors t = RandomStep(c, 1, 40 + i);
    Tensor out = Tensor::Create(DType::kF32, {1, 1, 1, c.v_dim}).value();
    ASSERT_TRUE(states.back().Step(t.q.cview(), t.k.cview(), t.v.cview(), out.view(), 1).ok());
    parts += 2 * 16 * c.head_dim * 4;
  }
  const int64_t grown = ResidentBytes() - before;
  EXPECT_LT(grown, parts + (int64_t{8} << 20))
      << "resident memory grew by " << grown / 1024 << " KiB for " << parts / 1024
      << " KiB of parts";
}

// A long session fills a slab (a huge page once full); a one-page
// session's part lands in the next; the long one ends. What stays is that
// part (an earlier version mapped the next slab huge and kept its whole
// 2 MiB, for K and for V, the budget charging one page).
TEST(DecodeStateTest, AHugeSlabLeftWithOnePartGivesTheRestBack) {
  const F32Paged paged;
  DecodeStateConfig c;
  c.heads = 1;
  c.kv_heads = 1;
  c.head_dim = 2000;  // 125 KiB parts, 16 to a slab; a size no other test uses
  c.v_dim = c.head_dim;
  const auto step = [](DecodeState& s, const DecodeStateConfig& cfg, int64_t tokens) {
    StepTensors t = RandomStep(cfg, tokens, 50 + tokens);
    Tensor out = Tensor::Create(DType::kF32, {1, tokens, 1, cfg.v_dim}).value();
    return s.Step(t.q.cview(), t.k.cview(), t.v.cview(), out.view(), 1);
  };
  DecodeStateConfig lc = c;
  lc.max_context = 256;  // 16 pages: one full slab per arena
  {
    // The same long step once before measuring: the threads' scratch
    // buffers, kept between calls, are not what this is about.
    DecodeState warm = DecodeState::Create(lc).value();
    ASSERT_TRUE(step(warm, lc, 256).ok());
  }
  malloc_trim(0);
  const int64_t before = ResidentBytes();
  std::optional<DecodeState> x = DecodeState::Create(lc).value();
  ASSERT_TRUE(step(*x, lc, 256).ok());
  c.max_context = 16;
  DecodeState y = DecodeState::Create(c).value();
  ASSERT_TRUE(step(y, c, 1).ok());
  x.reset();  // the long session ends
  malloc_trim(0);  // the steps' freed buffers are not what this is about
  const int64_t grown = ResidentBytes() - before;
  EXPECT_LT(grown, int64_t{1536} << 10)
      << "resident memory grew by " << grown / 1024 << " KiB holding one 125 KiB page";
  EXPECT_EQ(y.position(), 1);
}

// Sessions of 8 part sizes (8 arenas each for K and V), each one slab's
// worth of pages and one more: resident memory grows by about their parts.
// A new slab used to be mapped with huge pages once its arena held a slab's
// worth of parts, so each arena's second slab, holding one part, was
// resident whole (2 MiB): here ~30 MiB the budget never charged, 128 MiB
// over 64 arenas in an external test. Slabs now become huge pages only
// once full.
TEST(DecodeStateTest, APartlyFilledSlabIsNotAHugePage) {
  const F32Paged paged;
  const auto step = [](DecodeState& s, const DecodeStateConfig& cfg, int64_t tokens) {
    StepTensors t = RandomStep(cfg, tokens, 60 + tokens);
    Tensor out = Tensor::Create(DType::kF32, {1, tokens, 1, cfg.v_dim}).value();
    return s.Step(t.q.cview(), t.k.cview(), t.v.cview(), out.view(), 1);
  };
  const auto config = [](int i) {
    DecodeStateConfig c;
    c.heads = 1;
    c.kv_heads = 1;
    c.head_dim = 3000 + 8 * i;  // ~190 KiB parts, 10 to a slab; sizes no other test uses
    c.v_dim = c.head_dim;
    c.max_context = (int64_t{2} << 20) / (16 * c.head_dim * 4) * 16 + 16;
    return c;
  };
  {
    // The same long steps once before measuring: the threads' scratch
    // buffers, kept between calls, are not what this is about.
    DecodeStateConfig c = config(8);
    DecodeState warm = DecodeState::Create(c).value();
    ASSERT_TRUE(step(warm, c, c.max_context).ok());
  }
  malloc_trim(0);
  const int64_t before = ResidentBytes();
  std::vector<DecodeState> states;
  int64_t parts = 0;
  for (int i = 0; i < 8; ++i) {
    const DecodeStateConfig c = config(i);
    states.push_back(DecodeState::Create(c).value());
    ASSERT_TRUE(step(states.back(), c, c.max_context).ok());
    parts += c.max_context * 2 * c.head_dim * 4;
  }
  malloc_trim(0);
  const int64_t grown = ResidentBytes() - before;
  EXPECT_LT(grown, parts + (int64_t{8} << 20))
      << "resident memory grew by " << grown / 1024 << " KiB for " << parts / 1024
      << " KiB of parts";
}

// A slab becomes a huge page when it fills, once: after a part in it is
// freed (back to 4 KiB pages) a part taken into the hole does not collapse
// it again (a collapse copies 2 MiB under the arena's lock; sessions opening
// and closing paid one each time they plugged the hole).
TEST(DecodeStateTest, ASlabIsCollapsedIntoAHugePageOnce) {
  const F32Paged paged;
  DecodeStateConfig c;
  c.heads = 1;
  c.kv_heads = 1;
  // 125 KiB parts, 16 to a slab. A binary's first 64 part sizes get arenas,
  // later ones plain allocations: the empty ones are forgotten first.
  internal::ForgetEmptyKvPageArenasForTesting();
  c.head_dim = 2000;
  c.v_dim = c.head_dim;
  c.max_context = 16;  // one page each
  const auto one_page = [&](int seed) {
    DecodeState s = DecodeState::Create(c).value();
    StepTensors t = RandomStep(c, 1, seed);
    Tensor out = Tensor::Create(DType::kF32, {1, 1, 1, c.v_dim}).value();
    EXPECT_TRUE(s.Step(t.q.cview(), t.k.cview(), t.v.cview(), out.view(), 1).ok());
    return s;
  };
  const int64_t before = internal::KvSlabCollapses();
  std::vector<DecodeState> states;
  for (int i = 0; i < 16; ++i) states.push_back(one_page(70 + i));
  EXPECT_EQ(internal::KvSlabCollapses(), before + 2);  // the K slab and the V slab
  for (int round = 0; round < 3; ++round) {
    states.erase(states.begin() + 3);  // a hole in each slab
    states.push_back(one_page(80 + round));  // plugged
  }
  EXPECT_EQ(internal::KvSlabCollapses(), before + 2);
}

// Two states take turns, a page each, so every slab (2 MiB) holds one
// 920 KiB part of each and 208 KiB of slack: full, it becomes a huge page,
// slack and all. What is resident is what the pages were charged: each part
// carries half its slab (the parts alone were charged, and the slack, up to
// 1/7 of the KV held, was resident beyond the budget: RSS 283 MiB over it in
// an external test). When one state ends, its slabs' slack goes back with
// its parts (it stayed, charged to no page).
TEST(DecodeStateTest, ACollapsedSlabsSlackIsCharged) {
  const F32Paged paged;
  DecodeStateConfig c;
  c.heads = 1;
  c.kv_heads = 1;
  c.head_dim = 14720;  // 16 x 14720 x 4 = 920 KiB parts, 2 to a slab; a size no other test uses
  c.v_dim = c.head_dim;
  constexpr int64_t kPages = 32;
  c.max_context = kPages * DecodeState::kPageTokens;
  const auto step = [&](DecodeState& s, int seed) {
    StepTensors t = RandomStep(c, DecodeState::kPageTokens, seed);
    Tensor out = Tensor::Create(DType::kF32, {1, DecodeState::kPageTokens, 1, c.v_dim}).value();
    return s.Step(t.q.cview(), t.k.cview(), t.v.cview(), out.view(), 1);
  };
  {
    // The steps' scratch buffers, kept between calls, are not what this is about.
    DecodeState warm = DecodeState::Create(c).value();
    for (int i = 0; i < kPages; ++i) ASSERT_TRUE(step(warm, 90 + i).ok());
  }
  malloc_trim(0);
  const int64_t before = ResidentBytes();
  auto charger = std::make_shared<CountingCharger>();
  auto b_charger = std::make_shared<CountingCharger>();
  DecodeState a = DecodeState::Create(c).value();
  std::optional<DecodeState> b = DecodeState::Create(c).value();
  a.set_page_charger(charger);
  b->set_page_charger(b_charger);
  for (int i = 0; i < kPages; ++i) {
    ASSERT_TRUE(step(a, 100 + i).ok());
    ASSERT_TRUE(step(*b, 200 + i).ok());
  }
  malloc_trim(0);
  int64_t grown = ResidentBytes() - before;
  EXPECT_LE(grown, charger->live + b_charger->live + (int64_t{4} << 20))
      << "resident memory grew by " << grown / 1024 << " KiB for "
      << (charger->live + b_charger->live) / 1024 << " KiB charged";
  b.reset();
  malloc_trim(0);
  grown = ResidentBytes() - before;
  EXPECT_LE(grown, charger->live + (int64_t{4} << 20))
      << "resident memory grew by " << grown / 1024 << " KiB for " << charger->live / 1024
      << " KiB charged";
}

// Pages of 64-byte parts (1 kv head, head_dim 1): what a page holds beside
// its parts (each part's whole 4 KiB page, the Page and its control block,
// its entries in the state's arrays) is charged too. The parts alone were:
// 128 bytes charged for ~420 resident a page (an external test: 96
// sessions, RSS 411 MiB past the budget in use).
TEST(DecodeStateTest, SmallPagesAreChargedWhatTheyHold) {
  const F32Paged paged;
  DecodeStateConfig c;
  c.heads = 1;
  c.kv_heads = 1;
  c.head_dim = 1;
  c.v_dim = 1;
  c.max_context = int64_t{1} << 16;  // 4096 pages of 8 KiB
  const int64_t n = c.max_context;
  Tensor k = RandomTensor(DType::kF32, {1, n, 1, 1}, 300);
  Tensor v = RandomTensor(DType::kF32, {1, n, 1, 1}, 301);
  {
    DecodeState warm = DecodeState::Create(c).value();
    ASSERT_TRUE(warm.Import(k.cview(), v.cview(), DecodeState::KeyForm::kRaw).ok());
  }
  malloc_trim(0);
  const int64_t before = ResidentBytes();
  auto charger = std::make_shared<CountingCharger>();
  DecodeState s = DecodeState::Create(c).value();
  s.set_page_charger(charger);
  ASSERT_TRUE(s.Import(k.cview(), v.cview(), DecodeState::KeyForm::kRaw).ok());
  malloc_trim(0);
  const int64_t grown = ResidentBytes() - before;
  EXPECT_EQ(charger->live, s.byte_size());
  EXPECT_LE(grown, charger->live + (int64_t{1} << 20))
      << "resident memory grew by " << grown / 1024 << " KiB for " << charger->live / 1024
      << " KiB charged";
}

// Pages of two part sizes under 16 KiB (1 KiB and 128 bytes) taken in turn
// by two groups of states, then one group closes: what its pages were
// refunded leaves resident memory. Parts that small were malloc chunks, and
// a freed page's parts were a hole between the other group's live chunks,
// smaller than the 4 KiB page malloc_trim could return (an external test:
// 84 MiB of 183 MiB refunded stayed resident, the budget counting it free).
TEST(DecodeStateTest, SmallPagesRefundedLeaveResidentMemory) {
  const F32Paged paged;
  const auto config = [](int64_t head_dim) {
    DecodeStateConfig c;
    c.heads = 1;
    c.kv_heads = 1;
    c.head_dim = head_dim;
    c.v_dim = head_dim;
    c.max_context = DecodeState::kPageTokens;  // one page each
    return c;
  };
  const DecodeStateConfig big = config(16), tiny = config(2);  // 1 KiB and 128-byte parts
  const int64_t n = DecodeState::kPageTokens;
  const Tensor big_k = RandomTensor(DType::kF32, {1, n, 1, big.head_dim}, 310);
  const Tensor big_v = RandomTensor(DType::kF32, {1, n, 1, big.v_dim}, 311);
  const Tensor tiny_k = RandomTensor(DType::kF32, {1, n, 1, tiny.head_dim}, 312);
  const Tensor tiny_v = RandomTensor(DType::kF32, {1, n, 1, tiny.v_dim}, 313);
  constexpr int kStates = 4096;
  auto big_charger = std::make_shared<CountingCharger>();
  auto tiny_charger = std::make_shared<CountingCharger>();
  std::vector<DecodeState> bigs, tinies;
  for (int i = 0; i < kStates; ++i) {
    bigs.push_back(DecodeState::Create(big).value());
    bigs.back().set_page_charger(big_charger);
    tinies.push_back(DecodeState::Create(tiny).value());
    tinies.back().set_page_charger(tiny_charger);
  }
  for (int i = 0; i < kStates; ++i) {  // the pages in turn
    ASSERT_TRUE(bigs[i].Import(big_k.cview(), big_v.cview(), DecodeState::KeyForm::kRaw).ok());
    ASSERT_TRUE(
        tinies[i].Import(tiny_k.cview(), tiny_v.cview(), DecodeState::KeyForm::kRaw).ok());
  }
  const int64_t refunded = big_charger->live;
  EXPECT_EQ(refunded, kStates * bigs[0].page_bytes());
  malloc_trim(0);
  const int64_t before = ResidentBytes();
  bigs.clear();
  malloc_trim(0);
  const int64_t dropped = before - ResidentBytes();
  EXPECT_EQ(big_charger->live, 0);
  EXPECT_GE(dropped, refunded - (int64_t{1} << 20))
      << "resident memory fell by " << dropped / 1024 << " KiB when " << refunded / 1024
      << " KiB of pages were refunded";
  EXPECT_EQ(tinies.back().position(), n);
}

// A step's finite f32 key beyond bf16's range is refused for a bf16 cache,
// the state unchanged: it was stored as Inf when this step's query scored
// it -Inf (weight 0), and every later step then failed.
TEST(DecodeStateTest, StepRefusesAKeyTheBf16CacheWouldHoldAsInf) {
  DecodeStateConfig c;
  c.heads = 1;
  c.kv_heads = 1;
  c.head_dim = 8;
  c.v_dim = 8;
  c.max_context = 8;
  c.kv_dtype = DType::kBF16;
  DecodeState s = DecodeState::Create(c).value();
  Tensor q = Tensor::Create(DType::kF32, {1, 1, 1, 8}).value();
  Tensor k = Tensor::Create(DType::kF32, {1, 1, 1, 8}).value();
  Tensor v = Tensor::Create(DType::kF32, {1, 1, 1, 8}).value();
  for (int i = 0; i < 8; ++i) {
    q.data<float>()[i] = i == 0 ? -100.0f : 0.0f;
    k.data<float>()[i] = i == 0 ? 3.3999e38f : 0.0f;
    v.data<float>()[i] = 1.0f;
  }
  Tensor out = Tensor::Create(DType::kF32, {1, 1, 1, 8}).value();
  absl::Status st = s.Step(q.cview(), k.cview(), v.cview(), out.view(), 1, nullptr, "step.");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(), HasSubstr("step.k (rounded to the bf16 cache)"));
  EXPECT_EQ(s.position(), 0);
  k.data<float>()[0] = 1.0f;
  ASSERT_TRUE(s.Step(q.cview(), k.cview(), v.cview(), out.view(), 1, nullptr, "step.").ok());
  EXPECT_EQ(s.position(), 1);
}

// Under a length-dependent rule every cached key is rotated again when the
// frequencies change. A key some rotation of which leaves the cache's range
// is refused when it arrives (step or import), naming it; it was stored and
// later re-rotated to Inf, failing a later step with an overflow blamed on
// that step's inputs. A key whose every rotation fits goes through
// re-rotation and the steps stay finite.
TEST(DecodeStateTest, LengthDependentRopeRefusesKeysSomeRotationOfWhichOverflows) {
  for (DType kv : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(kv));
    DecodeStateConfig c;
    c.heads = 1;
    c.kv_heads = 1;
    c.head_dim = 4;
    c.v_dim = 4;
    c.max_context = 64;
    c.kv_dtype = kv;
    RopeConfig rope;
    rope.head_dim = 4;
    rope.scaling.type = RopeScalingType::kDynamicNtk;
    rope.scaling.factor = 2.0;
    rope.scaling.original_max_positions = 4;
    c.rope = rope;
    auto step = [&](DecodeState& s, int64_t tokens, float k1, float k3) {
      Tensor q = Tensor::Create(DType::kF32, {1, tokens, 1, 4}).value();
      Tensor k = Tensor::Create(DType::kF32, {1, tokens, 1, 4}).value();
      Tensor v = Tensor::Create(DType::kF32, {1, tokens, 1, 4}).value();
      for (int64_t i = 0; i < tokens * 4; ++i) {
        q.data<float>()[i] = 1e-30f;
        k.data<float>()[i] = 0.5f;
        v.data<float>()[i] = 1.0f;
      }
      // Channels 1 and 3 are one rotated pair (half split) of the last token.
      k.data<float>()[(tokens - 1) * 4 + 1] = k1;
      k.data<float>()[(tokens - 1) * 4 + 3] = k3;
      Tensor out = Tensor::Create(DType::kF32, {1, tokens, 1, 4}).value();
      absl::Status st = s.Step(q.cview(), k.cview(), v.cview(), out.view(), 1, nullptr, "step.");
      if (st.ok()) {
        for (int64_t i = 0; i < tokens * 4; ++i) EXPECT_TRUE(std::isfinite(out.data<float>()[i]));
      }
      return st;
    };
    DecodeState s = DecodeState::Create(c).value();
    // Each fits as given, their pair's norm (4.5e38) does not.
    absl::Status st = step(s, 4, 3.4e38f, 3e38f);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(st.message(), HasSubstr("step.k[0, 3, 0, 1] and [0, 3, 0, 3]")) << st;
    EXPECT_THAT(st.message(), HasSubstr("dynamic"));
    EXPECT_EQ(s.position(), 0);
    // Norm 2.8e38: every rotation fits; re-rotated past 4 tokens, and again.
    ASSERT_TRUE(step(s, 4, 2e38f, 2e38f).ok());
    ASSERT_TRUE(step(s, 40, 0.5f, 0.5f).ok());
    ASSERT_TRUE(step(s, 1, 0.5f, 0.5f).ok());
    EXPECT_EQ(s.position(), 45);
    // LongRoPE with attention_factor 0.5: the same pair (norm 4.5e38) times
    // 0.5 fits every rotation, and is taken.
    {
      DecodeStateConfig lc = c;
      RopeConfig lr = rope;
      lr.scaling = RopeScaling();
      lr.scaling.type = RopeScalingType::kLongRope;
      lr.scaling.original_max_positions = 4;
      lr.scaling.attention_factor = 0.5;
      lr.scaling.short_factor = {1.0, 1.0};
      lr.scaling.long_factor = {2.0, 2.0};
      lc.rope = lr;
      DecodeState l = DecodeState::Create(lc).value();
      absl::Status taken = step(l, 4, 3.4e38f, 3e38f);
      EXPECT_TRUE(taken.ok()) << taken;
    }
    // Import: the same refusal for a prefix.
    DecodeState t = DecodeState::Create(c).value();
    Tensor k = Tensor::Create(DType::kF32, {1, 2, 1, 4}).value();
    Tensor v = Tensor::Create(DType::kF32, {1, 2, 1, 4}).value();
    for (int i = 0; i < 8; ++i) k.data<float>()[i] = v.data<float>()[i] = 1.0f;
    k.data<float>()[4 + 0] = 3.4e38f;
    k.data<float>()[4 + 2] = 3e38f;
    st = t.Import(k.cview(), v.cview(), DecodeState::KeyForm::kRaw, "prefix.");
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(st.message(), HasSubstr("prefix.k[0, 1, 0, 0] and [0, 1, 0, 2]"));
    EXPECT_EQ(t.position(), 0);
  }
}

// Finite prefix keys that leave the float range when rotated, and finite f32
// values beyond bf16's range for a bf16 cache, are refused naming the
// tensor, the state left empty. They were stored as Inf (every later step
// then failed on them).
TEST(DecodeStateTest, ImportRefusesWhatWouldBeStoredAsInf) {
  for (DType kv : {DType::kF32, DType::kBF16}) {
    for (bool int8 : {false, true}) {
      if (int8 && kv == DType::kBF16) continue;
      SCOPED_TRACE(::testing::Message() << DTypeName(kv) << (int8 ? " int8" : ""));
      DecodeStateConfig c = BaseConfig();
      c.kv_dtype = kv;
      c.int8_kv = int8;
      c.start_position = 3;  // a rotation that mixes the pair's channels
      StepTensors t = RandomStep(c, 2, 9);
      Tensor& k = t.k;
      float* kf = k.data<float>();
      for (int64_t i = 0; i < k.num_elements(); ++i) kf[i] = (i % 2 == 0 ? 3e38f : -3e38f);
      DecodeState s = DecodeState::Create(c).value();
      absl::Status st = s.Import(k.cview(), t.v.cview(), DecodeState::KeyForm::kRaw, "prefix.");
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_THAT(st.message(), HasSubstr("prefix.k (rotated at its positions)"));
      EXPECT_EQ(s.position(), 0);
    }
  }
  // 3.39e38 is a finite f32 that rounds to Inf in bf16.
  DecodeStateConfig c = BaseConfig();
  c.kv_dtype = DType::kBF16;
  StepTensors t = RandomStep(c, 2, 10);
  Tensor& v = t.v;
  v.data<float>()[5] = 3.3999e38f;
  DecodeState s = DecodeState::Create(c).value();
  absl::Status st = s.Import(t.k.cview(), v.cview(), DecodeState::KeyForm::kRaw, "prefix.");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(), HasSubstr("prefix.v (rounded to the bf16 cache)"));
  EXPECT_EQ(s.position(), 0);
  v.data<float>()[5] = 3.3e38f;  // rounds to bf16's largest finite: stored
  ASSERT_TRUE(s.Import(t.k.cview(), v.cview(), DecodeState::KeyForm::kRaw, "prefix.").ok());
  EXPECT_EQ(s.position(), 2);
}

}  // namespace
}  // namespace ropeattn

// ------------------------------------------------------- int8 KV states --

namespace ropeattn {
namespace {

// An int8 state, steps of 1, 5 and 20 tokens (decode and prefill paths):
// each answer is the fp64 attention of the rotated queries over the values
// the state stores (its export: scale * q), within f32 tolerance; and every
// stored key is within half a quantization step (max|row| / 254) of the
// fp64-rotated key: quantized after rotation. Head-major pages (AVX-512
// kernels off) and, where the machine has AVX-512, tile pages (on).
TEST(Int8DecodeStateTest, StepsAreExactOverTheStoredValues) {
  for (const bool avx512 : {false, true})
  for (const int64_t v_dim : {32, 20}) {  // 20: a partial last vector of V
  SCOPED_TRACE(absl::StrCat("v_dim ", v_dim, avx512 ? " avx512" : ""));
  const bool previous = internal::SetAvx512KernelsForTesting(avx512);
  absl::Cleanup restore = [previous] { internal::SetAvx512KernelsForTesting(previous); };
  DecodeStateConfig c = BaseConfig();
  c.int8_kv = true;
  c.v_dim = v_dim;
  DecodeState state = DecodeState::Create(c).value();
  EXPECT_EQ(state.storage(), avx512 && KvCacheDecodeIsFaster() ? DecodeState::Storage::kInt8Tiles
                                                               : DecodeState::Storage::kInt8);
  std::vector<double> rotated_keys, values;
  int64_t pos = 0;
  uint64_t seed = 140;
  for (int64_t tokens : {1, 5, 20}) {
    StepTensors s = RandomStep(c, tokens, seed += 3);
    Tensor out = Tensor::Create(DType::kF32, {1, tokens, c.heads, c.v_dim}).value();
    ASSERT_TRUE(state.Step(s.q.cview(), s.k.cview(), s.v.cview(), out.view(), 2).ok());
    ref::RotateRefParams r;
    r.seq = tokens;
    r.head_dim = r.rotary_dim = c.head_dim;
    r.inv_freq = ref::DefaultInvFreq(c.head_dim, 10000.0);
    for (int64_t t = 0; t < tokens; ++t) r.positions.push_back(pos + t);
    r.heads = c.heads;
    const std::vector<double> q = ref::Rotate(r, ToDoubles(s.q.cview()));
    r.heads = c.kv_heads;
    const std::vector<double> k = ref::Rotate(r, ToDoubles(s.k.cview()));
    const std::vector<double> v = ToDoubles(s.v.cview());
    rotated_keys.insert(rotated_keys.end(), k.begin(), k.end());
    values.insert(values.end(), v.begin(), v.end());
    const int64_t len = pos + tokens;
    absl::StatusOr<DecodeState::Exported> e = state.Export();
    ASSERT_TRUE(e.ok()) << e.status();
    const std::vector<double> stored_k = ToDoubles(e->k.cview()), stored_v = ToDoubles(e->v.cview());
    ASSERT_EQ(stored_k.size(), rotated_keys.size());
    for (const auto& [stored, exact, dim] :
         {std::make_tuple(&stored_k, &rotated_keys, c.head_dim),
          std::make_tuple(&stored_v, &values, c.v_dim)}) {
      for (size_t row = 0; row * dim < exact->size(); ++row) {
        double m = 0;
        for (int64_t x = 0; x < dim; ++x) m = std::max(m, std::fabs((*exact)[row * dim + x]));
        for (int64_t x = 0; x < dim; ++x) {
          ASSERT_LE(std::fabs((*stored)[row * dim + x] - (*exact)[row * dim + x]),
                    m / 254.0 * 1.001 + 1e-6)
              << "row " << row << " channel " << x;
        }
      }
    }
    const ref::AttentionRefParams p = StepRefParams(c, pos, tokens);
    const ref::AttentionRefResult want = ref::Attention(p, q, stored_k, stored_v);
    EXPECT_TRUE(AllClose(ToDoubles(out.cview()), want.out, testing::kF32Tol)) << "at " << pos;
    pos = len;
  }
  }
}

// Fork, truncate and batching keep an int8 state's answers bit for bit
// (head-major and tile pages).
TEST(Int8DecodeStateTest, ForkTruncateAndBatchAreExact) {
  for (const bool avx512 : {false, true}) {
  SCOPED_TRACE(avx512 ? "avx512" : "avx2");
  const bool previous = internal::SetAvx512KernelsForTesting(avx512);
  absl::Cleanup restore = [previous] { internal::SetAvx512KernelsForTesting(previous); };
  DecodeStateConfig c = BaseConfig();
  c.int8_kv = true;
  DecodeState a = DecodeState::Create(c).value();
  StepTensors first = RandomStep(c, 9, 300);
  Tensor out = Tensor::Create(DType::kF32, {1, 9, c.heads, c.v_dim}).value();
  ASSERT_TRUE(a.Step(first.q.cview(), first.k.cview(), first.v.cview(), out.view(), 2).ok());
  DecodeState b = DecodeState::Create(c).value();
  ASSERT_TRUE(b.CopyFrom(a).ok());
  StepTensors next = RandomStep(c, 1, 310);
  Tensor oa = Tensor::Create(DType::kF32, {1, 1, c.heads, c.v_dim}).value();
  Tensor ob = Tensor::Create(DType::kF32, {1, 1, c.heads, c.v_dim}).value();
  ASSERT_TRUE(a.Step(next.q.cview(), next.k.cview(), next.v.cview(), oa.view(), 2).ok());
  ASSERT_TRUE(b.Step(next.q.cview(), next.k.cview(), next.v.cview(), ob.view(), 2).ok());
  EXPECT_TRUE(SameBytes(oa, ob));
  // Truncated back and stepped again: the same answer as the first time.
  ASSERT_TRUE(a.Truncate(9).ok());
  Tensor again = Tensor::Create(DType::kF32, {1, 1, c.heads, c.v_dim}).value();
  ASSERT_TRUE(a.Step(next.q.cview(), next.k.cview(), next.v.cview(), again.view(), 2).ok());
  EXPECT_TRUE(SameBytes(oa, again));
  // Batched with an f32 state: each as alone.
  ASSERT_TRUE(a.Truncate(9).ok());
  DecodeStateConfig cf = BaseConfig();
  DecodeState f = DecodeState::Create(cf).value();
  Tensor of_solo = Tensor::Create(DType::kF32, {1, 1, c.heads, c.v_dim}).value();
  ASSERT_TRUE(f.Step(next.q.cview(), next.k.cview(), next.v.cview(), of_solo.view(), 2).ok());
  ASSERT_TRUE(f.Truncate(0).ok());
  Tensor o_int8 = Tensor::Create(DType::kF32, {1, 1, c.heads, c.v_dim}).value();
  Tensor o_f32 = Tensor::Create(DType::kF32, {1, 1, c.heads, c.v_dim}).value();
  std::vector<DecodeState::Job> jobs(2);
  jobs[0] = {&a, next.q.cview(), next.k.cview(), next.v.cview(), o_int8.view()};
  jobs[1] = {&f, next.q.cview(), next.k.cview(), next.v.cview(), o_f32.view()};
  DecodeState::StepMany(absl::MakeSpan(jobs), 2, 2);
  ASSERT_TRUE(jobs[0].status.ok()) << jobs[0].status;
  ASSERT_TRUE(jobs[1].status.ok()) << jobs[1].status;
  EXPECT_TRUE(SameBytes(o_int8, oa));
  EXPECT_TRUE(SameBytes(o_f32, of_solo));
  }
}

// An int8 state without RoPE (odd head dims allowed), GQA (3 query heads
// per kv head), sliding windows, steps of 1 to 31 tokens (partial tiles,
// and the prefill path's gather): each answer is the fp64 attention over
// the stored values (the export) within f32 tolerance. Pages created with
// the AVX-512 kernels on (tile pages where the machine has AVX-512), read
// with them on and, to check the tile kernels' AVX2 versions on int8, off.
TEST(Int8DecodeStateTest, OddShapesAndWindowsAreExactOverTheStoredValues) {
  for (const bool avx512_reads : {true, false})
  for (const int64_t head_dim : {37, 64, 1})
  for (const int64_t v_dim : {20, 17, 1, 130})
  for (const int64_t window : {0, 5, 40}) {
    if (!avx512_reads && (head_dim == 1 || v_dim == 1 || window == 5)) continue;
    SCOPED_TRACE(absl::StrCat("head_dim ", head_dim, " v_dim ", v_dim, " window ", window,
                              avx512_reads ? "" : " avx2 reads"));
    const bool previous = internal::SetAvx512KernelsForTesting(true);
    absl::Cleanup restore = [previous] { internal::SetAvx512KernelsForTesting(previous); };
    DecodeStateConfig c;
    c.heads = 6;
    c.kv_heads = 2;
    c.head_dim = head_dim;
    c.v_dim = v_dim;
    c.max_context = 200;
    c.int8_kv = true;
    c.attention.window = window;
    DecodeState state = DecodeState::Create(c).value();
    EXPECT_EQ(state.storage(), KvCacheDecodeIsFaster() ? DecodeState::Storage::kInt8Tiles
                                                       : DecodeState::Storage::kInt8);
    internal::SetAvx512KernelsForTesting(avx512_reads);
    int64_t pos = 0;
    uint64_t seed = 1000;
    for (int64_t tokens : {1, 3, 20, 1, 17, 2, 31, 1}) {
      Tensor q = RandomTensor(DType::kF32, {1, tokens, c.heads, c.head_dim}, seed += 3);
      Tensor k = RandomTensor(DType::kF32, {1, tokens, c.kv_heads, c.head_dim}, seed + 1);
      Tensor v = RandomTensor(DType::kF32, {1, tokens, c.kv_heads, c.v_dim}, seed + 2);
      Tensor out = Tensor::Create(DType::kF32, {1, tokens, c.heads, c.v_dim}).value();
      ASSERT_TRUE(state.Step(q.cview(), k.cview(), v.cview(), out.view(), 2).ok());
      absl::StatusOr<DecodeState::Exported> e = state.Export();
      ASSERT_TRUE(e.ok()) << e.status();
      const ref::AttentionRefParams p = StepRefParams(c, pos, tokens);
      const ref::AttentionRefResult want =
          ref::Attention(p, ToDoubles(q.cview()), ToDoubles(e->k.cview()), ToDoubles(e->v.cview()));
      EXPECT_TRUE(AllClose(ToDoubles(out.cview()), want.out, testing::kF32Tol))
          << "at " << pos << ", " << tokens << " tokens";
      pos += tokens;
    }
  }
}

// A fork inside a page (40 tokens) and one truncated into the shared first
// page (10), then parent and forks write different tokens: each answers as
// a twin that never shared anything, bit for bit; and an export imported
// into a new state exports the same bytes.
TEST(Int8DecodeStateTest, ForksWritingIntoASharedPageStayExact) {
  DecodeStateConfig c;
  c.heads = 6;
  c.kv_heads = 2;
  c.head_dim = 32;
  c.v_dim = 24;
  c.max_context = 200;
  c.int8_kv = true;
  auto step = [&](DecodeState& s, uint64_t seed, int64_t tokens) {
    Tensor q = RandomTensor(DType::kF32, {1, tokens, c.heads, c.head_dim}, seed);
    Tensor k = RandomTensor(DType::kF32, {1, tokens, c.kv_heads, c.head_dim}, seed + 1);
    Tensor v = RandomTensor(DType::kF32, {1, tokens, c.kv_heads, c.v_dim}, seed + 2, -50, 50);
    Tensor out = Tensor::Create(DType::kF32, {1, tokens, c.heads, c.v_dim}).value();
    EXPECT_TRUE(s.Step(q.cview(), k.cview(), v.cview(), out.view(), 2).ok());
    return out;
  };
  DecodeState parent = DecodeState::Create(c).value();
  step(parent, 10, 40);
  DecodeState fork = DecodeState::Create(c).value();
  ASSERT_TRUE(fork.CopyFrom(parent).ok());
  DecodeState cut = DecodeState::Create(c).value();
  ASSERT_TRUE(cut.CopyFrom(parent).ok());
  ASSERT_TRUE(cut.Truncate(10).ok());
  const Tensor from_cut = step(cut, 77, 3);
  const Tensor from_fork = step(fork, 50, 3);
  const Tensor parent_a = step(parent, 60, 3);
  const Tensor parent_b = step(parent, 70, 1);
  DecodeState twin = DecodeState::Create(c).value();
  step(twin, 10, 40);
  DecodeState twin_fork = DecodeState::Create(c).value();
  ASSERT_TRUE(twin_fork.CopyFrom(twin).ok());
  DecodeState twin_cut = DecodeState::Create(c).value();
  ASSERT_TRUE(twin_cut.CopyFrom(twin).ok());
  ASSERT_TRUE(twin_cut.Truncate(10).ok());
  EXPECT_TRUE(SameBytes(step(twin, 60, 3), parent_a));
  EXPECT_TRUE(SameBytes(step(twin, 70, 1), parent_b));
  EXPECT_TRUE(SameBytes(step(twin_fork, 50, 3), from_fork));
  EXPECT_TRUE(SameBytes(step(twin_cut, 77, 3), from_cut));
  const DecodeState::Exported e = parent.Export().value();
  DecodeState imported = DecodeState::Create(c).value();
  ASSERT_TRUE(imported.Import(e.k.cview(), e.v.cview(), e.key_form).ok());
  const DecodeState::Exported again = imported.Export().value();
  EXPECT_TRUE(SameBytes(e.k, again.k));
  EXPECT_TRUE(SameBytes(e.v, again.v));
}

TEST(Int8DecodeStateTest, HoldsInt8RowsAndScalesAndRefusesWhatItCannotDoExactly) {
  DecodeStateConfig c = BaseConfig();
  c.max_context = 1024;
  c.int8_kv = true;
  // Pages are allocated as tokens arrive: none at first, then 63 pages of
  // 16 tokens (32 pages of 32 in tiles) for 1000 tokens, each int8 codes and
  // one f32 scale per (token, kv head), for K and V.
  DecodeState i8 = DecodeState::Create(c).value();
  EXPECT_EQ(i8.byte_size(), 0);
  StepTensors prefix = RandomStep(c, 1000, 31);
  ASSERT_TRUE(i8.Import(prefix.k.cview(), prefix.v.cview(), DecodeState::KeyForm::kRaw).ok());
  const int64_t P8 = DecodeState::PageTokensOf(i8.storage());
  EXPECT_EQ(P8, i8.storage() == DecodeState::Storage::kInt8Tiles ? KvCache::kTile : 16);
  EXPECT_EQ(i8.page_bytes(), KvPageHeldBytes(P8 * c.kv_heads * (c.head_dim + 4),
                                             P8 * c.kv_heads * (c.v_dim + 4)));
  EXPECT_EQ(i8.byte_size(), (1000 + P8 - 1) / P8 * i8.page_bytes());
  c.int8_kv = false;
  c.kv_dtype = DType::kBF16;
  DecodeState bf16 = DecodeState::Create(c).value();
  ASSERT_TRUE(bf16.Import(prefix.k.cview(), prefix.v.cview(), DecodeState::KeyForm::kRaw).ok());
  // 16-token rows, or 32-token tile pages where the machine has AVX-512.
  const int64_t P = DecodeState::PageTokensOf(bf16.storage());
  EXPECT_EQ(bf16.byte_size(), (1000 + P - 1) / P *
                                  KvPageHeldBytes(P * c.kv_heads * c.head_dim * 2,
                                                  P * c.kv_heads * c.v_dim * 2));
  // Parts under 16 KiB take whole 4 KiB pages: at these sizes (1-2 KiB
  // parts) int8 holds what bf16 does, though its parts are smaller.
  EXPECT_LE(i8.byte_size(), bf16.byte_size());

  c = BaseConfig();
  c.int8_kv = true;
  c.linear = true;
  EXPECT_EQ(DecodeState::Create(c).status().code(), absl::StatusCode::kInvalidArgument);
  c.linear = false;
  c.kv_dtype = DType::kBF16;
  EXPECT_EQ(DecodeState::Create(c).status().code(), absl::StatusCode::kInvalidArgument);
  c.kv_dtype = DType::kF32;
  c.rope->scaling.type = RopeScalingType::kDynamicNtk;
  c.rope->scaling.factor = 2.0;
  c.rope->scaling.original_max_positions = 16;
  const absl::Status s = DecodeState::Create(c).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), ::testing::HasSubstr("dynamic"));
}

// Uniform [-1, 1) samples turned standard normal (Box-Muller on pairs).
void MakeStandardNormal(Tensor& t) {
  float* x = t.data<float>();
  const int64_t n = t.num_elements();
  for (int64_t i = 0; i + 1 < n; i += 2) {
    const double u1 = std::max(1e-12, (static_cast<double>(x[i]) + 1.0) / 2.0);
    const double u2 = (static_cast<double>(x[i + 1]) + 1.0) / 2.0;
    const double r = std::sqrt(-2.0 * std::log(u1));
    x[i] = static_cast<float>(r * std::cos(2.0 * M_PI * u2));
    x[i + 1] = static_cast<float>(r * std::sin(2.0 * M_PI * u2));
  }
}

// The error table of the issue: f32, bf16 and int8 caches against the fp64
// attention of the unquantized inputs, on random inputs and on structured
// ones (an outlier channel at 20x in every key and value, and keys with a
// large common offset before rotation), at positions near 1e3 and 1e6, with
// q, k, v uniform in [-1, 1) and standard normal (larger logits: the error
// grows with them, as quantizing a key moves its logit by up to |q| times
// half its scale per channel). Error: max |out - ref| / max |ref| over a
// 64-token prefill and 8 single steps. Bounds asserted (uniform / normal):
// f32 1e-5 / 1e-5, bf16 2e-2 / 1e-1, int8 8e-2 / 5e-1.
TEST(Int8DecodeStateTest, ErrorTableAgainstFp64) {
  struct Kind {
    const char* name;
    DType kv_dtype;
    bool int8;
    double bound, normal_bound;
  };
  const Kind kinds[] = {{"f32", DType::kF32, false, 1e-5, 1e-5},
                        {"bf16", DType::kBF16, false, 2e-2, 1e-1},
                        {"int8", DType::kF32, true, 8e-2, 5e-1}};
  for (bool normal : {false, true})
  for (bool structured : {false, true}) {
    for (int64_t start : {int64_t{1000}, int64_t{1000000}}) {
      std::string line = absl::StrCat(normal ? "normal " : "uniform ",
                                      structured ? "structured" : "random", " start ", start, ":");
      for (const Kind& kind : kinds) {
        DecodeStateConfig c = BaseConfig();
        c.head_dim = c.v_dim = 64;
        c.rope->head_dim = 64;
        c.rope->theta = 500000;
        c.max_context = 128;
        c.start_position = start;
        c.kv_dtype = kind.kv_dtype;
        c.int8_kv = kind.int8;
        DecodeState state = DecodeState::Create(c).value();
        std::vector<double> keys, values;
        double worst = 0;
        int64_t pos = 0;
        uint64_t seed = 900;
        for (int64_t tokens : {64, 1, 1, 1, 1, 1, 1, 1, 1}) {
          StepTensors s = RandomStep(c, tokens, seed += 3);
          if (normal) {
            for (Tensor* t : {&s.q, &s.k, &s.v}) MakeStandardNormal(*t);
          }
          if (structured) {
            float* k = s.k.data<float>();
            float* v = s.v.data<float>();
            for (int64_t row = 0; row < tokens * c.kv_heads; ++row) {
              k[row * c.head_dim + 5] *= 20.0f;
              v[row * c.v_dim + 9] *= 20.0f;
              for (int64_t x = 0; x < c.head_dim; ++x) k[row * c.head_dim + x] += 3.0f;
            }
          }
          Tensor out = Tensor::Create(DType::kF32, {1, tokens, c.heads, c.v_dim}).value();
          ASSERT_TRUE(state.Step(s.q.cview(), s.k.cview(), s.v.cview(), out.view(), 2).ok());
          ref::RotateRefParams r;
          r.seq = tokens;
          r.head_dim = r.rotary_dim = c.head_dim;
          r.inv_freq = ref::DefaultInvFreq(c.head_dim, 500000.0);
          for (int64_t t = 0; t < tokens; ++t) r.positions.push_back(start + pos + t);
          r.heads = c.heads;
          const std::vector<double> q = ref::Rotate(r, ToDoubles(s.q.cview()));
          r.heads = c.kv_heads;
          const std::vector<double> k = ref::Rotate(r, ToDoubles(s.k.cview()));
          const std::vector<double> v = ToDoubles(s.v.cview());
          keys.insert(keys.end(), k.begin(), k.end());
          values.insert(values.end(), v.begin(), v.end());
          const ref::AttentionRefParams p = StepRefParams(c, pos, tokens);
          const ref::AttentionRefResult want = ref::Attention(p, q, keys, values);
          const std::vector<double> got = ToDoubles(out.cview());
          double err = 0, mag = 0;
          for (size_t i = 0; i < got.size(); ++i) {
            err = std::max(err, std::fabs(got[i] - want.out[i]));
            mag = std::max(mag, std::fabs(want.out[i]));
          }
          worst = std::max(worst, err / mag);
          pos += tokens;
        }
        absl::StrAppend(&line, " ", kind.name, " ", absl::StrFormat("%.1e", worst));
        EXPECT_LE(worst, normal ? kind.normal_bound : kind.bound)
            << kind.name << (normal ? " normal" : " uniform")
            << (structured ? " structured" : " random") << " start " << start;
      }
      std::printf("kv error table: %s\n", line.c_str());
    }
  }
}


// The process's memory mappings.
int64_t Mappings() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int64_t n = 0;
  while (std::getline(maps, line)) ++n;
  return n;
}

// Parts of any size up to a slab come from arenas (their slots page-
// rounded, so every size has one): past 64 sizes each part was its own
// mmap, and two groups of states taking pages in turn, one then freed, left
// a mapping per live part; ~65k of them reach vm.max_map_count (65530),
// past which every mmap and malloc of the process fails. Here 40 sizes of
// 16 KiB and more are taken first (as other sessions would), then 2 x 2048
// one-page states of another size; freeing one group must not leave a
// mapping per live part.
TEST(DecodeStateTest, PartsOfManySizesShareArenasNotAMappingEach) {
  const F32Paged paged;
  const auto config = [](int64_t head_dim) {
    DecodeStateConfig c;
    c.heads = 1;
    c.kv_heads = 1;
    c.head_dim = head_dim;
    c.v_dim = head_dim;
    c.max_context = DecodeState::kPageTokens;  // one page each
    return c;
  };
  const int64_t n = DecodeState::kPageTokens;
  std::vector<DecodeState> fill;
  for (int i = 0; i < 40; ++i) {
    const DecodeStateConfig c = config(256 + 2 * i);
    const Tensor k = RandomTensor(DType::kF32, {1, n, 1, c.head_dim}, 400 + i);
    fill.push_back(DecodeState::Create(c).value());
    ASSERT_TRUE(fill.back().Import(k.cview(), k.cview(), DecodeState::KeyForm::kRaw).ok());
  }
  const DecodeStateConfig c = config(334);  // parts of 21376 bytes
  const Tensor k = RandomTensor(DType::kF32, {1, n, 1, c.head_dim}, 500);
  constexpr int kStates = 2048;
  std::vector<DecodeState> a, b;
  for (int i = 0; i < kStates; ++i) {
    a.push_back(DecodeState::Create(c).value());
    ASSERT_TRUE(a.back().Import(k.cview(), k.cview(), DecodeState::KeyForm::kRaw).ok());
    b.push_back(DecodeState::Create(c).value());
    ASSERT_TRUE(b.back().Import(k.cview(), k.cview(), DecodeState::KeyForm::kRaw).ok());
  }
  const int64_t before = Mappings();
  b.clear();
  const int64_t grown = Mappings() - before;
  EXPECT_LT(grown, kStates / 8) << grown << " more mappings for " << kStates << " live states";
}

}  // namespace
}  // namespace ropeattn
