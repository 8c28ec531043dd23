#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <random>

#include "kernels/bounding.hpp"
#include "kernels/key_accumulate.hpp"
#include "src/naive_reference.hpp"
#include "tests/scoped_omp_threads.hpp"

using namespace dpstream;

namespace {

// A trigger of records with heavy users, ties in time, values outside the clamp range, and
// the records in a scrambled order (arrival order must not matter).
std::vector<Record> random_trigger(std::mt19937_64& rng, int trigger, std::uint64_t& position) {
  std::vector<Record> out;
  std::uniform_int_distribution<int> n_dist(0, 400);
  const int n = n_dist(rng);
  for (int i = 0; i < n; ++i) {
    const std::uint64_t user = (rng() % 4 == 0) ? 7 : rng() % 60;  // user 7 is heavy
    const std::uint64_t key = rng() % 25;
    const double value = std::uniform_real_distribution<double>(-3.0, 5.0)(rng);
    out.push_back(Record{user, key, trigger * 100 + static_cast<std::int64_t>(rng() % 5), position++, value});
  }
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

struct Totals {
  std::int64_t count;
  int128 sum;
  std::int64_t users;
  bool operator==(const Totals&) const = default;
};

}  // namespace

TEST(Bounding, MatchesNaiveReferenceOverManyTriggers) {
  const std::uint32_t C = 6;
  const double lo = -1.0, hi = 2.5;
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    std::mt19937_64 rng(12345);
    kernels::UserState users;
    kernels::KeyStateTable keys;
    kernels::BoundingStats stats;
    NaiveReference naive(C, lo, hi);
    naive.begin_window();
    std::uint64_t position = 0, total = 0;
    for (int t = 0; t < 30; ++t) {
      auto records = random_trigger(rng, t, position);
      total += records.size();
      auto partials = kernels::bound_and_aggregate(records, {C, lo, hi}, users, stats);
      const auto got = keys.accumulate(partials);
      const auto want = naive.process(records);
      ASSERT_EQ(got.size(), want.size()) << "trigger " << t;
      for (std::size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].key, want[i].key);
        EXPECT_EQ((Totals{got[i].count, got[i].sum, got[i].users}), (Totals{want[i].count, want[i].sum, want[i].users}))
            << "trigger " << t << " key " << got[i].key;
      }
    }
    EXPECT_EQ(stats.kept + stats.dropped, total);
    for (const auto& shard : users.kept)
      for (const auto& [user, kept] : shard) EXPECT_LE(kept, C) << "user " << user;
    EXPECT_GT(stats.dropped, 0u);
    EXPECT_GT(stats.clamped, 0u);
  }
}

TEST(Bounding, KeepsTheFirstCInStreamOrderNotArrivalOrder) {
  kernels::UserState users;
  kernels::BoundingStats stats;
  // One user, 5 records on 5 keys; C = 2. Stream order: (timestamp, position).
  std::vector<Record> records = {
      {1, 50, 10, 4, 1.0}, {1, 40, 10, 3, 1.0}, {1, 30, 5, 9, 1.0}, {1, 20, 7, 0, 1.0}, {1, 10, 12, 1, 1.0}};
  auto partials = kernels::bound_and_aggregate(records, {2, 0.0, 1.0}, users, stats);
  std::sort(partials.begin(), partials.end(), [](auto& a, auto& b) { return a.key < b.key; });
  ASSERT_EQ(partials.size(), 2u);
  EXPECT_EQ(partials[0].key, 20u);  // t = 7
  EXPECT_EQ(partials[1].key, 30u);  // t = 5
  EXPECT_EQ(stats.dropped, 3u);
}

TEST(Bounding, ClampsAndCountsAUserOncePerKey) {
  kernels::UserState users;
  kernels::BoundingStats stats;
  // 1e300 and -1e300 would overflow a fixed-point conversion: clamping comes first.
  std::vector<Record> t0 = {{9, 1, 0, 0, 1e300}, {9, 1, 1, 1, -1e300}, {9, 2, 2, 2, 0.25}};
  auto p0 = kernels::bound_and_aggregate(t0, {10, -1.0, 1.0}, users, stats);
  std::sort(p0.begin(), p0.end(), [](auto& a, auto& b) { return a.key < b.key; });
  ASSERT_EQ(p0.size(), 2u);
  EXPECT_EQ(p0[0].count, 2);
  EXPECT_EQ(p0[0].sum, 0);  // 1 + (-1)
  EXPECT_EQ(p0[0].new_users, 1);
  EXPECT_EQ(p0[1].sum, to_fixed(0.25));
  EXPECT_EQ(stats.clamped, 2u);
  // Next trigger: the same user on key 1 again is not a new user for key 1.
  std::vector<Record> t1 = {{9, 1, 5, 3, 0.5}};
  auto p1 = kernels::bound_and_aggregate(t1, {10, -1.0, 1.0}, users, stats);
  ASSERT_EQ(p1.size(), 1u);
  EXPECT_EQ(p1[0].new_users, 0);
  EXPECT_EQ(users.users(), 1u);
  EXPECT_EQ(users.user_key_pairs(), 2u);
  users.clear();
  EXPECT_EQ(users.users(), 0u);
}

TEST(Bounding, SumsBeyondInt64NeverAbortAndStayExact) {
  // 6000 users with C = 2 records of the largest value on key 7, and as many of the smallest on key 8:
  // each key's sum is 12000 * 2^51 ~ 2^64.6 in fixed point, beyond int64 within one trigger.
  const std::uint32_t C = 2;
  const double lo = -kMaxAbsClamp, hi = kMaxAbsClamp;
  std::vector<Record> records;
  std::uint64_t position = 0;
  for (std::uint64_t u = 0; u < 6000; ++u)
    for (int i = 0; i < 3; ++i) {  // the third record of each user is dropped by bounding
      records.push_back({u, 7, static_cast<std::int64_t>(position), position, 1e12});  // clamped to 2^31
      ++position;
      records.push_back({100000 + u, 8, static_cast<std::int64_t>(position), position, -hi});
      ++position;
    }
  const int128 one_record = int128{1} << 51;  // 2^31 in 2^-20 fixed point
  for (const int threads : {1, 2}) {
    dpstream::testing::ScopedOmpThreads scoped(threads);
    kernels::UserState users;
    kernels::KeyStateTable keys;
    kernels::BoundingStats stats;
    const auto partials = kernels::bound_and_aggregate(records, {C, lo, hi}, users, stats);
    const auto got = keys.accumulate(partials);
    ASSERT_EQ(got.size(), 2u);
    EXPECT_EQ(got[0].key, 7u);
    EXPECT_EQ(got[0].count, 12000);
    EXPECT_EQ(got[0].users, 6000);
    EXPECT_TRUE(got[0].sum == 12000 * one_record) << static_cast<double>(got[0].sum);
    EXPECT_TRUE(got[1].sum == -12000 * one_record) << static_cast<double>(got[1].sum);
    EXPECT_EQ(stats.dropped, 12000u);
    // The same trigger again (new positions do not matter: C is reached): the running sums hold.
    const auto again = keys.accumulate(kernels::bound_and_aggregate(records, {C, lo, hi}, users, stats));
    EXPECT_TRUE(again.empty());
  }
}
