#include "core/decode_state.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "core/limits.h"
#include "core/status_macros.h"

namespace ropeattn {
namespace {

constexpr absl::string_view kRotationOverflow =
    "the finite keys left the float range when rotated (values near the range limit, or times "
    "the rule's attention factor); reduce their magnitude";

// `heads_name`, `dim_name`: what dimensions 2 and 3 are for this tensor (q:
// heads, head_dim; k: kv_heads, head_dim; v: kv_heads, v_dim), so a GQA
// user is not sent looking for the query head count in k or v.
absl::Status CheckStepTensor(const ConstTensorView& t, const std::string& name, int64_t tokens,
                             int64_t heads, absl::string_view heads_name, int64_t dim,
                             absl::string_view dim_name) {
  if (t.rank() != 4 || t.dim(0) != 1 || t.dim(1) != tokens || t.dim(2) != heads ||
      t.dim(3) != dim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s must have shape [1, %d, %d, %d] ([batch 1, tokens, %s, %s]), got %s",
                        name, tokens, heads, dim, heads_name, dim_name, DimsToString(t.dims())));
  }
  RA_RETURN_IF_ERROR(CheckBSHD(t, name));
  return CheckFinite(t, name);
}

// Under a length-dependent rule (dynamic NTK, LongRoPE) the cached keys are
// rotated again from their raw values whenever the frequencies change, at
// angles no step can foresee. A raw key is taken only if every rotation of
// it fits the storage: a rotated pair's components are at most the pair's
// norm times the attention factor (`factor`, the largest the session can
// see), so a later re-rotation never makes a value the cache cannot hold
// (f32: finite; bf16: not rounded to Inf). `raw`: contiguous f32
// [1, T, kv_heads, head_dim].
absl::Status CheckEveryRotationFits(const Tensor& raw, const RopeConfig& rope, double factor,
                                    bool bf16, const std::string& name) {
  const int64_t tokens = raw.dim(1), heads = raw.dim(2), d = raw.dim(3);
  const int64_t half = rope.effective_rotary_dim() / 2;
  // Past these the value rounds to Inf (bf16: from 0x1.ffp+127 up), with a
  // margin for the f32 rounding of the rotation itself.
  const double limit = (bf16 ? 0x1.ffp+127 : static_cast<double>(FLT_MAX)) * (1.0 - 0x1p-18);
  const float* x = raw.data<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* row = x + (t * heads + h) * d;
      for (int64_t c = 0; c < half; ++c) {
        const int64_t a = rope.layout == RopeLayout::kHalfSplit ? c : 2 * c;
        const int64_t b = rope.layout == RopeLayout::kHalfSplit ? c + half : 2 * c + 1;
        const double norm = std::hypot(static_cast<double>(row[a]), static_cast<double>(row[b]));
        if (norm * factor >= limit) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s[0, %d, %d, %d] and [0, %d, %d, %d] (%g, %g): under the length-dependent RoPE "
              "rule \"%s\" every cached key is rotated again when the frequencies change, and "
              "a rotation of this pair (norm %g%s) can leave the %s range; reduce their magnitude",
              name, t, h, a, t, h, b, row[a], row[b], RopeRuleOf(rope.scaling.type).name, norm,
              factor != 1.0 ? absl::StrFormat(", times the attention factor %g", factor) : "",
              bf16 ? "bf16" : "float"));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

std::atomic<int64_t> g_slab_collapses{0};

// Page parts are carved from 2 MiB slabs, each turned into a
// transparent huge page once full (below): a decode streams every page, and over
// 4 KiB pages it takes a TLB miss every 4 KiB (measured: the GQA decode at
// 4k context ran ~25% slower over separately allocated 128 KiB pages than
// over one huge-page tensor, and as fast over slabs). One arena per slot
// size and stream: a part up to a slab takes whole 4 KiB pages (its size
// rounded up), so there are at most 512 slot sizes a stream, and every such
// part has an arena (kMaxArenas is above them all); a part over a slab is a
// page-rounded mapping of its own. A part per mapping for any size the
// client chooses would let ~65k live parts reach vm.max_map_count (65530),
// past which every mmap and malloc of the process fails. A freed part's whole 4 KiB
// pages go back to the system at once (MADV_DONTNEED, or munmap), so a slab
// that keeps a few live parts holds little more than them, and a slab is
// unmapped when its last part is freed. No part comes from malloc: a freed
// malloc chunk is a hole between other sessions' live chunks, rarely
// holding a whole page malloc_trim could return (120 sessions of 2 KiB
// parts closed between 120 of 128-byte ones left 84 MiB of their 183 MiB
// charge resident, counted free by the budget).
// Thread-safe: parts are freed by whichever thread drops the last holder.
class PageArena {
 public:
  static constexpr int64_t kSlab = int64_t{2} << 20;
  static constexpr int64_t kMinSlabPart = int64_t{16} << 10;
  static constexpr int64_t kPage = 4096;
  // Of slots of kMinSlabPart and above: page-rounded sizes up to a slab
  // (509 a stream) never reach it; past it parts are mappings of their own.
  static constexpr size_t kMaxArenas = 1024;
  // A full slab of parts of `bytes` becomes a huge page: its slack after
  // the last part is at most 1/8 of it.
  static constexpr bool Collapses(int64_t bytes) { return kSlab % bytes <= kSlab / 8; }
  static constexpr int64_t PageRound(int64_t bytes) {
    return SatMul(SatAdd(bytes, kPage - 1) / kPage, kPage);
  }
  // What a part of `bytes` takes in its arena: whole 4 KiB pages.
  static constexpr int64_t SlotBytes(int64_t bytes) {
    return bytes <= kSlab ? PageRound(bytes) : bytes;
  }

