#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/key_accumulate.hpp"
#include "partition/hash.hpp"
#include "tests/scoped_omp_threads.hpp"

using namespace dpstream;

namespace {
// The touched lists' key ids, per shard.
std::vector<std::vector<std::uint64_t>> touched_keys(const kernels::KeyStateTable& table) {
  std::vector<std::vector<std::uint64_t>> keys;
  for (const auto& shard : table.touched) {
    keys.emplace_back();
    for (const auto& t : shard) keys.back().push_back(t.key);
  }
  return keys;
}

// Accumulates `partials` in a fresh table and expects every key's totals (count, sum, users) exact and in key
// order, as a std::map adds them in 128 bits; `label` names the case.
void expect_totals_in_key_order(const std::vector<KeyPartial>& partials, const std::string& label) {
  std::map<std::uint64_t, std::array<int128, 3>> want;
  for (const KeyPartial& p : partials) {
    auto& w = want[p.key];
    w[0] += p.count, w[1] += p.sum, w[2] += p.new_users;
  }
  kernels::KeyStateTable table;
  const auto got = table.accumulate(partials);
  ASSERT_EQ(got.size(), want.size()) << label;
  auto w = want.begin();
  for (std::size_t i = 0; i < got.size(); ++i, ++w) {
    ASSERT_EQ(got[i].key, w->first) << label << ", at " << i;
    EXPECT_TRUE(int128{got[i].count} == w->second[0] && got[i].sum == w->second[1] &&
                int128{got[i].users} == w->second[2])
        << label << ", key " << got[i].key;
  }
}
}  // namespace

TEST(KeyAccumulate, RunningTotalsAndChangedKeysSorted) {
  kernels::KeyStateTable table;
  auto c1 = table.accumulate({{5, 1, 10, 1}, {3, 2, 20, 2}, {5, 3, 30, 1}});
  ASSERT_EQ(c1.size(), 2u);
  EXPECT_EQ(c1[0].key, 3u);
  EXPECT_EQ(c1[1].key, 5u);
  EXPECT_EQ(c1[1].count, 4);
  EXPECT_EQ(c1[1].sum, 40);
  EXPECT_EQ(c1[1].users, 2);
  auto c2 = table.accumulate({{5, 1, 1, 0}});
  ASSERT_EQ(c2.size(), 1u);
  EXPECT_EQ(c2[0].count, 5);
  EXPECT_EQ(c2[0].sum, 41);
  EXPECT_EQ(table.keys(), 2u);
  EXPECT_GT(table.memory_bytes(), 0u);
}

// The radix sort by key takes one pass per 11-bit digit in which keys differ: none (one key), one (keys below
// 2^11: the result copied back from the scratch buffer), three (below 2^33), six (any 64-bit key), each with
// 70000 partials (the threaded partition at two threads). Totals in key order, as a std::map adds them.
TEST(KeyAccumulate, TotalsInKeyOrderForKeysOfAnyWidthAndThreadCount) {
  for (const int key_bits : {0, 11, 33, 64})
    for (const int threads : {1, 2}) {
      dpstream::testing::ScopedOmpThreads scoped(threads);
      std::mt19937_64 rng(static_cast<std::uint64_t>(key_bits));
      std::vector<KeyPartial> partials;
      for (int i = 0; i < 70000; ++i) {
        const std::uint64_t key = key_bits == 0 ? 42 : key_bits == 64 ? rng() : rng() >> (64 - key_bits);
        partials.push_back({key, 1 + static_cast<std::int64_t>(rng() % 3), static_cast<std::int64_t>(rng() % 1000),
                            static_cast<std::int64_t>(rng() % 2)});
      }
      expect_totals_in_key_order(partials,
                                 std::to_string(key_bits) + "-bit keys, " + std::to_string(threads) + " thread(s)");
    }
}

