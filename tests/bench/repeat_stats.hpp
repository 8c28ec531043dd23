// Statistics of a benchmark's repeats (bench_bounding, bench_draws): the median beside the minimum.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace dpstream::bench {

// The middle value, or the mean of the two middle values of an even count; v must not be empty.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace dpstream::bench
