#include "kernels/bounding.hpp"

#include <omp.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <stdexcept>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "common/default_init.hpp"
#include "common/fault_injection.hpp"
#include "common/prefetch.hpp"
#include "partition/hash.hpp"
#include "partition/radix_sort.hpp"

namespace dpstream::kernels {

namespace {

namespace rec = user_record;
constexpr std::uint8_t kPassed = 1;  // Bucket::flags

// Journaled count after appending one fingerprint to `held` of which `done` are journaled. With the
// journal off the new one needs no record, but earlier ones still pending must stay pending: it
// counts as recorded only when nothing before it is pending (recording too much is harmless, losing
// a pending pair would let a resume count the user twice for its key).
std::uint32_t recorded_after_add(std::uint32_t done, std::uint32_t held, bool journal) {
  return !journal && done == held ? held + 1 : done;
}

// Everything of the record is in the journal: nothing of it is pending any more.
void mark_journaled(std::uint8_t* r, std::uint32_t held) {
  rec::set_state(r, rec::with_journaled(static_cast<std::uint8_t>(rec::state(r) & ~rec::kChanged), held));
}

bool record_pending(const std::uint8_t* record, std::uint32_t held) {
  const std::uint8_t s = rec::state(record);
  return (s & rec::kChanged) != 0 || rec::journaled(s) != held;
}

// Whether the record's `held` fingerprints include `f`, 8 at a time, without a branch on where it is found (the
// scan's exit mispredicted about once a first touch, cachegrind). Up to 8: the 16 bytes that end where the record
// ends, the bytes before its fingerprints masked off (they lie in its bucket: above a bucket's header and directory
// lie at least one record's 10-byte head and the directory's 2 bytes a record). More: vectors from the last 8 down,
// and the first 8 (overlapping the vector after them).
bool holds_fingerprint(const std::uint8_t* record, std::uint32_t held, std::uint32_t f) {
#if defined(__SSE2__)
  const __m128i want = _mm_set1_epi16(static_cast<std::int16_t>(f));
  const auto equal_at = [&](const std::uint8_t* at) {
    return static_cast<std::uint32_t>(
        _mm_movemask_epi8(_mm_cmpeq_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)), want)));
  };
  if (held <= 8) return (equal_at(record + rec::size(held) - 16) >> (16 - 2 * held)) != 0;
  const std::uint8_t* const fingerprints = record + rec::kHead;
  std::uint32_t equal = equal_at(fingerprints);
  for (std::size_t end = 2 * std::size_t{held}; end > 16; end -= 16) equal |= equal_at(fingerprints + end - 16);
  return equal != 0;
#else
  for (std::uint32_t i = 0; i < held; ++i)
    if (rec::fingerprint(record, i) == f) return true;
  return false;
#endif
}

}  // namespace

#if defined(__SSE2__)
// Byte `half` (0: tag, 1: count) of the directory's 16 entries, one per lane: its first 32 bytes deinterleaved.
__m128i UserState::Bucket::directory_bytes(const Bucket& b, int half) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.bytes + kDirectory));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.bytes + kDirectory + 16));
  if (half == 1) return _mm_packus_epi16(_mm_srli_epi16(lo, 8), _mm_srli_epi16(hi, 8));
  const __m128i low_bytes = _mm_set1_epi16(0x00ff);
  return _mm_packus_epi16(_mm_and_si128(lo, low_bytes), _mm_and_si128(hi, low_bytes));
}
#endif

std::size_t UserState::Bucket::bytes_through(std::uint32_t i) const {
#if defined(__SSE2__)
  // The counts of entries 0..i summed in one vector.
  const __m128i held = directory_bytes(*this, 1);
  const __m128i lanes = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m128i through = _mm_cmplt_epi8(lanes, _mm_set1_epi8(static_cast<char>(i + 1)));
  const __m128i sums = _mm_sad_epu8(_mm_and_si128(held, through), _mm_setzero_si128());
  const auto fingerprints =
      static_cast<std::size_t>(_mm_cvtsi128_si64(sums) + _mm_cvtsi128_si64(_mm_unpackhi_epi64(sums, sums)));
#else
  std::size_t fingerprints = 0;
  for (std::uint32_t j = 0; j <= i; ++j) fingerprints += held(j);
#endif
  return rec::kHead * (i + 1) + 2 * fingerprints;
}

std::uint32_t UserState::Bucket::tag_matches(std::uint32_t t) const {
#if defined(__SSE2__)
  // Entries past the count are masked off.
  const __m128i tags = directory_bytes(*this, 0);
  const auto equal =
      static_cast<std::uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(tags, _mm_set1_epi8(static_cast<char>(t)))));
  return equal & ((std::uint32_t{1} << count()) - 1);
#else
  std::uint32_t equal = 0;
  for (std::uint32_t i = 0; i < count(); ++i) equal |= (tag(i) == t ? 1u : 0u) << i;
  return equal;
#endif
}

std::uint64_t UserState::slot_hash(std::uint64_t user) {
  return partition::salted_hash(user, partition::kUserSlotSalt);
}

std::uint64_t UserState::user_of_slot_hash(std::uint64_t hash) {
  return partition::salted_unhash(hash, partition::kUserSlotSalt);
}

std::size_t UserState::Shard::home_in(std::size_t buckets, std::uint64_t slot_hash) {
  return static_cast<std::size_t>(static_cast<uint128>(slot_hash) * buckets >> 64);  // uniform on [0, buckets)
}

std::size_t UserState::Shard::home_of(std::uint64_t slot_hash) const { return home_in(buckets.size(), slot_hash); }

std::size_t UserState::Shard::bucket_of(const std::uint8_t* record) const {
  return static_cast<std::size_t>(record - buckets.data()->base()) / kBucketBytes;
}

