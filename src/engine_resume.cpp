// Engine and the checkpoint: opening it (a new job, a resume, or a finished job), a new job's first
// commit, and a resume's state, counters, rows and input position (docs/CHECKPOINTS.md).
#include <cstdio>
#include <filesystem>

#include "common/elapsed.hpp"
#include "src/durable_io.hpp"
#include "src/engine.hpp"
#include "src/errors.hpp"

namespace dpstream {

// Checkpoint: a new job, a resume, or a finished job (docs/CHECKPOINTS.md), once the output directory is
// this job's alone (OutputLock); also without checkpoints, so that an unfinished job is never overwritten
// silently. False for a finished job, whose last rows and summary.json are written again (the last commit
// may have been cut short after its manifest; both are idempotent).
bool Engine::open_checkpoint() {
  if (!options_.write_output) return true;
  shuffle::on_all_ranks<ConfigError>(comm_, [&] {  // before anything in the directory is read or written
    if (root_)
      output_lock_ =
          std::make_unique<OutputLock>(config_.output.dir, options_.start_mode != checkpoint::StartMode::Resume);
  });
  if (root_ && !output_lock_->note().empty())
    std::fprintf(stderr, "dpstream: note: %s\n", output_lock_->note().c_str());
  std::string input_digest;
  shuffle::on_all_ranks<InputError>(comm_, [&] {
    if (root_ && config_.input.kind == InputKind::Csv) input_digest = checkpoint::file_digest(config_.input.path);
  });
  shuffle::broadcast_string(comm_, input_digest);
  identity_ = checkpoint::identity_fields(config_, input_digest);
  const checkpoint::Opened opened = [&] {
    try {
      return store_.open(config_.name, identity_, options_.start_mode);
    } catch (const CheckpointError& e) {  // its advice to resume needs the checkpoints this spec turned off
      if (checkpointing_) throw;
      throw CheckpointError(std::string(e.what()) +
                            " (--resume needs checkpoints: resume without [checkpoint] every = 0)");
    }
  }();
  if (root_)
    for (const auto& note : opened.notes) std::fprintf(stderr, "dpstream: %s\n", note.c_str());
  resuming_ = opened.kind == checkpoint::Opened::Kind::Resume;
  if (opened.kind != checkpoint::Opened::Kind::Complete) return true;

  const std::filesystem::path out_dir = config_.output.dir;
  kernels::UserState no_users;
  kernels::KeyStateTable no_keys;
  const std::string staged = store_.load(no_users, no_keys, /*window_done=*/true);
  shuffle::on_all_ranks<CheckpointError>(comm_, [&] {
    if (!root_) return;
    const auto& m = store_.manifest();
    ReleaseWriter(out_dir, release_columns_).restore(m.releases, staged);
    if (!m.summary.is_null()) write_file_atomically(out_dir / "summary.json", m.summary.dump(2) + "\n");
  });
  store_.remove_temporaries();
  report_.already_complete = true;
  report_.releases_path = (out_dir / "releases.csv").string();
  return false;
}

// A new job's empty start (commit 0) or a resume from the last commit; without checkpoints, a stale
// checkpoint removed (it must not outlive its output).
void Engine::start_checkpoint(const noise::Secret& secret) {
  if (!checkpointing_) {
    if (!options_.write_output) return;
    shuffle::on_all_ranks<CheckpointError>(comm_, [&] {
      if (!root_) return;
      std::error_code ec;
      std::filesystem::remove_all(store_.dir(), ec);
      writer_->start();
    });
    return;
  }
  const auto t0 = Clock::now();
  if (resuming_) {
    resume();
  } else {
    store_.begin(config_.name, identity_, needs_secret() ? &secret : nullptr);
    shuffle::on_all_ranks<CheckpointError>(comm_, [&] {
      if (root_) writer_->start();
    });
    nlohmann::json ledger = nlohmann::json::object();
    if (dp_) ledger = {{"epsilon_per_window", config_.privacy.epsilon}, {"delta_per_window", config_.privacy.delta}};
    if (dp_ && !plan_.private_run) ledger["private"] = false;  // [privacy] seed: a test, no budget spent
    store_.commit_start(root_ ? writer_->committed() : ReleasesExtent{}, ledger);
  }
  users_.journal = keys_.journal = true;
  releaser_->journal_first_tests(true);
  if (root_) store_.set_publisher([this](const std::string& rows) { writer_->append(rows); });
  commits_->figures().load = seconds_since(t0);
}

// Resume: the first trigger after the last commit, this rank's share of the state (re-partitioned
// for another rank count), releases.csv cut back to the commit, the counters, the input skipped to there.
void Engine::resume() {
  const auto& m = store_.manifest();
  const std::uint32_t T = config_.stream.triggers;
  resumed_from_ = static_cast<std::uint32_t>(m.seq);
  start_window_ = m.window_index;
  start_trigger_ = m.next_trigger;
  if (start_trigger_ == T) ++start_window_, start_trigger_ = 0;
  if (root_)
    std::fprintf(stderr,
                 "dpstream: resuming job '%s' from commit %llu (window %u of %u, %u of %u trigger(s) committed), "
                 "written by %d rank(s), on %d rank(s)%s\n",
                 config_.name.c_str(), static_cast<unsigned long long>(m.seq), start_window_ + 1,
                 config_.stream.windows, start_trigger_, T, m.ranks, comm_.size(),
                 m.ranks != comm_.size() ? ": re-partitioning the state" : "");
  if (start_trigger_ != 0) reserve_tables();  // before the state comes in, not after it grew step by step
  const std::string staged = store_.load(users_, keys_, /*window_done=*/start_trigger_ == 0, &resumed_first_tests_);
  shuffle::on_all_ranks<CheckpointError>(comm_, [&] {
    if (root_) writer_->restore(m.releases, staged);
  });
  store_.remove_temporaries();
  counters_.restore(m.counters, root_);
  source_->skip_to(config_.stream.first_window, config_.stream.first_window + start_window_, start_trigger_);
}

}  // namespace dpstream
