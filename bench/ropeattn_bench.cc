// ropeattn-bench: kernel speed as a fraction of this machine's own ceilings,
// measured in the same run.
//
// Ceilings (run first; a kernel case whose ceiling was filtered out measures
// it itself before starting):
//   ceiling/copy_bandwidth  large buffer copy on all threads; bytes = read + write
//   ceiling/gemm_f32        oneDNN matmul 2048^3 f32 through core MatMul
//   ceiling/gemm_bf16       the same in bf16 (f32 accumulation)
// Kernel cases report their rate (bytes/s for rope and decode: bytes read +
// written; FLOP/s for prefill, causal FLOPs = 2 * S * S * D * H) and
// fraction_of_ceiling. Decode caches are rotated among enough copies to defeat
// the L3, and are passed with check_finite = false because a serving session
// checks K/V once when they are appended, not on every step.
//
// Threads: ROPEATTN_BENCH_THREADS, default all available CPUs.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench/copy_ceiling.h"
#include "absl/strings/str_format.h"
#include "benchmark/benchmark.h"
#include "core/attention.h"
#include "core/cpu.h"
#include "core/decode_state.h"
#include "core/gemm.h"
#include "core/kv_cache.h"
#include "core/rope.h"
#include "core/tensor.h"

namespace ropeattn {
namespace {

using Clock = std::chrono::steady_clock;

int Threads() {
  if (const char* env = std::getenv("ROPEATTN_BENCH_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  return AvailableCpus();
}

Tensor Random(DType dtype, std::vector<int64_t> dims, uint64_t seed) {
  Tensor t = Tensor::Create(dtype, dims).value();
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const int64_t n = t.num_elements();
  if (dtype == DType::kF32) {
    float* p = t.data<float>();
    for (int64_t i = 0; i < n; ++i) p[i] = dist(rng);
  } else {
    uint16_t* p = t.data<uint16_t>();
    for (int64_t i = 0; i < n; ++i) p[i] = FloatToBF16(dist(rng));
  }
  return t;
}

// ------------------------------------------------------------- ceilings --

enum Ceiling { kCopy = 0, kGemmF32 = 1, kGemmBF16 = 2, kRead = 3 };
// The best rate seen so far in this run: with --benchmark_repetitions each
// ceiling repetition may raise it, and every kernel is judged against the
// highest (never against whichever repetition happened to run last).
double g_ceiling[4] = {0, 0, 0, 0};
void RaiseCeiling(Ceiling which, double rate) {
  g_ceiling[which] = std::max(g_ceiling[which], rate);
}

using bench::BestCopyBandwidth;
using bench::CopyBuffers;
using bench::kCopyBytes;
using bench::ParallelCopy;

// Streams the source buffer with vector loads only (no writes). Not one of
// the required ceilings: decode only reads, so this says how close it is to
// what memory can deliver to reads alone.
float ParallelRead(const CopyBuffers& b, int threads) {
  float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t n = kCopyBytes / sizeof(float) / nt;
    const float* p = reinterpret_cast<const float*>(b.src) + t * n;
    // 64 independent partial sums (eight 8-lane vectors once vectorized), so
    // the adds never wait on each other and only the loads can limit the
    // rate. Four scalar sums left it add-latency-bound: ~12% below this when
    // memory was fast (64 vs 72 GB/s).
    constexpr int64_t kLanes = 64;
    float acc[kLanes] = {};
    for (int64_t i = 0; i + kLanes <= n; i += kLanes) {
      for (int64_t j = 0; j < kLanes; ++j) acc[j] += p[i + j];
    }
    for (float x : acc) total += x;
  }
  return total;
}

double MeasureGemm(DType dtype, int reps, int threads) {
  const int64_t n = 2048;
  Tensor a = Random(dtype, {n, n}, 1), bm = Random(dtype, {n, n}, 2);
  Tensor c = Tensor::Create(DType::kF32, {n, n}).value();
  if (!MatMul(a.view(), bm.view(), c.view(), threads).ok()) std::abort();  // warm-up
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    if (!MatMul(a.view(), bm.view(), c.view(), threads).ok()) std::abort();
    double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, 2.0 * n * n * n / s);
  }
  return best;
}

double EnsureCeiling(Ceiling which) {
  if (g_ceiling[which] > 0) return g_ceiling[which];
  const int threads = Threads();
  if (which == kCopy) {
    g_ceiling[kCopy] = BestCopyBandwidth(threads);
  } else if (which == kRead) {
    CopyBuffers b;
    double best = 0;
    for (int r = 0; r < 5; ++r) {
      auto t0 = Clock::now();
      benchmark::DoNotOptimize(ParallelRead(b, threads));
      double s = std::chrono::duration<double>(Clock::now() - t0).count();
      best = std::max(best, kCopyBytes / s);
    }
    g_ceiling[kRead] = best;
  } else {
    g_ceiling[which] = MeasureGemm(which == kGemmF32 ? DType::kF32 : DType::kBF16, 5, threads);
  }
  return g_ceiling[which];
}

// Runs `body` in the benchmark loop, timing wall clock ourselves (the
// kernels are multi-threaded, so CPU time would mislead), and reports
// `work` units per iteration as a rate plus its fraction of the ceiling.
template <typename Body>
void RunTimed(benchmark::State& state, double work_per_iter, const char* unit, Ceiling ceiling,
              Body&& body) {
  const double ceil_rate = EnsureCeiling(ceiling);
  double seconds = 0;
  int64_t iters = 0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    body(iters);
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    ++iters;
  }
  const double rate = work_per_iter * iters / seconds;
  state.counters[unit] = benchmark::Counter(rate);
  state.counters["fraction_of_ceiling"] = rate / ceil_rate;
  state.counters["ceiling"] = benchmark::Counter(ceil_rate);
  state.counters["threads"] = Threads();
}

