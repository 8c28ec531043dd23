#include "tools/naive_reference.hpp"

#include <algorithm>
#include <map>
#include <set>

#include "kernels/bounding.hpp"

namespace dpstream {

void NaiveReference::begin_window() {
  kept_.clear();
  touched_.clear();
  totals_.clear();
}

std::vector<KeyTotals> NaiveReference::process(std::vector<Record> records) {
  std::sort(records.begin(), records.end(), stream_order_less);
  std::unordered_set<std::uint64_t> changed;
  std::map<std::uint64_t, std::set<std::uint64_t>> keys_of;  // each user's kept keys of this trigger
  for (const Record& r : records) {
    auto& kept = kept_[r.user];
    if (kept >= c_) continue;
    ++kept;
    auto& t = totals_[r.key];
    t.key = r.key;
    ++t.count;
    t.sum += to_fixed(std::clamp(r.value, lo_, hi_));
    keys_of[r.user].insert(r.key);
    changed.insert(r.key);
  }
  // The engine's first-touch rule: a user counts for a key when the key's fingerprint (salted by the
  // user) is new to that user, its keys of a trigger taken in ascending order (docs/PRIVACY.md section
  // 4); an exact (user, key) set differs where two keys of one user collide (about 1e-4 of the pairs).
  for (const auto& [user, keys] : keys_of)
    for (const std::uint64_t key : keys)
      if (touched_.insert({user, kernels::UserState::key_fingerprint(key, user)}).second) ++totals_[key].users;
  std::vector<KeyTotals> out;
  out.reserve(changed.size());
  for (auto k : changed) out.push_back(totals_[k]);
  std::sort(out.begin(), out.end(), [](const KeyTotals& a, const KeyTotals& b) { return a.key < b.key; });
  return out;
}

}  // namespace dpstream
