// The progress line on rank 0's terminal after each batch of triggers ([engine] trigger_batch; one
// trigger up to T = 99): window, trigger, rate, rows, ETA.
#pragma once

#include <chrono>
#include <cstdint>

#include "shuffle/comm.hpp"
#include "src/config.hpp"

namespace dpstream {

class ProgressReporter {
 public:
  using Clock = std::chrono::steady_clock;
  // Collective: decided on rank 0 (whose terminal it is) and shared, because the count is a collective.
  ProgressReporter(const JobConfig& config, const shuffle::Comm& comm, Clock::time_point run_start);

  bool on() const { return on_; }
  // The triggers already done when this run starts (a resume); the ETA counts this run's pace only.
  void start_at(std::uint64_t triggers_done) { triggers_at_start_ = triggers_done; }
  // After a trigger: this rank's records, the trigger's rows (rank 0), the job's triggers done and in
  // all. At a batch's end (collective when on: the records summed once a batch) prints its line.
  void trigger_done(std::int64_t window, std::uint32_t trigger, std::uint32_t triggers_per_window,
                    std::uint64_t local_records, std::uint64_t released, std::uint64_t triggers_done,
                    std::uint64_t total_triggers, bool dp, bool batch_end);

 private:
  const shuffle::Comm& comm_;
  Clock::time_point run_start_;
  bool on_ = false;
  std::uint64_t triggers_at_start_ = 0;
  std::uint64_t global_records_ = 0;
  std::uint64_t local_since_sum_ = 0;  // this rank's records of the batch so far
};

}  // namespace dpstream
