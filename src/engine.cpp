#include "src/engine.hpp"

#include <fmt/format.h>
#include <omp.h>
#include <openssl/crypto.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "common/fault_injection.hpp"
#include "kernels/bounding.hpp"
#include "kernels/key_accumulate.hpp"
#include "kernels/noise.hpp"
#include "kernels/releaser.hpp"
#include "dpstream_version.hpp"
#include "partition/hash.hpp"
#include "partition/partitioner.hpp"
#include "src/csv_input.hpp"
#include "src/durable_io.hpp"
#include "src/errors.hpp"
#include "src/naive_reference.hpp"
#include "src/privacy_plan.hpp"
#include "src/release_writer.hpp"
#include "src/run_counters.hpp"
#include "src/stop_request.hpp"
#include "src/summary.hpp"
#include "src/trigger_pipeline.hpp"
#include "src/workload.hpp"

namespace dpstream {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

using KeyNames = absl::flat_hash_map<std::uint64_t, std::string>;

// Runs `fn` on every rank; if it throws on any rank, all ranks throw E with the first message.
template <class E = InputError, class Fn>
void on_every_rank(const shuffle::Comm& comm, Fn&& fn) {
  shuffle::on_all_ranks<E>(comm, std::forward<Fn>(fn));
}

// String keys: every rank sends (id, name) of the keys it read to the key's owner, which keeps the
// names for output. Ids of distinct names were kept apart at ingest (CsvSource::separate_ids).
KeyNames distribute_key_names(const RecordSource& source, const shuffle::Comm& comm) {
  const int P = comm.size();
  std::vector<shuffle::ByteWriter> out(static_cast<std::size_t>(P));
  for (const auto& [id, name] : source.key_names()) {
    auto& w = out[static_cast<std::size_t>(partition::key_owner(id, P))];
    w.put(id);
    w.put_string(name);
  }
  std::vector<std::byte> send;
  std::vector<std::uint64_t> offsets{0};
  for (auto& w : out) {
    send.insert(send.end(), w.bytes().begin(), w.bytes().end());
    offsets.push_back(send.size());
  }
  std::vector<std::uint64_t> recv_offsets;
  const auto recv = comm.alltoallv_bytes(send.data(), offsets, recv_offsets);
  KeyNames names;
  for (shuffle::ByteReader in(recv.data(), recv.size()); !in.done();) {
    const auto id = in.get<std::uint64_t>();
    names.try_emplace(id, in.get_string());
  }
  return names;
}

// One trigger's rows of releases.csv, on rank 0. Each key owner names, sorts and formats its own rows;
// rank 0 only merges the ranks' sorted runs (by key name, or by key id for integer keys) and copies
// their text. Wire format per rank: row count, per row (sort key, end offset of its line), the text.
struct ReleaseText {
  std::string text;
  std::uint64_t rows = 0;
};
ReleaseText gather_release_text(const std::vector<KeyRelease>& released, const KeyNames* names, std::int64_t window,
                                std::uint32_t trigger, ReleaseColumns columns, const shuffle::Comm& comm) {
  std::vector<ReleaseRow> rows;
  rows.reserve(released.size());
  for (const auto& t : released)
    rows.push_back({t.key, names ? names->at(t.key) : std::to_string(t.key), t.count, t.sum});
  if (names)
    std::sort(rows.begin(), rows.end(), [](const ReleaseRow& a, const ReleaseRow& b) { return a.name < b.name; });
  else
    std::sort(rows.begin(), rows.end(), [](const ReleaseRow& a, const ReleaseRow& b) { return a.key < b.key; });
  std::string text;
  std::vector<std::uint64_t> ends;
  ends.reserve(rows.size());
  format_rows(window, trigger, rows, columns, text, ends);
  shuffle::ByteWriter w;
  w.put(static_cast<std::uint64_t>(rows.size()));
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (names) w.put_string(rows[i].name);
    else w.put(rows[i].key);
    w.put(ends[i]);
  }
  w.put_string(text);
  const auto all = comm.gather_bytes_to_root(w.bytes());
  ReleaseText out;
  if (all.empty()) return out;

