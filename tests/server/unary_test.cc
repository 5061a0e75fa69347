// The stateless handlers (RunAttend, RunEncode) and the wire conversions,
// called directly: every attention feature and every Encode op against the
// fp64 references in tests/reference/, and the bad-input matrix with exact
// status codes. The UnaryRpcTest suite at the end repeats a few cases through
// a real server on a loopback port.
//
// Tolerances (relative, norm-wise, tests/core/test_util.h): f32 results
// within kF32Tol = 1e-5 of the fp64 reference; anything that passes through
// bf16 (inputs, rotated keys, outputs) within kBF16Tol = 1e-2.
//
// Wire tensors are built and read here with plain memcpy, not with the
// convert.h functions under test, so a bug there cannot cancel out.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/convert.h"
#include "server/handlers.h"
#include "tests/core/test_util.h"
#include "tests/reference/attention_ref.h"
#include "tests/reference/encodings_ref.h"
#include "tests/reference/relative_bias_ref.h"
#include "tests/reference/rope_ref.h"
#include "tests/server/server_test_util.h"

namespace ropeattn::server {
namespace {

using ::ropeattn::testing::AllClose;
using ::ropeattn::testing::kBF16Tol;
using ::ropeattn::testing::kF32Tol;
using ::ropeattn::testing::RandomTensor;
using ::ropeattn::testing::ToDoubles;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kThreads = 2;

// --- Wire helpers independent of convert.cc ---

v1::Tensor Wire(const Tensor& t) {
  v1::Tensor w;
  w.set_dtype(t.dtype() == DType::kF32 ? v1::DTYPE_F32 : v1::DTYPE_BF16);
  for (int64_t d : t.dims()) w.add_shape(d);
  w.set_data(std::string(t.data<char>(), t.byte_size()));
  return w;
}

std::vector<double> Doubles(const v1::Tensor& w) {
  std::vector<double> out;
  const std::string& b = w.data();
  if (w.dtype() == v1::DTYPE_F32) {
    for (size_t i = 0; i + 4 <= b.size(); i += 4) {
      float f;
      std::memcpy(&f, b.data() + i, 4);
      out.push_back(f);
    }
  } else {
    for (size_t i = 0; i + 2 <= b.size(); i += 2) {
      uint16_t h;
      std::memcpy(&h, b.data() + i, 2);
      out.push_back(BF16ToFloat(h));
    }
  }
  return out;
}

std::vector<int64_t> Shape(const v1::Tensor& w) { return {w.shape().begin(), w.shape().end()}; }

// --- Attend against the reference ---

// What the reference rotates q and k with: the frequencies the test derives
// from the rule's own reference function, not from the server.
struct RopeRef {
  std::vector<double> inv_freq;
  double attention_factor = 1.0;
  int64_t rotary_dim = 0;  // 0: head_dim
  bool interleaved = false;
};

struct AttendCase {
  int64_t batch = 1, q_len = 1, k_len = 1, heads = 1, kv_heads = 0, head_dim = 8, v_dim = 8;
  DType q_dtype = DType::kF32;
  DType kv_dtype = DType::kF32;
  v1::DType out_dtype = v1::DTYPE_UNSPECIFIED;
  // heads / kv_heads / head_dim are filled in from the fields above.
  v1::AttentionSpec spec;
  std::vector<int64_t> q_offsets;
  std::vector<int64_t> key_lengths;
  std::vector<int64_t> q_positions, k_positions;  // explicit, per token
  bool return_probs = false;
  std::optional<RopeRef> rope;
  // Bias fields of the reference (the rest is filled in from the case).
  ref::AttentionRefParams ref_bias;
  uint64_t seed = 1;
};

std::vector<double> RefRotate(const RopeRef& r, const std::vector<double>& x, int64_t batch,
                              int64_t seq, int64_t heads, int64_t head_dim,
                              std::vector<int64_t> positions) {
  ref::RotateRefParams p;
  p.batch = batch;
  p.seq = seq;
  p.heads = heads;
  p.head_dim = head_dim;
  p.rotary_dim = r.rotary_dim == 0 ? head_dim : r.rotary_dim;
  p.interleaved = r.interleaved;
  p.positions = std::move(positions);
  p.inv_freq = r.inv_freq;
  p.attention_factor = r.attention_factor;
  return ref::Rotate(p, x);
}

void ExpectAttendMatchesReference(const AttendCase& c, double tol) {
  const int64_t kv_heads = c.kv_heads == 0 ? c.heads : c.kv_heads;
  const Tensor q = RandomTensor(c.q_dtype, {c.batch, c.q_len, c.heads, c.head_dim}, c.seed);
  const Tensor k = RandomTensor(c.kv_dtype, {c.batch, c.k_len, kv_heads, c.head_dim}, c.seed + 1);
  const Tensor v = RandomTensor(c.kv_dtype, {c.batch, c.k_len, kv_heads, c.v_dim}, c.seed + 2);

  v1::AttendRequest request;
  *request.mutable_spec() = c.spec;
  request.mutable_spec()->set_heads(c.heads);
  request.mutable_spec()->set_kv_heads(c.kv_heads);
  request.mutable_spec()->set_head_dim(c.head_dim);
  *request.mutable_q() = Wire(q);
  *request.mutable_k() = Wire(k);
  *request.mutable_v() = Wire(v);
  for (int64_t o : c.q_offsets) request.add_q_offsets(o);
  for (int64_t l : c.key_lengths) request.add_key_lengths(l);
  for (int64_t x : c.q_positions) request.add_q_positions(x);
  for (int64_t x : c.k_positions) request.add_k_positions(x);
  request.set_return_probs(c.return_probs);
  request.set_out_dtype(c.out_dtype);

  v1::AttendResponse response;
  const absl::Status status = RunAttend(request, &response, ComputeOptions{kThreads});
  ASSERT_TRUE(status.ok()) << status;

  std::vector<double> qd = ToDoubles(q.cview());
  std::vector<double> kd = ToDoubles(k.cview());
  const std::vector<double> vd = ToDoubles(v.cview());
  std::vector<int64_t> offsets = c.q_offsets;
  if (offsets.empty()) offsets.assign(c.batch, c.k_len - c.q_len);
  if (c.rope.has_value()) {
    std::vector<int64_t> q_pos, k_pos;
    for (int64_t b = 0; b < c.batch; ++b) {
      for (int64_t i = 0; i < c.q_len; ++i) q_pos.push_back(offsets[b] + i);
      for (int64_t j = 0; j < c.k_len; ++j) k_pos.push_back(j);
    }
    if (!c.q_positions.empty()) q_pos = c.q_positions;
    if (!c.k_positions.empty()) k_pos = c.k_positions;
    qd = RefRotate(*c.rope, qd, c.batch, c.q_len, c.heads, c.head_dim, q_pos);
    kd = RefRotate(*c.rope, kd, c.batch, c.k_len, kv_heads, c.head_dim, k_pos);
  }
  ref::AttentionRefParams p = c.ref_bias;
  p.batch = c.batch;
  p.q_len = c.q_len;
  p.k_len = c.k_len;
  p.heads = c.heads;
  p.kv_heads = kv_heads;
  p.head_dim = c.head_dim;
  p.v_dim = c.v_dim;
  p.scale = c.spec.scale();
  p.causal = c.spec.causal();
  p.window = c.spec.window();
  p.softcap = c.spec.softcap();
  p.q_offsets = c.q_offsets;
  p.key_lengths = c.key_lengths;
  p.q_positions = c.q_positions;
  p.k_positions = c.k_positions;
  const ref::AttentionRefResult expected = ref::Attention(p, qd, kd, vd);

  const v1::DType out_dtype = c.out_dtype == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_F32 : c.out_dtype;
  EXPECT_EQ(response.out().dtype(), out_dtype);
  EXPECT_THAT(Shape(response.out()), ElementsAre(c.batch, c.q_len, c.heads, c.v_dim));
  EXPECT_TRUE(AllClose(Doubles(response.out()), expected.out, tol));
  if (c.return_probs) {
    EXPECT_EQ(response.probs().dtype(), v1::DTYPE_F32);
    EXPECT_THAT(Shape(response.probs()), ElementsAre(c.batch, c.heads, c.q_len, c.k_len));
    EXPECT_TRUE(AllClose(Doubles(response.probs()), expected.probs, tol));
  } else {
    EXPECT_FALSE(response.has_probs());
  }
}

AttendCase BaseCase() {
  AttendCase c;
  c.batch = 2;
  c.q_len = 3;
  c.k_len = 7;
  c.heads = 4;
  c.head_dim = 16;
  c.v_dim = 12;
  return c;
}

TEST(RunAttendTest, PlainMultiHead) {
  AttendCase c = BaseCase();
  c.key_lengths = {7, 4};
  ExpectAttendMatchesReference(c, kF32Tol);
}

TEST(RunAttendTest, GroupedQueryWithExplicitScale) {
  AttendCase c = BaseCase();
  c.heads = 8;
  c.kv_heads = 2;
  c.spec.set_scale(0.3);
  ExpectAttendMatchesReference(c, kF32Tol);
}

TEST(RunAttendTest, CausalWithOffsetsAndPadding) {
  AttendCase c = BaseCase();
  c.spec.set_causal(true);
  c.q_offsets = {2, 0};
  c.key_lengths = {7, 5};
  c.return_probs = true;
  ExpectAttendMatchesReference(c, kF32Tol);
}

TEST(RunAttendTest, SlidingWindow) {
  AttendCase c = BaseCase();
  c.q_len = 6;
  c.spec.set_window(3);
  ExpectAttendMatchesReference(c, kF32Tol);
  c.spec.set_causal(true);
  ExpectAttendMatchesReference(c, kF32Tol);
}

TEST(RunAttendTest, Softcap) {
  AttendCase c = BaseCase();
  c.spec.set_softcap(0.5);
  c.spec.set_scale(2.0);  // large logits, so the cap actually bites
  ExpectAttendMatchesReference(c, kF32Tol);
}

TEST(RunAttendTest, AlibiStandardSlopes) {
  AttendCase c = BaseCase();
  c.heads = 6;  // not a power of two: the interleaved-slopes rule
  c.spec.mutable_alibi();
  c.spec.set_causal(true);
  c.ref_bias.bias = ref::RefBias::kAlibi;
  c.ref_bias.alibi_slopes = ref::AlibiSlopes(6);
  ExpectAttendMatchesReference(c, kF32Tol);
}

TEST(RunAttendTest, AlibiExplicitSlopesBidirectional) {
  AttendCase c = BaseCase();
  const std::vector<double> slopes = {0.5, 0.25, 0.125, 1.5};
  for (double s : slopes) c.spec.mutable_alibi()->add_slopes(s);
  c.q_offsets = {1, 3};
  c.ref_bias.bias = ref::RefBias::kAlibi;
  c.ref_bias.alibi_slopes = slopes;
  ExpectAttendMatchesReference(c, kF32Tol);
}

TEST(RunAttendTest, T5Buckets) {
  for (bool bidirectional : {true, false}) {
    SCOPED_TRACE(bidirectional ? "bidirectional" : "causal");
    AttendCase c = BaseCase();
    c.k_len = 40;  // distances past the exact range and past max_distance
    c.q_len = 5;
    const int num_buckets = 8;
    const Tensor table = RandomTensor(DType::kF32, {num_buckets, c.heads}, 77, -2.0f, 2.0f);
    *c.spec.mutable_t5()->mutable_table() = Wire(table);
    // num_buckets 0: taken from the table's shape.
    c.spec.mutable_t5()->set_max_distance(16);
    c.spec.mutable_t5()->set_bidirectional(bidirectional);
    c.spec.set_causal(!bidirectional);
    c.ref_bias.bias = ref::RefBias::kT5;
    c.ref_bias.t5_table = ToDoubles(table.cview());
    c.ref_bias.t5_num_buckets = num_buckets;
    c.ref_bias.t5_max_distance = 16;
    c.ref_bias.t5_bidirectional = bidirectional;
    ExpectAttendMatchesReference(c, kF32Tol);
  }
}

TEST(RunAttendTest, T5DefaultMaxDistanceIs128) {
  AttendCase c = BaseCase();
  c.k_len = 200;
  c.q_len = 2;
  const Tensor table = RandomTensor(DType::kF32, {32, c.heads}, 78, -2.0f, 2.0f);
  *c.spec.mutable_t5()->mutable_table() = Wire(table);
  c.spec.mutable_t5()->set_num_buckets(32);
  c.spec.mutable_t5()->set_bidirectional(true);
  c.ref_bias.bias = ref::RefBias::kT5;
  c.ref_bias.t5_table = ToDoubles(table.cview());
  c.ref_bias.t5_num_buckets = 32;
  c.ref_bias.t5_max_distance = 128;
  c.ref_bias.t5_bidirectional = true;
  ExpectAttendMatchesReference(c, kF32Tol);
}

TEST(RunAttendTest, RopeDefaultRotatesQAtDefaultOffsetsAndKAtIndices) {
  AttendCase c = BaseCase();
  c.spec.set_causal(true);
  c.spec.mutable_rope();  // everything default: half split, theta 10000
  c.rope = RopeRef{ref::DefaultInvFreq(c.head_dim, 10000.0), 1.0};
  c.return_probs = true;
  ExpectAttendMatchesReference(c, kF32Tol);
}

// Keys with gaps and repeats, queries anywhere, near position 1e6: RoPE at
// each token's position (dynamic NTK planned for the largest + 1), causal
// window and ALiBi by position. fp64 reference, 1e-5 relative.
TEST(RunAttendTest, ExplicitQueryAndKeyPositions) {
  const int64_t far = 1000000;
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(variant);
    AttendCase c = BaseCase();
    c.kv_heads = 2;
    c.k_positions = {far + 0, far + 3, far + 3, far + 9, far + 10, far + 20, far + 21,
                     far + 1, far + 2, far + 4, far + 8, far + 16, far + 32, far + 64};
    c.q_positions = {far + 9, far + 22, far + 3, far + 70, far + 8, far + 1};
    c.spec.set_causal(true);
    c.return_probs = true;
    if (variant == 0) {
      c.spec.mutable_rope();
      c.rope = RopeRef{ref::DefaultInvFreq(c.head_dim, 10000.0), 1.0};
      c.spec.set_window(12);
    } else if (variant == 1) {
      v1::RopeSpec* rope = c.spec.mutable_rope();
      rope->mutable_scaling()->set_rope_type("dynamic");
      rope->mutable_scaling()->set_factor(2.0);
      rope->mutable_scaling()->set_original_max_position_embeddings(4096);
      c.rope = RopeRef{ref::DynamicNtkInvFreq(c.head_dim, 10000.0, 2.0, 4096, far + 71), 1.0};
    } else {
      c.spec.mutable_alibi();
      c.ref_bias.bias = ref::RefBias::kAlibi;
      c.ref_bias.alibi_slopes = ref::AlibiSlopes(c.heads);
      c.spec.set_causal(false);
      c.spec.set_window(30);
    }
    ExpectAttendMatchesReference(c, kF32Tol);
  }
}

TEST(RunAttendTest, RopeYarnWithOffsets) {
  AttendCase c = BaseCase();
  c.heads = 4;
  c.kv_heads = 2;
  v1::RopeSpec* rope = c.spec.mutable_rope();
  rope->set_theta(500.0);
  rope->mutable_scaling()->set_rope_type("yarn");
  rope->mutable_scaling()->set_factor(4.0);
  rope->mutable_scaling()->set_original_max_position_embeddings(8);
  rope->mutable_scaling()->set_beta_fast(16.0);
  c.q_offsets = {20, 5};  // past k_len: q may sit anywhere
  ref::YarnRefParams y;
  y.factor = 4.0;
  y.original_len = 8;
  y.beta_fast = 16.0;
  c.rope = RopeRef{ref::YarnInvFreq(c.head_dim, 500.0, y), ref::YarnAttentionFactor(y)};
  ASSERT_NE(c.rope->attention_factor, 1.0);  // the case must exercise the factor
  ExpectAttendMatchesReference(c, kF32Tol);
}

TEST(RunAttendTest, RopeLlama3) {
  AttendCase c = BaseCase();
  v1::RopeScaling* s = c.spec.mutable_rope()->mutable_scaling();
  s->set_rope_type("llama3");
  s->set_factor(8.0);
  s->set_original_max_position_embeddings(16);
  s->set_low_freq_factor(1.0);
  s->set_high_freq_factor(2.0);
  c.spec.set_causal(true);
  c.rope = RopeRef{ref::Llama3InvFreq(c.head_dim, 10000.0, 8.0, 1.0, 2.0, 16), 1.0};
  ExpectAttendMatchesReference(c, kF32Tol);
}

TEST(RunAttendTest, RopeLongRopeUsesLongFactorsPastOriginalLength) {
  // Sk = 7 > L0 = 4: the request spans past L0, so the long factors apply.
  AttendCase c = BaseCase();
  v1::RopeScaling* s = c.spec.mutable_rope()->mutable_scaling();
  s->set_rope_type("longrope");
  s->set_factor(4.0);
  s->set_original_max_position_embeddings(4);
  std::vector<double> short_f, long_f;
  for (int i = 0; i < c.head_dim / 2; ++i) {
    short_f.push_back(1.0 + 0.1 * i);
    long_f.push_back(2.0 + 0.5 * i);
    s->add_short_factor(short_f.back());
    s->add_long_factor(long_f.back());
  }
  c.rope = RopeRef{ref::LongRopeInvFreq(c.head_dim, 10000.0, short_f, long_f, 4, c.k_len),
                   ref::LongRopeAttentionFactor(4.0, 4, std::nullopt)};
  ExpectAttendMatchesReference(c, kF32Tol);
}

TEST(RunAttendTest, RopeDynamicNtkPlansForTheLastQueryPosition) {
  // The last query sits at 30 + 2 = 32, past Sk: seq_len is 33, not 7.
  AttendCase c = BaseCase();
  v1::RopeScaling* s = c.spec.mutable_rope()->mutable_scaling();
  s->set_rope_type("dynamic");
  s->set_factor(2.0);
  s->set_original_max_position_embeddings(4);
  c.q_offsets = {30, 1};
  c.rope = RopeRef{ref::DynamicNtkInvFreq(c.head_dim, 10000.0, 2.0, 4, 33), 1.0};
  ExpectAttendMatchesReference(c, kF32Tol);
}

TEST(RunAttendTest, RopePartialRotary) {
  AttendCase c = BaseCase();
  c.spec.mutable_rope()->set_rotary_dim(6);
  c.spec.set_causal(true);
  c.rope = RopeRef{ref::DefaultInvFreq(6, 10000.0), 1.0, 6, false};
  ExpectAttendMatchesReference(c, kF32Tol);
}

TEST(RunAttendTest, RopeInterleavedFullAndPartial) {
  for (int64_t rotary_dim : {0, 8}) {
    SCOPED_TRACE(rotary_dim);
    AttendCase c = BaseCase();
    c.spec.mutable_rope()->set_layout(v1::ROPE_LAYOUT_INTERLEAVED);
    c.spec.mutable_rope()->set_rotary_dim(rotary_dim);
    c.spec.mutable_rope()->set_theta(100.0);
    const int64_t d = rotary_dim == 0 ? c.head_dim : rotary_dim;
    c.rope = RopeRef{ref::DefaultInvFreq(d, 100.0), 1.0, rotary_dim, true};
    ExpectAttendMatchesReference(c, kF32Tol);
  }
}

TEST(RunAttendTest, Bf16InputsWithRope) {
  AttendCase c = BaseCase();
  c.q_dtype = DType::kBF16;
  c.kv_dtype = DType::kBF16;
  c.spec.set_causal(true);
  c.spec.mutable_rope();
  c.rope = RopeRef{ref::DefaultInvFreq(c.head_dim, 10000.0), 1.0};
  c.return_probs = true;
  ExpectAttendMatchesReference(c, kBF16Tol);
  c.out_dtype = v1::DTYPE_BF16;
  ExpectAttendMatchesReference(c, kBF16Tol);
}

TEST(RunAttendTest, Bf16OutputFromF32Inputs) {
  AttendCase c = BaseCase();
  c.out_dtype = v1::DTYPE_BF16;
  ExpectAttendMatchesReference(c, kBF16Tol);
}

TEST(RunAttendTest, MoreQueriesThanKeysWithoutPositionsIsPlainAttention) {
  AttendCase c = BaseCase();
  c.q_len = 9;
  c.k_len = 4;
  ExpectAttendMatchesReference(c, kF32Tol);
}

TEST(RunAttendTest, DecodeLongContextPastTheRopeTable) {
  // One query against 70000 keys: positions past the 65536-position cos/sin
  // table are computed on the fly and must agree with the reference.
  AttendCase c;
  c.q_len = 1;
  c.k_len = 70000;
  c.heads = 2;
  c.kv_heads = 1;
  c.head_dim = 8;
  c.v_dim = 4;
  c.spec.mutable_rope();
  c.spec.set_causal(true);
  c.rope = RopeRef{ref::DefaultInvFreq(8, 10000.0), 1.0};
  ExpectAttendMatchesReference(c, kF32Tol);
}

// A few tokens at high positions: exact against the reference, and priced
// (and computed) for the rows they rotate, not for a cos/sin table of every
// position below them (2^16 rows for one query at 65534 took 60 ms).
TEST(RunAttendTest, FewTokensAtHighPositionsBuildNoTableOfEveryPosition) {
  AttendCase c;
  c.q_len = 2;
  c.k_len = 3;
  c.heads = 2;
  c.kv_heads = 1;
  c.head_dim = 64;
  c.v_dim = 4;
  c.spec.mutable_rope();
  c.q_offsets = {65534};
  c.rope = RopeRef{ref::DefaultInvFreq(64, 10000.0), 1.0};
  ExpectAttendMatchesReference(c, kF32Tol);

  v1::AttendRequest r;
  r.mutable_spec()->set_heads(2);
  r.mutable_spec()->set_kv_heads(1);
  r.mutable_spec()->set_head_dim(64);
  r.mutable_spec()->mutable_rope();
  *r.mutable_q() = Wire(RandomTensor(DType::kF32, {1, 2, 2, 64}, 1));
  *r.mutable_k() = Wire(RandomTensor(DType::kF32, {1, 3, 1, 64}, 2));
  *r.mutable_v() = Wire(RandomTensor(DType::kF32, {1, 3, 1, 4}, 3));
  const absl::StatusOr<Cost> low = PriceAttend(r, kThreads);
  r.add_q_offsets(65534);
  const absl::StatusOr<Cost> high = PriceAttend(r, kThreads);
  ASSERT_TRUE(low.ok() && high.ok());
  // At most 5 tokens' cos/sin rows, whatever their positions.
  EXPECT_LE(high->compute, low->compute);
  EXPECT_LE(high->transient_bytes, low->transient_bytes);
  // The table of 2^16 rows x 32 pairs would alone be 16 MiB.
  EXPECT_LT(high->transient_bytes, 1 << 20);
}

// Every query row and every (batch row, kv head, query tile) carries a fixed
// price: requests of tiny head dims against one key were priced at a few
// units a row (they ran ~50x their price, ~100 ns a row, ~4 us a tile) and
// would teach the admission a rate that refuses everyone else.
TEST(RunAttendTest, QueryRowsAndTilesArePricedWhateverTheirDims) {
  v1::AttendRequest r;
  r.mutable_spec()->set_heads(1);
  r.mutable_spec()->set_head_dim(2);
  for (int i = 0; i < 200; ++i) r.add_q_offsets(0);
  *r.mutable_q() = Wire(RandomTensor(DType::kF32, {200, 17, 1, 2}, 1));
  *r.mutable_k() = Wire(RandomTensor(DType::kF32, {200, 1, 1, 2}, 2));
  *r.mutable_v() = Wire(RandomTensor(DType::kF32, {200, 1, 1, 1}, 3));
  const absl::StatusOr<Cost> c = PriceAttend(r, kThreads);
  ASSERT_TRUE(c.ok()) << c.status();
  // 3400 query rows at 2048 units and 200 prefill tiles (one per batch row)
  // at 65536: >= 20M units, where pairs and element steps alone came to 0.24M.
  EXPECT_GE(c->compute, 3400 * 2048 + 200 * 65536);
}

// The decode kernel streams K/V from memory: a request that reads many
// bytes per multiply-add (one query, long context) is priced by its bytes,
// so it costs about the units of a prefill-shaped request of the same time.
TEST(RunAttendTest, MemoryBoundRequestsArePricedByTheirBytes) {
  v1::AttendRequest r;
  r.mutable_spec()->set_heads(32);
  r.mutable_spec()->set_head_dim(128);
  *r.mutable_q() = Wire(*Tensor::Create(DType::kF32, {1, 1, 32, 128}));
  *r.mutable_k() = Wire(*Tensor::Create(DType::kF32, {1, 1024, 32, 128}));
  *r.mutable_v() = Wire(*Tensor::Create(DType::kF32, {1, 1024, 32, 128}));
  const absl::StatusOr<Cost> c = PriceAttend(r, kThreads);
  ASSERT_TRUE(c.ok()) << c.status();
  const int64_t kv_bytes = int64_t{1024} * 32 * 256 * 4;  // 34 MB
  EXPECT_GE(c->compute, kv_bytes * 8);
  // The arithmetic alone (pairs x (head_dim + v_dim + 16)) is 8x less.
  EXPECT_GE(c->compute, 8 * (int64_t{32} * 1024 * 272));
}

TEST(RunAttendTest, EmptyBatchOrKeysGiveZerosWithoutTouchingHugeDims) {
  // Zero-byte tensors whose other dims are huge: answered at once.
  v1::AttendRequest r;
  r.mutable_spec()->set_heads(4);
  r.mutable_spec()->set_kv_heads(2);
  r.mutable_spec()->set_head_dim(8);
  r.mutable_spec()->mutable_rope();
  const int64_t huge = int64_t{1} << 40;
  const std::pair<v1::Tensor*, std::vector<int64_t>> empties[] = {{r.mutable_q(), {huge, 0, 4, 8}},
                                                                  {r.mutable_k(), {huge, 0, 2, 8}},
                                                                  {r.mutable_v(), {huge, 0, 2, 6}}};
  for (const auto& [w, dims] : empties) {
    w->set_dtype(v1::DTYPE_F32);
    for (int64_t d : dims) w->add_shape(d);
  }
  r.set_return_probs(true);
  v1::AttendResponse response;
  ASSERT_TRUE(RunAttend(r, &response, ComputeOptions{kThreads}).ok());
  EXPECT_THAT(Shape(response.out()), ElementsAre(huge, 0, 4, 6));
  EXPECT_TRUE(response.out().data().empty());

  // No keys: every query sees nothing, so out and probs are zeros.
  *r.mutable_q() = Wire(RandomTensor(DType::kF32, {2, 3, 4, 8}, 1));
  *r.mutable_k() = Wire(*Tensor::Create(DType::kF32, {2, 0, 2, 8}));
  *r.mutable_v() = Wire(*Tensor::Create(DType::kF32, {2, 0, 2, 6}));
  r.mutable_spec()->set_causal(true);
  ASSERT_TRUE(RunAttend(r, &response, ComputeOptions{kThreads}).ok());
  EXPECT_THAT(Shape(response.out()), ElementsAre(2, 3, 4, 6));
  EXPECT_EQ(Doubles(response.out()), std::vector<double>(2 * 3 * 4 * 6, 0.0));
  EXPECT_THAT(Shape(response.probs()), ElementsAre(2, 4, 3, 0));

  // ... unless the empty v claims a value dim that makes out too large.
  r.mutable_v()->set_shape(3, huge);
  EXPECT_EQ(RunAttend(r, &response, ComputeOptions{kThreads}).code(),
            absl::StatusCode::kResourceExhausted);

  // An empty batch is priced as what it is, nothing, however long its
  // sequences: it used to be charged prefill tiles for 2^40 keys (2 PB) and
  // refused as RESOURCE_EXHAUSTED.
  for (const auto& [w, dims] :
       {std::pair{r.mutable_q(), std::vector<int64_t>{0, huge, 4, 8}},
        std::pair{r.mutable_k(), std::vector<int64_t>{0, huge, 2, 8}},
        std::pair{r.mutable_v(), std::vector<int64_t>{0, huge, 2, 6}}}) {
    w->Clear();
    w->set_dtype(v1::DTYPE_F32);
    for (int64_t d : dims) w->add_shape(d);
  }
  r.set_return_probs(false);
  const absl::StatusOr<Cost> empty_cost = PriceAttend(r, kThreads);
  ASSERT_TRUE(empty_cost.ok()) << empty_cost.status();
  EXPECT_LT(empty_cost->transient_bytes, 1 << 20);
  EXPECT_TRUE(CheckCost(*empty_cost, CostLimits(), "Attend").ok());
  ASSERT_TRUE(RunAttend(r, &response, ComputeOptions{kThreads}).ok());
  EXPECT_THAT(Shape(response.out()), ElementsAre(0, huge, 4, 6));
}

// A dim of up to 2^63 - 1 is accepted beside a 0 (no elements), and the
// cost model rounds query rows up to prefill tiles: (q_len + 63) / 64
// overflowed (signed, undefined; a sanitizer build aborts) and could give a
// negative tile count that lowered a saturated price.
TEST(RunAttendTest, HugeDimsArePricedWithoutOverflow) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  AttendDims d;
  d.batch = 1;
  d.q_len = kMax;
  d.k_len = 1;
  d.heads = 1;
  d.kv_heads = 1;
  d.head_dim = 1;
  d.v_dim = 1;
  EXPECT_EQ(AttendCost(d).compute, kMax);
  EXPECT_EQ(AttendCost(d).transient_bytes, kMax);
  // The reviewer's request: q [0, 2^63 - 1, 1, 1], no elements.
  v1::AttendRequest r;
  r.mutable_spec()->set_heads(1);
  r.mutable_spec()->set_head_dim(1);
  for (const auto& [w, dims] : {std::pair{r.mutable_q(), std::vector<int64_t>{0, kMax, 1, 1}},
                                std::pair{r.mutable_k(), std::vector<int64_t>{0, 1, 1, 1}},
                                std::pair{r.mutable_v(), std::vector<int64_t>{0, 1, 1, 1}}}) {
    w->set_dtype(v1::DTYPE_F32);
    for (int64_t x : dims) w->add_shape(x);
  }
  const absl::StatusOr<Cost> c = PriceAttend(r, kThreads);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_GE(c->compute, 0);
  EXPECT_GE(c->transient_bytes, 0);
}

