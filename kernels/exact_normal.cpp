#include "kernels/exact_normal.hpp"

#include <boost/multiprecision/cpp_int.hpp>

#include "kernels/cdf_table.hpp"
#include "kernels/cpu_features.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <utility>

namespace dpstream::noise {

namespace mp = boost::multiprecision;

namespace {
// A uniform deviate in (0, 1) whose base-2^64 digits are drawn only when a comparison needs them.
class Deviate {
 public:
  void reset() { digits_.clear(); }
  void reset_to(std::uint64_t first_digit) { digits_.assign(1, first_digit); }
  std::uint64_t digit(NodeStream& rng, std::size_t i) {
    while (digits_.size() <= i) digits_.push_back(rng.next_u64());
    return digits_[i];
  }
  // this < other, drawing digits of both until they differ (almost always at the first).
  bool less(NodeStream& rng, Deviate& other) {
    for (std::size_t i = 0;; ++i) {
      const std::uint64_t a = digit(rng, i), b = other.digit(rng, i);
      if (a != b) return a < b;
    }
  }
  bool below_half(NodeStream& rng) { return (digit(rng, 0) >> 63) == 0; }
  void swap(Deviate& other) noexcept { digits_.swap(other.digits_); }
  absl::InlinedVector<std::uint64_t, 2>& digits() { return digits_; }

 private:
  absl::InlinedVector<std::uint64_t, 2> digits_;
};

class AlgorithmN {
 public:
  explicit AlgorithmN(NodeStream& rng) : rng_(rng) {}

  NormalSample sample(std::size_t min_words) {
    std::uint32_t k = 0;
    for (;;) {
      k = geometric_half();  // N1
      const std::uint64_t k64 = k;
      if (k64 > 1 && !exp_minus_half_power(k64 * (k64 - 1))) continue;  // N2: exp(-k(k-1)/2)
      x_.reset();                                                       // N3
      std::uint32_t j = 0;
      while (j <= k && algorithm_b(k)) ++j;  // N4: exp(-x(2k+x)/2)
      if (j > k) break;
    }
    NormalSample z;
    z.negative = rng_.next_bit();  // N5
    z.k = k;
    auto& d = x_.digits();
    while (d.size() < std::max<std::size_t>(min_words, 1)) d.push_back(rng_.next_u64());
    z.fraction.assign(d.begin(), d.end());
    return z;
  }

 private:
  // Algorithm H: true with probability exp(-1/2) (von Neumann: a decreasing run below 1/2 of even length).
  bool exp_minus_half() {
    p_.reset();
    if (!p_.below_half(rng_)) return true;
    for (;;) {
      q_.reset();
      if (!q_.less(rng_, p_)) return false;
      p_.reset();
      if (!p_.less(rng_, q_)) return true;
    }
  }
  // N1: n >= 0 with probability exp(-n/2) (1 - exp(-1/2)).
  std::uint32_t geometric_half() {
    std::uint32_t n = 0;
    while (exp_minus_half()) {
      if (++n == 0xffffffffu) throw std::range_error("normal sample: integer part out of range");
    }
    return n;
  }
  // true with probability exp(-n/2).
  bool exp_minus_half_power(std::uint64_t n) {
    while (n-- > 0)
      if (!exp_minus_half()) return false;
    return true;
  }
  // Algorithm C: -1, 0, +1 with probabilities 1/m, 1/m, 1 - 2/m.
  int three_way(std::uint64_t m) {
    const std::uint64_t u = rng_.uniform_below(m);
    return u == 0 ? -1 : (u == 1 ? 0 : 1);
  }
  // Algorithm B: true with probability exp(-x (2k + x) / (2k + 2)): a run z1 > z2 > ... below x, each
  // kept with probability (2k + x) / (2k + 2); true when the run has even length.
  bool algorithm_b(std::uint32_t k) {
    const std::uint64_t m = 2 * static_cast<std::uint64_t>(k) + 2;
    std::uint64_t n = 0;
    for (;; ++n) {
      int f = k == 0 ? three_way(m) : 0;  // for k = 0 the choice is made first (it ends the run half the time)
      if (f < 0) break;
      q_.reset();
      if (!q_.less(rng_, n == 0 ? x_ : p_)) break;
      if (k > 0) f = three_way(m);
      if (f < 0) break;
      if (f == 0) {  // keep with probability x: a fresh deviate below x
        p_.reset();
        if (!p_.less(rng_, x_)) break;
      }
      p_.swap(q_);  // the run's last element
    }
    return n % 2 == 0;
  }

