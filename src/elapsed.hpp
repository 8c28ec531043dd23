// Wall-clock seconds for the engine's stage times, progress and commit cadence (one steady clock).
#pragma once

#include <chrono>

namespace dpstream {

using SteadyClock = std::chrono::steady_clock;
inline double seconds_since(SteadyClock::time_point t0) {
  return std::chrono::duration<double>(SteadyClock::now() - t0).count();
}

}  // namespace dpstream
