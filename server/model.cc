#include "server/model.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "absl/utility/utility.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"
#include "server/param_limits.h"

// Views of F32/BF16 weights point straight into the file, whose bytes are
// little-endian by the safetensors spec.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors views need a little-endian host");

namespace ropeattn::server {
namespace {

using json = nlohmann::json;

// Limits against hostile files. The safetensors reference implementation
// refuses headers above 100 MB; a config.json is a few KB.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
constexpr int64_t kMaxConfigBytes = int64_t{16} << 20;
// Config integers feed shape products (heads * head_dim, ...): capping each at
// 2^31 - 1 keeps every product of two within int64.
constexpr int64_t kMaxConfigInt = std::numeric_limits<int32_t>::max();

// ---------------------------------------------------------------------------
// Files.

std::string JoinPath(absl::string_view dir, absl::string_view file) {
  if (dir.empty() || absl::EndsWith(dir, "/")) return absl::StrCat(dir, file);
  return absl::StrCat(dir, "/", file);
}

absl::Status ErrnoStatus(int err, absl::string_view what, absl::string_view path) {
  const std::string msg = absl::StrCat(what, " ", path, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    case ENOMEM:
      return absl::ResourceExhaustedError(msg);
    // The name itself is unusable (a shard named in an index can be anything
    // without a '/'): a broken checkpoint, not a server fault.
    case ENAMETOOLONG:
    case ELOOP:
    case EISDIR:
    case EINVAL:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::InternalError(msg);
  }
}

bool FileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// A whole file mapped read-only while a model loads. The mapping outlives the
// fd (closed at once); the weights a model uses are copied out of it, and it
// is unmapped when loading ends.
class MappedFile {
 public:
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path,
                                                          std::string display_name) {
    // O_NONBLOCK: opening a FIFO for reading would wait for a writer (and
    // start-up with it); it is refused below as not a regular file.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return ErrnoStatus(errno, "cannot open", path);
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      return ErrnoStatus(err, "cannot stat", path);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat(display_name, ": not a regular file"));
    }
    auto file = std::unique_ptr<MappedFile>(new MappedFile());
    file->name_ = std::move(display_name);
    file->size_ = static_cast<size_t>(st.st_size);
    if (file->size_ > 0) {
      void* addr = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (addr == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        return ErrnoStatus(err, "cannot mmap", path);
      }
      file->data_ = static_cast<const uint8_t*>(addr);
    }
    ::close(fd);
    return file;
  }

  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& name() const { return name_; }  // as shown in messages
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  MappedFile() = default;
  std::string name_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, absl::string_view display) {
  // O_NONBLOCK: a FIFO would block the open (and start-up) until a writer
  // came; only a regular file is read.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(display, " not found: ", path));
    return ErrnoStatus(errno, "cannot open", path);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(display, ": not a regular file: ", path));
  }
  std::string out;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return ErrnoStatus(err, "cannot read", path);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (static_cast<int64_t>(out.size()) > kMaxConfigBytes) {
      ::close(fd);
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: larger than %d bytes", display, kMaxConfigBytes));
    }
  }
  ::close(fd);
  return out;
}

// A short rendering of a JSON value for messages (hostile files can hold
// megabytes in one value).
// Appends value's JSON to out, nested values past `depth` levels as [...] or
// {...}, stopping once out holds more than `budget` characters: a value
// nested 100,000 deep (json::dump recurses once per level) or megabytes long
// is named in a few dozen characters, never by walking all of it.
void BriefInto(const json& value, int depth, size_t budget, std::string* out) {
  if (out->size() > budget) return;
  if (!value.is_structured()) {
    std::string s = value.dump();
    out->append(s.size() > budget ? s.substr(0, budget + 1) : s);
    return;
  }
  const bool object = value.is_object();
  if (depth == 0) {
    out->append(value.empty() ? (object ? "{}" : "[]") : (object ? "{...}" : "[...]"));
    return;
  }
  out->push_back(object ? '{' : '[');
  bool first = true;
  for (auto it = value.begin(); it != value.end() && out->size() <= budget; ++it) {
    if (!first) out->push_back(',');
    first = false;
    if (object) absl::StrAppend(out, json(it.key()).dump(), ":");
    BriefInto(*it, depth - 1, budget, out);
  }
  out->push_back(object ? '}' : ']');
}

std::string Brief(const json& value) {
  std::string s;
  BriefInto(value, /*depth=*/4, /*budget=*/64, &s);
  if (s.size() > 64) s = absl::StrCat(s.substr(0, 61), "...");
  return s;
}

// Deeper nesting is refused before parsing: the parser builds every level
// first (a header of 30 million '[' took 2.2 GB and 20 s before it failed).
// Real files nest 3 (safetensors) to about 5 (config.json) levels.
constexpr int kMaxJsonDepth = 64;

// Whether arrays and objects in `text` nest deeper than kMaxJsonDepth
// (brackets inside strings do not count).
bool NestsTooDeep(absl::string_view text) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}

// What ParseJson does with a key an object gives twice. json keeps the
// last, as Python's json module does (config.json, the shard index). A
// safetensors header is read as the reference loader (serde) reads it: a
// field given twice in a tensor's entry is refused (two readers could take
// different dtypes or offsets), a tensor named twice too (its first entry's
// bytes are left unclaimed), and a __metadata__ key given twice keeps the
// last (a string-to-string map).
enum class DuplicateKeys { kLastWins, kSafetensorsHeader };

absl::StatusOr<json> ParseJson(absl::string_view text, absl::string_view file,
                               absl::string_view what,
                               DuplicateKeys duplicates = DuplicateKeys::kLastWins) {
  std::set<std::string> top_keys, entry_keys;
  std::string top_key, duplicate, duplicate_in;
  // Depth 1: the header's keys; depth 2: the keys of the object under one.
  const json::parser_callback_t check = [&](int depth, json::parse_event_t event,
                                            json& parsed) {
    if (event == json::parse_event_t::object_start && depth == 1) entry_keys.clear();
    if (event != json::parse_event_t::key || !duplicate.empty()) return true;
    const std::string& key = parsed.get_ref<const std::string&>();
    if (depth == 1) {
      top_key = key;
      if (!top_keys.insert(key).second) duplicate = key;
    } else if (depth == 2 && top_key != "__metadata__" && !entry_keys.insert(key).second) {
      duplicate = key;
      duplicate_in = top_key;
    }
    return true;
  };
  // JSON never holds a raw NUL (in a string it is written \u0000), but the
  // parser stops at one: "<json>\0garbage" would parse as <json>. A
  // safetensors header is padded with spaces only.
  if (const size_t nul = text.find('\0'); nul != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": invalid JSON",
                                                   what.empty() ? "" : " in ", what,
                                                   ": a NUL byte at offset ", nul));
  }
  if (NestsTooDeep(text)) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": invalid JSON",
                                                   what.empty() ? "" : " in ", what,
                                                   ": arrays and objects nest deeper than ",
                                                   kMaxJsonDepth, " levels"));
  }
  try {
    // in_place: json's implicit conversions make plain `return` ambiguous.
    absl::StatusOr<json> out(
        absl::in_place,
        json::parse(text.begin(), text.end(),
                    duplicates == DuplicateKeys::kSafetensorsHeader ? check
                                                                    : json::parser_callback_t()));
    if (!duplicate_in.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          file, ": ", what, ": tensor ", duplicate_in, " gives field ", Brief(json(duplicate)),
          " twice (the safetensors format allows each field once)"));
    }
    if (!duplicate.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          file, ": ", what.empty() ? "the top level" : what, " gives key ",
          Brief(json(duplicate)), " twice"));
    }
    return out;
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": invalid JSON", what.empty() ? "" : " in ", what, ": ", e.what()));
  }
}

// ---------------------------------------------------------------------------
// config.json.

// Reads typed keys of one JSON object; `prefix` ("rope_scaling.") makes
// messages name the full key. Absent keys read as std::nullopt; a null one
// is refused by the typed reads unless the caller gives it a meaning
// (`null_ok`). Find/Has treat null as absent.
class KeyReader {
 public:
  KeyReader(const json& obj, absl::string_view file, absl::string_view prefix)
      : obj_(obj), file_(file), prefix_(prefix) {}

  const json* Find(absl::string_view key) const {
    auto it = obj_.find(std::string(key));
    if (it == obj_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  bool Has(absl::string_view key) const { return Find(key) != nullptr; }
  // The key is written, possibly as null (null is "None" in transformers,
  // which differs from absent where the default is not None).
  bool Present(absl::string_view key) const { return obj_.contains(std::string(key)); }
  const std::string& prefix() const { return prefix_; }
  absl::string_view file() const { return file_; }

  // "FILE: key PREFIX.KEY", as messages name a key.
  std::string Name(absl::string_view key) const {
    return absl::StrCat(file_, ": key ", prefix_, key);
  }
  absl::Status Error(absl::string_view key, absl::string_view problem) const {
    return absl::InvalidArgumentError(absl::StrCat(file_, ": key ", prefix_, key, " ", problem));
  }
  absl::Status TypeError(absl::string_view key, absl::string_view expected, const json& got) const {
    return Error(key, absl::StrCat("must be ", expected, ", got ", Brief(got)));
  }

  // A positive integer (at most 2^31 - 1). Floats such as 64.0 are refused:
  // no real config writes them, and accepting them would hide a typo.
  //
  // null is Python's None. Every typed read refuses it (INVALID_ARGUMENT
  // naming the key: transformers carries None into the model, which fails
  // or computes something else than the default) unless the caller passes
  // `null_ok`, where the family's transformers code gives None a meaning;
  // the caller then reads std::nullopt and follows that meaning
  // (docs/checkpoints.md lists the keys).
  absl::StatusOr<std::optional<int64_t>> PositiveInt(absl::string_view key,
                                                     bool null_ok = false) const {
    RA_ASSIGN_OR_RETURN(const json* v, Value(key, null_ok));
    if (v == nullptr) return std::nullopt;
    if (!v->is_number_integer()) return TypeError(key, "a positive integer", *v);
    if (v->is_number_unsigned()) {
      const uint64_t u = v->get<uint64_t>();
      if (u == 0 || u > static_cast<uint64_t>(kMaxConfigInt)) {
        return TypeError(key, absl::StrCat("a positive integer <= ", kMaxConfigInt), *v);
      }
      return static_cast<int64_t>(u);
    }
    return TypeError(key, "a positive integer", *v);
  }
  // The first of `keys` written (aliases such as hidden_size / n_embd); a
  // null one is refused, not skipped.
  absl::StatusOr<std::optional<int64_t>> PositiveIntOf(
      std::initializer_list<absl::string_view> keys) const {
    for (absl::string_view key : keys) {
      if (Present(key)) return PositiveInt(key);
    }
    return std::nullopt;
  }
  absl::StatusOr<int64_t> RequiredPositiveInt(std::initializer_list<absl::string_view> keys) const {
    RA_ASSIGN_OR_RETURN(std::optional<int64_t> v, PositiveIntOf(keys));
    if (!v.has_value()) {
      std::vector<std::string> full;
      for (absl::string_view k : keys) full.push_back(absl::StrCat(prefix_, k));
      return absl::InvalidArgumentError(absl::StrCat(file_, ": key ", absl::StrJoin(full, " (or "),
                                                     keys.size() > 1 ? ")" : "", " is missing"));
    }
    return *v;
  }
  // An integer >= 0 (at most 2^31 - 1).
  absl::StatusOr<std::optional<int64_t>> NonNegativeInt(absl::string_view key,
                                                        bool null_ok = false) const {
    RA_ASSIGN_OR_RETURN(const json* v, Value(key, null_ok));
    if (v == nullptr) return std::nullopt;
    if (v->is_number_unsigned() && v->get<uint64_t>() <= static_cast<uint64_t>(kMaxConfigInt)) {
      return static_cast<int64_t>(v->get<uint64_t>());
    }
    return TypeError(key, absl::StrCat("an integer in [0, ", kMaxConfigInt, "]"), *v);
  }
  absl::StatusOr<std::optional<double>> Number(absl::string_view key, bool null_ok = false) const {
    RA_ASSIGN_OR_RETURN(const json* v, Value(key, null_ok));
    if (v == nullptr) return std::nullopt;
    if (!v->is_number()) return TypeError(key, "a number", *v);
    return v->get<double>();
  }
  absl::StatusOr<std::optional<std::string>> String(absl::string_view key,
                                                    bool null_ok = false) const {
    RA_ASSIGN_OR_RETURN(const json* v, Value(key, null_ok));
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) return TypeError(key, "a string", *v);
    return v->get<std::string>();
  }
  // A flag. `null_ok`: None is falsy wherever transformers tests the flag
  // (`if config.x`, `nn.Linear(bias=None)`), so null reads as false, not as
  // the default.
  absl::StatusOr<std::optional<bool>> Bool(absl::string_view key, bool null_ok = false) const {
    RA_ASSIGN_OR_RETURN(const json* v, Value(key, null_ok));
    if (v == nullptr) {
      if (Present(key)) return false;
      return std::nullopt;
    }
    if (!v->is_boolean()) return TypeError(key, "true or false", *v);
    return v->get<bool>();
  }
  // The refusal of a null the caller checks itself.
  absl::Status NullError(absl::string_view key) const {
    return Error(key, "is null: transformers has no None meaning for it (None is carried into "
                      "the model, which fails); write a value or leave the key out");
  }
  // Whether the key is written as null.
  bool IsNull(absl::string_view key) const { return Present(key) && !Has(key); }
  absl::StatusOr<std::optional<std::vector<double>>> NumberArray(absl::string_view key,
                                                                 bool null_ok = false) const {
    RA_ASSIGN_OR_RETURN(const json* v, Value(key, null_ok));
    if (v == nullptr) return std::nullopt;
    if (!v->is_array()) return TypeError(key, "an array of numbers", *v);
    std::vector<double> out;
    out.reserve(v->size());
    for (size_t i = 0; i < v->size(); ++i) {
      if (!(*v)[i].is_number()) {
        return Error(
            key, absl::StrCat("must be an array of numbers, element ", i, " is ", Brief((*v)[i])));
      }
      out.push_back((*v)[i].get<double>());
    }
    return out;
  }

 private:
  // The key's value: nullptr when absent, or null and `null_ok`; a null
  // otherwise is refused.
  absl::StatusOr<const json*> Value(absl::string_view key, bool null_ok) const {
    auto it = obj_.find(std::string(key));
    if (it == obj_.end()) return nullptr;
    if (it->is_null()) {
      if (null_ok) return nullptr;
      return NullError(key);
    }
    return &*it;
  }

  const json& obj_;
  absl::string_view file_;
  std::string prefix_;
};

// The architecture table (docs/checkpoints.md): every model_type served, and
// the defaults its transformers config class gives keys a config.json omits.
struct FamilyRow {
  Family family;
  const char* name;
  std::vector<const char*> model_types;
  int64_t default_head_dim;      // 0: hidden_size / num_heads
  int64_t default_kv_heads;      // 0: num_attention_heads
  double default_theta;          // rope_theta when absent
  int64_t default_max_positions;  // max_position_embeddings (GPT-J: n_positions) when absent
  bool reads_head_dim;           // false: head_dim is always hidden / heads
  bool reads_kv_heads;           // false: no GQA (num_key_value_heads not read)
  // head_dim: null is hidden / heads: the config class fills None (Llama,
  // Mistral) or the attention reads `getattr(config, "head_dim", None) or
  // ...` (Mixtral). The others that read it without a default take
  // `getattr(config, "head_dim", hidden // heads)`, which returns the None a
  // config.json null sets, and fail (`None ** -0.5`).
  bool head_dim_null_is_hidden_over_heads;
};

const std::vector<FamilyRow>& Families() {
  static const auto* rows = new std::vector<FamilyRow>{
      {Family::kLlama, "Llama", {"llama"}, 0, 0, 10000.0, 2048, true, true, true},
      {Family::kMistral, "Mistral", {"mistral"}, 0, 8, 10000.0, 131072, true, true, true},
      // MixtralConfig: Mistral's attention, its own defaults (rope_theta 1e6,
      // sliding_window None).
      {Family::kMistral, "Mixtral", {"mixtral"}, 0, 8, 1000000.0, 131072, true, true, true},
      {Family::kQwen2, "Qwen2", {"qwen2"}, 0, 32, 10000.0, 32768, true, true, false},
      {Family::kQwen2, "Qwen2-MoE", {"qwen2_moe"}, 0, 16, 10000.0, 32768, true, true, false},
      {Family::kQwen3, "Qwen3", {"qwen3"}, 128, 32, 10000.0, 32768, true, true, false},
      {Family::kQwen3, "Qwen3-MoE", {"qwen3_moe"}, 0, 4, 10000.0, 32768, true, true, false},
      {Family::kGemma, "Gemma", {"gemma"}, 256, 16, 10000.0, 8192, true, true, false},
      {Family::kGemma2, "Gemma 2", {"gemma2"}, 256, 4, 10000.0, 8192, true, true, false},
      {Family::kGemma3, "Gemma 3", {"gemma3_text"}, 256, 4, 1000000.0, 131072, true, true,
       false},
      {Family::kPhi3, "Phi-3", {"phi3"}, 0, 0, 10000.0, 4096, true, true, false},
      {Family::kGptNeoX, "GPT-NeoX", {"gpt_neox"}, 0, 0, 10000.0, 2048, false, false, false},
      {Family::kGptJ, "GPT-J", {"gptj"}, 0, 0, 10000.0, 2048, false, false, false},
      {Family::kBert, "BERT", {"bert"}, 0, 0, 10000.0, 512, false, false, false},
  };
  return *rows;
}

std::string SupportedModelTypes() {
  std::vector<std::string> names;
  for (const FamilyRow& row : Families()) {
    for (const char* t : row.model_types) names.push_back(t);
  }
  return absl::StrJoin(names, ", ");
}

const FamilyRow* FindFamily(absl::string_view model_type) {
  for (const FamilyRow& row : Families()) {
    for (const char* t : row.model_types) {
      if (model_type == t) return &row;
    }
  }
  return nullptr;
}

absl::Status Refuse(absl::string_view file, absl::string_view key, const json& value,
                    absl::string_view why) {
  return absl::UnimplementedError(
      absl::StrCat(file, ": key ", key, " = ", Brief(value), " is not supported: ", why));
}

// rotary_dim from a fraction of head_dim exactly as transformers computes
// it, int(head_dim * factor): the double product truncated, so 100 * 0.29 =
// 28.999999999999996 gives 28, as Python does. 0 (head_dim 8, factor 0.1)
// means no channel rotates: transformers' inv_freq is empty and
// apply_rotary_pos_emb rotates q[..., :0], so the layer is attention without
// RoPE (ResolveRope's caller drops the RoPE; core's rotary_dim 0 would rotate
// the whole head).
absl::StatusOr<int64_t> RotaryDimFromFraction(const KeyReader& r, absl::string_view key,
                                              double fraction, int64_t head_dim, Family family) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    return r.Error(key, absl::StrFormat("must be in [0, 1], got %g", fraction));
  }
  const int64_t dim = static_cast<int64_t>(static_cast<double>(head_dim) * fraction);
  if (dim == 0) return 0;
  if (dim % 2 != 0) {
    // transformers' Phi-3 (and current GPT-NeoX, where older versions fail)
    // rotate dim + 1 channels at frequencies base^(-2i/dim): a rotation this
    // server's RoPE does not compute.
    return absl::UnimplementedError(absl::StrFormat(
        "%s is not supported: it gives an odd rotary_dim %d (int(head_dim %d * %.17g)), with "
        "which transformers rotates %d channels at frequencies base^(-2i/%d)",
        r.Name(key), dim, head_dim, fraction, dim + 1, dim));
  }
  return dim;
}

