#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <span>
#include <unordered_set>

#include "partition/hash.hpp"
#include "partition/partitioner.hpp"
#include "partition/radix_sort.hpp"

using namespace dpstream::partition;

TEST(Hash, Mix64IsABijectionOnASample) {
  std::unordered_set<std::uint64_t> seen;
  for (std::uint64_t i = 0; i < 1'000'000; ++i) ASSERT_TRUE(seen.insert(salted_hash(i, kUserSalt)).second) << i;
}

TEST(Hash, UnmixInvertsMixEverywhere) {
  std::mt19937_64 rng(99);
  std::vector<std::uint64_t> ids = {0, 1, 2, ~std::uint64_t{0}, std::uint64_t{1} << 63, kUserSalt, kUserSlotSalt};
  for (int i = 0; i < 1'000'000; ++i) ids.push_back(rng());
  for (const std::uint64_t id : ids) {
    ASSERT_EQ(unmix64(mix64(id)), id) << id;
    ASSERT_EQ(mix64(unmix64(id)), id) << id;
    ASSERT_EQ(salted_unhash(salted_hash(id, kUserSlotSalt), kUserSlotSalt), id) << id;
  }
  // Each step's inverse on its own: a wrong iteration count would miss the lowest bits of large values.
  for (const int s : {27, 30, 31})
    for (const std::uint64_t y : ids) ASSERT_EQ(unshift_xor(y ^ (y >> s), s), y) << s;
  for (const std::uint64_t a : {kMixMultiplier1, kMixMultiplier2, std::uint64_t{3}, ~std::uint64_t{0}})
    EXPECT_EQ(a * inverse_mod_2_64(a), 1u) << a;
}

TEST(Hash, SaltsGiveDifferentPartitions) {
  int same = 0;
  const int P = 4, n = 100'000;
  for (std::uint64_t i = 0; i < n; ++i)
    same += owner_rank(salted_hash(i, kUserSalt), P) == owner_rank(salted_hash(i, kKeySalt), P);
  // Independent salts agree with probability 1/P: 25000 expected, sd ~137; 10 sd margin.
  EXPECT_NEAR(same, static_cast<double>(n) / P, 1400);
}

TEST(Hash, OwnerIsInRangeAndUniform) {
  for (int P : {1, 2, 3, 7, 64}) {
    std::vector<double> counts(P, 0);
    const int n = 700'000;
    for (std::uint64_t i = 0; i < n; ++i) {
      const int o = owner_rank(salted_hash(i, kKeySalt), P);
      ASSERT_GE(o, 0);
      ASSERT_LT(o, P);
      counts[o] += 1;
    }
    // Chi-square with P-1 dof; bound at mean + 10 sd is a false-failure rate far below 1e-9.
    double chi2 = 0, e = static_cast<double>(n) / P;
    for (double c : counts) chi2 += (c - e) * (c - e) / e;
    EXPECT_LT(chi2, (P - 1) + 10 * std::sqrt(2.0 * std::max(1, P - 1))) << "P=" << P;
  }
  EXPECT_EQ(owner_rank(~0ULL, 5), 4);
  EXPECT_EQ(owner_rank(0, 5), 0);
}

