// Threshold failure of key selection (docs/PRIVACY.md section 6), measured on the real kernel:
// DpReleaser with the discrete Gaussian PRF noise, the Honaker prefix with its per-node rounding,
// and the thresholds of selection_thresholds (the code make_privacy_plan uses), at the noise scale of
// a real plan, with a fresh secret per trial.
//
// Setting: the engine A' of section 6, key selection without the gate. With mu = 0 the bar is tau_s;
// DpParams.mu = -1/2 with tau_s + 1/2 keeps that bar and tests every tracked key, including keys with
// NO data (0 users, 0 records). Such a key passes only by noise: every pass is a threshold failure.
// beta = 0.01: rates are measurable (about 1e-3 per test), and a threshold with a smaller tail
// correction than the proven one is caught (sqrt(ln(1/beta)) instead of sqrt(2 ln(1/beta)), or lambda_1
// instead of lambda_s at every step, pass more often than beta at this beta).
//
// Claims:
//  (a) per test: P[prefix noise at step s > tau_s] <= beta, at every step s = 1..T of a round. Measured
//      in round 0 with the thresholds of steps < s set to +1e30, so every key reaches step s;
//  (b) in a whole window with restarting rounds (a pass starts a new round, whose tree is fresh): among
//      the tests that reach step s, of round 0 (data-independent start) and of round 1 (its start depends
//      on round 0's noise), the pass rate is <= beta: reaching step s (no pass before) is a decreasing
//      event of the round's own node noises, a pass at s an increasing one, so by Harris-FKG the
//      condition can only lower the rate (section 6);
//  (c) the union bound that section 6 charges in delta: P[a key with no data passes at some trigger of
//      the window] <= T beta, and for the C keys of one user P[one of them does] <= C T beta.
// Sharper, to check the sampler, the Honaker numerators and the rounding and not only the bound: at
// s = 1, 2, 4, 8, 16 the prefix is one node of height j, whose noise numerator N_j (N_0 = Y,
// N_j = 2^j Y + N_left + N_right) has its exact distribution computed here from the discrete Gaussian
// pmf; the rate of (a) must match P[round(N_j 2^20 / (2^(j+1) - 1)) > tau_s 2^20] (two-sided), and the
// rates of (b) must not exceed it (one-sided). The same claims are checked for banded-inverse counters,
// whose prefix noise is exactly Gaussian: the exact pass probability is the Gaussian tail at every step.
//
// Statistics: every pass count is binomial given its number of tests (distinct keys are independent:
// distinct PRF nodes; within one key, (a) and (b) count at most one test per (round, step)). Each
// check is an exact binomial tail test at level kAlpha / kChecks: the whole file fails by chance with
// probability below kAlpha = 1e-6 when every claim holds.
#include <gtest/gtest.h>

#include <omp.h>
#include "tests/scoped_omp_threads.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/int128.hpp"
#include "common/record.hpp"
#include "kernels/dp_release.hpp"
#include "kernels/dp_tree.hpp"
#include "kernels/key_accumulate.hpp"
#include "kernels/noise.hpp"
#include "src/config.hpp"
#include "src/privacy_plan.hpp"

