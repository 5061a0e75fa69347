// Writes the seed corpus of the fuzz targets: a handful of small valid and
// near-valid inputs per target, under <dir>/<target>/seed-<name>.
//   build-fuzz/bin/ropeattn_fuzz_seeds tests/fuzz/corpus
// (cmake --build build-fuzz --target ropeattn_fuzz_seeds). The output is
// committed; rerun this after changing it.
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ropeattn/v1/attention.pb.h"
#include "tests/fuzz/safetensors_writer.h"

namespace ropeattn::fuzz {
namespace {

std::string g_root;

void Write(const std::string& target, const std::string& name, const std::string& bytes) {
  const std::string dir = absl::StrCat(g_root, "/", target);
  ::mkdir(g_root.c_str(), 0755);
  ::mkdir(dir.c_str(), 0755);
  std::ofstream out(absl::StrCat(dir, "/seed-", name), std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "cannot write %s/%s\n", dir.c_str(), name.c_str());
    std::exit(1);
  }
}

void Write(const std::string& target, const std::string& name,
           const google::protobuf::Message& m) {
  Write(target, name, m.SerializeAsString());
}

// A [dims] tensor of small deterministic values (f32 or bf16).
void Fill(v1::Tensor* t, std::vector<int64_t> dims, v1::DType dtype = v1::DTYPE_F32,
          uint32_t seed = 1) {
  t->Clear();
  t->set_dtype(dtype);
  int64_t n = 1;
  for (int64_t d : dims) {
    t->add_shape(d);
    n *= d;
  }
  std::string data;
  uint32_t x = seed * 2654435761u + 12345u;
  for (int64_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    const float f = static_cast<float>(static_cast<int32_t>(x >> 8) % 2001 - 1000) / 1000.0f;
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if (dtype == v1::DTYPE_F32) {
      data.append(reinterpret_cast<const char*>(&bits), 4);
    } else {
      const uint16_t b = static_cast<uint16_t>(bits >> 16);
      data.append(reinterpret_cast<const char*>(&b), 2);
    }
  }
  t->set_data(data);
}

// An f32 tensor with exactly these values.
void Values(v1::Tensor* t, std::vector<int64_t> dims, const std::vector<float>& values) {
  t->Clear();
  t->set_dtype(v1::DTYPE_F32);
  for (int64_t d : dims) t->add_shape(d);
  t->set_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4));
}

// Three tokens of head_dim 8 whose last query's logit against key 1 is
// +inf + -inf = NaN while its other logits stay finite (every input finite).
const std::vector<float> kNanQ = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f,  //
                                  0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f,  //
                                  1e29f, 1e29f, 1e29f, 1e29f, 1e29f, 1e29f, 1e29f, 1e29f};
const std::vector<float> kNanK = {1, 1, 1, 1, 1, 1, 1, 1,  //
                                  1e29f, 1e29f, 1e29f, 1e29f, -1e29f, -1e29f, -1e29f, -1e29f,  //
                                  1, 1, 1, 1, 1, 1, 1, 1};

void Rope(v1::RopeSpec* r, const std::string& type, double factor = 0, int64_t l0 = 0) {
  r->mutable_scaling()->set_rope_type(type);
  if (factor != 0) r->mutable_scaling()->set_factor(factor);
  if (l0 != 0) r->mutable_scaling()->set_original_max_position_embeddings(l0);
}

