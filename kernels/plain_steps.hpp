// Key selection's simulations (kernels/dp_release.cpp) pass over most of the steps they simulate: those
// that fail the threshold test for every noise their interval allows and cannot lower the key's quiet
// bound. PlainSteps decides that on a step's NoiseEdges with two compares, where DpReleaser's exact tests
// (passes() at the interval's top, quiet_bound_holds()) convert the rounded interval twice and divide; a
// step it does not take goes through those tests, so it changes no decision of the simulation.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/banded_counter.hpp"

namespace dpstream::kernels {

class PlainSteps {
 public:
  // thresholds[s] = mu + tau[s] in users, the double the threshold test compares against at round step s;
  // `one`: grid units per user, a power of two.
  PlainSteps(const std::vector<double>& thresholds, std::int64_t one);
  PlainSteps() = default;

  // The floor on the users a plain step must fail for: max(0, round users, quiet users + 2), in grid units.
  double floor_units(std::int64_t round_users, std::int64_t quiet_users) const;
  // True only if the step fails the test at `round_users` for every noise in e.interval() and every such
  // noise leaves `quiet_users` as it is (floor = floor_units(round_users, quiet_users)); NaN edges: false.
  bool plain(const banded::NoiseEdges& e, double floor, std::uint32_t step) const {
    return e.above <= top_[step] - floor && e.below >= bottom_[step];
  }

  // The largest user count that fails the threshold test at every round step first..last for every noise at
  // or below `above` (grid units, |above| < 2^50), at most 2^30; kNoCount when a threshold there lies outside
  // (-2^28, 2^28) users or `above` is not within 2^50 (the count is also at most 2^50 grid units). A run of a
  // simulation whose noise is bounded by BandedNoise::run_bounds fails at every step for these counts (and any round
  // users among them).
  static constexpr std::int64_t kNoCount = std::numeric_limits<std::int64_t>::min();
  std::int64_t failing_users(double above, std::uint32_t first, std::uint32_t last) const;

  // Grid units kept between a plain step's edges and the limits: covers the interval's +-1 and ceil/floor
  // (2), the limits' and the subtraction's roundings (under 1) and the quiet test's margin (under 1).
  static constexpr double kMarginUnits = 8;

 private:
  double one_ = 1;
  std::vector<double> top_, bottom_;  // per round step: the edges' limits (top_ before the floor is taken off)
  bool top_rises_ = false;            // top_ non-decreasing from step 1 (thresholds that grow with the step)
};

}  // namespace dpstream::kernels
