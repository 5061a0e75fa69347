// Layer mode, Embed and the model RPCs against a real server serving the
// built-in demo model. The expected values come from the same deterministic
// demo weights (loaded here in-process) pushed through a plain fp64 chain:
// x -> q/k/v projections -> the model's RoPE (tests/reference/rope_ref) ->
// causal attention (tests/reference/attention_ref) -> output projection.
// Tolerance: 1e-5 relative (norm-wise) for f32 weights and activations.
#include <immintrin.h>
#include <stdlib.h>

#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model.h"
#include "tests/core/test_util.h"
#include "tests/reference/attention_ref.h"
#include "tests/reference/rope_ref.h"
#include "tests/server/safetensors_writer.h"
#include "tests/server/server_test_util.h"

namespace ropeattn::testing {
namespace {

using ::testing::HasSubstr;

// y[r, o] = sum_i x[r, i] * W[o, i] + b[o], in double.
std::vector<double> RefLinear(const std::vector<double>& x, int64_t rows, const ConstTensorView& w,
                              const ConstTensorView& b) {
  const int64_t out = w.dim(0), in = w.dim(1);
  std::vector<double> y(rows * out, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = b.empty_view() ? 0.0 : b.GetFloat({o});
      for (int64_t i = 0; i < in; ++i) acc += x[r * in + i] * w.GetFloat({o, i});
      y[r * out + o] = acc;
    }
  }
  return y;
}

// The fp64 layer over a whole sequence [1, S, hidden] at positions 0..S-1.
std::vector<double> RefLayer(const server::Model& model, int64_t layer,
                             const std::vector<double>& x, int64_t s) {
  const server::ModelConfig& c = model.config();
  const server::LayerWeights* w = model.layer(layer).value();
  std::vector<double> q = RefLinear(x, s, w->q_proj, w->q_bias);
  std::vector<double> k = RefLinear(x, s, w->k_proj, w->k_bias);
  std::vector<double> v = RefLinear(x, s, w->v_proj, w->v_bias);
  if (c.rope) {
    const RopeConfig& r = *c.rope;
    const int64_t d = r.effective_rotary_dim();
    ref::RotateRefParams rp;
    rp.seq = s;
    rp.head_dim = c.head_dim;
    rp.rotary_dim = d;
    rp.interleaved = r.layout == RopeLayout::kInterleaved;
    for (int64_t i = 0; i < s; ++i) rp.positions.push_back(i);
    // The demo model uses Llama 3 scaling; compute its frequencies
    // independently of the core.
    EXPECT_EQ(r.scaling.type, RopeScalingType::kLlama3);
    rp.inv_freq = ref::Llama3InvFreq(d, r.theta, r.scaling.factor, r.scaling.low_freq_factor,
                                     r.scaling.high_freq_factor, r.scaling.original_max_positions);
    rp.heads = c.num_heads;
    q = ref::Rotate(rp, q);
    rp.heads = c.num_kv_heads;
    k = ref::Rotate(rp, k);
  }
  ref::AttentionRefParams ap;
  ap.q_len = s;
  ap.k_len = s;
  ap.heads = c.num_heads;
  ap.kv_heads = c.num_kv_heads;
  ap.head_dim = c.head_dim;
  ap.v_dim = c.head_dim;
  ap.causal = true;
  const std::vector<double> attn = ref::Attention(ap, q, k, v).out;
  return RefLinear(attn, s, w->o_proj, w->o_bias);
}

class LayerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = StartTestServer(TestServerOptions());
    ASSERT_NE(server_, nullptr);
    stub_ = TestStub(server_->port());
    demo_ = server::Model::Demo("demo").value();
  }
  void TearDown() override {
    if (server_) server_->Shutdown(absl::Seconds(1));
  }
  std::unique_ptr<server::Server> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  std::shared_ptr<const server::Model> demo_;
};

