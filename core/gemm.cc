// Matmul on oneDNN 2.6 primitives, built once per shape and cached.
//
// oneDNN primitives are not thread-safe with the library-owned scratchpad,
// so every primitive here uses scratchpad_mode::user and each calling thread
// brings its own scratchpad and stream: one cached primitive then serves any
// number of threads at once. oneDNN plans its work for the thread count it
// sees at creation, so the count is part of the cache key.
//
// bf16 without a bf16 matmul: oneDNN 2.6 builds bf16 matmuls only on
// avx512_core and up, so on AVX2-only hosts (or under ONEDNN_MAX_CPU_ISA
// below AVX512_CORE) bf16 operands are widened to f32 in per-thread buffers
// and run on the f32 primitive. bf16 -> f32 is exact and so are the products
// of two bf16 values in f32, so this is the same math with f32 accumulation,
// as the bf16 primitive does; only the summation order may differ.
#include "core/gemm.h"

#include <cpuid.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <list>
#include <memory>
#include <new>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "core/gemm_internal.h"
#include "core/status_macros.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace ropeattn {
namespace internal {
namespace {

struct Key {
  int64_t m, n, k, a_rs, a_cs, b_rs, b_cs, ldc;
  int dtype;
  int threads;
  bool operator==(const Key& o) const {
    return std::tie(m, n, k, a_rs, a_cs, b_rs, b_cs, ldc, dtype, threads) ==
           std::tie(o.m, o.n, o.k, o.a_rs, o.a_cs, o.b_rs, o.b_cs, o.ldc, o.dtype, o.threads);
  }
  template <typename H>
  friend H AbslHashValue(H h, const Key& x) {
    return H::combine(std::move(h), x.m, x.n, x.k, x.a_rs, x.a_cs, x.b_rs, x.b_cs, x.ldc, x.dtype,
                      x.threads);
  }
};

struct Entry {
  dnnl::matmul prim;
  dnnl::memory::desc a_md, b_md, c_md;
  size_t scratch_bytes = 0;
};

dnnl::engine& Engine() {
  static dnnl::engine* engine = [] {
    // PrimitiveCache below keeps the primitives, bounded; oneDNN's own cache
    // would hold up to 1024 more of them.
    dnnl::set_primitive_cache_capacity(0);
    return new dnnl::engine(dnnl::engine::kind::cpu, 0);
  }();
  return *engine;
}

class PrimitiveCache {
 public:
  // Bounded: shapes come from requests, and each primitive holds ~60 KiB
  // (its JIT code and descriptors) the memory budget does not see: 2048 of
  // them, a client's Attends of 2100 different key lengths, held 125 MiB,
  // RSS past budget + 100 MiB. The least recently used shape goes first
  // (entries in use are shared_ptr-owned by their callers). oneDNN's own
  // primitive cache is turned off (Engine()): it would keep 1024 more.
  static constexpr size_t kMaxEntries = 256;

  absl::StatusOr<std::shared_ptr<const Entry>> Get(const Key& key) {
    {
      absl::MutexLock lock(&mu_);
      auto it = map_.find(key);
      if (it != map_.end()) {
        order_.splice(order_.begin(), order_, it->second.second);
        return it->second.first;
      }
    }
    // Build outside the lock: creation can take a while and two threads
    // racing on the same new shape only waste a little work.
    auto entry = std::make_shared<Entry>();
    try {
      using dt = dnnl::memory::data_type;
      const dt in_dt = key.dtype == static_cast<int>(DType::kF32) ? dt::f32 : dt::bf16;
      entry->a_md = dnnl::memory::desc({key.m, key.k}, in_dt, {key.a_rs, key.a_cs});
      entry->b_md = dnnl::memory::desc({key.k, key.n}, in_dt, {key.b_rs, key.b_cs});
      entry->c_md = dnnl::memory::desc({key.m, key.n}, dt::f32, {key.ldc, 1});
      dnnl::primitive_attr attr;
      attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
      dnnl::matmul::desc desc(entry->a_md, entry->b_md, entry->c_md);
      dnnl::matmul::primitive_desc pd(desc, attr, Engine());
      entry->scratch_bytes = pd.scratchpad_desc().get_size();
      entry->prim = dnnl::matmul(pd);
      built_.fetch_add(1, std::memory_order_relaxed);
    } catch (const dnnl::error& e) {
      return absl::InternalError(
          absl::StrFormat("oneDNN could not create a matmul for [%d x %d] * [%d x %d] (%s): %s",
                          key.m, key.k, key.k, key.n, key.dtype == 0 ? "f32" : "bf16", e.what()));
    }
    absl::MutexLock lock(&mu_);
    auto it = map_.find(key);
    if (it != map_.end()) return it->second.first;  // another thread built it too
    while (map_.size() >= kMaxEntries) {
      map_.erase(order_.back());
      order_.pop_back();
    }
    order_.push_front(key);
    map_.emplace(key, std::make_pair(entry, order_.begin()));
    return std::shared_ptr<const Entry>(std::move(entry));
  }

