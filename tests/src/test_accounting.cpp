// zCDP accounting against tests/reference/zcdp_conversion.json (50-digit mpmath values) and
// the README table; normal quantiles against 60-digit mpmath values (cross-checked with math.erfc);
// the analytic Gaussian mechanism against tests/reference/analytic_gaussian.json and against
// tests/reference/analytic_gaussian.py (100-digit mpmath, tiny deltas and small eps).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <vector>

#include "src/accounting.hpp"

using namespace dpstream::accounting;

namespace {
nlohmann::json reference(const std::string& name = "zcdp_conversion.json") {
  std::ifstream f(std::string(DPSTREAM_REFERENCE_DIR) + "/" + name);
  if (!f) throw std::runtime_error("missing tests/reference/" + name);
  return nlohmann::json::parse(f);
}

double rel(double got, double want) { return std::abs(got - want) / std::abs(want); }

const std::vector<double> kRhos = {1e-8, 1e-6, 1e-4, 0.01, 0.1, 0.5, 1, 5, 30, 300, 1e4};
const std::vector<double> kDeltas = {1e-300, 1e-100, 1e-20, 1e-9, 1e-5, 1e-2, 0.5};
const std::vector<double> kEpss = {1e-3, 0.1, 1, 3, 6, 10, 50, 300};
}  // namespace

TEST(ZcdpReference, EpsGivenRho) {
  const auto entries = reference()["eps_given_rho"];
  ASSERT_GE(entries.size(), 10u);
  for (const auto& e : entries) {
    const double rho = e["rho"], delta = e["delta"], simple = e["eps_simple"], cks = e["eps_cks"];
    SCOPED_TRACE("rho=" + std::to_string(rho) + " delta=" + std::to_string(delta));
    EXPECT_LE(rel(zcdp_eps_simple(rho, delta), simple), 1e-12);
    const double eps = zcdp_eps_tight(rho, delta);
    EXPECT_LE(rel(eps, cks), 1e-9);
    EXPECT_GE(eps, cks * (1 - 1e-12));  // never optimistic
    EXPECT_LE(zcdp_delta(rho, eps), delta);
    EXPECT_LE(rel(zcdp_delta(rho, cks), delta), 1e-9);
  }
}

TEST(ZcdpReference, RhoGivenEps) {
  const auto entries = reference()["rho_given_eps"];
  ASSERT_GE(entries.size(), 3u);
  for (const auto& e : entries) {
    const double eps = e["eps"], delta = e["delta"], simple = e["rho_simple"], cks = e["rho_cks"];
    SCOPED_TRACE("eps=" + std::to_string(eps) + " delta=" + std::to_string(delta));
    EXPECT_LE(rel(zcdp_rho_simple(eps, delta), simple), 1e-12);
    const double rho = zcdp_rho_tight(eps, delta);
    EXPECT_LE(rel(rho, cks), 1e-9);
    EXPECT_LE(rho, cks * (1 + 1e-12));  // never optimistic
    EXPECT_LE(zcdp_delta(rho, eps), delta);
    EXPECT_LE(rel(zcdp_delta(cks, eps), delta), 1e-9);
  }
}

TEST(ZcdpReference, ReadmeTable) {
  struct Row {
    double rho, simple5, tight5, simple9, tight9;
  };
  const Row rows[] = {{0.01, 0.688614, 0.545726, 0.920456, 0.810174},
                      {0.1, 2.245966, 1.914239, 2.979116, 2.715482},
                      {0.5, 5.298526, 4.728387, 6.937898, 6.474070},
                      {1, 7.786140, 7.077197, 10.104563, 9.521464},
                      {5, 20.174271, 19.047260, 25.358421, 24.405988}};
  for (const auto& r : rows) {
    EXPECT_NEAR(zcdp_eps_simple(r.rho, 1e-5), r.simple5, 5e-7);
    EXPECT_NEAR(zcdp_eps_tight(r.rho, 1e-5), r.tight5, 5e-7);
    EXPECT_NEAR(zcdp_eps_simple(r.rho, 1e-9), r.simple9, 5e-7);
    EXPECT_NEAR(zcdp_eps_tight(r.rho, 1e-9), r.tight9, 5e-7);
  }
  EXPECT_NEAR(zcdp_rho_tight(1, 1e-9), 0.0149731, 5e-8);
  EXPECT_NEAR(zcdp_rho_tight(3, 1e-9), 0.1205824, 5e-8);
  EXPECT_NEAR(zcdp_rho_tight(6, 1e-9), 0.4353456, 5e-8);
}

