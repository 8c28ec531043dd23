// Samples of the continuous standard normal N(0, 1) from a node's PRF stream, for the factorized
// counters (kernels/banded_counter.hpp). A sample is sign (k + x) with k >= 0 an integer and x in
// (0, 1) of which the leading 64-bit digits are known; the digits after them are uniform and
// independent of everything else, drawn from the same stream on demand, so any precision is exact.
// Two samplers of the same distribution:
//  - sample_normal (the engine's): a cell of width 2^-7 of |Z| from an inverse-CDF table of 192-bit
//    probabilities (kernels/cdf_table.hpp; 2071 cells, |Z| < 16.18, the last taking the mass beyond, < 2^-193), then a
//    uniform point of the cell accepted with probability exp(-(z^2 - a^2)/2) (a = the cell's inner
//    edge; > 0.85) by von Neumann's exact comparisons of lazy digits. Within 2^-179 of N(0, 1) in
//    total variation (the table's rounding: docs/PRIVACY.md section 4). Its first attempt reads fixed places
//    of the stream's first two blocks, laid out so that block 0 (two words) decides ~99.4% of draws.
//  - sample_normal_karney: Karney's Algorithm N ("Sampling exactly from the normal distribution",
//    ACM TOMS 42(1), 2016; arXiv 1303.6257), exact, no table; about ten times slower. The reference.
#pragma once

#include <absl/container/inlined_vector.h>

#include <array>
#include <cstddef>
#include <cstdint>

#include "kernels/noise.hpp"

namespace dpstream::noise {

struct NormalSample {
  bool negative = false;
  std::uint32_t k = 0;                             // integer part of |Z|
  absl::InlinedVector<std::uint64_t, 2> fraction;  // x = 0.fraction[0] fraction[1] ... (base 2^64)
  // |Z| lies in [k + 0.f0..f(w-1), k + 0.f0..f(w-1) + 2^(-64 w)) for w = fraction.size().
};

// One sample from `rng` (the node's stream, from its start). Its first `min_words` fraction digits
// (at least 1) are returned; min_words only adds digits drawn after the sample and its sign, so the
// leading digits are the same for any min_words: a later, more precise draw refines, never changes.
NormalSample sample_normal(NodeStream& rng, std::size_t min_words = 1);
NormalSample sample_normal_karney(NodeStream& rng, std::size_t min_words = 1);

// The sample as a fixed-point number with 64 fraction bits, truncated toward zero: sign (k 2^64 + f0),
// within one unit (2^-64) of Z, on Z's side of zero. k < 2^30 (else std::range_error: P[|Z| >= 2^30] < 2^-(10^17)).
int128 normal_fixed64(const NormalSample& z);

// Z~: the sample truncated toward zero to 56 fraction bits, sign floor(|Z| 2^56), in an int64 (the
// banded counters' per-step value: kernels/banded_counter.hpp). |Z| < 2^7, else std::range_error
// (P[|Z| >= 128] < 10^-3500). fixed56_of(normal_fixed64(z)) == normal_fixed56(z).
std::int64_t normal_fixed56(const NormalSample& z);
std::int64_t fixed56_of(int128 fixed64);
// normal_fixed56(sample_normal(node stream)) of the n nodes `first` with index first.index, first.index + 1,
// ... (a counter's steps): the same values, block 0 of many nodes encrypted in one call and decided by
// fixed56_from_first_block, the rest by the general sampler; packed by addition, no list of ids.
// std::invalid_argument if the last index is out of range.
void normal_fixed56_run(WindowPrf& prf, const NodeId& first, std::size_t n, std::int64_t* out);
// The same of n nodes of any ids (a blocked prefix's blocks: a few per level), block 0 of up to 64 in one call.
void normal_fixed56_nodes(WindowPrf& prf, const NodeId* ids, std::size_t n, std::int64_t* out);
// normal_fixed56(sample_normal(stream)) from the stream's first two words alone when they decide it (about
// 99.4% of draws: true, `out` set); false when the sample needs more of the stream.
bool fixed56_from_first_block(const std::array<std::uint64_t, 2>& block0, std::int64_t& out);
// How block 0s are decided in a run: eight at a time with AVX-512F where this CPU runs it (the blocks its vector
// steps leave then one at a time), else one at a time; the same outputs either way. Avx512Only: the vector steps
// alone, which leave a few blocks the scalar test decides (for tests and measurements).
enum class Block0Path { Avx512, Scalar, Avx512Only };
Block0Path best_block0_path();
// fixed56_from_first_block of n <= 64 consecutive 16-byte blocks (w0, w1 each, as NodeStream reads them): bit i of
// the result set when block i decides its sample (out[i] set; the others' out untouched), on every path but
// Avx512Only (std::invalid_argument: n > 64, or an AVX-512 path where the CPU or build has none).
std::uint64_t fixed56_from_first_blocks(const std::uint8_t* blocks, std::size_t n, std::int64_t* out,
                                        Block0Path path = best_block0_path());

}  // namespace dpstream::noise
