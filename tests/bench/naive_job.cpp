// The whole-job yardstick of issue 15: what a competent engineer writes in an afternoon for the
// non-private job, single-threaded, no output, no checkpoints. It draws a workload of the same
// distributions as dpstream's synthetic input (core paper, DP-SQLP, arXiv 2303.18086, section 5.1:
// records per user Zipf-Mandelbrot on [1, 1e5] with q = 26, s = 6.738; keys Zipf-Mandelbrot on
// [1, K] with q = 1000, s = 1.4; uniform times in a day) by inverse CDF from std::mt19937_64,
// shuffles it, stable-sorts it by time, keeps each user's first C records with one
// std::unordered_map and counts per key with another. jobs/bench-whole-job.sh times it side by side
// with dpstream's whole job (generation, shuffles, bounding, accumulation, output, checkpoints).
//   naive_job USERS KEYS [C]   prints: records=N kept=N keys_touched=N seconds=S
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <unordered_map>
#include <vector>

namespace {

// Cumulative probabilities of (x + q)^-s for x = lo..hi, normalised.
std::vector<double> zipf_cdf(int lo, int hi, double q, double s) {
  std::vector<double> cdf;
  cdf.reserve(static_cast<std::size_t>(hi) - static_cast<std::size_t>(lo) + 1);
  double total = 0;
  for (int x = lo; x <= hi; ++x) cdf.push_back(total += std::pow(x + q, -s));
  for (double& c : cdf) c /= total;
  return cdf;
}

int draw(const std::vector<double>& cdf, double u) {  // 0-based index of the first cdf >= u
  return static_cast<int>(std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
}

struct Row {
  std::uint64_t user, key;
  std::uint32_t time;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: naive_job USERS KEYS [C]\n");
    return 2;
  }
  const std::uint64_t users = std::strtoull(argv[1], nullptr, 10);
  const int keys = std::atoi(argv[2]);
  const std::uint32_t C = argc > 3 ? static_cast<std::uint32_t>(std::atoi(argv[3])) : 32;
  if (users == 0 || keys <= 0 || C == 0) {
    std::fprintf(stderr, "naive_job: USERS, KEYS and C must be positive\n");
    return 2;
  }
  const auto start = std::chrono::steady_clock::now();
  const auto per_user = zipf_cdf(1, 100000, 26.0, 6.738), per_key = zipf_cdf(1, keys, 1000.0, 1.4);
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<Row> rows;
  for (std::uint64_t u = 0; u < users; ++u) {
    const int n = draw(per_user, uniform(rng)) + 1;
    for (int i = 0; i < n; ++i)
      rows.push_back(
          {u, static_cast<std::uint64_t>(draw(per_key, uniform(rng))) + 1, static_cast<std::uint32_t>(rng() % 86400)});
  }
  std::shuffle(rows.begin(), rows.end(), rng);  // arrival order is not time order
  std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.time < b.time; });
  std::unordered_map<std::uint64_t, std::uint32_t> kept_per_user;
  std::unordered_map<std::uint64_t, std::uint64_t> count_per_key;
  std::uint64_t kept = 0;
  for (const Row& r : rows) {
    std::uint32_t& k = kept_per_user[r.user];
    if (k == C) continue;
    ++k;
    ++kept;
    ++count_per_key[r.key];
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("records=%zu kept=%llu keys_touched=%zu seconds=%.3f\n", rows.size(),
              static_cast<unsigned long long>(kept), count_per_key.size(), seconds);
  return 0;
}
