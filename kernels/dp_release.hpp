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

#include "kernels/banded_counter.hpp"
#include "kernels/counter_kind.hpp"
#include "kernels/dp_tree.hpp"
#include "kernels/key_accumulate.hpp"
#include "kernels/key_scan.hpp"
#include "kernels/noise.hpp"
#include "kernels/plain_steps.hpp"
#include "kernels/selection_cache.hpp"

namespace dpstream::kernels {

struct DpParams {
  std::uint32_t triggers = 0;  // T: leaves of a value tree
  double mu = 0;               // keys with <= mu users in a round are never released
  std::vector<double> tau;     // tau[s]: threshold margin at round step s = 1..T (tau[0] unused)
  double sigma_selection = 0;  // per node, in users
  bool release_count = true;
  bool release_sum = true;
  double sigma_count = 0;        // per node, in records
  double sigma_sum = 0;          // per node, in sum quanta
  std::int64_t sum_quantum = 1;  // fixed-point units per sum quantum (a power of two)
  CounterKind selection_counter = CounterKind::Tree;
  CounterKind value_counter = CounterKind::Tree;  // count and sum
  std::vector<std::int64_t> band;                 // the banded counters' band (either kind Banded)
};

struct DpStats {
  std::uint64_t tested = 0;       // (key, trigger) threshold tests: keys with > mu round users, per trigger
  std::uint64_t released = 0;     // (key, trigger) releases
  std::uint64_t noise_draws = 0;  // discrete Gaussian samples (simulations included)
  std::uint64_t visited = 0;      // (key, trigger) visits: keys of the micro-batch and keys due (all, for Full)
  std::uint64_t simulated = 0;    // steps simulated ahead by failed keys (Algorithm 4)
  std::uint64_t bounded = 0;      // of those, steps taken on one bound of their run (BandedNoise::run_bounds)
  std::uint64_t scheduled = 0;    // visits scheduled by a simulation (a predicted release or the horizon's end)
  std::uint64_t discarded = 0;    // scheduled visits overtaken by new records before they were due
  std::uint64_t predicted = 0;    // releases at a scheduled visit (new records, if any, stayed quiet)
  std::uint64_t quiet = 0;        // keys of the micro-batch left unvisited: too few users to pass before their visit
};

// Key selection's noise held per tested key (a cache: noise is a pure function of its node): the tree's
// at the last test and at the simulation's frontier ahead of it; the banded counter's at the frontier
// only (BandedNoise::rewind returns to a test before it for about the draws the second copy saved),
// and without its ring: a visit that advances draws the ring's b - 1 samples again with its steps'
// (24 bytes kept per key instead of 88, for up to b - 1 more draws per visit; a rewind draws none more).
struct TreeSelectionNoise {
  dptree::PrefixNoise tested, ahead;
};
struct BandedSelectionNoise {
  banded::BandedFrontier frontier;
};

// A key's first test in its round, on the banded counter: its prefix up to `step` - b + 1 may be drawn as
// blocks (BandedNoise::start_blocked), so the counter is no longer a function of (key, round) alone but
// of that step too, fixed by the data: a checkpoint keeps it and a resume seeks the key there again, or
// the resumed job would draw the prefix again as other blocks (docs/PRIVACY.md section 9).
struct FirstTest {
  std::uint64_t key;
  std::uint32_t round, step;
};

class DpReleaser {
 public:
  DpReleaser(DpParams params, const noise::Secret& secret, KeyScan scan = KeyScan::Predicted);
  ~DpReleaser();  // wipes the secret
  DpReleaser(const DpReleaser&) = delete;
  DpReleaser& operator=(const DpReleaser&) = delete;

  // Starts a window, or resumes one from a checkpoint: the next trigger visits every tracked key.
  void begin_window(std::int64_t window);
  // The first tests since the last drain (every rank's keys' that it tested; empty unless journaling).
  std::vector<FirstTest> drain_first_tests(const KeyStateTable& keys);
  // A resume's: each of this rank's keys still in the round of its first test is sought at that step again.
  void restore_first_tests(const std::vector<FirstTest>& tests, const KeyStateTable& keys);
  bool journal_first_tests = false;                 // note retested entries for drain_first_tests (a checkpointed job)
  static constexpr std::uint32_t kMinBlocked = 16;  // a shorter prefix is drawn step by step
  // After the trigger's accumulation (keys.touched: its keys above mu): tests the keys that can pass and
  // schedules their next visits; returns the releases sorted by key.
  std::vector<KeyRelease> release(KeyStateTable& keys, std::uint32_t trigger, DpStats& stats);
  // Accumulation and release of a batch of consecutive triggers from `first_trigger` (batch[i]: trigger
  // first_trigger + i's groups), shard by shard: a thread takes a shard through every trigger of the batch, so
  // the shard's key slots and selection entries stay in its cache. The same releases as accumulate and
  // release trigger by trigger. Adds each trigger's visits to `visits_per_trigger`, and to `accumulate_seconds`
  // the time its threads spent accumulating, divided by their number (a rank's wall time when they share it).
  std::vector<std::vector<KeyRelease>> release_batch(KeyStateTable& keys,
                                                     const std::vector<KeyStateTable::ShardedGroups>& batch,
                                                     std::uint32_t first_trigger, DpStats& stats,
                                                     std::vector<std::uint64_t>& visits_per_trigger,
                                                     double& accumulate_seconds);
  std::uint64_t cached_keys() const;
  std::uint64_t memory_bytes() const;
  const DpParams& params() const { return params_; }

