// A plain fp64 attention layer as transformers computes it for each served
// family, written from the modeling code's steps, not from server/: it takes
// the checkpoint's raw tensors (fused ones as stored) and does the split,
// norms, rotation, attention and output projection itself, so a test that
// compares the server against it catches a misread layout on either side.
//
// x is [seq, hidden] for one sequence at positions start .. start + seq - 1;
// the result is the attention block's output [seq, hidden] (o_proj / dense /
// output.dense applied, no residual).
#ifndef ROPEATTN_TESTS_REFERENCE_LAYER_REF_H_
#define ROPEATTN_TESTS_REFERENCE_LAYER_REF_H_

#include <cstdint>
#include <vector>

namespace ropeattn::ref {

enum class RefQkv {
  kSeparate,  // q_proj, k_proj, v_proj
  kConcat,    // Phi-3 qkv_proj: rows [q; k; v]
  kPerHead,   // GPT-NeoX query_key_value: view(..., heads, 3 * d).chunk(3, -1)
};
enum class RefNorm { kNone, kRms, kRmsOnePlus };

struct LayerRefParams {
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0;
  RefQkv qkv = RefQkv::kSeparate;
  // Weights as stored, [out, in] row-major; biases empty when absent.
  std::vector<double> q, k, v, fused, o;
  std::vector<double> q_bias, k_bias, v_bias, fused_bias, o_bias;
  RefNorm norm = RefNorm::kNone;
  std::vector<double> q_norm, k_norm;  // [head_dim]
  double eps = 1e-6;
  // RoPE (rope false: none).
  bool rope = false;
  int64_t rotary_dim = 0;
  bool interleaved = false;
  std::vector<double> inv_freq;  // rotary_dim / 2
  double attention_factor = 1.0;
  // Attention.
  double scale = 0.0;  // 0: head_dim^-0.5
  double softcap = 0.0;
  int64_t window = 0;  // keys with q_pos - k_pos < window
  bool causal = true;
  int64_t start = 0;  // position of token 0
};

std::vector<double> LayerRef(const LayerRefParams& p, const std::vector<double>& x, int64_t seq);

}  // namespace ropeattn::ref

#endif  // ROPEATTN_TESTS_REFERENCE_LAYER_REF_H_
