#include "src/progress.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "common/elapsed.hpp"

namespace dpstream {

namespace {
std::string human_rate(double per_second) {
  if (per_second >= 1e6) return fmt::format("{:.2f} M", per_second / 1e6);
  if (per_second >= 1e3) return fmt::format("{:.1f} k", per_second / 1e3);
  return fmt::format("{:.0f} ", per_second);
}
}  // namespace

ProgressReporter::ProgressReporter(const JobConfig& config, const shuffle::Comm& comm, Clock::time_point run_start)
    : comm_(comm), run_start_(run_start) {
  const bool root = comm.rank() == 0;
  on_ =
      comm.max(std::uint64_t{root && (config.output.progress == ProgressMode::Always ||
                                      (config.output.progress == ProgressMode::Auto && ::isatty(STDERR_FILENO)))}) != 0;
}

void ProgressReporter::trigger_done(std::int64_t window, std::uint32_t trigger, std::uint32_t triggers_per_window,
                                    std::uint64_t local_records, std::uint64_t released, std::uint64_t triggers_done,
                                    std::uint64_t total_triggers, bool dp, bool batch_end) {
  if (!on_) return;
  local_since_sum_ += local_records;
  if (!batch_end) return;
  global_records_ += comm_.sum(local_since_sum_);
  local_since_sum_ = 0;
  const double elapsed = seconds_since(run_start_);
  const double done_here = static_cast<double>(triggers_done - triggers_at_start_);
  const double remaining = elapsed / std::max(done_here, 1.0) * static_cast<double>(total_triggers - triggers_done);
  if (comm_.rank() == 0)
    std::fprintf(stderr, "[window %lld trigger %u/%u] %srecords/s, %llu %s, elapsed %.1f s, ETA %.1f s\n",
                 static_cast<long long>(window), trigger + 1, triggers_per_window,
                 human_rate(static_cast<double>(global_records_) / std::max(elapsed, 1e-9)).c_str(),
                 static_cast<unsigned long long>(released), dp ? "keys released" : "keys changed", elapsed, remaining);
}

}  // namespace dpstream