UserState::UserRef UserState::Shard::find(std::uint64_t user, std::uint64_t hash) {
  const std::uint32_t tag = tag_of(hash);
  std::size_t b = home_of(hash);
  for (std::size_t n = 0; n < buckets.size(); ++n, b = next_slot(b, buckets.size())) {
    Bucket& bucket = buckets[b];
    for (std::uint32_t m = bucket.tag_matches(tag); m != 0; m &= m - 1) {
      const auto i = static_cast<std::uint32_t>(std::countr_zero(m));
      std::uint8_t* r = bucket.record(i);
      if (rec::user(r) == user) return {r, i};
    }
    if ((bucket.flags() & kPassed) == 0) return {};
  }
  return {};
}

bool UserState::Shard::over_load(std::size_t more) const {
  return (record_bytes + more) * 100 > buckets.size() * Bucket::kRoom * kMaxLoadPercent;
}

// Records of few fingerprints fill a bucket's kMaxRecords entries before its bytes (16 of no fingerprint take 192
// of 253 bytes): without this limit the table would fill by count, and placing a record would probe ever longer.
bool UserState::Shard::over_count() const { return (users + 1) * 100 > buckets.size() * kMaxRecords * kMaxLoadPercent; }

std::size_t UserState::Shard::grown(std::size_t buckets) { return std::max<std::size_t>(4, buckets + buckets / 8 + 1); }

UserState::UserRef UserState::Shard::place_in(TableSlots<Bucket>& table, std::size_t from, std::uint32_t tag,
                                              std::uint32_t held) {
  const std::size_t size = rec::size(held);
  std::size_t b = from;
  for (std::size_t n = 0; n < table.size(); ++n, b = next_slot(b, table.size())) {
    Bucket& bucket = table[b];
    if (bucket.count() < kMaxRecords && bucket.free_bytes() >= size + 2) {
      const std::uint32_t i = bucket.count();
      bucket.set_entry(i, tag, held);
      bucket.count() = static_cast<std::uint8_t>(i + 1);
      bucket.used() = static_cast<std::uint8_t>(bucket.used() + size);
      return {bucket.lowest(), i};
    }
    bucket.flags() |= kPassed;
  }
  return {};
}

UserState::UserRef UserState::Shard::place_or_grow(std::size_t from, std::uint64_t hash, std::uint32_t held) {
  const std::size_t bytes = rec::size(held) + 2;
  if (buckets.empty() || over_load(bytes) || over_count()) {
    grow();
    from = home_of(hash);
  }
  for (;;) {
    if (const UserRef at = place_in(buckets, from, tag_of(hash), held); at.record != nullptr) {
      record_bytes += bytes;
      return at;
    }
    grow();
    from = home_of(hash);
  }
}

UserState::UserRef UserState::Shard::grow_record(UserRef u) {
  Bucket& bucket = buckets[bucket_of(u.record)];
  if (bucket.free_bytes() < 2 || over_load(2)) return grow_record_elsewhere(u);
  return widen_in_bucket(bucket, u);
}

UserState::UserRef UserState::Shard::widen_in_bucket(Bucket& bucket, UserRef u) {
  // The record and those after it (below it) move down by two bytes; its new fingerprint goes at its end.
  std::uint8_t* const low = bucket.lowest();
  const std::uint32_t held = bucket.held(u.slot);
  std::memmove(low - 2, low, static_cast<std::size_t>(u.record - low) + rec::size(held));
  bucket.set_held(u.slot, held + 1);
  bucket.used() = static_cast<std::uint8_t>(bucket.used() + 2);
  record_bytes += 2;
  return {u.record - 2, u.slot};
}

UserState::UserRef UserState::Shard::grow_record_elsewhere(UserRef u) {
  if (over_load(2)) {
    const std::uint64_t user = rec::user(u.record);
    grow();
    u = find(user, slot_hash(user));
    if (u.record == nullptr) throw std::logic_error("UserState: a record lost in a rehash");
  }
  Bucket& bucket = buckets[bucket_of(u.record)];
  if (bucket.free_bytes() >= 2) return widen_in_bucket(bucket, u);
  const std::uint32_t held = bucket.held(u.slot);
  const std::size_t size = rec::size(held);
  // Moves on: out of this bucket (the records after it move up into its place, the directory entries after
  // its close up) to the first with room after it, which keeps it on its probe from home (this bucket gets
  // flagged, as the ones before it were). The moved record has room for one more fingerprint, left unset.
  std::uint8_t copy[rec::kHead + std::size_t{2} * kInline];
  std::memcpy(copy, u.record, size);
  std::uint8_t* const low = bucket.lowest();
  std::memmove(low + size, low, static_cast<std::size_t>(u.record - low));
  std::uint8_t* const entry = bucket.base() + Bucket::entry(u.slot);
  std::memmove(entry, entry + 2, 2 * (std::size_t{bucket.count()} - u.slot - 1));
  bucket.count() = static_cast<std::uint8_t>(bucket.count() - 1);
  bucket.used() = static_cast<std::uint8_t>(bucket.used() - size);
  record_bytes -= size + 2;
  const std::uint64_t user = rec::user(copy);
  const UserRef moved = place_or_grow(bucket_of(u.record), slot_hash(user), held + 1);
  std::memcpy(moved.record, copy, size);
  if (record_pending(moved.record, held + 1)) marked.note(bucket_of(moved.record));
  return moved;
}

void UserState::Shard::grow() { rehash(grown(buckets.size())); }

