// The tree code against tests/reference/honaker_variance.json: exact prefix-variance factors,
// a Monte Carlo check of PrefixNoise (the engine's own Honaker recursion) with continuous Gaussian
// node noise, and an exact check that "true prefix + rounded noise" equals the same rounding applied
// to the noisy node values (the post-processing argument in docs/PRIVACY.md).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "kernels/dp_tree.hpp"

using namespace dpstream::kernels::dptree;

namespace {
nlohmann::json reference() {
  std::ifstream f(std::string(DPSTREAM_REFERENCE_DIR) + "/honaker_variance.json");
  if (!f) throw std::runtime_error("missing tests/reference/honaker_variance.json");
  // The file is Python's json output: it spells an unbounded formula value "Infinity", not JSON.
  std::stringstream whole;  // not istreambuf_iterator: GCC 12 warns of a null dereference inside it at -O3
  whole << f.rdbuf();
  std::string text = whole.str();
  for (std::size_t at; (at = text.find("Infinity")) != std::string::npos;) text.replace(at, 8, "null");
  return nlohmann::json::parse(text);
}
}  // namespace

TEST(DpTree, Levels) {
  EXPECT_EQ(levels(1), 1u);
  EXPECT_EQ(levels(16), 5u);
  EXPECT_EQ(levels(100), 7u);
  EXPECT_EQ(levels(1000), 10u);
}

TEST(DpTree, PrefixVarianceFactorsMatchReference) {
  const auto ref = reference();
  for (const auto& row : ref["prefix_variance"]) {
    const auto i = row["i"].get<std::uint32_t>();
    EXPECT_NEAR(prefix_variance_factor(i), row["var_honaker_bottom_up"].get<double>(), 1e-12) << "i = " << i;
  }
  for (const auto& row : ref["node_variance"]) {
    const auto j = row["height_j_levels_below"].get<std::uint32_t>();
    if (j < 32) {
      EXPECT_NEAR(prefix_variance_factor(1u << j), row["v_exact"].get<double>(), 1e-12) << "j = " << j;
    }
  }
}

// Var of the engine's prefix noise, estimated over independent trees with N(0, 1) node noise
// scaled by 2^20 (so rounding is negligible). Each estimate has relative sd sqrt(2 / trials);
// the 6-sd bound has a false-failure rate below 1e-8 per step (16 steps).
TEST(DpTree, MonteCarloPrefixVarianceMatchesReference) {
  const auto ref = reference();
  const int trials = 40000;
  const double scale = 1 << 20;
  std::mt19937_64 gen(20261121);
  std::normal_distribution<double> normal;
  std::vector<double> sum2(17, 0.0);
  for (int t = 0; t < trials; ++t) {
    PrefixNoise tree;
    for (std::uint32_t i = 1; i <= 16; ++i) {
      tree.advance(i, [&](std::uint32_t, std::uint32_t) {
        return static_cast<std::int64_t>(std::llround(normal(gen) * scale));
      });
      const double x = static_cast<double>(tree.prefix_noise(1)) / scale;
      sum2[i] += x * x;
    }
  }
  for (const auto& row : ref["prefix_variance"]) {
    const auto i = row["i"].get<std::uint32_t>();
    const double expected = row["var_honaker_bottom_up"].get<double>();
    const double got = sum2[i] / trials;
    EXPECT_NEAR(got, expected, 6 * expected * std::sqrt(2.0 / trials)) << "i = " << i;
  }
}

// Each node's noise is drawn exactly once, when the node completes, whatever the advance pattern.
TEST(DpTree, DrawsEachNodeOnceAndJumpsEqualSteps) {
  std::map<std::pair<std::uint32_t, std::uint32_t>, int> seen;
  auto draw = [&](std::uint32_t level, std::uint32_t index) {
    ++seen[{level, index}];
    return std::int64_t{level} * 1000 + std::int64_t{index} * 7 + 3;
  };
  PrefixNoise stepped, jumped;
  for (std::uint32_t i = 1; i <= 100; ++i) stepped.advance(i, draw);
  for (const auto& [node, n] : seen) EXPECT_EQ(n, 1) << node.first << "," << node.second;
  EXPECT_EQ(seen.size(), 100u + 50 + 25 + 12 + 6 + 3 + 1);  // nodes ending at or before 100
  jumped.advance(37, draw);
  jumped.advance(100, draw);
  EXPECT_EQ(stepped.prefix_noise(1 << 20), jumped.prefix_noise(1 << 20));
}