  NodeStream& rng_;
  Deviate x_, p_, q_;
};
}  // namespace

// ---- the table sampler ---------------------------------------------------------------------
namespace {
constexpr int kCellBits = 7;                      // cells of width h = 2^-7
constexpr std::size_t kCells = 20u << kCellBits;  // masses for |Z| < 20; the table stops at 2071 (its C_m reach 2^192)

// Cell j of |Z| is [j h, (j + 1) h), proposed with mass w_j = exp(-(j h)^2 / 2) (the density at its
// inner edge): w_j = w_(j-1) r_j with r_1 = exp(-h^2/2), r_j = r_(j-1) exp(-h^2), in 320-bit floating point.
const CdfTable& cell_table() {
  static const CdfTable table = [] {
    namespace mp = boost::multiprecision;
    const BigFloat h2 = mp::ldexp(BigFloat(1), -2 * kCellBits);
    const BigFloat b = mp::exp(-h2);
    std::vector<BigFloat> mass(kCells + 1);
    mass[0] = 1;
    BigFloat w = 1, r = mp::exp(-h2 / 2);
    for (std::size_t j = 1; j <= kCells; ++j) {
      w *= r;
      r *= b;
      mass[j] = w;
    }
    return CdfTable::from_masses(mass);
  }();
  return table;
}

mp::cpp_int digits_value(Deviate& d, NodeStream& rng, std::size_t words) {  // floor(d 2^(64 words))
  mp::cpp_int v = 0;
  for (std::size_t i = 0; i < words; ++i) v = (v << 64) + d.digit(rng, i);
  return v;
}

// V < f(U) = U (2j + U) 2^-(2 kCellBits + 1), exactly: from `words` digits of each, V lies in
// [v, v + 1) and f(U) in [f(u), f(u + 1)) (units 2^-64 words; f increasing), which decides unless they
// overlap; then one more digit of each.
bool below_f(NodeStream& rng, Deviate& v_dev, Deviate& u_dev, std::uint64_t j) {
  {  // one digit each, in 128-bit arithmetic: F = U (2j + U) in units of 2^-64 is below 2^77
    const std::uint64_t u = u_dev.digit(rng, 0), v = v_dev.digit(rng, 0);
    constexpr int kShift = 2 * kCellBits + 1;
    const uint128 u1 = uint128{u} + 1;  // <= 2^64
    const uint128 sq = uint128{u} * u;
    const uint128 sq1_ceil =
        u1 == (uint128{1} << 64) ? (uint128{1} << 64) : ((u1 * u1) >> 64) + (static_cast<std::uint64_t>(u1 * u1) != 0);
    const uint128 f_lo = (uint128{2} * j * u + (sq >> 64)) >> kShift;  // floor, units 2^-64
    const uint128 f_hi = (uint128{2} * j * u1 + sq1_ceil + ((uint128{1} << kShift) - 1)) >> kShift;  // ceil
    if (uint128{v} + 1 <= f_lo) return true;
    if (uint128{v} >= f_hi) return false;
  }
  for (std::size_t words = 2;; ++words) {
    const unsigned bits = static_cast<unsigned>(64 * words);
    const mp::cpp_int u = digits_value(u_dev, rng, words), v = digits_value(v_dev, rng, words);
    const mp::cpp_int one = mp::cpp_int(1) << bits, den = mp::cpp_int(1) << (2 * kCellBits + 1);
    // f(U) 2^bits for U = u / 2^bits: (2j u 2^bits + u^2) / (2^bits den)
    const mp::cpp_int lo_num = 2 * mp::cpp_int(j) * u * one + u * u,
                      hi_num = 2 * mp::cpp_int(j) * (u + 1) * one + (u + 1) * (u + 1);
    const mp::cpp_int f_lo = lo_num / (one * den), f_hi = (hi_num + one * den - 1) / (one * den);
    if (v + 1 <= f_lo) return true;
    if (v >= f_hi) return false;
    if (words > 64) throw std::range_error("normal sample: comparison undecided after 4096 bits");
  }
}

// Where a sample's first attempt reads its digits (the stream's first two blocks, w0 .. w3), so that
// block 0 alone decides almost every draw (normal_fixed56_run reads only it):
//   w0             the cell table's uniform, top word (its lower words, on a tie, come after w3);
//   w1 bits 63..15 U's top 49 digits (Z~'s 56 kept bits are the cell's 7 and these 49);
//   w1 bits 14..1  V's top 14 digits;  w1 bit 0  the sign;
//   w2 bits 63..49 U's next 15 digits;  w3 bits 63..14  V's next 50 digits (the rest of w2, w3 unused).
// Every digit is read once, for one purpose: U, V, the cell's uniform and the sign are independent
// uniforms as if each had its own stream. After w3 the stream is read in order (ties, later digits, retries).
struct FirstAttempt {
  static constexpr int kKeptBits = 56;                  // Z~'s fraction bits (kernels/banded_counter.hpp)
  static constexpr int kUHigh = kKeptBits - kCellBits;  // 49
  static constexpr int kVHigh = 64 - kUHigh - 1;        // 14
  static std::uint64_t u_high(std::uint64_t w1) { return w1 >> (64 - kUHigh); }
  static std::uint64_t v_high(std::uint64_t w1) { return (w1 >> 1) & ((std::uint64_t{1} << kVHigh) - 1); }
  static bool negative(std::uint64_t w1) { return (w1 & 1u) != 0; }
  static std::uint64_t u_digit(std::uint64_t w1, std::uint64_t w2) {
    return u_high(w1) << (64 - kUHigh) | w2 >> kUHigh;
  }
  static std::uint64_t v_digit(std::uint64_t w1, std::uint64_t w3) {
    return v_high(w1) << (64 - kVHigh) | w3 >> kVHigh;
  }
};

class CellSampler {
 public:
  explicit CellSampler(NodeStream& rng) : rng_(rng), table_(cell_table()) {}