bool UserState::Shard::copy_records_to(TableSlots<Bucket>& table) const {
  bool placed = true;
  for (const Bucket& b : buckets) {
    for_each_in(b, [&](const std::uint8_t* r, std::uint32_t held) {
      const std::uint64_t hash = slot_hash(rec::user(r));
      const UserRef at = placed ? place_in(table, home_in(table.size(), hash), tag_of(hash), held) : UserRef{};
      if (at.record != nullptr) std::memcpy(at.record, r, rec::size(held));
      placed = at.record != nullptr;
    });
    if (!placed) return false;
  }
  return true;
}

void UserState::Shard::rehash(std::size_t capacity, const TableAllocator<Bucket>& alloc) {
  TableSlots<Bucket> table(capacity, alloc);
  while (!copy_records_to(table)) TableSlots<Bucket>(grown(table.size())).swap(table);
  marked.rehash(table.size());
  buckets.swap(table);
}

void UserState::clear() {
  for (auto& sh : shards_) sh = Shard{};
  slab_ = TableSlab{};
}

// Bytes expected: 12 per user (its record's head and directory entry) and 2 per pair inline (the rest in the
// overflow set), and at least a bucket's room over kMaxRecords per user (its entries: over_count); buckets for
// them at most kMaxLoadPercent full, with four standard deviations of a shard's share to spare.
void UserState::reserve(std::uint64_t users, std::uint64_t pairs) {
  const double per_shard_users = static_cast<double>(users) / kShards;
  const double pairs_per_user =
      users == 0 ? 0.0 : std::min<double>(kInline, static_cast<double>(pairs) / static_cast<double>(users));
  const double bytes_per_user =
      std::max(rec::kHead + 2 + 2 * pairs_per_user, static_cast<double>(Bucket::kRoom) / kMaxRecords);
  const double bytes = (per_shard_users + 4 * std::sqrt(per_shard_users)) * bytes_per_user;
  const auto capacity =
      static_cast<std::size_t>(std::ceil(bytes * 100 / kMaxLoadPercent / static_cast<double>(Bucket::kRoom)));
  if (capacity < 4) return;
  reserve_shards<Bucket>(
      slab_, kShards, capacity, [&](std::size_t s) { return shards_[s].buckets.size(); },
      [&](std::size_t s, const TableAllocator<Bucket>& alloc) { shards_[s].rehash(capacity, alloc); });
}

void UserState::clear_journal() {
#pragma omp parallel for schedule(dynamic, 8)
  for (std::size_t s = 0; s < kShards; ++s) {
    Shard& sh = shards_[s];
    sh.marked.drain(
        sh.buckets.size(), [](std::size_t) {},
        [&](std::size_t b) { Shard::for_each_in(sh.buckets[b], mark_journaled); });
    std::vector<UserFingerprint>().swap(sh.overflow_journal);
    sh.pending = {};
  }
}

bool UserState::journal_empty() const {
  const JournalSize j = journal_size();
  return j.changed_users == 0 && j.new_pairs == 0;
}

std::uint32_t UserState::key_fingerprint(std::uint64_t key, std::uint64_t user) {
  const std::uint64_t salt = partition::salted_hash(user, partition::kFingerprintSalt);
  return static_cast<std::uint32_t>(partition::salted_hash(key, salt) >> (64 - kFingerprintBits));
}

std::pair<UserState::UserRef, bool> UserState::find_or_add(std::size_t shard, std::uint64_t user) {
  return find_or_add(shard, user, slot_hash(user));
}

std::pair<UserState::UserRef, bool> UserState::find_or_add(std::size_t shard, std::uint64_t user, std::uint64_t hash) {
  Shard& sh = shards_[shard];
  if (const UserRef found = sh.find(user, hash); found.record != nullptr) return {found, false};
  const UserRef r = sh.place_or_grow(sh.home_of(hash), hash, 0);
  std::memcpy(r.record, &user, sizeof user);
  rec::set_state(r.record, 0);
  rec::set_kept_byte(r.record, 0);
  ++sh.users;
  return {r, true};
}

void UserState::set_wide_kept(std::size_t shard, UserRef u, std::uint32_t kept) {
  Shard& sh = shards_[shard];
  if (rec::kept_byte(u.record) == rec::kWideKept) sh.wide_kept.erase(rec::user(u.record));
  rec::set_kept_byte(u.record, static_cast<std::uint8_t>(std::min<std::uint32_t>(kept, rec::kWideKept)));
  if (kept >= rec::kWideKept) sh.wide_kept[rec::user(u.record)] = kept;
}

void UserState::prefetch_slot(std::size_t shard, std::uint64_t slot_hash) const {
  const Shard& sh = shards_[shard];
  if (!sh.buckets.empty()) dpstream::prefetch_object(&sh.buckets[sh.home_of(slot_hash)]);
}

bool UserState::add_pair(std::size_t shard, std::uint64_t user, UserRef& u, std::uint32_t fingerprint) {
  if (fingerprint >> kFingerprintBits != 0)
    throw std::out_of_range("UserState: a key fingerprint of more than kFingerprintBits bits");
  Shard& sh = shards_[shard];
  const std::uint32_t n = sh.buckets[sh.bucket_of(u.record)].held(u.slot);
  if (holds_fingerprint(u.record, n, fingerprint)) return false;
  if (n == kInline) {
    if (!sh.overflow.insert({user, fingerprint}).second) return false;
    if (journal) {
      sh.overflow_journal.emplace_back(user, fingerprint);
      ++sh.pending.new_pairs;
    }
    ++sh.pairs;
    return true;
  }
  const std::uint8_t state = rec::state(u.record);
  u = sh.grow_record(u);
  rec::set_fingerprint(u.record, n, static_cast<std::uint16_t>(fingerprint));
  const std::uint32_t done = recorded_after_add(rec::journaled(state), n, journal);
  rec::set_state(u.record, rec::with_journaled(state, done));
  if (done <= n) {
    ++sh.pending.new_pairs;
    sh.marked.note(sh.bucket_of(u.record));
  }
  ++sh.pairs;
  return true;
}