// --- Encode against the reference ---

// As the service does: price, check against the default limits, then run.
absl::StatusOr<v1::EncodeResponse> Encode(const v1::EncodeRequest& request) {
  v1::EncodeResponse response;
  absl::StatusOr<Cost> cost = PriceEncode(request);
  if (!cost.ok()) return cost.status();
  if (absl::Status st = CheckCost(*cost, CostLimits(), "Encode"); !st.ok()) return st;
  absl::Status status = RunEncode(request, &response, ComputeOptions{kThreads});
  if (!status.ok()) return status;
  return response;
}

TEST(RunEncodeTest, SinusoidalBothLayouts) {
  for (bool interleaved : {true, false}) {
    SCOPED_TRACE(interleaved);
    v1::EncodeRequest request;
    auto* op = request.mutable_sinusoidal();
    op->set_num_positions(50);
    op->set_d_model(32);
    op->set_first_position(1000);
    op->set_layout(interleaved ? v1::SINUSOIDAL_LAYOUT_UNSPECIFIED
                               : v1::SINUSOIDAL_LAYOUT_SIN_COS_HALF);
    absl::StatusOr<v1::EncodeResponse> r = Encode(request);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_THAT(Shape(r->table()), ElementsAre(50, 32));
    EXPECT_TRUE(AllClose(Doubles(r->table()),
                         ref::SinusoidalTable(50, 32, 10000.0, interleaved, 1000), kF32Tol));
  }
}

