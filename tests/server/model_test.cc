// Model artifacts: config.json resolution for the RoPE styles real
// checkpoints use, safetensors loading (weights copied out, files unmapped
// after load: checked against /proc/self/maps), sharded checkpoints, every kind of broken file,
// the demo model and the registry.
#include "server/model.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/safetensors_writer.h"

namespace ropeattn::server {
namespace {

using ::ropeattn::testing::BF16Bytes;
using ::ropeattn::testing::F32Bytes;
using ::ropeattn::testing::SafetensorsBytes;
using ::ropeattn::testing::SafetensorsFromHeader;
using ::ropeattn::testing::SafetensorsHeaderJson;
using ::ropeattn::testing::SafetensorsLayout;
using ::ropeattn::testing::SafetensorsTensor;
using ::ropeattn::testing::TempDir;
using ::ropeattn::testing::U16Bytes;
using ::ropeattn::testing::WriteFileOrDie;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

// --- /proc/self/maps: proves a view points into the file mapping. ---

// The path of the mapping holding `p`, or "" if none (anonymous or heap
// memory has no path or a bracketed name).
std::string MappingPathOf(const void* p) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    std::istringstream in(line);
    std::string range, perms, offset, dev, inode, path;
    in >> range >> perms >> offset >> dev >> inode;
    std::getline(in >> std::ws, path);
    const size_t dash = range.find('-');
    const uintptr_t lo = std::stoull(range.substr(0, dash), nullptr, 16);
    const uintptr_t hi = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (addr >= lo && addr < hi) return path;
  }
  return "";
}

int CountMappingsOf(const std::string& path) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int n = 0;
  while (std::getline(maps, line)) n += absl::EndsWith(line, " " + path) ? 1 : 0;
  return n;
}

// --- A tiny Llama-style checkpoint. ---

struct TinyDims {
  int64_t hidden = 32, heads = 4, kv_heads = 2, head_dim = 8, vocab = 16, layers = 2;
  int64_t max_positions = 128;
};

std::string TinyConfig(const TinyDims& d = {}, absl::string_view extra = "") {
  return absl::StrFormat(
      R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": %d,
          "num_attention_heads": %d, "num_key_value_heads": %d, "vocab_size": %d,
          "num_hidden_layers": %d, "max_position_embeddings": %d, "rope_theta": 10000.0%s})",
      d.hidden, d.heads, d.kv_heads, d.vocab, d.layers, d.max_positions, extra);
}

// Distinct, exactly representable values (multiples of 1/256 in [-1, 1)), so
// BF16 rounding is also exact and each tensor differs from the others.
std::vector<float> Values(int64_t n, int seed) {
  std::vector<float> v(static_cast<size_t>(n));
  uint32_t s = 2463534242u + 7919u * static_cast<uint32_t>(seed);
  for (auto& x : v) {
    s ^= s << 13, s ^= s >> 17, s ^= s << 5;
    x = static_cast<float>(static_cast<int>(s % 512) - 256) / 256.0f;
  }
  return v;
}

// F16 bit patterns with their exact f32 values: normal, negative, the
// largest finite, the smallest subnormal, a subnormal, the most negative
// finite, 1/3 (infinity is a weight a checkpoint may not hold: see
// NonFiniteWeightsAreRefusedAtLoad).
const std::vector<std::pair<uint16_t, float>>& F16Samples() {
  static const auto* samples =
      new std::vector<std::pair<uint16_t, float>>{{0x3C00, 1.0f},
                                                  {0xC000, -2.0f},
                                                  {0x7BFF, 65504.0f},
                                                  {0x0001, std::ldexp(1.0f, -24)},
                                                  {0x8200, -std::ldexp(1.0f, -15)},
                                                  {0xFBFF, -65504.0f},
                                                  {0x3555, 0.333251953125f},
                                                  {0x0000, 0.0f}};
  return *samples;
}

SafetensorsTensor F32Tensor(std::string name, std::vector<int64_t> shape, int seed) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return {std::move(name), "F32", shape, F32Bytes(Values(n, seed)), std::nullopt};
}

// Layer 0's v_proj is BF16 and layer 1's o_proj F16 (from F16Samples); the
// rest is F32.
std::vector<SafetensorsTensor> TinyTensors(const TinyDims& d = {}) {
  std::vector<SafetensorsTensor> t;
  int seed = 0;
  t.push_back(F32Tensor("model.embed_tokens.weight", {d.vocab, d.hidden}, ++seed));
  for (int64_t i = 0; i < d.layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".self_attn.");
    t.push_back(F32Tensor(p + "q_proj.weight", {d.heads * d.head_dim, d.hidden}, ++seed));
    t.push_back(F32Tensor(p + "k_proj.weight", {d.kv_heads * d.head_dim, d.hidden}, ++seed));
    SafetensorsTensor v =
        F32Tensor(p + "v_proj.weight", {d.kv_heads * d.head_dim, d.hidden}, ++seed);
    if (i == 0)
      v.dtype = "BF16", v.bytes = BF16Bytes(Values(d.kv_heads * d.head_dim * d.hidden, seed));
    t.push_back(std::move(v));
    SafetensorsTensor o = F32Tensor(p + "o_proj.weight", {d.hidden, d.heads * d.head_dim}, ++seed);
    if (i == 1) {
      std::vector<uint16_t> bits(static_cast<size_t>(d.hidden * d.heads * d.head_dim));
      for (size_t k = 0; k < bits.size(); ++k)
        bits[k] = F16Samples()[k % F16Samples().size()].first;
      o.dtype = "F16", o.bytes = U16Bytes(bits);
    }
    t.push_back(std::move(o));
  }
  return t;
}

SafetensorsTensor* Find(std::vector<SafetensorsTensor>& tensors, absl::string_view name) {
  for (auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

const SafetensorsTensor* Find(const std::vector<SafetensorsTensor>& tensors,
                              absl::string_view name) {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

void WriteCheckpoint(const TempDir& dir, const std::vector<SafetensorsTensor>& tensors,
                     const std::string& config = TinyConfig(),
                     const SafetensorsLayout& layout = {}) {
  WriteFileOrDie(dir.File("config.json"), config);
  WriteFileOrDie(dir.File("model.safetensors"), SafetensorsBytes(tensors, layout));
}

absl::Status LoadStatus(const TempDir& dir) { return Model::Load("m", dir.path()).status(); }

bool SameBytes(const ConstTensorView& view, const std::string& bytes) {
  const size_t n = static_cast<size_t>(view.num_elements()) * DTypeSize(view.dtype());
  return n == bytes.size() && std::memcmp(view.raw(), bytes.data(), n) == 0;
}

// ============================ config.json ===================================

TEST(ParseModelConfigTest, Llama31ResolvesLlama3Scaling) {
  const char* kConfig = R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "torch_dtype": "bfloat16", "vocab_size": 128256})";
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kConfig, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "LlamaForCausalLM");
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->num_heads, 32);
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->vocab_size, 128256);
  EXPECT_EQ(c->max_positions, 131072);
  EXPECT_EQ(c->num_layers, 32);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->positions, PositionKind::kRope);
  ASSERT_TRUE(c->rope.has_value());
  const RopeConfig& r = *c->rope;
  EXPECT_EQ(r.head_dim, 128);
  EXPECT_EQ(r.effective_rotary_dim(), 128);
  EXPECT_EQ(r.theta, 500000.0);
  EXPECT_EQ(r.layout, RopeLayout::kHalfSplit);
  EXPECT_EQ(r.scaling.type, RopeScalingType::kLlama3);
  EXPECT_EQ(r.scaling.factor, 8.0);
  EXPECT_EQ(r.scaling.low_freq_factor, 1.0);
  EXPECT_EQ(r.scaling.high_freq_factor, 4.0);
  EXPECT_EQ(r.scaling.original_max_positions, 8192);
}

std::string Phi3Config(absl::string_view type_key, absl::string_view type,
                       absl::string_view extra_scaling = "") {
  std::vector<std::string> short_f, long_f;
  for (int i = 0; i < 48; ++i) {
    short_f.push_back(absl::StrCat(1.0 + 0.01 * i));
    long_f.push_back(absl::StrCat(1.5 + 0.5 * i));
  }
  return absl::StrFormat(
      R"({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
          "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 32,
          "vocab_size": 32064, "max_position_embeddings": 131072,
          "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
          "rope_scaling": {"%s": "%s", "short_factor": [%s], "long_factor": [%s]%s}})",
      type_key, type, absl::StrJoin(short_f, ", "), absl::StrJoin(long_f, ", "), extra_scaling);
}

TEST(ParseModelConfigTest, Phi3LongRopeDerivesFactorFromLengths) {
  for (const auto& [key, type] : std::vector<std::pair<std::string, std::string>>{
           {"rope_type", "longrope"}, {"type", "longrope"}, {"type", "su"}, {"type", "yarn"},
           {"rope_type", "yarn"}}) {
    SCOPED_TRACE(key + "=" + type);
    absl::StatusOr<ModelConfig> c = ParseModelConfig(Phi3Config(key, type), "config.json");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->head_dim, 96);
    ASSERT_TRUE(c->rope.has_value());
    const RopeScaling& s = c->rope->scaling;
    EXPECT_EQ(s.type, RopeScalingType::kLongRope);
    EXPECT_EQ(s.original_max_positions, 4096);  // from the top level
    EXPECT_EQ(s.factor, 131072.0 / 4096.0);     // max / original when not given
    ASSERT_EQ(s.short_factor.size(), 48u);
    ASSERT_EQ(s.long_factor.size(), 48u);
    EXPECT_DOUBLE_EQ(s.short_factor[47], 1.47);
    EXPECT_EQ(s.long_factor[3], 3.0);
    EXPECT_EQ(c->rope->theta, 10000.0);
  }
}


TEST(ParseModelConfigTest, Phi3ExplicitFactorWins) {
  absl::StatusOr<ModelConfig> c =
      ParseModelConfig(Phi3Config("rope_type", "longrope", R"(, "factor": 4.0)"), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope->scaling.factor, 4.0);
}

TEST(ParseModelConfigTest, Phi3WrongFactorCountIsRejectedByCoreValidation) {
  std::string config = Phi3Config("rope_type", "longrope");
  // 47 short factors for 48 pairs.
  config.replace(config.find("1, 1.01"), 3, "");
  absl::StatusOr<ModelConfig> c = ParseModelConfig(config, "config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), AllOf(HasSubstr("config.json"), HasSubstr("short_factor")));
}

void ExpectConfigError(absl::string_view config, absl::StatusCode code,
                       std::vector<std::string> substrings);

TEST(ParseModelConfigTest, YarnTruncateAndFactorAsTransformersReadsThem) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(
      TinyConfig({}, R"(, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
          "original_max_position_embeddings": 32, "truncate": false}, "head_dim": 64)"),
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->rope->scaling.truncate);
  // No factor: extended from L0 to max_position_embeddings (128 / 32).
  c = ParseModelConfig(TinyConfig({}, R"(, "rope_scaling": {"rope_type": "yarn",
          "original_max_position_embeddings": 32})"),
                       "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->rope->scaling.truncate);
  EXPECT_EQ(c->rope->scaling.factor, 4.0);
  ExpectConfigError(TinyConfig({}, R"(, "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
          "truncate": "no"})"),
                    absl::StatusCode::kInvalidArgument, {"rope_scaling.truncate"});
}

TEST(ParseModelConfigTest, Qwen2Yarn) {
  const char* kConfig = R"({
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
    "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28,
    "vocab_size": 152064, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    "sliding_window": 131072, "use_sliding_window": false,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 32768}})";
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kConfig, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->num_kv_heads, 4);
  EXPECT_TRUE(c->attention_bias);  // Qwen2 always has q/k/v biases
  const RopeConfig& r = *c->rope;
  EXPECT_EQ(r.theta, 1e6);
  EXPECT_EQ(r.scaling.type, RopeScalingType::kYarn);
  EXPECT_EQ(r.scaling.factor, 4.0);
  EXPECT_EQ(r.scaling.original_max_positions, 32768);
  EXPECT_EQ(r.scaling.beta_fast, 32.0);
  EXPECT_EQ(r.scaling.beta_slow, 1.0);
  EXPECT_FALSE(r.scaling.attention_factor.has_value());
  EXPECT_EQ(r.layout, RopeLayout::kHalfSplit);
}

TEST(ParseModelConfigTest, GptNeoXPartialRotaryHalfSplit) {
  const char* kConfig = R"({
    "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 1024,
    "num_attention_heads": 16, "num_hidden_layers": 24, "vocab_size": 50304,
    "max_position_embeddings": 2048, "rotary_pct": 0.25, "rotary_emb_base": 10000,
    "use_parallel_residual": true})";
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kConfig, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->num_kv_heads, 16);
  EXPECT_EQ(c->rope->rotary_dim, 16);  // 64 * 0.25: frequencies come from 16, not 64
  EXPECT_EQ(c->rope->layout, RopeLayout::kHalfSplit);
  EXPECT_EQ(c->rope->theta, 10000.0);
  EXPECT_EQ(c->rope->scaling.type, RopeScalingType::kDefault);
}

// Phi3Config always has a top-level original_max_position_embeddings
// (default 4096), which transformers writes over the block's. Elsewhere
// transformers 5 writes a top-level one over the block's, while transformers
// 4 read the block's for yarn (else max_position_embeddings) and llama3 (else
// failed) and only the top level for longrope: a length on which the two
// disagree is refused, one they agree on served.
TEST(ParseModelConfigTest, TrainedLengthWhereTransformersVersionsAgreeAndPhi3DefaultsTo4096) {
  auto l0_of = [](std::string config) -> int64_t {
    absl::StatusOr<ModelConfig> c = ParseModelConfig(config, "config.json");
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? c->rope->scaling.original_max_positions : -1;
  };
  auto replace = [](std::string s, const std::string& from, const std::string& to) {
    s.replace(s.find(from), from.size(), to);
    return s;
  };
  const std::string phi3 =
      Phi3Config("rope_type", "longrope", R"(, "original_max_position_embeddings": 32)");
  EXPECT_EQ(l0_of(replace(phi3, R"("original_max_position_embeddings": 4096)",
                          R"("original_max_position_embeddings": 16)")),
            16);  // top 16 over the block's 32
  const std::string no_top =
      replace(replace(phi3, R"("original_max_position_embeddings": 4096,)", ""), "131072",
              "16384");
  absl::StatusOr<ModelConfig> c = ParseModelConfig(no_top, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope->scaling.original_max_positions, 4096);  // Phi3Config's default
  EXPECT_EQ(c->rope->scaling.factor, 16384.0 / 4096.0);

  // yarn and llama3 (TinyConfig: llama, max_position_embeddings 128), under
  // either block name: the block's length alone, or the same one at both levels.
  const std::string llama3_freqs = R"("low_freq_factor": 1.0, "high_freq_factor": 4.0, )";
  for (const char* block : {"rope_scaling", "rope_parameters"}) {
    for (const std::string rule : {"yarn", "llama3"}) {
      SCOPED_TRACE(absl::StrCat(block, " ", rule));
      const auto config = [&](absl::string_view top_l0, absl::string_view block_l0) {
        return TinyConfig(
            {}, absl::StrCat(top_l0.empty() ? "" : ", \"original_max_position_embeddings\": ",
                             top_l0, ", \"", block, "\": {\"rope_type\": \"", rule,
                             "\", \"factor\": 2.0, ", rule == "llama3" ? llama3_freqs : "",
                             "\"original_max_position_embeddings\": ", block_l0, "}"));
      };
      EXPECT_EQ(l0_of(config("", "32")), 32);
      EXPECT_EQ(l0_of(config("32", "32")), 32);
      ExpectConfigError(
          config("64", "32"), absl::StatusCode::kUnimplemented,
          {"original_max_position_embeddings = 64",
           absl::StrCat(block, ".original_max_position_embeddings = 32"), rule, "transformers 5"});
    }
  }
  // yarn with the top-level length alone: transformers 4 takes
  // max_position_embeddings (128), 5 the key; served only when they agree.
  EXPECT_EQ(l0_of(TinyConfig({}, R"(, "original_max_position_embeddings": 128,
      "rope_scaling": {"rope_type": "yarn", "factor": 2.0})")),
            128);
  ExpectConfigError(
      TinyConfig({}, R"(, "original_max_position_embeddings": 32,
      "rope_scaling": {"rope_type": "yarn", "factor": 2.0})"),
      absl::StatusCode::kUnimplemented,
      {"original_max_position_embeddings = 32", "max_position_embeddings = 128", "rope_scaling"});
  // llama3 with the top-level length alone: transformers 4 fails (KeyError),
  // 5 reads it.
  EXPECT_EQ(l0_of(TinyConfig({}, R"(, "original_max_position_embeddings": 32,
      "rope_scaling": {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0})")),
            32);
  // The same refusal in another family (Qwen2's yarn).
  ExpectConfigError(
      R"({"model_type": "qwen2", "hidden_size": 32, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 16, "num_hidden_layers": 1,
          "max_position_embeddings": 128, "original_max_position_embeddings": 64,
          "rope_scaling": {"type": "yarn", "factor": 4,
                           "original_max_position_embeddings": 32}})",
      absl::StatusCode::kUnimplemented,
      {"original_max_position_embeddings = 64",
       "rope_scaling.original_max_position_embeddings = 32"});

  // longrope outside Phi-3 (head_dim 8: 4 factors each): a top-level length
  // wins over the block's in both versions; the block's alone is read by 5
  // only (4 takes max_position_embeddings), served when they agree.
  const auto longrope = [](absl::string_view top_l0, absl::string_view block_l0) {
    return TinyConfig(
        {}, absl::StrCat(
                top_l0.empty() ? "" : ", \"original_max_position_embeddings\": ", top_l0,
                R"(, "rope_scaling": {"rope_type": "longrope",
                              "short_factor": [1, 1, 1, 1], "long_factor": [2, 2, 2, 2])",
                block_l0.empty() ? "" : ", \"original_max_position_embeddings\": ", block_l0, "}"));
  };
  EXPECT_EQ(l0_of(longrope("64", "32")), 64);
  EXPECT_EQ(l0_of(longrope("64", "")), 64);
  EXPECT_EQ(l0_of(longrope("", "128")), 128);
  ExpectConfigError(longrope("", "32"), absl::StatusCode::kUnimplemented,
                    {"rope_scaling.original_max_position_embeddings = 32",
                     "max_position_embeddings = 128", "longrope"});
}

