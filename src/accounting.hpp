// Privacy accounting: conversions between rho-zCDP and (eps, delta)-DP, Gaussian tail helpers, the
// analytic Gaussian mechanism and optimal composition of (eps0, delta0)-DP mechanisms.
// Tight conversion: Canonne, Kamath & Steinke 2020 (arXiv 2004.00010, Prop. 12 / Cor. 13), ported
// from IBM cdp2adp.py; simple conversion: Bun & Steinke 2016 (Prop. 1.3).
// Invalid arguments (NaN, rho, eps or eps0 negative or infinite, sigma or sensitivity not positive
// and finite, delta or p outside (0, 1), delta0 outside [0, 1), k = 0) throw std::invalid_argument.
#pragma once

#include <cstdint>

namespace dpstream::accounting {

// delta(rho, eps) = inf_{a>1} exp((a-1)(a rho - eps)) / (a-1) * (1 - 1/a)^a, in [0, 1]; 0 at rho = 0.
double zcdp_delta(double rho, double eps);
// Smallest eps with zcdp_delta(rho, eps) <= delta (safe, upper end of the bisection); 0 at rho = 0.
double zcdp_eps_tight(double rho, double delta);
// Largest rho with zcdp_delta(rho, eps) <= delta (safe, lower end of the bisection).
double zcdp_rho_tight(double eps, double delta);
// eps = rho + 2 sqrt(rho ln(1/delta)).
double zcdp_eps_simple(double rho, double delta);
// Inverse of the simple bound: rho = (sqrt(L + eps) - sqrt(L))^2, L = ln(1/delta).
double zcdp_rho_simple(double eps, double delta);

// P[N(0,1) > z] = erfc(z / sqrt 2) / 2.
double normal_upper_tail(double z);
// z with P[N(0,1) > z] = p, p in (0, 1); relative accuracy ~1e-15 in z for p down to 1e-300.
double normal_upper_quantile(double p);

// Analytic Gaussian mechanism (Balle & Wang 2018, Thm 8): N(0, sigma^2) noise on a query of L2 sensitivity
// Delta is (eps, delta)-DP iff delta >= Phi(a - b) - e^eps Phi(-a - b), a = Delta / (2 sigma), b = eps sigma / Delta.

// delta(eps) = Phi(a - b) - e^eps Phi(-a - b) = Phi(a - b) - phi(a - b) R(a + b) (R the Mills ratio, as eps = 2ab);
// relative accuracy ~1e-13 down to 1e-300 (~1e-16 / a when -2 < a - b < 0 and a is tiny).
double gaussian_delta(double eps, double sigma, double sensitivity);
// Smallest sigma with gaussian_delta(eps, sigma, Delta) <= delta (1 - 1e-12) (safe, upper end of a bisection in
// log sigma; the margin covers gaussian_delta's rounding); +inf if no finite sigma does (eps = 0, delta < ~1e-308).
double gaussian_sigma(double eps, double delta, double sensitivity);
// Smallest eps with gaussian_delta(eps, sigma, Delta) <= delta (1 - 1e-12) (safe, upper end); 0 if eps = 0
// already does, +inf if no finite eps does.
double gaussian_eps(double sigma, double delta, double sensitivity);

// Optimal homogeneous composition (Kairouz, Oh & Viswanath 2015, Thm 3.3; any eps: Murtagh & Vadhan 2016,
// Thm 1.5): the k-fold composition of (eps0, delta0)-DP mechanisms is (eps, delta)-DP iff
// delta >= 1 - (1 - delta0)^k (1 - D), D = sum_{l=0}^{k} C(k,l) max(0, e^{(k-l) eps0} - e^{eps + l eps0}) / (1 +
// e^{eps0})^k.

// delta(eps) = 1 - (1 - delta0)^k (1 - D); D summed in log space over l < (k eps0 - eps) / (2 eps0), the
// positive terms. Relative accuracy ~1e-13 for k up to 1e5; one call takes ~15-50 us at k = 1000, ~0.1-0.5 ms at 1e5.
double optimal_composition_delta(double eps0, double delta0, std::uint32_t k, double eps);
// Largest eps0 with optimal_composition_delta(eps0, delta0, k, eps) <= delta (safe, lower end of the bisection, with a
// 1e-11 relative margin on D and 4 ulps on 1 - (1 - delta0)^k against rounding);
// throws std::invalid_argument when even eps0 -> 0 fails, i.e. 1 - (1 - delta0)^k >= delta.
double optimal_composition_eps0(double eps, double delta, double delta0, std::uint32_t k);

}  // namespace dpstream::accounting
