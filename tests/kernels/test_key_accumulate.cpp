#include <gtest/gtest.h>

#include <algorithm>
#include <limits>

#include "kernels/key_accumulate.hpp"

using namespace dpstream;

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
