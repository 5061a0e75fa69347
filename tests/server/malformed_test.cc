// Issue 11's generated malformed-request matrix, through a real server on a
// loopback port: every RPC and every Decode operation, mutated field by field
// (overflowing shape products, zero and negative dims, dtype/byte mismatches,
// out-of-range enums and positions, non-finite and out-of-range floats,
// oversize strings, operations out of order). Each case asserts its exact
// status code and that the message names the field; after the whole matrix
// the server still reports SERVING and answers a valid Attend exactly.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "ropeattn/v1/attention.grpc.pb.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "server/server.h"
#include "server/wire_bound.h"
#include "tests/server/server_test_util.h"

namespace ropeattn::testing {
namespace {

using Code = grpc::StatusCode;
constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

v1::Tensor Wire(std::vector<int64_t> dims, v1::DType dtype = v1::DTYPE_F32) {
  v1::Tensor t;
  t.set_dtype(dtype);
  int64_t n = 1;
  for (int64_t d : dims) {
    t.add_shape(d);
    n *= d;
  }
  std::string data;
  if (dtype == v1::DTYPE_BF16) {
    for (int64_t i = 0; i < n; ++i) {
      float f = 0.25f * static_cast<float>(i % 7) - 0.5f;
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      const uint16_t top = static_cast<uint16_t>(bits >> 16);
      data.append(reinterpret_cast<const char*>(&top), 2);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float f = 0.25f * static_cast<float>(i % 7) - 0.5f;
      data.append(reinterpret_cast<const char*>(&f), 4);
    }
  }
  t.set_data(data);
  return t;
}

enum class Rpc { kAttend, kEncode, kEmbed, kDecode, kGetSession, kCloseSession, kGetModel };

struct Case {
  std::string name;
  Rpc rpc = Rpc::kAttend;
  v1::AttendRequest attend;
  v1::EncodeRequest encode;
  v1::EmbedRequest embed;
  // Every operation but the last must succeed; the last is the case.
  std::vector<v1::DecodeRequest> decode;
  std::string id;  // GetSession / CloseSession / GetModel
  Code code = Code::INVALID_ARGUMENT;
  std::string names;  // the message must contain this
};

// ---------------------------------------------------------------- bases --

v1::AttendRequest BaseAttend(v1::DType dtype = v1::DTYPE_F32) {
  v1::AttendRequest r;
  r.mutable_spec()->set_heads(2);
  r.mutable_spec()->set_head_dim(4);
  r.mutable_spec()->mutable_rope();
  *r.mutable_q() = Wire({1, 3, 2, 4}, dtype);
  *r.mutable_k() = Wire({1, 3, 2, 4}, dtype);
  *r.mutable_v() = Wire({1, 3, 2, 4}, dtype);
  return r;
}

v1::DecodeRequest BaseOpen() {
  v1::DecodeRequest d;
  d.mutable_open()->mutable_spec()->set_heads(2);
  d.mutable_open()->mutable_spec()->set_head_dim(4);
  d.mutable_open()->mutable_spec()->mutable_rope();
  d.mutable_open()->set_max_context(16);
  return d;
}

v1::DecodeRequest BaseStep(v1::DType dtype = v1::DTYPE_F32) {
  v1::DecodeRequest d;
  d.mutable_step()->set_seq(1);
  *d.mutable_step()->mutable_q() = Wire({1, 1, 2, 4}, dtype);
  *d.mutable_step()->mutable_k() = Wire({1, 1, 2, 4}, dtype);
  *d.mutable_step()->mutable_v() = Wire({1, 1, 2, 4}, dtype);
  return d;
}

v1::EncodeRequest BaseRopeApply(v1::DType dtype = v1::DTYPE_F32) {
  v1::EncodeRequest e;
  e.mutable_rope_apply()->mutable_rope();
  *e.mutable_rope_apply()->mutable_x() = Wire({1, 3, 2, 4}, dtype);
  return e;
}

v1::EmbedRequest BaseEmbed() {
  v1::EmbedRequest e;
  e.set_model("demo");
  for (int64_t id : {1, 2, 3}) e.add_token_ids(id);
  return e;
}

// ------------------------------------------------------------ generators --

// A wire tensor's mutations: (label, mutate, code, what the message names).
struct TensorMutation {
  std::string label;
  std::function<void(v1::Tensor*)> apply;
  Code code;
  std::string names_suffix;  // appended to the tensor's field name
};

std::vector<TensorMutation> TensorMutations(int rank, bool can_be_nonfinite) {
  std::vector<TensorMutation> m;
  for (int dtype : {0, 3, 7, -1, 1000}) {
    m.push_back({absl::StrCat("dtype=", dtype),
                 [dtype](v1::Tensor* t) { t->set_dtype(static_cast<v1::DType>(dtype)); },
                 Code::INVALID_ARGUMENT, ".dtype"});
  }
  for (int i = 0; i < rank; ++i) {
    for (int64_t bad : {int64_t{-1}, int64_t{-7}, kI64Min}) {
      m.push_back({absl::StrCat("shape[", i, "]=", bad),
                   [i, bad](v1::Tensor* t) { t->set_shape(i, bad); }, Code::INVALID_ARGUMENT,
                   absl::StrCat(".shape[", i, "]")});
    }
  }
  // Products past int64 (and past 2^60) whatever the data.
  const std::vector<std::vector<int64_t>> overflowing = {
      {kI64Max, kI64Max, 1, 1},           {int64_t{1} << 31, int64_t{1} << 31, int64_t{1} << 31, 4},
      {int64_t{1} << 40, int64_t{1} << 40, 1, 1}, {3, kI64Max, 2, 4},
      {int64_t{1} << 62, 4, 1, 1},        {1, int64_t{1} << 61, 2, 4}};
  for (size_t k = 0; k < overflowing.size(); ++k) {
    m.push_back({absl::StrCat("overflowing shape #", k),
                 [dims = overflowing[k], rank](v1::Tensor* t) {
                   t->clear_shape();
                   for (int i = 0; i < rank; ++i) t->add_shape(dims[i % dims.size()]);
                 },
                 Code::INVALID_ARGUMENT, ".shape"});
  }
  m.push_back({"9 dims", [](v1::Tensor* t) {
                 t->clear_shape();
                 for (int i = 0; i < 9; ++i) t->add_shape(1);
               },
               Code::INVALID_ARGUMENT, ".shape"});
  m.push_back({"100000 dims", [](v1::Tensor* t) {
                 t->clear_shape();
                 for (int i = 0; i < 100000; ++i) t->add_shape(1);
               },
               Code::INVALID_ARGUMENT, ".shape"});
  m.push_back({"data one byte short", [](v1::Tensor* t) { t->mutable_data()->pop_back(); },
               Code::INVALID_ARGUMENT, ".data"});
  m.push_back({"data one byte long", [](v1::Tensor* t) { t->mutable_data()->push_back('\0'); },
               Code::INVALID_ARGUMENT, ".data"});
  m.push_back({"data empty", [](v1::Tensor* t) { t->clear_data(); }, Code::INVALID_ARGUMENT,
               ".data"});
  m.push_back({"data doubled", [](v1::Tensor* t) { t->set_data(t->data() + t->data()); },
               Code::INVALID_ARGUMENT, ".data"});
  m.push_back({"f32 data labelled bf16",
               [](v1::Tensor* t) {
                 t->set_dtype(t->dtype() == v1::DTYPE_F32 ? v1::DTYPE_BF16 : v1::DTYPE_F32);
               },
               Code::INVALID_ARGUMENT, ".data"});
  if (can_be_nonfinite) {
    const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
    for (int s = 0; s < 3; ++s) {
      for (int where : {0, 1}) {  // first or last element
        m.push_back({absl::StrCat("non-finite #", s, where == 0 ? " first" : " last"),
                     [f = specials[s], where](v1::Tensor* t) {
                       std::string* d = t->mutable_data();
                       if (t->dtype() == v1::DTYPE_BF16) {
                         uint32_t bits;
                         std::memcpy(&bits, &f, 4);
                         const uint16_t top = static_cast<uint16_t>(bits >> 16);
                         std::memcpy(d->data() + (where == 0 ? 0 : d->size() - 2), &top, 2);
                       } else {
                         std::memcpy(d->data() + (where == 0 ? 0 : d->size() - 4), &f, 4);
                       }
                     },
                     Code::INVALID_ARGUMENT, ""});
      }
    }
  }
  return m;
}

// RopeSpec float fields: (name the message must use, setter).
struct FloatField {
  std::string names;
  std::function<void(v1::RopeSpec*, double)> set;
};

std::vector<FloatField> RopeFloatFields() {
  auto scaled = [](const char* type) {
    return [type](v1::RopeSpec* r) { r->mutable_scaling()->set_rope_type(type); };
  };
  std::vector<FloatField> f;
  f.push_back({"theta", [](v1::RopeSpec* r, double v) { r->set_theta(v); }});
  f.push_back({"factor", [s = scaled("linear")](v1::RopeSpec* r, double v) {
                 s(r);
                 r->mutable_scaling()->set_factor(v);
               }});
  f.push_back({"factor", [s = scaled("dynamic")](v1::RopeSpec* r, double v) {
                 s(r);
                 r->mutable_scaling()->set_factor(v);
               }});
  auto yarn = [s = scaled("yarn")](v1::RopeSpec* r) {
    s(r);
    r->mutable_scaling()->set_factor(4);
    r->mutable_scaling()->set_original_max_position_embeddings(64);
  };
  f.push_back({"factor", [s = scaled("yarn")](v1::RopeSpec* r, double v) {
                 s(r);
                 r->mutable_scaling()->set_original_max_position_embeddings(64);
                 r->mutable_scaling()->set_factor(v);
               }});
  f.push_back({"beta_fast", [yarn](v1::RopeSpec* r, double v) {
                 yarn(r);
                 r->mutable_scaling()->set_beta_fast(v);
               }});
  f.push_back({"beta_slow", [yarn](v1::RopeSpec* r, double v) {
                 yarn(r);
                 r->mutable_scaling()->set_beta_slow(v);
               }});
  f.push_back({"attention_factor", [yarn](v1::RopeSpec* r, double v) {
                 yarn(r);
                 r->mutable_scaling()->set_attention_factor(v);
               }});
  f.push_back({"mscale", [yarn](v1::RopeSpec* r, double v) {
                 yarn(r);
                 r->mutable_scaling()->set_mscale(v);
               }});
  f.push_back({"mscale_all_dim", [yarn](v1::RopeSpec* r, double v) {
                 yarn(r);
                 r->mutable_scaling()->set_mscale_all_dim(v);
               }});
  auto llama3 = [s = scaled("llama3")](v1::RopeSpec* r) {
    s(r);
    r->mutable_scaling()->set_factor(8);
    r->mutable_scaling()->set_original_max_position_embeddings(64);
  };
  f.push_back({"low_freq_factor", [llama3](v1::RopeSpec* r, double v) {
                 llama3(r);
                 r->mutable_scaling()->set_low_freq_factor(v);
               }});
  f.push_back({"high_freq_factor", [llama3](v1::RopeSpec* r, double v) {
                 llama3(r);
                 r->mutable_scaling()->set_high_freq_factor(v);
               }});
  auto longrope = [s = scaled("longrope")](v1::RopeSpec* r, int bad, double v) {
    s(r);
    r->mutable_scaling()->set_original_max_position_embeddings(64);
    for (int i = 0; i < 2; ++i) {  // rotary_dim 4: 2 entries each
      r->mutable_scaling()->add_short_factor(bad == 0 && i == 1 ? v : 1.0);
      r->mutable_scaling()->add_long_factor(bad == 1 && i == 1 ? v : 1.0);
    }
  };
  f.push_back({"short_factor", [longrope](v1::RopeSpec* r, double v) { longrope(r, 0, v); }});
  f.push_back({"long_factor", [longrope](v1::RopeSpec* r, double v) { longrope(r, 1, v); }});
  return f;
}

const std::vector<double>& BadFloats() {
  static const std::vector<double> v = {kNaN, kInf, -kInf, 1e308, -1e308, 1e30, -1e30};
  return v;
}

std::string FloatLabel(double v) { return absl::StrCat(v); }

// Where a RopeSpec can be sent: (label, build a case around `rope`).
struct RopeContext {
  std::string label;
  std::function<Case(const v1::RopeSpec&)> make;
};

std::vector<RopeContext> RopeContexts() {
  std::vector<RopeContext> c;
  c.push_back({"Attend", [](const v1::RopeSpec& rope) {
                 Case k;
                 k.rpc = Rpc::kAttend;
                 k.attend = BaseAttend();
                 *k.attend.mutable_spec()->mutable_rope() = rope;
                 return k;
               }});
  c.push_back({"Decode.open", [](const v1::RopeSpec& rope) {
                 Case k;
                 k.rpc = Rpc::kDecode;
                 v1::DecodeRequest open = BaseOpen();
                 *open.mutable_open()->mutable_spec()->mutable_rope() = rope;
                 k.decode = {open};
                 return k;
               }});
  c.push_back({"Encode.rope_frequencies", [](const v1::RopeSpec& rope) {
                 Case k;
                 k.rpc = Rpc::kEncode;
                 *k.encode.mutable_rope_frequencies()->mutable_rope() = rope;
                 k.encode.mutable_rope_frequencies()->set_head_dim(4);
                 k.encode.mutable_rope_frequencies()->set_seq_len(8);
                 return k;
               }});
  c.push_back({"Encode.rope_cos_sin", [](const v1::RopeSpec& rope) {
                 Case k;
                 k.rpc = Rpc::kEncode;
                 *k.encode.mutable_rope_cos_sin()->mutable_rope() = rope;
                 k.encode.mutable_rope_cos_sin()->set_head_dim(4);
                 k.encode.mutable_rope_cos_sin()->set_seq_len(8);
                 for (int64_t p : {0, 1, 5}) k.encode.mutable_rope_cos_sin()->add_positions(p);
                 return k;
               }});
  c.push_back({"Encode.rope_apply", [](const v1::RopeSpec& rope) {
                 Case k;
                 k.rpc = Rpc::kEncode;
                 k.encode = BaseRopeApply();
                 *k.encode.mutable_rope_apply()->mutable_rope() = rope;
                 return k;
               }});
  return c;
}

// Spec fields an AttentionSpec carries, for Attend and Decode.open.
struct SpecContext {
  std::string label;
  std::function<Case(const std::function<void(v1::AttentionSpec*)>&)> make;
};

std::vector<SpecContext> SpecContexts() {
  std::vector<SpecContext> c;
  c.push_back({"Attend", [](const std::function<void(v1::AttentionSpec*)>& f) {
                 Case k;
                 k.rpc = Rpc::kAttend;
                 k.attend = BaseAttend();
                 f(k.attend.mutable_spec());
                 return k;
               }});
  c.push_back({"Decode.open", [](const std::function<void(v1::AttentionSpec*)>& f) {
                 Case k;
                 k.rpc = Rpc::kDecode;
                 v1::DecodeRequest open = BaseOpen();
                 f(open.mutable_open()->mutable_spec());
                 k.decode = {open};
                 return k;
               }});
  return c;
}

std::vector<Case> GenerateCases() {
  std::vector<Case> cases;
  auto add = [&](Case c, std::string name, Code code, std::string names) {
    c.name = std::move(name);
    c.code = code;
    c.names = std::move(names);
    cases.push_back(std::move(c));
  };

  // --- Tensors: every wire tensor of every RPC, f32 and bf16 bases. ---
  for (v1::DType dt : {v1::DTYPE_F32, v1::DTYPE_BF16}) {
    const std::string dts = dt == v1::DTYPE_F32 ? "f32" : "bf16";
    for (const char* field : {"q", "k", "v"}) {
      for (const TensorMutation& m : TensorMutations(4, true)) {
        Case c;
        c.rpc = Rpc::kAttend;
        c.attend = BaseAttend(dt);
        v1::Tensor* t = field[0] == 'q'   ? c.attend.mutable_q()
                        : field[0] == 'k' ? c.attend.mutable_k()
                                          : c.attend.mutable_v();
        m.apply(t);
        add(c, absl::StrCat("Attend ", dts, " ", field, " ", m.label), m.code,
            m.names_suffix.empty() ? std::string(field) : absl::StrCat(field, m.names_suffix));
      }
      for (const TensorMutation& m : TensorMutations(4, true)) {
        Case c;
        c.rpc = Rpc::kDecode;
        v1::DecodeRequest open = BaseOpen();
        open.mutable_open()->set_kv_dtype(dt);
        v1::DecodeRequest step = BaseStep(dt);
        v1::Tensor* t = field[0] == 'q'   ? step.mutable_step()->mutable_q()
                        : field[0] == 'k' ? step.mutable_step()->mutable_k()
                                          : step.mutable_step()->mutable_v();
        m.apply(t);
        c.decode = {open, step};
        add(c, absl::StrCat("Decode.step ", dts, " ", field, " ", m.label), m.code,
            m.names_suffix.empty() ? std::string(field) : absl::StrCat(field, m.names_suffix));
      }
    }
    for (const TensorMutation& m : TensorMutations(4, true)) {
      Case c;
      c.rpc = Rpc::kEncode;
      c.encode = BaseRopeApply(dt);
      m.apply(c.encode.mutable_rope_apply()->mutable_x());
      add(c, absl::StrCat("Encode.rope_apply ", dts, " x ", m.label), m.code,
          absl::StrCat("x", m.names_suffix));
    }
  }

  // --- Float parameters outside their documented range. ---
  for (const RopeContext& ctx : RopeContexts()) {
    for (const FloatField& f : RopeFloatFields()) {
      for (double v : BadFloats()) {
        v1::RopeSpec rope;
        f.set(&rope, v);
        add(ctx.make(rope), absl::StrCat(ctx.label, " rope ", f.names, "=", FloatLabel(v)),
            Code::INVALID_ARGUMENT, f.names);
      }
    }
  }
  for (const SpecContext& ctx : SpecContexts()) {
    for (double v : BadFloats()) {
      add(ctx.make([v](v1::AttentionSpec* s) { s->set_scale(v); }),
          absl::StrCat(ctx.label, " scale=", FloatLabel(v)), Code::INVALID_ARGUMENT, "scale");
      add(ctx.make([v](v1::AttentionSpec* s) { s->set_softcap(v); }),
          absl::StrCat(ctx.label, " softcap=", FloatLabel(v)), Code::INVALID_ARGUMENT, "softcap");
      add(ctx.make([v](v1::AttentionSpec* s) {
            s->mutable_alibi()->add_slopes(0.5);
            s->mutable_alibi()->add_slopes(v);
          }),
          absl::StrCat(ctx.label, " alibi slope=", FloatLabel(v)), Code::INVALID_ARGUMENT,
          "slopes");
    }
    // --- Integer spec fields: zero, negative, huge, inconsistent. ---
    // Attend: any heads but q's 2 is malformed. An open has no q: 3 heads is
    // a valid session, and 2^40 of them a session the budget cannot hold.
    const bool is_open = ctx.label == "Decode.open";
    for (int64_t h : {int64_t{0}, int64_t{-1}, kI64Min, int64_t{3}, int64_t{1} << 40, kI64Max}) {
      if (is_open && h == 3) continue;
      add(ctx.make([h](v1::AttentionSpec* s) { s->set_heads(h); }),
          absl::StrCat(ctx.label, " heads=", h),
          is_open && h > 3 ? Code::RESOURCE_EXHAUSTED : Code::INVALID_ARGUMENT, "heads");
    }
    for (int64_t h : {int64_t{-1}, kI64Min, int64_t{3}, int64_t{4}, int64_t{1} << 40}) {
      add(ctx.make([h](v1::AttentionSpec* s) { s->set_kv_heads(h); }),
          absl::StrCat(ctx.label, " kv_heads=", h), Code::INVALID_ARGUMENT, "kv_heads");
    }
    for (int64_t d : {int64_t{0}, int64_t{-1}, kI64Min, int64_t{3}, int64_t{1} << 40}) {
      add(ctx.make([d](v1::AttentionSpec* s) { s->set_head_dim(d); }),
          absl::StrCat(ctx.label, " head_dim=", d),
          is_open && d == (int64_t{1} << 40) ? Code::RESOURCE_EXHAUSTED : Code::INVALID_ARGUMENT,
          "head_dim");
    }
    for (int64_t w : {int64_t{-1}, kI64Min}) {
      add(ctx.make([w](v1::AttentionSpec* s) { s->set_window(w); }),
          absl::StrCat(ctx.label, " window=", w), Code::INVALID_ARGUMENT, "window");
    }
    for (int64_t rd : {int64_t{-2}, int64_t{3}, int64_t{6}, int64_t{8}, kI64Max, kI64Min}) {
      add(ctx.make([rd](v1::AttentionSpec* s) { s->mutable_rope()->set_rotary_dim(rd); }),
          absl::StrCat(ctx.label, " rotary_dim=", rd), Code::INVALID_ARGUMENT, "rotary_dim");
    }
    for (int layout : {3, 9, -1}) {
      add(ctx.make([layout](v1::AttentionSpec* s) {
            s->mutable_rope()->set_layout(static_cast<v1::RopeLayout>(layout));
          }),
          absl::StrCat(ctx.label, " rope layout=", layout), Code::INVALID_ARGUMENT, "layout");
    }
    for (const std::string& type :
         {std::string("bogus"), std::string("YARN "), std::string(1 << 20, 'y'),
          std::string("linear\0x", 8)}) {
      add(ctx.make([type](v1::AttentionSpec* s) {
            s->mutable_rope()->mutable_scaling()->set_rope_type(type);
            s->mutable_rope()->mutable_scaling()->set_factor(2);
          }),
          absl::StrCat(ctx.label, " rope_type of ", type.size(), " bytes"),
          Code::INVALID_ARGUMENT, "rope_type");
    }
    for (int64_t omp : {int64_t{-1}, kI64Min}) {
      add(ctx.make([omp](v1::AttentionSpec* s) {
            s->mutable_rope()->mutable_scaling()->set_rope_type("yarn");
            s->mutable_rope()->mutable_scaling()->set_factor(4);
            s->mutable_rope()->mutable_scaling()->set_original_max_position_embeddings(omp);
          }),
          absl::StrCat(ctx.label, " original_max_position_embeddings=", omp),
          Code::INVALID_ARGUMENT, "original_max_position_embeddings");
    }
    // LongRoPE lists of the wrong length.
    for (int n : {0, 1, 3, 1000}) {
      add(ctx.make([n](v1::AttentionSpec* s) {
            auto* sc = s->mutable_rope()->mutable_scaling();
            sc->set_rope_type("longrope");
            sc->set_original_max_position_embeddings(64);
            for (int i = 0; i < n; ++i) sc->add_short_factor(1.0);
            for (int i = 0; i < 2; ++i) sc->add_long_factor(1.0);
          }),
          absl::StrCat(ctx.label, " short_factor with ", n, " entries"), Code::INVALID_ARGUMENT,
          "short_factor");
    }
    // ALiBi slopes of the wrong count.
    for (int n : {1, 3, 100}) {
      add(ctx.make([n](v1::AttentionSpec* s) {
            for (int i = 0; i < n; ++i) s->mutable_alibi()->add_slopes(0.5);
          }),
          absl::StrCat(ctx.label, " ", n, " alibi slopes for 2 heads"), Code::INVALID_ARGUMENT,
          "slopes");
    }
  }

  // --- Attend positions and options. ---
  for (int64_t off : {int64_t{-1}, kI64Min, (int64_t{1} << 40) + 1, kI64Max}) {
    Case c;
    c.attend = BaseAttend();
    c.attend.add_q_offsets(off);
    // Negative is malformed; past the 2^40 position bound is out of range.
    add(c, absl::StrCat("Attend q_offsets=", off),
        off < 0 ? Code::INVALID_ARGUMENT : Code::OUT_OF_RANGE, "q_offsets");
  }
  for (int n : {2, 5}) {
    Case c;
    c.attend = BaseAttend();
    for (int i = 0; i < n; ++i) c.attend.add_q_offsets(0);
    add(c, absl::StrCat("Attend ", n, " q_offsets for 1 row"), Code::INVALID_ARGUMENT,
        "q_offsets");
  }
  for (int64_t len : {int64_t{-1}, int64_t{4}, kI64Max, kI64Min}) {
    Case c;
    c.attend = BaseAttend();
    c.attend.add_key_lengths(len);
    // More keys than k holds is out of range.
    add(c, absl::StrCat("Attend key_lengths=", len),
        len < 0 ? Code::INVALID_ARGUMENT : Code::OUT_OF_RANGE, "key_lengths");
  }
  {
    Case c;
    c.attend = BaseAttend();
    c.attend.add_key_lengths(3);
    c.attend.add_key_lengths(3);
    add(c, "Attend 2 key_lengths for 1 row", Code::INVALID_ARGUMENT, "key_lengths");
  }
  for (int dt : {3, 9, -1}) {
    Case c;
    c.attend = BaseAttend();
    c.attend.set_out_dtype(static_cast<v1::DType>(dt));
    add(c, absl::StrCat("Attend out_dtype=", dt), Code::INVALID_ARGUMENT, "out_dtype");
  }
  {
    // Shapes that disagree with each other (each valid alone).
    const std::vector<std::tuple<std::string, std::vector<int64_t>, std::vector<int64_t>,
                                 std::vector<int64_t>, std::string>>
        mismatched = {
            {"batch of k", {1, 3, 2, 4}, {2, 3, 2, 4}, {2, 3, 2, 4}, "k"},
            {"keys of v", {1, 3, 2, 4}, {1, 3, 2, 4}, {1, 4, 2, 4}, "v"},
            {"head_dim of k", {1, 3, 2, 4}, {1, 3, 2, 6}, {1, 3, 2, 4}, "k"},
            {"heads of q", {1, 3, 3, 4}, {1, 3, 2, 4}, {1, 3, 2, 4}, "q"},
            {"rank 3 q", {3, 2, 4}, {1, 3, 2, 4}, {1, 3, 2, 4}, "q"},
            {"rank 5 q", {1, 1, 3, 2, 4}, {1, 3, 2, 4}, {1, 3, 2, 4}, "q"},
            {"zero heads in q", {1, 3, 0, 4}, {1, 3, 2, 4}, {1, 3, 2, 4}, "q"},
            {"zero head_dim in k", {1, 3, 2, 4}, {1, 3, 2, 0}, {1, 3, 2, 4}, "k"},
        };
    for (const auto& [label, q, k, v, names] : mismatched) {
      Case c;
      c.attend = BaseAttend();
      *c.attend.mutable_q() = Wire(q);
      *c.attend.mutable_k() = Wire(k);
      *c.attend.mutable_v() = Wire(v);
      add(c, absl::StrCat("Attend mismatched ", label), Code::INVALID_ARGUMENT, names);
    }
  }
  // T5 table mutations (Attend with a T5 spec).
  for (const TensorMutation& m : TensorMutations(2, true)) {
    Case c;
    c.attend = BaseAttend();
    *c.attend.mutable_spec()->mutable_t5()->mutable_table() = Wire({32, 2});
    m.apply(c.attend.mutable_spec()->mutable_t5()->mutable_table());
    add(c, absl::StrCat("Attend t5.table ", m.label), m.code,
        m.names_suffix.empty() ? std::string("table") : absl::StrCat("table", m.names_suffix));
  }
  for (int32_t nb : {-1, 31, 33, std::numeric_limits<int32_t>::min()}) {
    Case c;
    c.attend = BaseAttend();
    *c.attend.mutable_spec()->mutable_t5()->mutable_table() = Wire({32, 2});
    c.attend.mutable_spec()->mutable_t5()->set_num_buckets(nb);
    add(c, absl::StrCat("Attend t5 num_buckets=", nb), Code::INVALID_ARGUMENT, "num_buckets");
  }
  for (int32_t md : {-1, std::numeric_limits<int32_t>::min()}) {
    Case c;
    c.attend = BaseAttend();
    *c.attend.mutable_spec()->mutable_t5()->mutable_table() = Wire({32, 2});
    c.attend.mutable_spec()->mutable_t5()->set_max_distance(md);
    add(c, absl::StrCat("Attend t5 max_distance=", md), Code::INVALID_ARGUMENT, "max_distance");
  }

  // --- Layer-mode Attend. ---
  {
    auto layer = [](std::function<void(v1::LayerInput*)> f) {
      Case c;
      c.attend.mutable_layer()->set_model("demo");
      c.attend.mutable_layer()->set_layer(0);
      *c.attend.mutable_layer()->mutable_hidden() = Wire({1, 3, 64});
      f(c.attend.mutable_layer());
      return c;
    };
    for (int32_t l : {-1, 2, 99, std::numeric_limits<int32_t>::max()}) {
      add(layer([l](v1::LayerInput* in) { in->set_layer(l); }),
          absl::StrCat("Attend layer.layer=", l),
          l < 0 ? Code::INVALID_ARGUMENT : Code::OUT_OF_RANGE, "layer");
    }
    for (const std::string& name : {std::string("nope"), std::string(1 << 20, 'm')}) {
      add(layer([name](v1::LayerInput* in) { in->set_model(name); }),
          absl::StrCat("Attend layer.model of ", name.size(), " bytes"), Code::NOT_FOUND, "model");
    }
    for (const TensorMutation& m : TensorMutations(3, true)) {
      Case c = layer([&m](v1::LayerInput* in) { m.apply(in->mutable_hidden()); });
      add(c, absl::StrCat("Attend layer.hidden ", m.label), m.code,
          m.names_suffix.empty() ? std::string("hidden")
                                 : absl::StrCat("hidden", m.names_suffix));
    }
    for (std::vector<int64_t> dims : std::vector<std::vector<int64_t>>{
             {1, 3, 63}, {1, 3, 65}, {3, 64}, {1, 1, 3, 64}}) {
      add(layer([dims](v1::LayerInput* in) { *in->mutable_hidden() = Wire(dims); }),
          absl::StrCat("Attend layer.hidden of rank ", dims.size(), " last ", dims.back()),
          Code::INVALID_ARGUMENT, "hidden");
    }
  }

  // --- Encode ops. ---
  auto encode = [](std::function<void(v1::EncodeRequest*)> f) {
    Case c;
    c.rpc = Rpc::kEncode;
    f(&c.encode);
    return c;
  };
  for (int64_t bad : {int64_t{-1}, kI64Min}) {
    add(encode([bad](v1::EncodeRequest* e) {
          e->mutable_sinusoidal()->set_num_positions(bad);
          e->mutable_sinusoidal()->set_d_model(8);
        }),
        absl::StrCat("Encode.sinusoidal num_positions=", bad), Code::INVALID_ARGUMENT,
        "num_positions");
    add(encode([bad](v1::EncodeRequest* e) {
          e->mutable_sinusoidal()->set_num_positions(4);
          e->mutable_sinusoidal()->set_d_model(bad);
        }),
        absl::StrCat("Encode.sinusoidal d_model=", bad), Code::INVALID_ARGUMENT, "d_model");
    add(encode([bad](v1::EncodeRequest* e) {
          e->mutable_sinusoidal()->set_num_positions(4);
          e->mutable_sinusoidal()->set_d_model(8);
          e->mutable_sinusoidal()->set_first_position(bad);
        }),
        absl::StrCat("Encode.sinusoidal first_position=", bad), Code::INVALID_ARGUMENT,
        "first_position");
    add(encode([bad](v1::EncodeRequest* e) {
          e->mutable_alibi()->set_heads(bad);
        }),
        absl::StrCat("Encode.alibi heads=", bad), Code::INVALID_ARGUMENT, "heads");
    for (const char* field : {"q_len", "k_len", "q_offset"}) {
      add(encode([bad, field](v1::EncodeRequest* e) {
            auto* a = e->mutable_alibi();
            a->set_heads(2);
            a->set_q_len(2);
            a->set_k_len(2);
            if (field[0] == 'q' && field[2] == 'l') a->set_q_len(bad);
            if (field[0] == 'k') a->set_k_len(bad);
            if (field[2] == 'o') a->set_q_offset(bad);
          }),
          absl::StrCat("Encode.alibi ", field, "=", bad), Code::INVALID_ARGUMENT, field);
      add(encode([bad, field](v1::EncodeRequest* e) {
            auto* t = e->mutable_t5();
            t->set_q_len(2);
            t->set_k_len(2);
            if (field[0] == 'q' && field[2] == 'l') t->set_q_len(bad);
            if (field[0] == 'k') t->set_k_len(bad);
            if (field[2] == 'o') t->set_q_offset(bad);
          }),
          absl::StrCat("Encode.t5 ", field, "=", bad), Code::INVALID_ARGUMENT, field);
    }
    add(encode([bad](v1::EncodeRequest* e) {
          e->mutable_rope_frequencies()->set_head_dim(bad);
          e->mutable_rope_frequencies()->mutable_rope();
        }),
        absl::StrCat("Encode.rope_frequencies head_dim=", bad), Code::INVALID_ARGUMENT,
        "head_dim");
    add(encode([bad](v1::EncodeRequest* e) {
          e->mutable_rope_frequencies()->set_head_dim(4);
          e->mutable_rope_frequencies()->set_seq_len(bad);
          e->mutable_rope_frequencies()->mutable_rope();
        }),
        absl::StrCat("Encode.rope_frequencies seq_len=", bad), Code::INVALID_ARGUMENT, "seq_len");
    add(encode([bad](v1::EncodeRequest* e) {
          e->mutable_rope_cos_sin()->set_head_dim(4);
          e->mutable_rope_cos_sin()->mutable_rope();
          e->mutable_rope_cos_sin()->add_positions(0);
          e->mutable_rope_cos_sin()->add_positions(bad);
        }),
        absl::StrCat("Encode.rope_cos_sin positions=", bad), Code::INVALID_ARGUMENT, "positions");
    add(encode([bad](v1::EncodeRequest* e) {
          *e = BaseRopeApply();
          for (int i = 0; i < 3; ++i) e->mutable_rope_apply()->add_positions(i == 1 ? bad : i);
        }),
        absl::StrCat("Encode.rope_apply positions=", bad), Code::INVALID_ARGUMENT, "positions");
    add(encode([bad](v1::EncodeRequest* e) {
          *e = BaseRopeApply();
          e->mutable_rope_apply()->add_offsets(bad);
        }),
        absl::StrCat("Encode.rope_apply offsets=", bad), Code::INVALID_ARGUMENT, "offsets");
    add(encode([bad](v1::EncodeRequest* e) {
          *e = BaseRopeApply();
          e->mutable_rope_apply()->set_seq_len(bad);
        }),
        absl::StrCat("Encode.rope_apply seq_len=", bad), Code::INVALID_ARGUMENT, "seq_len");
  }
  for (int64_t far : {(int64_t{1} << 40) + 1, kI64Max}) {
    add(encode([far](v1::EncodeRequest* e) {
          e->mutable_rope_cos_sin()->set_head_dim(4);
          e->mutable_rope_cos_sin()->mutable_rope();
          e->mutable_rope_cos_sin()->add_positions(far);
        }),
        absl::StrCat("Encode.rope_cos_sin positions=", far), Code::OUT_OF_RANGE, "positions");
    add(encode([far](v1::EncodeRequest* e) {
          *e = BaseRopeApply();
          e->mutable_rope_apply()->add_offsets(far);
        }),
        absl::StrCat("Encode.rope_apply offsets=", far), Code::OUT_OF_RANGE, "offsets");
  }
  // A length past the last position is named with its own value, not the
  // first position's.
  {
    const int64_t len = int64_t{1} << 41;
    const std::string shown = absl::StrCat(" = ", len);
    add(encode([len](v1::EncodeRequest* e) {
          e->mutable_sinusoidal()->set_num_positions(len);
          e->mutable_sinusoidal()->set_d_model(8);
        }),
        "Encode.sinusoidal num_positions=2^41", Code::OUT_OF_RANGE,
        absl::StrCat("sinusoidal.num_positions", shown));
    for (const char* op : {"alibi", "t5"}) {
      for (const char* field : {"q_len", "k_len"}) {
        const bool t5 = op[0] == 't', k = field[0] == 'k';
        add(encode([=](v1::EncodeRequest* e) {
              if (t5) {
                auto* t = e->mutable_t5();
                t->set_q_len(k ? 2 : len);
                t->set_k_len(k ? len : 2);
              } else {
                auto* a = e->mutable_alibi();
                a->set_heads(2);
                a->set_q_len(k ? 2 : len);
                a->set_k_len(k ? len : 2);
              }
            }),
            absl::StrCat("Encode.", op, " ", field, "=2^41"), Code::OUT_OF_RANGE,
            absl::StrCat(op, ".", field, shown));
      }
    }
    add(encode([len](v1::EncodeRequest* e) {
          *e = BaseRopeApply();
          // No heads: an empty tensor, so its length is checked, not its bytes.
          v1::Tensor* x = e->mutable_rope_apply()->mutable_x();
          x->set_shape(1, len);
          x->set_shape(2, 0);
          x->clear_data();
          x->clear_f32_values();
        }),
        "Encode.rope_apply x.shape[1]=2^41", Code::OUT_OF_RANGE,
        absl::StrCat("rope_apply.x.shape[1]", shown));
  }
  for (int n : {1, 2, 4, 7}) {
    add(encode([n](v1::EncodeRequest* e) {
          *e = BaseRopeApply();
          for (int i = 0; i < n; ++i) e->mutable_rope_apply()->add_positions(i);
        }),
        absl::StrCat("Encode.rope_apply ", n, " positions for 3 tokens"), Code::INVALID_ARGUMENT,
        "positions");
    add(encode([n](v1::EncodeRequest* e) {
          *e = BaseRopeApply();
          for (int i = 0; i < n + 1; ++i) e->mutable_rope_apply()->add_offsets(0);
        }),
        absl::StrCat("Encode.rope_apply ", n + 1, " offsets for 1 row"), Code::INVALID_ARGUMENT,
        "offsets");
  }
  for (int layout : {3, 9, -1}) {
    add(encode([layout](v1::EncodeRequest* e) {
          e->mutable_sinusoidal()->set_num_positions(4);
          e->mutable_sinusoidal()->set_d_model(8);
          e->mutable_sinusoidal()->set_layout(static_cast<v1::SinusoidalLayout>(layout));
        }),
        absl::StrCat("Encode.sinusoidal layout=", layout), Code::INVALID_ARGUMENT, "layout");
  }
  for (double v : BadFloats()) {
    add(encode([v](v1::EncodeRequest* e) {
          e->mutable_sinusoidal()->set_num_positions(4);
          e->mutable_sinusoidal()->set_d_model(8);
          e->mutable_sinusoidal()->set_base(v);
        }),
        absl::StrCat("Encode.sinusoidal base=", FloatLabel(v)), Code::INVALID_ARGUMENT, "base");
  }
  // Sizes priced past the limits: refused before any work.
  add(encode([](v1::EncodeRequest* e) {
        e->mutable_alibi()->set_heads(64);
        e->mutable_alibi()->set_q_len(int64_t{1} << 20);
        e->mutable_alibi()->set_k_len(int64_t{1} << 20);
      }),
      "Encode.alibi 2^46 bias entries", Code::RESOURCE_EXHAUSTED, "max_message_bytes");
  add(encode([](v1::EncodeRequest* e) {
        e->mutable_alibi()->set_heads(2);
        e->mutable_alibi()->set_q_len(int64_t{1} << 40);
      }),
      "Encode.alibi q_len 2^40 no keys", Code::RESOURCE_EXHAUSTED, "compute");
  add(encode([](v1::EncodeRequest* e) {
        e->mutable_sinusoidal()->set_num_positions(int64_t{1} << 30);
        e->mutable_sinusoidal()->set_d_model(1024);
      }),
      "Encode.sinusoidal 2^40 entries", Code::RESOURCE_EXHAUSTED, "max_message_bytes");
  add(encode([](v1::EncodeRequest*) {}), "Encode with no op", Code::INVALID_ARGUMENT, "op");
  for (const TensorMutation& m : TensorMutations(2, true)) {
    Case c = encode([](v1::EncodeRequest* e) {
      e->mutable_t5()->set_q_len(2);
      e->mutable_t5()->set_k_len(2);
      *e->mutable_t5()->mutable_table() = Wire({32, 2});
    });
    m.apply(c.encode.mutable_t5()->mutable_table());
    add(c, absl::StrCat("Encode.t5 table ", m.label), m.code,
        m.names_suffix.empty() ? std::string("table") : absl::StrCat("table", m.names_suffix));
  }

  // --- Embed. ---
  auto embed = [](std::function<void(v1::EmbedRequest*)> f) {
    Case c;
    c.rpc = Rpc::kEmbed;
    c.embed = BaseEmbed();
    f(&c.embed);
    return c;
  };
  for (const std::string& name : {std::string("nope"), std::string(""), std::string(1 << 20, 'e')}) {
    add(embed([name](v1::EmbedRequest* e) { e->set_model(name); }),
        absl::StrCat("Embed model of ", name.size(), " bytes"), Code::NOT_FOUND, "model");
  }
  for (int64_t id : {int64_t{-1}, int64_t{256}, kI64Max, kI64Min}) {
    add(embed([id](v1::EmbedRequest* e) { e->set_token_ids(1, id); }),
        absl::StrCat("Embed token id ", id), Code::INVALID_ARGUMENT, "token_ids");
  }
  for (std::vector<int64_t> shape : std::vector<std::vector<int64_t>>{
           {2, 2}, {1, 4}, {-1, -3}, {3}, {1, 1, 3}, {kI64Max, 2}, {0, 3}}) {
    add(embed([shape](v1::EmbedRequest* e) {
          for (int64_t d : shape) e->add_shape(d);
        }),
        absl::StrCat("Embed shape of rank ", shape.size(), " first ", shape[0]),
        Code::INVALID_ARGUMENT, "shape");
  }
  for (int64_t off : {int64_t{-1}, kI64Min, (int64_t{1} << 40) + 1}) {
    add(embed([off](v1::EmbedRequest* e) { e->add_q_offsets(off); }),
        absl::StrCat("Embed q_offsets=", off),
        off < 0 ? Code::INVALID_ARGUMENT : Code::OUT_OF_RANGE, "q_offsets");
  }
  add(embed([](v1::EmbedRequest* e) {
        e->add_q_offsets(0);
        e->add_q_offsets(0);
      }),
      "Embed 2 q_offsets for 1 row", Code::INVALID_ARGUMENT, "q_offsets");
  for (int dt : {3, 9, -1}) {
    add(embed([dt](v1::EmbedRequest* e) { e->set_out_dtype(static_cast<v1::DType>(dt)); }),
        absl::StrCat("Embed out_dtype=", dt), Code::INVALID_ARGUMENT, "out_dtype");
  }

  // --- Decode: open fields, operations out of order, session ids. ---
  auto decode = [](std::vector<v1::DecodeRequest> ops) {
    Case c;
    c.rpc = Rpc::kDecode;
    c.decode = std::move(ops);
    return c;
  };
  auto open_with = [](std::function<void(v1::OpenSession*)> f) {
    v1::DecodeRequest d = BaseOpen();
    f(d.mutable_open());
    return d;
  };
  add(decode({open_with([](v1::OpenSession* o) { o->set_layer(2); })}),
      "Decode.open layer without model", Code::INVALID_ARGUMENT, "open.layer = 2");
  for (int dt : {3, 9, -1}) {
    // kv_dtype 3 is DTYPE_INT8, a valid cache dtype: 4 stands for the unknown.
    const int kv = dt == 3 ? 4 : dt;
    add(decode({open_with([kv](v1::OpenSession* o) { o->set_kv_dtype(static_cast<v1::DType>(kv)); })}),
        absl::StrCat("Decode.open kv_dtype=", kv), Code::INVALID_ARGUMENT,
        "kv_dtype has unknown value");
    add(decode({open_with([kv](v1::OpenSession* o) { o->set_kv_dtype(static_cast<v1::DType>(kv)); })}),
        absl::StrCat("Decode.open kv_dtype=", kv, " names int8"), Code::INVALID_ARGUMENT,
        "or DTYPE_INT8");
    add(decode({open_with([dt](v1::OpenSession* o) { o->set_out_dtype(static_cast<v1::DType>(dt)); })}),
        absl::StrCat("Decode.open out_dtype=", dt), Code::INVALID_ARGUMENT, "out_dtype");
    add(decode({open_with([dt](v1::OpenSession* o) { o->set_kind(static_cast<v1::AttentionKind>(dt)); })}),
        absl::StrCat("Decode.open kind=", dt), Code::INVALID_ARGUMENT, "kind");
  }
  for (int64_t mc : {int64_t{-1}, kI64Min}) {
    add(decode({open_with([mc](v1::OpenSession* o) { o->set_max_context(mc); })}),
        absl::StrCat("Decode.open max_context=", mc), Code::INVALID_ARGUMENT, "max_context");
  }
  for (int64_t mc : {(int64_t{1} << 20) + 1, kI64Max}) {
    add(decode({open_with([mc](v1::OpenSession* o) { o->set_max_context(mc); })}),
        absl::StrCat("Decode.open max_context=", mc), Code::INVALID_ARGUMENT, "max_context");
  }
  for (int64_t vd : {int64_t{-1}, kI64Min, int64_t{1} << 40}) {
    add(decode({open_with([vd](v1::OpenSession* o) { o->set_v_dim(vd); })}),
        absl::StrCat("Decode.open v_dim=", vd),
        vd > 0 ? Code::RESOURCE_EXHAUSTED : Code::INVALID_ARGUMENT, "v_dim");
  }
  add(decode({open_with([](v1::OpenSession* o) {
        *o->mutable_spec()->mutable_t5()->mutable_table() = Wire({32, 2});
      })}),
      "Decode.open t5", Code::UNIMPLEMENTED, "t5");
  // A linear session has no score scale and no KV cache: both are refused,
  // not accepted and ignored.
  add(decode({open_with([](v1::OpenSession* o) {
        o->set_kind(v1::ATTENTION_KIND_LINEAR);
        o->mutable_spec()->set_scale(1e4);
      })}),
      "Decode.open linear with scale", Code::UNIMPLEMENTED, "open.spec.scale 10000");
  add(decode({open_with([](v1::OpenSession* o) {
        o->set_kind(v1::ATTENTION_KIND_LINEAR);
        o->set_kv_dtype(v1::DTYPE_BF16);
      })}),
      "Decode.open linear with bf16 kv", Code::INVALID_ARGUMENT, "open.kv_dtype DTYPE_BF16");
  add(decode({open_with([](v1::OpenSession* o) {
        o->set_kind(v1::ATTENTION_KIND_LINEAR);
        o->set_kv_dtype(v1::DTYPE_INT8);
      })}),
      "Decode.open linear with int8 kv", Code::INVALID_ARGUMENT, "open.kv_dtype DTYPE_INT8");
  for (const std::string& name : {std::string("nope"), std::string(1 << 20, 'n')}) {
    add(decode({open_with([name](v1::OpenSession* o) {
          o->clear_spec();
          o->set_model(name);
        })}),
        absl::StrCat("Decode.open model of ", name.size(), " bytes"), Code::NOT_FOUND, "model");
  }
  for (int32_t l : {-1, 2, std::numeric_limits<int32_t>::max()}) {
    add(decode({open_with([l](v1::OpenSession* o) {
          o->clear_spec();
          o->set_model("demo");
          o->set_layer(l);
        })}),
        absl::StrCat("Decode.open layer=", l), l < 0 ? Code::INVALID_ARGUMENT : Code::OUT_OF_RANGE,
        "layer");
  }
  // Operations before open / attach.
  {
    v1::DecodeRequest trunc, fork, close, empty;
    trunc.mutable_truncate()->set_position(0);
    fork.mutable_fork();
    close.mutable_close();
    for (const auto& [label, op] : std::vector<std::pair<std::string, v1::DecodeRequest>>{
             {"step", BaseStep()}, {"truncate", trunc}, {"fork", fork}, {"close", close}}) {
      add(decode({op}), absl::StrCat("Decode ", label, " before open"), Code::INVALID_ARGUMENT,
          "open");
    }
    add(decode({empty}), "Decode empty message first", Code::INVALID_ARGUMENT, "msg");
    add(decode({BaseOpen(), empty}), "Decode empty message after open", Code::INVALID_ARGUMENT,
        "msg");
    add(decode({BaseOpen(), BaseOpen()}), "Decode second open", Code::FAILED_PRECONDITION,
        "already holds");
    v1::DecodeRequest attach;
    attach.mutable_attach()->set_session_id("0123456789abcdef0123456789abcdef");
    add(decode({BaseOpen(), attach}), "Decode attach after open", Code::FAILED_PRECONDITION,
        "already holds");
    add(decode({attach}), "Decode attach unknown id", Code::NOT_FOUND, "session");
    attach.mutable_attach()->set_session_id(std::string(1 << 20, 's'));
    add(decode({attach}), "Decode attach 1 MiB id", Code::NOT_FOUND, "session");
    attach.mutable_attach()->set_session_id("");
    add(decode({attach}), "Decode attach empty id", Code::NOT_FOUND, "session");
    for (int64_t pos : {int64_t{-1}, int64_t{1}, int64_t{17}, kI64Max, kI64Min}) {
      v1::DecodeRequest t;
      t.mutable_truncate()->set_position(pos);
      // Negative, as any negative position: INVALID_ARGUMENT; past the
      // session's length: OUT_OF_RANGE.
      const Code past = pos < 0 ? Code::INVALID_ARGUMENT : Code::OUT_OF_RANGE;
      add(decode({BaseOpen(), t}), absl::StrCat("Decode truncate to ", pos, " of 0"), past,
          "position");
      add(decode({BaseOpen(), BaseStep(), t}),
          absl::StrCat("Decode truncate to ", pos, " of 1"), pos == 1 ? Code::OK : past,
          "position");
    }
    // Steps that do not fit the session.
    v1::DecodeRequest too_long = BaseStep();
    for (auto* t : {too_long.mutable_step()->mutable_q(), too_long.mutable_step()->mutable_k(),
                    too_long.mutable_step()->mutable_v()}) {
      *t = Wire({1, 17, 2, 4});
    }
    add(decode({BaseOpen(), too_long}), "Decode step past max_context", Code::OUT_OF_RANGE,
        "max_context");
    v1::DecodeRequest two_rows = BaseStep();
    for (auto* t : {two_rows.mutable_step()->mutable_q(), two_rows.mutable_step()->mutable_k(),
                    two_rows.mutable_step()->mutable_v()}) {
      *t = Wire({2, 1, 2, 4});
    }
    add(decode({BaseOpen(), two_rows}), "Decode step of 2 rows", Code::INVALID_ARGUMENT, "q");
    v1::DecodeRequest hidden_step = BaseStep();
    *hidden_step.mutable_step()->mutable_hidden() = Wire({1, 1, 64});
    add(decode({BaseOpen(), hidden_step}), "Decode step with hidden outside layer mode",
        Code::INVALID_ARGUMENT, "hidden");
  }

  // --- Session and model ids on the unary calls. ---
  for (Rpc rpc : {Rpc::kGetSession, Rpc::kCloseSession}) {
    for (const std::string& id :
         {std::string("nope"), std::string(""), std::string(1 << 20, 'i'), std::string(31, '0'),
          std::string(32, 'z'), std::string("0123456789abcdef0123456789abcdeg")}) {
      Case c;
      c.rpc = rpc;
      c.id = id;
      add(c,
          absl::StrCat(rpc == Rpc::kGetSession ? "GetSession" : "CloseSession", " id of ",
                       id.size(), " bytes"),
          Code::NOT_FOUND, "session");
    }
  }
  for (const std::string& name : {std::string("nope"), std::string(""), std::string(1 << 20, 'g')}) {
    Case c;
    c.rpc = Rpc::kGetModel;
    c.id = name;
    add(c, absl::StrCat("GetModel name of ", name.size(), " bytes"), Code::NOT_FOUND, "model");
  }
  return cases;
}

// ---------------------------------------------------------------- runner --

struct Outcome {
  Code code = Code::OK;
  std::string message;
};

Outcome RunCase(v1::AttentionService::Stub* stub, const Case& c) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  grpc::Status st;
  switch (c.rpc) {
    case Rpc::kAttend: {
      v1::AttendResponse out;
      st = stub->Attend(&ctx, c.attend, &out);
      break;
    }
    case Rpc::kEncode: {
      v1::EncodeResponse out;
      st = stub->Encode(&ctx, c.encode, &out);
      break;
    }
    case Rpc::kEmbed: {
      v1::EmbedResponse out;
      st = stub->Embed(&ctx, c.embed, &out);
      break;
    }
    case Rpc::kGetSession: {
      v1::GetSessionRequest r;
      r.set_session_id(c.id);
      v1::SessionInfo out;
      st = stub->GetSession(&ctx, r, &out);
      break;
    }
    case Rpc::kCloseSession: {
      v1::CloseSessionRequest r;
      r.set_session_id(c.id);
      v1::CloseSessionResponse out;
      st = stub->CloseSession(&ctx, r, &out);
      break;
    }
    case Rpc::kGetModel: {
      v1::GetModelRequest r;
      r.set_name(c.id);
      v1::ModelInfo out;
      st = stub->GetModel(&ctx, r, &out);
      break;
    }
    case Rpc::kDecode: {
      auto stream = stub->Decode(&ctx);
      for (size_t i = 0; i < c.decode.size(); ++i) {
        const bool last = i + 1 == c.decode.size();
        if (!stream->Write(c.decode[i])) break;
        v1::DecodeResponse resp;
        if (!stream->Read(&resp)) break;  // the stream's status says why
        if (resp.has_error()) {
          if (!last) {
            return {Code::ABORTED,
                    absl::StrCat("setup op ", i, " failed: ", resp.error().message())};
          }
          stream->WritesDone();
          stream->Finish();
          return {static_cast<Code>(resp.error().code()), resp.error().message()};
        }
        if (last) {
          stream->WritesDone();
          const grpc::Status end = stream->Finish();
          if (!end.ok()) return {end.error_code(), end.error_message()};
          return {Code::OK, ""};
        }
      }
      stream->WritesDone();
      st = stream->Finish();
      if (st.ok()) return {Code::UNKNOWN, "the stream ended OK before the last operation"};
      break;
    }
  }
  return {st.error_code(), st.error_message()};
}

TEST(MalformedMatrixTest, EveryCaseGetsItsCodeAndNamesItsFieldThenTheServerStillWorks) {
  auto server = StartTestServer(TestServerOptions());
  ASSERT_NE(server, nullptr);
  auto stub = TestStub(server->port());
  const std::vector<Case> cases = GenerateCases();
  ASSERT_GE(cases.size(), 1000u);
  int failures = 0;
  for (const Case& c : cases) {
    const Outcome o = RunCase(stub.get(), c);
    EXPECT_NE(o.code, Code::INTERNAL) << c.name << ": " << o.message;
    EXPECT_NE(o.code, Code::UNKNOWN) << c.name << ": " << o.message;
    const bool code_ok = o.code == c.code;
    const bool names_ok = c.code == Code::OK || o.message.find(c.names) != std::string::npos;
    // Client strings are quoted to a prefix; every message is capped.
    const bool short_ok = o.message.size() <= 1024;
    if (!code_ok || !names_ok || !short_ok) {
      ++failures;
      ADD_FAILURE() << c.name << ": expected code " << c.code << " naming \"" << c.names
                    << "\", got " << o.code << " \"" << o.message.substr(0, 300) << "\"";
    }
  }
  RecordProperty("cases", static_cast<int>(cases.size()));
  std::printf("malformed matrix: %zu cases, %d mismatches\n", cases.size(), failures);

  // Afterwards: SERVING, no session left behind, and a valid Attend exact.
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server->port()),
                                     grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext hctx;
  grpc::health::v1::HealthCheckRequest hreq;
  grpc::health::v1::HealthCheckResponse hresp;
  ASSERT_TRUE(health->Check(&hctx, hreq, &hresp).ok());
  EXPECT_EQ(hresp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
    EXPECT_EQ(info.open_sessions(), 0);
    EXPECT_EQ(info.memory_bytes_in_use(), 0);
  }
  // One query over three equal keys: the answer is the mean of the values.
  v1::AttendRequest r;
  r.mutable_spec()->set_heads(1);
  r.mutable_spec()->set_head_dim(2);
  *r.mutable_q() = Wire({1, 1, 1, 2});
  v1::Tensor k = Wire({1, 3, 1, 2});
  const float key[2] = {0.5f, -0.25f};
  for (int i = 0; i < 3; ++i) std::memcpy(k.mutable_data()->data() + 8 * i, key, 8);
  *r.mutable_k() = k;
  v1::Tensor v = Wire({1, 3, 1, 2});
  const float vals[6] = {1, 2, 3, 4, 5, 6};
  std::memcpy(v.mutable_data()->data(), vals, sizeof(vals));
  *r.mutable_v() = v;
  grpc::ClientContext ctx;
  v1::AttendResponse out;
  const grpc::Status st = stub->Attend(&ctx, r, &out);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(out.out().data().size(), 8u);
  float got[2];
  std::memcpy(got, out.out().data().data(), 8);
  EXPECT_NEAR(got[0], 3.0f, 1e-6);  // (1 + 3 + 5) / 3
  EXPECT_NEAR(got[1], 4.0f, 1e-6);  // (2 + 4 + 6) / 3
}


