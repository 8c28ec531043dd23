// One exact normal sample's cost, as the banded counters draw them (kernels/exact_normal.hpp): runs of
// consecutive steps of many keys' counters through normal_fixed56_run (Z~) (key selection draws its
// look-ahead, up to 127 steps, and a key's prefix this way), on one core, repeated. Prints the minimum
// and the median over the repeats in ns per sample (compare builds by the minimum, alternating: this
// host is shared). Every repeat must give the same samples, and the first ~131,000 samples must equal
// the general sampler's node by node (sample_normal on each node's own stream), so a fast path that
// drifts from the reference fails here too. docs/PERFORMANCE.md round 20.
//
//   bench_draws [--samples N] [--run-length L] [--repeats R]
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <vector>

#include "kernels/exact_normal.hpp"
#include "kernels/noise.hpp"
#include "partition/hash.hpp"
#include "tests/bench/repeat_stats.hpp"

namespace {

namespace noise = dpstream::noise;

noise::NodeId first_node(std::uint64_t run) {  // run r: key r of the banded selection family, from step 1
  return {run, noise::Family::BandedSelection, 0, 0, 0};
}

// The samples of `runs` runs of `length` steps; returns a position-dependent digest of all of them: a sum of
// independent products (a chain of hash_combine, one multiply waiting on the last, cost 4-5 ns a sample, more
// than the draw it checked).
std::uint64_t draw_runs(noise::WindowPrf& prf, std::uint64_t runs, std::uint32_t length, std::vector<std::int64_t>& z) {
  std::uint64_t h = 0, position = 0;
  for (std::uint64_t r = 0; r < runs; ++r) {
    noise::normal_fixed56_run(prf, first_node(r), length, z.data());
    for (const std::int64_t v : z) h += dpstream::partition::mix64(static_cast<std::uint64_t>(v) ^ position++);
  }
  return h;
}

// Every sample of the first `runs` runs, node by node: at ~0.6% of samples the batch falls back to the
// general sampler, so thousands of runs reach that path and the shortcut's rare cases.
void check_against_general_sampler(noise::WindowPrf& prf, std::uint64_t runs, std::uint32_t length,
                                   std::vector<std::int64_t>& z) {
  for (std::uint64_t r = 0; r < runs; ++r) {
    noise::normal_fixed56_run(prf, first_node(r), length, z.data());
    for (std::uint32_t i = 0; i < length; ++i) {
      noise::NodeId id = first_node(r);
      id.index = i;
      noise::NodeStream stream(prf, id);
      if (noise::normal_fixed56(noise::sample_normal(stream)) != z[i])
        throw std::logic_error(fmt::format("step {} of run {} differs from the general sampler", i + 1, r));
    }
  }
}

}  // namespace

int main(int argc, char** argv) try {
  std::uint64_t samples = 4'000'000;
  std::uint32_t length = 64;
  int repeats = 5;
  CLI::App app{"ns per exact normal sample, drawn in runs of consecutive steps as the banded counters do"};
  app.add_option("--samples", samples, "Samples per repeat (rounded down to whole runs)")
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{1} << 32));
  app.add_option("--run-length", length, "Consecutive steps per run (key selection looks up to 64 ahead)")
      ->check(CLI::Range(1u, 1u << 16));
  app.add_option("--repeats", repeats, "Repeats; the minimum and the median are printed")->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);

  const std::uint64_t runs = std::max<std::uint64_t>(samples / length, 1);
  noise::WindowPrf prf(noise::secret_from_seed(7), 0);
  std::vector<std::int64_t> z(length);
  check_against_general_sampler(prf, std::min<std::uint64_t>(runs, (std::uint64_t{1} << 17) / length + 1), length, z);
  std::vector<double> ns;
  std::uint64_t first_hash = 0;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    const std::uint64_t h = draw_runs(prf, runs, length, z);
    const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
    if (r == 0) first_hash = h;
    if (h != first_hash) throw std::logic_error(fmt::format("repeat {} drew other samples than the first", r));
    ns.push_back(took.count() / static_cast<double>(runs * length));
  }
  fmt::print(
      "RESULT bench=draws samples={} run_length={} repeats={} ns_per_sample_min={:.2f} ns_per_sample_median={:.2f}\n",
      runs * length, length, repeats, *std::min_element(ns.begin(), ns.end()), dpstream::bench::median(ns));
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "bench_draws: {}\n", e.what());
  return 2;
}