  // The arena for parts of `bytes` read in one pass (`stream`: K parts
  // apart from V parts, even of the same size); null: plain mappings.
  static PageArena* For(int64_t bytes, int stream) {
    bytes = SlotBytes(bytes);
    if (bytes > kSlab) return nullptr;
    Registry& r = TheRegistry();
    absl::MutexLock lock(&r.mu);
    auto it = r.arenas.find({bytes, stream});
    if (it != r.arenas.end()) return it->second.get();
    if (bytes >= kMinSlabPart && r.large >= kMaxArenas) return nullptr;
    if (bytes >= kMinSlabPart) ++r.large;
    auto& a = r.arenas[{bytes, stream}];
    a.reset(new PageArena(bytes));
    return a.get();
  }
  // Tests only (nothing else may hold an arena): forgets the arenas that
  // hold no slab, so a test's part size gets one whatever ran before.
  static void ForgetEmptyArenas() {
    Registry& r = TheRegistry();
    absl::MutexLock lock(&r.mu);
    for (auto it = r.arenas.begin(); it != r.arenas.end();) {
      bool empty;
      {
        absl::MutexLock alock(&it->second->mu_);
        empty = it->second->slabs_.empty();
      }
      if (empty && it->first.first >= kMinSlabPart) --r.large;
      it = empty ? r.arenas.erase(it) : std::next(it);
    }
  }
  // What a part of `bytes` keeps resident in its arena, so what it is
  // charged (docs/kv-memory.md). A slab that collapses holds its slack whole
  // while it is huge, so each of its parts carries its share of the slab
  // (up to 1/7 more than the part: a 1.75 MiB part, one a slab, is charged
  // 2 MiB); a slab on 4 KiB pages holds its parts' pages; a part under
  // kMinSlabPart its whole pages (a 128-byte part 4 KiB). A part over a
  // slab is a mapping of whole pages.
  static int64_t HeldBytes(int64_t bytes) {
    bytes = SlotBytes(bytes);
    if (bytes > kSlab) return PageRound(bytes);
    if (Collapses(bytes)) return (kSlab + kSlab / bytes - 1) / (kSlab / bytes);
    return PageRound(bytes);
  }
  // What a part of `bytes` taken from `arena` (null: a plain mapping)
  // keeps resident: a plain mapping (a part over a slab, or past the arena
  // cap, which page-rounded slot sizes never reach) holds its whole pages,
  // which the page is charged when it holds more than HeldBytes.
  static int64_t HeldBytesIn(const PageArena* arena, int64_t bytes) {
    return arena != nullptr ? HeldBytes(bytes) : PageRound(bytes);
  }
  // Null when memory runs out; `*arena` is where the part came from, for Put.
  static char* Get(int64_t bytes, int stream, PageArena** arena) {
    *arena = For(bytes, stream);
    if (*arena != nullptr) return (*arena)->Take();
    void* p = mmap(nullptr, PageRound(bytes), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
  }
  static void Put(char* part, int64_t bytes, PageArena* arena) {
    if (arena != nullptr) {
      arena->Give(part);
    } else {
      munmap(part, PageRound(bytes));
    }
  }

 private:
  struct Slab;
  explicit PageArena(int64_t bytes) : bytes_(bytes) {}

  struct Registry {
    absl::Mutex mu;
    std::map<std::pair<int64_t, int>, std::unique_ptr<PageArena>> arenas ABSL_GUARDED_BY(mu);
    size_t large ABSL_GUARDED_BY(mu) = 0;  // arenas of parts of kMinSlabPart and above
  };
  static Registry& TheRegistry() {
    static Registry* r = new Registry();
    return *r;
  }

  char* Take() {
    absl::MutexLock lock(&mu_);
    if (open_.empty()) {
      // A new slab starts on 4 KiB pages: a huge page is resident whole at
      // its first touch, so a slab holding one small part would cost 2 MiB
      // the budget never charged (64 arenas, each with one partly filled
      // huge slab: 128 MiB, RSS past budget + 100 MiB in an external test).
      char* base = MapSlab();
      if (base == nullptr) return nullptr;
      Slab& slab = slabs_[base];
      for (int64_t i = kSlab / bytes_ - 1; i >= 0; --i) slab.free.push_back(base + i * bytes_);
      open_.insert(base);
    }
    char* base = *open_.begin();
    Slab& slab = slabs_[base];
    ++slab.used;
    ++live_;
    char* part = slab.free.back();
    slab.free.pop_back();
    if (slab.free.empty()) {
      open_.erase(base);
      // Full: every byte of it is a live (charged) part, but for the slack
      // after the last part, kept small. It goes to one huge page now
      // (MADV_COLLAPSE, Linux 6.1+; before that khugepaged collapses it
      // later), which the decode streams with one TLB entry. Give() takes
      // it back to 4 KiB pages at the first part freed in it, for good: a
      // collapse copies 2 MiB (0.3-5.7 ms measured, under this arena's
      // lock), and sessions opening and closing would pay one each time
      // they plugged the hole.
      if (Collapses(bytes_) && !slab.shrunk) {
        madvise(base, kSlab, MADV_HUGEPAGE);
        madvise(base, kSlab, kMadvCollapse);
        slab.huge = true;
        g_slab_collapses.fetch_add(1, std::memory_order_relaxed);
      }
    }
    return part;
  }

  void Give(char* part) {
    char* base = reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(part) & ~(kSlab - 1));
    absl::MutexLock lock(&mu_);
    Slab& slab = slabs_[base];
    --live_;
    if (--slab.used == 0) {
      open_.erase(base);
      slabs_.erase(base);
      munmap(base, kSlab);
    } else {
      // Its whole 4 KiB pages back to the system; a later Take faults them
      // in. A slab with a hole stays on 4 KiB pages from now on (khugepaged
      // would otherwise fill the hole again to rebuild the huge page).
      Release(part);
      slab.free.push_back(part);
      open_.insert(base);
      if (slab.huge) Shrink(base, slab);
    }
    // Fewer than a slab's worth of live parts left: no huge page stays, so
    // what is resident is the parts (a huge slab holding one part of a small
    // session after a long one closed kept its whole 2 MiB).
    if (live_ < kSlab / bytes_) {
      for (auto& [b, sl] : slabs_) {
        if (sl.huge) Shrink(b, sl);
      }
    }
  }

