// A decoding session's state in the core: its keys and values (or its
// linear-attention running sums), its position, and the RoPE it applies,
// with the storage chosen once at creation (docs/scheduler.md, "The decode
// path"). The server's Session adds ownership, locking and lifetimes; every
// byte of computation is here.
//
// A step appends T tokens at positions position() .. position()+T-1: q and k
// are rotated there (RoPE), k and v are written into the storage, and the
// queries attend causally to every token so far (softmax), or update and read
// the running sums (linear). Steps of many states can run as one parallel pass
// (StepMany); each state's result is bit-identical to its own Step.
#ifndef ROPEATTN_CORE_DECODE_STATE_H_
#define ROPEATTN_CORE_DECODE_STATE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/attention.h"
#include "core/kv_cache.h"
#include "core/linear_attention.h"
#include "core/rope.h"
#include "core/stop.h"
#include "core/tensor.h"

namespace ropeattn {

struct DecodeStateConfig {
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t v_dim = 0;
  int64_t max_context = 0;  // tokens the state holds at most
  // Absolute position of the state's first token: token j sits at
  // start_position + j for RoPE (and for the length a length-dependent rule
  // is planned for, start_position + tokens). Masks and biases only see
  // distances, which do not change. In [0, kMaxPosition].
  int64_t start_position = 0;
  DType kv_dtype = DType::kF32;
  // Softmax K/V held as int8 with an f32 scale per (token, kv head), keys
  // quantized after rotation (docs/kv-memory.md); kv_dtype must then be f32
  // (the attention computes in f32 over the stored values). Unimplemented
  // under a length-dependent RoPE rule (its keys would be re-rotated and
  // quantized again), InvalidArgument with `linear`.
  bool int8_kv = false;
  bool linear = false;  // linear attention (running sums) instead of softmax
  std::optional<RopeConfig> rope;
  // Softmax: scale, window, softcap and bias (causal is implied). Whatever
  // the bias points into must outlive the state.
  AttentionOptions attention;
  // Precomputed cos/sin rows; positions past it are computed on the fly
  // (exactly, in fp64), so this only trades memory for speed. None by
  // default: a session rotates each position's row about twice (its q and
  // its k), so a table built at open mostly holds rows no step has reached.
  int64_t rope_table_positions = 0;
};

// Who pays for a state's pages (docs/kv-memory.md): Charge is called before
// a page is allocated (an error refuses the step or import that needed it,
// with that status), Refund when the page's last holder drops it, on
// whatever thread that happens. Must be thread-safe.
class KvPageCharger {
 public:
  virtual ~KvPageCharger() = default;
  virtual absl::Status Charge(int64_t bytes) = 0;
  virtual void Refund(int64_t bytes) = 0;
};

// Bytes a KV page whose K and V parts are `k_part_bytes` and `v_part_bytes`
// holds resident (docs/kv-memory.md): each part with what its allocation
// keeps beside it (a share of its slab's slack where the slab becomes a huge
// page, whole 4 KiB pages otherwise: every part takes whole pages), and the
// page's own objects. Saturates at int64 max.
int64_t KvPageHeldBytes(int64_t k_part_bytes, int64_t v_part_bytes);

class DecodeState {
 public:
  // Where a softmax state keeps K/V, always in pages allocated as tokens
  // arrive and shared by forks until written (copy on write): f32 or bf16
  // pages of KvCache::kTile tokens in the KvCache's tile layout where that
  // decode is the faster one (kTiles, KvCacheDecodeIsFaster), else
  // token-major pages of kPageTokens tokens of kv_dtype (kTokenMajor); int8
  // codes and scales (config.int8_kv) likewise in tiles where that decode is
  // the faster one (kInt8Tiles), else in head-major pages of kPageTokens
  // tokens (kInt8).
  enum class Storage { kLinear, kTiles, kTokenMajor, kInt8, kInt8Tiles };
  static constexpr int64_t kPageTokens = 16;
  static Storage StorageFor(const DecodeStateConfig& config);
  static bool IsInt8(Storage s) { return s == Storage::kInt8 || s == Storage::kInt8Tiles; }
  // Pages of KvCache::kTile tokens in the KvCache's tile layout.
  static bool IsTiles(Storage s) { return s == Storage::kTiles || s == Storage::kInt8Tiles; }
  // Tokens per page of a storage (0 for kLinear).
  static int64_t PageTokensOf(Storage storage);
  // Whether a rule's frequencies depend on the length (dynamic NTK,
  // LongRoPE): the state then keeps raw keys and re-rotates them.
  static bool RopeIsLengthDependent(const std::optional<RopeConfig>& rope);

