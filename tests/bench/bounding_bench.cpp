// Bounding alone, on one core, repeated: the kernel's cost per record without MPI, the other stages or
// the host's run-to-run drift in one figure. It generates the first window of a job's synthetic stream
// once, keeps the records of the users that rank 0 of `ranks` would own (what bounding sees there after
// the user shuffle), then bounds the window `repeats` times from an empty user table reserved as the
// engine reserves it (journal off: the engine turns it on only when it checkpoints), in the engine's
// batches of triggers ([engine] trigger_batch; 20 a batch at T = 1000), and prints the minimum and the
// median over the repeats (the minimum is the least disturbed by other work on a shared host; compare
// binaries by it, alternating). Every repeat must leave the same state and partials.
//
//   bench_bounding JOB.toml [--set section.key=value ...] [--ranks P] [--repeats R]
#include <fmt/format.h>
#include <omp.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/record.hpp"
#include "kernels/bounding.hpp"
#include "partition/hash.hpp"
#include "src/config.hpp"
#include "src/workload.hpp"
#include "tests/bench/repeat_stats.hpp"

namespace {

using dpstream::Record;
namespace kernels = dpstream::kernels;

struct Args {
  std::string job;
  std::vector<std::string> overrides;
  int ranks = 2;
  int repeats = 7;
};

// The job's first window as rank 0 of `ranks` bounds it: its users' records trigger by trigger, and the
// window's users and kept records, which size the user table as the engine sizes it (src/engine.cpp).
struct Window {
  std::vector<std::vector<Record>> triggers;
  std::uint64_t users = 0, kept_records = 0;
};

Window owned_window(const dpstream::JobConfig& config, int ranks) {
  dpstream::SyntheticSource source(config, 0, 1);
  Window w{std::vector<std::vector<Record>>(source.triggers_per_window()), source.users_per_window() / ranks,
           source.kept_records_per_window() / ranks};
  for (std::uint32_t t = 0; t < w.triggers.size(); ++t)
    for (const Record& r : source.take_trigger(config.stream.first_window, t))
      if (dpstream::partition::user_owner(r.user, ranks) == 0) w.triggers[t].push_back(r);
  return w;
}

// What a repeat leaves: its counts, the user state's digest and an order-free hash of its partials.
struct Outcome {
  kernels::BoundingStats stats;
  std::uint64_t partials = 0, partials_hash = 0, state_digest = 0;
  bool operator==(const Outcome& o) const {
    return stats.kept == o.stats.kept && stats.dropped == o.stats.dropped && stats.clamped == o.stats.clamped &&
           stats.new_users == o.stats.new_users && partials == o.partials && partials_hash == o.partials_hash &&
           state_digest == o.state_digest;
  }
};

std::uint64_t partial_hash(const dpstream::KeyPartial& p) {
  using dpstream::partition::hash_combine;
  return hash_combine(
      hash_combine(hash_combine(p.key, static_cast<std::uint64_t>(p.count)), static_cast<std::uint64_t>(p.sum)),
      static_cast<std::uint64_t>(p.new_users));
}

}  // namespace

int main(int argc, char** argv) try {
  Args args;
  CLI::App app{"Bounding alone on one core, repeated: minimum and median ns per record"};
  app.add_option("job", args.job, "Job spec (TOML) with synthetic input, e.g. jobs/paper-workload.toml")->required();
  app.add_option("--set", args.overrides, "Override a job key: --set section.key=value (repeatable)");
  app.add_option("--ranks", args.ranks, "Bound the share of rank 0 of this many ranks")->check(CLI::Range(1, 1 << 20));
  app.add_option("--repeats", args.repeats, "Repeats of the whole window")->check(CLI::Range(1, 1 << 20));
  CLI11_PARSE(app, argc, argv);
  const dpstream::JobConfig config = dpstream::load_job(args.job, args.overrides);
  if (config.input.kind != dpstream::InputKind::Synthetic)
    throw std::invalid_argument("bench_bounding needs a synthetic job ([input] kind = \"synthetic\")");
  omp_set_num_threads(1);
  const Window window = owned_window(config, args.ranks);
  std::uint64_t records = 0;
  for (const auto& t : window.triggers) records += t.size();
  const kernels::BoundingParams params{config.privacy.max_records_per_user, config.privacy.clamp_min,
                                       config.privacy.clamp_max};
  const std::size_t batch = config.engine.triggers_per_batch(static_cast<std::uint32_t>(window.triggers.size()));
  std::vector<double> ns_per_record;
  double fastest = 0;
  Outcome first;
  for (int r = 0; r < args.repeats; ++r) {
    kernels::UserState state;
    state.reserve(window.users, window.kept_records);
    Outcome out;
    std::chrono::duration<double, std::nano> elapsed{0};  // the kernel's calls only
    for (std::size_t first_trigger = 0; first_trigger < window.triggers.size(); first_trigger += batch) {
      std::vector<std::span<const Record>> triggers;
      for (std::size_t t = first_trigger; t < std::min(window.triggers.size(), first_trigger + batch); ++t)
        triggers.emplace_back(window.triggers[t]);
      const auto t0 = std::chrono::steady_clock::now();
      const auto partials = kernels::bound_and_aggregate_batch(triggers, params, state, out.stats);
      elapsed += std::chrono::steady_clock::now() - t0;
      for (const auto& trigger_partials : partials) {
        out.partials += trigger_partials.size();
        for (const auto& p : trigger_partials) out.partials_hash += partial_hash(p);
      }
    }
    out.state_digest = state.digest(1);
    ns_per_record.push_back(elapsed.count() / static_cast<double>(std::max<std::uint64_t>(records, 1)));
    fastest = r == 0 ? ns_per_record.back() : std::min(fastest, ns_per_record.back());
    if (r == 0) first = out;
    if (!(out == first))
      throw std::logic_error(fmt::format(
          "repeat {} left other state or partials than the first: kept {} / {}, "
          "partials {} / {}, state digest {:016x} / {:016x}",
          r, out.stats.kept, first.stats.kept, out.partials, first.partials, out.state_digest, first.state_digest));
  }
  fmt::print(
      "RESULT bench=bounding records={} triggers={} trigger_batch={} kept={} partials={} repeats={} "
      "ns_per_record_min={:.1f} ns_per_record_median={:.1f} records_per_s_min_time={:.0f}\n",
      records, window.triggers.size(), batch, first.stats.kept, first.partials, args.repeats, fastest,
      dpstream::bench::median(ns_per_record), fastest > 0 ? 1e9 / fastest : 0.0);
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "bench_bounding: {}\n", e.what());
  return 2;
}
