#include "server/cost.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/attention.h"
#include "core/decode_state.h"
#include "core/status_macros.h"

namespace ropeattn::server {
namespace {

// The prefill kernel's query rows per task (core/attention.cc): they size
// the score buffers.
constexpr int64_t kPrefillRows = 128;
// Fixed costs of a query row and of a query tile (AttendCost).
constexpr int64_t kQueryRowWeight = 2048;
constexpr int64_t kQueryTileWeight = 65536;
// A byte of K/V streamed from memory. The decode kernel is memory-bound:
// one query against 4096 f32 keys (32 heads, d 128, 134 MB) took 16.8 ms on
// one thread, ~0.125 ns a byte, where the prefill runs 0.013 ns a priced
// unit; counted as max(arithmetic, bytes x this), a decode-shaped and a
// prefill-shaped request of the same time cost about the same units, so one
// learned rate serves both (they were 30x apart).
constexpr int64_t kKvByteWeight = 8;

std::string Bytes(int64_t n) {
  if (n == kInt64Max) return "more than 2^63 bytes";
  if (n >= (int64_t{1} << 30)) return absl::StrFormat("%d bytes (%.1f GiB)", n, n / 1073741824.0);
  if (n >= (int64_t{1} << 20)) return absl::StrFormat("%d bytes (%.1f MiB)", n, n / 1048576.0);
  return absl::StrFormat("%d bytes", n);
}

std::string Count(int64_t n) {
  return n == kInt64Max ? std::string("more than 2^63") : absl::StrCat(n);
}

int64_t Sum(std::initializer_list<int64_t> xs) {
  int64_t s = 0;
  for (int64_t x : xs) s = SatAdd(s, x);
  return s;
}

// ceil(n / d) for n >= 0, d > 0, without the overflow of (n + d - 1) / d: a
// dim of up to 2^63 - 1 is accepted when another is 0 (no elements).
int64_t CeilDiv(int64_t n, int64_t d) { return n / d + (n % d != 0 ? 1 : 0); }

// cos + sin f32 rows for `positions` positions of a rotary_dim rotation.
int64_t RopeTableBytes(int64_t positions, int64_t rotary_dim) {
  return SatProduct({positions, rotary_dim / 2, 2, 4});
}

// Score and accumulator buffers of one attention call (core/attention.cc):
// the decode kernel keeps every row's scores, the prefill kernel one tile
// per thread; the prefill also packs the visible K/V once.
// Whether the core takes the prefill path (core's ChooseAttentionPath: more
// than 16 query rows, or more than 64 rows sharing a kv head: a 2-token step
// of 64 heads over one kv head is a prefill).
bool TakesPrefill(int64_t q_len, int64_t heads, int64_t kv_heads, bool return_probs) {
  return q_len > 0 && ChooseAttentionPath(q_len, heads, kv_heads, return_probs) ==
                          AttentionPath::kPrefill;
}

int64_t AttentionScratchBytes(int64_t batch, int64_t heads, int64_t kv_heads, int64_t q_len,
                              int64_t k_len, int64_t head_dim, int64_t v_dim, DType kv_dtype,
                              int threads, bool prefill) {
  const int64_t rows = SatProduct({batch, heads, q_len});
  // No query row (an empty batch, say): the kernel is never entered, so a
  // long k_len or q_len of an empty batch costs no tiles.
  if (rows == 0) return 0;
  if (!prefill) {
    return Sum({SatProduct({rows, std::max<int64_t>(k_len, 1), 4}),
                SatProduct({threads, rows, v_dim, 4}), SatProduct({rows, head_dim, 4})});
  }
  const int64_t pack =
      SatProduct({batch, kv_heads, k_len, SatAdd(head_dim, v_dim), static_cast<int64_t>(DTypeSize(kv_dtype))});
  const int64_t tiles =
      SatProduct({threads, kPrefillRows, SatAdd(SatMul(k_len, 2), SatAdd(head_dim, v_dim)), 4});
  // bf16 K/V where the bf16 GEMM flushes subnormals (AVX512-BF16): a tile
  // meeting one goes through an f32 GEMM on its keys' K and V rows widened,
  // in each kernel thread (one 1e-39 in k and v made a [1, 12000, 1, 2048]
  // Attend peak 120 MiB past its price).
  const int64_t widened =
      kv_dtype == DType::kBF16 ? SatProduct({threads, k_len, SatAdd(head_dim, v_dim), 4}) : 0;
  return Sum({pack, tiles, widened});
}

// The size of the key range [lo, hi) the query at position `pos` sees
// among `key_len` keys (core/attention.cc, Plan::KeyRange with index
// positions); <= 0 when it sees none.
int64_t RangeSize(bool causal, int64_t window, int64_t key_len, int64_t pos) {
  const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  int64_t hi = key_len;
  if (causal) {
    hi = std::min(hi, pos + 1);
  } else if (window > 0) {
    hi = std::min(hi, pos + window);
  }
  return hi - lo;
}

struct VisibleKeys {
  int64_t pairs = 0;    // sum over the query rows of their visible keys
  int64_t max_row = 0;  // the most keys one row sees
};

// The visible keys of the queries at positions [p0, p0 + rows), in closed
// form: the range's ends are linear in the position between at most two
// breakpoints (where the window's start leaves 0, where the end reaches
// key_len), so each piece is an arithmetic series clipped at 0.
VisibleKeys VisibleKeysOf(bool causal, int64_t window, int64_t key_len, int64_t p0,
                          int64_t rows) {
  // Positions stay within kMaxPosition and the window within
  // kMaxPosition + 1 (as the core clamps it): no term below overflows.
  window = std::min<int64_t>(window, kMaxPosition + 1);
  const int64_t p1 = p0 + rows;
  std::vector<int64_t> cuts = {p0, p1};
  if (window > 0) cuts.push_back(window - 1);
  if (causal) {
    cuts.push_back(key_len - 1);
  } else if (window > 0) {
    cuts.push_back(key_len - window);
  }
  std::sort(cuts.begin(), cuts.end());
  __int128 sum = 0;
  int64_t max_row = 0;
  int64_t s = p0;
  for (int64_t e : cuts) {
    if (e <= s || e > p1) continue;
    const int64_t n = e - s;
    const int64_t a = RangeSize(causal, window, key_len, s);
    const int64_t slope = n > 1 ? RangeSize(causal, window, key_len, s + 1) - a : 0;
    max_row = std::max({max_row, a, a + slope * (n - 1)});
    if (slope == 0) {
      sum += static_cast<__int128>(n) * std::max<int64_t>(a, 0);
    } else if (slope > 0) {  // a, a + 1, ...: the terms from max(0, -a) on
      const int64_t m = n - std::min(n, std::max<int64_t>(0, -a));
      const int64_t first = a + (n - m);
      sum += static_cast<__int128>(m) * first + static_cast<__int128>(m) * (m - 1) / 2;
    } else {  // a, a - 1, ...: the first a terms while positive
      const int64_t m = std::clamp<int64_t>(a, 0, n);
      sum += static_cast<__int128>(m) * a - static_cast<__int128>(m) * (m - 1) / 2;
    }
    s = e;
  }
  VisibleKeys v;
  v.pairs = sum > kInt64Max ? kInt64Max : static_cast<int64_t>(sum);
  v.max_row = max_row;
  return v;
}

// What one head's rows of one batch row cost the kernels: the (query, key)
// pairs they score, and the keys each kv head streams.
struct Visits {
  int64_t pairs = 0;
  int64_t keys = 0;
  // The span of keys the batch row's queries see together: the kernels size
  // per-call buffers (the decode's score rows, the prefill's packed K/V of
  // every batch row) by the widest batch row's span.
  int64_t span = 0;
};

// The decode kernel scores each row's visible keys and reads their union
// once (rounded to the cache's tiles); the prefill kernel scores, per
// 128-row block, every row against the block's union (a row sees at most
// 127 keys fewer than it: its window or causal edge moves a key a row) and
// reads that union once per block. Unmasked: q_len x key_len pairs, and
// key_len keys per block (or once).
Visits VisitsOf(bool causal, int64_t window, int64_t q_offset, int64_t q_len, int64_t key_len,
                bool prefill) {
  const int64_t full = SatMul(q_len, key_len);
  const int64_t blocks = prefill ? CeilDiv(q_len, kPrefillRows) : 1;
  Visits v;
  if (!causal && window <= 0) {
    v.pairs = full;
    v.keys = SatMul(key_len, blocks);
    v.span = key_len;
    return v;
  }
  const VisibleKeys k = VisibleKeysOf(causal, window, key_len, q_offset, q_len);
  if (k.pairs == 0) return v;  // every row masked: no tile is touched
  v.span = std::min(key_len, Sum({k.max_row, q_len - 1, KvCache::kTile}));
  if (prefill) {
    v.pairs = std::min(full, SatAdd(k.pairs, SatMul(q_len, kPrefillRows - 1)));
    v.keys = std::min(SatMul(key_len, blocks),
                      SatAdd(CeilDiv(v.pairs, kPrefillRows),
                             std::min(key_len, SatAdd(k.max_row, kPrefillRows - 1))));
  } else {
    v.pairs = k.pairs;
    v.keys = std::min(key_len, Sum({k.max_row, q_len - 1, KvCache::kTile}));
  }
  return v;
}

}  // namespace

int64_t VisiblePairs(bool causal, int64_t window, int64_t q_offset, int64_t q_len,
                     int64_t key_len) {
  return VisibleKeysOf(causal, window, key_len, q_offset, q_len).pairs;
}

int64_t DenseBytes(int64_t elements, DType dtype) {
  return SatMul(elements, static_cast<int64_t>(DTypeSize(dtype)));
}

absl::Status CheckCost(const Cost& cost, const CostLimits& limits, absl::string_view method) {
  if (cost.reply_bytes > limits.max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s: the answer (%s) would be %s, above the message limit of %d bytes "
        "(--max_message_bytes); ask for less per request",
        method, cost.reply_what, Bytes(cost.reply_bytes), limits.max_message_bytes));
  }
  if (cost.compute > limits.max_request_compute) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s: %s costs %s compute units, above the per-request bound of %d "
        "(--max_request_compute); split the request",
        method, cost.compute_what, Count(cost.compute), limits.max_request_compute));
  }
  return absl::OkStatus();
}

