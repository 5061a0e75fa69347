// The cost model (docs/cost-model.md): what a request will cost, computed from
// its fields with saturating arithmetic before any work, and the server-wide
// memory budget that session state and in-flight requests share.
//
// Handlers validate a request's structure and describe its dimensions in one
// of the *Dims structs below; the functions here turn those into a Cost. All
// formulas live in this file, so a limit is one fact in one place.
#ifndef ROPEATTN_SERVER_COST_H_
#define ROPEATTN_SERVER_COST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "core/limits.h"
#include "core/tensor.h"

namespace ropeattn::server {

// A scalar element step weighs this many multiply-adds (the kernels run 16
// f32 FMAs per instruction; element-wise and bookkeeping loops do not).
inline constexpr int64_t kElementWeight = 16;
// One RoPE cos/sin pair computed in fp64 (std::cos + std::sin of p * inv_freq):
// ~11-15 ns on the reference machine, where a unit of attention work takes
// ~0.02 ns: some 48 element steps (priced at 8, a RoPE call at small
// positions ran ~5x its price). Past kSlowSinCosPosition the angles
// (p * inv_freq, up to p) leave glibc's fast argument reduction, ~100 ns a
// pair: an Attend at q_offsets near 2^40 ran 15x its price, a dynamic-RoPE
// step re-rotating its keys at start_position 2^39 13x.
inline constexpr int64_t kSinCosWeight = 48 * kElementWeight;
inline constexpr int64_t kSlowSinCosWeight = 320 * kElementWeight;
inline constexpr int64_t kSlowSinCosPosition = int64_t{1} << 26;
// The weight of a pair at positions up to `max_position`.
inline constexpr int64_t SinCosWeight(int64_t max_position) {
  return max_position >= kSlowSinCosPosition ? kSlowSinCosWeight : kSinCosWeight;
}
// Framing, shapes and small fields of any answer, on top of its tensors.
inline constexpr int64_t kReplyOverheadBytes = 4096;

struct Cost {
  int64_t reply_bytes = 0;      // the serialized answer (upper bound)
  int64_t transient_bytes = 0;  // held while the request runs
  int64_t compute = 0;          // multiply-adds, loop steps weighted
  int64_t held_bytes = 0;       // session state kept after the request
  // What drives each figure, for messages ("out [1, 8, 4, 64] f32", ...).
  std::string reply_what;
  std::string compute_what;
  std::string held_what;
};

struct CostLimits {
  int64_t max_message_bytes = int64_t{256} << 20;
  int64_t max_request_compute = int64_t{1} << 40;
};

// OK, or ResourceExhausted naming what exceeds which limit (reply bytes
// against max_message_bytes, compute against max_request_compute). `method`
// prefixes the message ("Attend", "Decode.Step", ...).
absl::Status CheckCost(const Cost& cost, const CostLimits& limits, absl::string_view method);

// Bytes of a dense tensor (saturating).
int64_t DenseBytes(int64_t elements, DType dtype);

// --- Attend (q/k/v given) ---
struct AttendDims {
  int64_t batch = 0, q_len = 0, k_len = 0, heads = 0, kv_heads = 0, head_dim = 0, v_dim = 0;
  DType q_dtype = DType::kF32, kv_dtype = DType::kF32, out_dtype = DType::kF32;
  bool return_probs = false;
  int64_t rope_rotary_dim = 0;   // 0: no RoPE
  int64_t rope_table_rows = 0;   // cos/sin rows precomputed (RopeTablePositionsFor)
  int64_t t5_rel_positions = 0;  // T5: relative positions the bias table spans
  int64_t wire_bytes = 0;        // bytes of q, k, v (and tables) on the wire
  // Elements of q, k and v: each is read (checked finite, copied or packed)
  // whatever the mask leaves, so each costs an element step.
  int64_t input_elements = 0;
  int64_t max_position = 0;  // the largest query or key position (SinCosWeight)
  int threads = 1;
  // The mask (core/attention.h): compute is priced by the (query, key)
  // pairs the kernels visit, not batch x heads x Sq x Sk.
  bool causal = false;
  int64_t window = 0;                // 0: none
  std::vector<int64_t> q_offsets;    // per batch row; empty: Sk - Sq each
  std::vector<int64_t> key_lengths;  // per batch row; empty: Sk each
  // q_positions / k_positions given: the mask follows them, and only
  // key_lengths narrow the price (every other row is priced whole).
  bool explicit_positions = false;
};
Cost AttendCost(const AttendDims& d);
// The (query, key) pairs core/attention.h's mask leaves visible to q_len
// queries at positions q_offset, q_offset + 1, ... over key_len keys at
// positions 0, 1, ... (causal, and a window > 0), summed over the rows in
// closed form (no loop over the rows); saturating. The kernels visit these,
// rounded to tiles (AttendCost, StepCost).
int64_t VisiblePairs(bool causal, int64_t window, int64_t q_offset, int64_t q_len,
                     int64_t key_len);

// --- Attend in layer mode ---
struct LayerDims {
  int64_t batch = 0, seq = 0, hidden = 0, heads = 0, kv_heads = 0, head_dim = 0;
  DType hidden_dtype = DType::kF32, out_dtype = DType::kF32;
  int64_t rope_rotary_dim = 0;
  int64_t rope_table_rows = 0;   // cos/sin rows precomputed (RopeTablePositionsFor)
  int threads = 1;
};
Cost LayerAttendCost(const LayerDims& d);

// --- Embed ---
Cost EmbedCost(int64_t tokens, int64_t hidden, DType out_dtype, bool adds_positions);

// --- Encode: each op's output elements and loop nest ---
struct EncodeDims {
  std::string what;           // "alibi bias [8, 1024, 1024]", for messages
  int64_t out_bytes = 0;      // tensors and repeated fields in the answer
  int64_t in_bytes = 0;       // input tensors copied (rope_apply.x, t5.table)
  int64_t loop_steps = 0;     // LoopSteps of the op's loop nest
  int64_t sincos = 0;         // fp64 cos/sin pairs computed (kSinCosWeight each)
  int64_t scratch_bytes = 0;  // working buffers besides in and out
};
Cost EncodeCost(const EncodeDims& d);

// --- Decoding sessions ---
struct SessionDims {
  bool linear = false;
  bool kv_cache_layout = false;  // pages in the KvCache's tiles (KvCache::kTile tokens)
  int64_t kv_heads = 0, head_dim = 0, v_dim = 0, max_context = 0;
  DType kv_dtype = DType::kF32;
  bool int8_kv = false;  // int8 rows + an f32 scale per (token, kv head)
  int64_t rope_rotary_dim = 0;      // 0: no RoPE
  bool rope_length_dependent = false;  // dynamic NTK / LongRoPE: raw keys kept
  int64_t window = 0;  // sliding window of the (causal) attention; 0: none
  int64_t start_position = 0;  // absolute position of the first token (SinCosWeight)
};
// held_bytes: the session's state for its whole life (KV or linear state,
// raw keys; no RoPE table: each step computes its positions' rows). Paged KV (tiles, token-major and int8, core/decode_state.h)
// is charged as max_context rounded up to whole pages.
Cost SessionOpenCost(const SessionDims& d);
// Bytes of a LinearAttentionState of these dims (batch 1).
int64_t LinearStateBytes(const SessionDims& d);
// Tokens of one KV page (DecodeState::PageTokensOf the session's storage:
// KvCache::kTile for tile pages, DecodeState::kPageTokens otherwise), 0 for
// a linear state.
int64_t KvPageTokens(const SessionDims& d);
// Bytes one KV page is charged (KvPageTokens tokens of K and V, int8
// scales, each part on a 64-byte line, as KvPageHeldBytes: with what its
// allocations hold beside them), 0 for a linear state. Must equal
// DecodeState::page_bytes().
int64_t KvPageBytes(const SessionDims& d);

struct StepDims {
  int64_t tokens = 0, position = 0;  // position before the step
  int64_t heads = 0;
  int64_t wire_bytes = 0;             // q, k, v (or hidden) on the wire
  int64_t hidden = 0;                 // layer mode: hidden_size (0 otherwise)
  DType out_dtype = DType::kF32;
  int threads = 1;
};
Cost StepCost(const SessionDims& s, const StepDims& d);

// Server-wide memory: session state and in-flight requests' transient
// buffers together stay under one budget. Thread-safe.
class MemoryBudget {
 public:
  explicit MemoryBudget(int64_t budget_bytes) : budget_(budget_bytes) {}

