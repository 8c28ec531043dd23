// The engine: runs a job on all ranks, window by window and trigger by trigger. Each trigger goes
// ingest -> route by user -> bound -> route by key -> accumulate and release (src/trigger_pipeline.hpp)
// -> release rows staged on rank 0; commits (src/commit_scheduler.hpp) make it resumable.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/bounding.hpp"
#include "kernels/key_accumulate.hpp"
#include "kernels/noise.hpp"
#include "kernels/releaser.hpp"
#include "shuffle/comm.hpp"
#include "src/checkpoint.hpp"
#include "src/commit_scheduler.hpp"
#include "src/config.hpp"
#include "src/output_lock.hpp"
#include "src/privacy_plan.hpp"
#include "src/progress.hpp"
#include "src/record_source.hpp"
#include "src/release_stager.hpp"
#include "src/release_writer.hpp"
#include "src/run_counters.hpp"
#include "src/run_summary.hpp"
#include "src/trigger_pipeline.hpp"

namespace dpstream {

struct RunOptions {
  bool write_output = true;  // false for the benchmark: no releases.csv / summary.json
  // Benchmark (`dpstream bench`): builds the RESULT line from the run and its summary (collective; the
  // CLI passes tools::bench_result_line, so the engine never links the offline tools).
  std::function<std::string(const RunFigures&, nlohmann::json&, const shuffle::Comm&)> bench_line;
  // New job, --resume or --fresh (with write_output: checkpoints in DIR/checkpoint).
  checkpoint::StartMode start_mode = checkpoint::StartMode::Start;
};

struct RunReport {
  std::string summary_json;          // what summary.json holds (rank 0)
  std::string releases_path;         // rank 0
  std::string result_line;           // benchmark RESULT line (rank 0)
  std::string run_result_line;       // `run --result` RESULT line (rank 0)
  bool already_complete = false;     // --resume found the job finished: nothing was run
  int stop_signal = 0;               // the job stopped early on this signal (SIGTERM / SIGUSR1)
  std::string stop_message;          // rank 0: where it stopped and how to continue
  std::string skipped_rows_message;  // rank 0: input rows skipped, by kind (empty when none)
};

// One run of one job on all ranks of `comm`; run() once.
class Engine {
 public:
  Engine(const JobConfig& job, const shuffle::Comm& comm, const RunOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Collective: see run_job.
  RunReport run();

 private:
  using Clock = std::chrono::steady_clock;

  // Setting up (src/engine_setup.cpp): refusals first, then the checkpoint, the job's secret, the
  // output, the input, the state, and a new job's first commit or a resume's state.
  bool set_up();  // false: --resume found the job complete (its output is written again)
  // DP noise and keyed CSV ids need the job's secret (kept in the checkpoint); other jobs have none.
  bool needs_secret() const { return dp_ || config_.input.kind == InputKind::Csv; }
  noise::Secret job_secret() const;
  void admit_to_ledger(const noise::Secret& secret, bool charge);
  void open_output();
  void refuse_unwritable_outputs(const std::filesystem::path& out_dir) const;
  void open_input(const noise::Secret& secret);
  void create_state();
  // The checkpoint (src/engine_resume.cpp).
  bool open_checkpoint();  // false: the job is complete
  void start_checkpoint(const noise::Secret& secret);
  void resume();

  // The job (src/engine.cpp).
  void run_window(std::uint32_t wi);
  void reserve_tables();
  void process_batch(std::uint32_t wi, std::uint32_t first, std::uint32_t end);
  std::vector<Record> ingest(std::int64_t window, std::uint32_t trigger);
  void await_ingest();
  std::vector<std::uint64_t> stage_release(const std::vector<std::vector<KeyRelease>>& releases, std::int64_t window,
                                           std::uint32_t first_trigger);
  void end_trigger(std::uint32_t wi, std::uint32_t trigger, std::uint64_t local_records, std::uint64_t released,
                   bool batch_end);
  RunReport stopped();
  RunReport finish();

  JobConfig config_;  // the windows of a CSV job are resolved from its input
  const shuffle::Comm& comm_;
  const RunOptions options_;
  const Clock::time_point run_start_;
  const double collective_seconds_at_start_;  // comm_'s, so that the summary counts this run's only
  const std::uint64_t collective_calls_at_start_;
  std::uint64_t triggers_run_ = 0;  // by this run (not a resume's earlier ones, nor skipped windows)
  const bool root_, dp_, checkpointing_;
  const ReleaseColumns release_columns_;
  RunReport report_;
  PrivacyPlan plan_;
  std::unique_ptr<ProgressReporter> progress_;
  // Rank 0's lock on the output directory (src/output_lock.hpp): declared before everything that writes
  // there, so that it is dropped after them.
  std::unique_ptr<OutputLock> output_lock_;
  // Declared before the store: the store's I/O thread publishes through the writer (rank 0's), so the
  // writer must outlive it when an error unwinds the stack.
  std::unique_ptr<ReleaseWriter> writer_;
  checkpoint::Store store_;
  checkpoint::Fields identity_;
  bool resuming_ = false;
  std::optional<std::uint32_t> resumed_from_;  // the commit a resume started from
  std::unique_ptr<kernels::Releaser> releaser_;
  std::unique_ptr<RecordSource> source_;
  StageTimes stage_;
  kernels::UserState users_;
  kernels::KeyStateTable keys_;
  RunCounters counters_;  // the job's, carried over a resume
  StatePeaks peaks_;      // this run's
  std::unique_ptr<ReleaseStager> stager_;
  std::unique_ptr<CommitScheduler> commits_;
  std::unique_ptr<TriggerPipeline> pipeline_;
  std::uint32_t start_window_ = 0, start_trigger_ = 0;   // the beginning, or the first trigger after the last commit
  std::vector<kernels::FirstTest> resumed_first_tests_;  // a resume's, for key selection once its window begins
  std::uint64_t triggers_done_ = 0, total_triggers_ = 0;
  StopAgreement stop_;
  std::uint32_t stopped_window_ = 0, stopped_trigger_ = 0;
};

// Runs the job on all ranks of `comm`. A stop signal (src/stop_request.hpp) on any rank stops every
// rank after the same trigger with that trigger committed (stop_signal != 0). Throws ConfigError / InputError /
// CheckpointError (the same on every rank) for bad jobs, input and checkpoints; nothing is written in that case.
RunReport run_job(const JobConfig& config, const shuffle::Comm& comm, const RunOptions& options);

}  // namespace dpstream
