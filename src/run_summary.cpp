#include "src/run_summary.hpp"

#include <fmt/format.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/bounded_json.hpp"
#include "dpstream_version.hpp"
#include "kernels/aes_blocks.hpp"
#include "src/durable_io.hpp"
#include "src/summary.hpp"

namespace dpstream {

namespace {

// Keys visited by key selection per trigger, summed over ranks: the mean over the job's triggers
// (carried over a resume) and the most at one trigger this run processed.
nlohmann::json visits_json(const shuffle::Comm& comm, std::uint64_t visited,
                           const std::vector<std::uint64_t>& per_trigger, std::uint64_t triggers) {
  const auto global = comm.sum(per_trigger);
  const std::uint64_t most = global.empty() ? 0 : *std::max_element(global.begin(), global.end());
  return {{"mean", static_cast<double>(comm.sum(visited)) / static_cast<double>(std::max<std::uint64_t>(1, triggers))},
          {"max", most}};
}

// Sum over ranks of `bytes` divided by the sum of `count` (at least 1).
double per_unit(const shuffle::Comm& comm, std::uint64_t bytes, std::uint64_t count) {
  return static_cast<double>(comm.sum(bytes)) / std::max<double>(1.0, static_cast<double>(comm.sum(count)));
}

// The job, its mode and (private modes) its accounting and the key-selection figures.
void add_job_and_privacy(nlohmann::json& j, const RunFigures& run, const shuffle::Comm& comm) {
  const JobConfig& config = run.config;
  const PrivacyMode mode = config.privacy.mode;
  const bool dp = is_private(mode);
  j["job"] = config.name;
  j["dpstream_version"] = {{"version", kVersion}, {"commit", kGitCommit}};
  j["spec"] = config.source;
  j["mode"] = to_string(mode);
  // How a run's rows make its histogram at a trigger (dpstream evaluate): each row replaces the key's
  // value, or (per-batch baseline) adds to it.
  j["release_values"] = mode == PrivacyMode::BaselineBatch ? "increments" : "running";
  j["private"] = dp && run.plan.private_run;
  if (!dp) return;
  const RunCounters& c = run.counters;
  j["privacy"] = budget_json(run.plan, false);
  j["threshold_proven"] = run.plan.threshold == ThresholdTail::Subgaussian;
  j["dp"] = {{"threshold_tests", comm.sum(c.dp.tested)},
             {"release_rows", comm.sum(c.dp.released)},
             {"keys_released", comm.sum(c.keys_released)},
             {"noise_draws", comm.sum(c.dp.noise_draws)},
             {"key_scan", to_string(config.engine.key_scan)},
             {"keys_visited_per_trigger", visits_json(comm, c.dp.visited, c.visits_per_trigger, run.total_triggers)},
             {"simulated_steps", comm.sum(c.dp.simulated)},
             {"simulated_steps_bounded", comm.sum(c.dp.bounded)},
             {"scheduled_visits", comm.sum(c.dp.scheduled)},
             {"discarded_visits", comm.sum(c.dp.discarded)},
             {"predicted_releases", comm.sum(c.dp.predicted)},
             {"quiet_keys", comm.sum(c.dp.quiet)},
             {"keys_with_noise_cache", comm.sum(run.peaks.cached_keys)},
             {"key_state_bytes_per_tracked_key", per_unit(comm, run.peaks.key_bytes, run.peaks.keys)},
             // Its parts: the key table (totals and round state) and key selection's and the value
             // counters' noise caches (derivable state, kernels/selection_cache.hpp).
             {"key_state_bytes_per_tracked_key_parts",
              {{"key_table", per_unit(comm, run.peaks.key_table_bytes, run.peaks.keys)},
               {"noise_caches", per_unit(comm, run.peaks.key_bytes - run.peaks.key_table_bytes, run.peaks.keys)}}}};
}

// Input rows by kind, records through bounding, distinct users and keys, the state's digest.
void add_counts(nlohmann::json& j, const RunFigures& run, const shuffle::Comm& comm) {
  const InputStats& in = run.input;
  const RunCounters& c = run.counters;
  j["input"] = {{"kind", to_string(run.config.input.kind)},
                {"rows_read", comm.sum(in.rows)},
                {"malformed", comm.sum(in.malformed)},
                {"non_finite", comm.sum(in.non_finite)},
                {"out_of_window", comm.sum(in.out_of_window)}};
  const std::uint64_t kept = comm.sum(c.bounding.kept), dropped = comm.sum(c.bounding.dropped);
  j["records"] = {{"read", comm.sum(in.rows)},
                  {"accepted", kept + dropped},
                  {"kept", kept},
                  {"dropped_by_bounding", dropped},
                  {"clamped", comm.sum(c.bounding.clamped)},
                  {"bad_rows", comm.sum(in.malformed + in.non_finite + in.out_of_window)}};  // all kinds, see "input"
  j["distinct_users"] = comm.sum(c.distinct_users);
  j["distinct_keys"] = comm.sum(c.distinct_keys);
  j["state_digest"] = fmt::format("{:016x}", comm.sum(c.state_digest));
  j["triggers"] = run.total_triggers;
  j["triggers_per_bounding_batch"] = run.config.engine.triggers_per_batch(run.config.stream.triggers);
  j["release_rows"] = run.release_rows;
}

// Per rank, the CPU its main thread began most of its bounding batches on (-1: none known) and their share:
// ranks that are not bound move between CPUs, and on a host whose cores run at different speeds the rank on
// the slower one sets every stage's maximum.
void add_cpus(nlohmann::json& j, const std::vector<std::uint64_t>& batches_on_cpu, const shuffle::Comm& comm) {
  const auto most = std::max_element(batches_on_cpu.begin(), batches_on_cpu.end());
  const std::uint64_t total = std::accumulate(batches_on_cpu.begin(), batches_on_cpu.end(), std::uint64_t{0});
  // note_cpu only grows the counts to a CPU it counts, so a non-empty vector's largest count is at least 1.
  const std::uint64_t cpu =
      most == batches_on_cpu.end() ? ~std::uint64_t{0} : static_cast<std::uint64_t>(most - batches_on_cpu.begin());
  // The share in millionths: the allgather carries integers.
  const std::uint64_t share =
      total == 0
          ? 0
          : static_cast<std::uint64_t>(std::llround(1e6 * static_cast<double>(*most) / static_cast<double>(total)));
  nlohmann::json cpus = nlohmann::json::array(), shares = nlohmann::json::array();
  for (const std::uint64_t c : comm.allgather(cpu))
    cpus.push_back(c == ~std::uint64_t{0} ? -1 : static_cast<std::int64_t>(c));
  for (const std::uint64_t s : comm.allgather(share)) shares.push_back(static_cast<double>(s) / 1e6);
  j["main_cpu_per_rank"] = {{"cpu", cpus}, {"share_of_batches", shares}};
}

// Stage seconds (max over ranks), checkpoint costs, throughput and shuffle volume.
void add_times(nlohmann::json& j, const RunFigures& run, const shuffle::Comm& comm) {
  const StageTimes& stage = run.stage;
  auto stage_max = [&](double v) { return comm.max(v); };
  nlohmann::json& seconds = j["stage_seconds_max_over_ranks"];
  for (const Stage& s : kStages) seconds[s.name] = stage_max(stage.*s.seconds);
  if (!run.checkpoint.is_null()) j["checkpoint"] = run.checkpoint;
  const double engine_seconds = stage_max(stage.engine_path());
  const auto records = static_cast<double>(run.global_records);
  j["engine_path_seconds"] = engine_seconds;
  j["wall_seconds"] = stage_max(run.wall_seconds);
  // Per rank: its wall and its seconds inside collectives (waiting for the slowest rank, moving data):
  // a rank that spends much longer there than the others computed less (load imbalance).
  const auto per_rank = [&](double value) {
    std::vector<double> out;
    for (const std::uint64_t us : comm.allgather(static_cast<std::uint64_t>(std::llround(value * 1e6))))
      out.push_back(static_cast<double>(us) * 1e-6);
    return out;
  };
  j["seconds_per_rank"] = {{"wall", per_rank(run.wall_seconds)}, {"in_collectives", per_rank(run.collective_seconds)}};
  // Synchronizations of all ranks per trigger: each one waits for the slowest rank (a batch of triggers
  // shares its exchanges and agreements, [engine] trigger_batch).
  const std::uint64_t calls = comm.max(run.collective_calls);
  j["collective_calls"] = calls;
  j["collective_calls_per_trigger"] =
      static_cast<double>(calls) / static_cast<double>(std::max<std::uint64_t>(1, run.triggers_run));
  // Which cipher code computed the noise PRF's blocks (the same blocks either way; the speed differs).
  const std::uint64_t vaes = comm.sum(noise::Aes256Blocks::best_engine() == noise::Aes256Blocks::Engine::Vaes512);
  j["noise_cipher_ranks"] = {{"vaes512", vaes}, {"openssl", static_cast<std::uint64_t>(comm.size()) - vaes}};
  // Each stage per rank: which rank's work the others wait for (a stage's maximum alone does not say).
  nlohmann::json& stages = j["seconds_per_rank"]["stages"];
  for (const Stage& s : kStages) stages[s.name] = per_rank(stage.*s.seconds);
  add_cpus(j, run.counters.batches_on_cpu, comm);
  j["records_per_second"] = records / std::max(stage_max(run.wall_seconds), 1e-9);
  j["engine_records_per_second"] = records / std::max(engine_seconds, 1e-9);
  const double per_record = 1.0 / std::max<double>(1.0, records);
  const RunCounters& c = run.counters;
  j["shuffle_bytes_per_record"] = {
      {"user_shuffle_total", static_cast<double>(comm.sum(c.user_traffic.bytes_total)) * per_record},
      {"user_shuffle_to_other_ranks", static_cast<double>(comm.sum(c.user_traffic.bytes_sent_to_others)) * per_record},
      {"key_shuffle_total", static_cast<double>(comm.sum(c.key_traffic.bytes_total)) * per_record},
      {"key_shuffle_to_other_ranks", static_cast<double>(comm.sum(c.key_traffic.bytes_sent_to_others)) * per_record}};
}

// Peak memory per rank and the state's bytes per user and per key.
void add_memory(nlohmann::json& j, const RunFigures& run, const shuffle::Comm& comm) {
  const StatePeaks& peaks = run.peaks;
  j["peak_rss_bytes_per_rank"] = comm.allgather(peak_rss_bytes());
  j["peak_state_bytes_per_rank"] = comm.allgather(peaks.state_bytes);
  // Bytes of state per active user (kept counts and first-touch pairs) and per tracked key (totals,
  // round state and, in mode dp, the noise cache), summed over ranks and divided by the global count.
  j["state_bytes_per_active_user"] = per_unit(comm, peaks.user_bytes, peaks.active_users);
  j["key_state_bytes_per_tracked_key"] = per_unit(comm, peaks.key_bytes, peaks.keys);
  // Ranks x threads above this node's online CPUs: timings then show volume, not speed.
  j["oversubscribed"] =
      comm.size() * omp_get_max_threads() > static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
}

}  // namespace

nlohmann::json build_run_summary(const RunFigures& run, const shuffle::Comm& comm) {
  nlohmann::json j;
  add_job_and_privacy(j, run, comm);
  j["ranks"] = comm.size();
  j["threads_per_rank"] = omp_get_max_threads();
  add_counts(j, run, comm);
  add_times(j, run, comm);
  add_memory(j, run, comm);
  return j;
}

FoundSummary read_found_summary(const std::filesystem::path& path) {
  constexpr std::uintmax_t kMaxSummaryBytes = std::uintmax_t{64} << 20;  // a job's summary is kilobytes
  FoundSummary found;
  try {
    if (std::filesystem::file_size(path) > kMaxSummaryBytes) return found;
    const auto bytes = read_file_bytes(path);
    const auto j = parse_bounded_json({reinterpret_cast<const char*>(bytes.data()), bytes.size()});
    // dpstream_version since 2026-11-23; before, the job's name with its mode and record counts.
    const auto has = [&](const char* key, bool (nlohmann::json::*is)() const noexcept) {
      return j.contains(key) && (j.at(key).*is)();
    };
    if (!j.is_object() || !has("job", &nlohmann::json::is_string) ||
        !(has("dpstream_version", &nlohmann::json::is_object) ||
          (has("mode", &nlohmann::json::is_string) && has("records", &nlohmann::json::is_object))))
      return found;
    found.job = j.at("job").get<std::string>();
    found.private_release = j.contains("private") && j.at("private").is_boolean() && j.at("private").get<bool>();
    found.dpstream = true;
  } catch (const std::exception&) {  // unreadable, not JSON, nested too deep: not a summary a job wrote
  }
  return found;
}

std::string skipped_rows_message(const nlohmann::json& input, const JobConfig& config) {
  const auto n = [&](const char* kind) { return input.at(kind).get<std::uint64_t>(); };
  const std::uint64_t malformed = n("malformed"), non_finite = n("non_finite"), outside = n("out_of_window");
  if (malformed + non_finite + outside == 0) return {};
  return fmt::format(
      "dpstream: skipped {} of {} input rows: {} malformed, {} non-finite value, {} outside the job's windows {}..{}{} "
      "(summary.json \"input\")",
      malformed + non_finite + outside, n("rows_read"), malformed, non_finite, outside, config.stream.first_window,
      config.stream.first_window + config.stream.windows - 1,
      !outside || config.stream.windows_from_input ? ""
      : config.privacy.ledger.empty()
          ? "; leave out [stream] first_window and windows to process every window of the input"
          // A ledger job declares its windows (they are charged before the data is seen): name the others instead.
          : "; a ledger job must declare its windows: set [stream] first_window and windows to the ones to charge");
}

}  // namespace dpstream
