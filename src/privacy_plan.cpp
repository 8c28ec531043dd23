#include "src/privacy_plan.hpp"

#include <stdexcept>

#include <fmt/format.h>

#include <bit>
#include <cmath>
#include <utility>

#include "common/record.hpp"
#include "kernels/bounding.hpp"
#include "kernels/dp_tree.hpp"
#include "kernels/noise.hpp"
#include "src/accounting.hpp"
#include "src/errors.hpp"

namespace dpstream {

namespace {

constexpr double kMaxSamplerSigma = 16777216.0;    // 2^24: the exact sampler's range (kernels/noise.hpp)
constexpr double kMinSamplerSigma = 1.0 / 1024.0;  // 2^-10
constexpr double kSumGridSigma = 4194304.0;        // 2^22: sum noise is drawn on a grid with sigma <= this

// The sigma the sampler really uses (sigma^2 rounded up to its exact rational form).
double exact_sigma(const JobConfig& c, double sigma, const std::string& family) {
  if (!(sigma >= kMinSamplerSigma && sigma <= kMaxSamplerSigma))
    throw ConfigError(fmt::format(
        "{}: {} noise sigma = {:.6g} is outside the exact sampler's range [2^-10, 2^24]; {}", c.origin(), family, sigma,
        sigma > kMaxSamplerSigma ? "raise epsilon, lower max_records_per_user or narrow clamp_min/clamp_max"
                                 : "epsilon is so large that the noise vanishes; lower epsilon"));
  return noise::DiscreteGaussian::rounded_sigma(sigma);
}

// A banded counter's sigma (kernels/banded_counter.hpp): rounded up to a multiple of 2^-32.
double banded_sigma(const JobConfig& c, double sigma, const std::string& family) {
  if (!(sigma >= 0x1p-20 && sigma <= 0x1p30))
    throw ConfigError(fmt::format("{}: {} noise sigma = {:.6g} is outside the banded counter's range [2^-20, 2^30]; {}",
                                  c.origin(), family, sigma,
                                  sigma > 1 ? "raise epsilon, lower max_records_per_user or narrow clamp_min/clamp_max"
                                            : "epsilon is so large that the noise vanishes; lower epsilon"));
  return kernels::banded::BandedPlan({std::int64_t{1} << kernels::banded::kCoefBits}, sigma).sigma();
}

// A tree's noise numerators N_j = 2^j n + N_left + N_right are held in int64 (kernels/dp_tree.hpp):
// |N_j| <= (j + 1) 2^j max|n| with j < 21 (T <= 2^20) and max|n| <= 2^11 (sigma + 1) (the sampler's cut),
// so every sigma the sampler accepts keeps them below 2^60. Totals and released values are 128-bit
// (common/record.hpp): no job needs a data-dependent overflow check.
static_assert(21.0 * 0x1p20 * 0x1p11 * (kMaxSamplerSigma + 1.0) < 0x1p60);

// The released columns' noise: per tree level (one level for a baseline's one-shot release), one
// user's <= C records move a column by at most C * L_col in L2 over all keys (sum over keys of
// (c_k L)^2 <= (C L)^2); the m columns share rho_agg equally: sigma = C L sqrt(m levels / (2 rho_agg)).
// `levels` is the squared L2 norm of one unit's effect on one counter: levels(T) for a tree (one node
// per level), ||C e_1||^2 for a banded counter (section 5).
void add_aggregation_columns(const JobConfig& c, PrivacyPlan& p, double levels, double rho_agg) {
  const auto& pc = c.privacy;
  const int m = int{c.query.count} + int{c.query.sum};
  const bool banded = p.value_counter == CounterKind::Banded;
  auto sigma_for = [&](double per_record) { return p.C * per_record * std::sqrt(m * levels / (2.0 * rho_agg)); };
  auto rounded = [&](double sigma, const char* family) {
    return banded ? banded_sigma(c, sigma, family) : exact_sigma(c, sigma, family);
  };
  if (c.query.count) {
    TreeFamily f{"count", static_cast<double>(p.C), 0, 0, "records"};
    f.sigma = rounded(sigma_for(1.0), "count");
    f.rho = levels * f.sensitivity * f.sensitivity / (2.0 * f.sigma * f.sigma);
    p.aggregation.push_back(f);
  }
  if (c.query.sum) {
    auto bound_on_grid = [&](std::int64_t q) {
      const auto lo = kernels::quantize(to_fixed(pc.clamp_min), q), hi = kernels::quantize(to_fixed(pc.clamp_max), q);
      return from_fixed(std::max(std::llabs(lo), std::llabs(hi)));
    };
    p.clamp_bound = bound_on_grid(1);
    if (p.clamp_bound == 0)
      throw ConfigError(
          fmt::format("{}: [query] aggregations has \"sum\" but the clamp range [{}, {}] makes every sum 0; "
                      "widen clamp_min/clamp_max or release only [\"count\"]",
                      c.origin(), pc.clamp_min, pc.clamp_max));
    // Draw sum noise on the coarsest power-of-two grid that keeps sigma <= 2^22 grid steps; values
    // are rounded to that grid at bounding, and L is taken after rounding.
    const double sigma_fixed = sigma_for(p.clamp_bound) * kValueScale;
    while (sigma_fixed / static_cast<double>(p.sum_quantum) > kSumGridSigma) p.sum_quantum *= 2;
    p.clamp_bound = bound_on_grid(p.sum_quantum);
    const double quantum = static_cast<double>(p.sum_quantum) / kValueScale;
    if (p.clamp_bound == 0 || quantum > (pc.clamp_max - pc.clamp_min) / 100.0)
      throw ConfigError(
          fmt::format("{}: the sum noise needs a value grid of {:.6g}, coarser than 1% of the clamp range "
                      "[{}, {}]; narrow the range around the values, lower max_records_per_user, raise "
                      "epsilon, or release only [\"count\"]",
                      c.origin(), quantum, pc.clamp_min, pc.clamp_max));
    p.sum_sigma_quanta = rounded(sigma_for(p.clamp_bound) / quantum, "sum");
    TreeFamily f{"sum", p.C * p.clamp_bound, p.sum_sigma_quanta * quantum, 0, "value"};
    f.rho = levels * f.sensitivity * f.sensitivity / (2.0 * f.sigma * f.sigma);
    p.aggregation.push_back(f);
  }
}

// What every private mode's plan starts from: the job's budget, bound and stream.
PrivacyPlan plan_common(const JobConfig& c) {
  const auto& pc = c.privacy;
  PrivacyPlan p;
  p.mode = pc.mode;
  p.composition = pc.composition;
  p.epsilon = pc.epsilon;
  p.delta = pc.delta;
  p.C = pc.max_records_per_user;
  p.T = c.stream.triggers;
  p.threshold = pc.threshold;
  p.private_run = !pc.seed.has_value();
  return p;
}

// Baselines (docs/PRIVACY.md section 8). One release is a one-shot query: Gaussian thresholding of
// the key's user count (L2 sensitivity sqrt(C): a user counts once in each of <= C keys) and the
// columns' Gaussian noise (one tree level). Thresholding is delta-approximate zCDP (OpenDP's
// NoiseThresholdPrivacyMap): a key whose only user is the one added or removed passes with
// probability tail = P[noise > tau - 1]; conditioned on no such pass, the rest is rho-zCDP.
PrivacyPlan make_baseline_plan(const JobConfig& c) {
  const auto& pc = c.privacy;
  PrivacyPlan p = plan_common(c);
  p.levels = 1;
  const bool repeated = pc.mode == PrivacyMode::BaselineRepeated;
  auto& b = p.baseline;
  double rho_release = 0;  // one release's rho (selection + columns) in the worst case
  if (pc.composition == Composition::Zcdp) {
    // Repeated: the user is in all T releases with up to C records each: T rho_release. Batch: the
    // user's <= C records are spread over the batches (c_t in batch t, k_t <= c_t keys), and the
    // releases are independent, so the Renyi divergences add to sum_t (k_t / 2 s_sel^2 + c_t^2 / 2 s^2)
    // <= C / 2 s_sel^2 + C^2 / 2 s^2: one release's rho; likewise <= C (batch, key) pairs can pass alone.
    b.releases_composed = repeated ? p.T : 1;
    b.keys_per_user = repeated ? static_cast<double>(p.T) * p.C : p.C;
    b.delta_threshold = p.delta * pc.selection_delta_share;
    b.delta_conversion = p.delta - b.delta_threshold;
    b.rho_total = accounting::zcdp_rho_tight(p.epsilon, b.delta_conversion);
    rho_release = b.rho_total / b.releases_composed;
    b.tail = b.delta_threshold / b.keys_per_user;
  } else {
    // The paper's accounting: every release is (eps0, delta0)-DP with the worst-case sensitivity, and
    // T of them compose by the optimal composition theorem; half of delta goes to 1 - (1 - delta0)^T.
    b.releases_composed = p.T;
    b.keys_per_user = static_cast<double>(p.T) * p.C;
    b.delta0 = -std::expm1(std::log1p(-p.delta / 2.0) / p.T);
    try {
      b.eps0 = accounting::optimal_composition_eps0(p.epsilon, p.delta, b.delta0, p.T);
    } catch (const std::invalid_argument& e) {
      throw ConfigError(
          fmt::format("{}: [privacy] composition = \"optimal\" cannot split (eps {}, delta {}) over T = {} "
                      "releases ({}); raise epsilon or delta, or use composition = \"zcdp\"",
                      c.origin(), p.epsilon, p.delta, p.T, e.what()));
    }
    b.delta0_threshold = b.delta0 * pc.selection_delta_share;
    b.delta_conversion = b.delta0 - b.delta0_threshold;
    rho_release = accounting::zcdp_rho_tight(b.eps0, b.delta_conversion);
    b.tail = b.delta0_threshold / p.C;
    b.delta_threshold = b.delta0_threshold * p.T;
  }
  const double rho_sel = rho_release * pc.selection_epsilon_share;
  p.rho_aggregation = rho_release - rho_sel;
  p.selection = {"threshold", std::sqrt(static_cast<double>(p.C)), 0, 0, "users"};
  p.selection.sigma = exact_sigma(c, std::sqrt(p.C / (2.0 * rho_sel)), "threshold");
  p.selection.rho = p.C / (2.0 * p.selection.sigma * p.selection.sigma);
  add_aggregation_columns(c, p, 1, p.rho_aggregation);

  // The noisy user count is an integer: a key whose only user is this one passes when N > tau - 1.
  p.tail_z = pc.threshold == ThresholdTail::Subgaussian ? std::sqrt(2.0 * std::log(1.0 / b.tail))
                                                        : accounting::normal_upper_quantile(b.tail);
  b.tau = 1.0 + p.selection.sigma * p.tail_z;
  if (!std::isfinite(b.tau))
    throw ConfigError(fmt::format("{}: the baseline's threshold is not finite; raise delta", c.origin()));
  p.tau.assign(p.T + 1, b.tau);
  p.lambda.assign(p.T + 1, p.selection.sigma);
  p.mu = 0;

  double rho_used = p.selection.rho;
  for (const auto& f : p.aggregation) rho_used += f.rho;
  if (pc.composition == Composition::Zcdp) {
    p.eps_total = accounting::zcdp_eps_tight(rho_used * b.releases_composed, b.delta_conversion);
    p.delta_total = b.delta_conversion + b.delta_threshold;
  } else {
    const double eps0_used = accounting::zcdp_eps_tight(rho_used, b.delta_conversion);
    p.eps_total = p.epsilon;
    p.delta_total =
        accounting::optimal_composition_delta(eps0_used, b.delta_conversion + b.delta0_threshold, p.T, p.epsilon);
  }
  p.rho_total = rho_used * b.releases_composed;
  if (p.eps_total > p.epsilon * (1 + 1e-9) || p.delta_total > p.delta * (1 + 1e-9))
    throw ConfigError(
        fmt::format("{}: the plan spends (eps {:.6g}, delta {:.3g}), over the budget (eps {}, delta {}); "
                    "this is a bug, please report it",
                    c.origin(), p.eps_total, p.delta_total, p.epsilon, p.delta));
  return p;
}

}  // namespace

namespace {
// tau_s = lambda_s tail_z + margin_s, s = 1..T, from std_and_margin(s) = {lambda_s, margin_s}.
template <class StdAndMargin>
SelectionThresholds thresholds_from(double beta, std::uint32_t T, ThresholdTail tail, StdAndMargin&& std_and_margin) {
  SelectionThresholds t;
  t.tail_z = tail == ThresholdTail::Subgaussian ? std::sqrt(2.0 * std::log(1.0 / beta))
                                                : accounting::normal_upper_quantile(beta);
  t.tau.assign(T + 1, 0.0);
  t.lambda.assign(T + 1, 0.0);
  for (std::uint32_t s = 1; s <= T; ++s) {
    const auto [lambda, margin] = std_and_margin(s);
    t.lambda[s] = lambda;
    t.tau[s] = lambda * t.tail_z + margin;
  }
  return t;
}
}  // namespace

// The round's Honaker prefix at step s has noise std lambda_s = sigma sqrt(v_s); each of its
// popcount(s) nodes is rounded to the 2^-20 grid (at most half a step each; a full step is added).
SelectionThresholds selection_thresholds(double sigma, double beta, std::uint32_t T, ThresholdTail tail) {
  return thresholds_from(beta, T, tail, [&](std::uint32_t s) {
    return std::pair{sigma * std::sqrt(kernels::dptree::prefix_variance_factor(s)), std::popcount(s) / kValueScale};
  });
}

// The banded counter's prefix at step s has noise std lambda_s = sigma sqrt(sum_{j<s} M_j^2), exactly
// Gaussian, rounded once to the 2^-20 grid (at most half a step; a full step is added).
SelectionThresholds banded_selection_thresholds(const kernels::banded::BandedPlan& plan, double beta, std::uint32_t T,
                                                ThresholdTail tail) {
  if (!plan.monotone())  // docs/PRIVACY.md section 6: the union bound needs a non-decreasing prefix noise
    throw std::invalid_argument("banded key selection needs a band whose partial sums are all >= 0");
  return thresholds_from(beta, T, tail, [&](std::uint32_t s) {
    return std::pair{plan.sigma() * std::sqrt(plan.variance_factor(s)), 1.0 / kValueScale};
  });
}

bool threshold_proven(const PrivacyPlan& p) {
  return p.threshold == ThresholdTail::Subgaussian ||
         (!is_baseline(p.mode) && p.selection_counter == CounterKind::Banded);
}

ledger::Request job_ledger_request(const JobConfig& config, const PrivacyPlan& plan, std::string run_id) {
  if (!plan.private_run)
    throw ConfigError(
        fmt::format("ledger {}: [privacy] seed makes this run a test whose output is not private (two "
                    "seeded jobs may share noise); a ledger accounts private releases: remove seed "
                    "or the ledger",
                    config.privacy.ledger));
  if (!threshold_proven(plan))
    throw ConfigError(
        fmt::format("ledger {}: threshold = \"gaussian-quantile\" with tree key selection has no "
                    "proven failure probability to charge: use threshold = \"subgaussian\" or "
                    "selection_counter = \"banded\"",
                    config.privacy.ledger));
  const LedgerCharge charge = ledger_charge(plan);
  ledger::Request request{.run_id = std::move(run_id),
                          .job = config.name,
                          .mechanism = charge.mechanism,
                          .zcdp = charge.zcdp,
                          .rho = charge.rho,
                          .delta_extra = charge.delta_extra,
                          .coupled = charge.coupled,
                          .epsilon = charge.epsilon,
                          .delta = charge.delta,
                          .blocks = {}};
  for (std::uint32_t w = 0; w < config.stream.windows; ++w) request.blocks.push_back(config.stream.first_window + w);
  return request;
}

LedgerCharge ledger_charge(const PrivacyPlan& p) {
  LedgerCharge charge;
  charge.zcdp = p.composition == Composition::Zcdp;
  charge.epsilon = p.eps_total;
  charge.delta = p.delta_total;
  double rho_used = p.selection.rho;
  for (const auto& f : p.aggregation) rho_used += f.rho;
  if (is_baseline(p.mode)) {
    charge.rho = rho_used * p.baseline.releases_composed;  // one user pays this many releases
    charge.delta_extra = p.baseline.delta_threshold;
    charge.mechanism =
        fmt::format("{}, composition {}, T = {}, C = {}", to_string(p.mode), to_string(p.composition), p.T, p.C);
  } else {
    charge.rho = rho_used;
    charge.coupled = static_cast<double>(p.C) * p.T * p.beta;  // delta_beta = (e^eps + 1) C T beta
    charge.mechanism =
        fmt::format("dp (DP-SQLP), composition {}, counters {}/{}, T = {}, C = {}", to_string(p.composition),
                    to_string(p.selection_counter), to_string(p.value_counter), p.T, p.C);
  }
  if (!charge.zcdp) charge.rho = charge.delta_extra = charge.coupled = 0;
  return charge;
}

PrivacyPlan make_privacy_plan(const JobConfig& c) {
  const auto& pc = c.privacy;
  if (!is_private(pc.mode))
    throw ConfigError(
        fmt::format("{}: [privacy] mode is \"none\": there is no privacy budget; set mode = \"dp\"", c.origin()));
  if (is_baseline(pc.mode)) return make_baseline_plan(c);
  PrivacyPlan p = plan_common(c);
  const bool one_ledger = pc.composition == Composition::Zcdp;
  p.levels = kernels::dptree::levels(p.T);
  p.selection_counter = pc.selection_counter;
  p.value_counter = pc.value_counter;
  if (p.selection_counter == CounterKind::Banded || p.value_counter == CounterKind::Banded) {
    p.band = kernels::banded::optimized_band(p.T, pc.counter_band);
    p.band_norm2 = kernels::banded::sensitivity_squared(p.band, p.T);
  }
  p.epsilon_selection = p.epsilon * pc.selection_epsilon_share;
  p.epsilon_aggregation = p.epsilon - p.epsilon_selection;
  p.delta_selection = p.delta * pc.selection_delta_share;
  p.delta_aggregation = p.delta - p.delta_selection;

  // Theorem 3.1 charges (e^eps + 1) * P[some test of a user's key errs by more than tau], with the
  // eps of the mechanism without thresholds (key selection alone, or everything under one ledger);
  // a user touches <= C keys and each key is tested <= T times per window: union bound C T beta.
  const double tests = static_cast<double>(p.C) * p.T;
  const double beta_cost = (std::exp(one_ledger ? p.epsilon : p.epsilon_selection) + 1.0) * tests;
  if (!std::isfinite(beta_cost))
    throw ConfigError(
        fmt::format("{}: [privacy] epsilon = {} is too large to account: the key-selection failure term "
                    "(e^eps_sel + 1) C T beta leaves no usable beta; use a smaller epsilon",
                    c.origin(), p.epsilon));
  if (!(p.delta_selection / beta_cost >= 1e-300))  // both make it: a tiny delta or a large (finite) e^eps
    throw ConfigError(fmt::format(
        "{}: [privacy] delta = {} with epsilon = {} leaves no usable beta: key selection's share of delta ({:.3g}) "
        "over the failure term's (e^eps_sel + 1) C T = {:.3g} is below 1e-300; use a larger delta or a smaller "
        "epsilon",
        c.origin(), p.delta, p.epsilon, p.delta_selection, beta_cost));
  p.beta_defaulted = !pc.beta.has_value();
  p.beta = pc.beta ? *pc.beta : p.delta_selection / (2.0 * beta_cost);  // default: half of selection's delta
  p.delta_beta = beta_cost * p.beta;
  p.delta_selection_conversion = p.delta_selection - p.delta_beta;
  if (!(p.delta_selection_conversion > 0))
    throw ConfigError(fmt::format(
        "{}: [privacy] beta = {:.3g} costs (e^eps_sel + 1) * C * T * beta = {:.3g} of delta, at least key selection's "
        "share {:.3g}; set beta below {:.3g} (or remove it: the default is {:.3g})",
        c.origin(), p.beta, p.delta_beta, p.delta_selection, p.delta_selection / beta_cost,
        p.delta_selection / (2.0 * beta_cost)));

  // Key selection: a user adds 1 to one leaf of one round tree of each of <= C keys, so per tree
  // level the L2 sensitivity is sqrt(C); rho = levels * C / (2 sigma^2).
  // One ledger: rho = rho(eps, delta - delta_beta), split by selection_epsilon_share; basic: each part's
  // own (eps, delta) converted separately (the paper's split).
  if (one_ledger) {
    p.rho_total = accounting::zcdp_rho_tight(p.epsilon, p.delta - p.delta_beta);
    p.rho_aggregation = p.rho_total * (1.0 - pc.selection_epsilon_share);
  } else {
    p.rho_aggregation = accounting::zcdp_rho_tight(p.epsilon_aggregation, p.delta_aggregation);
  }
  const double rho_sel = one_ledger ? p.rho_total * pc.selection_epsilon_share
                                    : accounting::zcdp_rho_tight(p.epsilon_selection, p.delta_selection_conversion);
  // A banded counter: one unit at any step moves C x by a column of C, of squared norm <= ||C e_1||^2.
  const double sel_norm2 = p.selection_counter == CounterKind::Banded ? p.band_norm2 : p.levels;
  const double value_norm2 = p.value_counter == CounterKind::Banded ? p.band_norm2 : p.levels;
  p.selection = {"key_selection", std::sqrt(static_cast<double>(p.C)), 0, 0, "users"};
  const double sigma_sel = std::sqrt(sel_norm2 * p.C / (2.0 * rho_sel));
  p.selection.sigma = p.selection_counter == CounterKind::Banded ? banded_sigma(c, sigma_sel, "key-selection")
                                                                 : exact_sigma(c, sigma_sel, "key-selection");
  p.selection.rho = sel_norm2 * p.C / (2.0 * p.selection.sigma * p.selection.sigma);

  add_aggregation_columns(c, p, value_norm2, p.rho_aggregation);

  const SelectionThresholds thresholds =
      p.selection_counter == CounterKind::Banded
          ? banded_selection_thresholds(kernels::banded::BandedPlan(p.band, p.selection.sigma), p.beta, p.T,
                                        pc.threshold)
          : selection_thresholds(p.selection.sigma, p.beta, p.T, pc.threshold);
  p.tail_z = thresholds.tail_z;
  p.tau = thresholds.tau;
  p.lambda = thresholds.lambda;
  if (!std::isfinite(p.tail_z) || !std::isfinite(p.tau[p.T]))
    throw ConfigError(
        fmt::format("{}: [privacy] beta = {:.3g} is too small for a finite threshold; raise beta or lower epsilon",
                    c.origin(), p.beta));
  // Default mu = floor(min tau / 24): the bar mu + tau sits 4% above tau, while keys with <= mu users
  // in their round (most of the long tail) skip their noise entirely. Measured on the paper's
  // workload (docs/EVALUATION.md): tau / 4 released 10% fewer keys; mu = 0 costs 9x the draws.
  p.mu_defaulted = !pc.mu.has_value();
  p.mu = pc.mu ? *pc.mu : std::floor(*std::min_element(p.tau.begin() + 1, p.tau.end()) / 24.0);

  // Report: each part by the tight and the simple conversion; the total by basic composition.
  double rho_agg_used = 0;
  for (const auto& f : p.aggregation) rho_agg_used += f.rho;
  p.eps_selection_tight = accounting::zcdp_eps_tight(p.selection.rho, p.delta_selection_conversion);
  p.eps_selection_simple = accounting::zcdp_eps_simple(p.selection.rho, p.delta_selection_conversion);
  p.eps_aggregation_tight = accounting::zcdp_eps_tight(rho_agg_used, p.delta_aggregation);
  p.eps_aggregation_simple = accounting::zcdp_eps_simple(rho_agg_used, p.delta_aggregation);
  if (one_ledger) {
    p.eps_total = accounting::zcdp_eps_tight(p.selection.rho + rho_agg_used, p.delta - p.delta_beta);
    p.delta_total = (p.delta - p.delta_beta) + p.delta_beta;
  } else {
    p.eps_total = p.eps_selection_tight + p.eps_aggregation_tight;
    p.delta_total = p.delta_selection_conversion + p.delta_beta + p.delta_aggregation;
  }
  if (p.eps_total > p.epsilon * (1 + 1e-9) || p.delta_total > p.delta * (1 + 1e-9))
    throw ConfigError(
        fmt::format("{}: the plan spends (eps {:.6g}, delta {:.3g}), over the budget (eps {}, delta {}); "
                    "this is a bug, please report it",
                    c.origin(), p.eps_total, p.delta_total, p.epsilon, p.delta));
  return p;
}

namespace {
// The released columns' noise, as both release kernels take it.
template <class Params>
void set_column_noise(const PrivacyPlan& p, Params& params) {
  params.release_count = params.release_sum = false;
  for (const auto& f : p.aggregation) {
    if (f.name == "count") {
      params.release_count = true;
      params.sigma_count = f.sigma;
    }
    if (f.name == "sum") params.release_sum = true;
  }
  params.sigma_sum = p.sum_sigma_quanta;
  params.sum_quantum = p.sum_quantum;
}
}  // namespace

kernels::BaselineParams baseline_params(const PrivacyPlan& p) {
  kernels::BaselineParams params;
  params.tau = p.baseline.tau;
  params.sigma_selection = p.selection.sigma;
  set_column_noise(p, params);
  return params;
}

kernels::DpParams release_params(const PrivacyPlan& p) {
  kernels::DpParams params;
  params.triggers = p.T;
  params.mu = p.mu;
  params.tau = p.tau;
  params.sigma_selection = p.selection.sigma;
  params.selection_counter = p.selection_counter;
  params.value_counter = p.value_counter;
  params.band = p.band;
  set_column_noise(p, params);
  return params;
}

std::unique_ptr<kernels::Releaser> make_releaser(PrivacyMode mode, const PrivacyPlan& plan, const noise::Secret& secret,
                                                 kernels::KeyScan scan) {
  switch (mode) {
    case PrivacyMode::None:
      return kernels::make_exact_releaser();
    case PrivacyMode::Dp:
      return kernels::make_dp_sqlp_releaser(release_params(plan), secret, scan);
    case PrivacyMode::BaselineRepeated:
      return kernels::make_baseline_releaser(baseline_params(plan), secret, true);
    case PrivacyMode::BaselineBatch:
      return kernels::make_baseline_releaser(baseline_params(plan), secret, false);
  }
  throw std::logic_error("make_releaser: unknown privacy mode");
}

namespace {
nlohmann::json family_json(const TreeFamily& f) {
  return nlohmann::json{{"name", f.name},
                        {"unit", f.unit},
                        {"l2_sensitivity_per_level", f.sensitivity},
                        {"sigma", f.sigma},
                        {"rho", f.rho}};
}

nlohmann::json baseline_json(const PrivacyPlan& p) {
  const auto& b = p.baseline;
  nlohmann::json j;
  j["budget"] = {{"epsilon", p.epsilon}, {"delta", p.delta}, {"unit", "one user's records in one window"}};
  j["mode"] = to_string(p.mode);
  j["composition"] = to_string(p.composition);
  j["private"] = p.private_run;
  j["threshold_proven"] = threshold_proven(p);
  j["releases"] = {{"triggers", p.T}, {"releases_composed", b.releases_composed}, {"C", p.C}};
  j["per_release"] = {{"rho", p.selection.rho + p.rho_aggregation}, {"eps0", b.eps0}, {"delta0", b.delta0}};
  nlohmann::json fams = nlohmann::json::array();
  for (const auto& f : p.aggregation) fams.push_back(family_json(f));
  j["threshold"] = {{"noise", family_json(p.selection)},
                    {"tau", b.tau},
                    {"tail_per_key", b.tail},
                    {"keys_per_user", b.keys_per_user},
                    {"delta", b.delta_threshold},
                    {"tail_z", p.tail_z},
                    {"threshold_tail", to_string(p.threshold)}};
  j["aggregation"] = {{"columns", fams},
                      {"sum_grid", static_cast<double>(p.sum_quantum) / kValueScale},
                      {"clamp_bound", p.clamp_bound}};
  j["total"] = {{"epsilon", p.eps_total},
                {"delta", p.delta_total},
                {"within_budget", true},
                {"rho", p.rho_total},
                {"delta_conversion", b.delta_conversion},
                {"composition", p.composition == Composition::Zcdp
                                    ? "zCDP over all releases, converted once (CKS 2020)"
                                    : "optimal composition of T (eps0, delta0) releases (KOV 2015)"}};
  return j;
}

std::string baseline_text(const PrivacyPlan& p) {
  const auto& b = p.baseline;
  std::string s;
  auto line = [&](const std::string& t) { s += t + "\n"; };
  line(fmt::format(
      "privacy budget per window: epsilon = {}, delta = {} (user-level: all of one user's records in a window)",
      p.epsilon, p.delta));
  if (!p.private_run) line("WARNING: [privacy] seed fixes the noise secret: test mode, the output is NOT private");
  if (p.threshold != ThresholdTail::Subgaussian)
    line(
        "WARNING: threshold = \"gaussian-quantile\" assumes the Gaussian tail bounds the discrete noise's, which is "
        "not proven (docs/PRIVACY.md section 6)");
  line(fmt::format("mode {}: a one-shot query with Gaussian thresholding at each of T = {} triggers, C = {}",
                   to_string(p.mode), p.T, p.C));
  if (p.composition == Composition::Zcdp)
    line(fmt::format(
        "composition     zcdp: rho = {:.6g} in total, a user pays {} release(s)' rho; converted once with delta {:.4g}",
        b.rho_total, b.releases_composed, b.delta_conversion));
  else
    line(fmt::format(
        "composition     optimal (KOV 2015): T = {} releases of (eps0 {:.6g}, delta0 {:.4g}); eps0 from one "
        "release's rho by the tight conversion",
        p.T, b.eps0, b.delta0));
  line(fmt::format("  per release   rho = {:.6g} (threshold {:.6g} + columns {:.6g})",
                   p.selection.rho + p.rho_aggregation, p.selection.rho, p.rho_aggregation));
  line(fmt::format(
      "threshold       sigma = {:.6g} users, L2 sensitivity sqrt(C) = {:.6g}; tau = 1 + sigma * {:.6g} = {:.6g}",
      p.selection.sigma, p.selection.sensitivity, p.tail_z, b.tau));
  line(fmt::format("  delta         {:.4g} = {:.4g} keys-and-releases per user x tail {:.4g} per key and release",
                   b.delta_threshold, b.keys_per_user, b.tail));
  for (const auto& f : p.aggregation)
    line(fmt::format("  {:<13} sigma = {:.6g} {} per release, L2 sensitivity {:.6g}, rho = {:.6g}", f.name, f.sigma,
                     f.unit, f.sensitivity, f.rho));
  line(fmt::format("total           eps {:.6g} <= {}, delta {:.4g} <= {:.4g}: within budget", p.eps_total, p.epsilon,
                   p.delta_total, p.delta));
  return s;
}
}  // namespace

nlohmann::json budget_json(const PrivacyPlan& p, bool thresholds_table) {
  if (is_baseline(p.mode)) return baseline_json(p);
  auto family = family_json;
  nlohmann::json j;
  j["budget"] = {{"epsilon", p.epsilon}, {"delta", p.delta}, {"unit", "one user's records in one window"}};
  j["mode"] = "dp";
  j["composition"] = to_string(p.composition);
  j["private"] = p.private_run;
  j["threshold_proven"] = threshold_proven(p);
  j["trees"] = {{"triggers", p.T}, {"levels", p.levels}};
  nlohmann::json band = nlohmann::json::array();
  for (const std::int64_t m : p.band) band.push_back(std::ldexp(static_cast<double>(m), -kernels::banded::kCoefBits));
  j["counters"] = {{"selection", to_string(p.selection_counter)},
                   {"values", to_string(p.value_counter)},
                   {"band", band},
                   {"band_sensitivity_squared", p.band_norm2}};
  j["key_selection"] = {{"epsilon", p.epsilon_selection},
                        {"delta", p.delta_selection},
                        {"delta_conversion", p.delta_selection_conversion},
                        {"delta_beta", p.delta_beta},
                        {"beta_per_test", p.beta},
                        {"beta_defaulted", p.beta_defaulted},
                        {"mu", p.mu},
                        {"mu_defaulted", p.mu_defaulted},
                        {"tree", family(p.selection)},
                        {"eps_tight", p.eps_selection_tight},
                        {"eps_simple", p.eps_selection_simple},
                        {"threshold_tail", to_string(p.threshold)},
                        {"tail_z", p.tail_z},
                        {"tau_first", p.tau[1]},
                        {"tau_max", *std::max_element(p.tau.begin() + 1, p.tau.end())},
                        {"tau_last", p.tau[p.T]}};
  if (thresholds_table) {
    nlohmann::json rows = nlohmann::json::array();
    for (std::uint32_t s = 1; s <= p.T; ++s) rows.push_back({{"step", s}, {"lambda", p.lambda[s]}, {"tau", p.tau[s]}});
    j["key_selection"]["thresholds"] = rows;
  }
  nlohmann::json fams = nlohmann::json::array();
  for (const auto& f : p.aggregation) fams.push_back(family(f));
  j["aggregation"] = {{"epsilon", p.epsilon_aggregation},
                      {"delta", p.delta_aggregation},
                      {"rho", p.rho_aggregation},
                      {"columns", fams},
                      {"eps_tight", p.eps_aggregation_tight},
                      {"eps_simple", p.eps_aggregation_simple},
                      {"sum_grid", static_cast<double>(p.sum_quantum) / kValueScale},
                      {"clamp_bound", p.clamp_bound}};
  j["total"] = {{"epsilon", p.eps_total},
                {"delta", p.delta_total},
                {"within_budget", true},
                {"rho", p.rho_total},
                {"composition", p.composition == Composition::Zcdp
                                    ? "zCDP: one ledger for key selection and aggregation, converted once (CKS 2020)"
                                    : "basic (key selection + aggregation)"}};
  return j;
}

std::string budget_text(const PrivacyPlan& p, bool thresholds_table) {
  if (is_baseline(p.mode)) return baseline_text(p);
  std::string s;
  auto line = [&](const std::string& t) { s += t + "\n"; };
  line(fmt::format(
      "privacy budget per window: epsilon = {}, delta = {} (user-level: all of one user's records in a window)",
      p.epsilon, p.delta));
  if (!p.private_run) line("WARNING: [privacy] seed fixes the noise secret: test mode, the output is NOT private");
  const bool banded_sel = p.selection_counter == CounterKind::Banded;
  const bool banded_values = p.value_counter == CounterKind::Banded;
  if (p.threshold != ThresholdTail::Subgaussian && !banded_sel)
    line(
        "WARNING: threshold = \"gaussian-quantile\" is the paper's approximation; the delta below assumes it bounds "
        "the discrete noise's tail, which is not proven (docs/PRIVACY.md section 6)");
  if (!banded_sel && !banded_values)
    line(fmt::format("mode dp (DP-SQLP), composition {}; trees: T = {} triggers, {} levels (floor(log2 T) + 1), C = {}",
                     to_string(p.composition), p.T, p.levels, p.C));
  else
    line(
        fmt::format("mode dp (DP-SQLP), composition {}; counters: key selection {}, values {}; T = {} triggers, C = {}",
                    to_string(p.composition), to_string(p.selection_counter), to_string(p.value_counter), p.T, p.C));
  if (banded_sel != banded_values)
    line(fmt::format("tree            {} levels (floor(log2 T) + 1): one unit moves one node per level", p.levels));
  if (banded_sel || banded_values) {
    std::string band;
    for (const std::int64_t m : p.band)
      band += fmt::format("{}{:.6g}", band.empty() ? "" : ", ",
                          std::ldexp(static_cast<double>(m), -kernels::banded::kCoefBits));
    line(fmt::format("banded          band m = ({}) of C^-1; ||C e_1||^2 = {:.6g} over T steps (exact normal noise)",
                     band, p.band_norm2));
  }
  line("");
  if (p.composition == Composition::Zcdp)
    line(fmt::format(
        "composition     zcdp: rho = {:.6g} = rho(eps, delta - beta term {:.4g}), shared by key selection ({:.6g}) "
        "and aggregation ({:.6g})",
        p.rho_total, p.delta_beta, p.selection.rho, p.rho_aggregation));
  line(fmt::format("key selection   eps {:.6g}, delta {:.4g} = {:.4g} (Gaussian conversion) + {:.4g} (beta term)",
                   p.epsilon_selection, p.delta_selection, p.delta_selection_conversion, p.delta_beta));
  if (banded_sel)
    line(fmt::format(
        "  banded        sigma = {:.6g} users per step, L2 sensitivity sqrt(C) ||C e_1|| = {:.6g}, rho = {:.6g}",
        p.selection.sigma, p.selection.sensitivity * std::sqrt(p.band_norm2), p.selection.rho));
  else
    line(fmt::format(
        "  tree          sigma = {:.6g} users per node, L2 sensitivity sqrt(C) = {:.6g} per level, rho = {:.6g}",
        p.selection.sigma, p.selection.sensitivity, p.selection.rho));
  line(fmt::format("  eps           {:.6g} tight (CKS 2020), {:.6g} simple (rho + 2 sqrt(rho ln 1/delta))",
                   p.eps_selection_tight, p.eps_selection_simple));
  line(fmt::format("  beta          {:.4g} per threshold test{}, charged (e^eps{} + 1) * C * T * beta = {:.4g}", p.beta,
                   p.beta_defaulted ? " (default: half of selection's delta)" : "",
                   p.composition == Composition::Zcdp ? "" : "_sel", p.delta_beta));
  line(fmt::format(
      "  threshold     mu = {}{}, tau_s = lambda_s * {:.6g} ({}); tau_1 = {:.6g}, max tau = {:.6g}, tau_T = {:.6g}",
      p.mu, p.mu_defaulted ? " (default: floor(min tau / 24))" : "", p.tail_z,
      p.threshold == ThresholdTail::Subgaussian ? "subgaussian tail" : "Gaussian quantile", p.tau[1],
      *std::max_element(p.tau.begin() + 1, p.tau.end()), p.tau[p.T]));
  line(fmt::format("aggregation     eps {:.6g}, delta {:.4g}, rho = {:.6g} shared by {} column(s)",
                   p.epsilon_aggregation, p.delta_aggregation, p.rho_aggregation, p.aggregation.size()));
  for (const auto& f : p.aggregation)
    if (banded_values)
      line(fmt::format("  {:<13} sigma = {:.6g} {} per step, L2 sensitivity {:.6g} ||C e_1|| = {:.6g}, rho = {:.6g}",
                       f.name, f.sigma, f.unit, f.sensitivity, f.sensitivity * std::sqrt(p.band_norm2), f.rho));
    else
      line(fmt::format("  {:<13} sigma = {:.6g} {} per node, L2 sensitivity {:.6g} per level, rho = {:.6g}", f.name,
                       f.sigma, f.unit, f.sensitivity, f.rho));
  if (p.sum_quantum > 1 || p.clamp_bound > 0)
    line(fmt::format("  sum grid      values rounded to multiples of {:.6g}; L = {:.6g}",
                     static_cast<double>(p.sum_quantum) / kValueScale, p.clamp_bound));
  line(fmt::format("  eps           {:.6g} tight, {:.6g} simple", p.eps_aggregation_tight, p.eps_aggregation_simple));
  line("");
  if (p.composition == Composition::Zcdp)
    line(fmt::format(
        "total           eps {:.6g} <= {}, delta {:.4g} <= {:.4g}: within budget (composition zcdp: one ledger, "
        "rho = {:.6g}, converted once; the per-part eps above are for information)",
        p.eps_total, p.epsilon, p.delta_total, p.delta, p.rho_total));
  else
    line(fmt::format(
        "total           eps {:.6g} <= {}, delta {:.4g} <= {:.4g}: within budget (basic composition of the two parts)",
        p.eps_total, p.epsilon, p.delta_total, p.delta));
  if (thresholds_table) {
    line("");
    line("step  lambda        tau");
    for (std::uint32_t st = 1; st <= p.T; ++st)
      line(fmt::format("{:<5} {:<13.6g} {:.6g}", st, p.lambda[st], p.tau[st]));
  }
  return s;
}

}  // namespace dpstream
