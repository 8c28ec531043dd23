// Wall-clock seconds (one steady clock): the engine's stage times, progress, commit cadence, and the
// time each rank spends inside collectives (shuffle::Comm).
#pragma once

#include <chrono>
#include <cstdint>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <x86intrin.h>
#endif

namespace dpstream {

using SteadyClock = std::chrono::steady_clock;
inline double seconds_since(SteadyClock::time_point t0) {
  return std::chrono::duration<double>(SteadyClock::now() - t0).count();
}

// The summed length of many short intervals within one span, for a split of a stage's time (key accumulation
// inside key selection's shard loop: two steady-clock reads per shard and trigger cost 26 ns each on this
// host's kvm-clock, about 5% of key selection at T = 1000). On x86-64 the intervals are read on the CPU's
// time-stamp counter (RDTSC, 11 ns here) and converted at the rate the steady clock shows over the span from
// construction to seconds(); elsewhere they are steady-clock nanoseconds. One thread's: a thread's intervals
// are read on the core it runs on (the invariant TSC of current x86-64 CPUs is the same on every core).
class IntervalSum {
 public:
  IntervalSum() : span_start_(SteadyClock::now()), span_start_ticks_(ticks()) {}
  static std::uint64_t ticks() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    return __rdtsc();
#else
    return static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now().time_since_epoch()).count());
#endif
  }
  // An interval from `from` (a ticks()) to now; none when the counter reads earlier than `from` (a thread moved to a
  // core whose counter lags: the interval is lost rather than wrapped to 2^64 ticks).
  void add_since(std::uint64_t from) {
    const std::uint64_t now = ticks();
    if (now > from) sum_ += now - from;
  }
  double seconds() const {
    const std::uint64_t span_ticks = ticks() - span_start_ticks_;
    return span_ticks == 0 ? 0.0
                           : seconds_since(span_start_) * static_cast<double>(sum_) / static_cast<double>(span_ticks);
  }

 private:
  SteadyClock::time_point span_start_;
  std::uint64_t span_start_ticks_;
  std::uint64_t sum_ = 0;
};

}  // namespace dpstream
