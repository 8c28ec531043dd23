// Engine set-up: everything before the first trigger, in the order the ranks refuse a job (the
// fault plan, the privacy plan, the CSV file, the checkpoint: src/engine_resume.cpp), then the job's
// secret, the output, the input, the state, and a new job's first commit or a resume's state.
#include <fmt/format.h>
#include <openssl/crypto.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "common/elapsed.hpp"
#include "common/fault_injection.hpp"
#include "src/csv_input.hpp"
#include "src/engine.hpp"
#include "src/errors.hpp"
#include "src/ledger.hpp"
#include "src/output_lock.hpp"
#include "src/workload.hpp"

namespace dpstream {

bool Engine::set_up() {
  shuffle::on_all_ranks<ConfigError>(comm_, [&] { fault::arm_from_environment(comm_.rank()); });
  progress_ = std::make_unique<ProgressReporter>(config_, comm_, run_start_);
  shuffle::on_all_ranks<ConfigError>(comm_, [&] {  // DP: the plan, refused before any data is read
    if (dp_) plan_ = make_privacy_plan(config_);
  });
  shuffle::on_all_ranks<InputError>(comm_, [&] {  // checks that every rank makes on its own before any data moves
    if (config_.input.kind == InputKind::Csv) check_csv_file(config_.input.path);
  });
  if (options_.write_output && !checkpointing_ && options_.start_mode == checkpoint::StartMode::Resume)
    throw ConfigError("--resume needs checkpoints: remove [checkpoint] every = 0 (or --set checkpoint.every=1)");
  if (!open_checkpoint()) return false;

  noise::Secret secret = job_secret();
  releaser_ = make_releaser(config_.privacy.mode, plan_, secret, config_.engine.key_scan);
  open_output();
  admit_to_ledger(secret, /*charge=*/false);  // a refusal before the input is read, not after its parse
  open_input(secret);
  create_state();
  // Charged after the output is known to be writable and the input is read (a CSV's parse may take minutes), right
  // before commit 0 stores the secret: a job killed before the charge spent nothing, and one killed after it finds
  // commit 0 moments later and can be resumed. Charged before the input, a kill during the parse spent the charge
  // and left no checkpoint to resume it by.
  fault::point("input_read");
  admit_to_ledger(secret, /*charge=*/true);
  start_checkpoint(secret);
  OPENSSL_cleanse(secret.data(), secret.size());
  triggers_done_ = std::uint64_t{start_window_} * config_.stream.triggers + start_trigger_;
  progress_->start_at(triggers_done_);
  commits_->start_at(start_trigger_);  // the time-based commit cadence counts from here
  return true;
}

// The job's secret (DP noise, keyed CSV ids), the same on every rank: the job's own on resume, else
// from the seed or the OS. Zero for a job that needs none.
noise::Secret Engine::job_secret() const {
  noise::Secret secret{};
  if (!needs_secret()) return secret;
  if (resuming_) return store_.secret();
  if (config_.privacy.seed) return noise::secret_from_seed(*config_.privacy.seed);
  shuffle::on_all_ranks<std::runtime_error>(comm_, [&] {
    if (root_) secret = noise::secret_from_os();
  });
  comm_.broadcast(secret.data(), secret.size());
  return secret;
}

// [privacy] ledger: rank 0 asks for the job's budget on every window it will read, before anything is released or
// committed (src/ledger.hpp); a refusal stops every rank (exit 2) and depends on the ledger and the spec only. The run
// id is a PRF of the secret and the job's identity: a resume (same secret, same identity) is not charged again, a new
// secret is. `charge` false: the same question before the input is read, nothing charged (the ledger may change
// before the charge, which asks again).
void Engine::admit_to_ledger(const noise::Secret& secret, bool charge) {
  if (config_.privacy.ledger.empty()) return;
  shuffle::on_all_ranks<ConfigError>(comm_, [&] {
    ledger::Request request = job_ledger_request(config_, plan_, "");  // its refusals on every rank
    if (!root_) return;
    const auto identity = identity_.empty() ? checkpoint::identity_fields(config_, "") : identity_;
    request.run_id = ledger::run_id(secret.data(), secret.size(), checkpoint::fingerprint(identity));
    if (charge) {
      ledger::charge_or_refuse(config_.privacy.ledger, config_.stream.window_seconds, request, resuming_);
      return;
    }
    const ledger::Admission a =
        ledger::preview_admission(config_.privacy.ledger, config_.stream.window_seconds, request, resuming_);
    if (a.outcome == ledger::Outcome::Refused) throw ConfigError(a.message);
  });
}

// Rank 0's output directory, created and checked before any data is read, and its releases.csv writer.
void Engine::open_output() {
  const std::filesystem::path out_dir = config_.output.dir;
  shuffle::on_all_ranks<ConfigError>(comm_, [&] {
    if (!options_.write_output || !root_) return;
    std::error_code ec;
    std::filesystem::create_directories(out_dir, ec);
    if (ec)
      throw ConfigError(
          fmt::format("cannot create output dir {}: {}; set [output] dir or --out", out_dir.string(), ec.message()));
    refuse_unwritable_dir(out_dir, "choose a writable [output] dir or --out");
    refuse_unwritable_outputs(out_dir);
    writer_ = std::make_unique<ReleaseWriter>(out_dir, release_columns_, !checkpointing_);
  });
}

// What the job will write must be writable before a ledger is charged for it (the charge precedes the job's
// first commit): a releases.csv or summary.json that is not a regular file, or a checkpoint directory the job
// cannot write in, failed only once the budget was spent.
void Engine::refuse_unwritable_outputs(const std::filesystem::path& out_dir) const {
  namespace fs = std::filesystem;
  for (const char* name : {"releases.csv", "summary.json"}) {
    std::error_code ec;
    const fs::path path = out_dir / name;
    const fs::file_status target = fs::status(path, ec);  // a dangling link is replaced like a missing file
    if (fs::exists(target) && !fs::is_regular_file(target))
      throw ConfigError(
          fmt::format("{} is not a regular file, and the job writes its {} there: move it, or choose "
                      "another --out",
                      path.string(), name));
  }
  // A summary.json that no dpstream job wrote is the user's (or the job's own input): it would be replaced.
  std::error_code ec;
  const fs::path summary = out_dir / "summary.json";
  const bool has_summary = fs::is_regular_file(summary, ec);
  const FoundSummary found = has_summary ? read_found_summary(summary) : FoundSummary{};
  if (has_summary && !found.dpstream)
    throw ConfigError(
        fmt::format("{} was not written by a dpstream job (not a JSON object naming its job and its dpstream_version "
                    "or mode and records), and the job would replace it: move it, or choose another --out",
                    summary.string()));
  // A releases.csv beside neither a checkpoint nor a summary.json is no dpstream job's (a finished job leaves its
  // summary.json, a started one its checkpoint, a failed one without checkpoints no releases.csv): it was replaced.
  const bool checkpoint_dir = fs::exists(store_.dir(), ec);
  if (fs::is_regular_file(out_dir / "releases.csv", ec) && !found.dpstream && !checkpoint_dir)
    throw ConfigError(
        fmt::format("{} was not written by a dpstream job (neither checkpoint/ nor a job's summary.json lies "
                    "beside it), and the job would replace it: move it, or choose another --out",
                    (out_dir / "releases.csv").string()));
  // A finished private job's release is replaced by a new one: said here when its checkpoint was deleted or is
  // discarded by --fresh (otherwise the store says so).
  if (found.private_release && (!checkpoint_dir || options_.start_mode == checkpoint::StartMode::Fresh))
    std::fprintf(stderr,
                 "dpstream: warning: %s holds the release of the finished private job '%s' (summary.json): this run "
                 "replaces it by a new one, and releasing the same windows again spends their privacy budget again "
                 "(a [privacy] ledger charges it)\n",
                 terminal_safe(out_dir.string(), false).c_str(), terminal_safe(found.job, false).c_str());
  if (!checkpointing_ || !fs::is_directory(store_.dir(), ec)) return;
  if (::access(store_.dir().c_str(), W_OK | X_OK) != 0) {
    const int err = errno;
    throw ConfigError(
        fmt::format("cannot write in {} ({}), where the job keeps its checkpoint: make it writable, "
                    "or choose another --out",
                    store_.dir().string(), errno_text(err)));
  }
}

// The input (CSV ids keyed by the secret; a CSV job's windows resolved from it), and the names of
// string keys at their owners for the release rows. Counts as ingest time.
void Engine::open_input(const noise::Secret& secret) {
  const auto t0 = Clock::now();
  shuffle::on_all_ranks<InputError>(comm_, [&] {
    if (config_.input.kind == InputKind::Csv) {
      IdPrf ids(secret);
      source_ = std::make_unique<CsvSource>(config_, comm_.rank(), comm_.size(), ids);
    } else {
      source_ = std::make_unique<SyntheticSource>(config_, comm_.rank(), comm_.size());
    }
  });
  if (auto* csv = dynamic_cast<CsvSource*>(source_.get())) {
    csv->separate_ids(comm_);
    resolve_windows_from_input(config_, *csv, comm_);
  }
  std::optional<KeyNames> names;
  if (source_->has_string_keys()) names = distribute_key_names(*source_, comm_);
  if (options_.write_output)
    stager_ = std::make_unique<ReleaseStager>(comm_, release_columns_, writer_.get(), checkpointing_,
                                              config_.stream.triggers, std::move(names));
  stage_.ingest += seconds_since(t0);
}

// The pipeline through the run's state, and the commit scheduler over it.
void Engine::create_state() {
  const kernels::BoundingParams bounding{config_.privacy.max_records_per_user, config_.privacy.clamp_min,
                                         config_.privacy.clamp_max, dp_ ? plan_.sum_quantum : 1,
                                         /*users_per_trigger=*/config_.privacy.mode == PrivacyMode::BaselineBatch};
  total_triggers_ = std::uint64_t{config_.stream.windows} * config_.stream.triggers;
  pipeline_ = std::make_unique<TriggerPipeline>(comm_, bounding, users_, keys_, *releaser_, counters_, stage_);
  commits_ = std::make_unique<CommitScheduler>(config_, comm_, checkpointing_, store_, writer_.get(), users_, keys_,
                                               *releaser_, counters_, stage_);
}

}  // namespace dpstream