TEST_F(LayerTest, ListAndGetModelDescribeTheDemoModel) {
  grpc::ClientContext ctx;
  v1::ListModelsResponse list;
  ASSERT_TRUE(stub_->ListModels(&ctx, {}, &list).ok());
  ASSERT_EQ(list.models_size(), 1);
  const v1::ModelInfo& m = list.models(0);
  const server::ModelConfig& c = demo_->config();
  EXPECT_EQ(m.name(), "demo");
  EXPECT_EQ(m.source(), demo_->source());
  EXPECT_EQ(m.hidden_size(), c.hidden_size);
  EXPECT_EQ(m.num_heads(), c.num_heads);
  EXPECT_EQ(m.num_kv_heads(), c.num_kv_heads);
  EXPECT_LT(m.kv_heads(), m.heads());  // GQA
  EXPECT_EQ(m.num_layers(), demo_->num_layers());
  EXPECT_EQ(m.positions(), v1::POSITION_KIND_ROPE);
  EXPECT_EQ(m.rope().scaling().rope_type(), "llama3");
  // The resolved inverse frequencies are the Llama 3 rule's.
  const RopeConfig& r = *c.rope;
  const std::vector<double> want = ref::Llama3InvFreq(
      r.effective_rotary_dim(), r.theta, r.scaling.factor, r.scaling.low_freq_factor,
      r.scaling.high_freq_factor, r.scaling.original_max_positions);
  ASSERT_EQ(m.inv_freq_size(), static_cast<int>(want.size()));
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(m.inv_freq(i), want[i], 1e-12 * want[i]);
  EXPECT_GT(m.resident_bytes(), 0);

  grpc::ClientContext ctx2;
  v1::GetModelRequest req;
  req.set_name("nope");
  v1::ModelInfo info;
  grpc::Status st = stub_->GetModel(&ctx2, req, &info);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(st.error_message(), HasSubstr("nope"));
}

TEST_F(LayerTest, EmbedReturnsTableRowsAndRejectsOutOfVocabularyIds) {
  const server::ModelConfig& c = demo_->config();
  v1::EmbedRequest req;
  req.set_model("demo");
  const std::vector<int64_t> ids = {0, 5, c.vocab_size - 1, 17, 3, 3};
  for (int64_t id : ids) req.add_token_ids(id);
  req.add_shape(2);
  req.add_shape(3);
  grpc::ClientContext ctx;
  v1::EmbedResponse resp;
  ASSERT_TRUE(stub_->Embed(&ctx, req, &resp).ok());
  ASSERT_THAT(resp.embeddings().shape(), ::testing::ElementsAre(2, 3, c.hidden_size));
  const std::vector<double> got = WireToDoubles(resp.embeddings());
  for (size_t t = 0; t < ids.size(); ++t) {
    for (int64_t h = 0; h < c.hidden_size; ++h) {
      ASSERT_EQ(got[t * c.hidden_size + h], demo_->embed_tokens().GetFloat({ids[t], h}))
          << "token " << t << " dim " << h;
    }
  }
  req.set_token_ids(4, c.vocab_size);
  grpc::ClientContext ctx2;
  grpc::Status st = stub_->Embed(&ctx2, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(),
              HasSubstr(absl::StrCat("token_ids[4] = ", c.vocab_size, " is outside")));
}

