// How much memory protobuf may allocate to parse a message, bounded from its
// wire bytes before they are parsed (so the cost of parsing is checked before
// the work, like every other cost): repeated numbers widen (a 1-byte varint
// becomes an 8-byte int64, and its array may double its capacity), unknown
// fields are kept one entry each, every nested message is an object.
#ifndef ROPEATTN_SERVER_WIRE_BOUND_H_
#define ROPEATTN_SERVER_WIRE_BOUND_H_

#include <cstdint>
#include <optional>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/zero_copy_stream.h"

namespace ropeattn::server {

// An upper bound on the bytes protobuf allocates parsing `in` (to its end) as
// a `type`, or nullopt when the bytes are not well-formed wire format (the
// parse then fails on its own, allocating no more than the bound so far).
std::optional<int64_t> ParsedBytesBound(google::protobuf::io::ZeroCopyInputStream* in,
                                        const google::protobuf::Descriptor* type);

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_WIRE_BOUND_H_