void AttendSeeds() {
  const char* t = "attend_fuzz";
  {  // causal MHA, default RoPE
    v1::AttendRequest r;
    auto* s = r.mutable_spec();
    s->set_heads(2);
    s->set_head_dim(8);
    s->set_causal(true);
    s->mutable_rope()->set_theta(10000);
    Fill(r.mutable_q(), {1, 4, 2, 8}, v1::DTYPE_F32, 1);
    Fill(r.mutable_k(), {1, 4, 2, 8}, v1::DTYPE_F32, 2);
    Fill(r.mutable_v(), {1, 4, 2, 8}, v1::DTYPE_F32, 3);
    Write(t, "causal-rope", r);
  }
  {  // GQA, bf16 K/V, ALiBi, probs, offsets and padding, bf16 out
    v1::AttendRequest r;
    auto* s = r.mutable_spec();
    s->set_heads(4);
    s->set_kv_heads(2);
    s->set_head_dim(4);
    s->set_causal(true);
    s->mutable_alibi();
    Fill(r.mutable_q(), {2, 2, 4, 4}, v1::DTYPE_F32, 4);
    Fill(r.mutable_k(), {2, 5, 2, 4}, v1::DTYPE_BF16, 5);
    Fill(r.mutable_v(), {2, 5, 2, 6}, v1::DTYPE_BF16, 6);
    r.add_q_offsets(3);
    r.add_q_offsets(1);
    r.add_key_lengths(5);
    r.add_key_lengths(3);
    r.set_return_probs(true);
    r.set_out_dtype(v1::DTYPE_BF16);
    Write(t, "gqa-alibi-probs", r);
  }
  {  // T5 bias, bidirectional
    v1::AttendRequest r;
    auto* s = r.mutable_spec();
    s->set_heads(2);
    s->set_head_dim(4);
    auto* t5 = s->mutable_t5();
    Fill(t5->mutable_table(), {8, 2}, v1::DTYPE_F32, 7);
    t5->set_max_distance(16);
    t5->set_bidirectional(true);
    Fill(r.mutable_q(), {1, 3, 2, 4}, v1::DTYPE_F32, 8);
    Fill(r.mutable_k(), {1, 3, 2, 4}, v1::DTYPE_F32, 9);
    Fill(r.mutable_v(), {1, 3, 2, 4}, v1::DTYPE_F32, 10);
    Write(t, "t5", r);
  }
  {  // sliding window, soft-cap, scale, YaRN, interleaved, a long prefill
    v1::AttendRequest r;
    auto* s = r.mutable_spec();
    s->set_heads(1);
    s->set_head_dim(8);
    s->set_causal(true);
    s->set_window(3);
    s->set_softcap(30);
    s->set_scale(0.25);
    s->mutable_rope()->set_layout(v1::ROPE_LAYOUT_INTERLEAVED);
    Rope(s->mutable_rope(), "yarn", 4, 8);
    Fill(r.mutable_q(), {1, 20, 1, 8}, v1::DTYPE_F32, 11);
    Fill(r.mutable_k(), {1, 20, 1, 8}, v1::DTYPE_F32, 12);
    Fill(r.mutable_v(), {1, 20, 1, 8}, v1::DTYPE_F32, 13);
    Write(t, "window-softcap-yarn", r);
  }
  {  // llama3 and longrope with partial rotary
    v1::AttendRequest r;
    auto* s = r.mutable_spec();
    s->set_heads(2);
    s->set_head_dim(8);
    s->mutable_rope()->set_rotary_dim(4);
    Rope(s->mutable_rope(), "longrope", 4, 4);
    for (double f : {1.0, 1.5}) s->mutable_rope()->mutable_scaling()->add_short_factor(f);
    for (double f : {2.0, 3.0}) s->mutable_rope()->mutable_scaling()->add_long_factor(f);
    Fill(r.mutable_q(), {1, 2, 2, 8}, v1::DTYPE_F32, 14);
    Fill(r.mutable_k(), {1, 6, 2, 8}, v1::DTYPE_F32, 15);
    Fill(r.mutable_v(), {1, 6, 2, 8}, v1::DTYPE_F32, 16);
    Write(t, "longrope-partial", r);
    Rope(s->mutable_rope(), "llama3", 8, 4);
    s->mutable_rope()->mutable_scaling()->clear_short_factor();
    s->mutable_rope()->mutable_scaling()->clear_long_factor();
    Write(t, "llama3-partial", r);
  }
  {  // layer mode on the demo model
    v1::AttendRequest r;
    r.mutable_spec()->set_causal(true);
    auto* l = r.mutable_layer();
    l->set_model("demo");
    l->set_layer(1);
    Fill(l->mutable_hidden(), {1, 3, 128}, v1::DTYPE_F32, 17);
    r.add_q_offsets(5);
    Write(t, "layer-demo", r);
    Fill(l->mutable_hidden(), {2, 0, 128}, v1::DTYPE_BF16, 18);
    r.clear_q_offsets();
    Write(t, "layer-empty", r);
  }
  {  // regression: a NaN logit reached the softmax's exp (UBSan: NaN to int)
    v1::AttendRequest r;
    r.mutable_spec()->set_heads(1);
    r.mutable_spec()->set_head_dim(8);
    r.mutable_spec()->set_causal(true);
    Values(r.mutable_q(), {1, 3, 1, 8}, kNanQ);
    Values(r.mutable_k(), {1, 3, 1, 8}, kNanK);
    Values(r.mutable_v(), {1, 3, 1, 8}, kNanK);
    Write(t, "regression-nan-logit", r);
  }
  {  // near-valid: empty query block, and a byte length one short
    v1::AttendRequest r;
    auto* s = r.mutable_spec();
    s->set_heads(2);
    s->set_head_dim(4);
    Fill(r.mutable_q(), {3, 0, 2, 4});
    Fill(r.mutable_k(), {3, 2, 2, 4});
    Fill(r.mutable_v(), {3, 2, 2, 4});
    r.set_return_probs(true);
    Write(t, "empty-q", r);
    Fill(r.mutable_q(), {3, 1, 2, 4});
    r.mutable_q()->mutable_data()->pop_back();
    Write(t, "short-q", r);
  }
}