  int64_t size() {
    absl::MutexLock lock(&mu_);
    return static_cast<int64_t>(map_.size());
  }
  int64_t built() { return built_.load(std::memory_order_relaxed); }

 private:
  absl::Mutex mu_;
  std::atomic<int64_t> built_{0};
  std::list<Key> order_ ABSL_GUARDED_BY(mu_);  // most recently used first
  absl::flat_hash_map<Key, std::pair<std::shared_ptr<const Entry>, std::list<Key>::iterator>> map_
      ABSL_GUARDED_BY(mu_);
};

PrimitiveCache& Cache() {
  static PrimitiveCache* cache = new PrimitiveCache();
  return *cache;
}

// An f32 buffer that grows without initialising its contents.
struct WideBuffer {
  std::unique_ptr<float[]> data;
  size_t cap = 0;
  float* Get(size_t count) {
    if (count > cap) {
      data.reset();  // free first: the peak is then one buffer, not two
      data.reset(new float[count]);
      cap = count;
    }
    return data.get();
  }
  // Frees a buffer above `keep_bytes` rather than keeping it for later calls.
  void Trim(size_t keep_bytes) {
    if (cap * sizeof(float) > keep_bytes) {
      data.reset();
      cap = 0;
    }
  }
};

// Per-thread execution state: a stream, a growable, 64-byte aligned
// scratchpad, and the f32 copies of bf16 operands when there is no bf16 matmul.
struct ThreadState {
  dnnl::stream stream{Engine()};
  std::unique_ptr<uint8_t[]> scratch;
  size_t scratch_cap = 0;
  WideBuffer wide_a, wide_b;
  uint8_t* Scratch(size_t bytes) {
    if (bytes + 64 > scratch_cap) {
      scratch_cap = bytes + 64;
      scratch.reset(new uint8_t[scratch_cap]);
    }
    auto p = reinterpret_cast<uintptr_t>(scratch.get());
    return reinterpret_cast<uint8_t*>((p + 63) & ~uintptr_t{63});
  }
};

ThreadState& State() {
  thread_local ThreadState state;
  return state;
}

// Whether oneDNN creates bf16 matmuls here. It needs avx512_core for any bf16
// matmul (whatever the shape or strides), so one small probe, made once,
// answers for all of them.
bool NativeBf16Matmul() {
  static const bool native = [] {
    try {
      using dt = dnnl::memory::data_type;
      const dnnl::memory::desc a({16, 16}, dt::bf16, {16, 1});
      const dnnl::memory::desc b({16, 16}, dt::bf16, {16, 1});
      const dnnl::memory::desc c({16, 16}, dt::f32, {16, 1});
      dnnl::primitive_attr attr;
      attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, Engine());
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return native;
}

// Widened operands above this many bytes are freed after the call rather than
// kept by the thread (a bf16 weight matrix would otherwise stay resident as
// f32 in every thread that ever ran a Linear on it).
constexpr size_t kKeepWideBytes = size_t{16} << 20;

// The bf16 operand x ([rows, cols]) widened to f32 in `buf`, keeping its
// orientation: row-major if its columns are the unit stride (or it has no unit
// stride at all), column-major if its rows are. Exact.
MatOperand WidenBF16(int64_t rows, int64_t cols, const MatOperand& x, WideBuffer& buf,
                     int threads) {
  const auto* src = static_cast<const uint16_t*>(x.data);
  const size_t count = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  float* dst = buf.Get(count);
  const int64_t rs = x.row_stride, cs = x.col_stride;
  // Below this many elements a parallel region costs more than it saves.
  const bool parallel = threads > 1 && count >= (size_t{1} << 16);
  if (rs == 1 && cs != 1 && rows > 1) {
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
    for (int64_t j = 0; j < cols; ++j) {
      const uint16_t* s = src + j * cs;
      float* d = dst + j * rows;
      for (int64_t i = 0; i < rows; ++i) d[i] = BF16ToFloat(s[i]);
    }
    return MatOperand{dst, DType::kF32, 1, rows};
  }
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    const uint16_t* s = src + i * rs;
    float* d = dst + i * cols;
    if (cs == 1) {
      for (int64_t j = 0; j < cols; ++j) d[j] = BF16ToFloat(s[j]);
    } else {
      for (int64_t j = 0; j < cols; ++j) d[j] = BF16ToFloat(s[j * cs]);
    }
  }
  return MatOperand{dst, DType::kF32, cols, 1};
}

// c = a * b on the cached primitive for these operands. *no_primitive tells
// whether the failure (if any) was oneDNN refusing to create the primitive.
absl::Status Run(int64_t m, int64_t n, int64_t k, const MatOperand& a, const MatOperand& b,
                 float* c, int64_t ldc, int threads, bool* no_primitive) {
  *no_primitive = false;
  Key key{m,
          n,
          k,
          a.row_stride,
          a.col_stride,
          b.row_stride,
          b.col_stride,
          ldc,
          static_cast<int>(a.dtype),
          threads};
  auto entry = Cache().Get(key);
  if (!entry.ok()) {
    *no_primitive = true;
    return entry.status();
  }
  try {
    ThreadState& ts = State();
    const Entry& e = **entry;
    dnnl::memory am(e.a_md, Engine(), const_cast<void*>(a.data));
    dnnl::memory bm(e.b_md, Engine(), const_cast<void*>(b.data));
    dnnl::memory cm(e.c_md, Engine(), c);
    std::unordered_map<int, dnnl::memory> args = {
        {DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
    if (e.scratch_bytes > 0) {
      dnnl::memory sm(dnnl::memory::desc({static_cast<int64_t>(e.scratch_bytes)},
                                         dnnl::memory::data_type::u8, {1}),
                      Engine(), ts.Scratch(e.scratch_bytes));
      args.emplace(DNNL_ARG_SCRATCHPAD, sm);
    }
    e.prim.execute(ts.stream, args);
    ts.stream.wait();
  } catch (const dnnl::error& err) {
    return absl::InternalError(absl::StrCat("oneDNN matmul failed: ", err.what()));
  }
  return absl::OkStatus();
}

// The same product with bf16 a and b widened to f32 (see the top of the file).
absl::Status RunWidened(int64_t m, int64_t n, int64_t k, const MatOperand& a, const MatOperand& b,
                        float* c, int64_t ldc, int threads) {
  ThreadState& ts = State();
  absl::Status status;
  try {
    const MatOperand wa = WidenBF16(m, k, a, ts.wide_a, threads);
    const MatOperand wb = WidenBF16(k, n, b, ts.wide_b, threads);
    bool no_primitive;
    status = Run(m, n, k, wa, wb, c, ldc, threads, &no_primitive);
  } catch (const std::bad_alloc&) {
    status = absl::ResourceExhaustedError(absl::StrFormat(
        "no memory to widen a bf16 [%d x %d] * [%d x %d] matmul to f32", m, k, k, n));
  }
  ts.wide_a.Trim(kKeepWideBytes);
  ts.wide_b.Trim(kKeepWideBytes);
  return status;
}

}  // namespace

absl::Status Gemm(int64_t m, int64_t n, int64_t k, const MatOperand& a, const MatOperand& b,
                  float* c, int64_t ldc, int num_threads) {
  if (m == 0 || n == 0) return absl::OkStatus();
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i) std::memset(c + i * ldc, 0, n * sizeof(float));
    return absl::OkStatus();
  }
  const bool nested = omp_in_parallel();
  const int threads = nested ? 1 : std::max(1, num_threads);
  // oneDNN sizes its work from omp_get_max_threads(); the ICV is per thread.
  const int saved = omp_get_max_threads();
  if (saved != threads) omp_set_num_threads(threads);
  absl::Status status;
  if (a.dtype == DType::kBF16 && !NativeBf16Matmul()) {
    status = RunWidened(m, n, k, a, b, c, ldc, threads);
  } else {
    bool no_primitive;
    status = Run(m, n, k, a, b, c, ldc, threads, &no_primitive);
    // Not expected once the probe found bf16 matmuls, but if oneDNN still
    // refuses one for this shape, the f32 primitive computes the same.
    if (!status.ok() && no_primitive && a.dtype == DType::kBF16) {
      status = RunWidened(m, n, k, a, b, c, ldc, threads);
    }
  }
  if (saved != threads) omp_set_num_threads(saved);
  return status;
}

bool Bf16GemmFlushes() {
  static const bool flushes = [] {
    if (!NativeBf16Matmul()) return false;  // widened to f32: nothing is flushed
    // Without AVX512_BF16 (CPUID leaf 7.1 EAX bit 5) or AMX-BF16 (leaf 7.0
    // EDX bit 22) oneDNN computes bf16 matmuls with f32 FMAs, which keep
    // subnormals (checked on an avx512_bf16 host under ONEDNN_MAX_CPU_ISA=
    // AVX512_CORE and AVX512_CORE_VNNI: subnormal inputs, products and sums
    // came back exact; under AVX512_CORE_BF16 all three came back 0).
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    bool bf16 = false;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) {
      bf16 = (edx >> 22) & 1;
      if (eax >= 1 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) bf16 |= (eax >> 5) & 1;
    }
    if (!bf16) return false;
    // The same when ONEDNN_MAX_CPU_ISA keeps oneDNN below those instructions.
    // Any other answer (including ISAs this code does not know) counts as
    // flushing: a needless repair costs time, a missing one exactness.
    const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
    return isa != dnnl::cpu_isa::avx512_core && isa != dnnl::cpu_isa::avx512_core_vnni;
  }();
  return flushes;
}