TEST(Zcdp, RoundTrips) {
  for (double d : kDeltas) {
    for (double eps : kEpss) {
      const double rho = zcdp_rho_tight(eps, d);
      EXPECT_LE(rel(zcdp_eps_tight(rho, d), eps), 1e-9) << "eps=" << eps << " delta=" << d;
      EXPECT_LE(rel(zcdp_eps_simple(zcdp_rho_simple(eps, d), d), eps), 1e-12) << "eps=" << eps << " delta=" << d;
    }
    for (double rho : kRhos) {
      const double eps = zcdp_eps_tight(rho, d);
      if (eps == 0) continue;  // delta(rho, 0) <= d already: nothing to invert
      EXPECT_LE(rel(zcdp_rho_tight(eps, d), rho), 1e-9) << "rho=" << rho << " delta=" << d;
    }
  }
}

TEST(Zcdp, SafeSideAndTightBelowSimple) {
  for (double d : kDeltas) {
    for (double rho : kRhos) {
      const double eps = zcdp_eps_tight(rho, d);
      EXPECT_LE(eps, zcdp_eps_simple(rho, d)) << "rho=" << rho << " delta=" << d;
      EXPECT_LE(zcdp_delta(rho, eps), d) << "rho=" << rho << " delta=" << d;
    }
    for (double eps : kEpss) {
      const double rho = zcdp_rho_tight(eps, d);
      EXPECT_GE(rho, zcdp_rho_simple(eps, d)) << "eps=" << eps << " delta=" << d;
      EXPECT_LE(zcdp_delta(rho, eps), d) << "eps=" << eps << " delta=" << d;
      EXPECT_GT(zcdp_delta(std::nextafter(rho, 2 * rho + 1) * (1 + 1e-12), eps), d) << "not the largest rho";
    }
  }
}

TEST(Zcdp, Monotone) {
  for (double d : kDeltas) {
    for (std::size_t i = 1; i < kRhos.size(); ++i) {
      EXPECT_LE(zcdp_eps_tight(kRhos[i - 1], d), zcdp_eps_tight(kRhos[i], d));
      EXPECT_LE(zcdp_delta(kRhos[i - 1], 1.0), zcdp_delta(kRhos[i], 1.0));
    }
    for (std::size_t i = 1; i < kEpss.size(); ++i) {
      EXPECT_LT(zcdp_rho_tight(kEpss[i - 1], d), zcdp_rho_tight(kEpss[i], d));
      EXPECT_GE(zcdp_delta(0.5, kEpss[i - 1]), zcdp_delta(0.5, kEpss[i]));
    }
  }
  for (std::size_t j = 1; j < kDeltas.size(); ++j) {
    EXPECT_GT(zcdp_eps_tight(1.0, kDeltas[j - 1]), zcdp_eps_tight(1.0, kDeltas[j]));
    EXPECT_LT(zcdp_rho_tight(1.0, kDeltas[j - 1]), zcdp_rho_tight(1.0, kDeltas[j]));
  }
}

