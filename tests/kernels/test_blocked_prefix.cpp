// Tests of the banded counter's blocked prefix (kernels/banded_counter.hpp, start_blocked): the blocks
// cover the prefix exactly; where each block's sample is the sum of its steps' (scaled by 2^-L), the
// blocked counter's every state, bound and exact rounding equal the step-by-step counter's and an
// arbitrary-precision computation written here; with the PRF's samples its noise has the law that
// the step-by-step construction has (moments and covariances against the plan's formula).
#include <gtest/gtest.h>

#include <boost/multiprecision/cpp_int.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/banded_counter.hpp"
#include "kernels/exact_normal.hpp"
#include "kernels/noise.hpp"

using namespace dpstream;
using namespace dpstream::kernels::banded;
namespace mp = boost::multiprecision;

namespace {

constexpr std::int64_t kGrid = std::int64_t{1} << 20;  // the engine's output grid (one user = 2^20)
constexpr unsigned kFrac = 128;                        // the synthetic samples' fraction bits

// A sample of value v (units 2^-128) with `words` fraction digits, truncated toward zero as the sampler's
// digits are (more words than two: zeros).
noise::NormalSample sample_of(const mp::cpp_int& v, std::size_t words) {
  noise::NormalSample z;
  z.negative = v < 0;
  const mp::cpp_int m = z.negative ? mp::cpp_int(-v) : v;
  z.k = static_cast<std::uint32_t>(m >> kFrac);
  const mp::cpp_int f = m & ((mp::cpp_int(1) << kFrac) - 1);
  for (std::size_t w = 0; w < words; ++w)
    z.fraction.push_back(w < 2 ? static_cast<std::uint64_t>((f >> (64 * (1 - w))) & ~std::uint64_t{0}) : 0);
  return z;
}

// Steps 1..n with exact values below 1 in magnitude on a grid of 2^-118, and every block's value as the sum
// of its steps over 2^L: exact in 128 fraction bits for L <= 10.
struct SyntheticWorld {
  std::vector<mp::cpp_int> steps;  // steps[r - 1], units 2^-128
  explicit SyntheticWorld(std::uint32_t n, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (std::uint32_t r = 0; r < n; ++r) {
      mp::cpp_int m = rng() >> 10;  // 54 random bits below 2^-10, then 64 more: < 2^-10 + ...
      m = (m << 64 | rng()) << 10;
      steps.push_back(rng() & 1 ? mp::cpp_int(-m) : m);
    }
  }
  mp::cpp_int block(std::uint32_t level, std::uint32_t index) const {
    mp::cpp_int sum = 0;
    const std::uint32_t size = 1u << (2 * level);
    for (std::uint32_t r = index * size; r < (index + 1) * size; ++r) sum += steps.at(r);
    return sum >> level;  // exact: every step is a multiple of 2^10 units
  }
  std::int64_t kept(std::uint32_t index) const { return noise::normal_fixed56(sample_of(steps.at(index), 1)); }
  std::int64_t block_kept(std::uint32_t level, std::uint32_t index) const {
    return noise::normal_fixed56(sample_of(block(level, index), 1));
  }
};

// round(q N_t), ties away from zero, from the exact values: sigma q sum_r M_(t-r) Z_r.
int128 reference_noise(const BandedPlan& plan, std::int64_t q, std::uint32_t t, const SyntheticWorld& w) {
  mp::cpp_int y = 0;
  for (std::uint32_t r = 1; r <= t; ++r) y += w.steps.at(r - 1) * plan.cumulative(t - r);
  const mp::cpp_int num = y * plan.sigma_numerator() * q;
  const unsigned shift = kFrac + kCoefBits + kSigmaBits;
  const mp::cpp_int mag = ((num < 0 ? mp::cpp_int(-num) : num) + (mp::cpp_int(1) << (shift - 1))) >> shift;
  const int128 m = static_cast<int128>((static_cast<uint128>(static_cast<std::uint64_t>(mag >> 64)) << 64) |
                                       static_cast<std::uint64_t>(mag & ~std::uint64_t{0}));
  return num < 0 ? -m : m;
}

// A counter started blocked at step p + b - 1 from the world's blocks and ring.
BandedNoise blocked_counter(const BandedPlan& plan, std::uint32_t p, const SyntheticWorld& w) {
  const std::size_t keep = plan.band() - 1;
  std::vector<std::int64_t> ring(keep);
  for (std::size_t i = 0; i < keep; ++i) ring[i] = w.kept(static_cast<std::uint32_t>(p + i));
  BandedNoise n;
  n.start_blocked(plan, p,
                  BandedNoise::blocks_kept_sum(prefix_blocks(p),
                                               [&](std::uint32_t l, std::uint32_t j) { return w.block_kept(l, j); }),
                  ring.data());
  return n;
}

}  // namespace

