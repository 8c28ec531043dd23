// What a run counts: the time per stage, the job's counters (summed over ranks for summary.json and
// carried over a resume through the manifest's "counters"), and the state's size at each window's end.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

#include "kernels/bounding.hpp"
#include "kernels/dp_release.hpp"
#include "kernels/key_accumulate.hpp"
#include "kernels/releaser.hpp"
#include "partition/hash.hpp"
#include "shuffle/comm.hpp"
#include "src/checkpoint.hpp"

namespace dpstream {

// Wall time per stage, summed over triggers (seconds).
struct StageTimes {
  double ingest = 0, partition_user = 0, shuffle_user = 0, bounding = 0, partition_key = 0, shuffle_key = 0,
         accumulate = 0, dp_release = 0, output = 0, checkpoint = 0;
  double engine_path() const;  // the stages of kStages marked engine_path
};

// Every stage by its name in summary.json's stage_seconds_max_over_ranks, in pipeline order. The engine
// path (what `dpstream bench` times) is the stages from the user partition to the release: not reading
// the input, writing the output or checkpointing.
struct Stage {
  const char* name;
  double StageTimes::*seconds;
  bool engine_path;
};
inline constexpr std::array<Stage, 10> kStages = {{{"ingest", &StageTimes::ingest, false},
                                                   {"partition_user", &StageTimes::partition_user, true},
                                                   {"shuffle_user", &StageTimes::shuffle_user, true},
                                                   {"bounding", &StageTimes::bounding, true},
                                                   {"partition_key", &StageTimes::partition_key, true},
                                                   {"shuffle_key", &StageTimes::shuffle_key, true},
                                                   {"accumulate", &StageTimes::accumulate, true},
                                                   {"dp_release", &StageTimes::dp_release, true},
                                                   {"output", &StageTimes::output, false},
                                                   {"checkpoint", &StageTimes::checkpoint, false}}};

inline double StageTimes::engine_path() const {
  double total = 0;
  for (const Stage& s : kStages)
    if (s.engine_path) total += this->*s.seconds;
  return total;
}

// Why a commit was made (docs/CHECKPOINTS.md, "Cadence"; when several hold at once, the first of
// these); the names of summary.json's commits_by_cause.
enum class CommitCause { WindowEnd, Every, Journal, Seconds, Stop, Count };
inline constexpr std::array<const char*, static_cast<std::size_t>(CommitCause::Count)> kCommitCauseNames = {
    "window_end", "every", "journal", "seconds", "stop"};

struct RunCounters {
  kernels::BoundingStats bounding;
  kernels::DpStats dp;
  shuffle::TrafficCounter user_traffic, key_traffic;
  std::uint64_t distinct_users = 0, distinct_keys = 0;  // per window, summed over windows
  std::uint64_t state_digest = 0;                       // sum over windows of the state's digest at the window's end
  std::uint64_t keys_released = 0;  // keys released at least once in their window (KeyState::round > 0)
  std::uint64_t records = 0;        // records this rank read
  // The job's commits by cause, counted on rank 0 only (every rank decides alike), over all its runs.
  std::array<std::uint64_t, static_cast<std::size_t>(CommitCause::Count)> commits_by_cause{};
  std::vector<std::uint64_t>
      visits_per_trigger;  // keys visited by key selection at each trigger of this run (not carried)
  // The CPU this rank's main thread ran on at the start of each bounding batch of this run, counted per CPU
  // (index: sched_getcpu's number; not carried): on a host whose cores differ, which core a rank had.
  std::vector<std::uint64_t> batches_on_cpu;
  void note_cpu(int cpu) {
    if (cpu < 0) return;  // unknown here
    if (static_cast<std::size_t>(cpu) >= batches_on_cpu.size())
      batches_on_cpu.resize(static_cast<std::size_t>(cpu) + 1);
    ++batches_on_cpu[static_cast<std::size_t>(cpu)];
  }

  // f(name, counter) for every carried counter; the names are the manifest's "counters" members.
  template <class F>
  void for_each_carried(F&& f) {
    f("kept", bounding.kept), f("dropped", bounding.dropped), f("clamped", bounding.clamped);
    f("new_users", bounding.new_users);
    f("threshold_tests", dp.tested), f("dp_release_rows", dp.released), f("noise_draws", dp.noise_draws);
    f("keys_visited", dp.visited), f("simulated_steps", dp.simulated), f("scheduled_visits", dp.scheduled);
    f("simulated_steps_bounded", dp.bounded);  // absent from older checkpoints: restored as 0
    f("discarded_visits", dp.discarded), f("predicted_releases", dp.predicted), f("quiet_keys", dp.quiet);
    f("user_shuffle_bytes", user_traffic.bytes_total),
        f("user_shuffle_bytes_to_others", user_traffic.bytes_sent_to_others);
    f("key_shuffle_bytes", key_traffic.bytes_total), f("key_shuffle_bytes_to_others", key_traffic.bytes_sent_to_others);
    f("distinct_users", distinct_users), f("distinct_keys", distinct_keys), f("state_digest", state_digest);
    f("keys_released", keys_released), f("records", records);
    for (std::size_t c = 0; c < commits_by_cause.size(); ++c) f(commit_counter_names[c], commits_by_cause[c]);
  }
  static constexpr std::array<const char*, static_cast<std::size_t>(CommitCause::Count)> commit_counter_names = {
      "commits_window_end", "commits_every", "commits_journal", "commits_seconds", "commits_stop"};