// GPT-NeoX's base is rotary_emb_base (a top-level rope_theta is never read)
// and its fraction rotary_pct; a top-level partial_rotary_factor, or a RoPE
// block's rope_theta or partial_rotary_factor, that disagrees is one
// transformers versions read differently: refused.
TEST(ParseModelConfigTest, GptNeoXReadsRotaryEmbBaseAndRefusesAmbiguousFractions) {
  auto neox = [](absl::string_view extra) {
    return absl::StrCat(R"({"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 1, "vocab_size": 8, "max_position_embeddings": 64)",
                        extra, "}");
  };
  absl::StatusOr<ModelConfig> c = ParseModelConfig(neox(R"(, "rope_theta": 100)"), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope->theta, 10000.0);
  c = ParseModelConfig(neox(R"(, "rotary_emb_base": 100, "rope_theta": 10000)"), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope->theta, 100.0);
  c = ParseModelConfig(neox(R"(, "rotary_pct": 0.5, "partial_rotary_factor": 0.5)"),
                       "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope->rotary_dim, 8);
  ExpectConfigError(neox(R"(, "rotary_pct": 0.5, "partial_rotary_factor": 1.0)"),
                    absl::StatusCode::kUnimplemented, {"partial_rotary_factor", "rotary_pct"});
  ExpectConfigError(neox(R"(, "partial_rotary_factor": 0.5)"), absl::StatusCode::kUnimplemented,
                    {"partial_rotary_factor", "0.25"});
  // A RoPE block's rope_theta and partial_rotary_factor: transformers 4 reads
  // only rotary_emb_base (default 10000) and rotary_pct (default 0.25),
  // transformers 5 the block's. Served when they agree, else refused.
  for (const char* block : {"rope_scaling", "rope_parameters"}) {
    SCOPED_TRACE(block);
    const auto with_block = [&](absl::string_view top, absl::string_view inner) {
      return neox(absl::StrCat(top, ", \"", block, "\": {\"rope_type\": \"default\"", inner, "}"));
    };
    c = ParseModelConfig(with_block("", R"(, "rope_theta": 10000)"), "config.json");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->rope->theta, 10000.0);
    c = ParseModelConfig(with_block(R"(, "rotary_emb_base": 100)", R"(, "rope_theta": 100)"),
                         "config.json");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->rope->theta, 100.0);
    ExpectConfigError(
        with_block("", R"(, "rope_theta": 100)"), absl::StatusCode::kUnimplemented,
        {absl::StrCat(block, ".rope_theta = 100"), "rotary_emb_base = 10000", "its default"});
    ExpectConfigError(with_block(R"(, "rotary_emb_base": 500)", R"(, "rope_theta": 100)"),
                      absl::StatusCode::kUnimplemented,
                      {absl::StrCat(block, ".rope_theta = 100"), "rotary_emb_base = 500"});
    c = ParseModelConfig(with_block("", R"(, "partial_rotary_factor": 0.25)"), "config.json");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->rope->rotary_dim, 4);
    c = ParseModelConfig(with_block(R"(, "rotary_pct": 0.5)", R"(, "partial_rotary_factor": 0.5)"),
                         "config.json");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->rope->rotary_dim, 8);
    ExpectConfigError(
        with_block("", R"(, "partial_rotary_factor": 0.5)"), absl::StatusCode::kUnimplemented,
        {absl::StrCat(block, ".partial_rotary_factor = 0.5"), "rotary_pct = 0.25", "its default"});
    ExpectConfigError(with_block(R"(, "rotary_pct": 0.5)", R"(, "partial_rotary_factor": 1)"),
                      absl::StatusCode::kUnimplemented,
                      {absl::StrCat(block, ".partial_rotary_factor = 1"), "rotary_pct = 0.5"});
  }
  ExpectConfigError(
      TinyConfig({}, R"(, "partial_rotary_factor": 1.0, "rope_scaling": {"rope_type": "default",
          "partial_rotary_factor": 0.5})"),
      absl::StatusCode::kUnimplemented, {"rope_scaling.partial_rotary_factor", "disagree"});
}

TEST(ParseModelConfigTest, GptJInterleavedRotaryDim) {
  const char* kConfig = R"({
    "architectures": ["GPTJForCausalLM"], "model_type": "gptj", "n_embd": 4096, "n_head": 16,
    "n_layer": 28, "n_positions": 2048, "rotary_dim": 64, "vocab_size": 50400})";
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kConfig, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->num_heads, 16);
  EXPECT_EQ(c->num_layers, 28);
  EXPECT_EQ(c->max_positions, 2048);
  EXPECT_EQ(c->head_dim, 256);
  EXPECT_EQ(c->rope->rotary_dim, 64);
  EXPECT_EQ(c->rope->layout, RopeLayout::kInterleaved);
}

TEST(ParseModelConfigTest, PartialRotaryFactorAndExplicitHeadDim) {
  // head_dim given explicitly (Qwen3 / Gemma style, heads * head_dim !=
  // hidden_size); a factor of 1 is the whole head.
  absl::StatusOr<ModelConfig> c = ParseModelConfig(
      TinyConfig({}, R"(, "head_dim": 20, "partial_rotary_factor": 1.0)"), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 20);
  EXPECT_EQ(c->rope->head_dim, 20);
  EXPECT_EQ(c->rope->rotary_dim, 20);
  // Llama's attention cannot apply a partial rotary (transformers fails on
  // it): refused, not computed with a made-up meaning.
  c = ParseModelConfig(TinyConfig({}, R"(, "head_dim": 20, "partial_rotary_factor": 0.4)"),
                       "config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented) << c.status();
  EXPECT_THAT(c.status().message(), AllOf(HasSubstr("partial_rotary_factor = 0.4"),
                                          HasSubstr("llama")));
}

// transformers computes the rotary dimension as int(head_dim * fraction):
// the double product truncated (100 * 0.29 = 28.999999999999996 gives 28).
TEST(ParseModelConfigTest, PartialRotaryIsTruncatedAsPythonInt) {
  // A 4-head, head_dim 100 config of `type` with `key` = `fraction`.
  const auto config = [](absl::string_view type, absl::string_view key,
                         absl::string_view fraction) {
    return absl::StrCat(R"({"model_type": ")", type, R"(", "hidden_size": 400,
            "num_attention_heads": 4, "vocab_size": 8, "num_hidden_layers": 1,
            "max_position_embeddings": 16, ")",
                        key, "\": ", fraction, "}");
  };
  const auto neox = [&](absl::string_view pct) { return config("gpt_neox", "rotary_pct", pct); };
  absl::StatusOr<ModelConfig> c = ParseModelConfig(neox("0.29"), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 100);
  EXPECT_EQ(c->rope->rotary_dim, 28);
  // 0.57 * 100 = 56.99999999999999: 56, even, served.
  c = ParseModelConfig(neox("0.57"), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope->rotary_dim, 56);
  // 0.58 * 100 = 57.99999999999999: 57, odd. Current transformers rotates
  // 58 channels at base^(-2i/57) (older versions fail): UNIMPLEMENTED.
  c = ParseModelConfig(neox("0.58"), "config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented) << c.status();
  EXPECT_THAT(c.status().message(), AllOf(HasSubstr("rotary_pct"), HasSubstr("rotary_dim 57")));

  const auto phi3 = [&](absl::string_view factor) {
    return config("phi3", "partial_rotary_factor", factor);
  };
  c = ParseModelConfig(phi3("0.57"), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope->rotary_dim, 56);
  // Phi-3 computes an odd dimension (58 channels at base^(-2i/57)): not a
  // rotation this server computes, so UNIMPLEMENTED naming the key.
  c = ParseModelConfig(phi3("0.58"), "config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented) << c.status();
  EXPECT_THAT(c.status().message(),
              AllOf(HasSubstr("partial_rotary_factor"), HasSubstr("odd rotary_dim 57")));
}

// transformers' dynamic NTK scales from max_position_embeddings whatever
// original_max_position_embeddings says (block or top level).
TEST(ParseModelConfigTest, DynamicScalesFromMaxPositionEmbeddings) {
  for (const char* extra :
       {R"(, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0,
             "original_max_position_embeddings": 16})",
        R"(, "original_max_position_embeddings": 16,
             "rope_scaling": {"rope_type": "dynamic", "factor": 2.0})"}) {
    SCOPED_TRACE(extra);
    absl::StatusOr<ModelConfig> c = ParseModelConfig(TinyConfig({}, extra), "config.json");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->rope->scaling.type, RopeScalingType::kDynamicNtk);
    EXPECT_EQ(c->rope->scaling.original_max_positions, 128);  // max_position_embeddings
  }
}

// Values transformers only warns about are computed: a factor below 1
// (linear, dynamic, yarn, llama3) and yarn's betas the other way round.
TEST(ParseModelConfigTest, ValuesTransformersOnlyWarnsAboutAreServed) {
  for (const char* block :
       {R"({"rope_type": "linear", "factor": 0.5})", R"({"rope_type": "dynamic", "factor": 0.5})",
        R"({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 64})",
        R"({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
            "beta_fast": 1, "beta_slow": 32})",
        R"({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
            "beta_fast": 0, "beta_slow": 0})",
        R"({"rope_type": "llama3", "factor": 0.5, "original_max_position_embeddings": 64,
            "low_freq_factor": 1, "high_freq_factor": 4})",
        R"({"rope_type": "llama3", "factor": 8, "original_max_position_embeddings": 64,
            "low_freq_factor": 4, "high_freq_factor": 1})",
        R"({"rope_type": "llama3", "factor": 8, "original_max_position_embeddings": 64,
            "low_freq_factor": 2, "high_freq_factor": 2})"}) {
    SCOPED_TRACE(block);
    absl::StatusOr<ModelConfig> c =
        ParseModelConfig(TinyConfig({}, absl::StrCat(R"(, "rope_scaling": )", block)), "config.json");
    ASSERT_TRUE(c.ok()) << c.status();
    absl::StatusOr<RopeFrequencies> f = ComputeRopeFrequencies(*c->rope, 1);
    ASSERT_TRUE(f.ok()) << f.status();
  }
  // llama3 with high_freq_factor <= low_freq_factor is a step at L0 / low;
  // a pair's wavelength on it (pair 0's is 2 pi) is NaN in transformers (or
  // on a side float32 rounding picks): UNIMPLEMENTED naming both fields.
  {
    absl::StatusOr<ModelConfig> step = ParseModelConfig(
        TinyConfig({}, absl::StrFormat(R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8,
            "original_max_position_embeddings": 64, "low_freq_factor": %.17g,
            "high_freq_factor": 1})",
                                       64.0 / (2.0 * M_PI))),
        "config.json");
    EXPECT_EQ(step.status().code(), absl::StatusCode::kUnimplemented) << step.status();
    EXPECT_THAT(step.status().message(),
                AllOf(HasSubstr("rope_scaling"), HasSubstr("high_freq_factor = 1"),
                      HasSubstr("low_freq_factor = 10.18")));
  }
  // beta 0 is transformers' `or 32` / `or 1`: the defaults.
  absl::StatusOr<ModelConfig> c = ParseModelConfig(
      TinyConfig({}, R"(, "rope_scaling": {"rope_type": "yarn", "factor": 4,
          "original_max_position_embeddings": 64, "beta_fast": 0, "beta_slow": 0})"),
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope->scaling.beta_fast, 32.0);
  EXPECT_EQ(c->rope->scaling.beta_slow, 1.0);
}

// Values transformers computes to finite frequencies that this server's
// RoPE does not: UNIMPLEMENTED naming the key and value, not malformed input.
TEST(ParseModelConfigTest, RopeValuesTransformersComputesAreUnimplemented) {
  const struct {
    const char* extra;
    std::vector<std::string> parts;
  } cases[] = {
      {R"(, "rope_theta": 1.0)", {"key rope_theta = 1 ", "base > 1"}},
      {R"(, "rope_theta": 0.5)", {"key rope_theta = 0.5 "}},
      {R"(, "rope_scaling": {"rope_type": "linear", "factor": 2, "rope_theta": 0.5})",
       {"key rope_scaling.rope_theta = 0.5 "}},
      {R"(, "rope_scaling": {"rope_type": "linear", "factor": -2})",
       {"key rope_scaling.factor = -2 "}},
      {R"(, "rope_scaling": {"rope_type": "yarn", "factor": 2,
          "original_max_position_embeddings": 32, "attention_factor": -1})",
       {"key rope_scaling.attention_factor = -1 "}},
      {R"(, "rope_scaling": {"rope_type": "yarn", "factor": 2,
          "original_max_position_embeddings": 32, "attention_factor": 0})",
       {"key rope_scaling.attention_factor = 0 "}},
      {R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8,
          "original_max_position_embeddings": 32, "low_freq_factor": -1,
          "high_freq_factor": 4})",
       {"key rope_scaling.low_freq_factor = -1 "}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.extra);
    ExpectConfigError(TinyConfig({}, c.extra), absl::StatusCode::kUnimplemented, c.parts);
  }
  // GPT-NeoX names its base rotary_emb_base.
  ExpectConfigError(R"({"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4,
      "vocab_size": 8, "num_hidden_layers": 1, "rotary_emb_base": 0.75})",
                    absl::StatusCode::kUnimplemented, {"key rotary_emb_base = 0.75 "});
}

// A fraction of head_dim that truncates to 0 rotary channels: transformers'
// inv_freq is empty and apply_rotary_pos_emb rotates q[..., :0], so the layer
// is attention without RoPE, served as such (GPT-NeoX rotary_pct, Phi-3
// partial_rotary_factor). GPT-J's rotary_dim 0 fails in transformers (its
// sinusoids are then hidden_size wide): invalid.
TEST(ParseModelConfigTest, ZeroRotaryChannelsServeNoRope) {
  const auto config = [](absl::string_view type, absl::string_view key,
                         absl::string_view value) {
    return absl::StrCat(R"({"model_type": ")", type, R"(", "hidden_size": 32,
            "num_attention_heads": 4, "vocab_size": 8, "num_hidden_layers": 1,
            "max_position_embeddings": 16, ")",
                        key, "\": ", value, "}");
  };
  for (const auto& [type, key, value] :
       {std::tuple<const char*, const char*, const char*>{"gpt_neox", "rotary_pct", "0.1"},
        {"gpt_neox", "rotary_pct", "0"},
        {"phi3", "partial_rotary_factor", "0.1"}}) {
    SCOPED_TRACE(absl::StrCat(type, " ", key, " ", value));
    absl::StatusOr<ModelConfig> c = ParseModelConfig(config(type, key, value), "config.json");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->head_dim, 8);
    EXPECT_FALSE(c->rope.has_value());
    EXPECT_EQ(c->positions, PositionKind::kNone);
    EXPECT_EQ(RopeOfLayer(*c, 0), nullptr);
  }
  ExpectConfigError(config("gpt_neox", "rotary_pct", "-0.1"), absl::StatusCode::kInvalidArgument,
                    {"rotary_pct", "[0, 1]"});
  ExpectConfigError(config("gptj", "rotary_dim", "0"), absl::StatusCode::kInvalidArgument,
                    {"rotary_dim"});
}