namespace {

// Rows `rows` of the bf16 a (k columns), dense in `out` ([rows.size(), k]).
void GatherRows(const MatOperand& a, int64_t k, const std::vector<int64_t>& rows,
                std::vector<uint16_t>& out) {
  const auto* ap = static_cast<const uint16_t*>(a.data);
  out.resize(rows.size() * static_cast<size_t>(k));
  for (size_t i = 0; i < rows.size(); ++i) {
    const uint16_t* src = ap + rows[i] * a.row_stride;
    uint16_t* dst = out.data() + i * k;
    if (a.col_stride == 1) {
      std::memcpy(dst, src, k * sizeof(uint16_t));
    } else {
      for (int64_t t = 0; t < k; ++t) dst[t] = src[t * a.col_stride];
    }
  }
}

// The widened f32 GEMM of rows x b[:, cols] on `threads` threads, written to
// those rows and columns of c. `rows` / `cols` empty mean all of them (no
// gather).
absl::Status RedoWidenedOrThrow(int64_t m, int64_t n, int64_t k, const MatOperand& a,
                                const MatOperand& b, const std::vector<int64_t>& rows,
                                const std::vector<int64_t>& cols, float* c, int64_t ldc,
                                int threads) {
  const bool all_rows = rows.empty(), all_cols = cols.empty();
  const int64_t rr = all_rows ? m : static_cast<int64_t>(rows.size());
  const int64_t cc = all_cols ? n : static_cast<int64_t>(cols.size());
  std::vector<uint16_t> ga, gb;
  MatOperand ra = a, rb = b;
  if (!all_rows) {
    GatherRows(a, k, rows, ga);
    ra = MatOperand{ga.data(), DType::kBF16, k, 1};
  }
  if (!all_cols) {
    // Column j of b as row j of a [cc, k] matrix: b[:, cols] column-major.
    const auto* bp = static_cast<const uint16_t*>(b.data);
    gb.resize(static_cast<size_t>(cc) * static_cast<size_t>(k));
    for (int64_t i = 0; i < cc; ++i) {
      const uint16_t* src = bp + cols[i] * b.col_stride;
      uint16_t* dst = gb.data() + i * k;
      if (b.row_stride == 1) {
        std::memcpy(dst, src, k * sizeof(uint16_t));
      } else {
        for (int64_t t = 0; t < k; ++t) dst[t] = src[t * b.row_stride];
      }
    }
    rb = MatOperand{gb.data(), DType::kBF16, 1, k};
  }
  const bool direct = all_rows && all_cols;  // everything redone: in place
  std::vector<float> out(direct ? 0 : static_cast<size_t>(rr) * static_cast<size_t>(cc));
  const int saved = omp_get_max_threads();
  if (saved != threads) omp_set_num_threads(threads);
  const absl::Status st = direct ? RunWidened(m, n, k, ra, rb, c, ldc, threads)
                                 : RunWidened(rr, cc, k, ra, rb, out.data(), cc, threads);
  if (saved != threads) omp_set_num_threads(saved);
  if (!st.ok() || direct) return st;
  for (int64_t i = 0; i < rr; ++i) {
    float* crow = c + (all_rows ? i : rows[i]) * ldc;
    const float* src = out.data() + i * cc;
    if (all_cols) {
      std::memcpy(crow, src, cc * sizeof(float));
    } else {
      for (int64_t j = 0; j < cc; ++j) crow[cols[j]] = src[j];
    }
  }
  return absl::OkStatus();
}

absl::Status RedoWidened(int64_t m, int64_t n, int64_t k, const MatOperand& a, const MatOperand& b,
                         const std::vector<int64_t>& rows, const std::vector<int64_t>& cols,
                         float* c, int64_t ldc, int threads) {
  try {
    return RedoWidenedOrThrow(m, n, k, a, b, rows, cols, c, ldc, threads);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "no memory to redo %d rows x %d columns of a bf16 [%d x %d] * [%d x %d] matmul in f32",
        rows.empty() ? m : static_cast<int64_t>(rows.size()),
        cols.empty() ? n : static_cast<int64_t>(cols.size()), m, k, k, n));
  }
}

