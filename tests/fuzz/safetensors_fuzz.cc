// safetensors: the checkpoint reader of server/model.cc on hostile files.
//
// An input that starts with '{' is a model.safetensors.index.json for a
// directory holding a valid two-shard checkpoint (safetensors_writer.h);
// anything else is a model.safetensors file. Each input is
// 1. parsed from memory with ParseSafetensors (the header and index
//    validation Model::Load applies to every file), and
// 2. loaded with Model::Load from a scratch directory (config.json of a tiny
//    Llama-style model, the input written as the file), which adds mapping,
//    the tensor table, naming, dtype and shape binding, F16 conversion and
//    the copy of misaligned data.
//
// Checked: no crash or sanitizer finding; ParseSafetensors either refuses
// with INVALID_ARGUMENT naming the file, or returns tensors that lie inside
// the data buffer after the header, do not overlap, and hold exactly
// product(shape) * dtype size bytes; Model::Load never answers INTERNAL or
// UNKNOWN, and for a single file it refuses exactly when ParseSafetensors
// does, with the same message; a loaded model has the config's shapes and
// every weight byte is readable.
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/strings/match.h"
#include "tests/fuzz/fuzz_util.h"
#include "tests/fuzz/safetensors_writer.h"

namespace ropeattn::fuzz {
namespace {

std::string g_single_dir;   // config.json + model.safetensors (the input)
std::string g_sharded_dir;  // config.json + two shards + index (the input)

void WriteFile(const std::string& path, absl::string_view bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) Fail("cannot write the scratch checkpoint", path);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) Fail("cannot write the scratch checkpoint", path);
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

// In memory (/dev/shm) when the machine has it: a file per execution.
std::string MakeScratchDir() {
  const char* tmp = std::getenv("TMPDIR");
  const char* base = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm"
                     : tmp != nullptr && *tmp != '\0' ? tmp
                                                      : "/tmp";
  std::string pattern = absl::StrCat(base, "/ropeattn-safetensors-fuzz-XXXXXX");
  if (::mkdtemp(pattern.data()) == nullptr) Fail("mkdtemp failed", pattern);
  return pattern;
}

void RemoveScratch() {
  for (const std::string& dir : {g_single_dir, g_sharded_dir}) {
    if (dir.empty()) continue;
    for (const char* f : {"config.json", "model.safetensors", "model.safetensors.index.json",
                          kShard1, kShard2}) {
      ::unlink(absl::StrCat(dir, "/", f).c_str());
    }
    ::rmdir(dir.c_str());
  }
}

// Bits per element (F4 and F6 pack below a byte).
int64_t DtypeBits(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64" || dtype == "C64") return 64;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 32;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 16;
  if (dtype == "F6_E2M3" || dtype == "F6_E3M2") return 6;
  if (dtype == "F4") return 4;
  return 8;
}

void CheckParsed(absl::string_view bytes, const std::vector<server::SafetensorsTensor>& tensors) {
  FUZZ_CHECK(bytes.size() >= 8, "a file shorter than its header length was accepted");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  const uint64_t data_start = 8 + header_len;
  FUZZ_CHECK(data_start <= bytes.size(), "the header runs past the file");
  std::vector<std::pair<uint64_t, uint64_t>> extents;
  for (const server::SafetensorsTensor& t : tensors) {
    FUZZ_CHECK(t.name != "__metadata__", "__metadata__ taken for a tensor");
    int64_t n = 1;
    for (int64_t d : t.shape) {
      FUZZ_CHECK(d >= 0, t.name);
      n = SatMul(n, d);
    }
    FUZZ_CHECK(SatMul(n, DtypeBits(t.dtype)) == SatMul(t.num_bytes, 8),
               t.name + ": bytes != shape");
    FUZZ_CHECK(t.offset >= data_start, t.name + ": data inside the header");
    FUZZ_CHECK(t.num_bytes >= 0 && t.offset + static_cast<uint64_t>(t.num_bytes) <= bytes.size(),
               t.name + ": data past the end of the file");
    if (t.num_bytes > 0) extents.push_back({t.offset, t.offset + t.num_bytes});
  }
  std::sort(extents.begin(), extents.end());
  for (size_t i = 1; i < extents.size(); ++i) {
    FUZZ_CHECK(extents[i].first >= extents[i - 1].second, "overlapping tensors accepted");
  }
}

void CheckModel(const server::Model& m) {
  const server::ModelConfig& c = m.config();
  FUZZ_CHECK(m.num_layers() == c.num_layers, "layer count");
  FUZZ_CHECK(m.embed_tokens().rank() == 2 && m.embed_tokens().dim(0) == c.vocab_size &&
                 m.embed_tokens().dim(1) == c.hidden_size,
             "embed_tokens shape");
  std::vector<ConstTensorView> views = {m.embed_tokens()};
  for (int64_t l = 0; l < m.num_layers(); ++l) {
    const server::LayerWeights* w = *m.layer(l);
    FUZZ_CHECK(w->q_proj.dim(0) == c.num_heads * c.head_dim && w->q_proj.dim(1) == c.hidden_size,
               "q_proj shape");
    FUZZ_CHECK(w->k_proj.dim(0) == c.num_kv_heads * c.head_dim, "k_proj shape");
    FUZZ_CHECK(w->v_proj.dim(0) == c.num_kv_heads * c.head_dim, "v_proj shape");
    FUZZ_CHECK(w->o_proj.dim(0) == c.hidden_size && w->o_proj.dim(1) == c.num_heads * c.head_dim,
               "o_proj shape");
    for (const ConstTensorView* v : {&w->q_proj, &w->k_proj, &w->v_proj, &w->o_proj, &w->q_bias,
                                     &w->k_bias, &w->v_bias, &w->o_bias}) {
      views.push_back(*v);
    }
  }
  volatile uint64_t sink = 0;
  for (const ConstTensorView& v : views) {
    if (v.empty_view()) continue;
    const size_t bytes = static_cast<size_t>(v.num_elements()) * DTypeSize(v.dtype());
    const uint8_t* p = static_cast<const uint8_t*>(v.raw());
    for (size_t i = 0; i < bytes; ++i) sink = sink + p[i];
  }
}

}  // namespace
}  // namespace ropeattn::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  using namespace ropeattn::fuzz;
  g_single_dir = MakeScratchDir();
  g_sharded_dir = MakeScratchDir();
  WriteFile(g_single_dir + "/config.json", kTinyConfig);
  WriteFile(g_sharded_dir + "/config.json", kTinyConfig);
  WriteFile(absl::StrCat(g_sharded_dir, "/", kShard1), SafetensorsBytes(ShardTensors(1)));
  WriteFile(absl::StrCat(g_sharded_dir, "/", kShard2), SafetensorsBytes(ShardTensors(2)));
  std::atexit(RemoveScratch);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ropeattn;
  using namespace ropeattn::fuzz;
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  const bool index_mode = size > 0 && data[0] == '{';
  absl::Status parse_status;
  if (!index_mode) {
    absl::StatusOr<std::vector<server::SafetensorsTensor>> parsed =
        server::ParseSafetensors(bytes, "model.safetensors");
    parse_status = parsed.status();
    if (parsed.ok()) {
      CheckParsed(bytes, *parsed);
    } else {
      FUZZ_CHECK(parsed.status().code() == absl::StatusCode::kInvalidArgument,
                 parsed.status().ToString().substr(0, 500));
      FUZZ_CHECK(absl::StartsWith(parsed.status().message(), "model.safetensors"),
                 parsed.status().ToString().substr(0, 500));
    }
  }
  const std::string& dir = index_mode ? g_sharded_dir : g_single_dir;
  WriteFile(dir + (index_mode ? "/model.safetensors.index.json" : "/model.safetensors"), bytes);
  absl::StatusOr<std::shared_ptr<const server::Model>> model = server::Model::Load("fuzz", dir);
  Note("parse", parse_status);
  Note("load", model.status());
  if (!model.ok()) {
    const absl::Status& s = model.status();
    FUZZ_CHECK(s.code() != absl::StatusCode::kInternal && s.code() != absl::StatusCode::kUnknown,
               s.ToString().substr(0, 500));
    if (!index_mode && !parse_status.ok()) {
      FUZZ_CHECK(s == parse_status, "Load and ParseSafetensors disagree: " +
                                        s.ToString().substr(0, 300) + " vs " +
                                        parse_status.ToString().substr(0, 300));
    }
    return 0;
  }
  FUZZ_CHECK(index_mode || parse_status.ok(),
             "Load accepted a file ParseSafetensors refused: " + parse_status.ToString());
  CheckModel(**model);
  return 0;
}
