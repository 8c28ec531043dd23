// Exact samples of the continuous standard normal N(0, 1) from a node's PRF stream, for the
// factorized counters (kernels/banded_counter.hpp): Karney's Algorithm N ("Sampling exactly from the
// normal distribution", ACM TOMS 42(1), 2016; arXiv 1303.6257). Only comparisons of lazily drawn
// uniform digits and exact small-integer choices are used: no floating point, no table, no
// truncation. A sample is sign (k + x) with k >= 0 an integer and x in (0, 1) a uniform deviate of
// which the leading 64-bit digits are known; the digits after them are uniform and independent of
// everything else, drawn from the same stream on demand, so any precision is available exactly.
#pragma once

#include <absl/container/inlined_vector.h>

#include <cstddef>
#include <cstdint>

#include "kernels/noise.hpp"

namespace dpstream::noise {

struct NormalSample {
  bool negative = false;
  std::uint32_t k = 0;                               // integer part of |Z|
  absl::InlinedVector<std::uint64_t, 2> fraction;    // x = 0.fraction[0] fraction[1] ... (base 2^64)
  // |Z| lies in [k + 0.f0..f(w-1), k + 0.f0..f(w-1) + 2^(-64 w)) for w = fraction.size().
};

// One sample from `rng` (the node's stream, from its start). Its first `min_words` fraction digits
// (at least 1) are returned; min_words only adds digits drawn after the sample and its sign, so the
// leading digits are the same for any min_words: a later, more precise draw refines, never changes.
NormalSample sample_normal(NodeStream& rng, std::size_t min_words = 1);

// The sample as a fixed-point number with 64 fraction bits, truncated toward zero: sign (k 2^64 + f0),
// within one unit (2^-64) of Z, on Z's side of zero. k < 2^30 (else std::range_error: P[|Z| >= 2^30] < 2^-(10^17)).
int128 normal_fixed64(const NormalSample& z);

}  // namespace dpstream::noise
