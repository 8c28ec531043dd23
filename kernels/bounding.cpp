#include "kernels/bounding.hpp"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <limits>
#include <stdexcept>

#include "common/fault_injection.hpp"
#include "common/prefetch.hpp"
#include "partition/hash.hpp"
#include "partition/partitioner.hpp"

namespace dpstream::kernels {

namespace {

using Slot = UserState::Slot;
constexpr std::uint32_t kLast = UserState::kInline - 1;  // the inline word that becomes the block offset

// Slot meta word: occupied (bit 31), kept count changed since the last drain (30), has a block (29),
// the block holds fingerprints not yet journaled (28: the drain's pass over the slots reads only the
// blocks of users with something to journal), inline fingerprints held (bits 0-2) and already
// journaled (bits 3-5).
constexpr std::uint32_t kOccupied = 1u << 31, kChanged = 1u << 30, kHasBlock = 1u << 29, kBlockPending = 1u << 28;
std::uint32_t inline_held(std::uint32_t m) { return m & 7; }
std::uint32_t inline_journaled(std::uint32_t m) { return m >> 3 & 7; }
bool has_block(std::uint32_t m) { return (m & kHasBlock) != 0; }
std::uint32_t with_inline(std::uint32_t m, std::uint32_t held, std::uint32_t done) {
  return (m & ~0x3fu) | held | done << 3;
}
// With a block, the slot's last inline word holds the block's offset instead of a fingerprint.
std::uint32_t inline_capacity(std::uint32_t m) { return has_block(m) ? kLast : UserState::kInline; }
std::uint32_t block_of(const Slot& s) { return has_block(s.meta) ? s.fp[kLast] : 0; }

// Block header word: fingerprints held (bits 0-7), fingerprints already journaled (8-15), size class (16-19).
constexpr std::uint32_t kCountMask = 0xff;
std::uint32_t held(std::uint32_t h) { return h & kCountMask; }
std::uint32_t journaled(std::uint32_t h) { return h >> 8 & kCountMask; }
std::uint32_t size_class(std::uint32_t h) { return h >> 16 & 0xf; }
std::uint32_t class_words(std::uint32_t cls) { return 2u << cls; }  // header + capacity
std::uint32_t class_capacity(std::uint32_t cls) { return class_words(cls) - 1; }
std::uint32_t header(std::uint32_t count, std::uint32_t done, std::uint32_t cls) {
  return count | done << 8 | cls << 16;
}
std::uint32_t class_for(std::uint32_t fingerprints) {  // smallest class holding them (capped)
  std::uint32_t cls = 0;
  while (cls + 1 < UserState::kClasses && class_capacity(cls) < fingerprints) ++cls;
  return cls;
}

// Journaled count after appending one fingerprint to `held` of which `done` are journaled. With the
// journal off the new one needs no record, but earlier ones still pending must stay pending: it
// counts as recorded only when nothing before it is pending (recording too much is harmless, losing
// a pending pair would let a resume count the user twice for its key).
std::uint32_t recorded_after_add(std::uint32_t done, std::uint32_t held, bool journal) {
  return !journal && done == held ? held + 1 : done;
}

// f(fingerprint) for every fingerprint of the slot (inline, then block), and of those not yet journaled.
template <class F>
void for_each_fingerprint(const Slot& s, const std::vector<std::uint32_t>& words, bool only_new, F&& f) {
  for (std::uint32_t i = only_new ? inline_journaled(s.meta) : 0; i < inline_held(s.meta); ++i) f(s.fp[i]);
  if (only_new && (s.meta & kBlockPending) == 0) return;
  if (const std::uint32_t b = block_of(s); b != 0)
    for (std::uint32_t i = only_new ? journaled(words[b]) : 0; i < held(words[b]); ++i) f(words[b + 1 + i]);
}

// Everything of the slot is in the journal: nothing of it is pending any more.
void mark_journaled(Slot& s, std::vector<std::uint32_t>& words) {
  const bool block_pending = (s.meta & kBlockPending) != 0;
  s.meta = with_inline(s.meta & ~(kChanged | kBlockPending), inline_held(s.meta), inline_held(s.meta));
  if (const std::uint32_t b = block_of(s); b != 0 && block_pending)
    words[b] = header(held(words[b]), held(words[b]), size_class(words[b]));
}

// The block's part is read from the slot's kBlockPending, which is set exactly while the block's
// journaled count is below its held count (move_to_block, append_to_block; mark_journaled clears both).
bool pending(const Slot& s) {
  return (s.meta & (kChanged | kBlockPending)) != 0 || inline_journaled(s.meta) != inline_held(s.meta);
}

}  // namespace

std::uint64_t UserState::slot_hash(std::uint64_t user) {
  return partition::salted_hash(user, partition::kUserSlotSalt);
}

std::size_t UserState::Shard::home_of(std::uint64_t slot_hash) const {
  return static_cast<std::size_t>(static_cast<uint128>(slot_hash) * slots.size() >> 64);  // uniform on [0, size)
}

const UserState::Slot* UserState::Shard::find(std::uint64_t user, std::uint64_t hash) const {
  if (slots.empty()) return nullptr;
  for (std::size_t i = home_of(hash);;) {
    const Slot& s = slots[i];
    if (!occupied(s)) return nullptr;
    if (s.user == user) return &s;
    i = next_slot(i, slots.size());
  }
}

void UserState::Shard::grow() { rehash(grown_capacity(slots.size())); }  // kernels/table_memory.hpp

void UserState::Shard::rehash(std::size_t capacity, const TableAllocator<Slot>& alloc) {
  marked.rehash(capacity);
  TableSlots<Slot> old(capacity, alloc);
  old.swap(slots);
  for (const Slot& s : old) {
    if (!occupied(s)) continue;
    std::size_t i = home_of(slot_hash(s.user));
    while (occupied(slots[i])) i = next_slot(i, slots.size());
    slots[i] = s;
  }
}

std::uint32_t UserState::Shard::allocate(std::uint32_t cls) {
  if (const std::uint32_t b = free_head[cls]; b != 0) {
    free_head[cls] = words[b];
    return b;
  }
  const std::size_t at = words.size(), n = class_words(cls);
  if (at + n > std::numeric_limits<std::uint32_t>::max())
    throw std::length_error("UserState: more than 2^32 fingerprint words in one shard (use more ranks)");
  // Grow by 1/4 (not 2x): a move is amortised O(1) and the arena stays close to its contents.
  if (at + n > words.capacity()) words.reserve(std::max(words.capacity() + words.capacity() / 4, at + n + 1024));
  words.resize(at + n);
  return static_cast<std::uint32_t>(at);
}

void UserState::Shard::release(std::uint32_t block, std::uint32_t cls) {
  words[block] = free_head[cls];
  free_head[cls] = block;
}

// Gives the slot a block with room for `capacity` fingerprints, moving its last inline one there.
void UserState::Shard::move_to_block(Slot& slot, std::uint32_t capacity) {
  const std::uint32_t cls = class_for(capacity), block = allocate(cls);
  const std::uint32_t ih = inline_held(slot.meta), ij = inline_journaled(slot.meta);
  const std::uint32_t moved = ih > kLast ? 1 : 0;
  if (moved) words[block + 1] = slot.fp[kLast];
  const std::uint32_t done = moved != 0 && ij > kLast ? 1 : 0;
  words[block] = header(moved, done, cls);
  slot.fp[kLast] = block;
  slot.meta =
      with_inline(slot.meta | kHasBlock | (done < moved ? kBlockPending : 0), std::min(ih, kLast), std::min(ij, kLast));
  if (done < moved) note_pending(slot);
}

// Moves the slot's block to a class with room for `more` fingerprints (no move if it has room).
void UserState::Shard::grow_block(Slot& slot, std::uint32_t more) {
  const std::uint32_t old = block_of(slot), h = words[old], cls = size_class(h), to = class_for(held(h) + more);
  if (to <= cls) return;
  const std::uint32_t block = allocate(to);  // may move `words`: index, never hold pointers
  std::copy_n(words.begin() + old + 1, held(h), words.begin() + block + 1);
  words[block] = header(held(h), journaled(h), to);
  release(old, cls);
  slot.fp[kLast] = block;
}

// Appends a fingerprint the user does not hold to its block, or to the overflow set once the largest
// block is full (which also catches a fingerprint already there).
bool UserState::Shard::append_to_block(Slot& slot, std::uint64_t user, std::uint32_t fingerprint, bool journal) {
  std::uint32_t h = words[block_of(slot)];
  if (held(h) == class_capacity(size_class(h)) && size_class(h) + 1 < kClasses) {
    grow_block(slot, 1);
    h = words[block_of(slot)];
  }
  if (held(h) < class_capacity(size_class(h))) {
    const std::uint32_t b = block_of(slot), count = held(h) + 1;
    words[b + count] = fingerprint;
    const std::uint32_t done = recorded_after_add(journaled(h), held(h), journal);
    words[b] = header(count, done, size_class(h));
    pending.new_pairs += done < count ? 1 : 0;
    if (done < count) {
      slot.meta |= kBlockPending;
      note_pending(slot);
    }
    ++pairs;
    return true;
  }
  if (!overflow.insert({user, fingerprint}).second) return false;
  if (journal) {
    overflow_journal.emplace_back(user, fingerprint);
    ++pending.new_pairs;
  }
  ++pairs;
  return true;
}

void UserState::clear() {
  for (auto& sh : shards_) sh = Shard{};
  slab_ = TableSlab{};
}

void UserState::reserve(std::uint64_t users) {
  const auto per_shard = static_cast<std::size_t>(static_cast<double>(users) / kShards);
  const std::size_t capacity = reserved_capacity(per_shard);
  reserve_shards<Slot>(
      slab_, kShards, capacity, [&](std::size_t s) { return shards_[s].slots.size(); },
      [&](std::size_t s, const TableAllocator<Slot>& alloc) { shards_[s].rehash(capacity, alloc); });
}

void UserState::clear_journal() {
#pragma omp parallel for schedule(dynamic, 8)
  for (std::size_t s = 0; s < kShards; ++s) {
    Shard& sh = shards_[s];
    for (Slot& slot : sh.slots)
      if (occupied(slot)) mark_journaled(slot, sh.words);
    sh.marked.clear();
    std::vector<UserFingerprint>().swap(sh.overflow_journal);
    sh.pending = {};
  }
}

bool UserState::journal_empty() const {
  for (const Shard& sh : shards_) {
    if (!sh.overflow_journal.empty()) return false;
    for (const Slot& slot : sh.slots)
      if (occupied(slot) && pending(slot)) return false;
  }
  return true;
}

std::uint32_t UserState::key_fingerprint(std::uint64_t key) {
  return static_cast<std::uint32_t>(partition::salted_hash(key, partition::kFingerprintSalt) >> 32);
}

std::pair<UserState::Slot*, bool> UserState::find_or_add(std::size_t shard, std::uint64_t user) {
  return find_or_add(shard, user, slot_hash(user));
}

std::pair<UserState::Slot*, bool> UserState::find_or_add(std::size_t shard, std::uint64_t user, std::uint64_t hash) {
  Shard& sh = shards_[shard];
  if (table_full(sh.users, sh.slots.size())) sh.grow();
  for (std::size_t i = sh.home_of(hash);;) {
    Slot& s = sh.slots[i];
    if (!occupied(s)) {
      s = Slot{user, 0, kOccupied, {}};
      ++sh.users;
      return {&s, true};
    }
    if (s.user == user) return {&s, false};
    i = next_slot(i, sh.slots.size());
  }
}

void UserState::prefetch_slot(std::size_t shard, std::uint64_t slot_hash) const {
  const Shard& sh = shards_[shard];
  if (!sh.slots.empty()) prefetch_probe(sh.slots, sh.home_of(slot_hash));
}

void UserState::prefetch_block(std::size_t shard, std::uint64_t user, std::uint64_t hash) const {
  const Shard& sh = shards_[shard];
  const Slot* s = sh.find(user, hash);
  if (s == nullptr || !has_block(s->meta)) return;
  const std::size_t block = block_of(*s);
  dpstream::prefetch(sh.words.data() + block);  // header and the first fingerprints
  // The line after, wherever the boundary falls: all of a block of up to 16 words (most users); a larger
  // block's later words load on use.
  if (block + 15 < sh.words.size()) dpstream::prefetch(sh.words.data() + block + 15);
}

void UserState::reserve_pairs(std::size_t shard, Slot& slot, std::uint32_t more) {
  Shard& sh = shards_[shard];
  const std::uint32_t ih = inline_held(slot.meta);
  if (has_block(slot.meta))
    sh.grow_block(slot, more);
  else if (ih + more > kInline)
    sh.move_to_block(slot, ih + more - kLast);
}

bool UserState::add_pair(std::size_t shard, std::uint64_t user, Slot& slot, std::uint32_t fingerprint) {
  Shard& sh = shards_[shard];
  bool held_already = false;
  for_each_fingerprint(slot, sh.words, false, [&](std::uint32_t f) { held_already |= f == fingerprint; });
  if (held_already) return false;
  if (const std::uint32_t ih = inline_held(slot.meta); ih < inline_capacity(slot.meta)) {
    slot.fp[ih] = fingerprint;
    const std::uint32_t done = recorded_after_add(inline_journaled(slot.meta), ih, journal);
    slot.meta = with_inline(slot.meta, ih + 1, done);
    sh.pending.new_pairs += done <= ih ? 1 : 0;
    if (done <= ih) sh.note_pending(slot);
    ++sh.pairs;
    return true;
  }
  if (!has_block(slot.meta)) sh.move_to_block(slot, 2);
  return sh.append_to_block(slot, user, fingerprint, journal);
}

void UserState::mark_changed(std::size_t shard, Slot& slot) {
  Shard& sh = shards_[shard];
  sh.pending.changed_users += (slot.meta & kChanged) == 0 ? 1 : 0;
  slot.meta |= kChanged;
  sh.note_pending(slot);
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
  for (const Slot& s : sh.slots)
    if (occupied(s)) for_each_fingerprint(s, sh.words, false, [&](std::uint32_t f) { out.emplace_back(s.user, f); });
  out.insert(out.end(), sh.overflow.begin(), sh.overflow.end());
  return out;
}

void UserState::drain_journal(std::size_t shard, std::vector<UserFingerprint>& changed_users,
                              std::vector<UserFingerprint>& new_pairs) {
  Shard& sh = shards_[shard];
  // Sized from the counts, not grown by doubling: the commit holds these until they are written.
  changed_users.reserve(changed_users.size() + sh.pending.changed_users);
  new_pairs.reserve(new_pairs.size() + sh.pending.new_pairs);
  // Only the groups noted since the last drain can hold a pending slot (GroupMarks).
  sh.marked.drain(
      sh.slots.size(), [&](std::size_t i) { dpstream::prefetch(&sh.slots[i]); },
      [&](std::size_t i) {
        Slot& s = sh.slots[i];
        if (!occupied(s) || !pending(s)) return;
        if ((s.meta & kChanged) != 0) changed_users.emplace_back(s.user, s.kept);
        for_each_fingerprint(s, sh.words, true, [&](std::uint32_t f) { new_pairs.emplace_back(s.user, f); });
        mark_journaled(s, sh.words);
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
    b += (slab_.holds(sh.slots.data()) ? 0 : sh.slots.capacity() * sizeof(Slot)) +
         sh.words.capacity() * sizeof(std::uint32_t) + hash_table_bytes(sh.overflow) +
         sh.overflow_journal.capacity() * sizeof(UserFingerprint);
  return b;
}

std::uint64_t UserState::digest(std::uint64_t seed) const {
  constexpr std::uint64_t kPairDomain = 0x5061697273ULL;  // pairs hash apart from kept counts
  std::uint64_t total = 0;
#pragma omp parallel for schedule(dynamic, 4) reduction(+ : total)
  for (std::size_t s = 0; s < kShards; ++s) {
    const Shard& sh = shards_[s];
    constexpr std::size_t kAhead = 16;  // blocks lie in arrival order, slots in hash order: a DRAM miss each
    for (std::size_t i = 0; i < sh.slots.size(); ++i) {
      if (i + kAhead < sh.slots.size())
        if (const std::uint32_t b = block_of(sh.slots[i + kAhead]); b != 0) dpstream::prefetch(sh.words.data() + b);
      const Slot& slot = sh.slots[i];
      if (!occupied(slot)) continue;
      const std::uint64_t u = partition::hash_combine(seed, slot.user);
      total += partition::hash_combine(u, slot.kept);
      for_each_fingerprint(slot, sh.words, false,
                           [&](std::uint32_t f) { total += partition::hash_combine(u ^ kPairDomain, f); });
    }
    for (const auto& [user, fingerprint] : sh.overflow)
      total += partition::hash_combine(partition::hash_combine(seed, user) ^ kPairDomain, fingerprint);
  }
  return total;
}

namespace {

struct alignas(64) ThreadOut {  // padded: threads update their own counters
  std::vector<KeyPartial> partials;
  BoundingStats stats;
};

// Bounds a run of shards' records on one thread. Users are visited in groups (a user's records of the
// trigger, in stream order); their state is random in memory, so it is prefetched a few users ahead
// (the slot kSlotAhead users ahead, then its block kBlockAhead ahead, once the slot is cached): the
// DRAM latency of many users overlaps instead of adding up. Prefetches retire at once, where loads
// that miss would fill the reorder buffer and stall it (perf: 60 ns per user with batched loads).
// The prefetch runs on across the shards of the run: per shard it started cold, and at T = 1000 (about
// 24 users per shard and trigger) most users' blocks were never prefetched.
class ShardBounder {
 public:
  static constexpr std::size_t kSlotAhead = 32, kBlockAhead = 16;
  ShardBounder(const BoundingParams& params, UserState& state, ThreadOut& out)
      : params_(params), state_(state), out_(out) {}

  // Shards [first_shard, last_shard) of `records`, grouped by shard at `offsets`.
  void run(std::size_t first_shard, std::size_t last_shard, const Record* records,
           const std::vector<std::uint64_t>& offsets) {
    order_.clear();
    groups_.clear();
    for (std::size_t s = first_shard; s < last_shard; ++s) {
      const std::size_t from = order_.size();
      sort_by_user(records, offsets[s], offsets[s + 1]);
      for (std::size_t i = from; i < order_.size(); ++i)
        if (i == from || order_[i].slot_hash != order_[i - 1].slot_hash) groups_.push_back({i, s});
    }
    const std::size_t n = groups_.size();
    groups_.push_back({order_.size(), last_shard});
    for (std::size_t i = 0; i < std::min(n, kSlotAhead); ++i) prefetch_slot(i);
    for (std::size_t i = 0; i < n; ++i) {
      if (i + kSlotAhead < n) prefetch_slot(i + kSlotAhead);
      if (i + kBlockAhead < n) prefetch_block(records, i + kBlockAhead);
      bound_user(groups_[i].shard, records, groups_[i].at, groups_[i + 1].at);
    }
  }

 private:
  // 16 bytes: sorting these is cheaper than sorting 40-byte records. Sorted by the user's slot hash (a
  // bijection of the user id, so equal hashes are equal users), a trigger's users are visited in the
  // order of their home slots.
  struct UserRecord {
    std::uint64_t slot_hash;
    std::uint64_t index;  // in the trigger's records (16 bytes with 32 or 64 bits here)
  };
  struct Group {  // one user's first place in order_, and its shard
    std::size_t at;
    std::size_t shard;
  };
  static bool hash_then_arrival(const UserRecord& a, const UserRecord& b) {
    return a.slot_hash != b.slot_hash ? a.slot_hash < b.slot_hash : a.index < b.index;
  }
  std::uint64_t user_of(const Record* records, std::size_t at) const { return records[order_[at].index].user; }
  void prefetch_slot(std::size_t group) const {
    state_.prefetch_slot(groups_[group].shard, order_[groups_[group].at].slot_hash);
  }
  void prefetch_block(const Record* records, std::size_t group) const {
    state_.prefetch_block(groups_[group].shard, user_of(records, groups_[group].at),
                          order_[groups_[group].at].slot_hash);
  }

  // Appends to order_ one shard's records [first, last) by user, each user's in stream order (timestamp,
  // position). A user's records usually arrive in stream order (the generator and time-sorted files emit
  // them so, and the shuffle and partition keep their relative order): sorted by (slot hash, arrival),
  // then a user's run is re-sorted by stream order only when it is not in it already.
  void sort_by_user(const Record* records, std::size_t first, std::size_t last) {
    const std::size_t from = order_.size();
    for (std::size_t r = first; r != last; ++r) order_.push_back({UserState::slot_hash(records[r].user), r});
    const auto begin = order_.begin() + static_cast<std::ptrdiff_t>(from);
    sort_by_hash(begin, order_.end());
    const auto by_stream = [records](const UserRecord& a, const UserRecord& b) {
      return stream_order_less(records[a.index], records[b.index]);
    };
    for (auto g = begin; g != order_.end();) {
      auto g_end = g + 1;
      while (g_end != order_.end() && g_end->slot_hash == g->slot_hash) ++g_end;
      if (g_end - g > 1 && !std::is_sorted(g, g_end, by_stream)) std::sort(g, g_end, by_stream);
      g = g_end;
    }
  }

  // Sorts [begin, end) (in arrival order) by (slot hash, arrival): one stable counting pass on the hash's
  // top bits, about one record per bucket (the hashes are uniform), then each bucket on its own. A
  // comparison sort cost 34 ns per record here (perf), this about 5.
  using OrderIt = std::vector<UserRecord>::iterator;
  void sort_by_hash(OrderIt begin, OrderIt end) {
    const auto n = static_cast<std::size_t>(end - begin);
    if (n <= 32 || n > (std::size_t{1} << 20)) {
      std::sort(begin, end, hash_then_arrival);
      return;
    }
    const auto bits = static_cast<int>(std::bit_width(n));  // 2^bits > n buckets
    bucket_start_.assign((std::size_t{1} << bits) + 1, 0);
    for (auto r = begin; r != end; ++r) ++bucket_start_[(r->slot_hash >> (64 - bits)) + 1];
    for (std::size_t b = 1; b < bucket_start_.size(); ++b) bucket_start_[b] += bucket_start_[b - 1];
    scratch_.resize(n);
    bucket_end_ = bucket_start_;
    for (auto r = begin; r != end; ++r) scratch_[bucket_end_[r->slot_hash >> (64 - bits)]++] = *r;
    std::copy(scratch_.begin(), scratch_.end(), begin);
    for (std::size_t b = 0; b + 1 < bucket_start_.size(); ++b)
      if (bucket_start_[b + 1] - bucket_start_[b] > 1) {
        const auto from = begin + static_cast<std::ptrdiff_t>(bucket_start_[b]);
        const auto to = begin + static_cast<std::ptrdiff_t>(bucket_start_[b + 1]);
        if (!std::is_sorted(from, to, hash_then_arrival))
          std::sort(from, to, hash_then_arrival);  // one heavy user: sorted
      }
  }

  // One user's records of the trigger (order_[from, to), in stream order): keeps the first C - kept,
  // clamps, counts.
  void bound_user(std::size_t s, const Record* records, std::size_t from, std::size_t to) {
    const std::uint64_t user = user_of(records, from);
    auto [slot, added] = state_.find_or_add(s, user, order_[from].slot_hash);
    if (added) ++out_.stats.new_users;
    const auto n = static_cast<std::uint32_t>(to - from);
    const std::uint32_t take = std::min(n, params_.max_records_per_user - slot->kept);
    slot->kept += take;
    out_.stats.kept += take;
    out_.stats.dropped += n - take;
    if (take == 1) {  // most users of a trigger: one record, one key, nothing to sort or group
      const Record& r = records[order_[from].index];
      count_key(s, user, *slot, r.key, 1, kept_value(r));
    } else if (take > 1) {
      kept_values_.clear();
      for (std::uint32_t i = 0; i < take; ++i) {
        const Record& r = records[order_[from + i].index];
        kept_values_.emplace_back(r.key, kept_value(r));
      }
      // Per-(user, key) aggregation: sort the user's kept records by key and walk the runs.
      std::sort(kept_values_.begin(), kept_values_.end());
      if (added && kept_values_.size() > UserState::kInline) state_.reserve_pairs(s, *slot, distinct_keys());
      for (std::size_t i = 0; i < kept_values_.size();) {
        const std::uint64_t key = kept_values_[i].first;
        std::int64_t count = 0;
        int128 sum = 0;  // fixed point, exact (see record.hpp)
        for (; i < kept_values_.size() && kept_values_[i].first == key; ++i) {
          ++count;
          sum += kept_values_[i].second;
        }
        count_key(s, user, *slot, key, count, sum);
      }
    }
    if (state_.journal && take > 0) state_.mark_changed(s, *slot);
  }

  // A kept record's value: clamped, in fixed point, rounded to the value quantum.
  std::int64_t kept_value(const Record& r) {
    double v = r.value;
    if (v < params_.clamp_min || v > params_.clamp_max) {
      v = std::clamp(v, params_.clamp_min, params_.clamp_max);
      ++out_.stats.clamped;
    }
    return quantize(to_fixed(v), params_.value_quantum);
  }

  // The user's kept records of one key: its first touch counted, its partial emitted.
  void count_key(std::size_t s, std::uint64_t user, Slot& slot, std::uint64_t key, std::int64_t count, int128 sum) {
    const bool first_touch = state_.add_pair(s, user, slot, UserState::key_fingerprint(key));
    append_partial(out_.partials, key, count, sum, first_touch || params_.users_per_trigger ? 1 : 0);
  }

  std::uint32_t distinct_keys() const {  // in the sorted kept_values_
    std::uint32_t distinct = 1;
    for (std::size_t i = 1; i < kept_values_.size(); ++i)
      distinct += kept_values_[i].first != kept_values_[i - 1].first;
    return distinct;
  }

  const BoundingParams& params_;
  UserState& state_;
  ThreadOut& out_;
  std::vector<UserRecord> order_, scratch_;
  std::vector<std::uint32_t> bucket_start_, bucket_end_;             // sort_by_hash's counting pass
  std::vector<Group> groups_;                                        // each user's, then the end
  std::vector<std::pair<std::uint64_t, std::int64_t>> kept_values_;  // (key, fixed value) of one user
};

}  // namespace

std::vector<KeyPartial> bound_and_aggregate(const std::vector<Record>& records, const BoundingParams& params,
                                            UserState& state, BoundingStats& stats) {
  using partition::kUserSalt;
  using partition::salted_hash;
  constexpr std::size_t S = UserState::kShards;
  // Group by shard (stable), then each thread takes whole shards: no locks on the state.
  auto sharded = partition::partition_by(
      records, S, [](const Record& r) { return partition::local_shard(salted_hash(r.user, kUserSalt), S); });

  const int threads = omp_get_max_threads();
  // Runs of consecutive shards: a shard joins the run before it while that run holds fewer than
  // kRunRecords records and max_run_shards shards, so small triggers (T = 1000) keep the prefetch warm across
  // shards and large ones sort and visit a shard at a time (a run's records and order stay in L2:
  // runs of 16 shards at 1/100 of the billion-key job made bounding 20% slower).
  // At most S / (2 threads) shards, so that each thread has runs of its own however small the trigger.
  constexpr std::size_t kRunRecords = 4096;
  const std::size_t max_run_shards = std::clamp<std::size_t>(S / (2 * static_cast<std::size_t>(threads)), 1, 16);
  std::vector<std::size_t> runs{0};
  for (std::size_t s = 1; s < S; ++s)
    if (s - runs.back() >= max_run_shards || sharded.offsets[s] - sharded.offsets[runs.back()] >= kRunRecords)
      runs.push_back(s);
  runs.push_back(S);
  const std::size_t run_count = runs.size() - 1;
  std::vector<ThreadOut> out(static_cast<std::size_t>(threads));
#pragma omp parallel num_threads(threads)
  {
    ThreadOut& mine = out[static_cast<std::size_t>(omp_get_thread_num())];
    mine.partials.reserve(records.size() / static_cast<std::size_t>(threads) + 16);
    ShardBounder bounder(params, state, mine);
#pragma omp for schedule(dynamic, 1)
    for (std::size_t r = 0; r < run_count; ++r) {
      if (runs[r] <= S / 2 && S / 2 < runs[r + 1]) fault::point("bounding");
      bounder.run(runs[r], runs[r + 1], sharded.items.data(), sharded.offsets);
    }
  }

  std::vector<KeyPartial> partials = std::move(out.front().partials);  // one thread: no copy of them all
  if (out.size() > 1) {
    std::size_t total = 0;
    for (const auto& o : out) total += o.partials.size();
    partials.reserve(total);
  }
  for (auto& o : out) {
    if (&o != &out.front()) partials.insert(partials.end(), o.partials.begin(), o.partials.end());
    stats.kept += o.stats.kept;
    stats.dropped += o.stats.dropped;
    stats.clamped += o.stats.clamped;
    stats.new_users += o.stats.new_users;
  }
  return partials;
}

}  // namespace dpstream::kernels
