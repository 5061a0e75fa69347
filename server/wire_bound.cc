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
// A string longer than this (protobuf 3.21's kSafeStringSize) is read from
// a chunked stream by appending, so its capacity may double past its length.
constexpr int64_t kSafeStringSize = 50'000'000;

// A string's (or an unknown length-delimited field's) bytes of `length`.
int64_t StringBytes(int64_t length) {
  return kStringBytes + (length > kSafeStringSize ? 2 * length : length);
}

// Wire bytes of one element of a packed fixed-width field, 0 for varints.
int FixedWireBytes(const FieldDescriptor* f) {
  switch (f->type()) {
    case FieldDescriptor::TYPE_FIXED64:
    case FieldDescriptor::TYPE_SFIXED64:
    case FieldDescriptor::TYPE_DOUBLE:
      return 8;
    case FieldDescriptor::TYPE_FIXED32:
    case FieldDescriptor::TYPE_SFIXED32:
    case FieldDescriptor::TYPE_FLOAT:
      return 4;
    default:
      return 0;
  }
}

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
      *bound += StringBytes(length) + (f->is_repeated() ? 16 : 0);
      continue;
    }
    const bool own_wire =
        f != nullptr && wire == WireFormatLite::WireTypeForFieldType(
                                    static_cast<WireFormatLite::FieldType>(f->type()));
    if (f != nullptr && f->is_repeated() && f->cpp_type() != FieldDescriptor::CPPTYPE_STRING &&
        f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE && (length_delimited || own_wire)) {
      // The array may double its capacity as it grows.
      const int64_t element = 2 * ElementBytes(f);
      if (length_delimited) {  // packed: a varint takes at least one wire byte
        uint32_t length;
        if (!in->ReadVarint32(&length) || !in->Skip(static_cast<int>(length))) return false;
        const int fixed = FixedWireBytes(f);
        *bound += element * (fixed > 0 ? static_cast<int64_t>(length) / fixed + 1
                                       : static_cast<int64_t>(length));
        continue;
      }
      *bound += element;  // unpacked, its own wire type
      if (!WireFormatLite::SkipField(in, tag)) return false;
      continue;
    }
    const int before = in->CurrentPosition();
    if (!WireFormatLite::SkipField(in, tag)) return false;
    if (!own_wire) {
      // Unknown (or of a wire type its field does not have, a group on a
      // number field included): kept as unknown fields; a group's every
      // field is one, and every nested group a field set of its own.
      const int64_t skipped = in->CurrentPosition() - before;
      *bound += kUnknownFieldBytes + (wire == WireFormatLite::WIRETYPE_START_GROUP
                                          ? 2 * kUnknownFieldBytes * skipped
                                          : StringBytes(skipped));
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
