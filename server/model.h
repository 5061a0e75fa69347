// Model artifacts: Hugging Face-style checkpoints (config.json plus
// model.safetensors, or a sharded set with model.safetensors.index.json),
// loaded once at start-up, and the built-in demo model.
//
// Files are memory-mapped (PROT_READ, MAP_PRIVATE) only while loading: the
// tensors a model uses are copied out (F32 and BF16 as they are, F16
// converted to F32: the kernels have no f16 path) and the files unmapped
// before Load returns, so a served model holds no file open or mapped and a
// file truncated, rewritten or deleted afterwards changes nothing (served
// from the mapping, it would raise SIGBUS or change weights behind the
// load-time checks). A broken checkpoint stops loading with one clear
// message naming the file and the tensor; a model is never half-loaded.
//
// Every tensor of every file is bounds-checked at load (header length within
// the file, data_offsets within the data buffer, end - begin equal to the
// shape's element count times the dtype size, the tensors covering the data
// buffer exactly: no overlap, no hole, nothing after the last), whether the
// model uses it or not; as the reference loader, a field given twice in a
// tensor's entry and a __metadata__ other than strings to strings are
// refused. Only tensors the model uses must be F32/BF16/F16: checkpoints
// carry other buffers (int64 position ids, ...).
//
// Tensor names read, per family (L = layer index):
//   Llama, Mistral, Qwen2/3, Gemma 1/2/3:
//     model.embed_tokens.weight                   [vocab, hidden]
//     model.layers.L.self_attn.q_proj.weight      [heads * head_dim, hidden]
//     model.layers.L.self_attn.{k,v}_proj.weight  [kv_heads * head_dim, hidden]
//     model.layers.L.self_attn.o_proj.weight      [hidden, heads * head_dim]
//     model.layers.L.self_attn.{q,k,v,o}_proj.bias  [out]: q/k/v required when
//         attention_bias (always for Qwen2), o optional; a bias present is loaded
//     model.layers.L.self_attn.{q,k}_norm.weight  [head_dim] (Qwen3, Gemma 3)
//   Phi-3: model.layers.L.self_attn.qkv_proj.weight [(heads + 2 kv_heads) * head_dim,
//     hidden], rows q, then k, then v (viewed in place); o_proj as Llama.
//   GPT-NeoX: gpt_neox.embed_in.weight; gpt_neox.layers.L.attention.
//     query_key_value.{weight,bias} [3 hidden, hidden], rows per head [q k v]
//     (gathered into owned q/k/v at load); ...attention.dense.{weight,bias}.
//   GPT-J: transformer.wte.weight; transformer.h.L.attn.{q,k,v,out}_proj.weight.
//   BERT (with or without a "bert." prefix): embeddings.{word,position,
//     token_type}_embeddings.weight, embeddings.LayerNorm.{weight,bias} (or
//     gamma/beta); encoder.layer.L.attention.self.{query,key,value}.{weight,bias},
//     encoder.layer.L.attention.output.dense.{weight,bias}.
// Other tensors (MLP, other norms, lm_head) are ignored. A checkpoint whose
// names are not its family's: Unimplemented, naming the first expected tensor
// and the closest name in the file.
//
// Thread-safety: a Model is immutable after Load and may be shared freely.
#ifndef ROPEATTN_SERVER_MODEL_H_
#define ROPEATTN_SERVER_MODEL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/rope.h"
#include "core/tensor.h"

