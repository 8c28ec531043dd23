#include "src/engine.hpp"

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>

#include "kernels/bounding.hpp"
#include "kernels/key_accumulate.hpp"
#include "kernels/noise.hpp"
#include "kernels/releaser.hpp"
#include "src/csv_input.hpp"
#include "src/bench_result.hpp"
#include "src/durable_io.hpp"
#include "src/fault_injection.hpp"
#include "src/errors.hpp"
#include "src/privacy_plan.hpp"
#include "src/progress.hpp"
#include "src/release_stager.hpp"
#include "src/release_writer.hpp"
#include "src/run_summary.hpp"
#include "src/run_counters.hpp"
#include "src/stop_request.hpp"
#include "src/summary.hpp"
#include "src/trigger_pipeline.hpp"
#include "src/workload.hpp"

namespace dpstream {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Runs `fn` on every rank; if it throws on any rank, all ranks throw E with the first message.
template <class E = InputError, class Fn>
void on_every_rank(const shuffle::Comm& comm, Fn&& fn) {
  shuffle::on_all_ranks<E>(comm, std::forward<Fn>(fn));
}

// A stop signal seen by any rank, agreed by all (one small allgather per trigger).
struct StopAgreement {
  int signal = 0;  // the first rank's signal
  int rank = -1;   // the first rank that received one
};
// One agreement at the end of every trigger: a stop signal seen by any rank, and whether rank 0's
// commit clock has run out (the ranks' clocks differ; rank 0's decides for all).
struct TriggerEnd {
  StopAgreement stop;
  bool commit_due = false;
};
TriggerEnd agree_on_trigger_end(const shuffle::Comm& comm, bool commit_due_on_root) {
  constexpr std::uint64_t kCommitDue = std::uint64_t{1} << 32;  // above any signal number
  const auto seen = comm.allgather(static_cast<std::uint64_t>(stop_request::signal_received()) |
                                   (commit_due_on_root ? kCommitDue : 0));
  TriggerEnd end;
  end.commit_due = (seen.at(0) & kCommitDue) != 0;
  for (std::size_t r = 0; r < seen.size(); ++r)
    if (const auto signal = seen[r] & (kCommitDue - 1); signal != 0) {
      end.stop = {static_cast<int>(signal), static_cast<int>(r)};
      break;
    }
  return end;
}

}  // namespace