void BM_CopyBandwidth(benchmark::State& state) {
  const int threads = Threads();
  CopyBuffers b;
  ParallelCopy(b, threads);
  double seconds = 0;
  int64_t iters = 0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    ParallelCopy(b, threads);
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    ++iters;
  }
  const double rate = 2.0 * kCopyBytes * iters / seconds;
  RaiseCeiling(kCopy, rate);
  state.counters["bytes_per_second"] = benchmark::Counter(rate);
  state.counters["threads"] = threads;
}

void BM_ReadBandwidth(benchmark::State& state) {
  const int threads = Threads();
  CopyBuffers b;
  double seconds = 0;
  int64_t iters = 0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    benchmark::DoNotOptimize(ParallelRead(b, threads));
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    ++iters;
  }
  const double rate = static_cast<double>(kCopyBytes) * iters / seconds;
  RaiseCeiling(kRead, rate);
  state.counters["bytes_per_second"] = benchmark::Counter(rate);
  state.counters["threads"] = threads;
}

void BM_Gemm(benchmark::State& state, DType dtype) {
  const int threads = Threads();
  const int64_t n = 2048;
  Tensor a = Random(dtype, {n, n}, 1), b = Random(dtype, {n, n}, 2);
  Tensor c = Tensor::Create(DType::kF32, {n, n}).value();
  if (!MatMul(a.view(), b.view(), c.view(), threads).ok()) {
    state.SkipWithError("MatMul failed");
    return;
  }
  double seconds = 0;
  int64_t iters = 0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    benchmark::DoNotOptimize(MatMul(a.view(), b.view(), c.view(), threads));
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    ++iters;
  }
  const double rate = 2.0 * n * n * n * iters / seconds;
  RaiseCeiling(dtype == DType::kF32 ? kGemmF32 : kGemmBF16, rate);
  state.counters["FLOP/s"] = benchmark::Counter(rate);
  state.counters["threads"] = threads;
}

// ---------------------------------------------------------------- rope --

void BM_Rope(benchmark::State& state, RopeLayout layout) {
  const int64_t s = 2048, h = 32, d = 128;
  RopeConfig cfg;
  cfg.head_dim = d;
  cfg.layout = layout;
  auto rot = RopeRotator::Create(cfg, s, s);
  if (!rot.ok()) {
    state.SkipWithError(std::string(rot.status().message()).c_str());
    return;
  }
  // Tensors in turn (128 MiB in all, 4x the L3), so each call starts with its
  // input in memory, not in cache.
  std::vector<Tensor> xs;
  for (int i = 0; i < 4; ++i) xs.push_back(Random(DType::kF32, {1, s, h, d}, 10 + i));
  const double bytes = 2.0 * s * h * d * sizeof(float);
  RunTimed(state, bytes, "bytes_per_second", kCopy, [&](int64_t it) {
    absl::Status st =
        rot->Apply(xs[it % xs.size()].view(), Positions{}, RopeDirection::kForward, Threads());
    if (!st.ok()) std::abort();
  });
}