void UserState::mark_changed(std::size_t shard, UserRef u) {
  Shard& sh = shards_[shard];
  const std::uint8_t s = rec::state(u.record);
  sh.pending.changed_users += (s & rec::kChanged) == 0 ? 1 : 0;
  rec::set_state(u.record, static_cast<std::uint8_t>(s | rec::kChanged));
  sh.marked.note(sh.bucket_of(u.record));
}

UserState::JournalSize UserState::journal_size(std::size_t shard) const { return shards_[shard].pending; }

UserState::JournalSize UserState::journal_size() const {
  JournalSize total;
  for (const Shard& sh : shards_) {
    total.changed_users += sh.pending.changed_users;
    total.new_pairs += sh.pending.new_pairs;
  }
  return total;
}

std::vector<UserState::UserFingerprint> UserState::pairs(std::size_t shard) const {
  const Shard& sh = shards_[shard];
  std::vector<UserFingerprint> out;
  out.reserve(sh.pairs);
  sh.for_each_record([&](const std::uint8_t* r, std::uint32_t held) {
    for (std::uint32_t i = 0; i < held; ++i) out.emplace_back(rec::user(r), rec::fingerprint(r, i));
  });
  out.insert(out.end(), sh.overflow.begin(), sh.overflow.end());
  return out;
}

void UserState::drain_journal(std::size_t shard, std::vector<UserFingerprint>& changed_users,
                              std::vector<UserFingerprint>& new_pairs) {
  Shard& sh = shards_[shard];
  // Sized from the counts, not grown by doubling: the commit holds these until they are written.
  changed_users.reserve(changed_users.size() + sh.pending.changed_users);
  new_pairs.reserve(new_pairs.size() + sh.pending.new_pairs);
  // Only the buckets noted since the last drain can hold a pending record (GroupMarks).
  sh.marked.drain(
      sh.buckets.size(), [&](std::size_t b) { dpstream::prefetch_object(&sh.buckets[b]); },
      [&](std::size_t b) {
        Shard::for_each_in(sh.buckets[b], [&](std::uint8_t* r, std::uint32_t held) {
          if (!record_pending(r, held)) return;
          const std::uint8_t s = rec::state(r);
          if ((s & rec::kChanged) != 0) changed_users.emplace_back(rec::user(r), kept_of(sh, r));
          for (std::uint32_t i = rec::journaled(s); i < held; ++i)
            new_pairs.emplace_back(rec::user(r), rec::fingerprint(r, i));
          mark_journaled(r, held);
        });
      });
  new_pairs.insert(new_pairs.end(), sh.overflow_journal.begin(), sh.overflow_journal.end());
  std::vector<UserFingerprint>().swap(sh.overflow_journal);
  sh.pending = {};
}

std::uint64_t UserState::users() const {
  std::uint64_t n = 0;
  for (const auto& sh : shards_) n += sh.users;
  return n;
}

std::uint64_t UserState::user_key_pairs() const {
  std::uint64_t n = 0;
  for (const auto& sh : shards_) n += sh.pairs;
  return n;
}

std::uint64_t UserState::memory_bytes() const {
  std::uint64_t b = slab_.bytes();
  for (const auto& sh : shards_)
    b += (slab_.holds(sh.buckets.data()) ? 0 : sh.buckets.capacity() * sizeof(Bucket)) +
         hash_table_bytes(sh.wide_kept) + hash_table_bytes(sh.overflow) +
         sh.overflow_journal.capacity() * sizeof(UserFingerprint);
  return b;
}

std::uint64_t UserState::digest(std::uint64_t seed) const {
  constexpr std::uint64_t kPairDomain = 0x5061697273ULL;  // pairs hash apart from kept counts
  std::uint64_t total = 0;
#pragma omp parallel for schedule(dynamic, 4) reduction(+ : total)
  for (std::size_t s = 0; s < kShards; ++s) {
    const Shard& sh = shards_[s];
    sh.for_each_record([&](const std::uint8_t* r, std::uint32_t held) {
      const std::uint64_t u = partition::hash_combine(seed, rec::user(r));
      total += partition::hash_combine(u, kept_of(sh, r));
      for (std::uint32_t i = 0; i < held; ++i)
        total += partition::hash_combine(u ^ kPairDomain, rec::fingerprint(r, i));
    });
    for (const auto& [user, fingerprint] : sh.overflow)
      total += partition::hash_combine(partition::hash_combine(seed, user) ^ kPairDomain, fingerprint);
  }
  return total;
}

namespace {

struct alignas(64) ThreadOut {                    // padded: threads update their own counters
  std::vector<std::vector<KeyPartial>> partials;  // per trigger of the batch
  BoundingStats stats;
};

// A batch's records, each named by one index: its trigger's place in the batch in the high bits, its place
// in that trigger's records in the low ones. Index order is trigger order, then arrival order.
class BatchRecords {
 public:
  static constexpr int kPositionBits = 40;
  static constexpr std::uint64_t kMaxPerTrigger = std::uint64_t{1} << kPositionBits;
  static constexpr std::size_t kMaxTriggers = std::size_t{1} << (64 - kPositionBits);
  explicit BatchRecords(const std::vector<std::span<const Record>>& triggers) {
    if (triggers.empty() || triggers.size() > kMaxTriggers)
      throw std::invalid_argument("bounding: a batch holds 1 to 2^24 triggers");
    for (const auto& t : triggers) {
      if (t.size() >= kMaxPerTrigger) throw std::invalid_argument("bounding: 2^40 records or more in one trigger");
      bases_.push_back(t.data());
    }
  }
  static std::uint64_t index(std::size_t trigger, std::size_t position) {
    return static_cast<std::uint64_t>(trigger) << kPositionBits | position;
  }
  static std::size_t trigger_of(std::uint64_t index) { return static_cast<std::size_t>(index >> kPositionBits); }
  const Record& at(std::uint64_t index) const { return bases_[trigger_of(index)][index & (kMaxPerTrigger - 1)]; }

