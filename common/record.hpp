// The record model: fixed-size records on the hot path, one struct per stage.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common/int128.hpp"

namespace dpstream {

// One input record as it enters the pipeline. `user` and `key` are 64-bit ids: integers
// for the synthetic workload, keyed PRF values of the strings for CSV input (src/id_prf.hpp).
struct Record {
  std::uint64_t user;
  std::uint64_t key;
  std::int64_t timestamp;  // integer seconds
  std::uint64_t position;  // position in the input: the last tie-break of stream order
  double value;
};
static_assert(std::is_trivially_copyable_v<Record> && sizeof(Record) == 40);

// Stream order inside one trigger: (timestamp, position). Window and trigger are equal
// for all records of one trigger batch.
inline bool stream_order_less(const Record& a, const Record& b) {
  return a.timestamp != b.timestamp ? a.timestamp < b.timestamp : a.position < b.position;
}

// Values are clamped and then accumulated in fixed point with kValueFracBits fractional bits,
// so that sums are exact, associative and therefore identical for any rank or thread count.
inline constexpr int kValueFracBits = 20;
inline constexpr double kValueScale = static_cast<double>(std::int64_t{1} << kValueFracBits);

// std::llround(v 2^20): half away from zero. Inline, not libm's call (27 instructions a kept record in
// bounding): within +-2^62 the cast truncates toward zero and x - t, x's fraction, is exact; anything
// else (beyond, NaN) goes to llround as before.
inline std::int64_t to_fixed(double v) {
  const double x = v * kValueScale;
  if (!(std::abs(x) < 0x1p62)) return std::llround(x);
  const auto t = static_cast<std::int64_t>(x);
  const double fraction = x - static_cast<double>(t);
  return t + (fraction >= 0.5 ? 1 : 0) - (fraction <= -0.5 ? 1 : 0);
}

// Largest |clamp bound| accepted: keeps one record below 2^51 in fixed point.
inline constexpr double kMaxAbsClamp = 2147483648.0;  // 2^31

inline double from_fixed(std::int64_t f) { return static_cast<double>(f) / kValueScale; }

// Sums and released values are held in 128 bits. A key sees fewer than 2^64 records of |value| < 2^51
// (fixed point), so |sum| < 2^115 and |count| * 2^20 < 2^84: no input can make an addition overflow,
// and the job never aborts on what the data add up to (an abort would be an output that depends on
// one user). Noise numerators are bounded by the sampler's range (privacy_plan.cpp). The types and the
// two-word form Int128Words are in common/int128.hpp.

// Per-key partial aggregate of one trigger, produced by the user owners after bounding and
// sent to the key owners. The sum travels in 64 bits: a rank's larger sum for one key is sent as
// several partials of that key (append_partial), which the key owner adds in 128 bits.
struct KeyPartial {
  std::uint64_t key;
  std::int64_t count;      // kept records
  std::int64_t sum;        // fixed-point sum of clamped values
  std::int64_t new_users;  // users touching this key for the first time in the window
};
static_assert(std::is_trivially_copyable_v<KeyPartial> && sizeof(KeyPartial) == 32);

// Appends key's partial (count, sum, new_users) to out, splitting a sum beyond int64 into chunks.
inline void append_partial(std::vector<KeyPartial>& out, std::uint64_t key, std::int64_t count, int128 sum,
                           std::int64_t new_users) {
  constexpr int128 kChunk = INT64_MAX;
  for (; sum > kChunk; sum -= kChunk) out.push_back({key, 0, INT64_MAX, 0});
  for (; sum < -kChunk; sum += kChunk) out.push_back({key, 0, -INT64_MAX, 0});
  out.push_back({key, count, static_cast<std::int64_t>(sum), new_users});
}

// Running totals of one key after a trigger (raw, never leaves the engine in DP mode).
struct KeyTotals {
  std::uint64_t key;
  std::int64_t count;
  int128 sum;  // fixed point
  std::int64_t users;
};
static_assert(std::is_trivially_copyable_v<KeyTotals>);

// One release row of a key before naming: running totals in fixed point (2^-20) - exact in mode
// "none", noisy estimates in mode "dp".
struct KeyRelease {
  std::uint64_t key;
  int128 count;
  int128 sum;
};

}  // namespace dpstream
