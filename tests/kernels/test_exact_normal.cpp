// Tests of the exact continuous normal sampler (kernels/exact_normal.hpp) against the normal CDF
// computed independently (std::erfc). Fixed seeds; each statistical assertion states its
// false-failure rate under a fresh seed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
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

// The batch (fetched first blocks, a shortcut for a cell accepted at the first digits) draws exactly
// what the general sampler draws from each node's own stream, tail cells (where the shortcut fails
// more often) included.
TEST(ExactNormal, BatchEqualsOneNodeAtATime) {
  WindowPrf prf(secret_from_seed(21), 3);
  constexpr std::uint32_t kNodes = 200000;
  std::vector<NodeId> ids;
  for (std::uint32_t i = 0; i < kNodes; ++i) ids.push_back(NodeId{i % 97, Family::BandedSelection, i % 5, 0, i});
  std::vector<dpstream::int128> batch(kNodes);
  normal_fixed64_batch(prf, ids.data(), ids.size(), batch.data());
  std::uint32_t beyond_two = 0;
  for (std::uint32_t i = 0; i < kNodes; ++i) {
    NodeStream s(prf, ids[i]);
    const NormalSample z = sample_normal(s);
    ASSERT_EQ(batch[i], normal_fixed64(z)) << "node " << i;
    beyond_two += z.k >= 2;
  }
  EXPECT_GT(beyond_two, 7000u) << "the tails must be exercised (P[|Z| >= 2] = 0.0455)";
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
  for (int i = 0; i < 100000; ++i) words.push_back(x = x * 6364136223846793005u + 1442695040888963407u);
  for (std::size_t m = 0; m < table.hi.size(); m += 37) words.insert(words.end(), {table.hi[m], table.hi[m] - 1});
  std::size_t ties = 0;
  for (const std::uint64_t u0 : words) {
    ASSERT_EQ(table.cell_from_top(u0), reference(u0)) << u0;
    ties += reference(u0) == CdfTable::kTie;
  }
  EXPECT_GT(ties, 100u);
}
