// Tests of partition selection (sql/selection.hpp): the open libraries' formulas against the independent values
// of tests/reference/partition_selection.json, the engine's exact thresholds against direct summation of the
// noise's pmf, and decide() by Monte Carlo over independent PRF streams. Statistical assertions use fixed seeds
// (reproducible) and state the false-failure rate each would have under a fresh seed.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "sql/selection.hpp"

using namespace dpstream;
using sql::Selection;

namespace {

nlohmann::json reference() {
  std::ifstream f(std::string(DPSTREAM_REFERENCE_DIR) + "/partition_selection.json");
  if (!f) throw std::runtime_error("missing tests/reference/partition_selection.json");
  return nlohmann::json::parse(f);
}

double rel(double a, double b) { return std::fabs(a - b) / std::fabs(b); }

// P[X >= m] for X ~ DLap(b), P(x) ~ q^|x|, q = exp(-1/b): both sums directly, smallest terms first.
long double dlap_tail(double b, std::int64_t m) {
  const long double q = std::exp(-1.0L / b);
  const std::int64_t ymax = static_cast<std::int64_t>(80 * b) + 80 + std::abs(m);  // beyond: < exp(-80) relative
  long double z = 0, tail = 0;
  for (std::int64_t y = ymax; y >= -ymax; --y) {
    const long double w = std::pow(q, static_cast<long double>(std::abs(y)));
    z += w;
    if (y >= m) tail += w;
  }
  return tail / z;
}

// P[X >= m] for X ~ N_Z(0, sigma^2) with the sampler's exact sigma^2 = n 2^-k, by direct summation.
long double dgauss_tail(const noise::DiscreteGaussian& dg, std::int64_t m) {
  const long double s2 = std::ldexp(static_cast<long double>(dg.sigma2_num()), -dg.sigma2_exp());
  const std::int64_t ymax = static_cast<std::int64_t>(40 * dg.sigma()) + 40 + std::abs(m);
  long double z = 0, tail = 0;
  for (std::int64_t y = ymax; y >= -ymax; --y) {
    const auto yl = static_cast<long double>(y);
    const long double w = std::exp(-yl * yl / (2 * s2));
    z += w;
    if (y >= m) tail += w;
  }
  return tail / z;
}

// Independent selection streams: one NodeStream per key, as the brief of the SQL operator draws them.
struct Streams {
  noise::WindowPrf prf{noise::secret_from_seed(1), 0};
  noise::NodeStream at(std::uint64_t key) {
    return noise::NodeStream(prf, noise::NodeId{key, noise::Family::KeySelection, 0, 0, 0});
  }
};

// Keeps of a group of n users over keys [first, first + count).
double keeps(const Selection& sel, std::uint64_t n, std::uint64_t first, std::uint64_t count) {
  Streams s;
  double kept = 0;
  for (std::uint64_t key = first; key < first + count; ++key) {
    auto rng = s.at(key);
    kept += sel.decide(n, rng).keep;
  }
  return kept;
}

// |count - N p| within 5 binomial standard deviations (+1 for discreteness): false failure < 6e-7.
void expect_binomial(double count, double trials, double p, const std::string& what) {
  EXPECT_LE(std::fabs(count - trials * p), 5 * std::sqrt(trials * p * (1 - p)) + 1)
      << what << ": " << count << " of " << trials << ", expected p " << p;
}

template <class F>
void expect_refused(F make, const std::vector<std::string>& words) {
  try {
    make();
    ADD_FAILURE() << "accepted";
  } catch (const std::invalid_argument& e) {
    for (const auto& w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  }
}

}  // namespace

// (a) Laplace thresholds (Wilson et al.; Google's LaplacePartitionSelection) at 1e-9, and delta_k itself.
TEST(Selection, LaplaceContinuousMatchesReference) {
  const auto ref = reference();
  int rows = 0;
  for (const auto& r : ref.at("laplace_threshold")) {
    const double eps = r.at("eps"), delta = r.at("delta");
    const auto k = r.at("Cu").get<std::uint32_t>();
    EXPECT_LE(rel(sql::adjusted_delta(delta, k), r.at("per_partition_delta_exact")), 1e-12) << k;
    EXPECT_LE(rel(sql::laplace_threshold_continuous(eps, delta, k), r.at("tau")), 1e-9)
        << "eps " << eps << " delta " << delta << " k " << k;
    ++rows;
  }
  EXPECT_EQ(rows, 12);
}

// (b) Google's p(n) against the optimal curve of Desfontaines et al. (Thm 1): the reference's optimal_pi is the
// same quantity (Google's closed form is its solution). laplace_threshold_keep_prob is a different quantity
// (the keep probability of continuous Laplace thresholding) and is not tested here.
TEST(Selection, MagicMatchesReference) {
  const auto ref = reference();
  const auto& kp = ref.at("keep_prob_n_1_to_20");
  const double eps = kp.at("eps"), delta = kp.at("delta");
  const auto k = kp.at("Cu").get<std::uint32_t>();
  for (const auto& r : kp.at("rows")) {
    const auto n = r.at("n").get<std::uint64_t>();
    EXPECT_LE(rel(sql::magic_keep_probability(eps, delta, k, n), r.at("optimal_pi")), 1e-12) << n;
  }
  const auto n2 = kp.at("crossover_n2").get<std::uint64_t>();  // 1 beyond the second crossover, < 1 up to it
  EXPECT_LT(sql::magic_keep_probability(eps, delta, k, n2), 1.0);
  EXPECT_EQ(sql::magic_keep_probability(eps, delta, k, n2 + 1), 1.0);
  EXPECT_EQ(sql::magic_keep_probability(eps, delta, k, 0), 0.0);

  const auto& c5 = ref.at("optimal_pi_Cu5_google_style");  // eps = 1, delta = 1e-5, k = 5
  EXPECT_LE(rel(sql::adjusted_delta(1e-5, 5), c5.at("delta_per_partition")), 1e-12);
  EXPECT_DOUBLE_EQ(1.0 / 5, c5.at("eps_per_partition").get<double>());
  const auto& pi = c5.at("pi_n_1_to_60");
  ASSERT_EQ(pi.size(), 60u);
  for (std::uint64_t n = 1; n <= 60; ++n)
    EXPECT_LE(rel(sql::magic_keep_probability(1, 1e-5, 5, n), pi[n - 1]), 1e-12) << n;
}

// (c) Laplace: tau is the least integer with P[1 + X >= tau] <= delta_k, by direct summation of the DLap pmf.
TEST(Selection, LaplaceThresholdExact) {
  int cases = 0;
  for (double eps : {0.1, 0.5, 1.0, 3.0, 10.0})
    for (double delta : {0.3, 1e-3, 1e-5, 1e-9})
      for (std::uint32_t k : {1u, 5u, 32u}) {
        const auto sel = Selection::laplace(eps, delta, k);
        const double dk = sql::adjusted_delta(delta, k), b = sel.noise_scale();
        const std::int64_t tau = sel.threshold();
        const std::string at = "eps " + std::to_string(eps) + " delta " + std::to_string(delta) + " k " +
                               std::to_string(k) + " tau " + std::to_string(tau);
        EXPECT_GE(b, k / eps) << at;
        EXPECT_LE(b, k / eps * (1 + 1e-15)) << at;
        const long double keep = dlap_tail(b, tau - 1), below = dlap_tail(b, tau - 2);
        EXPECT_LE(keep, dk) << at;   // P[1 + X >= tau] <= delta_k
        EXPECT_GT(below, dk) << at;  // and tau - 1 would not do
        EXPECT_LE(sel.single_user_keep_bound(), dk) << at;
        EXPECT_LE(rel(sel.single_user_keep_bound(), static_cast<double>(keep)), 1e-12) << at;
        // Close to the continuous threshold: the tails differ by the factor 2 / (1 + q) in [1, 2).
        EXPECT_LE(std::fabs(static_cast<double>(tau) - sql::laplace_threshold_continuous(eps, delta, k)),
                  b * std::log(2.0) + 2)
            << at;
        ++cases;
      }
  EXPECT_EQ(cases, 60);
}

// (c) Gaussian: P[1 + X >= tau] <= delta_k by direct summation of the N_Z pmf, the bound holds, and tau exceeds
// the continuous threshold 1 + sigma z by 1 to 2 (so it is within max(sigma, 2) of it).
TEST(Selection, GaussianThresholdBound) {
  int cases = 0;
  for (double rho : {0.005, 0.05, 0.5, 5.0})
    for (double delta : {0.3, 1e-3, 1e-5, 1e-9})
      for (std::uint32_t k : {1u, 5u, 32u}) {
        const auto sel = Selection::gaussian(rho, delta, k);
        const noise::DiscreteGaussian dg(std::sqrt(k / (2 * rho)));
        const double dk = sql::adjusted_delta(delta, k), sigma = sel.noise_scale();
        const std::int64_t tau = sel.threshold();
        const std::string at = "rho " + std::to_string(rho) + " delta " + std::to_string(delta) + " k " +
                               std::to_string(k) + " tau " + std::to_string(tau);
        ASSERT_EQ(sigma, dg.sigma()) << at;
        const long double keep = dgauss_tail(dg, tau - 1);
        EXPECT_LE(keep, dk) << at;
        EXPECT_LE(keep, sel.single_user_keep_bound()) << at;
        EXPECT_LE(sel.single_user_keep_bound(), dk) << at;
        const double gap = static_cast<double>(tau) - sql::gaussian_threshold_continuous(sigma, delta, k);
        EXPECT_GE(gap, 1) << at;
        EXPECT_LE(gap, 2 + 1e-6) << at;
        EXPECT_LE(std::fabs(gap), std::max(sigma, 2 + 1e-6)) << at;
        ++cases;
      }
  EXPECT_EQ(cases, 48);
}

TEST(Selection, ExtremeParameters) {
  // eps = 1e6: b = 1e-6 is raised to 2^-10; P[X >= 1] ~ exp(-1024), so tau = 2 (one user never released).
  const auto lap = Selection::laplace(1e6, 1e-5, 1);
  EXPECT_EQ(lap.noise_scale(), std::ldexp(1.0, -10));
  EXPECT_EQ(lap.threshold(), 2);
  EXPECT_LT(lap.single_user_keep_bound(), 1e-300);
  // Large b and tiny delta: tau ~ b ln(1 / (2 delta)).
  const auto wide = Selection::laplace(1e-3, 1e-12, 1u << 20);
  EXPECT_NEAR(static_cast<double>(wide.threshold()) /
                  (wide.noise_scale() * std::log(0.5 / sql::adjusted_delta(1e-12, 1u << 20))),
              1.0, 1e-6);
  EXPECT_LE(wide.single_user_keep_bound(), sql::adjusted_delta(1e-12, 1u << 20));
  // rho huge: sigma raised to 2^-10, tau = 2 + ceil(2^-10 z) = 3.
  const auto g = Selection::gaussian(1e12, 1e-5, 1);
  EXPECT_EQ(g.noise_scale(), std::ldexp(1.0, -10));
  EXPECT_EQ(g.threshold(), 3);
  // Magic at eps' = 1e6: p(1) = delta', p(2) = 1, no NaN.
  EXPECT_EQ(sql::magic_keep_probability(1e6, 1e-5, 1, 1), 1e-5);
  EXPECT_EQ(sql::magic_keep_probability(1e6, 1e-5, 1, 2), 1.0);
  // Magic at tiny eps': the first phase tends to n delta'.
  EXPECT_NEAR(sql::magic_keep_probability(1e-6, 1e-5, 1u << 20, 3) / (3 * sql::adjusted_delta(1e-5, 1u << 20)), 1.0,
              1e-9);
}

// (d) One-user groups: the release frequency over 200k independent streams. Laplace's bound is the exact keep
// probability (two-sided test); the Gaussian one is an upper bound (one-sided), and the exact N_Z tail two-sided.
TEST(Selection, SingleUserReleaseFrequency) {
  constexpr double kN = 200000;
  const auto lap = Selection::laplace(1.0, 0.05, 1);  // b = 1, tau = 4, P = e^-3 / (1 + e^-1) = 0.0364
  EXPECT_EQ(lap.threshold(), 4);
  expect_binomial(keeps(lap, 1, 0, kN), kN, lap.single_user_keep_bound(), "laplace, one user");
  const auto lap5 = Selection::laplace(2.0, 0.15, 5);  // b = 2.5
  expect_binomial(keeps(lap5, 1, 1000000, kN), kN, lap5.single_user_keep_bound(), "laplace k = 5, one user");

  const auto gs = Selection::gaussian(0.005, 0.05, 1);  // sigma = 10, tau = 19
  const noise::DiscreteGaussian dg(10.0);
  const double exact = static_cast<double>(dgauss_tail(dg, gs.threshold() - 1));
  const double seen = keeps(gs, 1, 2000000, kN), bound = gs.single_user_keep_bound();
  std::printf("gaussian sigma 10: tau %lld, bound %.4g, exact %.4g, seen %.4g\n",
              static_cast<long long>(gs.threshold()), bound, exact, seen / kN);
  EXPECT_GT(exact, 0.01);
  expect_binomial(seen, kN, exact, "gaussian, one user");
  EXPECT_LE(seen, kN * bound + 5 * std::sqrt(kN * bound * (1 - bound)));
}

// (d) Groups far above tau are always kept (miss probability < exp(-40) per group), with the noisy count centred.
TEST(Selection, ManyUsersAlwaysKept) {
  constexpr std::uint64_t kN = 20000;
  for (const auto& sel : {Selection::laplace(1.0, 1e-5, 5), Selection::gaussian(0.05, 1e-5, 5)}) {
    const double width = sel.kind() == sql::SelectionKind::Laplace ? 40 * sel.noise_scale() : 12 * sel.noise_scale();
    const auto n = static_cast<std::uint64_t>(static_cast<double>(sel.threshold()) + std::ceil(width));
    Streams s;
    double kept = 0, sum = 0, sum2 = 0;
    for (std::uint64_t key = 0; key < kN; ++key) {
      auto rng = s.at(5000000 + key);
      const auto d = sel.decide(n, rng);
      kept += d.keep;
      const double x = static_cast<double>(d.noisy_count) - static_cast<double>(n);
      sum += x, sum2 += x * x;
    }
    EXPECT_EQ(kept, double(kN)) << sel.describe();
    EXPECT_LT(std::fabs(sum / kN), 5 * std::sqrt(sum2 / kN / kN)) << sel.describe();  // mean 0: 5 s.e.
  }
}

// (e) Magic: decide() keeps with frequency p(n); 100k streams per n (5 binomial standard deviations each).
TEST(Selection, MagicDecideFrequencies) {
  constexpr double kN = 100000;
  struct Case {
    double eps, delta;
    std::uint32_t k;
  };
  for (const auto& c : {Case{1.0, 0.01, 1}, Case{2.0, 0.05, 4}}) {
    const auto sel = Selection::magic(c.eps, c.delta, c.k);
    EXPECT_LE(sel.single_user_keep_bound(), sql::adjusted_delta(c.delta, c.k));
    EXPECT_LE(rel(sel.single_user_keep_bound(), sql::adjusted_delta(c.delta, c.k)), 1.01e-6);
    for (std::uint64_t n : {1, 2, 3, 4, 5, 6, 8, 12, 30}) {
      const double p = sql::magic_keep_probability(c.eps, c.delta, c.k, n);
      expect_binomial(keeps(sel, n, (n << 32) + std::uint64_t{c.k} * 1000000, kN), kN, p,
                      sel.describe() + ", n " + std::to_string(n));
    }
    EXPECT_EQ(keeps(sel, 1000, 0, 100), 100.0);  // p = 1
  }
}

TEST(Selection, PublicAndDescribe) {
  const auto pub = Selection::public_groups();
  Streams s;
  auto rng = s.at(1);
  const auto d = pub.decide(7, rng);
  EXPECT_TRUE(d.keep);
  EXPECT_EQ(d.noisy_count, 7);
  EXPECT_EQ(rng.blocks_used(), 0u);  // no randomness spent
  EXPECT_FALSE(pub.has_noisy_count());
  EXPECT_EQ(pub.describe(), "public: listed groups only, no noise");
  const auto lap = Selection::laplace(1.25, 1e-5, 5);
  EXPECT_TRUE(lap.has_noisy_count());
  EXPECT_EQ(lap.describe().rfind("laplace: b = 4, tau = ", 0), 0u) << lap.describe();
  EXPECT_EQ(Selection::gaussian(0.5, 1e-5, 1).describe().rfind("gaussian: sigma = 1, tau = 7 (P[keep | 1 user] <= ", 0),
            0u);
  EXPECT_EQ(Selection::magic(1, 1e-5, 1).describe().rfind("magic: eps' = 1, delta' = ", 0), 0u);
  EXPECT_FALSE(Selection::magic(1, 1e-5, 1).has_noisy_count());
}

TEST(Selection, ReportedThresholds) {
  // The values quoted in the report (docs/SQL.md), pinned: exact DLap / N_Z thresholds.
  for (const auto& sel :
       {Selection::laplace(1, 1e-5, 1), Selection::laplace(1, 1e-5, 5), Selection::gaussian(0.5, 1e-5, 1)})
    std::printf("%s\n", sel.describe().c_str());
  EXPECT_EQ(Selection::laplace(1, 1e-5, 1).threshold(), 13);
  EXPECT_EQ(Selection::laplace(1, 1e-5, 5).threshold(), 64);
  EXPECT_EQ(Selection::gaussian(0.5, 1e-5, 1).threshold(), 7);
}

// (f) Invalid parameters are refused with a message naming what to change.
TEST(Selection, InvalidParametersRefused) {
  const double nan = std::nan(""), inf = HUGE_VAL;
  for (double eps : {0.0, -1.0, nan, 2e6, inf}) {
    expect_refused([&] { Selection::laplace(eps, 1e-5, 1); }, {"epsilon", "(0, 1e6]"});
    expect_refused([&] { Selection::magic(eps, 1e-5, 1); }, {"epsilon"});
    expect_refused([&] { sql::laplace_threshold_continuous(eps, 1e-5, 1); }, {"epsilon"});
    expect_refused([&] { sql::magic_keep_probability(eps, 1e-5, 1, 1); }, {"epsilon"});
  }
  for (double delta : {0.0, 1.0, -0.1, nan, 1.5}) {
    expect_refused([&] { Selection::laplace(1, delta, 1); }, {"delta", "(0, 1)"});
    expect_refused([&] { Selection::gaussian(1, delta, 1); }, {"delta"});
    expect_refused([&] { Selection::magic(1, delta, 1); }, {"delta"});
    expect_refused([&] { sql::adjusted_delta(delta, 1); }, {"delta"});
  }
  for (std::uint32_t k : {0u, (1u << 20) + 1}) {
    expect_refused([&] { Selection::laplace(1, 1e-5, k); }, {"max_groups_contributed", "[1, 2^20]"});
    expect_refused([&] { Selection::gaussian(1, 1e-5, k); }, {"max_groups_contributed"});
    expect_refused([&] { Selection::magic(1, 1e-5, k); }, {"max_groups_contributed"});
  }
  for (double rho : {0.0, -1.0, nan, inf}) expect_refused([&] { Selection::gaussian(rho, 1e-5, 1); }, {"rho"});
  expect_refused([&] { Selection::laplace(1e-7, 1e-5, 1u << 20); }, {"epsilon is too small", "raise epsilon"});
  expect_refused([&] { Selection::gaussian(1e-20, 1e-5, 1); }, {"rho is too small", "raise epsilon"});
  expect_refused([&] { sql::gaussian_threshold_continuous(0, 1e-5, 1); }, {"sigma"});
  EXPECT_NO_THROW(Selection::laplace(1e6, 0.999, 1u << 20));            // the edges of the ranges are accepted
  EXPECT_NO_THROW(Selection::gaussian(std::ldexp(1.0, -49), 1e-5, 1));  // sigma = 2^24 exactly
}
