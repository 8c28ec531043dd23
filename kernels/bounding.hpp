// Contribution bounding on the user owner: at most C records per user per window, chosen by
// stream order; values clamped; per-(user, key) aggregation with a first-touch flag. Partials are
// not pre-reduced by key here: a per-thread key map cost a cache miss per record (17% of a run), while
// the key owner sorts its partials by key anyway (KeyStateTable::accumulate's radix sort).
#pragma once

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
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

// One user's record in the user table (UserState): user id (8 bytes), state (1: fingerprints already journaled
// in bits 0-5, kept count changed since the last drain in bit 6), kept count (1 byte; kWideKept: in the shard's
// wide_kept map), then its key fingerprints (16 bits each). How many it holds is in its bucket's directory.
// Unaligned: read and written with memcpy.
namespace user_record {
inline constexpr std::size_t kHead = 10;
inline constexpr std::uint8_t kWideKept = 255;
inline constexpr std::uint8_t kChanged = 1u << 6;
inline std::uint64_t user(const std::uint8_t* r) {
  std::uint64_t u;
  std::memcpy(&u, r, sizeof u);
  return u;
}
inline std::uint8_t state(const std::uint8_t* r) { return r[8]; }
inline void set_state(std::uint8_t* r, std::uint8_t s) { r[8] = s; }
inline std::uint32_t journaled(std::uint8_t s) { return s & 63u; }
inline std::uint8_t with_journaled(std::uint8_t s, std::uint32_t done) {
  return static_cast<std::uint8_t>((s & ~63u) | done);
}
inline std::uint8_t kept_byte(const std::uint8_t* r) { return r[9]; }
inline void set_kept_byte(std::uint8_t* r, std::uint8_t k) { r[9] = k; }
inline std::size_t size(std::uint32_t held) { return kHead + std::size_t{2} * held; }
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
// counted for; more go to an exact (user, fingerprint) set. A bucket starts with a directory of its records,
// two bytes each: a tag (8 bits of the user's slot hash that neither its shard nor its home takes) and the
// record's fingerprint count; the records lie packed at the bucket's end, the first at the very end. So a
// lookup compares the tags in the bucket's first line at once and computes where the record starts from the
// counts before it, instead of walking every record before it (a chain of dependent loads whose exit
// mispredicted about once a user: docs/PERFORMANCE.md round 45). A user costs 12 + 2 x keys bytes (paper
// workload: ~6 keys, 24 bytes) over the table's load.
//
// Buckets are probed linearly from the user's home bucket (from slot_hash): a record lies in the first
// bucket from home that had room when it was placed, or moved to when it grew (the records after it in the
// bucket shift to make room for a fingerprint, or the record moves on to the next bucket with room). A bucket
// a record passed is flagged, and a lookup goes on past flagged buckets only. The table grows (by 1/8)
// before its records and directories fill kMaxLoadPercent of its bytes.
//
// First touches: a user adds at most 1 to a key's user count. Two keys of the same user with equal
// fingerprints (probability < C / 2^16 per new key) count that user once for both: an under-count
// of that user's own contribution only, never another user's, and never an over-count (a false
// negative is impossible: a key always has its fingerprint). docs/PRIVACY.md section 4.
class UserState {
 public:
  static constexpr std::size_t kShards = 256;
  // Four cache lines: three records of 32 keys (74 bytes and their directory entries) fit one, so a table of
  // such users fills to its load limit; in 128-byte buckets one did, and such a table cost 218 B per user.
  static constexpr std::size_t kBucketBytes = 256;
  static constexpr std::uint32_t kInline = 32;           // fingerprints in a record (10 + 64 = 74 bytes)
  static_assert(kInline < 64);                           // user_record's 6-bit journaled count
  static constexpr std::uint32_t kMaxRecords = 16;       // in a bucket: its directory's tags fill one 16-byte vector
  static constexpr std::uint32_t kFingerprintBits = 16;  // key_fingerprint's values are below 2^16
  static constexpr std::uint32_t kMaxLoadPercent = 85;   // of a table's bytes for directories and records
  using UserFingerprint = std::pair<std::uint64_t, std::uint32_t>;  // (user, key fingerprint)
  // Where a user's record lies: valid until the shard's next find_or_add or add_pair (add_pair updates
  // the one it is given), or the next reserve() or clear().
  struct UserRef {
    std::uint8_t* record = nullptr;
    std::uint32_t slot = 0;  // its entry in its bucket's directory
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
      shards_[s].for_each_record(
          [&](const std::uint8_t* r, std::uint32_t) { f(user_record::user(r), kept_of(shards_[s], r)); });
  }

