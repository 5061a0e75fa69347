// Embed, as the server runs it below gRPC (server/service.cc, Embed) with the
// built-in demo model registered as "demo": the input is a serialized
// ropeattn.v1.EmbedRequest; PriceEmbed, CheckCost and the memory budget, then
// RunEmbed.
//
// Checked: no crash or sanitizer finding; refusals never INTERNAL/UNKNOWN; a
// cost refusal is RESOURCE_EXHAUSTED; an OK answer fits its priced reply
// size, is [B, S, hidden_size] of the asked dtype with exact bytes and finite
// values, and the heap grew by at most the priced transient bytes (plus a
// fixed slack).
#include <cstddef>
#include <cstdint>

#include "server/layer.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ropeattn::fuzz::InitTarget();
  ropeattn::fuzz::DemoRegistry();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ropeattn;
  using namespace ropeattn::fuzz;
  v1::EmbedRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;
  const server::ModelRegistry& models = DemoRegistry();
  static server::MemoryBudget budget(kBudgetBytes);

  const std::optional<Admitted> admitted =
      Admit(server::PriceEmbed(models, request), "Embed", budget);
  if (!admitted) return 0;
  const server::Cost* cost = &admitted->cost;
  v1::EmbedResponse response;
  HeapMeter::Start();
  const absl::Status status = server::RunEmbed(models, request, &response);
  HeapMeter::Check(cost->transient_bytes, "Embed");
  if (!status.ok()) {
    CheckRefusal(status);
    return 0;
  }
  Note("answered", status);
  CheckReplySize(response, *cost);
  const v1::Tensor& e = response.embeddings();
  CheckAnswerTensor(e, "embeddings");
  const int64_t hidden = (*models.Get(request.model()))->config().hidden_size;
  const int64_t n = request.token_ids_size();
  const int64_t b = request.shape_size() == 2 ? request.shape(0) : 1;
  const int64_t s = request.shape_size() == 2 ? request.shape(1) : n;
  FUZZ_CHECK(e.shape_size() == 3 && e.shape(0) == b && e.shape(1) == s && e.shape(2) == hidden,
             "embeddings are not [B, S, hidden_size]: " + e.ShortDebugString().substr(0, 200));
  const v1::DType want =
      request.out_dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_F32 : request.out_dtype();
  FUZZ_CHECK(e.dtype() == want, "embeddings dtype");
  return 0;
}
