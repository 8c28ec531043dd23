// Per-key accumulation on the key owner: running totals over the window and the list of keys
// whose totals changed at this trigger.
#pragma once

#include <absl/container/flat_hash_map.h>

#include <cstdint>
#include <vector>

#include "src/record.hpp"

namespace dpstream::kernels {

struct KeyState {  // 48 bytes
  std::int64_t count = 0;
  Int128Words sum;         // fixed point, exact (record.hpp); two words: a table slot stays 56 bytes
  std::int64_t users = 0;  // distinct users in the window
  // DP key selection (Algorithm 2): the current round began at trigger round_start with
  // round_base_users users; round r + 1 starts right after the key's r-th release.
  std::int64_t round_base_users = 0;
  std::uint32_t round = 0;
  std::uint32_t round_start = 0;
};
static_assert(sizeof(KeyState) == 48 && alignof(KeyState) == 8);

class KeyStateTable {
 public:
  static constexpr std::size_t kShards = 256;

  void clear();  // also clears the journal
  void clear_journal();
  std::uint64_t keys() const;
  std::uint64_t memory_bytes() const;

  // What accumulate returns for every key the trigger touched, sorted by key id: its running
  // totals (mode none), the trigger's own totals (the per-batch baseline), or nothing (DP). Every
  // report leaves the keys touched in `touched`, per shard and ascending, for key selection to visit.
  enum class Report { RunningTotals, TriggerTotals, Nothing };
  // Adds one trigger's partials (any order, a key may repeat).
  std::vector<KeyTotals> accumulate(const std::vector<KeyPartial>& partials, Report report = Report::RunningTotals);

  std::vector<absl::flat_hash_map<std::uint64_t, KeyState>> shards{kShards};
  // Keys of the last accumulate, per shard, ascending.
  std::vector<std::vector<std::uint64_t>> touched{kShards};
  static std::size_t shard_of(std::uint64_t key);

  // Journal (only when `journal` is on): per shard, keys whose state changed since the last
  // checkpoint, by accumulation or by a release (a key may repeat).
  bool journal = false;
  std::vector<std::vector<std::uint64_t>> changed_keys{kShards};
};

}  // namespace dpstream::kernels
