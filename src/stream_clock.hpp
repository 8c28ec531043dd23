// Event time to (window, trigger): window w holds [w * W, (w + 1) * W); trigger i of T holds
// the i-th of T equal slices of it, i.e. offsets o with floor(o * T / W) = i.
#pragma once

#include <cstdint>

#include "partition/hash.hpp"

namespace dpstream {

struct StreamClock {
  static constexpr std::int64_t kSmallOffset = std::int64_t{1} << 31;
  std::int64_t window_seconds;
  std::uint32_t triggers;

  std::int64_t window_of(std::int64_t ts) const {
    std::int64_t w = ts / window_seconds;
    if (ts % window_seconds < 0) --w;  // floor for negative timestamps
    return w;
  }
  std::int64_t offset_in_window(std::int64_t ts) const { return ts - window_of(ts) * window_seconds; }
  std::uint32_t trigger_of_offset(std::int64_t offset) const {
    // |offset| < 2^31 and triggers < 2^32: the product fits in 64 bits and the 128-bit division (a libgcc
    // call) is not needed; the quotient is the same.
    if (offset >= -kSmallOffset && offset < kSmallOffset)
      return static_cast<std::uint32_t>(offset * std::int64_t{triggers} / window_seconds);
    return static_cast<std::uint32_t>((static_cast<int128>(offset) * triggers) / window_seconds);
  }
  std::uint32_t trigger_of(std::int64_t ts) const { return trigger_of_offset(offset_in_window(ts)); }
};

}  // namespace dpstream