namespace ropeattn::server {

// How a model encodes absolute positions at the embedding.
enum class PositionKind { kNone, kRope, kLearned, kSinusoidal };

// The architecture families served (docs/checkpoints.md). Each reads its
// config keys and tensors the way its transformers code does.
enum class Family {
  kLlama,    // llama
  kMistral,  // mistral, mixtral: sliding_window on every layer
  kQwen2,    // qwen2, qwen2_moe: q/k/v biases; use_sliding_window
  kQwen3,    // qwen3, qwen3_moe: + per-head RMSNorm of q and k
  kGemma,    // gemma: head_dim 256 default, embeddings * sqrt(hidden)
  kGemma2,   // gemma2: query_pre_attn_scalar, soft-cap, alternating window
  kGemma3,   // gemma3_text: + (1 + w) q/k norms, local RoPE base on sliding layers
  kPhi3,     // phi3: fused qkv_proj, LongRoPE, sliding_window
  kGptNeoX,  // gpt_neox: fused per-head query_key_value, partial rotary
  kGptJ,     // gptj: interleaved rotary_dim, no biases
  kBert,     // bert: learned absolute positions, bidirectional
};
const char* FamilyName(Family family);

// Per-head normalization of q and k before RoPE.
enum class QkNorm {
  kNone,
  kRms,         // Qwen3: w * x / sqrt(mean(x^2) + eps)
  kRmsOnePlus,  // Gemma 3: (1 + w) * x / sqrt(mean(x^2) + eps)
};

// What differs between one layer and the next.
struct LayerAttention {
  int64_t window = 0;       // sliding window (keys q_pos - window < j <= q_pos); 0: none
  bool local_rope = false;  // RoPE from ModelConfig::local_rope (Gemma 3 sliding layers)
};

// Architecture facts resolved from config.json (keys as in
// positional-encodings.md section 4).
struct ModelConfig {
  std::string architecture;  // config "architectures"[0] or "model_type"
  std::string model_type;
  Family family = Family::kLlama;
  int64_t hidden_size = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;  // num_key_value_heads, default num_heads
  int64_t head_dim = 0;      // head_dim, default hidden_size / num_heads
  int64_t vocab_size = 0;
  int64_t max_positions = 0;  // max_position_embeddings (n_positions)
  int64_t num_layers = 0;     // num_hidden_layers (n_layer), at most kMaxLayers
  PositionKind positions = PositionKind::kRope;
  // RoPE: rope_theta, rope_scaling / rope_parameters (rope_type or legacy
  // type, factor, original_max_position_embeddings, beta_fast, beta_slow,
  // mscale, mscale_all_dim, attention_factor, short_factor, long_factor,
  // low_freq_factor, high_freq_factor), partial_rotary_factor or rotary_dim
  // (GPT-J: rotary_dim, interleaved pairs), all resolved here.
  std::optional<RopeConfig> rope;
  // Gemma 3: the RoPE of sliding layers (rope_local_base_freq, default rule).
  std::optional<RopeConfig> local_rope;
  bool attention_bias = false;  // q/k/v projections have biases
  // The attention itself, as the family computes it.
  bool causal = true;    // decoders; BERT is bidirectional
  double scale = 0.0;    // logit scale; 0: 1/sqrt(head_dim)
  double softcap = 0.0;  // attn_logit_softcapping; 0: none
  QkNorm qk_norm = QkNorm::kNone;
  double rms_norm_eps = 1e-6;  // q/k norms
  // Embed: Gemma multiplies embeddings by sqrt(hidden_size) (in the table's
  // dtype); 1 for other families.
  double embed_scale = 1.0;
  double layer_norm_eps = 1e-12;  // BERT's embedding LayerNorm
  int64_t type_vocab_size = 2;    // BERT's token type rows
  std::vector<LayerAttention> layers;  // num_layers entries
};

// Layer counts above this are refused (per-layer tables are sized by it).
inline constexpr int64_t kMaxLayers = 4096;

// The RoPE layer `layer` applies (null: none).
const RopeConfig* RopeOfLayer(const ModelConfig& config, int64_t layer);

// Resolves a config.json text; `file_name` prefixes every message.
// Exact or refused (docs/checkpoints.md): model_type must be one of the
// families above (Unimplemented otherwise, or when it is missing); every key
// the family's transformers code reads that changes the attention is either
// computed exactly or Unimplemented naming the key and value
// (quantization_config, layer types other than full/sliding attention,
// Gemma's use_bidirectional_attention, BERT's is_decoder or a relative
// position_embedding_type, mrope, a RoPE rule transformers does not have:
// ntk, or "su" outside Phi-3). Keys the family's code never reads are
// ignored, as transformers ignores them.
// Aliases: hidden_size / n_embd, num_attention_heads / n_head,
// max_position_embeddings / n_positions, num_hidden_layers / n_layer.
// Absent keys take the family's transformers defaults (head_dim 256 for
// Gemma, 128 for Qwen3; Mistral's sliding_window 4096; Gemma 2's
// attn_logit_softcapping 50; query_pre_attn_scalar 256; GPT-NeoX's rotary_pct
// 0.25; GPT-J's rotary_dim 64; Gemma 3's rope_theta 1e6, ...); null keys mean
// None. RoPE resolution:
// - rope_parameters (newer transformers) wins over rope_scaling; the rule is
//   rope_type or legacy type, one of transformers' (default, linear,
//   "dynamic" = dynamic NTK, yarn, longrope, llama3; Phi-3's "su" and "yarn"
//   = longrope); a factor with no rule is refused. rope_theta (or GPT-NeoX
//   rotary_emb_base) may also sit inside rope_parameters; Gemma 3's may be
//   keyed by layer type.
// - original_max_position_embeddings: from the scaling block, else the top
//   level (Phi-3), else max_position_embeddings for dynamic / yarn / longrope
//   (as transformers does); llama3 requires it.
// - longrope factor defaults to max_position_embeddings / original.
// - Partial rotary: partial_rotary_factor, else rotary_pct (GPT-NeoX), else
//   rotary_dim (GPT-J); a fraction gives floor(head_dim * f). 0 channels
//   (GPT-NeoX, Phi-3) rotate nothing, as in transformers: `rope` is unset
//   and `positions` is kNone.
// - Layout: interleaved for GPT-J, half-split otherwise.
// The RopeConfig is checked with ValidateRopeConfig.
// Errors: InvalidArgument naming the key for invalid JSON, a missing required
// key, a wrong type or an inconsistent value (heads not dividing hidden_size
// without head_dim, kv heads not dividing heads, unknown rope_type, an invalid
// RoPE setting, more than kMaxLayers layers, ...); Unimplemented as above,
// and for a RoPE value transformers computes to finite frequencies that
// ValidateRopeConfig refuses (a base in (0, 1], a negative factor, ...).
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view config_json,
                                             absl::string_view file_name);