  // Allocates the state (zero tokens). InvalidArgument for bad sizes,
  // ResourceExhausted when memory runs out, RoPE errors as RopeRotator's.
  static absl::StatusOr<DecodeState> Create(DecodeStateConfig config);

  DecodeState(DecodeState&&) = default;
  DecodeState& operator=(DecodeState&&) = default;

  const DecodeStateConfig& config() const { return config_; }
  Storage storage() const { return storage_; }
  // Tokens held; the next token's absolute position is
  // config().start_position + position().
  int64_t position() const { return position_; }

  // How a KV prefix's keys are given: as the model computed them before
  // RoPE, or already rotated at their positions (what an engine's KV cache
  // holds).
  enum class KeyForm { kRaw, kRotated };
  // Fills an empty softmax state with a prefix of P tokens at positions
  // start_position .. start_position + P - 1: k [1, P, kv_heads, head_dim],
  // v [1, P, kv_heads, v_dim] (f32 or bf16, finite). Raw keys are rotated
  // here; rotated keys are stored as given, except under a length-dependent
  // rule (dynamic NTK, LongRoPE), where they are taken as rotated for
  // length start_position + P (as a prefill of the prefix rotates them) and
  // un-rotated once to keep their raw values. Errors leave the state empty:
  // FailedPrecondition if it holds tokens, Unimplemented for linear states,
  // InvalidArgument for shapes or non-finite values (naming `names` + k/v),
  // OutOfRange past max_context. Under a length-dependent rule a raw key a
  // rotation of which could leave the cache's range is refused too
  // (InvalidArgument naming it): every cached key is rotated again when
  // the frequencies change.
  absl::Status Import(ConstTensorView k, ConstTensorView v, KeyForm form,
                      const std::string& names = "");
  // Unimplemented for linear states.
  // The held keys, rotated at their positions (in the state's kv dtype), or,
  // under a length-dependent rule, the raw f32 keys the
  // state keeps (key_form kRaw): rotated keys rounded to the cache dtype
  // would be un-rotated and rounded again by an import, not the same keys.
  // Values: [1, position(), kv_heads, v_dim] in the cache dtype. Importing
  // k (with key_form) and v into a state of the same config gives the same
  // cache bit for bit.
  struct Exported {
    Tensor k, v;
    KeyForm key_form = KeyForm::kRotated;
  };
  absl::StatusOr<Exported> Export() const;

  // One step. q [1, T, heads, head_dim], k [1, T, kv_heads, head_dim],
  // v [1, T, kv_heads, v_dim] (f32 or bf16, any batch and sequence strides),
  // out [1, T, heads, v_dim] (f32 or bf16, written). Errors leave the state
  // unchanged: InvalidArgument for a wrong shape or a non-finite input
  // (naming `<names>q`, `<names>k` or `<names>v` and the index), OutOfRange
  // past max_context, the stop token's status if it fired.
  struct Job {
    DecodeState* state = nullptr;
    ConstTensorView q, k, v;
    TensorView out;
    const StopToken* stop = nullptr;
    std::string names;     // prefix for the tensors' names in errors, e.g. "step."
    absl::Status status;   // written by StepMany
  };
  absl::Status Step(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out,
                    int threads, const StopToken* stop = nullptr, std::string names = "");
  // The steps of distinct states in one pass of at most `threads` threads;
  // `plan_threads` is the thread count each job's attention is planned for
  // (its solo Step's `threads`), which fixes its bits. Sets every job's
  // status; a failed job leaves its state unchanged and the others go on.
  static void StepMany(absl::Span<Job> jobs, int threads, int plan_threads);

