// Attend, as the server runs it below gRPC (server/service.cc, Attend and
// RunOnExecutor): the input is a serialized ropeattn.v1.AttendRequest; it is
// priced (PriceAttend, or PriceLayerAttend for request.layer against the
// demo model), checked against the limits (CheckCost) and the memory budget,
// and only then run (RunAttend / RunLayerAttend).
//
// Checked: no crash or sanitizer finding; refusals never INTERNAL/UNKNOWN; a
// cost refusal is RESOURCE_EXHAUSTED; an OK answer fits its priced reply size,
// has the documented shape, exact byte lengths and only finite values, and
// the heap grew by at most the priced transient bytes (plus a fixed slack).
#include <cstddef>
#include <cstdint>

#include "server/handlers.h"
#include "server/layer.h"
#include "tests/fuzz/fuzz_util.h"

namespace ropeattn::fuzz {
namespace {

void CheckAnswer(const v1::AttendRequest& request, const v1::AttendResponse& response,
                 const server::Cost& cost) {
  CheckReplySize(response, cost);
  CheckAnswerTensor(response.out(), "out");
  CheckAnswerTensor(response.probs(), "probs");
  const v1::Tensor& out = response.out();
  FUZZ_CHECK(out.shape_size() == (request.has_layer() ? 3 : 4), out.DebugString());
  const v1::DType want = request.out_dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_F32
                                                                      : request.out_dtype();
  FUZZ_CHECK(out.dtype() == want, out.ShortDebugString());
  if (request.has_layer()) {
    const v1::Tensor& h = request.layer().hidden();
    FUZZ_CHECK(out.shape(0) == h.shape(0) && out.shape(1) == h.shape(1) &&
                   out.shape(2) == h.shape(2),
               "layer out shape differs from hidden's");
    return;
  }
  // out [B, Sq, H, Dv], probs [B, H, Sq, Sk] when asked.
  const v1::Tensor& q = request.q();
  const v1::Tensor& k = request.k();
  const v1::Tensor& v = request.v();
  FUZZ_CHECK(out.shape(0) == q.shape(0) && out.shape(1) == q.shape(1) &&
                 out.shape(2) == q.shape(2) && out.shape(3) == v.shape(3),
             "out shape is not [B, Sq, H, Dv]");
  if (request.return_probs()) {
    const v1::Tensor& p = response.probs();
    FUZZ_CHECK(p.shape_size() == 4 && p.shape(0) == q.shape(0) && p.shape(1) == q.shape(2) &&
                   p.shape(2) == q.shape(1) && p.shape(3) == k.shape(1),
               "probs shape is not [B, H, Sq, Sk]");
  } else {
    FUZZ_CHECK(!response.has_probs(), "probs in an answer that did not ask for them");
  }
}

}  // namespace
}  // namespace ropeattn::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ropeattn::fuzz::InitTarget();
  ropeattn::fuzz::DemoRegistry();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ropeattn;
  using namespace ropeattn::fuzz;
  v1::AttendRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;  // not kept in the corpus
  const server::ModelRegistry& models = DemoRegistry();
  static server::MemoryBudget budget(kBudgetBytes);

  const std::optional<Admitted> admitted =
      Admit(request.has_layer() ? server::PriceLayerAttend(models, request, kThreads)
                                : server::PriceAttend(request, kThreads),
            "Attend", budget);
  if (!admitted) return 0;
  const server::Cost* cost = &admitted->cost;
  v1::AttendResponse response;
  HeapMeter::Start();
  const server::ComputeOptions options{kThreads, nullptr};
  const absl::Status status = request.has_layer()
                                  ? server::RunLayerAttend(models, request, &response, options)
                                  : server::RunAttend(request, &response, options);
  HeapMeter::Check(cost->transient_bytes, "Attend");
  if (!status.ok()) {
    CheckRefusal(status);
    return 0;
  }
  Note("answered", status);
  CheckAnswer(request, response, *cost);
  return 0;
}
