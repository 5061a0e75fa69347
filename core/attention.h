// Softmax attention: MHA / GQA / MQA with causal, padding, sliding window,
// soft-capping and additive relative biases.
//
//   out[b, i, h, :] = sum_j p[b, h, i, j] * v[b, j, h / g, :]
//   p[b, h, i, :]   = softmax_j(logit(b, h, i, j)) over visible keys j
//   logit           = cap(scale * <q[b, i, h, :], k[b, j, h / g, :]>) + bias(h, q_pos, j)
// where g = heads / kv_heads, cap(x) = softcap * tanh(x / softcap) when softcap > 0.
// Query i of row b is at absolute position q_pos = q_offset[b] + i; key j is at
// position j (or both as given explicitly: AttentionOptions::q_positions,
// k_positions). Key j is visible to query i when
//   j < key_length[b]                      (padding)
//   and, if causal, j <= q_pos
//   and, if window > 0, |q_pos - j| < window (causal: q_pos - window < j <= q_pos).
// A row with no visible key yields zeros (and zero probabilities), never NaN.
// RoPE is applied by the caller (RopeRotator) to q and k before this call.
#ifndef ROPEATTN_CORE_ATTENTION_H_
#define ROPEATTN_CORE_ATTENTION_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/kv_cache.h"
#include "core/relative_bias.h"
#include "core/stop.h"
#include "core/tensor.h"