TEST_F(LayerTest, AttendAndDecodeInLayerModeMatchTheReference) {
  const server::ModelConfig& c = demo_->config();
  const int64_t s = 9;
  const Tensor x = RandomTensor(DType::kF32, {1, s, c.hidden_size}, 42);
  const std::vector<double> xd = ToDoubles(x.view());
  for (int64_t layer = 0; layer < demo_->num_layers(); ++layer) {
    SCOPED_TRACE(::testing::Message() << "layer " << layer);
    const std::vector<double> want = RefLayer(*demo_, layer, xd, s);
    // One shot.
    v1::AttendRequest req;
    req.mutable_spec()->set_causal(true);
    req.mutable_layer()->set_model("demo");
    req.mutable_layer()->set_layer(static_cast<int32_t>(layer));
    *req.mutable_layer()->mutable_hidden() = ToWire(x.view());
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    grpc::Status st = stub_->Attend(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_THAT(resp.out().shape(), ::testing::ElementsAre(1, s, c.hidden_size));
    EXPECT_TRUE(AllClose(WireToDoubles(resp.out()), want, kF32Tol));
    // Token by token in a layer-mode session.
    grpc::ClientContext sctx;
    auto rw = stub_->Decode(&sctx);
    v1::DecodeRequest open;
    open.mutable_open()->set_model("demo");
    open.mutable_open()->set_layer(static_cast<int32_t>(layer));
    open.mutable_open()->set_max_context(64);
    v1::DecodeResponse r;
    ASSERT_TRUE(rw->Write(open));
    ASSERT_TRUE(rw->Read(&r));
    ASSERT_TRUE(r.has_opened()) << r.DebugString();
    std::vector<double> got;
    for (int64_t t = 0; t < s; ++t) {
      v1::DecodeRequest step;
      step.mutable_step()->set_seq(t + 1);
      *step.mutable_step()->mutable_hidden() = ToWire(x.cview().Slice(1, t, 1));
      ASSERT_TRUE(rw->Write(step));
      ASSERT_TRUE(rw->Read(&r));
      ASSERT_TRUE(r.has_step()) << r.DebugString();
      const std::vector<double> row = WireToDoubles(r.step().out());
      got.insert(got.end(), row.begin(), row.end());
    }
    EXPECT_TRUE(AllClose(got, want, kF32Tol));
    rw->WritesDone();
    EXPECT_TRUE(rw->Finish().ok());
  }
}

TEST_F(LayerTest, LayerModeErrors) {
  const server::ModelConfig& c = demo_->config();
  const Tensor x = RandomTensor(DType::kF32, {1, 4, c.hidden_size}, 1);
  auto attend = [&](const v1::AttendRequest& req) {
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    return stub_->Attend(&ctx, req, &resp);
  };
  v1::AttendRequest req;
  req.mutable_layer()->set_model("demo");
  req.mutable_layer()->set_layer(static_cast<int32_t>(demo_->num_layers()));
  *req.mutable_layer()->mutable_hidden() = ToWire(x.view());
  EXPECT_EQ(attend(req).error_code(), grpc::StatusCode::OUT_OF_RANGE);
  req.mutable_layer()->set_layer(-1);  // never a layer: INVALID_ARGUMENT
  grpc::Status negative = attend(req);
  EXPECT_EQ(negative.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(negative.error_message(), HasSubstr("layer must be >= 0"));
  req.mutable_layer()->set_layer(0);
  req.mutable_layer()->set_model("missing");
  EXPECT_EQ(attend(req).error_code(), grpc::StatusCode::NOT_FOUND);
  req.mutable_layer()->set_model("demo");
  const Tensor wrong = RandomTensor(DType::kF32, {1, 4, c.hidden_size + 1}, 1);
  *req.mutable_layer()->mutable_hidden() = ToWire(wrong.view());
  grpc::Status st = attend(req);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("layer.hidden"));
  *req.mutable_layer()->mutable_hidden() = ToWire(x.view());
  // The model's geometry and positional scheme cannot be overridden: a spec
  // asking for ALiBi, another RoPE or other heads is refused, not ignored.
  for (const auto& [field, set] :
       std::vector<std::pair<std::string, std::function<void(v1::AttentionSpec*)>>>{
           {"spec.alibi", [](v1::AttentionSpec* s) { s->mutable_alibi(); }},
           {"spec.rope", [](v1::AttentionSpec* s) { s->mutable_rope()->set_theta(12345); }},
           {"spec.t5", [](v1::AttentionSpec* s) { s->mutable_t5(); }},
           {"spec.heads = 3", [](v1::AttentionSpec* s) { s->set_heads(3); }},
           {"spec.head_dim = 99", [](v1::AttentionSpec* s) { s->set_head_dim(99); }}}) {
    SCOPED_TRACE(field);
    v1::AttendRequest bad = req;
    set(bad.mutable_spec());
    st = attend(bad);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr(field));
    EXPECT_THAT(st.error_message(), HasSubstr("leave them unset"));
  }
  EXPECT_TRUE(attend(req).ok());
  // The spec may restate the model's logit scale (head_dim^-0.5 = 0.25 for
  // the demo) in any spelling that is the same f32 (transformers' x**-0.5
  // and 1/sqrt(x) differ in fp64's last bit for many x); another is refused.
  for (double same : {0.25, std::pow(16.0, -0.5), 0.25 * (1 + 1e-12)}) {
    v1::AttendRequest restated = req;
    restated.mutable_spec()->set_scale(same);
    EXPECT_TRUE(attend(restated).ok()) << same;
  }
  v1::AttendRequest other = req;
  other.mutable_spec()->set_scale(0.2501);
  st = attend(other);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("spec.scale = 0.2501"));
  *req.mutable_q() = ToWire(x.view());
  EXPECT_EQ(attend(req).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // A session's layer without a model is refused, not ignored (it used to
  // open a plain q/k/v session).
  grpc::ClientContext sctx;
  auto rw = stub_->Decode(&sctx);
  v1::DecodeRequest open;
  open.mutable_open()->set_layer(1);
  open.mutable_open()->mutable_spec()->set_heads(2);
  open.mutable_open()->mutable_spec()->set_head_dim(8);
  ASSERT_TRUE(rw->Write(open));
  v1::DecodeResponse r;
  EXPECT_FALSE(rw->Read(&r)) << r.DebugString();
  st = rw->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("open.layer = 1"));
  EXPECT_THAT(st.error_message(), HasSubstr("open.model"));

  // A layer-mode open that sets the model's geometry or positional scheme
  // is refused naming the field, its value and the model's (one fixed
  // sentence named all five fields).
  for (const auto& [want, set] :
       std::vector<std::pair<std::string, std::function<void(v1::OpenSession*)>>>{
           {"open.spec.heads = 3", [](v1::OpenSession* o) { o->mutable_spec()->set_heads(3); }},
           {"open.spec.kv_heads = 5",
            [](v1::OpenSession* o) { o->mutable_spec()->set_kv_heads(5); }},
           {"open.spec.head_dim = 24",
            [](v1::OpenSession* o) { o->mutable_spec()->set_head_dim(24); }},
           {"open.v_dim = 40", [](v1::OpenSession* o) { o->set_v_dim(40); }},
           {"open.spec.alibi", [](v1::OpenSession* o) { o->mutable_spec()->mutable_alibi(); }}}) {
    SCOPED_TRACE(want);
    grpc::ClientContext lctx;
    auto lrw = stub_->Decode(&lctx);
    v1::DecodeRequest lopen;
    lopen.mutable_open()->set_model("demo");
    set(lopen.mutable_open());
    ASSERT_TRUE(lrw->Write(lopen));
    v1::DecodeResponse lr;
    EXPECT_FALSE(lrw->Read(&lr)) << lr.DebugString();
    const grpc::Status lst = lrw->Finish();
    EXPECT_EQ(lst.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(lst.error_message(), HasSubstr(want));
    EXPECT_THAT(lst.error_message(), HasSubstr("model demo"));
  }
}