  NormalSample sample(std::size_t min_words) {
    std::array<std::uint64_t, 4> w;
    for (auto& word : w) word = rng_.next_u64();
    std::uint64_t j = table_.sample_from_top(w[0], rng_);
    u_.reset_to(FirstAttempt::u_digit(w[1], w[2]));
    p_.reset_to(FirstAttempt::v_digit(w[1], w[3]));
    while (!accept(j)) {  // later attempts: every uniform from the stream in order
      j = table_.sample(rng_);
      u_.reset();
      p_.reset();
    }
    NormalSample z;
    z.negative = FirstAttempt::negative(w[1]);
    z.k = static_cast<std::uint32_t>(j >> kCellBits);
    // |Z| = (j + U) 2^-7: fraction word i = low 7 bits of j (i = 0) or of U's digit i - 1, then U's digit i's top 57.
    const std::size_t words = std::max<std::size_t>(min_words, 1);
    std::uint64_t carry = j & ((1u << kCellBits) - 1);
    for (std::size_t i = 0; i < words; ++i) {
      const std::uint64_t d = u_.digit(rng_, i);
      z.fraction.push_back(carry << (64 - kCellBits) | d >> kCellBits);
      carry = d & ((1u << kCellBits) - 1);
    }
    return z;
  }

 private:
  // Bernoulli(exp(-f(U))) by von Neumann: V1 > V2 > ... with V1 < f(U); true iff the run has even length.
  // V1 is p_ (fresh, or its first digit given).
  bool accept(std::uint64_t j) {
    if (!below_f(rng_, p_, u_, j)) return true;
    for (bool even = false;; even = !even) {
      q_.reset();
      if (!q_.less(rng_, p_)) return even;  // run length 1 (odd) ends with false
      p_.swap(q_);
    }
  }

