#include <gtest/gtest.h>

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

TEST(KeyAccumulate, SumOverflowIsAnErrorNotAWrap) {
  kernels::KeyStateTable table;
  const auto big = std::numeric_limits<std::int64_t>::max() - 5;
  table.accumulate({{1, 1, big, 1}});
  EXPECT_THROW(table.accumulate({{1, 1, 100, 0}}), std::overflow_error);
}
