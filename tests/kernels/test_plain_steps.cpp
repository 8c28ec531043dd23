#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "common/int128.hpp"
#include "kernels/plain_steps.hpp"

using namespace dpstream;
using kernels::PlainSteps;
using kernels::banded::NoiseEdges;
using kernels::banded::NoiseInterval;

namespace {
constexpr std::int64_t kOne = std::int64_t{1} << 20;  // the engine's grid: 2^20 units per user

// The decisions a plain step must imply, computed as DpReleaser's threshold test and quiet-bound shortcut
// state them (kernels/dp_release.cpp): the test fails at the interval's top, and the boundary at both ends
// lies in (-2^30, 2^30) users, at least quiet + 2 at the top.
bool fails_and_keeps_quiet(double threshold, const NoiseInterval& i, std::int64_t users, std::int64_t quiet) {
  if (!i.known()) return false;
  const bool passes_at_top = to_double(int128{users} * kOne + i.hi) > threshold * static_cast<double>(kOne);
  const double least = threshold - to_double(i.hi) / static_cast<double>(kOne);
  const double most = threshold - to_double(i.lo) / static_cast<double>(kOne);
  return !passes_at_top && std::abs(least) < 0x1p30 && std::abs(most) < 0x1p30 &&
         least >= static_cast<double>(quiet) + 2;
}
}  // namespace

// Edges drawn within a few grid units of every limit PlainSteps keeps (the test's boundary at the current
// users, the quiet bound's, the 2^30 range), with every fractional offset: whatever it takes must pass the
// exact decisions, and away from the limits (by more than twice its margin) it takes every step they allow.
TEST(PlainSteps, TakesOnlyStepsTheExactTestsPassOver) {
  const std::vector<double> thresholds{0.5, 3.75, 17.0 + 1.0 / 3, 1234.5678, -6.25, 0x1p27, 0x1p28 - 1, 0x1p28, 1e12};
  const PlainSteps plain(thresholds, kOne);
  std::mt19937_64 g(7);
  std::uniform_real_distribution<double> unit(0, 1);
  std::uint64_t taken = 0, allowed = 0, far_allowed = 0, far_taken = 0;
  for (int trial = 0; trial < 400000; ++trial) {
    const auto step = static_cast<std::uint32_t>(g() % thresholds.size());
    const double m = thresholds[step];
    const std::int64_t users = static_cast<std::int64_t>(g() % 5000);
    std::int64_t quiet = std::numeric_limits<std::int64_t>::max();
    switch (g() % 4) {
      case 0:
        break;  // no bound yet
      case 1:
        quiet = users + static_cast<std::int64_t>(g() % 7) - 3;
        break;
      case 2:
        quiet = static_cast<std::int64_t>(std::floor(m)) - static_cast<std::int64_t>(g() % 40);
        break;
      default:
        quiet = -(std::int64_t{1} << 50);
        break;
    }
    const double floor = plain.floor_units(users, quiet);
    // The top edge around one of the limits and the bottom edge a width below it; or the bottom edge around the
    // range's limit; or anywhere from 2^31 users below the threshold (where the exact tests' 2^30 range fails)
    // up to it, with the top edge anywhere up to its limit (widths up to 2^51 units).
    const double limit_top = m * static_cast<double>(kOne) - floor;
    const double limit_bottom = (m - 0x1p29) * static_cast<double>(kOne);
    double above = 0, below = 0;
    const double jitter = (unit(g) - 0.5) * 40;
    switch (g() % 4) {
      case 0:
      case 1:
        above = std::floor(limit_top) + jitter;
        below = above - std::floor(unit(g) * 60) - unit(g);
        break;
      case 2:
        below = std::floor(limit_bottom) + jitter;
        above = below + std::floor(unit(g) * 60) + unit(g);
        break;
      default:
        below = (m - 0x1p31 + unit(g) * 0x1p31) * static_cast<double>(kOne);
        above = below + unit(g) * std::max(0.0, limit_top - below);
        break;
    }
    if (g() % 50 == 0) above = below = std::numeric_limits<double>::quiet_NaN();  // doubles cannot bound it
    const NoiseEdges e{below, above};
    const bool exact = fails_and_keeps_quiet(m, e.interval(), users, quiet);
    const bool took = plain.plain(e, floor, step);
    if (took) {
      ASSERT_TRUE(exact) << "step " << step << " users " << users << " quiet " << quiet << " edges " << below << " "
                         << above;
    }
    taken += took, allowed += exact;
    if (exact && above < limit_top - 2 * PlainSteps::kMarginUnits &&
        below > limit_bottom + 2 * PlainSteps::kMarginUnits && std::abs(m) < 0x1p28) {
      ++far_allowed;
      far_taken += took;
    }
  }
  EXPECT_GT(taken, 50000u);
  EXPECT_GT(far_allowed, 20000u);
  EXPECT_EQ(far_taken, far_allowed);  // conservative only within its margin
  EXPECT_GT(allowed, taken);          // that margin is used: some steps the exact tests allow go to them
}