  NodeStream& rng_;
  const CdfTable& table_;
  Deviate u_, p_, q_;
};
}  // namespace

NormalSample sample_normal(NodeStream& rng, std::size_t min_words) { return CellSampler(rng).sample(min_words); }

NormalSample sample_normal_karney(NodeStream& rng, std::size_t min_words) { return AlgorithmN(rng).sample(min_words); }

namespace {
// CellSampler's Z~ when its first attempt is decided by block 0 alone (w0, w1: FirstAttempt): the cell j
// from w0 and V's top 14 digits above j, i.e. V >= (j + 1) 2^-14 > (2j + 1) 2^-15 > U (2j + U) 2^-15 = f(U),
// so below_f is false and the cell accepted; Z~ = sign (j 2^49 + U's top 49 digits). Else (a tie in the
// cell table, or V's top digits not above j: probability about (j + 1) 2^-14) false, and the caller runs
// the general sampler on the node's stream from its start (the same sample). Inlined, its value in registers.
[[gnu::always_inline]] inline bool fixed56_from_block0(std::uint64_t w0, std::uint64_t w1, const CdfTable& table,
                                                       std::int64_t& out) {
  static_assert(kCells < (std::size_t{1} << FirstAttempt::kVHigh));         // every cell's j + 1 is a 14-digit V
  static_assert(kCells < (std::size_t{1} << (63 - FirstAttempt::kUHigh)));  // j 2^49 + U's digits < 2^63
  const std::size_t j = table.cell_from_top(w0);
  if (j == CdfTable::kTie || FirstAttempt::v_high(w1) <= j) return false;
  const auto value = static_cast<std::int64_t>(std::uint64_t{j} << FirstAttempt::kUHigh | FirstAttempt::u_high(w1));
  out = FirstAttempt::negative(w1) ? -value : value;
  return true;
}

// fixed56_from_block0 of one 16-byte block (w0, w1, as NodeStream reads them).
bool decide_one(const std::uint8_t* block, const CdfTable& table, std::int64_t& out) {
  std::array<std::uint64_t, 2> w;
  std::memcpy(w.data(), block, sizeof(w));
  return fixed56_from_block0(w[0], w[1], table, out);
}

#if DPSTREAM_HAVE_AVX512_CODE
// decide_one eight blocks a step, with fixed56_from_block0's arithmetic lane by lane: the cell from one lookup of
// the table's bucket word (CdfTable::bucket: the guide's cell m, and the bucket's first entry, halved, that the
// search compares u0 with), V's test and the value. A lane that needs more (an entry's half equal to u0's, a
// second entry in the bucket where u0 lies past the first, V not above the cell) is left undecided, for
// decide_one (a lane it decides, it decides as decide_one would). One gather a step, where the guide and the
// two entries the search reads took three, each waiting on the one before (perf: 45% of a draw's time).
// Bit i of the result set when block i is decided (out[i] set); bit i of `refused` set when its cell is known and
// V's test fails it (decide_one would refuse it too: the general sampler decides). Lanes past n read nothing.
DPSTREAM_AVX512_TARGET std::uint64_t decide_avx512(const std::uint8_t* blocks, std::size_t n, const CdfTable& table,
                                                   std::int64_t* out, std::uint64_t& refused) {
  const __m512i even = _mm512_set_epi64(14, 12, 10, 8, 6, 4, 2, 0), odd = _mm512_set_epi64(15, 13, 11, 9, 7, 5, 3, 1);
  const __m512i one = _mm512_set1_epi64(1), v_bits = _mm512_set1_epi64((1 << FirstAttempt::kVHigh) - 1);
  const __m512i field_bits = _mm512_set1_epi64(static_cast<long long>(CdfTable::kBucketField));
  const __m512i second_bit = _mm512_set1_epi64(static_cast<long long>(CdfTable::kSecondInBucket));
  const long long* bucket = reinterpret_cast<const long long*>(table.bucket.data());
  constexpr __mmask8 kAll = 0xff;  // the zero-masked forms: GCC 12 warns of its unmasked ones' undefined source
  std::uint64_t decided = 0;
  refused = 0;
  for (std::size_t at = 0; at < n; at += 8) {
    const std::size_t lanes = std::min<std::size_t>(8, n - at);
    const auto in_run = static_cast<__mmask8>((1u << lanes) - 1);
    const std::uint8_t* p = blocks + 16 * at;  // words 0-7 in the first register, 8-15 in the second
    const auto words_lo = static_cast<__mmask8>(lanes >= 4 ? 0xff : (1u << 2 * lanes) - 1);
    const auto words_hi = static_cast<__mmask8>(lanes <= 4 ? 0 : (1u << 2 * (lanes - 4)) - 1);
    const __m512i a = _mm512_maskz_loadu_epi64(words_lo, p);
    const __m512i b = _mm512_maskz_loadu_epi64(words_hi, words_hi != 0 ? p + 64 : p);  // no pointer past the run
    const __m512i w0 = _mm512_permutex2var_epi64(a, even, b), w1 = _mm512_permutex2var_epi64(a, odd, b);
    // The cell: m where u0's half offset in its bucket is below the field, m + 1 above it (no second entry).
    const __m512i top = _mm512_maskz_srli_epi64(kAll, w0, 64 - CdfTable::kGuideBits);
    const __m512i word = _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), kAll, top, bucket, 8);
    const __m512i m = _mm512_maskz_srli_epi64(kAll, word, 64 - CdfTable::kGuideBits);
    const __m512i field = _mm512_and_si512(word, field_bits);
    const __m512i half = _mm512_and_si512(_mm512_maskz_srli_epi64(kAll, w0, 1), field_bits);
    const __mmask8 at_m = _mm512_cmplt_epu64_mask(half, field);
    const __mmask8 at_m1 = _mm512_cmpgt_epu64_mask(half, field) & ~_mm512_test_epi64_mask(word, second_bit);
    const __m512i j = _mm512_mask_add_epi64(m, at_m1, m, one);
    // V's top 14 digits above j: accepted; Z~ = sign (j 2^49 + U's top 49 digits).
    const __m512i v_high = _mm512_and_si512(_mm512_maskz_srli_epi64(kAll, w1, 1), v_bits);
    const __mmask8 cell_known = (at_m | at_m1) & in_run, v_above = _mm512_cmpgt_epu64_mask(v_high, j);
    const __mmask8 ok = cell_known & v_above;
    refused |= std::uint64_t{static_cast<__mmask8>(cell_known & ~v_above)} << at;
    const __m512i value = _mm512_or_si512(_mm512_maskz_slli_epi64(kAll, j, FirstAttempt::kUHigh),
                                          _mm512_maskz_srli_epi64(kAll, w1, 64 - FirstAttempt::kUHigh));
    const __mmask8 negative = _mm512_test_epi64_mask(w1, one);
    const __m512i z = _mm512_mask_sub_epi64(value, negative, _mm512_setzero_si512(), value);
    _mm512_mask_storeu_epi64(out + at, ok, z);
    decided |= std::uint64_t{ok} << at;
  }
  return decided;
}
#endif