TEST(Zcdp, EdgeCases) {
  EXPECT_EQ(zcdp_delta(0, 0), 0.0);
  EXPECT_EQ(zcdp_delta(0, 3), 0.0);
  EXPECT_EQ(zcdp_eps_tight(0, 1e-9), 0.0);
  EXPECT_EQ(zcdp_eps_simple(0, 1e-9), 0.0);
  EXPECT_EQ(zcdp_rho_simple(0, 1e-9), 0.0);
  EXPECT_EQ(zcdp_delta(10, 0), 1.0);  // capped
  for (double rho : kRhos)
    for (double eps : {0.0, 0.5, 5.0, 500.0}) {
      const double d = zcdp_delta(rho, eps);
      EXPECT_GE(d, 0.0);
      EXPECT_LE(d, 1.0);
    }
  EXPECT_GT(zcdp_rho_tight(0, 1e-9), 0.0);  // eps = 0 still admits a tiny rho
  EXPECT_LE(zcdp_delta(zcdp_rho_tight(0, 1e-9), 0), 1e-9);
  // Far outside double range (true rho ~ 1e-600) the answer must stay safe, not come from NaN or overflow.
  EXPECT_LE(zcdp_delta(zcdp_rho_tight(0, 1e-300), 0), 1e-300);
  EXPECT_NEAR(zcdp_delta(1e-320, 0) / 1e-160, std::sqrt(2e-320) / std::exp(0.5) / 1e-160, 1e-3);  // ~ sqrt(2 rho / e)
}

TEST(Zcdp, InvalidArgumentsThrow) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  EXPECT_THROW(zcdp_delta(-1e-3, 1), std::invalid_argument);
  EXPECT_THROW(zcdp_delta(1, -1e-3), std::invalid_argument);
  EXPECT_THROW(zcdp_delta(nan, 1), std::invalid_argument);
  EXPECT_THROW(zcdp_delta(1, nan), std::invalid_argument);
  EXPECT_THROW(zcdp_delta(inf, 1), std::invalid_argument);
  for (double bad : {0.0, 1.0, -0.1, 1.5, nan}) {
    EXPECT_THROW(zcdp_eps_tight(1, bad), std::invalid_argument);
    EXPECT_THROW(zcdp_rho_tight(1, bad), std::invalid_argument);
    EXPECT_THROW(zcdp_eps_simple(1, bad), std::invalid_argument);
    EXPECT_THROW(zcdp_rho_simple(1, bad), std::invalid_argument);
    EXPECT_THROW(normal_upper_quantile(bad), std::invalid_argument);
  }
  EXPECT_THROW(zcdp_eps_tight(-1, 1e-9), std::invalid_argument);
  EXPECT_THROW(zcdp_eps_simple(nan, 1e-9), std::invalid_argument);
  EXPECT_THROW(zcdp_rho_tight(-1, 1e-9), std::invalid_argument);
  EXPECT_THROW(zcdp_rho_simple(nan, 1e-9), std::invalid_argument);
  EXPECT_THROW(normal_upper_tail(nan), std::invalid_argument);
}

TEST(Normal, KnownQuantiles) {
  // 60-digit mpmath bisection on erfc, cross-checked with a double bisection on math.erfc.
  EXPECT_NEAR(normal_upper_quantile(0.5), 0.0, 1e-15);
  const std::pair<double, double> known[] = {{0.3, 0.52440051270804078404},   {0.025, 1.9599639845400542355},
                                             {1e-5, 4.2648907939228246285},   {1e-9, 5.9978070150076868716},
                                             {1e-15, 7.941345326170996781},   {1e-100, 21.273453560965324295},
                                             {1e-300, 37.047096299361199237}, {0.7, -0.52440051270804078404}};
  for (const auto& [p, z] : known) EXPECT_LE(rel(normal_upper_quantile(p), z), 1e-14) << "p=" << p;
  EXPECT_DOUBLE_EQ(normal_upper_tail(0), 0.5);
  EXPECT_NEAR(normal_upper_tail(1.9599639845400542355), 0.025, 1e-17);
}

TEST(Normal, QuantileRoundTripAndMonotone) {
  double prev_z = std::numeric_limits<double>::infinity();
  for (double lg = -300; lg <= std::log10(0.5) + 1e-12; lg += 0.05) {
    const double p = std::pow(10.0, lg), z = normal_upper_quantile(p);
    EXPECT_LE(rel(normal_upper_tail(z), p), 1e-12) << "p=" << p;
    EXPECT_LT(z, prev_z) << "p=" << p;
    prev_z = z;
  }
  for (double p = 0.5; p < 1; p += 0.01)
    EXPECT_LE(rel(normal_upper_tail(normal_upper_quantile(p)), p), 1e-12) << "p=" << p;
}