// Large triggers (the radix sort's parallel passes) of keys that share a prefix (an id space that does not start
// at 0: only the digits that vary are sorted) and span two 11-bit digits to their ends, sums at int64's
// edges: every key's totals exact and in key order.
TEST(KeyAccumulate, LargeTriggersOfTwoDigitKeysTotalExactlyInKeyOrder) {
  const std::int64_t big = std::numeric_limits<std::int64_t>::max();
  for (const int key_bits : {12, 20, 22})
    for (const std::uint64_t prefix : {std::uint64_t{0}, std::uint64_t{0xABCD} << 40, ~std::uint64_t{0} << 22})
      for (const int threads : {1, 2}) {
        dpstream::testing::ScopedOmpThreads scoped(threads);
        std::mt19937_64 rng(static_cast<std::uint64_t>(key_bits) ^ prefix);
        std::vector<KeyPartial> partials;
        const std::uint64_t span = std::uint64_t{1} << key_bits;
        for (int i = 0; i < 80000; ++i) {
          // Half the partials on 64 keys (repeats in one cell), the rest anywhere, the span's ends included.
          const std::uint64_t low = i % 2 == 0 ? rng() % 64 * (span / 64) : i % 1001 == 1 ? span - 1 : rng() % span;
          const std::int64_t sum = i % 97 == 0 ? (i % 2 == 0 ? big : -big) : static_cast<std::int64_t>(rng() % 1000);
          partials.push_back(
              {prefix | low, 1 + static_cast<std::int64_t>(rng() % 3), sum, static_cast<std::int64_t>(rng() % 2)});
        }
        expect_totals_in_key_order(partials, std::to_string(key_bits) + "-bit keys, prefix " + std::to_string(prefix) +
                                                 ", " + std::to_string(threads) + " thread(s)");
      }
}

TEST(KeyAccumulate, SumsBeyondInt64AreExactNotAnError) {
  // Whether a sum leaves int64 depends on the data: it must neither abort nor wrap (record.hpp).
  kernels::KeyStateTable table;
  const std::int64_t big = std::numeric_limits<std::int64_t>::max() - 5;
  table.accumulate({{1, 1, big, 1}});
  auto after = table.accumulate({{1, 1, 100, 0}, {1, 1, big, 0}, {2, 1, -big, 1}, {2, 1, -big, 0}});
  ASSERT_EQ(after.size(), 2u);
  EXPECT_TRUE(after[0].sum == int128{big} * 2 + 100);
  EXPECT_EQ(after[0].count, 3);
  EXPECT_TRUE(after[1].sum == -int128{big} * 2);
  // The trigger's own totals (the per-batch baseline) are exact too.
  auto batch = table.accumulate({{1, 0, big, 0}, {1, 0, big, 0}}, kernels::KeyStateTable::Report::TriggerTotals);
  EXPECT_TRUE(batch.at(0).sum == int128{big} * 2);
}

TEST(KeyAccumulate, WidePartialSumsAreSplitIntoInt64Chunks) {
  for (const int128 sum : {int128{0}, int128{-7}, int128{INT64_MAX}, -int128{INT64_MAX}, int128{INT64_MAX} + 1,
                           int128{INT64_MIN}, int128{1} << 70, -(int128{1} << 70) - 3}) {
    std::vector<KeyPartial> out;
    append_partial(out, 9, 4, sum, 2);
    int128 total = 0;
    std::int64_t count = 0, users = 0;
    for (const KeyPartial& p : out) {
      EXPECT_EQ(p.key, 9u);
      total += p.sum;
      count += p.count;
      users += p.new_users;
    }
    EXPECT_TRUE(total == sum) << static_cast<double>(sum);
    EXPECT_EQ(count, 4);
    EXPECT_EQ(users, 2);
    const int128 magnitude = sum < 0 ? -sum : sum;  // ceil(|sum| / INT64_MAX) chunks, at least one
    EXPECT_EQ(out.size(), std::max<std::size_t>(1, static_cast<std::size_t>((magnitude + INT64_MAX - 1) / INT64_MAX)));
    kernels::KeyStateTable table;  // the key owner adds the chunks back exactly
    EXPECT_TRUE(table.accumulate(out).at(0).sum == sum);
  }
}

// Counts and users live in 32-bit fields until a value does not fit; then the key's state moves to
// the full-width side table. Whether that happens depends on the data: it must stay exact, never abort.
TEST(KeyAccumulate, CountsBeyond32BitsMoveTheKeyToFullWidthExactly) {
  for (const bool sums : {true, false}) {
    kernels::KeyStateTable table(sums);
    const std::int64_t near = 0xffffffffLL - 3;  // 2^32 - 4
    table.accumulate({{7, near, 5, near}, {8, 1, 2, 1}});
    auto totals = table.accumulate({{7, 2, 1, 2}, {7, 1, 1, 1}, {7, 9, 1, 0}, {8, 1, 2, 0}});
    ASSERT_EQ(totals.size(), 2u);
    EXPECT_EQ(totals[0].count, near + 12);  // crossed 2^32 - 1 within one trigger
    EXPECT_EQ(totals[0].users, near + 3);
    EXPECT_TRUE(totals[0].sum == (sums ? 8 : 0));
    EXPECT_EQ(totals[1].count, 2);
    EXPECT_TRUE(totals[1].sum == (sums ? 4 : 0));
    // A wide key keeps accumulating and its release fields round-trip.
    table.accumulate({{7, std::int64_t{1} << 40, 0, 1}});
    kernels::KeyState st = table.at(7);
    EXPECT_EQ(st.count, near + 12 + (std::int64_t{1} << 40));
    EXPECT_EQ(st.users, near + 4);
    st.round = 3;
    st.round_start = 17;
    st.round_base_users = st.users;
    table.put(7, st);
    EXPECT_TRUE(table.at(7) == st);
    EXPECT_EQ(table.keys(), 2u);
  }
}