// The general sampler on a node's stream whose block 0 was fetched: the rare draws, out of line.
[[gnu::noinline]] std::int64_t general_fixed56(WindowPrf& prf, u128 packed, const std::uint8_t* block0) {
  NodeStream again(prf, packed, 1, block0);
  return normal_fixed56(sample_normal(again));
}

}  // namespace

bool fixed56_from_first_block(const std::array<std::uint64_t, 2>& block0, std::int64_t& out) {
  return fixed56_from_block0(block0[0], block0[1], cell_table(), out);
}

Block0Path best_block0_path() { return cpu_runs_avx512f() ? Block0Path::Avx512 : Block0Path::Scalar; }

std::uint64_t fixed56_from_first_blocks(const std::uint8_t* blocks, std::size_t n, std::int64_t* out, Block0Path path) {
  if (n > 64) throw std::invalid_argument("fixed56_from_first_blocks: at most 64 blocks");
  const CdfTable& table = cell_table();
  std::uint64_t decided = 0, refused = 0;  // refused: left to the general sampler without a scalar test
  if (path != Block0Path::Scalar) {
#if DPSTREAM_HAVE_AVX512_CODE
    if (!cpu_runs_avx512f()) throw std::invalid_argument("fixed56_from_first_blocks: this CPU has no AVX-512F");
    decided = decide_avx512(blocks, n, table, out, refused);
    if (path == Block0Path::Avx512Only) return decided;
#else
    throw std::invalid_argument("fixed56_from_first_blocks: this build has no AVX-512 code");
#endif
  }
  // Every block the vector steps left undecided and did not refuse (all of them on the scalar path).
  for (std::uint64_t rest = ~(decided | refused) & (n == 0 ? 0 : ~std::uint64_t{0} >> (64 - n)); rest != 0;
       rest &= rest - 1) {
    const auto i = static_cast<std::size_t>(std::countr_zero(rest));
    if (decide_one(blocks + 16 * i, table, out[i])) decided |= std::uint64_t{1} << i;
  }
  return decided;
}