// A checkpoint written to disk: Qwen2-style config (q/k/v biases) with bf16
// weights, served with --model semantics. Layer mode must match the fp64
// chain computed from the same (bf16-rounded) weights; tolerance 1e-2
// relative since activations meet bf16 weights.
TEST(CheckpointLayerTest, Bf16WeightsWithBiasesMatchTheReference) {
  char dir_template[] = "/tmp/ropeattn_ckpt_XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  const int64_t hidden = 64, heads = 4, kv = 2, hd = 16, vocab = 32;
  WriteFileOrDie(dir + "/config.json",
                 absl::StrCat(R"({"architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2", "hidden_size": )",
                              hidden, R"(, "num_attention_heads": )", heads,
                              R"(, "num_key_value_heads": )", kv, R"(, "vocab_size": )", vocab, R"(,
    "max_position_embeddings": 256, "num_hidden_layers": 1, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}})"));
  uint64_t seed = 100;
  auto random = [&](int64_t n) {
    const Tensor t = RandomTensor(DType::kF32, {n}, ++seed, -0.3f, 0.3f);
    return std::vector<float>(t.data<float>(), t.data<float>() + n);
  };
  std::vector<SafetensorsTensor> tensors = {
      {"model.embed_tokens.weight", "BF16", {vocab, hidden}, BF16Bytes(random(vocab * hidden))},
      {"model.layers.0.self_attn.q_proj.weight",
       "BF16",
       {heads * hd, hidden},
       BF16Bytes(random(heads * hd * hidden))},
      {"model.layers.0.self_attn.q_proj.bias", "BF16", {heads * hd}, BF16Bytes(random(heads * hd))},
      {"model.layers.0.self_attn.k_proj.weight",
       "BF16",
       {kv * hd, hidden},
       BF16Bytes(random(kv * hd * hidden))},
      {"model.layers.0.self_attn.k_proj.bias", "BF16", {kv * hd}, BF16Bytes(random(kv * hd))},
      {"model.layers.0.self_attn.v_proj.weight",
       "BF16",
       {kv * hd, hidden},
       BF16Bytes(random(kv * hd * hidden))},
      {"model.layers.0.self_attn.v_proj.bias", "BF16", {kv * hd}, BF16Bytes(random(kv * hd))},
      {"model.layers.0.self_attn.o_proj.weight",
       "BF16",
       {hidden, heads * hd},
       BF16Bytes(random(hidden * heads * hd))},
  };
  WriteFileOrDie(dir + "/model.safetensors", SafetensorsBytes(tensors));
  auto model = server::Model::Load("tiny", dir);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE((*model)->config().attention_bias);

  server::ServerOptions o = TestServerOptions();
  o.models = {{"tiny", dir}};
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());
  const int64_t s = 7;
  const Tensor x = RandomTensor(DType::kF32, {1, s, hidden}, 9);
  v1::AttendRequest req;
  req.mutable_spec()->set_causal(true);
  req.mutable_layer()->set_model("tiny");
  *req.mutable_layer()->mutable_hidden() = ToWire(x.view());
  grpc::ClientContext ctx;
  v1::AttendResponse resp;
  grpc::Status st = stub->Attend(&ctx, req, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();

  // fp64 chain with YaRN frequencies from the reference.
  const server::Model& m = **model;
  const server::LayerWeights* w = m.layer(0).value();
  const std::vector<double> xd = ToDoubles(x.view());
  std::vector<double> q = RefLinear(xd, s, w->q_proj, w->q_bias);
  std::vector<double> k = RefLinear(xd, s, w->k_proj, w->k_bias);
  std::vector<double> v = RefLinear(xd, s, w->v_proj, w->v_bias);
  ref::YarnRefParams yp;
  yp.factor = 4;
  yp.original_len = 64;
  ref::RotateRefParams rp;
  rp.seq = s;
  rp.head_dim = hd;
  rp.rotary_dim = hd;
  for (int64_t i = 0; i < s; ++i) rp.positions.push_back(i);
  rp.inv_freq = ref::YarnInvFreq(hd, 10000, yp);
  rp.attention_factor = ref::YarnAttentionFactor(yp);
  rp.heads = heads;
  q = ref::Rotate(rp, q);
  rp.heads = kv;
  k = ref::Rotate(rp, k);
  ref::AttentionRefParams ap;
  ap.q_len = s;
  ap.k_len = s;
  ap.heads = heads;
  ap.kv_heads = kv;
  ap.head_dim = hd;
  ap.v_dim = hd;
  ap.causal = true;
  const std::vector<double> want =
      RefLinear(ref::Attention(ap, q, k, v).out, s, w->o_proj, w->o_bias);
  EXPECT_TRUE(AllClose(WireToDoubles(resp.out()), want, kBF16Tol));
  server->Shutdown(absl::Seconds(1));
}

