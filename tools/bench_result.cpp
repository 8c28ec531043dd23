#include "tools/bench_result.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <omp.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "src/summary.hpp"

namespace dpstream {

std::string bench_result_line(const RunFigures& run, nlohmann::json& j, const shuffle::Comm& comm) {
  const int P = comm.size();
  const double engine_rate = j["engine_records_per_second"].get<double>();
  const int cores = P * omp_get_max_threads();
  std::string line = fmt::format(
      "RESULT job={} ranks={} threads={} records={} engine_seconds={:.3f} engine_records_per_s={:.0f} "
      "engine_records_per_s_per_core={:.0f} "
      "user_shuffle_bytes_per_record={:.2f} key_shuffle_bytes_per_record={:.2f} peak_rss_mb_max={:.1f} "
      "state_mb_max={:.1f} oversubscribed={}",
      run.config.name, P, omp_get_max_threads(), run.global_records, j["engine_path_seconds"].get<double>(),
      engine_rate, engine_rate / cores, j["shuffle_bytes_per_record"]["user_shuffle_total"].get<double>(),
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
  return line;
}

BenchRepeat bench_repeat(const std::string& summary_json, int cores) {
  const auto j = nlohmann::json::parse(summary_json);
  return {.engine_seconds = j.at("engine_path_seconds").get<double>(),
          .records_per_s_per_core = j.at("engine_records_per_second").get<double>() / cores};
}

namespace {
// The median of `v` (the mean of the middle two for an even count); v is not empty.
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}
}  // namespace

std::string bench_repeats_line(const std::string& job, int ranks, int threads, const std::vector<BenchRepeat>& runs) {
  if (runs.empty()) throw std::logic_error("bench_repeats_line: no repeat");
  std::vector<double> seconds, rates;
  for (const BenchRepeat& r : runs) seconds.push_back(r.engine_seconds), rates.push_back(r.records_per_s_per_core);
  return fmt::format(
      "RESULT_REPEATS job={} ranks={} threads={} repeats={} engine_seconds_min={:.3f} engine_seconds_median={:.3f} "
      "engine_seconds_max={:.3f} engine_records_per_s_per_core_best={:.0f} "
      "engine_records_per_s_per_core_median={:.0f} engine_records_per_s_per_core_worst={:.0f}",
      job, ranks, threads, runs.size(), *std::min_element(seconds.begin(), seconds.end()), median(seconds),
      *std::max_element(seconds.begin(), seconds.end()), *std::max_element(rates.begin(), rates.end()), median(rates),
      *std::min_element(rates.begin(), rates.end()));
}

}  // namespace dpstream