TEST(BlockedPrefix, BlocksCoverThePrefixAlignedLargestFirst) {
  std::vector<std::uint32_t> ps;
  for (std::uint32_t p = 0; p <= 5000; ++p) ps.push_back(p);
  for (std::uint32_t l = 1; l <= kMaxBlockLevel; ++l)
    for (const std::int64_t d : {-1, 0, 1}) ps.push_back(static_cast<std::uint32_t>((std::int64_t{1} << (2 * l)) + d));
  ps.push_back(kMaxSteps);
  ps.push_back(kMaxSteps - 1);
  for (const std::uint32_t p : ps) {
    if (p > kMaxSteps) continue;
    const auto blocks = prefix_blocks(p);
    std::uint64_t next = 1;  // the first step not yet covered
    std::uint32_t last_level = kMaxBlockLevel + 1, at_level = 0;
    for (const PrefixBlock& b : blocks) {
      ASSERT_LE(b.level, kMaxBlockLevel);
      const std::uint64_t size = std::uint64_t{1} << (2 * b.level);
      ASSERT_EQ(std::uint64_t{b.index} * size + 1, next) << "p " << p << ": blocks must be contiguous and aligned";
      ASSERT_LE(b.level, last_level) << "p " << p << ": largest first";
      at_level = b.level == last_level ? at_level + 1 : 1;
      ASSERT_LE(at_level, 3u) << "p " << p;
      last_level = b.level;
      next += size;
    }
    ASSERT_EQ(next, std::uint64_t{p} + 1) << "p " << p << ": the blocks cover exactly steps 1..p";
    ASSERT_LE(blocks.size(), 31u);
  }
  EXPECT_TRUE(prefix_blocks(0).empty());
  EXPECT_THROW(prefix_blocks(kMaxSteps + 1), std::invalid_argument);
}

// Where each block's value is its steps' sum over 2^L, the blocked counter is the same counter: the same
// estimate within the kept samples' error, every bound holding the reference noise, and the exact
// rounding equal to the reference at every step, through advances, rewinds and restores.
TEST(BlockedPrefix, EqualsTheStepsWhereBlocksAreTheirSums) {
  constexpr std::uint32_t kSteps = 1400;
  const SyntheticWorld w(kSteps, 7);
  const auto kept = [&](std::uint32_t i) { return w.kept(i); };
  const auto redraw = [&](std::uint32_t i, std::size_t words) { return sample_of(w.steps.at(i), words); };
  int block_redraws = 0;
  const auto redraw_block = [&](std::uint32_t l, std::uint32_t j, std::size_t words) {
    ++block_redraws;
    return sample_of(w.block(l, j), words);
  };
  for (const std::size_t b : {1u, 2u, 5u, 8u, 16u}) {
    const BandedPlan plan(optimized_band(1000, b), 0.75);
    const std::uint32_t keep = static_cast<std::uint32_t>(b - 1);
    for (const std::uint32_t p : {1u, 2u, 3u, 4u, 5u, 15u, 16u, 17u, 63u, 64u, 65u, 255u, 256u, 300u, 1023u, 1024u}) {
      SCOPED_TRACE(testing::Message() << "b " << b << " p " << p);
      const std::uint32_t t0 = p + keep;
      BandedNoise blocked = blocked_counter(plan, p, w), stepped;
      stepped.advance(plan, t0, kept);
      ASSERT_EQ(blocked.at(), t0);
      ASSERT_EQ(blocked.blocked(), p);
      // The kept estimates differ by the truncations only: within A_t of each other.
      const int128 diff = blocked.estimate_units(plan) - stepped.estimate_units(plan);
      ASSERT_LE(diff < 0 ? -diff : diff, static_cast<int128>(plan.abs_cumulative_sum(t0)) * 2);
      for (std::uint32_t t = t0; t <= std::min(t0 + 40, kSteps - 130); ++t) {
        if (t > t0) {
          blocked.push(plan, w.kept(t - 1));
          stepped.push(plan, w.kept(t - 1));
        }
        for (const std::int64_t q : {std::int64_t{1}, kGrid, std::int64_t{1} << 40, std::int64_t{1} << 58}) {
          const int128 truth = reference_noise(plan, q, t, w);
          ASSERT_TRUE(blocked.prefix_noise(plan, q, redraw, redraw_block) == truth) << "t " << t << " q " << q;
          ASSERT_TRUE(stepped.prefix_noise(plan, q, redraw) == truth) << "t " << t << " q " << q;
          const NoiseInterval in = blocked.prefix_interval(plan, q);
          ASSERT_TRUE(!in.known() || (in.lo <= truth && truth <= in.hi)) << "t " << t << " q " << q;
        }
        if (b > 1) {  // the simulations' bounds ahead hold the truth too
          std::vector<std::int64_t> ahead(64);
          for (std::uint32_t i = 0; i < 64; ++i) ahead[i] = w.kept(t + i);
          std::vector<NoiseEdges> edges;
          blocked.intervals_ahead(plan, kGrid, ahead.data(), ahead.size(), edges);
          const NoiseEdges run = blocked.run_bounds(plan, kGrid, ahead.data(), ahead.size());
          for (std::uint32_t i = 0; i < 64; i += 7) {
            const int128 truth = reference_noise(plan, kGrid, t + i + 1, w);
            const NoiseInterval in = edges[i].interval();
            ASSERT_TRUE(in.known() && in.lo <= truth && truth <= in.hi) << "t " << t << " ahead " << i;
            const NoiseInterval r = run.interval();
            ASSERT_TRUE(!r.known() || (r.lo <= truth && truth <= r.hi)) << "t " << t << " ahead " << i;
          }
        }
      }
      // A rewind to the first test and a restore from the frontier reach what stepping there reaches.
      const BandedFrontier f = blocked.frontier();
      EXPECT_EQ(f.blocked, p);
      BandedNoise restored;
      restored.restore(plan, f, t0, kept);
      EXPECT_TRUE(restored.estimate_units(plan) == blocked_counter(plan, p, w).estimate_units(plan));
      EXPECT_TRUE(restored.prefix_noise(plan, kGrid, redraw, redraw_block) == reference_noise(plan, kGrid, t0, w));
      blocked.rewind(plan, t0, kept);
      EXPECT_TRUE(blocked.estimate_units(plan) == restored.estimate_units(plan));
      EXPECT_THROW(blocked.rewind(plan, t0 - 1, kept), std::logic_error);          // steps not defined one by one
      EXPECT_THROW(blocked.start_blocked(plan, p, 0, nullptr), std::logic_error);  // not a fresh counter
    }
  }
  EXPECT_GT(block_redraws, 0) << "the exact path with blocks was never taken: q too small to test it";
  const BandedPlan plan(optimized_band(1000, 8), 1.0);
  EXPECT_THROW(exact_prefix_noise(plan, kGrid, 20, redraw, 10), std::logic_error) << "blocks without a block draw";
  EXPECT_THROW(exact_prefix_noise(plan, kGrid, 16, redraw, 10, redraw_block), std::logic_error) << "t < p + b - 1";
}

