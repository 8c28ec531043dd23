// Contribution bounding on the user owner: at most C records per user per window, chosen by
// stream order; values clamped; per-(user, key) aggregation with a first-touch flag. Partials are
// not pre-reduced by key here: a per-thread key map cost a cache miss per record (17% of a run), while
// the key owner sorts its partials by key anyway (KeyStateTable::accumulate's radix sort).
#pragma once

#include <absl/container/flat_hash_map.h>
#include <absl/container/flat_hash_set.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "common/record.hpp"
#include "kernels/table_memory.hpp"

namespace dpstream::kernels {

struct BoundingParams {
  std::uint32_t max_records_per_user;  // C
  double clamp_min;                    // values are clamped (as doubles, so any magnitude is
  double clamp_max;                    // safe) and then rounded to fixed point
  std::int64_t value_quantum = 1;      // DP: fixed values are rounded to multiples of the sum noise grid
  // KeyPartial::new_users counts a user once per key per window (false), or once per key in every
  // trigger where the user has kept records of the key (true: the per-batch baseline's user counts).
  bool users_per_trigger = false;
};

// Nearest multiple of q (ties away from zero); monotone, so clamped values stay within the rounded bounds.
inline std::int64_t quantize(std::int64_t fixed, std::int64_t q) {
  if (q <= 1) return fixed;
  const std::int64_t r = (fixed >= 0 ? fixed + q / 2 : fixed - q / 2) / q;
  return r * q;
}

struct BoundingStats {
  std::uint64_t kept = 0;
  std::uint64_t dropped = 0;    // over the per-user limit C
  std::uint64_t clamped = 0;    // kept records whose value was clamped
  std::uint64_t new_users = 0;  // users seen for the first time in the window
};

// Per-user state of one window, owned by the rank that owns the user. Sharded by the low bits
// of the user hash so that OpenMP threads own disjoint shards.
//
// A user is one 32-byte slot in its shard's open-addressing table (linear probing from a salted home
// position, never more than 80% full): user id, kept count, flags and the 32-bit fingerprints of the
// first keys it was counted for, so a visit costs one cache line. A user with more than kInline keys
// moves the last inline fingerprint and the rest to a block of its shard's arena (the slot's last
// word then holds the block's offset); a user with more than kInline - 1 + 63 keys keeps the rest in
// an exact (user, fingerprint) set.
//
// First touches: a user adds at most 1 to a key's user count. Two keys of the same user with equal
// fingerprints (probability <= C / 2^32 per new key) count that user once for both: an under-count
// of that user's own contribution only, never another user's, and never an over-count (a false
// negative is impossible: a key always has its fingerprint). docs/PRIVACY.md section 4.
//
// Block layout: one header word (fingerprints held, fingerprints already journaled, size class) and
// 2^(class+1) - 1 fingerprints. Freed blocks go to a free list per class.
class UserState {
 public:
  static constexpr std::size_t kShards = 256;
  static constexpr std::uint32_t kInline = 4;                                  // fingerprints in the slot
  static constexpr std::uint32_t kClasses = 6;                                 // blocks of 2, 4, ..., 64 words
  static constexpr std::uint32_t kBlockCapacity = (2u << (kClasses - 1)) - 1;  // 63 fingerprints
  struct alignas(32) Slot {  // 32-aligned: a slot never straddles a cache line
    std::uint64_t user = 0;
    std::uint32_t kept = 0;  // records kept so far in the window
    std::uint32_t meta = 0;  // occupied, changed, has-block flags and the inline counts (bounding.cpp)
    std::uint32_t fp[kInline] = {};
  };
  static_assert(sizeof(Slot) == 32);
  using UserFingerprint = std::pair<std::uint64_t, std::uint32_t>;  // (user, key fingerprint)

  void clear();  // also clears the journal
  // Sizes every shard's table for its share of `users` users in all (hashing spreads them evenly) and the
  // share's spread (reserved_capacity), so that it does not grow step by step while they arrive (a shard
  // far above its share grows once more); never shrinks a table. Contents stay as they are.
  void reserve(std::uint64_t users);
  void clear_journal();
  std::uint64_t users() const;
  std::uint64_t user_key_pairs() const;
  std::uint64_t memory_bytes() const;  // from the tables' and arenas' capacities
  // Order-free hash of the contents (each user's kept count and key fingerprints) under `seed`: a sum
  // over users and pairs mod 2^64, so digests of the parts of a partitioned state add up to the whole's.
  std::uint64_t digest(std::uint64_t seed) const;
  // f(user, kept) for every user of the window, shard by shard.
  template <class F>
  void for_each_user(F&& f) const {
    for (const Shard& sh : shards_)
      for (const Slot& slot : sh.slots)
        if (occupied(slot)) f(slot.user, slot.kept);
  }

