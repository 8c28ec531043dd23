// Partition selection of the DP SQL operator: which groups may appear in the result at all (seed 003,
// Wilson et al., arXiv 1909.01917, section 4.2.2: "tau-thresholding"; the open libraries' variants,
// docs/SQL.md and docs/PRIVACY.md section 12). A user is in at most k = max_groups_contributed groups
// and adds at most 1 to a group's distinct-user count n. A group with n = 0 is never considered.
//
//  - Laplace  (pure eps):  n + X >= tau, X ~ DLap(b) exact (P(x) ~ exp(-|x|/b)), b = k / eps rounded up (and
//             to at least 2^-10); tau the least integer with P[1 + X >= tau] <= delta_k (1 - 1e-9),
//             delta_k = 1 - (1 - delta)^(1/k), from the exact tail P[X >= m] = exp(-m/b) / (1 + exp(-1/b)).
//  - Gaussian (rho-zCDP + delta): n + X >= tau, X ~ N_Z(0, sigma^2), sigma^2 = k / (2 rho) rounded up (and
//             sigma to at least 2^-10); tau = 2 + ceil(sigma z), z = max(0, Phi^-1(1 - delta_k)) enlarged by
//             1e-9 (1 + |z|): P[X >= m] <= Q((m - 1) / sigma) for m >= 1 for the discrete Gaussian (its
//             normalizer is >= sigma sqrt(2 pi), Poisson summation).
//  - Magic    (eps, delta): keep with probability p(n), the near-truncated-geometric rule of Google's
//             library (NearTruncatedGeometricPartitionSelection), eps' = eps / k,
//             delta' = delta_k - max(1e-6 delta_k, 1e-14): the margin absorbs the rounding of p(n) (~1e-16
//             absolute); refused when delta_k < 1e-12.
//  - Public   (no cost): the analyst lists the groups; listed groups are released even when empty,
//             unlisted groups never.
// The noisy count of Laplace and Gaussian selection is a DP count of distinct users: ANON_COUNT(DISTINCT
// uid) and the denominators of ANON_AVG / ANON_VAR reuse it (post-processing, no extra cost).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kernels/noise.hpp"

namespace dpstream::sql {

enum class SelectionKind { Laplace, Gaussian, Magic, Public };

// 1 - (1 - delta)^(1/k), as -expm1(log1p(-delta) / k) (Google's CalculateAdjustedDelta); delta in (0, 1),
// k >= 1, else std::invalid_argument (as for the three functions below; they also need eps, sigma > 0).
double adjusted_delta(double delta, std::uint32_t k);

// The open libraries' continuous-noise thresholds, for comparison (docs/SQL.md; the reference values of
// tests/reference/partition_selection.json): keep iff n + Lap(k / eps) > tau, tau = 1 - (k / eps) ln(2 delta_k).
// (For delta_k > 1/2: tau = 1 + (k / eps) ln(2 (1 - delta_k)); Google branches on delta > 1/2 instead.)
double laplace_threshold_continuous(double eps, double delta, std::uint32_t k);
// Google's GaussianPartitionSelection with a given sigma: tau = 1 + sigma Phi^-1(1 - delta_k).
double gaussian_threshold_continuous(double sigma, double delta, std::uint32_t k);
// Google's NearTruncatedGeometricPartitionSelection::ProbabilityOfKeep for n >= 0 users (pre_threshold 1).
double magic_keep_probability(double eps, double delta, std::uint32_t k, std::uint64_t n);

// A selection rule with its exact noise; built once per query, then decide() per group.
class Selection {
 public:
  // eps in (0, 1e6], rho > 0 finite, delta in (0, 1), k in [1, 2^20]; b = k / eps <= 2^40 and
  // sigma <= 2^24; else std::invalid_argument saying what to change.
  static Selection laplace(double eps, double delta, std::uint32_t k);
  static Selection gaussian(double rho, double delta, std::uint32_t k);
  static Selection magic(double eps, double delta, std::uint32_t k);
  static Selection public_groups();

  SelectionKind kind() const { return kind_; }
  // Laplace: the rounded scale b; Gaussian: the rounded sigma; 0 otherwise.
  double noise_scale() const { return scale_; }
  // Laplace / Gaussian: the integer threshold tau; 0 otherwise.
  std::int64_t threshold() const { return tau_; }
  // Whether the noise gives a DP distinct-user count that other aggregates may reuse.
  bool has_noisy_count() const { return kind_ == SelectionKind::Laplace || kind_ == SelectionKind::Gaussian; }
  // The probability that a group of one user is kept: an upper bound on it, <= delta_k by construction.
  double single_user_keep_bound() const { return single_user_bound_; }

  struct Decision {
    bool keep = false;
    std::int64_t noisy_count = 0;  // n + X (Laplace, Gaussian); n itself otherwise
  };
  // The decision for a group with n >= 1 distinct users; `rng` is the group's own selection stream.
  // Public: always keep (the caller removes unlisted groups before).
  Decision decide(std::uint64_t n, noise::NodeStream& rng) const;

  // One line for the report, e.g. "laplace: b = 4, tau = 52 (P[keep | 1 user] <= 2.0e-06)".
  std::string describe() const;

 private:
  SelectionKind kind_ = SelectionKind::Public;
  double eps_ = 0, delta_ = 0;
  std::uint32_t k_ = 1;
  double scale_ = 0;
  std::int64_t tau_ = 0;
  double single_user_bound_ = 0;
  double magic_n1_ = 0, magic_n2_ = 0, magic_p_n1_ = 0;  // Magic: crossovers, p(n1); eps_, delta_ hold eps', delta'
  std::shared_ptr<const noise::DiscreteLaplace> lap_;
  std::shared_ptr<const noise::DiscreteGaussian> gauss_;
};

}  // namespace dpstream::sql