TEST(ParseModelConfigTest, GptJNullRotaryDimNeedsOneHead) {
  const auto gptj = [](int heads) {
    return absl::StrFormat(
        R"({"model_type": "gptj", "n_embd": 64, "n_head": %d, "n_layer": 1,
            "n_positions": 32, "rotary_dim": null, "vocab_size": 8})",
        heads);
  };
  // One head: the whole head (= hidden_size) is rotated, as transformers does.
  absl::StatusOr<ModelConfig> c = ParseModelConfig(gptj(1), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope->rotary_dim, 64);
  // More heads: transformers' cos/sin are hidden_size wide and fail against
  // a head.
  c = ParseModelConfig(gptj(4), "config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_THAT(c.status().message(), AllOf(HasSubstr("rotary_dim"), HasSubstr("4 heads")));
}

TEST(ParseModelConfigTest, LegacyDynamicAndRopeParameters) {
  absl::StatusOr<ModelConfig> dyn = ParseModelConfig(
      TinyConfig({}, R"(, "rope_scaling": {"type": "dynamic", "factor": 2.0})"), "config.json");
  ASSERT_TRUE(dyn.ok()) << dyn.status();
  EXPECT_EQ(dyn->rope->scaling.type, RopeScalingType::kDynamicNtk);
  EXPECT_EQ(dyn->rope->scaling.factor, 2.0);
  EXPECT_EQ(dyn->rope->scaling.original_max_positions, 128);  // max_position_embeddings

  // transformers >= 4.56 moves rope_theta into rope_parameters.
  absl::StatusOr<ModelConfig> params =
      ParseModelConfig(TinyConfig({}, R"(, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                             "rope_theta": 50000.0})"),
                       "config.json");
  ASSERT_TRUE(params.ok()) << params.status();
  EXPECT_EQ(params->rope->scaling.type, RopeScalingType::kLinear);
  EXPECT_EQ(params->rope->theta, 50000.0);

  // Both blocks: transformers takes `rope_scaling or rope_parameters`, so a
  // non-empty rope_scaling wins and a null or empty one does not.
  params = ParseModelConfig(
      TinyConfig({}, R"(, "rope_scaling": {"rope_type": "linear", "factor": 3.0},
          "rope_parameters": {"rope_type": "dynamic", "factor": 2.0})"),
      "config.json");
  ASSERT_TRUE(params.ok()) << params.status();
  EXPECT_EQ(params->rope->scaling.type, RopeScalingType::kLinear);
  EXPECT_EQ(params->rope->scaling.factor, 3.0);
  for (const char* empty : {"null", "{}"}) {
    params = ParseModelConfig(
        TinyConfig({}, absl::StrCat(R"(, "rope_scaling": )", empty,
                                    R"(, "rope_parameters": {"rope_type": "linear", "factor": 2.0})")),
        "config.json");
    ASSERT_TRUE(params.ok()) << params.status();
    EXPECT_EQ(params->rope->scaling.type, RopeScalingType::kLinear) << empty;
    EXPECT_EQ(params->rope->scaling.factor, 2.0) << empty;
  }

  absl::StatusOr<ModelConfig> none =
      ParseModelConfig(TinyConfig({}, R"(, "rope_scaling": null)"), "config.json");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->rope->scaling.type, RopeScalingType::kDefault);
}

TEST(ParseModelConfigTest, BertIsLearnedAbsolute) {
  const char* kConfig = R"({
    "architectures": ["BertModel"], "model_type": "bert", "hidden_size": 768,
    "num_attention_heads": 12, "num_hidden_layers": 12, "vocab_size": 30522,
    "max_position_embeddings": 512, "position_embedding_type": "absolute"})";
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kConfig, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->positions, PositionKind::kLearned);
  EXPECT_FALSE(c->rope.has_value());
}

// transformers 4 adds no position embeddings for a null
// position_embedding_type (getattr gives None), transformers 5 always adds
// them: not one answer.
TEST(ParseModelConfigTest, BertNullPositionEmbeddingTypeIsUnimplemented) {
  ExpectConfigError(R"({"model_type": "bert", "hidden_size": 32, "num_attention_heads": 4,
      "num_hidden_layers": 1, "vocab_size": 10, "position_embedding_type": null})",
                    absl::StatusCode::kUnimplemented, {"key position_embedding_type", "null"});
}

// pruned_heads makes transformers build layers with fewer heads than
// num_attention_heads: refused naming the key, in every family; {} prunes
// nothing.
TEST(ParseModelConfigTest, PrunedHeadsAreRefused) {
  using C = absl::StatusCode;
  const std::string bert = R"("model_type": "bert", "hidden_size": 32, "num_attention_heads": 4,
      "num_hidden_layers": 1, "vocab_size": 10)";
  ExpectConfigError(absl::StrCat("{", bert, R"(, "pruned_heads": {"0": [1]}})"),
                    C::kUnimplemented, {"key pruned_heads", "\"0\""});
  ExpectConfigError(TinyConfig({}, R"(, "pruned_heads": {"1": [0, 2]})"), C::kUnimplemented,
                    {"key pruned_heads"});
  ExpectConfigError(absl::StrCat("{", bert, R"(, "pruned_heads": null})"), C::kInvalidArgument,
                    {"key pruned_heads", "null"});
  ExpectConfigError(absl::StrCat("{", bert, R"(, "pruned_heads": [1]})"), C::kInvalidArgument,
                    {"key pruned_heads"});
  EXPECT_TRUE(ParseModelConfig(absl::StrCat("{", bert, R"(, "pruned_heads": {}})"), "config.json")
                  .ok());
}

// Each config class's own rope_theta and max_position_embeddings when the
// file omits them: Mixtral shares Mistral's attention but MixtralConfig
// defaults rope_theta to 1e6 (and sliding_window to None).
TEST(ParseModelConfigTest, FamiliesTakeTheirRopeThetaAndLengthDefaults) {
  struct Case {
    const char* model_type;
    double theta;
    int64_t max_positions;
  };
  for (const Case& k : {Case{"llama", 10000.0, 2048}, Case{"mistral", 10000.0, 131072},
                        Case{"mixtral", 1000000.0, 131072}, Case{"qwen2", 10000.0, 32768},
                        Case{"qwen2_moe", 10000.0, 32768}, Case{"qwen3", 10000.0, 32768},
                        Case{"qwen3_moe", 10000.0, 32768}, Case{"gemma", 10000.0, 8192},
                        Case{"gemma2", 10000.0, 8192}, Case{"gemma3_text", 1000000.0, 131072},
                        Case{"phi3", 10000.0, 4096}, Case{"gpt_neox", 10000.0, 2048},
                        Case{"gptj", 10000.0, 2048}}) {
    SCOPED_TRACE(k.model_type);
    absl::StatusOr<ModelConfig> c = ParseModelConfig(
        absl::StrCat(R"({"model_type": ")", k.model_type, R"(", "hidden_size": 512,
            "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 128,
            "vocab_size": 8, "num_hidden_layers": 6})"),
        "config.json");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->max_positions, k.max_positions);
    // Gemma 3's global layers (every 6th) use rope_theta.
    EXPECT_EQ(RopeOfLayer(*c, 5)->theta, k.theta);
  }
  absl::StatusOr<ModelConfig> bert = ParseModelConfig(
      R"({"model_type": "bert", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 8,
          "num_hidden_layers": 1})",
      "config.json");
  ASSERT_TRUE(bert.ok()) << bert.status();
  EXPECT_EQ(bert->max_positions, 512);
  // Mixtral: no window when absent (MixtralConfig's None), unlike Mistral.
  absl::StatusOr<ModelConfig> mixtral = ParseModelConfig(
      R"({"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 8, "vocab_size": 8,
          "num_hidden_layers": 1, "max_position_embeddings": 64})",
      "config.json");
  ASSERT_TRUE(mixtral.ok()) << mixtral.status();
  EXPECT_EQ(mixtral->layers[0].window, 0);
  EXPECT_EQ(mixtral->num_kv_heads, 8);
  EXPECT_EQ(mixtral->rope->theta, 1000000.0);
}

// Gemma 3's RoPEs where transformers 4 (rope_theta + rope_scaling global,
// rope_local_base_freq sliding) and 5 (rope_parameters keyed by layer type,
// rope_scaling merged into full_attention, a block without rope_theta
// filled from rope_theta / rope_local_base_freq) agree; refused by key where
// they do not.
TEST(ParseModelConfigTest, Gemma3RopeIsWhatTransformers4And5Share) {
  auto parse = [](absl::string_view extra) {
    return ParseModelConfig(
        absl::StrCat(R"({"model_type": "gemma3_text", "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 8,
            "num_hidden_layers": 2, "sliding_window": 4, "sliding_window_pattern": 2,
            "max_position_embeddings": 64)",
                     extra, "}"),
        "config.json");
  };
  // A sliding block without rope_theta: rope_local_base_freq (both versions),
  // not the global rope_theta.
  absl::StatusOr<ModelConfig> c = parse(R"(, "rope_theta": 1000000.0,
      "rope_local_base_freq": 20000.0, "rope_parameters": {
      "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
      "sliding_attention": {"rope_type": "default"}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(RopeOfLayer(*c, 0)->theta, 20000.0);
  EXPECT_EQ(RopeOfLayer(*c, 1)->theta, 1000000.0);
  // ... and without rope_local_base_freq its default 10000, whatever
  // rope_theta says; a full block without rope_theta takes rope_theta.
  c = parse(R"(, "rope_theta": 500000.0, "rope_parameters": {
      "full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(RopeOfLayer(*c, 0)->theta, 10000.0);
  EXPECT_EQ(RopeOfLayer(*c, 1)->theta, 500000.0);
  // Equal values in both places are served.
  c = parse(R"(, "rope_local_base_freq": 20000.0, "rope_parameters": {
      "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(RopeOfLayer(*c, 0)->theta, 20000.0);
  EXPECT_EQ(RopeOfLayer(*c, 1)->theta, 1000000.0);
  // rope_scaling merged into a keyed full_attention block: the same rule as
  // transformers 4's rope_scaling alone is served.
  c = parse(R"(, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_parameters": {
      "full_attention": {"rope_type": "default"},
      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(RopeOfLayer(*c, 1)->scaling.type, RopeScalingType::kLinear);
  EXPECT_EQ(RopeOfLayer(*c, 1)->scaling.factor, 8.0);
  EXPECT_EQ(RopeOfLayer(*c, 0)->scaling.type, RopeScalingType::kDefault);

  // Where the versions disagree: UNIMPLEMENTED naming the keys.
  struct Refused {
    const char* extra;
    std::vector<const char*> words;
  };
  for (const Refused& r : std::vector<Refused>{
           {R"(, "rope_local_base_freq": 30000.0, "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}})",
            {"rope_parameters.sliding_attention.rope_theta", "rope_local_base_freq"}},
           {R"(, "rope_theta": 1000000.0, "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 500000.0}})",
            {"rope_parameters.full_attention.rope_theta", "rope_theta"}},
           // 5 keeps the block's "default" rule, 4 reads the legacy "type".
           {R"(, "rope_scaling": {"type": "linear", "factor": 8.0})", {"rope_scaling", "\"type\""}},
           // 5 keeps the block's factor-free keys next to rope_scaling's.
           {R"(, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 500000.0}})",
            {"rope_scaling", "full_attention"}},
           {R"(, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_parameters": {
                "sliding_attention": {"rope_type": "default"}})",
            {"rope_scaling", "full_attention"}},
           // A flat block: transformers' Gemma 3 never computes it.
           {R"(, "rope_parameters": {"rope_type": "linear", "factor": 8.0})",
            {"rope_parameters", "keyed by layer type"}},
       }) {
    SCOPED_TRACE(r.extra);
    c = parse(r.extra);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented) << c.status();
    for (const char* w : r.words) EXPECT_THAT(c.status().message(), HasSubstr(w));
  }
}