// -------------------------------------------------------------- decode --

// Where the decode reads K/V from: where a decoding session of this dtype
// keeps them on this machine (DecodeState::StorageFor: pages of 32 tokens
// in the KvCache's tile layout where its decode is the faster one,
// KvCacheDecodeIsFaster, else 16-token pages), or token-major tensors as a
// stateless Attend call passes them.
enum class KvSource { kSession, kTensors };

// A session state holding K/V [1, kv, kv_heads, d] (raw keys, no RoPE) in
// its pages, f32, bf16 or int8.
DecodeState PagedState(const Tensor& k, const Tensor& v, int64_t heads, bool int8) {
  DecodeStateConfig c;
  c.heads = heads;
  c.kv_heads = k.dim(2);
  c.head_dim = k.dim(3);
  c.v_dim = v.dim(3);
  c.max_context = k.dim(1);
  c.kv_dtype = int8 ? DType::kF32 : k.dtype();
  c.int8_kv = int8;
  DecodeState s = DecodeState::Create(c).value();
  if (!s.Import(k.cview(), v.cview(), DecodeState::KeyForm::kRaw).ok() ||
      s.paged_view() == nullptr) {
    std::abort();
  }
  return s;
}

void BM_Decode(benchmark::State& state, DType kv_dtype, int64_t kv, int64_t kv_heads,
               KvSource requested, BiasKind bias) {
  const int64_t h = 32, d = 128;
  const bool paged = requested == KvSource::kSession;
  state.counters["paged"] = paged ? 1 : 0;
  const int64_t cache_bytes = 2 * kv * kv_heads * d * static_cast<int64_t>(DTypeSize(kv_dtype));
  // Enough caches that the set is 4x the L3 (32 MiB here) or more.
  const int copies = static_cast<int>(std::max<int64_t>(2, (int64_t{128} << 20) / cache_bytes + 1));
  std::vector<Tensor> ks, vs;
  std::vector<DecodeState> states;
  for (int i = 0; i < copies; ++i) {
    Tensor k = Random(kv_dtype, {1, kv, kv_heads, d}, 100 + i);
    Tensor v = Random(kv_dtype, {1, kv, kv_heads, d}, 200 + i);
    if (paged) {
      states.push_back(PagedState(k, v, 32, /*int8=*/false));
    } else {
      ks.push_back(std::move(k));
      vs.push_back(std::move(v));
    }
  }
  Tensor q = Random(DType::kF32, {1, 1, h, d}, 7);
  Tensor out = Tensor::Create(DType::kF32, {1, 1, h, d}).value();
  AttentionOptions opt;
  opt.causal = true;
  opt.check_finite = false;
  opt.num_threads = Threads();
  if (bias == BiasKind::kAlibi) {
    opt.bias.kind = BiasKind::kAlibi;
    for (int64_t i = 1; i <= h; ++i) opt.bias.alibi_slopes.push_back(std::exp2(-8.0 * i / h));
  }
  RunTimed(state, static_cast<double>(cache_bytes), "bytes_per_second", kCopy, [&](int64_t it) {
    const int c = static_cast<int>(it % copies);
    absl::Status st =
        paged ? AttendPaged(q.view(), *states[c].paged_view(), kv, opt, out.view())
                : Attend(q.view(), ks[c].view(), vs[c].view(), opt, out.view());
    if (!st.ok()) std::abort();
  });
  state.counters["caches"] = copies;
  // In the KvCache's tile layout: a KvCache, or a session's tile pages
  // (f32 and bf16 on AVX-512 machines).
  state.counters["kv_cache_layout"] =
      paged && DecodeState::IsTiles(states[0].storage()) ? 1 : 0;
  state.counters["fraction_of_read_bandwidth"] =
      state.counters["bytes_per_second"].value / EnsureCeiling(kRead);
}

