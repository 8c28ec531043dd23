// Tests of the exact continuous normal sampler (kernels/exact_normal.hpp) against the normal CDF
// computed independently (std::erfc). Fixed seeds; each statistical assertion states its
// false-failure rate under a fresh seed.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "kernels/cdf_table.hpp"
#include "kernels/exact_normal.hpp"

using namespace dpstream::noise;

namespace {

NodeId node(std::uint32_t i) { return NodeId{7, Family::KeySelection, 0, 0, i}; }

double value(const NormalSample& z) {
  const double v = z.k + std::ldexp(static_cast<double>(z.fraction[0]), -64);
  return z.negative ? -v : v;
}

double normal_cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }

// Upper tail of chi-square with `dof` degrees of freedom (Wilson-Hilferty; adequate at dof >= 30).
double chi2_upper(double x, double dof) {
  const double z = (std::cbrt(x / dof) - (1 - 2 / (9 * dof))) / std::sqrt(2 / (9 * dof));
  return 0.5 * std::erfc(z / std::sqrt(2.0));
}

std::vector<NormalSample> draw(std::uint32_t n, std::uint64_t seed, std::size_t words = 1, bool karney = false) {
  WindowPrf prf(secret_from_seed(seed), 0);
  std::vector<NormalSample> out;
  out.reserve(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    NodeStream s(prf, node(i));
    out.push_back(karney ? sample_normal_karney(s, words) : sample_normal(s, words));
  }
  return out;
}

double chi2_against_cdf(const std::vector<NormalSample>& samples) {
  constexpr int kBins = 64;  // width 1/8 on [-4, 4]; plus two tails
  std::vector<double> count(kBins + 2, 0);
  for (const auto& z : samples) {
    const double v = value(z);
    const int b = v < -4 ? 0 : (v >= 4 ? kBins + 1 : 1 + static_cast<int>(std::floor((v + 4) * 8)));
    count[b] += 1;
  }
  const double n = static_cast<double>(samples.size());
  double chi2 = 0;
  for (int b = 0; b < kBins + 2; ++b) {
    const double lo = b == 0 ? -INFINITY : -4 + (b - 1) / 8.0, hi = b == kBins + 1 ? INFINITY : -4 + b / 8.0;
    const double expected = n * ((std::isinf(hi) ? 1 : normal_cdf(hi)) - (std::isinf(lo) ? 0 : normal_cdf(lo)));
    chi2 += (count[b] - expected) * (count[b] - expected) / expected;
  }
  return chi2_upper(chi2, kBins + 1);
}

}  // namespace

// 400k samples in 66 bins (width 1/8 on [-4, 4] plus the two tails): chi-square p > 1e-6 (a fresh
// seed fails with probability 1e-6), for the table sampler and for Karney's exact algorithm.
TEST(ExactNormal, MatchesTheNormalCdf) {
  EXPECT_GT(chi2_against_cdf(draw(400000, 11)), 1e-6);
  EXPECT_GT(chi2_against_cdf(draw(400000, 12, 1, true)), 1e-6);
}

