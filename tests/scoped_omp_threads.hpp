// Fixes the number of OpenMP threads for a scope. Statistical kernel tests open ~10^5-10^6 parallel
// regions of little work; on a loaded machine two spinning threads per region cost several times more
// than one. Kernel output does not depend on the thread count (test_engine checks it end to end).
#pragma once

#include <omp.h>

namespace dpstream::testing {

class ScopedOmpThreads {
 public:
  explicit ScopedOmpThreads(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~ScopedOmpThreads() { omp_set_num_threads(saved_); }
  ScopedOmpThreads(const ScopedOmpThreads&) = delete;
  ScopedOmpThreads& operator=(const ScopedOmpThreads&) = delete;

 private:
  int saved_;
};

}  // namespace dpstream::testing
