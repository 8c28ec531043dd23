#include "kernels/bounding.hpp"

#include <omp.h>

#include <algorithm>
#include <limits>
#include <stdexcept>

#include "common/fault_injection.hpp"
#include "partition/hash.hpp"
#include "partition/partitioner.hpp"

namespace dpstream::kernels {

namespace {

// Block header word: fingerprints held (bits 0-7), fingerprints already journaled (8-15), size
// class (16-19), kept count changed since the last drain (31).
constexpr std::uint32_t kCountMask = 0xff, kChanged = 1u << 31;
std::uint32_t held(std::uint32_t h) { return h & kCountMask; }
std::uint32_t journaled(std::uint32_t h) { return h >> 8 & kCountMask; }
std::uint32_t size_class(std::uint32_t h) { return h >> 16 & 0xf; }
std::uint32_t class_words(std::uint32_t cls) { return 2u << cls; }  // header + capacity
std::uint32_t class_capacity(std::uint32_t cls) { return class_words(cls) - 1; }
std::uint32_t header(std::uint32_t count, std::uint32_t done, std::uint32_t cls, bool changed) {
  return count | done << 8 | cls << 16 | (changed ? kChanged : 0);
}
// The block's fingerprints and kept count are in the journal: nothing of it is pending any more.
void mark_journaled(std::uint32_t& h) { h = header(held(h), held(h), size_class(h), false); }
std::uint32_t class_for(std::uint32_t fingerprints) {  // smallest class holding them (capped)
  std::uint32_t cls = 0;
  while (cls + 1 < UserState::kClasses && class_capacity(cls) < fingerprints) ++cls;
  return cls;
}

}  // namespace

std::uint32_t UserState::Arena::allocate(std::uint32_t cls) {
  if (const std::uint32_t b = free_head[cls]; b != 0) {
    free_head[cls] = words[b];
    return b;
  }
  const std::size_t at = words.size(), n = class_words(cls);
  if (at + n > std::numeric_limits<std::uint32_t>::max())
    throw std::length_error("UserState: more than 2^32 fingerprint words in one shard (use more ranks)");
  // Grow by 1/4 (not 2x): the arena is most of the per-user memory, and a move is amortised O(1).
  if (at + n > words.capacity()) words.reserve(std::max(words.capacity() + words.capacity() / 4, at + n + 1024));
  words.resize(at + n);
  return static_cast<std::uint32_t>(at);
}

void UserState::Arena::release(std::uint32_t block, std::uint32_t cls) {
  words[block] = free_head[cls];
  free_head[cls] = block;
}

void UserState::clear() {
  for (auto& m : kept) m.clear();
  for (auto& a : arenas_) a = Arena{};
}

void UserState::clear_journal() {
#pragma omp parallel for schedule(dynamic, 8)
  for (std::size_t s = 0; s < kShards; ++s) {
    auto& words = arenas_[s].words;
    for (const auto& [user, slot] : kept[s])
      if (slot.block != 0) mark_journaled(words[slot.block]);
    std::vector<UserFingerprint>().swap(arenas_[s].overflow_journal);
  }
}

bool UserState::journal_empty() const {
  for (std::size_t s = 0; s < kShards; ++s) {
    if (!arenas_[s].overflow_journal.empty()) return false;
    for (const auto& [user, slot] : kept[s])
      if (slot.block != 0) {
        const std::uint32_t h = arenas_[s].words[slot.block];
        if ((h & kChanged) != 0 || journaled(h) != held(h)) return false;
      }
  }
  return true;
}

std::uint32_t UserState::key_fingerprint(std::uint64_t key) {
  return static_cast<std::uint32_t>(partition::salted_hash(key, partition::kFingerprintSalt) >> 32);
}

std::pair<UserState::Slot*, bool> UserState::find_or_add(std::size_t shard, std::uint64_t user) {
  auto [it, added] = kept[shard].try_emplace(user, Slot{});
  return {&it->second, added};
}

void UserState::reserve_pairs(std::size_t shard, Slot& slot, std::uint32_t more) {
  Arena& a = arenas_[shard];
  if (slot.block == 0) {
    const std::uint32_t cls = class_for(more);
    slot.block = a.allocate(cls);
    a.words[slot.block] = header(0, 0, cls, false);
    return;
  }
  const std::uint32_t h = a.words[slot.block], cls = size_class(h);
  const std::uint32_t to = class_for(held(h) + more);
  if (to <= cls) return;
  const std::uint32_t block = a.allocate(to);  // may move the arena: index, never hold pointers
  std::copy_n(a.words.begin() + slot.block + 1, held(h), a.words.begin() + block + 1);
  a.words[block] = header(held(h), journaled(h), to, (h & kChanged) != 0);
  a.release(slot.block, cls);
  slot.block = block;
}

bool UserState::add_pair(std::size_t shard, std::uint64_t user, Slot& slot, std::uint32_t fingerprint) {
  Arena& a = arenas_[shard];
  if (slot.block == 0) reserve_pairs(shard, slot, 1);
  std::uint32_t h = a.words[slot.block];
  const std::uint32_t* fps = a.words.data() + slot.block + 1;
  if (std::find(fps, fps + held(h), fingerprint) != fps + held(h)) return false;
  if (held(h) == class_capacity(size_class(h)) && size_class(h) + 1 < kClasses) {
    reserve_pairs(shard, slot, 1);
    h = a.words[slot.block];
  }
  if (held(h) < class_capacity(size_class(h))) {
    a.words[slot.block + 1 + held(h)] = fingerprint;
    const std::uint32_t count = held(h) + 1;
    a.words[slot.block] = header(count, journal ? journaled(h) : count, size_class(h), (h & kChanged) != 0);
    ++a.pairs;
    return true;
  }
  // A full largest block: the rest of this user's keys in the exact overflow set.
  if (!a.overflow.insert({user, fingerprint}).second) return false;
  if (journal) a.overflow_journal.emplace_back(user, fingerprint);
  ++a.pairs;
  return true;
}

void UserState::mark_changed(std::size_t shard, const Slot& slot) {
  if (slot.block != 0) arenas_[shard].words[slot.block] |= kChanged;
}

std::vector<UserState::UserFingerprint> UserState::pairs(std::size_t shard) const {
  const Arena& a = arenas_[shard];
  std::vector<UserFingerprint> out;
  out.reserve(a.pairs);
  for (const auto& [user, slot] : kept[shard]) {
    if (slot.block == 0) continue;
    const std::uint32_t n = held(a.words[slot.block]);
    for (std::uint32_t i = 0; i < n; ++i) out.emplace_back(user, a.words[slot.block + 1 + i]);
  }
  out.insert(out.end(), a.overflow.begin(), a.overflow.end());
  return out;
}

void UserState::drain_journal(std::size_t shard, std::vector<UserFingerprint>& changed_users,
                              std::vector<UserFingerprint>& new_pairs) {
  Arena& a = arenas_[shard];
  for (const auto& [user, slot] : kept[shard]) {
    if (slot.block == 0) continue;
    const std::uint32_t h = a.words[slot.block];
    if ((h & kChanged) != 0) changed_users.emplace_back(user, slot.kept);
    for (std::uint32_t i = journaled(h); i < held(h); ++i) new_pairs.emplace_back(user, a.words[slot.block + 1 + i]);
    mark_journaled(a.words[slot.block]);
  }
  new_pairs.insert(new_pairs.end(), a.overflow_journal.begin(), a.overflow_journal.end());
  std::vector<UserFingerprint>().swap(a.overflow_journal);
}

std::uint64_t UserState::users() const {
  std::uint64_t n = 0;
  for (const auto& m : kept) n += m.size();
  return n;
}

std::uint64_t UserState::user_key_pairs() const {
  std::uint64_t n = 0;
  for (const auto& a : arenas_) n += a.pairs;
  return n;
}

std::uint64_t UserState::memory_bytes() const {
  // flat_hash_* store one control byte plus the slot per capacity entry.
  std::uint64_t b = 0;
  for (const auto& m : kept) b += m.capacity() * (1 + sizeof(std::pair<const std::uint64_t, Slot>));
  for (const auto& a : arenas_)
    b += a.words.capacity() * sizeof(std::uint32_t) + a.overflow.capacity() * (1 + sizeof(UserFingerprint)) +
         a.overflow_journal.capacity() * sizeof(UserFingerprint);
  return b;
}

std::uint64_t UserState::digest(std::uint64_t seed) const {
  constexpr std::uint64_t kPairDomain = 0x5061697273ULL;  // pairs hash apart from kept counts
  std::uint64_t total = 0;
#pragma omp parallel for schedule(dynamic, 4) reduction(+ : total)
  for (std::size_t s = 0; s < kShards; ++s) {
    const Arena& a = arenas_[s];
    for (const auto& [user, slot] : kept[s]) {
      const std::uint64_t u = partition::hash_combine(seed, user);
      total += partition::hash_combine(u, slot.kept);
      const std::uint32_t n = slot.block ? held(a.words[slot.block]) : 0;
      for (std::uint32_t i = 0; i < n; ++i)
        total += partition::hash_combine(u ^ kPairDomain, a.words[slot.block + 1 + i]);
    }
    for (const auto& [user, fingerprint] : a.overflow)
      total += partition::hash_combine(partition::hash_combine(seed, user) ^ kPairDomain, fingerprint);
  }
  return total;
}

namespace {

struct alignas(64) ThreadOut {  // padded: threads update their own counters
  std::vector<KeyPartial> partials;
  BoundingStats stats;
};

struct KeySum {  // a thread's pre-reduction of one key
  std::int64_t count = 0;
  int128 sum = 0;  // fixed point, exact (see record.hpp)
  std::int64_t new_users = 0;
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
  std::vector<ThreadOut> out(static_cast<std::size_t>(threads));
#pragma omp parallel num_threads(threads)
  {
    ThreadOut& mine = out[static_cast<std::size_t>(omp_get_thread_num())];
    absl::flat_hash_map<std::uint64_t, KeySum> local;                 // per-thread pre-reduction by key
    std::vector<std::pair<std::uint64_t, std::int64_t>> kept_values;  // (key, fixed value) of one user
#pragma omp for schedule(dynamic, 4)
    for (std::size_t s = 0; s < S; ++s) {
      Record* first = sharded.items.data() + sharded.offsets[s];
      Record* last = sharded.items.data() + sharded.offsets[s + 1];
      // Stream order within each user: (timestamp, position).
      std::sort(first, last, [](const Record& a, const Record& b) {
        return a.user != b.user ? a.user < b.user : stream_order_less(a, b);
      });
      if (s == S / 2) fault::point("bounding");
      for (Record* g = first; g != last;) {
        Record* g_end = g;
        while (g_end != last && g_end->user == g->user) ++g_end;
        const std::uint64_t user = g->user;
        auto [slot, added] = state.find_or_add(s, user);
        if (added) ++mine.stats.new_users;
        const auto n = static_cast<std::uint32_t>(g_end - g);
        const std::uint32_t allowance = params.max_records_per_user - slot->kept;
        const std::uint32_t take = std::min(n, allowance);
        slot->kept += take;
        mine.stats.kept += take;
        mine.stats.dropped += n - take;

        kept_values.clear();
        for (std::uint32_t i = 0; i < take; ++i) {
          double v = g[i].value;
          if (v < params.clamp_min || v > params.clamp_max) {
            v = std::clamp(v, params.clamp_min, params.clamp_max);
            ++mine.stats.clamped;
          }
          kept_values.emplace_back(g[i].key, quantize(to_fixed(v), params.value_quantum));
        }
        // Per-(user, key) aggregation: sort the user's kept records by key and walk the runs.
        std::sort(kept_values.begin(), kept_values.end());
        if (slot->block == 0 && take > 0) {  // a new user's block sized for its distinct keys
          std::uint32_t distinct = 1;
          for (std::size_t i = 1; i < kept_values.size(); ++i)
            distinct += kept_values[i].first != kept_values[i - 1].first;
          state.reserve_pairs(s, *slot, distinct);
        }
        for (std::size_t i = 0; i < kept_values.size();) {
          const std::uint64_t key = kept_values[i].first;
          auto& p = local[key];
          for (; i < kept_values.size() && kept_values[i].first == key; ++i) {
            ++p.count;
            p.sum += kept_values[i].second;
          }
          const std::uint32_t fingerprint = UserState::key_fingerprint(key);
          const bool first_touch = state.add_pair(s, user, *slot, fingerprint);
          p.new_users += first_touch || params.users_per_trigger ? 1 : 0;
        }
        if (state.journal && take > 0) state.mark_changed(s, *slot);
        g = g_end;
      }
    }
    mine.partials.reserve(local.size());
    for (const auto& [k, p] : local) append_partial(mine.partials, k, p.count, p.sum, p.new_users);
  }

  std::vector<KeyPartial> partials;
  for (auto& o : out) {
    partials.insert(partials.end(), o.partials.begin(), o.partials.end());
    stats.kept += o.stats.kept;
    stats.dropped += o.stats.dropped;
    stats.clamped += o.stats.clamped;
    stats.new_users += o.stats.new_users;
  }
  return partials;
}

}  // namespace dpstream::kernels