Cost AttendCost(const AttendDims& d) {
  Cost c;
  const int64_t out_el = SatProduct({d.batch, d.q_len, d.heads, d.v_dim});
  const int64_t probs_el = d.return_probs ? SatProduct({d.batch, d.heads, d.q_len, d.k_len}) : 0;
  const int64_t out_bytes = DenseBytes(out_el, d.out_dtype);
  c.reply_bytes = Sum({out_bytes, SatMul(probs_el, 4), kReplyOverheadBytes});
  c.reply_what = absl::StrFormat("out [%d, %d, %d, %d] %s", d.batch, d.q_len, d.heads, d.v_dim,
                                 DTypeName(d.out_dtype));
  if (d.return_probs) {
    absl::StrAppendFormat(&c.reply_what, " + probs [%d, %d, %d, %d] f32", d.batch, d.heads,
                          d.q_len, d.k_len);
  }
  c.transient_bytes =
      // The request as received and its aligned copy.
      Sum({SatMul(d.wire_bytes, 2), out_bytes, SatMul(probs_el, 4), c.reply_bytes,
           d.rope_rotary_dim > 0 ? RopeTableBytes(d.rope_table_rows, d.rope_rotary_dim) : 0,
           SatProduct({SatAdd(d.heads, 1), d.t5_rel_positions, 4}),
           SatProduct({d.batch, d.q_len, 16}),
           AttentionScratchBytes(d.batch, d.heads, d.kv_heads, d.q_len, d.k_len, d.head_dim,
                                 d.v_dim, d.kv_dtype, d.threads,
                                 TakesPrefill(d.q_len, d.heads, d.kv_heads, d.return_probs))});
  const int64_t rope_el =
      d.rope_rotary_dim > 0
          ? SatAdd(SatProduct({d.batch, d.q_len, d.heads, d.rope_rotary_dim / 2}),
                   SatProduct({d.batch, d.k_len, d.kv_heads, d.rope_rotary_dim / 2}))
          : 0;
  const int64_t elements =
      Sum({LoopSteps({d.batch, d.q_len, d.heads}), LoopSteps({d.batch, d.k_len, d.kv_heads}),
           d.input_elements, rope_el, out_el, probs_el, SatMul(d.heads, d.t5_rel_positions)});
  // cos/sin rows: the table's, and at most one per rotated token past it.
  const int64_t sincos =
      d.rope_rotary_dim > 0
          ? SatMul(SatAdd(d.rope_table_rows, SatMul(d.batch, SatAdd(d.q_len, d.k_len))),
                   d.rope_rotary_dim / 2)
          : 0;
  // Fixed work per query row (its softmax pass, output row and bookkeeping)
  // and, on the prefill path, per (batch row, kv head, query tile) (its GEMM
  // calls and packing), which tiny head dims or one key would otherwise leave priced
  // at a few units: measured ~100 ns a row and ~4 us a tile, where a unit
  // of real attention work takes 0.03-0.08 ns (1 thread, AVX2). Unpriced,
  // [200, 17, 1, 2]-shaped requests ran 50x their price and would teach the
  // admission a rate that refuses everyone else.
  const int64_t rows = SatProduct({d.batch, d.q_len, d.heads});
  const bool prefill = TakesPrefill(d.q_len, d.heads, d.kv_heads, d.return_probs);
  const int64_t tiles =
      prefill ? SatProduct({d.batch, d.kv_heads, CeilDiv(d.q_len, kPrefillRows)})
              : 0;
  // The pairs the kernels score and the K/V rows they stream (VisitsOf):
  // masked tiles and padded keys are skipped. Rows listed in q_offsets /
  // key_lengths are priced one by one (the lists are on the wire), the
  // others alike.
  const bool causal = d.causal && !d.explicit_positions;
  const int64_t window = d.explicit_positions ? 0 : d.window;
  const int64_t listed =
      static_cast<int64_t>(std::max(d.q_offsets.size(), d.key_lengths.size()));
  int64_t pairs_per_head = 0, keys_per_kv_head = 0, widest = 0;
  auto add = [&](const Visits& v, int64_t count) {
    pairs_per_head = SatAdd(pairs_per_head, SatMul(v.pairs, count));
    keys_per_kv_head = SatAdd(keys_per_kv_head, SatMul(v.keys, count));
    widest = std::max(widest, v.span);
  };
  auto row = [&](int64_t b) {
    const int64_t offset = b < static_cast<int64_t>(d.q_offsets.size()) ? d.q_offsets[b]
                                                                         : d.k_len - d.q_len;
    const int64_t key_len =
        b < static_cast<int64_t>(d.key_lengths.size()) ? d.key_lengths[b] : d.k_len;
    return VisitsOf(causal, window, offset, d.q_len, key_len, prefill);
  };
  for (int64_t b = 0; b < std::min(listed, d.batch); ++b) add(row(b), 1);
  if (d.batch > listed) add(row(listed), d.batch - listed);
  const int64_t pairs = SatMul(pairs_per_head, d.heads);
  const int64_t kv_bytes =
      SatProduct({keys_per_kv_head, d.kv_heads, SatAdd(d.head_dim, d.v_dim),
                  static_cast<int64_t>(DTypeSize(d.kv_dtype))});
  // Per-call buffers sized by the widest batch row's span, whatever the
  // others see: the decode fills a score row of it for every query row, the
  // prefill packs that span of K/V for every (batch row, kv head). A batch
  // of 512 rows, one seeing 8192 keys and the others 1, ran 160x its
  // price (668 ms) when each row paid only its own keys.
  const int64_t widest_steps =
      prefill ? SatProduct({d.batch, d.kv_heads, widest, SatAdd(d.head_dim, d.v_dim)})
              : SatMul(rows, widest);
  // Each pair also costs its softmax (scale, max, exp, sum): one element step.
  c.compute = Sum({std::max(SatMul(pairs, Sum({d.head_dim, d.v_dim, kElementWeight})),
                            SatMul(kv_bytes, kKvByteWeight)),
                   SatMul(SatAdd(elements, widest_steps), kElementWeight),
                   SatMul(sincos, SinCosWeight(d.max_position)), SatMul(rows, kQueryRowWeight),
                   SatMul(tiles, kQueryTileWeight)});
  c.compute_what = absl::StrFormat(
      "the attention [batch %d x heads %d x Sq %d x Sk %d] over head_dim %d + v_dim %d%s", d.batch,
      d.heads, d.q_len, d.k_len, d.head_dim, d.v_dim,
      d.t5_rel_positions > 0
          ? absl::StrFormat(" with a T5 bias table of %d relative positions", d.t5_rel_positions)
          : std::string());
  return c;
}

