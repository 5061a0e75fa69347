// Consistent hashing of routing keys onto targets, for clients that talk to
// several ropeattn-server replicas without a proxy.
//
// Each target is placed on a 64-bit ring at `virtual_nodes` points, point i at
// Mix64(Fnv1a64("<target>#<i>")); a key is placed at Mix64(Fnv1a64(key)) and
// belongs to the target of the first point at or after it (wrapping). Both
// hashes are fixed functions implemented here (FNV-1a 64 and the splitmix64
// finalizer), never std::hash or absl::Hash, so every process and every build
// maps a key to the same target, given the same target list (the order of the
// list does not matter). Adding or removing one target moves only the keys of
// the points it gains or loses (about 1/N of them).
//
// Failover: Preference(key) lists the distinct targets in the order met when
// walking the ring from the key; NextAfter(key, t) is the target after t in
// that list, so every process fails a key over to the same replica.
#ifndef ROPEATTN_CLIENT_RING_H_
#define ROPEATTN_CLIENT_RING_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace ropeattn::client {

// FNV-1a, 64-bit (offset basis 0xcbf29ce484222325, prime 0x100000001b3).
uint64_t Fnv1a64(absl::string_view bytes);
// The splitmix64 finalizer: spreads FNV's weak low bits over all 64.
uint64_t Mix64(uint64_t x);
// Mix64(Fnv1a64(key)): where a key (or a virtual node's name) sits.
uint64_t RingHash(absl::string_view key);

class HashRing {
 public:
  static constexpr int kDefaultVirtualNodes = 160;

  // Duplicate targets are kept once (first occurrence); virtual_nodes < 1 is
  // taken as 1. An empty list gives an empty ring (lookups return -1).
  explicit HashRing(std::vector<std::string> targets, int virtual_nodes = kDefaultVirtualNodes);

  bool empty() const { return targets_.empty(); }
  size_t size() const { return targets_.size(); }
  // The distinct targets, in the order given; indices below refer to it.
  const std::vector<std::string>& targets() const { return targets_; }
  int virtual_nodes() const { return virtual_nodes_; }

  // Index of the target that owns `key`; -1 for an empty ring.
  int Lookup(absl::string_view key) const;
  // Every distinct target in ring order from `key` (the owner first).
  std::vector<int> Preference(absl::string_view key) const;
  // The target after `after` in Preference(key), wrapping (a one-target ring
  // answers that target); -1 for an empty ring or an index out of range.
  int NextAfter(absl::string_view key, int after) const;
  // Index of `target`, or -1.
  int IndexOf(absl::string_view target) const;

 private:
  // First point at or after `hash` (wrapping).
  size_t FirstPoint(uint64_t hash) const;

  std::vector<std::string> targets_;
  int virtual_nodes_;
  // (position, target index), sorted; ties broken by target name so the
  // order never depends on the order of the target list.
  std::vector<std::pair<uint64_t, int>> points_;
};

}  // namespace ropeattn::client

#endif  // ROPEATTN_CLIENT_RING_H_