  // The whole 4 KiB pages of a free part back to the system.
  void Release(char* part) const {
    const uintptr_t lo = (reinterpret_cast<uintptr_t>(part) + kPage - 1) & ~(kPage - 1);
    const uintptr_t hi = (reinterpret_cast<uintptr_t>(part) + bytes_) & ~(kPage - 1);
    if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
  }
  // A huge slab to 4 KiB pages: no huge page again, and the pages of its
  // free parts (never taken ones too) and of the slack after its last part
  // back to the system (a part is charged its share of the slack, so the
  // slack must go with the slab's other parts).
  void Shrink(char* base, Slab& slab) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    madvise(base, kSlab, MADV_NOHUGEPAGE);
    for (char* p : slab.free) Release(p);
    const uintptr_t slack = (reinterpret_cast<uintptr_t>(base) + kSlab / bytes_ * bytes_ + kPage -
                             1) & ~(kPage - 1);
    const uintptr_t end = reinterpret_cast<uintptr_t>(base) + kSlab;
    if (end > slack) madvise(reinterpret_cast<void*>(slack), end - slack, MADV_DONTNEED);
    slab.huge = false;
    slab.shrunk = true;
  }

  // A 2 MiB-aligned 2 MiB mapping (twice the size mapped, the rest
  // unmapped), on 4 KiB pages.
  static char* MapSlab() {
    void* p = mmap(nullptr, 2 * kSlab, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    const uintptr_t start = reinterpret_cast<uintptr_t>(p);
    const uintptr_t base = (start + kSlab - 1) & ~static_cast<uintptr_t>(kSlab - 1);
    if (base > start) munmap(p, base - start);
    if (start + 2 * kSlab > base + kSlab) {
      munmap(reinterpret_cast<void*>(base + kSlab), start + 2 * kSlab - (base + kSlab));
    }
    madvise(reinterpret_cast<void*>(base), kSlab, MADV_NOHUGEPAGE);
    return reinterpret_cast<char*>(base);
  }

  // Synchronous collapse into a huge page (Linux 6.1; older kernels refuse
  // it with EINVAL, and khugepaged collapses the slab later).
  static constexpr int kMadvCollapse = 25;

  struct Slab {
    std::vector<char*> free;
    int64_t used = 0;
    bool huge = false;    // filled, made MADV_HUGEPAGE, no part freed since
    bool shrunk = false;  // was huge, then a part was freed: stays on 4 KiB pages
  };
  const int64_t bytes_;
  absl::Mutex mu_;
  int64_t live_ ABSL_GUARDED_BY(mu_) = 0;  // parts taken and not given back
  std::map<char*, Slab> slabs_ ABSL_GUARDED_BY(mu_);
  std::set<char*> open_ ABSL_GUARDED_BY(mu_);  // slabs with a free part
};

}  // namespace

// One page, in two parts from their own arenas (so a state's K parts sit
// next to each other in a slab, and so do its V parts: the scores pass and
// the values pass each stream one run of memory): K rows [kPageTokens,
// kv_heads, head_dim] and V rows [kPageTokens, kv_heads, v_dim] of the
// page's element type, each followed (int8) by its scales [kPageTokens,
// kv_heads] f32 on the next 64-byte line.
struct DecodeState::Page {
  char* part[2] = {nullptr, nullptr};  // K, V
  int64_t part_bytes[2] = {0, 0};
  PageArena* arena[2] = {nullptr, nullptr};  // null: a plain mapping
  std::shared_ptr<KvPageCharger> payer;  // refunded `charged` when the page is freed
  int64_t charged = 0;
  Page() = default;
  Page(const Page&) = delete;
  Page& operator=(const Page&) = delete;
  ~Page() {
    for (int i = 0; i < 2; ++i) {
      if (part[i] != nullptr) PageArena::Put(part[i], part_bytes[i], arena[i]);
    }
    if (payer) payer->Refund(charged);
  }
};

namespace {

constexpr int64_t RoundUp64(int64_t n) { return (n + 63) / 64 * 64; }

struct PageLayout {
  int64_t elem, k_bytes, v_bytes, scale_bytes;  // scale_bytes: each of K and V, int8 only
  int64_t rows_bytes(bool keys) const { return keys ? k_bytes : v_bytes; }  // the scales' offset
  int64_t part(bool keys) const { return rows_bytes(keys) + scale_bytes; }
};

PageLayout LayoutOf(const DecodeStateConfig& c, DecodeState::Storage storage) {
  const bool int8 = DecodeState::IsInt8(storage);
  // kTiles, kInt8Tiles: K [kv_heads][head_dim][kTile] (one KvCache tile per
  // head), V [kv_heads][kTile][v_dim], f32, bf16 or int8 codes; the others
  // [tokens][kv_heads][dim] rows (int8: head-major) of their element type.
  // int8 scales follow the codes, one per (token, kv head), head-major.
  const int64_t rows = DecodeState::PageTokensOf(storage) * c.kv_heads;
  PageLayout l;
  l.elem = int8 ? 1 : DTypeSize(c.kv_dtype);
  l.k_bytes = RoundUp64(rows * c.head_dim * l.elem);
  l.v_bytes = RoundUp64(rows * c.v_dim * l.elem);
  l.scale_bytes = int8 ? RoundUp64(rows * static_cast<int64_t>(sizeof(float))) : 0;
  return l;
}

}  // namespace

int64_t DecodeState::PageTokensOf(Storage storage) {
  switch (storage) {
    case Storage::kLinear:
      return 0;
    case Storage::kTiles:
    case Storage::kInt8Tiles:
      return KvCache::kTile;
    case Storage::kTokenMajor:
    case Storage::kInt8:
      return kPageTokens;
  }
  return 0;
}

// A page's own objects beside its parts: the Page and its shared_ptr
// control block (one 80-byte allocation) and its entries in the state's
// pages_, k_pages_, v_pages_ and (int8) scale arrays, 48 bytes, twice over
// for the vectors' spare capacity.
constexpr int64_t kPageBookkeepingBytes = 192;

int64_t KvPageHeldBytes(int64_t k_part_bytes, int64_t v_part_bytes) {
  return SatAdd(SatAdd(PageArena::HeldBytes(k_part_bytes), PageArena::HeldBytes(v_part_bytes)),
                kPageBookkeepingBytes);
}

int64_t DecodeState::page_bytes() const {
  if (!Paged()) return 0;
  const PageLayout l = LayoutOf(config_, storage_);
  return KvPageHeldBytes(l.part(true), l.part(false));
}