// The rule a RoPE block names under `key`, as transformers reads it: only a
// rule transformers has (RopeRule::in_transformers), by its own name, and
// Phi3Config's rewrite of "su" and "yarn" to longrope (older versions under
// `type`, current ones under `rope_type` too). A rule this server computes
// only for requests (ntk, "su" outside Phi-3) is UNIMPLEMENTED: transformers
// fails on it (ROPE_INIT_FUNCTIONS has no such key), so serving it would
// compute what no transformers model does.
absl::StatusOr<RopeScalingType> ConfigRopeRule(const KeyReader& s, absl::string_view key,
                                               absl::string_view name,
                                               const ModelConfig& config) {
  if (name == "mrope") {
    // Qwen2-VL's multimodal sections rotate 3-D positions: not a 1-D rule.
    return absl::UnimplementedError(
        absl::StrCat(s.Name(key), " \"mrope\" (multimodal RoPE) is not supported"));
  }
  const bool phi3 = config.family == Family::kPhi3;
  if (phi3 && (name == "su" || name == "yarn")) return RopeScalingType::kLongRope;
  std::vector<std::string> known;
  for (const RopeRule& rule : RopeRules()) {
    if (!rule.in_transformers) continue;
    if (name == rule.name) return rule.type;
    known.push_back(rule.name);
  }
  if (phi3) known.push_back("su and yarn (read as longrope)");
  const std::string expected = absl::StrCat("transformers' rules: ", absl::StrJoin(known, ", "));
  if (ParseRopeScalingType(name).ok()) {
    return Refuse(s.file(), absl::StrCat(s.prefix(), key), json(std::string(name)),
                  absl::StrCat("transformers has no such rule for ", config.model_type,
                               " (its rotary embedding fails on it); ", expected));
  }
  return s.Error(key, absl::StrCat("is not a known RoPE rule: \"", name, "\"; ", expected));
}

// A RoPE block naming its rule twice, as "rope_type" and the legacy "type"
// with different values. transformers 4's config classes of these families
// copy `type` over `rope_type` (BC) and compute `type`; transformers 5's
// standardize_rope_params keeps `rope_type`: no one answer. MistralConfig,
// MixtralConfig, GemmaConfig and Gemma2Config in 4 do not touch the block and
// their rotary embedding reads `rope_type` first, as 5 does; Phi3Config in
// 4 loads only a block of exactly type, short_factor and long_factor, so
// only 5 reads one with both keys; GPT-J reads no scaling (refused apart).
absl::Status CheckRuleKeysAgree(const KeyReader& s, const ModelConfig& config) {
  switch (config.family) {
    case Family::kLlama:
    case Family::kQwen2:
    case Family::kQwen3:
    case Family::kGptNeoX:
    case Family::kGemma3:
      break;
    default:
      return absl::OkStatus();
  }
  const json* rope_type = s.Find("rope_type");
  const json* type = s.Find("type");
  if (rope_type == nullptr || type == nullptr || !rope_type->is_string() || !type->is_string() ||
      *rope_type == *type) {
    return absl::OkStatus();
  }
  return absl::UnimplementedError(absl::StrFormat(
      "%s: keys %srope_type = \"%s\" and %stype = \"%s\" disagree: transformers 4's %s config "
      "copies type over rope_type and computes \"%s\", transformers 5 keeps rope_type and "
      "computes \"%s\"; give the rule once",
      s.file(), s.prefix(), absl::CHexEscape(rope_type->get<std::string>()).substr(0, 64),
      s.prefix(), absl::CHexEscape(type->get<std::string>()).substr(0, 64), config.model_type,
      absl::CHexEscape(type->get<std::string>()).substr(0, 64),
      absl::CHexEscape(rope_type->get<std::string>()).substr(0, 64)));
}

// Values transformers computes to finite frequencies that this server's RoPE
// (ValidateRopeConfig) refuses: UNIMPLEMENTED naming the key and value, not
// INVALID_ARGUMENT. Those transformers turns into NaN, infinities or an
// error (a base <= 0, a factor of 0, a beta <= 0) stay invalid.
absl::Status RefuseUncomputedRope(const RopeConfig& rope, absl::string_view file,
                                  absl::string_view theta_key, absl::string_view block_name) {
  const RopeScaling& sc = rope.scaling;
  auto refuse = [&](absl::string_view key, double value, absl::string_view why) {
    return absl::UnimplementedError(absl::StrFormat(
        "%s: key %s = %g is not supported: %s", file, key, value, why));
  };
  if (rope.theta > 0.0 && rope.theta <= 1.0) {
    return refuse(theta_key, rope.theta,
                  "transformers computes a RoPE base in (0, 1] (frequencies base^(-2i/d) of 1 "
                  "and above), this server's RoPE needs a base > 1");
  }
  const std::string prefix = absl::StrCat(block_name, ".");
  const bool factor_divides = sc.type == RopeScalingType::kLinear ||
                              sc.type == RopeScalingType::kYarn ||
                              sc.type == RopeScalingType::kLlama3;
  if (factor_divides && std::isfinite(sc.factor) && sc.factor < 0.0) {
    return refuse(absl::StrCat(prefix, "factor"), sc.factor,
                  "transformers divides the frequencies by a negative factor (they turn the "
                  "other way), this server's RoPE needs a factor > 0");
  }
  if ((sc.type == RopeScalingType::kYarn || sc.type == RopeScalingType::kLongRope) &&
      sc.attention_factor.has_value() && std::isfinite(*sc.attention_factor) &&
      *sc.attention_factor <= 0.0) {
    return refuse(absl::StrCat(prefix, "attention_factor"), *sc.attention_factor,
                  "transformers multiplies cos and sin by it, this server's RoPE needs an "
                  "attention_factor > 0");
  }
  if (sc.type == RopeScalingType::kLlama3) {
    for (const auto& [key, value] : {std::pair<const char*, double>{"low_freq_factor",
                                                                    sc.low_freq_factor},
                                     {"high_freq_factor", sc.high_freq_factor}}) {
      if (std::isfinite(value) && value < 0.0) {
        return refuse(absl::StrCat(prefix, key), value,
                      "transformers' llama3 rule computes with a negative wavelength bound, "
                      "this server's RoPE needs it > 0");
      }
    }
  }
  if (sc.type == RopeScalingType::kLongRope) {
    for (const auto& [key, list] :
         {std::pair<const char*, const std::vector<double>*>{"short_factor", &sc.short_factor},
          {"long_factor", &sc.long_factor}}) {
      for (size_t i = 0; i < list->size(); ++i) {
        const double v = (*list)[i];
        if (std::isfinite(v) && v < 0.0) {
          return refuse(absl::StrFormat("%s%s[%d]", prefix, key, i), v,
                        "transformers divides the frequencies by a negative factor, this "
                        "server's RoPE needs every factor > 0");
        }
      }
    }
  }
  return absl::OkStatus();
}

