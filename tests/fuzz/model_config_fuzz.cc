// config.json: ParseModelConfig (server/model.h) on the raw input bytes, as
// Model::Load reads a checkpoint's config.json.
//
// Checked: no crash, exception or sanitizer finding; errors are
// INVALID_ARGUMENT or UNIMPLEMENTED and name the file; an accepted config is
// self-consistent: positive sizes within the documented 2^31 - 1 cap, kv
// heads dividing heads, head_dim = hidden_size / heads when not given, a
// RoPE config (kRope only) that ValidateRopeConfig accepts, with an even
// rotary_dim in (0, head_dim], and finite frequencies for the model's
// max_positions when they can be computed.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "absl/strings/match.h"
#include "core/rope.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ropeattn;
  using namespace ropeattn::fuzz;
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<server::ModelConfig> config = server::ParseModelConfig(text, "config.json");
  Note("config", config.status());
  if (!config.ok()) {
    const absl::Status& s = config.status();
    FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument ||
                   s.code() == absl::StatusCode::kUnimplemented,
               s.ToString().substr(0, 500));
    FUZZ_CHECK(absl::StartsWith(s.message(), "config.json"), s.ToString().substr(0, 500));
    return 0;
  }
  const server::ModelConfig& c = *config;
  constexpr int64_t kCap = std::numeric_limits<int32_t>::max();
  for (int64_t v : {c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size,
                    c.max_positions, c.num_layers}) {
    FUZZ_CHECK(v > 0 && v <= kCap, "a config size outside [1, 2^31 - 1]");
  }
  FUZZ_CHECK(c.num_heads % c.num_kv_heads == 0, "kv heads do not divide heads");
  if (c.positions == server::PositionKind::kRope) {
    FUZZ_CHECK(c.rope.has_value(), "RoPE positions without a RoPE config");
    const RopeConfig& r = *c.rope;
    FUZZ_CHECK(ValidateRopeConfig(r).ok(), ValidateRopeConfig(r).ToString());
    FUZZ_CHECK(r.head_dim == c.head_dim, "rope head_dim differs from the model's");
    const int64_t rd = r.effective_rotary_dim();
    FUZZ_CHECK(rd > 0 && rd % 2 == 0 && rd <= c.head_dim, "rotary_dim");
    // What ModelInfo reports (server/layer.cc FillModelInfo): frequencies
    // for max_positions. Past the 2^16 pairs Encode allows they are skipped:
    // a hostile head_dim could make this slow, not wrong.
    if (rd / 2 <= 4096) {
      absl::StatusOr<RopeFrequencies> f = ComputeRopeFrequencies(r, c.max_positions);
      if (f.ok()) {
        FUZZ_CHECK(std::isfinite(f->attention_factor), "attention factor not finite");
        for (double x : f->inv_freq) FUZZ_CHECK(std::isfinite(x), "inv_freq not finite");
      } else {
        CheckRefusal(f.status());
      }
    }
  } else {
    FUZZ_CHECK(!c.rope.has_value(), "a RoPE config for a model without RoPE positions");
  }
  return 0;
}