TEST(RunEncodeTest, SinusoidalCustomBase) {
  v1::EncodeRequest request;
  auto* op = request.mutable_sinusoidal();
  op->set_num_positions(10);
  op->set_d_model(8);
  op->set_base(50.0);
  absl::StatusOr<v1::EncodeResponse> r = Encode(request);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(AllClose(Doubles(r->table()), ref::SinusoidalTable(10, 8, 50.0, true, 0), kF32Tol));
}

TEST(RunEncodeTest, RopeFrequenciesEveryRule) {
  constexpr int64_t kD = 16;
  struct Rule {
    const char* name;
    std::function<void(v1::RopeScaling*)> fill;
    std::vector<double> inv_freq;
    double attention_factor;
  };
  ref::YarnRefParams y;
  y.factor = 16.0;
  y.original_len = 32;
  y.beta_slow = 2.0;
  y.mscale = 0.8;
  y.mscale_all_dim = 0.5;
  std::vector<double> sf(kD / 2), lf(kD / 2);
  for (int i = 0; i < kD / 2; ++i) {
    sf[i] = 1.0 + i;
    lf[i] = 3.0 + 2 * i;
  }
  const std::vector<Rule> rules = {
      {"", [](v1::RopeScaling*) {}, ref::DefaultInvFreq(kD, 10000.0), 1.0},
      {"linear", [](v1::RopeScaling* s) { s->set_factor(4.0); },
       ref::LinearInvFreq(kD, 10000.0, 4.0), 1.0},
      {"ntk", [](v1::RopeScaling* s) { s->set_factor(4.0); }, ref::NtkInvFreq(kD, 10000.0, 4.0),
       1.0},
      {"dynamic",
       [](v1::RopeScaling* s) {
         s->set_factor(2.0);
         s->set_original_max_position_embeddings(32);
       },
       ref::DynamicNtkInvFreq(kD, 10000.0, 2.0, 32, 100), 1.0},
      {"yarn",
       [](v1::RopeScaling* s) {
         s->set_factor(16.0);
         s->set_original_max_position_embeddings(32);
         s->set_beta_slow(2.0);
         s->set_mscale(0.8);
         s->set_mscale_all_dim(0.5);
       },
       ref::YarnInvFreq(kD, 10000.0, y), ref::YarnAttentionFactor(y)},
      {"su",
       [&](v1::RopeScaling* s) {
         s->set_original_max_position_embeddings(32);
         s->set_attention_factor(1.25);
         for (double f : sf) s->add_short_factor(f);
         for (double f : lf) s->add_long_factor(f);
       },
       ref::LongRopeInvFreq(kD, 10000.0, sf, lf, 32, 100), 1.25},
      {"llama3",
       [](v1::RopeScaling* s) {
         s->set_factor(8.0);
         s->set_original_max_position_embeddings(64);
       },
       ref::Llama3InvFreq(kD, 10000.0, 8.0, 1.0, 4.0, 64), 1.0},
  };
  for (const Rule& rule : rules) {
    SCOPED_TRACE(rule.name);
    v1::EncodeRequest request;
    auto* op = request.mutable_rope_frequencies();
    op->set_head_dim(kD);
    op->set_seq_len(100);
    op->mutable_rope()->mutable_scaling()->set_rope_type(rule.name);
    rule.fill(op->mutable_rope()->mutable_scaling());
    absl::StatusOr<v1::EncodeResponse> r = Encode(request);
    ASSERT_TRUE(r.ok()) << r.status();
    const std::vector<double> got(r->inv_freq().begin(), r->inv_freq().end());
    EXPECT_TRUE(AllClose(got, rule.inv_freq, 1e-12));
    EXPECT_NEAR(r->attention_factor(), rule.attention_factor, 1e-12);
  }
}