// Within a table cell [a, a + h) (h = 2^-7) the density falls as exp(-(z^2 - a^2)/2): the position
// t = frac(128 |Z|) has E[t] - 1/2 = about -a h / 12. Over the 16M samples with 1 <= |Z| < 3 its mean
// must match the value integrated from the normal pdf within 5 standard errors (false failure 6e-7);
// a sampler that accepted every proposal (uniform within cells) is 7 standard errors off.
TEST(ExactNormal, DensityFallsWithinCells) {
  constexpr double h = 1.0 / 128;
  const auto pdf = [](double z) { return std::exp(-z * z / 2) / std::sqrt(2 * M_PI); };
  double mass = 0, moment = 0;  // for |Z| >= 0: cells [a, a + h) with 1 <= a < 3, both signs (a factor 2 cancels)
  for (int j = 128; j < 384; ++j) {
    const double a = j * h, b = a + h, m = normal_cdf(b) - normal_cdf(a);
    mass += m;
    moment += (pdf(a) - pdf(b) - a * m) / h - m / 2;  // E[(t - 1/2) 1_cell]
  }
  const double expected = moment / mass;
  WindowPrf prf(secret_from_seed(31), 0);
  double n = 0, sum = 0;
  for (std::uint32_t i = 0; i < 16000000; ++i) {
    NodeStream st(prf, NodeId{i >> 20, Family::KeySelection, 0, 0, i & 0xfffff});
    const NormalSample z = sample_normal(st);
    if (z.k < 1 || z.k >= 3) continue;
    const double t = std::ldexp(static_cast<double>(z.fraction[0] << 7), -64);  // frac(128 |Z|)
    n += 1, sum += t - 0.5;
  }
  const double se = std::sqrt(1.0 / 12 / n);
  EXPECT_LT(std::abs(sum / n - expected), 5 * se) << "mean " << sum / n << " expected " << expected << " se " << se;
}

// Moments: mean within 5 standard errors of 0, variance within 5 of 1 (false failure < 1e-6 each).
TEST(ExactNormal, MeanAndVariance) {
  constexpr std::uint32_t kN = 200000;
  double s = 0, s2 = 0, s4 = 0;
  for (const auto& z : draw(kN, 3)) {
    const double v = value(z);
    s += v, s2 += v * v, s4 += v * v * v * v;
  }
  const double mean = s / kN, var = s2 / kN;
  EXPECT_LT(std::abs(mean), 5 / std::sqrt(kN));
  EXPECT_LT(std::abs(var - 1), 5 * std::sqrt(2.0 / kN));       // Var(Z^2) = 2
  EXPECT_LT(std::abs(s4 / kN - 3), 5 * std::sqrt(96.0 / kN));  // E Z^4 = 3, Var(Z^4) = 96
}

// The fraction's low digits are uniform: the lowest bit of the first digit and a second digit's top
// bit are fair coins (5 standard errors).
TEST(ExactNormal, LowDigitsAreUniform) {
  constexpr std::uint32_t kN = 100000;
  double low = 0, second = 0;
  for (const auto& z : draw(kN, 5, 2)) {
    low += static_cast<double>(z.fraction[0] & 1);
    second += static_cast<double>(z.fraction[1] >> 63);
  }
  EXPECT_LT(std::abs(low / kN - 0.5), 5 * 0.5 / std::sqrt(kN));
  EXPECT_LT(std::abs(second / kN - 0.5), 5 * 0.5 / std::sqrt(kN));
}

// A pure function of the node, and asking for more digits refines the sample without changing it.
TEST(ExactNormal, MoreDigitsRefineTheSameSample) {
  const auto one = draw(2000, 9, 1), three = draw(2000, 9, 3), again = draw(2000, 9, 1);
  for (std::size_t i = 0; i < one.size(); ++i) {
    ASSERT_EQ(three[i].fraction.size(), 3u);
    EXPECT_EQ(one[i].negative, three[i].negative);
    EXPECT_EQ(one[i].k, three[i].k);
    EXPECT_EQ(one[i].fraction[0], three[i].fraction[0]);
    EXPECT_EQ(one[i].fraction[0], again[i].fraction[0]);
    EXPECT_EQ(normal_fixed64(one[i]), normal_fixed64(three[i]));
  }
  // Different nodes give different samples.
  EXPECT_NE(one[0].fraction[0], one[1].fraction[0]);
}

// normal_fixed64 is sign (k 2^64 + f0): within 2^-64 of the value, toward zero.
TEST(ExactNormal, FixedPointIsTruncatedTowardZero) {
  for (const auto& z : draw(1000, 13)) {
    const dpstream::int128 f = normal_fixed64(z);
    const double v = std::ldexp(static_cast<double>(f), -64);
    EXPECT_NEAR(v, value(z), 1e-12);
    EXPECT_EQ(f < 0, z.negative && (z.k > 0 || z.fraction[0] > 0));
  }
}