// put/at round-trip every state exactly, at the edges of the packed fields and beyond them; a key
// put back with small values after going wide stays exact too.
TEST(KeyAccumulate, EveryStateRoundTripsPackedOrWide) {
  kernels::KeyStateTable table;
  const std::int64_t edges[] = {0,
                                1,
                                0x7ffffffdLL,
                                0x7ffffffeLL,
                                0x7fffffffLL,
                                0x80000000LL,
                                0xfffffffeLL,
                                0xffffffffLL,
                                0x100000000LL,
                                0x1fffffffeLL,
                                INT64_MAX,
                                -1,
                                INT64_MIN};
  std::uint64_t key = 1;
  std::vector<std::pair<std::uint64_t, kernels::KeyState>> put;
  for (const std::int64_t count : edges)
    for (const std::int64_t users : edges) {
      kernels::KeyState st;
      st.count = count;
      st.users = users;
      st.round_base_users = users / 2;
      st.round = static_cast<std::uint32_t>(key * 2654435761u);
      st.round_start = static_cast<std::uint32_t>(key);
      st.sum = (int128{count} << 20) - users;
      table.put(key, st);
      put.emplace_back(key++, st);
    }
  for (const auto& [k, st] : put) EXPECT_TRUE(table.at(k) == st) << "key " << k;
  kernels::KeyState small;
  small.count = 3;
  table.put(put.back().first, small);
  EXPECT_TRUE(table.at(put.back().first) == small);
  EXPECT_FALSE(table.find(key + 1000).has_value());
  EXPECT_THROW(table.at(key + 1000), std::out_of_range);
  std::uint64_t visited = 0;
  table.for_each([&](std::uint64_t k, const kernels::KeyState& st) {
    ++visited;
    EXPECT_TRUE(table.at(k) == st);
  });
  EXPECT_EQ(visited, put.size());
}

// A released key keeps its round state beside its slot (24-byte entries, not a 48-byte full state): exact
// through every change (released, released again, back to no round, beyond the packed limits and back),
// with base users up to 2^32 - 1 packed, and the side table costs what the entries need.
TEST(KeyAccumulate, ReleasedKeysKeepTheirRoundBesideTheSlotExactly) {
  constexpr std::uint64_t kKeys = 10000;
  kernels::KeyStateTable never(false), released(false);
  std::vector<KeyPartial> partials;
  for (std::uint64_t k = 0; k < kKeys; ++k) partials.push_back({k, 5, 0, 4});
  never.accumulate(partials, kernels::KeyStateTable::Report::Nothing);
  released.accumulate(partials, kernels::KeyStateTable::Report::Nothing);
  for (std::uint64_t k = 0; k < kKeys; ++k) {
    kernels::KeyState st = released.at(k);
    st.round = 1, st.round_start = 7, st.round_base_users = st.users;
    released.put(k, st);
  }
  // 10,000 keys over 256 side tables of 24-byte entries, each at most 7/8 and at least 7/16 full, plus a
  // control byte: under 58 B a key, where full states (56 B a slot) cost 130 at the same load.
  EXPECT_LE(released.memory_bytes() - never.memory_bytes(), kKeys * 58);
  released.accumulate(partials, kernels::KeyStateTable::Report::Nothing);  // a new trigger's records
  never.accumulate(partials, kernels::KeyStateTable::Report::Nothing);
  for (std::uint64_t k = 0; k < kKeys; ++k) {
    const kernels::KeyState st = released.at(k);
    ASSERT_EQ(st.count, 10);
    ASSERT_EQ(st.users, 8);
    ASSERT_EQ(st.round, 1u);
    ASSERT_EQ(st.round_start, 7u);
    ASSERT_EQ(st.round_base_users, 4);
  }
  // Every transition, on one key: each state read back exactly, and the digest as if put fresh.
  const std::int64_t big = 0xffffffffLL;
  const kernels::KeyState states[] = {
      {.count = 3, .users = 2, .round_base_users = 1, .round = 2, .round_start = 9},
      {.count = 3, .users = 2},  // no round again
      {.count = 0x7ffffffd, .users = 0x7fffffff, .round_base_users = 0x7fffffff, .round = 1, .round_start = 1},
      {.count = 0x7ffffffd, .users = 0x7fffffff, .round_base_users = big, .round = 1, .round_start = 1},
      {.count = 0x7ffffffe, .users = 1, .round_base_users = 1, .round = 1, .round_start = 1},    // not kFree: wide
      {.count = 0x80000000LL, .users = 5, .round_base_users = 1, .round = 3, .round_start = 4},  // wide
      {.count = 6, .users = 5, .round_base_users = 1, .round = 3, .round_start = 4},             // stays wide
      {.count = 1, .users = big + 1, .round_base_users = big + 1, .round = 7, .round_start = 8}};
  for (const kernels::KeyState& st : states) {
    released.put(3, st);
    EXPECT_TRUE(released.at(3) == st) << st.count << " " << st.users << " " << st.round_base_users;
    kernels::KeyStateTable fresh(false);
    for (std::uint64_t k = 0; k < kKeys; ++k)
      if (k != 3) fresh.put(k, released.at(k));
    fresh.put(3, st);
    EXPECT_EQ(fresh.digest(11), released.digest(11));
  }
  EXPECT_EQ(released.full_state_keys(kernels::KeyStateTable::shard_of(3)) > 0, true);
}