// With the PRF's samples (blocks from their own nodes, level L >= 1), the noise at the first test and
// later has the law of the step-by-step construction: mean 0, Var N_t = sigma^2 sum_(j < t) M_j^2,
// Cov(N_t, N_(t+k)) = sigma^2 sum_(r <= t) M_(t-r) M_(t+k-r), and a normal's fourth moment. The blocked
// and the stepped noise of one key share exactly the ring's steps and the level-0 blocks' (level 0 is
// the step's own node): their covariance is that share.
TEST(BlockedPrefix, HasTheStepsLawWithThePrfsSamples) {
  constexpr int kKeys = 20000;
  constexpr std::uint32_t kP = 298, kLag = 37;  // p = 298: 1 + 0 + 2 + 2 + 2 blocks at levels 4..0
  const BandedPlan plan(optimized_band(1000, 8), 1.0);
  const std::uint32_t keep = 7, t0 = kP + keep;
  noise::WindowPrf prf(noise::secret_from_seed(11), 0);
  const auto node = [](std::uint64_t key, std::uint32_t level, std::uint32_t index) {
    return noise::NodeId{key, noise::Family::BandedSelection, 0, level, index};
  };
  const auto kept_of = [&](const noise::NodeId& id) {
    noise::NodeStream s(prf, id);
    return noise::normal_fixed56(noise::sample_normal(s, 1));
  };
  const auto blocks = prefix_blocks(kP);
  std::uint32_t level0 = 0;
  for (const PrefixBlock& b : blocks) level0 += b.level == 0;
  ASSERT_EQ(blocks.size(), 7u);
  ASSERT_EQ(level0, 2u);
  double s0 = 0, s00 = 0, s0k = 0, skk = 0, s0000 = 0, s0st = 0;
  std::vector<std::int64_t> steps(t0 + kLag);
  for (int key = 0; key < kKeys; ++key) {
    noise::normal_fixed56_run(prf, node(key, 0, 0), steps.size(), steps.data());
    const auto step = [&](std::uint32_t i) { return steps[i]; };
    const auto redraw = [&](std::uint32_t i, std::size_t words) {
      noise::NodeStream s(prf, node(key, 0, i));
      return noise::sample_normal(s, words);
    };
    const auto redraw_block = [&](std::uint32_t l, std::uint32_t j, std::size_t words) {
      noise::NodeStream s(prf, node(key, l, j));
      return noise::sample_normal(s, words);
    };
    BandedNoise blocked, stepped;
    blocked.start_blocked(plan, kP,
                          BandedNoise::blocks_kept_sum(
                              blocks, [&](std::uint32_t l, std::uint32_t j) { return kept_of(node(key, l, j)); }),
                          steps.data() + kP);
    stepped.advance(plan, t0, step);
    const double x0 = static_cast<double>(blocked.prefix_noise(plan, kGrid, redraw, redraw_block)) / kGrid;
    const double st = static_cast<double>(stepped.prefix_noise(plan, kGrid, redraw)) / kGrid;
    blocked.advance(plan, t0 + kLag, step);
    const double xk = static_cast<double>(blocked.prefix_noise(plan, kGrid, redraw, redraw_block)) / kGrid;
    s0 += x0, s00 += x0 * x0, s0k += x0 * xk, skk += xk * xk, s0000 += x0 * x0 * x0 * x0, s0st += x0 * st;
  }
  const double n = kKeys;
  const double var0 = plan.variance_factor(t0), vark = plan.variance_factor(t0 + kLag);
  double cov = 0;
  for (std::uint32_t r = 1; r <= t0; ++r) {
    const double a = std::ldexp(static_cast<double>(plan.cumulative(t0 - r)), -kCoefBits);
    const double c = std::ldexp(static_cast<double>(plan.cumulative(t0 + kLag - r)), -kCoefBits);
    cov += a * c;
  }
  const double tail = std::ldexp(static_cast<double>(plan.cumulative(keep)), -kCoefBits);
  double shared = level0 * tail * tail;  // the level-0 blocks' steps and the ring's
  for (std::uint32_t j = 0; j < keep; ++j)
    shared += std::pow(std::ldexp(static_cast<double>(plan.cumulative(j)), -kCoefBits), 2);
  // Five standard errors (normal moments: Var(x^2) = 2 v^2, Var(xy) = v_x v_y + c^2, Var(x^4) = 96 v^4).
  EXPECT_NEAR(s0 / n, 0, 5 * std::sqrt(var0 / n));
  EXPECT_NEAR(s00 / n, var0, 5 * var0 * std::sqrt(2 / n));
  EXPECT_NEAR(skk / n, vark, 5 * vark * std::sqrt(2 / n));
  EXPECT_NEAR(s0k / n, cov, 5 * std::sqrt((var0 * vark + cov * cov) / n));
  EXPECT_NEAR(s0000 / n, 3 * var0 * var0, 5 * var0 * var0 * std::sqrt(96 / n));
  EXPECT_NEAR(s0st / n, shared, 5 * std::sqrt((var0 * var0 + shared * shared) / n));
}

