// The naive single-threaded reference: one std::unordered_map loop doing the same bounding
// and counting as the engine. Used by the benchmark (speed baseline) and the tests (oracle).
#pragma once

#include <cstdint>
#include <map>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/record.hpp"

namespace dpstream {

struct PairHash {
  std::size_t operator()(const std::pair<std::uint64_t, std::uint64_t>& p) const {
    return std::hash<std::uint64_t>()(p.first * 0x9E3779B97F4A7C15ULL ^ p.second);
  }
};

class NaiveReference {
 public:
  NaiveReference(std::uint32_t max_records_per_user, double clamp_min, double clamp_max)
      : c_(max_records_per_user), lo_(clamp_min), hi_(clamp_max) {}

  void begin_window();
  // One trigger's records in any order; returns the changed keys' totals, sorted by key.
  std::vector<KeyTotals> process(std::vector<Record> records);

 private:
  std::uint32_t c_;
  double lo_, hi_;
  std::unordered_map<std::uint64_t, std::uint32_t> kept_;
  std::unordered_set<std::pair<std::uint64_t, std::uint64_t>, PairHash> touched_;  // (user, key fingerprint)
  std::unordered_map<std::uint64_t, KeyTotals> totals_;
};

}  // namespace dpstream