// A count-only query stores no sums: the same keys take less memory, and a never-released key is one
// 16-byte slot.
TEST(KeyAccumulate, CountOnlyTablesStoreNoSums) {
  kernels::KeyStateTable with_sums(true), count_only(false);
  std::vector<KeyPartial> partials;
  for (std::uint64_t k = 0; k < 100000; ++k) partials.push_back({k * 0x9E3779B97F4A7C15ull, 1, 1000, 1});
  with_sums.accumulate(partials, kernels::KeyStateTable::Report::Nothing);
  count_only.accumulate(partials, kernels::KeyStateTable::Report::Nothing);
  EXPECT_EQ(with_sums.keys(), count_only.keys());
  EXPECT_GE(with_sums.memory_bytes(), count_only.memory_bytes() + std::uint64_t{100000} * 16);
  // Hash slots (16 bytes + 1 control byte) at absl's load factor of at least 7/16 after growth.
  EXPECT_LE(count_only.memory_bytes(), 100000 * 17 * 16 / 7 + 256 * 64);
  EXPECT_TRUE(count_only.at(partials[5].key).sum == 0);
  EXPECT_TRUE(with_sums.at(partials[5].key).sum == 1000);
}

// The state digest depends on the contents only: the same states put in another order (so into
// other hash-table layouts) agree, a change of any one field of one key does not, nor does another seed.
TEST(KeyAccumulate, StateDigestIsOrderFreeAndSeesEveryField) {
  std::mt19937_64 rng(11);
  std::vector<std::pair<std::uint64_t, kernels::KeyState>> states;
  for (std::uint64_t k = 0; k < 20000; ++k) {
    kernels::KeyState st;
    st.count = static_cast<std::int64_t>(rng() % 50) + (k % 97 == 0 ? (std::int64_t{1} << 33) : 0);  // some wide
    st.users = st.count / 2 + 1;
    if (k % 13 == 0)
      st.round = static_cast<std::uint32_t>(1 + k % 3), st.round_start = static_cast<std::uint32_t>(k % 40),
      st.round_base_users = 2;
    st.sum = int128{static_cast<std::int64_t>(rng() % 1000)} - 500;
    states.emplace_back(rng(), st);
  }
  auto digest_of = [](const auto& list, std::uint64_t seed) {
    kernels::KeyStateTable t;
    for (const auto& [k, st] : list) t.put(k, st);
    return t.digest(seed);
  };
  const std::uint64_t d = digest_of(states, 4);
  auto reversed = states;
  std::reverse(reversed.begin(), reversed.end());
  EXPECT_EQ(digest_of(reversed, 4), d);
  EXPECT_NE(digest_of(states, 5), d);
  EXPECT_EQ(kernels::KeyStateTable().digest(4), 0u);
  const std::vector<void (*)(kernels::KeyState&)> changes = {
      [](kernels::KeyState& s) { ++s.count; },
      [](kernels::KeyState& s) { s.sum = int128(s.sum) + (int128{1} << 64); },
      [](kernels::KeyState& s) { s.sum = int128(s.sum) + 1; },
      [](kernels::KeyState& s) { ++s.users; },
      [](kernels::KeyState& s) { ++s.round_base_users; },
      [](kernels::KeyState& s) { ++s.round; },
      [](kernels::KeyState& s) { ++s.round_start; }};
  for (std::size_t c = 0; c < changes.size(); ++c)
    for (const std::size_t i : {std::size_t{0}, std::size_t{65}, std::size_t{291}}) {
      auto changed = states;
      changes[c](changed[i].second);
      EXPECT_NE(digest_of(changed, 4), d) << "change " << c << " of key " << i;
    }
  auto fewer = states;
  fewer.pop_back();
  EXPECT_NE(digest_of(fewer, 4), d);
}

