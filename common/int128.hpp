// 128-bit integers: the one declaration of the signed and unsigned types (a GCC/Clang extension) and
// their helpers. Sums and released values (common/record.hpp), exact multiply-shift range reduction
// (partition/hash.hpp), noise arithmetic (kernels/noise.hpp) and error sums (src/evaluate.cpp) use them.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <stdexcept>

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

// A signed integer below 2^95 in magnitude kept as three 32-bit words (alignment 4), so that a struct
// packs it with two 4-byte fields in 20 bytes (a banded counter's frontier, kernels/banded_counter.hpp:
// its running sum is below 2^84). Converting a value out of range throws std::overflow_error.
struct Int96Words32 {
  static_assert(std::endian::native == std::endian::little, "the low words come first");
  static constexpr int128 kLimit = int128{1} << 95;  // |v| < kLimit
  std::uint32_t words[3] = {};
  Int96Words32() = default;
  Int96Words32(int128 v) {  // NOLINT: implicit by design
    if (v >= kLimit || v < -kLimit) throw std::overflow_error("Int96Words32: a value beyond 2^95");
    std::memcpy(words, &v, sizeof words);  // the low 96 bits (little-endian)
  }
  operator int128() const {  // NOLINT: implicit by design
    int128 v = 0;
    std::memcpy(&v, words, sizeof words);
    return (v << 32) >> 32;  // sign-extends bit 95 (arithmetic shift)
  }
};

}  // namespace dpstream
