// The architecture matrix (docs/checkpoints.md): per served family, a small
// checkpoint with that family's real tensor names and config keys, served by a
// real server on a loopback port; layer mode one shot (Attend) and token by
// token (a Decode session) against tests/reference/layer_ref, an fp64 layer
// as transformers computes it, reading the raw (fused) tensors itself.
// Tolerance: 1e-5 relative (norm-wise), f32 weights and activations.
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model.h"
#include "tests/core/test_util.h"
#include "tests/reference/layer_ref.h"
#include "tests/reference/rope_ref.h"
#include "tests/server/safetensors_writer.h"
#include "tests/server/server_test_util.h"

namespace ropeattn::testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kSeq = 9;

// A checkpoint under construction: tensors written as F32, and the same
// values as doubles for the reference.
class Checkpoint {
 public:
  // Uniform in [lo, hi), rounded to f32; written under `name`.
  std::vector<double> Add(const std::string& name, std::vector<int64_t> shape, double lo = -0.4,
                          double hi = 0.4) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const Tensor t = RandomTensor(DType::kF32, {n}, ++seed_, static_cast<float>(lo),
                                  static_cast<float>(hi));
    std::vector<float> f(t.data<float>(), t.data<float>() + n);
    tensors_.push_back({name, "F32", shape, F32Bytes(f), std::nullopt});
    return std::vector<double>(f.begin(), f.end());
  }
  void Write(const TempDir& dir, const std::string& config) const {
    WriteFileOrDie(dir.File("config.json"), config);
    WriteFileOrDie(dir.File("model.safetensors"), SafetensorsBytes(tensors_));
  }

 private:
  std::vector<SafetensorsTensor> tensors_;
  uint64_t seed_ = 1000;
};

// One family's case: the config, the checkpoint and, per layer, the
// reference's parameters. `freqs(layer, length)` sets the RoPE frequencies
// the layer uses for a sequence of `length` tokens (LongRoPE switches).
struct ArchCase {
  std::string name;
  std::string config;
  Checkpoint ckpt;
  std::vector<ref::LayerRefParams> layers;
  std::function<void(int64_t layer, int64_t length, ref::LayerRefParams&)> freqs;
  bool decoder = true;
  // Embedding tables as written (BERT: positions, token types, LayerNorm).
  std::vector<double> embed, positions, types, ln_weight, ln_bias;
};

std::string Config(absl::string_view model_type, absl::string_view arch, int64_t hidden,
                   int64_t heads, int64_t layers, absl::string_view extra) {
  return absl::StrCat(R"({"architectures": [")", arch, R"("], "model_type": ")", model_type,
                      R"(", "hidden_size": )", hidden, R"(, "num_attention_heads": )", heads,
                      R"(, "vocab_size": 16, "max_position_embeddings": 64, "num_hidden_layers": )",
                      layers, extra, "}");
}

ref::LayerRefParams Dims(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  ref::LayerRefParams p;
  p.hidden = hidden;
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  return p;
}

// Separate q/k/v/o under `root` + {q,k,v,o}_proj (or GPT-J's out_proj).
void AddSeparate(Checkpoint& ck, ref::LayerRefParams& p, const std::string& root, bool bias,
                 bool o_bias, const char* o_name = "o_proj") {
  const int64_t qo = p.heads * p.head_dim, ko = p.kv_heads * p.head_dim;
  p.q = ck.Add(root + "q_proj.weight", {qo, p.hidden});
  p.k = ck.Add(root + "k_proj.weight", {ko, p.hidden});
  p.v = ck.Add(root + "v_proj.weight", {ko, p.hidden});
  p.o = ck.Add(absl::StrCat(root, o_name, ".weight"), {p.hidden, qo});
  if (bias) {
    p.q_bias = ck.Add(root + "q_proj.bias", {qo});
    p.k_bias = ck.Add(root + "k_proj.bias", {ko});
    p.v_bias = ck.Add(root + "v_proj.bias", {ko});
  }
  if (o_bias) p.o_bias = ck.Add(absl::StrCat(root, o_name, ".bias"), {p.hidden});
}

std::vector<double> Embeddings(Checkpoint& ck, const std::string& name, int64_t hidden) {
  return ck.Add(name, {16, hidden}, -1.0, 1.0);
}