RunReport run_job(const JobConfig& job, const shuffle::Comm& comm, const RunOptions& options) {
  JobConfig config = job;  // the windows of a CSV job are resolved from its input below
  const auto run_start = Clock::now();
  const int P = comm.size();
  const bool root = comm.rank() == 0;
  on_every_rank<ConfigError>(comm, [&] { fault::arm_from_environment(comm.rank()); });
  ProgressReporter progress(config, comm, run_start);

  // DP: the plan (refused before any data is read).
  const PrivacyMode mode = config.privacy.mode;
  const bool dp = is_private(mode);  // DP-SQLP or a baseline: a privacy plan and a noise secret
  PrivacyPlan plan;
  on_every_rank<ConfigError>(comm, [&] {
    if (dp) plan = make_privacy_plan(config);
  });

  // Checks that every rank makes on its own before any data moves.
  on_every_rank(comm, [&] {
    if (config.input.kind == InputKind::Csv) check_csv_file(config.input.path);
  });
  const std::filesystem::path out_dir = config.output.dir;

  // Checkpoint: a new job, a resume, or a finished job (docs/CHECKPOINTS.md).
  const bool checkpointing = options.write_output && config.checkpoint.enabled();
  const ReleaseColumns release_columns{config.query.count, config.query.sum};
  if (options.write_output && !checkpointing && options.start_mode == checkpoint::StartMode::Resume)
    throw ConfigError("--resume needs checkpoints: remove [checkpoint] every = 0 (or --set checkpoint.every=1)");
  // Declared before the store: the store's I/O thread publishes through the writer, so the writer
  // must outlive it when an error unwinds the stack.
  std::unique_ptr<ReleaseWriter> writer;
  checkpoint::Store store(out_dir / "checkpoint", comm);
  checkpoint::Fields identity;
  checkpoint::Opened opened;
  RunReport report;
  if (options.write_output) {  // also without checkpoints: never overwrite an unfinished job silently
    std::string input_digest;
    on_every_rank(comm, [&] {
      if (root && config.input.kind == InputKind::Csv) input_digest = checkpoint::file_digest(config.input.path);
    });
    shuffle::broadcast_string(comm, input_digest);
    identity = checkpoint::identity_fields(config, input_digest);
    opened = store.open(config.name, identity, options.start_mode);
    if (root)
      for (const auto& note : opened.notes) std::fprintf(stderr, "dpstream: %s\n", note.c_str());
    if (opened.kind == checkpoint::Opened::Kind::Complete) {
      // The last commit may have been cut short after its manifest: its rows and summary.json
      // are written again (both idempotent).
      kernels::UserState no_users;
      kernels::KeyStateTable no_keys;
      const std::string staged = store.load(no_users, no_keys, /*window_done=*/true);
      on_every_rank<CheckpointError>(comm, [&] {
        if (!root) return;
        const auto& m = store.manifest();
        ReleaseWriter(out_dir, release_columns).restore(m.releases_bytes, staged, m.release_rows);
        if (!m.summary.is_null()) write_file_atomically(out_dir / "summary.json", m.summary.dump(2) + "\n");
      });
      report.already_complete = true;
      report.releases_path = (out_dir / "releases.csv").string();
      return report;
    }
  }
  const bool resuming = opened.kind == checkpoint::Opened::Kind::Resume;

  // The job's secret (DP noise, keyed CSV ids), the same on every rank: the job's own on resume, else
  // from the seed or the OS.
  noise::Secret secret{};
  const bool has_secret = dp || config.input.kind == InputKind::Csv;
  if (has_secret) {
    if (resuming)
      secret = store.secret();
    else if (config.privacy.seed)
      secret = noise::secret_from_seed(*config.privacy.seed);
    else {
      on_every_rank<std::runtime_error>(comm, [&] {
        if (root) secret = noise::secret_from_os();
      });
      comm.broadcast(secret.data(), secret.size());
    }
  }
  const std::unique_ptr<kernels::Releaser> releaser = make_releaser(mode, plan, secret, config.engine.key_scan);

  on_every_rank<ConfigError>(comm, [&] {
    if (!options.write_output || !root) return;
    std::error_code ec;
    std::filesystem::create_directories(out_dir, ec);
    if (ec) throw ConfigError(fmt::format("cannot create output dir {}: {}; set [output] dir or --out", out_dir.string(), ec.message()));
    if (::access(out_dir.c_str(), W_OK) != 0)
      throw ConfigError(fmt::format("output dir {} is not writable; choose a writable [output] dir or --out", out_dir.string()));
    writer = std::make_unique<ReleaseWriter>(out_dir, release_columns, !checkpointing);
  });

  StageTimes stage;
  auto t0 = Clock::now();
  std::unique_ptr<RecordSource> source;
  on_every_rank(comm, [&] {
    if (config.input.kind == InputKind::Csv) {
      IdPrf ids(secret);
      source = std::make_unique<CsvSource>(config, comm.rank(), P, ids);
    } else {
      source = std::make_unique<SyntheticSource>(config, comm.rank(), P);
    }
  });
  if (auto* csv = dynamic_cast<CsvSource*>(source.get())) {
    csv->separate_ids(comm);
    resolve_windows_from_input(config, *csv, comm);
  }
  std::optional<KeyNames> key_names;
  if (source->has_string_keys()) key_names = distribute_key_names(*source, comm);
  std::unique_ptr<ReleaseStager> stager;  // release rows to rank 0 (src/release_stager.hpp)
  if (options.write_output)
    stager = std::make_unique<ReleaseStager>(comm, release_columns, writer.get(), checkpointing, std::move(key_names));
  stage.ingest += seconds_since(t0);

  const kernels::BoundingParams bounding{config.privacy.max_records_per_user, config.privacy.clamp_min,
                                         config.privacy.clamp_max, dp ? plan.sum_quantum : 1,
                                         /*users_per_trigger=*/mode == PrivacyMode::BaselineBatch};
  const std::uint32_t T = config.stream.triggers;
  kernels::UserState users;
  kernels::KeyStateTable keys(/*track_sums=*/config.query.sum);
  RunCounters counters;  // the job's, carried over a resume
  StatePeaks peaks;      // this run's
  const std::uint64_t total_triggers = std::uint64_t{config.stream.windows} * T;

  // Where the stream starts: the beginning, or the first trigger after the last commit.
  std::uint32_t start_window = 0, start_trigger = 0, resumed_from = 0;
  CommitFigures commits;
  if (checkpointing) {
    t0 = Clock::now();
    if (resuming) {
      const auto& m = store.manifest();
      resumed_from = static_cast<std::uint32_t>(m.seq);
      start_window = m.window_index;
      start_trigger = m.next_trigger;
      if (start_trigger == T) ++start_window, start_trigger = 0;
      if (root)
        std::fprintf(stderr,
                     "dpstream: resuming job '%s' from commit %llu (window %u of %u, %u of %u trigger(s) committed), "
                     "written by %d rank(s), on %d rank(s)%s\n",
                     config.name.c_str(), static_cast<unsigned long long>(m.seq), start_window + 1, config.stream.windows,
                     start_trigger, T, m.ranks, P, m.ranks != P ? ": re-partitioning the state" : "");
      const std::string staged = store.load(users, keys, /*window_done=*/start_trigger == 0);
      on_every_rank<CheckpointError>(comm, [&] {
        if (root) writer->restore(m.releases_bytes, staged, m.release_rows);
      });
      counters.restore(m.counters, root);
      source->skip_to(config.stream.first_window, config.stream.first_window + start_window, start_trigger);
    } else {
      store.begin(config.name, identity, has_secret ? &secret : nullptr);
      on_every_rank<CheckpointError>(comm, [&] {
        if (root) writer->start();
      });
      nlohmann::json ledger = nlohmann::json::object();
      if (dp) ledger = {{"epsilon_per_window", config.privacy.epsilon}, {"delta_per_window", config.privacy.delta}};
      store.commit_start(root ? writer->bytes() : 0, ledger);
    }
    users.journal = keys.journal = true;
    if (root) store.set_publisher([&writer](const std::string& rows) { writer->append(rows); });
    commits.load = seconds_since(t0);
  } else if (options.write_output) {
    on_every_rank<CheckpointError>(comm, [&] {
      if (!root) return;
      std::error_code ec;
      std::filesystem::remove_all(store.dir(), ec);  // a stale checkpoint must not outlive its output
      writer->start();
    });
  }
  OPENSSL_cleanse(secret.data(), secret.size());
  std::uint64_t triggers_done = std::uint64_t{start_window} * T + start_trigger;
  progress.start_at(triggers_done);

  // One commit: every rank's state changes since the last one, rank 0's rows, the counters. The
  // files are written in the background; the commit becomes visible during the next trigger.
  auto last_commit = Clock::now();  // the time-based cadence counts from here (rank 0's clock decides)
  auto commit = [&](std::uint32_t wi, std::uint32_t first_trigger, std::uint32_t next_trigger, bool complete) {
    const auto c0 = Clock::now();
    // A window's last commit carries no state: the next window starts empty, and a resume from that
    // commit reads none (Store::load, window_done). Writing it would put the whole window on the
    // critical path of the window's end. Its journal is dropped with the state (or the job ends).
    auto journal = std::make_shared<checkpoint::Journal>();
    if (next_trigger == T) keys.clear_journal();  // frees the change log now; users' marks go with clear()
    else *journal = checkpoint::drain_journal(users, keys);
    commits.journal += seconds_since(c0);
    commits.user_bytes += journal->user_bytes();
    commits.key_bytes += journal->key_bytes();
    std::string rows = root ? writer->take_pending() : std::string();
    commits.release_bytes += rows.size();
    const auto sums = counters.global_sums(comm);
    commits.add(store.commit(std::move(journal), std::move(rows),
                           {wi, first_trigger, next_trigger, complete}, sums, root ? writer->bytes() : 0,
                           root ? writer->rows() : 0));
    ++commits.commits;
    stage.checkpoint += seconds_since(c0);
    last_commit = Clock::now();
  };

  bool final_commit_pending = false;
  std::uint32_t uncommitted_from = start_trigger;  // first trigger of the window not yet committed
  StopAgreement stop;
  TriggerPipeline pipeline(comm, bounding, users, keys, *releaser, counters, stage);
  std::uint32_t stopped_window = 0, stopped_trigger = 0;
  for (std::uint32_t wi = start_window; wi < config.stream.windows && !stop.signal; ++wi) {
    const std::int64_t window = config.stream.first_window + wi;
    // Windows from the input: a window without a record on any rank releases nothing and is skipped.
    // Its triggers count as done, so that the job's last trigger is known as such (no stop agreement there).
    if (config.stream.windows_from_input && wi + 1 < config.stream.windows &&
        comm.max(std::uint64_t{source->has_window(window)}) == 0) {
      triggers_done += T;
      continue;
    }
    releaser->begin_window(window);
    for (std::uint32_t trigger = wi == start_window ? start_trigger : 0; trigger < T; ++trigger) {
      t0 = Clock::now();
      std::vector<Record> local = source->take_trigger(window, trigger);  // cannot fail: input was parsed at ingest
      fault::point("ingest");
      stage.ingest += seconds_since(t0);
      const std::uint64_t local_count = local.size();

      // 1-4. route by user, bound, route by key, accumulate, release (src/trigger_pipeline.hpp).
      const std::vector<KeyRelease> release = pipeline.process(std::move(local), trigger);

      // 5. release rows, staged on rank 0 until their trigger is committed.
      t0 = Clock::now();
      const std::uint64_t released = stager ? stager->stage(release, window, trigger) : 0;
      stage.output += seconds_since(t0);

      ++triggers_done;
      counters.records += local_count;
      const bool window_end = trigger + 1 == T;
      if (window_end) {  // before the window's last commit, which carries these counters
        counters.end_window(window, users, keys, /*count_released=*/dp);
        peaks.observe(users, keys, *releaser);
      }

      // 6. one agreement per trigger (not after the job's last): a stop signal, and rank 0's commit clock.
      const TriggerEnd end = triggers_done < total_triggers
                                 ? agree_on_trigger_end(comm, root && checkpointing &&
                                                                  seconds_since(last_commit) >= config.checkpoint.seconds)
                                 : TriggerEnd{};
      stop = end.stop;

      // 7. checkpoint when `seconds` have passed or every `every` triggers, and at the end of each
      // window; the job's very last commit waits for summary.json.
      bool committed_now = false;
      const bool count_due = config.checkpoint.every && trigger + 1 - uncommitted_from >= *config.checkpoint.every;
      if (checkpointing && (count_due || end.commit_due || window_end)) {
        if (wi + 1 == config.stream.windows && window_end) {
          final_commit_pending = true;
        } else {
          commit(wi, uncommitted_from, trigger + 1, false);
          uncommitted_from = window_end ? 0 : trigger + 1;
          committed_now = true;
        }
      }

      progress.trigger_done(window, trigger, T, local_count, released, triggers_done, total_triggers, dp);

      // 8. a stop signal on any rank: every rank stops after this trigger, which is committed even
      // between two scheduled commits (the job's last trigger simply finishes the job).
      if (stop.signal != 0) {
        if (checkpointing && !committed_now) commit(wi, uncommitted_from, trigger + 1, false);
        stopped_window = wi;
        stopped_trigger = trigger;
        break;
      }
    }
    if (!final_commit_pending && !stop.signal) {
      users.clear();
      keys.clear();
    }
  }
  if (stop.signal) {  // the last commit made durable and visible; no summary.json (the job is unfinished)
    if (checkpointing) commits.add(store.finish());
    report.stop_signal = stop.signal;
    const std::string where =
        fmt::format("after trigger {} of {} in window {} of {}", stopped_trigger + 1, T, stopped_window + 1, config.stream.windows);
    if (checkpointing)
      report.stop_message = fmt::format(
          "dpstream: stopped cleanly on {} (first seen by rank {}) {}; commit {} holds every trigger up to there and "
          "releases.csv its rows; continue with: dpstream run ... --resume (any rank count)",
          stop_request::signal_name(stop.signal), stop.rank, where, store.manifest().seq);
    else
      report.stop_message = fmt::format(
          "dpstream: stopped on {} (first seen by rank {}) {}; checkpoints are off ([checkpoint] every = 0), so "
          "nothing can be resumed and no output was kept",
          stop_request::signal_name(stop.signal), stop.rank, where);
    return report;
  }
  const double wall = seconds_since(run_start);
  const std::uint64_t global_records = comm.sum(counters.records);

  // Run summary (src/run_summary.hpp): sums over ranks, and per-rank figures gathered to every rank.
  nlohmann::json checkpoint_json;
  if (checkpointing) {
    checkpoint_json = commits.json(comm, commits.commits + (final_commit_pending ? 1 : 0));
    checkpoint_json["every"] = config.checkpoint.every ? nlohmann::json(*config.checkpoint.every) : nlohmann::json(nullptr);
    checkpoint_json["seconds"] = config.checkpoint.seconds;
    checkpoint_json["resumed_from_commit"] = resuming ? nlohmann::json(resumed_from) : nlohmann::json(nullptr);
  }
  const RunFigures run{.config = config,
                       .plan = plan,
                       .counters = counters,
                       .peaks = peaks,
                       .stage = stage,
                       .input = source->stats(),
                       .release_rows = writer ? writer->rows() + writer->pending_rows() : 0,
                       .total_triggers = total_triggers,
                       .wall_seconds = wall,
                       .global_records = global_records,
                       .checkpoint = checkpoint_json};
  nlohmann::json j = build_run_summary(run, comm);
  if (options.naive_reference) report.result_line = bench_result_line(run, j, comm);
  report.skipped_rows_message = skipped_rows_message(j["input"], config);
  report.summary_json = j.dump(2);
  report.run_result_line = run_result_line(j);

  // The job's last commit (it keeps the summary), then summary.json: a resume after a crash in
  // between writes the summary from the checkpoint.
  if (final_commit_pending) {
    commit(config.stream.windows - 1, uncommitted_from, T, true);
    users.clear();
    keys.clear();
  }
  if (checkpointing) commits.add(store.finish(j));
  on_every_rank<std::runtime_error>(comm, [&] {
    if (!root || !writer) return;
    if (!checkpointing) writer->append("", /*sync=*/true), writer->finish();
    write_file_atomically(out_dir / "summary.json", report.summary_json + "\n");
    report.releases_path = writer->final_path().string();
  });
  return report;
}

}  // namespace dpstream