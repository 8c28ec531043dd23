#include "src/omp_threads.hpp"

#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

namespace dpstream {

namespace {
int cpus_allowed() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 0;
  return CPU_COUNT(&set);
}
}  // namespace

int choose_threads_per_rank(const shuffle::Comm& comm) {
  const int local_ranks = comm.ranks_on_node();  // before any early return: a collective
  // NOLINTNEXTLINE(concurrency-mt-unsafe): read before the first parallel region
  const char* set = std::getenv("OMP_NUM_THREADS");
  if (set != nullptr && *set != '\0') return omp_get_max_threads();
  const int online = static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  const int allowed = cpus_allowed() > 0 ? cpus_allowed() : online;
  const int threads = std::max(1, std::min(allowed, online / std::max(1, local_ranks)));
  omp_set_num_threads(threads);
  return threads;
}

}  // namespace dpstream
