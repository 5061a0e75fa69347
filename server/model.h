// Model artifacts: Hugging Face-style checkpoints (config.json plus
// model.safetensors, or a sharded set with model.safetensors.index.json),
// loaded once at start-up, and the built-in demo model.
//
// Weights are memory-mapped (PROT_READ, MAP_PRIVATE), not copied: F32 and
// BF16 tensors are used in place; F16 tensors are converted to F32 once at
// load (the kernels have no f16 path). Data the header leaves misaligned for
// its dtype (a header length that is not a multiple of 4) is copied instead of
// read unaligned. A broken checkpoint stops loading with one clear message
// naming the file and the tensor; a model is never half-loaded.
//
// Every tensor of every file is bounds-checked at load (header length within
// the file, data_offsets within the data buffer, end - begin equal to the
// shape's element count times the dtype size, no two tensors overlapping),
// whether the model uses it or not. Only tensors the model uses must be
// F32/BF16/F16: checkpoints carry other buffers (int64 position ids, ...).
// Files must not be truncated while a model maps them (the kernel would
// raise SIGBUS on access; no load-time check can prevent that).
//
// Tensor names read (Llama / Mistral / Qwen2 style, separate q/k/v/o):
//   model.embed_tokens.weight                     [vocab, hidden]
//   model.layers.{i}.self_attn.q_proj.weight      [heads * head_dim, hidden]
//   model.layers.{i}.self_attn.{k,v}_proj.weight  [kv_heads * head_dim, hidden]
//   model.layers.{i}.self_attn.o_proj.weight      [hidden, heads * head_dim]
//   model.layers.{i}.self_attn.{q,k,v,o}_proj.bias  [out]: q/k/v required
//       when attention_bias, o optional; a bias present in the file is loaded
//   embeddings.position_embeddings.weight or model.embed_positions.weight
//                                                 [max_positions, hidden], kLearned only
// Other tensors (MLP, norms, lm_head) are ignored. A checkpoint with no
// model.layers.N.self_attn.q_proj.weight at all uses another naming scheme
// (GPT-NeoX, GPT-J, BERT, Phi-3's fused qkv_proj): Unimplemented, naming the
// first expected tensor and the closest name in the file.
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

// Architecture facts resolved from config.json (keys as in
// positional-encodings.md section 4).
struct ModelConfig {
  std::string architecture;  // config "architectures"[0] or "model_type"
  std::string model_type;
  int64_t hidden_size = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;  // num_key_value_heads, default num_heads
  int64_t head_dim = 0;      // head_dim, default hidden_size / num_heads
  int64_t vocab_size = 0;
  int64_t max_positions = 0;  // max_position_embeddings (n_positions)
  int64_t num_layers = 0;     // num_hidden_layers (n_layer)
  PositionKind positions = PositionKind::kRope;
  // RoPE: rope_theta, rope_scaling / rope_parameters (rope_type or legacy
  // type, factor, original_max_position_embeddings, beta_fast, beta_slow,
  // mscale, mscale_all_dim, attention_factor, short_factor, long_factor,
  // low_freq_factor, high_freq_factor), partial_rotary_factor or rotary_dim
  // (GPT-J: rotary_dim, interleaved pairs), all resolved here.
  std::optional<RopeConfig> rope;
  bool attention_bias = false;  // q/k/v projections have biases
};

// Resolves a config.json text; `file_name` prefixes every message.
// Aliases: hidden_size / n_embd, num_attention_heads / n_head,
// max_position_embeddings / n_positions, num_hidden_layers / n_layer.
// Absent or null optional keys take transformers' defaults. Resolution rules:
// - rope_parameters (newer transformers) wins over rope_scaling; the rule is
//   rope_type or legacy type ("su" = longrope, "dynamic" = dynamic NTK); a
//   factor with no rule is refused. rope_theta (or GPT-NeoX rotary_emb_base,
//   default 10000) may also sit inside rope_parameters.
// - original_max_position_embeddings: from the scaling block, else the top
//   level (Phi-3), else max_position_embeddings for dynamic / yarn / longrope
//   (as transformers does); llama3 requires it.
// - longrope factor defaults to max_position_embeddings / original.
// - Partial rotary: partial_rotary_factor, else rotary_pct (GPT-NeoX), else
//   rotary_dim (GPT-J); a fraction gives floor(head_dim * f). rotary_dim is
//   always set explicitly (head_dim when full).
// - Layout: interleaved for model_type gptj / codegen, half-split otherwise.
// - Biases: attention_bias, else qkv_bias, else true for qwen2 / qwen2_moe.
// - Positions: position_embedding_type "absolute" (the default for bert,
//   roberta, xlm-roberta, electra) gives kLearned and no rope.
// The RopeConfig is checked with ValidateRopeConfig.
// Errors: InvalidArgument naming the key for invalid JSON, a missing required
// key, a wrong type or an inconsistent value (heads not dividing hidden_size
// without head_dim, kv heads not dividing heads, unknown rope_type, an invalid
// RoPE setting, ...); Unimplemented for a valid but unsupported scheme (mrope,
// relative position_embedding_type).
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view config_json,
                                             absl::string_view file_name);

// The tensors of one safetensors file, validated as Model::Load validates
// every file it maps: header length within the file (and at most 100 MB),
// header JSON, each tensor's dtype, shape and data_offsets inside the data
// buffer with end - begin equal to the shape's bytes, no two tensors
// overlapping. `bytes` is the whole file; InvalidArgument naming `file_name`
// and the tensor otherwise. Sorted by name; `offset` is from the start of
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
struct LayerWeights {
  ConstTensorView q_proj, k_proj, v_proj, o_proj;  // required
  ConstTensorView q_bias, k_bias, v_bias, o_bias;  // optional (absent: empty view)
};

class Model {
 public:
  // Loads `dir`: config.json, then model.safetensors if present, else the
  // shards listed in model.safetensors.index.json ({"weight_map": {tensor:
  // shard file}}; shards are plain file names beside the index, each mapped
  // once, and must hold exactly the tensors the index assigns them).
  // NotFound for a missing config.json, weights file, shard or tensor;
  // InvalidArgument naming the file and tensor for invalid config.json, a
  // bad safetensors header length, header JSON, offsets outside the file or
  // overlapping, a dtype other than F32/BF16/F16, a shape that does not match
  // the config; Unimplemented for another tensor naming scheme.
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
  // Learned absolute positions [max_positions, hidden_size] (kLearned only).
  ConstTensorView position_table() const { return position_table_; }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // OutOfRange naming the layer for an index outside [0, num_layers).
  absl::StatusOr<const LayerWeights*> layer(int64_t index) const;
  // Bytes of the weights this model uses: read in place from file mappings,
  // and held in memory (F16 converted, misaligned copied, or generated).
  int64_t mapped_bytes() const { return mapped_bytes_; }
  int64_t resident_bytes() const { return resident_bytes_; }

 private:
  Model() = default;
  struct Storage;
  std::string name_, source_;
  ModelConfig config_;
  ConstTensorView embed_tokens_, position_table_;
  std::vector<LayerWeights> layers_;
  int64_t mapped_bytes_ = 0, resident_bytes_ = 0;
  std::unique_ptr<Storage> storage_;  // mappings and owned tensors
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