// A bf16 GEMM on AVX512-BF16 treats subnormal inputs, products and partial
// sums as zero. With no subnormal in a's row, each flush loses less than
// FLT_MIN times the larger of 1 and the row's largest |a| (a subnormal b
// times an a; a product or a partial sum below FLT_MIN), and a dot product of
// k terms has fewer than 2k of them. Where that bound is not 2^-24 below |c|
// (f32 rounding), the element is suspect. The suspect elements are redone
// from the same bf16 values in an f32 GEMM (exact products, f32 sums): the
// rows that hold any, times the distinct columns that hold any, gathered
// into one multithreaded GEMM, so that zero weight rows (pruned or padded
// outputs, exactly 0 in every row) cost a GEMM of those columns. A row with a
// subnormal input, and every suspect row when the columns are over half of
// n, is redone whole.
absl::Status FlushRepair(int64_t m, int64_t n, int64_t k, const MatOperand& a,
                         const MatOperand& b, const float* row_top, float* c, int64_t ldc,
                         int num_threads) {
  if (!Bf16GemmFlushes()) return absl::OkStatus();
  const auto* ap = static_cast<const uint16_t*>(a.data);
  const double normal = std::numeric_limits<float>::min();
  std::vector<int64_t> redo;     // rows redone whole
  std::vector<int64_t> suspect;  // other rows with suspect elements
  std::vector<int64_t> cols;     // the distinct columns of those elements
  std::vector<char> in_cols(n, 0);
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* arow = ap + r * a.row_stride;
    bool subnormal = false;
    if (a.col_stride == 1) {
#pragma omp simd reduction(| : subnormal)
      for (int64_t t = 0; t < k; ++t) {
        const uint16_t mag = arow[t] & 0x7fff;
        subnormal |= mag != 0 && mag < 0x0080;
      }
    } else {
      for (int64_t t = 0; t < k; ++t) {
        const uint16_t mag = arow[t * a.col_stride] & 0x7fff;
        subnormal |= mag != 0 && mag < 0x0080;
      }
    }
    if (subnormal) {
      redo.push_back(r);
      continue;
    }
    if (row_top[r] == 0) continue;  // every product is 0: nothing to lose
    const double bound =
        0x1p24 * 2.0 * static_cast<double>(k) * normal * std::max(1.0, double{row_top[r]});
    const float* crow = c + r * ldc;
    bool any = false;
    for (int64_t j = 0; j < n; ++j) {
      if (!(std::fabs(static_cast<double>(crow[j])) >= bound)) {
        any = true;
        if (!in_cols[j]) {
          in_cols[j] = 1;
          cols.push_back(j);
        }
      }
    }
    if (any) suspect.push_back(r);
  }
  if (redo.empty() && suspect.empty()) return absl::OkStatus();
  const int threads = omp_in_parallel() ? 1 : std::max(1, num_threads);
  if (2 * static_cast<int64_t>(cols.size()) > n) {
    // Most columns: the whole rows cost little more than gathering them.
    redo.insert(redo.end(), suspect.begin(), suspect.end());
    suspect.clear();
  }
  if (static_cast<int64_t>(redo.size()) == m) {
    return RedoWidened(m, n, k, a, b, {}, {}, c, ldc, threads);
  }
  if (!suspect.empty()) {
    std::sort(cols.begin(), cols.end());
    const std::vector<int64_t> no_gather;
    RA_RETURN_IF_ERROR(RedoWidened(m, n, k, a, b,
                                   static_cast<int64_t>(suspect.size()) == m ? no_gather : suspect,
                                   static_cast<int64_t>(cols.size()) == n ? no_gather : cols, c,
                                   ldc, threads));
  }
  if (!redo.empty()) {
    const std::vector<int64_t> all_cols;
    RA_RETURN_IF_ERROR(RedoWidened(m, n, k, a, b, redo, all_cols, c, ldc, threads));
  }
  return absl::OkStatus();
}

}  // namespace

}  // namespace internal

