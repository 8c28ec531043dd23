// The trigger loop: ingest -> partition by user -> all-to-all -> bounding -> partition by key
// -> all-to-all -> per-key accumulation -> release rows.
#pragma once

#include <cstdint>
#include <string>

#include "shuffle/comm.hpp"
#include "src/checkpoint.hpp"
#include "src/config.hpp"
#include "src/run_counters.hpp"  // StageTimes

namespace dpstream {

struct RunOptions {
  bool write_output = true;      // false for the benchmark: no releases.csv / summary.json
  bool naive_reference = false;  // benchmark: also time the naive single-threaded loop on rank 0
  bool progress_to_terminal_only = false;
  // New job, --resume or --fresh (with write_output: checkpoints in DIR/checkpoint).
  checkpoint::StartMode start_mode = checkpoint::StartMode::Start;
};

struct RunReport {
  std::string summary_json;  // what summary.json holds (rank 0)
  std::string releases_path;  // rank 0
  std::string result_line;    // benchmark RESULT line (rank 0)
  std::string run_result_line;  // `run --result` RESULT line (rank 0)
  bool already_complete = false;  // --resume found the job finished: nothing was run
  int stop_signal = 0;            // the job stopped early on this signal (SIGTERM / SIGUSR1)
  std::string stop_message;       // rank 0: where it stopped and how to continue
  std::string skipped_rows_message;  // rank 0: input rows skipped, by kind (empty when none)
};

// Runs the job on all ranks of `comm`. A stop signal (src/stop_request.hpp) on any rank stops every
// rank after the same trigger with that trigger committed (stop_signal != 0). Throws ConfigError / InputError / CheckpointError (the same
// on every rank) for bad jobs, input and checkpoints; nothing is written in that case.
RunReport run_job(const JobConfig& config, const shuffle::Comm& comm, const RunOptions& options);

}  // namespace dpstream
