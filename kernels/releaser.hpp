// The release step of a trigger on the key owner, one interface for every mode, built once per job
// (src/privacy_plan.hpp make_releaser):
//   exact    mode none: every key whose running totals changed at the trigger, exactly;
//   DP-SQLP  mode dp: streaming key selection and hierarchical perturbation (DpReleaser);
//   baseline the core paper's baselines 1 and 2: a one-shot DP query per trigger (BaselineReleaser).
// Each says what the trigger's accumulation must report for it (KeyStateTable::Report).
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "kernels/baseline_release.hpp"
#include "kernels/dp_release.hpp"
#include "kernels/key_accumulate.hpp"

namespace dpstream::kernels {

class Releaser {
 public:
  virtual ~Releaser() = default;
  // What KeyStateTable::accumulate returns at each trigger, to be passed to release().
  virtual KeyStateTable::Report accumulation() const = 0;
  // Round users at or below which a key is never tested: keys.touched lists only the keys above it. A
  // releaser that does not read keys.touched lists none (a listed key carries its 48-byte state).
  virtual double touched_above() const { return std::numeric_limits<double>::infinity(); }
  // Starts a window, or resumes one from a checkpoint.
  virtual void begin_window(std::int64_t window) = 0;
  // Key selection state that a checkpoint must keep (DpReleaser::FirstTest): what came since the last
  // drain, and a resume's, given back after begin_window (the entries of this rank's keys).
  virtual void journal_first_tests(bool /*on*/) {}  // keep them for drain_first_tests (a checkpointed job)
  virtual std::vector<FirstTest> drain_first_tests(const KeyStateTable& /*keys*/) { return {}; }
  virtual void restore_first_tests(const std::vector<FirstTest>& /*tests*/, const KeyStateTable& /*keys*/) {}
  // The trigger's rows sorted by key, from `reported` (what accumulate returned; consumed) and the
  // key table (keys.touched: the trigger's keys above touched_above()). Counts tests, draws and visits
  // into `stats`.
  virtual std::vector<KeyRelease> release(std::vector<KeyTotals>&& reported, KeyStateTable& keys, std::uint32_t trigger,
                                          DpStats& stats) = 0;
  // A batch of consecutive triggers from `first_trigger` (partials[i]: trigger first_trigger + i's, consumed):
  // each trigger's rows sorted by key. By default each trigger is accumulated (accumulation()) and released on
  // its own, in order; DP-SQLP takes the batch shard by shard (DpReleaser::release_batch), with the same rows.
  // Adds each trigger's visits to `visits_per_trigger` and the time spent accumulating to `accumulate_seconds`.
  virtual std::vector<std::vector<KeyRelease>> release_batch(std::vector<std::vector<KeyPartial>>&& partials,
                                                             KeyStateTable& keys, std::uint32_t first_trigger,
                                                             DpStats& stats,
                                                             std::vector<std::uint64_t>& visits_per_trigger,
                                                             double& accumulate_seconds);
  // State held beside the key table (noise caches and schedules): keys that have some, and its bytes.
  virtual std::uint64_t cached_keys() const { return 0; }
  virtual std::uint64_t memory_bytes() const { return 0; }
};

std::unique_ptr<Releaser> make_exact_releaser();
std::unique_ptr<Releaser> make_dp_sqlp_releaser(DpParams params, const noise::Secret& secret, KeyScan scan);
// over_running_totals: baseline 1 (the query over the window so far); false: baseline 2 (the batch).
std::unique_ptr<Releaser> make_baseline_releaser(BaselineParams params, const noise::Secret& secret,
                                                 bool over_running_totals);

}  // namespace dpstream::kernels
