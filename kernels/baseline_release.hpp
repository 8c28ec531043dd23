// The core paper's baselines (section 5), released on the key owner once per trigger: a one-shot
// DP histogram query with Gaussian thresholding (seed 003, Wilson et al. 2020) per trigger.
//   repeated (baseline 1): the query over all of the window's data so far (the key's running
//     totals, users = distinct users so far); the row holds the trigger's release.
//   batch (baseline 2): the query over the trigger's micro-batch only (users = the batch's users
//     of the key); the row holds that batch's release, and the histogram at trigger i is the sum
//     of a key's rows up to i (summary.json "release_values": "increments").
// A candidate key (users >= 1) is released when users + N(0, sigma_sel^2) > tau, with its count
// (and sum) plus independent noise. Each release draws fresh noise, a pure function of
// (secret, window, key, family, trigger) (kernels/noise.hpp); nothing is cached or stored.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "kernels/dp_release.hpp"
#include "kernels/key_accumulate.hpp"
#include "kernels/noise.hpp"

namespace dpstream::kernels {

struct BaselineParams {
  double tau = 0;              // release when users + noise > tau (in users)
  double sigma_selection = 0;  // in users
  bool release_count = true;
  bool release_sum = true;
  double sigma_count = 0;  // in records
  double sigma_sum = 0;    // in sum quanta
  std::int64_t sum_quantum = 1;
};

class BaselineReleaser {
 public:
  BaselineReleaser(BaselineParams params, const noise::Secret& secret);
  ~BaselineReleaser();  // wipes the secret
  BaselineReleaser(const BaselineReleaser&) = delete;
  BaselineReleaser& operator=(const BaselineReleaser&) = delete;

  void begin_window(std::int64_t window) { window_ = window; }
  // One one-shot query over `candidates` (totals per key: running totals or the batch's; any order).
  // Marks each released key in `keys` (KeyState::round counts its releases) and returns the rows sorted by key.
  std::vector<KeyRelease> release(const std::vector<KeyTotals>& candidates, KeyStateTable& keys, std::uint32_t trigger,
                                  DpStats& stats);
  // Baseline 1's candidates: the running totals of every key in the table.
  static std::vector<KeyTotals> running_totals(const KeyStateTable& keys);

 private:
  BaselineParams params_;
  noise::Secret secret_;
  std::int64_t window_ = 0;
  noise::DiscreteGaussian selection_noise_;
  std::optional<noise::DiscreteGaussian> count_noise_, sum_noise_;
};

}  // namespace dpstream::kernels