TEST(ParseModelConfigTest, FamiliesTakeTheirTransformersDefaults) {
  auto parse = [](absl::string_view model_type, absl::string_view extra) {
    return ParseModelConfig(
        absl::StrCat(R"({"model_type": ")", model_type, R"(", "hidden_size": 512,
            "num_attention_heads": 4, "vocab_size": 8, "num_hidden_layers": 6,
            "max_position_embeddings": 64)",
                     absl::StrContains(extra, "num_key_value_heads") ? ""
                                                                    : R"(, "num_key_value_heads": 4)",
                     extra, "}"),
        "config.json");
  };
  // Mistral: sliding_window 4096 when absent, none when null, on every layer.
  absl::StatusOr<ModelConfig> c = parse("mistral", R"(, "num_key_value_heads": 2)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layers[5].window, 4096);
  c = parse("mistral", R"(, "num_key_value_heads": 2, "sliding_window": null)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layers[0].window, 0);
  // Gemma 2: head_dim 256, scale 256^-0.5, soft-cap 50, window on even layers.
  c = parse("gemma2", R"(, "num_key_value_heads": 2)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 256);
  EXPECT_DOUBLE_EQ(c->scale, 1.0 / 16.0);
  EXPECT_EQ(c->softcap, 50.0);
  EXPECT_EQ(c->layers[0].window, 4096);
  EXPECT_EQ(c->layers[1].window, 0);
  EXPECT_DOUBLE_EQ(c->embed_scale, std::sqrt(512.0));
  c = parse("gemma2", R"(, "num_key_value_heads": 2, "attn_logit_softcapping": null)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->softcap, 0.0);
  // Gemma 3: every 6th layer global; sliding ones rotate with the local base.
  c = parse("gemma3_text", R"(, "num_key_value_heads": 1, "rope_scaling": {"rope_type": "linear",
      "factor": 8.0}, "rope_theta": 1000000.0)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->qk_norm, QkNorm::kRmsOnePlus);
  EXPECT_EQ(c->layers[4].window, 4096);
  EXPECT_EQ(c->layers[5].window, 0);
  EXPECT_EQ(RopeOfLayer(*c, 0)->theta, 10000.0);
  EXPECT_EQ(RopeOfLayer(*c, 0)->scaling.type, RopeScalingType::kDefault);
  EXPECT_EQ(RopeOfLayer(*c, 5)->theta, 1000000.0);
  EXPECT_EQ(RopeOfLayer(*c, 5)->scaling.type, RopeScalingType::kLinear);
  // Gemma 3 with rope_parameters keyed by layer type (newer transformers).
  c = parse("gemma3_text", R"(, "num_key_value_heads": 1, "rope_parameters": {
      "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
      "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(RopeOfLayer(*c, 0)->theta, 20000.0);
  EXPECT_EQ(RopeOfLayer(*c, 5)->scaling.factor, 4.0);
  // Qwen2: window only with use_sliding_window, from max_window_layers on.
  c = parse("qwen2", R"(, "sliding_window": 32, "max_window_layers": 2)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layers[3].window, 0);
  EXPECT_TRUE(c->attention_bias);
  c = parse("qwen2", R"(, "use_sliding_window": true, "sliding_window": 32, "max_window_layers": 2)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layers[1].window, 0);
  EXPECT_EQ(c->layers[2].window, 32);
  // An explicit layer_types list wins.
  c = parse("qwen3", R"(, "use_sliding_window": true, "sliding_window": 32, "layer_types":
      ["sliding_attention", "full_attention", "full_attention", "full_attention",
       "full_attention", "sliding_attention"])");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->qk_norm, QkNorm::kRms);
  EXPECT_EQ(c->layers[0].window, 32);
  EXPECT_EQ(c->layers[1].window, 0);
  EXPECT_EQ(c->layers[5].window, 32);
  // GPT-NeoX: rotary_pct 0.25 by default, no GQA key read.
  c = parse("gpt_neox", R"(, "num_key_value_heads": 2)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_kv_heads, 4);
  EXPECT_EQ(c->rope->rotary_dim, 32);
  EXPECT_TRUE(c->attention_bias);
  // GPT-J: rotary_dim 64 by default, interleaved.
  c = parse("gptj", "");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope->rotary_dim, 64);
  EXPECT_EQ(c->rope->layout, RopeLayout::kInterleaved);
  // Llama ignores keys its transformers code never reads.
  c = parse("llama", R"(, "position_embedding_type": "absolute", "sliding_window": 8)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->positions, PositionKind::kRope);
  EXPECT_EQ(c->layers[0].window, 0);
}

// The MoE variants, Mistral / Phi-3 and GPT-J as their own transformers
// config and attention classes resolve them (an external review found each
// one served with the dense family's rule or a key transformers never reads).
TEST(ParseModelConfigTest, VariantsFollowTheirOwnTransformersClasses) {
  auto parse = [](absl::string_view model_type, absl::string_view extra) {
    return ParseModelConfig(
        absl::StrCat(R"({"model_type": ")", model_type, R"(", "hidden_size": 64,
            "num_attention_heads": 16, "vocab_size": 8, "num_hidden_layers": 4,
            "max_position_embeddings": 64)",
                     extra, "}"),
        "config.json");
  };
  // Qwen2-MoE: 16 kv heads by default, qkv_bias (default true), sliding on
  // the even layers below max_window_layers.
  absl::StatusOr<ModelConfig> c = parse("qwen2_moe", "");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_kv_heads, 16);
  EXPECT_TRUE(c->attention_bias);
  c = parse("qwen2_moe", R"(, "qkv_bias": false, "use_sliding_window": true,
      "sliding_window": 3, "max_window_layers": 3)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->layers[0].window, 3);
  EXPECT_EQ(c->layers[1].window, 0);
  EXPECT_EQ(c->layers[2].window, 3);
  EXPECT_EQ(c->layers[3].window, 0);  // not below max_window_layers
  // Qwen2 (dense) keeps its own rule: from max_window_layers on.
  c = parse("qwen2", R"(, "num_key_value_heads": 4, "use_sliding_window": true,
      "sliding_window": 3, "max_window_layers": 3)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layers[0].window, 0);
  EXPECT_EQ(c->layers[3].window, 3);
  // Qwen3-MoE: 4 kv heads, head_dim hidden / heads, the window on every
  // layer when use_sliding_window.
  c = parse("qwen3_moe", R"(, "use_sliding_window": true, "sliding_window": 3)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_kv_heads, 4);
  EXPECT_EQ(c->head_dim, 4);
  for (const LayerAttention& l : c->layers) EXPECT_EQ(l.window, 3);
  c = parse("qwen3_moe", R"(, "sliding_window": 3)");
  ASSERT_TRUE(c.ok()) << c.status();
  for (const LayerAttention& l : c->layers) EXPECT_EQ(l.window, 0);
  // Gemma 2: 4 kv heads by default.
  c = parse("gemma2", "");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_kv_heads, 4);
  // Families whose code does not read layer_types: a list that agrees is
  // fine, one that asks for other layers is refused naming the entry.
  c = parse("mistral", R"(, "sliding_window": 3, "layer_types": ["sliding_attention",
      "sliding_attention", "sliding_attention", "sliding_attention"])");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layers[1].window, 3);
  ExpectConfigError(
      absl::StrCat(R"({"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 16,
          "vocab_size": 8, "num_hidden_layers": 2, "max_position_embeddings": 64,
          "sliding_window": 3, "layer_types": ["full_attention", "sliding_attention"]})"),
      absl::StatusCode::kUnimplemented, {"layer_types[0]", "full_attention", "sliding_window 3"});
  ExpectConfigError(
      R"({"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 16,
          "vocab_size": 8, "num_hidden_layers": 2, "max_position_embeddings": 64,
          "sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"]})",
      absl::StatusCode::kUnimplemented, {"layer_types[1]", "phi3"});
  // Phi3Config raises on a rule other than default and longrope ("su" and
  // "yarn" it rewrites to longrope).
  for (const char* rule : {"linear", "dynamic"}) {
    ExpectConfigError(
        absl::StrCat(R"({"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 16,
          "vocab_size": 8, "num_hidden_layers": 2, "max_position_embeddings": 64,
          "original_max_position_embeddings": 32,
          "rope_scaling": {"rope_type": ")", rule, R"(", "factor": 2.0}})"),
        absl::StatusCode::kInvalidArgument, {"rope_scaling", rule, "Phi3Config"});
  }
  ExpectConfigError(
      R"({"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 16,
          "vocab_size": 8, "num_hidden_layers": 2, "max_position_embeddings": 64,
          "use_sliding_window": true, "sliding_window": 3,
          "layer_types": ["sliding_attention", "full_attention"]})",
      absl::StatusCode::kUnimplemented, {"layer_types[1]", "qwen3_moe"});
  // Without a window a "sliding" layer is a full one, in transformers too.
  c = parse("qwen3_moe", R"(, "layer_types": ["sliding_attention", "full_attention",
      "full_attention", "full_attention"])");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layers[0].window, 0);
  // GPT-J: base 10000 and no scaling, whatever the config says.
  c = parse("gptj", R"(, "rope_theta": 10000, "rotary_dim": 4)");
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectConfigError(
      R"({"model_type": "gptj", "n_embd": 64, "n_head": 4, "vocab_size": 8, "n_layer": 1,
          "n_positions": 64, "rotary_dim": 16, "rope_theta": 100})",
      absl::StatusCode::kUnimplemented, {"rope_theta", "10000"});
  ExpectConfigError(
      R"({"model_type": "gptj", "n_embd": 64, "n_head": 4, "vocab_size": 8, "n_layer": 1,
          "n_positions": 64, "rotary_dim": 16, "rope_scaling": {"rope_type": "linear", "factor": 4}})",
      absl::StatusCode::kUnimplemented, {"rope_scaling", "GPT-J"});
}

TEST(ParseModelConfigTest, WhatCannotBeComputedExactlyIsRefusedByKey) {
  using C = absl::StatusCode;
  const std::string base = R"("hidden_size": 64, "num_attention_heads": 4, "vocab_size": 8,
      "num_hidden_layers": 2, "max_position_embeddings": 64, "num_key_value_heads": 4)";
  ExpectConfigError(absl::StrCat("{", base, "}"), C::kUnimplemented,
                    {"model_type is missing", "llama", "gemma3_text"});
  ExpectConfigError(absl::StrCat(R"({"model_type": "olmo2", )", base, "}"), C::kUnimplemented,
                    {"model_type", "olmo2", "phi3"});
  ExpectConfigError(absl::StrCat(R"({"model_type": "llama", "quantization_config": {"bits": 4}, )",
                                 base, "}"),
                    C::kUnimplemented, {"quantization_config"});
  ExpectConfigError(absl::StrCat(R"({"model_type": "qwen3", "layer_types": ["full_attention",
      "chunked_attention"], )", base, "}"),
                    C::kUnimplemented, {"layer_types[1]", "chunked_attention"});
  ExpectConfigError(absl::StrCat(R"({"model_type": "qwen3", "layer_types": ["full_attention"], )",
                                 base, "}"),
                    C::kInvalidArgument, {"layer_types"});
  ExpectConfigError(absl::StrCat(R"({"model_type": "gemma3_text", "use_bidirectional_attention": true, )",
                                 base, "}"),
                    C::kUnimplemented, {"use_bidirectional_attention"});
  ExpectConfigError(absl::StrCat(R"({"model_type": "bert", "is_decoder": true, )", base, "}"),
                    C::kUnimplemented, {"is_decoder"});
  ExpectConfigError(absl::StrCat(R"({"model_type": "gemma2", "query_pre_attn_scalar": 0, )", base,
                                 "}"),
                    C::kInvalidArgument, {"query_pre_attn_scalar"});
  ExpectConfigError(R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
      "vocab_size": 8, "num_hidden_layers": 100000, "max_position_embeddings": 64})",
                    C::kInvalidArgument, {"num_hidden_layers", "100000"});
}

void ExpectConfigError(absl::string_view config, absl::StatusCode code,
                       std::vector<std::string> substrings) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(config, "config.json");
  ASSERT_FALSE(c.ok()) << config;
  EXPECT_EQ(c.status().code(), code) << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("config.json"));
  for (const std::string& s : substrings) {
    EXPECT_THAT(std::string(c.status().message()), HasSubstr(s));
  }
}

TEST(ParseModelConfigTest, Errors) {
  using C = absl::StatusCode;
  TinyDims odd_hidden, three_kv;
  odd_hidden.hidden = 30;
  three_kv.kv_heads = 3;
  ExpectConfigError(R"({"hidden_size": 64,)", C::kInvalidArgument, {"invalid JSON"});
  ExpectConfigError("[1, 2]", C::kInvalidArgument, {"object"});
  ExpectConfigError(R"({"hidden_size": 64, "vocab_size": 8, "num_hidden_layers": 1,
                        "max_position_embeddings": 16})",
                    C::kInvalidArgument, {"num_attention_heads", "missing"});
  ExpectConfigError(TinyConfig(odd_hidden), C::kInvalidArgument,
                    {"num_attention_heads", "hidden_size (30)"});
  ExpectConfigError(TinyConfig(three_kv), C::kInvalidArgument, {"num_key_value_heads"});
  ExpectConfigError(R"({"hidden_size": "64", "num_attention_heads": 4})", C::kInvalidArgument,
                    {"hidden_size", "\"64\""});
  ExpectConfigError(TinyConfig({}, R"(, "attention_bias": "yes")"), C::kInvalidArgument,
                    {"attention_bias"});
  ExpectConfigError(TinyConfig({}, R"(, "rope_scaling": {"rope_type": "foo", "factor": 2})"),
                    C::kInvalidArgument, {"rope_scaling.rope_type", "foo"});
  ExpectConfigError(TinyConfig({}, R"(, "rope_scaling": {"factor": 2})"), C::kInvalidArgument,
                    {"rope_scaling.rope_type", "missing"});
  ExpectConfigError(TinyConfig({}, R"(, "rope_scaling": {"rope_type": "llama3"})"),
                    C::kInvalidArgument, {"rope_scaling.factor"});
  // No trained length at either level: transformers 4 fails, 5 takes
  // max_position_embeddings; refused naming the absent key, not "got 0".
  ExpectConfigError(TinyConfig({}, R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8,
      "low_freq_factor": 1, "high_freq_factor": 4})"),
                    C::kUnimplemented,
                    {"rope_scaling.original_max_position_embeddings is absent", "llama3"});
  ExpectConfigError(TinyConfig({}, R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8,
      "original_max_position_embeddings": 32, "high_freq_factor": 4})"),
                    C::kInvalidArgument, {"rope_scaling.low_freq_factor", "required"});
  ExpectConfigError(TinyConfig({}, R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8,
      "original_max_position_embeddings": 32, "low_freq_factor": 1})"),
                    C::kInvalidArgument, {"rope_scaling.high_freq_factor", "required"});
  ExpectConfigError(TinyConfig({}, R"(, "rope_scaling": {"rope_type": "linear", "factor": 0})"),
                    C::kInvalidArgument, {"factor"});
  ExpectConfigError(TinyConfig({}, R"(, "rope_scaling": {"rope_type": "yarn", "factor": 2,
      "original_max_position_embeddings": 32, "beta_slow": -1})"),
                    C::kInvalidArgument, {"beta_slow -1"});
  ExpectConfigError(TinyConfig({}, R"(, "rope_scaling": "linear")"), C::kInvalidArgument,
                    {"rope_scaling"});
  // A base transformers turns into NaN (<= 0) is invalid; one in (0, 1] it
  // computes (RopeValuesTransformersComputesAreUnimplemented).
  ExpectConfigError(TinyConfig({}, R"(, "rope_theta": 0)"), C::kInvalidArgument, {"theta"});
  ExpectConfigError(TinyConfig({}, R"(, "rope_theta": -2)"), C::kInvalidArgument, {"theta"});
  ExpectConfigError(
      R"({"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4,
          "vocab_size": 8, "num_hidden_layers": 1, "max_position_embeddings": 16,
          "rotary_pct": 0.3125})",
      C::kUnimplemented, {"rotary_pct", "odd rotary_dim 5"});
  ExpectConfigError(TinyConfig({}, R"(, "rope_scaling": {"type": "mrope"})"), C::kUnimplemented,
                    {"mrope"});
  ExpectConfigError(
      R"({"model_type": "bert", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 8,
          "num_hidden_layers": 1, "max_position_embeddings": 16,
          "position_embedding_type": "relative_key"})",
      C::kUnimplemented, {"relative_key"});
}

// transformers' rotary embedding knows default, linear, dynamic, yarn,
// longrope and llama3 (ROPE_INIT_FUNCTIONS) and fails on any other name;
// only Phi3Config rewrites "su" (and "yarn") to longrope. A rule this server
// computes for requests alone is refused in a config, naming the key and
// the value, and an unknown rule's message lists only what a config may name.
TEST(ParseModelConfigTest, RopeRulesTransformersLacksAreRefused) {
  using C = absl::StatusCode;
  ExpectConfigError(TinyConfig({}, R"(, "rope_scaling": {"rope_type": "ntk", "factor": 2.0})"),
                    C::kUnimplemented, {"key rope_scaling.rope_type = \"ntk\"", "llama"});
  ExpectConfigError(TinyConfig({}, R"(, "rope_parameters": {"rope_type": "ntk", "factor": 2.0})"),
                    C::kUnimplemented, {"key rope_parameters.rope_type = \"ntk\""});
  ExpectConfigError(TinyConfig({}, R"(, "original_max_position_embeddings": 16,
                        "rope_scaling": {"type": "su", "short_factor": [1, 1, 1, 1],
                        "long_factor": [2, 2, 2, 2]})"),
                    C::kUnimplemented, {"key rope_scaling.type = \"su\"", "llama"});
  ExpectConfigError(
      R"({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 16,
          "rope_scaling": {"rope_type": "su",
          "short_factor": [1, 1, 1, 1, 1, 1, 1, 1], "long_factor": [2, 2, 2, 2, 2, 2, 2, 2]}})",
      C::kUnimplemented, {"key rope_scaling.rope_type = \"su\"", "qwen2"});
  ExpectConfigError(
      R"({"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4,
          "head_dim": 16, "num_hidden_layers": 1, "vocab_size": 16,
          "rope_scaling": {"rope_type": "ntk", "factor": 2.0}})",
      C::kUnimplemented, {"rope_type = \"ntk\""});
  absl::StatusOr<ModelConfig> c = ParseModelConfig(
      TinyConfig({}, R"(, "rope_scaling": {"rope_type": "bogus", "factor": 2.0})"), "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), C::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()),
              AllOf(HasSubstr("rope_scaling.rope_type"), HasSubstr("\"bogus\""),
                    HasSubstr("default, linear, dynamic, yarn, longrope, llama3"),
                    Not(HasSubstr("ntk")), Not(HasSubstr("(or su)"))));
  // rope_type and the legacy type naming different rules: transformers 4's
  // LlamaConfig (and Qwen2's, Qwen3's, GPT-NeoX's, Gemma 3's) copies type
  // over rope_type, 5 keeps rope_type. Refused naming both, in either block.
  ExpectConfigError(
      TinyConfig({},
                 R"(, "rope_scaling": {"rope_type": "linear", "type": "dynamic", "factor": 4})"),
      C::kUnimplemented,
      {"keys rope_scaling.rope_type = \"linear\" and rope_scaling.type = \"dynamic\"", "llama"});
  ExpectConfigError(
      TinyConfig({},
                 R"(, "rope_parameters": {"rope_type": "linear", "type": "dynamic", "factor": 4})"),
      C::kUnimplemented,
      {"keys rope_parameters.rope_type = \"linear\" and rope_parameters.type = \"dynamic\""});
  for (const char* model_type : {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gpt_neox"}) {
    ExpectConfigError(
        absl::StrReplaceAll(TinyConfig({}, R"(, "rope_scaling": {"rope_type": "dynamic",
                                           "type": "linear", "factor": 4})"),
                            {{"\"llama\"", absl::StrCat("\"", model_type, "\"")}}),
        C::kUnimplemented, {"rope_scaling.type = \"linear\"", model_type});
  }
  ExpectConfigError(
      R"({"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4,
          "head_dim": 16, "num_hidden_layers": 1, "vocab_size": 16,
          "rope_scaling": {"rope_type": "linear", "type": "dynamic", "factor": 2.0}})",
      C::kUnimplemented,
      {"rope_scaling.rope_type = \"linear\"", "rope_scaling.type = \"dynamic\""});
  // Equal values, and the families whose transformers 4 reads rope_type
  // first too (Mistral, Mixtral, Gemma, Gemma 2), load rope_type's rule.
  for (const char* model_type : {"llama", "mistral", "mixtral", "gemma", "gemma2"}) {
    const bool same = absl::string_view(model_type) == "llama";
    c = ParseModelConfig(
        absl::StrReplaceAll(
            TinyConfig({},
                       absl::StrCat(
                           R"(, "head_dim": 16, "rope_scaling": {"rope_type": "linear", "type": ")",
                           same ? "linear" : "dynamic", R"(", "factor": 4})")),
            {{"\"llama\"", absl::StrCat("\"", model_type, "\"")}}),
        "config.json");
    ASSERT_TRUE(c.ok()) << model_type << " " << c.status();
    EXPECT_EQ(c->rope->scaling.type, RopeScalingType::kLinear) << model_type;
  }
  // Phi3Config in transformers 4 loads only a block of exactly type,
  // short_factor and long_factor: only 5 reads one with both keys, by
  // rope_type (su and yarn as longrope).
  const std::string phi3 =
      R"({"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4,
          "num_hidden_layers": 1, "vocab_size": 16, "original_max_position_embeddings": 16,
          "max_position_embeddings": 64, "rope_scaling": {%s,
          "short_factor": [1, 1, 1, 1, 1, 1, 1, 1], "long_factor": [2, 2, 2, 2, 2, 2, 2, 2]}})";
  for (const auto& [keys, rule] :
       {std::pair<const char*, RopeScalingType>{R"("type": "su", "rope_type": "default")",
                                                RopeScalingType::kDefault},
        {R"("type": "default", "rope_type": "su")", RopeScalingType::kLongRope},
        {R"("type": "su", "rope_type": "longrope")", RopeScalingType::kLongRope}}) {
    c = ParseModelConfig(absl::StrReplaceAll(phi3, {{"%s", keys}}), "config.json");
    ASSERT_TRUE(c.ok()) << keys << " " << c.status();
    EXPECT_EQ(c->rope->scaling.type, rule) << keys;
  }
  // Every rule transformers has loads by its own name.
  for (const char* block :
       {R"({"rope_type": "default"})", R"({"rope_type": "linear", "factor": 2.0})",
        R"({"rope_type": "dynamic", "factor": 2.0})",
        R"({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64})",
        R"({"rope_type": "longrope", "short_factor": [1, 1, 1, 1], "long_factor": [2, 2, 2, 2],
            "original_max_position_embeddings": 128})",
        R"({"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 64,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0})"}) {
    c = ParseModelConfig(TinyConfig({}, absl::StrCat(R"(, "rope_scaling": )", block)),
                         "config.json");
    EXPECT_TRUE(c.ok()) << block << " " << c.status();
  }
}