  struct Run {  // one rank's sorted rows
    std::vector<std::uint64_t> ids, ends;
    std::vector<std::string> names;
    std::string text;
    std::size_t next = 0;
  };
  std::vector<Run> runs;
  for (shuffle::ByteReader in(all.data(), all.size()); !in.done();) {
    Run r;
    const auto n = in.get<std::uint64_t>();
    for (std::uint64_t i = 0; i < n; ++i) {
      if (names) r.names.push_back(in.get_string());
      else r.ids.push_back(in.get<std::uint64_t>());
      r.ends.push_back(in.get<std::uint64_t>());
    }
    r.text = in.get_string();
    out.rows += n;
    if (n > 0) runs.push_back(std::move(r));
  }
  out.text.reserve([&] {
    std::size_t b = 0;
    for (const auto& r : runs) b += r.text.size();
    return b;
  }());
  auto less = [&](const Run& a, const Run& b) {
    return names ? a.names[a.next] < b.names[b.next] : a.ids[a.next] < b.ids[b.next];
  };
  while (!runs.empty()) {  // P-way merge; P is small, a linear scan picks the smallest head
    std::size_t best = 0;
    for (std::size_t i = 1; i < runs.size(); ++i)
      if (less(runs[i], runs[best])) best = i;
    Run& r = runs[best];
    const std::uint64_t begin = r.next == 0 ? 0 : r.ends[r.next - 1];
    out.text.append(r.text, begin, r.ends[r.next] - begin);
    if (++r.next == r.ends.size()) runs.erase(runs.begin() + static_cast<std::ptrdiff_t>(best));
  }
  return out;
}

std::string human_rate(double per_second) {
  if (per_second >= 1e6) return fmt::format("{:.2f} M", per_second / 1e6);
  if (per_second >= 1e3) return fmt::format("{:.1f} k", per_second / 1e3);
  return fmt::format("{:.0f} ", per_second);
}

// Times the naive single-threaded reference over the whole synthetic stream (rank 0 only).
struct NaiveTiming {
  double seconds = 0;
  std::uint64_t records = 0;
};
NaiveTiming time_naive_reference(const JobConfig& config) {
  SyntheticSource all(config, 0, 1);
  NaiveReference naive(config.privacy.max_records_per_user, config.privacy.clamp_min, config.privacy.clamp_max);
  NaiveTiming t;
  for (std::uint32_t w = 0; w < config.stream.windows; ++w) {
    const std::int64_t window = config.stream.first_window + w;
    naive.begin_window();
    for (std::uint32_t i = 0; i < config.stream.triggers; ++i) {
      auto records = all.take_trigger(window, i);
      t.records += records.size();
      const auto t0 = Clock::now();
      naive.process(std::move(records));
      t.seconds += seconds_since(t0);
    }
  }
  return t;
}

// Keys visited by key selection per trigger, summed over ranks: the mean over the job's triggers
// (carried over a resume) and the most at one trigger this run processed.
nlohmann::json visits_json(const shuffle::Comm& comm, std::uint64_t visited, const std::vector<std::uint64_t>& per_trigger,
                           std::uint64_t triggers) {
  const auto global = comm.sum(per_trigger);
  const std::uint64_t most = global.empty() ? 0 : *std::max_element(global.begin(), global.end());
  return {{"mean", static_cast<double>(comm.sum(visited)) / static_cast<double>(std::max<std::uint64_t>(1, triggers))},
          {"max", most}};
}