  // At a window's end, before its state is dropped: its distinct users and keys, the state's digest,
  // and (DP modes) the keys released at least once in it (KeyState::round > 0).
  void end_window(std::int64_t window, const kernels::UserState& users, const kernels::KeyStateTable& keys,
                  bool count_released) {
    distinct_users += users.users();
    distinct_keys += keys.keys();
    const auto w = static_cast<std::uint64_t>(window);
    state_digest += users.digest(partition::hash_combine(w, 'U')) + keys.digest(partition::hash_combine(w, 'K'));
    if (count_released)
      keys.for_each([&](std::uint64_t, const kernels::KeyState& st) { keys_released += st.round > 0; });
  }

  // The carried counters summed over ranks (a collective).
  nlohmann::json global_sums(const shuffle::Comm& comm) {
    std::vector<std::uint64_t> local;
    for_each_carried([&](const char*, std::uint64_t v) { local.push_back(v); });
    const auto sums = comm.sum(local);
    nlohmann::json j = nlohmann::json::object();
    std::size_t i = 0;
    for_each_carried([&](const char* name, std::uint64_t) { j[name] = sums[i++]; });
    return j;
  }
  // A resume: the job's sums go to rank 0 (every rank's values are summed again later), 0 elsewhere.
  void restore(const nlohmann::json& j, bool root) {
    for_each_carried([&](const char* name, std::uint64_t& v) {
      v = root && j.contains(name) ? j.at(name).get<std::uint64_t>() : 0;
    });
  }
};

// The state at the end of the window with the most users (keys): a window's state only grows, so
// that is its peak. Figures of this rank.
struct StatePeaks {
  std::uint64_t active_users = 0, user_bytes = 0;
  std::uint64_t keys = 0, key_bytes = 0;  // key table plus the releaser's caches
  std::uint64_t key_table_bytes = 0;      // of key_bytes, the key table's
  std::uint64_t state_bytes = 0;          // users, keys and caches together
  std::uint64_t cached_keys = 0;          // keys with a releaser cache, summed over windows

  void observe(const kernels::UserState& users, const kernels::KeyStateTable& table,
               const kernels::Releaser& releaser) {
    cached_keys += releaser.cached_keys();
    if (users.users() >= active_users) active_users = users.users(), user_bytes = users.memory_bytes();
    const std::uint64_t table_bytes = table.memory_bytes(), kb = table_bytes + releaser.memory_bytes();
    if (table.keys() >= keys) keys = table.keys(), key_bytes = kb, key_table_bytes = table_bytes;
    state_bytes = std::max(state_bytes, users.memory_bytes() + kb);
  }
};

// What this process's commits cost and wrote (summary.json "checkpoint": a resumed run counts its
// own commits only). Seconds on the trigger loop's path (journal, wait, gather) and on the I/O thread.
struct CommitFigures {
  std::uint64_t commits = 0, segment_bytes = 0, user_bytes = 0, key_bytes = 0, release_bytes = 0;
  double load = 0, journal = 0, wait = 0, gather = 0, io_thread = 0, encode = 0, write = 0;

  void add(const checkpoint::CommitStats& cs) {
    wait += cs.wait_seconds, gather += cs.gather_seconds, io_thread += cs.background_seconds;
    encode += cs.encode_seconds, write += cs.write_seconds, segment_bytes += cs.segment_bytes;
  }
  // Sums and maxima over ranks (collectives); `commits` counts the job's last one if still to come.
  nlohmann::json json(const shuffle::Comm& comm, std::uint64_t all_commits) const {
    auto most = [&](double v) { return comm.max(v); };
    return {{"commits", all_commits},
            {"load_seconds_max_over_ranks", most(load)},
            {"seconds_max_over_ranks",
             {{"journal", most(journal)},
              {"wait_for_io", most(wait)},
              {"gather", most(gather)},
              {"io_thread", most(io_thread)},
              {"io_thread_encode", most(encode)},
              {"io_thread_write", most(write)}}},
            {"segment_bytes_written", comm.sum(segment_bytes)},
            // The journals' payload at full width (16 B per user, 12 per pair, 56 per key row), not the
            // bytes on disk: segment_bytes_written counts those (columns are stored narrow).
            {"user_state_bytes_written", comm.sum(user_bytes)},
            {"key_state_bytes_written", comm.sum(key_bytes)},
            {"release_bytes_staged", comm.sum(release_bytes)}};
  }
};

}  // namespace dpstream