TEST(RunEncodeTest, RopeFrequenciesYarnTruncateAndLongRopeMaxPositionEmbeddings) {
  constexpr int64_t kD = 64;
  v1::EncodeRequest request;
  auto* op = request.mutable_rope_frequencies();
  op->set_head_dim(kD);
  auto* s = op->mutable_rope()->mutable_scaling();
  s->set_rope_type("yarn");
  s->set_factor(8.0);
  s->set_original_max_position_embeddings(4096);
  s->set_truncate(false);
  ref::YarnRefParams y;
  y.factor = 8.0;
  y.original_len = 4096;
  y.truncate = false;
  absl::StatusOr<v1::EncodeResponse> r = Encode(request);
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<double> got(r->inv_freq().begin(), r->inv_freq().end());
  EXPECT_TRUE(AllClose(got, ref::YarnInvFreq(kD, 10000.0, y), 1e-12));
  y.truncate = true;  // the two differ for this config
  EXPECT_FALSE(AllClose(got, ref::YarnInvFreq(kD, 10000.0, y), 1e-6));

  // Phi-3: max_position_embeddings 131072 over L0 4096 gives f = 32.
  s->Clear();
  s->set_rope_type("longrope");
  s->set_original_max_position_embeddings(4096);
  s->set_max_position_embeddings(131072);
  const std::vector<double> sf(kD / 2, 1.0), lf(kD / 2, 4.0);
  for (int i = 0; i < kD / 2; ++i) {
    s->add_short_factor(sf[i]);
    s->add_long_factor(lf[i]);
  }
  op->set_seq_len(5000);
  r = Encode(request);
  ASSERT_TRUE(r.ok()) << r.status();
  got.assign(r->inv_freq().begin(), r->inv_freq().end());
  EXPECT_TRUE(AllClose(got, ref::LongRopeInvFreq(kD, 10000.0, sf, lf, 4096, 5000), 1e-12));
  EXPECT_NEAR(r->attention_factor(), ref::LongRopeAttentionFactor(1.0, 4096, std::nullopt, 131072),
              1e-12);
  EXPECT_NEAR(r->attention_factor(), std::sqrt(1.0 + std::log(32.0) / std::log(4096.0)), 1e-12);
}

// An empty T5 grid (q_len or k_len 0) is an empty answer, priced as one:
// however long its other side, nothing is built.
TEST(RunEncodeTest, AnEmptyT5GridCostsNothingWhateverItsOtherSide) {
  for (const auto& [q_len, k_len] : {std::pair<int64_t, int64_t>{0, int64_t{1} << 40},
                                     std::pair<int64_t, int64_t>{int64_t{1} << 40, 0}}) {
    v1::EncodeRequest request;
    request.mutable_t5()->set_q_len(q_len);
    request.mutable_t5()->set_k_len(k_len);
    absl::StatusOr<Cost> cost = PriceEncode(request);
    ASSERT_TRUE(cost.ok()) << cost.status();
    EXPECT_LT(cost->transient_bytes, 1 << 20) << q_len << " x " << k_len;
    EXPECT_LT(cost->compute, 1 << 20) << q_len << " x " << k_len;
    absl::StatusOr<v1::EncodeResponse> r = Encode(request);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->buckets_size(), 0);
  }
}

// Every fp64 cos/sin pair an op computes is priced at kSinCosWeight (some 8
// element steps), not as one element step: the admission's estimates and
// --max_request_compute see the angle work of sinusoidal tables, cos/sin
// rows and rope_apply.
TEST(RunEncodeTest, AnglesArePricedAtTheirWeight) {
  const auto compute_of = [](const v1::EncodeRequest& r) {
    absl::StatusOr<Cost> c = PriceEncode(r);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? c->compute : 0;
  };
  v1::EncodeRequest none, some;
  none.mutable_sinusoidal()->set_d_model(64);
  some.mutable_sinusoidal()->set_d_model(64);
  some.mutable_sinusoidal()->set_num_positions(1000);
  EXPECT_GE(compute_of(some) - compute_of(none), 1000 * 32 * kSinCosWeight);
  none.Clear();
  none.mutable_rope_cos_sin()->set_head_dim(64);
  some = none;
  for (int i = 0; i < 1000; ++i) some.mutable_rope_cos_sin()->add_positions(i);
  EXPECT_GE(compute_of(some) - compute_of(none), 1000 * 32 * kSinCosWeight);
  none.Clear();
  *none.mutable_rope_apply()->mutable_x() = Wire(RandomTensor(DType::kF32, {1, 1, 1, 64}, 1));
  some.Clear();
  *some.mutable_rope_apply()->mutable_x() = Wire(RandomTensor(DType::kF32, {1, 1000, 1, 64}, 1));
  EXPECT_GE(compute_of(some) - compute_of(none), 999 * 32 * kSinCosWeight);
}

TEST(RunEncodeTest, RopeCosSinAtArbitraryPositions) {
  v1::EncodeRequest request;
  auto* op = request.mutable_rope_cos_sin();
  op->set_head_dim(16);
  op->mutable_rope()->set_rotary_dim(12);
  op->mutable_rope()->mutable_scaling()->set_rope_type("yarn");
  op->mutable_rope()->mutable_scaling()->set_factor(4.0);
  op->mutable_rope()->mutable_scaling()->set_original_max_position_embeddings(64);
  const std::vector<int64_t> positions = {0, 5, 3, 100000, int64_t{1} << 30};
  for (int64_t p : positions) op->add_positions(p);
  absl::StatusOr<v1::EncodeResponse> r = Encode(request);
  ASSERT_TRUE(r.ok()) << r.status();
  ref::YarnRefParams y;
  y.factor = 4.0;
  y.original_len = 64;
  const std::vector<double> inv = ref::YarnInvFreq(12, 10000.0, y);
  const double a = ref::YarnAttentionFactor(y);
  std::vector<double> cos_ref, sin_ref;
  for (int64_t p : positions) {
    for (double f : inv) {
      cos_ref.push_back(a * std::cos(static_cast<double>(p) * f));
      sin_ref.push_back(a * std::sin(static_cast<double>(p) * f));
    }
  }
  EXPECT_THAT(Shape(r->cos()), ElementsAre(5, 6));
  EXPECT_THAT(Shape(r->sin()), ElementsAre(5, 6));
  EXPECT_TRUE(AllClose(Doubles(r->cos()), cos_ref, kF32Tol));
  EXPECT_TRUE(AllClose(Doubles(r->sin()), sin_ref, kF32Tol));
  EXPECT_EQ(r->inv_freq_size(), 6);
  EXPECT_NEAR(r->attention_factor(), a, 1e-12);
}

// A scaling factor inside its range can still make position * inv_freq
// overflow float32, where transformers computes it (linear 1e-36 at position
// 1000: 1e39): refused up front naming the field, its value and the
// position, not blamed on the input tensor, nor answered where transformers
// gives NaN.
TEST(RunEncodeTest, AnAngleThatOverflowsNamesTheFactorAndPosition) {
  const int64_t kPos = 1000;
  v1::RopeSpec rope;
  rope.mutable_scaling()->set_rope_type("linear");
  rope.mutable_scaling()->set_factor(1e-36);
  const auto expect_named = [](const absl::Status& st, absl::string_view field) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(st.message(), AllOf(HasSubstr(field), HasSubstr("scaling.factor = 1e-36"),
                                    HasSubstr("position 1000"), HasSubstr("float32"),
                                    Not(HasSubstr("reduce")), Not(HasSubstr("NaN"))));
  };
  v1::EncodeRequest cos_sin;
  *cos_sin.mutable_rope_cos_sin()->mutable_rope() = rope;
  cos_sin.mutable_rope_cos_sin()->set_head_dim(4);
  cos_sin.mutable_rope_cos_sin()->add_positions(kPos);
  expect_named(Encode(cos_sin).status(), "rope_cos_sin.rope");

  v1::EncodeRequest apply;
  *apply.mutable_rope_apply()->mutable_rope() = rope;
  *apply.mutable_rope_apply()->mutable_x() =
      Wire(Tensor::Create(DType::kF32, {1, 1, 1, 4}).value());
  apply.mutable_rope_apply()->add_offsets(kPos);
  expect_named(Encode(apply).status(), "rope_apply.rope");

  v1::AttendRequest attend;
  attend.mutable_spec()->set_heads(1);
  attend.mutable_spec()->set_head_dim(4);
  *attend.mutable_spec()->mutable_rope() = rope;
  *attend.mutable_q() = Wire(Tensor::Create(DType::kF32, {1, 1, 1, 4}).value());
  *attend.mutable_k() = Wire(Tensor::Create(DType::kF32, {1, 1, 1, 4}).value());
  *attend.mutable_v() = Wire(RandomTensor(DType::kF32, {1, 1, 1, 4}, 5));
  attend.add_q_offsets(kPos);
  attend.add_k_positions(kPos);
  v1::AttendResponse response;
  expect_named(RunAttend(attend, &response, ComputeOptions{kThreads}), "spec.rope");

  // The same factor at a position whose angle stays finite is computed.
  cos_sin.mutable_rope_cos_sin()->set_positions(0, 1);
  absl::StatusOr<v1::EncodeResponse> ok = Encode(cos_sin);
  ASSERT_TRUE(ok.ok()) << ok.status();

  // An inverse frequency past float32 (1e300: Inf in transformers, NaN at
  // every position, 0 included) is refused at any position.
  rope.mutable_scaling()->set_factor(1e-300);
  *cos_sin.mutable_rope_cos_sin()->mutable_rope() = rope;
  cos_sin.mutable_rope_cos_sin()->set_positions(0, 0);
  const absl::Status st = Encode(cos_sin).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(), AllOf(HasSubstr("rope_cos_sin.rope"),
                                  HasSubstr("scaling.factor = 1e-300"), HasSubstr("float32")));
}

// Without seq_len, a length-dependent rule is planned for the largest
// position + 1 (transformers' max(position_ids) + 1), not for 0.
TEST(RunEncodeTest, RopeCosSinWithoutSeqLenPlansForTheLargestPosition) {
  v1::EncodeRequest request;
  auto* op = request.mutable_rope_cos_sin();
  op->set_head_dim(16);
  op->mutable_rope()->mutable_scaling()->set_rope_type("dynamic");
  op->mutable_rope()->mutable_scaling()->set_factor(2.0);
  op->mutable_rope()->mutable_scaling()->set_original_max_position_embeddings(64);
  const std::vector<int64_t> positions = {3, 5000, 17};
  for (int64_t p : positions) op->add_positions(p);
  absl::StatusOr<v1::EncodeResponse> r = Encode(request);
  ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<double> inv = ref::DynamicNtkInvFreq(16, 10000.0, 2.0, 64, 5001);
  std::vector<double> cos_ref;
  for (int64_t p : positions) {
    for (double f : inv) cos_ref.push_back(std::cos(static_cast<double>(p) * f));
  }
  EXPECT_TRUE(AllClose(Doubles(r->cos()), cos_ref, kF32Tol));
}

v1::EncodeRequest RopeApplyRequest(const Tensor& x) {
  v1::EncodeRequest request;
  auto* op = request.mutable_rope_apply();
  *op->mutable_x() = Wire(x);
  op->mutable_rope()->set_theta(1000.0);
  return request;
}

TEST(RunEncodeTest, RopeApplyExplicitPositionsOffsetsAndDefault) {
  const Tensor x = RandomTensor(DType::kF32, {2, 3, 2, 8}, 11);
  const std::vector<double> xd = ToDoubles(x.cview());
  RopeRef rr{ref::DefaultInvFreq(8, 1000.0), 1.0};
  {
    v1::EncodeRequest request = RopeApplyRequest(x);
    const std::vector<int64_t> pos = {7, 0, 300, 2, 2, 99999};
    for (int64_t p : pos) request.mutable_rope_apply()->add_positions(p);
    absl::StatusOr<v1::EncodeResponse> r = Encode(request);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(AllClose(Doubles(r->x()), RefRotate(rr, xd, 2, 3, 2, 8, pos), kF32Tol));
  }
  {
    v1::EncodeRequest request = RopeApplyRequest(x);
    request.mutable_rope_apply()->add_offsets(10);
    request.mutable_rope_apply()->add_offsets(40);
    absl::StatusOr<v1::EncodeResponse> r = Encode(request);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(AllClose(Doubles(r->x()), RefRotate(rr, xd, 2, 3, 2, 8, {10, 11, 12, 40, 41, 42}),
                         kF32Tol));
  }
  {
    v1::EncodeRequest request = RopeApplyRequest(x);
    absl::StatusOr<v1::EncodeResponse> r = Encode(request);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(
        AllClose(Doubles(r->x()), RefRotate(rr, xd, 2, 3, 2, 8, {0, 1, 2, 0, 1, 2}), kF32Tol));
  }
}

