// When the trigger loop commits (docs/CHECKPOINTS.md) and the one agreement of all ranks after each
// batch of triggers: a commit once `seconds` have passed (rank 0's clock decides for all), once the commit
// journal holds `journal_mib` MiB on any rank, or every `every` triggers, at the end of every window,
// and after a stop signal seen by any rank; the job's very last commit waits for summary.json. Also
// what the commits cost and what caused them (summary.json "checkpoint").
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>

#include "kernels/bounding.hpp"
#include "kernels/key_accumulate.hpp"
#include "kernels/releaser.hpp"
#include "shuffle/comm.hpp"
#include "src/checkpoint.hpp"
#include "src/config.hpp"
#include "src/release_writer.hpp"
#include "src/run_counters.hpp"

namespace dpstream {

// A stop signal seen by any rank, agreed by all.
struct StopAgreement {
  int signal = 0;  // the first rank's signal
  int rank = -1;   // the first rank that received one
};

class CommitScheduler {
 public:
  using Clock = std::chrono::steady_clock;
  // `checkpointing` false: never commits, but still agrees on stop signals. `writer`: rank 0's.
  CommitScheduler(const JobConfig& config, const shuffle::Comm& comm, bool checkpointing, checkpoint::Store& store,
                  ReleaseWriter* writer, kernels::UserState& users, kernels::KeyStateTable& keys,
                  kernels::Releaser& releaser, RunCounters& counters, StageTimes& stage);

  // The run starts at `first_trigger` of its first window; the commit clock starts now.
  void start_at(std::uint32_t first_trigger);
  // After trigger `trigger` of window index `wi`: at a batch's end (`batch_end`; a window's last trigger
  // ends one) agrees on a stop signal and rank 0's commit clock (collective; not after the job's last
  // trigger), then commits when due. The job's last commit is left pending for finish_job. Within a batch
  // the user state is already ahead of the trigger, so a commit due there waits for the batch's end.
  StopAgreement end_trigger(std::uint32_t wi, std::uint32_t trigger, bool last_of_job, bool batch_end);
  // A stop after that trigger: commits it unless end_trigger just did.
  void commit_for_stop(std::uint32_t wi, std::uint32_t trigger);
  // Stopped: the last commit made durable and visible.
  void finish_stopped();
  // The job's last commit written and its files awaited (collective), so that json() counts every
  // commit's bytes; it becomes visible with the summary in finish_job.
  void write_last_commit();
  // The job's last commit, which keeps `summary`, made durable and visible.
  void finish_job(const nlohmann::json& summary);

  bool final_commit_pending() const { return final_commit_pending_; }
  CommitFigures& figures() { return figures_; }
  // summary.json "checkpoint" (collective); null without checkpoints. `resumed_from`: the commit a
  // resume started from, if any.
  nlohmann::json json(std::optional<std::uint32_t> resumed_from) const;

 private:
  void commit(std::uint32_t wi, std::uint32_t first_trigger, std::uint32_t next_trigger, bool complete);
  void count(CommitCause cause);  // in the job's carried counters (rank 0)
  bool clock_ran_out() const;     // `seconds` since the last commit
  bool journal_full() const;      // this rank's journal holds `journal_mib` MiB

  const JobConfig& config_;
  const shuffle::Comm& comm_;
  const bool checkpointing_;
  checkpoint::Store& store_;
  ReleaseWriter* writer_;
  kernels::UserState& users_;
  kernels::KeyStateTable& keys_;
  kernels::Releaser& releaser_;  // its key selection state a commit keeps (first tests)
  RunCounters& counters_;
  StageTimes& stage_;
  CommitFigures figures_;
  Clock::time_point last_commit_ = Clock::now();  // the time-based cadence counts from here
  std::uint32_t uncommitted_from_ = 0;            // first trigger of the window not yet committed
  bool committed_now_ = false;                    // end_trigger committed the trigger
  std::optional<CommitCause> deferred_;           // a commit due within the batch, made at its end
  bool final_commit_pending_ = false;
};

}  // namespace dpstream
