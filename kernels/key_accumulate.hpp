// Per-key accumulation on the key owner: running totals over the window and the list of keys
// whose totals changed at this trigger.
#pragma once

#include <absl/container/flat_hash_map.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "common/prefetch.hpp"
#include "common/record.hpp"
#include "kernels/table_memory.hpp"

namespace dpstream::kernels {

// The state of one key in the window, in exact 64-bit values: what the kernels and checkpoints read
// and write. The table stores it packed (KeyStateTable::Packed).
struct KeyState {
  std::int64_t count = 0;
  Int128Words sum{};       // fixed point, exact (record.hpp); zero when the table tracks no sums
  std::int64_t users = 0;  // distinct users in the window
  // DP key selection (Algorithm 2): the current round began at trigger round_start with
  // round_base_users users; round r + 1 starts right after the key's r-th release.
  std::int64_t round_base_users = 0;
  std::uint32_t round = 0;
  std::uint32_t round_start = 0;
  // Users of the current round, as key selection compares them with mu (a double).
  double round_users() const { return static_cast<double>(users - round_base_users); }
  bool operator==(const KeyState& o) const {
    return count == o.count && int128(sum) == int128(o.sum) && users == o.users &&
           round_base_users == o.round_base_users && round == o.round && round_start == o.round_start;
  }
};

// A hash table of 16-byte slots (key, count, users) with linear probing from a home slot chosen by
// multiply-shift, so the capacity can be any size: it grows by 1/4, or 1/8 once large, at a load of 5/6
// (kernels/table_memory.hpp), and a key costs 16 / load = 19 to 24 bytes (a power-of-two table at
// absl's 7/8 costs 18 to 39 bytes with its control byte; growing by 3/2 cost 20 to 30). A free slot has count kFree;
// keys are never erased.
class PackedSlots {
 public:
  struct Slot {
    std::uint64_t key;
    std::uint32_t count;
    std::uint32_t users;
  };
  static_assert(sizeof(Slot) == 16);
  static constexpr std::uint32_t kFree = 0xfffffffeu;

  std::size_t size() const { return size_; }
  std::size_t capacity() const { return slots_.size(); }
  const Slot* data() const { return slots_.data(); }
  // Room for `keys` and their spread (reserved_capacity), in `alloc`'s memory; never shrinks.
  void reserve(std::size_t keys, const TableAllocator<Slot>& alloc = {});
  // `hash` is the key's salted hash (partition/hash.hpp): bits 8-39 pick the home slot, independent
  // of the shard (bits 0-7) and the owner rank (the top bits).
  const Slot* find(std::uint64_t key, std::uint64_t hash) const;
  Slot* find(std::uint64_t key, std::uint64_t hash) {
    return const_cast<Slot*>(static_cast<const PackedSlots*>(this)->find(key, hash));
  }
  Slot& find_or_insert(std::uint64_t key, std::uint64_t hash);  // inserts {key, 0, 0}
  void prefetch(std::uint64_t hash) const {
    if (!slots_.empty()) prefetch_probe(slots_, home(hash));
  }
  template <class F>
  void for_each(F&& f) const {
    for (const Slot& s : slots_)
      if (s.count != kFree) f(s);
  }
  // The owner's journal: note_marked(slot) after marking it; drain_marked(f) calls f(slot) for the
  // occupied slots of the groups noted since (GroupMarks), ascending, and forgets them.
  void note_marked(const Slot& s) { marked_.note(static_cast<std::size_t>(&s - slots_.data())); }
  template <class F>
  void drain_marked(F&& f) {
    marked_.drain(
        slots_.size(), [&](std::size_t i) { dpstream::prefetch(&slots_[i]); },
        [&](std::size_t i) {
          if (slots_[i].count != kFree) f(slots_[i]);
        });
  }