 private:
  // Per shard, the tested keys' selection noise and schedules (kernels/selection_cache.hpp).
  template <class State>
  using CacheShards = std::vector<SelectionCache<State>>;
  // Per shard, the noise of a released key's value counter at its last release (most tested keys are
  // never released). Only the columns the job releases, of its counter kind, get entries: one struct
  // of all four held 320 B per released key where a count-only banded job needs 88; a banded counter
  // keeps its frontier (24 B) and draws its ring again at the next release.
  template <class Noise>
  using ValueNoises = std::vector<absl::flat_hash_map<std::uint64_t, Noise>>;
  // Triggers first_trigger .. first_trigger + triggers - 1; with `batch`, each shard's keys are accumulated
  // from it before each trigger's selection (else keys.touched holds the one trigger's).
  template <class Selection>
  std::vector<std::vector<KeyRelease>> release_with(KeyStateTable& keys, std::uint32_t first_trigger,
                                                    std::uint32_t triggers,
                                                    const std::vector<KeyStateTable::ShardedGroups>* batch,
                                                    DpStats& stats, std::vector<std::uint64_t>* visits_per_trigger,
                                                    double* accumulate_seconds,
                                                    CacheShards<typename Selection::State>& caches);
  // mu + tau[step] in users: the one double that passes(), failing_boundary() and plain_steps_ compare against.
  double threshold(std::uint32_t step) const { return params_.mu + params_.tau[step]; }
  bool passes(int128 prefix_noise, std::int64_t round_users, std::uint32_t step) const;  // noise on the kOne grid
  // The test's boundary in users as a real number: it passes iff round users exceed it (up to rounding).
  double failing_boundary(int128 prefix_noise, std::uint32_t step) const;
  // The largest round user count that fails the test at `step` with this prefix noise, exactly, within
  // [-kUsersLimit, kUsersLimit] (-kUsersLimit also when no count is known to fail).
  static constexpr std::int64_t kUsersLimit = std::int64_t{1} << 50;
  std::int64_t max_failing_users(int128 prefix_noise, std::uint32_t step, double boundary) const;
  // quiet_users = min(quiet_users, max_failing_users(...)).
  void lower_quiet_bound(std::int64_t& quiet_users, int128 prefix_noise, std::uint32_t step) const;
  // lower_quiet_bound for every noise in [lo, hi] at once: false (the bound unchanged) when the ends'
  // largest failing counts differ, and the exact noise must decide.
  bool lower_quiet_bound_within(std::int64_t& quiet_users, int128 lo, int128 hi, std::uint32_t step) const;
  // lower_quiet_bound leaves the bound as it is for every noise in [lo, hi] (the boundary is 2 or more
  // above it, and far inside double's exact range).
  bool quiet_bound_holds(std::int64_t quiet_users, int128 lo, int128 hi, std::uint32_t step) const;

  DpParams params_;
  PlainSteps plain_steps_;  // the simulations' shortcut past steps that change nothing
  KeyScan scan_;
  bool scan_all_next_ = true;  // the first trigger of a window or of a resumed run visits every key
  noise::Secret secret_;
  std::int64_t window_ = 0;
  std::optional<noise::DiscreteGaussian> selection_noise_;                    // tree key selection
  std::optional<noise::DiscreteGaussian> count_noise_, sum_noise_;            // for the chosen columns (tree counters)
  std::optional<banded::BandedPlan> selection_band_, count_band_, sum_band_;  // banded counters
  CacheShards<TreeSelectionNoise> tree_caches_{KeyStateTable::kShards};
  CacheShards<BandedSelectionNoise> banded_caches_{KeyStateTable::kShards};
  ValueNoises<dptree::PrefixNoise> count_trees_{KeyStateTable::kShards}, sum_trees_{KeyStateTable::kShards};
  ValueNoises<banded::BandedFrontier> count_bands_{KeyStateTable::kShards}, sum_bands_{KeyStateTable::kShards};
  // Per shard, for drain_first_tests: entries below this were journaled; older entries tested again since.
  std::vector<std::uint32_t> journaled_entries_ = std::vector<std::uint32_t>(KeyStateTable::kShards);
  std::vector<std::vector<std::uint32_t>> retested_ = std::vector<std::vector<std::uint32_t>>(KeyStateTable::kShards);
  // Per shard, the number of keys whose round users exceed mu (each is tested at every trigger until released).
  std::vector<std::uint64_t> above_mu_ = std::vector<std::uint64_t>(KeyStateTable::kShards);
};

}  // namespace dpstream::kernels