// One RoPE from `top` (the config) and a scaling block (`block`, may be null,
// named `block_name` in messages). The base is the block's rope_theta, else
// the top-level `top_theta_key` (Gemma 3's sliding layers:
// rope_local_base_freq), else `theta_default`. rotary_dim 0 in the result
// means that no channel rotates (a fraction of head_dim truncated to 0,
// RotaryDimFromFraction): the caller serves the layer without RoPE, and the
// base and rule, which transformers then computes nothing with, are not
// validated. Every other result has rotary_dim > 0.
absl::StatusOr<RopeConfig> ResolveRope(const KeyReader& top, const ModelConfig& config,
                                       absl::string_view file, const json* block,
                                       absl::string_view block_name, double theta_default,
                                       absl::string_view top_theta_key = "rope_theta") {
  RopeConfig rope;
  rope.head_dim = config.head_dim;
  const Family family = config.family;

  if (block != nullptr && !block->is_object()) {
    return top.TypeError(block_name, "an object", *block);
  }
  static const json kEmpty = json::object();
  const KeyReader s(block != nullptr ? *block : kEmpty, file, absl::StrCat(block_name, "."));

  // Base: rope_theta (inside the block in newer transformers), else the top
  // level's, else the family's default. GPT-NeoX names it rotary_emb_base
  // and never reads a top-level rope_theta (GPTNeoXConfig).
  RA_ASSIGN_OR_RETURN(std::optional<double> theta, s.Number("rope_theta", /*null_ok=*/true));
  // The key the base came from, for messages.
  std::string theta_key = absl::StrCat(s.prefix(), "rope_theta");
  // A null base in the block is None in transformers 5 (setdefault keeps
  // it), which fails; GPT-J never reads it.
  if (block != nullptr && family != Family::kGptJ && s.Present("rope_theta") &&
      !s.Has("rope_theta")) {
    return s.Error("rope_theta", "is null: transformers has no None meaning for the RoPE base "
                                 "(None is carried into the layer, which fails); write a value "
                                 "or leave the key out");
  }
  if (family == Family::kGptNeoX) {
    // transformers 4's GPT-NeoX rotates with rotary_emb_base (default 10000)
    // and never reads the block's rope_theta; transformers 5 takes the
    // block's when it has one: refused unless they agree.
    RA_ASSIGN_OR_RETURN(std::optional<double> base, top.Number("rotary_emb_base"));
    const double effective_base = base.value_or(theta_default);
    if (theta.has_value() && *theta != effective_base) {
      return absl::UnimplementedError(absl::StrFormat(
          "%s: keys %srope_theta = %g and rotary_emb_base = %g%s disagree: transformers 4's "
          "GPT-NeoX rotates with rotary_emb_base, transformers 5 with the block's rope_theta",
          file, s.prefix(), *theta, effective_base, base.has_value() ? "" : " (its default)"));
    }
    theta = effective_base;
    theta_key = "rotary_emb_base";
  } else if (!theta.has_value()) {
    // A null top-level base was refused with the class default in its
    // message (ParseModelConfig), except GPT-J's, which is never read.
    RA_ASSIGN_OR_RETURN(theta, top.Number(top_theta_key, /*null_ok=*/true));
    theta_key = std::string(top_theta_key);
  }
  rope.theta = theta.value_or(theta_default);

  // Partial rotary and pair layout: GPT-J rotates interleaved pairs of its
  // first rotary_dim (default 64) channels; GPT-NeoX the first rotary_pct
  // (default 0.25) of each head, half-split.
  rope.layout = family == Family::kGptJ ? RopeLayout::kInterleaved : RopeLayout::kHalfSplit;
  rope.rotary_dim = config.head_dim;
  // GPT-J never reads a partial_rotary_factor (null included).
  const bool partial_unread = family == Family::kGptJ;
  RA_ASSIGN_OR_RETURN(std::optional<double> partial,
                      s.Number("partial_rotary_factor", partial_unread));
  RA_ASSIGN_OR_RETURN(std::optional<double> top_partial,
                      top.Number("partial_rotary_factor", partial_unread));
  const KeyReader* partial_reader = &s;
  if (partial.has_value() && top_partial.has_value() && *partial != *top_partial) {
    // transformers 5 moves the top-level value into the block when building
    // the config (the block's wins) and again when building the rotary
    // embedding (the top level's wins): no single answer to compute.
    return absl::UnimplementedError(absl::StrFormat(
        "%s: keys %spartial_rotary_factor = %g and partial_rotary_factor = %g disagree: "
        "transformers reads one or the other depending on where it looks",
        file, s.prefix(), *partial, *top_partial));
  }
  if (!partial.has_value()) {
    partial = top_partial;
    partial_reader = &top;
  }
  if (family == Family::kGptNeoX) {
    RA_ASSIGN_OR_RETURN(std::optional<double> rotary_pct, top.Number("rotary_pct"));
    const double pct = rotary_pct.value_or(0.25);
    const bool from_block = s.Has("partial_rotary_factor");
    if (partial.has_value() && *partial != pct) {
      // GPTNeoXConfig rotates rotary_pct (default 0.25); transformers before
      // 5 overwrote a top-level partial_rotary_factor with it and never read
      // the block's, 5 lets either win when it builds the rotary embedding.
      // (A block's and a top-level one that differ were refused above.)
      return absl::UnimplementedError(absl::StrFormat(
          "%s: key %spartial_rotary_factor = %g disagrees with GPT-NeoX's rotary_pct = %g%s: "
          "transformers versions differ in which one they rotate",
          file, from_block ? s.prefix() : "", *partial, pct,
          rotary_pct.has_value() ? "" : " (its default)"));
    }
    if (!from_block) partial = pct;
    RA_ASSIGN_OR_RETURN(rope.rotary_dim,
                        RotaryDimFromFraction(from_block ? s : top,
                                              from_block ? "partial_rotary_factor" : "rotary_pct",
                                              *partial, config.head_dim, family));
  } else if (family == Family::kGptJ) {
    RA_ASSIGN_OR_RETURN(std::optional<int64_t> rotary_dim, top.PositiveInt("rotary_dim", /*null_ok=*/true));
    // An explicit null rotates the whole head; absent means 64.
    if (!rotary_dim.has_value() && top.Present("rotary_dim") && config.num_heads > 1) {
      // transformers' GPT-J then builds cos/sin as wide as the hidden size
      // and fails to multiply them with a head.
      return top.Error("rotary_dim",
                       absl::StrFormat("is null with %d heads: transformers' GPT-J rotates "
                                       "hidden_size channels then, which fails unless there is "
                                       "one head",
                                       config.num_heads));
    }
    const int64_t dim = rotary_dim.value_or(top.Present("rotary_dim") ? config.head_dim : 64);
    if (dim > config.head_dim || dim % 2 != 0) {
      return top.Error("rotary_dim", absl::StrFormat("must be even and <= head_dim (%d), got %d",
                                                     config.head_dim, dim));
    }
    rope.rotary_dim = dim;
  } else if (partial.has_value()) {
    if (family != Family::kPhi3 && *partial != 1.0) {
      // Llama-style attention rotates the whole head: transformers builds
      // cos/sin for the fraction and then fails to apply them.
      return absl::UnimplementedError(absl::StrFormat(
          "%s: key partial_rotary_factor = %g is not supported: transformers' %s attention "
          "rotates the whole head (only phi3, gpt_neox and gptj rotate part of it)",
          file, *partial, config.model_type));
    }
    RA_ASSIGN_OR_RETURN(
        rope.rotary_dim,
        RotaryDimFromFraction(*partial_reader, "partial_rotary_factor", *partial, config.head_dim,
                              family));
  }

  // Scaling rule. Gemma 3's blocks are merged for transformers 5 and
  // compared with transformers 4's rope_scaling in ResolveGemma3Rope.
  RopeScaling& sc = rope.scaling;
  if (family != Family::kGemma3) RA_RETURN_IF_ERROR(CheckRuleKeysAgree(s, config));
  RA_ASSIGN_OR_RETURN(std::optional<std::string> type_name, s.String("rope_type"));
  absl::string_view type_key = "rope_type";
  if (!type_name.has_value()) {
    RA_ASSIGN_OR_RETURN(type_name, s.String("type"));
    type_key = "type";
  }
  if (type_name.has_value()) {
    RA_ASSIGN_OR_RETURN(sc.type, ConfigRopeRule(s, type_key, *type_name, config));
  } else if (s.Has("factor")) {
    // A factor without a rule is ambiguous (linear? dynamic?): refuse it.
    return s.Error("rope_type", "is missing (a factor is given but no rule)");
  }

  // Every rule but default reads the factor; None fails in them
  // (`inv_freq / None`, `get_mscale(None)`).
  RA_ASSIGN_OR_RETURN(std::optional<double> factor, s.Number("factor", /*null_ok=*/true));
  if (sc.type != RopeScalingType::kDefault && s.IsNull("factor")) return s.NullError("factor");
  // The trained length. Phi3Config always has a top-level one (default
  // 4096), so a Phi-3 block's is never read. Elsewhere transformers 5's
  // standardize_rope_params writes a top-level one over the block's (and
  // fills an absent one from max_position_embeddings), while transformers 4
  // read the block's for yarn (else max_position_embeddings) and llama3
  // (else failed) and only the top level for longrope (else
  // max_position_embeddings): where the two give different lengths the
  // config is refused.
  // A top-level null is refused only where a rule reads the key (yarn,
  // llama3, longrope); LlamaConfig never reads it, Phi3Config only for
  // longrope.
  RA_ASSIGN_OR_RETURN(std::optional<int64_t> l0,
                      top.PositiveInt("original_max_position_embeddings", /*null_ok=*/true));
  if (top.IsNull("original_max_position_embeddings") &&
      (sc.type == RopeScalingType::kYarn || sc.type == RopeScalingType::kLlama3 ||
       sc.type == RopeScalingType::kLongRope)) {
    return top.NullError("original_max_position_embeddings");
  }
  if (!l0.has_value() && family == Family::kPhi3) {
    l0 = 4096;
  } else if (family != Family::kPhi3) {
    const bool yarn_or_llama3 =
        sc.type == RopeScalingType::kYarn || sc.type == RopeScalingType::kLlama3;
    std::optional<int64_t> block_l0;
    if (!l0.has_value() || yarn_or_llama3) {
      RA_ASSIGN_OR_RETURN(block_l0,
                          s.PositiveInt("original_max_position_embeddings", /*null_ok=*/true));
      if ((yarn_or_llama3 || sc.type == RopeScalingType::kLongRope) &&
          s.IsNull("original_max_position_embeddings")) {
        return s.NullError("original_max_position_embeddings");
      }
    }
    if (yarn_or_llama3 && l0.has_value() && block_l0.has_value() && *l0 != *block_l0) {
      return absl::UnimplementedError(absl::StrFormat(
          "%s: keys original_max_position_embeddings = %d and "
          "%soriginal_max_position_embeddings = %d disagree: transformers 4's %s reads the "
          "block's, transformers 5 writes the top-level one over it",
          file, *l0, s.prefix(), *block_l0, RopeScalingTypeName(sc.type)));
    }
    if (sc.type == RopeScalingType::kYarn && l0.has_value() && !block_l0.has_value() &&
        *l0 != config.max_positions) {
      return absl::UnimplementedError(absl::StrFormat(
          "%s: key original_max_position_embeddings = %d differs from "
          "max_position_embeddings = %d, which transformers 4's yarn uses when %s has no "
          "original_max_position_embeddings (transformers 5 uses the top-level key)",
          file, *l0, config.max_positions, block_name));
    }
    if (sc.type == RopeScalingType::kLongRope && !l0.has_value() && block_l0.has_value() &&
        *block_l0 != config.max_positions) {
      return absl::UnimplementedError(absl::StrFormat(
          "%s: key %soriginal_max_position_embeddings = %d differs from "
          "max_position_embeddings = %d: transformers 4's longrope reads only a top-level "
          "original_max_position_embeddings (else max_position_embeddings), transformers 5 "
          "the block's",
          file, s.prefix(), *block_l0, config.max_positions));
    }
    if (!l0.has_value()) l0 = block_l0;
  }
  // What the rule needs and how transformers fills it in (core registry).
  const RopeRule& rule = RopeRuleOf(sc.type);
  if (sc.type == RopeScalingType::kDynamicNtk) {
    // transformers' dynamic NTK scales from max_position_embeddings and never
    // reads original_max_position_embeddings (block or top level).
    l0 = config.max_positions;
  } else if (rule.original_defaults_to_max_positions && !l0.has_value()) {
    // transformers takes the trained length from max_position_embeddings
    // when the scaling block does not give it.
    l0 = config.max_positions;
  }
  if (rule.factor_defaults_to_extension && !factor.has_value() && l0.has_value()) {
    // Without a factor, transformers extends from L0 to max_position_embeddings.
    factor = static_cast<double>(config.max_positions) / static_cast<double>(*l0);
  }
  if (rule.needs_factor && !factor.has_value()) {
    return s.Error("factor", "is missing (required by this rule)");
  }
  if (sc.type == RopeScalingType::kLlama3 && !l0.has_value()) {
    // transformers 4 indexes the block's key (a KeyError when absent),
    // transformers 5 fills it from max_position_embeddings: no one answer.
    return absl::UnimplementedError(absl::StrFormat(
        "%s: key %soriginal_max_position_embeddings is absent (at the top level too), which "
        "llama3 scaling needs: transformers 4 fails without it, transformers 5 takes "
        "max_position_embeddings (%d); write it",
        file, s.prefix(), config.max_positions));
  }
  if (factor.has_value()) sc.factor = *factor;
  if (l0.has_value()) sc.original_max_positions = *l0;

  // transformers: `rope_scaling.get("beta_fast") or 32`, so 0 and null mean
  // the default.
  RA_ASSIGN_OR_RETURN(std::optional<double> beta_fast, s.Number("beta_fast", /*null_ok=*/true));
  RA_ASSIGN_OR_RETURN(std::optional<double> beta_slow, s.Number("beta_slow", /*null_ok=*/true));
  if (beta_fast.has_value() && *beta_fast != 0.0) sc.beta_fast = *beta_fast;
  if (beta_slow.has_value() && *beta_slow != 0.0) sc.beta_slow = *beta_slow;
  if (sc.type == RopeScalingType::kYarn) {
    // truncate: false keeps the correction range's bounds fractional; so
    // does null (`if truncate:` on `get("truncate", True)`, None).
    RA_ASSIGN_OR_RETURN(std::optional<bool> truncate, s.Bool("truncate", /*null_ok=*/true));
    sc.truncate = truncate.value_or(true);
  }
  // Read with `.get(...)`: None is the absent default.
  RA_ASSIGN_OR_RETURN(sc.attention_factor, s.Number("attention_factor", /*null_ok=*/true));
  RA_ASSIGN_OR_RETURN(sc.mscale, s.Number("mscale", /*null_ok=*/true));
  RA_ASSIGN_OR_RETURN(sc.mscale_all_dim, s.Number("mscale_all_dim", /*null_ok=*/true));
  // Read only by the rules that index them (a null there fails).
  RA_ASSIGN_OR_RETURN(std::optional<std::vector<double>> short_factor,
                      s.NumberArray("short_factor", /*null_ok=*/true));
  RA_ASSIGN_OR_RETURN(std::optional<std::vector<double>> long_factor,
                      s.NumberArray("long_factor", /*null_ok=*/true));
  if (sc.type == RopeScalingType::kLongRope) {
    for (const char* key : {"short_factor", "long_factor"}) {
      if (s.IsNull(key)) return s.NullError(key);
    }
  }
  if (short_factor.has_value()) sc.short_factor = std::move(*short_factor);
  if (long_factor.has_value()) sc.long_factor = std::move(*long_factor);
  RA_ASSIGN_OR_RETURN(std::optional<double> low, s.Number("low_freq_factor", /*null_ok=*/true));
  RA_ASSIGN_OR_RETURN(std::optional<double> high, s.Number("high_freq_factor", /*null_ok=*/true));
  if (low.has_value()) sc.low_freq_factor = *low;
  if (high.has_value()) sc.high_freq_factor = *high;
  if (sc.type == RopeScalingType::kLlama3) {
    // transformers indexes these without a default (a KeyError when absent).
    for (const auto& [key, value] : {std::pair<const char*, const std::optional<double>*>{
                                         "low_freq_factor", &low},
                                     {"high_freq_factor", &high}}) {
      if (s.IsNull(key)) return s.NullError(key);
      if (!value->has_value()) {
        return s.Error(key, "is required by rope_type llama3 (transformers has no default)");
      }
    }
  }

  if (rope.rotary_dim == 0) return rope;
  RA_RETURN_IF_ERROR(RefuseUncomputedRope(rope, file, theta_key, block_name));
  if (absl::Status st = ValidateRopeConfig(rope); !st.ok()) {
    // UNIMPLEMENTED (a value transformers computes, but not to one answer)
    // stays so; the rest is invalid.
    if (st.code() == absl::StatusCode::kUnimplemented) {
      return absl::UnimplementedError(
          absl::StrCat(file, ": key ", block_name, ": ", st.message()));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": RoPE settings are invalid: ", st.message()));
  }
  return rope;
}

