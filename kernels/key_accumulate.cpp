#include "kernels/key_accumulate.hpp"

#include <omp.h>

#include <algorithm>
#include <stdexcept>

#include "common/fault_injection.hpp"
#include "partition/hash.hpp"
#include "partition/partitioner.hpp"

namespace dpstream::kernels {

std::size_t KeyStateTable::shard_of(std::uint64_t key) {
  return partition::local_shard(partition::salted_hash(key, partition::kKeySalt), kShards);
}

void KeyStateTable::clear() {
  for (auto& sh : shards_) sh = Shard{};
  for (auto& t : touched) t.clear();
  clear_journal();
}

void KeyStateTable::clear_journal() {
  for (auto& c : changed_keys) std::vector<std::uint64_t>().swap(c);
}

std::uint64_t KeyStateTable::keys() const {
  std::uint64_t n = 0;
  for (const auto& sh : shards_) n += sh.packed.size();
  return n;
}

std::uint64_t KeyStateTable::memory_bytes() const {
  std::uint64_t b = 0;
  for (const auto& sh : shards_)
    b += sh.packed.capacity() * (1 + sizeof(std::pair<const std::uint64_t, Packed>)) +
         sh.wide.capacity() * (1 + sizeof(std::pair<const std::uint64_t, KeyState>)) +
         sh.sums.capacity() * (1 + sizeof(std::pair<const std::uint64_t, Int128Words>));
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

KeyState KeyStateTable::load(const Shard& sh, std::uint64_t key, const Packed& p) const {
  if (p.count == kWide) return sh.wide.at(key);
  KeyState st;
  st.count = p.count;
  st.users = p.users;
  if (track_sums_)
    if (const auto it = sh.sums.find(key); it != sh.sums.end()) st.sum = it->second;
  return st;
}

// Packed while the round state is zero and count and users fit 32 bits; once not, the key's state
// stays full width (with its sum) for the rest of the window.
void KeyStateTable::store(Shard& sh, std::uint64_t key, Packed& p, const KeyState& st) {
  const auto fits = [](std::int64_t v) { return v >= 0 && v < std::int64_t{kWide}; };
  if (p.count != kWide && fits(st.count) && fits(st.users) && st.round_base_users == 0 && st.round == 0 &&
      st.round_start == 0) {
    p.count = static_cast<std::uint32_t>(st.count);
    p.users = static_cast<std::uint32_t>(st.users);
    if (track_sums_) {
      if (int128(st.sum) != 0)
        sh.sums[key] = st.sum;
      else
        sh.sums.erase(key);
    }
    return;
  }
  KeyState& wide = sh.wide[key];
  wide = st;
  if (!track_sums_) wide.sum = 0;
  if (p.count != kWide && track_sums_) sh.sums.erase(key);
  p.count = kWide;
}

KeyStateTable::Packed& KeyStateTable::slot(Shard& sh, std::uint64_t key) { return sh.packed[key]; }

std::optional<KeyState> KeyStateTable::find(std::uint64_t key) const {
  const Shard& sh = shards_[shard_of(key)];
  const auto it = sh.packed.find(key);
  if (it == sh.packed.end()) return std::nullopt;
  return load(sh, key, it->second);
}

KeyState KeyStateTable::at(std::uint64_t key) const {
  auto st = find(key);
  if (!st) throw std::out_of_range("KeyStateTable: key not tracked");
  return *st;
}

void KeyStateTable::put(std::uint64_t key, const KeyState& st) {
  Shard& sh = shards_[shard_of(key)];
  store(sh, key, slot(sh, key), st);
}

std::vector<KeyTotals> KeyStateTable::accumulate(const std::vector<KeyPartial>& partials, Report report) {
  constexpr std::size_t S = kShards;
  auto sharded = partition::partition_by(partials, S, [](const KeyPartial& p) { return shard_of(p.key); });
  std::vector<std::vector<KeyTotals>> changed(S);
#pragma omp parallel for schedule(dynamic, 4)
  for (std::size_t s = 0; s < S; ++s) {
    KeyPartial* first = sharded.items.data() + sharded.offsets[s];
    KeyPartial* last = sharded.items.data() + sharded.offsets[s + 1];
    if (s == S / 2) fault::point("accumulate");
    std::sort(first, last, [](const KeyPartial& a, const KeyPartial& b) { return a.key < b.key; });
    Shard& sh = shards_[s];
    touched[s].clear();
    for (KeyPartial* p = first; p != last;) {
      const std::uint64_t key = p->key;
      Packed& packed = slot(sh, key);
      KeyState st = load(sh, key, packed);
      KeyTotals trigger_totals{key, 0, 0, 0};
      for (; p != last && p->key == key; ++p) {
        trigger_totals.count += p->count;
        trigger_totals.sum += p->sum;  // 128 bits: cannot overflow (record.hpp)
        trigger_totals.users += p->new_users;
      }
      st.count += trigger_totals.count;
      if (track_sums_) st.sum += trigger_totals.sum;
      st.users += trigger_totals.users;
      store(sh, key, packed, st);
      if (journal) changed_keys[s].push_back(key);
      if (report == Report::RunningTotals) changed[s].push_back(KeyTotals{key, st.count, st.sum, st.users});
      if (report == Report::TriggerTotals) changed[s].push_back(trigger_totals);
      touched[s].push_back(key);
    }
  }
  std::vector<KeyTotals> out;
  for (auto& c : changed) out.insert(out.end(), c.begin(), c.end());
  std::sort(out.begin(), out.end(), [](const KeyTotals& a, const KeyTotals& b) { return a.key < b.key; });
  return out;
}

}  // namespace dpstream::kernels
