#include "tools/naive_reference.hpp"

#include <algorithm>

namespace dpstream {

void NaiveReference::begin_window() {
  kept_.clear();
  touched_.clear();
  totals_.clear();
}

std::vector<KeyTotals> NaiveReference::process(std::vector<Record> records) {
  std::sort(records.begin(), records.end(), stream_order_less);
  std::unordered_set<std::uint64_t> changed;
  for (const Record& r : records) {
    auto& kept = kept_[r.user];
    if (kept >= c_) continue;
    ++kept;
    auto& t = totals_[r.key];
    t.key = r.key;
    ++t.count;
    t.sum += to_fixed(std::clamp(r.value, lo_, hi_));
    if (touched_.insert({r.user, r.key}).second) ++t.users;
    changed.insert(r.key);
  }
  std::vector<KeyTotals> out;
  out.reserve(changed.size());
  for (auto k : changed) out.push_back(totals_[k]);
  std::sort(out.begin(), out.end(), [](const KeyTotals& a, const KeyTotals& b) { return a.key < b.key; });
  return out;
}

}  // namespace dpstream