// ------------------------------------------------- bytes that do not parse --

namespace raw {

grpc::ByteBuffer Bytes(const std::string& s) {
  grpc::Slice slice(s);
  return grpc::ByteBuffer(&slice, 1);
}

// One unary call of `method` carrying `bytes` as its message.
grpc::Status Unary(grpc::GenericStub* stub, const std::string& method, const std::string& bytes) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  const grpc::ByteBuffer request = Bytes(bytes);
  grpc::ByteBuffer response;
  absl::Notification done;
  grpc::Status status;
  stub->UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response,
                  [&](grpc::Status s) {
                    status = std::move(s);
                    done.Notify();
                  });
  done.WaitForNotification();
  return status;
}

// A stream of `method` (by default Decode): `messages` written in order,
// then the stream left open or, with `half_close`, closed for writes; then
// the stream's final status and how many answers came before it.
class Stream : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  Stream(grpc::GenericStub* stub, std::vector<std::string> messages,
         const std::string& method = "/ropeattn.v1.AttentionService/Decode",
         bool half_close = false)
      : messages_(std::move(messages)), half_close_(half_close) {
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    stub->PrepareBidiStreamingCall(&ctx_, method, grpc::StubOptions(), this);
    StartRead(&in_);
    WriteNext();
    StartCall();
  }
  grpc::Status Await(int* answers) {
    done_.WaitForNotification();
    *answers = answers_;
    return status_;
  }
  void OnWriteDone(bool ok) override {
    if (ok) WriteNext();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    ++answers_;
    StartRead(&in_);
  }
  void OnDone(const grpc::Status& s) override {
    status_ = s;
    done_.Notify();
  }

 private:
  void WriteNext() {
    if (next_ == messages_.size()) {
      if (half_close_) StartWritesDone();
      return;
    }
    out_ = Bytes(messages_[next_++]);
    StartWrite(&out_);
  }
  grpc::ClientContext ctx_;
  std::vector<std::string> messages_;
  const bool half_close_;
  size_t next_ = 0;
  grpc::ByteBuffer in_, out_;
  int answers_ = 0;
  grpc::Status status_;
  absl::Notification done_;
};

}  // namespace raw