void EncodeSeeds() {
  const char* t = "encode_fuzz";
  {
    v1::EncodeRequest r;
    auto* op = r.mutable_sinusoidal();
    op->set_num_positions(6);
    op->set_d_model(8);
    op->set_first_position(3);
    op->set_layout(v1::SINUSOIDAL_LAYOUT_SIN_COS_HALF);
    Write(t, "sinusoidal", r);
  }
  {
    v1::EncodeRequest r;
    auto* op = r.mutable_rope_frequencies();
    op->set_head_dim(16);
    op->set_seq_len(64);
    Rope(op->mutable_rope(), "dynamic", 2, 16);
    Write(t, "rope-frequencies-dynamic", r);
  }
  {
    v1::EncodeRequest r;
    auto* op = r.mutable_rope_cos_sin();
    op->set_head_dim(8);
    op->set_seq_len(32);
    Rope(op->mutable_rope(), "yarn", 4, 8);
    op->mutable_rope()->mutable_scaling()->set_attention_factor(1.5);
    for (int64_t p : {0, 1, 7, 31}) op->add_positions(p);
    Write(t, "rope-cos-sin-yarn", r);
  }
  {
    v1::EncodeRequest r;
    auto* op = r.mutable_rope_apply();
    Fill(op->mutable_x(), {2, 3, 2, 8}, v1::DTYPE_BF16, 20);
    op->add_offsets(0);
    op->add_offsets(9);
    op->set_inverse(true);
    Rope(op->mutable_rope(), "ntk", 2);
    Write(t, "rope-apply-offsets", r);
    // Regression: an empty x whose other dims overflow int64 strides (UBSan).
    {
      v1::EncodeRequest e = r;
      v1::Tensor* x = e.mutable_rope_apply()->mutable_x();
      x->Clear();
      x->set_dtype(v1::DTYPE_F32);
      for (int64_t d : {int64_t{1}, int64_t{0}, int64_t{1} << 61, int64_t{8}}) x->add_shape(d);
      e.mutable_rope_apply()->clear_offsets();
      e.mutable_rope_apply()->add_offsets(0);
      Write(t, "regression-rope-apply-empty-huge", e);
    }
    op->clear_offsets();
    for (int64_t p = 0; p < 6; ++p) op->add_positions(p * 3);
    op->set_inverse(false);
    Rope(op->mutable_rope(), "linear", 2);
    Write(t, "rope-apply-positions", r);
  }
  {
    v1::EncodeRequest r;
    auto* op = r.mutable_alibi();
    op->set_heads(6);
    op->set_q_len(3);
    op->set_k_len(5);
    op->set_q_offset(2);
    Write(t, "alibi", r);
    op->set_bidirectional(true);
    op->set_q_len(0);
    Write(t, "alibi-slopes", r);
    op->set_heads(0);
    Write(t, "alibi-no-heads", r);
  }
  {
    v1::EncodeRequest r;
    auto* op = r.mutable_t5();
    op->set_num_buckets(8);
    op->set_max_distance(20);
    op->set_q_len(4);
    op->set_k_len(6);
    op->set_q_offset(2);
    Fill(op->mutable_table(), {8, 3}, v1::DTYPE_F32, 21);
    Write(t, "t5-table", r);
    op->clear_table();
    op->set_bidirectional(true);
    Write(t, "t5-buckets", r);
  }
}

