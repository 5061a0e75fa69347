#include "client/ring.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace ropeattn::client {

uint64_t Fnv1a64(absl::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t RingHash(absl::string_view key) { return Mix64(Fnv1a64(key)); }

HashRing::HashRing(std::vector<std::string> targets, int virtual_nodes)
    : virtual_nodes_(std::max(virtual_nodes, 1)) {
  for (std::string& t : targets) {
    if (std::find(targets_.begin(), targets_.end(), t) == targets_.end()) {
      targets_.push_back(std::move(t));
    }
  }
  points_.reserve(targets_.size() * static_cast<size_t>(virtual_nodes_));
  for (size_t t = 0; t < targets_.size(); ++t) {
    for (int i = 0; i < virtual_nodes_; ++i) {
      points_.emplace_back(RingHash(absl::StrCat(targets_[t], "#", i)), static_cast<int>(t));
    }
  }
  std::sort(points_.begin(), points_.end(),
            [this](const std::pair<uint64_t, int>& a, const std::pair<uint64_t, int>& b) {
              if (a.first != b.first) return a.first < b.first;
              return targets_[a.second] < targets_[b.second];
            });
}

size_t HashRing::FirstPoint(uint64_t hash) const {
  auto it =
      std::lower_bound(points_.begin(), points_.end(), hash,
                       [](const std::pair<uint64_t, int>& p, uint64_t h) { return p.first < h; });
  return it == points_.end() ? 0 : static_cast<size_t>(it - points_.begin());
}

int HashRing::Lookup(absl::string_view key) const {
  if (points_.empty()) return -1;
  return points_[FirstPoint(RingHash(key))].second;
}

std::vector<int> HashRing::Preference(absl::string_view key) const {
  std::vector<int> order;
  if (points_.empty()) return order;
  std::vector<bool> seen(targets_.size(), false);
  const size_t start = FirstPoint(RingHash(key));
  for (size_t n = 0; n < points_.size() && order.size() < targets_.size(); ++n) {
    const int t = points_[(start + n) % points_.size()].second;
    if (!seen[t]) {
      seen[t] = true;
      order.push_back(t);
    }
  }
  return order;
}

int HashRing::NextAfter(absl::string_view key, int after) const {
  if (after < 0 || static_cast<size_t>(after) >= targets_.size()) return -1;
  const std::vector<int> order = Preference(key);
  for (size_t i = 0; i < order.size(); ++i) {
    if (order[i] == after) return order[(i + 1) % order.size()];
  }
  return -1;
}

int HashRing::IndexOf(absl::string_view target) const {
  for (size_t t = 0; t < targets_.size(); ++t) {
    if (targets_[t] == target) return static_cast<int>(t);
  }
  return -1;
}

}  // namespace ropeattn::client