// ---- Analytic Gaussian mechanism (Balle & Wang 2018) ----------------------------------------------------

namespace {
double classic_sigma(double eps, double delta, double sensitivity) {  // Dwork & Roth 2014, Thm A.1 (eps < 1)
  return sensitivity * std::sqrt(2 * std::log(1.25 / delta)) / eps;
}
}  // namespace

TEST(GaussianReference, SharedJson) {
  const auto rows = reference("analytic_gaussian.json")["rows"];
  ASSERT_GE(rows.size(), 3u);
  for (const auto& r : rows) {
    const double eps = r["eps"], delta = r["delta"], sens = r["Delta2"];
    const double want = std::stod(r["sigma_analytic_str"].get<std::string>());
    const double classic = std::stod(r["sigma_classic_str"].get<std::string>());
    SCOPED_TRACE("eps=" + std::to_string(eps) + " delta=" + std::to_string(delta) + " Delta=" + std::to_string(sens));
    const double sigma = gaussian_sigma(eps, delta, sens);
    EXPECT_LE(rel(sigma, want), 1e-12);
    EXPECT_GE(sigma, want);  // never optimistic (want is the 50-digit value rounded to 20 digits)
    EXPECT_LE(gaussian_delta(eps, sigma, sens), delta);
    EXPECT_GT(gaussian_delta(eps, sigma * (1 - 1e-12), sens), delta) << "not the smallest sigma";
    EXPECT_LE(rel(gaussian_delta(eps, want, sens), delta), 1e-12);
    EXPECT_LE(rel(classic_sigma(eps, delta, sens), classic), 1e-14);
    EXPECT_LE(rel(gaussian_delta(eps, classic, sens), r["delta_achieved_by_sigma_classic"].get<double>()), 1e-12);
    const double e = gaussian_eps(want, delta, sens);
    EXPECT_LE(rel(e, eps), 1e-12);
    EXPECT_LE(gaussian_delta(e, want, sens), delta);
  }
  // The README's rounded table.
  EXPECT_NEAR(gaussian_sigma(1, 1e-5, 1), 3.7306316, 5e-8);
  EXPECT_NEAR(gaussian_sigma(3, 1e-9, 1), 1.9437243, 5e-8);
  EXPECT_NEAR(gaussian_sigma(6, 1e-9, 32), 32.8395799, 5e-8);
}

