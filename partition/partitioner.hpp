// Decide the destination of every item, then lay the items out grouped by destination
// (a counting sort): the send buffer of an all-to-all, or the shards of a local kernel.
#pragma once

#include <omp.h>

#include <cstdint>
#include <vector>

namespace dpstream::partition {

template <class T>
struct Partitioned {
  std::vector<T> items;                // grouped by destination, original order kept inside a group
  std::vector<std::uint64_t> counts;   // items per destination
  std::vector<std::uint64_t> offsets;  // start of each destination's group; offsets[n] = size
};

// Stable counting sort of `items` into `n` destinations given by `dest(item)`. OpenMP: each
// thread histograms and scatters a contiguous block, so the result is independent of the
// thread count (blocks by the threads started: the runtime may start fewer than asked).
template <class T, class DestFn>
Partitioned<T> partition_by(const std::vector<T>& items, std::size_t n, DestFn dest) {
  Partitioned<T> out;
  out.counts.assign(n, 0);
  out.offsets.assign(n + 1, 0);
  out.items.resize(items.size());
  const std::size_t size = items.size();
  const int threads = size < 65536 ? 1 : omp_get_max_threads();
  std::vector<std::uint32_t> dest_of(size);
  std::vector<std::vector<std::uint64_t>> hist(threads, std::vector<std::uint64_t>(n, 0));
#pragma omp parallel num_threads(threads)
  {
    const int started = omp_get_num_threads();
    const int t = omp_get_thread_num();
    const std::size_t lo = size * t / started, hi = size * (t + 1) / started;
    auto& h = hist[t];
    for (std::size_t i = lo; i < hi; ++i) {
      const auto d = static_cast<std::uint32_t>(dest(items[i]));
      dest_of[i] = d;
      ++h[d];
    }
#pragma omp barrier
#pragma omp single
    {
      // Exclusive scan over (destination, thread): thread t's slice of group d follows t-1's.
      std::uint64_t running = 0;
      for (std::size_t d = 0; d < n; ++d) {
        out.offsets[d] = running;
        for (int tt = 0; tt < started; ++tt) {
          const std::uint64_t c = hist[tt][d];
          hist[tt][d] = running;
          running += c;
        }
        out.counts[d] = running - out.offsets[d];
      }
      out.offsets[n] = running;
    }
    for (std::size_t i = lo; i < hi; ++i) out.items[h[dest_of[i]]++] = items[i];
  }
  return out;
}

}  // namespace dpstream::partition