// An int8 session cache (docs/kv-memory.md): the session's pages of int8
// rows with an f32 scale per (token, kv head), quantized from random K/V.
// Bytes: the int8 rows and their scales.
void BM_DecodeInt8(benchmark::State& state, int64_t kv, int64_t kv_heads) {
  const int64_t h = 32, d = 128;
  const int64_t cache_bytes = 2 * kv * kv_heads * (d + static_cast<int64_t>(sizeof(float)));
  const int copies = static_cast<int>(std::max<int64_t>(2, (int64_t{128} << 20) / cache_bytes + 1));
  std::vector<DecodeState> states;
  for (int i = 0; i < copies; ++i) {
    Tensor k = Random(DType::kF32, {1, kv, kv_heads, d}, 100 + i);
    Tensor v = Random(DType::kF32, {1, kv, kv_heads, d}, 200 + i);
    states.push_back(PagedState(k, v, h, /*int8=*/true));
  }
  Tensor q = Random(DType::kF32, {1, 1, h, d}, 7);
  Tensor out = Tensor::Create(DType::kF32, {1, 1, h, d}).value();
  AttentionOptions opt;
  opt.causal = true;
  opt.num_threads = Threads();
  RunTimed(state, static_cast<double>(cache_bytes), "bytes_per_second", kCopy, [&](int64_t it) {
    const int c = static_cast<int>(it % copies);
    if (!AttendPaged(q.view(), *states[c].paged_view(), kv, opt, out.view()).ok()) std::abort();
  });
  state.counters["caches"] = copies;
  // In the tile layout (int8 tile pages, AVX-512 machines) or head-major rows.
  state.counters["kv_cache_layout"] = DecodeState::IsTiles(states[0].storage()) ? 1 : 0;
  state.counters["paged"] = 1;
  state.counters["fraction_of_read_bandwidth"] =
      state.counters["bytes_per_second"].value / EnsureCeiling(kRead);
}

// ---------------------------------------------------------------- fork --

// Counts the bytes of the pages alive (every page once, whoever holds it).
class CountingPages : public KvPageCharger {
 public:
  absl::Status Charge(int64_t bytes) override {
    live_ += bytes;
    return absl::OkStatus();
  }
  void Refund(int64_t bytes) override { live_ -= bytes; }
  int64_t live() const { return live_; }

 private:
  std::atomic<int64_t> live_{0};
};

// Forks that share memory (docs/kv-memory.md): a session of `kv` tokens (32
// heads over kv_heads, d 128, f32, the storage a session has here) forked
// `forks` times, each fork then stepping `tokens` new tokens. Time: the
// forks and their steps. memory_ratio: the bytes the session and its forks
// hold together (each shared page once) / the session's bytes alone.
void BM_ForkMemory(benchmark::State& state, int64_t kv, int64_t kv_heads, int forks,
                   int64_t tokens) {
  const int64_t h = 32, d = 128;
  DecodeStateConfig c;
  c.heads = h;
  c.kv_heads = kv_heads;
  c.head_dim = d;
  c.v_dim = d;
  c.max_context = kv + tokens;
  auto pages = std::make_shared<CountingPages>();
  DecodeState parent = DecodeState::Create(c).value();
  parent.set_page_charger(pages);
  const bool paged = parent.paged_view() != nullptr;
  {
    Tensor k = Random(DType::kF32, {1, kv, kv_heads, d}, 1);
    Tensor v = Random(DType::kF32, {1, kv, kv_heads, d}, 2);
    if (!parent.Import(k.cview(), v.cview(), DecodeState::KeyForm::kRaw).ok()) std::abort();
  }
  const int64_t alone = paged ? pages->live() : parent.byte_size();
  Tensor q = Random(DType::kF32, {1, tokens, h, d}, 3);
  Tensor k = Random(DType::kF32, {1, tokens, kv_heads, d}, 4);
  Tensor v = Random(DType::kF32, {1, tokens, kv_heads, d}, 5);
  Tensor out = Tensor::Create(DType::kF32, {1, tokens, h, d}).value();
  int64_t together = 0;
  RunTimed(state, static_cast<double>(forks), "forks_per_second", kCopy, [&](int64_t) {
    std::vector<DecodeState> children;
    for (int f = 0; f < forks; ++f) {
      children.push_back(DecodeState::Create(c).value());
      children.back().set_page_charger(pages);
      if (!children.back().CopyFrom(parent).ok()) std::abort();
      if (!children.back().Step(q.cview(), k.cview(), v.cview(), out.view(), Threads()).ok()) {
        std::abort();
      }
    }
    together = paged ? pages->live() : alone;
    if (!paged) {
      for (const DecodeState& s : children) together += s.byte_size();
    }
  });
  state.counters.erase("fraction_of_ceiling");
  state.counters.erase("ceiling");
  state.counters["paged"] = paged ? 1 : 0;
  state.counters["session_bytes"] = static_cast<double>(alone);
  state.counters["total_bytes"] = static_cast<double>(together);
  state.counters["memory_ratio"] = static_cast<double>(together) / static_cast<double>(alone);
}