  // The user's fingerprint of `key`, below 2^kFingerprintBits. Salted by the user, so that two keys
  // collide for a user with probability 2^-16 independently of other users: with one salt for all, the
  // same pairs of keys would collide for every user in every window (a pair of popular keys losing the
  // same share of their users each time).
  static std::uint32_t key_fingerprint(std::uint64_t key, std::uint64_t user);
  // The hash that places a user in its shard's table (a bijection of the id; home buckets grow with it).
  static std::uint64_t slot_hash(std::uint64_t user);
  static std::uint64_t user_of_slot_hash(std::uint64_t slot_hash);  // its inverse
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
  // up: the user's home bucket (from slot_hash(user)), all four lines: a lookup reads the directory in the first
  // and the record wherever it lies (the directory's line first and the record's once it arrived, 16 users later,
  // was 8% slower: bench_bounding). A hint: a stale one costs nothing but a line.
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
  // Directory entries from byte kDirectory on: (tag, fingerprint count) of record i at kDirectory + 2 i; records
  // from the end: record i's last byte is just before record i - 1's first.
  struct alignas(64) Bucket {
    static constexpr std::size_t kDirectory = 3;
    static constexpr std::size_t kRoom = kBucketBytes - kDirectory;  // for directory entries and records
    std::uint8_t bytes[kBucketBytes] = {};
    std::uint8_t* base() { return bytes; }
    const std::uint8_t* base() const { return bytes; }
    // Records; flags (kPassed: a record placed past this bucket may have its home at or before it); record bytes.
    std::uint8_t& count() { return bytes[0]; }
    std::uint8_t count() const { return bytes[0]; }
    std::uint8_t& flags() { return bytes[1]; }
    std::uint8_t flags() const { return bytes[1]; }
    std::uint8_t& used() { return bytes[2]; }
    std::uint8_t used() const { return bytes[2]; }
    static std::size_t entry(std::uint32_t i) { return kDirectory + 2 * std::size_t{i}; }  // record i's tag, then count
    std::uint32_t tag(std::uint32_t i) const { return bytes[entry(i)]; }
    std::uint32_t held(std::uint32_t i) const { return bytes[entry(i) + 1]; }
    void set_entry(std::uint32_t i, std::uint32_t tag, std::uint32_t held) {
      bytes[entry(i)] = static_cast<std::uint8_t>(tag);
      bytes[entry(i) + 1] = static_cast<std::uint8_t>(held);
    }
    void set_held(std::uint32_t i, std::uint32_t n) { bytes[entry(i) + 1] = static_cast<std::uint8_t>(n); }
    std::size_t free_bytes() const { return kRoom - 2 * std::size_t{count()} - used(); }
    // Record i's first byte, from the sizes of the records 0..i (the directory's counts).
    std::uint8_t* record(std::uint32_t i) { return bytes + kBucketBytes - bytes_through(i); }
    const std::uint8_t* record(std::uint32_t i) const { return bytes + kBucketBytes - bytes_through(i); }
    std::uint8_t* lowest() { return bytes + kBucketBytes - used(); }  // the last record's first byte
    std::size_t bytes_through(std::uint32_t i) const;
#if defined(__SSE2__)
    static __m128i directory_bytes(const Bucket& b, int half);
#endif
    // Bit i set for each record i whose tag is `tag`.
    std::uint32_t tag_matches(std::uint32_t tag) const;
  };
  static_assert(sizeof(Bucket) == kBucketBytes);
  static_assert(Bucket::kRoom <= 255, "Bucket::used counts its bytes in 8 bits");
  static_assert(user_record::kHead + std::size_t{2} * kInline + 2 <= Bucket::kRoom, "a full record fits a bucket");
  static std::uint32_t tag_of(std::uint64_t slot_hash) { return static_cast<std::uint32_t>(slot_hash >> 8) & 0xffu; }
  struct Shard {
    TableSlots<Bucket> buckets;
    std::uint64_t users = 0, pairs = 0;
    std::uint64_t record_bytes = 0;                               // of all records and their entries: the table's load
    absl::flat_hash_map<std::uint64_t, std::uint32_t> wide_kept;  // kept counts of kWideKept or more
    absl::flat_hash_set<UserFingerprint> overflow;                // beyond kInline fingerprints
    std::vector<UserFingerprint> overflow_journal;
    JournalSize pending;   // what drain_journal will return (its new_pairs include overflow_journal)
    GroupMarks<1> marked;  // buckets that may hold a pending record
    static std::size_t home_in(std::size_t buckets, std::uint64_t slot_hash);  // monotone in the hash
    std::size_t home_of(std::uint64_t slot_hash) const;
    std::size_t bucket_of(const std::uint8_t* record) const;
    UserRef find(std::uint64_t user, std::uint64_t slot_hash);  // record nullptr: not found
    // A record of `held` fingerprints (its bytes to be written by the caller) at the end of the first bucket
    // of `table` with room, from `from` on, flagging the buckets passed; nullptr if none has room.
    static UserRef place_in(TableSlots<Bucket>& table, std::size_t from, std::uint32_t tag, std::uint32_t held);
    // place_in() this table, growing it first while it is over its load, and again when no bucket has
    // room (docs/PERFORMANCE.md rounds 13 and 15: buckets of three full records keep that rare).
    UserRef place_or_grow(std::size_t from, std::uint64_t slot_hash, std::uint32_t held);
    UserRef grow_record(UserRef u);  // one more fingerprint's room at its end; returns where it is now
    // grow_record where its bucket has no room or the table is at its load: grows the table or moves it on.
    UserRef grow_record_elsewhere(UserRef u);
    UserRef widen_in_bucket(Bucket& bucket, UserRef u);  // it has room: it and the records after it shift
    bool over_load(std::size_t more) const;              // its records and entries, with `more` bytes, over the load
    bool over_count() const;                             // one more record puts its entries over the load
    static std::size_t grown(std::size_t buckets);       // by 1/8 and a bucket
    void grow();
    // Moves every record to a table of `buckets` buckets, or of more while one finds no room there; the
    // current table stays as it is until the new one holds them all (a failed allocation loses nothing).
    void rehash(std::size_t buckets, const TableAllocator<Bucket>& alloc = {});
    bool copy_records_to(TableSlots<Bucket>& table) const;  // false when one found no room
    template <class B, class F>  // f(record, held) for every record of bucket `b` (const or not)
    static void for_each_in(B& b, F&& f) {
      for (std::uint32_t i = 0, end = 0; i < b.count(); ++i) {
        end += static_cast<std::uint32_t>(user_record::size(b.held(i)));
        f(b.base() + kBucketBytes - end, b.held(i));
      }
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
