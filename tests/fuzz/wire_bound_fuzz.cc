// ParsedBytesBound (server/wire_bound.h) against protobuf's own parse: the
// first byte picks a request type, the rest is its wire bytes. Whatever
// protobuf parses, the bound exists and covers what the message then takes
// in memory (SpaceUsedLong); the server refuses what the bound rejects
// without parsing it, so a gap either way would let parsing go unpriced.
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "ropeattn/v1/attention.pb.h"
#include "server/wire_bound.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ropeattn;
  if (size < 1) return -1;
  std::unique_ptr<google::protobuf::Message> m;
  switch (data[0] % 6) {
    case 0: m = std::make_unique<v1::AttendRequest>(); break;
    case 1: m = std::make_unique<v1::EncodeRequest>(); break;
    case 2: m = std::make_unique<v1::EmbedRequest>(); break;
    case 3: m = std::make_unique<v1::DecodeRequest>(); break;
    case 4: m = std::make_unique<v1::GetServerInfoRequest>(); break;
    default: m = std::make_unique<v1::GetSessionRequest>(); break;
  }
  const int n = static_cast<int>(size - 1);
  // In small blocks, as gRPC hands over a message's slices: protobuf parses
  // a chunked stream differently from one flat array (strings and packed
  // fields grow as they are appended).
  const int block = 1 + data[0] / 6 % 64;
  google::protobuf::io::ArrayInputStream in(data + 1, n, block);
  const std::optional<int64_t> bound = server::ParsedBytesBound(&in, m->GetDescriptor());
  google::protobuf::io::ArrayInputStream again(data + 1, n, block);
  const bool parsed = m->ParseFromZeroCopyStream(&again);
  if (parsed) {
    if (!bound.has_value()) std::abort();  // parsed, but would have been refused unpriced
    if (*bound < static_cast<int64_t>(m->SpaceUsedLong())) std::abort();
  }
  return 0;
}