// gRPC's own parsing answered a unary call whose bytes do not parse
// UNIMPLEMENTED with no message, and ended a Decode stream with OK as if
// its client had half-closed (the step dropped, a non-resumable session
// freed). The service parses them itself now: INVALID_ARGUMENT naming the
// message type, and the field for a string that is not UTF-8.
TEST(UnparseableBytesTest, AreInvalidArgumentNamingTheMessageOnEveryMethod) {
  auto server = StartTestServer(TestServerOptions());
  ASSERT_NE(server, nullptr);
  grpc::GenericStub stub(TestChannel(server->port()));
  // A field 1 length prefix past the end; a group end tag with no start.
  v1::AttendRequest attend;
  attend.mutable_spec()->set_heads(1);
  const std::string good = attend.SerializeAsString();
  const std::vector<std::string> bad = {good.substr(0, good.size() - 1) + "\x0a\x7f",
                                        std::string("\x0c\xff\xff", 3)};
  const std::vector<std::pair<const char*, const char*>> methods = {
      {"Attend", "AttendRequest"},
      {"Encode", "EncodeRequest"},
      {"Embed", "EmbedRequest"},
      {"GetSession", "GetSessionRequest"},
      {"ListSessions", "ListSessionsRequest"},
      {"CloseSession", "CloseSessionRequest"},
      {"GetServerInfo", "GetServerInfoRequest"},
      {"ListModels", "ListModelsRequest"},
      {"GetModel", "GetModelRequest"}};
  for (const auto& [method, type] : methods) {
    for (const std::string& bytes : bad) {
      const grpc::Status st =
          raw::Unary(&stub, absl::StrCat("/ropeattn.v1.AttentionService/", method), bytes);
      EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
      EXPECT_THAT(st.error_message(),
                  ::testing::HasSubstr(absl::StrCat("not a valid ropeattn.v1.", type)))
          << method;
    }
  }
  // A string that is not UTF-8: named by field.
  {
    v1::GetSessionRequest r;
    r.set_session_id("ab\xff\xfe");
    const grpc::Status st =
        raw::Unary(&stub, "/ropeattn.v1.AttentionService/GetSession", r.SerializeAsString());
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr("GetSessionRequest.session_id"));
  }
  // Decode: a good open answered, then bytes that do not parse end the
  // stream with INVALID_ARGUMENT, not OK.
  v1::DecodeRequest open;
  v1::OpenSession* o = open.mutable_open();
  o->mutable_spec()->set_heads(1);
  o->mutable_spec()->set_head_dim(4);
  o->set_max_context(8);
  v1::DecodeRequest attach;
  attach.mutable_attach()->set_session_id("ab\xff\xfe");
  for (const std::string& bytes : {bad[0], bad[1], attach.SerializeAsString()}) {
    raw::Stream stream(&stub, {open.SerializeAsString(), bytes});
    int answers = 0;
    const grpc::Status st = stream.Await(&answers);
    EXPECT_EQ(answers, 1);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr("not a valid ropeattn.v1.DecodeRequest"));
  }
  // The server still answers well-formed calls.
  auto typed = TestStub(server->port());
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  ASSERT_TRUE(typed->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.open_sessions(), 0);
}