Cost LayerAttendCost(const LayerDims& d) {
  Cost c;
  const int64_t tokens = SatMul(d.batch, d.seq);
  const int64_t q_el = SatProduct({tokens, d.heads, d.head_dim});
  const int64_t kv_el = SatProduct({tokens, d.kv_heads, d.head_dim});
  const int64_t out_el = SatMul(tokens, d.hidden);
  c.reply_bytes = SatAdd(DenseBytes(out_el, d.out_dtype), kReplyOverheadBytes);
  c.reply_what = absl::StrFormat("out [%d, %d, %d] %s", d.batch, d.seq, d.hidden,
                                 DTypeName(d.out_dtype));
  c.transient_bytes =
      Sum({SatMul(DenseBytes(out_el, d.hidden_dtype), 2),  // hidden, received and copied
           SatMul(Sum({q_el, kv_el, kv_el, q_el}), 4),  // q, k, v, attention out
           SatMul(out_el, 8),                           // projected out (+ cast)
           c.reply_bytes,
           d.rope_rotary_dim > 0 ? RopeTableBytes(d.rope_table_rows, d.rope_rotary_dim) : 0,
           AttentionScratchBytes(d.batch, d.heads, d.kv_heads, d.seq, d.seq, d.head_dim,
                                 d.head_dim, DType::kF32, d.threads,
                                 TakesPrefill(d.seq, d.heads, d.kv_heads, false))});
  const int64_t proj = SatMul(SatProduct({tokens, d.hidden, d.head_dim}),
                              Sum({d.heads, d.kv_heads, d.kv_heads, d.heads}));
  const int64_t pairs = SatProduct({d.batch, d.heads, d.seq, d.seq});
  const int64_t elements = Sum({LoopSteps({d.batch, d.seq, d.heads}), q_el, kv_el, out_el});
  // cos/sin rows: the table's, and at most one per rotated q or k token.
  const int64_t sincos =
      d.rope_rotary_dim > 0
          ? SatMul(SatAdd(d.rope_table_rows, SatMul(tokens, 2)), d.rope_rotary_dim / 2)
          : 0;
  c.compute = Sum({proj, SatMul(pairs, SatAdd(SatMul(d.head_dim, 2), kElementWeight)),
                   SatMul(elements, kElementWeight), SatMul(sincos, kSinCosWeight)});
  c.compute_what = absl::StrFormat(
      "the layer [batch %d x seq %d, hidden %d, %d heads over %d kv heads of %d]", d.batch, d.seq,
      d.hidden, d.heads, d.kv_heads, d.head_dim);
  return c;
}