std::vector<ArchCase> Cases() {
  std::vector<ArchCase> cases;
  auto fixed = [](std::vector<double> inv, double factor = 1.0) {
    return [inv, factor](int64_t, int64_t, ref::LayerRefParams& p) {
      p.inv_freq = inv;
      p.attention_factor = factor;
    };
  };
  {  // Llama 3.1: llama3 scaling, attention_bias (q/k/v/o biases).
    ArchCase c;
    c.name = "llama";
    c.config = Config("llama", "LlamaForCausalLM", 32, 4, 1, R"(, "num_key_value_heads": 2,
        "rope_theta": 500000.0, "attention_bias": true, "rms_norm_eps": 1e-5,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})");
    c.embed = Embeddings(c.ckpt, "model.embed_tokens.weight", 32);
    ref::LayerRefParams p = Dims(32, 4, 2, 8);
    AddSeparate(c.ckpt, p, "model.layers.0.self_attn.", true, true);
    p.rope = true;
    p.rotary_dim = 8;
    c.layers = {p};
    c.freqs = fixed(ref::Llama3InvFreq(8, 500000.0, 8.0, 1.0, 4.0, 16));
    cases.push_back(std::move(c));
  }
  {  // Mistral: sliding_window on every layer.
    ArchCase c;
    c.name = "mistral";
    c.config = Config("mistral", "MistralForCausalLM", 32, 4, 1, R"(, "num_key_value_heads": 1,
        "rope_theta": 1000000.0, "sliding_window": 4, "head_dim": 8)");
    Embeddings(c.ckpt, "model.embed_tokens.weight", 32);
    ref::LayerRefParams p = Dims(32, 4, 1, 8);
    AddSeparate(c.ckpt, p, "model.layers.0.self_attn.", false, false);
    p.rope = true;
    p.rotary_dim = 8;
    p.window = 4;
    c.layers = {p};
    c.freqs = fixed(ref::DefaultInvFreq(8, 1000000.0));
    cases.push_back(std::move(c));
  }
  {  // Mixtral: no rope_theta or sliding_window in the file, so MixtralConfig's
     // defaults: base 1e6, no window.
    ArchCase c;
    c.name = "mixtral";
    c.config = Config("mixtral", "MixtralForCausalLM", 32, 4, 1, R"(, "num_key_value_heads": 2,
        "num_local_experts": 2, "num_experts_per_tok": 1)");
    Embeddings(c.ckpt, "model.embed_tokens.weight", 32);
    ref::LayerRefParams p = Dims(32, 4, 2, 8);
    AddSeparate(c.ckpt, p, "model.layers.0.self_attn.", false, false);
    p.rope = true;
    p.rotary_dim = 8;
    c.layers = {p};
    c.freqs = fixed(ref::DefaultInvFreq(8, 1000000.0));
    cases.push_back(std::move(c));
  }
  {  // Qwen2: q/k/v biases (no key says so), sliding window from layer 1.
    ArchCase c;
    c.name = "qwen2";
    c.config = Config("qwen2", "Qwen2ForCausalLM", 32, 4, 2, R"(, "num_key_value_heads": 2,
        "rope_theta": 1000000.0, "use_sliding_window": true, "sliding_window": 3,
        "max_window_layers": 1)");
    Embeddings(c.ckpt, "model.embed_tokens.weight", 32);
    for (int layer = 0; layer < 2; ++layer) {
      ref::LayerRefParams p = Dims(32, 4, 2, 8);
      AddSeparate(c.ckpt, p, absl::StrCat("model.layers.", layer, ".self_attn."), true, false);
      p.rope = true;
      p.rotary_dim = 8;
      p.window = layer == 1 ? 3 : 0;
      c.layers.push_back(p);
    }
    c.freqs = fixed(ref::DefaultInvFreq(8, 1000000.0));
    cases.push_back(std::move(c));
  }
  {  // Qwen3: head_dim != hidden / heads, per-head RMSNorm of q and k.
    ArchCase c;
    c.name = "qwen3";
    c.config = Config("qwen3", "Qwen3ForCausalLM", 32, 4, 1, R"(, "num_key_value_heads": 2,
        "head_dim": 16, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "attention_bias": false,
        "use_sliding_window": false, "sliding_window": null, "max_window_layers": 28)");
    Embeddings(c.ckpt, "model.embed_tokens.weight", 32);
    ref::LayerRefParams p = Dims(32, 4, 2, 16);
    AddSeparate(c.ckpt, p, "model.layers.0.self_attn.", false, false);
    p.norm = ref::RefNorm::kRms;
    p.q_norm = c.ckpt.Add("model.layers.0.self_attn.q_norm.weight", {16}, 0.5, 1.5);
    p.k_norm = c.ckpt.Add("model.layers.0.self_attn.k_norm.weight", {16}, 0.5, 1.5);
    p.eps = 1e-6;
    p.rope = true;
    p.rotary_dim = 16;
    c.layers = {p};
    c.freqs = fixed(ref::DefaultInvFreq(16, 1000000.0));
    cases.push_back(std::move(c));
  }
  {  // Gemma 2: query_pre_attn_scalar, soft-cap, window on even layers.
    ArchCase c;
    c.name = "gemma2";
    c.config = Config("gemma2", "Gemma2ForCausalLM", 32, 4, 2, R"(, "num_key_value_heads": 2,
        "head_dim": 16, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 1.5,
        "final_logit_softcapping": 30.0, "sliding_window": 4, "rope_theta": 10000.0)");
    c.embed = Embeddings(c.ckpt, "model.embed_tokens.weight", 32);
    for (int layer = 0; layer < 2; ++layer) {
      ref::LayerRefParams p = Dims(32, 4, 2, 16);
      AddSeparate(c.ckpt, p, absl::StrCat("model.layers.", layer, ".self_attn."), false, false);
      p.rope = true;
      p.rotary_dim = 16;
      p.scale = 1.0 / std::sqrt(24.0);
      p.softcap = 1.5;
      p.window = layer == 0 ? 4 : 0;
      c.layers.push_back(p);
    }
    c.freqs = fixed(ref::DefaultInvFreq(16, 10000.0));
    cases.push_back(std::move(c));
  }
  // Gemma 3's two layers (sliding, then global): (1 + w) q/k norms,
  // query_pre_attn_scalar 16, window 4 on the sliding one.
  const auto AddGemma3Layers = [](ArchCase& c) {
    Embeddings(c.ckpt, "model.embed_tokens.weight", 32);
    for (int layer = 0; layer < 2; ++layer) {
      ref::LayerRefParams p = Dims(32, 4, 1, 16);
      const std::string root = absl::StrCat("model.layers.", layer, ".self_attn.");
      AddSeparate(c.ckpt, p, root, false, false);
      p.norm = ref::RefNorm::kRmsOnePlus;
      p.q_norm = c.ckpt.Add(root + "q_norm.weight", {16}, -0.5, 0.5);
      p.k_norm = c.ckpt.Add(root + "k_norm.weight", {16}, -0.5, 0.5);
      p.rope = true;
      p.rotary_dim = 16;
      p.scale = 0.25;
      p.window = layer == 0 ? 4 : 0;
      c.layers.push_back(p);
    }
  };
  {  // Gemma 3: (1 + w) q/k norms, local RoPE base on sliding layers, linear
     // scaling on global ones.
    ArchCase c;
    c.name = "gemma3";
    c.config = Config("gemma3_text", "Gemma3ForCausalLM", 32, 4, 2, R"(, "num_key_value_heads": 1,
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4,
        "sliding_window_pattern": 2, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rms_norm_eps": 1e-6)");
    AddGemma3Layers(c);
    c.freqs = [](int64_t layer, int64_t, ref::LayerRefParams& p) {
      p.inv_freq = layer == 0 ? ref::DefaultInvFreq(16, 10000.0)
                              : ref::LinearInvFreq(16, 1000000.0, 8.0);
    };
    cases.push_back(std::move(c));
  }
  {  // Gemma 3 written for transformers 5: rope_parameters keyed by layer
     // type; the sliding block has no rope_theta, so rope_local_base_freq
     // gives it (as transformers 4 and 5 both do), not the global base.
    ArchCase c;
    c.name = "gemma3_keyed";
    c.config = Config("gemma3_text", "Gemma3ForCausalLM", 32, 4, 2, R"(, "num_key_value_heads": 1,
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4,
        "sliding_window_pattern": 2, "rope_theta": 1000000.0, "rope_local_base_freq": 20000.0,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0},
                            "sliding_attention": {"rope_type": "default"}},
        "rms_norm_eps": 1e-6)");
    AddGemma3Layers(c);
    c.freqs = [](int64_t layer, int64_t, ref::LayerRefParams& p) {
      p.inv_freq = layer == 0 ? ref::DefaultInvFreq(16, 20000.0)
                              : ref::LinearInvFreq(16, 1000000.0, 8.0);
    };
    cases.push_back(std::move(c));
  }
  {  // Phi-3: fused qkv_proj, LongRoPE (long factors past L0 = 8), window 5.
    ArchCase c;
    c.name = "phi3";
    std::vector<double> short_f = {1.0, 1.1, 1.3, 2.0}, long_f = {1.2, 2.5, 4.0, 9.0};
    c.config = Config("phi3", "Phi3ForCausalLM", 32, 4, 1, absl::StrCat(
        R"(, "num_key_value_heads": 2, "rope_theta": 10000.0, "sliding_window": 5,
        "original_max_position_embeddings": 8, "rope_scaling": {"type": "longrope",
        "short_factor": [)", absl::StrJoin(short_f, ", "), R"(], "long_factor": [)",
        absl::StrJoin(long_f, ", "), "]}"));
    Embeddings(c.ckpt, "model.embed_tokens.weight", 32);
    ref::LayerRefParams p = Dims(32, 4, 2, 8);
    p.qkv = ref::RefQkv::kConcat;
    p.fused = c.ckpt.Add("model.layers.0.self_attn.qkv_proj.weight", {(4 + 2 * 2) * 8, 32});
    p.o = c.ckpt.Add("model.layers.0.self_attn.o_proj.weight", {32, 32});
    p.rope = true;
    p.rotary_dim = 8;
    p.window = 5;
    c.layers = {p};
    // transformers: factor = max_position_embeddings / original = 64 / 8.
    const double factor = ref::LongRopeAttentionFactor(64.0 / 8.0, 8, std::nullopt);
    c.freqs = [short_f, long_f, factor](int64_t, int64_t length, ref::LayerRefParams& p) {
      p.inv_freq = ref::LongRopeInvFreq(8, 10000.0, short_f, long_f, 8, length);
      p.attention_factor = factor;
    };
    cases.push_back(std::move(c));
  }
  {  // GPT-NeoX: fused per-head query_key_value with biases, rotary_pct 0.5.
    ArchCase c;
    c.name = "gpt_neox";
    c.config = Config("gpt_neox", "GPTNeoXForCausalLM", 32, 4, 1,
                      R"(, "rotary_pct": 0.5, "rotary_emb_base": 10000, "use_parallel_residual": true)");
    Embeddings(c.ckpt, "gpt_neox.embed_in.weight", 32);
    ref::LayerRefParams p = Dims(32, 4, 4, 8);
    p.qkv = ref::RefQkv::kPerHead;
    p.fused = c.ckpt.Add("gpt_neox.layers.0.attention.query_key_value.weight", {96, 32});
    p.fused_bias = c.ckpt.Add("gpt_neox.layers.0.attention.query_key_value.bias", {96});
    p.o = c.ckpt.Add("gpt_neox.layers.0.attention.dense.weight", {32, 32});
    p.o_bias = c.ckpt.Add("gpt_neox.layers.0.attention.dense.bias", {32});
    p.rope = true;
    p.rotary_dim = 4;
    c.layers = {p};
    c.freqs = fixed(ref::DefaultInvFreq(4, 10000.0));
    cases.push_back(std::move(c));
  }
  {  // GPT-J: interleaved pairs over the first rotary_dim channels, no biases.
    ArchCase c;
    c.name = "gptj";
    c.config = absl::StrCat(R"({"architectures": ["GPTJForCausalLM"], "model_type": "gptj",
        "n_embd": 32, "n_head": 4, "n_layer": 1, "n_positions": 64, "vocab_size": 16,
        "rotary_dim": 4})");
    Embeddings(c.ckpt, "transformer.wte.weight", 32);
    ref::LayerRefParams p = Dims(32, 4, 4, 8);
    AddSeparate(c.ckpt, p, "transformer.h.0.attn.", false, false, "out_proj");
    p.rope = true;
    p.rotary_dim = 4;
    p.interleaved = true;
    c.layers = {p};
    c.freqs = fixed(ref::DefaultInvFreq(4, 10000.0));
    cases.push_back(std::move(c));
  }
  {  // BERT: bidirectional, biases everywhere, learned positions (no RoPE).
    ArchCase c;
    c.name = "bert";
    c.decoder = false;
    c.config = Config("bert", "BertForMaskedLM", 32, 4, 1,
                      R"(, "type_vocab_size": 2, "layer_norm_eps": 1e-12)");
    c.embed = Embeddings(c.ckpt, "bert.embeddings.word_embeddings.weight", 32);
    c.positions = c.ckpt.Add("bert.embeddings.position_embeddings.weight", {64, 32});
    c.types = c.ckpt.Add("bert.embeddings.token_type_embeddings.weight", {2, 32});
    c.ln_weight = c.ckpt.Add("bert.embeddings.LayerNorm.weight", {32}, 0.5, 1.5);
    c.ln_bias = c.ckpt.Add("bert.embeddings.LayerNorm.bias", {32});
    ref::LayerRefParams p = Dims(32, 4, 4, 8);
    const std::string r = "bert.encoder.layer.0.attention.";
    p.q = c.ckpt.Add(r + "self.query.weight", {32, 32});
    p.q_bias = c.ckpt.Add(r + "self.query.bias", {32});
    p.k = c.ckpt.Add(r + "self.key.weight", {32, 32});
    p.k_bias = c.ckpt.Add(r + "self.key.bias", {32});
    p.v = c.ckpt.Add(r + "self.value.weight", {32, 32});
    p.v_bias = c.ckpt.Add(r + "self.value.bias", {32});
    p.o = c.ckpt.Add(r + "output.dense.weight", {32, 32});
    p.o_bias = c.ckpt.Add(r + "output.dense.bias", {32});
    p.causal = false;
    c.layers = {p};
    c.freqs = fixed({});
    cases.push_back(std::move(c));
  }
  return cases;
}

class ArchitectureTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ArchitectureTest, LayerModeMatchesTransformersOneShotAndTokenByToken) {
  std::vector<ArchCase> cases = Cases();
  ArchCase* found = nullptr;
  for (ArchCase& c : cases) {
    if (c.name == GetParam()) found = &c;
  }
  ASSERT_NE(found, nullptr);
  ArchCase& ac = *found;
  TempDir dir;
  ac.ckpt.Write(dir, ac.config);
  server::ServerOptions o = TestServerOptions();
  o.models = {{ac.name, dir.path()}};
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());

  const int64_t hidden = ac.layers[0].hidden;
  const Tensor x = RandomTensor(DType::kF32, {1, kSeq, hidden}, 77, -1.0f, 1.0f);
  const std::vector<double> xd = ToDoubles(x.view());
  for (int64_t layer = 0; layer < static_cast<int64_t>(ac.layers.size()); ++layer) {
    SCOPED_TRACE(::testing::Message() << ac.name << " layer " << layer);
    ref::LayerRefParams p = ac.layers[static_cast<size_t>(layer)];
    ac.freqs(layer, kSeq, p);
    const std::vector<double> want = ref::LayerRef(p, xd, kSeq);

    v1::AttendRequest req;
    req.mutable_layer()->set_model(ac.name);
    req.mutable_layer()->set_layer(static_cast<int32_t>(layer));
    *req.mutable_layer()->mutable_hidden() = ToWire(x.view());
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    grpc::Status st = stub->Attend(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_THAT(resp.out().shape(), ::testing::ElementsAre(1, kSeq, hidden));
    EXPECT_TRUE(AllClose(WireToDoubles(resp.out()), want, kF32Tol)) << "one shot";

    grpc::ClientContext sctx;
    auto rw = stub->Decode(&sctx);
    v1::DecodeRequest open;
    open.mutable_open()->set_model(ac.name);
    open.mutable_open()->set_layer(static_cast<int32_t>(layer));
    open.mutable_open()->set_max_context(64);
    v1::DecodeResponse r;
    ASSERT_TRUE(rw->Write(open));
    if (!ac.decoder) {
      // An encoder has no decoding session: the open fails the stream.
      EXPECT_FALSE(rw->Read(&r)) << r.DebugString();
      rw->WritesDone();
      const grpc::Status fin = rw->Finish();
      EXPECT_EQ(fin.error_code(), grpc::StatusCode::UNIMPLEMENTED);
      EXPECT_THAT(fin.error_message(), HasSubstr("bidirectionally"));
      continue;
    }
    ASSERT_TRUE(rw->Read(&r));
    ASSERT_TRUE(r.has_opened()) << r.DebugString();
    // Step t's answer is the last row of the layer over tokens 0..t, with
    // the frequencies for that length (LongRoPE switches past L0).
    for (int64_t t = 0; t < kSeq; ++t) {
      v1::DecodeRequest step;
      step.mutable_step()->set_seq(t + 1);
      *step.mutable_step()->mutable_hidden() = ToWire(x.cview().Slice(1, t, 1));
      ASSERT_TRUE(rw->Write(step));
      ASSERT_TRUE(rw->Read(&r));
      ASSERT_TRUE(r.has_step()) << r.DebugString();
      ref::LayerRefParams pt = ac.layers[static_cast<size_t>(layer)];
      ac.freqs(layer, t + 1, pt);
      const std::vector<double> prefix(xd.begin(), xd.begin() + (t + 1) * hidden);
      const std::vector<double> full = ref::LayerRef(pt, prefix, t + 1);
      const std::vector<double> row(full.end() - hidden, full.end());
      EXPECT_TRUE(AllClose(WireToDoubles(r.step().out()), row, kF32Tol)) << "step " << t;
    }
    rw->WritesDone();
    EXPECT_TRUE(rw->Finish().ok());
  }
  server->Shutdown(absl::Seconds(1));
}