 private:
  std::vector<const Record*> bases_;
};

// A record of the batch as bounding groups and sorts it: its user's slot hash (a bijection of the user id, so
// equal hashes are equal users, and the id is UserState::user_of_slot_hash of it), its BatchRecords index, key and
// value. 32 bytes, two a line: visiting users in hash order then reads them in order, where reading the 40-byte
// records by index fetched 1-2 lines at random per user (perf: the records' prefetches and loads held 15% of
// bounding's own samples). Timestamp and position stay in the record: only a user the limit cuts needs them.
struct alignas(32) UserRecord {
  std::uint64_t slot_hash;
  std::uint64_t index;  // BatchRecords::index
  std::uint64_t key;
  double value;
};
static_assert(sizeof(UserRecord) == 32);
// A function object, so that the sorts inline the compare (given a function's address, std::sort called it).
constexpr auto hash_then_arrival = [](const UserRecord& a, const UserRecord& b) {
  return (static_cast<uint128>(a.slot_hash) << 64 | a.index) < (static_cast<uint128>(b.slot_hash) << 64 | b.index);
};

// By (slot hash, index): insertion for a few entries (group_by_user's shards of at most 16; std::sort's call cost
// more than their sort), std::sort beyond unless already in order (one heavy user's entries come in index order).
void sort_small(UserRecord* from, UserRecord* to) {
  if (to - from < 2) return;
  if (to - from > 16) {
    if (!std::is_sorted(from, to, hash_then_arrival)) std::sort(from, to, hash_then_arrival);
    return;
  }
  for (UserRecord* i = from + 1; i != to; ++i) {
    const UserRecord e = *i;
    UserRecord* j = i;
    for (; j != from && hash_then_arrival(e, *(j - 1)); --j) *j = *(j - 1);
    *j = e;
  }
}

// The batch's records as UserRecord entries (slot hash, index, key, value) grouped by shard (UserState::shard_of), in
// index order within a shard: a stable counting sort that hashes each record once (the hash gives the shard and the
// order within it), into memory that is not zero-filled first.
class ShardedEntries {
 public:
  explicit ShardedEntries(const std::vector<std::span<const Record>>& triggers) {
    for (const auto& t : triggers) size_ += t.size();
    entries_.reset(new UserRecord[size_]);  // default-initialized: every entry is written below
    std::unique_ptr<std::uint64_t[]> hashes(new std::uint64_t[size_]);
    const int threads = size_ < 65536 ? 1 : omp_get_max_threads();
    // Thread t of the nt started (the runtime may start fewer than asked) takes the t-th block of the records
    // (in index order) in both passes; its part of a shard follows thread t - 1's.
    std::vector<std::array<std::uint64_t, UserState::kShards>> next(static_cast<std::size_t>(threads));
#pragma omp parallel num_threads(threads)
    {
      const auto nt = static_cast<std::size_t>(omp_get_num_threads());
      const auto t = static_cast<std::size_t>(omp_get_thread_num());
      const std::size_t lo = size_ * t / nt, hi = size_ * (t + 1) / nt;
      std::array<std::uint64_t, UserState::kShards>& count = next[t];
      count.fill(0);
      for_each_in(triggers, lo, hi, [&](std::size_t i, std::size_t trigger, std::size_t position) {
        const std::uint64_t h = UserState::slot_hash(triggers[trigger][position].user);
        hashes[i] = h;
        ++count[UserState::shard_of_slot_hash(h)];
      });
#pragma omp barrier
#pragma omp single
      {
        std::uint64_t running = 0;
        for (std::size_t s = 0; s < UserState::kShards; ++s) {
          shard_start_[s] = running;
          for (std::size_t u = 0; u < nt; ++u) running += std::exchange(next[u][s], running);
        }
        shard_start_[UserState::kShards] = running;
      }
      for_each_in(triggers, lo, hi, [&](std::size_t i, std::size_t trigger, std::size_t position) {
        const std::uint64_t h = hashes[i];
        const std::uint64_t at = count[UserState::shard_of_slot_hash(h)]++;
        const Record& r = triggers[trigger][position];
        entries_[at] = {h, BatchRecords::index(trigger, position), r.key, r.value};
        // 256 streams written at random, likely more than the hardware prefetch follows: each shard's next line
        // fetched before its stores reach it (bench_bounding 1-2 ns a record lower, PERFORMANCE round 46).
        if (at + kEntriesAhead < size_) dpstream::prefetch(entries_.get() + at + kEntriesAhead);
      });
    }
  }
  static constexpr std::uint64_t kEntriesAhead = 4;  // two lines of 32-byte entries
  UserRecord* data() { return entries_.get(); }
  // Where shard s's entries begin; shard_begin(kShards) is the batch's size.
  std::uint64_t shard_begin(std::size_t s) const { return shard_start_[s]; }

