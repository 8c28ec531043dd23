// Wall-clock seconds (one steady clock): the engine's stage times, progress, commit cadence, and the
// time each rank spends inside collectives (shuffle::Comm).
#pragma once

#include <chrono>

namespace dpstream {

using SteadyClock = std::chrono::steady_clock;
inline double seconds_since(SteadyClock::time_point t0) {
  return std::chrono::duration<double>(SteadyClock::now() - t0).count();
}

}  // namespace dpstream