// The tensors of one safetensors file, validated as Model::Load validates
// every file it maps: header length within the file (and at most 100 MB),
// header JSON, each tensor's dtype, shape and data_offsets inside the data
// buffer with end - begin equal to the shape's bytes, the tensors covering
// the data buffer exactly (sorted by offset, each starting where the one
// before ends, the first at 0, the last ending at the buffer's end), no field
// given twice in an entry, __metadata__ (if not null) an object of strings.
// `bytes` is the whole file; InvalidArgument naming `file_name` and the
// tensor otherwise. Sorted by name; `offset` is from the start of
// `bytes`. Nothing is mapped or copied.
struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // "F32", "BF16", "I64", ...
  Dims shape;
  uint64_t offset = 0;
  int64_t num_bytes = 0;
};
absl::StatusOr<std::vector<SafetensorsTensor>> ParseSafetensors(absl::string_view bytes,
                                                                 absl::string_view file_name);

// One attention layer's weights, Hugging Face layout: W [out, in] row-major.
// Fused checkpoints (Phi-3, GPT-NeoX) are split at load: q_proj/k_proj/
// v_proj are always separate [out, hidden] views.
struct LayerWeights {
  ConstTensorView q_proj, k_proj, v_proj, o_proj;  // required
  ConstTensorView q_bias, k_bias, v_bias, o_bias;  // optional (absent: empty view)
  ConstTensorView q_norm, k_norm;                  // [head_dim], when config.qk_norm is set
};

