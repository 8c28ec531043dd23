#include "src/engine.hpp"

#include <fmt/format.h>
#include <sched.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/elapsed.hpp"
#include "common/fault_injection.hpp"
#include "src/durable_io.hpp"
#include "src/errors.hpp"
#include "src/run_summary.hpp"
#include "src/stop_request.hpp"
#include "src/summary.hpp"

namespace dpstream {

Engine::Engine(const JobConfig& job, const shuffle::Comm& comm, const RunOptions& options)
    : config_(job),
      comm_(comm),
      options_(options),
      run_start_(Clock::now()),
      collective_seconds_at_start_(comm.collective_seconds()),
      collective_calls_at_start_(comm.collective_calls()),
      root_(comm.rank() == 0),
      dp_(is_private(job.privacy.mode)),  // DP-SQLP or a baseline: a privacy plan and a noise secret
      checkpointing_(options.write_output && job.checkpoint.enabled()),
      release_columns_{job.query.count, job.query.sum},
      store_(std::filesystem::path(job.output.dir) / "checkpoint", comm),
      keys_(/*track_sums=*/job.query.sum) {}

Engine::~Engine() = default;

// The job: set up (or resume), every window's triggers, then the summary. A stop signal on any rank
// ends the job on every rank after the same trigger.
RunReport Engine::run() {
  if (!set_up()) return report_;  // --resume of a finished job: nothing to run
  for (std::uint32_t wi = start_window_; wi < config_.stream.windows && !stop_.signal; ++wi) run_window(wi);
  return stop_.signal ? stopped() : finish();
}

void Engine::run_window(std::uint32_t wi) {
  const std::uint32_t T = config_.stream.triggers;
  const std::int64_t window = config_.stream.first_window + wi;
  // Windows from the input: a window without a record on any rank releases nothing and is skipped.
  // Its triggers count as done, so that the job's last trigger is known as such (no stop agreement there).
  // Never the window a resume continues: its state is loaded (to be cleared at its end, not carried into
  // the next window), and its records may all lie before the commit while scheduled releases remain.
  const bool resumed_here = wi == start_window_ && start_trigger_ > 0;
  if (config_.stream.windows_from_input && wi + 1 < config_.stream.windows && !resumed_here &&
      comm_.max(std::uint64_t{source_->has_window(window)}) == 0) {
    triggers_done_ += T;
    return;
  }
  releaser_->begin_window(window);
  if (resumed_here) {
    releaser_->restore_first_tests(resumed_first_tests_, keys_);
    std::vector<kernels::FirstTest>().swap(resumed_first_tests_);
  }
  reserve_tables();
  const std::uint32_t batch = config_.engine.triggers_per_batch(T);
  for (std::uint32_t first = wi == start_window_ ? start_trigger_ : 0; first < T && !stop_.signal;) {
    const std::uint32_t end = first + std::min(batch, T - first);  // a batch ends with its window at the latest
    process_batch(wi, first, end);
    first = end;
  }
  if (!commits_->final_commit_pending() && !stop_.signal) {  // the next window starts empty
    users_.clear();
    keys_.clear();
  }
}

// Tables sized for the window when the input knows its users and keys (users and keys are hashed
// evenly over ranks); a hint, so a reservation that fails leaves the tables to grow.
void Engine::reserve_tables() {
  const auto ranks = static_cast<std::uint64_t>(comm_.size());
  if (const std::uint64_t users = source_->users_per_window())
    users_.reserve(users / ranks, source_->kept_records_per_window() / ranks);
  if (const std::uint64_t keys = source_->keys_per_window()) keys_.reserve(keys / ranks);
}

// Triggers [first, end) of a window on every rank, each step for all of them at once
// (src/trigger_pipeline.hpp): ingested, routed by user, bounded, routed by key, accumulated and released
// trigger by trigger -> release rows staged on rank 0 -> each trigger ended, a commit when due. The user
// state is ahead of the key state within the batch, so commits and stops wait for its end
// (src/commit_scheduler.hpp).
void Engine::process_batch(std::uint32_t wi, std::uint32_t first, std::uint32_t end) {
  const std::int64_t window = config_.stream.first_window + wi;
  counters_.note_cpu(sched_getcpu());
  std::vector<std::uint64_t> local_records;
  std::vector<std::vector<Record>> local;
  for (std::uint32_t trigger = first; trigger < end; ++trigger) {
    local.push_back(ingest(window, trigger));
    local_records.push_back(local.back().size());
  }
  await_ingest();
  std::vector<std::vector<KeyPartial>> partials = pipeline_->bound(pipeline_->route_by_user(std::move(local)));
  const std::vector<std::vector<KeyRelease>> releases = pipeline_->release(std::move(partials), first);
  const std::vector<std::uint64_t> released = stage_release(releases, window, first);
  for (std::uint32_t trigger = first; trigger < end; ++trigger)
    end_trigger(wi, trigger, local_records[trigger - first], released[trigger - first], trigger + 1 == end);
}

std::vector<Record> Engine::ingest(std::int64_t window, std::uint32_t trigger) {
  const auto t0 = Clock::now();
  std::vector<Record> local = source_->take_trigger(window, trigger);  // cannot fail: input was parsed at ingest
  fault::point("ingest");
  stage_.ingest += seconds_since(t0);
  return local;
}

// Every rank's batch read: the wait for the slowest rank's source is ingest time. Without it the user shuffle's
// first collective waited for it, and a source's imbalance between ranks counted as engine time (the user
// shuffle, 0.24 s a rank in a slow hour against 0.05 s with this barrier, docs/PERFORMANCE.md round 44).
void Engine::await_ingest() {
  const auto t0 = Clock::now();
  comm_.barrier();
  stage_.ingest += seconds_since(t0);
}

// The batch's rows, staged on rank 0 until their trigger is committed; returns each trigger's row count (rank 0).
std::vector<std::uint64_t> Engine::stage_release(const std::vector<std::vector<KeyRelease>>& releases,
                                                 std::int64_t window, std::uint32_t first_trigger) {
  const auto t0 = Clock::now();
  std::vector<std::uint64_t> released(releases.size(), 0);
  if (stager_) released = stager_->stage(releases, window, first_trigger);
  stage_.output += seconds_since(t0);
  return released;
}

// After a trigger: the counters (at a window's end also its figures), the agreement on a stop
// signal and a commit, progress; on a stop, the batch's last trigger committed even between two
// scheduled commits (the job's last trigger simply finishes the job).
void Engine::end_trigger(std::uint32_t wi, std::uint32_t trigger, std::uint64_t local_records, std::uint64_t released,
                         bool batch_end) {
  const std::int64_t window = config_.stream.first_window + wi;
  const bool window_end = trigger + 1 == config_.stream.triggers;
  ++triggers_done_;
  ++triggers_run_;
  counters_.records += local_records;
  if (window_end) {  // before the window's last commit, which carries these counters
    counters_.end_window(window, users_, keys_, /*count_released=*/dp_);
    peaks_.observe(users_, keys_, *releaser_);
  }
  const bool last_of_job = triggers_done_ >= total_triggers_;
  const StopAgreement stop = commits_->end_trigger(wi, trigger, last_of_job, batch_end);
  if (last_of_job)
    stop_ = {};  // the job's last trigger finishes the job, also after a stop agreed within its batch
  else if (stop_.signal == 0)
    stop_ = stop;  // the first one agreed, kept to the batch's end
  progress_->trigger_done(window, trigger, config_.stream.triggers, local_records, released, triggers_done_,
                          total_triggers_, dp_, batch_end);
  if (stop_.signal != 0 && batch_end) {
    commits_->commit_for_stop(wi, trigger);
    stopped_window_ = wi;
    stopped_trigger_ = trigger;
  }
}

// Stopped on a signal: the last commit made durable and visible; no summary.json (the job is unfinished).
RunReport Engine::stopped() {
  commits_->finish_stopped();
  report_.stop_signal = stop_.signal;
  const std::string where = fmt::format("after trigger {} of {} in window {} of {}", stopped_trigger_ + 1,
                                        config_.stream.triggers, stopped_window_ + 1, config_.stream.windows);
  if (checkpointing_)
    report_.stop_message = fmt::format(
        "dpstream: stopped cleanly on {} (first seen by rank {}) {}; commit {} holds every trigger up to there and "
        "releases.csv its rows; continue with: dpstream run ... --resume (any rank count)",
        stop_request::signal_name(stop_.signal), stop_.rank, where, store_.manifest().seq);
  else
    report_.stop_message = fmt::format(
        "dpstream: stopped on {} (first seen by rank {}) {}; checkpoints are off ([checkpoint] every = 0), so "
        "nothing can be resumed and no output was kept",
        stop_request::signal_name(stop_.signal), stop_.rank, where);
  return report_;
}

// The job's end: the job's last commit written (so the summary counts its bytes), the summary
// (src/run_summary.hpp), that commit made visible with it, then summary.json: a resume after a crash in
// between writes the summary from the checkpoint.
RunReport Engine::finish() {
  commits_->write_last_commit();
  const double wall = seconds_since(run_start_);
  const RunFigures run{.config = config_,
                       .plan = plan_,
                       .counters = counters_,
                       .peaks = peaks_,
                       .stage = stage_,
                       .input = source_->stats(),
                       .release_rows = writer_ ? writer_->rows() + writer_->pending_rows() : 0,
                       .total_triggers = total_triggers_,
                       .wall_seconds = wall,
                       .collective_seconds = comm_.collective_seconds() - collective_seconds_at_start_,
                       .collective_calls = comm_.collective_calls() - collective_calls_at_start_,
                       .triggers_run = triggers_run_,
                       .global_records = comm_.sum(counters_.records),
                       .checkpoint = commits_->json(resumed_from_)};
  nlohmann::json j = build_run_summary(run, comm_);
  if (options_.bench_line) report_.result_line = options_.bench_line(run, j, comm_);
  report_.skipped_rows_message = skipped_rows_message(j["input"], config_);
  report_.summary_json = j.dump(2);
  report_.run_result_line = run_result_line(j);

  commits_->finish_job(j);
  shuffle::on_all_ranks<std::runtime_error>(comm_, [&] {
    if (!root_ || !writer_) return;
    if (!checkpointing_) writer_->append("", /*sync=*/true), writer_->finish();
    write_file_atomically(std::filesystem::path(config_.output.dir) / "summary.json", report_.summary_json + "\n");
    report_.releases_path = writer_->final_path().string();
  });
  return report_;
}

RunReport run_job(const JobConfig& config, const shuffle::Comm& comm, const RunOptions& options) {
  return Engine(config, comm, options).run();
}

}  // namespace dpstream
