// Contribution bounding on the user owner: at most C records per user per window, chosen by
// stream order; values clamped; per-(user, key) aggregation with a first-touch flag. Partials are
// not pre-reduced by key here: a per-thread key map cost a cache miss per record (17% of a run), while
// the key owner sorts its partials by key anyway (KeyStateTable::accumulate's radix sort).
#pragma once

#include <absl/container/flat_hash_map.h>
#include <absl/container/flat_hash_set.h>

#include <cstdint>
#include <cstring>
#include <span>
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

// One user's record in the user table (UserState): user id (8 bytes), tag (2: fingerprints held in bits
// 0-5, of which the first ones already journaled in bits 6-11, kept count changed since the last drain
// in bit 12), kept count (1 byte; kWideKept: in the shard's wide_kept map), then `held` 16-bit key
// fingerprints. Unaligned: read and written with memcpy.
namespace user_record {
inline constexpr std::size_t kHead = 11;
inline constexpr std::uint8_t kWideKept = 255;
inline constexpr std::uint16_t kChanged = 1u << 12;
inline std::uint64_t user(const std::uint8_t* r) {
  std::uint64_t u;
  std::memcpy(&u, r, sizeof u);
  return u;
}
inline std::uint16_t tag(const std::uint8_t* r) {
  std::uint16_t t;
  std::memcpy(&t, r + 8, sizeof t);
  return t;
}
inline void set_tag(std::uint8_t* r, std::uint16_t t) { std::memcpy(r + 8, &t, sizeof t); }
inline std::uint32_t held(std::uint16_t t) { return t & 63u; }
inline std::uint32_t journaled(std::uint16_t t) { return t >> 6 & 63u; }
inline std::uint16_t with_counts(std::uint16_t t, std::uint32_t held, std::uint32_t done) {
  return static_cast<std::uint16_t>((t & ~0xfffu) | held | done << 6);
}
inline std::uint8_t kept_byte(const std::uint8_t* r) { return r[10]; }
inline void set_kept_byte(std::uint8_t* r, std::uint8_t k) { r[10] = k; }
inline std::size_t size(const std::uint8_t* r) { return kHead + std::size_t{2} * held(tag(r)); }
inline std::uint32_t fingerprint(const std::uint8_t* r, std::uint32_t i) {
  std::uint16_t f;
  std::memcpy(&f, r + kHead + std::size_t{2} * i, sizeof f);
  return f;
}
inline void set_fingerprint(std::uint8_t* r, std::uint32_t i, std::uint16_t f) {
  std::memcpy(r + kHead + std::size_t{2} * i, &f, sizeof f);
}
}  // namespace user_record

// Per-user state of one window, owned by the rank that owns the user. Sharded by the low bits of the
// user's slot hash (shard_of) so that OpenMP threads own disjoint shards.
//
// A user is one variable-length record (user_record) packed with others into the 256-byte buckets (four
// cache lines) of its shard's table, holding the 16-bit fingerprints of the first kInline keys it was
// counted for; more go to an exact (user, fingerprint) set. So a visit reads the user's home bucket (or
// the next few, where its record moved on), and a user costs 11 + 2 x keys bytes (paper workload: ~6
// keys, 23 bytes) over the table's load.
//
// Buckets are probed linearly from the user's home bucket (from slot_hash): a record lies in the first
// bucket from home that had room when it was placed, or moved to when it grew (the bucket's records
// shift to make room for a fingerprint, or the record moves on to the next bucket with room). A bucket
// a record passed is flagged, and a lookup goes on past flagged buckets only. The table grows (by 1/8)
// before its records fill kMaxLoadPercent of its bytes.
//
// First touches: a user adds at most 1 to a key's user count. Two keys of the same user with equal
// fingerprints (probability < C / 2^16 per new key) count that user once for both: an under-count
// of that user's own contribution only, never another user's, and never an over-count (a false
// negative is impossible: a key always has its fingerprint). docs/PRIVACY.md section 4.
class UserState {
 public:
  static constexpr std::size_t kShards = 256;
  // Four cache lines: three records of 32 keys (75 bytes) fit one, so a table of such users fills to its
  // load limit; in 128-byte buckets one did (126 bytes of records), and such a table cost 218 B per user.
  static constexpr std::size_t kBucketBytes = 256;
  static constexpr std::uint32_t kInline = 32;  // fingerprints in a record (11 + 64 = 75 bytes)
  static_assert(kInline < 64);                  // user_record's 6-bit counts
  static_assert(user_record::kHead + std::size_t{2} * kInline <= kBucketBytes - 2, "a full record fits a bucket");
  static constexpr std::uint32_t kFingerprintBits = 16;             // key_fingerprint's values are below 2^16
  static constexpr std::uint32_t kMaxLoadPercent = 85;              // of a table's record bytes
  using UserFingerprint = std::pair<std::uint64_t, std::uint32_t>;  // (user, key fingerprint)
  // Where a user's record lies: valid until the shard's next find_or_add or add_pair (add_pair updates
  // the one it is given), or the next reserve() or clear().
  struct UserRef {
    std::uint8_t* record = nullptr;
  };