// A packed slot holds count and users below 2^32 - 2 (2^32 - 2 marks a free slot, 2^32 - 1 a wide
// key): the values on either side of that edge are exact, whether put or accumulated.
TEST(KeyAccumulate, PackedEdgeAtTwoToThe32MinusTwoIsExact) {
  kernels::KeyStateTable table;
  const std::int64_t top = 0xfffffffdLL;  // once the largest packed value (2^31 - 1 now): exact either way
  table.accumulate({{1, top, 0, top}, {2, top - 1, 0, top - 1}});
  auto totals = table.accumulate({{1, 1, 0, 1}, {2, 1, 0, 1}});
  ASSERT_EQ(totals.size(), 2u);
  EXPECT_EQ(totals[0].count, top + 1);
  EXPECT_EQ(totals[0].users, top + 1);
  EXPECT_EQ(totals[1].count, top);
  EXPECT_EQ(totals[1].users, top);
  EXPECT_TRUE(totals[0].sum == 0);  // stored as -count * 2^20 beside the packed slot
  EXPECT_EQ(table.keys(), 2u);
  for (const std::int64_t v : {top - 1, top, top + 1, top + 2}) {
    kernels::KeyState st;
    st.count = v;
    st.users = top + top + 1 - v;
    st.sum = -v;
    table.put(static_cast<std::uint64_t>(v), st);
    EXPECT_TRUE(table.at(static_cast<std::uint64_t>(v)) == st) << v;
  }
  EXPECT_EQ(table.keys(), 6u);
}

// Sums are stored as their excess over count * 2^20: zero for counting data (no storage), anything
// else exact, through every change of sign and back to zero, packed or wide.
TEST(KeyAccumulate, SumsAreExactAsExcessOverCount) {
  constexpr std::int64_t one = std::int64_t{1} << 20;
  kernels::KeyStateTable counting, other;
  std::vector<KeyPartial> ones, varied;
  for (std::uint64_t k = 0; k < 50000; ++k) {
    ones.push_back({k, 3, 3 * one, 1});
    varied.push_back({k, 3, 3 * one + 1, 1});
  }
  counting.accumulate(ones, kernels::KeyStateTable::Report::Nothing);
  other.accumulate(varied, kernels::KeyStateTable::Report::Nothing);
  EXPECT_LE(counting.memory_bytes(), kernels::KeyStateTable(false).memory_bytes() + std::uint64_t{50000} * 32);
  EXPECT_GE(other.memory_bytes(), counting.memory_bytes() + std::uint64_t{50000} * 16);
  const std::int64_t steps[] = {-one - 1, 2, one, -5 * one, 4 * one - 1, INT64_MAX, INT64_MIN, -one * 3};
  int128 expected = int128{3} * one;
  std::int64_t count = 3;
  for (const std::int64_t sum : steps) {
    const auto totals = counting.accumulate({{7, 1, sum, 0}});
    expected += sum;
    ++count;
    EXPECT_TRUE(totals.at(0).sum == expected) << static_cast<double>(expected);
    EXPECT_TRUE(counting.at(7).sum == expected);
    EXPECT_EQ(totals.at(0).count, count);
  }
  kernels::KeyState st = counting.at(8);  // a wide key keeps its full sum
  st.round = 1;
  counting.put(8, st);
  counting.accumulate({{8, 1, 5, 0}});
  EXPECT_TRUE(counting.at(8).sum == 3 * one + 5);
}