namespace dpstream {
namespace {

using kernels::DpParams;
using kernels::DpReleaser;
using kernels::DpStats;
using kernels::KeyStateTable;
using i128 = int128;  // common/int128.hpp

constexpr std::uint32_t kT = 16;   // triggers per window
constexpr std::uint32_t kC = 4;    // keys per user
constexpr double kBeta = 0.01;     // failure probability per test
constexpr double kAlpha = 1e-6;    // false-failure rate of the whole file
constexpr double kBlocked = 1e30;  // a threshold no noise reaches
constexpr std::int64_t kOne = std::int64_t{1} << kValueFracBits;
// Per counter, at most: (a) T steps vs beta + T exact; (b) 2 rounds x (T vs beta + T exact); (c) 2.
constexpr int kChecks = 2 * (kT + kT + 2 * (kT + kT) + 2);  // both counters, exact at every step (banded)
constexpr double kLevel = kAlpha / kChecks;

// ---------------------------------------------------------------------------------------------
// Exact binomial tails (sums of the pmf in log space; terms shrink geometrically away from the mode).

double log_binom_pmf(std::uint64_t n, std::uint64_t k, double p) {
  const auto nd = static_cast<double>(n), kd = static_cast<double>(k);
  // NOLINTNEXTLINE(concurrency-mt-unsafe): lgamma sets signgam; the test calls it from one thread
  return std::lgamma(nd + 1) - std::lgamma(kd + 1) - std::lgamma(nd - kd + 1) + kd * std::log(p) +
         (nd - kd) * std::log1p(-p);
}
// Sum of pmf(i) from i = from, moving away from the mode in direction step (+1 or -1).
double tail_sum(std::uint64_t n, std::uint64_t from, int step, double p) {
  long double total = 0;
  for (std::int64_t i = static_cast<std::int64_t>(from); i >= 0 && i <= static_cast<std::int64_t>(n); i += step) {
    const long double term = std::exp(static_cast<long double>(log_binom_pmf(n, static_cast<std::uint64_t>(i), p)));
    total += term;
    if (term < total * 1e-19L || term == 0) break;
  }
  return static_cast<double>(std::min<long double>(total, 1));
}
double binom_at_least(std::uint64_t n, std::uint64_t k, double p) {  // P[Bin(n, p) >= k]
  if (k == 0) return 1;
  if (k > n) return 0;
  if (static_cast<double>(k) > static_cast<double>(n) * p) return tail_sum(n, k, +1, p);
  return 1 - tail_sum(n, k - 1, -1, p);
}
double binom_at_most(std::uint64_t n, std::uint64_t k, double p) {  // P[Bin(n, p) <= k]
  if (k >= n) return 1;
  if (static_cast<double>(k) < static_cast<double>(n) * p) return tail_sum(n, k, -1, p);
  return 1 - tail_sum(n, k + 1, +1, p);
}

struct Rate {
  std::uint64_t passes = 0, tests = 0;
  double value() const { return tests ? static_cast<double>(passes) / static_cast<double>(tests) : 0.0; }
};

// The claim "rate <= bound" is rejected when P[Bin(tests, bound) >= passes] < kLevel.
void expect_at_most(const Rate& r, double bound, const std::string& what) {
  const double pvalue = binom_at_least(r.tests, r.passes, bound);
  EXPECT_GE(pvalue, kLevel) << what << ": " << r.passes << " passes in " << r.tests << " = " << r.value() << ", above "
                            << bound << " (one-sided binomial p-value " << pvalue << ")";
}
// "rate == p" is rejected when either tail is below kLevel / 2.
void expect_equal(const Rate& r, double p, const std::string& what) {
  const double lo = binom_at_most(r.tests, r.passes, p), hi = binom_at_least(r.tests, r.passes, p);
  EXPECT_GE(std::min(lo, hi), kLevel / 2) << what << ": " << r.passes << " passes in " << r.tests << " = " << r.value()
                                          << ", exact " << p << " (binomial tails " << lo << ", " << hi << ")";
}

// ---------------------------------------------------------------------------------------------
// Exact pass probability at s = 2^j: one node of height j, noise numerator N_j, estimate rounded to
// the 2^-20 grid per node; the kernel releases when NOT (noisy_users <= (mu + tau) 2^20) in double.

struct Pmf {  // P[X = offset + i] = p[i]
  std::int64_t offset = 0;
  std::vector<double> p;
};

Pmf discrete_gaussian_pmf(const noise::DiscreteGaussian& dg) {
  const long double s2 =
      std::ldexp(static_cast<long double>(dg.sigma2_num()), -dg.sigma2_exp());  // the sampler's sigma^2
  const auto ymax = static_cast<std::int64_t>(16 * dg.sigma()) + 2;             // tail < e^-128
  Pmf out{-ymax, std::vector<double>(static_cast<std::size_t>(2 * ymax + 1))};
  long double z = 0;
  std::vector<long double> w(out.p.size());
  for (std::int64_t y = -ymax; y <= ymax; ++y)
    z += w[static_cast<std::size_t>(y + ymax)] = std::exp(-static_cast<long double>(y * y) / (2 * s2));
  for (std::size_t i = 0; i < w.size(); ++i) out.p[i] = static_cast<double>(w[i] / z);
  return out;
}

// Distribution of m X + Y for independent X ~ a, Y ~ b.
Pmf scaled_convolution(const Pmf& a, std::int64_t m, const Pmf& b) {
  Pmf out{m * a.offset + b.offset,
          std::vector<double>(static_cast<std::size_t>(m) * (a.p.size() - 1) + b.p.size(), 0.0)};
  for (std::size_t i = 0; i < a.p.size(); ++i)
    for (std::size_t k = 0; k < b.p.size(); ++k) out.p[static_cast<std::size_t>(m) * i + k] += a.p[i] * b.p[k];
  return out;
}

// P[the prefix at s = 2^j passes the bar] from the exact distribution of N_j.
double exact_single_node_pass(const Pmf& y, std::uint32_t j, double bar) {
  Pmf n = y;
  for (std::uint32_t h = 1; h <= j; ++h) n = scaled_convolution(y, std::int64_t{1} << h, scaled_convolution(n, 1, n));
  const i128 den = (i128{1} << (j + 1)) - 1;  // odd: no ties
  double pass = 0;
  for (std::size_t i = 0; i < n.p.size(); ++i) {
    const i128 num = static_cast<i128>(n.offset + static_cast<std::int64_t>(i)) * kOne;
    i128 q = (2 * num + den) / (2 * den);  // nearest integer to num / den: floor((2 num + den) / (2 den))
    if ((2 * num + den) % (2 * den) != 0 && 2 * num + den < 0) --q;
    if (!(static_cast<double>(static_cast<std::int64_t>(q)) <= bar)) pass += n.p[i];
  }
  return pass;
}

// ---------------------------------------------------------------------------------------------

// The key-selection noise of a real plan: a parsed job at a realistic budget (sigma ~ 7 users).
PrivacyPlan real_plan(kernels::CounterKind counter) {
  const std::string toml = "[stream]\nwindow_seconds = 86400\ntriggers = " + std::to_string(kT) +
                           "\n[privacy]\nmode = \"dp\"\nmax_records_per_user = " + std::to_string(kC) +
                           "\nepsilon = 6.0\ndelta = 1e-9\nseed = 1\nselection_counter = \"" +
                           (counter == kernels::CounterKind::Banded ? "banded" : "tree") +
                           "\"\n[query]\naggregations = [\"count\"]\n";
  return make_privacy_plan(parse_job(toml, "test_threshold_failure", {}));
}

// A' with the bar tau_s (mu = 0); with only_step != 0 every other step's threshold is kBlocked. Only the
// selection tree draws noise (no released columns).
DpParams gate_off_params(double sigma, const std::vector<double>& tau, std::uint32_t only_step = 0,
                         const std::vector<std::int64_t>& band = {}) {
  DpParams p;
  if (!band.empty()) p.selection_counter = kernels::CounterKind::Banded, p.band = band;
  p.triggers = kT;
  p.mu = -0.5;
  p.tau.assign(kT + 1, 0.0);
  for (std::uint32_t s = 1; s <= kT; ++s) p.tau[s] = only_step != 0 && s != only_step ? kBlocked : tau[s] + 0.5;
  p.sigma_selection = sigma;
  p.release_count = p.release_sum = false;
  return p;
}

// One window's table of `keys` keys with no users and no records (ids 0..keys-1).
void no_data_keys(KeyStateTable& table, std::uint32_t keys) {
  table.clear();
  std::vector<KeyPartial> partials(keys);
  for (std::uint32_t k = 0; k < keys; ++k) partials[k] = KeyPartial{k, 0, 0, 0};
  table.accumulate(partials, KeyStateTable::Report::Nothing);
}

bool is_power_of_two(std::uint32_t s) { return std::has_single_bit(s); }

using dpstream::testing::ScopedOmpThreads;

// With banded counters (docs/PRIVACY.md section 5) the same claims, and the exact pass probability is
// the Gaussian tail at every step: the prefix noise is N(0, lambda_s^2), rounded to the 2^-20 grid.
void run_threshold_failure(kernels::CounterKind counter) {
  const bool banded = counter == kernels::CounterKind::Banded;
  const PrivacyPlan plan = real_plan(counter);
  const double sigma = plan.selection.sigma;
  const std::vector<std::int64_t> band = banded ? plan.band : std::vector<std::int64_t>{};
  const SelectionThresholds thr = banded ? banded_selection_thresholds(kernels::banded::BandedPlan(band, sigma), kBeta,
                                                                       kT, ThresholdTail::Subgaussian)
                                         : selection_thresholds(sigma, kBeta, kT, ThresholdTail::Subgaussian);
  std::vector<double> exact(kT + 1, -1);  // exact pass probability (tree: at single-node steps)
  if (banded) {
    for (std::uint32_t s = 1; s <= kT; ++s) {
      // passes iff round(2^20 N) > tau_s 2^20 (as a double), i.e. N > (floor(tau_s 2^20) + 1/2) 2^-20
      const double bar = (std::floor((-0.5 + (thr.tau[s] + 0.5)) * static_cast<double>(kOne)) + 0.5) / kOne;
      exact[s] = 0.5 * std::erfc(bar / (thr.lambda[s] * std::sqrt(2.0)));
      EXPECT_LE(exact[s], kBeta) << "step " << s << ": the proven bound fails for the exact distribution";
    }
  } else {
    const noise::DiscreteGaussian dg(sigma);
    ASSERT_EQ(dg.sigma(), sigma) << "the plan's sigma is the sampler's";
    const Pmf y = discrete_gaussian_pmf(dg);
    for (std::uint32_t s = 1; s <= kT; ++s)
      if (is_power_of_two(s)) {
        const double bar = (-0.5 + (thr.tau[s] + 0.5)) * static_cast<double>(kOne);  // as the kernel computes it
        exact[s] = exact_single_node_pass(y, static_cast<std::uint32_t>(std::countr_zero(s)), bar);
        ASSERT_GT(exact[s], 0.0);
        EXPECT_LE(exact[s], kBeta) << "step " << s << ": the proven bound fails for the exact distribution";
      }
  }
  std::printf("sigma_sel = %.4f, beta = %g, tail_z = %.4f, T = %u, C = %u, level per check %.2g\n", sigma, kBeta,
              thr.tail_z, kT, kC, kLevel);

  const ScopedOmpThreads one_thread(1);
  KeyStateTable table;
  DpStats stats;
  std::uint64_t seed = 1;

  // (a) Every step on its own: 50 secrets x 2 windows x 1000 keys = 1e5 tests per step.
  const std::uint32_t kKeysA = 1000, kSecretsA = 50, kWindowsA = 2;
  std::vector<Rate> step_rate(kT + 1);
  for (std::uint32_t s = 1; s <= kT; ++s) {
    const DpParams params = gate_off_params(sigma, thr.tau, s, band);
    for (std::uint32_t trial = 0; trial < kSecretsA; ++trial) {
      DpReleaser releaser(params, noise::secret_from_seed(seed++));
      for (std::uint32_t w = 0; w < kWindowsA; ++w) {
        releaser.begin_window(w);
        no_data_keys(table, kKeysA);
        for (std::uint32_t t = 0; t + 1 < s; ++t)
          ASSERT_TRUE(releaser.release(table, t, stats).empty()) << "blocked step passed";
        const std::uint64_t tested = stats.tested;
        step_rate[s].passes += releaser.release(table, s - 1, stats).size();
        ASSERT_EQ(stats.tested - tested, kKeysA) << "every no-data key is tested (gate off)";
        step_rate[s].tests += kKeysA;
      }
    }
  }

  // (b), (c) Whole windows: 50 secrets x 4 windows x 1000 keys = 2e5 key-windows, 3.2e6 tests.
  const std::uint32_t kKeysB = 1000, kSecretsB = 50, kWindowsB = 4;
  std::vector<std::vector<Rate>> round_rate(2, std::vector<Rate>(kT + 1));  // [round 0 / 1][step]
  Rate key_any, user_any, all_tests;
  const DpParams params = gate_off_params(sigma, thr.tau, 0, band);
  std::uint64_t later_rounds = 0;
  for (std::uint32_t trial = 0; trial < kSecretsB; ++trial) {
    DpReleaser releaser(params, noise::secret_from_seed(seed++));
    for (std::uint32_t w = 0; w < kWindowsB; ++w) {
      releaser.begin_window(w);
      no_data_keys(table, kKeysB);
      std::vector<std::uint32_t> round(kKeysB, 0), start(kKeysB, 0), passes(kKeysB, 0);  // the test's own bookkeeping
      for (std::uint32_t t = 0; t < kT; ++t) {
        const std::vector<KeyRelease> rel = releaser.release(table, t, stats);
        std::vector<bool> passed(kKeysB, false);
        for (const KeyRelease& r : rel) passed[r.key] = true;
        for (std::uint32_t k = 0; k < kKeysB; ++k) {
          const std::uint32_t step = t - start[k] + 1;
          if (round[k] < 2) {
            round_rate[round[k]][step].tests += 1;
            round_rate[round[k]][step].passes += passed[k];
          }
          all_tests.tests += 1;
          if (passed[k]) {
            all_tests.passes += 1;
            ++passes[k];
            ++round[k];
            start[k] = t + 1;
            later_rounds += round[k] >= 2;
          }
        }
      }
      // The kernel restarted exactly the rounds the test counted.
      table.for_each(
          [&](std::uint64_t key, const kernels::KeyState& st) { EXPECT_EQ(st.round, round[key]) << "key " << key; });
      for (std::uint32_t k = 0; k < kKeysB; ++k) key_any.passes += passes[k] > 0;
      key_any.tests += kKeysB;
      for (std::uint32_t u = 0; u + kC <= kKeysB; u += kC) {  // a user's C keys: disjoint groups of C keys
        bool any = false;
        for (std::uint32_t k = u; k < u + kC; ++k) any = any || passes[k] > 0;
        user_any.passes += any;
        user_any.tests += 1;
      }
    }
  }

  std::printf("step  exact     (a) alone             (b) round 0            (b) round 1\n");
  for (std::uint32_t s = 1; s <= kT; ++s) {
    const Rate& a = step_rate[s];
    const Rate& r0 = round_rate[0][s];
    const Rate& r1 = round_rate[1][s];
    std::printf("%4u  %-8s  %5llu/%-7llu %.5f  %5llu/%-7llu %.5f  %4llu/%-6llu %.5f\n", s,
                exact[s] >= 0 ? std::to_string(exact[s]).c_str() : "-", static_cast<unsigned long long>(a.passes),
                static_cast<unsigned long long>(a.tests), a.value(), static_cast<unsigned long long>(r0.passes),
                static_cast<unsigned long long>(r0.tests), r0.value(), static_cast<unsigned long long>(r1.passes),
                static_cast<unsigned long long>(r1.tests), r1.value());
  }
  std::printf(
      "all tests %.5f (%llu); P[key passes in window] %.5f <= T beta = %.2f; P[one of C keys] %.5f <= C T beta = "
      "%.2f\n",
      all_tests.value(), static_cast<unsigned long long>(all_tests.tests), key_any.value(), kT * kBeta,
      user_any.value(), kC * kT * kBeta);

  for (std::uint32_t s = 1; s <= kT; ++s) {
    const std::string at = "step " + std::to_string(s);
    expect_at_most(step_rate[s], kBeta, "(a) " + at + " alone");
    if (exact[s] >= 0) expect_equal(step_rate[s], exact[s], "(a) " + at + " alone vs exact");
    for (int r = 0; r < 2; ++r) {
      const std::string what = "(b) round " + std::to_string(r) + " " + at;
      expect_at_most(round_rate[r][s], kBeta, what);
      if (exact[s] >= 0) expect_at_most(round_rate[r][s], exact[s], what + " vs exact (unconditional)");
    }
  }
  expect_at_most(key_any, kT * kBeta, "(c) P[a no-data key passes in the window]");
  expect_at_most(user_any, kC * kT * kBeta, "(c) P[one of a user's C no-data keys passes in the window]");

  // Non-vacuity: the rates were measurable at every step (about 120 passes expected: a false failure below
  // 1e-20 each), and rounds restarted (round 1 reached step T / 2 in about 1700 key-windows, a second
  // restart happened in about 20).
  for (std::uint32_t s = 1; s <= kT; ++s) EXPECT_GT(step_rate[s].passes, 20u) << "step " << s;
  EXPECT_GT(round_rate[1][kT / 2].tests, 500u);
  EXPECT_GT(later_rounds, 0u);
}

TEST(ThresholdFailure, NoDataKeysPassAtMostBetaPerTestAndCTBetaPerWindow) {
  run_threshold_failure(kernels::CounterKind::Tree);
}

TEST(ThresholdFailure, BandedCountersToo) { run_threshold_failure(kernels::CounterKind::Banded); }

}  // namespace
}  // namespace dpstream
