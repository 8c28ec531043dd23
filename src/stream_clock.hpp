// Event time to (window, trigger): window w holds [w * W, (w + 1) * W); trigger i of T holds
// the i-th of T equal slices of it, i.e. offsets o with floor(o * T / W) = i.
#pragma once

#include <cstdint>

#include "partition/hash.hpp"

namespace dpstream {

struct StreamClock {
  std::int64_t window_seconds;
  std::uint32_t triggers;

  std::int64_t window_of(std::int64_t ts) const {
    std::int64_t w = ts / window_seconds;
    if (ts % window_seconds < 0) --w;  // floor for negative timestamps
    return w;
  }
  std::int64_t offset_in_window(std::int64_t ts) const { return ts - window_of(ts) * window_seconds; }
  std::uint32_t trigger_of_offset(std::int64_t offset) const {
    return static_cast<std::uint32_t>((static_cast<int128>(offset) * triggers) / window_seconds);
  }
  std::uint32_t trigger_of(std::int64_t ts) const { return trigger_of_offset(offset_in_window(ts)); }
};

}  // namespace dpstream