// One line on stderr when input rows were skipped (bad_rows = "skip"), counted by kind.
std::string skipped_rows_message(const nlohmann::json& input, const JobConfig& config) {
  const auto n = [&](const char* kind) { return input.at(kind).get<std::uint64_t>(); };
  const std::uint64_t malformed = n("malformed"), non_finite = n("non_finite"), outside = n("out_of_window");
  if (malformed + non_finite + outside == 0) return {};
  return fmt::format(
      "dpstream: skipped {} of {} input rows: {} malformed, {} non-finite value, {} outside the job's windows {}..{}{} "
      "(summary.json \"input\")",
      malformed + non_finite + outside, n("rows_read"), malformed, non_finite, outside, config.stream.first_window,
      config.stream.first_window + config.stream.windows - 1,
      outside && !config.stream.windows_from_input ? "; leave out [stream] first_window and windows to process every window of the input" : "");
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
  // Decided on rank 0 (whose terminal it is) and shared, because the progress count is a collective.
  const bool progress =
      comm.max(std::uint64_t{root && (config.output.progress == ProgressMode::Always ||
                                      (config.output.progress == ProgressMode::Auto && ::isatty(STDERR_FILENO)))}) != 0;

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
  KeyNames key_names;
  if (source->has_string_keys()) key_names = distribute_key_names(*source, comm);
  const KeyNames* names = source->has_string_keys() ? &key_names : nullptr;
  stage.ingest += seconds_since(t0);

  const kernels::BoundingParams bounding{config.privacy.max_records_per_user, config.privacy.clamp_min,
                                         config.privacy.clamp_max, dp ? plan.sum_quantum : 1,
                                         /*users_per_trigger=*/mode == PrivacyMode::BaselineBatch};
  const std::uint32_t T = config.stream.triggers;
  kernels::UserState users;
  kernels::KeyStateTable keys(/*track_sums=*/config.query.sum);
  RunCounters counters;  // the job's, carried over a resume
  StatePeaks peaks;      // this run's
  std::uint64_t global_records = 0;
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
  const std::uint64_t triggers_at_start = triggers_done;

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
      std::uint64_t released = 0;
      if (options.write_output) {
        const auto rows = gather_release_text(release, names, window, trigger, release_columns, comm);
        if (root) {
          writer->stage_text(rows.text, rows.rows);
          if (!checkpointing) writer->append(writer->take_pending(), /*sync=*/false);
        }
        released = rows.rows;
        fault::point("output");
      }
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

      if (progress) {
        global_records += comm.sum(local_count);
        const double elapsed = seconds_since(run_start);
        const double done_here = static_cast<double>(triggers_done - triggers_at_start);
        const double remaining = elapsed / std::max(done_here, 1.0) * static_cast<double>(total_triggers - triggers_done);
        if (root)
          std::fprintf(stderr, "[window %lld trigger %u/%u] %srecords/s, %llu %s, elapsed %.1f s, ETA %.1f s\n",
                     static_cast<long long>(window), trigger + 1, T,
                     human_rate(static_cast<double>(global_records) / std::max(elapsed, 1e-9)).c_str(),
                     static_cast<unsigned long long>(released), dp ? "keys released" : "keys changed", elapsed, remaining);
      }

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
  global_records = comm.sum(counters.records);

  // Run summary: sums over ranks, and per-rank figures gathered to every rank.
  const InputStats& in = source->stats();
  nlohmann::json j;
  j["job"] = config.name;
  j["dpstream_version"] = {{"version", kVersion}, {"commit", kGitCommit}};
  j["spec"] = config.source;
  j["mode"] = to_string(mode);
  // How a run's rows make its histogram at a trigger (dpstream evaluate): each row replaces the key's
  // value, or (per-batch baseline) adds to it.
  j["release_values"] = mode == PrivacyMode::BaselineBatch ? "increments" : "running";
  j["private"] = dp && plan.private_run;
  if (dp) {
    j["privacy"] = budget_json(plan, false);
    j["threshold_proven"] = plan.threshold == ThresholdTail::Subgaussian;
    j["dp"] = {{"threshold_tests", comm.sum(counters.dp.tested)},
               {"release_rows", comm.sum(counters.dp.released)},
               {"keys_released", comm.sum(counters.keys_released)},
               {"noise_draws", comm.sum(counters.dp.noise_draws)},
               {"key_scan", to_string(config.engine.key_scan)},
               {"keys_visited_per_trigger", visits_json(comm, counters.dp.visited, counters.visits_per_trigger, total_triggers)},
               {"simulated_steps", comm.sum(counters.dp.simulated)},
               {"scheduled_visits", comm.sum(counters.dp.scheduled)},
               {"discarded_visits", comm.sum(counters.dp.discarded)},
               {"predicted_releases", comm.sum(counters.dp.predicted)},
               {"keys_with_noise_cache", comm.sum(peaks.cached_keys)},
               {"key_state_bytes_per_tracked_key",
                static_cast<double>(comm.sum(peaks.key_bytes)) /
                    std::max<double>(1.0, static_cast<double>(comm.sum(peaks.keys)))}};
  }
  j["ranks"] = P;
  j["threads_per_rank"] = omp_get_max_threads();
  j["input"] = {{"kind", to_string(config.input.kind)},
                {"rows_read", comm.sum(in.rows)},
                {"malformed", comm.sum(in.malformed)},
                {"non_finite", comm.sum(in.non_finite)},
                {"out_of_window", comm.sum(in.out_of_window)}};
  const std::uint64_t kept = comm.sum(counters.bounding.kept), dropped = comm.sum(counters.bounding.dropped);
  j["records"] = {{"read", comm.sum(in.rows)},
                  {"accepted", kept + dropped},
                  {"kept", kept},
                  {"dropped_by_bounding", dropped},
                  {"clamped", comm.sum(counters.bounding.clamped)},
                  {"bad_rows", comm.sum(in.malformed + in.non_finite + in.out_of_window)}};  // all kinds, see "input"
  j["distinct_users"] = comm.sum(counters.distinct_users);
  j["distinct_keys"] = comm.sum(counters.distinct_keys);
  j["state_digest"] = fmt::format("{:016x}", comm.sum(counters.state_digest));
  j["triggers"] = total_triggers;
  j["release_rows"] = writer ? writer->rows() + writer->pending_rows() : 0;
  auto stage_max = [&](double v) { return comm.max(v); };
  j["stage_seconds_max_over_ranks"] = {{"ingest", stage_max(stage.ingest)},
                                       {"partition_user", stage_max(stage.partition_user)},
                                       {"shuffle_user", stage_max(stage.shuffle_user)},
                                       {"bounding", stage_max(stage.bounding)},
                                       {"partition_key", stage_max(stage.partition_key)},
                                       {"shuffle_key", stage_max(stage.shuffle_key)},
                                       {"accumulate", stage_max(stage.accumulate)},
                                       {"dp_release", stage_max(stage.dp_release)},
                                       {"output", stage_max(stage.output)},
                                       {"checkpoint", stage_max(stage.checkpoint)}};
  if (checkpointing) {
    j["checkpoint"] = commits.json(comm, commits.commits + (final_commit_pending ? 1 : 0));
    j["checkpoint"]["every"] = config.checkpoint.every ? nlohmann::json(*config.checkpoint.every) : nlohmann::json(nullptr);
    j["checkpoint"]["seconds"] = config.checkpoint.seconds;
    j["checkpoint"]["resumed_from_commit"] = resuming ? nlohmann::json(resumed_from) : nlohmann::json(nullptr);
  }
  const double engine_seconds = stage_max(stage.engine_path());
  j["engine_path_seconds"] = engine_seconds;
  j["wall_seconds"] = stage_max(wall);
  j["records_per_second"] = static_cast<double>(global_records) / std::max(stage_max(wall), 1e-9);
  j["engine_records_per_second"] = static_cast<double>(global_records) / std::max(engine_seconds, 1e-9);
  const double per_record = 1.0 / std::max<double>(1.0, static_cast<double>(global_records));
  j["shuffle_bytes_per_record"] = {
      {"user_shuffle_total", static_cast<double>(comm.sum(counters.user_traffic.bytes_total)) * per_record},
      {"user_shuffle_to_other_ranks", static_cast<double>(comm.sum(counters.user_traffic.bytes_sent_to_others)) * per_record},
      {"key_shuffle_total", static_cast<double>(comm.sum(counters.key_traffic.bytes_total)) * per_record},
      {"key_shuffle_to_other_ranks", static_cast<double>(comm.sum(counters.key_traffic.bytes_sent_to_others)) * per_record}};
  j["peak_rss_bytes_per_rank"] = comm.allgather(peak_rss_bytes());
  j["peak_state_bytes_per_rank"] = comm.allgather(peaks.state_bytes);
  // Bytes of state per active user (kept counts and first-touch pairs) and per tracked key (totals,
  // round state and, in mode dp, the noise cache), summed over ranks and divided by the global count.
  auto per = [&](std::uint64_t bytes, std::uint64_t count) {
    return static_cast<double>(comm.sum(bytes)) / std::max<double>(1.0, static_cast<double>(comm.sum(count)));
  };
  j["state_bytes_per_active_user"] = per(peaks.user_bytes, peaks.active_users);
  j["key_state_bytes_per_tracked_key"] = per(peaks.key_bytes, peaks.keys);
  // Ranks x threads above this node's online CPUs: timings then show volume, not speed.
  j["oversubscribed"] = P * omp_get_max_threads() > static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));

  if (options.naive_reference) {
    NaiveTiming naive;
    if (root) naive = time_naive_reference(config);
    const double naive_rate = static_cast<double>(naive.records) / std::max(naive.seconds, 1e-9);
    const double engine_rate = j["engine_records_per_second"].get<double>();
    const int cores = P * omp_get_max_threads();
    report.result_line = fmt::format(
        "RESULT job={} ranks={} threads={} records={} engine_seconds={:.3f} engine_records_per_s={:.0f} "
        "engine_records_per_s_per_core={:.0f} naive_records_per_s={:.0f} speedup_vs_naive={:.2f} "
        "user_shuffle_bytes_per_record={:.2f} key_shuffle_bytes_per_record={:.2f} peak_rss_mb_max={:.1f} "
        "state_mb_max={:.1f} oversubscribed={}",
        config.name, P, omp_get_max_threads(), global_records, engine_seconds, engine_rate, engine_rate / cores, naive_rate,
        engine_rate / std::max(naive_rate, 1e-9), j["shuffle_bytes_per_record"]["user_shuffle_total"].get<double>(),
        j["shuffle_bytes_per_record"]["key_shuffle_total"].get<double>(),
        static_cast<double>(comm.max(peak_rss_bytes())) / 1048576.0, static_cast<double>(comm.max(peaks.state_bytes)) / 1048576.0,
        j["oversubscribed"].get<bool>() ? "yes" : "no");
    j["naive_records_per_second"] = naive_rate;
  }
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