TEST(Partitioner, GroupsStablyAndCounts) {
  std::vector<std::uint64_t> items(200'003);
  for (std::size_t i = 0; i < items.size(); ++i) items[i] = i;
  auto dest = [](std::uint64_t v) { return static_cast<std::size_t>(salted_hash(v, kUserSalt) % 5); };
  auto p = partition_by(items, 5, dest);
  ASSERT_EQ(p.items.size(), items.size());
  ASSERT_EQ(p.offsets.back(), items.size());
  for (std::size_t d = 0; d < 5; ++d) {
    EXPECT_EQ(p.offsets[d + 1] - p.offsets[d], p.counts[d]);
    for (std::size_t i = p.offsets[d]; i < p.offsets[d + 1]; ++i) {
      EXPECT_EQ(dest(p.items[i]), d);
      if (i > p.offsets[d]) {
        EXPECT_LT(p.items[i - 1], p.items[i]) << "not stable";
      }
    }
  }
}

TEST(Partitioner, SameResultForAnyThreadCount) {
  std::vector<std::uint64_t> items(300'000);
  for (std::size_t i = 0; i < items.size(); ++i) items[i] = salted_hash(i, 42);
  auto dest = [](std::uint64_t v) { return static_cast<std::size_t>(v % 7); };
  omp_set_num_threads(1);
  auto one = partition_by(items, 7, dest);
  omp_set_num_threads(2);
  auto two = partition_by(items, 7, dest);
  EXPECT_EQ(one.items, two.items);
  EXPECT_EQ(one.offsets, two.offsets);
}

// The runtime may start fewer threads than asked (OMP_THREAD_LIMIT, OMP_DYNAMIC; here a region nested in an
// active one): every item is still placed, as with one thread.
TEST(Partitioner, SurvivesFewerThreadsThanAsked) {
  std::vector<std::uint64_t> items(300'000);
  for (std::size_t i = 0; i < items.size(); ++i) items[i] = salted_hash(i, 43);
  auto dest = [](std::uint64_t v) { return static_cast<std::size_t>(v % 7); };
  const int threads_before = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto want = partition_by(items, 7, dest);
  omp_set_num_threads(2);
  const int levels = omp_get_max_active_levels();
  omp_set_max_active_levels(1);
  Partitioned<std::uint64_t> got;
  int inner_threads = 0, asked = 0;
#pragma omp parallel num_threads(2)
  if (omp_get_thread_num() == 0) {
    asked = omp_get_max_threads();
#pragma omp parallel
    if (omp_get_thread_num() == 0) inner_threads = omp_get_num_threads();
    got = partition_by(items, 7, dest);
  }
  omp_set_max_active_levels(levels);
  omp_set_num_threads(threads_before);
  ASSERT_LT(inner_threads, asked) << "the nested region should get fewer threads than asked";
  EXPECT_EQ(got.items, want.items);
  EXPECT_EQ(got.offsets, want.offsets);
}

TEST(Partitioner, EmptyInput) {
  std::vector<int> none;
  auto p = partition_by(none, 3, [](int) { return 0; });
  EXPECT_TRUE(p.items.empty());
  EXPECT_EQ(p.offsets, (std::vector<std::uint64_t>{0, 0, 0, 0}));
}

// radix_sort_lsd against std::stable_sort by the same digits, the last pass's most significant: items with equal
// digits keep their order, and the result is in the buffer returned, for one to four digits, adjacent, overlapping
// or leaving bits out; with 32-bit counts kept from call to call (bounding's) and with 64-bit ones (the key sort's).
TEST(RadixSort, MatchesStableSortByItsDigits) {
  struct Item {
    std::uint64_t key;
    std::uint32_t at;
  };
  constexpr int kBits = 10;
  std::vector<std::uint32_t> kept_counts;
  for (const std::vector<int>& shifts :
       {std::vector<int>{0}, std::vector<int>{0, 10}, std::vector<int>{40, 50, 54}, std::vector<int>{0, 5, 10, 15}}) {
    std::vector<Item> items(5'000);
    for (std::size_t i = 0; i < items.size(); ++i)  // each key 2-3 times: stability shows
      items[i] = {salted_hash(i % 1'700, 7), static_cast<std::uint32_t>(i)};
    const auto digit = [](const Item& x, int shift) { return x.key >> shift & ((std::uint64_t{1} << kBits) - 1); };
    std::vector<Item> want = items;
    std::stable_sort(want.begin(), want.end(), [&](const Item& a, const Item& b) {
      for (auto s = shifts.rbegin(); s != shifts.rend(); ++s)
        if (digit(a, *s) != digit(b, *s)) return digit(a, *s) < digit(b, *s);
      return false;
    });
    const auto check = [&](auto& counts, const char* label) {
      std::vector<Item> copy = items, scratch(items.size());
      const Item* got = radix_sort_lsd(
          copy.data(), scratch.data(), copy.size(), std::span<const int>(shifts), kBits,
          [](const Item& x) { return x.key; }, counts);
      ASSERT_EQ(got, shifts.size() % 2 == 0 ? copy.data() : scratch.data()) << shifts.size() << " digits, " << label;
      for (std::size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(got[i].key, want[i].key) << i << ", " << label;
        ASSERT_EQ(got[i].at, want[i].at) << i << ", " << label;
      }
    };
    check(kept_counts, "32-bit counts kept between calls");
    std::vector<std::uint64_t> wide_counts;
    check(wide_counts, "64-bit counts");
  }
}