// ------------------------------------------------------------- prefill --

void BM_Prefill(benchmark::State& state, DType dtype, int64_t s, int64_t kv_heads) {
  const int64_t h = 32, d = 128;
  Tensor q = Random(dtype, {1, s, h, d}, 1);
  Tensor k = Random(dtype, {1, s, kv_heads, d}, 2);
  Tensor v = Random(dtype, {1, s, kv_heads, d}, 3);
  Tensor out = Tensor::Create(DType::kF32, {1, s, h, d}).value();
  AttentionOptions opt;
  opt.causal = true;
  opt.num_threads = Threads();
  const double flops = 2.0 * s * s * d * h;
  RunTimed(state, flops, "FLOP/s", dtype == DType::kF32 ? kGemmF32 : kGemmBF16, [&](int64_t) {
    absl::Status st = Attend(q.view(), k.view(), v.view(), opt, out.view());
    if (!st.ok()) std::abort();
  });
}

// A chunk of q_len new tokens against k_len keys (chunked prefill, a
// speculative step, a session's long step): causal, the queries the newest
// positions, so they see about every key.
void BM_PrefillChunk(benchmark::State& state, int64_t q_len, int64_t k_len, int64_t kv_heads) {
  const int64_t h = 32, d = 128;
  Tensor q = Random(DType::kF32, {1, q_len, h, d}, 1);
  Tensor k = Random(DType::kF32, {1, k_len, kv_heads, d}, 2);
  Tensor v = Random(DType::kF32, {1, k_len, kv_heads, d}, 3);
  Tensor out = Tensor::Create(DType::kF32, {1, q_len, h, d}).value();
  AttentionOptions opt;
  opt.causal = true;
  opt.num_threads = Threads();
  const double flops = 4.0 * q_len * k_len * d * h;
  RunTimed(state, flops, "FLOP/s", kGemmF32, [&](int64_t) {
    absl::Status st = Attend(q.view(), k.view(), v.view(), opt, out.view());
    if (!st.ok()) std::abort();
  });
}

// ------------------------------------------------------------- linear --

// A layer-mode projection, [rows, 4096] x W[4096, 4096]^T: oneDNN's matmul
// (Linear: prompts, stateless calls) against our row kernel (LinearRows:
// session steps, alone or batched). Work is the weight bytes, which every
// call streams once: rows = 16 is 16 one-token sessions projected together.
void BM_Linear(benchmark::State& state, DType wd, int64_t rows, bool ours) {
  const int64_t n = 4096;
  Tensor x = Random(DType::kF32, {rows, n}, 1), w = Random(wd, {n, n}, 2);
  Tensor y = Tensor::Create(DType::kF32, {rows, n}).value();
  RunTimed(state, static_cast<double>(w.byte_size()), "bytes_per_second", kCopy, [&](int64_t) {
    const absl::Status st = ours ? LinearRows(x.view(), w.view(), ConstTensorView(), y.view(), Threads())
                                 : Linear(x.view(), w.view(), ConstTensorView(), y.view(), Threads());
    if (!st.ok()) std::abort();
  });
  state.counters["rows"] = static_cast<double>(rows);
}