// The report and the touched keys are in key order whatever the keys' bits (the radix sort skips the
// digits equal in every key) and whatever the thread count; repeated keys are added up.
TEST(KeyAccumulate, ReportIsSortedAndThreadFree) {
  std::mt19937_64 rng(3);
  std::vector<KeyPartial> partials;
  std::map<std::uint64_t, std::int64_t> counts;
  for (int i = 0; i < 30000; ++i) {
    const std::uint64_t r = rng();
    const std::uint64_t key = i % 3 == 0 ? r : i % 3 == 1 ? r % 5000 : (r % 7) << 50 | (r & 0xff);
    partials.push_back({key, 1 + i % 4, i, 1});
    counts[key] += 1 + i % 4;
  }
  std::vector<std::vector<KeyTotals>> reports;
  std::vector<std::vector<std::vector<std::uint64_t>>> touched;
  for (const int threads : {1, 3}) {
    dpstream::testing::ScopedOmpThreads scoped(threads);
    kernels::KeyStateTable table;
    reports.push_back(table.accumulate(partials));
    touched.push_back(touched_keys(table));
    EXPECT_EQ(table.keys(), counts.size());
  }
  ASSERT_EQ(reports[0].size(), counts.size());
  auto it = counts.begin();
  for (const KeyTotals& t : reports[0]) {
    EXPECT_EQ(t.key, it->first);
    EXPECT_EQ(t.count, it->second);
    ++it;
  }
  for (std::size_t i = 0; i < reports[0].size(); ++i) EXPECT_TRUE(reports[0][i].sum == reports[1][i].sum);
  EXPECT_EQ(touched[0], touched[1]);
  for (const auto& shard : touched[0]) EXPECT_TRUE(std::is_sorted(shard.begin(), shard.end()));
}

// The table grows in steps of 1/4 at a load of 5/6: a key costs at most 16 / (2/3) = 24 bytes (25 at
// 4/5), and every key inserted so far is found after each growth.
TEST(KeyAccumulate, PackedTableStaysDenseThroughGrowth) {
  kernels::KeyStateTable table(false);
  std::uint64_t inserted = 0;
  for (const std::uint64_t batch : {1000u, 9000u, 40000u, 150000u}) {
    std::vector<KeyPartial> partials;
    for (std::uint64_t k = inserted; k < inserted + batch; ++k)
      partials.push_back({k * 0x9E3779B97F4A7C15ull, 1, 0, 1});
    inserted += batch;
    table.accumulate(partials, kernels::KeyStateTable::Report::Nothing);
    EXPECT_EQ(table.keys(), inserted);
    EXPECT_LE(table.memory_bytes(), inserted * 24 + std::uint64_t{256} * 16 * 16);
    for (std::uint64_t k = 0; k < inserted; k += 997) EXPECT_EQ(table.at(k * 0x9E3779B97F4A7C15ull).count, 1);
  }
}

// Key selection's filter: `touched` lists, ascending per shard, exactly the keys whose round users
// exceed the bound after the trigger, and `touched_below` counts the rest.
TEST(KeyAccumulate, TouchedListsOnlyKeysAboveTheBoundAndCountsTheRest) {
  kernels::KeyStateTable table(false);
  std::vector<KeyPartial> first, second;
  for (std::uint64_t k = 1; k <= 3000; ++k) first.push_back({k, 1, 0, static_cast<std::int64_t>(k % 5)});
  table.accumulate(first, kernels::KeyStateTable::Report::Nothing, 3.0);
  kernels::KeyState released = table.at(7);  // a released key: its round counts users from 5 on
  released.round = 1, released.round_base_users = 2;
  table.put(7, released);
  for (std::uint64_t k = 1; k <= 3000; k += 2) second.push_back({k, 1, 0, 1});
  table.accumulate(second, kernels::KeyStateTable::Report::Nothing, 3.0);
  std::uint64_t listed = 0, below = 0;
  for (std::size_t s = 0; s < kernels::KeyStateTable::kShards; ++s) {
    const std::vector<std::uint64_t> keys = touched_keys(table)[s];
    EXPECT_TRUE(std::is_sorted(keys.begin(), keys.end()));
    for (const std::uint64_t k : keys) {
      const kernels::KeyState st = table.at(k);
      EXPECT_GT(static_cast<double>(st.users - st.round_base_users), 3.0) << k;
      EXPECT_EQ(k % 2, 1u);
      ++listed;
    }
    below += table.touched_below[s];
  }
  std::uint64_t want_listed = 0;
  for (std::uint64_t k = 1; k <= 3000; k += 2) {
    const kernels::KeyState st = table.at(k);
    want_listed += static_cast<double>(st.users - st.round_base_users) > 3.0;  // exactly 3 users: not listed
  }
  EXPECT_EQ(listed, want_listed);
  EXPECT_EQ(listed + below, 1500u);
  EXPECT_GT(listed, 0u);
  EXPECT_GT(below, 0u);
}

