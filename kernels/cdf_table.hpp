// Inverse-CDF sampling on a table of 192-bit fixed-point cumulative probabilities, started from a
// 4096-entry guide table: the discrete Gaussian's table sampler (noise.hpp) and the normal
// sampler's cells (exact_normal.hpp). Entry m is C_m = round(2^192 P[index <= m]), computed in
// 320-bit binary floating point; the last entry is all ones (it takes the remaining mass). Each
// table probability is within 2^-192 of the exact one (plus the arithmetic's error), so a table of
// n entries is within n 2^-192 (plus the mass cut off) of the exact distribution in total variation.
#pragma once

#include <boost/multiprecision/cpp_bin_float.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/noise.hpp"

namespace dpstream::noise {

using BigFloat =
    boost::multiprecision::number<boost::multiprecision::cpp_bin_float<320, boost::multiprecision::digit_base_2>,
                                  boost::multiprecision::et_off>;

struct CdfTable {
  static constexpr unsigned kGuideBits = 12;
  std::vector<std::uint64_t> hi;                        // top word of C_m (the one the search reads)
  std::vector<std::array<std::uint64_t, 2>> lo;         // its two lower words
  std::array<std::uint32_t, (1u << kGuideBits)> guide;  // guide[h] = first m with hi[m] >= h 2^52
  // cell_from_top's answer per guide bucket h (u0 in [h 2^52, (h + 1) 2^52)), one word for a vector lookup:
  // bits 63-52 m = guide[h]; bit 51 set when a second entry's top word (before the last) also lies in the bucket;
  // bits 50-0 the first such word's offset in the bucket, halved (all ones when none lies there, which reads the
  // same as one in the bucket's last two words). With d = (u0 mod 2^52) / 2: d below the field gives m, d above
  // it gives m + 1 unless bit 51 is set; an equal d (a tie, or u0 next to the entry) is left to the search. A
  // bucket whose m is 4095 or more (a table of that many cells; 4095 is kept out too) is never decided here.
  std::array<std::uint64_t, (1u << kGuideBits)> bucket;
  static constexpr std::uint64_t kBucketField = (std::uint64_t{1} << 51) - 1;
  static constexpr std::uint64_t kSecondInBucket = std::uint64_t{1} << 51;

  // From the (unnormalized) masses of indices 0, 1, ...; entries stop where C_m would reach 2^192.
  static CdfTable from_masses(const std::vector<BigFloat>& mass);
  // The first m with U < C_m, U uniform on [0, 2^192): three stream words, the lower two read only
  // when U's top word equals an entry's (probability < 2^-50).
  std::size_t sample(NodeStream& rng) const { return sample_from_top(rng.next_u64(), rng); }
  // sample() with U's top word u0 read already (from a fixed place of the stream): the lower two from rng.
  std::size_t sample_from_top(std::uint64_t u0, NodeStream& rng) const {
    std::uint64_t u1 = 0, u2 = 0;
    bool lower_read = false;
    const auto below = [&](std::size_t m) {  // U < C_m
      if (u0 != hi[m]) return u0 < hi[m];
      if (!lower_read) u1 = rng.next_u64(), u2 = rng.next_u64(), lower_read = true;
      if (u1 != lo[m][0]) return u1 < lo[m][0];
      return u2 < lo[m][1];
    };
    const std::size_t last = hi.size() - 1;
    std::size_t m = guide[u0 >> (64 - kGuideBits)];
    while (m < last && !below(m)) ++m;
    return m;
  }
  // sample() from its first word u0 alone, or kTie where it would read the lower two (u0 equals an entry's
  // top word before the last).
  static constexpr std::size_t kTie = ~std::size_t{0};
  std::size_t cell_from_top(std::uint64_t u0) const {
    const std::size_t last = hi.size() - 1;
    std::size_t m = guide[u0 >> (64 - kGuideBits)];
    for (; m < last; ++m) {
      if (u0 == hi[m]) return kTie;
      if (u0 < hi[m]) break;
    }
    return m;
  }
};

}  // namespace dpstream::noise