absl::Status DecodeState::MakeWritable(int64_t from, int64_t to) {
  const PageLayout l = LayoutOf(config_, storage_);
  const int64_t bytes = page_bytes();
  const int64_t P = PageTokens();
  const int64_t first = from / P, end = (to + P - 1) / P;
  // On every exit, an error half way included: pages from `first` on may
  // have been replaced, and the view must not keep pointing at the old ones
  // (their other holders may free them).
  absl::Cleanup refresh = [this, first] { RebuildView(static_cast<size_t>(first)); };
  for (int64_t n = first; n < end; ++n) {
    const bool missing = n >= static_cast<int64_t>(pages_.size());
    if (!missing && pages_[n].use_count() == 1) {
      // Ours alone: a state that shared it finished reading it before it
      // dropped its share (a release), which this fence pairs with.
      std::atomic_thread_fence(std::memory_order_acquire);
      continue;
    }
    if (charger_) RA_RETURN_IF_ERROR(charger_->Charge(bytes));
    auto page = std::make_shared<Page>();
    page->payer = charger_;
    page->charged = charger_ ? bytes : 0;
    int64_t held = kPageBookkeepingBytes;
    for (int i = 0; i < 2; ++i) {
      page->part_bytes[i] = l.part(i == 0);
      page->part[i] = PageArena::Get(page->part_bytes[i], i, &page->arena[i]);
      held = SatAdd(held, PageArena::HeldBytesIn(page->arena[i], page->part_bytes[i]));
    }
    if (page->part[0] == nullptr || page->part[1] == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("out of memory allocating a KV page of %d bytes", bytes));
    }
    if (held > bytes && charger_) {
      // A part that is a mapping of its own holding more than
      // page_bytes() counts (kept for safety: slot sizes are page-rounded,
      // so none does).
      RA_RETURN_IF_ERROR(charger_->Charge(held - bytes));
      page->charged = held;
    }
    if (missing) {
      pages_.push_back(std::move(page));
    } else {
      // Shared: this state's copy (the other holders keep theirs).
      for (int i = 0; i < 2; ++i) {
        std::memcpy(page->part[i], pages_[n]->part[i], page->part_bytes[i]);
      }
      pages_[n] = std::move(page);
    }
  }
  return absl::OkStatus();  // `refresh` runs: pages before `first` are as they were
}

void DecodeState::RebuildView(size_t from) {
  const bool int8 = IsInt8(storage_);
  const PageLayout l = LayoutOf(config_, storage_);
  const size_t n = pages_.size();
  k_pages_.resize(n);
  v_pages_.resize(n);
  k_scales_.resize(int8 ? n : 0);
  v_scales_.resize(int8 ? n : 0);
  for (size_t i = from; i < n; ++i) {
    const Page& page = *pages_[i];
    k_pages_[i] = page.part[0];
    v_pages_[i] = page.part[1];
    if (int8) {
      k_scales_[i] = reinterpret_cast<const float*>(page.part[0] + l.rows_bytes(true));
      v_scales_[i] = reinterpret_cast<const float*>(page.part[1] + l.rows_bytes(false));
    }
  }
  view_.type = int8                               ? PagedKvView::Type::kInt8
               : config_.kv_dtype == DType::kBF16 ? PagedKvView::Type::kBF16
                                                  : PagedKvView::Type::kF32;
  view_.k_pages = k_pages_.data();
  view_.v_pages = v_pages_.data();
  view_.k_scales = int8 ? k_scales_.data() : nullptr;
  view_.v_scales = int8 ? v_scales_.data() : nullptr;
  view_.pages = static_cast<int64_t>(n);
  view_.page_tokens = PageTokens();
  view_.tiles = IsTiles(storage_);
  view_.kv_heads = config_.kv_heads;
  view_.head_dim = config_.head_dim;
  view_.v_dim = config_.v_dim;
  // int8 rows head-major (a head's 16 rows are 2 KiB at d 128, read as one
  // run, the heads in address order: measured 2.1-2.8 ms against 2.8-2.9
  // token-major at 4k MHA); f32 and bf16 token-major, where head-major
  // measured slower (bf16 MHA 3.4-4.5 ms against 2.6-2.8, f32 GQA 2.5-2.8
  // against 1.4-1.9).
  // (kTiles: the tile layout, no rows.)
  view_.token_rows = view_.tiles ? 0 : int8 ? 1 : config_.kv_heads;
  view_.head_rows = view_.tiles ? 0 : int8 ? kPageTokens : 1;
}