// Serves one case's checkpoint; the case and a stub stay valid with it.
struct Served {
  ArchCase ac;
  TempDir dir;
  std::unique_ptr<server::Server> server;
  std::unique_ptr<v1::AttentionService::Stub> stub;
  ~Served() {
    if (server) server->Shutdown(absl::Seconds(1));
  }
};
std::unique_ptr<Served> Serve(absl::string_view name) {
  auto s = std::make_unique<Served>();
  for (ArchCase& c : Cases()) {
    if (c.name == name) s->ac = std::move(c);
  }
  s->ac.ckpt.Write(s->dir, s->ac.config);
  server::ServerOptions o = TestServerOptions();
  o.models = {{s->ac.name, s->dir.path()}};
  s->server = StartTestServer(o);
  if (s->server == nullptr) return nullptr;
  s->stub = TestStub(s->server->port());
  return s;
}

TEST(ArchitectureLayerTest, TheSpecMayRestateTheModelsAttentionButNotChangeIt) {
  std::unique_ptr<Served> mistral = Serve("mistral");
  ASSERT_NE(mistral, nullptr);
  const Tensor x = RandomTensor(DType::kF32, {1, 5, 32}, 3);
  auto attend = [&](Served& s, const v1::AttentionSpec& spec) {
    v1::AttendRequest req;
    *req.mutable_spec() = spec;
    req.mutable_layer()->set_model(s.ac.name);
    *req.mutable_layer()->mutable_hidden() = ToWire(x.view());
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    return s.stub->Attend(&ctx, req, &resp);
  };
  v1::AttentionSpec spec;
  spec.set_window(4);
  spec.set_causal(true);
  EXPECT_TRUE(attend(*mistral, spec).ok());
  spec.set_window(3);
  grpc::Status st = attend(*mistral, spec);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("spec.window = 3"));
  EXPECT_THAT(st.error_message(), HasSubstr("(4,"));
  spec.set_window(0);
  spec.set_softcap(30);
  st = attend(*mistral, spec);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("spec.softcap"));
  spec.set_softcap(0);
  spec.set_scale(0.5);
  st = attend(*mistral, spec);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("spec.scale"));
  // A session open says the same.
  grpc::ClientContext sctx;
  auto rw = mistral->stub->Decode(&sctx);
  v1::DecodeRequest open;
  open.mutable_open()->set_model("mistral");
  open.mutable_open()->mutable_spec()->set_window(7);
  ASSERT_TRUE(rw->Write(open));
  v1::DecodeResponse r;
  EXPECT_FALSE(rw->Read(&r));
  rw->WritesDone();
  st = rw->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("spec.window = 7"));

  std::unique_ptr<Served> bert = Serve("bert");
  ASSERT_NE(bert, nullptr);
  spec.Clear();
  EXPECT_TRUE(attend(*bert, spec).ok());
  spec.set_causal(true);
  st = attend(*bert, spec);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("bidirectionally"));
}