void Register() {
  auto* b = benchmark::RegisterBenchmark("ceiling/copy_bandwidth", BM_CopyBandwidth);
  b->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
  benchmark::RegisterBenchmark("ceiling/read_bandwidth", BM_ReadBandwidth)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond)
      ->MinTime(1.0);
  benchmark::RegisterBenchmark("ceiling/gemm_f32", BM_Gemm, DType::kF32)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond)
      ->MinTime(1.0);
  benchmark::RegisterBenchmark("ceiling/gemm_bf16", BM_Gemm, DType::kBF16)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond)
      ->MinTime(1.0);
  benchmark::RegisterBenchmark("rope/f32/neox/s2048_h32_d128", BM_Rope, RopeLayout::kHalfSplit)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("rope/f32/interleaved/s2048_h32_d128", BM_Rope,
                               RopeLayout::kInterleaved)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  // Each named case reads K/V the way a decoding session keeps them here: a
  // session's pages (paged = 1), in the tile layout (kv_cache_layout = 1) or
  // in rows (0). The decode/f32/tensors/ cases are a stateless Attend over
  // token-major f32 K/V.
  struct DecodeCase {
    const char* name;
    DType dtype;
    int64_t kv;
    int64_t kv_heads;
    KvSource source;
    BiasKind bias = BiasKind::kNone;
  };
  const DecodeCase decode_cases[] = {
      {"decode/f32/kv4096_h32_kvh32_d128", DType::kF32, 4096, 32, KvSource::kSession},
      {"decode/f32/kv4096_h32_kvh8_d128", DType::kF32, 4096, 8, KvSource::kSession},
      {"decode/f32/kv8192_h32_kvh8_d128", DType::kF32, 8192, 8, KvSource::kSession},
      {"decode/f32/kv32768_h32_kvh8_d128", DType::kF32, 32768, 8, KvSource::kSession},
      {"decode/bf16/kv4096_h32_kvh32_d128", DType::kBF16, 4096, 32, KvSource::kSession},
      {"decode/bf16/kv8192_h32_kvh8_d128", DType::kBF16, 8192, 8, KvSource::kSession},
      {"decode/bf16/kv32768_h32_kvh8_d128", DType::kBF16, 32768, 8, KvSource::kSession},
      {"decode/f32/tensors/kv4096_h32_kvh32_d128", DType::kF32, 4096, 32, KvSource::kTensors},
      {"decode/f32/tensors/kv4096_h32_kvh8_d128", DType::kF32, 4096, 8, KvSource::kTensors},
      {"decode/f32/alibi/kv4096_h32_kvh8_d128", DType::kF32, 4096, 8, KvSource::kSession,
       BiasKind::kAlibi},
      {"decode/bf16/alibi/kv4096_h32_kvh32_d128", DType::kBF16, 4096, 32, KvSource::kSession,
       BiasKind::kAlibi},
  };
  for (const DecodeCase& c : decode_cases) {
    benchmark::RegisterBenchmark(c.name, BM_Decode, c.dtype, c.kv, c.kv_heads, c.source, c.bias)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark("decode/int8/kv4096_h32_kvh32_d128", BM_DecodeInt8, 4096, 32)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("decode/int8/kv8192_h32_kvh8_d128", BM_DecodeInt8, 8192, 8)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("fork/8x16/kv4096_h32_kvh8_d128", BM_ForkMemory, 4096, 8, 8, 16)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("prefill/f32/causal_s512_h32_kvh32_d128", BM_Prefill, DType::kF32,
                               512, 32)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("prefill/f32/causal_s2048_h32_kvh32_d128", BM_Prefill, DType::kF32,
                               2048, 32)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("prefill/f32/causal_s2048_h32_kvh8_d128", BM_Prefill, DType::kF32,
                               2048, 8)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("prefill/bf16/causal_s2048_h32_kvh32_d128", BM_Prefill, DType::kBF16,
                               2048, 32)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  for (const DType wd : {DType::kF32, DType::kBF16}) {
    for (const int64_t rows : {1, 16}) {
      for (const bool ours : {false, true}) {
        benchmark::RegisterBenchmark(absl::StrFormat("linear/%s/%s_m%d_4096x4096", DTypeName(wd),
                                                     ours ? "rows" : "onednn", rows)
                                         .c_str(),
                                     BM_Linear, wd, rows, ours)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
  for (const int64_t q_len : {17, 64}) {
    benchmark::RegisterBenchmark(
        absl::StrFormat("prefill/f32/chunk_q%d_kv4096_h32_kvh8_d128", q_len).c_str(),
        BM_PrefillChunk, q_len, 4096, 8)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace
}  // namespace ropeattn

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("cpu", ropeattn::CpuDescription());
  benchmark::AddCustomContext("kernel_threads", std::to_string(ropeattn::Threads()));
  ropeattn::Register();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
