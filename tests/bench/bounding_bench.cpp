// Bounding alone, on one core, repeated: the kernel's cost per record without MPI, the other stages or
// the host's run-to-run drift in one figure. It generates the first window of a job's synthetic stream
// once, keeps the records of the users that rank 0 of `ranks` would own (what bounding sees there after
// the user shuffle), then bounds the window `repeats` times from an empty user table reserved as the
// engine reserves it (journal off: the engine turns it on only when it checkpoints), and prints the
// minimum and the median over the repeats (the minimum is the least disturbed by other work on a shared
// host; compare binaries by it, alternating). Every repeat must leave the same state and partials.
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

int whole_number(const std::string& option, const std::string& text) {
  std::size_t used = 0;
  int value = 0;
  try {
    value = std::stoi(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size())
    throw std::invalid_argument(option + " takes a whole number, not '" + text + "'");
  return value;
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--set" && has_value) {
      a.overrides.emplace_back(argv[++i]);
    } else if (arg == "--ranks" && has_value) {
      a.ranks = whole_number(arg, argv[++i]);
    } else if (arg == "--repeats" && has_value) {
      a.repeats = whole_number(arg, argv[++i]);
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

// The job's first window's records, trigger by trigger, of the users that rank 0 of `ranks` owns.
std::vector<std::vector<Record>> owned_window(const dpstream::JobConfig& config, int ranks) {
  dpstream::SyntheticSource source(config, 0, 1);
  const std::int64_t window = config.stream.first_window;
  std::vector<std::vector<Record>> triggers(source.triggers_per_window());
  for (std::uint32_t t = 0; t < triggers.size(); ++t)
    for (const Record& r : source.take_trigger(window, t))
      if (dpstream::partition::user_owner(r.user, ranks) == 0) triggers[t].push_back(r);
  return triggers;
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

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
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
  double fastest = 0;
  Outcome first;
  for (int r = 0; r < args.repeats; ++r) {
    kernels::UserState state;
    state.reserve(sizes.users_per_window() / args.ranks, sizes.kept_records_per_window() / args.ranks);
    Outcome out;
    std::chrono::duration<double, std::nano> elapsed{0};  // the kernel's calls only
    for (const auto& t : triggers) {
      const auto t0 = std::chrono::steady_clock::now();
      const std::vector<dpstream::KeyPartial> partials = kernels::bound_and_aggregate(t, params, state, out.stats);
      elapsed += std::chrono::steady_clock::now() - t0;
      out.partials += partials.size();
      for (const auto& p : partials) out.partials_hash += partial_hash(p);
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
      "RESULT bench=bounding records={} triggers={} kept={} partials={} repeats={} ns_per_record_min={:.1f} "
      "ns_per_record_median={:.1f} records_per_s_min_time={:.0f}\n",
      records, triggers.size(), first.stats.kept, first.partials, args.repeats, fastest, median(ns_per_record),
      fastest > 0 ? 1e9 / fastest : 0.0);
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "bench_bounding: {}\n", e.what());
  return 2;
}