namespace {

absl::StatusOr<internal::MatOperand> Operand2D(const ConstTensorView& t, absl::string_view name) {
  if (t.rank() != 2) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s must have rank 2, got shape %s", name, DimsToString(t.dims())));
  }
  if (t.raw() == nullptr && t.num_elements() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is missing"));
  }
  if (t.stride(0) != 1 && t.stride(1) != 1 && t.num_elements() > 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s needs a unit stride on one axis, got strides %s", name, DimsToString(t.strides())));
  }
  return internal::MatOperand{t.raw(), t.dtype(), t.stride(0), t.stride(1)};
}

}  // namespace

absl::Status MatMul(ConstTensorView a, ConstTensorView b, TensorView c, int num_threads) {
  auto ao = Operand2D(a, "a");
  if (!ao.ok()) return ao.status();
  auto bo = Operand2D(b, "b");
  if (!bo.ok()) return bo.status();
  if (c.rank() != 2 || (c.num_elements() > 1 && c.stride(1) != 1)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "c must be a rank-2 tensor with unit column stride, got shape %s strides %s",
        DimsToString(c.dims()), DimsToString(c.strides())));
  }
  if (a.dtype() != b.dtype()) {
    return absl::InvalidArgumentError(absl::StrFormat("a and b must share a dtype, got %s and %s",
                                                      DTypeName(a.dtype()), DTypeName(b.dtype())));
  }
  if (c.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrFormat("c must be f32, got %s", DTypeName(c.dtype())));
  }
  if (a.dim(1) != b.dim(0) || c.dim(0) != a.dim(0) || c.dim(1) != b.dim(1)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("matmul shapes do not match: a %s, b %s, c %s", DimsToString(a.dims()),
                        DimsToString(b.dims()), DimsToString(c.dims())));
  }
  if (num_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_threads must be >= 1, got %d", num_threads));
  }
  return internal::Gemm(a.dim(0), b.dim(1), a.dim(1), *ao, *bo, c.data<float>(), c.stride(0),
                        num_threads);
}