// reserve() sizes the key tables up front: keys held before it keep their state, and a table filled
// after it holds what one that grew holds, in about the same bytes (room for the share and its spread).
TEST(KeyAccumulate, ReserveKeepsStateAndTakesTheBytesOfGrowth) {
  auto partials = [](std::uint64_t from, std::uint64_t to) {
    std::vector<KeyPartial> out;
    for (std::uint64_t k = from; k < to; ++k)
      out.push_back({k * 0x9E3779B97F4A7C15ull, static_cast<std::int64_t>(1 + k % 7), 0, 1});
    return out;
  };
  const std::uint64_t n = 120000;
  kernels::KeyStateTable grown(false), reserved(false);
  grown.accumulate(partials(0, n), kernels::KeyStateTable::Report::Nothing);
  reserved.accumulate(partials(0, n / 3), kernels::KeyStateTable::Report::Nothing);
  const std::uint64_t third = reserved.digest(3);
  reserved.reserve(n);
  EXPECT_EQ(reserved.digest(3), third);
  const std::uint64_t bytes = reserved.memory_bytes();
  EXPECT_GE(bytes, grown.memory_bytes() * 9 / 10);  // sized for all n before they come
  reserved.reserve(0);                              // never shrinks
  EXPECT_EQ(reserved.memory_bytes(), bytes);
  reserved.accumulate(partials(n / 3, n), kernels::KeyStateTable::Report::Nothing);
  EXPECT_EQ(reserved.keys(), n);
  EXPECT_EQ(reserved.digest(3), grown.digest(3));
  EXPECT_LE(reserved.memory_bytes(), grown.memory_bytes() * 5 / 4);
  EXPECT_GE(reserved.memory_bytes(), grown.memory_bytes() * 4 / 5);
}

// Key selection's full scan puts a released key's new round while it iterates the key's shard: a put
// of a key already held must never reallocate the shard, even when the shard is exactly at its growth
// threshold (the bug: a release at that moment freed the slots under the scan, and the engine aborted
// on "key not tracked" at 10M users and C = 1). Every shard is filled key by key and, at each size,
// every key is put back with a round state in the middle of a scan: the scan must see each key once,
// with the state it had.
TEST(KeyAccumulate, PutOfAHeldKeyDuringAScanNeverReallocates) {
  kernels::KeyStateTable table;
  const std::size_t shard = kernels::KeyStateTable::shard_of(1);
  std::vector<std::uint64_t> keys;
  for (std::uint64_t k = 1; keys.size() < 200; ++k)
    if (kernels::KeyStateTable::shard_of(k) == shard) keys.push_back(k);
  std::size_t scans = 0;
  for (std::size_t n = 1; n <= keys.size(); ++n) {
    kernels::KeyState st;
    st.count = st.users = static_cast<std::int64_t>(n);
    table.put(keys[n - 1], st);
    std::map<std::uint64_t, std::int64_t> seen;
    table.for_each_in(shard, [&](std::uint64_t key, const kernels::KeyState& s) {
      EXPECT_TRUE(seen.emplace(key, s.count).second) << "key " << key << " seen twice with " << n << " keys";
      kernels::KeyState released = s;
      released.round = 1, released.round_start = 3, released.round_base_users = s.users;  // goes full width
      table.put(key, released);
    });
    ASSERT_EQ(seen.size(), n) << "the scan must see every key once";
    for (std::size_t i = 0; i < n; ++i) {
      const auto s = table.find(keys[i]);
      ASSERT_TRUE(s.has_value()) << "key not tracked after the scan, " << n << " keys";
      EXPECT_EQ(s->round, 1u);
      EXPECT_EQ(seen.at(keys[i]), s->count);
    }
    // Back to packed state for the next size (a key with round state stays wide; start each size fresh).
    ++scans;
  }
  EXPECT_EQ(scans, keys.size());
}

