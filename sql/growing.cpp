#include "sql/growing.hpp"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

namespace dpstream::sql {

double growing_weight(int i, double gamma) {
  const double x = 1 / ((1 + gamma) * (1 + gamma));
  // sum_{i >= 0} (i + 1)^2 x^i = (1 + x) / (1 - x)^3
  return (i + 1.0) * (i + 1.0) * std::pow(x, i) * std::pow(1 - x, 3) / (1 + x);
}

std::vector<GrowingRelease> growing_schedule(double gamma, std::int64_t first, std::int64_t last,
                                             std::int64_t first_length, double rho, double delta_selection) {
  if (!(gamma > 0 && gamma <= 10))
    throw std::invalid_argument(fmt::format("--growing {}: the growth factor gamma must be in (0, 10]", gamma));
  if (first_length < 1) throw std::invalid_argument("--growing-first must be >= 1 window");
  if (last < first) throw std::invalid_argument("--growing needs --windows A:B with A <= B");
  std::vector<GrowingRelease> out;
  std::int64_t length = 0;
  for (int i = 0; i < 1000; ++i) {
    const double grown = std::ceil(static_cast<double>(first_length) * std::pow(1 + gamma, i) - 1e-9);
    length = std::max(length + 1, static_cast<std::int64_t>(grown));
    if (length > last - first + 1) break;
    out.push_back(
        {i, first, first + length - 1, rho * growing_weight(i, gamma), delta_selection * std::ldexp(1.0, -(i + 1))});
  }
  return out;
}

}  // namespace dpstream::sql