// Whether two resolved RoPEs rotate alike (every field a rule may read).
bool SameRope(const RopeConfig& a, const RopeConfig& b) {
  const RopeScaling& x = a.scaling;
  const RopeScaling& y = b.scaling;
  return a.head_dim == b.head_dim && a.rotary_dim == b.rotary_dim && a.theta == b.theta &&
         a.layout == b.layout && x.type == y.type && x.factor == y.factor &&
         x.original_max_positions == y.original_max_positions && x.beta_fast == y.beta_fast &&
         x.beta_slow == y.beta_slow && x.truncate == y.truncate &&
         x.attention_factor == y.attention_factor && x.mscale == y.mscale &&
         x.mscale_all_dim == y.mscale_all_dim && x.short_factor == y.short_factor &&
         x.long_factor == y.long_factor && x.max_position_embeddings == y.max_position_embeddings &&
         x.low_freq_factor == y.low_freq_factor && x.high_freq_factor == y.high_freq_factor;
}

// Gemma 3's two RoPEs (global layers: config.rope; sliding: config.local_rope).
// transformers 4 (Gemma3TextConfig): global = rope_theta (default 1e6) with
// rope_scaling; sliding = rope_local_base_freq (default 10000), default rule;
// rope_parameters is not read. transformers 5: rope_parameters keyed by
// layer type (default {"rope_type": "default"} each); rope_scaling updates
// the full_attention block; a block without rope_theta takes rope_theta
// (full) or rope_local_base_freq (sliding), else those defaults. What the two
// compute alike is served; where a key both read is overridden differently
// the config is refused naming the keys.
absl::Status ResolveGemma3Rope(const KeyReader& top, ModelConfig& config,
                               absl::string_view file) {
  const json* params = top.Find("rope_parameters");
  const json* scaling = top.Find("rope_scaling");
  if (params != nullptr && !params->is_object()) {
    return top.TypeError("rope_parameters", "an object", *params);
  }
  if (scaling != nullptr && !scaling->is_object()) {
    return top.TypeError("rope_scaling", "an object", *scaling);
  }
  const bool keyed = params != nullptr && (params->contains("full_attention") ||
                                           params->contains("sliding_attention"));
  if (params != nullptr && !params->empty() && !keyed) {
    // transformers 4 never reads it; 5 reads only the per-layer-type blocks
    // (a flat one is ignored, or fails in 5.0): nothing computes it as given.
    return Refuse(file, "rope_parameters", *params,
                  "transformers' Gemma 3 reads rope_parameters only keyed by layer type "
                  "(full_attention, sliding_attention)");
  }
  static const json kNoBlocks = json::object();
  const KeyReader p(keyed ? *params : kNoBlocks, file, "rope_parameters.");
  const json* full = keyed ? p.Find("full_attention") : nullptr;
  const json* sliding = keyed ? p.Find("sliding_attention") : nullptr;
  for (const auto& [name, b] : {std::pair<const char*, const json*>{"full_attention", full},
                                {"sliding_attention", sliding}}) {
    // A null block is None where transformers 5 expects a dict.
    if (p.IsNull(name)) return p.NullError(name);
    if (b != nullptr && !b->is_object()) return p.TypeError(name, "an object", *b);
  }
  const bool scaling_given = scaling != nullptr && !scaling->empty();
  if (scaling != nullptr) {
    RA_RETURN_IF_ERROR(CheckRuleKeysAgree(KeyReader(*scaling, file, "rope_scaling."), config));
  }
  if (keyed && scaling != nullptr && full == nullptr) {
    return absl::UnimplementedError(absl::StrCat(
        file, ": keys rope_scaling and rope_parameters (keyed by layer type, without "
              "full_attention) are not supported together: transformers 5 fails on them, "
              "transformers 4 reads rope_scaling only"));
  }
  // A block's rope_theta overrides a top-level key transformers 4 reads.
  const auto theta_clash = [&](const json* b, absl::string_view block_name,
                               absl::string_view top_key) -> absl::Status {
    if (b == nullptr) return absl::OkStatus();
    const KeyReader r(*b, file, absl::StrCat("rope_parameters.", block_name, "."));
    RA_ASSIGN_OR_RETURN(std::optional<double> block_theta, r.Number("rope_theta"));
    RA_ASSIGN_OR_RETURN(std::optional<double> top_theta, top.Number(top_key));
    if (block_theta.has_value() && top_theta.has_value() && *block_theta != *top_theta) {
      return absl::UnimplementedError(absl::StrFormat(
          "%s: keys rope_parameters.%s.rope_theta = %g and %s = %g disagree: transformers 4's "
          "Gemma 3 rotates its %s layers with %s, transformers 5 with the block's",
          file, block_name, *block_theta, top_key, *top_theta,
          block_name == "full_attention" ? "global" : "sliding", top_key));
    }
    return absl::OkStatus();
  };
  RA_RETURN_IF_ERROR(theta_clash(full, "full_attention", "rope_theta"));
  RA_RETURN_IF_ERROR(theta_clash(sliding, "sliding_attention", "rope_local_base_freq"));

  // Global layers as transformers 5 builds them: the full_attention block
  // (or {"rope_type": "default"}) updated with rope_scaling.
  json merged = full != nullptr ? *full : json{{"rope_type", "default"}};
  if (scaling != nullptr) merged.update(*scaling);
  const std::string global_name =
      !keyed ? std::string("rope_scaling")
             : scaling_given ? std::string("rope_parameters.full_attention (updated with rope_scaling)")
                             : std::string("rope_parameters.full_attention");
  RA_ASSIGN_OR_RETURN(config.rope,
                      ResolveRope(top, config, file, &merged, global_name, 1000000.0));
  if (scaling_given) {
    // transformers 4 reads rope_scaling alone (and a legacy "type" key,
    // which 5's merged block, already "default", does not take).
    absl::StatusOr<RopeConfig> four =
        ResolveRope(top, config, file, scaling, "rope_scaling", 1000000.0);
    if (!four.ok() || !SameRope(*four, *config.rope)) {
      return absl::UnimplementedError(absl::StrCat(
          file, ": key rope_scaling", keyed ? " with rope_parameters.full_attention" : "",
          " gives Gemma 3's global layers a RoPE transformers 4 and 5 compute differently: 4 "
          "reads rope_scaling alone (\"type\" or \"rope_type\"), 5 updates ",
          keyed ? "the full_attention block" : "{\"rope_type\": \"default\"}",
          " with it; give the rule as rope_scaling.rope_type",
          keyed ? " and keep the other keys in one place" : ""));
    }
  }
  // Sliding layers.
  if (sliding != nullptr) {
    RA_ASSIGN_OR_RETURN(config.local_rope,
                        ResolveRope(top, config, file, sliding,
                                    "rope_parameters.sliding_attention", 10000.0,
                                    "rope_local_base_freq"));
  } else {
    RA_ASSIGN_OR_RETURN(std::optional<double> local_base, top.Number("rope_local_base_freq"));
    RopeConfig local = *config.rope;
    local.theta = local_base.value_or(10000.0);
    local.scaling = RopeScaling{};
    RA_RETURN_IF_ERROR(RefuseUncomputedRope(local, file, "rope_local_base_freq", ""));
    if (absl::Status st = ValidateRopeConfig(local); !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          file, ": key rope_local_base_freq gives invalid RoPE settings: ", st.message()));
    }
    config.local_rope = local;
  }
  return absl::OkStatus();
}

// The sliding window as the family's config class resolves it: a key given
// as null means none; absent takes the class default (`absent_default`, 0
// for None).
absl::StatusOr<int64_t> WindowKey(const KeyReader& top, int64_t absent_default) {
  if (!top.Present("sliding_window")) return absent_default;
  RA_ASSIGN_OR_RETURN(std::optional<int64_t> w, top.PositiveInt("sliding_window", /*null_ok=*/true));
  return w.value_or(0);
}

// Which layers slide, per family (docs/checkpoints.md), and their window.
absl::Status ResolveLayers(const KeyReader& top, ModelConfig& c) {
  c.layers.assign(static_cast<size_t>(c.num_layers), LayerAttention{});
  int64_t window = 0;
  bool reads_layer_types = true;  // whether the family's transformers code reads layer_types
  std::vector<bool> sliding(static_cast<size_t>(c.num_layers), false);
  switch (c.family) {
    case Family::kMistral: {
      RA_ASSIGN_OR_RETURN(window, WindowKey(top, c.model_type == "mistral" ? 4096 : 0));
      sliding.assign(sliding.size(), true);
      reads_layer_types = false;  // MistralConfig warns and ignores it
      break;
    }
    case Family::kPhi3: {
      RA_ASSIGN_OR_RETURN(window, WindowKey(top, 0));
      sliding.assign(sliding.size(), true);
      reads_layer_types = false;  // Phi3Config has no such key
      break;
    }
    case Family::kQwen2:
    case Family::kQwen3: {
      RA_ASSIGN_OR_RETURN(std::optional<bool> use, top.Bool("use_sliding_window", /*null_ok=*/true));
      if (use.value_or(false)) {
        RA_ASSIGN_OR_RETURN(window, WindowKey(top, 4096));
      }
      if (c.model_type == "qwen3_moe") {
        // Qwen3MoeAttention: the window on every layer, layer_types unread.
        sliding.assign(sliding.size(), true);
        reads_layer_types = false;
        break;
      }
      // Compared with layer indices only when a window is in use (null
      // fails there; Qwen2Config's `sliding_window is not None and ...`
      // never reaches it otherwise).
      RA_ASSIGN_OR_RETURN(std::optional<int64_t> first,
                          top.NonNegativeInt("max_window_layers", /*null_ok=*/true));
      if (window > 0 && top.IsNull("max_window_layers")) {
        return top.NullError("max_window_layers");
      }
      const int64_t bound = first.value_or(28);
      for (int64_t i = 0; i < c.num_layers; ++i) {
        // Qwen2MoeConfig: even layers below max_window_layers; Qwen2 and
        // Qwen3: the layers from max_window_layers on.
        sliding[i] = window > 0 &&
                     (c.model_type == "qwen2_moe" ? i % 2 == 0 && i < bound : i >= bound);
      }
      break;
    }
    case Family::kGemma2: {
      RA_ASSIGN_OR_RETURN(window, WindowKey(top, 4096));
      for (int64_t i = 0; i < c.num_layers; ++i) sliding[i] = (i + 1) % 2 != 0;
      break;
    }
    case Family::kGemma3: {
      RA_ASSIGN_OR_RETURN(window, WindowKey(top, 4096));
      // Read only when no layer_types list is given (Gemma3TextConfig builds
      // the list from it): a null is refused only then.
      RA_ASSIGN_OR_RETURN(std::optional<int64_t> pattern,
                          top.PositiveInt("sliding_window_pattern", /*null_ok=*/true));
      if (top.IsNull("sliding_window_pattern") && !top.Has("layer_types")) {
        return top.NullError("sliding_window_pattern");
      }
      const int64_t n = pattern.value_or(6);
      for (int64_t i = 0; i < c.num_layers; ++i) sliding[i] = (i + 1) % n != 0;
      break;
    }
    default:
      return absl::OkStatus();  // no sliding window in these families
  }
  // An explicit layer_types list wins over the pattern where the family's
  // transformers code reads it; where it does not, a list that asks for
  // other layers than that code computes is refused, not followed or ignored.
  if (const json* types = top.Find("layer_types"); types != nullptr && !types->is_null()) {
    if (!types->is_array() || static_cast<int64_t>(types->size()) != c.num_layers) {
      return top.TypeError("layer_types",
                           absl::StrCat("an array of ", c.num_layers, " strings (one per layer)"),
                           *types);
    }
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const json& t = (*types)[static_cast<size_t>(i)];
      bool slides = false;
      if (t == "full_attention") {
        slides = false;
      } else if (t == "sliding_attention") {
        slides = true;
      } else {
        return Refuse(top.file(), absl::StrCat("layer_types[", i, "]"), t,
                      "only \"full_attention\" and \"sliding_attention\" layers are served");
      }
      if (reads_layer_types) {
        sliding[i] = slides;
      } else if ((slides && window > 0) != (sliding[i] && window > 0)) {
        return Refuse(top.file(), absl::StrCat("layer_types[", i, "]"), t,
                      absl::StrCat("transformers' ", c.model_type,
                                   " code does not read layer_types: it runs every layer ",
                                   window > 0 ? absl::StrCat("with sliding_window ", window)
                                              : std::string("without a window"),
                                   ", which this list contradicts"));
      }
    }
  }
  // A sliding layer without a window: transformers' mask for it
  // (create_sliding_window_causal_mask) raises "Could not find a
  // sliding_window argument"; Gemma 2 and 3 build that mask on every call.
  // Mistral, Phi-3 and Qwen3-MoE run such layers as full attention (their
  // code asks for the sliding mask only when a window is set).
  if (window == 0 && reads_layer_types) {
    const bool gemma = c.family == Family::kGemma2 || c.family == Family::kGemma3;
    for (int64_t i = 0; i < c.num_layers; ++i) {
      if (gemma || sliding[i]) {
        return absl::InvalidArgumentError(absl::StrCat(
            top.file(), ": sliding_window is none, but ",
            gemma ? absl::StrCat("every ", c.model_type, " forward builds a sliding-window mask")
                  : absl::StrCat("layer ", i, " is a sliding_attention layer"),
            ": transformers fails on a sliding-window mask without a window (set "
            "sliding_window",
            gemma ? "" : " and use_sliding_window", ")"));
      }
    }
  }
  for (int64_t i = 0; i < c.num_layers; ++i) {
    LayerAttention& l = c.layers[static_cast<size_t>(i)];
    l.window = sliding[i] ? window : 0;
    // Gemma 3's sliding layers rotate with the local base.
    l.local_rope = c.family == Family::kGemma3 && sliding[i];
  }
  return absl::OkStatus();
}

}  // namespace

const char* FamilyName(Family family) {
  for (const FamilyRow& row : Families()) {
    if (row.family == family) return row.name;
  }
  return "?";
}