absl::Status DecodeState::WritePaged(const ConstTensorView& rows, bool keys, int64_t at) {
  const DecodeStateConfig& c = config_;
  const bool int8 = IsInt8(storage_);
  const PageLayout l = LayoutOf(c, storage_);
  const int64_t dim = keys ? c.head_dim : c.v_dim;
  const int64_t tokens = rows.dim(1);
  const int64_t P = PageTokens();
  if (storage_ == Storage::kInt8Tiles) {
    // rows is f32 here, each row contiguous. A row is quantized as in
    // kInt8 pages, then its codes scattered into the tile layout (below).
    std::vector<int8_t> codes(dim);
    const float* src = rows.data<float>();
    const int64_t st = rows.stride(1), sj = rows.stride(2);
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t o = (at + t) % P;
      char* base = pages_[(at + t) / P]->part[keys ? 0 : 1];
      int8_t* q = reinterpret_cast<int8_t*>(base);
      float* scales = reinterpret_cast<float*>(base + l.rows_bytes(keys));
      for (int64_t j = 0; j < c.kv_heads; ++j) {
        if (!keys) {
          QuantizeInt8Rows(src + t * st + j * sj, dim, 1, dim, q + (j * P + o) * dim,
                           scales + j * P + o);
          continue;
        }
        QuantizeInt8Rows(src + t * st + j * sj, dim, 1, dim, codes.data(), scales + j * P + o);
        for (int64_t x = 0; x < dim; ++x) q[(j * dim + x) * P + o] = codes[x];
      }
    }
    return absl::OkStatus();
  }
  if (storage_ == Storage::kTiles) {
    // rows is f32 here (any strides), stored as kv_dtype (bf16: rounded to
    // nearest even, as any f32 row written to a bf16 cache). K element
    // (token o, head j, channel x) at (j * dim + x) * P + o; V row (o, j) at
    // (j * P + o) * dim.
    const float* src = rows.data<float>();
    const int64_t st = rows.stride(1), sj = rows.stride(2), sx = rows.stride(3);
    const bool bf16 = c.kv_dtype == DType::kBF16;
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t o = (at + t) % P;
      char* base = pages_[(at + t) / P]->part[keys ? 0 : 1];
      for (int64_t j = 0; j < c.kv_heads; ++j) {
        const float* r = src + t * st + j * sj;
        for (int64_t x = 0; x < dim; ++x) {
          const int64_t e = keys ? (j * dim + x) * P + o : (j * P + o) * dim + x;
          if (bf16) {
            reinterpret_cast<uint16_t*>(base)[e] = FloatToBF16(r[x * sx]);
          } else {
            reinterpret_cast<float*>(base)[e] = r[x * sx];
          }
        }
      }
    }
    return absl::OkStatus();
  }
  for (int64_t t = 0; t < tokens;) {
    const int64_t page = (at + t) / P, off = (at + t) % P;
    const int64_t n = std::min(tokens - t, P - off);
    char* base = pages_[page]->part[keys ? 0 : 1];
    for (int64_t j = 0; j < c.kv_heads; ++j) {
      const int64_t row = off * view_.token_rows + j * view_.head_rows;
      if (int8) {
        // rows is contiguous f32 here.
        // Head-major: this head's n tokens are n consecutive rows.
        QuantizeInt8Rows(rows.data<float>() + (t * c.kv_heads + j) * dim, c.kv_heads * dim, n, dim,
                         reinterpret_cast<int8_t*>(base) + row * dim,
                         reinterpret_cast<float*>(base + l.rows_bytes(keys)) + row);
      } else {
        // Token-major: this head's n tokens are rows kv_heads apart.
        const TensorView dst(base + row * dim * l.elem, c.kv_dtype, {1, n, 1, dim},
                             {n * c.kv_heads * dim, c.kv_heads * dim, dim, 1});
        RA_RETURN_IF_ERROR(CopyRows(rows.Slice(1, t, n).Slice(2, j, 1), dst));
      }
    }
    t += n;
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> DecodeState::ReadPaged(bool keys, int64_t n) const {
  const DecodeStateConfig& c = config_;
  const bool int8 = IsInt8(storage_);
  const PageLayout l = LayoutOf(c, storage_);
  const int64_t dim = keys ? c.head_dim : c.v_dim;
  const int64_t es = int8 ? 4 : l.elem;  // of the result
  RA_ASSIGN_OR_RETURN(Tensor t,
                      Tensor::Create(int8 ? DType::kF32 : c.kv_dtype, {1, n, c.kv_heads, dim}));
  const int64_t P = PageTokens();
  for (int64_t tok = 0; tok < n; ++tok) {
    const Page& page = *pages_[tok / P];
    const char* base = page.part[keys ? 0 : 1];
    for (int64_t j = 0; j < c.kv_heads; ++j) {
      char* dst = t.data<char>() + (tok * c.kv_heads + j) * dim * es;
      if (storage_ == Storage::kInt8Tiles) {
        const int64_t o = tok % P;
        const int8_t* q = reinterpret_cast<const int8_t*>(base);
        const float scale = reinterpret_cast<const float*>(base + l.rows_bytes(keys))[j * P + o];
        float* out = reinterpret_cast<float*>(dst);
        for (int64_t x = 0; x < dim; ++x) {
          out[x] = scale * static_cast<float>(q[keys ? (j * dim + x) * P + o : (j * P + o) * dim + x]);
        }
        continue;
      }
      if (storage_ == Storage::kTiles) {
        const int64_t o = tok % P;
        for (int64_t x = 0; x < dim; ++x) {
          const int64_t e = keys ? (j * dim + x) * P + o : (j * P + o) * dim + x;
          std::memcpy(dst + x * es, base + e * es, es);
        }
        continue;
      }
      const int64_t row = tok % P * view_.token_rows + j * view_.head_rows;
      if (!int8) {
        std::memcpy(dst, base + row * dim * l.elem, dim * l.elem);
        continue;
      }
      const int8_t* q = reinterpret_cast<const int8_t*>(base) + row * dim;
      const float scale = reinterpret_cast<const float*>(base + l.rows_bytes(keys))[row];
      float* out = reinterpret_cast<float*>(dst);
      for (int64_t x = 0; x < dim; ++x) out[x] = scale * static_cast<float>(q[x]);
    }
  }
  return t;
}

DecodeState::Storage DecodeState::StorageFor(const DecodeStateConfig& c) {
  if (c.linear) return Storage::kLinear;
  // int8 tiles: measured in docs/kv-memory.md ("int8 tile pages").
  if (c.int8_kv) return KvCacheDecodeIsFaster() ? Storage::kInt8Tiles : Storage::kInt8;
  // bf16 too: widening a bf16 tile row is exact, so its decode is the f32
  // tiles' over half the bytes (docs/kv-memory.md).
  if ((c.kv_dtype == DType::kF32 || c.kv_dtype == DType::kBF16) && KvCacheDecodeIsFaster()) {
    return Storage::kTiles;
  }
  return Storage::kTokenMajor;
}

bool DecodeState::RopeIsLengthDependent(const std::optional<RopeConfig>& rope) {
  return rope && RopeRuleOf(rope->scaling.type).length_dependent;
}

bool DecodeState::LengthDependent() const { return RopeIsLengthDependent(config_.rope); }

absl::StatusOr<DecodeState> DecodeState::Create(DecodeStateConfig config) {
  const DecodeStateConfig& c = config;
  RA_RETURN_IF_ERROR(CheckPositions(c.start_position, 1, "start_position"));
  if (c.heads <= 0 || c.kv_heads <= 0 || c.heads % c.kv_heads != 0 || c.head_dim <= 0 ||
      c.v_dim <= 0 || c.max_context < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a decode state needs heads (%d) a positive multiple of kv_heads (%d), positive head_dim "
        "(%d) and v_dim (%d), max_context >= 0 (%d)",
        c.heads, c.kv_heads, c.head_dim, c.v_dim, c.max_context));
  }
  if (c.int8_kv) {
    if (c.linear) {
      return absl::InvalidArgumentError(
          "an int8 KV cache is for softmax attention; a linear state keeps running sums");
    }
    if (c.kv_dtype != DType::kF32) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "an int8 KV cache computes in f32: kv_dtype must be f32, got %s", DTypeName(c.kv_dtype)));
    }
    if (RopeIsLengthDependent(c.rope)) {
      return absl::UnimplementedError(absl::StrFormat(
          "an int8 KV cache under the length-dependent RoPE rule \"%s\": its keys are rotated "
          "again when the length crosses the trained length, and quantizing them again would "
          "round them twice; use an f32 or bf16 cache",
          RopeRuleOf(c.rope->scaling.type).name));
    }
  }
  DecodeState s(std::move(config));
  const DecodeStateConfig& k = s.config_;
  s.storage_ = StorageFor(k);
  switch (s.storage_) {
    case Storage::kLinear: {
      RA_ASSIGN_OR_RETURN(LinearAttentionState st,
                          LinearAttentionState::Create(1, k.kv_heads, k.head_dim, k.v_dim));
      s.linear_.emplace(std::move(st));
      break;
    }
    case Storage::kTiles:
    case Storage::kInt8:
    case Storage::kInt8Tiles:
    case Storage::kTokenMajor:
      s.RebuildView();  // no pages until tokens arrive
      break;
  }
  if (s.LengthDependent() && !k.linear) {
    RA_ASSIGN_OR_RETURN(s.k_raw_,
                        Tensor::Create(DType::kF32, {1, k.max_context, k.kv_heads, k.head_dim}));
    // The largest attention factor the session's lengths can see (the
    // factor is constant within each of a rule's regimes: short and long).
    // (A factor below 1 counts as it is: LongRoPE with attention_factor
    // 0.5 halves every rotated key.)
    double largest = 0;
    for (const int64_t len :
         {k.start_position + 1, k.start_position + std::max<int64_t>(1, k.max_context)}) {
      RA_ASSIGN_OR_RETURN(RopeFrequencies f, ComputeRopeFrequencies(*k.rope, len));
      largest = std::max(largest, f.attention_factor);
    }
    s.max_attention_factor_ = largest;
  }
  if (k.rope && !s.LengthDependent()) {
    RA_ASSIGN_OR_RETURN(RopeRotator r,
                        RopeRotator::Create(*k.rope, k.max_context,
                                            std::min(k.max_context, k.rope_table_positions)));
    s.rotator_.emplace(std::move(r));
  }
  return s;
}