Cost EmbedCost(int64_t tokens, int64_t hidden, DType out_dtype, bool adds_positions) {
  Cost c;
  const int64_t el = SatMul(tokens, hidden);
  c.reply_bytes = SatAdd(DenseBytes(el, out_dtype), kReplyOverheadBytes);
  c.reply_what = absl::StrFormat("embeddings [%d tokens, %d] %s", tokens, hidden,
                                 DTypeName(out_dtype));
  c.transient_bytes = Sum({SatMul(el, 4), DenseBytes(el, out_dtype), c.reply_bytes,
                           SatMul(tokens, 16), SatMul(hidden, 8)});
  c.compute = SatMul(SatMul(LoopSteps({tokens, hidden}), adds_positions ? 2 : 1), kElementWeight);
  c.compute_what = absl::StrFormat("embedding %d tokens of %d", tokens, hidden);
  return c;
}

Cost EncodeCost(const EncodeDims& d) {
  Cost c;
  c.reply_bytes = SatAdd(d.out_bytes, kReplyOverheadBytes);
  c.reply_what = d.what;
  c.transient_bytes =
      Sum({SatMul(d.in_bytes, 2), SatMul(d.out_bytes, 2), d.scratch_bytes, kReplyOverheadBytes});
  c.compute = SatAdd(SatMul(d.loop_steps, kElementWeight), SatMul(d.sincos, kSinCosWeight));
  c.compute_what = d.what;
  return c;
}