namespace internal {

absl::Status CheckLinear(const ConstTensorView& x, const ConstTensorView& weight,
                         const ConstTensorView& bias, const TensorView& y, int num_threads) {
  if (x.rank() != 2 || !x.IsContiguous() || (x.raw() == nullptr && x.num_elements() > 0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "linear input must be a dense [rows, in] tensor, got %s", DimsToString(x.dims())));
  }
  if (weight.rank() != 2 || !weight.IsContiguous() ||
      (weight.raw() == nullptr && weight.num_elements() > 0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "linear weight must be a dense [out, in] tensor, got %s", DimsToString(weight.dims())));
  }
  const int64_t rows = x.dim(0), in = x.dim(1), out = weight.dim(0);
  if (weight.dim(1) != in) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "linear weight is %s but the input has %d features", DimsToString(weight.dims()), in));
  }
  if (y.rank() != 2 || y.dtype() != DType::kF32 || !y.IsContiguous() || y.dim(0) != rows ||
      y.dim(1) != out) {
    return absl::InvalidArgumentError(
        absl::StrFormat("linear output must be a dense f32 tensor of shape %s, got %s %s",
                        DimsToString({rows, out}), DTypeName(y.dtype()), DimsToString(y.dims())));
  }
  if (!bias.empty_view() && (bias.rank() != 1 || bias.dim(0) != out)) {
    return absl::InvalidArgumentError(absl::StrFormat("linear bias must have shape [%d], got %s",
                                                      out, DimsToString(bias.dims())));
  }
  if (num_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_threads must be >= 1, got %d", num_threads));
  }
  return absl::OkStatus();
}

}  // namespace internal