int64_t DecodeState::byte_size() const {
  int64_t bytes =
      static_cast<int64_t>(k_raw_.byte_size()) + static_cast<int64_t>(pages_.size()) * page_bytes();
  if (linear_) bytes += linear_->byte_size();
  return bytes;
}

int64_t DecodeState::shared_bytes() const {
  int64_t shared = 0;
  for (const auto& page : pages_) shared += page.use_count() > 1 ? 1 : 0;
  return shared * page_bytes();
}

absl::Status DecodeState::PrepareRope(int64_t new_len) {
  if (!LengthDependent()) return absl::OkStatus();
  const DecodeStateConfig& c = config_;
  // Planned as transformers does, for the largest position + 1.
  RA_ASSIGN_OR_RETURN(RopeFrequencies f,
                      ComputeRopeFrequencies(*c.rope, c.start_position + new_len));
  std::vector<double> key = f.inv_freq;
  key.push_back(f.attention_factor);
  if (rotator_ && key == rotator_freqs_) return absl::OkStatus();
  // Frequencies changed (dynamic NTK past L0, LongRoPE crossing its switch):
  // rotate every cached key again from its raw value, so the whole cache is
  // exactly what a one-shot pass over new_len tokens would hold. No table:
  // the rotator may change again next step.
  RA_ASSIGN_OR_RETURN(RopeRotator r, RopeRotator::FromFrequencies(*c.rope, f, 0));
  if (position_ > 0 && !c.linear) {
    RA_ASSIGN_OR_RETURN(Tensor keys, Tensor::CopyOf(k_raw_.cview().Slice(1, 0, position_)));
    const int64_t start = c.start_position;
    RA_RETURN_IF_ERROR(r.Apply(keys.view(), Positions{{}, absl::MakeConstSpan(&start, 1)},
                               RopeDirection::kForward, 1));
    // Every key was checked to fit any rotation when it arrived
    // (CheckEveryRotationFits); checked again before anything is written.
    RA_RETURN_IF_ERROR(CheckFinite(keys.cview(), "a cached key (rotated again)", kRotationOverflow));
    if (c.kv_dtype == DType::kBF16 && !IsInt8(storage_)) {
      RA_RETURN_IF_ERROR(CheckFitsBF16(keys.cview(), "a cached key (rotated again)"));
    }
    // Every cached key changes: the pages become this state's own first.
    RA_RETURN_IF_ERROR(MakeWritable(0, position_));
    RA_RETURN_IF_ERROR(WritePaged(keys.cview(), /*keys=*/true, 0));
  }
  rotator_.emplace(std::move(r));
  rotator_freqs_ = std::move(key);
  return absl::OkStatus();
}