  static std::uint32_t key_fingerprint(std::uint64_t key);
  // The hash that places a user in its shard's table (a bijection of the id; home slots grow with it).
  static std::uint64_t slot_hash(std::uint64_t user);
  // The user's slot in `shard`, added with kept = 0 and no fingerprint when new (second: added). The
  // pointer is valid until the next user is added to the shard.
  std::pair<Slot*, bool> find_or_add(std::size_t shard, std::uint64_t user);
  // The same with slot_hash(user) given (bounding has it from its sort); a wrong one would add the user twice.
  std::pair<Slot*, bool> find_or_add(std::size_t shard, std::uint64_t user, std::uint64_t slot_hash);
  // Prefetches ahead of find_or_add, so that the misses of many users' state overlap instead of adding
  // up: the cache line of the user's home slot (from slot_hash(user)) and the next one, then, once those
  // are cached, the start of its block.
  // Hints only: a prefetch never blocks and a stale one (the table grew since) costs nothing but a line.
  void prefetch_slot(std::size_t shard, std::uint64_t slot_hash) const;
  void prefetch_block(std::size_t shard, std::uint64_t user, std::uint64_t slot_hash) const;
  // Room for `more` new fingerprints (one block move at most; optional, add_pair grows too).
  void reserve_pairs(std::size_t shard, Slot& slot, std::uint32_t more);
  // Counts (user, key fingerprint) among the user's first touches; false if it was there. With the
  // journal on, the pair stays in the journal until drain_journal().
  bool add_pair(std::size_t shard, std::uint64_t user, Slot& slot, std::uint32_t fingerprint);
  // Marks the user's kept count as changed since the last drain (journal on).
  void mark_changed(std::size_t shard, Slot& slot);
  // Every counted pair as (user, key fingerprint), per shard in no particular order.
  std::vector<UserFingerprint> pairs(std::size_t shard) const;
  // The changes of `shard` since the last drain, as (user, kept) of every changed user and its new
  // (user, fingerprint) pairs; afterwards the shard holds no change. Reads only the cache lines of slots
  // marked since the last drain (GroupMarks).
  void drain_journal(std::size_t shard, std::vector<UserFingerprint>& changed_users,
                     std::vector<UserFingerprint>& new_pairs);
  bool journal_empty() const;
  // What drain_journal will return, counted as the changes happen (no pass over the users): users
  // first marked changed and pairs that became pending since the last drain. O(1) per shard.
  struct JournalSize {
    std::uint64_t changed_users = 0, new_pairs = 0;
  };
  JournalSize journal_size(std::size_t shard) const;
  JournalSize journal_size() const;  // all shards

  bool journal = false;  // record changes for the checkpoint (drain_journal)

 private:
  static bool occupied(const Slot& slot) { return slot.meta != 0; }
  struct Shard {
    TableSlots<Slot> slots;  // open addressing; empty slots have meta == 0
    std::uint64_t users = 0;
    std::vector<std::uint32_t> words{0, 0};  // fingerprint blocks; offset 0 is "no block"
    std::uint32_t free_head[kClasses] = {};  // a freed block's first word links to the next one
    std::uint64_t pairs = 0;
    absl::flat_hash_set<UserFingerprint> overflow;  // beyond a full block of kBlockCapacity
    std::vector<UserFingerprint> overflow_journal;
    JournalSize pending;   // what drain_journal will return (its new_pairs include overflow_journal)
    GroupMarks<2> marked;  // groups of slots that may be pending (2 slots of 32 bytes: a cache line)
    void note_pending(const Slot& s) { marked.note(static_cast<std::size_t>(&s - slots.data())); }
    std::size_t home_of(std::uint64_t slot_hash) const;  // monotone in the hash
    const Slot* find(std::uint64_t user, std::uint64_t slot_hash) const;
    void grow();
    void rehash(std::size_t capacity, const TableAllocator<Slot>& alloc = {});
    std::uint32_t allocate(std::uint32_t cls);
    void release(std::uint32_t block, std::uint32_t cls);
    void move_to_block(Slot& slot, std::uint32_t capacity);
    void grow_block(Slot& slot, std::uint32_t more);
    bool append_to_block(Slot& slot, std::uint64_t user, std::uint32_t fingerprint, bool journal);
  };
  TableSlab slab_;  // the shards' reserved tables (reserve()); declared first, so it outlives them
  std::vector<Shard> shards_{kShards};
};

// Bounds and aggregates one trigger's records of the users this rank owns (any order).
// Returns one partial per (user, key) with kept records (a key may appear more than once).
std::vector<KeyPartial> bound_and_aggregate(const std::vector<Record>& records, const BoundingParams& params,
                                            UserState& state, BoundingStats& stats);

}  // namespace dpstream::kernels
