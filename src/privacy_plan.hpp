// The privacy plan of a DP job: from (epsilon, delta, C, T, clamp, mu, beta, split, columns) to the
// noise of every tree family and the thresholds, with the accounting that justifies them
// (docs/PRIVACY.md). Computed without touching data; `dpstream budget` prints it.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels/baseline_release.hpp"
#include "kernels/dp_release.hpp"
#include "kernels/releaser.hpp"
#include "src/config.hpp"
#include "src/ledger.hpp"

namespace dpstream {

// One family of Gaussian trees, accounted in zCDP: rho = levels * sensitivity^2 / (2 sigma^2).
struct TreeFamily {
  std::string name;
  double sensitivity = 0;  // L2 per tree level of one user's contribution over all keys, in `unit`
  double sigma = 0;        // per-node noise standard deviation, in `unit`
  double rho = 0;
  std::string unit;
};

// The baselines of the core paper's section 5 (docs/PRIVACY.md section 8): one-shot queries with
// Gaussian thresholding (seed 003) at every trigger, on all data so far (repeated) or on the trigger's
// micro-batch (batch). `selection` and `aggregation` then hold the noise of one release.
struct BaselinePlan {
  double releases_composed = 0;  // zcdp: releases whose rho one user pays (T repeated, 1 batch); optimal: T
  double rho_total = 0;          // zcdp: the ledger over all releases
  double delta_conversion = 0;   // zcdp: rho -> eps; optimal: the composition's own delta
  double delta_threshold = 0;    // total probability that one of a user's keys passes only by noise
  double keys_per_user = 0;      // releases x keys in which one user may be a key's only user (T C or C)
  double tail = 0;               // per key and release: P[noise > tau - 1]
  double tau = 0;                // a key is released when users + noise > tau
  double eps0 = 0, delta0 = 0;   // optimal: one release's (eps, delta), composed T times
  double delta0_threshold = 0;   // optimal: the threshold part of delta0
};

struct PrivacyPlan {
  PrivacyMode mode = PrivacyMode::Dp;
  Composition composition = Composition::Zcdp;
  // Budget and its split (per window: the privacy unit is one user's records in one window).
  double epsilon = 0, delta = 0;
  double epsilon_selection = 0, delta_selection = 0;      // key selection: Gaussian conversion + beta term
  double epsilon_aggregation = 0, delta_aggregation = 0;  // hierarchical perturbation
  std::uint32_t C = 0, T = 0, levels = 0;
  // The counters (docs/PRIVACY.md section 5): trees, or banded-inverse counters of band `band`
  // (numerators of m_k on the 2^-30 grid) with ||C e_1||^2 = band_norm2 over T steps.
  CounterKind selection_counter = CounterKind::Tree, value_counter = CounterKind::Tree;
  std::vector<std::int64_t> band;
  double band_norm2 = 0;
  double mu = 0;
  bool mu_defaulted = false;
  // Threshold failure: beta per test, C * T tests that matter per user, charged (e^eps_sel + 1) C T beta.
  double beta = 0;
  bool beta_defaulted = false;
  double delta_beta = 0;
  double delta_selection_conversion = 0;  // delta_selection - delta_beta
  TreeFamily selection;
  std::vector<TreeFamily> aggregation;  // one per released column, sharing rho_aggregation
  double rho_aggregation = 0;
  double clamp_bound = 0;        // L = max |clamp| after rounding to the sum grid
  std::int64_t sum_quantum = 1;  // fixed-point units per sum noise unit
  double sum_sigma_quanta = 0;   // sum noise in grid units (what the sampler draws)
  double tail_z = 0;             // tau_s = lambda_s * tail_z + rounding margin
  std::vector<double> tau;       // tau[s], s = 1..T (tau[0] = 0, unused)
  std::vector<double> lambda;    // std of the Honaker prefix noise at round step s
  // Reported conversions.
  double eps_selection_tight = 0, eps_selection_simple = 0;
  double eps_aggregation_tight = 0, eps_aggregation_simple = 0;
  double eps_total = 0, delta_total = 0;  // basic composition of the two parts (what is guaranteed)
  bool private_run = true;                // false when [privacy] seed fixes the secret
  ThresholdTail threshold = ThresholdTail::Subgaussian;
  double rho_total = 0;   // composition = zcdp: the one ledger (selection + aggregation)
  BaselinePlan baseline;  // baseline modes only
};

// Key selection's thresholds (docs/PRIVACY.md section 6), index s = 1..T (index 0 unused):
// lambda_s = sigma sqrt(v_s), the std of a round's prefix noise at step s, and
// tau_s = lambda_s tail_z + popcount(s) 2^-20 with tail_z = sqrt(2 ln(1/beta)) (subgaussian, proven:
// P[prefix noise > tau_s] <= beta) or Phi^-1(1 - beta) (gaussian-quantile). No checks (the plan's).
struct SelectionThresholds {
  double tail_z = 0;
  std::vector<double> tau, lambda;
};
SelectionThresholds selection_thresholds(double sigma, double beta, std::uint32_t T, ThresholdTail tail);
// The same for banded-inverse counters: lambda_s = sigma sqrt(sum_{j<s} M_j^2), tau_s = lambda_s tail_z + 2^-20.
SelectionThresholds banded_selection_thresholds(const kernels::banded::BandedPlan& plan, double beta, std::uint32_t T,
                                                ThresholdTail tail);

// Throws ConfigError when the job is invalid for DP or would exceed its budget.
PrivacyPlan make_privacy_plan(const JobConfig& config);

// What the job costs each window it reads, for a budget ledger (src/ledger.hpp): under composition
// "zcdp", rho (every noise family it uses), the failure mass `coupled` that may occur on both
// neighbours (DP-SQLP: C T beta, charged (e^eps + 1) times at the block's eps) and `delta_extra` on
// one side only (the baselines' singleton keys); else only its (epsilon, delta). Both state what it
// guarantees alone.
struct LedgerCharge {
  bool zcdp = false;
  double rho = 0, delta_extra = 0, coupled = 0, epsilon = 0, delta = 0;
  std::string mechanism;
};
LedgerCharge ledger_charge(const PrivacyPlan& plan);
// A job's request to its [privacy] ledger: its charge on every window it reads, under `run_id`. Throws ConfigError for
// a job no ledger accounts: a seeded one (its output is not private) or one whose thresholds' failure bound is not
// proven. `run` charges it; `budget` asks whether the ledger would admit it now.
ledger::Request job_ledger_request(const JobConfig& config, const PrivacyPlan& plan, std::string run_id);
// Whether the thresholds' failure probability beta is a proven bound (subgaussian tail, or the exact
// Gaussian tail of banded key selection), not the paper's Gaussian-quantile approximation.
bool threshold_proven(const PrivacyPlan& plan);

// What the release kernel needs from the plan (noise scales, thresholds, columns).
kernels::DpParams release_params(const PrivacyPlan& plan);
kernels::BaselineParams baseline_params(const PrivacyPlan& plan);
// The release step of `mode` (exact for mode none, where `plan` is not read), its noise keyed by `secret`.
std::unique_ptr<kernels::Releaser> make_releaser(PrivacyMode mode, const PrivacyPlan& plan, const noise::Secret& secret,
                                                 kernels::KeyScan scan);

std::string budget_text(const PrivacyPlan& plan, bool thresholds_table);
nlohmann::json budget_json(const PrivacyPlan& plan, bool thresholds_table);

}  // namespace dpstream
