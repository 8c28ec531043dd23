#include "kernels/releaser.hpp"

#include <utility>

#include "common/elapsed.hpp"

namespace dpstream::kernels {

namespace {

class ExactReleaser final : public Releaser {
 public:
  KeyStateTable::Report accumulation() const override { return KeyStateTable::Report::RunningTotals; }
  void begin_window(std::int64_t) override {}
  std::vector<KeyRelease> release(std::vector<KeyTotals>&& reported, KeyStateTable&, std::uint32_t, DpStats&) override {
    std::vector<KeyRelease> rows;
    rows.reserve(reported.size());
    for (const auto& t : reported) rows.push_back({t.key, int128{t.count} << kValueFracBits, t.sum});
    return rows;
  }
};

class DpSqlpReleaser final : public Releaser {
 public:
  DpSqlpReleaser(DpParams params, const noise::Secret& secret, KeyScan scan) : impl_(std::move(params), secret, scan) {}
  // Key selection visits the trigger's keys above mu through keys.touched, with the states accumulate
  // left there.
  KeyStateTable::Report accumulation() const override { return KeyStateTable::Report::Nothing; }
  double touched_above() const override { return impl_.params().mu; }  // DP-SQLP tests only above mu
  void begin_window(std::int64_t window) override { impl_.begin_window(window); }
  void journal_first_tests(bool on) override { impl_.journal_first_tests = on; }
  std::vector<FirstTest> drain_first_tests(const KeyStateTable& keys) override { return impl_.drain_first_tests(keys); }
  void restore_first_tests(const std::vector<FirstTest>& tests, const KeyStateTable& keys) override {
    impl_.restore_first_tests(tests, keys);
  }
  std::vector<KeyRelease> release(std::vector<KeyTotals>&&, KeyStateTable& keys, std::uint32_t trigger,
                                  DpStats& stats) override {
    return impl_.release(keys, trigger, stats);
  }
  std::vector<std::vector<KeyRelease>> release_batch(std::vector<std::vector<KeyPartial>>&& partials,
                                                     KeyStateTable& keys, std::uint32_t first_trigger, DpStats& stats,
                                                     std::vector<std::uint64_t>& visits_per_trigger,
                                                     double& accumulate_seconds) override {
    const auto t0 = SteadyClock::now();
    std::vector<KeyStateTable::ShardedGroups> batch(partials.size());
    for (std::size_t i = 0; i < partials.size(); ++i) batch[i] = KeyStateTable::shard_groups(std::move(partials[i]));
    accumulate_seconds += seconds_since(t0);
    return impl_.release_batch(keys, batch, first_trigger, stats, visits_per_trigger, accumulate_seconds);
  }
  std::uint64_t cached_keys() const override { return impl_.cached_keys(); }
  std::uint64_t memory_bytes() const override { return impl_.memory_bytes(); }

 private:
  DpReleaser impl_;
};

class BaselineQueryReleaser final : public Releaser {
 public:
  BaselineQueryReleaser(BaselineParams params, const noise::Secret& secret, bool over_running_totals)
      : impl_(params, secret), over_running_totals_(over_running_totals) {}
  // Baseline 1 reads every key's running totals from the table; baseline 2 needs the batch's totals.
  KeyStateTable::Report accumulation() const override {
    return over_running_totals_ ? KeyStateTable::Report::Nothing : KeyStateTable::Report::TriggerTotals;
  }
  void begin_window(std::int64_t window) override { impl_.begin_window(window); }
  std::vector<KeyRelease> release(std::vector<KeyTotals>&& reported, KeyStateTable& keys, std::uint32_t trigger,
                                  DpStats& stats) override {
    if (over_running_totals_) reported = BaselineReleaser::running_totals(keys);
    return impl_.release(reported, keys, trigger, stats);
  }

 private:
  BaselineReleaser impl_;
  bool over_running_totals_;
};

}  // namespace

std::vector<std::vector<KeyRelease>> Releaser::release_batch(std::vector<std::vector<KeyPartial>>&& partials,
                                                             KeyStateTable& keys, std::uint32_t first_trigger,
                                                             DpStats& stats,
                                                             std::vector<std::uint64_t>& visits_per_trigger,
                                                             double& accumulate_seconds) {
  std::vector<std::vector<KeyRelease>> rows(partials.size());
  for (std::size_t t = 0; t < partials.size(); ++t) {
    const auto t0 = SteadyClock::now();
    std::vector<KeyTotals> reported = keys.accumulate(std::move(partials[t]), accumulation(), touched_above());
    accumulate_seconds += seconds_since(t0);
    const std::uint64_t visited_before = stats.visited;
    rows[t] = release(std::move(reported), keys, first_trigger + static_cast<std::uint32_t>(t), stats);
    visits_per_trigger.push_back(stats.visited - visited_before);
  }
  return rows;
}

std::unique_ptr<Releaser> make_exact_releaser() { return std::make_unique<ExactReleaser>(); }

std::unique_ptr<Releaser> make_dp_sqlp_releaser(DpParams params, const noise::Secret& secret, KeyScan scan) {
  return std::make_unique<DpSqlpReleaser>(std::move(params), secret, scan);
}

std::unique_ptr<Releaser> make_baseline_releaser(BaselineParams params, const noise::Secret& secret,
                                                 bool over_running_totals) {
  return std::make_unique<BaselineQueryReleaser>(params, secret, over_running_totals);
}

}  // namespace dpstream::kernels