// Z~ (normal_fixed56) is sign floor(|Z| 2^56): normal_fixed64 divided by 2^8 toward zero, checked here
// against the sample's own digits; |Z| >= 2^7 is refused (the banded counters' int64 range).
TEST(ExactNormal, Fixed56IsZTruncatedTowardZeroTo56Bits) {
  for (const auto& z : draw(1000, 14)) {
    const std::uint64_t magnitude = std::uint64_t{z.k} << 56 | z.fraction[0] >> 8;
    const auto expected = static_cast<std::int64_t>(magnitude);
    EXPECT_EQ(normal_fixed56(z), z.negative ? -expected : expected);
    EXPECT_EQ(fixed56_of(normal_fixed64(z)), normal_fixed56(z));
  }
  const dpstream::int128 edge = (dpstream::int128{1} << 71) - 1;  // |Z| just below 2^7
  EXPECT_EQ(fixed56_of(edge), std::numeric_limits<std::int64_t>::max());
  EXPECT_EQ(fixed56_of(-edge), -std::numeric_limits<std::int64_t>::max());
  EXPECT_EQ(fixed56_of(-dpstream::int128{255}), 0);  // toward zero, not down
  EXPECT_THROW(fixed56_of(edge + 1), std::range_error);
  EXPECT_THROW(fixed56_of(-edge - 1), std::range_error);
}

namespace {
// The general sampler fed the stream `words` (w0 .. w3, as the stream's first two blocks) and then the node's
// own PRF stream.
NormalSample sample_from_words(WindowPrf& prf, const NodeId& id, const std::array<std::uint64_t, 4>& words) {
  std::array<std::uint8_t, sizeof(words)> bytes;
  std::memcpy(bytes.data(), words.data(), sizeof(words));
  NodeStream s(prf, pack(id), 2, bytes.data());
  return sample_normal(s);
}
}  // namespace

// Where the first-block shortcut decides a draw, it gives the general sampler's Z~ (fed the same words): crafted
// blocks at every edge. The stream's layout (docs/PRIVACY.md section 4): w0 the cell's uniform; w1 = U's top 49
// digits, V's top 14, the sign; w2, w3 the rest of U's and V's first digits. The shortcut's rule: cell j is decided
// from block 0 iff w0 does not tie a table entry and V's top 14 digits exceed j (else the general sampler runs:
// always safe, so only the decided cases need the comparison; the rule itself is asserted so that a wider one,
// which would be unsound on some U, V, fails here).
// The tests' pseudo-random words (Knuth's MMIX LCG): the next state of x.
std::uint64_t lcg_next(std::uint64_t& x) { return x = x * 6364136223846793005u + 1442695040888963407u; }

