#include "kernels/key_accumulate.hpp"

#include <omp.h>

#include <algorithm>

#include "partition/hash.hpp"
#include "partition/partitioner.hpp"
#include "src/fault_injection.hpp"

namespace dpstream::kernels {

std::size_t KeyStateTable::shard_of(std::uint64_t key) {
  return partition::local_shard(partition::salted_hash(key, partition::kKeySalt), kShards);
}

void KeyStateTable::clear() {
  for (auto& s : shards) s.clear();
  for (auto& t : touched) t.clear();
  clear_journal();
}

void KeyStateTable::clear_journal() {
  for (auto& c : changed_keys) std::vector<std::uint64_t>().swap(c);
}

std::uint64_t KeyStateTable::keys() const {
  std::uint64_t n = 0;
  for (const auto& s : shards) n += s.size();
  return n;
}

std::uint64_t KeyStateTable::memory_bytes() const {
  std::uint64_t b = 0;
  for (const auto& s : shards) b += s.capacity() * (1 + sizeof(std::pair<const std::uint64_t, KeyState>));
  return b;
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
    auto& table = shards[s];
    touched[s].clear();
    for (KeyPartial* p = first; p != last;) {
      KeyState& st = table[p->key];
      const std::uint64_t key = p->key;
      KeyTotals trigger_totals{key, 0, 0, 0};
      for (; p != last && p->key == key; ++p) {
        trigger_totals.count += p->count;
        trigger_totals.sum += p->sum;  // 128 bits: cannot overflow (record.hpp)
        trigger_totals.users += p->new_users;
      }
      st.count += trigger_totals.count;
      st.sum += trigger_totals.sum;
      st.users += trigger_totals.users;
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
