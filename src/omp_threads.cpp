#include "src/omp_threads.hpp"

#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <vector>

namespace dpstream {

namespace {
constexpr std::size_t kMaskWords = CPU_SETSIZE / 64;

// The CPUs this process may run on as bit words (cpusets and cgroups show here), or the online
// CPUs if the mask cannot be read.
std::vector<std::uint64_t> allowed_cpus() {
  std::vector<std::uint64_t> words(kMaskWords, 0);
  cpu_set_t set;
  CPU_ZERO(&set);
  const bool known = sched_getaffinity(0, sizeof set, &set) == 0;
  const long online = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  for (std::size_t cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (known ? CPU_ISSET(cpu, &set) : static_cast<long>(cpu) < online)
      words[cpu / 64] |= std::uint64_t{1} << (cpu % 64);
  return words;
}

int count(const std::vector<std::uint64_t>& words) {
  int n = 0;
  for (const auto w : words) n += std::popcount(w);
  return n;
}

// OMP_NUM_THREADS as OpenMP reads it: a positive integer first (a list's first level); else unset.
bool threads_set_by_user() {
  // NOLINTNEXTLINE(concurrency-mt-unsafe): read before the first parallel region
  const char* text = std::getenv("OMP_NUM_THREADS");
  if (text == nullptr) return false;
  while (*text == ' ' || *text == '\t') ++text;
  char* end = nullptr;
  const long n = std::strtol(text, &end, 10);
  return end != text && n > 0;
}
}  // namespace

int choose_threads_per_rank(const shuffle::Comm& comm) {
  const auto mine = allowed_cpus();
  const auto node = comm.share_with_node(mine);  // before any early return: a collective
  if (threads_set_by_user()) return omp_get_max_threads();
  // The node's CPUs are those any of its ranks may use (a job's cgroup, not the whole host).
  const int threads = std::max(1, std::min(count(mine), count(node.words_or) / std::max(1, node.ranks)));
  omp_set_num_threads(threads);
  return omp_get_max_threads();
}

}  // namespace dpstream