// n_embd, n_head, n_layer and n_positions are GPTJConfig's names
// (attribute_map); every other served class ignores them and keeps its
// default for the long name. A short name without its long one is refused,
// naming it; beside its long one it is ignored, as transformers does.
TEST(ParseModelConfigTest, ShortKeyNamesAreReadOnlyForGptJ) {
  using C = absl::StatusCode;
  // LlamaConfig has no n_head: transformers makes 32 heads of 2, not 4 of 16.
  ExpectConfigError(R"({"model_type": "llama", "hidden_size": 64, "n_head": 4,
                        "num_hidden_layers": 1, "vocab_size": 16})",
                    C::kUnimplemented, {"key n_head", "llama", "num_attention_heads"});
  // n_positions would otherwise be yarn's L0 (transformers: 2048).
  ExpectConfigError(R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                        "num_hidden_layers": 1, "vocab_size": 16, "n_positions": 8192,
                        "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})",
                    C::kUnimplemented, {"key n_positions", "max_position_embeddings"});
  for (const char* type : {"gpt_neox", "bert", "qwen2", "gemma", "phi3", "mistral"}) {
    SCOPED_TRACE(type);
    ExpectConfigError(absl::StrFormat(R"({"model_type": "%s", "n_embd": 64,
                          "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 16})",
                                      type),
                      C::kUnimplemented, {"key n_embd", type, "hidden_size"});
    ExpectConfigError(absl::StrFormat(R"({"model_type": "%s", "hidden_size": 64,
                          "num_attention_heads": 4, "n_layer": 1, "vocab_size": 16})",
                                      type),
                      C::kUnimplemented, {"key n_layer", "num_hidden_layers"});
  }
  // Beside the long name a short one is an unread extra attribute.
  absl::StatusOr<ModelConfig> c = ParseModelConfig(
      R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "n_head": 8,
          "num_hidden_layers": 1, "n_layer": 3, "vocab_size": 16, "n_positions": 8192,
          "max_position_embeddings": 64})",
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_heads, 4);
  EXPECT_EQ(c->num_layers, 1);
  EXPECT_EQ(c->max_positions, 64);
  // GPT-J reads them.
  c = ParseModelConfig(R"({"model_type": "gptj", "n_embd": 64, "n_head": 4, "n_layer": 2,
                           "n_positions": 96, "rotary_dim": 4, "vocab_size": 8})",
                       "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->hidden_size, 64);
  EXPECT_EQ(c->num_heads, 4);
  EXPECT_EQ(c->num_layers, 2);
  EXPECT_EQ(c->max_positions, 96);
}

// head_dim: null is hidden / heads only where the family's transformers
// code maps None to it: LlamaConfig and MistralConfig fill it, Mixtral's
// attention reads `getattr(config, "head_dim", None) or ...`. Qwen2,
// Qwen2-MoE, Qwen3-MoE and Phi-3 declare no head_dim: their attention's
// `getattr(config, "head_dim", hidden // heads)` returns the None a null
// sets and fails, so the null is refused there, as where a class defaults it.
TEST(ParseModelConfigTest, HeadDimNullIsHiddenOverHeadsOnlyWhereTransformersMapsIt) {
  const auto cfg = [](const char* type, const char* extra) {
    return absl::StrFormat(R"({"model_type": "%s", "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 16%s})",
                           type, extra);
  };
  for (const char* type : {"llama", "mistral", "mixtral"}) {
    absl::StatusOr<ModelConfig> c = ParseModelConfig(cfg(type, R"(, "head_dim": null)"),
                                                     "config.json");
    ASSERT_TRUE(c.ok()) << type << " " << c.status();
    EXPECT_EQ(c->head_dim, 16) << type;
  }
  for (const char* type : {"qwen2", "qwen2_moe", "qwen3_moe", "phi3"}) {
    SCOPED_TRACE(type);
    ExpectConfigError(cfg(type, R"(, "head_dim": null)"), absl::StatusCode::kInvalidArgument,
                      {"key head_dim", "null", "hidden_size / num_attention_heads"});
    absl::StatusOr<ModelConfig> c = ParseModelConfig(cfg(type, ""), "config.json");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->head_dim, 16);
  }
}

// null is None in transformers: where a key's default is not None (and
// nothing maps None back) transformers fails, so null is refused naming the
// key; where None has a meaning it keeps it.
TEST(ParseModelConfigTest, NullIsRefusedWhereTransformersHasNoNoneMeaning) {
  using C = absl::StatusCode;
  const auto cfg = [](const char* type, const char* extra) {
    return absl::StrFormat(R"({"model_type": "%s", "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 16%s})",
                           type, extra);
  };
  ExpectConfigError(cfg("gemma", R"(, "head_dim": null)"), C::kInvalidArgument,
                    {"key head_dim", "null", "256"});
  ExpectConfigError(R"({"model_type": "gemma", "hidden_size": 64, "num_attention_heads": 4,
        "head_dim": 16, "num_key_value_heads": null, "num_hidden_layers": 1, "vocab_size": 16})",
                    C::kInvalidArgument, {"key num_key_value_heads", "null"});
  ExpectConfigError(cfg("qwen3", R"(, "head_dim": null)"), C::kInvalidArgument,
                    {"key head_dim", "null", "128"});
  ExpectConfigError(cfg("qwen3", R"(, "head_dim": 16, "rms_norm_eps": null)"),
                    C::kInvalidArgument, {"key rms_norm_eps", "null"});
  ExpectConfigError(cfg("llama", R"(, "rope_theta": null)"), C::kInvalidArgument,
                    {"key rope_theta", "null"});
  ExpectConfigError(cfg("llama", R"(, "rope_parameters": {"rope_type": "default",
                        "rope_theta": null})"),
                    C::kInvalidArgument, {"rope_parameters.rope_theta", "null"});
  ExpectConfigError(cfg("gemma2", R"(, "head_dim": 16, "query_pre_attn_scalar": null)"),
                    C::kInvalidArgument, {"key query_pre_attn_scalar", "null"});
  ExpectConfigError(cfg("gemma3_text", R"(, "head_dim": 16, "rope_local_base_freq": null)"),
                    C::kInvalidArgument, {"key rope_local_base_freq", "null"});
  // Keys that were read with the class default before (every typed read
  // now refuses null unless the family's transformers code gives None a
  // meaning).
  const std::string bert = R"("model_type": "bert", "hidden_size": 32, "num_attention_heads": 4,
      "num_hidden_layers": 1, "vocab_size": 10, "max_position_embeddings": 64)";
  ExpectConfigError(absl::StrCat("{", bert, R"(, "layer_norm_eps": null})"), C::kInvalidArgument,
                    {"key layer_norm_eps", "null"});
  ExpectConfigError(absl::StrCat("{", bert, R"(, "type_vocab_size": null})"),
                    C::kInvalidArgument, {"key type_vocab_size", "null"});
  ExpectConfigError(cfg("gemma3_text", R"(, "head_dim": 16, "sliding_window_pattern": null)"),
                    C::kInvalidArgument, {"key sliding_window_pattern", "null"});
  ExpectConfigError(cfg("qwen2", R"(, "use_sliding_window": true, "sliding_window": 4,
                        "max_window_layers": null)"),
                    C::kInvalidArgument, {"key max_window_layers", "null"});
  ExpectConfigError(cfg("phi3", R"(, "partial_rotary_factor": null)"), C::kInvalidArgument,
                    {"key partial_rotary_factor", "null"});
  ExpectConfigError(cfg("phi3", R"(, "max_position_embeddings": 8192,
                        "original_max_position_embeddings": null, "rope_scaling": {
                        "type": "longrope", "short_factor": [1, 1, 1, 1, 1, 1, 1, 1],
                        "long_factor": [2, 2, 2, 2, 2, 2, 2, 2]})"),
                    C::kInvalidArgument, {"key original_max_position_embeddings", "null"});
  ExpectConfigError(cfg("llama", R"(, "partial_rotary_factor": null)"), C::kInvalidArgument,
                    {"key partial_rotary_factor", "null"});
  ExpectConfigError(R"({"model_type": null, "hidden_size": 64, "num_attention_heads": 4,
                        "num_hidden_layers": 1, "vocab_size": 16})",
                    C::kInvalidArgument, {"key model_type", "null"});
  ExpectConfigError(cfg("llama", R"(, "max_position_embeddings": null)"), C::kInvalidArgument,
                    {"key max_position_embeddings"});
  // A null long name is not skipped for its short alias (GPT-J maps one onto
  // the other, so the null would win in transformers).
  ExpectConfigError(R"({"model_type": "gptj", "hidden_size": null, "n_embd": 64, "n_head": 4,
                        "n_layer": 1, "vocab_size": 8, "rotary_dim": 4})",
                    C::kInvalidArgument, {"key hidden_size", "null"});
  ExpectConfigError(cfg("llama", R"(, "rope_scaling": {"rope_type": "linear", "factor": null})"),
                    C::kInvalidArgument, {"rope_scaling.factor", "null"});
  ExpectConfigError(cfg("llama", R"(, "rope_scaling": {"rope_type": null, "factor": 2.0})"),
                    C::kInvalidArgument, {"rope_scaling.rope_type", "null"});
  ExpectConfigError(cfg("llama", R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                        "original_max_position_embeddings": 32, "low_freq_factor": null,
                        "high_freq_factor": 4.0})"),
                    C::kInvalidArgument, {"rope_scaling.low_freq_factor", "null"});
  ExpectConfigError(cfg("llama", R"(, "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                        "original_max_position_embeddings": null})"),
                    C::kInvalidArgument, {"rope_scaling.original_max_position_embeddings", "null"});
  ExpectConfigError(cfg("phi3", R"(, "rope_scaling": {"type": "longrope", "short_factor": null,
                        "long_factor": [2, 2, 2, 2, 2, 2, 2, 2]})"),
                    C::kInvalidArgument, {"rope_scaling.short_factor", "null"});
  ExpectConfigError(cfg("gemma3_text", R"(, "head_dim": 16,
                        "rope_parameters": {"full_attention": null})"),
                    C::kInvalidArgument, {"rope_parameters.full_attention", "null"});
  // A null key that the family's transformers code never reads loads: a
  // top-level original_max_position_embeddings without yarn, llama3 or
  // longrope; Gemma 3's sliding_window_pattern beside a layer_types list.
  for (const std::string& never_read :
       {cfg("llama", R"(, "rope_scaling": null, "original_max_position_embeddings": null)"),
        cfg("phi3", R"(, "original_max_position_embeddings": null)"),
        cfg("gemma3_text", R"(, "head_dim": 16, "sliding_window_pattern": null,
            "layer_types": ["sliding_attention"])")}) {
    absl::StatusOr<ModelConfig> loaded = ParseModelConfig(never_read, "config.json");
    EXPECT_TRUE(loaded.ok()) << never_read << " " << loaded.status();
  }
  // None has a meaning: kept.
  absl::StatusOr<ModelConfig> c = ParseModelConfig(
      R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": null, "head_dim": null, "num_hidden_layers": 1,
          "vocab_size": 16})",
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_kv_heads, 4);
  EXPECT_EQ(c->head_dim, 16);
  for (const char* type : {"qwen2", "mistral"}) {
    c = ParseModelConfig(absl::StrFormat(R"({"model_type": "%s", "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": null, "sliding_window": null,
            "num_hidden_layers": 1, "vocab_size": 16, "max_position_embeddings": 64})",
                                         type),
                         "config.json");
    ASSERT_TRUE(c.ok()) << type << " " << c.status();
    EXPECT_EQ(c->num_kv_heads, 4) << type;
  }
  c = ParseModelConfig(cfg("gemma2", R"(, "head_dim": 16, "attn_logit_softcapping": null)"),
                       "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  // A null flag is falsy where transformers tests it: no bias
  // (nn.Linear(bias=None)) even where the default is true, no truncation,
  // no window.
  c = ParseModelConfig(R"({"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4,
                           "num_hidden_layers": 1, "vocab_size": 16, "attention_bias": null})",
                       "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->attention_bias);
  c = ParseModelConfig(cfg("qwen2_moe", R"(, "qkv_bias": null)"), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->attention_bias);
  c = ParseModelConfig(cfg("llama", R"(, "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                           "truncate": null, "beta_fast": null, "attention_factor": null})"),
                       "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->rope->scaling.truncate);
  EXPECT_EQ(c->rope->scaling.beta_fast, RopeScaling{}.beta_fast);
  EXPECT_FALSE(c->rope->scaling.attention_factor.has_value());
  // max_window_layers is never compared without a window.
  c = ParseModelConfig(cfg("qwen2", R"(, "use_sliding_window": null, "max_window_layers": null)"),
                       "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layers[0].window, 0);
  // GPT-J never reads partial_rotary_factor: null there is ignored.
  c = ParseModelConfig(R"({"model_type": "gptj", "n_embd": 64, "n_head": 4, "n_layer": 1,
                           "n_positions": 32, "rotary_dim": 4, "vocab_size": 8,
                           "partial_rotary_factor": null})",
                       "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  // GPT-J never reads rope_theta: null there is ignored.
  c = ParseModelConfig(R"({"model_type": "gptj", "n_embd": 64, "n_head": 4, "n_layer": 1,
                           "n_positions": 32, "rotary_dim": 4, "vocab_size": 8,
                           "rope_theta": null})",
                       "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
}

// Configs transformers itself fails on, or values past what a request's
// spec may give (sessions carry the model's scale and softcap through the
// same checks): refused at load, naming the key.
TEST(ParseModelConfigTest, SlidingLayersWithoutAWindowAndOutOfRangeScalesAreRefused) {
  using C = absl::StatusCode;
  const std::string base = R"("hidden_size": 64, "num_attention_heads": 4, "vocab_size": 8,
      "num_hidden_layers": 2, "max_position_embeddings": 64, "num_key_value_heads": 4)";
  // transformers' create_sliding_window_causal_mask raises without a window.
  ExpectConfigError(absl::StrCat(R"({"model_type": "qwen2", "use_sliding_window": false,
      "layer_types": ["full_attention", "sliding_attention"], )", base, "}"),
                    C::kInvalidArgument, {"sliding_window", "layer 1"});
  ExpectConfigError(absl::StrCat(R"({"model_type": "gemma2", "sliding_window": null, )", base, "}"),
                    C::kInvalidArgument, {"sliding_window", "gemma2"});
  ExpectConfigError(
      absl::StrCat(R"({"model_type": "gemma3_text", "sliding_window": null, )", base, "}"),
      C::kInvalidArgument, {"sliding_window", "gemma3_text"});
  // Mistral runs a null window as full attention, as before.
  EXPECT_TRUE(ParseModelConfig(absl::StrCat(R"({"model_type": "mistral", "sliding_window": null, )",
                                            base, "}"),
                               "config.json")
                  .ok());
  ExpectConfigError(absl::StrCat(R"({"model_type": "gemma2", "query_pre_attn_scalar": 1e-12, )",
                                 base, "}"),
                    C::kInvalidArgument, {"query_pre_attn_scalar", "1e-12"});
  ExpectConfigError(absl::StrCat(R"({"model_type": "gemma2", "attn_logit_softcapping": 1e7, )",
                                 base, "}"),
                    C::kInvalidArgument, {"attn_logit_softcapping", "1e+07"});
  ExpectConfigError(absl::StrCat(R"({"model_type": "gemma2", "attn_logit_softcapping": 1e-300, )",
                                 base, "}"),
                    C::kInvalidArgument, {"attn_logit_softcapping", "1e-300"});
  // The scale is transformers' x**-0.5 (pow), not 1/sqrt(x): they differ in
  // fp64's last bit for 96.
  absl::StatusOr<ModelConfig> c = ParseModelConfig(
      absl::StrCat(R"({"model_type": "gemma2", "query_pre_attn_scalar": 96, )", base, "}"),
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->scale, std::pow(96.0, -0.5));
}