// Finite inputs times finite weights can overflow the float range: each
// such answer is refused with INVALID_ARGUMENT naming the tensor (never
// returned as Inf), and a refused session step leaves the session as it
// was. An external review found Attend, Decode and Embed answering Inf.
// Gemma's embeddings are scaled by sqrt(hidden_size) rounded to the table's
// dtype, as transformers casts it: for hidden 48, 6.9282032 in F32, 6.9375
// in BF16 and 6.9296875 in F16 (an F16 table is held widened to F32; its
// factor was the F32 one, 2e-4 off on every element). Every stored value
// here is exact in all three dtypes, so each answer is exactly row * factor.
TEST(CheckpointLayerTest, GemmaEmbeddingFactorIsRoundedToTheFilesDtype) {
  const int64_t hidden = 48, vocab = 4, heads = 2, kv = 1, hd = 24;
  const float sq = std::sqrt(48.0f);
  for (const auto& [dtype, factor] : std::vector<std::pair<std::string, float>>{
           {"F32", sq}, {"BF16", 6.9375f}, {"F16", 6.9296875f}}) {
    SCOPED_TRACE(dtype);
    char dir_template[] = "/tmp/ropeattn_ckpt_XXXXXX";
    ASSERT_NE(mkdtemp(dir_template), nullptr);
    const std::string dir = dir_template;
    WriteFileOrDie(dir + "/config.json", R"({"model_type": "gemma", "hidden_size": 48,
      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 24, "vocab_size": 4,
      "max_position_embeddings": 64, "num_hidden_layers": 1})");
    // Values k / 8 for small k: exact in F16, BF16 and F32.
    std::vector<float> embed(vocab * hidden);
    for (size_t i = 0; i < embed.size(); ++i) embed[i] = static_cast<float>(i % 13) / 8.0f - 0.75f;
    std::string bytes;
    if (dtype == "F32") bytes = F32Bytes(embed);
    if (dtype == "BF16") bytes = BF16Bytes(embed);
    if (dtype == "F16") {
      std::vector<uint16_t> bits(embed.size());
      for (size_t i = 0; i < embed.size(); ++i) {
        bits[i] = _cvtss_sh(embed[i], _MM_FROUND_TO_NEAREST_INT);
      }
      bytes = U16Bytes(bits);
    }
    std::vector<SafetensorsTensor> tensors = {
        {"model.embed_tokens.weight", dtype, {vocab, hidden}, bytes}};
    const std::vector<float> w(heads * hd * hidden, 0.01f);
    const std::string p = "model.layers.0.self_attn.";
    tensors.push_back({p + "q_proj.weight", "F32", {heads * hd, hidden}, F32Bytes(w)});
    tensors.push_back({p + "k_proj.weight", "F32", {kv * hd, hidden},
                       F32Bytes(std::vector<float>(kv * hd * hidden, 0.01f))});
    tensors.push_back({p + "v_proj.weight", "F32", {kv * hd, hidden},
                       F32Bytes(std::vector<float>(kv * hd * hidden, 0.01f))});
    tensors.push_back({p + "o_proj.weight", "F32", {hidden, heads * hd}, F32Bytes(w)});
    WriteFileOrDie(dir + "/model.safetensors", SafetensorsBytes(tensors));
    server::ServerOptions o = TestServerOptions();
    o.models = {{"g", dir}};
    auto server = StartTestServer(o);
    ASSERT_NE(server, nullptr);
    auto stub = TestStub(server->port());
    v1::EmbedRequest req;
    req.set_model("g");
    for (int64_t id : {2, 0, 3}) req.add_token_ids(id);
    grpc::ClientContext ctx;
    v1::EmbedResponse resp;
    const grpc::Status st = stub->Embed(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    const std::vector<double> got = WireToDoubles(resp.embeddings());
    ASSERT_EQ(got.size(), 3u * hidden);
    int i = 0;
    for (int64_t id : {2, 0, 3}) {
      for (int64_t h = 0; h < hidden; ++h, ++i) {
        EXPECT_EQ(got[i], static_cast<double>(embed[id * hidden + h] * factor)) << id << " " << h;
      }
    }
    server->Shutdown(absl::Seconds(1));
  }
}

