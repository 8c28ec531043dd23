#include "kernels/key_accumulate.hpp"

#include <omp.h>

#include <algorithm>
#include <array>
#include <memory>
#include <span>
#include <stdexcept>
#include <utility>

#include "common/fault_injection.hpp"
#include "partition/hash.hpp"
#include "partition/partitioner.hpp"
#include "partition/radix_sort.hpp"

namespace dpstream::kernels {

namespace {
constexpr int128 kOne = int128{1} << kValueFracBits;  // a value of 1.0 in fixed point

using partition::key_hash;

// LSD radix sort by key, 11-bit digits, each pass a stable counting sort from one buffer to the other, the second
// not zero-filled first; digits equal in every key are skipped (key ids below 2^22 take two passes). On one thread,
// radix_sort_lsd (every digit's histogram in one pass; partition_into would count a digit in a pass of its own and
// read the partials once more a digit); with several threads and a large trigger, partition_into's threads take a
// digit each. The same order either way. Equal keys end up adjacent, in any order.
void sort_by_key(std::vector<KeyPartial>& v) {
  constexpr int kBits = 11;
  constexpr std::size_t kRadix = std::size_t{1} << kBits;
  constexpr std::uint64_t kMask = kRadix - 1;
  const std::size_t n = v.size();
  if (n < 256) {
    std::sort(v.begin(), v.end(), [](const KeyPartial& a, const KeyPartial& b) { return a.key < b.key; });
    return;
  }
  std::uint64_t varying = 0;  // the bits in which some key differs from the first
  for (const KeyPartial& p : v) varying |= p.key ^ v.front().key;
  std::array<int, (64 + kBits - 1) / kBits> shifts{};
  std::size_t digits = 0;
  for (int shift = 0; shift < 64; shift += kBits)
    if ((varying >> shift & kMask) != 0) shifts[digits++] = shift;
  if (digits == 0) return;
  const std::unique_ptr<KeyPartial[]> scratch(new KeyPartial[n]);  // default-initialized: a pass writes all of it
  KeyPartial* from = v.data();
  KeyPartial* to = scratch.get();
  if (n >= partition::kParallelItems && omp_get_max_threads() > 1) {
    for (std::size_t d = 0; d < digits; ++d, std::swap(from, to))
      partition::partition_into(
          std::span<const KeyPartial>(from, n), kRadix,
          [shift = shifts[d]](const KeyPartial& p) { return p.key >> shift & kMask; }, to);
  } else {
    std::vector<std::uint64_t> counts;
    from = partition::radix_sort_lsd(
        from, to, n, std::span<const int>(shifts.data(), digits), kBits, [](const KeyPartial& p) { return p.key; },
        counts);
  }
  if (from != v.data()) std::copy_n(from, n, v.data());
}

// One trigger's totals per key, ascending by key, from partials sorted by key (sums in 128 bits:
// cannot overflow, record.hpp).
std::vector<KeyTotals> group_by_key(const std::vector<KeyPartial>& sorted) {
  std::vector<KeyTotals> groups;
  groups.reserve(sorted.size());
  for (const KeyPartial& p : sorted) {
    if (groups.empty() || groups.back().key != p.key) groups.push_back(KeyTotals{p.key, 0, 0, 0});
    KeyTotals& g = groups.back();
    g.count += p.count;
    g.sum += p.sum;
    g.users += p.new_users;
  }
  return groups;
}

// A trigger's totals per key, ascending, with each key's hash: what accumulate and shard_groups start from.
struct HashedGroups {
  std::vector<KeyTotals> groups;
  std::vector<std::uint64_t> hashes;  // hashes[i] = key_hash(groups[i].key)
};

HashedGroups grouped_and_hashed(std::vector<KeyPartial> partials) {
  sort_by_key(partials);
  std::vector<KeyTotals> groups = group_by_key(partials);
  std::vector<KeyPartial>().swap(partials);
  std::vector<std::uint64_t> hashes(groups.size());
  for (std::size_t i = 0; i < groups.size(); ++i) hashes[i] = key_hash(groups[i].key);
  return {std::move(groups), std::move(hashes)};
}
}  // namespace

const PackedSlots::Slot* PackedSlots::find(std::uint64_t key, std::uint64_t hash) const {
  if (slots_.empty()) return nullptr;
  for (std::size_t i = home(hash);; i = next_slot(i, slots_.size())) {
    if (slots_[i].count == kFree) return nullptr;
    if (slots_[i].key == key) return &slots_[i];
  }
}

// Only a new key may grow the table: a key already held is updated in place, so a caller iterating
// the shard (key selection's full scan puts a released key's new round) never sees it reallocated.
PackedSlots::Slot& PackedSlots::find_or_insert(std::uint64_t key, std::uint64_t hash) {
  if (!slots_.empty())
    for (std::size_t i = home(hash);; i = next_slot(i, slots_.size())) {
      if (slots_[i].count == kFree) break;
      if (slots_[i].key == key) return slots_[i];
    }
  if (full()) grow();  // a free slot always ends a probe
  for (std::size_t i = home(hash);; i = next_slot(i, slots_.size()))
    if (slots_[i].count == kFree) {
      ++size_;
      return slots_[i] = Slot{key, 0, 0};
    }
}

void PackedSlots::grow() { rehash(grown_capacity(slots_.size())); }

void PackedSlots::reserve(std::size_t keys, const TableAllocator<Slot>& alloc) {
  if (const std::size_t capacity = reserved_capacity(keys); capacity > slots_.size()) rehash(capacity, alloc);
}

void PackedSlots::rehash(std::size_t capacity, const TableAllocator<Slot>& alloc) {
  marked_.rehash(capacity);
  TableSlots<Slot> old(capacity, Slot{0, kFree, 0}, alloc);
  old.swap(slots_);
  for (const Slot& s : old) {
    if (s.count == kFree) continue;
    std::size_t i = home(key_hash(s.key));
    while (slots_[i].count != kFree) i = next_slot(i, slots_.size());
    slots_[i] = s;
  }
}

std::size_t KeyStateTable::shard_of(std::uint64_t key) { return partition::local_shard(key_hash(key), kShards); }

void KeyStateTable::reserve(std::uint64_t keys) {
  const auto per_shard = static_cast<std::size_t>(static_cast<double>(keys) / kShards);
  reserve_shards<Packed>(
      slab_, kShards, reserved_capacity(per_shard), [&](std::size_t s) { return shards_[s].packed.capacity(); },
      [&](std::size_t s, const TableAllocator<Packed>& alloc) { shards_[s].packed.reserve(per_shard, alloc); });
}

void KeyStateTable::clear() {
  for (auto& sh : shards_) sh = Shard{};
  slab_ = TableSlab{};
  for (auto& t : touched) t.clear();
  touched_states_current = false;
  std::fill(touched_below.begin(), touched_below.end(), 0);
  std::fill(changed_.begin(), changed_.end(), 0);
}

void KeyStateTable::mark_changed(std::uint64_t key) {
  if (!journal) return;
  const std::uint64_t h = key_hash(key);
  const std::size_t s = partition::local_shard(h, kShards);
  Packed* p = shards_[s].packed.find(key, h);
  if (p == nullptr) throw std::out_of_range("KeyStateTable: mark_changed of a key not tracked");
  mark(s, *p);
}

std::uint64_t KeyStateTable::changed_key_count() const {
  std::uint64_t n = 0;
  for (const std::uint64_t c : changed_) n += c;
  return n;
}

std::uint64_t KeyStateTable::keys() const {
  std::uint64_t n = 0;
  for (const auto& sh : shards_) n += sh.packed.size();
  return n;
}

std::uint64_t KeyStateTable::memory_bytes() const {
  std::uint64_t b = slab_.bytes();
  for (const auto& sh : shards_)
    b += (slab_.holds(sh.packed.data()) ? 0 : sh.packed.capacity() * sizeof(Packed)) + hash_table_bytes(sh.wide) +
         hash_table_bytes(sh.rounds) + hash_table_bytes(sh.excess);
  return b;
}

std::uint64_t KeyStateTable::digest(std::uint64_t seed) const {
  std::uint64_t total = 0;
#pragma omp parallel for schedule(dynamic, 4) reduction(+ : total)
  for (std::size_t s = 0; s < kShards; ++s)
    for_each_in(s, [&](std::uint64_t key, const KeyState& st) {
      std::uint64_t h = partition::hash_combine(seed, key);
      const int128 sum = st.sum;
      for (const std::uint64_t v :
           {static_cast<std::uint64_t>(st.count), static_cast<std::uint64_t>(sum),
            static_cast<std::uint64_t>(sum >> 64), static_cast<std::uint64_t>(st.users),
            static_cast<std::uint64_t>(st.round_base_users), std::uint64_t{st.round}, std::uint64_t{st.round_start}})
        h = partition::hash_combine(h, v);
      total += h;
    });
  return total;
}

KeyState KeyStateTable::load(const Shard& sh, const Packed& p) const {
  if (p.count == kWide) return sh.wide.at(p.key);
  KeyState st;
  st.count = p.count & ~kHasRound;
  st.users = p.users & ~kChanged;
  if ((p.count & kHasRound) != 0) {
    const RoundState& r = sh.rounds.at(p.key);
    st.round_base_users = r.base_users;
    st.round = r.round;
    st.round_start = r.start;
  }
  if (!track_sums_) return st;
  int128 sum = int128{st.count} * kOne;
  if (!sh.excess.empty())
    if (const auto it = sh.excess.find(p.key); it != sh.excess.end()) sum += int128(it->second);
  st.sum = sum;
  return st;
}

// Packed while the count is below 2^31 - 2 (so that with kHasRound it is neither kFree nor kWide), the
// users below 2^31 and the round's base users below 2^32, with the
// round state in Shard::rounds when it is not zero; once not, the key's state stays full width (with its
// sum) for the rest of the window. The journal mark stays.
void KeyStateTable::store(Shard& sh, Packed& p, const KeyState& st) {
  const bool has_round = st.round_base_users != 0 || st.round != 0 || st.round_start != 0;
  const bool had_round = p.count != kWide && (p.count & kHasRound) != 0;
  if (p.count != kWide && st.count >= 0 && st.count < std::int64_t{kHasRound} - 2 && st.users >= 0 &&
      st.users < std::int64_t{kChanged} && st.round_base_users >= 0 &&
      st.round_base_users <= std::int64_t{std::numeric_limits<std::uint32_t>::max()}) {
    // The side entry before the mark: an insertion that throws leaves the slot as it was.
    if (has_round)
      sh.rounds[p.key] = {static_cast<std::uint32_t>(st.round_base_users), st.round, st.round_start};
    else if (had_round)
      sh.rounds.erase(p.key);
    p.count = static_cast<std::uint32_t>(st.count) | (has_round ? kHasRound : 0);
    p.users = static_cast<std::uint32_t>(st.users) | (p.users & kChanged);
    if (!track_sums_) return;
    // |sum| < 2^115 and count * 2^20 < 2^51 (record.hpp): the excess fits 128 bits.
    if (const int128 excess = int128(st.sum) - int128{st.count} * kOne; excess != 0)
      sh.excess[p.key] = excess;
    else if (!sh.excess.empty())
      sh.excess.erase(p.key);
    return;
  }
  KeyState& wide = sh.wide[p.key];
  wide = st;
  if (!track_sums_) wide.sum = 0;
  if (had_round) sh.rounds.erase(p.key);
  if (p.count != kWide && track_sums_ && !sh.excess.empty()) sh.excess.erase(p.key);
  p.count = kWide;
}

std::optional<KeyState> KeyStateTable::find(std::uint64_t key) const {
  const std::uint64_t h = key_hash(key);
  const Shard& sh = shards_[partition::local_shard(h, kShards)];
  const Packed* p = sh.packed.find(key, h);
  if (p == nullptr) return std::nullopt;
  return load(sh, *p);
}

void KeyStateTable::prefetch(std::uint64_t key) const {
  const std::uint64_t h = key_hash(key);
  shards_[partition::local_shard(h, kShards)].packed.prefetch(h);
}

KeyState KeyStateTable::at(std::uint64_t key) const {
  auto st = find(key);
  if (!st) throw std::out_of_range("KeyStateTable: key not tracked");
  return *st;
}

void KeyStateTable::put(std::uint64_t key, const KeyState& st) {
  const std::uint64_t h = key_hash(key);
  Shard& sh = shards_[partition::local_shard(h, kShards)];
  store(sh, sh.packed.find_or_insert(key, h), st);
}

// store()'s packed case for a key it packed before: count below 2^31 - 2, users below 2^31 (the
// round's base users are unchanged, so still below 2^32). Partials' counts and users are below 2^63.
bool KeyStateTable::add_in_place(Packed& p, const KeyTotals& t) const {
  if (p.count == kWide || t.count < 0 || t.users < 0) return false;
  if (track_sums_ && t.sum != int128{t.count} * kOne) return false;
  const std::uint64_t count = (p.count & ~kHasRound) + static_cast<std::uint64_t>(t.count);
  const std::uint64_t users = (p.users & ~kChanged) + static_cast<std::uint64_t>(t.users);
  if (count >= kHasRound - 2 || users >= kChanged) return false;
  p.count = static_cast<std::uint32_t>(count) | (p.count & kHasRound);
  p.users = static_cast<std::uint32_t>(users) | (p.users & kChanged);
  return true;
}

// Adds one key's trigger totals t to its state; t becomes its running totals if so reported.
void KeyStateTable::add(std::size_t s, KeyTotals& t, std::uint64_t hash, Report report, double touched_above) {
  Shard& sh = shards_[s];
  Packed& packed = sh.packed.find_or_insert(t.key, hash);
  const bool in_place = add_in_place(packed, t);
  KeyState st = load(sh, packed);
  if (!in_place) {
    st.count += t.count;
    if (track_sums_) st.sum += t.sum;
    st.users += t.users;
    store(sh, packed, st);
  }
  if (journal) mark(s, packed);
  if (report == Report::RunningTotals) t = KeyTotals{t.key, st.count, st.sum, st.users};
  if (st.round_users() > touched_above)
    touched[s].push_back({t.key, st, hash});
  else
    ++touched_below[s];
}

// Thread `thread` of `threads` owns the shards s with s * threads / S = thread, and adds
// the groups of its keys in key order (so each shard's touched keys come out ascending). It reads
// the groups in sequence and prefetches the home slot of its key kAhead groups on: with a table
// larger than the cache, a key costs one miss, and kAhead of them overlap.
void KeyStateTable::accumulate_owned(std::vector<KeyTotals>& groups, const std::vector<std::uint64_t>& hashes,
                                     Report report, double touched_above, std::size_t thread, std::size_t threads) {
  constexpr std::size_t S = kShards, kAhead = 16;
  const auto shard = [](std::uint64_t h) { return partition::local_shard(h, S); };
  const auto mine = [&](std::size_t s) { return s * threads / S == thread; };
  const auto owns = [&](std::uint64_t h) { return mine(shard(h)); };
  for (std::size_t s = 0; s < S; ++s)
    if (mine(s)) touched[s].clear(), touched_below[s] = 0;
  if (mine(S / 2)) fault::point("accumulate");
  const std::size_t n = groups.size();
  for (std::size_t i = 0; i < n; ++i) {
    if (i + kAhead < n && owns(hashes[i + kAhead]))
      shards_[shard(hashes[i + kAhead])].packed.prefetch(hashes[i + kAhead]);
    if (owns(hashes[i])) add(shard(hashes[i]), groups[i], hashes[i], report, touched_above);
  }
}

KeyStateTable::ShardedGroups KeyStateTable::shard_groups(std::vector<KeyPartial> partials) {
  const HashedGroups sorted = grouped_and_hashed(std::move(partials));
  const std::size_t n = sorted.groups.size();
  ShardedGroups out;
  std::vector<std::uint32_t> count(kShards + 1);
  for (const std::uint64_t h : sorted.hashes) ++count[partition::local_shard(h, kShards) + 1];
  for (std::size_t s = 0; s < kShards; ++s) count[s + 1] += count[s];
  out.offsets = count;
  // A scatter into a copy (sequential reads, one write stream a shard). Permuting in place by cycles saves the
  // copy but reads and writes at random: at 1/10 scale it cost more time and moved no peak (PERFORMANCE round 42).
  out.groups.resize(n);
  out.hashes.resize(n);
  for (std::size_t i = 0; i < n; ++i) {  // stable: ascending within a shard
    const std::uint32_t at = count[partition::local_shard(sorted.hashes[i], kShards)]++;
    out.groups[at] = sorted.groups[i];
    out.hashes[at] = sorted.hashes[i];
  }
  return out;
}

void KeyStateTable::accumulate_shard(const ShardedGroups& g, std::size_t s, double touched_above) {
  constexpr std::size_t kAhead = 8;
  touched[s].clear();
  touched_below[s] = 0;
  const std::size_t begin = g.offsets[s], end = g.offsets[s + 1];
  PackedSlots& slots = shards_[s].packed;
  for (std::size_t i = begin; i < std::min(begin + kAhead, end); ++i) slots.prefetch(g.hashes[i]);
  for (std::size_t i = begin; i < end; ++i) {
    if (i + kAhead < end) slots.prefetch(g.hashes[i + kAhead]);
    KeyTotals t = g.groups[i];
    add(s, t, g.hashes[i], Report::Nothing, touched_above);
  }
}

std::vector<KeyTotals> KeyStateTable::accumulate(std::vector<KeyPartial> partials, Report report,
                                                 double touched_above) {
  // Sorted once by key: the report comes out in key order, and each shard's keys ascending.
  // Named members, not a structured binding: clang before 16 rejects bindings captured by an OpenMP region.
  HashedGroups sorted = grouped_and_hashed(std::move(partials));
  std::vector<KeyTotals>& groups = sorted.groups;  // add() writes each report row
  const std::vector<std::uint64_t>& hashes = sorted.hashes;
#pragma omp parallel
  accumulate_owned(groups, hashes, report, touched_above, static_cast<std::size_t>(omp_get_thread_num()),
                   static_cast<std::size_t>(omp_get_num_threads()));
  touched_states_current = true;
  if (report == Report::Nothing) return {};
  return std::move(sorted.groups);
}

}  // namespace dpstream::kernels