// Without seq_len, dynamic NTK (and LongRoPE) are planned for the largest
// position rotated + 1, as transformers plans them from max(position_ids).
TEST(RunEncodeTest, RopeApplyWithoutSeqLenPlansForTheLargestPosition) {
  const Tensor x = RandomTensor(DType::kF32, {1, 2, 2, 8}, 14);
  const std::vector<double> xd = ToDoubles(x.cview());
  auto dynamic = [](v1::EncodeRequest& request) {
    auto* s = request.mutable_rope_apply()->mutable_rope()->mutable_scaling();
    s->set_rope_type("dynamic");
    s->set_factor(4.0);
    s->set_original_max_position_embeddings(64);
  };
  {
    v1::EncodeRequest request = RopeApplyRequest(x);
    dynamic(request);
    request.mutable_rope_apply()->add_positions(3);
    request.mutable_rope_apply()->add_positions(5000);
    absl::StatusOr<v1::EncodeResponse> r = Encode(request);
    ASSERT_TRUE(r.ok()) << r.status();
    RopeRef rr{ref::DynamicNtkInvFreq(8, 1000.0, 4.0, 64, 5001), 1.0};
    EXPECT_TRUE(AllClose(Doubles(r->x()), RefRotate(rr, xd, 1, 2, 2, 8, {3, 5000}), kF32Tol));
  }
  {
    v1::EncodeRequest request = RopeApplyRequest(x);
    dynamic(request);
    request.mutable_rope_apply()->add_offsets(4999);  // tokens at 4999 and 5000
    absl::StatusOr<v1::EncodeResponse> r = Encode(request);
    ASSERT_TRUE(r.ok()) << r.status();
    RopeRef rr{ref::DynamicNtkInvFreq(8, 1000.0, 4.0, 64, 5001), 1.0};
    EXPECT_TRUE(AllClose(Doubles(r->x()), RefRotate(rr, xd, 1, 2, 2, 8, {4999, 5000}), kF32Tol));
    // An explicit seq_len still wins.
    request.mutable_rope_apply()->set_seq_len(10000);
    r = Encode(request);
    ASSERT_TRUE(r.ok()) << r.status();
    RopeRef rr10k{ref::DynamicNtkInvFreq(8, 1000.0, 4.0, 64, 10000), 1.0};
    EXPECT_TRUE(
        AllClose(Doubles(r->x()), RefRotate(rr10k, xd, 1, 2, 2, 8, {4999, 5000}), kF32Tol));
  }
}

TEST(RunEncodeTest, RopeApplyInverseUndoesForwardWithAttentionFactor) {
  const Tensor x = RandomTensor(DType::kF32, {1, 4, 3, 8}, 12);
  const std::vector<double> xd = ToDoubles(x.cview());
  v1::EncodeRequest request = RopeApplyRequest(x);
  auto* op = request.mutable_rope_apply();
  op->mutable_rope()->set_layout(v1::ROPE_LAYOUT_INTERLEAVED);
  op->mutable_rope()->mutable_scaling()->set_rope_type("yarn");
  op->mutable_rope()->mutable_scaling()->set_factor(8.0);
  op->mutable_rope()->mutable_scaling()->set_original_max_position_embeddings(16);
  op->add_offsets(5);
  absl::StatusOr<v1::EncodeResponse> fwd = Encode(request);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  ref::YarnRefParams y;
  y.factor = 8.0;
  y.original_len = 16;
  RopeRef rr{ref::YarnInvFreq(8, 1000.0, y), ref::YarnAttentionFactor(y), 0, true};
  EXPECT_NEAR(fwd->attention_factor(), rr.attention_factor, 1e-12);
  EXPECT_TRUE(AllClose(Doubles(fwd->x()), RefRotate(rr, xd, 1, 4, 3, 8, {5, 6, 7, 8}), kF32Tol));

  *op->mutable_x() = fwd->x();
  op->set_inverse(true);
  absl::StatusOr<v1::EncodeResponse> back = Encode(request);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(AllClose(Doubles(back->x()), xd, kF32Tol));
}

TEST(RunEncodeTest, RopeApplyBf16) {
  const Tensor x = RandomTensor(DType::kBF16, {2, 5, 1, 16}, 13);
  v1::EncodeRequest request = RopeApplyRequest(x);
  request.mutable_rope_apply()->mutable_rope()->set_rotary_dim(8);
  absl::StatusOr<v1::EncodeResponse> r = Encode(request);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->x().dtype(), v1::DTYPE_BF16);
  RopeRef rr{ref::DefaultInvFreq(8, 1000.0), 1.0, 8, false};
  EXPECT_TRUE(AllClose(
      Doubles(r->x()),
      RefRotate(rr, ToDoubles(x.cview()), 2, 5, 1, 16, {0, 1, 2, 3, 4, 0, 1, 2, 3, 4}), kBF16Tol));
}

TEST(RunEncodeTest, RopeApplyEmptyXWithHugeDims) {
  v1::EncodeRequest request;
  auto* x = request.mutable_rope_apply()->mutable_x();
  x->set_dtype(v1::DTYPE_F32);
  for (int64_t d : {int64_t{1} << 33, (int64_t{1} << 31) + 1, int64_t{0}, int64_t{8}}) {
    x->add_shape(d);
  }
  absl::StatusOr<v1::EncodeResponse> r = Encode(request);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->x().data().empty());
  EXPECT_EQ(r->attention_factor(), 1.0);
}

TEST(RunEncodeTest, AlibiSlopesAndBias) {
  for (bool bidirectional : {false, true}) {
    SCOPED_TRACE(bidirectional);
    v1::EncodeRequest request;
    auto* op = request.mutable_alibi();
    op->set_heads(12);
    op->set_q_len(4);
    op->set_k_len(9);
    op->set_q_offset(5);
    op->set_bidirectional(bidirectional);
    absl::StatusOr<v1::EncodeResponse> r = Encode(request);
    ASSERT_TRUE(r.ok()) << r.status();
    const std::vector<double> slopes = ref::AlibiSlopes(12);
    EXPECT_TRUE(
        AllClose(std::vector<double>(r->slopes().begin(), r->slopes().end()), slopes, 1e-12));
    EXPECT_THAT(Shape(r->bias()), ElementsAre(12, 4, 9));
    EXPECT_TRUE(
        AllClose(Doubles(r->bias()), ref::AlibiBias(slopes, 4, 9, 5, bidirectional), kF32Tol));
  }
}

TEST(RunEncodeTest, AlibiSlopesOnlyWhenQLenIsZero) {
  v1::EncodeRequest request;
  request.mutable_alibi()->set_heads(5);
  absl::StatusOr<v1::EncodeResponse> r = Encode(request);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(AllClose(std::vector<double>(r->slopes().begin(), r->slopes().end()),
                       ref::AlibiSlopes(5), 1e-12));
  EXPECT_FALSE(r->has_bias());
}

TEST(RunEncodeTest, T5BucketsAndBias) {
  for (bool bidirectional : {true, false}) {
    SCOPED_TRACE(bidirectional);
    v1::EncodeRequest request;
    auto* op = request.mutable_t5();
    op->set_num_buckets(16);
    op->set_max_distance(40);
    op->set_bidirectional(bidirectional);
    op->set_q_len(6);
    op->set_k_len(70);
    op->set_q_offset(30);
    const Tensor table = RandomTensor(DType::kF32, {16, 3}, 14);
    *op->mutable_table() = Wire(table);
    absl::StatusOr<v1::EncodeResponse> r = Encode(request);
    ASSERT_TRUE(r.ok()) << r.status();
    std::vector<int> expected;
    for (int64_t i = 0; i < 6; ++i) {
      for (int64_t j = 0; j < 70; ++j) {
        expected.push_back(ref::T5Bucket(j - (30 + i), bidirectional, 16, 40));
      }
    }
    EXPECT_THAT(r->buckets(), ElementsAreArray(expected));
    EXPECT_THAT(Shape(r->bias()), ElementsAre(3, 6, 70));
    EXPECT_TRUE(AllClose(Doubles(r->bias()),
                         ref::T5Bias(ToDoubles(table.cview()), 16, 3, bidirectional, 40, 6, 70, 30),
                         kF32Tol));
  }
}

TEST(RunEncodeTest, T5DefaultsWithoutTable) {
  v1::EncodeRequest request;
  request.mutable_t5()->set_q_len(2);
  request.mutable_t5()->set_k_len(300);
  request.mutable_t5()->set_bidirectional(true);
  absl::StatusOr<v1::EncodeResponse> r = Encode(request);
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<int> expected;
  for (int64_t i = 0; i < 2; ++i) {
    for (int64_t j = 0; j < 300; ++j) expected.push_back(ref::T5Bucket(j - i, true, 32, 128));
  }
  EXPECT_THAT(r->buckets(), ElementsAreArray(expected));
  EXPECT_FALSE(r->has_bias());
}

// --- Conversions ---

TEST(ConvertTest, ToGrpcStatusKeepsCodeAndMessage) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  const grpc::Status s = ToGrpcStatus(absl::OutOfRangeError("position 9 past 8"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(s.error_message(), "position 9 past 8");
  EXPECT_EQ(ToGrpcStatus(absl::ResourceExhaustedError("x")).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(ToGrpcStatus(absl::UnimplementedError("x")).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
}

TEST(ConvertTest, DTypes) {
  EXPECT_EQ(*DTypeFromProto(v1::DTYPE_F32, "f"), DType::kF32);
  EXPECT_EQ(*DTypeFromProto(v1::DTYPE_BF16, "f"), DType::kBF16);
  EXPECT_EQ(*DTypeFromProto(v1::DTYPE_UNSPECIFIED, "f", DType::kBF16), DType::kBF16);
  absl::StatusOr<DType> unspecified = DTypeFromProto(v1::DTYPE_UNSPECIFIED, "out_dtype");
  EXPECT_EQ(unspecified.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unspecified.status().message(), HasSubstr("out_dtype"));
  absl::StatusOr<DType> unknown = DTypeFromProto(7, "q.dtype", DType::kF32);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), HasSubstr("7"));
  EXPECT_EQ(DTypeToProto(DType::kF32), v1::DTYPE_F32);
  EXPECT_EQ(DTypeToProto(DType::kBF16), v1::DTYPE_BF16);
}

TEST(ConvertTest, TensorRoundTripAndStridedViews) {
  const Tensor t = RandomTensor(DType::kBF16, {2, 3, 4}, 5);
  absl::StatusOr<Tensor> back = TensorFromProto(Wire(t), "t");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->dtype(), DType::kBF16);
  EXPECT_THAT(back->dims(), ElementsAre(2, 3, 4));
  EXPECT_EQ(std::memcmp(back->data<char>(), t.data<char>(), t.byte_size()), 0);

  // A strided view (middle slice of axis 1) becomes dense row-major bytes.
  const Tensor f = RandomTensor(DType::kF32, {2, 5, 3}, 6);
  const ConstTensorView slice = f.cview().Slice(1, 1, 3);
  v1::Tensor wire;
  TensorToProto(slice, &wire);
  EXPECT_EQ(wire.dtype(), v1::DTYPE_F32);
  EXPECT_THAT(Shape(wire), ElementsAre(2, 3, 3));
  EXPECT_EQ(Doubles(wire), ToDoubles(slice));

  // Empty tensors are fine both ways.
  absl::StatusOr<Tensor> empty = TensorFromProto(Wire(*Tensor::Create(DType::kF32, {0, 4})), "e");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->num_elements(), 0);
}

