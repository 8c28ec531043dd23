// The record model: fixed-size records on the hot path, one struct per stage.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace dpstream {

// One input record as it enters the pipeline. `user` and `key` are 64-bit ids: integers
// for the synthetic workload, XXH3 hashes of the strings for CSV input.
struct Record {
  std::uint64_t user;
  std::uint64_t key;
  std::int64_t timestamp;   // integer seconds
  std::uint64_t position;   // position in the input: the last tie-break of stream order
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

inline std::int64_t to_fixed(double v) { return std::llround(v * kValueScale); }

// Largest |clamp bound| accepted: keeps one record below 2^51 in fixed point, and sums of up to
// 2^12 such records exact in int64 before the overflow check (add_or_flag) ever fires.
inline constexpr double kMaxAbsClamp = 2147483648.0;  // 2^31

// a += b, setting `overflow` instead of wrapping.
inline void add_or_flag(std::int64_t& a, std::int64_t b, bool& overflow) {
  overflow |= __builtin_add_overflow(a, b, &a);
}
inline double from_fixed(std::int64_t f) { return static_cast<double>(f) / kValueScale; }

// Per-key partial aggregate of one trigger, produced by the user owners after bounding and
// sent to the key owners.
struct KeyPartial {
  std::uint64_t key;
  std::int64_t count;      // kept records
  std::int64_t sum;        // fixed-point sum of clamped values
  std::int64_t new_users;  // users touching this key for the first time in the window
};
static_assert(std::is_trivially_copyable_v<KeyPartial> && sizeof(KeyPartial) == 32);

// Running totals of one key after a trigger (raw, never leaves the engine in DP mode).
struct KeyTotals {
  std::uint64_t key;
  std::int64_t count;
  std::int64_t sum;
  std::int64_t users;
};
static_assert(std::is_trivially_copyable_v<KeyTotals>);

// One release row of a key before naming: running totals in fixed point (2^-20) - exact in mode
// "none", noisy estimates in mode "dp".
struct KeyRelease {
  std::uint64_t key;
  std::int64_t count;
  std::int64_t sum;
};

}  // namespace dpstream

namespace dpstream {
inline constexpr const char* kSumOverflowMessage =
    "a key's sum of clamped values left the exact fixed-point range (|sum| < 2^43); narrow "
    "[privacy] clamp_min/clamp_max";
}  // namespace dpstream