 private:
  // f(i, t, position) for the batch's records i in [lo, hi) (counted over the triggers in index order): the
  // position-th record of trigger t.
  template <class F>
  static void for_each_in(const std::vector<std::span<const Record>>& triggers, std::size_t lo, std::size_t hi, F&& f) {
    std::size_t first = 0;
    for (std::size_t t = 0; t < triggers.size() && first < hi; first += triggers[t].size(), ++t) {
      const std::size_t from = std::max(lo, first), to = std::min(hi, first + triggers[t].size());
      for (std::size_t i = from; i < to; ++i) f(i, t, i - first);
    }
  }

  std::size_t size_ = 0;
  std::unique_ptr<UserRecord[]> entries_;
  std::array<std::uint64_t, UserState::kShards + 1> shard_start_{};
};

// Bounds a run of shards' records on one thread. Users are visited in groups (a user's records of the
// batch); their state is random in memory, so its home bucket is prefetched kSlotAhead users ahead (prefetch_user):
// the DRAM latency of many users overlaps instead of adding up. bound_user puts a user's records in stream order where
// the limit cuts them, not the sort by user, where reading them missed the cache for every user with several records
// (perf: 6% of bounding). Prefetches retire at once,
// where loads that miss would fill the reorder buffer and stall it (perf: 60 ns per user with batched loads). The
// prefetch runs on across the shards of the run: per shard it started cold, and at T = 1000 (about 24 users per shard
// and trigger) most users were never prefetched.
class ShardBounder {
 public:
  static constexpr std::size_t kSlotAhead = 32;
  ShardBounder(const BoundingParams& params, UserState& state, ThreadOut& out)
      : params_(params), state_(state), out_(out) {}

  // Shards [first_shard, last_shard) of the batch's `records`, whose entries `sharded` holds, user by user in
  // slot hash order (group_by_user), each user's records by trigger (and in stream order where the limit cuts them).
  void run(std::size_t first_shard, std::size_t last_shard, const BatchRecords& records, ShardedEntries& sharded) {
    order_ = sharded.data();
    records_ = &records;
    // At most one group per entry, then the end.
    groups_.resize(sharded.shard_begin(last_shard) - sharded.shard_begin(first_shard) + 1);
    std::size_t n = 0;
    for (std::size_t s = first_shard; s < last_shard; ++s)
      n = group_by_user(sharded.shard_begin(s), sharded.shard_begin(s + 1), s, n);
    groups_[n] = {sharded.shard_begin(last_shard), last_shard};
    for (std::size_t i = 0; i < std::min(n, kSlotAhead); ++i) prefetch_user(i);
    for (std::size_t i = 0; i < n; ++i) {
      if (i + kSlotAhead < n) prefetch_user(i + kSlotAhead);
      bound_user(groups_[i].shard, groups_[i].at, groups_[i + 1].at);
    }
  }

 private:
  struct Group {  // one user's first place in order_, and its shard
    std::size_t at;
    std::size_t shard;
  };
  // The user's home bucket, and for a user of more than C records in the batch (cut by the limit unless already
  // full) the first kRecordsAhead of them (the trigger's records, read in hash order: random): bound_user puts them
  // in stream order by their timestamps. A user of C or fewer is cut at most once a window (then it is full): its
  // records are read unprefetched then, where prefetching every user of several records cost bounding 3-6%.
  static constexpr std::size_t kRecordsAhead = 4;
  void prefetch_user(std::size_t group) const {
    const std::size_t at = groups_[group].at, to = groups_[group + 1].at;
    state_.prefetch_slot(groups_[group].shard, order_[at].slot_hash);
    if (to - at <= params_.max_records_per_user) return;
    for (std::size_t i = at; i < std::min(to, at + kRecordsAhead); ++i)
      dpstream::prefetch_object(&records_->at(order_[i].index));
  }

  // Sorts order_[first, last) (shard s's entries, which must come in index order: ShardedEntries fills a shard so)
  // by (slot hash, index) and writes a Group for each user's entries to groups_ from groups_[g] on; returns the
  // index after the last one written. A stable LSD radix sort on the hash's top 2 bit_width(n) + 2 bits (two
  // digits of 2-4 counts an entry below 2048 entries, more digits of at most 2^12 counts beyond: all digits' counts,
  // passes x 2^digit_bits x 4 bytes, fit L1 (8 KiB at 480 entries, 32 KiB at 2^20)), then one walk that starts a group
  // where the hash changes, without a branch. Two users whose top bits tie (in 1/32-1/8 of the shards) may be left out
  // of hash order, or interleaved: the walk sees a hash fall, and the shard is sorted in full. Stability keeps a user's
  // entries in index order. A counting pass into 4-8 times more buckets than entries and a walk over the buckets cost
  // 117 instructions a record (cachegrind); one bucket an entry left the bucket's size to a branch that mispredicted
  // about once a user.
  std::size_t group_by_user(std::size_t first, std::size_t last, std::size_t s, std::size_t g) {
    UserRecord* const begin = order_ + first;
    const std::size_t n = last - first;
    if (n <= kSortedSmall || n > std::numeric_limits<std::uint32_t>::max()) {  // radix_sort_lsd counts in 32 bits
      sort_small(begin, begin + n);
      return append_runs(first, last, s, g);
    }
    constexpr int kMaxDigitBits = 12;
    const int key_bits = std::min(64, 2 * static_cast<int>(std::bit_width(n)) + 2);
    const int passes = std::max(2, (key_bits + kMaxDigitBits - 1) / kMaxDigitBits);  // one would count 4 n^2
    const int digit_bits = (key_bits + passes - 1) / passes;
    // Least significant digit first; the last, most significant, is the hash's top digit_bits bits.
    std::array<int, (64 + kMaxDigitBits - 1) / kMaxDigitBits> shifts{};
    for (int p = 0; p < passes; ++p) shifts[p] = 64 - std::min(64, (passes - p) * digit_bits);
    if (scratch_.size() < n) scratch_.resize(n);
    const UserRecord* const sorted = partition::radix_sort_lsd(
        begin, scratch_.data(), n, std::span<const int>(shifts.data(), passes), digit_bits,
        [](const UserRecord& e) { return e.slot_hash; }, radix_counts_);
    if (sorted != begin) std::copy_n(sorted, n, begin);
    const std::size_t g0 = g;
    Group* const out = groups_.data();
    std::uint64_t previous = begin[0].slot_hash;
    bool fell = false;
    out[g++] = {first, s};
    for (std::size_t i = 1; i < n; ++i) {
      const std::uint64_t h = begin[i].slot_hash;
      fell |= h < previous;
      out[g] = {first + i, s};  // kept only where a user starts
      g += h != previous ? 1 : 0;
      previous = h;
    }
    if (!fell) return g;
    std::sort(begin, begin + n, hash_then_arrival);
    return append_runs(first, last, s, g0);
  }
  static constexpr std::size_t kSortedSmall = 16;  // entries that an insertion sort puts in order as fast
  // A Group for each run of equal slot hashes in order_[first, last) (shard s), from groups_[g] on; the index after.
  std::size_t append_runs(std::size_t first, std::size_t last, std::size_t s, std::size_t g) {
    for (std::size_t at = first; at != last;) {
      groups_[g++] = {at, s};
      const std::uint64_t h = order_[at].slot_hash;
      while (++at != last && order_[at].slot_hash == h) {
      }
    }
    return g;
  }