int64_t KvPageTokens(const SessionDims& d) {
  if (d.linear) return 0;
  return d.kv_cache_layout ? KvCache::kTile : DecodeState::kPageTokens;
}

int64_t KvPageBytes(const SessionDims& d) {
  if (d.linear) return 0;
  auto line = [](int64_t n) { return SatMul(SatAdd(n, 63) / 64, 64); };
  const int64_t rows = SatMul(KvPageTokens(d), d.kv_heads);
  const int64_t elem = d.int8_kv ? 1 : static_cast<int64_t>(DTypeSize(d.kv_dtype));
  const int64_t scales = d.int8_kv ? line(SatMul(rows, 4)) : 0;
  return KvPageHeldBytes(SatAdd(line(SatProduct({rows, d.head_dim, elem})), scales),
                         SatAdd(line(SatProduct({rows, d.v_dim, elem})), scales));
}

int64_t LinearStateBytes(const SessionDims& d) {
  // S, P and A [kv_heads, head_dim, v_dim] and z [kv_heads, head_dim], fp64.
  return SatMul(SatProduct({d.kv_heads, d.head_dim, SatAdd(SatMul(d.v_dim, 3), 1)}), 8);
}

Cost SessionOpenCost(const SessionDims& d) {
  Cost c;
  if (d.linear) {
    c.held_bytes = LinearStateBytes(d);
  } else {
    // Pages: tiles or rows of kv_dtype, or int8 rows and a 4-byte scale per
    // (token, kv head), for K and V.
    const int64_t pages = SatAdd(d.max_context, KvPageTokens(d) - 1) / KvPageTokens(d);
    c.held_bytes = SatMul(pages, KvPageBytes(d));
  }
  if (!d.linear) {
    if (d.rope_length_dependent) {
      c.held_bytes = SatAdd(c.held_bytes, SatProduct({d.max_context, d.kv_heads, d.head_dim, 4}));
    }
  }
  c.held_what = absl::StrFormat(
      "%s state for max_context %d x %d kv heads x (head_dim %d + v_dim %d) %s",
      d.linear ? "linear-attention" : "KV", d.max_context, d.kv_heads, d.head_dim, d.v_dim,
      d.int8_kv ? "int8" : DTypeName(d.kv_dtype));
  return c;
}