 private:
  std::size_t home(std::uint64_t hash) const { return home_slot(hash, slots_.size()); }
  // One more key would pass the load limit: 7/8 in a reservation's slab piece, 5/6 elsewhere (table_memory.hpp).
  bool full() const {
    return table_full(size_, slots_.size(), slots_.data() == slots_.get_allocator().piece ? kMaxLoadInPiece : kMaxLoad);
  }
  void grow();
  void rehash(std::size_t capacity, const TableAllocator<Slot>& alloc = {});
  TableSlots<Slot> slots_;
  GroupMarks<4> marked_;  // 4 slots of 16 bytes: a cache line
  std::size_t size_ = 0;
};

// Per-key state of the key owner, in 256 shards (a thread owns a shard at a time). A key costs one
// 16-byte slot of PackedSlots while its count is below 2^31 - 2 and its users below 2^31: almost every key of a large
// key space. A key released at least once adds its round state (round, its start and base users, each below 2^32) in a
// side table of 24-byte entries; a key with larger values keeps its full state (48 bytes) in another, so every value
// stays exact whatever the data. A sum, when the query has a sum column, is stored as its excess over count * 2^20
// (what the values add up to if each is 1.0): zero, and then not stored, for counting data; a table
// of its own otherwise.
class KeyStateTable {
 public:
  static constexpr std::size_t kShards = 256;

  // track_sums = false (a query without a sum column): sums are not stored and read back as 0.
  explicit KeyStateTable(bool track_sums = true) : track_sums_(track_sums) {}
  bool tracks_sums() const { return track_sums_; }

  void clear();  // also clears the journal
  // Sizes every shard's table for its share of `keys` keys in all (spread evenly by the hash), so that
  // it does not grow step by step while they arrive (one above its share grows as before).
  void reserve(std::uint64_t keys);
  std::uint64_t keys() const;
  std::uint64_t memory_bytes() const;
  // Order-free hash of every key's exact state under `seed` (a sum over keys mod 2^64, like
  // UserState::digest): equal for equal contents whatever the table's layout or the rank count.
  std::uint64_t digest(std::uint64_t seed) const;
  static std::size_t shard_of(std::uint64_t key);

  std::optional<KeyState> find(std::uint64_t key) const;
  KeyState at(std::uint64_t key) const;             // std::out_of_range if the key is not tracked
  void prefetch(std::uint64_t key) const;           // a hint: find(key) follows soon
  void put(std::uint64_t key, const KeyState& st);  // inserts or overwrites
  // f(key, const KeyState&) for every key of shard s (put on a visited key is allowed; no insert).
  template <class F>
  void for_each_in(std::size_t s, F&& f) const {
    const Shard& sh = shards_[s];
    sh.packed.for_each([&](const Packed& p) { f(p.key, load(sh, p)); });
  }
  template <class F>
  void for_each(F&& f) const {
    for (std::size_t s = 0; s < kShards; ++s) for_each_in(s, f);
  }

  // What accumulate returns for every key the trigger touched, sorted by key id: its running
  // totals (mode none), the trigger's own totals (the per-batch baseline), or nothing (DP). Every
  // report leaves the keys touched in `touched` (those above `touched_above`), per shard and ascending,
  // for key selection to visit.
  enum class Report { RunningTotals, TriggerTotals, Nothing };
  // Adds one trigger's partials (any order, a key may repeat); sorts them in place (moved in: no copy).
  // `touched_above`: `touched` lists only the keys whose round users (users - round_base_users, as a
  // double) exceed it, and `touched_below` counts the others (key selection tests no key at or below
  // mu, so it need not look them up again).
  std::vector<KeyTotals> accumulate(std::vector<KeyPartial> partials, Report report = Report::RunningTotals,
                                    double touched_above = -std::numeric_limits<double>::infinity());

  // A batch of triggers taken shard by shard (key selection's shard-major batches): each trigger's partials
  // sorted and grouped by key as accumulate does, then split by shard (each shard's groups ascending), so that
  // one thread can add a shard's keys of every trigger of the batch while the shard's slots stay in its cache.
  struct ShardedGroups {
    std::vector<KeyTotals> groups;       // by shard, ascending by key within a shard
    std::vector<std::uint64_t> hashes;   // key_hash of each group's key
    std::vector<std::uint32_t> offsets;  // shard s's groups: [offsets[s], offsets[s + 1])
  };
  static ShardedGroups shard_groups(std::vector<KeyPartial> partials);
  // accumulate (Report::Nothing) of one shard's groups: refills touched[s] and touched_below[s].
  void accumulate_shard(const ShardedGroups& g, std::size_t s, double touched_above);