// gRPC's health service (its own parsing) ended a Watch whose request does
// not parse INTERNAL "could not parse request"; its Check answers the same
// bytes INVALID_ARGUMENT, and so does Watch now. Valid calls are unchanged.
TEST(UnparseableBytesTest, AreInvalidArgumentOnHealth) {
  auto server = StartTestServer(TestServerOptions());
  ASSERT_NE(server, nullptr);
  grpc::GenericStub stub(TestChannel(server->port()));
  const std::string garbage("\xff\xff\xff", 3);
  const grpc::Status check = raw::Unary(&stub, "/grpc.health.v1.Health/Check", garbage);
  EXPECT_EQ(check.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << check.error_message();
  raw::Stream watch(&stub, {garbage}, "/grpc.health.v1.Health/Watch", /*half_close=*/true);
  int answers = -1;
  const grpc::Status st = watch.Await(&answers);
  EXPECT_EQ(answers, 0);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_EQ(st.error_message(), "could not parse request");
  // A valid Watch still answers SERVING and stays open.
  auto health = grpc::health::v1::Health::NewStub(TestChannel(server->port()));
  grpc::ClientContext ctx;
  auto reader = health->Watch(&ctx, grpc::health::v1::HealthCheckRequest());
  grpc::health::v1::HealthCheckResponse resp;
  ASSERT_TRUE(reader->Read(&resp));
  EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  ctx.TryCancel();
  while (reader->Read(&resp)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

// gRPC 1.51's reflection service (gRPC parses its requests) ended a stream
// whose message does not parse with OK, as if its client had half-closed:
// the requests after it were never answered. INVALID_ARGUMENT naming the
// message type now; a stream its client half-closes still ends OK, an empty
// message (valid) is still answered.
TEST(UnparseableBytesTest, AreInvalidArgumentOnReflection) {
  auto server = StartTestServer(TestServerOptions());
  ASSERT_NE(server, nullptr);
  grpc::GenericStub stub(TestChannel(server->port()));
  const std::string method = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";
  const std::string list("\x3a\x00", 2);  // list_services: ""
  const std::string garbage("\xff\xff", 2);
  const std::string not_utf8("\x0a\x02\xff\xfe", 4);  // host
  // Field 2^29 - 1 (the number the server marks its request object with),
  // as a varint and as a fixed64, then bytes that do not parse: the field
  // must not pass for the server's mark.
  const std::string spoof_varint("\xf8\xff\xff\xff\x0f\x01\xff\xff", 8);
  const std::string spoof_fixed64 =
      std::string("\xf9\xff\xff\xff\x0f", 5) + std::string(8, '\x01') + garbage;
  // The same field in a message that parses is answered.
  const std::string marked_list = std::string("\xf8\xff\xff\xff\x0f\x01", 6) + list;
  struct Case {
    std::vector<std::string> messages;
    bool half_close;
    int answers;
    grpc::StatusCode code;
  };
  const std::vector<Case> cases = {
      {{list, garbage, list}, false, 1, grpc::StatusCode::INVALID_ARGUMENT},
      {{garbage}, false, 0, grpc::StatusCode::INVALID_ARGUMENT},
      {{list, list, not_utf8}, true, 2, grpc::StatusCode::INVALID_ARGUMENT},
      {{list, list}, true, 2, grpc::StatusCode::OK},
      {{"", list}, true, 2, grpc::StatusCode::OK},
      {{}, true, 0, grpc::StatusCode::OK},
      {{list, spoof_varint, list}, false, 1, grpc::StatusCode::INVALID_ARGUMENT},
      {{list, spoof_fixed64, list}, false, 1, grpc::StatusCode::INVALID_ARGUMENT},
      {{marked_list, list}, true, 2, grpc::StatusCode::OK},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    raw::Stream stream(&stub, cases[i].messages, method, cases[i].half_close);
    int answers = -1;
    const grpc::Status st = stream.Await(&answers);
    EXPECT_EQ(answers, cases[i].answers) << "case " << i;
    EXPECT_EQ(st.error_code(), cases[i].code) << "case " << i << ": " << st.error_message();
    if (!st.ok()) {
      EXPECT_THAT(
          st.error_message(),
          ::testing::HasSubstr("not a valid grpc.reflection.v1alpha.ServerReflectionRequest"));
    }
  }
}

}  // namespace
}  // namespace ropeattn::testing

namespace ropeattn::testing {
namespace {

// The bound is at least what parsing allocates, on the shapes that widen.
TEST(ParsedBytesBoundTest, CoversWhatParsingAllocates) {
  std::vector<std::pair<std::string, std::unique_ptr<google::protobuf::Message>>> cases;
  {
    auto e = std::make_unique<v1::EmbedRequest>();
    e->set_model("demo");
    for (int i = 0; i < 100000; ++i) e->add_token_ids(i % 100);  // 1-byte varints
    cases.emplace_back(e->SerializeAsString(), std::make_unique<v1::EmbedRequest>());
  }
  {
    // Unknown varint fields, each 2-3 wire bytes.
    std::string bytes;
    for (int i = 0; i < 100000; ++i) bytes += std::string("\xa0\x06\x01", 3);  // field 100
    cases.emplace_back(bytes, std::make_unique<v1::GetServerInfoRequest>());
  }
  {
    v1::AttendRequest a = [] {
      v1::AttendRequest r;
      r.mutable_spec()->set_heads(2);
      r.mutable_spec()->set_head_dim(4);
      for (int i = 0; i < 1000; ++i) r.add_q_positions(i);
      *r.mutable_q() = Wire({1, 8, 2, 4});
      return r;
    }();
    cases.emplace_back(a.SerializeAsString(), std::make_unique<v1::AttendRequest>());
  }
  {
    // A group on a repeated number field (token_ids): kept as unknown
    // fields, one entry per inner field; it was bounded at 576 bytes.
    const int field = v1::EmbedRequest::descriptor()->FindFieldByName("token_ids")->number();
    std::string bytes(1, static_cast<char>(field << 3 | 3));
    for (int i = 0; i < 100000; ++i) bytes += std::string("\x08\x00", 2);
    bytes += static_cast<char>(field << 3 | 4);
    cases.emplace_back(bytes, std::make_unique<v1::EmbedRequest>());
  }
  for (auto& [bytes, message] : cases) {
    // Chunked, as gRPC hands over a message's slices.
    google::protobuf::io::ArrayInputStream in(bytes.data(), static_cast<int>(bytes.size()), 16384);
    const std::optional<int64_t> bound = server::ParsedBytesBound(&in, message->GetDescriptor());
    ASSERT_TRUE(bound.has_value()) << message->GetTypeName();
    google::protobuf::io::ArrayInputStream again(bytes.data(), static_cast<int>(bytes.size()),
                                                 16384);
    ASSERT_TRUE(message->ParseFromZeroCopyStream(&again)) << message->GetTypeName();
    EXPECT_GE(*bound, static_cast<int64_t>(message->SpaceUsedLong())) << message->GetTypeName();
    EXPECT_GT(*bound, static_cast<int64_t>(bytes.size())) << message->GetTypeName();
  }
  // Packed floats are bounded by their count (4 wire bytes each), not their
  // bytes: a one-token step of 32 heads of 128 given as f32_values stays
  // within the 64 KiB the server does not reserve for.
  {
    v1::DecodeRequest step;
    for (v1::Tensor* t : {step.mutable_step()->mutable_q(), step.mutable_step()->mutable_k(),
                          step.mutable_step()->mutable_v()}) {
      for (int64_t d : {1, 1, 32, 128}) t->add_shape(d);
      for (int i = 0; i < 32 * 128; ++i) t->add_f32_values(0.5f);
    }
    const std::string bytes = step.SerializeAsString();
    google::protobuf::io::ArrayInputStream in(bytes.data(), static_cast<int>(bytes.size()));
    const std::optional<int64_t> bound = server::ParsedBytesBound(&in, v1::DecodeRequest::descriptor());
    ASSERT_TRUE(bound.has_value());
    EXPECT_LT(*bound - static_cast<int64_t>(bytes.size()), int64_t{64} << 10);
  }
  // Not wire format: no bound (the parse refuses it).
  const std::string junk("\x0c\xff\xff", 3);
  google::protobuf::io::ArrayInputStream in(junk.data(), static_cast<int>(junk.size()));
  EXPECT_FALSE(server::ParsedBytesBound(&in, v1::AttendRequest::descriptor()).has_value());
}

// Parsing is a cost checked before the work: 32 MiB of one-byte token ids
// parsed into ~545 MiB (each an int64, the array doubling) before any
// budget check. What parsing takes beyond the wire bytes is now reserved
// from the memory budget first, or the request is refused.
TEST(UnparseableBytesTest, ParsingThatWidensPastTheBudgetIsRefusedBeforeIt) {
  server::ServerOptions o = TestServerOptions();
  o.memory_budget_bytes = int64_t{64} << 20;
  auto server = StartTestServer(o);
  ASSERT_NE(server, nullptr);
  grpc::GenericStub stub(TestChannel(server->port()));
  v1::EmbedRequest embed;
  embed.set_model("demo");
  for (int i = 0; i < (8 << 20); ++i) embed.add_token_ids(1);  // 8 MiB on the wire
  grpc::Status st =
      raw::Unary(&stub, "/ropeattn.v1.AttentionService/Embed", embed.SerializeAsString());
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_THAT(st.error_message(), ::testing::HasSubstr("parsing this ropeattn.v1.EmbedRequest"));
  std::string unknown;
  for (int i = 0; i < (3 << 20); ++i) unknown += std::string("\xa0\x06\x01", 3);
  st = raw::Unary(&stub, "/ropeattn.v1.AttentionService/GetServerInfo", unknown);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_THAT(st.error_message(),
              ::testing::HasSubstr("parsing this ropeattn.v1.GetServerInfoRequest"));
  // Ordinary requests are unaffected, and nothing stays reserved.
  auto typed = TestStub(server->port());
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  ASSERT_TRUE(typed->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.memory_bytes_in_use(), 0);
  v1::EmbedRequest small;
  small.set_model("demo");
  for (int i = 0; i < 1000; ++i) small.add_token_ids(1);
  grpc::ClientContext ectx;
  v1::EmbedResponse out;
  EXPECT_TRUE(typed->Embed(&ectx, small, &out).ok());
}

}  // namespace
}  // namespace ropeattn::testing