TEST(CheckpointLayerTest, OverflowingProductsAreRefusedNotAnsweredAsInf) {
  char dir_template[] = "/tmp/ropeattn_ckpt_XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  const int64_t hidden = 64, heads = 4, kv = 2, hd = 16, vocab = 8;
  WriteFileOrDie(dir + "/config.json", R"({"model_type": "gemma", "hidden_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 8,
    "max_position_embeddings": 128, "num_hidden_layers": 2})");
  uint64_t seed = 7;
  auto random = [&](int64_t n) {
    const Tensor t = RandomTensor(DType::kF32, {n}, ++seed, -0.3f, 0.3f);
    return std::vector<float>(t.data<float>(), t.data<float>() + n);
  };
  std::vector<float> embed = random(vocab * hidden);
  for (int64_t h = 0; h < hidden; ++h) embed[3 * hidden + h] = 1e38f;  // row 3, times sqrt(64)
  std::vector<SafetensorsTensor> tensors = {
      {"model.embed_tokens.weight", "F32", {vocab, hidden}, F32Bytes(embed)}};
  for (int layer = 0; layer < 2; ++layer) {
    const std::string p = absl::StrCat("model.layers.", layer, ".self_attn.");
    // Layer 0: q_proj overflows; layer 1: o_proj does.
    std::vector<float> qw = random(heads * hd * hidden), ow = random(hidden * heads * hd);
    for (float& w : layer == 0 ? qw : ow) w = 3e38f;
    tensors.push_back({p + "q_proj.weight", "F32", {heads * hd, hidden}, F32Bytes(qw)});
    tensors.push_back(
        {p + "k_proj.weight", "F32", {kv * hd, hidden}, F32Bytes(random(kv * hd * hidden))});
    tensors.push_back(
        {p + "v_proj.weight", "F32", {kv * hd, hidden}, F32Bytes(random(kv * hd * hidden))});
    tensors.push_back({p + "o_proj.weight", "F32", {hidden, heads * hd}, F32Bytes(ow)});
  }
  WriteFileOrDie(dir + "/model.safetensors", SafetensorsBytes(tensors));
  server::ServerOptions o = TestServerOptions();
  o.models = {{"big", dir}};
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());
  const Tensor x = RandomTensor(DType::kF32, {1, 3, hidden}, 9, 0.5f, 1.0f);
  for (const auto& [layer, tensor] :
       std::vector<std::pair<int, std::string>>{{0, "q_proj output"}, {1, "o_proj output"}}) {
    SCOPED_TRACE(tensor);
    v1::AttendRequest req;
    req.mutable_layer()->set_model("big");
    req.mutable_layer()->set_layer(layer);
    *req.mutable_layer()->mutable_hidden() = ToWire(x.view());
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    grpc::Status st = stub->Attend(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr(tensor));
    EXPECT_THAT(st.error_message(), HasSubstr("overflows the float range"));

    // A session step: refused the same way, and the session stays at 0 tokens.
    grpc::ClientContext sctx;
    auto rw = stub->Decode(&sctx);
    v1::DecodeRequest open;
    open.mutable_open()->set_model("big");
    open.mutable_open()->set_layer(layer);
    open.mutable_open()->set_max_context(16);
    v1::DecodeResponse r;
    ASSERT_TRUE(rw->Write(open));
    ASSERT_TRUE(rw->Read(&r));
    ASSERT_TRUE(r.has_opened()) << r.DebugString();
    const std::string id = r.opened().session_id();
    v1::DecodeRequest step;
    step.mutable_step()->set_seq(1);
    *step.mutable_step()->mutable_hidden() = ToWire(x.cview().Slice(1, 0, 2));
    ASSERT_TRUE(rw->Write(step));
    ASSERT_TRUE(rw->Read(&r));
    ASSERT_TRUE(r.has_error()) << r.DebugString();
    EXPECT_EQ(r.error().code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(r.error().message(), HasSubstr(tensor));
    EXPECT_THAT(r.error().message(), HasSubstr("overflows the float range"));
    grpc::ClientContext gctx;
    v1::GetSessionRequest get;
    get.set_session_id(id);
    v1::SessionInfo info;
    ASSERT_TRUE(stub->GetSession(&gctx, get, &info).ok());
    EXPECT_EQ(info.position(), 0);
    EXPECT_EQ(info.kv_bytes_held(), 0);
    rw->WritesDone();
    EXPECT_TRUE(rw->Finish().ok());
  }
  // Embed: row 3 times sqrt(hidden) overflows.
  v1::EmbedRequest ereq;
  ereq.set_model("big");
  for (int64_t id : {1, 3}) ereq.add_token_ids(id);
  grpc::ClientContext ectx;
  v1::EmbedResponse eresp;
  grpc::Status st = stub->Embed(&ectx, ereq, &eresp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("embeddings[0, 1, 0] is +inf"));
  ereq.clear_token_ids();
  ereq.add_token_ids(1);
  grpc::ClientContext ectx2;
  EXPECT_TRUE(stub->Embed(&ectx2, ereq, &eresp).ok());
  server->Shutdown(absl::Seconds(1));
}

TEST(CheckpointLayerTest, ABrokenCheckpointStopsStartUpNamingTheFile) {
  char dir_template[] = "/tmp/ropeattn_ckpt_XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  WriteFileOrDie(dir + "/config.json", R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
    "vocab_size": 32, "max_position_embeddings": 128, "num_hidden_layers": 1})");
  WriteFileOrDie(dir + "/model.safetensors", "\x10\x00\x00");  // shorter than the length field
  server::ServerOptions o = TestServerOptions();
  o.models = {{"broken", dir}};
  auto server = server::Server::Start(o);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << server.status();
  EXPECT_THAT(server.status().message(), HasSubstr("model.safetensors"));
  EXPECT_THAT(server.status().message(), HasSubstr("broken"));
}

}  // namespace
}  // namespace ropeattn::testing
