// A stable LSD radix sort on one thread: what key accumulation's sort by key and bounding's grouping by user share.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace dpstream::partition {

// Sorts items[0, n) stably by the digits key(item) >> shifts[d] & (2^bits - 1), shifts[0] the least significant,
// through `scratch` (room for n items; need not be zero-filled). One pass counts every digit's histogram, then one
// stable scatter a digit from one buffer to the other. Returns the buffer that holds the sorted items: `items` when
// shifts has an even size, `scratch` otherwise. `counts` is the caller's, kept between calls so that many small
// sorts do not allocate; Count must hold n.
template <class Count, class T, class KeyFn>
T* radix_sort_lsd(T* items, T* scratch, std::size_t n, std::span<const int> shifts, int bits, KeyFn key,
                  std::vector<Count>& counts) {
  const std::size_t radix = std::size_t{1} << bits;
  const std::uint64_t mask = radix - 1;
  const std::size_t digits = shifts.size();
  counts.assign(digits * radix, 0);  // digit d's counts at [d radix, (d + 1) radix), then its buckets' next places
  if (digits == 2) {                 // both callers' usual case: unrolled (the loop over digits cost bounding about 1%)
    Count* const high = counts.data() + radix;
    const int low_shift = shifts[0], high_shift = shifts[1];
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t k = key(items[i]);
      ++counts[k >> low_shift & mask];
      ++high[k >> high_shift & mask];
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t k = key(items[i]);
      for (std::size_t d = 0; d < digits; ++d) ++counts[d * radix + (k >> shifts[d] & mask)];
    }
  }
  for (std::size_t d = 0; d < digits; ++d) {
    Count running = 0;
    for (std::size_t b = d * radix; b < (d + 1) * radix; ++b) running += std::exchange(counts[b], running);
  }
  T* from = items;
  T* to = scratch;
  for (std::size_t d = 0; d < digits; ++d, std::swap(from, to)) {
    Count* const next = counts.data() + d * radix;
    const int shift = shifts[d];
    for (std::size_t i = 0; i < n; ++i) to[next[key(from[i]) >> shift & mask]++] = from[i];
  }
  return from;
}

}  // namespace dpstream::partition
