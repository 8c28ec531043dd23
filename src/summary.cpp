#include "src/summary.hpp"

#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <nlohmann/json.hpp>

namespace dpstream {
std::uint64_t peak_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<std::uint64_t>(ru.ru_maxrss) * 1024;  // Linux reports KiB
}

std::string run_result_line(const nlohmann::json& j) {
  const auto& st = j.at("stage_seconds_max_over_ranks");
  const double triggers = std::max(1.0, j.at("triggers").get<double>());
  auto per_trigger = [&](std::initializer_list<const char*> names) {
    double s = 0;
    for (const char* n : names) s += st.at(n).get<double>();
    return s / triggers * 1e3;  // ms
  };
  const auto& bytes = j.at("shuffle_bytes_per_record");
  std::uint64_t rss = 0;
  for (const auto& r : j.at("peak_rss_bytes_per_rank")) rss = std::max(rss, r.get<std::uint64_t>());
  return fmt::format(
      "RESULT job={} mode={} ranks={} threads={} records={} triggers={} wall_s={:.3f} records_per_s={:.0f} "
      "engine_records_per_s={:.0f} ms_per_trigger_ingest={:.2f} ms_per_trigger_partition={:.2f} "
      "ms_per_trigger_shuffle_user={:.2f} ms_per_trigger_bounding={:.2f} ms_per_trigger_shuffle_key={:.2f} "
      "ms_per_trigger_kernels={:.2f} ms_per_trigger_output={:.2f} ms_per_trigger_checkpoint={:.2f} "
      "bytes_per_record_sent={:.2f} bytes_per_record_to_other_ranks={:.2f} peak_rss_mb_max={:.1f} oversubscribed={}",
      j.at("job").get<std::string>(), j.at("mode").get<std::string>(), j.at("ranks").get<int>(),
      j.at("threads_per_rank").get<int>(), j.at("records").at("read").get<std::uint64_t>(),
      j.at("triggers").get<std::uint64_t>(), j.at("wall_seconds").get<double>(),
      j.at("records_per_second").get<double>(), j.at("engine_records_per_second").get<double>(),
      per_trigger({"ingest"}), per_trigger({"partition_user", "partition_key"}), per_trigger({"shuffle_user"}),
      per_trigger({"bounding"}), per_trigger({"shuffle_key"}), per_trigger({"accumulate", "dp_release"}),
      per_trigger({"output"}), per_trigger({"checkpoint"}),
      bytes.at("user_shuffle_total").get<double>() + bytes.at("key_shuffle_total").get<double>(),
      bytes.at("user_shuffle_to_other_ranks").get<double>() + bytes.at("key_shuffle_to_other_ranks").get<double>(),
      static_cast<double>(rss) / 1048576.0, j.at("oversubscribed").get<bool>() ? "yes" : "no");
}
}  // namespace dpstream