absl::Status Linear(ConstTensorView x, ConstTensorView weight, ConstTensorView bias, TensorView y,
                    int num_threads) {
  RA_RETURN_IF_ERROR(internal::CheckLinear(x, weight, bias, y, num_threads));
  const int64_t rows = x.dim(0), in = x.dim(1), out = weight.dim(0);
  const bool has_bias = !bias.empty_view();
  if (rows == 0 || out == 0) return absl::OkStatus();
  // The GEMM wants matching input dtypes: bring x to the weight's dtype.
  // A bf16 GEMM on AVX512-BF16 also flushes subnormal inputs, products and
  // partial sums to zero: hidden states near 1e-36 came out 0. A row whose
  // largest value is below 2^-32 is scaled up by a power of two once
  // rounded to bf16 (exact) and its output scaled back; what flushing can
  // still lose is bounded and repaired after the GEMM (FlushRepair).
  std::vector<int> row_exp(rows, 0);
  std::vector<float> row_top(rows, 0.0f);
  bool scaled = false;
  if (weight.dtype() == DType::kBF16) {
    for (int64_t r = 0; r < rows; ++r) {
      float top = 0;
      for (int64_t c = 0; c < in; ++c) {
        const float v = x.dtype() == DType::kF32 ? x.data<float>()[r * in + c]
                                                 : BF16ToFloat(x.data<uint16_t>()[r * in + c]);
        top = std::max(top, std::fabs(v));
      }
      if (top > 0 && top < 0x1p-32f) {
        row_exp[r] = std::min(126, -std::ilogb(top));
        scaled = true;
      }
      row_top[r] = std::ldexp(top, row_exp[r]);
    }
  }
  Tensor converted;
  ConstTensorView a = x;
  if (x.dtype() != weight.dtype() || scaled) {
    absl::StatusOr<Tensor> t = Tensor::Create(weight.dtype(), x.dims());
    if (!t.ok()) return t.status();
    converted = *std::move(t);
    for (int64_t r = 0; r < rows; ++r) {
      const float up = std::ldexp(1.0f, row_exp[r]);
      for (int64_t c = 0; c < in; ++c) {
        const int64_t i = r * in + c;
        const float v = x.dtype() == DType::kF32 ? x.data<float>()[i]
                                                 : BF16ToFloat(x.data<uint16_t>()[i]);
        if (weight.dtype() == DType::kBF16) {
          // Rounded to bf16 first, as bf16 inference rounds it (subnormals
          // keep fewer bits), then scaled: exact on a bf16 value.
          converted.data<uint16_t>()[i] = FloatToBF16(BF16ToFloat(FloatToBF16(v)) * up);
        } else {
          converted.data<float>()[i] = v;
        }
      }
    }
    a = converted.view();
  }
  // W^T as a [in, out] view of the [out, in] matrix: a dense transposed
  // operand, which oneDNN's brgemm takes as is.
  const internal::MatOperand ao{a.raw(), a.dtype(), in, 1};
  const internal::MatOperand bo{weight.raw(), weight.dtype(), 1, in};
  absl::Status st = internal::Gemm(rows, out, in, ao, bo, y.data<float>(), out, num_threads);
  if (!st.ok()) return st;
  float* yp = y.data<float>();
  if (weight.dtype() == DType::kBF16) {
    RA_RETURN_IF_ERROR(internal::FlushRepair(rows, out, in, ao, bo, row_top.data(), yp, out,
                                             num_threads));
  }
  if (scaled) {
    for (int64_t r = 0; r < rows; ++r) {
      if (row_exp[r] == 0) continue;
      const float down = std::ldexp(1.0f, -row_exp[r]);
      for (int64_t c = 0; c < out; ++c) yp[r * out + c] *= down;
    }
  }
  if (!has_bias) return absl::OkStatus();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < out; ++c) {
      yp[r * out + c] += bias.dtype() == DType::kF32 ? bias.data<float>()[c]
                                                     : BF16ToFloat(bias.data<uint16_t>()[c]);
    }
  }
  return absl::OkStatus();
}

int64_t MatMulCacheSize() { return internal::Cache().size(); }
int64_t MatMulPrimitivesBuilt() { return internal::Cache().built(); }

}  // namespace ropeattn