TEST(GaussianReference, Mpmath) {
  struct DeltaRow {
    double eps, sigma, sensitivity, delta;
  };
  const DeltaRow deltas[] = {
      // Generated by tests/reference/analytic_gaussian.py (mpmath, 100 digits).
      // {eps, sigma, sensitivity, delta}
      {1.0, 3.730631634815942, 1.0, 9.9999999999999994816e-6},
      {0.0, 10.0, 1.0, 3.9877611676744923193e-2},
      {0.0, 1000000.0, 1.0, 3.9894228040141605534e-7},
      {0.5, 0.3, 1.0, 8.7822261633462830541e-1},
      {1.0, 1.0, 1.0, 1.269367375066439458e-1},
      {3.0, 1.0, 1.0, 1.5371853694009548469e-3},
      {10.0, 1.0, 1.0, 9.8127058268469559492e-23},
      {10.0, 0.5, 1.0, 9.9402028161181527684e-6},
      {50.0, 0.2, 1.0, 1.2556669972910884248e-14},
      {50.0, 2.0, 1.0, 0.0 /* 4.6895737334716356036e-2166: below double range */},
      {60.0, 0.62, 1.0, 1.1409542798249527134e-291},
      {100.0, 0.3, 1.0, 7.0543471219710022626e-178},
      {0.01, 1000.0, 1.0, 7.5120257223581850587e-28},
      {0.05, 740.0, 1.0, 2.1409672069322978273e-304},
      {0.0001, 30000.0, 1.0, 1.273911417317757155e-8},
      {1e-06, 7000000.0, 1.0, 2.5147527025724410087e-20},
      {6.0, 32.83957987347089, 32.0, 1.0000000000000033226e-9},
      {2.0, 100.0, 64.0, 4.0603404769704757301e-4},
      {0.3, 0.001, 0.0001, 4.4351978820250867391e-5},
  };
  for (const auto& r : deltas) {
    const double got = gaussian_delta(r.eps, r.sigma, r.sensitivity);
    SCOPED_TRACE("eps=" + std::to_string(r.eps) + " sigma=" + std::to_string(r.sigma));
    if (r.delta == 0) {
      EXPECT_EQ(got, 0.0);
    } else {
      EXPECT_LE(rel(got, r.delta), 1e-12) << got << " vs " << r.delta;
    }
  }
  struct SigmaRow {
    double eps, delta, sensitivity, sigma;
  };
  const SigmaRow sigmas[] = {
      // {eps, delta, sensitivity, smallest sigma}
      {0.1, 1e-12, 1.0, 6.153905591889454663e+1},  {0.01, 1e-09, 1.0, 4.5850849749725294949e+2},
      {0.5, 1e-05, 1.0, 7.0318266755824914044},    {1.0, 1e-300, 1.0, 3.6865497894111099653e+1},
      {10.0, 1e-100, 1.0, 2.1327366227086315901},  {20.0, 1e-09, 1.0, 3.5981208665459255055e-1},
      {0.0, 1e-06, 1.0, 3.9894228040132825315e+5}, {2.0, 1e-12, 7.5, 2.5220043821361246415e+1},
  };
  for (const auto& r : sigmas) {
    const double got = gaussian_sigma(r.eps, r.delta, r.sensitivity);
    SCOPED_TRACE("eps=" + std::to_string(r.eps) + " delta=" + std::to_string(r.delta));
    EXPECT_LE(rel(got, r.sigma), 1e-12) << got << " vs " << r.sigma;
    EXPECT_GE(got, r.sigma);  // never optimistic
    EXPECT_LE(gaussian_delta(r.eps, got, r.sensitivity), r.delta);
  }
}

TEST(Gaussian, ClassicBoundIsLooserBelowEpsOne) {
  for (double d : {1e-300, 1e-100, 1e-20, 1e-12, 1e-9, 1e-5, 1e-2}) {
    for (double eps : {1e-4, 1e-3, 0.01, 0.1, 0.3, 0.5, 0.9, 0.999}) {
      for (double sens : {1.0, 32.0}) {
        const double classic = classic_sigma(eps, d, sens), analytic = gaussian_sigma(eps, d, sens);
        EXPECT_GE(classic, analytic) << "eps=" << eps << " delta=" << d;
        EXPECT_LE(gaussian_delta(eps, classic, sens), d) << "eps=" << eps << " delta=" << d;
      }
    }
  }
}

TEST(Gaussian, Monotone) {
  for (double sigma : {0.05, 0.3, 1.0, 3.0, 30.0, 1e4}) {
    double prev = 2;
    for (double eps = 0; eps <= 60; eps += 0.125) {  // delta falls with eps
      const double d = gaussian_delta(eps, sigma, 1);
      EXPECT_LE(d, prev) << "sigma=" << sigma << " eps=" << eps;
      EXPECT_GE(d, 0.0);
      EXPECT_LE(d, 1.0);
      prev = d;
    }
  }
  for (double eps : {0.0, 0.01, 0.5, 1.0, 6.0, 40.0}) {
    double prev = 2;
    for (double lg = -3; lg <= 6; lg += 0.01) {  // and with sigma
      const double d = gaussian_delta(eps, std::pow(10.0, lg), 1);
      EXPECT_LE(d, prev) << "eps=" << eps << " sigma=1e" << lg;
      prev = d;
    }
  }
  for (double d : {1e-300, 1e-20, 1e-9, 1e-5, 0.1}) {
    double prev_sigma = std::numeric_limits<double>::infinity();
    for (double eps : {0.0, 1e-3, 0.1, 1.0, 3.0, 10.0, 50.0}) {
      const double sigma = gaussian_sigma(eps, d, 1);
      EXPECT_LT(sigma, prev_sigma) << "eps=" << eps << " delta=" << d;
      prev_sigma = sigma;
    }
  }
  for (double eps : {0.1, 1.0, 6.0}) {
    double prev_sigma = 0;
    for (double d : {0.5, 1e-2, 1e-5, 1e-9, 1e-20, 1e-100, 1e-300}) {
      const double sigma = gaussian_sigma(eps, d, 1);
      EXPECT_GT(sigma, prev_sigma) << "eps=" << eps << " delta=" << d;
      prev_sigma = sigma;
    }
  }
}