// A value nested 100,000 deep where a number or object belongs is named in a
// short message (the message once dumped it recursively and overflowed the
// stack).
TEST(ParseModelConfigTest, DeeplyNestedValuesAreNamedBriefly) {
  const std::string deep = std::string(60, '[') + std::string(60, ']');
  ExpectConfigError(TinyConfig({}, absl::StrCat(R"(, "rope_scaling": )", deep)),
                    absl::StatusCode::kInvalidArgument, {"rope_scaling", "[[[[[...]]]]]"});
  ExpectConfigError(TinyConfig({}, absl::StrCat(R"(, "rope_theta": )", deep)),
                    absl::StatusCode::kInvalidArgument, {"rope_theta"});
}

// The parser builds every level before it can fail: 30 million '[' took
// 2.2 GB. Past 64 levels the file is refused before parsing; brackets in
// strings do not count.
TEST(ParseModelConfigTest, NestingPast64LevelsIsRefusedBeforeParsing) {
  const std::string deep = std::string(10000000, '[') + std::string(10000000, ']');
  ExpectConfigError(TinyConfig({}, absl::StrCat(R"(, "rope_scaling": )", deep)),
                    absl::StatusCode::kInvalidArgument, {"nest deeper than 64 levels"});
  const std::string at_limit = std::string(63, '[') + std::string(63, ']');
  ExpectConfigError(TinyConfig({}, absl::StrCat(R"(, "rope_theta": )", at_limit)),
                    absl::StatusCode::kInvalidArgument, {"rope_theta"});
  const std::string in_string = absl::StrCat("\"", std::string(100, '['), "\\\"", "\"");
  ExpectConfigError(TinyConfig({}, absl::StrCat(R"(, "rope_theta": )", in_string)),
                    absl::StatusCode::kInvalidArgument, {"rope_theta", "a number"});
}

// ============================ safetensors ===================================

TEST(ModelLoadTest, LlamaCheckpointIsCopiedAndItsFileReleased) {
  TempDir dir;
  const std::vector<SafetensorsTensor> tensors = TinyTensors();
  WriteCheckpoint(dir, tensors);
  absl::StatusOr<std::shared_ptr<const Model>> m = Model::Load("tiny", dir.path());
  ASSERT_TRUE(m.ok()) << m.status();
  const Model& model = **m;
  EXPECT_EQ(model.name(), "tiny");
  EXPECT_EQ(model.source(), dir.path());
  EXPECT_EQ(model.config().head_dim, 8);
  EXPECT_EQ(model.config().num_kv_heads, 2);
  ASSERT_EQ(model.num_layers(), 2);

  const std::string file = dir.File("model.safetensors");
  int64_t f16_elements = 0, copied_bytes = 0;
  for (const SafetensorsTensor& t : tensors) {
    SCOPED_TRACE(t.name);
    ConstTensorView view;
    if (t.name == "model.embed_tokens.weight") {
      view = model.embed_tokens();
    } else {
      const int layer = t.name[13] - '0';
      absl::StatusOr<const LayerWeights*> lw = model.layer(layer);
      ASSERT_TRUE(lw.ok());
      if (absl::StrContains(t.name, "q_proj")) view = (*lw)->q_proj;
      if (absl::StrContains(t.name, "k_proj")) view = (*lw)->k_proj;
      if (absl::StrContains(t.name, "v_proj")) view = (*lw)->v_proj;
      if (absl::StrContains(t.name, "o_proj")) view = (*lw)->o_proj;
    }
    EXPECT_THAT(view.dims(), ElementsAreArray(t.shape));
    if (t.dtype == "F16") {
      // Converted once to an owned f32 tensor, exactly.
      EXPECT_EQ(view.dtype(), DType::kF32);
      EXPECT_THAT(MappingPathOf(view.raw()), Not(EndsWith("model.safetensors")));
      const float* got = view.data<float>();
      for (int64_t k = 0; k < view.num_elements(); ++k) {
        const float want = F16Samples()[k % F16Samples().size()].second;
        ASSERT_EQ(got[k], want) << "element " << k;
        ASSERT_EQ(std::signbit(got[k]), std::signbit(want)) << "element " << k;
      }
      f16_elements += view.num_elements();
    } else {
      EXPECT_EQ(view.dtype(), t.dtype == "F32" ? DType::kF32 : DType::kBF16);
      EXPECT_THAT(MappingPathOf(view.raw()), Not(EndsWith("model.safetensors")));  // a copy
      EXPECT_TRUE(SameBytes(view, t.bytes));
      copied_bytes += static_cast<int64_t>(t.bytes.size());
    }
  }
  EXPECT_GT(f16_elements, 0);
  EXPECT_EQ(model.resident_bytes(), copied_bytes + f16_elements * 4);
  const LayerWeights* l0 = *model.layer(0);
  EXPECT_TRUE(l0->q_bias.empty_view());
  EXPECT_TRUE(l0->o_bias.empty_view());
  EXPECT_TRUE(model.position_table().empty_view());

  EXPECT_EQ(model.layer(2).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(model.layer(-1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(model.layer(2).status().message(), HasSubstr("layer 2"));

  // The file is mapped only while loading.
  EXPECT_EQ(CountMappingsOf(file), 0);
}

// A served model no longer reads its files: truncating one (which, served
// from the mapping, would kill the process with SIGBUS on the next access)
// or rewriting it in place (which would change the weights behind the
// load-time checks) changes nothing.
TEST(ModelLoadTest, FilesTruncatedOrRewrittenAfterLoadChangeNothing) {
  for (const bool truncate : {true, false}) {
    SCOPED_TRACE(truncate ? "truncated" : "rewritten with NaN");
    TempDir dir;
    const std::vector<SafetensorsTensor> tensors = TinyTensors();
    WriteCheckpoint(dir, tensors);
    absl::StatusOr<std::shared_ptr<const Model>> m = Model::Load("tiny", dir.path());
    ASSERT_TRUE(m.ok()) << m.status();
    const std::string file = dir.File("model.safetensors");
    std::string bytes = SafetensorsBytes(tensors);  // what WriteCheckpoint wrote
    if (truncate) {
      ASSERT_EQ(::truncate(file.c_str(), 16), 0);
    } else {
      // Same length, every data byte 0xff (a NaN in F32, BF16 and F16).
      uint64_t header = 0;  // the header length, little-endian
      std::memcpy(&header, bytes.data(), sizeof(header));
      std::fill(bytes.begin() + 8 + static_cast<std::ptrdiff_t>(header), bytes.end(), '\xff');
      std::ofstream(file, std::ios::binary | std::ios::in | std::ios::out).write(bytes.data(),
                                                                                 bytes.size());
    }
    const LayerWeights* l0 = (*m)->layer(0).value();
    const LayerWeights* l1 = (*m)->layer(1).value();
    EXPECT_TRUE(SameBytes((*m)->embed_tokens(), Find(tensors, "model.embed_tokens.weight")->bytes));
    EXPECT_TRUE(SameBytes(l0->q_proj, Find(tensors, "model.layers.0.self_attn.q_proj.weight")->bytes));
    EXPECT_TRUE(SameBytes(l0->v_proj, Find(tensors, "model.layers.0.self_attn.v_proj.weight")->bytes));  // BF16
    EXPECT_TRUE(SameBytes(l1->v_proj, Find(tensors, "model.layers.1.self_attn.v_proj.weight")->bytes));
    EXPECT_TRUE(CheckFinite(l1->o_proj, "o").ok());  // F16, converted at load
  }
}

TEST(ModelLoadTest, MisalignedDataIsCopiedNotMisread) {
  TempDir dir;
  const std::vector<SafetensorsTensor> tensors = TinyTensors();
  SafetensorsLayout layout;
  layout.extra_header_spaces = 1;  // data starts at an odd offset
  WriteCheckpoint(dir, tensors, TinyConfig(), layout);
  absl::StatusOr<std::shared_ptr<const Model>> m = Model::Load("tiny", dir.path());
  ASSERT_TRUE(m.ok()) << m.status();
  const ConstTensorView q = (*m)->layer(0).value()->q_proj;
  EXPECT_EQ(reinterpret_cast<uintptr_t>(q.raw()) % 4, 0u);
  EXPECT_TRUE(SameBytes(q, tensors[1].bytes));
  EXPECT_TRUE(SameBytes((*m)->layer(0).value()->v_proj, tensors[3].bytes));  // bf16
  EXPECT_GT((*m)->resident_bytes(), 0);
}

TEST(ModelLoadTest, BiasesAreLoadedWhenConfigured) {
  TempDir dir;
  TinyDims d;
  std::vector<SafetensorsTensor> tensors = TinyTensors(d);
  for (int64_t i = 0; i < d.layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".self_attn.");
    tensors.push_back(F32Tensor(p + "q_proj.bias", {d.heads * d.head_dim}, 100 + i));
    tensors.push_back(F32Tensor(p + "k_proj.bias", {d.kv_heads * d.head_dim}, 110 + i));
    tensors.push_back(F32Tensor(p + "v_proj.bias", {d.kv_heads * d.head_dim}, 120 + i));
  }
  WriteCheckpoint(dir, tensors, TinyConfig(d, R"(, "attention_bias": true)"));
  absl::StatusOr<std::shared_ptr<const Model>> m = Model::Load("tiny", dir.path());
  ASSERT_TRUE(m.ok()) << m.status();
  const LayerWeights* l1 = (*m)->layer(1).value();
  EXPECT_TRUE(SameBytes(l1->q_bias, Find(tensors, "model.layers.1.self_attn.q_proj.bias")->bytes));
  EXPECT_TRUE(SameBytes(l1->v_bias, Find(tensors, "model.layers.1.self_attn.v_proj.bias")->bytes));
  EXPECT_TRUE(l1->o_bias.empty_view());

  // Announced but absent: the load fails and names the bias.
  tensors.erase(tensors.end() - 1);
  WriteCheckpoint(dir, tensors, TinyConfig(d, R"(, "attention_bias": true)"));
  absl::Status st = LoadStatus(dir);
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(st.message(), HasSubstr("model.layers.1.self_attn.v_proj.bias"));
}

TEST(ModelLoadTest, BertLearnedPositionsAndEmbeddingNorm) {
  TempDir dir;
  TinyDims d;
  d.kv_heads = d.heads;
  const std::string config = absl::StrFormat(
      R"({"model_type": "bert", "hidden_size": %d, "num_attention_heads": %d, "vocab_size": %d,
          "num_hidden_layers": 1, "max_position_embeddings": %d})",
      d.hidden, d.heads, d.vocab, d.max_positions);
  std::vector<SafetensorsTensor> tensors = {
      F32Tensor("embeddings.word_embeddings.weight", {d.vocab, d.hidden}, 1),
      F32Tensor("embeddings.position_embeddings.weight", {d.max_positions, d.hidden}, 2),
      F32Tensor("embeddings.token_type_embeddings.weight", {2, d.hidden}, 3),
      F32Tensor("embeddings.LayerNorm.gamma", {d.hidden}, 4),  // the older spelling
      F32Tensor("embeddings.LayerNorm.beta", {d.hidden}, 5)};
  int seed = 10;
  for (const char* proj : {"self.query", "self.key", "self.value", "output.dense"}) {
    const std::string p = absl::StrCat("encoder.layer.0.attention.", proj);
    tensors.push_back(F32Tensor(p + ".weight", {d.hidden, d.hidden}, ++seed));
    tensors.push_back(F32Tensor(p + ".bias", {d.hidden}, ++seed));
  }
  WriteCheckpoint(dir, tensors, config);
  absl::StatusOr<std::shared_ptr<const Model>> m = Model::Load("tiny", dir.path());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->config().positions, PositionKind::kLearned);
  EXPECT_FALSE((*m)->config().causal);
  EXPECT_TRUE(SameBytes((*m)->position_table(), tensors[1].bytes));
  EXPECT_TRUE(SameBytes((*m)->embed_norm_weight(), tensors[3].bytes));
  const LayerWeights* l0 = (*m)->layer(0).value();
  EXPECT_TRUE(SameBytes(l0->k_bias, Find(tensors, "encoder.layer.0.attention.self.key.bias")->bytes));
  EXPECT_TRUE(
      SameBytes(l0->o_bias, Find(tensors, "encoder.layer.0.attention.output.dense.bias")->bytes));

  tensors.erase(tensors.begin() + 1);
  WriteCheckpoint(dir, tensors, config);
  absl::Status st = LoadStatus(dir);
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(st.message(), HasSubstr("embeddings.position_embeddings.weight"));
}

TEST(ModelLoadTest, ABiasTheFamilyDoesNotHaveIsRefused) {
  // Mistral's projections have no bias parameter: transformers would ignore
  // one in the file; the server refuses rather than add it.
  TempDir dir;
  TinyDims d;
  std::vector<SafetensorsTensor> tensors = TinyTensors(d);
  tensors.push_back(F32Tensor("model.layers.1.self_attn.k_proj.bias", {d.kv_heads * d.head_dim}, 9));
  WriteCheckpoint(dir, tensors,
                  absl::StrReplaceAll(TinyConfig(d), {{"\"llama\"", "\"mistral\""}}));
  absl::Status st = LoadStatus(dir);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented) << st;
  EXPECT_THAT(st.message(),
              AllOf(HasSubstr("model.layers.1.self_attn.k_proj.bias"), HasSubstr("a mistral layer"),
                    HasSubstr("its biases do not depend on config.json"),
                    Not(HasSubstr("attention_bias"))));

  // The message names the key the family reads, with its value: Qwen2-MoE's
  // q/k/v biases follow qkv_bias; Qwen2 reads no bias key (q/k/v always, o
  // never); Llama's attention_bias.
  const std::string p = "model.layers.0.self_attn.";
  std::vector<SafetensorsTensor> qkv = TinyTensors(d);
  qkv.push_back(F32Tensor(p + "q_proj.bias", {d.heads * d.head_dim}, 20));
  qkv.push_back(F32Tensor(p + "k_proj.bias", {d.kv_heads * d.head_dim}, 21));
  qkv.push_back(F32Tensor(p + "v_proj.bias", {d.kv_heads * d.head_dim}, 22));
  WriteCheckpoint(dir, qkv,
                  absl::StrReplaceAll(TinyConfig(d, R"(, "qkv_bias": false)"),
                                      {{"\"llama\"", "\"qwen2_moe\""}}));
  st = LoadStatus(dir);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented) << st;
  EXPECT_THAT(st.message(), AllOf(HasSubstr("a qwen2_moe layer"), HasSubstr("(qkv_bias is false)"),
                                  Not(HasSubstr("attention_bias"))));
  std::vector<SafetensorsTensor> with_o = qkv;
  for (int64_t i = 1; i < d.layers; ++i) {
    const std::string pi = absl::StrCat("model.layers.", i, ".self_attn.");
    with_o.push_back(F32Tensor(pi + "q_proj.bias", {d.heads * d.head_dim}, 30 + i));
    with_o.push_back(F32Tensor(pi + "k_proj.bias", {d.kv_heads * d.head_dim}, 40 + i));
    with_o.push_back(F32Tensor(pi + "v_proj.bias", {d.kv_heads * d.head_dim}, 50 + i));
  }
  with_o.push_back(F32Tensor(p + "o_proj.bias", {d.hidden}, 23));
  WriteCheckpoint(dir, with_o,
                  absl::StrReplaceAll(TinyConfig(d, R"(, "attention_bias": true)"),
                                      {{"\"llama\"", "\"qwen2\""}}));
  st = LoadStatus(dir);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented) << st;
  EXPECT_THAT(st.message(), AllOf(HasSubstr(p + "o_proj.bias"), HasSubstr("a qwen2 layer"),
                                  HasSubstr("its biases do not depend on config.json"),
                                  Not(HasSubstr("attention_bias"))));
  WriteCheckpoint(dir, qkv, TinyConfig(d));
  st = LoadStatus(dir);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented) << st;
  EXPECT_THAT(st.message(),
              AllOf(HasSubstr("a llama layer"), HasSubstr("(attention_bias is false)")));
}