Cost StepCost(const SessionDims& s, const StepDims& d) {
  Cost c;
  const int64_t new_len = SatAdd(d.position, d.tokens);
  const int64_t q_el = SatProduct({d.tokens, d.heads, s.head_dim});
  const int64_t kv_el = SatMul(SatMul(d.tokens, s.kv_heads), SatAdd(s.head_dim, s.v_dim));
  const int64_t out_el = SatProduct({d.tokens, d.heads, s.v_dim});
  const int64_t answer_el = d.hidden > 0 ? SatMul(d.tokens, d.hidden) : out_el;
  c.reply_bytes = SatAdd(DenseBytes(answer_el, d.out_dtype), kReplyOverheadBytes);
  c.reply_what = d.hidden > 0 ? absl::StrFormat("out [1, %d, %d] %s", d.tokens, d.hidden,
                                                DTypeName(d.out_dtype))
                              : absl::StrFormat("out [1, %d, %d, %d] %s", d.tokens, d.heads,
                                                s.v_dim, DTypeName(d.out_dtype));
  int64_t attention = 0;
  const bool prefill = !s.linear && TakesPrefill(d.tokens, d.heads, s.kv_heads, false);
  if (!s.linear) {
    attention = AttentionScratchBytes(1, d.heads, s.kv_heads, d.tokens, new_len, s.head_dim,
                                      s.v_dim, s.kv_dtype, d.threads, prefill);
    if (prefill) {
      // A step on the prefill path copies the rows out of the KvCache or the
      // pages into one tensor (int8 pages: dequantized to f32) first.
      attention = SatAdd(attention, SatProduct({new_len, s.kv_heads, SatAdd(s.head_dim, s.v_dim), 4}));
    }
    if (s.rope_length_dependent) {  // re-rotation of the cached keys
      attention = SatAdd(attention, SatProduct({new_len, s.kv_heads, s.head_dim, 4}));
    }
  }
  c.transient_bytes = Sum({SatMul(d.wire_bytes, 2), SatMul(SatAdd(q_el, kv_el), 8), SatMul(out_el, 8),
                           SatMul(answer_el, 8), c.reply_bytes, attention});
  // Layer mode: the hidden rows in f32, stacked with the pass's other steps
  // of the layer for the projections, and LinearRows' bf16-rounded copy of
  // them for bf16 weights (the outputs' stacked and split copies are the
  // f32 pairs above).
  if (d.hidden > 0) {
    c.transient_bytes = SatAdd(c.transient_bytes, SatProduct({d.tokens, d.hidden, 8}));
  }
  // A linear step works on a copy of the state (a failure leaves it as it was).
  if (s.linear) c.transient_bytes = SatAdd(c.transient_bytes, LinearStateBytes(s));
  int64_t compute = 0;
  if (s.linear) {
    // S, P and A updated per kv head and read per head; z beside them.
    compute = SatProduct({d.tokens, d.heads, s.head_dim, SatAdd(s.v_dim, 1), 6});
  } else {
    // The step's rows at position.. over the cache, causal and under the
    // session's window (AttendCost).
    const Visits v = VisitsOf(/*causal=*/true, s.window, d.position, d.tokens, new_len, prefill);
    compute = SatMul(SatMul(d.heads, v.pairs), Sum({s.head_dim, s.v_dim, kElementWeight}));
    // The cached K/V streamed (AttendCost): int8 rows plus a 4-byte scale
    // per (token, kv head) for K and V, or rows of kv_dtype. A step on the
    // prefill path gathers every cached row once first (PagedPrefill): at
    // least one pass.
    const int64_t row_bytes =
        s.int8_kv ? SatAdd(SatAdd(s.head_dim, s.v_dim), 8)
                  : SatMul(SatAdd(s.head_dim, s.v_dim), static_cast<int64_t>(DTypeSize(s.kv_dtype)));
    const int64_t keys = prefill ? std::max(v.keys, new_len) : v.keys;
    compute = std::max(compute, SatProduct({keys, s.kv_heads, row_bytes, kKvByteWeight}));
  }
  if (d.hidden > 0) {
    compute = SatAdd(compute, SatMul(SatProduct({d.tokens, d.hidden, s.head_dim}),
                                     Sum({d.heads, s.kv_heads, s.kv_heads, d.heads})));
  }
  if (s.rope_rotary_dim > 0) {
    // Each new token's cos/sin row, for its q and its k (no table).
    int64_t rows = SatMul(d.tokens, 2);
    if (s.rope_length_dependent) {
      // New frequencies re-rotate every cached key: its row, the rotation,
      // and the raw keys copied and the cache's keys rewritten.
      rows = SatAdd(rows, new_len);
      compute = SatAdd(compute, SatMul(SatProduct({new_len, s.kv_heads, s.rope_rotary_dim / 2}),
                                       kElementWeight));
      compute = SatAdd(compute, SatMul(SatProduct({new_len, s.kv_heads, s.head_dim, 2}),
                                       kElementWeight));
    }
    compute = SatAdd(compute, SatProduct({rows, s.rope_rotary_dim / 2,
                                          SinCosWeight(SatAdd(s.start_position, new_len))}));
  }
  c.compute = SatAdd(compute, SatMul(Sum({q_el, kv_el, out_el, answer_el}), kElementWeight));
  c.compute_what = absl::StrFormat("a step of %d tokens at position %d (%d heads)", d.tokens,
                                   d.position, d.heads);
  return c;
}