TEST(ConvertTest, ResolveSpecDefaults) {
  v1::AttentionSpec spec;
  spec.set_heads(8);
  spec.set_head_dim(64);
  spec.mutable_alibi();
  absl::StatusOr<ResolvedSpec> r = ResolveSpec(spec);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->kv_heads, 8);
  EXPECT_EQ(r->options.bias.kind, BiasKind::kAlibi);
  EXPECT_TRUE(AllClose(r->options.bias.alibi_slopes, ref::AlibiSlopes(8), 1e-15));
  EXPECT_FALSE(r->rope.has_value());

  v1::AttentionSpec rope_spec;
  rope_spec.set_heads(4);
  rope_spec.set_kv_heads(1);
  rope_spec.set_head_dim(64);
  rope_spec.mutable_rope()->mutable_scaling()->set_rope_type("yarn");
  rope_spec.mutable_rope()->mutable_scaling()->set_original_max_position_embeddings(4096);
  rope_spec.mutable_rope()->mutable_scaling()->set_beta_fast(-1.0);
  absl::StatusOr<ResolvedSpec> bad = ResolveSpec(rope_spec);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), AllOf(HasSubstr("spec.rope"), HasSubstr("beta_fast -1")));
  // An explicit zero is the default, as transformers' `get("beta_fast") or 32`.
  rope_spec.mutable_rope()->mutable_scaling()->set_beta_fast(0.0);
  absl::StatusOr<ResolvedSpec> ok = ResolveSpec(rope_spec);
  ASSERT_TRUE(ok.ok()) << ok.status();
  ASSERT_TRUE(ok->rope.has_value());
  EXPECT_EQ(ok->rope->theta, 10000.0);
  EXPECT_EQ(ok->rope->scaling.factor, 1.0);
  EXPECT_EQ(ok->rope->scaling.beta_fast, 32.0);
  EXPECT_EQ(ok->rope->scaling.type, RopeScalingType::kYarn);
}

// --- The bad-input matrix ---

v1::AttendRequest GoodAttend() {
  v1::AttendRequest r;
  r.mutable_spec()->set_heads(4);
  r.mutable_spec()->set_kv_heads(2);
  r.mutable_spec()->set_head_dim(8);
  *r.mutable_q() = Wire(RandomTensor(DType::kF32, {2, 3, 4, 8}, 21));
  *r.mutable_k() = Wire(RandomTensor(DType::kF32, {2, 5, 2, 8}, 22));
  *r.mutable_v() = Wire(RandomTensor(DType::kF32, {2, 5, 2, 6}, 23));
  return r;
}

absl::Status AttendStatus(const v1::AttendRequest& request) {
  v1::AttendResponse response;
  absl::StatusOr<Cost> cost = PriceAttend(request, kThreads);
  if (!cost.ok()) return cost.status();
  if (absl::Status st = CheckCost(*cost, CostLimits(), "Attend"); !st.ok()) return st;
  return RunAttend(request, &response, ComputeOptions{kThreads});
}

#define EXPECT_STATUS(expr, code_, substr)                     \
  do {                                                         \
    const absl::Status s_ = (expr);                            \
    EXPECT_EQ(s_.code(), absl::StatusCode::code_) << s_;       \
    EXPECT_THAT(std::string(s_.message()), HasSubstr(substr)); \
  } while (0)

TEST(BadInputTest, TheGoodRequestIsGood) { EXPECT_TRUE(AttendStatus(GoodAttend()).ok()); }

// Typed values (grpcurl JSON) instead of bytes: the same answer, and named
// errors for mixing, counts and dtype.
// A [B, H, S, D] tensor (the transformers layout) is refused naming both
// shapes: what it got and what it should send.
TEST(BadInputTest, TheTransformersLayoutIsNamed) {
  v1::AttendRequest r = GoodAttend();  // q [2, 3, 4, 8], k/v [2, 5, 2, *]
  *r.mutable_q() = Wire(RandomTensor(DType::kF32, {2, 4, 3, 8}, 21));
  absl::Status st = AttendStatus(r);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("shape [2, 4, 3, 8]"));
  EXPECT_THAT(st.message(), HasSubstr("i.e. [2, 3, 4, 8]"));
  r = GoodAttend();
  *r.mutable_k() = Wire(RandomTensor(DType::kF32, {2, 2, 5, 8}, 22));
  st = AttendStatus(r);
  EXPECT_THAT(st.message(), HasSubstr("transformers layout"));
  EXPECT_THAT(st.message(), HasSubstr("[2, 5, 2, 8]"));
}

TEST(BadInputTest, TypedValuesInsteadOfBytes) {
  const v1::AttendRequest good = GoodAttend();
  v1::AttendRequest typed = good;
  for (v1::Tensor* t : {typed.mutable_q(), typed.mutable_k(), typed.mutable_v()}) {
    std::vector<float> values(t->data().size() / sizeof(float));
    std::memcpy(values.data(), t->data().data(), t->data().size());
    t->clear_data();
    for (float x : values) t->add_f32_values(x);
  }
  v1::AttendResponse a, b;
  ASSERT_TRUE(RunAttend(good, &a, ComputeOptions{kThreads}).ok());
  const absl::Status st_typed = RunAttend(typed, &b, ComputeOptions{kThreads});
  ASSERT_TRUE(st_typed.ok()) << st_typed;
  EXPECT_EQ(a.out().data(), b.out().data());

  v1::AttendRequest both = typed;
  both.mutable_q()->set_data(good.q().data());
  EXPECT_THAT(AttendStatus(both).message(), HasSubstr("q sets both data"));
  v1::AttendRequest short_values = typed;
  short_values.mutable_k()->mutable_f32_values()->RemoveLast();
  EXPECT_THAT(AttendStatus(short_values).message(), HasSubstr("k.f32_values has"));
  v1::AttendRequest bf16 = typed;
  bf16.mutable_v()->set_dtype(v1::DTYPE_BF16);
  EXPECT_THAT(AttendStatus(bf16).message(), HasSubstr("v.f32_values needs dtype"));
}

TEST(BadInputTest, ExplicitPositionsNameTheFieldAndIndex) {
  const v1::AttendRequest good = GoodAttend();
  const int64_t batch = good.q().shape(0), sq = good.q().shape(1), sk = good.k().shape(1);
  v1::AttendRequest r = good;
  for (int64_t i = 0; i < batch * sq; ++i) r.add_q_positions(100 + i);
  for (int64_t i = 0; i < batch * sk; ++i) r.add_k_positions(i % sk);
  ASSERT_TRUE(AttendStatus(r).ok()) << AttendStatus(r);
  struct Bad {
    std::function<void(v1::AttendRequest&)> edit;
    const char* says;
  };
  const Bad bads[] = {
      {[](v1::AttendRequest& x) { x.add_q_offsets(0), x.add_q_offsets(0); }, "q_offsets or q_positions"},
      {[](v1::AttendRequest& x) { x.add_q_positions(1); }, "q_positions has"},
      {[](v1::AttendRequest& x) { x.set_q_positions(0, -1); }, "q_positions[0]"},
      {[](v1::AttendRequest& x) { x.add_k_positions(1); }, "k_positions has"},
      {[&](v1::AttendRequest& x) { x.set_k_positions(1, 5000); }, "k_positions[2]"},
      {[](v1::AttendRequest& x) { x.clear_q_positions(); }, "k_positions needs q_positions"},
  };
  for (const Bad& bad : bads) {
    v1::AttendRequest x = r;
    bad.edit(x);
    const absl::Status st = AttendStatus(x);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad.says << ": " << st;
    EXPECT_THAT(st.message(), HasSubstr(bad.says));
  }
}

TEST(BadInputTest, WrongByteLength) {
  v1::AttendRequest r = GoodAttend();
  r.mutable_spec()->set_heads(4);
  r.mutable_spec()->set_head_dim(64);
  r.mutable_q()->clear_shape();
  for (int64_t d : {1, 2, 4, 64}) r.mutable_q()->add_shape(d);
  r.mutable_q()->set_data(std::string(1000, '\0'));
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument,
                "q.data has 1000 bytes, shape [1, 2, 4, 64] in f32 needs 2048");
  r = GoodAttend();
  r.mutable_v()->mutable_data()->pop_back();
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "v.data has 479 bytes");
}

TEST(BadInputTest, QShapeDisagreesWithSpec) {
  v1::AttendRequest r = GoodAttend();
  r.mutable_spec()->set_heads(2);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument,
                "q has 4 heads (shape [2, 3, 4, 8]) but spec.heads is 2");
  r = GoodAttend();
  r.mutable_spec()->set_head_dim(16);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "spec.head_dim is 16");
  r = GoodAttend();
  r.mutable_spec()->set_kv_heads(4);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "spec.kv_heads is 4");
  r = GoodAttend();
  *r.mutable_k() = Wire(RandomTensor(DType::kF32, {1, 5, 2, 8}, 1));
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "k has batch 1");
  r = GoodAttend();
  *r.mutable_v() = Wire(RandomTensor(DType::kF32, {2, 4, 2, 6}, 1));
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "v has 4 keys");
  r = GoodAttend();
  *r.mutable_q() = Wire(RandomTensor(DType::kF32, {3, 4, 8}, 1));
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "q must have rank 4");
}

TEST(BadInputTest, OverflowingShapeProduct) {
  v1::AttendRequest r = GoodAttend();
  r.mutable_q()->clear_shape();
  for (int64_t d : {int64_t{1} << 40, int64_t{1} << 40, int64_t{1}, int64_t{1}}) {
    r.mutable_q()->add_shape(d);
  }
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "q.shape");
}

TEST(BadInputTest, NegativeDimAndTooManyDims) {
  v1::AttendRequest r = GoodAttend();
  r.mutable_k()->set_shape(1, -5);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "k.shape[1] is negative (-5)");
  r = GoodAttend();
  for (int i = 0; i < 100; ++i) r.mutable_q()->add_shape(1);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "q.shape has 104 dims");
}

TEST(BadInputTest, HeadsNotDivisibleByKvHeads) {
  v1::AttendRequest r = GoodAttend();
  r.mutable_spec()->set_kv_heads(3);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument,
                "spec.heads (4) must be a multiple of spec.kv_heads (3)");
}

TEST(BadInputTest, OddHeadDimWithRope) {
  v1::AttendRequest r;
  r.mutable_spec()->set_heads(1);
  r.mutable_spec()->set_head_dim(63);
  r.mutable_spec()->mutable_rope();
  *r.mutable_q() = Wire(RandomTensor(DType::kF32, {1, 1, 1, 63}, 1));
  *r.mutable_k() = Wire(RandomTensor(DType::kF32, {1, 1, 1, 63}, 2));
  *r.mutable_v() = Wire(RandomTensor(DType::kF32, {1, 1, 1, 63}, 3));
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "spec.head_dim must be even");
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "63");
  // Partial rotary over an even prefix of an odd head is fine.
  r.mutable_spec()->mutable_rope()->set_rotary_dim(62);
  EXPECT_TRUE(AttendStatus(r).ok());
  r.mutable_spec()->mutable_rope()->set_rotary_dim(61);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "spec.rope: rotary_dim must be even, got 61");
}

TEST(BadInputTest, UnknownRopeType) {
  v1::AttendRequest r = GoodAttend();
  r.mutable_spec()->mutable_rope()->mutable_scaling()->set_rope_type("foo");
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "\"foo\"");
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "spec.rope.scaling.rope_type");
}

TEST(BadInputTest, BadRopeScalingParameters) {
  v1::AttendRequest r = GoodAttend();
  auto* s = r.mutable_spec()->mutable_rope()->mutable_scaling();
  s->set_rope_type("longrope");
  s->set_original_max_position_embeddings(4);
  s->add_short_factor(1.0);
  s->add_long_factor(1.0);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "short_factor");
  s->clear_short_factor();
  s->clear_long_factor();
  s->set_rope_type("llama3");
  EXPECT_TRUE(AttendStatus(r).ok());
  s->set_high_freq_factor(0.5);  // below low_freq_factor: transformers warns and computes
  EXPECT_TRUE(AttendStatus(r).ok());
  s->set_high_freq_factor(0);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "high_freq_factor");
  s->clear_high_freq_factor();
  s->set_rope_type("yarn");
  s->clear_original_max_position_embeddings();
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "original_max_position_embeddings");
}

