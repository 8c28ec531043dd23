// Empty-key release prediction (DP-SQLP section 4.3, Algorithm 4; kernels/dp_release.hpp) changes
// which keys a trigger visits, never what it releases. KeyScan::Predicted runs side by side with
// KeyScan::Full (every tracked key tested at every trigger) on the same stream and secret; every
// trigger's releases and threshold-test count must be equal, over two windows, at 1 and 2 threads,
// with mu = 0 (every key with a user is tested) and mu > 0, thresholds that grow with the round's
// step, and a mid-window "resume" (a new releaser that knows nothing of the old one's predictions).
// Thresholds are low against the noise so that many keys are released by noise alone at triggers
// without records for them: the releases a wrong prediction would miss or invent.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/record.hpp"
#include "kernels/dp_release.hpp"
#include "kernels/key_accumulate.hpp"
#include "kernels/noise.hpp"
#include "tests/scoped_omp_threads.hpp"

namespace dpstream {
namespace {

using kernels::DpParams;
using kernels::DpReleaser;
using kernels::DpStats;
using kernels::KeyScan;
using kernels::KeyStateTable;

constexpr std::uint32_t kT = 48;
constexpr int kKeys = 400;

using kernels::CounterKind;

DpParams params(double mu, CounterKind counter = CounterKind::Tree, std::uint32_t triggers = kT) {
  DpParams p;
  p.selection_counter = p.value_counter = counter;
  if (counter == CounterKind::Banded) p.band = kernels::banded::optimized_band(triggers, 8);
  p.triggers = triggers;
  p.mu = mu;
  p.tau.resize(triggers + 1);
  for (std::uint32_t s = 0; s <= triggers; ++s) p.tau[s] = 5.0 + 0.1 * s;  // grows with the step, as the plan's
  p.sigma_selection = 3.0;
  p.sigma_count = 2.0;
  p.sigma_sum = 3.0;
  p.sum_quantum = 16;
  return p;
}

// Per trigger, the partials of a stream where key k gets records with a probability of its own
// (from every trigger to almost never), some with no new user (records of users it already had).
std::vector<std::vector<KeyPartial>> stream(std::uint64_t seed, std::uint32_t triggers = kT) {
  std::mt19937_64 rng(seed);
  std::vector<double> rate(kKeys);
  for (auto& r : rate) r = std::pow(std::uniform_real_distribution<double>(0.0, 1.0)(rng), 3.0);
  std::vector<std::vector<KeyPartial>> out(triggers);
  for (std::uint32_t t = 0; t < triggers; ++t)
    for (int k = 0; k < kKeys; ++k)
      if (std::uniform_real_distribution<double>(0.0, 1.0)(rng) < rate[k]) {
        const auto users = static_cast<std::int64_t>(rng() % 3);  // 0: records of known users only
        out[t].push_back({1000u + static_cast<std::uint64_t>(k) * 7919u, 1 + users, std::int64_t{1} << 20, users});
      }
  return out;
}

struct Totals {
  std::uint64_t releases = 0, predicted = 0, visits_full = 0, visits_predicted = 0, discarded = 0, quiet = 0;
  std::uint64_t bounded = 0;  // steps taken on one bound of their run
};

void expect_same(const std::vector<KeyRelease>& full, const std::vector<KeyRelease>& pred, const std::string& where) {
  ASSERT_EQ(full.size(), pred.size()) << where << ": release count";
  for (std::size_t i = 0; i < full.size(); ++i) {
    ASSERT_EQ(full[i].key, pred[i].key) << where;
    ASSERT_TRUE(full[i].count == pred[i].count && full[i].sum == pred[i].sum) << where << " key " << full[i].key;
  }
}

// Two windows of the stream; in window 1 the predicting releaser is replaced at `resume_at` by a new
// one (a resumed run: the key table is restored, the releaser's selection caches are not, but the
// first tests that a checkpoint keeps are given back, as Engine::run_window does).
void run_side_by_side(double mu, int threads, std::uint64_t seed, std::uint32_t resume_at, Totals& totals,
                      CounterKind counter, std::uint32_t triggers = kT) {
  const testing::ScopedOmpThreads scoped(threads);
  const auto secret = noise::secret_from_seed(seed);
  DpReleaser full(params(mu, counter, triggers), secret, KeyScan::Full);
  auto predicted = std::make_unique<DpReleaser>(params(mu, counter, triggers), secret, KeyScan::Predicted);
  // The engine's path: accumulate hands key selection only the keys above mu (touched_above).
  auto filtered = std::make_unique<DpReleaser>(params(mu, counter, triggers), secret, KeyScan::Predicted);
  predicted->journal_first_tests = filtered->journal_first_tests = true;
  for (std::int64_t window = 0; window < 2; ++window) {
    const auto partials = stream(seed * 31 + static_cast<std::uint64_t>(window), triggers);
    KeyStateTable full_keys, predicted_keys, filtered_keys;
    full.begin_window(window);
    predicted->begin_window(window);
    filtered->begin_window(window);
    DpStats fs, ps, fps;
    for (std::uint32_t t = 0; t < triggers; ++t) {
      const std::string where = "mu " + std::to_string(mu) + " threads " + std::to_string(threads) + " seed " +
                                std::to_string(seed) + " window " + std::to_string(window) + " trigger " +
                                std::to_string(t);
      if (window == 1 && t == resume_at) {
        const auto predicted_first = predicted->drain_first_tests(predicted_keys),
                   filtered_first = filtered->drain_first_tests(filtered_keys);
        predicted = std::make_unique<DpReleaser>(params(mu, counter, triggers), secret, KeyScan::Predicted);
        predicted->begin_window(window);
        predicted->restore_first_tests(predicted_first, predicted_keys);
        filtered = std::make_unique<DpReleaser>(params(mu, counter, triggers), secret, KeyScan::Predicted);
        filtered->begin_window(window);
        filtered->restore_first_tests(filtered_first, filtered_keys);
        predicted->journal_first_tests = filtered->journal_first_tests = true;
      }
      full_keys.accumulate(partials[t], KeyStateTable::Report::Nothing);
      predicted_keys.accumulate(partials[t], KeyStateTable::Report::Nothing);
      filtered_keys.accumulate(partials[t], KeyStateTable::Report::Nothing, mu);
      const std::uint64_t tested_full = fs.tested, tested_pred = ps.tested;
      const auto rf = full.release(full_keys, t, fs);
      const auto rp = predicted->release(predicted_keys, t, ps);
      expect_same(rf, rp, where);
      ASSERT_EQ(fs.tested - tested_full, ps.tested - tested_pred) << where << ": threshold tests";
      expect_same(rp, filtered->release(filtered_keys, t, fps), where + " (touched above mu only)");
      ASSERT_EQ(ps.tested, fps.tested) << where;
      ASSERT_EQ(ps.visited, fps.visited) << where << ": keys at or below mu count as visited";
    }
    totals.releases += fs.released;
    totals.predicted += ps.predicted;
    totals.visits_full += fs.visited;
    totals.visits_predicted += ps.visited;
    totals.discarded += ps.discarded;
    totals.quiet += ps.quiet;
    totals.bounded += ps.bounded;
    EXPECT_EQ(fs.predicted, 0u) << "the full scan schedules nothing";
  }
}

class KeyScanCounters : public ::testing::TestWithParam<CounterKind> {};

TEST_P(KeyScanCounters, PredictionReleasesExactlyWhatTheFullScanReleases) {
  for (const double mu : {0.0, 1.0, 3.0}) {
    Totals totals;
    for (const int threads : {1, 2})
      for (std::uint64_t seed = 1; seed <= 6; ++seed)
        run_side_by_side(mu, threads, seed, static_cast<std::uint32_t>(5 + 7 * seed % 40), totals, GetParam());
    // Not vacuous: many releases, some by noise alone at a predicted visit, predictions overtaken by
    // records, and fewer visits than the full scan (a dense stream: most keys get records often).
    EXPECT_GT(totals.releases, 500u) << "mu " << mu;
    EXPECT_GT(totals.predicted, 50u) << "mu " << mu
                                     << ": releases at a scheduled visit, no record since or only quiet ones";
    EXPECT_GT(totals.discarded, 50u) << "mu " << mu;
    EXPECT_GT(totals.quiet, 50u) << "mu " << mu << ": keys with records left unvisited (quiet bound)";
    EXPECT_LT(totals.visits_predicted * 4, totals.visits_full * 3) << "mu " << mu;
    std::printf(
        "mu %.0f: %llu releases, %llu at a scheduled visit, visits %llu (full scan %llu), "
        "%llu schedules overtaken, %llu quiet keys unvisited\n",
        mu, static_cast<unsigned long long>(totals.releases), static_cast<unsigned long long>(totals.predicted),
        static_cast<unsigned long long>(totals.visits_predicted), static_cast<unsigned long long>(totals.visits_full),
        static_cast<unsigned long long>(totals.discarded), static_cast<unsigned long long>(totals.quiet));
  }
}

// Windows of 400 triggers: look-aheads reach their cap (127 steps) and, with the banded counter, most runs are
// taken on one bound of their noise (BandedNoise::run_bounds), some of the cap's whole length; the releases stay
// the full scan's, across a resume in the middle of the second window.
TEST_P(KeyScanCounters, LongWindowsReleaseExactlyWhatTheFullScanReleases) {
  for (const double mu : {0.0, 3.0}) {
    Totals totals;
    for (std::uint64_t seed = 1; seed <= 2; ++seed)
      run_side_by_side(mu, 1, seed, 150 + 40 * static_cast<std::uint32_t>(seed), totals, GetParam(), 400);
    EXPECT_GT(totals.releases, 500u) << "mu " << mu;
    EXPECT_GT(totals.predicted, 50u) << "mu " << mu;
    if (GetParam() == CounterKind::Banded)
      EXPECT_GT(totals.bounded, 10000u) << "mu " << mu << ": runs taken on one bound";
    else
      EXPECT_EQ(totals.bounded, 0u) << "the tree's steps are known only once taken";
    std::printf("mu %.0f, T = 400: %llu releases, %llu at a scheduled visit, %llu steps taken on one bound\n", mu,
                static_cast<unsigned long long>(totals.releases), static_cast<unsigned long long>(totals.predicted),
                static_cast<unsigned long long>(totals.bounded));
  }
}

// A key that never gets another record after its first is still released when its noise says so:
// the prediction alone brings it back (the release the full scan finds by testing it every trigger).
TEST_P(KeyScanCounters, SilentKeysAreReleasedAtTheirPredictedTrigger) {
  const auto secret = noise::secret_from_seed(77);
  std::uint64_t releases = 0;
  for (const KeyScan scan : {KeyScan::Full, KeyScan::Predicted}) {
    DpReleaser releaser(params(0.0, GetParam()), secret, scan);
    releaser.begin_window(3);
    KeyStateTable keys;
    std::vector<KeyPartial> first;
    first.reserve(kKeys);
    for (int k = 0; k < kKeys; ++k) first.push_back({static_cast<std::uint64_t>(k) + 1, 1, 0, 1});
    DpStats stats;
    std::vector<std::vector<KeyRelease>> got;
    for (std::uint32_t t = 0; t < kT; ++t) {
      keys.accumulate(t == 0 ? first : std::vector<KeyPartial>{}, KeyStateTable::Report::Nothing);
      got.push_back(releaser.release(keys, t, stats));
    }
    static std::vector<std::vector<KeyRelease>> reference;  // set by the Full pass of this run
    if (scan == KeyScan::Full) {
      reference = got;
      for (const auto& r : got) releases += r.size();
    } else {
      for (std::uint32_t t = 0; t < kT; ++t) expect_same(reference[t], got[t], "trigger " + std::to_string(t));
      EXPECT_EQ(stats.predicted, releases - reference[0].size()) << "every later release came from a prediction";
    }
  }
  EXPECT_GT(releases, 20u) << "noise alone releases some of the one-user keys";
}

// Releases with no accumulate between them (a caller that accumulates once, as the threshold tests do):
// the touched list still names the keys of the last accumulate, but its states are the table's only
// until a release puts a new round, so later walks must read the table (a stale round 0 would test a
// released key again on its old noise).
TEST_P(KeyScanCounters, ReleasesWithoutAnAccumulateBetweenReadTheTable) {
  const auto secret = noise::secret_from_seed(78);
  DpParams p = params(0.0, GetParam());
  for (auto& tau : p.tau) tau = -50.0;  // every test passes: each key starts a new round at every trigger
  std::vector<std::vector<std::vector<KeyRelease>>> got;
  std::vector<std::vector<std::uint32_t>> rounds;
  for (const KeyScan scan : {KeyScan::Full, KeyScan::Predicted}) {
    DpReleaser releaser(p, secret, scan);
    releaser.begin_window(0);
    KeyStateTable keys;
    std::vector<KeyPartial> first;
    first.reserve(50);
    for (int k = 0; k < 50; ++k) first.push_back({static_cast<std::uint64_t>(k) + 1, 2, 2 << 20, 2});
    keys.accumulate(first, KeyStateTable::Report::Nothing);
    DpStats stats;
    got.emplace_back();
    for (std::uint32_t t = 0; t < 4; ++t) got.back().push_back(releaser.release(keys, t, stats));
    rounds.emplace_back();
    for (int k = 0; k < 50; ++k) rounds.back().push_back(keys.at(static_cast<std::uint64_t>(k) + 1).round);
  }
  for (std::uint32_t t = 0; t < 4; ++t) expect_same(got[0][t], got[1][t], "trigger " + std::to_string(t));
  EXPECT_EQ(rounds[0], rounds[1]);
  EXPECT_EQ(rounds[1][0], 1u) << "released at trigger 0 only: a new round has no users until new records come";
}

// A batch of triggers taken shard by shard (DpReleaser::release_batch: each shard accumulated and selected through
// every trigger of the batch before the next shard) releases what accumulate and release trigger by trigger
// release: the same rows, tests, draws, visits per trigger, first tests, journal and key table, in batches of 1 to 7
// triggers (the last one shorter where 48 is no multiple), at 1 and 2 threads, mu = 0 and 3, both scans.
TEST_P(KeyScanCounters, BatchesTakenShardByShardReleaseWhatTriggerByTriggerReleases) {
  std::uint64_t releases = 0, visits = 0;
  struct Case {
    KeyScan scan;
    double mu;
    int threads;
    std::uint32_t batch;
  };
  for (const Case& c :
       {Case{KeyScan::Predicted, 0.0, 2, 3}, Case{KeyScan::Predicted, 3.0, 1, 7}, Case{KeyScan::Predicted, 0.0, 1, 1},
        Case{KeyScan::Predicted, 3.0, 2, 5}, Case{KeyScan::Full, 3.0, 2, 3}, Case{KeyScan::Full, 0.0, 1, 7}}) {
    const auto [scan, mu, threads, batch] = c;
    const testing::ScopedOmpThreads scoped(threads);
    const std::uint64_t seed = 40 + batch;
    const auto secret = noise::secret_from_seed(seed);
    DpReleaser one(params(mu, GetParam()), secret, scan), batched(params(mu, GetParam()), secret, scan);
    one.journal_first_tests = batched.journal_first_tests = true;
    KeyStateTable one_keys, batched_keys;
    one_keys.journal = batched_keys.journal = true;
    for (std::int64_t window = 0; window < 2; ++window) {
      const auto partials = stream(seed * 31 + static_cast<std::uint64_t>(window));
      one_keys.clear();
      batched_keys.clear();
      one_keys.journal = batched_keys.journal = true;
      one.begin_window(window);
      batched.begin_window(window);
      DpStats os, bs;
      std::vector<std::uint64_t> one_visits, batched_visits;
      double seconds = 0;
      for (std::uint32_t first = 0; first < kT; first += batch) {
        const std::uint32_t n = std::min(batch, kT - first);
        std::vector<KeyStateTable::ShardedGroups> groups;
        for (std::uint32_t t = first; t < first + n; ++t) groups.push_back(KeyStateTable::shard_groups(partials[t]));
        const auto rows = batched.release_batch(batched_keys, groups, first, bs, batched_visits, seconds);
        ASSERT_EQ(rows.size(), n);
        for (std::uint32_t t = first; t < first + n; ++t) {
          one_keys.accumulate(partials[t], KeyStateTable::Report::Nothing, mu);
          const std::uint64_t visited = os.visited;
          const auto r = one.release(one_keys, t, os);
          one_visits.push_back(os.visited - visited);
          releases += r.size();
          expect_same(r, rows[t - first], "batch " + std::to_string(batch) + " trigger " + std::to_string(t));
        }
        const auto sorted = [](std::vector<kernels::FirstTest> v) {
          std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.key < b.key; });
          std::vector<std::uint64_t> flat;
          for (const auto& f : v) flat.insert(flat.end(), {f.key, f.round, f.step});
          return flat;
        };
        ASSERT_EQ(sorted(one.drain_first_tests(one_keys)), sorted(batched.drain_first_tests(batched_keys)));
        ASSERT_EQ(one_keys.changed_key_count(), batched_keys.changed_key_count()) << "the journal's marks";
      }
      visits += os.visited;
      EXPECT_EQ(one_visits, batched_visits) << "visits per trigger";
      EXPECT_EQ(os.tested, bs.tested);
      EXPECT_EQ(os.released, bs.released);
      EXPECT_EQ(os.noise_draws, bs.noise_draws);
      EXPECT_EQ(os.visited, bs.visited);
      EXPECT_EQ(os.quiet, bs.quiet);
      EXPECT_EQ(os.discarded, bs.discarded);
      EXPECT_EQ(os.predicted, bs.predicted);
      EXPECT_EQ(one_keys.digest(5), batched_keys.digest(5));
      EXPECT_GT(seconds, 0.0) << "the batch's accumulation is timed";
    }
  }
  EXPECT_GT(releases, 1000u);
  EXPECT_GT(visits, 10000u);
}

INSTANTIATE_TEST_SUITE_P(Counters, KeyScanCounters, ::testing::Values(CounterKind::Tree, CounterKind::Banded),
                         [](const auto& param_info) {
                           return param_info.param == CounterKind::Tree ? "Tree" : "Banded";
                         });

}  // namespace
}  // namespace dpstream