// Writes the tiny checkpoint as two shards plus the index.
void WriteSharded(const TempDir& dir, const std::vector<SafetensorsTensor>& tensors,
                  std::map<std::string, std::string>* weight_map) {
  std::vector<SafetensorsTensor> shard[2];
  for (const SafetensorsTensor& t : tensors) {
    const int s = absl::StrContains(t.name, "layers.1.") ? 1 : 0;
    shard[s].push_back(t);
    (*weight_map)[t.name] = absl::StrCat("model-0000", s + 1, "-of-00002.safetensors");
  }
  for (int s = 0; s < 2; ++s) {
    WriteFileOrDie(dir.File(absl::StrCat("model-0000", s + 1, "-of-00002.safetensors")),
                   SafetensorsBytes(shard[s]));
  }
}

void WriteIndex(const TempDir& dir, const std::map<std::string, std::string>& weight_map) {
  std::vector<std::string> entries;
  for (const auto& [name, file] : weight_map) {
    entries.push_back(absl::StrCat("\"", name, "\": \"", file, "\""));
  }
  WriteFileOrDie(dir.File("model.safetensors.index.json"),
                 absl::StrCat(R"({"metadata": {"total_size": 1234}, "weight_map": {)",
                              absl::StrJoin(entries, ", "), "}}"));
}

TEST(ModelLoadTest, ShardedCheckpointReadsEachShardAndReleasesIt) {
  TempDir dir;
  const std::vector<SafetensorsTensor> tensors = TinyTensors();
  std::map<std::string, std::string> weight_map;
  WriteSharded(dir, tensors, &weight_map);
  WriteIndex(dir, weight_map);
  WriteFileOrDie(dir.File("config.json"), TinyConfig());
  absl::StatusOr<std::shared_ptr<const Model>> m = Model::Load("sharded", dir.path());
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string shard1 = dir.File("model-00001-of-00002.safetensors");
  const std::string shard2 = dir.File("model-00002-of-00002.safetensors");
  EXPECT_TRUE(SameBytes((*m)->embed_tokens(), Find(tensors, "model.embed_tokens.weight")->bytes));
  EXPECT_TRUE(SameBytes((*m)->layer(0).value()->q_proj,
                        Find(tensors, "model.layers.0.self_attn.q_proj.weight")->bytes));
  EXPECT_TRUE(SameBytes((*m)->layer(1).value()->q_proj,
                        Find(tensors, "model.layers.1.self_attn.q_proj.weight")->bytes));
  EXPECT_TRUE(SameBytes((*m)->layer(1).value()->k_proj,
                        Find(tensors, "model.layers.1.self_attn.k_proj.weight")->bytes));
  EXPECT_EQ(CountMappingsOf(shard1), 0);
  EXPECT_EQ(CountMappingsOf(shard2), 0);
}

TEST(ModelLoadTest, ShardedIndexErrors) {
  TempDir dir;
  const std::vector<SafetensorsTensor> tensors = TinyTensors();
  std::map<std::string, std::string> weight_map;
  WriteSharded(dir, tensors, &weight_map);
  WriteFileOrDie(dir.File("config.json"), TinyConfig());
  const std::string q1 = "model.layers.1.self_attn.q_proj.weight";

  {  // A shard that is not there.
    auto wm = weight_map;
    wm[q1] = "model-00003-of-00003.safetensors";
    WriteIndex(dir, wm);
    absl::Status st = LoadStatus(dir);
    EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(st.message(), AllOf(HasSubstr("model.safetensors.index.json"),
                                    HasSubstr("model-00003-of-00003.safetensors"), HasSubstr(q1)));
  }
  {  // A path, not a file name beside the index.
    auto wm = weight_map;
    wm[q1] = "../model-00002-of-00002.safetensors";
    WriteIndex(dir, wm);
    absl::Status st = LoadStatus(dir);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr(q1));
  }
  {  // A NUL ends the name open() sees: "model-00002-of-00002.safetensors\0junk"
     // would open shard 2. Refused, the name escaped.
    auto wm = weight_map;
    wm[q1] = "model-00002-of-00002.safetensors\\u0000junk";
    WriteIndex(dir, wm);
    absl::Status st = LoadStatus(dir);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(st.message(),
                AllOf(HasSubstr(q1), HasSubstr("\"model-00002-of-00002.safetensors\\x00junk\"")));
  }
  {  // The index says shard 1, the tensor is in shard 2.
    auto wm = weight_map;
    wm[q1] = "model-00001-of-00002.safetensors";
    WriteIndex(dir, wm);
    absl::Status st = LoadStatus(dir);
    EXPECT_FALSE(st.ok());
    EXPECT_THAT(st.message(), AllOf(HasSubstr(q1), HasSubstr("model-00001-of-00002.safetensors")));
  }
  {  // A tensor listed that no shard holds.
    auto wm = weight_map;
    wm["model.norm.weight"] = "model-00001-of-00002.safetensors";
    WriteIndex(dir, wm);
    absl::Status st = LoadStatus(dir);
    EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(st.message(), HasSubstr("model.norm.weight"));
  }
  {  // No tensors at all: missing ones, NOT_FOUND as any other missing tensor.
    WriteIndex(dir, {});
    absl::Status st = LoadStatus(dir);
    EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
    EXPECT_THAT(st.message(), AllOf(HasSubstr("model.safetensors.index.json"),
                                    HasSubstr("model.embed_tokens.weight"),
                                    HasSubstr("no tensors")));
  }
  {
    WriteFileOrDie(dir.File("model.safetensors.index.json"), R"({"weight_map": [1]})");
    absl::Status st = LoadStatus(dir);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(),
                AllOf(HasSubstr("model.safetensors.index.json"), HasSubstr("weight_map")));
  }
}

// --- Broken checkpoints: one clear error each, naming file and tensor. ---

void ExpectLoadError(const TempDir& dir, absl::StatusCode code,
                     std::vector<std::string> substrings) {
  absl::Status st = LoadStatus(dir);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), code) << st;
  for (const std::string& s : substrings) {
    EXPECT_THAT(std::string(st.message()), HasSubstr(s));
  }
}

constexpr const char* kQ0 = "model.layers.0.self_attn.q_proj.weight";
constexpr const char* kK0 = "model.layers.0.self_attn.k_proj.weight";

TEST(ModelLoadErrorTest, MissingConfigIsNotFound) {
  TempDir dir;
  WriteFileOrDie(dir.File("model.safetensors"), SafetensorsBytes(TinyTensors()));
  ExpectLoadError(dir, absl::StatusCode::kNotFound, {"config.json"});
}

// A FIFO (or any file that is not a regular one) in place of the config or
// the weights is refused at once: opening a FIFO for reading waited for a
// writer, and start-up with it (SIGTERM could not stop it).
TEST(ModelLoadErrorTest, FifosAreRefusedWithoutWaiting) {
  for (const char* name : {"config.json", "model.safetensors"}) {
    TempDir dir;
    WriteCheckpoint(dir, TinyTensors(), TinyConfig());
    ASSERT_EQ(std::remove(dir.File(name).c_str()), 0);
    ASSERT_EQ(mkfifo(dir.File(name).c_str(), 0600), 0) << std::strerror(errno);
    ExpectLoadError(dir, absl::StatusCode::kInvalidArgument, {name, "not a regular file"});
  }
}

// A tensor named twice in one header (json keeps the last entry; the
// reference loader refuses the file, the first entry's bytes unclaimed), an
// entry nested 100,000 deep, and sizes whose fused q/k/v product leaves
// int64.
TEST(ModelLoadErrorTest, DuplicateNamesDeepEntriesAndHugeProductsAreRefused) {
  TempDir dir;
  WriteFileOrDie(dir.File("config.json"), TinyConfig());
  const std::string entry = R"({"dtype": "F32", "shape": [1], "data_offsets": [0, 4]})";
  WriteFileOrDie(dir.File("model.safetensors"),
                 SafetensorsFromHeader(absl::StrCat("{\"", kQ0, "\": ", entry, ", \"", kQ0,
                                                    "\": ", entry, "}"),
                                       std::string(4, '\0')));
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument, {"model.safetensors", kQ0, "twice"});
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  WriteFileOrDie(dir.File("model.safetensors"),
                 SafetensorsFromHeader(absl::StrCat("{\"", kQ0, "\": ", deep, "}"), ""));
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                  {"model.safetensors", "nest deeper than 64 levels"});
  const std::string nested = std::string(50, '[') + std::string(50, ']');
  WriteFileOrDie(dir.File("model.safetensors"),
                 SafetensorsFromHeader(absl::StrCat("{\"", kQ0, "\": ", nested, "}"), ""));
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument, {"model.safetensors", kQ0});

  WriteCheckpoint(dir, TinyTensors(),
                  R"({"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 2147483647,
                      "num_key_value_heads": 2147483647, "head_dim": 2147483646,
                      "vocab_size": 8, "num_hidden_layers": 1, "max_position_embeddings": 64})");
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument, {"2^50"});
}

TEST(ModelLoadErrorTest, MissingWeightsIsNotFound) {
  TempDir dir;
  WriteFileOrDie(dir.File("config.json"), TinyConfig());
  ExpectLoadError(dir, absl::StatusCode::kNotFound,
                  {"model.safetensors", "model.safetensors.index.json"});
}

TEST(ModelLoadErrorTest, InvalidConfigJson) {
  TempDir dir;
  WriteCheckpoint(dir, TinyTensors(), R"({"hidden_size": 32, )");
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument, {"config.json", "invalid JSON"});
}

TEST(ModelLoadErrorTest, FileShorterThanLengthField) {
  TempDir dir;
  WriteFileOrDie(dir.File("config.json"), TinyConfig());
  WriteFileOrDie(dir.File("model.safetensors"), std::string("\x10\0\0", 3));
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument, {"model.safetensors", "too short"});
}

TEST(ModelLoadErrorTest, HeaderLengthBeyondFile) {
  TempDir dir;
  for (uint64_t len : {uint64_t{1} << 20, ~uint64_t{0}}) {
    SafetensorsLayout layout;
    layout.header_length = len;
    WriteCheckpoint(dir, TinyTensors(), TinyConfig(), layout);
    ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                    {"model.safetensors", "header length", absl::StrCat(len)});
  }
}

TEST(ModelLoadErrorTest, InvalidHeaderJson) {
  TempDir dir;
  WriteFileOrDie(dir.File("config.json"), TinyConfig());
  WriteFileOrDie(dir.File("model.safetensors"),
                 SafetensorsFromHeader(R"({"model.embed_tokens.weight": {"dtype": )", ""));
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                  {"model.safetensors", "invalid JSON in header"});

  // The parser stops at a NUL: what follows it must not be ignored (the
  // format pads with spaces only).
  WriteFileOrDie(dir.File("model.safetensors"),
                 SafetensorsFromHeader(SafetensorsHeaderJson(TinyTensors(), "") +
                                           std::string("\0 not JSON {{{ ]]]", 18),
                                       ""));
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                  {"model.safetensors", "invalid JSON in header", "NUL"});

  WriteFileOrDie(dir.File("model.safetensors"), SafetensorsFromHeader("[1, 2]", ""));
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument, {"model.safetensors", "object"});

  // Well-formed JSON with the wrong types inside an entry.
  WriteFileOrDie(dir.File("model.safetensors"),
                 SafetensorsFromHeader(absl::StrCat(R"({")", kQ0,
                                                    R"(": {"dtype": "F32", "shape": "big",
                                                          "data_offsets": [0, 4]}})"),
                                       std::string(4, '\0')));
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument, {"model.safetensors", kQ0, "shape"});
  WriteFileOrDie(dir.File("model.safetensors"),
                 SafetensorsFromHeader(absl::StrCat(R"({")", kQ0,
                                                    R"(": {"dtype": "F32", "shape": [1],
                                                          "data_offsets": [-4, 0]}})"),
                                       std::string(4, '\0')));
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                  {"model.safetensors", kQ0, "data_offsets"});
}

TEST(ModelLoadErrorTest, OffsetsOutsideTheFile) {
  TempDir dir;
  std::vector<SafetensorsTensor> tensors = TinyTensors();
  Find(tensors, kQ0)->offsets = std::make_pair(uint64_t{1} << 40, (uint64_t{1} << 40) + 4096);
  WriteCheckpoint(dir, tensors);
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                  {"model.safetensors", kQ0, "outside the data buffer"});

  // end < begin.
  tensors = TinyTensors();
  Find(tensors, kQ0)->offsets = std::make_pair(uint64_t{4096}, uint64_t{0});
  WriteCheckpoint(dir, tensors);
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                  {"model.safetensors", kQ0, "end before begin"});
}

TEST(ModelLoadErrorTest, OverlappingTensors) {
  TempDir dir;
  std::vector<SafetensorsTensor> tensors = TinyTensors();
  // embed_tokens occupies [0, 2048): put k_proj (2048 bytes) half over it.
  Find(tensors, kK0)->offsets = std::make_pair(uint64_t{1024}, uint64_t{3072});
  WriteCheckpoint(dir, tensors);
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                  {"model.safetensors", "overlaps", kK0, "model.embed_tokens.weight"});
}

// The file of `tensors` with junk bytes before the first, between each two
// and after the last, each tensor's data_offsets pointing at its bytes.
std::string SpacedSafetensors(std::vector<SafetensorsTensor> tensors, size_t before_first,
                              size_t between, size_t after_last) {
  std::string data;
  for (size_t i = 0; i < tensors.size(); ++i) {
    data.append(i == 0 ? before_first : between, '\xab');
    const uint64_t begin = data.size();
    data += tensors[i].bytes;
    tensors[i].offsets = std::make_pair(begin, uint64_t{data.size()});
  }
  data.append(after_last, '\xab');
  return SafetensorsFromHeader(SafetensorsHeaderJson(tensors, R"({"format":"pt"})"), data);
}

// The format indexes the whole data buffer (the reference loader's
// InvalidOffset and MetadataIncompleteBuffer): bytes no tensor claims,
// before, between or after the tensors, are refused naming the file.
TEST(ModelLoadErrorTest, BytesNoTensorCoversAreRefused) {
  TempDir dir;
  const std::vector<SafetensorsTensor> tensors = TinyTensors();
  WriteFileOrDie(dir.File("config.json"), TinyConfig());
  WriteFileOrDie(dir.File("model.safetensors"), SpacedSafetensors(tensors, 0, 0, 0));
  EXPECT_TRUE(LoadStatus(dir).ok()) << LoadStatus(dir);

  WriteFileOrDie(dir.File("model.safetensors"), SpacedSafetensors(tensors, 0, 8, 0));
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                  {"model.safetensors", tensors[1].name, "leaves bytes [2048, 2056)",
                   absl::StrCat("after tensor ", tensors[0].name), "no holes"});
  WriteFileOrDie(dir.File("model.safetensors"), SpacedSafetensors(tensors, 8, 0, 0));
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                  {"model.safetensors", tensors[0].name, "leaves bytes [0, 8)", "start at 0"});
  WriteFileOrDie(dir.File("model.safetensors"), SpacedSafetensors(tensors, 0, 0, 64));
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                  {"model.safetensors", "64 bytes after the last tensor"});

  // An empty tensor counts too: where the one before it ends, as the
  // reference loader sorts and checks them, not inside another.
  std::vector<SafetensorsTensor> with_empty = tensors;
  with_empty.push_back({"extra.empty", "F32", {0}, "", std::nullopt});
  WriteCheckpoint(dir, with_empty);
  EXPECT_TRUE(LoadStatus(dir).ok()) << LoadStatus(dir);
  with_empty.back().offsets = std::make_pair(uint64_t{4}, uint64_t{4});
  WriteCheckpoint(dir, with_empty);
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                  {"model.safetensors", "extra.empty", "overlaps", "model.embed_tokens.weight"});
}