// A parameter the rule would not read is refused, naming the field and the
// rule (never silently ignored).
TEST(BadInputTest, RopeParametersTheRuleDoesNotReadAreRefused) {
  struct Case {
    const char* rule;
    std::function<void(v1::RopeScaling*)> set;
    const char* field;
  };
  auto longrope = [](v1::RopeScaling* s) {
    s->set_original_max_position_embeddings(4);
    for (int i = 0; i < 4; ++i) {  // head_dim 8: 4 pairs
      s->add_short_factor(1.0);
      s->add_long_factor(2.0);
    }
  };
  const Case cases[] = {
      {"default", [](v1::RopeScaling* s) { s->set_factor(2.0); }, "factor"},
      {"default", [](v1::RopeScaling* s) { s->set_original_max_position_embeddings(8); },
       "original_max_position_embeddings"},
      {"linear",
       [](v1::RopeScaling* s) {
         s->set_factor(2.0);
         s->set_attention_factor(1.1);
       },
       "attention_factor"},
      {"linear",
       [](v1::RopeScaling* s) {
         s->set_factor(2.0);
         s->set_original_max_position_embeddings(8);
       },
       "original_max_position_embeddings"},
      {"ntk",
       [](v1::RopeScaling* s) {
         s->set_factor(2.0);
         s->set_original_max_position_embeddings(8);
       },
       "original_max_position_embeddings"},
      {"dynamic",
       [](v1::RopeScaling* s) {
         s->set_factor(2.0);
         s->set_original_max_position_embeddings(8);
         s->set_beta_fast(16.0);
       },
       "beta_fast"},
      {"llama3",
       [](v1::RopeScaling* s) {
         s->set_factor(8.0);
         s->set_original_max_position_embeddings(16);
         s->set_beta_slow(2.0);
       },
       "beta_slow"},
      {"llama3",
       [](v1::RopeScaling* s) {
         s->set_factor(8.0);
         s->set_original_max_position_embeddings(16);
         s->set_truncate(false);
       },
       "truncate"},
      {"yarn",
       [](v1::RopeScaling* s) {
         s->set_factor(4.0);
         s->set_original_max_position_embeddings(16);
         s->add_short_factor(1.0);
       },
       "short_factor"},
      {"yarn",
       [](v1::RopeScaling* s) {
         s->set_factor(4.0);
         s->set_original_max_position_embeddings(16);
         s->set_low_freq_factor(1.0);
       },
       "low_freq_factor"},
      {"yarn",
       [](v1::RopeScaling* s) {
         s->set_factor(4.0);
         s->set_original_max_position_embeddings(16);
         s->set_mscale(1.0);  // without mscale_all_dim transformers ignores it
       },
       "mscale"},
      {"yarn",
       [](v1::RopeScaling* s) {
         s->set_factor(4.0);
         s->set_original_max_position_embeddings(16);
         s->set_mscale(1.0);
         s->set_mscale_all_dim(0.5);
         s->set_attention_factor(1.2);  // overrides both
       },
       "mscale"},
      {"yarn",
       [](v1::RopeScaling* s) {
         s->set_factor(4.0);
         s->set_original_max_position_embeddings(16);
         s->set_max_position_embeddings(64);
       },
       "max_position_embeddings"},
      {"longrope",
       [&](v1::RopeScaling* s) {
         longrope(s);
         s->set_factor(4.0);
         s->set_attention_factor(1.1);  // the factor only feeds the attention factor
       },
       "factor"},
      {"longrope",
       [&](v1::RopeScaling* s) {
         longrope(s);
         s->set_factor(4.0);
         s->set_max_position_embeddings(64);
       },
       "factor"},
      {"longrope",
       [&](v1::RopeScaling* s) {
         longrope(s);
         s->set_max_position_embeddings(64);
         s->set_attention_factor(1.1);
       },
       "max_position_embeddings"},
      {"longrope",
       [&](v1::RopeScaling* s) {
         longrope(s);
         s->set_beta_fast(8.0);
       },
       "beta_fast"},
  };
  for (const Case& c : cases) {
    v1::AttendRequest r = GoodAttend();
    auto* s = r.mutable_spec()->mutable_rope()->mutable_scaling();
    s->set_rope_type(c.rule);
    c.set(s);
    SCOPED_TRACE(s->ShortDebugString());
    const absl::Status st = AttendStatus(r);
    EXPECT_STATUS(st, kInvalidArgument, absl::StrCat("spec.rope.scaling.", c.field, " has no effect"));
    EXPECT_STATUS(st, kInvalidArgument, absl::StrCat("rope_type \"", c.rule, "\""));
  }
  // What each rule reads is accepted, and values meaning "not given" are
  // not counted: factor 1 with default, mscale 0 (transformers' truthiness).
  const Case good[] = {
      {"default", [](v1::RopeScaling* s) { s->set_factor(1.0); }, ""},
      {"linear", [](v1::RopeScaling* s) { s->set_mscale(0.0); }, ""},
      {"yarn",
       [](v1::RopeScaling* s) {
         s->set_factor(4.0);
         s->set_original_max_position_embeddings(16);
         s->set_beta_fast(16.0);
         s->set_beta_slow(2.0);
         s->set_truncate(false);
         s->set_mscale(1.0);
         s->set_mscale_all_dim(0.5);
       },
       ""},
      {"yarn",
       [](v1::RopeScaling* s) {
         s->set_factor(4.0);
         s->set_original_max_position_embeddings(16);
         s->set_mscale(0.0);  // 0: not given, so nothing beside attention_factor
         s->set_mscale_all_dim(0.0);
         s->set_attention_factor(1.2);
       },
       ""},
      {"longrope",
       [&](v1::RopeScaling* s) {
         longrope(s);
         s->set_max_position_embeddings(64);
       },
       ""},
      {"llama3",
       [](v1::RopeScaling* s) {
         s->set_factor(8.0);
         s->set_original_max_position_embeddings(16);
         s->set_low_freq_factor(1.0);
         s->set_high_freq_factor(2.0);
       },
       ""},
  };
  for (const Case& c : good) {
    v1::AttendRequest r = GoodAttend();
    auto* s = r.mutable_spec()->mutable_rope()->mutable_scaling();
    s->set_rope_type(c.rule);
    c.set(s);
    EXPECT_TRUE(AttendStatus(r).ok()) << s->ShortDebugString() << ": " << AttendStatus(r);
  }
  v1::AttendRequest r = GoodAttend();
  auto* s = r.mutable_spec()->mutable_rope()->mutable_scaling();
  s->set_rope_type("longrope");
  longrope(s);
  s->set_max_position_embeddings(-1);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "max_position_embeddings must be in [0, 2^40]");
}

TEST(BadInputTest, NaNInQNamesTensorAndIndex) {
  for (bool rope : {false, true}) {
    SCOPED_TRACE(rope);
    v1::AttendRequest r = GoodAttend();
    if (rope) r.mutable_spec()->mutable_rope();
    Tensor q = RandomTensor(DType::kF32, {2, 3, 4, 8}, 21);
    // [1, 2, 3, 5]: with half-split RoPE its pair partner is channel 1,
    // which must not be blamed.
    q.data<float>()[((1 * 3 + 2) * 4 + 3) * 8 + 5] = std::nanf("");
    *r.mutable_q() = Wire(q);
    EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "q[1, 2, 3, 5] is NaN");
  }
  for (bool rope : {false, true}) {
    SCOPED_TRACE(rope);
    v1::AttendRequest r = GoodAttend();
    if (rope) r.mutable_spec()->mutable_rope();
    Tensor k = RandomTensor(DType::kF32, {2, 5, 2, 8}, 22);
    k.data<float>()[((1 * 5 + 4) * 2 + 1) * 8 + 2] = -std::numeric_limits<float>::infinity();
    *r.mutable_k() = Wire(k);
    EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "k[1, 4, 1, 2] is -inf");
    r = GoodAttend();
    if (rope) r.mutable_spec()->mutable_rope();
    Tensor v = RandomTensor(DType::kF32, {2, 5, 2, 6}, 23);
    v.data<float>()[7] = std::numeric_limits<float>::infinity();
    *r.mutable_v() = Wire(v);
    EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "v[0, 0, 1, 1] is +inf");
  }
  // Finite, but rotation adds two values near the float maximum: named as
  // the rotated tensor, not as a bad input.
  v1::AttendRequest r = GoodAttend();
  r.mutable_spec()->mutable_rope();
  Tensor k = RandomTensor(DType::kF32, {2, 5, 2, 8}, 22);
  // Position 1, kv head 0: cos 0.54, sin 0.84, so 3e38 * (0.54 + 0.84).
  float* row = k.data<float>() + ((0 * 5 + 1) * 2 + 0) * 8;
  row[0] = 3e38f;
  row[4] = -3e38f;  // channel 0's half-split partner
  *r.mutable_k() = Wire(k);
  // Named as the rotation's result, not as a bad input (the default rule
  // has no attention factor to blame either).
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "k (rotated by spec.rope)[0, 1, 0, 0] is +inf");
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "the finite k left the float range");
}

TEST(BadInputTest, UnspecifiedAndUnknownDtypes) {
  v1::AttendRequest r = GoodAttend();
  r.mutable_q()->set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "q.dtype is DTYPE_UNSPECIFIED");
  r = GoodAttend();
  r.mutable_k()->set_dtype(static_cast<v1::DType>(9));
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "k.dtype has unknown value 9");
  r = GoodAttend();
  r.set_out_dtype(static_cast<v1::DType>(5));
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "out_dtype");
  r = GoodAttend();
  *r.mutable_v() = Wire(RandomTensor(DType::kBF16, {2, 5, 2, 6}, 1));
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "k and v must share a dtype");
}

TEST(BadInputTest, KeyLengths) {
  v1::AttendRequest r = GoodAttend();
  r.add_key_lengths(5);
  r.add_key_lengths(-1);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "key_lengths[1] must be >= 0, got -1");
  r.set_key_lengths(1, 6);
  EXPECT_STATUS(AttendStatus(r), kOutOfRange, "key_lengths[1] = 6 exceeds the 5 keys");
  r.add_key_lengths(1);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "key_lengths has 3 entries");
}

TEST(BadInputTest, QOffsets) {
  v1::AttendRequest r = GoodAttend();
  r.add_q_offsets(0);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "q_offsets has 1 entries");
  r.add_q_offsets(-3);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "q_offsets[1] must be >= 0, got -3");
  r.set_q_offsets(1, int64_t{1} << 40);  // the last of 3 queries lands past 2^40
  EXPECT_STATUS(AttendStatus(r), kOutOfRange, "q_offsets[1]");
}

TEST(BadInputTest, MoreQueriesThanKeysNeedOffsetsWhenPositionsMatter) {
  v1::AttendRequest r = GoodAttend();
  *r.mutable_q() = Wire(RandomTensor(DType::kF32, {2, 7, 4, 8}, 1));
  EXPECT_TRUE(AttendStatus(r).ok());
  r.mutable_spec()->set_causal(true);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "set q_offsets");
  r.mutable_spec()->set_causal(false);
  r.mutable_spec()->mutable_rope();
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "rope need real positions");
  r.add_q_offsets(0);
  r.add_q_offsets(9);
  EXPECT_TRUE(AttendStatus(r).ok());
}

TEST(BadInputTest, BadSpecScalars) {
  v1::AttendRequest r = GoodAttend();
  r.mutable_spec()->set_scale(-1.0);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "spec.scale must be finite and in [0, 10000], got -1");
  r = GoodAttend();
  r.mutable_spec()->set_softcap(std::nan(""));
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "spec.softcap");
  // A cap too small for f32 (it would round to 0, "none") is refused by
  // value, not run without a cap.
  for (double cap : {1e-46, 1e-300, 5e-324}) {
    r = GoodAttend();
    r.mutable_spec()->set_softcap(cap);
    EXPECT_STATUS(AttendStatus(r), kInvalidArgument,
                  absl::StrFormat("spec.softcap must be 0 (none) or finite and in [1e-30, 1e+06], got %g", cap));
  }
  r = GoodAttend();
  r.mutable_spec()->set_softcap(1e-30);
  EXPECT_TRUE(AttendStatus(r).ok());
  r = GoodAttend();
  r.mutable_spec()->set_window(-2);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "spec.window must be >= 0");
  r = GoodAttend();
  r.mutable_spec()->set_heads(0);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "spec.heads must be > 0, got 0");
  r = GoodAttend();
  r.mutable_spec()->set_kv_heads(-1);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "spec.kv_heads must be >= 0");
}