TEST(Gaussian, RoundTripsAndScaling) {
  for (double d : {1e-300, 1e-100, 1e-20, 1e-12, 1e-9, 1e-5, 1e-2, 0.5}) {
    for (double eps : {1e-4, 0.01, 0.1, 1.0, 3.0, 10.0, 50.0}) {
      const double sigma = gaussian_sigma(eps, d, 1);
      EXPECT_LE(gaussian_delta(eps, sigma, 1), d);
      const double e = gaussian_eps(sigma, d, 1);
      EXPECT_LE(rel(e, eps), 1e-9) << "eps=" << eps << " delta=" << d;
      EXPECT_LE(gaussian_delta(e, sigma, 1), d);
      // Only sigma / Delta matters.
      EXPECT_LE(rel(gaussian_sigma(eps, d, 32), 32 * sigma), 1e-14) << "eps=" << eps << " delta=" << d;
      const double d1 = gaussian_delta(eps, sigma * 0.9, 1), d32 = gaussian_delta(eps, sigma * 0.9 * 32, 32);
      EXPECT_LE(rel(d32, d1), 1e-12) << "eps=" << eps << " delta=" << d;
    }
  }
}

TEST(Gaussian, EdgeCases) {
  // eps = 0: delta = 2 Phi(Delta / (2 sigma)) - 1.
  for (double sigma : {0.1, 1.0, 10.0, 1e3})
    EXPECT_LE(rel(gaussian_delta(0, sigma, 1), 1 - 2 * normal_upper_tail(0.5 / sigma)), 1e-12) << sigma;
  EXPECT_EQ(gaussian_delta(1, 1e-300, 1), 1.0);  // no noise
  EXPECT_EQ(gaussian_delta(1e300, 1, 1), 0.0);   // far past double range
  EXPECT_EQ(gaussian_delta(1, 1e300, 1e-300), 0.0);
  EXPECT_EQ(gaussian_eps(1e6, 1e-3, 1), 0.0);  // eps = 0 already suffices
  EXPECT_GT(gaussian_eps(1e6, 1e-9, 1), 0.0);
  EXPECT_EQ(gaussian_sigma(0, 1e-320, 1), std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isfinite(gaussian_sigma(1e-300, 1e-300, 1)));
}

TEST(Gaussian, InvalidArgumentsThrow) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (double bad : {-1.0, nan, inf}) {
    EXPECT_THROW(gaussian_delta(bad, 1, 1), std::invalid_argument);
    EXPECT_THROW(gaussian_sigma(bad, 1e-5, 1), std::invalid_argument);
  }
  for (double bad : {0.0, -1.0, nan, inf}) {
    EXPECT_THROW(gaussian_delta(1, bad, 1), std::invalid_argument);
    EXPECT_THROW(gaussian_delta(1, 1, bad), std::invalid_argument);
    EXPECT_THROW(gaussian_sigma(1, 1e-5, bad), std::invalid_argument);
    EXPECT_THROW(gaussian_eps(bad, 1e-5, 1), std::invalid_argument);
    EXPECT_THROW(gaussian_eps(1, 1e-5, bad), std::invalid_argument);
  }
  for (double bad : {0.0, 1.0, -0.1, 1.5, nan}) {
    EXPECT_THROW(gaussian_sigma(1, bad, 1), std::invalid_argument);
    EXPECT_THROW(gaussian_eps(1, bad, 1), std::invalid_argument);
  }
}