// decode_fuzz's records: ctl, little-endian length, DecodeRequest.
void Record(std::string* out, uint8_t ctl, const v1::DecodeRequest& r) {
  const std::string m = r.SerializeAsString();
  out->push_back(static_cast<char>(ctl));
  out->push_back(static_cast<char>(m.size() & 0xff));
  out->push_back(static_cast<char>(m.size() >> 8));
  *out += m;
}

v1::DecodeRequest Open(int heads, int kv_heads, int head_dim, int64_t max_context) {
  v1::DecodeRequest r;
  auto* o = r.mutable_open();
  o->mutable_spec()->set_heads(heads);
  o->mutable_spec()->set_kv_heads(kv_heads);
  o->mutable_spec()->set_head_dim(head_dim);
  o->set_max_context(max_context);
  return r;
}

v1::DecodeRequest Step(uint64_t seq, int tokens, int heads, int kv_heads, int head_dim,
                       v1::DType dtype = v1::DTYPE_F32) {
  v1::DecodeRequest r;
  auto* s = r.mutable_step();
  s->set_seq(seq);
  Fill(s->mutable_q(), {1, tokens, heads, head_dim}, dtype, static_cast<uint32_t>(seq * 3 + 1));
  Fill(s->mutable_k(), {1, tokens, kv_heads, head_dim}, dtype, static_cast<uint32_t>(seq * 3 + 2));
  Fill(s->mutable_v(), {1, tokens, kv_heads, head_dim}, dtype, static_cast<uint32_t>(seq * 3 + 3));
  return r;
}

v1::DecodeRequest Truncate(uint64_t seq, int64_t position) {
  v1::DecodeRequest r;
  r.mutable_truncate()->set_seq(seq);
  r.mutable_truncate()->set_position(position);
  return r;
}

v1::DecodeRequest Fork(uint64_t seq) {
  v1::DecodeRequest r;
  r.mutable_fork()->set_seq(seq);
  return r;
}

v1::DecodeRequest Close(uint64_t seq) {
  v1::DecodeRequest r;
  r.mutable_close()->set_seq(seq);
  return r;
}

v1::DecodeRequest Attach(const std::string& id) {
  v1::DecodeRequest r;
  r.mutable_attach()->set_session_id(id);
  return r;
}

