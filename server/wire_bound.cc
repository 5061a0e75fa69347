#include "server/wire_bound.h"

#include <algorithm>
#include <climits>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace ropeattn::server {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::io::CodedInputStream;
using google::protobuf::internal::WireFormatLite;

// Generous per-object figures (64-bit libstdc++, protobuf 3.21): a nested
// message object; a std::string; an unknown field's entry (16 bytes in a
// vector that may double) plus its own allocation.
constexpr int64_t kMessageBytes = 512;
constexpr int64_t kStringBytes = 32;
constexpr int64_t kUnknownFieldBytes = 64;
constexpr int kMaxDepth = 100;  // protobuf's default recursion limit

// Bytes a value of `f` takes in memory, in a repeated field.
int64_t ElementBytes(const FieldDescriptor* f) {
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT64:
    case FieldDescriptor::CPPTYPE_UINT64:
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return 8;
    case FieldDescriptor::CPPTYPE_BOOL:
      return 1;
    default:
      return 4;
  }
}

bool Walk(CodedInputStream* in, const Descriptor* type, int depth, int64_t* bound) {
  if (depth > kMaxDepth) return false;
  while (true) {
    const uint32_t tag = in->ReadTag();
    if (tag == 0) return true;  // end of input or of this message's limit
    const int number = WireFormatLite::GetTagFieldNumber(tag);
    const WireFormatLite::WireType wire = WireFormatLite::GetTagWireType(tag);
    const FieldDescriptor* f = type == nullptr ? nullptr : type->FindFieldByNumber(number);
    const bool length_delimited = wire == WireFormatLite::WIRETYPE_LENGTH_DELIMITED;
    if (f != nullptr && f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE && length_delimited) {
      uint32_t length;
      if (!in->ReadVarint32(&length)) return false;
      *bound += kMessageBytes + (f->is_repeated() ? 16 : 0);
      const CodedInputStream::Limit limit = in->PushLimit(static_cast<int>(length));
      if (!Walk(in, f->message_type(), depth + 1, bound)) return false;
      if (in->BytesUntilLimit() != 0) return false;
      in->PopLimit(limit);
      continue;
    }
    if (f != nullptr && f->cpp_type() == FieldDescriptor::CPPTYPE_STRING && length_delimited) {
      uint32_t length;
      if (!in->ReadVarint32(&length) || !in->Skip(static_cast<int>(length))) return false;
      *bound += kStringBytes + length + (f->is_repeated() ? 16 : 0);
      continue;
    }
    if (f != nullptr && f->is_repeated() && f->cpp_type() != FieldDescriptor::CPPTYPE_STRING &&
        f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) {
      // Each element takes at least one wire byte; the array may double.
      const int64_t element = 2 * ElementBytes(f);
      if (length_delimited) {  // packed
        uint32_t length;
        if (!in->ReadVarint32(&length) || !in->Skip(static_cast<int>(length))) return false;
        *bound += element * static_cast<int64_t>(length);
        continue;
      }
      // Unpacked (or, of another wire type, an unknown field's entry).
      *bound += std::max<int64_t>(element, kUnknownFieldBytes);
      if (!WireFormatLite::SkipField(in, tag)) return false;
      continue;
    }
    const int before = in->CurrentPosition();
    if (!WireFormatLite::SkipField(in, tag)) return false;
    const bool expected =
        f != nullptr && wire == WireFormatLite::WireTypeForFieldType(
                                    static_cast<WireFormatLite::FieldType>(f->type()));
    if (!expected) {
      // Unknown (or of a wire type its field does not have): kept as
      // unknown fields; a group's every field is one.
      const int64_t skipped = in->CurrentPosition() - before;
      *bound += kUnknownFieldBytes + (wire == WireFormatLite::WIRETYPE_START_GROUP
                                          ? kUnknownFieldBytes * skipped
                                          : skipped);
    }
  }
}

}  // namespace

std::optional<int64_t> ParsedBytesBound(google::protobuf::io::ZeroCopyInputStream* in,
                                        const Descriptor* type) {
  CodedInputStream coded(in);
  coded.SetTotalBytesLimit(INT32_MAX);
  int64_t bound = kMessageBytes;
  if (!Walk(&coded, type, 0, &bound)) return std::nullopt;
  if (!coded.ConsumedEntireMessage()) return std::nullopt;
  return bound;
}

}  // namespace ropeattn::server
