// Per-key accumulation on the key owner: running totals over the window and the list of keys
// whose totals changed at this trigger.
#pragma once

#include <absl/container/flat_hash_map.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "common/record.hpp"

namespace dpstream::kernels {

// The state of one key in the window, in exact 64-bit values: what the kernels and checkpoints read
// and write. The table stores it packed (KeyStateTable::Packed).
struct KeyState {
  std::int64_t count = 0;
  Int128Words sum;         // fixed point, exact (record.hpp); zero when the table tracks no sums
  std::int64_t users = 0;  // distinct users in the window
  // DP key selection (Algorithm 2): the current round began at trigger round_start with
  // round_base_users users; round r + 1 starts right after the key's r-th release.
  std::int64_t round_base_users = 0;
  std::uint32_t round = 0;
  std::uint32_t round_start = 0;
  bool operator==(const KeyState& o) const {
    return count == o.count && int128(sum) == int128(o.sum) && users == o.users &&
           round_base_users == o.round_base_users && round == o.round && round_start == o.round_start;
  }
};

// Per-key state of the key owner, in 256 shards (a thread owns a shard at a time). A key costs one
// 16-byte slot (key, count, users in 32 bits each) in a hash table while it has never been released
// and its values fit 32 bits: almost every key of a large key space. A key released at least once
// (its round state is not zero) or with a value of 2^32 - 1 or more keeps its full state in a side
// table, so every value stays exact whatever the data. Sums, when the query has a sum column, are a
// table of their own.
class KeyStateTable {
 public:
  static constexpr std::size_t kShards = 256;

  // track_sums = false (a query without a sum column): sums are not stored and read back as 0.
  explicit KeyStateTable(bool track_sums = true) : track_sums_(track_sums) {}
  bool tracks_sums() const { return track_sums_; }

  void clear();  // also clears the journal
  void clear_journal();
  std::uint64_t keys() const;
  std::uint64_t memory_bytes() const;
  // Order-free hash of every key's exact state under `seed` (a sum over keys mod 2^64, like
  // UserState::digest): equal for equal contents whatever the table's layout or the rank count.
  std::uint64_t digest(std::uint64_t seed) const;
  static std::size_t shard_of(std::uint64_t key);

  std::optional<KeyState> find(std::uint64_t key) const;
  KeyState at(std::uint64_t key) const;             // std::out_of_range if the key is not tracked
  void put(std::uint64_t key, const KeyState& st);  // inserts or overwrites
  // f(key, const KeyState&) for every key of shard s (put on a visited key is allowed; no insert).
  template <class F>
  void for_each_in(std::size_t s, F&& f) const {
    const Shard& sh = shards_[s];
    for (const auto& [key, p] : sh.packed) f(key, load(sh, key, p));
  }
  template <class F>
  void for_each(F&& f) const {
    for (std::size_t s = 0; s < kShards; ++s) for_each_in(s, f);
  }

  // What accumulate returns for every key the trigger touched, sorted by key id: its running
  // totals (mode none), the trigger's own totals (the per-batch baseline), or nothing (DP). Every
  // report leaves the keys touched in `touched`, per shard and ascending, for key selection to visit.
  enum class Report { RunningTotals, TriggerTotals, Nothing };
  // Adds one trigger's partials (any order, a key may repeat).
  std::vector<KeyTotals> accumulate(const std::vector<KeyPartial>& partials, Report report = Report::RunningTotals);

  // Keys of the last accumulate, per shard, ascending.
  std::vector<std::vector<std::uint64_t>> touched{kShards};

  // Journal (only when `journal` is on): per shard, keys whose state changed since the last
  // checkpoint, by accumulation or by a release (a key may repeat).
  bool journal = false;
  std::vector<std::vector<std::uint64_t>> changed_keys{kShards};

 private:
  // A key's state while its round state is zero and its values fit 32 bits: 8 bytes.
  struct Packed {
    std::uint32_t count = 0;  // kWide: the state is in Shard::wide
    std::uint32_t users = 0;
  };
  static_assert(sizeof(Packed) == 8);
  static constexpr std::uint32_t kWide = 0xffffffffu;
  struct Shard {
    absl::flat_hash_map<std::uint64_t, Packed> packed;     // every tracked key
    absl::flat_hash_map<std::uint64_t, KeyState> wide;     // keys whose Packed::count is kWide
    absl::flat_hash_map<std::uint64_t, Int128Words> sums;  // non-zero sums of packed keys, when tracked
  };
  KeyState load(const Shard& sh, std::uint64_t key, const Packed& p) const;
  void store(Shard& sh, std::uint64_t key, Packed& p, const KeyState& st);
  Packed& slot(Shard& sh, std::uint64_t key);  // inserts a zero state

  bool track_sums_;
  std::vector<Shard> shards_{kShards};
};

}  // namespace dpstream::kernels