namespace ropeattn {

enum class BiasKind {
  kNone = 0,
  kAlibi = 1,   // alibi_slopes[heads]: bias = -slope * |q_pos - j| (causal: q_pos - j)
  kT5 = 2,      // t5_table [num_buckets, heads] with t5_config; bucket of (j - q_pos)
  kTensor = 3,  // tensor [heads, q_len, k_len] or [batch, heads, q_len, k_len], f32
};
// Precision: ALiBi is applied as -slope * (|q_pos - j| - r) with r the
// distance of the row's largest visible bias (its nearest visible key; its
// farthest for a negative slope), computed in fp64 from exact integers. The
// softmax is unchanged by that per-row constant, and results and
// probabilities keep f32 precision however far the query is from its keys
// (-slope * 5e5 itself has an f32 step of 0.03). T5 biases are table entries
// (bounded, no growth with distance) and tensor biases are the caller's f32
// values: both are added as given.


struct AttentionBias {
  BiasKind kind = BiasKind::kNone;
  std::vector<double> alibi_slopes;
  ConstTensorView t5_table;
  T5BucketConfig t5_config;
  ConstTensorView tensor;
};

struct AttentionOptions {
  // Logit scale; 0 means 1/sqrt(head_dim). Must be finite and >= 0.
  double scale = 0.0;
  bool causal = false;
  // > 0: sliding window width (keys with |q_pos - j| < window). 0: none.
  int64_t window = 0;
  // > 0: logits are soft-capped to (-softcap, softcap); at least the
  // smallest normal float (a cap that rounds below it is refused). 0: none.
  double softcap = 0.0;
  // Per batch row: absolute position of query 0. Empty: k_len - q_len for every
  // row (queries are the last q_len tokens, as when decoding against a cache).
  absl::Span<const int64_t> q_offsets;
  // Per batch row: number of valid keys (the rest is right padding). Empty: k_len.
  absl::Span<const int64_t> key_lengths;
  // Explicit positions instead: q_positions [batch * q_len] (row-major [b][i];
  // not with q_offsets), k_positions [batch * k_len] (non-decreasing within
  // each batch row; needs q_positions or q_offsets). Every mask and bias
  // then follows positions, not indexes: key j is visible to query i when
  // (causal) k_pos <= q_pos and (window) |q_pos - k_pos| < window; ALiBi and
  // T5 use q_pos - k_pos. Each position in [0, kMaxPosition].
  absl::Span<const int64_t> q_positions;
  absl::Span<const int64_t> k_positions;
  AttentionBias bias;
  // Check q, k and v for NaN/inf first (InvalidArgument naming tensor and
  // index). A caller whose K/V cache was checked when filled may turn this off;
  // q is always checked, and a non-finite result is never returned.
  bool check_finite = true;
  // Threads for this call (>= 1). The call never uses more.
  int num_threads = 1;
  // The thread count the decode kernel cuts its keys for (0: num_threads).
  // Its partial sums, and so the result's last bits, depend on this number
  // only: a call planned for 2 gives the same bytes run on 1 thread or on 2.
  int plan_threads = 0;
  // Tests and benchmarks may force a kernel; normally ChooseAttentionPath decides.
  enum class Path { kAuto, kDecode, kPrefill };
  Path force_path = Path::kAuto;
  // Optional: read between prefill tiles; once it says stop, no new tile
  // starts and the call returns the token's status (Cancelled or
  // DeadlineExceeded) with `out` partly written. Not owned.
  const StopToken* stop = nullptr;
};

// Precision contract, the same on every kernel and for every query count:
// sums accumulate in f32 and the softmax runs in f32. When k and v are bf16,
// q is rounded to bf16 (a no-op for bf16 q) before q * k, and each
// probability is rounded to bf16 (nearest even) before the P * V sum; the
// probabilities returned in `probs` are the f32 ones, before that rounding.
// When k and v are f32 nothing is rounded (bf16 q is widened exactly). A bf16
// `out` is the f32 result rounded once.
//
// q:   [batch, q_len, heads, head_dim], f32 or bf16
// k:   [batch, k_len, kv_heads, head_dim], f32 or bf16
// v:   [batch, k_len, kv_heads, v_dim], same dtype as k
// out: [batch, q_len, heads, v_dim], f32 or bf16 (written)
// probs: optional, [batch, heads, q_len, k_len] f32 (written) when non-null.
// Errors: InvalidArgument for any shape / dtype mismatch (naming the tensor and
// the dims), heads % kv_heads != 0, bad options (naming the field and value),
// non-finite inputs; OutOfRange for a key length > k_len or a query position
// past kMaxPosition; ResourceExhausted for a T5 bias table (heads x relative
// positions) above 2^26 entries; the stop token's status when it fired.
// Thread-safety: safe to call concurrently from many threads.
absl::Status Attend(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                    const AttentionOptions& options, TensorView out,
                    TensorView probs = TensorView());

// Attend with keys and values [0, length) of a decoding session's KvCache
// instead of k/v tensors: q [1, q_len, heads, head_dim] (f32 or bf16), out
// [1, q_len, heads, v_dim]; heads a multiple of cache.kv_heads(), head_dim ==
// cache.head_dim(). Same options, masks, errors and results as Attend over
// those rows (options.key_lengths, if given, has one entry <= length). The
// cache is not scanned for non-finite values: write only checked rows into it
// (sessions check each step's tensors); `out` is still never non-finite.
// Few query rows use the decode kernel on the cache's own layout; a long step
// (a prompt) copies the rows out once and takes Attend's prefill path.
// OutOfRange if length exceeds the cache's capacity.
absl::Status AttendCache(ConstTensorView q, const KvCache& cache, int64_t length,
                         const AttentionOptions& options, TensorView out,
                         TensorView probs = TensorView());

// A decoding session's int8 keys and values (docs/kv-memory.md): token-major
// rows, symmetric per (token, kv head): value = scale * q, q in [-127, 127].
// Row t of kv head j is k + (t * kv_heads + j) * head_dim, its scale
// k_scale[t * kv_heads + j]; likewise v. Not owned.
struct Int8KvView {
  const int8_t* k = nullptr;
  const float* k_scale = nullptr;
  const int8_t* v = nullptr;
  const float* v_scale = nullptr;
  int64_t seq = 0, kv_heads = 0, head_dim = 0, v_dim = 0;
};

// Quantizes `rows` rows of `dim` floats (row r at x + r * x_stride) into
// q (row r at q + r * dim) with one scale per row: scale = max|x| / 127,
// q = x / scale rounded to nearest even (a zero row: scale 0, q 0). A scale
// below FLT_MIN is rounded up to the 2^-149 grid (at least one step), and a
// row is stored so that quantizing scale x q again gives the same scale and
// q (an exported int8 session re-imports bit for bit). A row holding a NaN
// or an infinity gets scale NaN and q 0: it reads back as NaN.
void QuantizeInt8Rows(const float* x, int64_t x_stride, int64_t rows, int64_t dim, int8_t* q,
                      float* scales);

// Attend with keys and values [0, length) of an int8 view, as AttendCache:
// q [1, q_len, heads, head_dim] (f32 or bf16), out [1, q_len, heads, v_dim];
// the same options, masks and errors. Exact with respect to the stored
// values: the result is Attend's over the dequantized rows (scale * q) to
// f32 rounding. Few query rows use the decode kernel on the int8 rows; a
// long step dequantizes the rows once and takes the prefill path. The view
// is not scanned for non-finite values. InvalidArgument for a view whose
// sizes disagree with q or whose pointers are missing; OutOfRange if length
// exceeds kv.seq.
absl::Status AttendInt8(ConstTensorView q, const Int8KvView& kv, int64_t length,
                        const AttentionOptions& options, TensorView out,
                        TensorView probs = TensorView());

// A decoding session's keys and values in pages (docs/kv-memory.md): page
// n holds tokens [n * page_tokens, (n + 1) * page_tokens), batch 1. Token t
// of kv head j is row r = (t % page_tokens) * token_rows + j * head_rows of
// page t / page_tokens in k_pages (head_dim elements a row) and v_pages
// (v_dim elements), of `type`: token-major (token_rows = kv_heads,
// head_rows = 1, what 0 and 0 mean) or head-major (1 and page_tokens, a
// session's pages: a page is read in address order). int8 pages also have
// a scale per row (k_scales, v_scales: f32, row r's at index r of its page;
// value = scale * q). page_tokens must be a multiple of 8 when there are
// several pages (the decode's 8-key groups never straddle two). With
// `tiles` (page_tokens = KvCache::kTile, token_rows and head_rows unused) a
// page holds the KvCache layout for its tokens: K [kv_heads][head_dim]
// [page_tokens] (one tile per head) and V [kv_heads][page_tokens][v_dim],
// read by the KvCache's decode kernel; int8 tile pages keep the scale of
// token t, kv head j at index j * page_tokens + t. Not owned.
struct PagedKvView {
  enum class Type { kF32, kBF16, kInt8 };
  Type type = Type::kF32;
  const void* const* k_pages = nullptr;
  const void* const* v_pages = nullptr;
  const float* const* k_scales = nullptr;  // kInt8 only
  const float* const* v_scales = nullptr;  // kInt8 only
  int64_t pages = 0, page_tokens = 0;
  int64_t kv_heads = 0, head_dim = 0, v_dim = 0;
  int64_t token_rows = 0, head_rows = 0;  // 0, 0: token-major
  bool tiles = false;
};

// Attend with keys and values [0, length) of a paged view, as AttendCache:
// q [1, q_len, heads, head_dim] (f32 or bf16), out [1, q_len, heads, v_dim];
// the same options, masks, errors and precision contract as Attend over the
// same rows as one tensor (bf16 pages: Attend's bf16 contract; int8 pages:
// f32 over the dequantized values), and the same bytes whatever the page
// size. Few query rows use the decode kernel on the pages; a long step
// gathers the rows once (int8: dequantized) and takes the prefill path.
// InvalidArgument for a view whose sizes disagree with q or whose pointers
// are missing; OutOfRange if length exceeds pages * page_tokens.
absl::Status AttendPaged(ConstTensorView q, const PagedKvView& kv, int64_t length,
                         const AttentionOptions& options, TensorView out,
                         TensorView probs = TensorView());

// One attention computation of a batched pass (AttendBatch): q/k/v as for
// Attend, or q against keys [0, cache_length) of a KvCache as for
// AttendCache, or of a paged view as for AttendPaged (then k and v are not
// used). No probabilities.
struct AttentionJob {
  ConstTensorView q, k, v;
  const KvCache* cache = nullptr;
  const PagedKvView* paged = nullptr;
  int64_t cache_length = 0;
  AttentionOptions options;  // options.num_threads plans the job as a solo call would
  TensorView out;
  absl::Status status;  // written: what Attend / AttendCache would return
};
// Runs jobs (the decode steps of many sessions, say) as one parallel pass of
// at most `threads` threads over (job, key range) work items, instead of one
// parallel region per job. Jobs small enough for the decode kernel share the
// pass; longer ones (prompts) run their prefill one after another. Each job's
// output and status are bit-identical to its solo Attend / AttendCache call
// with the same arguments: how a job's keys are cut into partial sums depends
// only on the job. Jobs must not share an output.
void AttendBatch(absl::Span<AttentionJob> jobs, int threads);

// Which kernel Attend uses for a shape (exposed for tests and benchmarks).
enum class AttentionPath {
  kDecode,   // few queries per kv head: one streaming pass over K and V
  kPrefill,  // tiled, oneDNN matmuls, masked tiles skipped
};
AttentionPath ChooseAttentionPath(int64_t q_len, int64_t heads, int64_t kv_heads,
                                  bool return_probs);

}  // namespace ropeattn

#endif  // ROPEATTN_CORE_ATTENTION_H_