// The frontier's running sum in three words: every value below 2^95 in magnitude round-trips (the
// sign bit 95 extended), and one beyond throws instead of wrapping.
TEST(BlockedPrefix, FrontierSumRoundTripsBelowTwoToThe95) {
  const int128 limit = int128{1} << 95;
  std::mt19937_64 rng(3);
  std::vector<int128> values = {0, 1, -1, limit - 1, -limit, int128{1} << 83, -(int128{1} << 83), int128{1} << 64};
  for (int i = 0; i < 1000; ++i) values.push_back(static_cast<int128>(rng()) << (rng() % 32) >> 1);  // < 2^94
  for (const int128 v : values) {
    const Int96Words32 w(v);
    EXPECT_TRUE(int128(w) == v) << static_cast<double>(v);
    if (v != -limit) {
      EXPECT_TRUE(int128(Int96Words32(-v)) == -v);
    }
  }
  EXPECT_THROW(Int96Words32{limit}, std::overflow_error);
  EXPECT_THROW(Int96Words32{-limit - 1}, std::overflow_error);
  BandedFrontier f{3, 1, -(int128{1} << 80)};
  EXPECT_TRUE(int128(f.older) == -(int128{1} << 80));
}

// The blocks' batch draw (normal_fixed56_nodes) gives each node's own sample, over chunks of 64.
TEST(BlockedPrefix, NodesBatchEqualsEachNodesSample) {
  noise::WindowPrf prf(noise::secret_from_seed(5), 3);
  std::mt19937_64 rng(9);
  std::vector<noise::NodeId> ids;
  ids.reserve(150);
  for (int i = 0; i < 150; ++i)
    ids.push_back({rng(), noise::Family::BandedSelection, static_cast<std::uint32_t>(rng() % 5),
                   static_cast<std::uint32_t>(rng() % (kMaxBlockLevel + 1)), static_cast<std::uint32_t>(rng() % 4096)});
  std::vector<std::int64_t> got(ids.size());
  noise::normal_fixed56_nodes(prf, ids.data(), ids.size(), got.data());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    noise::NodeStream s(prf, ids[i]);
    ASSERT_EQ(got[i], noise::normal_fixed56(noise::sample_normal(s, 1))) << "node " << i;
  }
}
