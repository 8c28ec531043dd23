// zCDP <-> (eps, delta) conversions (port of IBM cdp2adp.py, CKS 2020) and Gaussian tail helpers.
#include "src/accounting.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace dpstream::accounting {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("dpstream::accounting: " + what);
}
void check_rho(double rho) { require(std::isfinite(rho) && rho >= 0, "rho must be finite and >= 0, got " + std::to_string(rho)); }
void check_eps(double eps) { require(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got " + std::to_string(eps)); }
void check_delta(double delta) { require(delta > 0 && delta < 1, "delta must lie in (0, 1), got " + std::to_string(delta)); }

// Bisection on [lo, hi] with `at_or_above(x)` false at lo and true at hi, run until the midpoint
// stops changing (OpenDP's stopping rule; cdp2adp.py runs a fixed 1000 steps). Returns both ends.
struct Bracket {
  double lo, hi;
};
template <class Pred>
Bracket bisect(double lo, double hi, Pred at_or_above) {
  for (int i = 0; i < 4096; ++i) {
    const double mid = lo + (hi - lo) / 2;
    if (mid <= lo || mid >= hi) break;
    (at_or_above(mid) ? hi : lo) = mid;
  }
  return {lo, hi};
}

// log delta at order a (CKS 2020 Prop. 12): (a-1)(a rho - eps) + a ln(1 - 1/a) - ln(a - 1).
double log_delta_at(double a, double rho, double eps) {
  return (a - 1) * (a * rho - eps) + a * std::log1p(-1 / a) - std::log(a - 1);
}

// Acklam's rational approximation of the upper quantile (relative error < 1.2e-9), start for Newton.
double acklam_upper_quantile(double p) {
  static constexpr double a[] = {-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
                                 1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00};
  static constexpr double b[] = {-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                                 6.680131188771972e+01, -1.328068155288572e+01};
  static constexpr double c[] = {-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
                                 -2.549671010429946e+00, 4.374664141464968e+00, 2.938163982698783e+00};
  static constexpr double d[] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                                 3.754408661907416e+00};
  constexpr double p_low = 0.02425;
  const auto tail = [&](double q) {  // lower quantile of the tail probability exp(-q^2/2)
    return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
           ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  };
  if (p < p_low) return -tail(std::sqrt(-2 * std::log(p)));
  if (p > 1 - p_low) return tail(std::sqrt(-2 * std::log1p(-p)));
  const double q = 0.5 - p, r = q * q;
  return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
         (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
}

}  // namespace

double zcdp_delta(double rho, double eps) {
  check_rho(rho);
  check_eps(eps);
  if (rho == 0) return 0;
  // cdp2adp.py cdp_delta: the optimal a solves (2a-1) rho - eps + ln(1 - 1/a) = 0; any a > 1 is valid,
  // a >= 1.01 keeps the bound numerically stable (the optimum is >= (1 + eps/rho)/2).
  const double amax = std::min((eps + 1) / (2 * rho) + 2, std::numeric_limits<double>::max());
  const double a = bisect(1.01, amax, [&](double x) { return (2 * x - 1) * rho - eps + std::log1p(-1 / x) >= 0; }).hi;
  const double log_delta = log_delta_at(a, rho, eps);
  return std::isnan(log_delta) ? 1.0 : std::exp(std::min(log_delta, 0.0));  // delta <= 1; unknown -> 1 (safe)
}

double zcdp_eps_tight(double rho, double delta) {
  check_rho(rho);
  check_delta(delta);
  if (rho == 0 || zcdp_delta(rho, 0) <= delta) return 0;
  // cdp2adp.py cdp_eps: start from the simple bound (CKS is tighter); widen if rounding says otherwise.
  double hi = zcdp_eps_simple(rho, delta);
  while (zcdp_delta(rho, hi) > delta) hi *= 2;
  return bisect(0, hi, [&](double e) { return zcdp_delta(rho, e) <= delta; }).hi;  // safe: delta(hi) <= target
}

double zcdp_rho_tight(double eps, double delta) {
  check_eps(eps);
  check_delta(delta);
  // cdp2adp.py cdp_rho: delta(0, eps) = 0 <= target; rho = eps + 1 almost always exceeds it, else widen.
  double hi = eps + 1;
  while (zcdp_delta(hi, eps) <= delta) hi *= 2;
  return bisect(0, hi, [&](double r) { return zcdp_delta(r, eps) > delta; }).lo;  // safe: delta(lo) <= target
}

double zcdp_eps_simple(double rho, double delta) {
  check_rho(rho);
  check_delta(delta);
  return rho + 2 * std::sqrt(rho * -std::log(delta));  // Bun & Steinke 2016, Prop. 1.3
}

double zcdp_rho_simple(double eps, double delta) {
  check_eps(eps);
  check_delta(delta);
  // (sqrt(L + eps) - sqrt(L))^2 written as eps^2 / (sqrt(L + eps) + sqrt(L))^2 to avoid cancellation.
  const double l = -std::log(delta), s = std::sqrt(l + eps) + std::sqrt(l);
  return eps / s * (eps / s);
}

double normal_upper_tail(double z) {
  require(!std::isnan(z), "z must not be NaN");
  return std::erfc(z / std::sqrt(2.0)) / 2;
}

double normal_upper_quantile(double p) {
  require(p > 0 && p < 1, "p must lie in (0, 1), got " + std::to_string(p));
  // Newton on f(z) = ln Q(z) - ln p, f'(z) = -phi(z) / Q(z): step ln(Q/p) * Q / phi, from Acklam's start.
  constexpr double inv_sqrt_2pi = 0.39894228040143267794;
  double z = acklam_upper_quantile(p);
  for (int i = 0; i < 8; ++i) {
    const double q = normal_upper_tail(z), phi = inv_sqrt_2pi * std::exp(-z * z / 2);
    if (q <= 0 || phi <= 0) break;  // beyond double range (p below ~1e-308): keep the estimate
    const double step = std::log(q / p) * (q / phi);
    z += step;
    if (std::abs(step) <= 4 * std::numeric_limits<double>::epsilon() * std::max(1.0, std::abs(z))) break;
  }
  return z;
}

}  // namespace dpstream::accounting
