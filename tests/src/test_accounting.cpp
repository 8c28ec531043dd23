// zCDP accounting against ../shared/reference/zcdp_conversion.json (50-digit mpmath values) and
// the README table; normal quantiles against 60-digit mpmath values (cross-checked with math.erfc).
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
nlohmann::json reference() {
  std::ifstream f(std::string(DPSTREAM_REFERENCE_DIR) + "/zcdp_conversion.json");
  if (!f) throw std::runtime_error("missing ../shared/reference/zcdp_conversion.json");
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
  for (double p = 0.5; p < 1; p += 0.01) EXPECT_LE(rel(normal_upper_tail(normal_upper_quantile(p)), p), 1e-12) << "p=" << p;
}