// A field given twice in a tensor's entry is refused, as the reference
// loader refuses it (json would keep the last, another reader the first:
// two dtypes for one tensor); a __metadata__ key given twice keeps the
// last there (a string map), so it loads here too.
TEST(ModelLoadErrorTest, FieldGivenTwiceInATensorEntryIsRefused) {
  TempDir dir;
  const std::vector<SafetensorsTensor> tensors = TinyTensors();
  std::string data;
  for (const SafetensorsTensor& t : tensors) data += t.bytes;
  const std::string header = SafetensorsHeaderJson(tensors, R"({"format":"pt"})");
  const std::string q_entry = absl::StrCat("\"", kQ0, "\":{\"dtype\":\"F32\"");
  ASSERT_NE(header.find(q_entry), std::string::npos);
  WriteFileOrDie(dir.File("config.json"), TinyConfig());
  WriteFileOrDie(dir.File("model.safetensors"),
                 SafetensorsFromHeader(
                     absl::StrReplaceAll(header, {{q_entry, absl::StrCat("\"", kQ0,
                                                                         "\":{\"dtype\":\"BF16\","
                                                                         "\"dtype\":\"F32\"")}}),
                     data));
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                  {"model.safetensors", kQ0, "field \"dtype\" twice"});
  const std::string offsets = "\"data_offsets\":[0,2048]";
  ASSERT_NE(header.find(offsets), std::string::npos);
  WriteFileOrDie(dir.File("model.safetensors"),
                 SafetensorsFromHeader(
                     absl::StrReplaceAll(header, {{offsets, "\"data_offsets\":[0,8]," + offsets}}),
                     data));
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                  {"model.safetensors", "model.embed_tokens.weight", "\"data_offsets\" twice"});

  SafetensorsLayout layout;
  layout.metadata_json = R"({"format":"np","format":"pt"})";
  WriteCheckpoint(dir, tensors, TinyConfig(), layout);
  EXPECT_TRUE(LoadStatus(dir).ok()) << LoadStatus(dir);
}

// __metadata__ is an optional map of strings to strings in the format (the
// reference loader refuses other values).
TEST(ModelLoadErrorTest, MetadataMustMapStringsToStrings) {
  TempDir dir;
  SafetensorsLayout layout;
  for (const char* ok : {R"({})", R"({"format":"pt","note":""})", "null"}) {
    layout.metadata_json = ok;
    WriteCheckpoint(dir, TinyTensors(), TinyConfig(), layout);
    EXPECT_TRUE(LoadStatus(dir).ok()) << ok << " " << LoadStatus(dir);
  }
  const std::vector<std::pair<std::string, std::vector<std::string>>> refused = {
      {R"({"format":"pt","n":1})", {"__metadata__ key \"n\"", "string", "got 1"}},
      {R"({"nested":{"a":"b"}})", {"__metadata__ key \"nested\"", "string"}},
      {R"({"flag":null})", {"__metadata__ key \"flag\"", "got null"}},
      {R"("pt")", {"__metadata__ must be an object of strings", "\"pt\""}},
      {R"(["pt"])", {"__metadata__ must be an object of strings"}},
  };
  for (const auto& [metadata, substrings] : refused) {
    SCOPED_TRACE(metadata);
    layout.metadata_json = metadata;
    WriteCheckpoint(dir, TinyTensors(), TinyConfig(), layout);
    std::vector<std::string> expected = substrings;
    expected.push_back("model.safetensors");
    ExpectLoadError(dir, absl::StatusCode::kInvalidArgument, expected);
  }
}

TEST(ModelLoadErrorTest, ByteCountNotMatchingShape) {
  TempDir dir;
  std::vector<SafetensorsTensor> tensors = TinyTensors();
  Find(tensors, kQ0)->shape = {32, 33};
  WriteCheckpoint(dir, tensors);
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                  {"model.safetensors", kQ0, "[32, 33]", "4096 bytes"});
}

TEST(ModelLoadErrorTest, HostileShapesDoNotOverflow) {
  TempDir dir;
  for (const char* shape : {"[1099511627776, 1099511627776, 1099511627776]",
                            "[9223372036854775807, 2]", "[18446744073709551615]"}) {
    SCOPED_TRACE(shape);
    WriteFileOrDie(dir.File("config.json"), TinyConfig());
    WriteFileOrDie(
        dir.File("model.safetensors"),
        SafetensorsFromHeader(absl::StrCat(R"({")", kQ0, R"(": {"dtype": "F32", "shape": )", shape,
                                           R"(, "data_offsets": [0, 0]}})"),
                              ""));
    ExpectLoadError(dir, absl::StatusCode::kInvalidArgument, {"model.safetensors", kQ0});
  }
}

TEST(ModelLoadErrorTest, UnsupportedDtype) {
  TempDir dir;
  std::vector<SafetensorsTensor> tensors = TinyTensors();
  // Valid safetensors dtypes this server does not compute in: UNIMPLEMENTED
  // naming the tensor and the dtype.
  Find(tensors, kQ0)->dtype = "I32";  // same element size, so only the dtype is wrong
  WriteCheckpoint(dir, tensors);
  ExpectLoadError(dir, absl::StatusCode::kUnimplemented, {"model.safetensors", kQ0, "I32"});
  {
    std::vector<SafetensorsTensor> f64 = TinyTensors();
    SafetensorsTensor* q = Find(f64, kQ0);
    q->dtype = "F64";
    q->bytes += q->bytes;  // 8 bytes per element
    WriteCheckpoint(dir, f64);
    ExpectLoadError(dir, absl::StatusCode::kUnimplemented, {"model.safetensors", kQ0, "F64"});
  }

  Find(tensors, kQ0)->dtype = "Q4_K";
  WriteCheckpoint(dir, tensors);
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                  {"model.safetensors", kQ0, "unknown dtype Q4_K"});
}

TEST(ModelLoadErrorTest, UnusedTensorsOfOtherDtypesAreFine) {
  // Real checkpoints carry buffers such as int64 position ids; only tensors
  // the model uses must be F32/BF16/F16.
  TempDir dir;
  std::vector<SafetensorsTensor> tensors = TinyTensors();
  tensors.push_back({"model.position_ids", "I64", {4}, std::string(32, '\1'), std::nullopt});
  WriteCheckpoint(dir, tensors);
  EXPECT_TRUE(LoadStatus(dir).ok()) << LoadStatus(dir);
  // Every safetensors dtype, sub-byte ones included (F4: 2 per byte, F6:
  // 4 per 3 bytes), with byte lengths as the reference loader checks them.
  tensors.push_back({"extra.f64", "F64", {3}, std::string(24, '\0'), std::nullopt});
  tensors.push_back({"extra.c64", "C64", {2}, std::string(16, '\0'), std::nullopt});
  tensors.push_back({"extra.u8", "U8", {3}, std::string(3, '\0'), std::nullopt});
  tensors.push_back({"extra.bool", "BOOL", {3}, std::string(3, '\1'), std::nullopt});
  tensors.push_back({"extra.e4m3", "F8_E4M3", {2}, std::string(2, '\0'), std::nullopt});
  tensors.push_back({"extra.e5m2", "F8_E5M2", {2}, std::string(2, '\0'), std::nullopt});
  tensors.push_back({"extra.e8m0", "F8_E8M0", {2}, std::string(2, '\0'), std::nullopt});
  tensors.push_back({"extra.f4", "F4", {2, 3}, std::string(3, '\0'), std::nullopt});
  tensors.push_back({"extra.f6a", "F6_E2M3", {4}, std::string(3, '\0'), std::nullopt});
  tensors.push_back({"extra.f6b", "F6_E3M2", {8}, std::string(6, '\0'), std::nullopt});
  WriteCheckpoint(dir, tensors);
  EXPECT_TRUE(LoadStatus(dir).ok()) << LoadStatus(dir);
  // A byte length that does not match is refused, used or not.
  tensors.push_back({"extra.bad_f4", "F4", {3}, std::string(2, '\0'), std::nullopt});
  WriteCheckpoint(dir, tensors);
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                  {"model.safetensors", "extra.bad_f4", "whole number of bytes"});
  tensors.back() = {"extra.bad_f64", "F64", {3}, std::string(16, '\0'), std::nullopt};
  WriteCheckpoint(dir, tensors);
  ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                  {"model.safetensors", "extra.bad_f64", "spans 16 bytes", "needs 24"});
}

TEST(ModelLoadErrorTest, ShapeNotMatchingConfig) {
  TempDir dir;
  std::vector<SafetensorsTensor> tensors = TinyTensors();
  SafetensorsTensor* q = Find(tensors, kQ0);
  q->shape = {32, 16};
  q->bytes.resize(32 * 16 * 4);
  WriteCheckpoint(dir, tensors);
  ExpectLoadError(
      dir, absl::StatusCode::kInvalidArgument,
      {"model.safetensors", kQ0, "has shape [32, 16], config expects [32, 32]", "hidden_size 32"});
}

// A NaN or Inf weight would turn every answer non-finite, or into an error
// blamed on the caller's q: the checkpoint is refused at load, naming the
// tensor and the element, whatever its dtype.
TEST(ModelLoadErrorTest, NonFiniteWeightsAreRefusedAtLoad) {
  {
    TempDir dir;
    std::vector<SafetensorsTensor> tensors = TinyTensors();
    SafetensorsTensor* q = Find(tensors, "model.layers.0.self_attn.q_proj.weight");
    ASSERT_NE(q, nullptr);
    std::vector<float> v = Values(q->shape[0] * q->shape[1], 3);
    v[5] = std::nanf("");
    q->bytes = F32Bytes(v);
    WriteCheckpoint(dir, tensors);
    ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                    {"model.safetensors", "model.layers.0.self_attn.q_proj.weight[0, 5]", "NaN",
                     "weights must be finite"});
  }
  {
    TempDir dir;
    std::vector<SafetensorsTensor> tensors = TinyTensors();
    SafetensorsTensor* o = Find(tensors, "model.layers.1.self_attn.o_proj.weight");  // F16
    ASSERT_NE(o, nullptr);
    o->bytes[2 * 7] = static_cast<char>(0x00), o->bytes[2 * 7 + 1] = static_cast<char>(0xFC);  // element 7: -inf
    WriteCheckpoint(dir, tensors);
    ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                    {"model.layers.1.self_attn.o_proj.weight", "-inf"});
  }
  {
    TempDir dir;
    std::vector<SafetensorsTensor> tensors = TinyTensors();
    SafetensorsTensor* v = Find(tensors, "model.layers.0.self_attn.v_proj.weight");  // BF16
    ASSERT_NE(v, nullptr);
    v->bytes[0] = static_cast<char>(0x80), v->bytes[1] = static_cast<char>(0x7F);  // element 0: +inf
    WriteCheckpoint(dir, tensors);
    ExpectLoadError(dir, absl::StatusCode::kInvalidArgument,
                    {"model.layers.0.self_attn.v_proj.weight", "+inf"});
  }
}

TEST(ModelLoadErrorTest, MissingTensorIsNotFound) {
  TempDir dir;
  std::vector<SafetensorsTensor> tensors = TinyTensors();
  tensors.erase(tensors.begin() + 7);  // layer 1 v_proj
  WriteCheckpoint(dir, tensors);
  ExpectLoadError(dir, absl::StatusCode::kNotFound,
                  {"model.safetensors", "model.layers.1.self_attn.v_proj.weight"});
}

TEST(ModelLoadErrorTest, OtherNamingSchemesAreUnimplemented) {
  TempDir dir;
  TinyDims d;
  // GPT-NeoX naming.
  WriteCheckpoint(dir, {F32Tensor("gpt_neox.embed_in.weight", {d.vocab, d.hidden}, 1),
                        F32Tensor("gpt_neox.layers.0.attention.query_key_value.weight",
                                  {3 * d.hidden, d.hidden}, 2)});
  ExpectLoadError(dir, absl::StatusCode::kUnimplemented,
                  {"model.safetensors", "model.embed_tokens.weight", "gpt_neox.embed_in.weight"});

  // Phi-3's fused projection: the first missing tensor is layer 0's q_proj.
  std::vector<SafetensorsTensor> phi3 = {
      F32Tensor("model.embed_tokens.weight", {d.vocab, d.hidden}, 1),
      F32Tensor("model.layers.0.self_attn.qkv_proj.weight",
                {(d.heads + 2 * d.kv_heads) * d.head_dim, d.hidden}, 2),
      F32Tensor("model.layers.0.self_attn.o_proj.weight", {d.hidden, d.hidden}, 3)};
  WriteCheckpoint(dir, phi3);
  ExpectLoadError(dir, absl::StatusCode::kUnimplemented,
                  {"model.safetensors", kQ0, "model.layers.0.self_attn.qkv_proj.weight"});
}

// ============================ demo and registry =============================

TEST(DemoModelTest, DimensionsAndRope) {
  absl::StatusOr<std::shared_ptr<const Model>> m = Model::Demo("demo");
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& c = (*m)->config();
  EXPECT_EQ((*m)->source(), "built-in");
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.num_heads, 8);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.vocab_size, 256);
  EXPECT_EQ(c.max_positions, 4096);
  EXPECT_EQ((*m)->num_layers(), 2);
  ASSERT_TRUE(c.rope.has_value());
  EXPECT_TRUE(ValidateRopeConfig(*c.rope).ok());
  EXPECT_EQ(c.rope->theta, 500000.0);
  EXPECT_EQ(c.rope->scaling.type, RopeScalingType::kLlama3);
  EXPECT_EQ(c.rope->scaling.factor, 8.0);
  EXPECT_EQ(c.rope->scaling.original_max_positions, 1024);
  EXPECT_THAT((*m)->embed_tokens().dims(), ElementsAre(256, 128));
  const LayerWeights* l1 = (*m)->layer(1).value();
  EXPECT_THAT(l1->q_proj.dims(), ElementsAre(128, 128));
  EXPECT_THAT(l1->k_proj.dims(), ElementsAre(32, 128));
  EXPECT_THAT(l1->v_proj.dims(), ElementsAre(32, 128));
  EXPECT_THAT(l1->o_proj.dims(), ElementsAre(128, 128));
  EXPECT_EQ((*m)->resident_bytes(), (256 * 128 + 2 * (128 * 128 * 2 + 32 * 128 * 2)) * 4);

  // Weights: within 1/sqrt(fan_in), not degenerate, and distinct per tensor.
  const float* q = l1->q_proj.data<float>();
  double sum_sq = 0;
  for (int64_t i = 0; i < l1->q_proj.num_elements(); ++i) {
    ASSERT_LE(std::fabs(q[i]), 1.0 / std::sqrt(128.0));
    sum_sq += q[i] * q[i];
  }
  // Uniform on [-a, a) has mean square a^2/3.
  EXPECT_NEAR(sum_sq / l1->q_proj.num_elements(), 1.0 / (3 * 128.0), 0.1 / (3 * 128.0));
  EXPECT_NE(std::memcmp(q, (*m)->layer(0).value()->q_proj.raw(), 128 * 128 * 4), 0);
}

TEST(DemoModelTest, TwoLoadsAreBitIdentical) {
  auto a = Model::Demo("a").value();
  auto b = Model::Demo("b").value();
  auto same = [](const ConstTensorView& x, const ConstTensorView& y) {
    return x.dims() == y.dims() &&
           std::memcmp(x.raw(), y.raw(), static_cast<size_t>(x.num_elements()) * 4) == 0;
  };
  EXPECT_NE(a->embed_tokens().raw(), b->embed_tokens().raw());
  EXPECT_TRUE(same(a->embed_tokens(), b->embed_tokens()));
  for (int64_t i = 0; i < a->num_layers(); ++i) {
    const LayerWeights* x = a->layer(i).value();
    const LayerWeights* y = b->layer(i).value();
    EXPECT_TRUE(same(x->q_proj, y->q_proj));
    EXPECT_TRUE(same(x->k_proj, y->k_proj));
    EXPECT_TRUE(same(x->v_proj, y->v_proj));
    EXPECT_TRUE(same(x->o_proj, y->o_proj));
  }
}

TEST(ModelRegistryTest, AddGetList) {
  ModelRegistry registry;
  EXPECT_EQ(registry.Get("demo").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(registry.Add(Model::Demo("demo").value()).ok());
  ASSERT_TRUE(registry.Add(Model::Demo("alpha").value()).ok());
  absl::Status dup = registry.Add(Model::Demo("demo").value());
  EXPECT_EQ(dup.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(dup.message(), HasSubstr("demo"));
  EXPECT_EQ(registry.Add(nullptr).code(), absl::StatusCode::kInvalidArgument);

  absl::StatusOr<std::shared_ptr<const Model>> got = registry.Get("demo");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ((*got)->name(), "demo");
  absl::Status missing = registry.Get("llama").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), AllOf(HasSubstr("llama"), HasSubstr("alpha, demo")));
  // The caller's name is escaped: control bytes and a UTF-8 sequence cut
  // at the 64-byte prefix reach the message as \x escapes, never raw.
  const std::string odd = std::string("a\nb\x1b\0c", 6) + std::string(57, 'x') + "\xc3\xa9tail";
  missing = registry.Get(odd).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  for (char ch : missing.message()) {
    const unsigned char c = static_cast<unsigned char>(ch);
    EXPECT_TRUE(c >= 0x20 && c < 0x7f) << "raw byte " << static_cast<int>(c);
  }
  EXPECT_THAT(missing.message(), HasSubstr("a\\nb\\x1b"));

  std::vector<std::string> names;
  for (const auto& m : registry.List()) names.push_back(m->name());
  EXPECT_THAT(names, ElementsAre("alpha", "demo"));
}

}  // namespace
}  // namespace ropeattn::server
