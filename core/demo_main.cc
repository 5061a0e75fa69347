// ropeattn-demo: a short tour of the core, printing a few results.
// (The server and client take over the main job in later milestones.)
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "core/attention.h"
#include "core/cpu.h"
#include "core/encodings.h"
#include "core/linear_attention.h"
#include "core/relative_bias.h"
#include "core/rope.h"

namespace ropeattn {
namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "demo failed: %s\n", s.ToString().c_str());
  return 1;
}

void Fill(Tensor& t, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1, 1);
  for (int64_t i = 0; i < t.num_elements(); ++i) t.data<float>()[i] = dist(rng);
}

int Run() {
  std::printf("ropeattn core demo on %s\n\n", CpuDescription().c_str());
  const int threads = AvailableCpus();

  // 1. RoPE frequencies under each scaling rule (head_dim 128, pairs 0, 31, 63).
  std::printf("RoPE inverse frequencies (head_dim 128, theta 500000) and attention factor:\n");
  const char* rules[] = {"default", "linear", "ntk", "dynamic", "yarn", "llama3"};
  for (const char* name : rules) {
    RopeConfig cfg;
    cfg.head_dim = 128;
    cfg.theta = 500000;
    cfg.scaling.type = ParseRopeScalingType(name).value();
    cfg.scaling.factor = cfg.scaling.type == RopeScalingType::kDefault ? 1.0 : 8.0;
    cfg.scaling.original_max_positions = 8192;
    auto f = ComputeRopeFrequencies(cfg, 32768);
    if (!f.ok()) return Fail(f.status());
    std::printf("  %-8s pair0 %.6e  pair31 %.6e  pair63 %.6e  factor %.4f\n", name, f->inv_freq[0],
                f->inv_freq[31], f->inv_freq[63], f->attention_factor);
  }

  // 2. Relative biases.
  auto slopes = AlibiSlopes(12);
  if (!slopes.ok()) return Fail(slopes.status());
  std::printf("\nALiBi slopes for 12 heads:");
  for (double s : *slopes) std::printf(" %.5f", s);
  T5BucketConfig t5;
  std::printf(
      "\nT5 buckets (bidirectional, 32 buckets, max distance 128) for -100 -8 -1 0 1 8 100:");
  for (int rel : {-100, -8, -1, 0, 1, 8, 100}) std::printf(" %d", T5RelativeBucket(rel, t5));
  std::printf("\n");

  // 3. Rotary attention: a causal prefill of 16 tokens, then the same last
  //    token decoded against the cache, with GQA (8 query heads, 2 kv heads).
  const int64_t s = 16, h = 8, kvh = 2, d = 64;
  Tensor q = Tensor::Create(DType::kF32, {1, s, h, d}).value();
  Tensor k = Tensor::Create(DType::kF32, {1, s, kvh, d}).value();
  Tensor v = Tensor::Create(DType::kF32, {1, s, kvh, d}).value();
  Fill(q, 1);
  Fill(k, 2);
  Fill(v, 3);
  RopeConfig cfg;
  cfg.head_dim = d;
  auto rope = RopeRotator::Create(cfg, s, s);
  if (!rope.ok()) return Fail(rope.status());
  absl::Status st = rope->Apply(q.view(), Positions{}, RopeDirection::kForward, threads);
  if (st.ok()) st = rope->Apply(k.view(), Positions{}, RopeDirection::kForward, threads);
  if (!st.ok()) return Fail(st);
  Tensor out = Tensor::Create(DType::kF32, {1, s, h, d}).value();
  AttentionOptions opt;
  opt.causal = true;
  opt.num_threads = threads;
  opt.force_path = AttentionOptions::Path::kPrefill;
  if (st = Attend(q.view(), k.view(), v.view(), opt, out.view()); !st.ok()) return Fail(st);
  Tensor last = Tensor::Create(DType::kF32, {1, 1, h, d}).value();
  opt.force_path = AttentionOptions::Path::kDecode;
  ConstTensorView q_last = q.cview().Slice(1, s - 1, 1);
  if (st = Attend(q_last, k.view(), v.view(), opt, last.view()); !st.ok()) return Fail(st);
  double max_diff = 0;
  for (int64_t i = 0; i < h * d; ++i) {
    max_diff = std::max<double>(
        max_diff, std::abs(last.data<float>()[i] - out.data<float>()[(s - 1) * h * d + i]));
  }
  std::printf("\nCausal RoPE attention, 16 tokens, 8 heads over 2 kv heads, head_dim 64:\n");
  std::printf("  out[15, head 0, 0:4] = %.6f %.6f %.6f %.6f\n", out.data<float>()[(s - 1) * h * d],
              out.data<float>()[(s - 1) * h * d + 1], out.data<float>()[(s - 1) * h * d + 2],
              out.data<float>()[(s - 1) * h * d + 3]);
  std::printf("  decode path for token 15 vs prefill row 15: max |diff| = %.2e\n", max_diff);

  // 4. Linear attention: the recurrent state reproduces the parallel form.
  LinearAttentionOptions lopt;
  lopt.rope = &*rope;
  lopt.num_threads = threads;
  Tensor lin = Tensor::Create(DType::kF32, {1, s, h, d}).value();
  if (st = LinearAttend(q.view(), k.view(), v.view(), Positions{}, lopt, lin.view()); !st.ok()) {
    return Fail(st);
  }
  auto state = LinearAttentionState::Create(1, kvh, d, d);
  if (!state.ok()) return Fail(state.status());
  double lin_diff = 0;
  Tensor step_out = Tensor::Create(DType::kF32, {1, 1, h, d}).value();
  for (int64_t t = 0; t < s; ++t) {
    st = state->Step(q.cview().Slice(1, t, 1), k.cview().Slice(1, t, 1), v.cview().Slice(1, t, 1),
                     lopt, step_out.view());
    if (!st.ok()) return Fail(st);
    for (int64_t i = 0; i < h * d; ++i) {
      lin_diff = std::max<double>(
          lin_diff, std::abs(step_out.data<float>()[i] - lin.data<float>()[t * h * d + i]));
    }
  }
  std::printf(
      "\nLinear attention with RoPE: recurrent (%lld state bytes) vs parallel form: "
      "max |diff| = %.2e\n",
      static_cast<long long>(state->byte_size()), lin_diff);
  return 0;
}

}  // namespace
}  // namespace ropeattn

int main() { return ropeattn::Run(); }
