#include "kernels/bounding.hpp"

#include <omp.h>

#include <algorithm>

#include "partition/hash.hpp"
#include "partition/partitioner.hpp"
#include "src/fault_injection.hpp"

namespace dpstream::kernels {

void UserState::clear() {
  for (auto& m : kept) m.clear();
  for (auto& s : touched) s.clear();
  clear_journal();
}

void UserState::clear_journal() {
  for (auto& u : changed_users) std::vector<std::pair<std::uint64_t, std::uint32_t>>().swap(u);
  for (auto& p : new_pairs) std::vector<std::pair<std::uint64_t, std::uint32_t>>().swap(p);
}

std::uint32_t UserState::key_fingerprint(std::uint64_t key) {
  return static_cast<std::uint32_t>(partition::salted_hash(key, partition::kFingerprintSalt) >> 32);
}

std::pair<UserState::Slot*, bool> UserState::find_or_add(std::size_t shard, std::uint64_t user) {
  auto& map = kept[shard];
  const auto index = static_cast<std::uint32_t>(map.size());  // dense: users leave only with clear()
  auto [it, added] = map.try_emplace(user, Slot{0, index});
  return {&it->second, added};
}

std::vector<std::pair<std::uint64_t, std::uint32_t>> UserState::pairs(std::size_t shard) const {
  std::vector<std::uint64_t> user_of(kept[shard].size());
  for (const auto& [user, slot] : kept[shard]) user_of[slot.index] = user;
  std::vector<std::pair<std::uint64_t, std::uint32_t>> out;
  out.reserve(touched[shard].size());
  for (const std::uint64_t code : touched[shard])
    out.emplace_back(user_of[code >> 32], static_cast<std::uint32_t>(code));
  return out;
}

std::uint64_t UserState::users() const {
  std::uint64_t n = 0;
  for (const auto& m : kept) n += m.size();
  return n;
}

std::uint64_t UserState::user_key_pairs() const {
  std::uint64_t n = 0;
  for (const auto& s : touched) n += s.size();
  return n;
}

std::uint64_t UserState::memory_bytes() const {
  // flat_hash_* store one control byte plus the slot per capacity entry.
  std::uint64_t b = 0;
  for (const auto& m : kept) b += m.capacity() * (1 + sizeof(std::pair<const std::uint64_t, Slot>));
  for (const auto& s : touched) b += s.capacity() * (1 + sizeof(std::uint64_t));
  return b;
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
  auto sharded = partition::partition_by(records, S, [](const Record& r) {
    return partition::local_shard(salted_hash(r.user, kUserSalt), S);
  });

  const int threads = omp_get_max_threads();
  std::vector<ThreadOut> out(static_cast<std::size_t>(threads));
#pragma omp parallel num_threads(threads)
  {
    ThreadOut& mine = out[static_cast<std::size_t>(omp_get_thread_num())];
    absl::flat_hash_map<std::uint64_t, KeySum> local;  // per-thread pre-reduction by key
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
      auto& changed_users = state.changed_users[s];
      auto& new_pairs = state.new_pairs[s];
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
        if (state.journal && take > 0) changed_users.emplace_back(user, slot->kept);
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
        for (std::size_t i = 0; i < kept_values.size();) {
          const std::uint64_t key = kept_values[i].first;
          auto& p = local[key];
          for (; i < kept_values.size() && kept_values[i].first == key; ++i) {
            ++p.count;
            p.sum += kept_values[i].second;
          }
          const std::uint32_t fingerprint = UserState::key_fingerprint(key);
          const bool first_touch = state.add_pair(s, *slot, fingerprint);
          if (state.journal && first_touch) new_pairs.emplace_back(user, fingerprint);
          p.new_users += first_touch || params.users_per_trigger ? 1 : 0;
        }
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
