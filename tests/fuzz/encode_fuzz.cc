// Encode, as the server runs it below gRPC (server/service.cc, Encode): the
// input is a serialized ropeattn.v1.EncodeRequest; PriceEncode, CheckCost and
// the memory budget, then RunEncode.
//
// Checked: no crash or sanitizer finding; refusals never INTERNAL/UNKNOWN; a
// cost refusal is RESOURCE_EXHAUSTED; an OK answer fits its priced reply
// size, its tensors have exact byte lengths and, like every number in it,
// are finite; the heap grew by at most the priced transient bytes (plus a
// fixed slack); per op, the answer has the fields and sizes the op promises.
#include <cstddef>
#include <cstdint>

#include "server/handlers.h"
#include "tests/fuzz/fuzz_util.h"

namespace ropeattn::fuzz {
namespace {

int64_t Elements(const v1::Tensor& t) {
  int64_t n = 1;
  for (int64_t d : t.shape()) n = SatMul(n, d);
  return n;
}

void CheckAnswer(const v1::EncodeRequest& request, const v1::EncodeResponse& r,
                 const server::Cost& cost) {
  CheckReplySize(r, cost);
  CheckAnswerTensor(r.table(), "table");
  CheckAnswerTensor(r.cos(), "cos");
  CheckAnswerTensor(r.sin(), "sin");
  CheckAnswerTensor(r.x(), "x");
  CheckAnswerTensor(r.bias(), "bias");
  for (double f : r.inv_freq()) CheckFiniteValue(f, "inv_freq");
  for (double s : r.slopes()) CheckFiniteValue(s, "slopes");
  CheckFiniteValue(r.attention_factor(), "attention_factor");
  switch (request.op_case()) {
    case v1::EncodeRequest::kSinusoidal: {
      const auto& op = request.sinusoidal();
      FUZZ_CHECK(r.table().shape_size() == 2 && r.table().shape(0) == op.num_positions() &&
                     r.table().shape(1) == op.d_model(),
                 r.table().ShortDebugString().substr(0, 200));
      break;
    }
    case v1::EncodeRequest::kRopeCosSin: {
      const auto& op = request.rope_cos_sin();
      FUZZ_CHECK(r.cos().shape_size() == 2 && r.cos().shape(0) == op.positions_size() &&
                     r.cos().shape(1) == r.inv_freq_size(),
                 "cos is not [positions, rotary_dim / 2]");
      FUZZ_CHECK(Elements(r.sin()) == Elements(r.cos()), "sin and cos differ in size");
      break;
    }
    case v1::EncodeRequest::kRopeApply: {
      const auto& op = request.rope_apply();
      FUZZ_CHECK(r.x().shape_size() == op.x().shape_size() &&
                     r.x().data().size() == op.x().data().size(),
                 "rope_apply.x changed shape");
      for (int i = 0; i < op.x().shape_size(); ++i) {
        FUZZ_CHECK(r.x().shape(i) == op.x().shape(i), "rope_apply.x changed shape");
      }
      break;
    }
    case v1::EncodeRequest::kAlibi: {
      const auto& op = request.alibi();
      FUZZ_CHECK(r.slopes_size() == op.heads(), "alibi: one slope per head");
      if (op.q_len() > 0) {
        FUZZ_CHECK(r.bias().shape_size() == 3 && r.bias().shape(0) == op.heads() &&
                       r.bias().shape(1) == op.q_len() && r.bias().shape(2) == op.k_len(),
                   "alibi bias is not [heads, q_len, k_len]");
      }
      break;
    }
    case v1::EncodeRequest::kT5: {
      const auto& op = request.t5();
      const int32_t buckets = op.num_buckets() == 0 ? 32 : op.num_buckets();
      FUZZ_CHECK(r.buckets_size() == SatMul(op.q_len(), op.k_len()), "t5: q_len * k_len buckets");
      for (int32_t b : r.buckets()) FUZZ_CHECK(b >= 0 && b < buckets, "t5 bucket out of range");
      break;
    }
    default:
      break;
  }
}

}  // namespace
}  // namespace ropeattn::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ropeattn::fuzz::InitTarget();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ropeattn;
  using namespace ropeattn::fuzz;
  v1::EncodeRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;
  static server::MemoryBudget budget(kBudgetBytes);

  const std::optional<Admitted> admitted =
      Admit(server::PriceEncode(request), "Encode", budget);
  if (!admitted) return 0;
  const server::Cost* cost = &admitted->cost;
  v1::EncodeResponse response;
  HeapMeter::Start();
  const absl::Status status =
      server::RunEncode(request, &response, server::ComputeOptions{kThreads, nullptr});
  HeapMeter::Check(cost->transient_bytes, "Encode");
  if (!status.ok()) {
    CheckRefusal(status);
    return 0;
  }
  Note("answered", status);
  CheckAnswer(request, response, *cost);
  return 0;
}
