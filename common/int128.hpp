// 128-bit integers: the one declaration of the signed and unsigned types (a GCC/Clang extension) and
// their helpers. Sums and released values (common/record.hpp), exact multiply-shift range reduction
// (partition/hash.hpp), noise arithmetic (kernels/noise.hpp) and error sums (src/evaluate.cpp) use them.
#pragma once

#include <cstdint>
#include <cstring>

namespace dpstream {

__extension__ typedef __int128 int128;  // GCC/Clang extension; __extension__ silences -Wpedantic
__extension__ typedef unsigned __int128 uint128;

inline std::uint64_t low_word(int128 v) { return static_cast<std::uint64_t>(v); }
inline std::int64_t high_word(int128 v) { return static_cast<std::int64_t>(v >> 64); }
inline int128 from_words(std::uint64_t low, std::int64_t high) {
  return static_cast<int128>((static_cast<uint128>(static_cast<std::uint64_t>(high)) << 64) | low);
}

// static_cast<double>(v): the same rounding (of the same integer), by one instruction where v fits 64
// bits instead of libgcc's 128-bit conversion (hot in key selection's simulations).
inline double to_double(int128 v) {
  const bool narrow = v >= -(int128{1} << 63) && v < (int128{1} << 63);
  return narrow ? static_cast<double>(static_cast<std::int64_t>(v)) : static_cast<double>(v);
}

// An int128 kept as two 64-bit words, so that table entries holding one stay 8-byte aligned (no
// padding to 16). Converts to and from int128; nothing can bind an int128 reference to it.
struct Int128Words {
  std::uint64_t low = 0;
  std::int64_t high = 0;
  Int128Words() = default;
  Int128Words(int128 v) : low(low_word(v)), high(high_word(v)) {}  // NOLINT: implicit by design
  operator int128() const { return from_words(low, high); }        // NOLINT: implicit by design
  Int128Words& operator+=(int128 v) { return *this = int128(*this) + v; }
};

// An int128 kept as four 32-bit words (alignment 4), so that a struct can pack it right after a 4-byte
// field: a 4-byte step and one of these make 20 bytes, where Int128Words would pad them to 24.
struct Int128Words32 {
  std::uint32_t words[4] = {};
  Int128Words32() = default;
  Int128Words32(int128 v) { std::memcpy(words, &v, sizeof v); }  // NOLINT: implicit by design
  operator int128() const {                                      // NOLINT: implicit by design
    int128 v;
    std::memcpy(&v, words, sizeof v);
    return v;
  }
};

}  // namespace dpstream