const RopeConfig* RopeOfLayer(const ModelConfig& config, int64_t layer) {
  if (layer >= 0 && layer < static_cast<int64_t>(config.layers.size()) &&
      config.layers[static_cast<size_t>(layer)].local_rope && config.local_rope.has_value()) {
    return &*config.local_rope;
  }
  return config.rope.has_value() ? &*config.rope : nullptr;
}

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view config_json,
                                             absl::string_view file_name) {
  RA_ASSIGN_OR_RETURN(json root, ParseJson(config_json, file_name, ""));
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file_name, ": top level must be a JSON object, got ", Brief(root)));
  }
  // Every accessor below checks types first, but nlohmann may still throw
  // (e.g. on a number conversion); no exception leaves this function.
  try {
    const KeyReader top(root, file_name, "");
    ModelConfig config;
    RA_ASSIGN_OR_RETURN(std::optional<std::string> model_type, top.String("model_type"));
    config.model_type = model_type.value_or("");
    config.architecture = config.model_type;
    if (const json* arch = top.Find("architectures"); arch != nullptr) {
      if (!arch->is_array() || (!arch->empty() && !(*arch)[0].is_string())) {
        return top.TypeError("architectures", "an array of strings", *arch);
      }
      if (!arch->empty()) config.architecture = (*arch)[0].get<std::string>();
    }

    // The short names n_embd, n_head, n_layer and n_positions are read only
    // where the transformers config class maps them (attribute_map): GPT-J.
    // Every other served class (LlamaConfig, GPTNeoXConfig, BertConfig, ...)
    // stores them as unread extra attributes and keeps its own default for
    // the long name, which is rarely what the file means: a short name
    // without its long one is refused, naming the key. (An unknown
    // model_type reads both spellings; it is refused below anyway.)
    const FamilyRow* early_row = FindFamily(config.model_type);
    const bool short_names = early_row == nullptr || early_row->family == Family::kGptJ;
    const auto checked_short = [&](absl::string_view long_key,
                                   absl::string_view short_key) -> absl::Status {
      if (short_names || top.Present(long_key) || !top.Present(short_key)) {
        return absl::OkStatus();
      }
      return absl::UnimplementedError(absl::StrCat(
          file_name, ": key ", short_key, " is not supported for model_type \"",
          config.model_type, "\": transformers' ", early_row->name,
          " config does not read it (only GPT-J maps it to ", long_key, ") and would use its "
          "default ", long_key, " instead; write ", long_key));
    };
    const auto alias_int = [&](absl::string_view long_key, absl::string_view short_key)
        -> absl::StatusOr<int64_t> {
      RA_RETURN_IF_ERROR(checked_short(long_key, short_key));
      if (short_names) return top.RequiredPositiveInt({long_key, short_key});
      return top.RequiredPositiveInt({long_key});
    };
    RA_ASSIGN_OR_RETURN(config.hidden_size, alias_int("hidden_size", "n_embd"));
    RA_ASSIGN_OR_RETURN(config.num_heads, alias_int("num_attention_heads", "n_head"));
    RA_ASSIGN_OR_RETURN(config.vocab_size, top.RequiredPositiveInt({"vocab_size"}));
    RA_ASSIGN_OR_RETURN(config.num_layers, alias_int("num_hidden_layers", "n_layer"));
    RA_RETURN_IF_ERROR(checked_short("max_position_embeddings", "n_positions"));
    if (config.num_layers > kMaxLayers) {
      return top.Error(top.Has("num_hidden_layers") ? "num_hidden_layers" : "n_layer",
                       absl::StrFormat("is %d, above the %d layers served", config.num_layers,
                                       kMaxLayers));
    }

    // Exact or refused: only the families whose attention this server
    // computes as transformers does.
    if (!model_type.has_value()) {
      return absl::UnimplementedError(absl::StrCat(
          file_name, ": key model_type is missing, so the attention's math is unknown; served: ",
          SupportedModelTypes()));
    }
    const FamilyRow* row = FindFamily(config.model_type);
    if (row == nullptr) {
      return absl::UnimplementedError(
          absl::StrCat(file_name, ": key model_type = \"", config.model_type.substr(0, 64),
                       "\" is not supported; served: ", SupportedModelTypes()));
    }
    config.family = row->family;
    const Family family = row->family;
    // The trained length, or the config class's default when the file has
    // neither spelling (a null one is refused: transformers would carry None).
    if (top.Present("max_position_embeddings") ||
        (family == Family::kGptJ && top.Present("n_positions"))) {
      RA_ASSIGN_OR_RETURN(config.max_positions,
                          family == Family::kGptJ
                              ? top.RequiredPositiveInt({"max_position_embeddings", "n_positions"})
                              : top.RequiredPositiveInt({"max_position_embeddings"}));
    } else {
      config.max_positions = row->default_max_positions;
    }
    // null is None in transformers. Where the family's config class has a
    // None meaning (sliding_window, attn_logit_softcapping, Llama's
    // num_key_value_heads, Llama's, Mistral's and Mixtral's head_dim, ...)
    // null reads as None below;
    // where its default is not None and nothing maps None back to it,
    // transformers carries None into the layer and fails building or
    // running it (num_heads * None, base ** x, None ** -0.5, x + None), so a
    // null there is refused, as max_position_embeddings: null is, rather
    // than served with the default.
    {
      const bool gemma =
          family == Family::kGemma || family == Family::kGemma2 || family == Family::kGemma3;
      std::vector<std::pair<const char*, std::string>> not_null;
      if (family != Family::kGptNeoX && family != Family::kGptJ && family != Family::kBert) {
        not_null.emplace_back("rope_theta", absl::StrFormat("%g", row->default_theta));
      }
      if (family == Family::kGptNeoX) {
        not_null.emplace_back("rotary_emb_base", "10000");
        not_null.emplace_back("rotary_pct", "0.25");
      }
      if (family == Family::kGemma3) not_null.emplace_back("rope_local_base_freq", "10000");
      if (row->reads_head_dim && !row->head_dim_null_is_hidden_over_heads) {
        not_null.emplace_back("head_dim", row->default_head_dim != 0
                                              ? absl::StrCat(row->default_head_dim)
                                              : "hidden_size / num_attention_heads");
      }
      // Gemma's classes have no None fallback for num_key_value_heads (the
      // others map None to num_attention_heads, as read below).
      if (gemma) not_null.emplace_back("num_key_value_heads", absl::StrCat(row->default_kv_heads));
      if (family == Family::kGemma2 || family == Family::kGemma3) {
        not_null.emplace_back("query_pre_attn_scalar", "256");
      }
      if (family == Family::kQwen3 || family == Family::kGemma3) {
        not_null.emplace_back("rms_norm_eps", "1e-06");
      }
      for (const auto& [key, default_value] : not_null) {
        if (top.Present(key) && !top.Has(key)) {
          return top.Error(key, absl::StrCat(
              "is null: transformers' ", row->name, " config has no None meaning for it (its "
              "default is ", default_value, "; None is carried into the layer, which fails); "
              "write a value or leave the key out"));
        }
      }
    }
    // PretrainedConfig keeps pruned_heads and transformers 4 prunes those
    // heads when it builds the model (BERT; other classes raise): an
    // attention with fewer heads than num_attention_heads says, which this
    // server does not compute. An empty object prunes nothing; null fails
    // (from_dict converts its keys).
    if (top.Present("pruned_heads")) {
      const json& pruned = root.at("pruned_heads");
      if (pruned.is_null()) return top.NullError("pruned_heads");
      if (!pruned.is_object()) return top.TypeError("pruned_heads", "an object", pruned);
      if (!pruned.empty()) {
        return Refuse(file_name, "pruned_heads", pruned,
                      "pruned attention heads are not served (transformers removes them from the "
                      "layers it builds)");
      }
    }
    if (const json* q = top.Find("quantization_config"); q != nullptr) {
      return Refuse(file_name, "quantization_config", *q,
                    "quantized weights are not served (F32, BF16 and F16 only)");
    }

    int64_t kv = config.num_heads;
    if (row->reads_kv_heads) {
      RA_ASSIGN_OR_RETURN(std::optional<int64_t> kv_heads, top.PositiveInt("num_key_value_heads", /*null_ok=*/true));
      if (kv_heads.has_value()) {
        kv = *kv_heads;
      } else if (row->default_kv_heads != 0 && !top.Present("num_key_value_heads")) {
        kv = row->default_kv_heads;
      }
    }
    config.num_kv_heads = kv;
    if (config.num_heads % config.num_kv_heads != 0) {
      return top.Error("num_key_value_heads",
                       absl::StrFormat("(%d) must divide num_attention_heads (%d)",
                                       config.num_kv_heads, config.num_heads));
    }
    std::optional<int64_t> head_dim;
    if (row->reads_head_dim) {
      RA_ASSIGN_OR_RETURN(head_dim, top.PositiveInt("head_dim", /*null_ok=*/true));
      if (!head_dim.has_value() && row->default_head_dim != 0 && !top.Present("head_dim")) {
        head_dim = row->default_head_dim;
      }
    }
    if (head_dim.has_value()) {
      config.head_dim = *head_dim;
    } else {
      if (config.hidden_size % config.num_heads != 0) {
        return top.Error("num_attention_heads",
                         absl::StrFormat("(%d) must divide hidden_size (%d) when head_dim is not "
                                         "given",
                                         config.num_heads, config.hidden_size));
      }
      config.head_dim = config.hidden_size / config.num_heads;
    }

    // Biases, as each family's attention module builds its projections.
    switch (family) {
      case Family::kQwen2:
      case Family::kGptNeoX:
      case Family::kBert: {
        // Qwen2: q/k/v always; Qwen2-MoE: qkv_bias, default true; GPT-NeoX:
        // attention_bias, default true; BERT: always. A null flag is no bias
        // (nn.Linear(bias=None)).
        RA_ASSIGN_OR_RETURN(std::optional<bool> bias, top.Bool("attention_bias", /*null_ok=*/true));
        RA_ASSIGN_OR_RETURN(std::optional<bool> qkv_bias, top.Bool("qkv_bias", /*null_ok=*/true));
        config.attention_bias = family == Family::kGptNeoX ? bias.value_or(true)
                                : config.model_type == "qwen2_moe" ? qkv_bias.value_or(true)
                                                                   : true;
        break;
      }
      case Family::kMistral:
      case Family::kPhi3:
      case Family::kGptJ:
        config.attention_bias = false;  // the projections have no bias parameter
        break;
      default: {
        RA_ASSIGN_OR_RETURN(std::optional<bool> bias, top.Bool("attention_bias", /*null_ok=*/true));
        config.attention_bias = bias.value_or(false);
        break;
      }
    }

    // The attention's own parameters.
    if (family == Family::kGemma2 || family == Family::kGemma3) {
      RA_ASSIGN_OR_RETURN(std::optional<double> qpas, top.Number("query_pre_attn_scalar"));
      const double scalar = qpas.value_or(256.0);
      // Its logit scale, scalar^-0.5 as transformers computes it (Python's
      // ** is C's pow), within what a request's spec.scale may be: sessions
      // carry the model's scale and softcap through the same checks.
      if (!(scalar > 0.0) || !std::isfinite(scalar) ||
          std::pow(scalar, -0.5) > kMaxLogitScale) {
        return top.Error("query_pre_attn_scalar",
                         absl::StrFormat("must be finite and >= %g (a logit scale of at most "
                                         "%g), got %g",
                                         1.0 / (kMaxLogitScale * kMaxLogitScale), kMaxLogitScale,
                                         scalar));
      }
      config.scale = std::pow(scalar, -0.5);
      RA_ASSIGN_OR_RETURN(std::optional<double> cap, top.Number("attn_logit_softcapping", /*null_ok=*/true));
      if (family == Family::kGemma2 && !cap.has_value() &&
          !top.Present("attn_logit_softcapping")) {
        cap = 50.0;
      }
      if (cap.has_value()) {
        if (!(*cap >= kMinSoftcap) || !std::isfinite(*cap) || *cap > kMaxSoftcap) {
          return top.Error("attn_logit_softcapping",
                           absl::StrFormat("must be in [%g, %g], got %g", kMinSoftcap,
                                           kMaxSoftcap, *cap));
        }
        config.softcap = *cap;
      }
      RA_ASSIGN_OR_RETURN(std::optional<bool> bidirectional,
                          top.Bool("use_bidirectional_attention", /*null_ok=*/true));
      if (bidirectional.value_or(false)) {
        return Refuse(file_name, "use_bidirectional_attention", *top.Find(
                                                                    "use_bidirectional_attention"),
                      "only the causal Gemma decoder is served");
      }
    }
    if (family == Family::kGemma || family == Family::kGemma2 || family == Family::kGemma3) {
      config.embed_scale = std::sqrt(static_cast<double>(config.hidden_size));
    }
    if (family == Family::kQwen3 || family == Family::kGemma3) {
      config.qk_norm = family == Family::kQwen3 ? QkNorm::kRms : QkNorm::kRmsOnePlus;
      RA_ASSIGN_OR_RETURN(std::optional<double> eps, top.Number("rms_norm_eps"));
      config.rms_norm_eps = eps.value_or(1e-6);
      if (!(config.rms_norm_eps > 0.0) || !std::isfinite(config.rms_norm_eps)) {
        return top.Error("rms_norm_eps",
                         absl::StrFormat("must be > 0, got %g", config.rms_norm_eps));
      }
    }

    // Positions.
    if (family == Family::kBert) {
      config.causal = false;
      config.positions = PositionKind::kLearned;
      if (top.IsNull("position_embedding_type")) {
        // transformers 4's BertEmbeddings reads getattr(config,
        // "position_embedding_type", "absolute"), None, and adds no position
        // embeddings; transformers 5 removed the key and always adds them.
        return absl::UnimplementedError(absl::StrCat(
            file_name, ": key position_embedding_type = null is not supported: transformers 4's "
                       "BERT then adds no position embeddings, transformers 5 absolute ones; "
                       "write \"absolute\" or leave the key out"));
      }
      RA_ASSIGN_OR_RETURN(std::optional<std::string> pos_type,
                          top.String("position_embedding_type"));
      if (pos_type.has_value() && *pos_type != "absolute") {
        return absl::UnimplementedError(
            absl::StrCat(file_name, ": key position_embedding_type \"", pos_type->substr(0, 64),
                         "\" is not supported (absolute only)"));
      }
      RA_ASSIGN_OR_RETURN(std::optional<bool> decoder, top.Bool("is_decoder", /*null_ok=*/true));
      if (decoder.value_or(false)) {
        return Refuse(file_name, "is_decoder", *top.Find("is_decoder"),
                      "BERT is served as the bidirectional encoder only");
      }
      RA_ASSIGN_OR_RETURN(std::optional<int64_t> types, top.PositiveInt("type_vocab_size"));
      config.type_vocab_size = types.value_or(2);
      RA_ASSIGN_OR_RETURN(std::optional<double> eps, top.Number("layer_norm_eps"));
      config.layer_norm_eps = eps.value_or(1e-12);
      if (!(config.layer_norm_eps > 0.0) || !std::isfinite(config.layer_norm_eps)) {
        return top.Error("layer_norm_eps",
                         absl::StrFormat("must be > 0, got %g", config.layer_norm_eps));
      }
      config.layers.assign(static_cast<size_t>(config.num_layers), LayerAttention{});
      return config;
    }
    config.positions = PositionKind::kRope;
    // rope_parameters (transformers >= 4.56) is read unless a non-empty
    // rope_scaling is given too: transformers' convert_rope_params_to_dict
    // takes `rope_scaling or rope_parameters`. Gemma 3 has its own rules
    // (ResolveGemma3Rope).
    const json* scaling = top.Find("rope_scaling");
    const bool scaling_given = scaling != nullptr && !(scaling->is_object() && scaling->empty());
    const char* block_key =
        top.Has("rope_parameters") && !scaling_given ? "rope_parameters" : "rope_scaling";
    const json* block = top.Find(block_key);
    if (family == Family::kGemma3) {
      RA_RETURN_IF_ERROR(ResolveGemma3Rope(top, config, file_name));
    } else {
      RA_ASSIGN_OR_RETURN(config.rope, ResolveRope(top, config, file_name, block, block_key,
                                                   row->default_theta));
    }
    if (family == Family::kGptJ) {
      // transformers' GPT-J builds its sinusoids with base 10000 and no
      // scaling whatever the config says: other values are refused.
      if (config.rope->theta != 10000.0) {
        return absl::UnimplementedError(absl::StrFormat(
            "%s: key rope_theta = %g is not supported: transformers' GPT-J rotates with base "
            "10000 and does not read rope_theta",
            file_name, config.rope->theta));
      }
      if (config.rope->scaling.type != RopeScalingType::kDefault) {
        return Refuse(file_name, block_key, *block,
                      "transformers' GPT-J does not read RoPE scaling");
      }
    }
    if (family == Family::kPhi3 && config.rope->scaling.type != RopeScalingType::kDefault &&
        config.rope->scaling.type != RopeScalingType::kLongRope) {
      // Phi3Config raises on any other rule: such a file is no Phi-3 config.
      return absl::InvalidArgumentError(absl::StrCat(
          file_name, ": key ", block_key, " has rope_type \"",
          RopeScalingTypeName(config.rope->scaling.type),
          "\": Phi3Config accepts only default and longrope scaling"));
    }
    if (config.rope->rotary_dim == 0) {
      // No channel rotates (RotaryDimFromFraction): attention without RoPE.
      config.rope.reset();
      config.positions = PositionKind::kNone;
    }
    RA_RETURN_IF_ERROR(ResolveLayers(top, config));
    return config;
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(file_name, ": ", e.what()));
  }
}

