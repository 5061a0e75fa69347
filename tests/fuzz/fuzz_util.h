// Shared by the libFuzzer targets: the limits they run under, the checks
// every answer must pass, and a heap-growth meter. A failed check prints what
// broke and traps, so libFuzzer records the input as a crash.
#ifndef ROPEATTN_TESTS_FUZZ_FUZZ_UTIL_H_
#define ROPEATTN_TESTS_FUZZ_FUZZ_UTIL_H_

#include <sanitizer/allocator_interface.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "google/protobuf/stubs/logging.h"
#include "absl/strings/string_view.h"
#include "core/tensor.h"
#include "ropeattn/v1/attention.pb.h"
#include "server/cost.h"
#include "server/model.h"
#include "server/options.h"

namespace ropeattn::fuzz {

// Small limits, so that whatever the cost model accepts runs in well under a
// second even instrumented (ASan + UBSan), and nothing it accepts can need
// more than a few hundred MiB: 1e8 compute units per request (multiply-adds,
// element steps weighted, server/cost.h), 64 MiB messages, a 256 MiB memory
// budget shared by sessions and requests. One compute thread per call:
// deterministic, and no thread start-up per execution.
inline constexpr int64_t kMaxMessageBytes = int64_t{64} << 20;
inline constexpr int64_t kMaxRequestCompute = 100'000'000;
inline constexpr int64_t kBudgetBytes = int64_t{256} << 20;
inline constexpr int kThreads = 1;
// Bytes a computation may allocate beyond what the cost model priced:
// one-time allocations (a oneDNN primitive and its cache entry, Abseil and
// protobuf internals), allocator rounding. A cost model that is off by a
// factor shows up far above it.
inline constexpr int64_t kHeapSlackBytes = int64_t{16} << 20;
// Error messages quote at most a short prefix of any client string
// (server/convert.h, QuoteForMessage); a message this long echoes one.
inline constexpr size_t kMaxMessageChars = 2048;

inline server::CostLimits FuzzLimits() { return {kMaxMessageBytes, kMaxRequestCompute}; }

// The server's defaults (server/options.h) with the limits above.
inline server::ServerOptions FuzzServerOptions() {
  server::ServerOptions o;
  o.threads_per_call = kThreads;
  o.max_message_bytes = kMaxMessageBytes;
  o.max_request_compute = kMaxRequestCompute;
  o.memory_budget_bytes = kBudgetBytes;
  o.max_sessions = 8;              // small, so the cap is reachable
  o.reap_interval_seconds = 3600;  // the reaper never runs on its own
  return o;
}

[[noreturn]] inline void Fail(const char* what, const std::string& detail = std::string()) {
  std::fprintf(stderr, "\n*** fuzz invariant broken: %s\n%s\n", what, detail.c_str());
  std::fflush(stderr);
  __builtin_trap();
}

#define FUZZ_CHECK(cond, detail)                                        \
  do {                                                                  \
    if (!(cond)) ::ropeattn::fuzz::Fail(#cond, (detail));               \
  } while (0)

inline std::string Describe(const absl::Status& s) { return s.ToString(); }

// ROPEATTN_FUZZ_VERBOSE=1 prints each input's outcome (to check what the
// seeds reach).
inline bool Verbose() {
  static const bool v = [] {
    const char* e = std::getenv("ROPEATTN_FUZZ_VERBOSE");
    return e != nullptr && *e != '\0' && *e != '0';
  }();
  return v;
}
inline void Note(const char* what, const absl::Status& s) {
  if (Verbose()) std::fprintf(stderr, "  %s: %s\n", what, s.ToString().substr(0, 300).c_str());
}

// A refusal (or a failed operation) uses a specific code: never INTERNAL or
// UNKNOWN (nor OK), and its message is bounded.
inline void CheckRefusal(const absl::Status& s) {
  Note("refused", s);
  FUZZ_CHECK(!s.ok(), "a refusal with an OK status");
  FUZZ_CHECK(s.code() != absl::StatusCode::kInternal, Describe(s));
  FUZZ_CHECK(s.code() != absl::StatusCode::kUnknown, Describe(s));
  FUZZ_CHECK(s.code() != absl::StatusCode::kDataLoss, Describe(s));
  FUZZ_CHECK(!s.message().empty(), "a refusal without a message");
  FUZZ_CHECK(s.message().size() <= kMaxMessageChars,
             std::string(s.message().substr(0, 300)) + "... (" +
                 std::to_string(s.message().size()) + " bytes)");
}

// A cost check that failed is RESOURCE_EXHAUSTED.
inline void CheckCostRefusal(const absl::Status& s) {
  CheckRefusal(s);
  FUZZ_CHECK(s.code() == absl::StatusCode::kResourceExhausted, Describe(s));
}

// What the server does before Run: the price (a refusal is checked), the
// limits (a refusal must be RESOURCE_EXHAUSTED), then the transient bytes
// reserved from `budget`. nullopt: refused, nothing to run.
struct Admitted {
  server::Cost cost;
  server::MemoryBudget::Reservation held;
};
inline std::optional<Admitted> Admit(const absl::StatusOr<server::Cost>& cost,
                                     const char* method, server::MemoryBudget& budget) {
  if (!cost.ok()) {
    CheckRefusal(cost.status());
    return std::nullopt;
  }
  if (absl::Status st = server::CheckCost(*cost, FuzzLimits(), method); !st.ok()) {
    CheckCostRefusal(st);
    return std::nullopt;
  }
  absl::StatusOr<server::MemoryBudget::Reservation> held =
      budget.Reserve(cost->transient_bytes, std::string("this ") + method + " request");
  if (!held.ok()) {
    CheckCostRefusal(held.status());
    return std::nullopt;
  }
  return Admitted{*cost, *std::move(held)};
}

// A wire tensor in an answer: a known dtype, non-negative dims, exactly
// product(shape) * dtype size bytes, every element finite.
inline void CheckAnswerTensor(const v1::Tensor& t, const char* name) {
  if (t.ByteSizeLong() == 0) return;  // unset
  FUZZ_CHECK(t.dtype() == v1::DTYPE_F32 || t.dtype() == v1::DTYPE_BF16, name);
  const int64_t elem = t.dtype() == v1::DTYPE_F32 ? 4 : 2;
  int64_t n = 1;
  for (int64_t d : t.shape()) {
    FUZZ_CHECK(d >= 0, name);
    n = SatMul(n, d);
  }
  FUZZ_CHECK(static_cast<int64_t>(t.data().size()) == SatMul(n, elem),
             std::string(name) + ": " + std::to_string(t.data().size()) + " bytes for " +
                 std::to_string(n) + " elements");
  const char* p = t.data().data();
  for (int64_t i = 0; i < static_cast<int64_t>(t.data().size()) / elem; ++i) {
    float f;
    if (elem == 4) {
      std::memcpy(&f, p + 4 * i, 4);
    } else {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      f = BF16ToFloat(b);
    }
    FUZZ_CHECK(std::isfinite(f), std::string(name) + " element " + std::to_string(i) +
                                     " is not finite in an OK answer");
  }
}

inline void CheckFiniteValue(double x, const char* name) {
  FUZZ_CHECK(std::isfinite(x), std::string(name) + " is not finite in an OK answer");
}

// The serialized answer fits the reply size the cost model priced (which
// includes kReplyOverheadBytes for framing and small fields).
inline void CheckReplySize(const google::protobuf::Message& reply, const server::Cost& cost) {
  const int64_t size = static_cast<int64_t>(reply.ByteSizeLong());
  FUZZ_CHECK(size <= cost.reply_bytes, "answer of " + std::to_string(size) +
                                           " bytes, priced at " +
                                           std::to_string(cost.reply_bytes) + " (" +
                                           cost.reply_what + ")");
}

// Heap growth, from ASan's allocator hooks: live bytes and the peak since
// the last Start(). Every thread's allocations count.
class HeapMeter {
 public:
  static void Install() {
    static const bool once = [] {
      __sanitizer_install_malloc_and_free_hooks(&OnMalloc, &OnFree);
      return true;
    }();
    (void)once;
  }
  static void Start() {
    const int64_t now = live().load(std::memory_order_relaxed);
    base().store(now, std::memory_order_relaxed);
    peak().store(now, std::memory_order_relaxed);
  }
  // Peak live bytes above the level at Start().
  static int64_t PeakGrowth() {
    return peak().load(std::memory_order_relaxed) - base().load(std::memory_order_relaxed);
  }
  // Checks the growth since Start() against `priced` bytes plus the slack.
  static void Check(int64_t priced, const std::string& what) {
    const int64_t grew = PeakGrowth();
    FUZZ_CHECK(grew <= SatAdd(priced, kHeapSlackBytes),
               what + ": heap grew by " + std::to_string(grew) + " bytes, priced " +
                   std::to_string(priced));
  }

 private:
  static std::atomic<int64_t>& live() {
    static std::atomic<int64_t> v{0};
    return v;
  }
  static std::atomic<int64_t>& base() {
    static std::atomic<int64_t> v{0};
    return v;
  }
  static std::atomic<int64_t>& peak() {
    static std::atomic<int64_t> v{0};
    return v;
  }
  static void OnMalloc(const volatile void* ptr, size_t size) {
    const int64_t now = live().fetch_add(static_cast<int64_t>(size)) + static_cast<int64_t>(size);
    int64_t p = peak().load(std::memory_order_relaxed);
    while (now > p && !peak().compare_exchange_weak(p, now, std::memory_order_relaxed)) {
    }
  }
  static void OnFree(const volatile void* ptr) {
    if (ptr == nullptr) return;
    live().fetch_sub(static_cast<int64_t>(__sanitizer_get_allocated_size(const_cast<void*>(ptr))));
  }
};

// Common start-up of the targets: the heap meter, and no protobuf log line
// for each mutated string that is not UTF-8 (the parse fails, as on the wire).
inline void InitTarget() {
  google::protobuf::SetLogHandler(nullptr);
  HeapMeter::Install();
}

// The registry the server holds without --model: the demo model as "demo".
inline const server::ModelRegistry& DemoRegistry() {
  static const server::ModelRegistry* registry = [] {
    auto* r = new server::ModelRegistry();
    auto demo = server::Model::Demo("demo");
    if (!demo.ok() || !r->Add(*demo).ok()) Fail("cannot build the demo model");
    return r;
  }();
  return *registry;
}

}  // namespace ropeattn::fuzz

#endif  // ROPEATTN_TESTS_FUZZ_FUZZ_UTIL_H_