  // Keys of the last accumulate, per shard, ascending (those above `touched_above`), each with its state
  // after it, and the others' count. The states are the table's while `touched_states_current`: accumulate
  // sets it, key selection reads them instead of looking each key up again and clears it (its releases put
  // new rounds), so a release with no accumulate before it looks the keys up.
  struct TouchedKey {
    std::uint64_t key;
    KeyState state;
    std::uint64_t hash;  // partition::key_hash(key), for key selection's cache index
  };
  std::vector<std::vector<TouchedKey>> touched{kShards};
  bool touched_states_current = false;
  std::vector<std::uint64_t> touched_below = std::vector<std::uint64_t>(kShards);

  // Journal (only when `journal` is on): a mark in the slot of every key whose state changed since
  // the last drain, by accumulation (set there) or by a release (mark_changed), and a count per shard.
  // A commit reads only the cache lines of marked slots (GroupMarks): a log of changed key ids grew
  // with every touch, and its drain sorted it and looked each key up (45.9 s of a 305-s run at 1/10 of
  // the billion-key job).
  bool journal = false;
  void mark_changed(std::uint64_t key);  // a tracked key; nothing when the journal is off
  // The keys marked (each once), in all and in shard s: O(shards), O(1).
  std::uint64_t changed_key_count() const;
  std::uint64_t changed_keys(std::size_t s) const { return changed_[s]; }
  // f(key, const KeyState&) for every marked key of shard s, in table order; clears their marks.
  template <class F>
  void drain_changed(std::size_t s, F&& f) {
    if (changed_[s] == 0) return;
    Shard& sh = shards_[s];
    sh.packed.drain_marked([&](Packed& p) {
      if ((p.users & kChanged) == 0) return;
      p.users &= ~kChanged;
      f(p.key, load(sh, p));
    });
    changed_[s] = 0;
  }
  // Keys of shard s with more than a count and users (released, or values beyond 31 bits): O(1).
  std::size_t full_state_keys(std::size_t s) const { return shards_[s].wide.size() + shards_[s].rounds.size(); }

 private:
  using Packed = PackedSlots::Slot;
  static constexpr std::uint32_t kWide = 0xffffffffu;  // Packed::count of a key whose state is in Shard::wide
  // Packed::count of any other key: its count (below 2^31 - 2) in bits 0-30, and in bit 31 whether its
  // round state is in Shard::rounds (zero otherwise).
  static constexpr std::uint32_t kHasRound = 1u << 31;
  struct RoundState {  // KeyState's round fields, in 32 bits each
    std::uint32_t base_users = 0, round = 0, start = 0;
  };
  // Packed::users: the key's users in bits 0-30 (a packed key has fewer than 2^31), its journal mark in
  // bit 31 (also for a wide key, whose users live in Shard::wide).
  static constexpr std::uint32_t kChanged = 1u << 31;
  struct Shard {
    PackedSlots packed;                                      // every tracked key
    absl::flat_hash_map<std::uint64_t, KeyState> wide;       // keys whose Packed::count is kWide
    absl::flat_hash_map<std::uint64_t, RoundState> rounds;   // keys whose Packed::count has kHasRound
    absl::flat_hash_map<std::uint64_t, Int128Words> excess;  // sum - count * 2^20 of packed keys, when not 0
  };
  KeyState load(const Shard& sh, const Packed& p) const;
  void store(Shard& sh, Packed& p, const KeyState& st);
  void add(std::size_t s, KeyTotals& t, std::uint64_t hash, Report report, double touched_above);
  // Adds t's count and users to a packed key's slot in place when they stay within its bits and t adds
  // nothing to the sum beyond count * 2^20: the round state and the sum's excess are unchanged, so
  // store() would write the side tables with what they hold. False (nothing changed) otherwise.
  bool add_in_place(Packed& p, const KeyTotals& t) const;
  void mark(std::size_t s, Packed& p) {
    if ((p.users & kChanged) != 0) return;
    p.users |= kChanged;
    shards_[s].packed.note_marked(p);
    ++changed_[s];
  }
  void accumulate_owned(std::vector<KeyTotals>& groups, const std::vector<std::uint64_t>& hashes, Report report,
                        double touched_above, std::size_t thread, std::size_t threads);

  bool track_sums_;
  TableSlab slab_;  // the shards' reserved tables (reserve()); declared first, so it outlives them
  std::vector<Shard> shards_{kShards};
  std::vector<std::uint64_t> changed_ = std::vector<std::uint64_t>(kShards);  // marked keys per shard
};

}  // namespace dpstream::kernels