void DecodeSeeds() {
  const char* t = "decode_fuzz";
  {  // softmax f32, RoPE: prefill, decode, truncate, fork, close
    std::string in;
    v1::DecodeRequest open = Open(4, 2, 8, 32);
    open.mutable_open()->mutable_spec()->mutable_rope()->set_theta(10000);
    Record(&in, 0, open);
    Record(&in, 0, Step(1, 5, 4, 2, 8));
    Record(&in, 0, Step(2, 1, 4, 2, 8));
    Record(&in, 0, Truncate(3, 4));
    Record(&in, 0, Fork(4));
    Record(&in, 0, Step(5, 2, 4, 2, 8));
    Record(&in, 1, Attach("1"));  // the fork
    Record(&in, 1, Step(6, 1, 4, 2, 8));
    Record(&in, 0, Close(7));
    Write(t, "softmax-rope-fork", in);
  }
  {  // far start, a raw KV prefix, steps, an export; a rotated-prefix open from it
    std::string in;
    v1::DecodeRequest open = Open(4, 2, 8, 32);
    auto* o = open.mutable_open();
    o->mutable_spec()->mutable_rope()->set_theta(10000);
    o->set_start_position(999990);
    const v1::DecodeRequest tokens = Step(0, 3, 4, 2, 8);
    *o->mutable_prefix()->mutable_k() = tokens.step().k();
    *o->mutable_prefix()->mutable_v() = tokens.step().v();
    o->mutable_prefix()->set_key_form(v1::KEY_FORM_RAW);
    Record(&in, 0, open);
    Record(&in, 0, Step(1, 2, 4, 2, 8));
    v1::DecodeRequest export_kv;
    export_kv.mutable_export_kv()->set_seq(2);
    Record(&in, 0, export_kv);
    o->mutable_prefix()->set_key_form(v1::KEY_FORM_ROTATED);
    Record(&in, 1, open);
    Record(&in, 1, Step(3, 1, 4, 2, 8));
    Write(t, "prefix-export", in);
  }
  {  // bf16 cache, ALiBi, window, bf16 out; resumable, detached, re-attached, reaped
    std::string in;
    v1::DecodeRequest open = Open(2, 1, 4, 16);
    auto* o = open.mutable_open();
    o->set_kv_dtype(v1::DTYPE_BF16);
    o->set_out_dtype(v1::DTYPE_BF16);
    o->set_resumable(true);
    o->set_idle_ttl_seconds(60);
    o->mutable_spec()->mutable_alibi();
    o->mutable_spec()->set_window(4);
    Record(&in, 0, open);
    Record(&in, 0 | 4, Step(1, 3, 2, 1, 4, v1::DTYPE_BF16));  // then the stream ends
    Record(&in, 1, Attach("0"));
    Record(&in, 1 | 16, Step(2, 1, 2, 1, 4));  // the reaper runs after it
    Record(&in, 2, Attach("0"));               // held by stream 1: refused
    Write(t, "bf16-alibi-resume", in);
  }
  {  // int8 cache with RoPE: prefill, steps, truncate, fork, export
    std::string in;
    v1::DecodeRequest open = Open(4, 2, 8, 32);
    open.mutable_open()->set_kv_dtype(v1::DTYPE_INT8);
    open.mutable_open()->mutable_spec()->mutable_rope();
    Record(&in, 0, open);
    Record(&in, 0, Step(1, 20, 4, 2, 8));
    Record(&in, 0, Step(2, 1, 4, 2, 8));
    Record(&in, 0, Truncate(3, 5));
    Record(&in, 0, Fork(4));
    v1::DecodeRequest export_kv;
    export_kv.mutable_export_kv()->set_seq(5);
    Record(&in, 0, export_kv);
    Write(t, "int8", in);
  }
  {  // linear attention with RoPE; truncate is unimplemented
    std::string in;
    v1::DecodeRequest open = Open(2, 2, 4, 8);
    open.mutable_open()->set_kind(v1::ATTENTION_KIND_LINEAR);
    open.mutable_open()->set_v_dim(6);
    open.mutable_open()->mutable_spec()->mutable_rope();
    Record(&in, 0, open);
    v1::DecodeRequest step = Step(1, 2, 2, 2, 4);
    Fill(step.mutable_step()->mutable_v(), {1, 2, 2, 6}, v1::DTYPE_F32, 30);
    Record(&in, 0, step);
    Record(&in, 0, Truncate(2, 1));
    Record(&in, 0, Fork(3));
    Write(t, "linear", in);
  }
  {  // dynamic NTK: the cache is re-rotated when the length passes L0
    std::string in;
    v1::DecodeRequest open = Open(2, 2, 8, 24);
    Rope(open.mutable_open()->mutable_spec()->mutable_rope(), "dynamic", 2, 4);
    Record(&in, 0, open);
    Record(&in, 0, Step(1, 3, 2, 2, 8));
    Record(&in, 0, Step(2, 3, 2, 2, 8));
    Record(&in, 0, Truncate(3, 2));
    Record(&in, 0, Step(4, 1, 2, 2, 8));
    Write(t, "dynamic-ntk", in);
  }
  {  // layer mode on the demo model; an operator closes it
    std::string in;
    v1::DecodeRequest open;
    open.mutable_open()->set_model("demo");
    open.mutable_open()->set_layer(0);
    open.mutable_open()->set_max_context(16);
    Record(&in, 1, open);
    v1::DecodeRequest step;
    step.mutable_step()->set_seq(1);
    Fill(step.mutable_step()->mutable_hidden(), {1, 2, 128}, v1::DTYPE_F32, 31);
    Record(&in, 1, step);
    Record(&in, 0 | 32, Attach("9"));  // unknown; then stream 1's session is closed
    Record(&in, 1, step);
    Write(t, "layer-demo", in);
  }
  {  // regression: a step whose q.k overflows to NaN logits
    std::string in;
    Record(&in, 0, Open(1, 1, 8, 8));
    v1::DecodeRequest step = Step(1, 3, 1, 1, 8);
    Values(step.mutable_step()->mutable_q(), {1, 3, 1, 8}, kNanQ);
    Values(step.mutable_step()->mutable_k(), {1, 3, 1, 8}, kNanK);
    Record(&in, 0, step);
    Write(t, "regression-nan-logit", in);
  }
  {  // near-valid: a step before open, a step past max_context
    std::string in;
    Record(&in, 0, Step(1, 1, 2, 2, 4));
    Record(&in, 0, Open(2, 2, 4, 2));
    Record(&in, 0, Step(2, 3, 2, 2, 4));
    Write(t, "out-of-order", in);
  }
}

