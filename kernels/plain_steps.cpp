#include "kernels/plain_steps.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace dpstream::kernels {

// With M = thresholds[s] (|M| < 2^28), a step is plain when above <= fl(M one - m - F) and below >=
// (M - 2^29) one + m, F = floor_units, m = kMarginUnits. Such a step has F < 2^49 (bottom <= below <= above
// <= top - F, or F <= top + 1 for the edges {1, -1} of no noise), although F reaches 2^83 without a quiet bound;
// so every quantity is below 2^52 in magnitude (rounding errors under 1/4 unit), and:
//  - the interval's top hi = ceil(above) + 1 < above + 2 <= M one - F - m + 2.3, so hi + u one < M one - 5
//    for the round users u <= F / one: an integer below M one, the test's right side: passes() is false;
//  - the boundary M - hi / one >= F / one + 5.7 / one >= quiet + 2 + 5.7 2^-20 in users, where a double of
//    magnitude < 2^30 rounds by at most 2^-23: quiet_bound_holds' test `least >= quiet + 2` holds, least >= 0;
//  - the interval's bottom lo = floor(below) - 1 > below - 2 >= (M - 2^29) one + 5.9: the boundary at lo is
//    below 2^29 users, so both boundaries lie in (-2^30, 2^30) as quiet_bound_holds requires.
// A threshold beyond 2^28 users gets top = -inf: no step is plain there.
PlainSteps::PlainSteps(const std::vector<double>& thresholds, std::int64_t one)
    : one_(static_cast<double>(one)), top_(thresholds.size()), bottom_(thresholds.size()) {
  if (one < 1 || (one & (one - 1)) != 0 || one > (std::int64_t{1} << 30))
    throw std::invalid_argument("PlainSteps: the grid must be a power of two up to 2^30 per user");
  for (std::size_t s = 0; s < thresholds.size(); ++s) {
    const double m = thresholds[s];
    const bool inside = std::abs(m) < 0x1p28;
    top_[s] = inside ? m * one_ - kMarginUnits : -std::numeric_limits<double>::infinity();
    bottom_[s] = inside ? (m - 0x1p29) * one_ + kMarginUnits : std::numeric_limits<double>::infinity();
  }
  top_rises_ = std::is_sorted(top_.begin() + std::min<std::ptrdiff_t>(1, std::ssize(top_)), top_.end());
}

// Exact for counts within 2^50: quiet + 2 as quiet_bound_holds computes it, each term scaled by a power of
// two. The initial quiet bound (int64 max) gives 2^63 users: nothing is plain until it is lowered.
double PlainSteps::floor_units(std::int64_t round_users, std::int64_t quiet_users) const {
  return std::max({0.0, static_cast<double>(round_users), static_cast<double>(quiet_users) + 2}) * one_;
}

// top_[s] = M one - 8 with M = thresholds[s], |M| < 2^28 (else -inf: kNoCount), exact up to 2^-5 (|M one| < 2^48).
// m = min top_ over the steps and d = m - above (|d| < 2^51: rounding under 1/4); u = floor(d / one) exactly (one
// is a power of two), capped so that u one <= 2^50. For a step t, a noise N <= above and a count c <= u:
// c one + N <= d + above < M_t one - 7.7, an integer below M_t one of magnitude < 2^51, which to_double keeps
// exactly: passes(N, c, t) is false.
std::int64_t PlainSteps::failing_users(double above, std::uint32_t first, std::uint32_t last) const {
  if (!(std::abs(above) < 0x1p50) || first > last || last >= top_.size()) return kNoCount;
  double m = top_[first];  // the least of top_[first..last]: the first one where the thresholds rise (most plans)
  if (!top_rises_ || first == 0)
    for (std::uint32_t s = first + 1; s <= last; ++s) m = std::min(m, top_[s]);
  if (!(m > -0x1p50)) return kNoCount;  // -inf: a threshold outside the range
  const double u = std::floor((m - above) / one_), cap = std::min(0x1p30, 0x1p50 / one_);
  return u >= cap ? static_cast<std::int64_t>(cap) : static_cast<std::int64_t>(u);
}

}  // namespace dpstream::kernels