// ---------------------------------------------------------------------------
// safetensors.

namespace {

// Bits per element of every safetensors dtype (F4 and F6 pack elements
// below a byte), so that a tensor the model does not use is still
// bounds-checked; only F32, BF16 and F16 load. 0: not a safetensors dtype.
int DtypeBits(absl::string_view dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64" || dtype == "C64") return 64;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 32;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 16;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" ||
      dtype == "F8_E5M2" || dtype == "F8_E8M0") {
    return 8;
  }
  if (dtype == "F6_E2M3" || dtype == "F6_E3M2") return 6;
  if (dtype == "F4") return 4;
  return 0;
}

struct TensorRecord {
  const MappedFile* file = nullptr;
  std::string dtype;
  Dims shape;
  const uint8_t* data = nullptr;
  int64_t num_bytes = 0;
};

using TensorTable = std::map<std::string, TensorRecord, std::less<>>;

uint64_t ReadLittleEndian64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Validates one file's bytes completely (header, every tensor's dtype size,
// shape, bounds and overlap) and adds its tensors to `table`; their records
// point at `file` (null for ParseSafetensors, which maps nothing).
absl::Status IndexSafetensorsBytes(absl::string_view bytes, const std::string& fname,
                                   const MappedFile* file, TensorTable* table) {
  const uint8_t* const data = reinterpret_cast<const uint8_t*>(bytes.data());
  if (bytes.size() < 8) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: file is %d bytes, too short for the 8-byte header length", fname, bytes.size()));
  }
  const uint64_t header_len = ReadLittleEndian64(data);
  const uint64_t room = bytes.size() - 8;
  if (header_len > room) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: header length %d exceeds the file (%d bytes after the length field)",
                        fname, header_len, room));
  }
  if (header_len > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: header length %d is above the %d-byte limit", fname, header_len, kMaxHeaderBytes));
  }
  const absl::string_view header_text(bytes.data() + 8, header_len);
  const uint8_t* buffer = data + 8 + header_len;
  const uint64_t buffer_size = room - header_len;

  RA_ASSIGN_OR_RETURN(json header,
                      ParseJson(header_text, fname, "header", DuplicateKeys::kSafetensorsHeader));
  if (!header.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(fname, ": header must be a JSON object, got ", Brief(header)));
  }

  struct Extent {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Extent> extents;
  try {
    for (auto it = header.begin(); it != header.end(); ++it) {
      const std::string& name = it.key();
      const json& entry = it.value();
      if (name == "__metadata__") {
        // The reference loader reads it as an optional map of strings to
        // strings and refuses anything else.
        if (entry.is_null()) continue;
        if (!entry.is_object()) {
          return absl::InvalidArgumentError(absl::StrCat(
              fname, ": __metadata__ must be an object of strings, got ", Brief(entry)));
        }
        for (auto meta = entry.begin(); meta != entry.end(); ++meta) {
          if (!meta->is_string()) {
            return absl::InvalidArgumentError(
                absl::StrCat(fname, ": __metadata__ key ", Brief(json(meta.key())),
                             " must map to a string, got ", Brief(meta.value())));
          }
        }
        continue;
      }
      auto bad = [&](absl::string_view what) {
        return absl::InvalidArgumentError(
            absl::StrCat(fname, ": tensor ", name, ": ", what, " (entry ", Brief(entry), ")"));
      };
      if (!entry.is_object()) return bad("entry must be an object");
      auto dtype_it = entry.find("dtype");
      auto shape_it = entry.find("shape");
      auto offsets_it = entry.find("data_offsets");
      if (dtype_it == entry.end() || !dtype_it->is_string()) return bad("dtype must be a string");
      if (shape_it == entry.end() || !shape_it->is_array()) return bad("shape must be an array");
      if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
          !(*offsets_it)[0].is_number_unsigned() || !(*offsets_it)[1].is_number_unsigned()) {
        return bad("data_offsets must be [begin, end] with non-negative integers");
      }
      TensorRecord rec;
      rec.file = file;
      rec.dtype = dtype_it->get<std::string>();
      const int bits = DtypeBits(rec.dtype);
      if (bits == 0) return bad(absl::StrCat("unknown dtype ", rec.dtype));
      for (const json& d : *shape_it) {
        if (!d.is_number_unsigned() ||
            d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
          return bad("shape must hold non-negative integers");
        }
        rec.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
      }
      absl::StatusOr<int64_t> n = NumElements(rec.shape);
      if (!n.ok()) return bad(n.status().message());
      const uint64_t begin = (*offsets_it)[0].get<uint64_t>();
      const uint64_t end = (*offsets_it)[1].get<uint64_t>();
      if (begin > end) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: tensor %s has data_offsets [%d, %d] with end before begin", fname,
                            name, begin, end));
      }
      if (end > buffer_size) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: tensor %s has data_offsets [%d, %d] outside the data buffer of %d bytes", fname,
            name, begin, end, buffer_size));
      }
      // As the reference loader: n * bits must be whole bytes, and exactly
      // the span (128-bit products: n < 2^63 and bits <= 64 cannot wrap).
      const uint64_t span = end - begin;
      const unsigned __int128 need_bits =
          static_cast<unsigned __int128>(static_cast<uint64_t>(*n)) * static_cast<unsigned>(bits);
      if (need_bits % 8 != 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: tensor %s: shape %s of %s is not a whole number of bytes", fname, name,
            DimsToString(rec.shape), rec.dtype));
      }
      if (need_bits / 8 != span) {
        const unsigned __int128 need = need_bits / 8;
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: tensor %s spans %d bytes, but shape %s of %s needs %s", fname, name, span,
            DimsToString(rec.shape), rec.dtype,
            need > std::numeric_limits<uint64_t>::max()
                ? std::string("more than 2^64")
                : absl::StrCat(static_cast<uint64_t>(need))));
      }
      rec.data = buffer + begin;
      rec.num_bytes = static_cast<int64_t>(span);
      auto [slot, inserted] = table->emplace(name, std::move(rec));
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat(
            fname, ": tensor ", name, " is also in ",
            slot->second.file != nullptr ? slot->second.file->name() : fname));
      }
      extents.push_back({begin, end, &slot->first});
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(fname, ": header: ", e.what()));
  }

  // The format indexes the whole data buffer: sorted by offsets, each tensor
  // (empty ones too) starts where the one before ends, the first at 0, and
  // the last ends at the buffer's end, as the reference loader checks.
  // Overlapping tensors would alias each other's weights, and bytes no
  // tensor claims are data some other reader may see and this one would not.
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) {
    return std::tie(a.begin, a.end, *a.name) < std::tie(b.begin, b.end, *b.name);
  });
  uint64_t covered = 0;
  for (size_t i = 0; i < extents.size(); ++i) {
    const Extent& e = extents[i];
    if (e.begin < covered) {
      const Extent& prev = extents[i - 1];
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: tensor %s (data_offsets [%d, %d]) overlaps tensor %s ([%d, %d])",
                          fname, *e.name, e.begin, e.end, *prev.name, prev.begin, prev.end));
    }
    if (e.begin > covered) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor %s (data_offsets [%d, %d]) leaves bytes [%d, %d) of the data buffer to no "
          "tensor (%s): the safetensors format allows no holes",
          fname, *e.name, e.begin, e.end, covered, e.begin,
          i == 0 ? std::string("the first tensor must start at 0")
                 : absl::StrCat("after tensor ", *extents[i - 1].name)));
    }
    covered = e.end;
  }
  if (covered != buffer_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the data buffer has %d bytes after the last tensor (bytes [%d, %d)): the "
        "safetensors format allows none",
        fname, buffer_size - covered, covered, buffer_size));
  }
  return absl::OkStatus();
}

absl::Status IndexSafetensors(const MappedFile& file, TensorTable* table) {
  const absl::string_view bytes(reinterpret_cast<const char*>(file.data()), file.size());
  return IndexSafetensorsBytes(bytes, file.name(), &file, table);
}

// Exact binary16 -> binary32 (every f16 value, subnormals, inf and NaN
// included, is representable in f32).
float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {
      // Subnormal: mant * 2^-24, exact in f32.
      const float f = std::ldexp(static_cast<float>(mant), -24);
      std::memcpy(&bits, &f, sizeof(bits));
      bits |= sign;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// Whether `name` is an attention or embedding tensor of some family's
// naming (such a name is never the "closest" stand-in for a missing one).
bool IsLoaderName(absl::string_view name) {
  for (absl::string_view suffix :
       {".self_attn.q_proj.weight", ".self_attn.k_proj.weight", ".self_attn.v_proj.weight",
        ".self_attn.o_proj.weight", ".self_attn.q_proj.bias", ".self_attn.k_proj.bias",
        ".self_attn.v_proj.bias", ".self_attn.o_proj.bias", ".attn.q_proj.weight",
        ".attn.k_proj.weight", ".attn.v_proj.weight", ".attn.out_proj.weight",
        "model.embed_tokens.weight"}) {
    if (absl::EndsWith(name, suffix)) return true;
  }
  return false;
}

// Where the checkpoint's tensors come from, and what is kept alive.
struct WeightSource {
  std::string description;  // "model.safetensors" or the index file name
  std::vector<std::unique_ptr<MappedFile>> files;
  TensorTable table;
};

absl::StatusOr<WeightSource> OpenWeights(const std::string& dir) {
  WeightSource src;
  const std::string single = JoinPath(dir, "model.safetensors");
  const std::string index_path = JoinPath(dir, "model.safetensors.index.json");
  if (FileExists(single)) {
    src.description = "model.safetensors";
    RA_ASSIGN_OR_RETURN(auto file, MappedFile::Open(single, "model.safetensors"));
    RA_RETURN_IF_ERROR(IndexSafetensors(*file, &src.table));
    src.files.push_back(std::move(file));
    return src;
  }
  if (!FileExists(index_path)) {
    return absl::NotFoundError(
        absl::StrCat("neither model.safetensors nor model.safetensors.index.json found in ", dir));
  }
  const std::string index_name = "model.safetensors.index.json";
  src.description = index_name;
  RA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(index_path, index_name));
  RA_ASSIGN_OR_RETURN(json index, ParseJson(text, index_name, ""));
  const json* weight_map = nullptr;
  if (index.is_object()) {
    auto it = index.find("weight_map");
    if (it != index.end() && it->is_object()) weight_map = &*it;
  }
  if (weight_map == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_name, ": key weight_map must be an object of tensor name -> shard"));
  }
  // Each shard is mapped and validated once, however many tensors it holds.
  std::set<std::string> shards;
  for (auto it = weight_map->begin(); it != weight_map->end(); ++it) {
    if (!it.value().is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(index_name, ": tensor ", it.key(), " maps to ",
                                                     Brief(it.value()), ", not a shard file name"));
    }
    const std::string shard = it.value().get<std::string>();
    // Shards live beside the index: a path could make us map any file. A
    // NUL would end the name open() sees, opening another file than named.
    if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos ||
        shard.find('\0') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(index_name, ": tensor ", it.key(),
                                                     " maps to \"", absl::CHexEscape(shard),
                                                     "\", which is not a file name in ", dir));
    }
    if (shards.count(shard) != 0) continue;
    absl::StatusOr<std::unique_ptr<MappedFile>> file =
        MappedFile::Open(JoinPath(dir, shard), shard);
    if (!file.ok()) {
      if (absl::IsNotFound(file.status())) {
        return absl::NotFoundError(absl::StrCat(index_name, ": shard \"", absl::CHexEscape(shard),
                                                "\" (tensor \"", absl::CHexEscape(it.key()),
                                                "\") not found in ", dir));
      }
      return file.status();
    }
    RA_RETURN_IF_ERROR(IndexSafetensors(**file, &src.table));
    shards.insert(shard);
    src.files.push_back(*std::move(file));
  }
  // The index is the authority on where a tensor lives: a disagreement means
  // the shards and the index come from different exports.
  for (auto it = weight_map->begin(); it != weight_map->end(); ++it) {
    const std::string shard = it.value().get<std::string>();
    auto rec = src.table.find(it.key());
    if (rec == src.table.end()) {
      return absl::NotFoundError(absl::StrCat(
          index_name, ": tensor \"", absl::CHexEscape(it.key()), "\" maps to shard \"",
          absl::CHexEscape(shard), "\", which does not contain it"));
    }
    if (rec->second.file->name() != shard) {
      return absl::InvalidArgumentError(absl::StrCat(
          index_name, ": tensor \"", absl::CHexEscape(it.key()), "\" maps to shard \"",
          absl::CHexEscape(shard), "\" but is in \"", absl::CHexEscape(rec->second.file->name()),
          "\""));
    }
  }
  return src;
}

}  // namespace