void EmbedSeeds() {
  const char* t = "embed_fuzz";
  v1::EmbedRequest r;
  r.set_model("demo");
  for (int64_t id : {1, 2, 3, 255}) r.add_token_ids(id);
  Write(t, "tokens", r);
  r.add_shape(2);
  r.add_shape(2);
  r.add_q_offsets(0);
  r.add_q_offsets(7);
  r.set_out_dtype(v1::DTYPE_BF16);
  Write(t, "batch-bf16", r);
  r.set_token_ids(3, 256);
  Write(t, "id-past-vocab", r);
  {  // regression: an empty [0, 2^62 + 1] batch overflowed the answer's strides (UBSan)
    v1::EmbedRequest e;
    e.set_model("demo");
    e.add_shape(0);
    e.add_shape((int64_t{1} << 62) + 1);
    Write(t, "regression-empty-huge-shape", e);
  }
  r.set_model("nope");
  Write(t, "unknown-model", r);
}

void ConfigSeeds() {
  const char* t = "model_config_fuzz";
  Write(t, "llama3", R"({"architectures":["LlamaForCausalLM"],"model_type":"llama",
"hidden_size":4096,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,
"max_position_embeddings":131072,"num_hidden_layers":32,"rope_theta":500000.0,
"rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
"original_max_position_embeddings":8192,"rope_type":"llama3"},"attention_bias":false})");
  Write(t, "yarn", R"({"model_type":"qwen2","hidden_size":64,"num_attention_heads":4,
"vocab_size":100,"max_position_embeddings":32768,"num_hidden_layers":2,
"rope_scaling":{"type":"yarn","factor":4.0,"original_max_position_embeddings":8192,
"beta_fast":32,"beta_slow":1,"mscale":0.707,"mscale_all_dim":1.0}})");
  Write(t, "longrope", R"({"model_type":"phi3","hidden_size":32,"num_attention_heads":2,
"vocab_size":10,"max_position_embeddings":131072,"original_max_position_embeddings":4096,
"num_hidden_layers":1,"partial_rotary_factor":0.5,
"rope_scaling":{"type":"longrope","short_factor":[1.0,1.1,1.2,1.3],
"long_factor":[2.0,3.0,4.0,5.0]}})");
  Write(t, "gptj", R"({"model_type":"gptj","n_embd":64,"n_head":4,"vocab_size":50,
"n_positions":2048,"n_layer":2,"rotary_dim":8})");
  Write(t, "neox", R"({"model_type":"gpt_neox","hidden_size":64,"num_attention_heads":4,
"vocab_size":50,"max_position_embeddings":2048,"num_hidden_layers":2,"rotary_pct":0.25,
"rotary_emb_base":10000,"rope_scaling":{"type":"dynamic","factor":2.0}})");
  Write(t, "rope-parameters", R"({"model_type":"llama","hidden_size":64,"num_attention_heads":4,
"head_dim":32,"vocab_size":50,"max_position_embeddings":4096,"num_hidden_layers":2,
"rope_parameters":{"rope_type":"linear","factor":2.0,"rope_theta":1000000}})");
  Write(t, "bert", R"({"model_type":"bert","hidden_size":64,"num_attention_heads":4,
"vocab_size":50,"max_position_embeddings":512,"num_hidden_layers":2})");
  Write(t, "mrope", R"({"model_type":"qwen2_vl","hidden_size":64,"num_attention_heads":4,
"vocab_size":50,"max_position_embeddings":512,"num_hidden_layers":2,
"rope_scaling":{"type":"mrope","mrope_section":[2,1,1]}})");
  Write(t, "factor-without-rule", R"({"hidden_size":64,"num_attention_heads":4,"vocab_size":5,
"max_position_embeddings":16,"num_hidden_layers":1,"rope_scaling":{"factor":2}})");
  Write(t, "truncated", R"({"hidden_size":64,"num_attention_heads":4,"vocab_)");
  Write(t, "gemma3", R"({"model_type":"gemma3_text","hidden_size":64,"num_attention_heads":4,
"num_key_value_heads":1,"head_dim":16,"vocab_size":50,"max_position_embeddings":512,
"num_hidden_layers":3,"query_pre_attn_scalar":16,"sliding_window":8,
"layer_types":["sliding_attention","sliding_attention","full_attention"],
"rope_parameters":{"full_attention":{"rope_type":"linear","factor":8.0,"rope_theta":1000000},
"sliding_attention":{"rope_type":"default","rope_theta":10000}}})");
  Write(t, "qwen3-window", R"({"model_type":"qwen3","hidden_size":64,"num_attention_heads":4,
"num_key_value_heads":2,"head_dim":32,"vocab_size":50,"max_position_embeddings":512,
"num_hidden_layers":3,"use_sliding_window":true,"sliding_window":16,"max_window_layers":1,
"rms_norm_eps":1e-6})");
}

