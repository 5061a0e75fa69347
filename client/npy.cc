// NumPy .npy reader and writer (format 1.0 / 2.0 / 3.0, see
// numpy/lib/format.py). Files may come from anywhere, so the parser trusts
// nothing: every length is checked against the file before it is used.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "client/client.h"

namespace ropeattn::client {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;
// numpy aligns the data to 64 bytes so it can be memory-mapped.
constexpr size_t kAlign = 64;

absl::Status Bad(absl::string_view path, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": not a usable .npy file: ", problem));
}

absl::Status FileError(int err, absl::string_view what, absl::string_view path) {
  return absl::ErrnoToStatus(err, absl::StrCat("cannot ", what, " ", path));
}

// The longest header read: numpy writes a few hundred bytes (version 2.0 only
// past 64 KiB, for thousands of dimensions). A larger length is refused
// before anything is allocated for it.
constexpr uint64_t kMaxHeaderLen = uint64_t{1} << 20;

// An open file descriptor, closed on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// Appends up to `n` bytes to `out`, fewer only at the end of the file. Reads
// in pieces, so a size the file does not back (a pipe that ends early) costs
// no more memory than what arrived.
absl::Status ReadUpTo(int fd, uint64_t n, const std::string& path, std::string* out) {
  constexpr uint64_t kPiece = uint64_t{1} << 20;
  while (n > 0) {
    const size_t old_size = out->size();
    const size_t piece = static_cast<size_t>(std::min(n, kPiece));
    out->resize(old_size + piece);
    ssize_t got;
    do {
      got = ::read(fd, out->data() + old_size, piece);
    } while (got < 0 && errno == EINTR);
    if (got < 0) {
      const int err = errno;
      out->resize(old_size);
      return FileError(err, "read", path);
    }
    out->resize(old_size + static_cast<size_t>(got));
    if (got == 0) break;
    n -= static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

// Recursive-descent parser for the header: a Python dict literal such as
// {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
class HeaderParser {
 public:
  explicit HeaderParser(absl::string_view text) : text_(text) {}

  struct Header {
    std::string descr;
    bool fortran_order = false;
    std::vector<int64_t> shape;
  };

  // Error strings are the problem only; the caller adds the file name.
  absl::StatusOr<Header> Parse() {
    Header h;
    bool have_descr = false, have_fortran = false, have_shape = false;
    SkipSpace();
    if (!Consume('{')) return Error("header is not a dict");
    while (true) {
      SkipSpace();
      if (Consume('}')) break;
      std::optional<std::string> key = String();
      if (!key) return Error("expected a quoted key");
      SkipSpace();
      if (!Consume(':')) return Error(absl::StrCat("expected ':' after '", *key, "'"));
      SkipSpace();
      if (*key == "descr") {
        if (have_descr) return Error("duplicate key 'descr'");
        std::optional<std::string> descr = String();
        if (!descr) return Error("'descr' is not a string (structured dtypes are not supported)");
        h.descr = *descr;
        have_descr = true;
      } else if (*key == "fortran_order") {
        if (have_fortran) return Error("duplicate key 'fortran_order'");
        if (ConsumeWord("True")) {
          h.fortran_order = true;
        } else if (ConsumeWord("False")) {
          h.fortran_order = false;
        } else {
          return Error("'fortran_order' is not True or False");
        }
        have_fortran = true;
      } else if (*key == "shape") {
        if (have_shape) return Error("duplicate key 'shape'");
        absl::Status s = Shape(h.shape);
        if (!s.ok()) return s;
        have_shape = true;
      } else {
        return Error(absl::StrCat("unexpected key '", *key, "'"));
      }
      SkipSpace();
      if (Consume(',')) continue;
      if (Consume('}')) break;
      return Error(absl::StrCat("expected ',' or '}' after the value of '", *key, "'"));
    }
    SkipSpace();
    if (pos_ != text_.size()) return Error("unexpected text after the header dict");
    if (!have_descr || !have_fortran || !have_shape) {
      return Error("header must have the keys 'descr', 'fortran_order' and 'shape'");
    }
    return h;
  }

 private:
  absl::Status Error(absl::string_view problem) const {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed header: ", problem, " at offset ", pos_));
  }

  void SkipSpace() {
    while (pos_ < text_.size() && absl::ascii_isspace(static_cast<unsigned char>(text_[pos_]))) {
      ++pos_;
    }
  }

  bool Consume(char c) {
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }

  bool ConsumeWord(absl::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  // A Python string literal in single or double quotes, without escapes
  // (numpy never writes any in these keys and values).
  std::optional<std::string> String() {
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"')) return std::nullopt;
    const char quote = text_[pos_];
    const size_t end = text_.find(quote, pos_ + 1);
    if (end == absl::string_view::npos) return std::nullopt;
    std::string s(text_.substr(pos_ + 1, end - pos_ - 1));
    if (s.find('\\') != std::string::npos) return std::nullopt;
    pos_ = end + 1;
    return s;
  }

  // A tuple of non-negative ints: (), (5,), (2, 3). Python 2 wrote longs as
  // "3L", so a trailing L is accepted.
  absl::Status Shape(std::vector<int64_t>& shape) {
    if (!Consume('(')) return Error("'shape' is not a tuple");
    while (true) {
      SkipSpace();
      if (Consume(')')) return absl::OkStatus();
      if (pos_ >= text_.size() || !absl::ascii_isdigit(static_cast<unsigned char>(text_[pos_]))) {
        return Error("'shape' holds something other than non-negative integers");
      }
      int64_t d = 0;
      while (pos_ < text_.size() && absl::ascii_isdigit(static_cast<unsigned char>(text_[pos_]))) {
        const int digit = text_[pos_] - '0';
        if (d > (std::numeric_limits<int64_t>::max() - digit) / 10) {
          return Error("a 'shape' dimension does not fit in 64 bits");
        }
        d = d * 10 + digit;
        ++pos_;
      }
      Consume('L');
      shape.push_back(d);
      SkipSpace();
      if (Consume(',')) continue;
      if (Consume(')')) return absl::OkStatus();
      return Error("expected ',' or ')' in 'shape'");
    }
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

std::string ShapeTuple(absl::Span<const int64_t> shape) {
  if (shape.size() == 1) return absl::StrCat("(", shape[0], ",)");
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

// IEEE binary16 to binary32 (exact: every half is a float).
float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf or NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);  // rebias 15 -> 127
  } else if (mant == 0) {
    bits = sign;  // +-0
  } else {
    // Subnormal half: normalize it, every one is a normal float.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | static_cast<uint32_t>(112 - e) << 23 | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// double to float, rounding to nearest even like numpy's astype. A finite
// double beyond the float range is undefined behaviour for static_cast, so
// that case is rounded by hand: to FLT_MAX below the halfway point to 2^128,
// to infinity from it on.
float DoubleToFloat(double d) {
  if (std::isfinite(d) && std::fabs(d) > std::numeric_limits<float>::max()) {
    const double halfway = std::ldexp(1.0, 128) - std::ldexp(1.0, 103);
    const float mag = std::fabs(d) >= halfway ? std::numeric_limits<float>::infinity()
                                              : std::numeric_limits<float>::max();
    return d < 0 ? -mag : mag;
  }
  return static_cast<float>(d);
}

enum class Element { kF32, kF16, kF64, kBF16Bits };

}  // namespace

absl::StatusOr<v1::Tensor> ReadNpy(const std::string& path) {
  return ReadNpy(path, std::numeric_limits<int64_t>::max(), "the limit");
}

absl::StatusOr<v1::Tensor> ReadNpy(const std::string& path, int64_t max_bytes,
                                   absl::string_view limit_name) {
  // The header is read and checked first, then exactly the data it
  // describes: a file that is not .npy (or /dev/zero) costs a few bytes, and
  // one larger than max_bytes is refused before its data is read.
  int raw_fd;
  do {
    raw_fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (raw_fd < 0 && errno == EINTR);
  if (raw_fd < 0) return FileError(errno, "open", path);
  const Fd fd(raw_fd);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return FileError(errno, "read", path);
  if (S_ISDIR(st.st_mode)) return FileError(EISDIR, "read", path);
  // A regular file's size is known up front; a pipe or device is read as it
  // comes, never past what the header asks for.
  const bool sized = S_ISREG(st.st_mode);
  const uint64_t file_size = sized ? static_cast<uint64_t>(st.st_size) : 0;

  std::string head;
  if (absl::Status s = ReadUpTo(fd.get(), kMagicLen + 2, path, &head); !s.ok()) return s;
  if (head.size() < kMagicLen + 2 ||
      absl::string_view(head).substr(0, kMagicLen) != absl::string_view(kMagic, kMagicLen)) {
    return Bad(path, "it does not start with the magic \"\\x93NUMPY\"");
  }
  const int major = static_cast<unsigned char>(head[6]);
  const int minor = static_cast<unsigned char>(head[7]);
  // 3.0 differs from 2.0 only in allowing UTF-8 in the header, which the
  // parser rejects anyway wherever it matters (keys and descr are ASCII).
  if ((major != 1 && major != 2 && major != 3) || minor != 0) {
    return Bad(path, absl::StrCat("unsupported format version ", major, ".", minor,
                                  " (1.0, 2.0 and 3.0 are supported)"));
  }
  const size_t len_bytes = major == 1 ? 2 : 4;
  if (absl::Status s = ReadUpTo(fd.get(), len_bytes, path, &head); !s.ok()) return s;
  if (head.size() < kMagicLen + 2 + len_bytes) {
    return Bad(path, "the file ends inside the header length");
  }
  uint64_t header_len = 0;
  for (size_t i = 0; i < len_bytes; ++i) {
    header_len |= static_cast<uint64_t>(static_cast<unsigned char>(head[8 + i])) << (8 * i);
  }
  const uint64_t header_start = kMagicLen + 2 + len_bytes;
  if (sized && header_len > file_size - std::min(file_size, header_start)) {
    return Bad(path, absl::StrCat("header length ", header_len, " runs past the end of the file (",
                                  file_size, " bytes)"));
  }
  if (header_len > kMaxHeaderLen) {
    return Bad(path, absl::StrCat("header length ", header_len, " is more than ", kMaxHeaderLen,
                                  " bytes (numpy writes a few hundred)"));
  }
  std::string header_text;
  if (absl::Status s = ReadUpTo(fd.get(), header_len, path, &header_text); !s.ok()) return s;
  if (header_text.size() < header_len) {
    return Bad(path, absl::StrCat("header length ", header_len, " runs past the end of the file (",
                                  header_start + header_text.size(), " bytes)"));
  }
  absl::StatusOr<HeaderParser::Header> header = HeaderParser(header_text).Parse();
  if (!header.ok()) return Bad(path, header.status().message());

  Element element;
  int64_t item_size;
  const std::string& descr = header->descr;
  if (descr == "<f4") {
    element = Element::kF32;
    item_size = 4;
  } else if (descr == "<f2") {
    element = Element::kF16;
    item_size = 2;
  } else if (descr == "<f8") {
    element = Element::kF64;
    item_size = 8;
  } else if (descr == "<u2" || descr == "|V2") {
    element = Element::kBF16Bits;
    item_size = 2;
  } else if (!descr.empty() && descr[0] == '>') {
    return Bad(path, absl::StrCat("big-endian dtype '", descr,
                                  "' is not supported (save it with a '<' dtype)"));
  } else {
    return Bad(path, absl::StrCat("unsupported dtype '", descr,
                                  "' (supported: '<f4', '<f2', '<f8', and bf16 bits as '<u2' "
                                  "or '|V2')"));
  }
  if (header->fortran_order) {
    return Bad(path, "Fortran order is not supported (save a C-contiguous array)");
  }

  const std::vector<int64_t>& shape = header->shape;
  // Element count with the byte count (n * 8, the widest element, which
  // also covers the f32 tensor of an f16 file) checked for overflow; a zero
  // dimension makes everything 0 whatever the others are.
  int64_t n = 1;
  bool zero = false;
  for (int64_t d : shape) zero = zero || d == 0;
  if (zero) n = 0;
  for (int64_t d : shape) {
    if (zero) break;
    if (n > std::numeric_limits<int64_t>::max() / 8 / d) {
      return Bad(path, absl::StrCat("shape ", ShapeTuple(shape), " of '", descr,
                                    "' is too large (its byte count overflows 64 bits)"));
    }
    n *= d;
  }
  const uint64_t want = static_cast<uint64_t>(n * item_size);
  // The limit is on the tensor made of it (f16 and f64 become f32), what a
  // request carries; the file's data read to make it is at most twice that
  // (f64), so it is bounded too. (The larger of the two refused a valid f64
  // file whose f32 tensor fits.)
  const int64_t tensor_bytes = n * (element == Element::kBF16Bits ? 2 : 4);
  const int64_t cost = tensor_bytes;
  if (cost > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        path, ": shape ", ShapeTuple(shape), " of '", descr, "' is ", cost,
        element == Element::kF32 || element == Element::kBF16Bits ? " bytes" : " bytes as f32",
        ", more than ", limit_name, " ", max_bytes, "; not read"));
  }
  const uint64_t data_start = header_start + header_len;
  if (sized && file_size - data_start != want) {
    const uint64_t have = file_size - data_start;
    return Bad(path, absl::StrCat(have < want ? "truncated: " : "trailing bytes: ", "shape ",
                                  ShapeTuple(shape), " of '", descr, "' needs ", want,
                                  " data bytes, the file holds ", have));
  }
  std::string contents;
  // One byte more than wanted tells a pipe with trailing bytes apart.
  if (absl::Status s = ReadUpTo(fd.get(), want + 1, path, &contents); !s.ok()) return s;
  if (contents.size() != want) {
    const bool more = contents.size() > want;
    return Bad(path, absl::StrCat(more ? "trailing bytes: " : "truncated: ", "shape ",
                                  ShapeTuple(shape), " of '", descr, "' needs ", want,
                                  " data bytes, the file holds ",
                                  more ? "more" : absl::StrCat(contents.size())));
  }
  const char* data = contents.data();
  if (element == Element::kF32) {
    v1::Tensor t;
    t.set_dtype(v1::DTYPE_F32);
    for (int64_t d : shape) t.add_shape(d);
    t.set_data(data, want);
    return t;
  }
  if (element == Element::kBF16Bits) {
    v1::Tensor t;
    t.set_dtype(v1::DTYPE_BF16);
    for (int64_t d : shape) t.add_shape(d);
    t.set_data(data, want);
    return t;
  }
  std::vector<float> values(static_cast<size_t>(n));
  for (size_t i = 0; i < values.size(); ++i) {
    if (element == Element::kF16) {
      uint16_t h;
      std::memcpy(&h, data + 2 * i, 2);
      values[i] = HalfToFloat(h);
    } else {
      double d;
      std::memcpy(&d, data + 8 * i, 8);
      values[i] = DoubleToFloat(d);
    }
  }
  return MakeF32(shape, values);
}

absl::Status WriteNpy(const std::string& path, const v1::Tensor& tensor) {
  // ToFloats checks the dtype and that the bytes match the shape; its
  // message already names the problem, the file name is added here.
  if (absl::StatusOr<std::vector<float>> check = ToFloats(tensor); !check.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write ", path, ": ", check.status().message()));
  }
  const char* descr = tensor.dtype() == v1::DTYPE_F32 ? "<f4" : "<u2";
  std::string dict = absl::StrCat(
      "{'descr': '", descr, "', 'fortran_order': False, 'shape': ",
      ShapeTuple(std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end())), ", }");
  // Pads with spaces and a final newline so the data starts at a multiple of
  // 64 bytes after a prefix of `prefix` bytes (magic, version, length).
  auto pad = [&dict](size_t prefix) {
    const size_t total = (prefix + dict.size() + 1 + kAlign - 1) / kAlign * kAlign;
    return total - prefix;
  };
  // Version 1.0 has a 16-bit header length; only a shape with thousands of
  // dimensions needs 2.0, which is what numpy falls back to as well.
  const bool v1 = pad(10) <= 0xffff;
  const size_t prefix = v1 ? 10 : 12;
  dict.append(pad(prefix) - dict.size() - 1, ' ');
  dict.push_back('\n');

  std::string head(kMagic, kMagicLen);
  head.push_back(v1 ? 1 : 2);
  head.push_back(0);
  const uint64_t len = dict.size();
  for (size_t i = 0; i < prefix - 8; ++i)
    head.push_back(static_cast<char>((len >> (8 * i)) & 0xff));
  head += dict;

  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return FileError(errno, "create", path);
  const std::string& data = tensor.data();
  bool ok = std::fwrite(head.data(), 1, head.size(), f) == head.size() &&
            std::fwrite(data.data(), 1, data.size(), f) == data.size();
  int err = errno;
  if (std::fclose(f) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    // A partial file would read back as "truncated"; better none at all.
    std::remove(path.c_str());
    return FileError(err, "write", path);
  }
  return absl::OkStatus();
}

}  // namespace ropeattn::client