// Embed returns what transformers feeds layer 0: Gemma scales by
// sqrt(hidden_size); BERT adds position and token type 0, then LayerNorm.
// Reference in fp64; 1e-5 relative.
TEST(ArchitectureLayerTest, EmbedIsWhatTransformersFeedsTheFirstLayer) {
  const std::vector<int64_t> ids = {3, 0, 15, 7};
  for (const char* name : {"gemma2", "bert", "llama"}) {
    SCOPED_TRACE(name);
    std::unique_ptr<Served> s = Serve(name);
    ASSERT_NE(s, nullptr);
    v1::EmbedRequest req;
    req.set_model(name);
    for (int64_t id : ids) req.add_token_ids(id);
    req.add_q_offsets(5);
    grpc::ClientContext ctx;
    v1::EmbedResponse resp;
    grpc::Status st = s->stub->Embed(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    const int64_t h = 32;
    std::vector<double> want;
    for (size_t i = 0; i < ids.size(); ++i) {
      std::vector<double> row(s->ac.embed.begin() + ids[i] * h,
                              s->ac.embed.begin() + (ids[i] + 1) * h);
      if (std::string(name) == "gemma2") {
        for (double& v : row) v *= std::sqrt(32.0);
      } else if (std::string(name) == "bert") {
        const int64_t pos = 5 + static_cast<int64_t>(i);
        double mean = 0.0, var = 0.0;
        for (int64_t j = 0; j < h; ++j) {
          row[j] += s->ac.positions[pos * h + j] + s->ac.types[j];
          mean += row[j] / h;
        }
        for (int64_t j = 0; j < h; ++j) var += (row[j] - mean) * (row[j] - mean) / h;
        for (int64_t j = 0; j < h; ++j) {
          row[j] = (row[j] - mean) / std::sqrt(var + 1e-12) * s->ac.ln_weight[j] + s->ac.ln_bias[j];
        }
      }
      want.insert(want.end(), row.begin(), row.end());
    }
    EXPECT_TRUE(AllClose(WireToDoubles(resp.embeddings()), want, kF32Tol));
  }
}


// The RoPE a model describes (GetModel) is a spec the server accepts back
// unchanged: it carries only the fields its rule reads.
TEST(ArchitectureLayerTest, AModelsRopeSpecCanBeSentBack) {
  for (const char* name : {"llama", "qwen2", "phi3", "gpt_neox", "gptj", "gemma3"}) {
    SCOPED_TRACE(name);
    std::unique_ptr<Served> s = Serve(name);
    ASSERT_NE(s, nullptr);
    grpc::ClientContext ctx;
    v1::GetModelRequest get;
    get.set_name(name);
    v1::ModelInfo info;
    ASSERT_TRUE(s->stub->GetModel(&ctx, get, &info).ok());
    ASSERT_TRUE(info.has_rope());
    v1::AttendRequest req;
    req.mutable_spec()->set_heads(info.heads());
    req.mutable_spec()->set_kv_heads(info.kv_heads());
    req.mutable_spec()->set_head_dim(info.head_dim());
    *req.mutable_spec()->mutable_rope() = info.rope();
    *req.mutable_q() = ToWire(RandomTensor(DType::kF32, {1, 3, info.heads(), info.head_dim()}, 1).cview());
    *req.mutable_k() = ToWire(RandomTensor(DType::kF32, {1, 3, info.kv_heads(), info.head_dim()}, 2).cview());
    *req.mutable_v() = ToWire(RandomTensor(DType::kF32, {1, 3, info.kv_heads(), info.head_dim()}, 3).cview());
    grpc::ClientContext actx;
    v1::AttendResponse resp;
    const grpc::Status st = s->stub->Attend(&actx, req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message() << "\n" << info.rope().DebugString();
  }
}

// GPT-J's sinusoid table has n_positions (64 here) rows and transformers
// fails past it: a layer computation reaching position 64 is OUT_OF_RANGE
// (one shot, a session step, a session's prefix), and a refused step leaves
// the session where it was.
TEST(ArchitectureLayerTest, GptJPositionsEndWithItsTable) {
  std::unique_ptr<Served> s = Serve("gptj");
  ASSERT_NE(s, nullptr);
  const Tensor x = RandomTensor(DType::kF32, {1, 4, 32}, 5);
  for (const auto& [offset, code] : std::vector<std::pair<int64_t, grpc::StatusCode>>{
           {60, grpc::StatusCode::OK}, {61, grpc::StatusCode::OUT_OF_RANGE}}) {
    v1::AttendRequest req;
    req.mutable_layer()->set_model("gptj");
    *req.mutable_layer()->mutable_hidden() = ToWire(x.view());
    req.add_q_offsets(offset);
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    const grpc::Status st = s->stub->Attend(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), code) << offset << ": " << st.error_message();
    if (code != grpc::StatusCode::OK) {
      EXPECT_THAT(st.error_message(), AllOf(HasSubstr("position 64"), HasSubstr("n_positions 64")));
    }
  }

  grpc::ClientContext sctx;
  auto rw = s->stub->Decode(&sctx);
  v1::DecodeRequest open;
  open.mutable_open()->set_model("gptj");
  open.mutable_open()->set_start_position(58);
  v1::DecodeResponse r;
  ASSERT_TRUE(rw->Write(open));
  ASSERT_TRUE(rw->Read(&r));
  ASSERT_TRUE(r.has_opened()) << r.DebugString();
  v1::DecodeRequest step;
  step.mutable_step()->set_seq(1);
  *step.mutable_step()->mutable_hidden() = ToWire(x.cview().Slice(1, 0, 4));  // 58..61
  ASSERT_TRUE(rw->Write(step));
  ASSERT_TRUE(rw->Read(&r));
  ASSERT_TRUE(r.has_step()) << r.DebugString();
  step.mutable_step()->set_seq(2);  // 62..65: past the table
  ASSERT_TRUE(rw->Write(step));
  ASSERT_TRUE(rw->Read(&r));
  ASSERT_TRUE(r.has_error()) << r.DebugString();
  EXPECT_EQ(r.error().code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_THAT(r.error().message(), HasSubstr("position 65"));
  *step.mutable_step()->mutable_hidden() = ToWire(x.cview().Slice(1, 0, 2));  // 62..63 fit
  ASSERT_TRUE(rw->Write(step));
  ASSERT_TRUE(rw->Read(&r));
  ASSERT_TRUE(r.has_step()) << r.DebugString();
  rw->WritesDone();
  EXPECT_TRUE(rw->Finish().ok());

  // A session starting at 64 could never step: refused at open.
  {
    grpc::ClientContext octx;
    auto orw = s->stub->Decode(&octx);
    v1::DecodeRequest late;
    late.mutable_open()->set_model("gptj");
    late.mutable_open()->set_start_position(64);
    ASSERT_TRUE(orw->Write(late));
    v1::DecodeResponse lr;
    EXPECT_FALSE(orw->Read(&lr)) << lr.DebugString();
    const grpc::Status lst = orw->Finish();
    EXPECT_EQ(lst.error_code(), grpc::StatusCode::OUT_OF_RANGE) << lst.error_message();
    EXPECT_THAT(lst.error_message(), HasSubstr("open.start_position"));
  }
  // A prefix of 8 tokens from position 60 reaches 67: refused at open.
  grpc::ClientContext pctx;
  auto prw = s->stub->Decode(&pctx);
  v1::DecodeRequest popen;
  popen.mutable_open()->set_model("gptj");
  popen.mutable_open()->set_start_position(60);
  v1::KvPrefix* pre = popen.mutable_open()->mutable_prefix();
  pre->set_key_form(v1::KEY_FORM_RAW);
  *pre->mutable_k() = ToWire(RandomTensor(DType::kF32, {1, 8, 4, 8}, 7).cview());
  *pre->mutable_v() = ToWire(RandomTensor(DType::kF32, {1, 8, 4, 8}, 8).cview());
  ASSERT_TRUE(prw->Write(popen));
  v1::DecodeResponse pr;
  EXPECT_FALSE(prw->Read(&pr)) << pr.DebugString();
  const grpc::Status pst = prw->Finish();
  EXPECT_EQ(pst.error_code(), grpc::StatusCode::OUT_OF_RANGE) << pst.error_message();
  EXPECT_THAT(pst.error_message(), AllOf(HasSubstr("open.prefix"), HasSubstr("position 67")));
}

INSTANTIATE_TEST_SUITE_P(Families, ArchitectureTest,
                         ::testing::Values("llama", "mistral", "mixtral", "qwen2", "qwen3",
                                           "gemma2", "gemma3", "gemma3_keyed", "phi3",
                                           "gpt_neox", "gptj", "bert"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace ropeattn::testing
