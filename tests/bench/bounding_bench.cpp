// Bounding alone, on one core, repeated: the kernel's cost per record without MPI, the other stages or
// the host's run-to-run drift in one figure. It generates one window of a job's synthetic stream once,
// keeps the records of the users that rank 0 of `ranks` would own (what bounding sees there after the
// user shuffle), then bounds the window `repeats` times from an empty user table reserved as the engine
// reserves it, and prints the minimum and the median over the repeats (the minimum is the least
// disturbed by other work on a shared host; compare binaries by it, alternating).
//
//   bench_bounding JOB.toml [--set section.key=value ...] [--ranks P] [--repeats R]
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/record.hpp"
#include "kernels/bounding.hpp"
#include "partition/hash.hpp"
#include "src/config.hpp"
#include "src/workload.hpp"

namespace {

using dpstream::Record;
namespace kernels = dpstream::kernels;

struct Args {
  std::string job;
  std::vector<std::string> overrides;
  int ranks = 2;
  int repeats = 7;
};

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--set" && has_value) {
      a.overrides.emplace_back(argv[++i]);
    } else if (arg == "--ranks" && has_value) {
      a.ranks = std::stoi(argv[++i]);
    } else if (arg == "--repeats" && has_value) {
      a.repeats = std::stoi(argv[++i]);
    } else if (a.job.empty() && arg.rfind("--", 0) != 0) {
      a.job = arg;
    } else {
      throw std::invalid_argument("unknown argument '" + arg +
                                  "'; usage: bench_bounding JOB.toml [--set section.key=value ...] [--ranks P] "
                                  "[--repeats R]");
    }
  }
  if (a.job.empty()) throw std::invalid_argument("name a job file (TOML), e.g. jobs/paper-workload.toml");
  if (a.ranks < 1 || a.repeats < 1) throw std::invalid_argument("--ranks and --repeats must be at least 1");
  return a;
}

// Window 0's records, trigger by trigger, of the users that rank 0 of `ranks` owns.
std::vector<std::vector<Record>> owned_window(const dpstream::JobConfig& config, int ranks) {
  dpstream::SyntheticSource source(config, 0, 1);
  std::vector<std::vector<Record>> triggers(source.triggers_per_window());
  for (std::uint32_t t = 0; t < triggers.size(); ++t)
    for (const Record& r : source.take_trigger(0, t))
      if (dpstream::partition::user_owner(r.user, ranks) == 0) triggers[t].push_back(r);
  return triggers;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args args = parse_args(argc, argv);
  const dpstream::JobConfig config = dpstream::load_job(args.job, args.overrides);
  if (config.input.kind != dpstream::InputKind::Synthetic)
    throw std::invalid_argument("bench_bounding needs a synthetic job ([input] kind = \"synthetic\")");
  omp_set_num_threads(1);
  const auto triggers = owned_window(config, args.ranks);
  std::uint64_t records = 0;
  for (const auto& t : triggers) records += t.size();
  const kernels::BoundingParams params{config.privacy.max_records_per_user, config.privacy.clamp_min,
                                       config.privacy.clamp_max};
  dpstream::SyntheticSource sizes(config, 0, 1);  // the engine's reserve: the window's users and kept records
  std::vector<double> ns_per_record;
  std::uint64_t kept = 0, partials = 0, first_partials = 0;  // every repeat must bound alike
  for (int r = 0; r < args.repeats; ++r) {
    kernels::UserState state;
    state.reserve(sizes.users_per_window() / args.ranks, sizes.kept_records_per_window() / args.ranks);
    kernels::BoundingStats stats;
    partials = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto& t : triggers) partials += kernels::bound_and_aggregate(t, params, state, stats).size();
    const std::chrono::duration<double, std::nano> elapsed = std::chrono::steady_clock::now() - t0;
    ns_per_record.push_back(elapsed.count() / static_cast<double>(std::max<std::uint64_t>(records, 1)));
    if (r > 0 && (stats.kept != kept || partials != first_partials))
      throw std::logic_error(fmt::format("repeat {} kept {} records in {} partials where the first kept {} in {}", r,
                                         stats.kept, partials, kept, first_partials));
    kept = stats.kept;
    first_partials = partials;
  }
  std::sort(ns_per_record.begin(), ns_per_record.end());
  fmt::print(
      "RESULT bench=bounding records={} triggers={} kept={} partials={} repeats={} ns_per_record_min={:.1f} "
      "ns_per_record_median={:.1f} records_per_s_min_time={:.0f}\n",
      records, triggers.size(), kept, partials, args.repeats, ns_per_record.front(),
      ns_per_record[ns_per_record.size() / 2], 1e9 / ns_per_record.front());
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "bench_bounding: {}\n", e.what());
  return 2;
}
