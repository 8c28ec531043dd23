#include "tools/bench_result.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "common/elapsed.hpp"
#include "src/summary.hpp"
#include "src/workload.hpp"
#include "tools/naive_reference.hpp"

namespace dpstream {

namespace {

// Times the naive single-threaded reference over the whole synthetic stream (rank 0 only).
struct NaiveTiming {
  double seconds = 0;
  std::uint64_t records = 0;
};
NaiveTiming time_naive_reference(const JobConfig& config) {
  using Clock = std::chrono::steady_clock;
  SyntheticSource all(config, 0, 1);
  NaiveReference naive(config.privacy.max_records_per_user, config.privacy.clamp_min, config.privacy.clamp_max);
  NaiveTiming t;
  for (std::uint32_t w = 0; w < config.stream.windows; ++w) {
    const std::int64_t window = config.stream.first_window + w;
    naive.begin_window();
    for (std::uint32_t i = 0; i < config.stream.triggers; ++i) {
      auto records = all.take_trigger(window, i);
      t.records += records.size();
      const auto t0 = Clock::now();
      naive.process(std::move(records));
      t.seconds += seconds_since(t0);
    }
  }
  return t;
}

}  // namespace

std::string bench_result_line(const RunFigures& run, nlohmann::json& j, const shuffle::Comm& comm) {
  const int P = comm.size();
  NaiveTiming naive;
  if (comm.rank() == 0) naive = time_naive_reference(run.config);
  const double naive_rate = static_cast<double>(naive.records) / std::max(naive.seconds, 1e-9);
  const double engine_rate = j["engine_records_per_second"].get<double>();
  const int cores = P * omp_get_max_threads();
  std::string line = fmt::format(
      "RESULT job={} ranks={} threads={} records={} engine_seconds={:.3f} engine_records_per_s={:.0f} "
      "engine_records_per_s_per_core={:.0f} naive_records_per_s={:.0f} speedup_vs_naive={:.2f} "
      "user_shuffle_bytes_per_record={:.2f} key_shuffle_bytes_per_record={:.2f} peak_rss_mb_max={:.1f} "
      "state_mb_max={:.1f} oversubscribed={}",
      run.config.name, P, omp_get_max_threads(), run.global_records, j["engine_path_seconds"].get<double>(),
      engine_rate, engine_rate / cores, naive_rate, engine_rate / std::max(naive_rate, 1e-9),
      j["shuffle_bytes_per_record"]["user_shuffle_total"].get<double>(),
      j["shuffle_bytes_per_record"]["key_shuffle_total"].get<double>(),
      static_cast<double>(comm.max(peak_rss_bytes())) / 1048576.0,
      static_cast<double>(comm.max(run.peaks.state_bytes)) / 1048576.0, j["oversubscribed"].get<bool>() ? "yes" : "no");
  // The engine path's stages (max over ranks), so that a figure names the stage that moved.
  for (const Stage& s : kStages)
    if (s.engine_path)
      line += fmt::format(" {}_seconds={:.3f}", s.name, j["stage_seconds_max_over_ranks"][s.name].get<double>());
  // Each rank's main CPU (summary.json main_cpu_per_rank), comma-separated by rank: where cores differ, it names the
  // rank the figure waited for.
  std::vector<std::string> cpus;
  for (const auto& c : j["main_cpu_per_rank"]["cpu"]) cpus.push_back(std::to_string(c.get<std::int64_t>()));
  line += fmt::format(" rank_cpus={}", fmt::join(cpus, ","));
  j["naive_records_per_second"] = naive_rate;
  return line;
}

}  // namespace dpstream
