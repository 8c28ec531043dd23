// summary.json of a finished run (the job, its privacy accounting, counts summed over ranks, stage
// times, checkpoint costs, memory) and the skipped-rows notice.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "shuffle/comm.hpp"
#include "src/config.hpp"
#include "src/privacy_plan.hpp"
#include "src/record_source.hpp"
#include "src/run_counters.hpp"

namespace dpstream {

// What the summary is made of: this rank's figures (the builder sums or maxes them over ranks).
struct RunFigures {
  const JobConfig& config;
  const PrivacyPlan& plan;  // empty unless a private mode
  const RunCounters& counters;
  const StatePeaks& peaks;
  const StageTimes& stage;
  const InputStats& input;
  std::uint64_t release_rows = 0;      // rank 0: rows handed to commits and still pending
  std::uint64_t total_triggers = 0;    // the job's
  double wall_seconds = 0;             // this rank's
  double collective_seconds = 0;       // this rank's inside collectives (shuffle::Comm::collective_seconds)
  std::uint64_t collective_calls = 0;  // this run's (shuffle::Comm::collective_calls; the same on every rank)
  std::uint64_t triggers_run = 0;      // by this run (a resume's: those after its commit; no skipped window's)
  std::uint64_t global_records = 0;    // records read, summed over ranks
  nlohmann::json checkpoint;           // the "checkpoint" block (CommitScheduler::json), null without checkpoints
};

// summary.json; a collective, every rank gets the same object.
nlohmann::json build_run_summary(const RunFigures& run, const shuffle::Comm& comm);

// A summary.json found where a job will write its own: whether a dpstream job wrote it (a JSON object naming its job
// and dpstream's version, or, before versions were recorded, its mode and record counts), and whether it describes a
// private release (whose replacement spends the budget again).
struct FoundSummary {
  bool dpstream = false;
  bool private_release = false;
  std::string job;
};
FoundSummary read_found_summary(const std::filesystem::path& path);

// One line for stderr when input rows were skipped (bad_rows = "skip"), counted by kind; empty when none.
std::string skipped_rows_message(const nlohmann::json& input, const JobConfig& config);

}  // namespace dpstream