// The cell table seen through fixed56_from_first_block alone (the table itself is the sampler's own).
constexpr std::uint64_t kAcceptAll = ~std::uint64_t{0} - 1;  // w1 with V's top digits at their maximum
bool tie(std::uint64_t w0) {  // w0 equals a table entry's top word: the lower words decide
  std::int64_t z = 0;
  return !fixed56_from_first_block({w0, kAcceptAll}, z);
}
std::uint64_t cell_of(std::uint64_t w0) {  // the cell w0 gives (a tie counted as the cell above it)
  std::int64_t z = 0;
  for (; !fixed56_from_first_block({w0, kAcceptAll}, z); ++w0)
    if (w0 == ~std::uint64_t{0}) return std::uint64_t{1} << 20;  // ties up to the top: above every decided cell
  return static_cast<std::uint64_t>(z) >> 49;
}
std::uint64_t lowest_word_of_cell(std::uint64_t j) {  // the smallest w0 with cell_of(w0) >= j
  std::uint64_t lo = 0, hi = ~std::uint64_t{0};
  while (lo < hi) {
    const std::uint64_t mid = lo + (hi - lo) / 2;
    if (cell_of(mid) >= j)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

TEST(ExactNormal, FirstBlockShortcutEqualsTheGeneralSamplerWhereItDecides) {
  WindowPrf prf(secret_from_seed(25), 2);
  // The largest cell block 0 can decide: the highest w0 that ties no entry. Beyond it the entries' top words are
  // the last few values below 2^64 (P[|Z| beyond] < 2^-62), each a tie the general sampler decides.
  // P[|Z| >= 8] > 2^-62: that cell is above 1024.
  std::uint64_t top = ~std::uint64_t{0};
  while (tie(top)) --top;
  const std::uint64_t last = cell_of(top);
  ASSERT_GE(last, 1024u);
  ASSERT_GT(~std::uint64_t{0} - top, 0u) << "the all-ones word ties the tail's entries";
  std::uint32_t decided = 0, refused = 0, ties = 0;
  for (const std::uint64_t want : std::array<std::uint64_t, 8>{0, 1, 100, 127, 128, 700, last - 1, last}) {
    // The cell's first word (a tie with the entry below it), or the highest word that ties nothing for the last.
    const std::uint64_t w0_first = want == last ? top : lowest_word_of_cell(want);
    ASSERT_GE(cell_of(w0_first), want);  // above `want` only where a tail cell has no word of its own
    const std::uint64_t room = ~std::uint64_t{0} - w0_first;  // offsets that stay in range (no wrap to cell 0)
    for (const std::uint64_t offset : std::array<std::uint64_t, 3>{0, 1, std::uint64_t{1} << 40}) {
      if (offset > room) continue;
      const std::uint64_t w0 = w0_first + offset;
      const std::uint64_t j = cell_of(w0);
      if (j > last) continue;  // past the highest word that ties nothing: ties up to the top
      ties += tie(w0);
      for (const std::uint64_t v_top : {j == 0 ? j : j - 1, j, j + 1, j + 2, (std::uint64_t{1} << 14) - 1}) {
        for (const std::uint64_t u_top :
             std::array<std::uint64_t, 4>{0, 1, (std::uint64_t{1} << 49) - 1, 0x123456789abc}) {
          for (const std::uint64_t sign : std::array<std::uint64_t, 2>{0, 1}) {
            const std::uint64_t w1 = u_top << 15 | v_top << 1 | sign;
            for (const std::uint64_t w2 : std::array<std::uint64_t, 2>{0, ~std::uint64_t{0}}) {
              const std::array<std::uint64_t, 4> words{w0, w1, w2, 0x0f0f0f0f0f0f0f0full};
              const NodeId id{want, Family::BandedSelection, static_cast<std::uint32_t>(v_top % 7), 0,
                              static_cast<std::uint32_t>(u_top & 0xffff)};
              std::int64_t fast = 0;
              const bool shortcut = fixed56_from_first_block({w0, w1}, fast);
              ASSERT_EQ(shortcut, !tie(w0) && v_top > j) << "cell " << j << " V top " << v_top;
              if (!shortcut) {
                ++refused;
                continue;
              }
              ++decided;
              const NormalSample z = sample_from_words(prf, id, words);
              ASSERT_EQ(fast, normal_fixed56(z)) << "cell " << j << " V top " << v_top << " U top " << u_top;
              const auto expected = static_cast<std::int64_t>(j << 49 | u_top);
              ASSERT_EQ(fast, sign ? -expected : expected);
            }
          }
        }
      }
    }
  }
  EXPECT_GT(decided, 0u);
  EXPECT_GT(refused, 0u);
  EXPECT_GT(ties, 0u) << "the lowest word of a cell above 0 is its lower entry's top word: a tie";
}

// normal_fixed56_run decides block 0s eight at a time with AVX-512F where the CPU runs it: the same decisions
// and values as one at a time, on every cell's edges (the words just below, at and above each entry's top word
// and each guide bucket's first word, where the bucket word's comparison and ties are decided), V's top digits
// just below, at and above the cell, both signs and random words, in runs of every length 1-64 at odd offsets.
// Lanes left undecided must keep `out` as it was.
TEST(ExactNormal, VectorBlock0PathDecidesAsTheScalarOne) {
  if (best_block0_path() != Block0Path::Avx512) GTEST_SKIP() << "this CPU has no AVX-512F: only the scalar path runs";
  std::uint64_t x = 0x243f6a8885a308d3u;
  const auto next = [&] { return lcg_next(x); };
  std::vector<std::uint64_t> w0s;
  for (std::uint64_t j = 1; j < 2100; ++j) {
    const std::uint64_t edge = lowest_word_of_cell(j);
    if (edge == ~std::uint64_t{0}) break;
    w0s.insert(w0s.end(), {edge - 1, edge, edge + 1});
  }
  for (std::uint64_t h = 0; h < 4096; ++h) w0s.insert(w0s.end(), {h << 52, (h << 52) - 1, (h << 52) + 1});
  w0s.insert(w0s.end(), {0, 1, ~std::uint64_t{0}, ~std::uint64_t{0} - 1});
  const std::size_t random_pairs = 50000;  // last: 4 pairs each (V's top digits below, at, above the cell, random)
  for (std::size_t i = 0; i < random_pairs; ++i) w0s.push_back(next());
  std::vector<std::uint64_t> words;  // w0, w1 pairs
  for (const std::uint64_t w0 : w0s) {
    const std::uint64_t j = std::min<std::uint64_t>(cell_of(w0), (1u << 14) - 1);
    for (const std::uint64_t v_top : {j == 0 ? 0 : j - 1, j, j + 1, next() >> 50}) {
      const std::uint64_t w1 = (next() & ~std::uint64_t{0x7fff}) | (v_top & 0x3fff) << 1 | (next() >> 63);
      words.insert(words.end(), {w0, w1});
    }
  }
  std::uint32_t decided = 0, undecided = 0, decided_random = 0, vector_alone_random = 0;
  std::vector<std::uint8_t> bytes(words.size() * 8 + 16);
  for (const std::size_t offset : {std::size_t{0}, std::size_t{3}}) {  // misaligned blocks too
    std::memcpy(bytes.data() + offset, words.data(), words.size() * 8);
    std::size_t at = 0;
    for (std::size_t n = 1; at + n <= words.size() / 2; n = n % 64 + 1) {
      std::array<std::int64_t, 64> scalar, vector;
      scalar.fill(-7);
      vector.fill(-7);
      const std::uint8_t* blocks = bytes.data() + offset + 16 * at;
      const std::uint64_t s = fixed56_from_first_blocks(blocks, n, scalar.data(), Block0Path::Scalar);
      const std::uint64_t v = fixed56_from_first_blocks(blocks, n, vector.data(), Block0Path::Avx512);
      ASSERT_EQ(v, s) << "blocks " << at << " .. " << at + n - 1;
      ASSERT_EQ(vector, scalar) << "blocks " << at << " .. " << at + n - 1;
      // The vector steps alone: a subset of the scalar decisions, with their values, the rest untouched.
      std::array<std::int64_t, 64> alone;
      alone.fill(-7);
      const std::uint64_t a = fixed56_from_first_blocks(blocks, n, alone.data(), Block0Path::Avx512Only);
      ASSERT_EQ(a & ~s, 0u) << "blocks " << at << " .. " << at + n - 1;
      for (std::size_t i = 0; i < 64; ++i) ASSERT_EQ(alone[i], (a >> i & 1) != 0 ? scalar[i] : -7) << at + i;
      const int set = std::popcount(s);
      decided += set;
      undecided += static_cast<std::uint32_t>(n) - set;
      if (at >= words.size() / 2 - 4 * random_pairs)  // the random words (the last blocks), as a run meets them
        decided_random += set, vector_alone_random += std::popcount(a);
      at += n;
    }
  }
  EXPECT_GT(decided, 100000u);
  EXPECT_GT(undecided, 10000u);
  // The vector steps leave only the rare cases (u0 past the first of two entries in its bucket: tail cells, about
  // 1% of draws; an equal half): a vector path that decided nothing would pass every comparison above.
  EXPECT_GT(vector_alone_random, decided_random / 100 * 99) << vector_alone_random << " of " << decided_random;
  std::array<std::int64_t, 65> out{};
  EXPECT_THROW(fixed56_from_first_blocks(bytes.data(), 65, out.data()), std::invalid_argument);
}

// The vector steps read no byte past a run's last block: runs of 1-64 blocks ending at an unreadable page (a
// masked load that read its whole register there would fault; AddressSanitizer does not see masked loads).
TEST(ExactNormal, VectorBlock0PathReadsNothingPastTheRun) {
  if (best_block0_path() != Block0Path::Avx512) GTEST_SKIP() << "this CPU has no AVX-512F: only the scalar path runs";
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  void* mem = mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  auto* base = static_cast<std::uint8_t*>(mem);
  ASSERT_EQ(mprotect(base + page, page, PROT_NONE), 0);
  std::uint64_t x = 0x13198a2e03707344u;
  for (std::size_t i = 0; i < page; i += 8) {
    const std::uint64_t word = lcg_next(x);
    std::memcpy(base + i, &word, 8);
  }
  for (std::size_t n = 1; n <= 64; ++n) {
    const std::uint8_t* blocks = base + page - 16 * n;
    std::array<std::int64_t, 64> scalar{}, vector{};
    const std::uint64_t s = fixed56_from_first_blocks(blocks, n, scalar.data(), Block0Path::Scalar);
    EXPECT_EQ(fixed56_from_first_blocks(blocks, n, vector.data(), Block0Path::Avx512), s) << n;
    EXPECT_EQ(vector, scalar) << n;
  }
  munmap(mem, 2 * page);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// The run takes the vector path exactly where GCC's CPU model says the CPU has AVX-512F.
TEST(ExactNormal, VectorPathChosenWhereTheCpuHasAvx512) {
  EXPECT_EQ(best_block0_path() == Block0Path::Avx512, __builtin_cpu_supports("avx512f") != 0);
}
#endif

// The sign (w1's bit 0) is independent of the magnitude: P[negative] is 1/2 within 5 standard errors in each
// of |Z|'s ranges [0, 1/2), [1/2, 1), [1, 2), [2, 20) and for each value of Z~'s two lowest bits (w1's bits 16
// and 15, U's lowest digits in block 0; V's 14 digits lie between them and the sign). False failure < 1e-5 in all.
TEST(ExactNormal, SignIsIndependentOfTheMagnitude) {
  WindowPrf prf(secret_from_seed(27), 1);
  constexpr std::uint32_t kN = 400000;
  std::vector<std::int64_t> run(kN);
  normal_fixed56_run(prf, NodeId{5, Family::BandedSelection, 1, 0, 0}, kN, run.data());
  std::array<double, 4> range_n{}, range_neg{}, low_n{}, low_neg{};
  for (const std::int64_t z : run) {
    const auto mag = static_cast<std::uint64_t>(z < 0 ? -z : z);
    const double v = std::ldexp(static_cast<double>(mag), -56);
    const int r = v < 0.5 ? 0 : (v < 1 ? 1 : (v < 2 ? 2 : 3));
    range_n[r] += 1, range_neg[r] += z < 0;
    low_n[mag & 3] += 1, low_neg[mag & 3] += z < 0;
  }
  for (int i = 0; i < 4; ++i) {
    EXPECT_LT(std::abs(range_neg[i] / range_n[i] - 0.5), 5 * 0.5 / std::sqrt(range_n[i])) << "range " << i;
    EXPECT_LT(std::abs(low_neg[i] / low_n[i] - 0.5), 5 * 0.5 / std::sqrt(low_n[i])) << "low bits " << i;
  }
}

// A run of consecutive indices (a counter's steps, packed by addition) draws what the general sampler
// draws from each node's own stream, as Z~; a run whose last index passes 2^20 - 1 is refused.
TEST(ExactNormal, Fixed56RunEqualsOneNodeAtATime) {
  WindowPrf prf(secret_from_seed(23), 5);
  constexpr std::uint32_t kSteps = 70000;
  const NodeId first{0x0123456789abcdefull, Family::BandedSelection, 7, 0, (1u << 20) - kSteps};
  std::vector<std::int64_t> run(kSteps);
  normal_fixed56_run(prf, first, kSteps, run.data());
  std::uint32_t beyond_two = 0;
  for (std::uint32_t i = 0; i < kSteps; ++i) {
    NodeId id = first;
    id.index += i;
    NodeStream s(prf, id);
    const NormalSample z = sample_normal(s);
    ASSERT_EQ(run[i], normal_fixed56(z)) << "step " << i;
    beyond_two += z.k >= 2;
  }
  EXPECT_GT(beyond_two, 2500u) << "the tails must be exercised (P[|Z| >= 2] = 0.0455)";
  EXPECT_THROW(normal_fixed56_run(prf, first, kSteps + 1, run.data()), std::invalid_argument);
  normal_fixed56_run(prf, first, 0, nullptr);
}

// The batch's shortcut reads the cell from the stream's first word: the first entry above it, or
// kTie where the word ties an entry the search compares (the lower words would decide).
TEST(CdfTable, CellFromTopIsTheFirstEntryAboveOrATie) {
  std::vector<BigFloat> mass;
  mass.reserve(5000);
  for (int m = 0; m < 5000; ++m) mass.push_back(BigFloat(1) / (1 + m % 7));  // more entries than guide cells
  const CdfTable table = CdfTable::from_masses(mass);
  const auto reference = [&](std::uint64_t u0) -> std::size_t {  // a linear scan
    for (std::size_t m = 0; m + 1 < table.hi.size(); ++m) {
      if (u0 == table.hi[m]) return CdfTable::kTie;
      if (u0 < table.hi[m]) return m;
    }
    return table.hi.size() - 1;
  };
  std::uint64_t x = 0x9e3779b97f4a7c15u;
  std::vector<std::uint64_t> words;
  words.reserve(100000 + 2 * (table.hi.size() / 37 + 1));
  for (int i = 0; i < 100000; ++i) words.push_back(lcg_next(x));
  for (std::size_t m = 0; m < table.hi.size(); m += 37) words.insert(words.end(), {table.hi[m], table.hi[m] - 1});
  std::size_t ties = 0;
  for (const std::uint64_t u0 : words) {
    ASSERT_EQ(table.cell_from_top(u0), reference(u0)) << u0;
    ties += reference(u0) == CdfTable::kTie;
  }
  EXPECT_GT(ties, 100u);
}

// The bucket word the vector path reads (CdfTable::bucket) gives cell_from_top's cell wherever it decides: on
// every bucket's first and last words, each entry's top word and its neighbours, and random words, for tables
// whose buckets hold no entry, one, or many (5000 entries: cells beyond the 12 bits, which it must never decide).
// It must decide most words: a word that decided nothing would pass the comparison alone.
TEST(CdfTable, BucketWordDecidesAsTheSearch) {
  for (const int entries : {300, 5000}) {
    std::vector<BigFloat> mass;
    mass.reserve(entries);
    for (int m = 0; m < entries; ++m) mass.push_back(BigFloat(1) / (1 + m % 7));
    const CdfTable table = CdfTable::from_masses(mass);
    std::uint64_t x = 0x3c6ef372fe94f82bu;
    std::vector<std::uint64_t> words;
    words.reserve(100000 + 2 * 4096 + 3 * table.hi.size());
    for (int i = 0; i < 100000; ++i) words.push_back(lcg_next(x));
    for (std::uint64_t h = 0; h < 4096; ++h)
      words.insert(words.end(), {h << 52, (h << 52) | (~std::uint64_t{0} >> 12)});
    for (const std::uint64_t hi : table.hi) words.insert(words.end(), {hi - 1, hi, hi + 1});
    std::size_t decided = 0;
    for (const std::uint64_t u0 : words) {
      const std::uint64_t word = table.bucket[u0 >> 52];
      const std::uint64_t field = word & CdfTable::kBucketField, half = (u0 >> 1) & CdfTable::kBucketField;
      const bool second = (word & CdfTable::kSecondInBucket) != 0;
      if (half == field || (half > field && second)) continue;  // left to the search
      ++decided;
      const std::size_t cell = (word >> 52) + (half > field ? 1 : 0);
      ASSERT_EQ(cell, table.cell_from_top(u0)) << entries << " entries, u0 " << u0;
    }
    EXPECT_GT(decided, words.size() / 2) << entries << " entries";
  }
}

// The engine's batch path at scale: 32.8 M values of Z~ from runs of consecutive steps (the fast path and its
// fallbacks as key selection meets them) in bins of width 1/16 of |Z| on [0, 8) by sign, plus the tails beyond 8:
// chi-square p > 1e-6 over the bins expecting >= 5, and P[|Z| >= 3], P[|Z| >= 4] within 5 standard errors of
// the exact values (false failure < 1e-6 each). A fast path without the in-cell test (uniform within cells)
// fails it: chi-square 371 over 155 degrees of freedom.
TEST(ExactNormal, RunsMatchTheNormalCdfAtScale) {
  WindowPrf prf(secret_from_seed(91), 4);
  constexpr int kBins = 128;  // per sign: [b / 16, (b + 1) / 16) for b < kBins, then [8, inf)
  std::vector<double> count(std::size_t{2} * (kBins + 1), 0);
  std::vector<std::int64_t> run(std::size_t{1} << 16);
  double n = 0;
  for (std::uint32_t key = 0; key < 500; ++key) {
    normal_fixed56_run(prf, NodeId{key, Family::BandedSelection, 3, 0, 0}, run.size(), run.data());
    for (const std::int64_t z : run) {
      const double a = std::ldexp(static_cast<double>(z < 0 ? -z : z), -56);
      count[(z < 0 ? 0 : kBins + 1) + (a >= 8 ? kBins : static_cast<int>(a * 16))] += 1;
      n += 1;
    }
  }
  const auto upper = [](double x) { return std::isinf(x) ? 0.0 : 0.5 * std::erfc(x / std::sqrt(2.0)); };  // P[Z >= x]
  double chi2 = 0, dof = -1, beyond3 = 0, beyond4 = 0;
  for (int side = 0; side < 2; ++side)
    for (int b = 0; b <= kBins; ++b) {
      const double c = count[side * (kBins + 1) + b];
      beyond3 += b >= 48 ? c : 0;
      beyond4 += b >= 64 ? c : 0;
      const double expected = n * (upper(b / 16.0) - upper(b == kBins ? INFINITY : (b + 1) / 16.0));
      if (expected < 5) continue;
      chi2 += (c - expected) * (c - expected) / expected;
      dof += 1;
    }
  EXPECT_GT(chi2_upper(chi2, dof), 1e-6) << "chi-square " << chi2 << " over " << dof << " degrees of freedom";
  for (const auto& [x, seen] : {std::pair{3.0, beyond3}, std::pair{4.0, beyond4}}) {
    const double expected = n * 2 * upper(x);
    EXPECT_LT(std::abs(seen - expected), 5 * std::sqrt(expected)) << "P[|Z| >= " << x << "]";
  }
}
