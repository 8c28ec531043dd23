// Cumulative releases on a growing stream (seed 004: Cummings et al., "Differential Privacy for Growing
// Databases", NeurIPS 2018, arXiv 1803.06416, BBScheduler, Theorem 10 with CDP composition): the query is
// re-run on all data so far each time the stream has grown by a factor (1 + gamma) in event time, release
// i covering windows A .. A + L_i - 1 with L_i = max(L_{i-1} + 1, ceil(L_0 (1 + gamma)^i)). Release i spends
// rho_i = rho w_i, w_i = (i + 1)^2 x^i (1 - x)^3 / (1 + x), x = (1 + gamma)^-2, whose sum over i >= 0 is 1:
// an unbounded number of releases stays within rho (the seed's eps_i ~ (i + 1) (1 + gamma)^-i, squared for
// zCDP), and thresholds spend delta_i = (delta / 2) 2^-(i + 1). The privacy unit is the user over the
// whole stream; docs/SQL.md "Growing streams" states the accuracy.
#pragma once

#include <cstdint>
#include <vector>

namespace dpstream::sql {

struct GrowingRelease {
  int index = 0;
  std::int64_t first_window = 0, last_window = 0;  // inclusive
  double rho = 0;                                  // rho_i
  double delta_selection = 0;                      // delta_i of its thresholds
};

// w_i of the header; gamma in (0, 10], i >= 0.
double growing_weight(int i, double gamma);

// The releases whose windows fit in [first, last]; throws std::invalid_argument on bad parameters.
std::vector<GrowingRelease> growing_schedule(double gamma, std::int64_t first, std::int64_t last,
                                             std::int64_t first_length, double rho, double delta_selection);

}  // namespace dpstream::sql
