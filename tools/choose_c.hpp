// dpstream choose-c: a differentially private choice of the contribution bound C
// ([privacy] max_records_per_user), as the core paper's section 3.2 suggests: the q-quantile of the
// per-user record counts in one window of the job's input, released with DP (docs/CHOOSING-C.md).
//
// Mechanism (every step after the noise is post-processing):
//  1. each rank reads its share of window W exactly as the job would (RecordSource), counts records
//     per user, and sends (user, count) pairs to the user's owner rank (the engine's user partition
//     and all-to-all); the owner sums them, so each user has one total count;
//  2. h[b] = #users with min(count, max_c + 1) = b, b in 1..max_c+1, summed over ranks;
//  3. adding or removing one user changes exactly one bin by 1 (L2 sensitivity 1); every bin gets
//     independent exact discrete Gaussian noise, sigma = sqrt(1 / (2 rho)) rounded up by the sampler,
//     rho = zcdp_rho_tight(epsilon, delta): rho-zCDP, hence (epsilon, delta)-DP;
//  4. noisy CDF F(c) = sum_{b <= c} noisy h[b], noisy n = F(max_c + 1); C = the smallest c in
//     1..max_c with F(c) >= q n (max_c when there is none).
// The raw histogram never leaves this file: results hold noisy values only.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "src/config.hpp"

namespace dpstream::shuffle {
class Comm;
}

namespace dpstream {

struct ChooseCOptions {
  double epsilon = 0;                  // required, > 0
  double delta = 0;                    // required, in (0, 1)
  double quantile = 0.99;              // in (0, 1)
  std::int64_t max_c = 1000;           // in [1, 1e6]; bin max_c + 1 = "more than max_c"
  std::optional<std::int64_t> window;  // default: the job's first window (required where the input sets them)
  std::optional<std::uint64_t> seed;   // test mode: noise secret from the seed (not private)
  std::string ledger;                  // charged for the window before it is read (default: the job's)
};

inline constexpr std::int64_t kChooseCMaxC = 1'000'000;

// What choose-c releases: noisy figures and public parameters only.
struct ChooseCResult {
  std::string job;
  std::string input;  // description of the input (kind, CSV path): job-spec facts, not data
  std::int64_t window = 0;
  std::int64_t window_seconds = 0;
  double quantile = 0;
  std::int64_t max_c = 0;
  double epsilon = 0, delta = 0;
  double rho_budget = 0;  // zcdp_rho_tight(epsilon, delta)
  double rho = 0;         // spent: 1 / (2 sigma^2) with the sampler's sigma (<= rho_budget)
  double sigma = 0;       // the sampler's sigma (sqrt(1 / (2 rho_budget)) rounded up)
  std::int64_t c = 0;
  bool c_at_max = false;                      // no c in 1..max_c reached q n: C = max_c (raise --max-c)
  std::int64_t noisy_users = 0;               // noisy n = F(max_c + 1)
  std::optional<double> noisy_share_above_c;  // (n - F(C)) / n; none when noisy n <= 0
  double cdf_stderr_at_c = 0;                 // sigma sqrt(C)
  bool private_run = true;                    // false with --seed
  std::optional<std::uint64_t> seed;
};

// Checks the options against the job (no data, no communication); throws ConfigError saying
// which option to change.
void check_choose_c_options(const JobConfig& config, const ChooseCOptions& options);

// The window value under which choose-c keys its PRF (see choose_c.cpp): never a job window.
inline std::int64_t choose_c_prf_window(std::int64_t window) { return -1 - window; }

// Post-processing of a noisy histogram (noisy[b - 1] = bin b, b in 1..max_c+1): C, n, share above C.
struct QuantileChoice {
  std::int64_t c = 0;
  bool c_at_max = false;
  std::int64_t noisy_users = 0;
  std::optional<double> share_above_c;
};
QuantileChoice choose_from_noisy_histogram(const std::vector<std::int64_t>& noisy, double quantile);

// Runs the mechanism on every rank of `comm` (a collective); every rank gets the same result.
// Throws ConfigError (options, job), InputError (input data).
ChooseCResult choose_c(const JobConfig& config, const ChooseCOptions& options, const shuffle::Comm& comm);
// The same from a job spec file and --set overrides (load_job on every rank, errors agreed).
ChooseCResult choose_c(const std::string& spec, const std::vector<std::string>& overrides,
                       const ChooseCOptions& options, const shuffle::Comm& comm);

// {"window", "quantile", "max_c", "epsilon", "delta", "rho", "sigma", "c", "noisy_users",
//  "noisy_share_above_c", "private", plus "rho_budget", "cdf_stderr_at_c", "c_at_max", "job"}
nlohmann::ordered_json choose_c_json(const ChooseCResult& r);
std::string choose_c_text(const ChooseCResult& r);

}  // namespace dpstream