  // Puts one user's entries order_[first, last) (by index) by trigger, then in stream order (timestamp,
  // position): the order of a trigger-by-trigger run, read from the records. A user's records usually arrive so (a
  // batch holds its triggers one after the other; the generator and time-sorted files emit them in stream order, and
  // the shuffle and partition keep their relative order), so they are re-sorted only when they are not.
  void in_stream_order(std::size_t first, std::size_t last) {
    const BatchRecords& records = *records_;
    const auto by_stream = [&records](const UserRecord& a, const UserRecord& b) {
      const std::size_t ta = BatchRecords::trigger_of(a.index), tb = BatchRecords::trigger_of(b.index);
      return ta != tb ? ta < tb : stream_order_less(records.at(a.index), records.at(b.index));
    };
    if (!std::is_sorted(order_ + first, order_ + last, by_stream)) std::sort(order_ + first, order_ + last, by_stream);
  }

  // One user's records of the batch (order_[from, to), by index, so by trigger; put in stream order where the
  // limit cuts them): keeps the first C - kept, clamps, counts each trigger's on its own.
  void bound_user(std::size_t s, std::size_t from, std::size_t to) {
    const std::uint64_t user = UserState::user_of_slot_hash(order_[from].slot_hash);
    auto [ref, added] = state_.find_or_add(s, user, order_[from].slot_hash);
    if (added) ++out_.stats.new_users;
    const auto n = static_cast<std::uint32_t>(to - from);
    const std::uint32_t kept = state_.kept(s, ref);
    const std::uint32_t take = std::min(n, params_.max_records_per_user - kept);
    // Stream order decides only which records the limit cuts off: kept all (or none), a trigger's records add up
    // to the same partials and fingerprints in any order (bound_trigger sorts them by key).
    if (take > 0 && take < n) in_stream_order(from, to);
    if (take > 0) state_.set_kept(s, ref, kept + take);
    out_.stats.kept += take;
    out_.stats.dropped += n - take;
    for (std::size_t at = from; at < from + take;) {  // the kept records of each trigger, in trigger order
      const std::size_t t = BatchRecords::trigger_of(order_[at].index);
      std::size_t end = at + 1;
      while (end < from + take && BatchRecords::trigger_of(order_[end].index) == t) ++end;
      bound_trigger(s, user, ref, at, end, out_.partials[t]);
      at = end;
    }
    if (state_.journal && take > 0) state_.mark_changed(s, ref);
  }

  // The user's kept records of one trigger (order_[from, to), at least one): a partial per key, its first touch
  // counted.
  void bound_trigger(std::size_t s, std::uint64_t user, UserState::UserRef& ref, std::size_t from, std::size_t to,
                     std::vector<KeyPartial>& partials) {
    if (to - from == 1) {  // most users of a trigger: one record, one key, nothing to sort or group
      const UserRecord& r = order_[from];
      count_key(s, user, ref, r.key, 1, kept_value(r.value), partials);
      return;
    }
    kept_values_.clear();
    for (std::size_t i = from; i < to; ++i) {
      const UserRecord& r = order_[i];
      kept_values_.emplace_back(r.key, kept_value(r.value));
    }
    // Per-(user, key) aggregation: sort the user's kept records by key and walk the runs.
    std::sort(kept_values_.begin(), kept_values_.end());
    for (std::size_t i = 0; i < kept_values_.size();) {
      const std::uint64_t key = kept_values_[i].first;
      std::int64_t count = 0;
      int128 sum = 0;  // fixed point, exact (see record.hpp)
      for (; i < kept_values_.size() && kept_values_[i].first == key; ++i) {
        ++count;
        sum += kept_values_[i].second;
      }
      count_key(s, user, ref, key, count, sum, partials);
    }
  }

  // A kept record's value: clamped, in fixed point, rounded to the value quantum.
  std::int64_t kept_value(double v) {
    if (v < params_.clamp_min || v > params_.clamp_max) {
      v = std::clamp(v, params_.clamp_min, params_.clamp_max);
      ++out_.stats.clamped;
    }
    return quantize(to_fixed(v), params_.value_quantum);
  }

