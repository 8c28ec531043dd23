// Partition selection (sql/selection.hpp): thresholds on the exact DLap / N_Z noise, Google's magic rule.
#include "sql/selection.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>

#include "src/accounting.hpp"

namespace dpstream::sql {

namespace {
constexpr double kMaxEps = 1e6;
constexpr std::uint32_t kMaxK = 1u << 20;
constexpr long double kTailMargin = 1e-9L;  // relative, on delta_k: absorbs rounding of the tails
constexpr double kMagicMargin = 1e-6;       // relative, on delta': absorbs rounding of p(n)
// Absolute part of the margin: p(n) near 1 carries ~1e-16 of rounding, which a relative cut of a tiny
// delta' would not cover; magic selection needs delta' >= 1e-12 so that this cut is at most 1%.
constexpr double kMagicAbsoluteMargin = 1e-14;
const double kMinScale = std::ldexp(1.0, -10);  // the samplers' smallest scale; more noise is safe
const double kMaxLaplaceScale = std::ldexp(1.0, 40), kMaxSigma = std::ldexp(1.0, 24);

std::string g6(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", x);
  return b;
}

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

void check_delta_k(const char* who, double delta, std::uint32_t k) {
  require(delta > 0 && delta < 1, std::string(who) + ": delta must be in (0, 1), e.g. 1e-5; got " + g6(delta));
  require(k >= 1 && k <= kMaxK,
          std::string(who) + ": max_groups_contributed must be in [1, 2^20]; got " + std::to_string(k));
}

void check_eps(const char* who, double eps) {
  require(eps > 0 && eps <= kMaxEps, std::string(who) + ": epsilon must be in (0, 1e6]; got " + g6(eps));
}

// Google's near-truncated-geometric curve for one group: p(n) with eps', delta' and the crossovers n1 < n2.
struct MagicCurve {
  double eps, delta, n1 = 0, n2 = 0, p_n1 = 0;
};

// delta' (e^{n eps'} - 1) / (e^{eps'} - 1), written as e^{(n-1) eps'} (1 - e^{-n eps'}) / (1 - e^{-eps'}) (no
// overflow).
double first_phase(double eps, double delta, double n) {
  return delta * std::exp((n - 1) * eps) * (std::expm1(-n * eps) / std::expm1(-eps));
}

// log1p(c (e^eps - 1)) for c > 0, also where e^eps overflows (then it is eps + ln c to double precision).
double log1p_scaled_expm1(double eps, double c) {
  const double x = std::expm1(eps) * c;
  return std::isinf(x) ? eps + std::log(c) : std::log1p(x);
}

MagicCurve magic_curve(double eps, double delta) {
  MagicCurve c{eps, delta};
  c.n1 = 1 + std::floor(std::log1p(std::tanh(eps / 2) * (1 / delta - 1)) / eps);
  c.p_n1 = std::min(1.0, first_phase(eps, delta, c.n1));
  c.n2 = c.p_n1 >= 1 ? c.n1 : c.n1 + std::floor(log1p_scaled_expm1(eps, (1 - c.p_n1) / delta) / eps);
  return c;
}

// p(0) = 0; first phase to n1; then p(n1) - (1 - p(n1) + delta' / (e^eps' - 1)) expm1(-(n - n1) eps') to n2; then 1.
double magic_p(const MagicCurve& c, double n) {
  double p = 1;
  if (n <= 0) {
    p = 0;
  } else if (n <= c.n1) {
    p = first_phase(c.eps, c.delta, n);
  } else if (n <= c.n2) {
    p = c.p_n1 - (1 - c.p_n1 + c.delta / std::expm1(c.eps)) * std::expm1(-(n - c.n1) * c.eps);
  }
  return std::clamp(p, 0.0, 1.0);
}

// The least m with P[X >= m] <= target: the closed form's root, then exact steps on the long double tail.
std::int64_t least_tail_index(const noise::DiscreteLaplace& dl, long double target) {
  const long double b = dl.scale(), lq = std::log1p(std::exp(-1 / b));  // ln(1 + q), q = exp(-1/b)
  // m >= 1: q^m / (1 + q) <= target;  m <= 0: 1 - q^(1-m) / (1 + q) <= target.
  const long double root = target < 0.5L ? -b * (std::log(target) + lq) : 1 + b * (std::log1p(-target) + lq);
  constexpr long double kLimit = 0x1p61L;
  auto m = static_cast<std::int64_t>(std::ceil(std::clamp(root, -kLimit, kLimit)));
  while (dl.upper_tail(m) > target) ++m;
  while (dl.upper_tail(m - 1) <= target) --m;
  return m;
}

// A long double probability as a double not below it.
double round_up(long double p) {
  const auto d = static_cast<double>(p);
  return static_cast<long double>(d) < p ? std::nextafter(d, 1.0) : d;
}

std::string bound_text(double p) {
  char b[48];
  std::snprintf(b, sizeof b, "(P[keep | 1 user] <= %.1e)", p);
  return b;
}
}  // namespace

double adjusted_delta(double delta, std::uint32_t k) {
  check_delta_k("adjusted_delta", delta, k);
  return -std::expm1(std::log1p(-delta) / k);
}

double laplace_threshold_continuous(double eps, double delta, std::uint32_t k) {
  check_eps("laplace_threshold_continuous", eps);
  const double b = k / eps, dk = adjusted_delta(delta, k);
  return dk > 0.5 ? 1 + b * std::log(2 * (1 - dk)) : 1 - b * std::log(2 * dk);  // P[1 + Lap(b) > tau] = dk
}

double gaussian_threshold_continuous(double sigma, double delta, std::uint32_t k) {
  require(sigma > 0 && std::isfinite(sigma), "gaussian_threshold_continuous: sigma must be positive and finite");
  return 1 + sigma * accounting::normal_upper_quantile(adjusted_delta(delta, k));
}

double magic_keep_probability(double eps, double delta, std::uint32_t k, std::uint64_t n) {
  check_eps("magic_keep_probability", eps);
  return magic_p(magic_curve(eps / k, adjusted_delta(delta, k)), static_cast<double>(n));
}

Selection Selection::laplace(double eps, double delta, std::uint32_t k) {
  check_eps("laplace selection", eps);
  check_delta_k("laplace selection", delta, k);
  const double b = k / eps;
  require(b <= kMaxLaplaceScale, "laplace selection: the selection's epsilon is too small (b = k / eps = " + g6(b) +
                                     " > 2^40); raise epsilon or lower max_groups_contributed");
  Selection s;
  s.kind_ = SelectionKind::Laplace, s.eps_ = eps, s.delta_ = delta, s.k_ = k;
  s.lap_ = std::make_shared<const noise::DiscreteLaplace>(std::max(b, kMinScale));
  s.scale_ = s.lap_->scale();
  const long double target = adjusted_delta(delta, k) * (1 - kTailMargin);
  const std::int64_t m = least_tail_index(*s.lap_, target);  // keep iff 1 + X >= tau iff X >= tau - 1
  s.tau_ = m + 1;
  s.single_user_bound_ = round_up(s.lap_->upper_tail(m));
  return s;
}

Selection Selection::gaussian(double rho, double delta, std::uint32_t k) {
  require(rho > 0 && std::isfinite(rho), "gaussian selection: rho must be positive and finite; got " + g6(rho));
  check_delta_k("gaussian selection", delta, k);
  const double sigma = std::sqrt(k / (2 * rho));
  require(sigma <= kMaxSigma, "gaussian selection: the selection's rho is too small (sigma = sqrt(k / (2 rho)) = " +
                                  g6(sigma) + " > 2^24); raise epsilon (or the selection's share of the budget)");
  Selection s;
  s.kind_ = SelectionKind::Gaussian, s.eps_ = rho, s.delta_ = delta, s.k_ = k;
  s.gauss_ = std::make_shared<const noise::DiscreteGaussian>(std::max(sigma, kMinScale));
  s.scale_ = s.gauss_->sigma();
  const double q = accounting::normal_upper_quantile(adjusted_delta(delta, k));
  const double z = std::max(0.0, q + 1e-9 * (1 + std::fabs(q)));  // slightly larger than Phi^-1(1 - delta_k)
  s.tau_ = 2 + static_cast<std::int64_t>(std::ceil(s.scale_ * z));
  // Q((tau - 2) / sigma) with sigma one ulp up (sigma() is correctly rounded) and 1e-12 for erfc's rounding.
  const double up = std::nextafter(s.scale_, kMaxSigma * 2);
  s.single_user_bound_ = accounting::normal_upper_tail(static_cast<double>(s.tau_ - 2) / up) * (1 + 1e-12);
  return s;
}

Selection Selection::magic(double eps, double delta, std::uint32_t k) {
  check_eps("magic selection", eps);
  check_delta_k("magic selection", delta, k);
  const double dk = adjusted_delta(delta, k);
  if (dk < 100 * kMagicAbsoluteMargin)
    throw std::invalid_argument(
        fmt::format("magic selection needs delta / k >= 1e-12 (got {:g} per group) so that "
                    "its floating-point margin is proven; use --selection laplace or gaussian",
                    dk));
  const MagicCurve c = magic_curve(eps / k, dk - std::max(dk * kMagicMargin, kMagicAbsoluteMargin));
  Selection s;
  s.kind_ = SelectionKind::Magic, s.eps_ = c.eps, s.delta_ = c.delta, s.k_ = k;
  s.magic_n1_ = c.n1, s.magic_n2_ = c.n2, s.magic_p_n1_ = c.p_n1;
  s.single_user_bound_ = magic_p(c, 1);
  return s;
}

Selection Selection::public_groups() { return Selection{}; }

Selection::Decision Selection::decide(std::uint64_t n, noise::NodeStream& rng) const {
  const auto count = static_cast<std::int64_t>(std::min<std::uint64_t>(n, std::uint64_t{1} << 62));
  switch (kind_) {
    case SelectionKind::Laplace:
    case SelectionKind::Gaussian: {
      const std::int64_t noisy = count + (lap_ ? lap_->sample(rng) : gauss_->sample(rng));
      return {noisy >= tau_, noisy};
    }
    case SelectionKind::Magic: {
      const double p = magic_p(MagicCurve{eps_, delta_, magic_n1_, magic_n2_, magic_p_n1_}, static_cast<double>(n));
      if (p >= 1) return {true, count};
      const auto num = static_cast<noise::u128>(std::floor(std::ldexp(p, 64)));  // exact: p has 53 bits
      return {rng.bernoulli(num, noise::u128{1} << 64), count};                  // P = floor(p 2^64) / 2^64 <= p
    }
    case SelectionKind::Public:
      break;
  }
  return {true, count};
}

std::string Selection::describe() const {
  switch (kind_) {
    case SelectionKind::Laplace:
      return "laplace: b = " + g6(scale_) + ", tau = " + std::to_string(tau_) + " " + bound_text(single_user_bound_);
    case SelectionKind::Gaussian:
      return "gaussian: sigma = " + g6(scale_) + ", tau = " + std::to_string(tau_) + " " +
             bound_text(single_user_bound_);
    case SelectionKind::Magic:
      return "magic: eps' = " + g6(eps_) + ", delta' = " + g6(delta_) + ", p(n) = 1 for n > " + g6(magic_n2_) + " " +
             bound_text(single_user_bound_);
    case SelectionKind::Public:
      break;
  }
  return "public: listed groups only, no noise";
}

}  // namespace dpstream::sql