absl::Status DecodeState::Prepare(Job& job, int plan_threads, AttentionJob* attention,
                                  Tensor* q_scratch, bool* done) {
  const DecodeStateConfig& c = config_;
  const std::string& n = job.names;
  const int64_t tokens = job.q.rank() >= 2 ? job.q.dim(1) : 0;
  if (tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%sq must have shape [1, tokens >= 1, %d, %d], got %s", n, c.heads,
                        c.head_dim, DimsToString(job.q.dims())));
  }
  RA_RETURN_IF_ERROR(
      CheckStepTensor(job.q, n + "q", tokens, c.heads, "heads", c.head_dim, "head_dim"));
  RA_RETURN_IF_ERROR(
      CheckStepTensor(job.k, n + "k", tokens, c.kv_heads, "kv_heads", c.head_dim, "head_dim"));
  RA_RETURN_IF_ERROR(
      CheckStepTensor(job.v, n + "v", tokens, c.kv_heads, "kv_heads", c.v_dim, "v_dim"));
  if (position_ + tokens > c.max_context) {
    return absl::OutOfRangeError(absl::StrFormat(
        "a step of %d tokens at position %d would exceed the session's max_context of %d", tokens,
        position_, c.max_context));
  }
  if (job.out.rank() != 4 || job.out.dim(0) != 1 || job.out.dim(1) != tokens ||
      job.out.dim(2) != c.heads || job.out.dim(3) != c.v_dim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the step's output must have shape [1, %d, %d, %d], got %s", tokens,
                        c.heads, c.v_dim, DimsToString(job.out.dims())));
  }
  const int64_t new_len = position_ + tokens;
  if (storage_ == Storage::kLinear) {
    LinearAttentionOptions lo;
    lo.rope = rotator_ ? &*rotator_ : nullptr;
    lo.num_threads = plan_threads;
    lo.check_finite = false;  // checked above
    *done = true;
    RA_RETURN_IF_ERROR(linear_->Step(job.q, job.k, job.v, lo, job.out));
    position_ = linear_->position();
    return absl::OkStatus();
  }
  // The queries, rotated in f32: the one copy a step needs of them.
  RA_ASSIGN_OR_RETURN(*q_scratch, CastTensor(job.q, DType::kF32));
  step_offset_ = position_;
  rope_offset_ = c.start_position + position_;
  const Positions at{{}, absl::MakeConstSpan(&rope_offset_, 1)};
  if (c.rope) {
    RA_RETURN_IF_ERROR(PrepareRope(new_len));
    RA_RETURN_IF_ERROR(rotator_->Apply(q_scratch->view(), at, RopeDirection::kForward, 1));
    RA_RETURN_IF_ERROR(CheckFinite(q_scratch->cview(), job.names + "q (rotated at its positions)",
                                   "the finite queries left the float range when rotated (values "
                                   "near the range limit, or times the rule's attention factor); "
                                   "reduce their magnitude"));
  }
  // Rows past position_ are scratch until position_ moves, so writing them
  // before the attention succeeds loses nothing on error (a page copied or
  // allocated for them stays, holding the same tokens below position_).
  if (Paged()) RA_RETURN_IF_ERROR(MakeWritable(position_, new_len));
  if (k_raw_.num_elements() > 0) {
    RA_RETURN_IF_ERROR(CopyRows(job.k, k_raw_.view().Slice(1, position_, tokens)));
  }
  // Keys rotated in f32, then stored once in the storage's type (rounded to
  // bf16, or quantized per (token, kv head)).
  RA_ASSIGN_OR_RETURN(Tensor kf, CastTensor(job.k, DType::kF32));
  if (LengthDependent()) {
    RA_RETURN_IF_ERROR(CheckEveryRotationFits(kf, *c.rope, max_attention_factor_,
                                              c.kv_dtype == DType::kBF16, job.names + "k"));
  }
  if (c.rope) RA_RETURN_IF_ERROR(rotator_->Apply(kf.view(), at, RopeDirection::kForward, 1));
  // Finite keys can leave the float range when rotated, and finite f32
  // keys or values the bf16 range when stored: refused before anything is
  // written (a key whose score is -Inf for this step's queries would
  // otherwise be committed as Inf, and fail every later step).
  RA_RETURN_IF_ERROR(CheckFinite(kf.cview(), job.names + "k (rotated at its positions)",
                                 kRotationOverflow));
  if (!IsInt8(storage_) && c.kv_dtype == DType::kBF16) {
    RA_RETURN_IF_ERROR(CheckFitsBF16(kf.cview(), job.names + "k (rounded to the bf16 cache)"));
    RA_RETURN_IF_ERROR(CheckFitsBF16(job.v, job.names + "v (rounded to the bf16 cache)"));
  }
  {
    RA_RETURN_IF_ERROR(WritePaged(kf.cview(), /*keys=*/true, position_));
    if (IsInt8(storage_) ||
        (storage_ == Storage::kTiles && job.v.dtype() != DType::kF32)) {
      RA_ASSIGN_OR_RETURN(Tensor vf, CastTensor(job.v, DType::kF32));
      RA_RETURN_IF_ERROR(WritePaged(vf.cview(), /*keys=*/false, position_));
    } else {
      RA_RETURN_IF_ERROR(WritePaged(job.v, /*keys=*/false, position_));
    }
    attention->paged = &view_;
  }
  attention->q = q_scratch->cview();
  attention->cache_length = new_len;
  AttentionOptions& o = attention->options;
  o = c.attention;
  o.causal = true;
  o.q_offsets = absl::MakeConstSpan(&step_offset_, 1);
  o.key_lengths = {};
  o.check_finite = false;        // new rows were checked above, old ones when appended
  o.num_threads = plan_threads;  // a prompt's prefill; the decode pass has its own threads
  o.plan_threads = plan_threads;
  o.stop = job.stop;
  attention->out = job.out;
  return absl::OkStatus();
}

void DecodeState::StepMany(absl::Span<Job> jobs, int threads, int plan_threads) {
  std::vector<AttentionJob> attention;
  std::vector<Tensor> q_scratch(jobs.size());
  std::vector<Job*> waiting;
  attention.reserve(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    Job& job = jobs[i];
    AttentionJob a;
    bool done = false;
    job.status = job.state->Prepare(job, plan_threads, &a, &q_scratch[i], &done);
    if (!job.status.ok() || done) continue;
    attention.push_back(std::move(a));
    waiting.push_back(&job);
  }
  AttendBatch(absl::MakeSpan(attention), threads);
  for (size_t i = 0; i < waiting.size(); ++i) {
    Job& job = *waiting[i];
    job.status = attention[i].status;
    if (!job.status.ok() && job.stop != nullptr && job.stop->ShouldStop()) {
      job.status = job.stop->status();  // stopped mid-way: the stop's own code
    }
    if (job.status.ok()) job.state->position_ += job.q.dim(1);
  }
}

absl::Status DecodeState::Step(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                               TensorView out, int threads, const StopToken* stop,
                               std::string names) {
  Job job;
  job.state = this;
  job.q = std::move(q);
  job.k = std::move(k);
  job.v = std::move(v);
  job.out = std::move(out);
  job.stop = stop;
  job.names = std::move(names);
  StepMany(absl::MakeSpan(&job, 1), threads, threads);
  return job.status;
}

absl::Status DecodeState::Truncate(int64_t position) {
  if (storage_ == Storage::kLinear) {
    return absl::UnimplementedError(
        "linear-attention sessions cannot be truncated: their state is a running sum");
  }
  if (position < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("truncate position must be >= 0, got %d", position));
  }
  if (position > position_) {
    return absl::OutOfRangeError(absl::StrFormat(
        "truncate position %d is outside [0, %d] (the session's length)", position, position_));
  }
  position_ = position;
  if (Paged()) {
    // Pages past the new length go (freed when no one else holds them); the
    // page the cut falls in is kept, and copied before a write if shared.
    const int64_t P = PageTokens();
    pages_.resize(std::min<size_t>(pages_.size(), (position + P - 1) / P));
    RebuildView();
  }
  return absl::OkStatus();
}