  // The user's kept records of one key: its first touch counted, its partial emitted.
  void count_key(std::size_t s, std::uint64_t user, UserState::UserRef& ref, std::uint64_t key, std::int64_t count,
                 int128 sum, std::vector<KeyPartial>& partials) {
    prefetch_partials_ahead(partials);
    const bool first_touch = state_.add_pair(s, user, ref, UserState::key_fingerprint(key, user));
    append_partial(partials, key, count, sum, first_touch || params_.users_per_trigger ? 1 : 0);
  }

  // A batch's users append to its triggers' partials in random order: one stream a trigger of the batch ([engine]
  // trigger_batch; 20 at T = 1000 by default, 2 at T = 100). The explanation that fits what was measured: 20 are more
  // than the hardware prefetch follows, so the new lines of the partials were store misses, and those filled the
  // store buffer (perf: the stall surfaced in the next load, add_pair's; bench_bounding at T = 1000 74-76 ns a
  // record, 63-64 at T = 100). The line kPartialsAhead partials past the end is fetched first (a read prefetch:
  // x86-64's baseline has no write prefetch): 64 ns a record at T = 1000. Only within the capacity (reserved per
  // batch): past it the line would be another allocation's.
  static constexpr std::size_t kPartialsAhead = 8;
  static void prefetch_partials_ahead(const std::vector<KeyPartial>& partials) {
    if (partials.size() + kPartialsAhead < partials.capacity())
      dpstream::prefetch(partials.data() + partials.size() + kPartialsAhead);
  }

  const BoundingParams& params_;
  UserState& state_;
  ThreadOut& out_;
  UserRecord* order_ = nullptr;  // the run's entries (sorted by user within each shard by run())
  const BatchRecords* records_ = nullptr;
  std::vector<UserRecord> scratch_;                                  // group_by_user's radix passes
  std::vector<std::uint32_t> radix_counts_;                          // group_by_user's radix counts
  std::vector<Group, DefaultInitAllocator<Group>> groups_;           // each user's, then the end
  std::vector<std::pair<std::uint64_t, std::int64_t>> kept_values_;  // (key, fixed value) of one user
};

}  // namespace

std::vector<std::vector<KeyPartial>> bound_and_aggregate_batch(const std::vector<std::span<const Record>>& triggers,
                                                               const BoundingParams& params, UserState& state,
                                                               BoundingStats& stats) {
  const BatchRecords records(triggers);
  constexpr std::size_t S = UserState::kShards;
  // Group by shard (stable), then each thread takes whole shards: no locks on the state.
  ShardedEntries sharded(triggers);

  const int threads = omp_get_max_threads();
  // Runs of consecutive shards: a shard joins the run before it while that run holds fewer than
  // kRunRecords records and max_run_shards shards, so small batches (T = 1000) keep the prefetch warm across
  // shards and large ones sort and visit a shard at a time (a run's entries stay in L2: runs of 16 shards
  // at 1/100 of the billion-key job made bounding 20% slower).
  // At most S / (2 threads) shards, so that each thread has runs of its own however small the batch.
  constexpr std::size_t kRunRecords = 4096;
  const std::size_t max_run_shards = std::clamp<std::size_t>(S / (2 * static_cast<std::size_t>(threads)), 1, 16);
  std::vector<std::size_t> runs{0};
  for (std::size_t s = 1; s < S; ++s)
    if (s - runs.back() >= max_run_shards || sharded.shard_begin(s) - sharded.shard_begin(runs.back()) >= kRunRecords)
      runs.push_back(s);
  runs.push_back(S);
  const std::size_t run_count = runs.size() - 1;
  const std::size_t trigger_count = triggers.size();
  std::vector<ThreadOut> out(static_cast<std::size_t>(threads));
  // Every entry sized here: the runtime may start fewer threads than asked (OMP_THREAD_LIMIT, OMP_DYNAMIC).
  for (ThreadOut& o : out) o.partials.resize(trigger_count);
#pragma omp parallel num_threads(threads)
  {
    ThreadOut& mine = out[static_cast<std::size_t>(omp_get_thread_num())];
    for (std::size_t t = 0; t < trigger_count; ++t)
      mine.partials[t].reserve(triggers[t].size() / static_cast<std::size_t>(threads) + 16);
    ShardBounder bounder(params, state, mine);
#pragma omp for schedule(dynamic, 1)
    for (std::size_t r = 0; r < run_count; ++r) {
      if (runs[r] <= S / 2 && S / 2 < runs[r + 1]) fault::point("bounding");
      bounder.run(runs[r], runs[r + 1], records, sharded);
    }
  }

  // Each trigger's partials: the first thread's taken over (one thread: no copy of them all), the others' appended.
  std::vector<std::vector<KeyPartial>> partials = std::move(out.front().partials);
  for (std::size_t t = 0; t < trigger_count && out.size() > 1; ++t) {
    std::size_t total = partials[t].size();
    for (std::size_t i = 1; i < out.size(); ++i) total += out[i].partials[t].size();
    partials[t].reserve(total);
    for (std::size_t i = 1; i < out.size(); ++i)
      partials[t].insert(partials[t].end(), out[i].partials[t].begin(), out[i].partials[t].end());
  }
  for (const auto& o : out) {
    stats.kept += o.stats.kept;
    stats.dropped += o.stats.dropped;
    stats.clamped += o.stats.clamped;
    stats.new_users += o.stats.new_users;
  }
  return partials;
}

std::vector<KeyPartial> bound_and_aggregate(const std::vector<Record>& records, const BoundingParams& params,
                                            UserState& state, BoundingStats& stats) {
  return std::move(bound_and_aggregate_batch({std::span<const Record>(records)}, params, state, stats).front());
}

}  // namespace dpstream::kernels