absl::StatusOr<std::vector<SafetensorsTensor>> ParseSafetensors(absl::string_view bytes,
                                                                 absl::string_view file_name) {
  TensorTable table;
  RA_RETURN_IF_ERROR(IndexSafetensorsBytes(bytes, std::string(file_name), nullptr, &table));
  const uint8_t* const data = reinterpret_cast<const uint8_t*>(bytes.data());
  std::vector<SafetensorsTensor> out;
  out.reserve(table.size());
  for (auto& [name, rec] : table) {
    SafetensorsTensor t;
    t.name = name;
    t.dtype = std::move(rec.dtype);
    t.shape = std::move(rec.shape);
    t.offset = static_cast<uint64_t>(rec.data - data);
    t.num_bytes = rec.num_bytes;
    out.push_back(std::move(t));
  }
  return out;
}

struct Model::Storage {
  // Every weight served: copied or converted from the files, or the demo
  // model's. Tensor buffers do not move when the vector grows.
  std::vector<Tensor> owned;
};

Model::~Model() = default;

namespace {

// Turns checkpoint records into views, checking dtype and shape.
class WeightBinder {
 public:
  // `layer_root` ("model.layers.") and `q_suffix` (".self_attn.q_proj.weight")
  // recognize the family's naming; `family` names it in messages.
  WeightBinder(const TensorTable& table, std::string source_name, std::string layer_root,
               std::string q_suffix, std::string family)
      : table_(table),
        source_name_(std::move(source_name)),
        layer_root_(std::move(layer_root)),
        q_suffix_(std::move(q_suffix)),
        family_(std::move(family)) {}

  // The checkpoint uses the family's naming if any layer has its first
  // projection under the layer root.
  bool KnownNaming() const {
    for (auto it = table_.lower_bound(layer_root_); it != table_.end(); ++it) {
      if (!absl::StartsWith(it->first, layer_root_)) break;
      if (absl::EndsWith(it->first, q_suffix_)) return true;
    }
    return false;
  }
  bool Contains(const std::string& name) const { return table_.count(name) != 0; }
  // The dtype the file stores a tensor in ("" when absent): F16 tensors are
  // widened to F32 at load.
  std::string FileDtype(const std::string& name) const {
    auto it = table_.find(name);
    return it == table_.end() ? std::string() : it->second.dtype;
  }

  absl::Status Missing(const std::string& name) const {
    if (KnownNaming() || table_.empty()) {
      // A checkpoint without any tensor is missing them, whatever its naming.
      return absl::NotFoundError(absl::StrCat(source_name_, ": tensor ", name,
                                              " not found in the checkpoint",
                                              table_.empty() ? " (it holds no tensors)" : ""));
    }
    // Hostile headers can hold millions of names: look at a bounded number.
    constexpr int kMaxCandidates = 100000;
    std::string closest;
    size_t best = std::numeric_limits<size_t>::max();
    int seen = 0;
    for (const auto& [candidate, rec] : table_) {
      if (++seen > kMaxCandidates) break;
      // A name this loader uses itself is never the stand-in we look for.
      if (candidate.size() > 512 || IsLoaderName(candidate)) continue;
      const size_t d = EditDistance(name, candidate);
      if (d < best) best = d, closest = candidate;
    }
    return absl::UnimplementedError(absl::StrCat(
        source_name_, ": tensor naming not supported: expected ", name, " (", family_,
        " naming, as config.json's model_type says), closest name found: ",
        closest.empty() ? "(no tensors)" : closest));
  }

  // A weight that is NaN or Inf would make every answer of the model
  // non-finite (or an error blamed on the caller's inputs): the checkpoint
  // is refused at load, naming the tensor and the element.
  static absl::StatusOr<ConstTensorView> Finite(ConstTensorView v, const std::string& file,
                                                const std::string& name) {
    absl::Status st = CheckFinite(v, name);
    if (st.ok()) return v;
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": tensor ",
        absl::StrReplaceAll(st.message(), {{": inputs must be finite", ""}}),
        ": a checkpoint's weights must be finite"));
  }

  // `why` explains the expected shape in config terms for the message.
  absl::StatusOr<ConstTensorView> Bind(const std::string& name, const Dims& expected,
                                       absl::string_view why, bool optional,
                                       std::vector<Tensor>* owned,
                                       int64_t* resident) const {
    auto it = table_.find(name);
    if (it == table_.end()) {
      // Constructed in place: moving an empty view trips GCC 12's
      // -Wmaybe-uninitialized inside InlinedVector.
      if (optional) return absl::StatusOr<ConstTensorView>(absl::in_place);
      return Missing(name);
    }
    const TensorRecord& rec = it->second;
    const std::string& fname = rec.file->name();
    if (rec.dtype != "F32" && rec.dtype != "BF16" && rec.dtype != "F16") {
      // A valid safetensors dtype (the index refused any other), which
      // transformers may load (upcasting F64, say) but this server does not
      // compute in.
      return absl::UnimplementedError(absl::StrCat(fname, ": tensor ", name, " has dtype ",
                                                   rec.dtype, ", which is not supported "
                                                   "(F32, BF16 and F16 weights are served)"));
    }
    if (rec.shape != expected) {
      return absl::InvalidArgumentError(absl::StrCat(fname, ": tensor ", name, " has shape ",
                                                     DimsToString(rec.shape), ", config expects ",
                                                     DimsToString(expected), " (", why, ")"));
    }
    if (rec.dtype == "F16") {
      RA_ASSIGN_OR_RETURN(Tensor t, Tensor::Create(DType::kF32, expected));
      float* out = t.data<float>();
      for (int64_t i = 0; i < t.num_elements(); ++i) {
        uint16_t h;
        std::memcpy(&h, rec.data + 2 * i, sizeof(h));
        out[i] = HalfToFloat(h);
      }
      *resident += static_cast<int64_t>(t.byte_size());
      owned->push_back(std::move(t));
      return Finite(owned->back().cview(), fname, name);
    }
    // Copied, never served from the file's pages: a file truncated or
    // rewritten in place while the server runs would otherwise kill it with
    // SIGBUS or change its weights behind the finiteness check. The copy is
    // also naturally aligned whatever the header length.
    const DType dtype = rec.dtype == "F32" ? DType::kF32 : DType::kBF16;
    RA_ASSIGN_OR_RETURN(Tensor t, Tensor::Create(dtype, expected));
    std::memcpy(t.data<uint8_t>(), rec.data, static_cast<size_t>(rec.num_bytes));
    *resident += rec.num_bytes;
    owned->push_back(std::move(t));
    return Finite(owned->back().cview(), fname, name);
  }

 private:
  const TensorTable& table_;
  std::string source_name_, layer_root_, q_suffix_, family_;
};

}  // namespace