  // Bytes held until destroyed (or Release()d); move-only.
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& o) noexcept : budget_(o.budget_), bytes_(o.bytes_) {
      o.budget_ = nullptr;
      o.bytes_ = 0;
    }
    Reservation& operator=(Reservation&& o) noexcept;
    Reservation(const Reservation&) = delete;
    Reservation& operator=(const Reservation&) = delete;
    ~Reservation() { Release(); }
    void Release();
    int64_t bytes() const { return bytes_; }
    // Holds `bytes` more of the same budget (ResourceExhausted as Reserve
    // when it cannot; FailedPrecondition for an empty reservation), or gives
    // `bytes` of it back (at most what it holds).
    absl::Status Grow(int64_t bytes, absl::string_view what);
    void Shrink(int64_t bytes);
    // Moves `bytes` of this reservation (at most what it holds) into a new
    // one of the same budget: nothing is reserved or given back, so it
    // never fails, however full the budget is.
    Reservation Split(int64_t bytes);

   private:
    friend class MemoryBudget;
    Reservation(MemoryBudget* b, int64_t bytes) : budget_(b), bytes_(bytes) {}
    MemoryBudget* budget_ = nullptr;
    int64_t bytes_ = 0;
  };

  // ResourceExhausted naming `what`, the bytes asked and the bytes free when
  // the budget cannot hold `bytes` more.
  absl::StatusOr<Reservation> Reserve(int64_t bytes, absl::string_view what);

  int64_t budget() const { return budget_; }
  int64_t in_use() const;

 private:
  const int64_t budget_;
  mutable absl::Mutex mu_;
  int64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_COST_H_