  void clear();  // also clears the journal
  // Sizes every shard's table for its share of `users` users holding `pairs` (user, key) pairs in all
  // (hashing spreads them evenly) and the share's spread, so that it does not grow step by step while
  // they arrive (a shard far above its share grows once more); never shrinks a table. Contents stay.
  void reserve(std::uint64_t users, std::uint64_t pairs);
  void clear_journal();
  std::uint64_t users() const;
  std::uint64_t user_key_pairs() const;
  std::uint64_t memory_bytes() const;  // from the tables' and sets' capacities
  // Order-free hash of the contents (each user's kept count and key fingerprints) under `seed`: a sum
  // over users and pairs mod 2^64, so digests of the parts of a partitioned state add up to the whole's.
  std::uint64_t digest(std::uint64_t seed) const;
  // f(user, kept) for every user of the window, shard by shard.
  template <class F>
  void for_each_user(F&& f) const {
    for (std::size_t s = 0; s < kShards; ++s)
      shards_[s].for_each_record([&](const std::uint8_t* r) { f(user_record::user(r), kept_of(shards_[s], r)); });
  }

  // The user's fingerprint of `key`, below 2^kFingerprintBits. Salted by the user, so that two keys
  // collide for a user with probability 2^-16 independently of other users: with one salt for all, the
  // same pairs of keys would collide for every user in every window (a pair of popular keys losing the
  // same share of their users each time).
  static std::uint32_t key_fingerprint(std::uint64_t key, std::uint64_t user);
  // The hash that places a user in its shard's table (a bijection of the id; home buckets grow with it).
  static std::uint64_t slot_hash(std::uint64_t user);
  // The user's shard: the slot hash's low bits (homes come from its high bits). The one mapping that bounding
  // and a checkpoint's restore both use: a user found in two shards would be counted twice.
  static std::size_t shard_of_slot_hash(std::uint64_t slot_hash) { return slot_hash & (kShards - 1); }
  static std::size_t shard_of(std::uint64_t user) { return shard_of_slot_hash(slot_hash(user)); }
  // The user's record in `shard`, added with kept = 0 and no fingerprint when new (second: added).
  std::pair<UserRef, bool> find_or_add(std::size_t shard, std::uint64_t user);
  // The same with slot_hash(user) given (bounding has it from its sort); a wrong one would add the user twice.
  std::pair<UserRef, bool> find_or_add(std::size_t shard, std::uint64_t user, std::uint64_t slot_hash);
  std::uint32_t kept(std::size_t shard, UserRef u) const { return kept_of(shards_[shard], u.record); }
  void set_kept(std::size_t shard, UserRef u, std::uint32_t kept) {
    if (kept < user_record::kWideKept && user_record::kept_byte(u.record) != user_record::kWideKept)
      user_record::set_kept_byte(u.record, static_cast<std::uint8_t>(kept));  // most users: no wide map
    else
      set_wide_kept(shard, u, kept);
  }
  // Prefetches ahead of find_or_add, so that the misses of many users' state overlap instead of adding
  // up: the user's home bucket (from slot_hash(user)). A hint: a stale one costs nothing but a line.
  void prefetch_slot(std::size_t shard, std::uint64_t slot_hash) const;
  // Counts (user, key fingerprint) among the user's first touches; false if it was there. With the
  // journal on, the pair stays in the journal until drain_journal(). Moves the record (updates `u`).
  bool add_pair(std::size_t shard, std::uint64_t user, UserRef& u, std::uint32_t fingerprint);
  // Marks the user's kept count as changed since the last drain (journal on).
  void mark_changed(std::size_t shard, UserRef u);
  // Every counted pair as (user, key fingerprint), per shard in no particular order.
  std::vector<UserFingerprint> pairs(std::size_t shard) const;
  // The changes of `shard` since the last drain, as (user, kept) of every changed user and its new
  // (user, fingerprint) pairs; afterwards the shard holds no change. Reads only the buckets that
  // held a record marked since the last drain (GroupMarks).
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
  struct alignas(64) Bucket {
    std::uint8_t used = 0;   // bytes of records
    std::uint8_t flags = 0;  // kPassed: a record placed past this bucket may have its home at or before it
    std::uint8_t bytes[kBucketBytes - 2] = {};
  };
  static_assert(sizeof(Bucket) == kBucketBytes);
  static_assert(sizeof(Bucket::bytes) <= 255, "Bucket::used counts its bytes in 8 bits");
  struct Shard {
    TableSlots<Bucket> buckets;
    std::uint64_t users = 0, pairs = 0;
    std::uint64_t record_bytes = 0;                               // of all records: the table's load
    absl::flat_hash_map<std::uint64_t, std::uint32_t> wide_kept;  // kept counts of kWideKept or more
    absl::flat_hash_set<UserFingerprint> overflow;                // beyond kInline fingerprints
    std::vector<UserFingerprint> overflow_journal;
    JournalSize pending;   // what drain_journal will return (its new_pairs include overflow_journal)
    GroupMarks<1> marked;  // buckets that may hold a pending record
    static std::size_t home_in(std::size_t buckets, std::uint64_t slot_hash);  // monotone in the hash
    std::size_t home_of(std::uint64_t slot_hash) const;
    std::size_t bucket_of(const std::uint8_t* record) const;
    std::uint8_t* find(std::uint64_t user, std::uint64_t slot_hash);
    // Room for `size` bytes at the end of the first bucket of `table` with room, from `from` on,
    // flagging the buckets passed; nullptr if none has room.
    static std::uint8_t* place_in(TableSlots<Bucket>& table, std::size_t from, std::size_t size);
    // place_in() this table, growing it first while it is over its load, and again when no bucket has
    // room (docs/PERFORMANCE.md rounds 13 and 15: buckets of three full records keep that rare).
    std::uint8_t* place_or_grow(std::size_t from, std::uint64_t slot_hash, std::size_t size);
    std::uint8_t* grow_record(std::uint8_t* record);  // two more bytes at its end; returns where it is now
    // grow_record where its bucket has no room or the table is at its load: grows the table or moves it on.
    std::uint8_t* grow_record_elsewhere(std::uint8_t* record);
    std::uint8_t* widen_in_bucket(Bucket& bucket, std::uint8_t* record);  // it has room: the records after it shift
    bool over_load(std::size_t more) const;
    static std::size_t grown(std::size_t buckets);  // by 1/8 and a bucket
    void grow();
    // Moves every record to a table of `buckets` buckets, or of more while one finds no room there; the
    // current table stays as it is until the new one holds them all (a failed allocation loses nothing).
    void rehash(std::size_t buckets, const TableAllocator<Bucket>& alloc = {});
    bool copy_records_to(TableSlots<Bucket>& table) const;  // false when one found no room
    template <class B, class F>                             // f(record) for every record of bucket `b` (const or not)
    static void for_each_in(B& b, F&& f) {
      for (std::size_t at = 0; at < b.used; at += user_record::size(b.bytes + at)) f(b.bytes + at);
    }
    template <class F>
    void for_each_record(F&& f) const {
      for (const Bucket& b : buckets) for_each_in(b, f);
    }
  };
  void set_wide_kept(std::size_t shard, UserRef u, std::uint32_t kept);  // set_kept with the wide map
  static std::uint32_t kept_of(const Shard& sh, const std::uint8_t* record) {
    const std::uint8_t k = user_record::kept_byte(record);
    return k != user_record::kWideKept ? k : sh.wide_kept.at(user_record::user(record));
  }
  TableSlab slab_;  // the shards' reserved tables (reserve()); declared first, so it outlives them
  std::vector<Shard> shards_{kShards};
};

// Bounds and aggregates one trigger's records of the users this rank owns (any order).
// Returns one partial per (user, key) with kept records (a key may appear more than once).
std::vector<KeyPartial> bound_and_aggregate(const std::vector<Record>& records, const BoundingParams& params,
                                            UserState& state, BoundingStats& stats);

// The same for consecutive triggers of a window at once (`triggers[i]`: the records of the batch's i-th, each
// below 2^40; at most 2^24 triggers). Returns each trigger's partials,
// and leaves `state` and `stats` as bounding them trigger by trigger would: a user's records are taken by
// trigger, then in stream order, and each trigger's are aggregated on their own. One pass over the state
// for several small triggers: at T = 1000 a trigger touches one user bucket in twenty, each a cache miss
// (docs/PERFORMANCE.md round 30).
std::vector<std::vector<KeyPartial>> bound_and_aggregate_batch(const std::vector<std::span<const Record>>& triggers,
                                                               const BoundingParams& params, UserState& state,
                                                               BoundingStats& stats);

}  // namespace dpstream::kernels