// Honaker from noisy node values (true + noise), computed directly with exact rationals per node and
// rounded per node, equals true prefix + PrefixNoise::prefix_noise for integer leaf data.
TEST(DpTree, TruePlusNoiseEqualsRoundedEstimateOfNoisyNodes) {
  std::mt19937_64 gen(7);
  std::uniform_int_distribution<int> leaf_value(0, 50), noise_value(-400, 400);
  const std::uint32_t n = 64;
  for (int rep = 0; rep < 50; ++rep) {
    std::vector<std::int64_t> leaves(n + 1);
    for (std::uint32_t i = 1; i <= n; ++i) leaves[i] = leaf_value(gen);
    std::map<std::pair<std::uint32_t, std::uint32_t>, std::int64_t> noise;
    auto draw = [&](std::uint32_t level, std::uint32_t index) {
      auto [it, fresh] = noise.try_emplace({level, index}, noise_value(gen));
      return it->second;
    };
    const std::int64_t q = 1 << 20;
    PrefixNoise tree;
    for (std::uint32_t i = 1; i <= n; ++i) {
      tree.advance(i, draw);
      // Direct: z(node) = (2^j y + (2^j - 1)(z_L + z_R)) / (2^(j+1) - 1) as exact rationals (long double is
      // exact enough here), rounded per node on the q grid.
      std::function<long double(std::uint32_t, std::uint32_t)> z = [&](std::uint32_t j,
                                                                       std::uint32_t k) -> long double {
        std::int64_t truth = 0;
        for (std::uint32_t l = k * (1u << j) + 1; l <= (k + 1) * (1u << j); ++l) truth += leaves[l];
        const long double y = static_cast<long double>(truth + noise.at({j, k}));
        if (j == 0) return y;
        const long double w = std::ldexp(1.0L, static_cast<int>(j));
        return (w * y + (w - 1) * (z(j - 1, 2 * k) + z(j - 1, 2 * k + 1))) / (2 * w - 1);
      };
      std::int64_t direct = 0, truth = 0;
      std::uint32_t start = 0;
      for (std::uint32_t j = 32; j-- > 0;)
        if (i >> j & 1u) {
          direct += std::llround(z(j, start >> j) * q);
          start += 1u << j;
        }
      for (std::uint32_t l = 1; l <= i; ++l) truth += leaves[l];
      EXPECT_EQ(static_cast<dpstream::int128>(truth) * q + tree.prefix_noise(q), direct) << "i = " << i;
    }
  }
}

TEST(DpTree, RoundDivIsNearestTiesAwayFromZero) {
  EXPECT_EQ(round_div(7, 2), 4);
  EXPECT_EQ(round_div(-7, 2), -4);
  EXPECT_EQ(round_div(5, 3), 2);
  EXPECT_EQ(round_div(-5, 3), -2);
  EXPECT_EQ(round_div(4, 3), 1);
  EXPECT_EQ(round_div(-4, 3), -1);
}

// The nearest-integer property checked directly in 128-bit arithmetic: r = round(n / d) iff
// |n - r d| <= d / 2, with a tie (2 |n - r d| = d) going away from zero. Over random numerators of
// every size (the 64-bit fast paths and the 128-bit one) and every Honaker denominator 2^(j+1) - 1.
TEST(DpTree, RoundingIsExactAtEverySize) {
  std::mt19937_64 rng(17);
  auto check = [](dpstream::int128 n, dpstream::int128 d, dpstream::int128 r, const char* what) {
    const dpstream::int128 twice_err = 2 * (n - r * d);  // 2 (n - r d), in [-d, d]
    ASSERT_TRUE(twice_err <= d && twice_err >= -d)
        << what << " n " << static_cast<double>(n) << " d " << static_cast<double>(d);
    if (twice_err == d || twice_err == -d) {
      ASSERT_TRUE(n >= 0 ? r * d >= n : r * d <= n) << what << ": tie toward zero";
    }
  };
  for (int i = 0; i < 200000; ++i) {
    const int bits = static_cast<int>(rng() % 100);  // magnitudes from 1 to 2^100
    dpstream::int128 n = static_cast<dpstream::int128>(rng() >> (bits < 64 ? 63 - bits % 64 : 0));
    if (bits >= 64) n = (n << (bits - 63)) | static_cast<dpstream::int128>(rng() >> 40);
    if (rng() & 1) n = -n;
    const std::uint32_t j = static_cast<std::uint32_t>(rng() % 32);
    const dpstream::int128 d = (dpstream::int128{1} << (j + 1)) - 1;
    check(n, d, round_honaker(n, j), "round_honaker");
    ASSERT_EQ(round_honaker(n, j), round_div(n, d));
    const dpstream::int128 d2 = 1 + static_cast<dpstream::int128>(rng() >> (rng() % 64));
    check(n, d2, round_div(n, d2), "round_div");
  }
  for (std::uint32_t j = 0; j < 32; ++j)  // ties and the edges of the fast path
    for (const dpstream::int128 n :
         {dpstream::int128{0}, dpstream::int128{1}, (dpstream::int128{1} << 62) - 1, dpstream::int128{1} << 62,
          (dpstream::int128{1} << j), ((dpstream::int128{2} << j) - 1) / 2 + 1,
          ((dpstream::int128{2} << j) - 1) * 12345 + ((dpstream::int128{2} << j) - 1) / 2}) {
      check(n, (dpstream::int128{2} << j) - 1, round_honaker(n, j), "round_honaker edge");
      check(-n, (dpstream::int128{2} << j) - 1, round_honaker(-n, j), "round_honaker edge");
    }
}

// PrefixTotal, updated only where a step changes the stack, equals prefix_noise at every step, for
// stacks started at any step and grids of any size.
TEST(DpTree, PrefixTotalTracksPrefixNoise) {
  std::mt19937_64 rng(23);
  for (int trial = 0; trial < 200; ++trial) {
    const std::int64_t q = std::int64_t{1} << (rng() % 40);
    auto draw = [&](std::uint32_t level, std::uint32_t index) {  // any pure function of the node will do
      std::mt19937_64 node(level * 1000003ULL + index * 7919ULL + static_cast<std::uint64_t>(trial));
      return static_cast<std::int64_t>(node() % 200001) - 100000;
    };
    PrefixNoise stack;
    stack.advance(static_cast<std::uint32_t>(rng() % 70), draw);
    PrefixTotal total(stack, q);
    ASSERT_EQ(total.total(), stack.prefix_noise(q));
    const std::uint32_t end = stack.at() + 80;
    for (std::uint32_t i = stack.at() + 1; i <= end; ++i) {
      PrefixNoise next = stack;
      next.advance(i, draw);
      stack = next;
      total.stepped(stack, i);
      ASSERT_EQ(total.total(), stack.prefix_noise(q)) << "trial " << trial << " step " << i;
    }
  }
}