void normal_fixed56_run(WindowPrf& prf, const NodeId& first, std::size_t n, std::int64_t* out) {
  if (n == 0) return;
  NodeId last = first;
  last.index += static_cast<std::uint32_t>(n - 1);
  if (n - 1 > std::numeric_limits<std::uint32_t>::max() || last.index < first.index)
    throw std::invalid_argument("normal_fixed56_run: node index out of range");
  static_cast<void>(pack(last));  // range-checks the run's last index; the ones between lie between
  u128 next = pack(first);
  constexpr std::size_t kChunk = 64, kBlock = 16;  // nodes a cipher call (many AES blocks in flight); bytes of block 0
  std::array<std::uint8_t, kChunk * kBlock> fetched;
  // Shorter runs decide block 0 one at a time: a vector step costs more for fewer lanes (2.6 against 3.2 ns a block
  // at 7, 17 against 4 ns at 1; 1.3 against 2.5 ns at 32).
  constexpr std::size_t kVectorFrom = 8;
  for (std::size_t at = 0; at < n; at += kChunk) {
    const std::size_t c = std::min(kChunk, n - at);
    prf.first_blocks_of_run(next, c, fetched.data());
    const std::uint64_t decided = fixed56_from_first_blocks(fetched.data(), c, out + at,
                                                            c >= kVectorFrom ? best_block0_path() : Block0Path::Scalar);
    for (std::uint64_t rest = ~decided & (~std::uint64_t{0} >> (64 - c)); rest != 0; rest &= rest - 1) {
      const auto i = static_cast<std::size_t>(std::countr_zero(rest));
      out[at + i] = general_fixed56(prf, next + (u128{i} << kIndexShift), fetched.data() + kBlock * i);
    }
    next += u128{c} << kIndexShift;  // by addition: the index field, range-checked above, never carries
  }
}

void normal_fixed56_nodes(WindowPrf& prf, const NodeId* ids, std::size_t n, std::int64_t* out) {
  constexpr std::size_t kChunk = 64, kBlock = 16;
  std::array<u128, kChunk> packed;
  std::array<std::uint8_t, kChunk * kBlock> fetched;
  for (std::size_t at = 0; at < n; at += kChunk) {
    const std::size_t c = std::min(kChunk, n - at);
    for (std::size_t i = 0; i < c; ++i) packed[i] = pack(ids[at + i]);
    prf.first_blocks(packed.data(), c, 1, fetched.data());
    const std::uint64_t decided = fixed56_from_first_blocks(fetched.data(), c, out + at, Block0Path::Scalar);
    for (std::uint64_t rest = ~decided & (~std::uint64_t{0} >> (64 - c)); rest != 0; rest &= rest - 1) {
      const auto i = static_cast<std::size_t>(std::countr_zero(rest));
      out[at + i] = general_fixed56(prf, packed[i], fetched.data() + kBlock * i);
    }
  }
}

int128 normal_fixed64(const NormalSample& z) {
  if (z.k >= (1u << 30)) throw std::range_error("normal sample: integer part too large for fixed point");
  const int128 v = (int128{z.k} << 64) + int128{z.fraction.at(0)};
  return z.negative ? -v : v;
}

std::int64_t fixed56_of(int128 fixed64) {
  constexpr int128 kLimit = int128{1} << (64 + 7);  // |Z| < 2^7: |Z~| < 2^63
  if (fixed64 <= -kLimit || fixed64 >= kLimit) throw std::range_error("normal sample: |Z| >= 2^7 (beyond Z~'s range)");
  return static_cast<std::int64_t>(fixed64 / (int128{1} << 8));  // toward zero, as |Z| itself is truncated
}

std::int64_t normal_fixed56(const NormalSample& z) { return fixed56_of(normal_fixed64(z)); }

}  // namespace dpstream::noise