  // Rolls back to `position` tokens (0 <= position <= position()).
  // Unimplemented for linear states (a running sum cannot forget).
  absl::Status Truncate(int64_t position);
  // Takes `other`'s history (a fork); `other` must have this config's
  // shapes and storage (InvalidArgument otherwise). Paged storage shares
  // other's full pages and copies its partly filled last one (at most
  // PageTokensOf - 1 tokens, charged to this state: a charge refused is
  // returned, this state left empty); a shared page is copied again only by
  // a side that truncates into it and writes. Under a length-dependent RoPE
  // rule every page is copied (its keys are rewritten when the frequencies
  // change). Raw keys and linear sums are copied.
  absl::Status CopyFrom(const DecodeState& other);
  // Bytes held by the storage, shared pages included.
  int64_t byte_size() const;
  // Of those, the bytes of pages another state also holds (a snapshot:
  // another thread may drop its share at any moment).
  int64_t shared_bytes() const;
  // Bytes one page holds resident, what it is charged: KvPageHeldBytes of
  // its parts (0 for storage without pages).
  int64_t page_bytes() const;
  // The view over the pages (null for a linear state), valid
  // until the state next changes: for benchmarks and tests.
  const PagedKvView* paged_view() const { return Paged() ? &view_ : nullptr; }
  // Pages this state allocates from now on are charged to `charger` (none:
  // not charged). Pages it already holds keep their payer.
  void set_page_charger(std::shared_ptr<KvPageCharger> charger) { charger_ = std::move(charger); }

 private:
  explicit DecodeState(DecodeStateConfig config) : config_(std::move(config)) {}
  // Validates a job and writes its tokens into rows position() ..: fills
  // the attention job (softmax) or runs the whole step (linear). On error
  // nothing the state reads has changed (rows past position() are scratch).
  absl::Status Prepare(Job& job, int plan_threads, AttentionJob* attention, Tensor* q_scratch,
                       bool* done);
  // Length-dependent RoPE (dynamic NTK, LongRoPE): the frequencies for
  // `new_len` tokens; the cached keys are rotated again from their raw values
  // whenever they change.
  absl::Status PrepareRope(int64_t new_len);
  bool LengthDependent() const;
  // Paged storage: makes the pages covering tokens [from, to) exist and this
  // state's alone (copying a shared one first), then refreshes the view.
  absl::Status MakeWritable(int64_t from, int64_t to);
  // Refreshes the view; pages before `from` are unchanged since the last.
  void RebuildView(size_t from = 0);
  // Writes rows [1, T, kv_heads, dim] of any dtype and strides (int8: f32
  // contiguous, quantized here) as tokens at .. at + T - 1 of the pages.
  absl::Status WritePaged(const ConstTensorView& rows, bool keys, int64_t at);
  // Reads tokens [0, n) of the pages as [1, n, kv_heads, dim] (int8:
  // dequantized, f32).
  absl::StatusOr<Tensor> ReadPaged(bool keys, int64_t n) const;
  bool Paged() const { return storage_ != Storage::kLinear; }
  int64_t PageTokens() const { return PageTokensOf(storage_); }

  DecodeStateConfig config_;
  Storage storage_ = Storage::kTokenMajor;
  int64_t position_ = 0;
  int64_t step_offset_ = 0;  // the preparing step's first index (its queries' offset)
  int64_t rope_offset_ = 0;  // the preparing step's first absolute position (RoPE)
  Tensor k_raw_;                        // unrotated keys, length-dependent RoPE only
  // Page n holds tokens [n * PageTokens(), ...); the view
  // the attention reads, over the pointer arrays beside it.
  struct Page;
  std::vector<std::shared_ptr<Page>> pages_;
  std::vector<const void*> k_pages_, v_pages_;
  std::vector<const float*> k_scales_, v_scales_;
  PagedKvView view_;
  std::shared_ptr<KvPageCharger> charger_;
  std::optional<LinearAttentionState> linear_;  // kLinear
  std::optional<RopeRotator> rotator_;
  std::vector<double> rotator_freqs_;  // what rotator_ was built from (length-dependent)
  double max_attention_factor_ = 1.0;  // length-dependent: the largest of its lengths
};

namespace internal {
// KV page slabs collapsed into huge pages since start (tests).
int64_t KvSlabCollapses();
// Tests only, with no state alive in another thread: forgets the page
// arenas holding no slab (a binary's first 64 part sizes get arenas).
void ForgetEmptyKvPageArenasForTesting();
}  // namespace internal

}  // namespace ropeattn

#endif  // ROPEATTN_CORE_DECODE_STATE_H_
