// IntervalSum (common/elapsed.hpp): intervals read on the time-stamp counter and converted at the steady clock's
// rate over the span, as key selection times key accumulation inside its shard loop.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>

#include "common/elapsed.hpp"

namespace {
// Busy for about `seconds` of steady-clock time.
void spin(double seconds) {
  const auto t0 = dpstream::SteadyClock::now();
  while (dpstream::seconds_since(t0) < seconds) {
  }
}
}  // namespace

// Intervals covering the whole span sum to the span; covering about half of it, to about half; none, to zero. The
// bounds are loose (a shared host may stop the thread anywhere), but a conversion off by the tick rate (GHz: 1e9
// too many) or intervals lost would fail them.
TEST(IntervalSum, ConvertsTicksAtTheSteadyClocksRate) {
  const auto span_start = dpstream::SteadyClock::now();
  dpstream::IntervalSum whole, half, none;
  for (int i = 0; i < 20; ++i) {
    const std::uint64_t t0 = dpstream::IntervalSum::ticks();
    spin(0.001);
    if (i % 2 == 0) half.add_since(t0);
    whole.add_since(t0);
  }
  const double span = dpstream::seconds_since(span_start);
  EXPECT_GT(whole.seconds(), 0.8 * span);
  EXPECT_LE(whole.seconds(), 1.05 * span);
  EXPECT_GT(half.seconds(), 0.2 * span);
  EXPECT_LT(half.seconds(), 0.8 * span);
  EXPECT_EQ(none.seconds(), 0.0);
}

// An interval whose start reads later than now (a lagging core's counter) adds nothing, rather than 2^64 ticks.
TEST(IntervalSum, ACounterThatReadsEarlierAddsNothing) {
  dpstream::IntervalSum sum;
  spin(0.001);
  sum.add_since(dpstream::IntervalSum::ticks() + (std::uint64_t{1} << 40));
  EXPECT_EQ(sum.seconds(), 0.0);
}