namespace {

// GPT-NeoX's query_key_value rows are grouped per head as [q(d) k(d) v(d)]:
// q, k and v (and their biases) gathered into owned tensors of the
// weight's dtype. owned: q, k, v weights, then q, k, v biases when given.
struct FusedSplit {
  std::vector<Tensor> owned;
  size_t owned_count = 0;
};
absl::StatusOr<FusedSplit> SplitPerHead(const ConstTensorView& w, const ConstTensorView& b,
                                        int64_t heads, int64_t head_dim) {
  FusedSplit out;
  const int64_t cols = w.dim(1);
  const size_t esize = DTypeSize(w.dtype());
  for (int part = 0; part < 3; ++part) {
    RA_ASSIGN_OR_RETURN(Tensor t, Tensor::Create(w.dtype(), {heads * head_dim, cols}));
    for (int64_t h = 0; h < heads; ++h) {
      const char* src = static_cast<const char*>(w.raw()) +
                        static_cast<size_t>((h * 3 + part) * head_dim * cols) * esize;
      std::memcpy(t.data<char>() + static_cast<size_t>(h * head_dim * cols) * esize, src,
                  static_cast<size_t>(head_dim * cols) * esize);
    }
    out.owned.push_back(std::move(t));
  }
  if (!b.empty_view()) {
    const size_t bsize = DTypeSize(b.dtype());
    for (int part = 0; part < 3; ++part) {
      RA_ASSIGN_OR_RETURN(Tensor t, Tensor::Create(b.dtype(), {heads * head_dim}));
      for (int64_t h = 0; h < heads; ++h) {
        const char* src = static_cast<const char*>(b.raw()) +
                          static_cast<size_t>((h * 3 + part) * head_dim) * bsize;
        std::memcpy(t.data<char>() + static_cast<size_t>(h * head_dim) * bsize, src,
                    static_cast<size_t>(head_dim) * bsize);
      }
      out.owned.push_back(std::move(t));
    }
  }
  out.owned_count = out.owned.size();
  return out;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Model>> Model::Load(const std::string& name,
                                                         const std::string& dir) {
  RA_ASSIGN_OR_RETURN(std::string config_text,
                      ReadSmallFile(JoinPath(dir, "config.json"), "config.json"));
  RA_ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(config_text, "config.json"));
  RA_ASSIGN_OR_RETURN(WeightSource src, OpenWeights(dir));

  std::shared_ptr<Model> model(new Model());
  model->name_ = name;
  model->source_ = dir;
  model->config_ = config;
  model->storage_ = std::make_unique<Storage>();
  std::vector<Tensor>* store = &model->storage_->owned;
  int64_t resident = 0;

  const ModelConfig& c = config;
  // Each size is capped alone; their products could still leave int64 (a
  // fused q/k/v of (heads + 2 kv_heads) * head_dim rows of hidden_size).
  const __int128 projection = static_cast<__int128>(c.num_heads + 2 * c.num_kv_heads) *
                              c.head_dim * std::max<int64_t>(c.hidden_size, 1);
  if (projection > (__int128{1} << 50)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: num_attention_heads %d, num_key_value_heads %d, head_dim %d and hidden_size %d make "
        "q/k/v projections of more than 2^50 weights",
        dir, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size));
  }
  const int64_t q_out = c.num_heads * c.head_dim;
  const int64_t kv_out = c.num_kv_heads * c.head_dim;
  const std::string q_why = absl::StrFormat("num_attention_heads %d * head_dim %d, hidden_size %d",
                                            c.num_heads, c.head_dim, c.hidden_size);
  const std::string kv_why = absl::StrFormat("num_key_value_heads %d * head_dim %d, hidden_size %d",
                                             c.num_kv_heads, c.head_dim, c.hidden_size);
  const std::string o_why = absl::StrFormat("hidden_size %d, num_attention_heads %d * head_dim %d",
                                            c.hidden_size, c.num_heads, c.head_dim);

  // The family's names (model.h lists them).
  std::string embed_name = "model.embed_tokens.weight";
  std::string layer_root = "model.layers.";
  std::string q_suffix = ".self_attn.q_proj.weight";
  std::string bert_prefix;
  switch (c.family) {
    case Family::kPhi3:
      q_suffix = ".self_attn.qkv_proj.weight";
      break;
    case Family::kGptNeoX:
      embed_name = "gpt_neox.embed_in.weight";
      layer_root = "gpt_neox.layers.";
      q_suffix = ".attention.query_key_value.weight";
      break;
    case Family::kGptJ:
      embed_name = "transformer.wte.weight";
      layer_root = "transformer.h.";
      q_suffix = ".attn.q_proj.weight";
      break;
    case Family::kBert:
      // BertModel saves without a prefix; BertFor* heads under "bert.".
      bert_prefix = src.table.count("bert.embeddings.word_embeddings.weight") != 0 ? "bert." : "";
      embed_name = bert_prefix + "embeddings.word_embeddings.weight";
      layer_root = bert_prefix + "encoder.layer.";
      q_suffix = ".attention.self.query.weight";
      break;
    default:
      break;
  }
  const WeightBinder binder(src.table, src.description, layer_root, q_suffix,
                            FamilyName(c.family));
  auto bind = [&](const std::string& tensor, const Dims& dims, absl::string_view why,
                  bool optional) {
    return binder.Bind(tensor, dims, why, optional, store, &resident);
  };
  const std::string hidden_why = absl::StrFormat("hidden_size %d", c.hidden_size);

  model->embed_tokens_f16_ = binder.FileDtype(embed_name) == "F16";
  RA_ASSIGN_OR_RETURN(model->embed_tokens_,
                      bind(embed_name, {c.vocab_size, c.hidden_size},
                           absl::StrFormat("vocab_size %d, hidden_size %d", c.vocab_size,
                                           c.hidden_size),
                           false));
  if (c.family == Family::kBert) {
    const Dims dims = {c.max_positions, c.hidden_size};
    RA_ASSIGN_OR_RETURN(model->position_table_,
                        bind(bert_prefix + "embeddings.position_embeddings.weight", dims,
                             absl::StrFormat("max_position_embeddings %d, hidden_size %d",
                                             c.max_positions, c.hidden_size),
                             false));
    // Token type 0 is what transformers adds when no token_type_ids are given.
    // BertEmbeddings always holds the table ([type_vocab_size, hidden]).
    const std::string tt = bert_prefix + "embeddings.token_type_embeddings.weight";
    RA_ASSIGN_OR_RETURN(ConstTensorView table,
                        bind(tt, {c.type_vocab_size, c.hidden_size},
                             absl::StrFormat("type_vocab_size %d, hidden_size %d",
                                             c.type_vocab_size, c.hidden_size),
                             false));
    model->token_type_row_ = table.Slice(0, 0, 1);
    // Older exports spell the LayerNorm's parameters gamma / beta.
    const std::string ln = bert_prefix + "embeddings.LayerNorm.";
    const bool old_names = src.table.count(ln + "gamma") != 0;
    RA_ASSIGN_OR_RETURN(model->embed_norm_weight_,
                        bind(ln + (old_names ? "gamma" : "weight"), {c.hidden_size}, hidden_why,
                             false));
    RA_ASSIGN_OR_RETURN(model->embed_norm_bias_, bind(ln + (old_names ? "beta" : "bias"),
                                                      {c.hidden_size}, hidden_why, false));
  }

  // Biases each family's projections have (docs/checkpoints.md).
  bool qkv_bias = c.attention_bias, o_bias = false, o_bias_required = false;
  switch (c.family) {
    case Family::kQwen2:
      break;  // q/k/v only
    case Family::kGptNeoX:
    case Family::kBert:
      o_bias = o_bias_required = c.attention_bias;
      break;
    case Family::kMistral:
    case Family::kPhi3:
    case Family::kGptJ:
      qkv_bias = false;
      break;
    default:
      // Llama, Gemma, Qwen3: attention_bias gives o_proj a bias too; one the
      // file lacks reads as zero.
      o_bias = c.attention_bias;
      break;
  }
  // The key that decides the family's biases, as its config class reads it
  // (none: fixed by the architecture).
  const char* bias_key = nullptr;
  switch (c.family) {
    case Family::kQwen2:
      if (c.model_type == "qwen2_moe") bias_key = "qkv_bias";
      break;
    case Family::kBert:
    case Family::kMistral:
    case Family::kPhi3:
    case Family::kGptJ:
      break;
    default:
      bias_key = "attention_bias";
      break;
  }
  const std::string bias_reason =
      bias_key != nullptr ? absl::StrCat(bias_key, " is ", c.attention_bias ? "true" : "false")
                          : std::string("its biases do not depend on config.json");
  // A bias tensor the family's module has no parameter for would be ignored
  // by transformers and used by us: refuse the checkpoint instead.
  auto unexpected = [&](const std::string& tensor) -> absl::Status {
    if (!binder.Contains(tensor)) return absl::OkStatus();
    return absl::UnimplementedError(absl::StrCat(src.description, ": tensor ", tensor,
                                                 " is in the checkpoint, but a ", c.model_type,
                                                 " layer with this config.json has no such bias (",
                                                 bias_reason, "); transformers would ignore it"));
  };

  model->layers_.resize(static_cast<size_t>(c.num_layers));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    LayerWeights& lw = model->layers_[static_cast<size_t>(i)];
    const std::string root = absl::StrCat(layer_root, i);
    // Separate projections: (weight name, bias name) per q, k, v, o.
    std::string names[4];
    std::string bias_names[4];
    switch (c.family) {
      case Family::kPhi3:
      case Family::kGptNeoX: {
        // Fused q/k/v.
        const bool neox = c.family == Family::kGptNeoX;
        const std::string fused =
            root + (neox ? ".attention.query_key_value." : ".self_attn.qkv_proj.");
        const int64_t rows = q_out + 2 * kv_out;
        const std::string why = absl::StrFormat(
            "(num_attention_heads %d + 2 * num_key_value_heads %d) * head_dim %d, hidden_size %d",
            c.num_heads, neox ? c.num_heads : c.num_kv_heads, c.head_dim, c.hidden_size);
        RA_ASSIGN_OR_RETURN(ConstTensorView w, bind(fused + "weight", {rows, c.hidden_size}, why,
                                                    false));
        ConstTensorView b;
        if (qkv_bias) {
          RA_ASSIGN_OR_RETURN(b, bind(fused + "bias", {rows}, "first dimension of the weight",
                                      false));
        } else {
          RA_RETURN_IF_ERROR(unexpected(fused + "bias"));
        }
        if (!neox) {
          // Phi-3: rows [q; k; v], each a contiguous block.
          lw.q_proj = w.Slice(0, 0, q_out);
          lw.k_proj = w.Slice(0, q_out, kv_out);
          lw.v_proj = w.Slice(0, q_out + kv_out, kv_out);
        } else {
          // GPT-NeoX: per head [q(d) k(d) v(d)]; gathered once.
          RA_ASSIGN_OR_RETURN(FusedSplit split, SplitPerHead(w, b, c.num_heads, c.head_dim));
          // The fused copies are not served: only the gathered q/k/v stay.
          // (Erasing moves Tensor handles, never their buffers.)
          for (const ConstTensorView& fused_view : {w, b}) {
            if (fused_view.empty_view()) continue;
            const auto held = std::find_if(store->begin(), store->end(), [&](const Tensor& t) {
              return t.cview().raw() == fused_view.raw();
            });
            if (held == store->end()) continue;
            resident -= static_cast<int64_t>(held->byte_size());
            store->erase(held);
          }
          for (Tensor& t : split.owned) {
            resident += static_cast<int64_t>(t.byte_size());
            store->push_back(std::move(t));
          }
          const size_t base = store->size() - split.owned_count;
          lw.q_proj = (*store)[base + 0].cview();
          lw.k_proj = (*store)[base + 1].cview();
          lw.v_proj = (*store)[base + 2].cview();
          if (!b.empty_view()) {
            lw.q_bias = (*store)[base + 3].cview();
            lw.k_bias = (*store)[base + 4].cview();
            lw.v_bias = (*store)[base + 5].cview();
          }
        }
        if (!neox && !b.empty_view()) {
          lw.q_bias = b.Slice(0, 0, q_out);
          lw.k_bias = b.Slice(0, q_out, kv_out);
          lw.v_bias = b.Slice(0, q_out + kv_out, kv_out);
        }
        names[3] = root + (neox ? ".attention.dense.weight" : ".self_attn.o_proj.weight");
        bias_names[3] = root + (neox ? ".attention.dense.bias" : ".self_attn.o_proj.bias");
        break;
      }
      case Family::kGptJ:
        for (int k = 0; k < 4; ++k) {
          const char* proj[] = {"q_proj", "k_proj", "v_proj", "out_proj"};
          names[k] = absl::StrCat(root, ".attn.", proj[k], ".weight");
          bias_names[k] = absl::StrCat(root, ".attn.", proj[k], ".bias");
        }
        break;
      case Family::kBert:
        for (int k = 0; k < 3; ++k) {
          const char* proj[] = {"query", "key", "value"};
          names[k] = absl::StrCat(root, ".attention.self.", proj[k], ".weight");
          bias_names[k] = absl::StrCat(root, ".attention.self.", proj[k], ".bias");
        }
        names[3] = root + ".attention.output.dense.weight";
        bias_names[3] = root + ".attention.output.dense.bias";
        break;
      default:
        for (int k = 0; k < 4; ++k) {
          const char* proj[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
          names[k] = absl::StrCat(root, ".self_attn.", proj[k], ".weight");
          bias_names[k] = absl::StrCat(root, ".self_attn.", proj[k], ".bias");
        }
        break;
    }
    struct Spec {
      ConstTensorView* weight;
      ConstTensorView* bias;
      Dims dims;
      const std::string* why;
      bool has_bias, bias_required;
    };
    const Spec specs[] = {
        {&lw.q_proj, &lw.q_bias, {q_out, c.hidden_size}, &q_why, qkv_bias, qkv_bias},
        {&lw.k_proj, &lw.k_bias, {kv_out, c.hidden_size}, &kv_why, qkv_bias, qkv_bias},
        {&lw.v_proj, &lw.v_bias, {kv_out, c.hidden_size}, &kv_why, qkv_bias, qkv_bias},
        {&lw.o_proj, &lw.o_bias, {c.hidden_size, q_out}, &o_why, o_bias, o_bias_required},
    };
    for (int k = 0; k < 4; ++k) {
      if (names[k].empty()) continue;  // fused, bound above
      const Spec& s = specs[k];
      RA_ASSIGN_OR_RETURN(*s.weight, bind(names[k], s.dims, *s.why, false));
      if (s.has_bias) {
        RA_ASSIGN_OR_RETURN(*s.bias, bind(bias_names[k], {s.dims[0]},
                                          "first dimension of the weight", !s.bias_required));
      } else {
        RA_RETURN_IF_ERROR(unexpected(bias_names[k]));
      }
    }
    if (c.qk_norm != QkNorm::kNone) {
      const std::string why = absl::StrFormat("head_dim %d", c.head_dim);
      RA_ASSIGN_OR_RETURN(lw.q_norm,
                          bind(root + ".self_attn.q_norm.weight", {c.head_dim}, why, false));
      RA_ASSIGN_OR_RETURN(lw.k_norm,
                          bind(root + ".self_attn.k_norm.weight", {c.head_dim}, why, false));
    }
  }
  model->resident_bytes_ = resident;
  // src's files are unmapped on return: nothing served points into them.
  return std::shared_ptr<const Model>(std::move(model));
}

namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Seeding each tensor from its name keeps a tensor's values stable when
// other tensors are added to the demo.
uint64_t Fnv1a(absl::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char ch : s) h = (h ^ static_cast<uint8_t>(ch)) * 0x100000001b3ull;
  return h;
}

// Uniform in [-scale, scale), deterministic for a given name.
absl::StatusOr<Tensor> SeededTensor(absl::string_view name, const Dims& dims, double scale) {
  RA_ASSIGN_OR_RETURN(Tensor t, Tensor::Create(DType::kF32, dims));
  uint64_t state = Fnv1a(name);
  float* out = t.data<float>();
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    // 53 random bits -> [0, 1) exactly in double, then to [-1, 1).
    const double u = static_cast<double>(SplitMix64(state) >> 11) * 0x1.0p-53;
    out[i] = static_cast<float>((2.0 * u - 1.0) * scale);
  }
  return t;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Model>> Model::Demo(const std::string& name) {
  ModelConfig c;
  c.architecture = "ropeattn-demo";
  c.model_type = "llama";
  c.hidden_size = 128;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.vocab_size = 256;
  c.max_positions = 4096;
  c.num_layers = 2;
  c.positions = PositionKind::kRope;
  RopeConfig rope;
  rope.head_dim = c.head_dim;
  rope.rotary_dim = c.head_dim;
  rope.theta = 500000.0;
  rope.layout = RopeLayout::kHalfSplit;
  rope.scaling.type = RopeScalingType::kLlama3;
  rope.scaling.factor = 8.0;
  rope.scaling.low_freq_factor = 1.0;
  rope.scaling.high_freq_factor = 4.0;
  rope.scaling.original_max_positions = 1024;
  RA_RETURN_IF_ERROR(ValidateRopeConfig(rope));
  c.rope = rope;

  std::shared_ptr<Model> model(new Model());
  model->name_ = name;
  model->source_ = "built-in";
  model->config_ = c;
  model->storage_ = std::make_unique<Storage>();
  Storage* store = model->storage_.get();
  auto add = [&](const std::string& tname, const Dims& dims,
                 double scale) -> absl::StatusOr<ConstTensorView> {
    RA_ASSIGN_OR_RETURN(Tensor t, SeededTensor(tname, dims, scale));
    model->resident_bytes_ += static_cast<int64_t>(t.byte_size());
    store->owned.push_back(std::move(t));
    return store->owned.back().cview();
  };
  // Projections scaled by 1/sqrt(fan_in) keep activations O(1) through a layer.
  const double in_scale = 1.0 / std::sqrt(static_cast<double>(c.hidden_size));
  const double o_scale = 1.0 / std::sqrt(static_cast<double>(c.num_heads * c.head_dim));
  RA_ASSIGN_OR_RETURN(model->embed_tokens_,
                      add("model.embed_tokens.weight", {c.vocab_size, c.hidden_size}, 1.0));
  model->layers_.resize(static_cast<size_t>(c.num_layers));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    LayerWeights& lw = model->layers_[static_cast<size_t>(i)];
    const std::string p = absl::StrCat("model.layers.", i, ".self_attn.");
    const int64_t q_out = c.num_heads * c.head_dim, kv_out = c.num_kv_heads * c.head_dim;
    RA_ASSIGN_OR_RETURN(lw.q_proj, add(p + "q_proj.weight", {q_out, c.hidden_size}, in_scale));
    RA_ASSIGN_OR_RETURN(lw.k_proj, add(p + "k_proj.weight", {kv_out, c.hidden_size}, in_scale));
    RA_ASSIGN_OR_RETURN(lw.v_proj, add(p + "v_proj.weight", {kv_out, c.hidden_size}, in_scale));
    RA_ASSIGN_OR_RETURN(lw.o_proj, add(p + "o_proj.weight", {c.hidden_size, q_out}, o_scale));
  }
  return std::shared_ptr<const Model>(std::move(model));
}

absl::StatusOr<const LayerWeights*> Model::layer(int64_t index) const {
  if (index < 0 || index >= num_layers()) {
    return absl::OutOfRangeError(
        absl::StrFormat("model %s: layer %d is outside [0, %d)", name_, index, num_layers()));
  }
  return &layers_[static_cast<size_t>(index)];
}

absl::Status ModelRegistry::Add(std::shared_ptr<const Model> model) {
  if (model == nullptr) return absl::InvalidArgumentError("cannot register a null model");
  const std::string name = model->name();
  auto [it, inserted] = models_.emplace(name, std::move(model));
  if (!inserted) {
    return absl::AlreadyExistsError(
        absl::StrCat("model ", name, " is already registered (from ", it->second->source(), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Model>> ModelRegistry::Get(absl::string_view name) const {
  auto it = models_.find(name);
  if (it == models_.end()) {
    std::vector<std::string> known;
    for (const auto& [n, m] : models_) known.push_back(n);
    // The name is the caller's: a short prefix, escaped (control bytes and
    // a cut UTF-8 sequence must not reach the status message raw).
    const std::string shown = absl::CHexEscape(name.substr(0, 64));
    return absl::NotFoundError(absl::StrCat("model \"", shown, name.size() > 64 ? "\"..." : "\"",
                                            " not found; known models: ",
                                            known.empty() ? "(none)" : absl::StrJoin(known, ", ")));
  }
  return it->second;
}

std::vector<std::shared_ptr<const Model>> ModelRegistry::List() const {
  std::vector<std::shared_ptr<const Model>> out;
  out.reserve(models_.size());
  for (const auto& [n, m] : models_) out.push_back(m);
  return out;
}

}  // namespace ropeattn::server