TEST(BadInputTest, BadBiasSpecs) {
  v1::AttendRequest r = GoodAttend();
  r.mutable_spec()->mutable_alibi()->add_slopes(0.5);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument,
                "spec.alibi.slopes has 1 entries, expected one per head (4)");
  for (int i = 0; i < 3; ++i) r.mutable_spec()->mutable_alibi()->add_slopes(std::nan(""));
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "spec.alibi.slopes[1] must be finite");

  r = GoodAttend();
  *r.mutable_spec()->mutable_t5()->mutable_table() = Wire(RandomTensor(DType::kF32, {32, 3}, 1));
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument,
                "spec.t5.table must have shape [num_buckets=32, heads=4]");
  *r.mutable_spec()->mutable_t5()->mutable_table() = Wire(RandomTensor(DType::kF32, {32, 4}, 1));
  EXPECT_TRUE(AttendStatus(r).ok());
  r.mutable_spec()->mutable_t5()->set_num_buckets(16);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "num_buckets=16");
  r.mutable_spec()->mutable_t5()->set_num_buckets(3);
  r.mutable_spec()->mutable_t5()->set_bidirectional(true);
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "spec.t5: num_buckets must be even");
  r.mutable_spec()->mutable_t5()->clear_table();
  EXPECT_STATUS(AttendStatus(r), kInvalidArgument, "spec.t5.table.dtype");
}

TEST(BadInputTest, HostileResultSizesAreResourceExhausted) {
  // 1 x 4 heads x 100000 queries x 200000 keys: small messages (q is 3.2 MB
  // with head_dim 2), but probs would be 8e10 floats.
  v1::AttendRequest r;
  r.mutable_spec()->set_heads(4);
  r.mutable_spec()->set_kv_heads(1);
  r.mutable_spec()->set_head_dim(2);
  r.mutable_q()->set_dtype(v1::DTYPE_BF16);
  for (int64_t d : {1, 100000, 4, 2}) r.mutable_q()->add_shape(d);
  r.mutable_q()->set_data(std::string(100000 * 4 * 2 * 2, '\0'));
  r.mutable_k()->set_dtype(v1::DTYPE_BF16);
  for (int64_t d : {1, 200000, 1, 2}) r.mutable_k()->add_shape(d);
  r.mutable_k()->set_data(std::string(200000 * 2 * 2, '\0'));
  r.mutable_v()->set_dtype(v1::DTYPE_BF16);
  for (int64_t d : {1, 200000, 1, 1}) r.mutable_v()->add_shape(d);
  r.mutable_v()->set_data(std::string(200000 * 2, '\0'));
  EXPECT_STATUS(AttendStatus(r), kResourceExhausted,
                "the attention [batch 1 x heads 4 x Sq 100000");

  // A tiny v with a huge value dim times many queries: out would not fit.
  v1::AttendRequest o;
  o.mutable_spec()->set_heads(1);
  o.mutable_spec()->set_head_dim(1);
  *o.mutable_q() = Wire(*Tensor::Create(DType::kF32, {1, 100000, 1, 1}));
  *o.mutable_k() = Wire(*Tensor::Create(DType::kF32, {1, 1, 1, 1}));
  *o.mutable_v() = Wire(*Tensor::Create(DType::kF32, {1, 1, 1, 100000}));
  EXPECT_STATUS(AttendStatus(o), kResourceExhausted, "out [1, 100000, 1, 100000]");
}

TEST(BadInputTest, EncodeWithoutOp) {
  v1::EncodeResponse response;
  EXPECT_STATUS(RunEncode(v1::EncodeRequest(), &response, ComputeOptions{}), kInvalidArgument,
                "EncodeRequest.op is not set");
}

TEST(BadInputTest, EncodeOps) {
  v1::EncodeRequest r;
  r.mutable_sinusoidal()->set_num_positions(1 << 20);
  r.mutable_sinusoidal()->set_d_model(1 << 10);
  EXPECT_STATUS(Encode(r).status(), kResourceExhausted, "sinusoidal table [1048576, 1024]");
  r.mutable_sinusoidal()->set_num_positions(int64_t{1} << 62);
  EXPECT_STATUS(Encode(r).status(), kOutOfRange, "sinusoidal.first_position = 0");
  r.mutable_sinusoidal()->set_num_positions(-1);
  EXPECT_STATUS(Encode(r).status(), kInvalidArgument, "sinusoidal.num_positions must be >= 0");
  r.mutable_sinusoidal()->set_num_positions(4);
  r.mutable_sinusoidal()->set_d_model(7);
  EXPECT_STATUS(Encode(r).status(), kInvalidArgument, "sinusoidal.d_model must be even");

  r.Clear();
  r.mutable_rope_frequencies()->set_head_dim(0);
  EXPECT_STATUS(Encode(r).status(), kInvalidArgument, "rope_frequencies.head_dim must be > 0");
  r.mutable_rope_frequencies()->set_head_dim(int64_t{1} << 40);
  EXPECT_STATUS(Encode(r).status(), kInvalidArgument,
                "rope_frequencies.head_dim is 1099511627776; RoPE ops take at most 65536");

  r.Clear();
  r.mutable_rope_cos_sin()->set_head_dim(8);
  r.mutable_rope_cos_sin()->add_positions((int64_t{1} << 40) + 1);
  EXPECT_STATUS(Encode(r).status(), kOutOfRange, "rope_cos_sin.positions[0]");
  r.mutable_rope_cos_sin()->set_positions(0, -1);
  EXPECT_STATUS(Encode(r).status(), kInvalidArgument, "positions[0] must be >= 0");

  Tensor x = RandomTensor(DType::kF32, {1, 2, 1, 8}, 3);
  r = RopeApplyRequest(x);
  r.mutable_rope_apply()->add_positions(1);
  EXPECT_STATUS(Encode(r).status(), kInvalidArgument, "rope_apply.positions has 1 entries");
  r.mutable_rope_apply()->add_positions(int64_t{1} << 41);
  EXPECT_STATUS(Encode(r).status(), kOutOfRange, "rope_apply.positions[1]");
  r.mutable_rope_apply()->add_offsets(0);
  EXPECT_STATUS(Encode(r).status(), kInvalidArgument, "at most one of positions");
  x.data<float>()[3] = std::nanf("");
  r = RopeApplyRequest(x);
  EXPECT_STATUS(Encode(r).status(), kInvalidArgument, "rope_apply.x[0, 0, 0, 3] is NaN");
  r.mutable_rope_apply()->mutable_rope()->mutable_scaling()->set_rope_type("bar");
  EXPECT_STATUS(Encode(r).status(), kInvalidArgument, "\"bar\"");

  r.Clear();
  r.mutable_alibi()->set_heads(0);
  EXPECT_STATUS(Encode(r).status(), kInvalidArgument, "alibi.heads must be > 0");
  r.mutable_alibi()->set_heads(100000);
  EXPECT_STATUS(Encode(r).status(), kInvalidArgument, "alibi.heads");
  r.mutable_alibi()->set_heads(8);
  r.mutable_alibi()->set_q_len(100000);
  r.mutable_alibi()->set_k_len(100000);
  EXPECT_STATUS(Encode(r).status(), kResourceExhausted, "alibi bias [8, 100000, 100000]");
  r.mutable_alibi()->set_k_len(-1);
  EXPECT_STATUS(Encode(r).status(), kInvalidArgument, "alibi.k_len must be >= 0");

  r.Clear();
  r.mutable_t5()->set_num_buckets(6);
  r.mutable_t5()->set_max_distance(2);
  EXPECT_STATUS(Encode(r).status(), kInvalidArgument, "t5: max_distance");
  r.mutable_t5()->set_max_distance(0);
  r.mutable_t5()->set_q_len(1);
  r.mutable_t5()->set_k_len(1);
  r.mutable_t5()->set_q_len(2);  // positions 2^40 and 2^40 + 1: one past the bound
  r.mutable_t5()->set_q_offset(int64_t{1} << 40);
  EXPECT_STATUS(Encode(r).status(), kOutOfRange, "t5.q_offset = 1099511627776");
  r.mutable_t5()->set_q_len(1);
  r.mutable_t5()->set_q_offset(0);
  *r.mutable_t5()->mutable_table() = Wire(RandomTensor(DType::kF32, {5, 2}, 1));
  EXPECT_STATUS(Encode(r).status(), kInvalidArgument, "t5.table must have shape [num_buckets=6");
}

// --- End to end through a real server ---

class UnaryRpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = ropeattn::testing::StartTestServer(ropeattn::testing::TestServerOptions());
    ASSERT_NE(server_, nullptr);
    stub_ = ropeattn::testing::TestStub(server_->port());
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(1));
  }
  std::unique_ptr<grpc::ClientContext> Context() {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return ctx;
  }

  std::unique_ptr<Server> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

TEST_F(UnaryRpcTest, AttendWithRopeMatchesReference) {
  const Tensor q = RandomTensor(DType::kF32, {1, 2, 4, 16}, 31);
  const Tensor k = RandomTensor(DType::kF32, {1, 6, 2, 16}, 32);
  const Tensor v = RandomTensor(DType::kF32, {1, 6, 2, 8}, 33);
  v1::AttendRequest request;
  request.mutable_spec()->set_heads(4);
  request.mutable_spec()->set_kv_heads(2);
  request.mutable_spec()->set_head_dim(16);
  request.mutable_spec()->set_causal(true);
  request.mutable_spec()->mutable_rope();
  *request.mutable_q() = Wire(q);
  *request.mutable_k() = Wire(k);
  *request.mutable_v() = Wire(v);
  request.set_return_probs(true);
  v1::AttendResponse response;
  const grpc::Status status = stub_->Attend(Context().get(), request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();

  const RopeRef rr{ref::DefaultInvFreq(16, 10000.0), 1.0};
  ref::AttentionRefParams p;
  p.q_len = 2;
  p.k_len = 6;
  p.heads = 4;
  p.kv_heads = 2;
  p.head_dim = 16;
  p.v_dim = 8;
  p.causal = true;
  const ref::AttentionRefResult expected = ref::Attention(
      p, RefRotate(rr, ToDoubles(q.cview()), 1, 2, 4, 16, {4, 5}),
      RefRotate(rr, ToDoubles(k.cview()), 1, 6, 2, 16, {0, 1, 2, 3, 4, 5}), ToDoubles(v.cview()));
  EXPECT_TRUE(AllClose(Doubles(response.out()), expected.out, kF32Tol));
  EXPECT_TRUE(AllClose(Doubles(response.probs()), expected.probs, kF32Tol));
}

TEST_F(UnaryRpcTest, EncodeAlibiMatchesReference) {
  v1::EncodeRequest request;
  request.mutable_alibi()->set_heads(8);
  request.mutable_alibi()->set_q_len(3);
  request.mutable_alibi()->set_k_len(5);
  v1::EncodeResponse response;
  const grpc::Status status = stub_->Encode(Context().get(), request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(AllClose(Doubles(response.bias()),
                       ref::AlibiBias(ref::AlibiSlopes(8), 3, 5, 0, false), kF32Tol));
}

TEST_F(UnaryRpcTest, ErrorsKeepTheirCodeAndMessageOnTheWire) {
  v1::AttendRequest request = GoodAttend();
  request.mutable_q()->set_data(std::string(1000, '\0'));
  v1::AttendResponse response;
  grpc::Status status = stub_->Attend(Context().get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("q.data has 1000 bytes"));

  request = GoodAttend();
  request.add_key_lengths(5);
  request.add_key_lengths(9);
  status = stub_->Attend(Context().get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_THAT(status.error_message(), HasSubstr("key_lengths[1] = 9"));

  v1::EncodeResponse encode_response;
  status = stub_->Encode(Context().get(), v1::EncodeRequest(), &encode_response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("EncodeRequest.op is not set"));
}

}  // namespace
}  // namespace ropeattn::server
