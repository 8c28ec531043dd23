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

// Intervals covering the whole span sum to about the span; the even and the odd ones add up to the whole; none sum
// to zero. The whole's bounds are loose and the halves are not compared with the span: a shared host may stop the
// thread inside any one interval for longer than the others together (CI saw an even half of 0.0458 s in a 0.0447 s
// span). A conversion off by the tick rate (GHz: 1e9 too many) or intervals lost still fail.
TEST(IntervalSum, ConvertsTicksAtTheSteadyClocksRate) {
  const auto span_start = dpstream::SteadyClock::now();
  dpstream::IntervalSum whole, even, odd, none;
  for (int i = 0; i < 20; ++i) {
    const std::uint64_t t0 = dpstream::IntervalSum::ticks();
    spin(0.001);
    (i % 2 == 0 ? even : odd).add_since(t0);
    whole.add_since(t0);
  }
  const double span = dpstream::seconds_since(span_start);
  EXPECT_GT(whole.seconds(), 0.5 * span);
  EXPECT_LE(whole.seconds(), 1.5 * span);
  EXPECT_GT(even.seconds(), 0.0);
  EXPECT_GT(odd.seconds(), 0.0);
  EXPECT_NEAR(even.seconds() + odd.seconds(), whole.seconds(), 0.01 * whole.seconds());
  EXPECT_EQ(none.seconds(), 0.0);
}

// An interval whose start reads later than now (a lagging core's counter) adds nothing, rather than 2^64 ticks.
TEST(IntervalSum, ACounterThatReadsEarlierAddsNothing) {
  dpstream::IntervalSum sum;
  spin(0.001);
  sum.add_since(dpstream::IntervalSum::ticks() + (std::uint64_t{1} << 40));
  EXPECT_EQ(sum.seconds(), 0.0);
}