absl::Status DecodeState::Import(ConstTensorView k, ConstTensorView v, KeyForm form,
                                 const std::string& names) {
  const DecodeStateConfig& c = config_;
  if (storage_ == Storage::kLinear) {
    return absl::UnimplementedError(
        "a linear-attention state has no KV to import: its state is a running sum");
  }
  if (position_ != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "a KV prefix can only be imported into an empty state; this one holds %d tokens",
        position_));
  }
  const int64_t tokens = k.rank() >= 2 ? k.dim(1) : -1;
  RA_RETURN_IF_ERROR(
      CheckStepTensor(k, names + "k", tokens, c.kv_heads, "kv_heads", c.head_dim, "head_dim"));
  RA_RETURN_IF_ERROR(
      CheckStepTensor(v, names + "v", tokens, c.kv_heads, "kv_heads", c.v_dim, "v_dim"));
  if (tokens > c.max_context) {
    return absl::OutOfRangeError(absl::StrFormat(
        "a prefix of %d tokens exceeds the session's max_context of %d", tokens, c.max_context));
  }
  if (tokens == 0) return absl::OkStatus();
  const int64_t start = c.start_position;
  const Positions at{{}, absl::MakeConstSpan(&start, 1)};
  // Keys in f32, raw (unrotated).
  RA_ASSIGN_OR_RETURN(Tensor raw, CastTensor(k, DType::kF32));
  if (c.rope && form == KeyForm::kRotated && LengthDependent()) {
    // Undo the rotation they were given with (this length's frequencies):
    // the state re-rotates from raw keys when the frequencies change.
    RA_ASSIGN_OR_RETURN(RopeRotator given, RopeRotator::Create(*c.rope, start + tokens, 0));
    RA_RETURN_IF_ERROR(given.Apply(raw.view(), at, RopeDirection::kInverse, 1));
    RA_RETURN_IF_ERROR(CheckFinite(raw.cview(), names + "k (un-rotated)", kRotationOverflow));
  }
  if (c.rope && LengthDependent()) {
    RA_RETURN_IF_ERROR(CheckEveryRotationFits(raw, *c.rope, max_attention_factor_,
                                              c.kv_dtype == DType::kBF16,
                                              names + (form == KeyForm::kRotated ? "k (un-rotated)"
                                                                                 : "k")));
  }
  if (k_raw_.num_elements() > 0) {
    RA_RETURN_IF_ERROR(CopyRows(raw.cview(), k_raw_.view().Slice(1, 0, tokens)));
  }
  // Stored exactly as given when they come rotated (outside a
  // length-dependent rule `raw` is then k itself, in f32).
  Tensor rotated = std::move(raw);
  if (!(c.rope && form == KeyForm::kRotated && !LengthDependent())) {
    if (c.rope) {
      if (LengthDependent()) {
        RA_RETURN_IF_ERROR(PrepareRope(tokens));  // position_ is 0: nothing re-rotated
      }
      RA_RETURN_IF_ERROR(rotator_->Apply(rotated.view(), at, RopeDirection::kForward, 1));
    }
  }
  // Finite keys can leave the float range when rotated, and finite f32
  // values the bf16 range when stored: refused, as a step's would be, never
  // held as Inf (every later step would fail on them).
  RA_RETURN_IF_ERROR(
      CheckFinite(rotated.cview(), names + "k (rotated at its positions)", kRotationOverflow));
  if (!IsInt8(storage_) && c.kv_dtype == DType::kBF16) {
    RA_RETURN_IF_ERROR(CheckFitsBF16(rotated.cview(), names + "k (rounded to the bf16 cache)"));
    RA_RETURN_IF_ERROR(CheckFitsBF16(v, names + "v (rounded to the bf16 cache)"));
  }
  {
    RA_RETURN_IF_ERROR(MakeWritable(0, tokens));
    RA_RETURN_IF_ERROR(WritePaged(rotated.cview(), /*keys=*/true, 0));
    if (IsInt8(storage_) ||
        (storage_ == Storage::kTiles && v.dtype() != DType::kF32)) {
      RA_ASSIGN_OR_RETURN(Tensor vf, CastTensor(v, DType::kF32));
      RA_RETURN_IF_ERROR(WritePaged(vf.cview(), /*keys=*/false, 0));
    } else {
      RA_RETURN_IF_ERROR(WritePaged(v, /*keys=*/false, 0));
    }
  }
  position_ = tokens;
  return absl::OkStatus();
}

absl::StatusOr<DecodeState::Exported> DecodeState::Export() const {
  if (storage_ == Storage::kLinear) {
    return absl::UnimplementedError(
        "a linear-attention state has no KV to export: its state is a running sum");
  }
  Exported e;
  const int64_t n = position_;
  {
    // int8: the stored values, dequantized (scale * q).
    RA_ASSIGN_OR_RETURN(e.k, ReadPaged(/*keys=*/true, n));
    RA_ASSIGN_OR_RETURN(e.v, ReadPaged(/*keys=*/false, n));
  }
  if (k_raw_.num_elements() > 0) {
    RA_ASSIGN_OR_RETURN(e.k, Tensor::CopyOf(k_raw_.cview().Slice(1, 0, n)));
    e.key_form = KeyForm::kRaw;
  }
  return e;
}

absl::Status DecodeState::CopyFrom(const DecodeState& other) {
  const DecodeStateConfig& a = config_;
  const DecodeStateConfig& b = other.config_;
  if (storage_ != other.storage_ || a.kv_heads != b.kv_heads || a.head_dim != b.head_dim ||
      a.v_dim != b.v_dim || a.kv_dtype != b.kv_dtype || other.position_ > a.max_context ||
      (k_raw_.num_elements() > 0) != (other.k_raw_.num_elements() > 0)) {
    return absl::InvalidArgumentError("a decode state can only copy one of its own kind");
  }
  const int64_t n = other.position_;
  if (linear_) {
    linear_ = other.linear_;
  } else {
    // The full pages that hold other's n tokens are shared, not copied. A
    // partly filled last page is copied now, paid by this state: so the
    // source, writing its next token there, never has to (docs/kv-memory.md).
    // Under a length-dependent rule every cached key is rewritten when the
    // frequencies change, so nothing stays shared: all pages are copied.
    const int64_t P = PageTokens();
    const size_t used = static_cast<size_t>((n + P - 1) / P);
    pages_.assign(other.pages_.begin(), other.pages_.begin() + std::min(used, other.pages_.size()));
    RebuildView();
    const int64_t own_from = LengthDependent() ? 0 : n / P * P;
    absl::Status copied = MakeWritable(own_from, n);
    if (!copied.ok()) {
      pages_.clear();
      RebuildView();
      return copied;
    }
  }
  if (k_raw_.num_elements() > 0) {
    RA_RETURN_IF_ERROR(CopyRows(other.k_raw_.cview().Slice(1, 0, n), k_raw_.view().Slice(1, 0, n)));
  }
  rotator_ = other.rotator_;
  rotator_freqs_ = other.rotator_freqs_;
  position_ = n;
  return absl::OkStatus();
}

namespace internal {
int64_t KvSlabCollapses() { return g_slab_collapses.load(std::memory_order_relaxed); }
void ForgetEmptyKvPageArenasForTesting() { PageArena::ForgetEmptyArenas(); }
}  // namespace internal

}  // namespace ropeattn