// Far from every limit: the simulation's usual step (noise of tens of users, thresholds of tens).
TEST(PlainSteps, TakesTheUsualStep) {
  const PlainSteps plain({0, 20.5, 21.0}, kOne);
  const auto around = [](double users) {  // an interval of a few units around `users` users of noise
    const double v = users * static_cast<double>(kOne);
    return NoiseEdges{v - 3.5, v + 3.5};
  };
  EXPECT_TRUE(plain.plain(around(-4.0), plain.floor_units(10, 12), 1));          // 10 - 4 < 20.5; boundary 24.5 >= 14
  EXPECT_FALSE(plain.plain(around(11.0), plain.floor_units(10, 12), 1));         // 10 + 11 passes 20.5
  EXPECT_FALSE(plain.plain(around(-4.0), plain.floor_units(10, 23), 1));         // boundary 24.5 < 23 + 2: may lower it
  EXPECT_FALSE(plain.plain(around(-4.0), plain.floor_units(10, INT64_MAX), 2));  // no quiet bound yet
  EXPECT_FALSE(plain.plain(NoiseEdges{}, plain.floor_units(0, 0), 1));           // unknown interval
  EXPECT_TRUE(plain.plain(NoiseEdges{1, -1}, plain.floor_units(3, 5), 2));       // no noise yet: the interval [0, 0]
}

TEST(PlainSteps, RefusesAGridThatIsNotAPowerOfTwo) {
  EXPECT_THROW(PlainSteps({1.0}, 3), std::invalid_argument);
  EXPECT_THROW(PlainSteps({1.0}, 0), std::invalid_argument);
  EXPECT_NO_THROW(PlainSteps({1.0}, kOne));
}

// A run's failing count (PlainSteps::failing_users): every count up to it fails the threshold test, as
// DpReleaser's passes() states it, at every step of the run for every noise up to `above` (the integer noises
// just below it checked), and it is the largest such count up to the margins (one more passes somewhere with
// noise just below `above`, unless capped).
TEST(PlainSteps, FailingUsersFailEveryStepOfTheRun) {
  std::mt19937_64 g(13);
  std::vector<double> thresholds(300);
  for (double& t : thresholds) t = static_cast<double>(g() % 400000) / 1024.0 - 50;  // (-50, 340) users, fractions
  thresholds[250] = 0x1p28;                                                          // outside the range
  const PlainSteps plain(thresholds, kOne);
  std::uniform_real_distribution<double> unit(0, 1);
  std::uint64_t checked = 0, tight = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const auto first = static_cast<std::uint32_t>(1 + g() % 240), last = first + static_cast<std::uint32_t>(g() % 64);
    const double above = (unit(g) * 600 - 300) * static_cast<double>(kOne) + unit(g);
    const std::int64_t u = plain.failing_users(above, first, last);
    if (last >= 250) {
      EXPECT_EQ(u, PlainSteps::kNoCount) << "a threshold outside the range";
      continue;
    }
    ASSERT_NE(u, PlainSteps::kNoCount);
    double least = std::numeric_limits<double>::infinity();
    for (std::uint32_t s = first; s <= last; ++s) {
      least = std::min(least, thresholds[s]);
      for (std::int64_t below = 0; below < 3; ++below) {
        const auto noise = static_cast<std::int64_t>(std::floor(above)) - below;
        EXPECT_FALSE(to_double(int128{u} * kOne + noise) > thresholds[s] * static_cast<double>(kOne))
            << "count " << u << " passes at step " << s;
        ++checked;
      }
    }
    // One more user passes at the lowest threshold, but for the margin of 8 grid units and the roundings.
    const auto noise = static_cast<std::int64_t>(std::floor(above));
    tight += to_double(int128{u + 1} * kOne + noise + 10) > least * static_cast<double>(kOne);
  }
  EXPECT_GT(checked, 100000u);
  EXPECT_GT(tight, 15000u);  // all but the trials stopped by the range
  // Rising thresholds (the engine's plans; the least is the first step's) against the same scan on a copy whose
  // step 0 breaks the order.
  std::vector<double> rising(200);
  for (std::size_t s = 0; s < rising.size(); ++s) rising[s] = 100 + std::sqrt(static_cast<double>(s)) * 7.25;
  std::vector<double> broken = rising;
  broken[199] = 0;  // past every trial's steps: the same least thresholds, but `scanned` must scan
  const PlainSteps fast(rising, kOne), scanned(broken, kOne);
  for (int trial = 0; trial < 2000; ++trial) {
    const auto first = static_cast<std::uint32_t>(1 + g() % 150), last = first + static_cast<std::uint32_t>(g() % 49);
    const double above = (unit(g) * 200 - 100) * static_cast<double>(kOne);
    ASSERT_EQ(fast.failing_users(above, first, last), scanned.failing_users(above, first, last));
  }
  const std::vector<double> few{5.0, 6.0};
  const PlainSteps small(few, kOne);
  EXPECT_EQ(small.failing_users(std::numeric_limits<double>::quiet_NaN(), 0, 1), PlainSteps::kNoCount);
  EXPECT_EQ(small.failing_users(0x1p51, 0, 1), PlainSteps::kNoCount);
  EXPECT_EQ(small.failing_users(0, 1, 2), PlainSteps::kNoCount);  // beyond the steps
  const std::vector<double> high{0x1p28 - 1, 0x1p28 - 1};
  EXPECT_EQ(PlainSteps(high, kOne).failing_users(-0x1p50 + 1, 0, 1), std::int64_t{1} << 30);  // capped
}