MemoryBudget::Reservation& MemoryBudget::Reservation::operator=(Reservation&& o) noexcept {
  if (this != &o) {
    Release();
    budget_ = std::exchange(o.budget_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

void MemoryBudget::Reservation::Release() {
  if (budget_ != nullptr && bytes_ > 0) {
    absl::MutexLock lock(&budget_->mu_);
    budget_->in_use_ -= bytes_;
  }
  budget_ = nullptr;
  bytes_ = 0;
}

absl::Status MemoryBudget::Reservation::Grow(int64_t bytes, absl::string_view what) {
  if (budget_ == nullptr) {
    return absl::FailedPreconditionError("an empty memory reservation cannot grow");
  }
  RA_ASSIGN_OR_RETURN(Reservation more, budget_->Reserve(bytes, what));
  bytes_ += std::exchange(more.bytes_, 0);
  more.budget_ = nullptr;
  return absl::OkStatus();
}

void MemoryBudget::Reservation::Shrink(int64_t bytes) {
  bytes = std::clamp<int64_t>(bytes, 0, bytes_);
  if (budget_ == nullptr || bytes == 0) return;
  absl::MutexLock lock(&budget_->mu_);
  budget_->in_use_ -= bytes;
  bytes_ -= bytes;
}

MemoryBudget::Reservation MemoryBudget::Reservation::Split(int64_t bytes) {
  bytes = std::clamp<int64_t>(bytes, 0, bytes_);
  if (budget_ == nullptr || bytes == 0) return Reservation();
  bytes_ -= bytes;
  return Reservation(budget_, bytes);
}

absl::StatusOr<MemoryBudget::Reservation> MemoryBudget::Reserve(int64_t bytes,
                                                                absl::string_view what) {
  bytes = std::max<int64_t>(bytes, 0);
  absl::MutexLock lock(&mu_);
  if (bytes > budget_ - in_use_) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "memory budget exhausted: %s needs %s, %s of the %s budget are free "
        "(--memory_budget_bytes); retry later or ask for less",
        what, Bytes(bytes), Bytes(budget_ - in_use_), Bytes(budget_)));
  }
  in_use_ += bytes;
  return Reservation(this, bytes);
}

int64_t MemoryBudget::in_use() const {
  absl::MutexLock lock(&mu_);
  return in_use_;
}

}  // namespace ropeattn::server
