#include "tools/bench_result.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <omp.h>

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

}  // namespace dpstream
