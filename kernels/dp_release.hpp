// DP release on the key owner, once per trigger: streaming key selection (DP-SQLP Algorithm 2)
// and hierarchical perturbation (Algorithm 3) over every tracked key.
//
// Key selection: per key and round, a binary tree over the per-trigger increments of the key's
// distinct-user count (users new to the key in the window; the round's leaf 1 is the trigger the
// round starts at). A key whose round count exceeds mu is tested: it is released when the Honaker
// prefix estimate exceeds mu + tau[s] at the round's step s. A key whose round count is <= mu is
// never tested, so never released. A release starts the next round.
// Perturbation: per key and released column, one tree over the window's triggers whose leaf at a
// release trigger holds everything accumulated since the previous release; the released value is
// the Honaker prefix estimate, i.e. the running total plus the noise of the prefix's nodes.
// All noise is a pure function of (secret, window, key, family, round, node) (kernels/noise.hpp).
#pragma once

#include <absl/container/flat_hash_map.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "kernels/dp_tree.hpp"
#include "kernels/key_accumulate.hpp"
#include "kernels/noise.hpp"

namespace dpstream::kernels {

struct DpParams {
  std::uint32_t triggers = 0;      // T: leaves of a value tree
  double mu = 0;                   // keys with <= mu users in a round are never released
  std::vector<double> tau;         // tau[s]: threshold margin at round step s = 1..T (tau[0] unused)
  double sigma_selection = 0;      // per node, in users
  bool release_count = true;
  bool release_sum = true;
  double sigma_count = 0;          // per node, in records
  double sigma_sum = 0;            // per node, in sum quanta
  std::int64_t sum_quantum = 1;    // fixed-point units per sum quantum (a power of two)
};

struct DpStats {
  std::uint64_t tested = 0;        // (key, trigger) threshold tests
  std::uint64_t released = 0;      // (key, trigger) releases
  std::uint64_t noise_draws = 0;   // discrete Gaussian samples
};

class DpReleaser {
 public:
  DpReleaser(DpParams params, const noise::Secret& secret);
  ~DpReleaser();  // wipes the secret
  DpReleaser(const DpReleaser&) = delete;
  DpReleaser& operator=(const DpReleaser&) = delete;

  void begin_window(std::int64_t window);
  // Tests every tracked key after the trigger's accumulation; returns the releases sorted by key.
  std::vector<KeyRelease> release(KeyStateTable& keys, std::uint32_t trigger, DpStats& stats);
  std::uint64_t cached_keys() const;
  std::uint64_t memory_bytes() const;
  const DpParams& params() const { return params_; }

 private:
  // Noise stacks of the keys that have been tested (derivable: a cache, never needed for privacy).
  struct NoiseCache {
    std::uint32_t selection_round = 0;
    dptree::PrefixNoise selection, count, sum;
  };
  DpParams params_;
  noise::Secret secret_;
  std::int64_t window_ = 0;
  noise::DiscreteGaussian selection_noise_;
  std::optional<noise::DiscreteGaussian> count_noise_, sum_noise_;  // for the chosen columns
  std::vector<absl::flat_hash_map<std::uint64_t, NoiseCache>> caches_{KeyStateTable::kShards};
};

}  // namespace dpstream::kernels