void SafetensorsSeeds() {
  const char* t = "safetensors_fuzz";
  Write(t, "f32", SafetensorsBytes(TinyTensors("F32", 4, false)));
  Write(t, "bf16-biases", SafetensorsBytes(TinyTensors("BF16", 2, true), 0, true));
  Write(t, "f16-misaligned", SafetensorsBytes(TinyTensors("F16", 2, false), 3));
  Write(t, "f32-misaligned", SafetensorsBytes(TinyTensors("F32", 4, true), 1));
  std::vector<StTensor> extra = TinyTensors("F32", 4, false);
  extra.push_back({"model.layers.0.mlp.up_proj.weight", "I64", {2, 3}, 8});
  Write(t, "extra-i64", SafetensorsBytes(extra));
  std::vector<StTensor> other = {{"gpt_neox.layers.0.attention.query_key_value.weight", "F32",
                                  {3, 2}, 4}};
  Write(t, "other-naming", SafetensorsBytes(other));
  std::string truncated = SafetensorsBytes(TinyTensors("F32", 4, false));
  truncated.resize(truncated.size() - 5);
  Write(t, "truncated", truncated);
  Write(t, "index", TinyIndex());
  // Regression: a shard name past NAME_MAX made Load answer INTERNAL.
  Write(t, "regression-index-long-shard-name",
        absl::StrCat(R"({"weight_map":{"model.embed_tokens.weight":")", std::string(300, 'x'),
                     R"(.safetensors"}})"));
}

}  // namespace
}  // namespace ropeattn::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR (tests/fuzz/corpus)\n", argv[0]);
    return 2;
  }
  ropeattn::fuzz::g_root = argv[1];
  ropeattn::fuzz::AttendSeeds();
  ropeattn::fuzz::EncodeSeeds();
  ropeattn::fuzz::DecodeSeeds();
  ropeattn::fuzz::EmbedSeeds();
  ropeattn::fuzz::ConfigSeeds();
  ropeattn::fuzz::SafetensorsSeeds();
  return 0;
}
