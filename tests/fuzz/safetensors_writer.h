// Writes small safetensors files (8-byte little-endian header length, JSON
// header, data) and the tiny checkpoint the safetensors fuzz target loads
// them into. Shared by safetensors_fuzz.cc and make_seeds.cc.
#ifndef ROPEATTN_TESTS_FUZZ_SAFETENSORS_WRITER_H_
#define ROPEATTN_TESTS_FUZZ_SAFETENSORS_WRITER_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ropeattn::fuzz {

// The checkpoint's config.json: a Llama-style model of hidden 8, 2 heads
// over 1 kv head of 4, vocab 4, one layer. Its tensors:
//   model.embed_tokens.weight [4, 8], model.layers.0.self_attn.q_proj.weight
//   [8, 8], k_proj / v_proj [4, 8], o_proj [8, 8] (biases optional).
inline constexpr char kTinyConfig[] = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
  "vocab_size": 4, "max_position_embeddings": 16, "num_hidden_layers": 1,
  "rope_theta": 10000.0
})";

struct StTensor {
  std::string name;
  std::string dtype;  // F32, BF16, F16, I64, ...
  std::vector<int64_t> shape;
  int elem_bytes = 4;
};

// The tiny model's tensors in `dtype` (elem_bytes its size), biases
// included when asked.
inline std::vector<StTensor> TinyTensors(const std::string& dtype, int elem_bytes, bool biases) {
  const std::string p = "model.layers.0.self_attn.";
  std::vector<StTensor> t = {
      {"model.embed_tokens.weight", dtype, {4, 8}, elem_bytes},
      {p + "q_proj.weight", dtype, {8, 8}, elem_bytes},
      {p + "k_proj.weight", dtype, {4, 8}, elem_bytes},
      {p + "v_proj.weight", dtype, {4, 8}, elem_bytes},
      {p + "o_proj.weight", dtype, {8, 8}, elem_bytes},
  };
  if (biases) {
    t.push_back({p + "q_proj.bias", dtype, {8}, elem_bytes});
    t.push_back({p + "k_proj.bias", dtype, {4}, elem_bytes});
    t.push_back({p + "v_proj.bias", dtype, {4}, elem_bytes});
  }
  return t;
}

// A whole file: tensors packed in order, data filled with a small pattern
// (0.125-ish values in f32 / bf16 / f16 bits). `header_pad` spaces make the
// header length differ from a multiple of 8 (misaligned data when odd).
inline std::string SafetensorsBytes(const std::vector<StTensor>& tensors, int header_pad = 0,
                                    bool metadata = false) {
  std::vector<std::string> entries;
  if (metadata) entries.push_back(R"("__metadata__":{"format":"pt"})");
  uint64_t offset = 0;
  std::string data;
  for (const StTensor& t : tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    const uint64_t bytes = static_cast<uint64_t>(n) * t.elem_bytes;
    entries.push_back(absl::StrCat("\"", t.name, "\":{\"dtype\":\"", t.dtype, "\",\"shape\":[",
                                   absl::StrJoin(t.shape, ","), "],\"data_offsets\":[", offset,
                                   ",", offset + bytes, "]}"));
    for (int64_t i = 0; i < n; ++i) {
      // f32 0.125 + i/1024, bf16 and f16 near 0.125: finite in every dtype.
      if (t.elem_bytes == 4) {
        const float f = 0.125f + static_cast<float>(i % 64) / 1024.0f;
        char b[4];
        std::memcpy(b, &f, 4);
        data.append(b, 4);
      } else if (t.elem_bytes == 2) {
        const uint16_t h = t.dtype == "F16" ? static_cast<uint16_t>(0x3000 + (i % 64))
                                            : static_cast<uint16_t>(0x3e00 + (i % 64));
        data.push_back(static_cast<char>(h & 0xff));
        data.push_back(static_cast<char>(h >> 8));
      } else {
        data.append(static_cast<size_t>(t.elem_bytes), static_cast<char>(i & 0x7f));
      }
    }
    offset += bytes;
  }
  std::string header = absl::StrCat("{", absl::StrJoin(entries, ","), "}");
  header.append(static_cast<size_t>(header_pad), ' ');
  std::string out(8, '\0');
  const uint64_t len = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  return out + header + data;
}

// The sharded form of the tiny model: two shards and the index naming them.
inline constexpr char kShard1[] = "model-00001-of-00002.safetensors";
inline constexpr char kShard2[] = "model-00002-of-00002.safetensors";
inline std::vector<StTensor> ShardTensors(int shard) {
  std::vector<StTensor> all = TinyTensors("F32", 4, false);
  if (shard == 1) return {all[0], all[1], all[2]};
  return {all[3], all[4]};
}
inline std::string TinyIndex() {
  std::vector<std::string> entries;
  for (int shard : {1, 2}) {
    for (const StTensor& t : ShardTensors(shard)) {
      entries.push_back(absl::StrCat("\"", t.name, "\":\"", shard == 1 ? kShard1 : kShard2, "\""));
    }
  }
  return absl::StrCat(R"({"metadata":{"total_size":768},"weight_map":{)",
                      absl::StrJoin(entries, ","), "}}");
}

}  // namespace ropeattn::fuzz

#endif  // ROPEATTN_TESTS_FUZZ_SAFETENSORS_WRITER_H_
