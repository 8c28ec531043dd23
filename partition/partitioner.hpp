// Decide the destination of every item, then lay the items out grouped by destination
// (a counting sort): the send buffer of an all-to-all, or the shards of a local kernel.
#pragma once

#include <omp.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/default_init.hpp"

namespace dpstream::partition {

// Items from which partition_into uses its threads (fewer: one, whose start costs more than their scatter).
inline constexpr std::size_t kParallelItems = 65536;

template <class T>
struct Partitioned {
  DefaultInitVector<T> items;          // grouped by destination, original order kept inside a group
  std::vector<std::uint64_t> counts;   // items per destination
  std::vector<std::uint64_t> offsets;  // start of each destination's group; offsets[n] = size
};

// Stable counting sort of `items` into `n` destinations given by `dest(item)`, written to `out` (room for
// items.size() items; what it held before does not matter, so it need not be zero-filled). Returns each
// destination's first place in `out`, then items.size(). OpenMP: each thread histograms and scatters a
// contiguous block, so the result is independent of the thread count (blocks by the threads started: the
// runtime may start fewer than asked).
template <class T, class DestFn>
std::vector<std::uint64_t> partition_into(std::span<const T> items, std::size_t n, DestFn dest, T* out) {
  std::vector<std::uint64_t> offsets(n + 1, 0);
  const std::size_t size = items.size();
  const int threads = size < kParallelItems ? 1 : omp_get_max_threads();
  const std::unique_ptr<std::uint32_t[]> dest_of(new std::uint32_t[size]);  // written before it is read
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
        offsets[d] = running;
        for (int tt = 0; tt < started; ++tt) {
          const std::uint64_t c = hist[tt][d];
          hist[tt][d] = running;
          running += c;
        }
      }
      offsets[n] = running;
    }
    for (std::size_t i = lo; i < hi; ++i) out[h[dest_of[i]]++] = items[i];
  }
  return offsets;
}

// partition_into a new vector (not zero-filled first: partition_into writes every item), with each destination's
// count.
template <class T, class DestFn>
Partitioned<T> partition_by(const std::vector<T>& items, std::size_t n, DestFn dest) {
  Partitioned<T> out{DefaultInitVector<T>(items.size()), {}, {}};
  out.offsets = partition_into(std::span<const T>(items), n, dest, out.items.data());
  out.counts.resize(n);
  for (std::size_t d = 0; d < n; ++d) out.counts[d] = out.offsets[d + 1] - out.offsets[d];
  return out;
}

}  // namespace dpstream::partition