// Key selection reads a touched key's state from the list: after every trigger each listed state must
// be the table's, and both the sums of an independent model, whichever way accumulate took (in the
// slot, or through the side tables: released keys' rounds, sums off count * 2^20, counts and users
// crossing the packed limits, partials split into int64 chunks), with sums tracked or not.
TEST(KeyAccumulate, TouchedStatesAreTheTablesAfterEveryTrigger) {
  constexpr std::int64_t one = std::int64_t{1} << 20;
  constexpr std::int64_t edge = (std::int64_t{1} << 31) - 2;  // the first count a slot cannot hold
  for (const bool sums : {true, false}) {
    kernels::KeyStateTable table(sums);
    std::map<std::uint64_t, kernels::KeyState> model;
    std::mt19937_64 rng(sums ? 11 : 12);
    std::uint64_t in_side_tables = 0;
    for (int trigger = 0; trigger < 40; ++trigger) {
      std::vector<KeyPartial> partials;
      for (int i = 0; i < 3000; ++i) {
        const std::uint64_t key = rng() % 2000;
        const std::uint64_t kind = rng() % 100;
        std::int64_t count = 1 + static_cast<std::int64_t>(rng() % 4), users = static_cast<std::int64_t>(rng() % 2);
        if (kind == 0 && key % 50 == 0) count = users = edge / 3;  // a few keys grow past the slot's bits
        const std::int64_t sum = kind < 5    ? count * one + static_cast<std::int64_t>(rng() % 9) - 4
                                 : kind == 5 ? INT64_MAX
                                             : count * one;
        partials.push_back({key, count, sum, users});
        kernels::KeyState& m = model[key];
        m.count += count;
        m.users += users;
        if (sums) m.sum = int128(m.sum) + sum;
      }
      table.accumulate(partials, kernels::KeyStateTable::Report::Nothing, 2.0);
      std::uint64_t listed = 0;
      for (const auto& shard : table.touched)
        for (const auto& t : shard) {
          ++listed;
          EXPECT_TRUE(t.state == table.at(t.key)) << t.key << " at trigger " << trigger;
          EXPECT_TRUE(t.state == model.at(t.key)) << t.key << " at trigger " << trigger;
          EXPECT_GT(t.state.round_users(), 2.0);
        }
      std::uint64_t below = 0;
      for (const std::uint64_t b : table.touched_below) below += b;
      std::set<std::uint64_t> distinct;
      for (const KeyPartial& p : partials) distinct.insert(p.key);
      EXPECT_EQ(listed + below, distinct.size());
      // Release some keys as key selection does: a new round from the users so far.
      for (std::uint64_t key = static_cast<std::uint64_t>(trigger) % 7; key < 2000; key += 37) {
        if (!model.count(key)) continue;
        kernels::KeyState& m = model[key];
        ++m.round;
        m.round_start = static_cast<std::uint32_t>(trigger) + 1;
        m.round_base_users = m.users;
        table.put(key, m);
      }
    }
    for (const auto& [key, m] : model) {
      EXPECT_TRUE(table.at(key) == m) << key;
      in_side_tables += m.count >= edge || m.round != 0;
    }
    EXPECT_GT(in_side_tables, 50u);  // both ways were taken
    // A released key's count or users reaching the slot's limits by one in-place add (with the round's
    // bit a count of 2^31 - 2 would read as a free slot, 2^31 - 1 as a wide key).
    for (const std::int64_t target : {edge - 1, edge, edge + 1}) {
      for (const bool of_users : {false, true}) {
        const std::uint64_t key = 100000 + static_cast<std::uint64_t>(target - edge + 1) * 2 + of_users;
        kernels::KeyState st;
        st.count = of_users ? 5 : target - 1;
        st.users = of_users ? (std::int64_t{1} << 31) - 2 + (target - edge) : 3;
        st.sum = sums ? int128{st.count} * one : 0;
        st.round = 2, st.round_start = 9, st.round_base_users = 1;
        table.put(key, st);
        table.accumulate({{key, 1, one, of_users ? 1 : 0}}, kernels::KeyStateTable::Report::Nothing, 0.0);
        st.count += 1;
        st.users += of_users ? 1 : 0;
        if (sums) st.sum = int128(st.sum) + one;
        EXPECT_TRUE(table.at(key) == st) << target << " users " << of_users;
        ASSERT_EQ(table.touched[kernels::KeyStateTable::shard_of(key)].size(), 1u);
        EXPECT_TRUE(table.touched[kernels::KeyStateTable::shard_of(key)][0].state == st);
        // Key selection finds its cache entry by this hash (a wrong one finds none: the key is visited again).
        EXPECT_EQ(table.touched[kernels::KeyStateTable::shard_of(key)][0].hash, partition::key_hash(key));
      }
    }
  }
}
