// zCDP <-> (eps, delta) conversions (port of IBM cdp2adp.py, CKS 2020), Gaussian tail helpers, the analytic
// Gaussian mechanism (Balle & Wang 2018) and optimal composition (Kairouz, Oh & Viswanath 2015).
#include "src/accounting.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>

namespace dpstream::accounting {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("dpstream::accounting: " + what);
}
std::string num(double x) {  // %g keeps tiny deltas readable (std::to_string prints 1e-12 as 0.000000)
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}
void check_rho(double rho) { require(std::isfinite(rho) && rho >= 0, "rho must be finite and >= 0, got " + num(rho)); }
void check_eps(double eps) { require(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got " + num(eps)); }
void check_delta(double delta) { require(delta > 0 && delta < 1, "delta must lie in (0, 1), got " + num(delta)); }

void check_positive(double x, const char* name) {
  require(std::isfinite(x) && x > 0, std::string(name) + " must be finite and > 0, got " + num(x));
}
void check_eps0(double eps0) {
  require(std::isfinite(eps0) && eps0 >= 0, "eps0 must be finite and >= 0, got " + num(eps0));
}
void check_delta0(double delta0) {
  require(delta0 >= 0 && delta0 < 1, "delta0 must lie in [0, 1), got " + num(delta0));
}
void check_k(std::uint32_t k) { require(k >= 1, "k (number of composed mechanisms) must be >= 1"); }

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
  static constexpr double a[] = {-3.969683028665376e+01, 2.209460984245205e+02,  -2.759285104469687e+02,
                                 1.383577518672690e+02,  -3.066479806614716e+01, 2.506628277459239e+00};
  static constexpr double b[] = {-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                                 6.680131188771972e+01, -1.328068155288572e+01};
  static constexpr double c[] = {-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
                                 -2.549671010429946e+00, 4.374664141464968e+00,  2.938163982698783e+00};
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

// ---- Analytic Gaussian -------------------------------------------------------------------------------

constexpr double kSqrt2 = 1.41421356237309504880;
constexpr double kSqrt2Pi = 2.50662827463100050242;
constexpr double kLnSqrt2Pi = 0.91893853320467274178;
constexpr double kGaussianMargin = 1e-12;  // relative, on delta, when inverting gaussian_delta

// Depth of Laplace's continued fraction R(t) = 1/(t + 1/(t + 2/(t + 3/(t + ...)))) for relative error below
// 2e-16 at t >= 2 (checked against 50-digit mpmath: depth 100 at t = 2, 60 at t = 3, 40 at t = 4).
int mills_depth(double t) { return t < 3 ? 100 : t < 4 ? 60 : 40; }

// Mills ratio R(t) = Q(t) / phi(t) for t >= 0 (Q the upper normal tail, phi the density), relative error ~2e-16;
// erfc below t = 2 (where exp(t^2 / 2) is exact enough), the continued fraction above (never underflows).
double mills(double t) {
  if (t < 2) return std::erfc(t / kSqrt2) / 2 * kSqrt2Pi * std::exp(t * t / 2);
  double f = 0;
  for (int j = mills_depth(t); j >= 1; --j) f = j / (t + f);
  return 1 / (t + f);
}

// R(v) - R(u) for 2 <= v <= u = v + w without cancellation: with F_0 = R, F_j(t) = j / (t + F_{j+1}(t)),
// D_j = F_j(v) - F_j(u) = F_j(v) F_j(u) / j * (w - D_{j+1}), run backwards from D_depth = 0 alongside the
// fractions themselves. Relative error ~2e-16 for any w (a plain difference loses ~1e-16 * v / w).
double mills_diff(double v, double u, double w) {
  if (v < 2) return mills(v) - mills(u);
  double fv = 0, fu = 0, d = 0;
  for (int j = mills_depth(v); j >= 1; --j) {
    fv = j / (v + fv);
    fu = j / (u + fu);
    d = fv * fu / j * (w - d);
  }
  return (1 / (v + fv)) * (1 / (u + fu)) * (w - d);
}

// phi(x) * m with x^2 split exactly (fma) so that exp(-x^2 / 2) carries no rounding of x^2.
double density_times(double x, double m) {
  const double h = x * x;
  if (!std::isfinite(h) || m <= 0) return 0;
  const double l = std::fma(x, x, -h);
  if (h < 1400) return std::exp(-h / 2) * std::exp(-l / 2) / kSqrt2Pi * m;
  return std::exp(-h / 2 - l / 2 - kLnSqrt2Pi + std::log(m));  // below ~1e-300: exp of a sum is fine
}

// ---- Optimal composition: Loader's (2000) saddle-point binomial pmf, as in R's dbinom_raw ---------------

// stirlerr(n) = ln n! - ((n + 1/2) ln n - n + ln sqrt(2 pi)), for integers n >= 1.
double stirlerr(double n) {
  static constexpr double kTable[16] = {// n = 0 (unused) .. 15, 25-digit mpmath
                                        0.0,
                                        0.08106146679532725821967026,
                                        0.04134069595540929409382208,
                                        0.02767792568499833914878929,
                                        0.02079067210376509311152277,
                                        0.01664469118982119216319487,
                                        0.01387612882307074799874573,
                                        0.01189670994589177009505572,
                                        0.01041126526197209649747857,
                                        0.009255462182712732917728637,
                                        0.008330563433362871256469319,
                                        0.007573675487951840794972024,
                                        0.006942840107209529865664153,
                                        0.006408994188004207068439631,
                                        0.005951370112758847735624416,
                                        0.00555473355196280137103869};
  if (n <= 15) return kTable[static_cast<int>(n)];
  constexpr double s0 = 1.0 / 12, s1 = 1.0 / 360, s2 = 1.0 / 1260, s3 = 1.0 / 1680, s4 = 1.0 / 1188;
  const double nn = n * n;  // Stirling series, truncated where the next term is below 1e-16
  if (n > 500) return (s0 - s1 / nn) / n;
  if (n > 80) return (s0 - (s1 - s2 / nn) / nn) / n;
  if (n > 35) return (s0 - (s1 - (s2 - s3 / nn) / nn) / nn) / n;
  return (s0 - (s1 - (s2 - (s3 - s4 / nn) / nn) / nn) / nn) / n;
}

// bd0(x, np) = x ln(x / np) + np - x >= 0, as a series in v = (x - np) / (x + np) when x is near np.
double bd0(double x, double np) {
  if (std::abs(x - np) < 0.1 * (x + np)) {
    double v = (x - np) / (x + np), s = (x - np) * v, ej = 2 * x * v;
    v *= v;
    for (int j = 1; j < 1000; ++j) {
      ej *= v;
      const double s1 = s + ej / (2 * j + 1);
      if (s1 == s) return s1;
      s = s1;
    }
    return s;
  }
  return x * std::log(x / np) + np - x;
}

// ln P[Binom(n, p) = x] for 0 < x < n, q = 1 - p (both passed, each accurate): relative error ~1e-15 in the
// probability for any n, where a sum of lgamma values would lose ~n * 1e-16.
double log_binom_pmf(double x, double n, double p, double q) {
  const double lc = stirlerr(n) - stirlerr(x) - stirlerr(n - x) - bd0(x, n * p) - bd0(n - x, n * q);
  return lc - 0.5 * (2 * kLnSqrt2Pi + std::log(x) + std::log1p(-x / n));
}

// Running log-sum-exp.
struct LogSum {
  double max = -std::numeric_limits<double>::infinity(), scaled = 0;  // sum = e^max * scaled
  void add(double t) {
    if (t == -std::numeric_limits<double>::infinity()) return;
    if (t <= max) {
      scaled += std::exp(t - max);
    } else {
      scaled = scaled * std::exp(max - t) + 1;
      max = t;
    }
  }
};

// D = sum_l C(k,l) max(0, e^{(k-l) eps0} - e^{eps + l eps0}) / (1 + e^{eps0})^k. Term l is P[Binom(k, q) = l] *
// (1 - e^{eps - (k - 2l) eps0}) with q = 1 / (1 + e^{eps0}), positive exactly for l < r = (k eps0 - eps) / (2 eps0).
// Both factors are log-concave in l, so the terms are unimodal with their peak at or below the binomial mode
// m = floor((k + 1) q): walk down and up from min(m, floor r) and stop 60 nats below the running maximum
// (the rest, at most k terms each e^-60 of the peak, is below 1e-16 relative for any 32-bit k).
double kov_sum(double eps0, std::uint32_t k, double eps) {
  if (eps0 == 0) return 0;
  const double n = k, r = 0.5 * n - eps / (2 * eps0);
  if (!(r > 0)) return 0;
  const double top = std::floor(r);  // last candidate l; the factor test below settles l = r exactly
  const double em = std::exp(-eps0), q = em / (1 + em), p = 1 / (1 + em), log_p = -std::log1p(em);
  const auto term = [&](double l) {
    // eps - (k - 2l) eps0 with one rounding (k - 2l is exact), so the factor is right even near l = r.
    const double factor = -std::expm1(std::fma(-(n - 2 * l), eps0, eps));
    if (!(factor > 0)) return -std::numeric_limits<double>::infinity();
    if (l == 0) return n * log_p + std::log(factor);
    if (q == 0) return -std::numeric_limits<double>::infinity();  // e^{-eps0} underflowed: P[l > 0] ~ 0
    return log_binom_pmf(l, n, q, p) + std::log(factor);
  };
  constexpr double kCut = 60;
  const double start = std::min(std::floor((n + 1) * q), top);
  LogSum sum;
  for (double l = start; l >= 0; --l) {
    const double t = term(l);
    sum.add(t);
    if (t < sum.max - kCut) break;
  }
  for (double l = start + 1; l <= top; ++l) {
    const double t = term(l);
    if (t == -std::numeric_limits<double>::infinity()) break;  // past r
    sum.add(t);
    if (t < sum.max - kCut) break;
  }
  if (sum.scaled == 0) return 0;
  return std::min(1.0, std::exp(sum.max + std::log(sum.scaled)));
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
  require(p > 0 && p < 1, "p must lie in (0, 1), got " + num(p));
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

double gaussian_delta(double eps, double sigma, double sensitivity) {
  check_eps(eps);
  check_positive(sigma, "sigma");
  check_positive(sensitivity, "sensitivity");
  // a = Delta / (2 sigma) and b = eps sigma / Delta, ordered so that no intermediate overflows needlessly.
  const double a = sensitivity / sigma / 2, eps_sigma = eps * sigma;
  const double b = std::isfinite(eps_sigma) ? eps_sigma / sensitivity : eps * (sigma / sensitivity), x = a - b;
  // e^eps phi(a + b) = phi(a - b) because eps = 2ab, and Phi(-t) = phi(t) R(t), so the e^eps term is
  // phi(x) R(a + b) exactly: no exp(eps) and no log-space subtraction of two nearly equal logs.
  double delta;
  if (x >= 0 && a <= 1) {
    // Phi(x) - e^eps Q(a + b) = (Phi(x) - 1/2) + (1/2 - Q(a + b)) - expm1(eps) Q(a + b): with b <= a <= 1 the last
    // term is at most ~a/2 of the first two, so a tiny delta (sigma >> Delta, eps ~ 0) keeps its digits.
    const double u = a + b;
    delta = (std::erf(x / kSqrt2) + std::erf(u / kSqrt2)) / 2 - std::expm1(eps) * (std::erfc(u / kSqrt2) / 2);
  } else if (x >= 0) {
    delta = std::erfc(-x / kSqrt2) / 2 - density_times(x, mills(a + b));  // >= ~0.3 here
  } else {
    // Phi(x) = phi(x) R(-x): delta = phi(x) (R(b - a) - R(a + b)), the difference taken inside the fraction.
    delta = density_times(x, mills_diff(b - a, a + b, 2 * a));
  }
  return std::clamp(delta, 0.0, 1.0);
}

double gaussian_sigma(double eps, double delta, double sensitivity) {
  check_eps(eps);
  check_delta(delta);
  check_positive(sensitivity, "sensitivity");
  // delta falls from 1 (sigma -> 0) to 0 (sigma -> inf): bracket from sigma = Delta by doubling or halving.
  // The 1e-12 margin covers gaussian_delta's own rounding (< 3e-13 against 100-digit mpmath), so the answer is
  // safe for the exact curve too; it moves sigma by ~1e-12 / (d ln delta / d ln sigma), i.e. by 1e-13 or less.
  const double target = delta * (1 - kGaussianMargin);
  const auto ok = [&](double s) { return gaussian_delta(eps, s, sensitivity) <= target; };
  double lo = sensitivity, hi = sensitivity;
  if (ok(hi)) {
    do {
      hi = lo;
      lo /= 2;
    } while (lo > 0 && ok(lo));
    if (lo == 0) return hi;
  } else {
    do {
      lo = hi;
      hi *= 2;
    } while (std::isfinite(hi) && !ok(hi));
    if (!std::isfinite(hi)) return std::numeric_limits<double>::infinity();
  }
  for (int i = 0; i < 4096; ++i) {  // bisection in log sigma down to adjacent doubles
    const double mid = lo * std::sqrt(hi / lo);
    if (mid <= lo || mid >= hi) break;
    (ok(mid) ? hi : lo) = mid;
  }
  return hi;  // safe: delta(hi) <= target
}

double gaussian_eps(double sigma, double delta, double sensitivity) {
  check_positive(sigma, "sigma");
  check_delta(delta);
  check_positive(sensitivity, "sensitivity");
  const double target = delta * (1 - kGaussianMargin);  // as in gaussian_sigma
  const auto ok = [&](double e) { return gaussian_delta(e, sigma, sensitivity) <= target; };
  if (ok(0)) return 0;
  double lo = 0, hi = 1;
  while (!ok(hi)) {
    lo = hi;
    hi *= 2;
    if (!std::isfinite(hi)) return std::numeric_limits<double>::infinity();
  }
  return bisect(lo, hi, ok).hi;  // safe: delta(hi) <= target
}

double optimal_composition_delta(double eps0, double delta0, std::uint32_t k, double eps) {
  check_eps0(eps0);
  check_delta0(delta0);
  check_k(k);
  check_eps(eps);
  const double log_keep = k * std::log1p(-delta0);  // ln (1 - delta0)^k
  // 1 - (1 - delta0)^k (1 - D) as a sum of two non-negative parts.
  return std::min(1.0, -std::expm1(log_keep) + std::exp(log_keep) * kov_sum(eps0, k, eps));
}

double optimal_composition_eps0(double eps, double delta, double delta0, std::uint32_t k) {
  check_eps(eps);
  check_delta(delta);
  check_delta0(delta0);
  check_k(k);
  // delta_total <= delta  <=>  (1 - delta0)^k D <= delta - (1 - (1 - delta0)^k) =: slack. The test runs on the
  // slack with margins for rounding (4 ulps on the delta0 part, 1e-11 relative on D), because the slack can be
  // a few ulps of delta: with delta = k delta0 (e.g. 5e-10 = 1000 * 5e-13) it is only the O(delta0^2) term.
  const double log_keep = k * std::log1p(-delta0), keep = std::exp(log_keep);
  const double floor_delta = -std::expm1(log_keep);
  const double slack = (delta - floor_delta * (1 + 0x1p-50)) * (1 - 0x1p-52);
  require(slack > 0, "optimal_composition_eps0: the delta0 parts alone cost 1 - (1 - delta0)^k = " + num(floor_delta) +
                         " >= delta = " + num(delta) + " (delta0 = " + num(delta0) + ", k = " + std::to_string(k) +
                         "); no eps0 >= 0 meets it");
  const auto over = [&](double e0) { return keep * kov_sum(e0, k, eps) * (1 + 1e-11) > slack; };
  // eps0 = eps / k composes purely to eps (D = 0) and eps0 = 0 has D = 0 exactly; delta -> 1 as eps0 -> inf.
  double lo = eps / k;
  if (over(lo)) lo = 0;  // rounding at the l = 0 boundary
  double hi = std::max(2 * lo, 1.0);
  while (!over(hi)) {
    lo = hi;
    hi *= 2;
    if (!std::isfinite(hi)) return lo;
  }
  return bisect(lo, hi, over).lo;  // safe: the lower end passes the test
}

}  // namespace dpstream::accounting