class Model {
 public:
  // Loads `dir`: config.json, then model.safetensors if present, else the
  // shards listed in model.safetensors.index.json ({"weight_map": {tensor:
  // shard file}}; shards are plain file names beside the index, each mapped
  // once, and must hold exactly the tensors the index assigns them).
  // NotFound for a missing config.json, weights file, shard or tensor;
  // InvalidArgument naming the file and tensor for invalid config.json, a
  // bad safetensors header length, header JSON, offsets outside the file,
  // overlapping or leaving bytes to no tensor, a dtype other than
  // F32/BF16/F16, a shape that does not match the config; Unimplemented for
  // another tensor naming scheme.
  static absl::StatusOr<std::shared_ptr<const Model>> Load(const std::string& name,
                                                           const std::string& dir);
  // The built-in demo model: hidden 128, 8 heads, 2 kv heads (GQA), head_dim
  // 16, vocab 256, 2 layers, max_positions 4096, no biases; RoPE theta 500000,
  // half-split, Llama 3 scaling (factor 8, low 1, high 4, original 1024).
  // Weights are owned f32, uniform from splitmix64 seeded by each tensor's
  // name (so bit-identical across loads and machines): embeddings in [-1, 1),
  // projections in [-1/sqrt(fan_in), 1/sqrt(fan_in)).
  static absl::StatusOr<std::shared_ptr<const Model>> Demo(const std::string& name);

  ~Model();

  const std::string& name() const { return name_; }
  const std::string& source() const { return source_; }  // dir, or "built-in"
  const ModelConfig& config() const { return config_; }
  // [vocab_size, hidden_size]
  ConstTensorView embed_tokens() const { return embed_tokens_; }
  // Whether the file stored the table in F16 (held widened to F32): Gemma's
  // embedding factor is rounded to the file's dtype, as transformers does.
  bool embed_tokens_f16() const { return embed_tokens_f16_; }
  // Learned absolute positions [max_positions, hidden_size] (kLearned only).
  ConstTensorView position_table() const { return position_table_; }
  // BERT: token type 0's embedding row [1, hidden_size] and the embedding
  // LayerNorm's weight and bias [hidden_size] (empty views otherwise).
  ConstTensorView token_type_row() const { return token_type_row_; }
  ConstTensorView embed_norm_weight() const { return embed_norm_weight_; }
  ConstTensorView embed_norm_bias() const { return embed_norm_bias_; }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // OutOfRange naming the layer for an index outside [0, num_layers).
  absl::StatusOr<const LayerWeights*> layer(int64_t index) const;
  // Bytes of the weights this model uses, all held in memory (copied or
  // converted from the files, or generated).
  int64_t resident_bytes() const { return resident_bytes_; }

 private:
  Model() = default;
  struct Storage;
  std::string name_, source_;
  ModelConfig config_;
  ConstTensorView embed_tokens_, position_table_;
  bool embed_tokens_f16_ = false;
  ConstTensorView token_type_row_, embed_norm_weight_, embed_norm_bias_;
  std::vector<LayerWeights> layers_;
  int64_t resident_bytes_ = 0;
  std::unique_ptr<Storage> storage_;  // the tensors it serves
};

// Name -> model, filled at start-up. Immutable once the server runs.
class ModelRegistry {
 public:
  absl::Status Add(std::shared_ptr<const Model> model);  // AlreadyExists for a duplicate name
  // NotFound naming the model and listing the known ones.
  absl::StatusOr<std::shared_ptr<const Model>> Get(absl::string_view name) const;
  std::vector<std::shared_ptr<const Model>> List() const;

 private:
  std::map<std::string, std::shared_ptr<const Model>, std::less<>> models_;
};

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_MODEL_H_
