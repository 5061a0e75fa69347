// Test-side safetensors writer: builds checkpoints (valid and deliberately
// broken) in a temporary directory. Header-only so any test can use it
// without a CMake change.
//
// Layout written: u64 little-endian header length N, N bytes of JSON padded
// with spaces (as the reference writer does, so data starts 8-byte aligned),
// then each tensor's bytes in order.
#ifndef ROPEATTN_TESTS_SERVER_SAFETENSORS_WRITER_H_
#define ROPEATTN_TESTS_SERVER_SAFETENSORS_WRITER_H_

#include <stdlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "core/tensor.h"

namespace ropeattn::testing {

struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // "F32", "BF16", "F16", "I32", ... written verbatim
  std::vector<int64_t> shape;
  std::string bytes;  // raw little-endian payload
  // Written as data_offsets instead of the packed position (broken files).
  std::optional<std::pair<uint64_t, uint64_t>> offsets;
};

struct SafetensorsLayout {
  // The JSON is padded with spaces so 8 + N is a multiple of this.
  size_t header_alignment = 8;
  // Spaces appended after that padding: 1 misaligns every tensor.
  size_t extra_header_spaces = 0;
  // Replaces the header length field (broken files).
  std::optional<uint64_t> header_length;
  // The "__metadata__" object, or empty for none.
  std::string metadata_json = R"({"format":"pt"})";
};

inline std::string JsonQuote(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

// The header JSON for `tensors`, packing data in order unless offsets are set.
inline std::string SafetensorsHeaderJson(const std::vector<SafetensorsTensor>& tensors,
                                         const std::string& metadata_json) {
  std::vector<std::string> entries;
  if (!metadata_json.empty()) entries.push_back(absl::StrCat("\"__metadata__\":", metadata_json));
  uint64_t pos = 0;
  for (const SafetensorsTensor& t : tensors) {
    uint64_t begin = pos, end = pos + t.bytes.size();
    pos = end;
    if (t.offsets.has_value()) std::tie(begin, end) = *t.offsets;
    entries.push_back(absl::StrCat(JsonQuote(t.name), ":{\"dtype\":", JsonQuote(t.dtype),
                                   ",\"shape\":[", absl::StrJoin(t.shape, ","),
                                   "],\"data_offsets\":[", begin, ",", end, "]}"));
  }
  return absl::StrCat("{", absl::StrJoin(entries, ","), "}");
}

// A whole file from an arbitrary header text and data buffer.
inline std::string SafetensorsFromHeader(std::string header, absl::string_view data,
                                         const SafetensorsLayout& layout = {}) {
  if (layout.header_alignment > 1) {
    while ((8 + header.size()) % layout.header_alignment != 0) header += ' ';
  }
  header.append(layout.extra_header_spaces, ' ');
  const uint64_t n = layout.header_length.value_or(header.size());
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += header;
  out.append(data.data(), data.size());
  return out;
}

inline std::string SafetensorsBytes(const std::vector<SafetensorsTensor>& tensors,
                                    const SafetensorsLayout& layout = {}) {
  std::string data;
  for (const SafetensorsTensor& t : tensors) data += t.bytes;
  return SafetensorsFromHeader(SafetensorsHeaderJson(tensors, layout.metadata_json), data, layout);
}

inline void WriteFileOrDie(const std::string& path, absl::string_view contents) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  f.close();
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::abort();
  }
}

inline std::string F32Bytes(const std::vector<float>& v) {
  std::string out(v.size() * 4, '\0');
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

inline std::string BF16Bytes(const std::vector<float>& v) {
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) bits[i] = FloatToBF16(v[i]);
  std::string out(bits.size() * 2, '\0');
  std::memcpy(out.data(), bits.data(), out.size());
  return out;
}

// F16 (or any 16-bit) payload from raw bit patterns.
inline std::string U16Bytes(const std::vector<uint16_t>& bits) {
  std::string out(bits.size() * 2, '\0');
  std::memcpy(out.data(), bits.data(), out.size());
  return out;
}

// A fresh directory under $TMPDIR (or /tmp), removed with its contents on
// destruction.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = absl::StrCat(base != nullptr && *base != '\0' ? base : "/tmp",
                                    "/ropeattn_model_test.XXXXXX");
    if (::mkdtemp(tmpl.data()) == nullptr) {
      std::fprintf(stderr, "mkdtemp failed for %s\n", tmpl.c_str());
      std::abort();
    }
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string File(absl::string_view name) const { return absl::StrCat(path_, "/", name); }

 private:
  std::string path_;
};

}  // namespace ropeattn::testing

#endif  // ROPEATTN_TESTS_SERVER_SAFETENSORS_WRITER_H_
