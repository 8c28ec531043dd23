// zCDP accounting: conversions between rho-zCDP and (eps, delta)-DP, and Gaussian tail helpers.
// Tight conversion: Canonne, Kamath & Steinke 2020 (arXiv 2004.00010, Prop. 12 / Cor. 13), ported
// from IBM cdp2adp.py; simple conversion: Bun & Steinke 2016 (Prop. 1.3).
// Invalid arguments (NaN, rho or eps negative or infinite, delta or p outside (0, 1)) throw
// std::invalid_argument.
#pragma once

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

}  // namespace dpstream::accounting
