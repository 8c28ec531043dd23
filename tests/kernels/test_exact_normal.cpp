// Tests of the exact continuous normal sampler (kernels/exact_normal.hpp) against the normal CDF
// computed independently (std::erfc). Fixed seeds; each statistical assertion states its
// false-failure rate under a fresh seed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

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

std::vector<NormalSample> draw(std::uint32_t n, std::uint64_t seed, std::size_t words = 1) {
  WindowPrf prf(secret_from_seed(seed), 0);
  std::vector<NormalSample> out;
  out.reserve(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    NodeStream s(prf, node(i));
    out.push_back(sample_normal(s, words));
  }
  return out;
}

}  // namespace

// 400k samples in 66 bins (width 1/8 on [-4, 4] plus the two tails): chi-square p > 1e-6 (a fresh
// seed fails with probability 1e-6). A sampler off by 1% in one bin's mass fails it.
TEST(ExactNormal, MatchesTheNormalCdf) {
  constexpr std::uint32_t kN = 400000;
  constexpr int kBins = 64;  // inner bins; plus two tails
  std::vector<double> count(kBins + 2, 0);
  for (const auto& z : draw(kN, 11)) {
    const double v = value(z);
    const int b = v < -4 ? 0 : (v >= 4 ? kBins + 1 : 1 + static_cast<int>(std::floor((v + 4) * 8)));
    count[b] += 1;
  }
  double chi2 = 0;
  for (int b = 0; b < kBins + 2; ++b) {
    const double lo = b == 0 ? -INFINITY : -4 + (b - 1) / 8.0, hi = b == kBins + 1 ? INFINITY : -4 + b / 8.0;
    const double expected = kN * ((std::isinf(hi) ? 1 : normal_cdf(hi)) - (std::isinf(lo) ? 0 : normal_cdf(lo)));
    chi2 += (count[b] - expected) * (count[b] - expected) / expected;
  }
  EXPECT_GT(chi2_upper(chi2, kBins + 1), 1e-6) << "chi2 = " << chi2;
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
  EXPECT_LT(std::abs(var - 1), 5 * std::sqrt(2.0 / kN));  // Var(Z^2) = 2
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
