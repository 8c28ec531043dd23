// Tests of the PRF-derived discrete Gaussian noise (the 192-bit table and exact CKS20). Statistical assertions use
// fixed seeds (so outcomes are reproducible) and state the false-failure rate each would have under a fresh seed.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "kernels/noise.hpp"

using namespace dpstream::noise;

namespace {

std::string hex(const std::uint8_t* p, std::size_t n) {
  std::string s;
  char b[3];
  for (std::size_t i = 0; i < n; ++i) {
    std::snprintf(b, sizeof b, "%02x", p[i]);
    s += b;
  }
  return s;
}

NodeId node(std::uint64_t i, std::uint64_t key_base = 0) {  // distinct node per i, as in the engine
  return NodeId{key_base + (i >> 20), Family::Count, 0, 0, static_cast<std::uint32_t>(i & ((1u << 20) - 1))};
}

std::uint64_t first_word(WindowPrf& prf, const NodeId& id) {
  NodeStream s(prf, id);
  return s.next_u64();
}

// Regularized upper incomplete gamma Q(a, x) (series / Lentz continued fraction): chi-square p-value.
double gamma_q(double a, double x) {
  if (x <= 0) return 1;
  const double lpre = -x + a * std::log(x) - std::lgamma(a);  // NOLINT(concurrency-mt-unsafe): one thread
  if (x < a + 1) {
    double ap = a, del = 1 / a, sum = del;
    for (int i = 0; i < 100000 && std::fabs(del) > std::fabs(sum) * 1e-16; ++i) sum += del *= x / ++ap;
    return 1 - sum * std::exp(lpre);
  }
  double b = x + 1 - a, c = 1e300, d = 1 / b, h = d;
  for (int i = 1; i < 100000; ++i) {
    const double an = -i * (i - a);
    b += 2;
    d = an * d + b;
    if (std::fabs(d) < 1e-300) d = 1e-300;
    c = b + an / c;
    if (std::fabs(c) < 1e-300) c = 1e-300;
    d = 1 / d;
    h *= d * c;
    if (std::fabs(d * c - 1) < 1e-16) break;
  }
  return std::exp(lpre) * h;
}
double chi2_pvalue(double stat, double df) { return gamma_q(df / 2, stat / 2); }

// The exact pmf of N_Z(0, sigma^2) for the rational sigma^2 = n 2^-k the sampler holds, on [-ymax, ymax].
struct Pmf {
  std::int64_t ymax;
  std::vector<double> p;  // p[y + ymax]
  explicit Pmf(const DiscreteGaussian& dg) : ymax(static_cast<std::int64_t>(12 * dg.sigma()) + 3) {
    const double s2 = std::ldexp(static_cast<double>(dg.sigma2_num()), -dg.sigma2_exp());
    p.resize(2 * ymax + 1);
    long double z = 0;
    for (std::int64_t y = -ymax; y <= ymax; ++y) z += p[y + ymax] = std::exp(-double(y) * double(y) / (2 * s2));
    for (auto& v : p) v = static_cast<double>(v / z);
  }
  double at(std::int64_t y) const { return y < -ymax || y > ymax ? 0.0 : p[y + ymax]; }
};

// `exact`: CKS20 (sample_exact) even where the table sampler exists.
std::vector<std::int64_t> draw(const DiscreteGaussian& dg, std::uint64_t seed, std::size_t count, bool exact = false) {
  std::vector<std::int64_t> out(count);
#pragma omp parallel
  {
    WindowPrf prf(secret_from_seed(seed), 0);
#pragma omp for schedule(static)
    for (std::size_t i = 0; i < count; ++i) {
      if (!exact) {
        out[i] = node_noise(prf, node(i), dg);
      } else {
        NodeStream s(prf, node(i));
        out[i] = dg.sample_exact(s);
      }
    }
  }
  return out;
}

}  // namespace

TEST(Noise, SecretFromSeedKnownAnswer) {
  // SHA-256("dpstream test seed" || 01 00 00 00 00 00 00 00), computed independently with Python hashlib.
  const Secret s1 = secret_from_seed(1);
  EXPECT_EQ(hex(s1.data(), 32), "b8b6cce4bdd0d4fbe2972cd8304dc99f23b112396584903d04e1edc5b0fa025c");
  EXPECT_EQ(hex(secret_from_seed(2).data(), 32), "b34045d61cc43d59f03dd0512d28227e987255405e49ccac1de08f8129c7eb28");
  EXPECT_NE(s1, secret_from_seed(2));
  EXPECT_EQ(s1, secret_from_seed(1));
}

TEST(Noise, SecretFromOsDiffers) {
  EXPECT_NE(secret_from_os(), secret_from_os());  // equal with probability 2^-256
}

TEST(Noise, PrfKnownAnswer) {
  // Python: K_w = HMAC-SHA256(secret_from_seed(1), b"dpstream window" + (-2).to_bytes(8, "little", signed=True)),
  // AES-256-ECB of ((key<<64)|(2<<60)|(5<<40)|(3<<35)|(77<<15)|ctr).to_bytes(16, "big") for ctr = 0, 1.
  WindowPrf prf(secret_from_seed(1), -2);
  std::uint8_t out[32];
  prf.blocks(NodeId{0x0123456789abcdefULL, Family::Sum, 5, 3, 77}, 0, 2, out);
  EXPECT_EQ(hex(out, 32), "e863921fc6c6af9fafe834923627cb799cb9bbd0cb4183a9f16574959ffaa350");
  std::uint8_t one[16];  // block 1 alone equals the second block of the batch
  prf.blocks(NodeId{0x0123456789abcdefULL, Family::Sum, 5, 3, 77}, 1, 1, one);
  EXPECT_EQ(std::memcmp(one, out + 16, 16), 0);
  std::vector<std::uint8_t> big(std::size_t{200} * 16),
      small(16);  // batches past the 64-block chunk agree block by block
  prf.blocks(node(9), 0, 200, big.data());
  for (std::uint32_t i : {0u, 63u, 64u, 199u}) {
    prf.blocks(node(9), i, 1, small.data());
    EXPECT_EQ(std::memcmp(small.data(), big.data() + std::size_t{16} * i, 16), 0) << i;
  }
}

TEST(Noise, FirstBlocksEqualEachNodesStream) {
  // first_blocks builds many nodes' plaintexts for one cipher call (its loop unrolled for the batch's
  // NodeStream::kFirstBlocks): node i's c-th block is block c of that node's own stream, at every
  // blocks-per-node; more than 64 blocks in one call is refused.
  WindowPrf prf(secret_from_seed(2), 7);
  for (std::uint32_t per = 1; per <= 8; ++per) {
    const std::size_t n = 64 / per;
    std::vector<u128> packed;
    for (std::size_t i = 0; i < n; ++i)
      packed.push_back(pack(NodeId{i * 977 + per, Family::BandedSelection, per, static_cast<std::uint32_t>(i % 3),
                                   static_cast<std::uint32_t>(i * 40503 % (1u << 20))}));
    std::vector<std::uint8_t> out(n * per * 16), own(std::size_t{per} * 16);
    prf.first_blocks(packed.data(), n, per, out.data());
    for (std::size_t i = 0; i < n; ++i) {
      prf.blocks_packed(packed[i], 0, per, own.data());
      ASSERT_EQ(std::memcmp(own.data(), out.data() + i * per * 16, own.size()), 0) << per << " " << i;
    }
  }
  std::vector<u128> many(33, pack(node(1)));
  std::vector<std::uint8_t> out(std::size_t{66} * 16);
  EXPECT_THROW(prf.first_blocks(many.data(), many.size(), NodeStream::kFirstBlocks, out.data()), std::invalid_argument);
}

// first_blocks_of_run steps the index field by addition: block 0 of each node of a run is block 0 of that node's
// own stream, for runs of every length 1-64 starting at index 0, in the middle, and ending at the last index
// (2^20 - 1, where one more would carry into the level field); more than 64 nodes in one call is refused.
TEST(Noise, FirstBlocksOfRunEqualEachNodesStream) {
  WindowPrf prf(secret_from_seed(3), 9);
  std::vector<std::uint8_t> out(std::size_t{64} * 16), own(16);
  for (std::size_t n = 1; n <= 64; ++n) {
    for (const std::uint32_t start : {0u, 40503u, (1u << 20) - static_cast<std::uint32_t>(n)}) {
      const NodeId first{n * 31 + start, Family::BandedSelection, 5, 3, start};
      prf.first_blocks_of_run(pack(first), n, out.data());
      for (std::size_t i = 0; i < n; ++i) {
        NodeId id = first;
        id.index += static_cast<std::uint32_t>(i);
        prf.blocks(id, 0, 1, own.data());
        ASSERT_EQ(std::memcmp(own.data(), out.data() + i * 16, 16), 0) << n << " " << start << " " << i;
      }
    }
  }
  std::vector<std::uint8_t> more(std::size_t{65} * 16);
  EXPECT_THROW(prf.first_blocks_of_run(pack(node(1)), 65, more.data()), std::invalid_argument);
  // One node past the last index would carry into the level field (another node's stream): refused.
  const NodeId last{7, Family::BandedSelection, 5, 3, (1u << 20) - 1};
  EXPECT_NO_THROW(prf.first_blocks_of_run(pack(last), 1, more.data()));
  EXPECT_THROW(prf.first_blocks_of_run(pack(last), 2, more.data()), std::invalid_argument);
  EXPECT_THROW(prf.first_blocks_of_run(pack(node(1)) | 1, 1, more.data()), std::invalid_argument);  // a block counter
}

TEST(Noise, BatchedDrawsEqualSingleDraws) {
  // node_noises fetches the first blocks of many nodes in one cipher call: the same values as node_noise.
  WindowPrf prf(secret_from_seed(4), 3);
  for (const double sigma : {0.7, 30.0, 5000.0, 1048576.0}) {  // table and CKS20
    const DiscreteGaussian dg(sigma);
    for (const std::size_t n :
         {std::size_t{1}, std::size_t{2}, std::size_t{31}, std::size_t{32}, std::size_t{33}, std::size_t{100}}) {
      std::vector<NodeId> ids;
      for (std::size_t i = 0; i < n; ++i)
        ids.push_back(NodeId{i * 31 + n, Family::KeySelection, 2, static_cast<std::uint32_t>(i % 5),
                             static_cast<std::uint32_t>(i)});
      std::vector<std::int64_t> batched(n);
      node_noises(prf, ids.data(), n, dg, batched.data());
      for (std::size_t i = 0; i < n; ++i)
        ASSERT_EQ(batched[i], node_noise(prf, ids[i], dg)) << sigma << " " << n << " " << i;
    }
  }
}

TEST(Noise, OutOfRangeFieldsThrow) {
  WindowPrf prf(secret_from_seed(1), 0);
  DiscreteGaussian dg(3.0);
  std::uint8_t out[16];
  const NodeId bad[] = {{1, Family::Count, 1u << 20, 0, 0},
                        {1, Family::Count, 0, 32, 0},
                        {1, Family::Count, 0, 0, 1u << 20},
                        {1, static_cast<Family>(16), 0, 0, 0}};
  for (const NodeId& id : bad) {
    EXPECT_THROW(pack(id), std::invalid_argument);
    EXPECT_THROW(NodeStream(prf, id), std::invalid_argument);
    EXPECT_THROW(prf.blocks(id, 0, 1, out), std::invalid_argument);
    EXPECT_THROW(node_noise(prf, id, dg), std::invalid_argument);
  }
  const NodeId max_ok{~0ULL, static_cast<Family>(15), (1u << 20) - 1, 31, (1u << 20) - 1};
  EXPECT_EQ(pack(max_ok), ~u128{0} << 15);  // the fields fill the 113 bits above the counter
  EXPECT_NO_THROW(node_noise(prf, max_ok, dg));
}

TEST(Noise, CounterExhaustionThrows) {
  WindowPrf prf(secret_from_seed(1), 0);
  std::uint8_t out[32];
  EXPECT_NO_THROW(prf.blocks(node(0), WindowPrf::kBlocksPerNode - 1, 1, out));
  EXPECT_THROW(prf.blocks(node(0), WindowPrf::kBlocksPerNode - 1, 2, out), std::out_of_range);
  NodeStream s(prf, node(0));
  for (std::uint32_t i = 0; i < 2 * WindowPrf::kBlocksPerNode; ++i) s.next_u64();  // 2 words per block
  EXPECT_EQ(s.blocks_used(), WindowPrf::kBlocksPerNode);
  EXPECT_THROW(s.next_u64(), std::out_of_range);
}

TEST(Noise, SameNodeSameNoiseAcrossObjectsAndThreads) {
  const DiscreteGaussian dg(30.0);
  constexpr std::size_t kN = 20000;
  WindowPrf a(secret_from_seed(7), 3), b(secret_from_seed(7), 3);
  std::vector<std::int64_t> seq(kN);
  for (std::size_t i = 0; i < kN; ++i) {
    seq[i] = node_noise(a, node(i), dg);
    ASSERT_EQ(seq[i], node_noise(b, node(i), dg)) << i;
  }
  WindowPrf moved(std::move(b));  // a moved PRF keeps its key
  EXPECT_EQ(node_noise(moved, node(5), dg), seq[5]);
  std::vector<std::int64_t> par(kN);
#pragma omp parallel
  {
    WindowPrf prf(secret_from_seed(7), 3);  // one PRF per thread; reverse order so threads see other nodes
#pragma omp for schedule(dynamic, 64)
    for (std::size_t j = 0; j < kN; ++j) par[kN - 1 - j] = node_noise(prf, node(kN - 1 - j), dg);
  }
  EXPECT_EQ(par, seq);
  const auto again = draw(dg, 7, 1000);  // and draw() (threads) agrees with itself
  EXPECT_EQ(again, draw(dg, 7, 1000));
}

TEST(Noise, FrozenOutputs) {
  // Regression pin (not an independent check): a restart must reproduce released noise, so any change to the
  // PRF layout or to the sampler's use of random bits shows up here.
  // CKS20 (sample_exact) keeps the outputs it had before the table sampler existed.
  WindowPrf prf(secret_from_seed(1), 0);
  const std::vector<std::pair<double, std::vector<std::int64_t>>> table = {
      {1.0, {-1, 0, 1, 0, -1, 1, 0, 2}},
      {30.0, {-21, -12, 37, 16, -36, 47, 16, 47}},
      {1048576.0, {-118382, 1659597, -693556, 1168491, 2023457, -1126589, 167876, -854671}}};  // CKS20 above 4096
  const std::vector<std::pair<double, std::vector<std::int64_t>>> exact = {{1.0, {1, -1, 1, 0, 1, 1, 1, 1}},
                                                                           {30.0, {14, 7, 64, -9, -4, 3, -4, 7}}};
  for (const auto& [sigma, want] : table) {
    const DiscreteGaussian dg(sigma);
    std::vector<std::int64_t> got;
    for (std::uint32_t i = 0; i < 8; ++i) got.push_back(node_noise(prf, NodeId{5, Family::Count, 0, 2, i}, dg));
    EXPECT_EQ(got, want) << sigma;
  }
  for (const auto& [sigma, want] : exact) {
    const DiscreteGaussian dg(sigma);
    std::vector<std::int64_t> got;
    for (std::uint32_t i = 0; i < 8; ++i) {
      NodeStream s(prf, NodeId{5, Family::Count, 0, 2, i});
      got.push_back(dg.sample_exact(s));
    }
    EXPECT_EQ(got, want) << "sample_exact, sigma " << sigma;
  }
}

TEST(Noise, TableMatchesIndependentReference) {
  // tests/reference/discrete_gaussian_table.txt: Python decimal exp at 130 digits, each w_m directly.
  std::ifstream f(std::string(DPSTREAM_REFERENCE_DIR) + "/discrete_gaussian_table.txt");
  ASSERT_TRUE(f) << "missing tests/reference/discrete_gaussian_table.txt";
  std::string line;
  std::optional<DiscreteGaussian> dg;
  int sigmas = 0, entries = 0;
  while (std::getline(f, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream in(line);
    std::string first;
    in >> first;
    if (first == "sigma") {
      double sigma = 0;
      std::uint64_t n = 0, size = 0;
      int k = 0;
      in >> sigma >> n >> k >> size;
      dg.emplace(sigma);
      ASSERT_TRUE(dg->tabulated()) << sigma;
      EXPECT_EQ(dg->sigma2_num(), n) << sigma;
      EXPECT_EQ(dg->sigma2_exp(), k) << sigma;
      EXPECT_EQ(dg->table_size(), size) << sigma;
      ++sigmas;
      continue;
    }
    std::string hex;
    in >> hex;
    ASSERT_EQ(hex.size(), 48u) << line;
    const std::array<std::uint64_t, 3> want = {std::stoull(hex.substr(0, 16), nullptr, 16),
                                               std::stoull(hex.substr(16, 16), nullptr, 16),
                                               std::stoull(hex.substr(32, 16), nullptr, 16)};
    EXPECT_EQ(dg->table_entry(std::stoull(first)), want) << "sigma " << dg->sigma() << " entry " << first;
    ++entries;
  }
  EXPECT_EQ(sigmas, 6);
  EXPECT_GT(entries, 40);
}

TEST(Noise, DistinctInputsGiveDistinctStreams) {
  // Each check fails by chance with probability 2^-64 (first words of distinct PRF inputs collide).
  const Secret s = secret_from_seed(1);
  WindowPrf w0(s, 0), w1(s, 1), other(secret_from_seed(2), 0);
  const NodeId base{42, Family::Count, 3, 4, 5};
  const std::uint64_t ref = first_word(w0, base);
  EXPECT_NE(ref, first_word(w1, base));
  EXPECT_NE(ref, first_word(other, base));
  std::vector<NodeId> variants(7, base);
  variants[0].key = 43;
  variants[1].family = Family::Sum;
  variants[2].family = Family::KeySelection;
  variants[3].round = 4;
  variants[4].level = 5;
  variants[5].index = 6;
  variants[6].key = 42ULL << 32;
  for (const NodeId& v : variants) EXPECT_NE(ref, first_word(w0, v));
  NodeStream st(w0, base);  // words within one stream differ too
  const std::uint64_t x0 = st.next_u64(), x1 = st.next_u64(), x2 = st.next_u64(), x3 = st.next_u64(),
                      x4 = st.next_u64();
  EXPECT_TRUE(x0 != x1 && x1 != x2 && x2 != x3 && x3 != x4);
}

TEST(Noise, NeighbouringNodesUncorrelated) {
  // Pearson correlation of N pairs of independent variables: ~ N(0, 1/N); |r| <= 5/sqrt(N) has false-failure
  // rate < 6e-7 per pair type.
  const DiscreteGaussian dg(30.0);
  constexpr std::uint32_t kN = 200000;
  const Secret s = secret_from_seed(11);
  WindowPrf prf(s, 0), prf_next(s, 1);
  std::vector<double> idx(kN + 1), lvl(kN), fam(kN), win(kN);
  for (std::uint32_t i = 0; i <= kN; ++i) idx[i] = double(node_noise(prf, NodeId{9, Family::Count, 0, 0, i}, dg));
  for (std::uint32_t i = 0; i < kN; ++i) {
    lvl[i] = double(node_noise(prf, NodeId{9, Family::Count, 0, 1, i}, dg));
    fam[i] = double(node_noise(prf, NodeId{9, Family::Sum, 0, 0, i}, dg));
    win[i] = double(node_noise(prf_next, NodeId{9, Family::Count, 0, 0, i}, dg));
  }
  auto corr = [](const double* x, const double* y, std::size_t n) {
    double sx = 0, sy = 0, sxx = 0, syy = 0, sxy = 0;
    for (std::size_t i = 0; i < n; ++i)
      sx += x[i], sy += y[i], sxx += x[i] * x[i], syy += y[i] * y[i], sxy += x[i] * y[i];
    const double dn = double(n);
    return (sxy / dn - sx * sy / dn / dn) / std::sqrt((sxx / dn - sx * sx / dn / dn) * (syy / dn - sy * sy / dn / dn));
  };
  const double bound = 5 / std::sqrt(double(kN));
  const double r_idx = corr(idx.data(), idx.data() + 1, kN), r_lvl = corr(idx.data(), lvl.data(), kN),
               r_fam = corr(idx.data(), fam.data(), kN), r_win = corr(idx.data(), win.data(), kN);
  std::printf("corr index/index+1 %.5f, level 0/1 %.5f, Count/Sum %.5f, window 0/1 %.5f (bound %.5f)\n", r_idx, r_lvl,
              r_fam, r_win, bound);
  EXPECT_LT(std::fabs(r_idx), bound);
  EXPECT_LT(std::fabs(r_lvl), bound);
  EXPECT_LT(std::fabs(r_fam), bound);
  EXPECT_LT(std::fabs(r_win), bound);
}

TEST(Noise, UniformAndBernoulli) {
  WindowPrf prf(secret_from_seed(3), 0);
  std::optional<NodeStream> s;  // a fresh node every 1000 draws, as one node's stream has 2^15 blocks
  auto rng = [&, i = std::uint64_t{0}]() mutable -> NodeStream& {
    if (i++ % 1000 == 0) s.emplace(prf, node(i));
    return *s;
  };
  // uniform_below(6): chi-square with 5 df; p-value threshold 1e-6 is the false-failure rate.
  constexpr int kN = 600000;
  std::vector<double> c6(6);
  for (int i = 0; i < kN; ++i) ++c6[rng().uniform_below(6)];
  double stat = 0;
  for (double c : c6) stat += (c - kN / 6.0) * (c - kN / 6.0) / (kN / 6.0);
  EXPECT_GT(chi2_pvalue(stat, 5), 1e-6) << stat;
  // uniform_below_u128(3 * 2^100): top part x >> 100 uniform on {0, 1, 2} (chi-square 2 df, threshold 1e-6).
  const u128 n = u128{3} << 100;
  std::vector<double> c3(3);
  for (int i = 0; i < kN / 10; ++i) {
    const u128 x = rng().uniform_below_u128(n);
    ASSERT_LT(x, n);
    ++c3[static_cast<int>(x >> 100)];
  }
  stat = 0;
  for (double c : c3) stat += (c - kN / 30.0) * (c - kN / 30.0) / (kN / 30.0);
  EXPECT_GT(chi2_pvalue(stat, 2), 1e-6) << stat;
  // bernoulli: frequency within 5 binomial standard deviations (false failure < 6e-7 each), for 64-bit, dyadic,
  // 127-bit and > 2^127 denominators (the last one goes through uniform_below_u128).
  const std::pair<u128, u128> cases[] = {
      {1, 3}, {3, 8}, {(u128{1} << 126) + 12345, (u128{3} << 125) + 1}, {~u128{0} / 5, ~u128{0}}};
  for (const auto& [num, den] : cases) {
    const double p = double(num) / double(den);
    int hits = 0;
    for (int i = 0; i < kN / 10; ++i) hits += rng().bernoulli(num, den);
    EXPECT_LT(std::fabs(hits - p * kN / 10), 5 * std::sqrt(static_cast<double>(kN) / 10 * p * (1 - p))) << p;
  }
  EXPECT_FALSE(rng().bernoulli(0, 7));
  EXPECT_TRUE(rng().bernoulli(7, 7));
  EXPECT_THROW(rng().bernoulli(8, 7), std::invalid_argument);
  EXPECT_THROW(rng().bernoulli(0, 0), std::invalid_argument);
  EXPECT_THROW(rng().uniform_below(0), std::invalid_argument);
  EXPECT_EQ(rng().uniform_below(1), 0u);
}

TEST(Noise, DiscreteGaussianParameters) {
  for (double sigma :
       {std::ldexp(1.0, -10), 0.1, 0.5, 1.0, 3.7, 30.0, 1000.0, std::ldexp(1.0, 20), 123456.789, std::ldexp(1.0, 24)}) {
    const DiscreteGaussian dg(sigma);
    const double s2 = std::ldexp(static_cast<double>(dg.sigma2_num()), -dg.sigma2_exp());
    EXPECT_GE(dg.sigma2_num(), 1ULL << 51);
    EXPECT_LT(dg.sigma2_num(), 1ULL << 52);
    EXPECT_GE(dg.sigma(), sigma);
    EXPECT_LE(dg.sigma(), sigma * (1 + 1e-15));
    EXPECT_GE(static_cast<long double>(s2), static_cast<long double>(sigma) * sigma);  // rounded up, exactly
    EXPECT_EQ(dg.t(), static_cast<std::uint64_t>(std::floor(dg.sigma())) + 1);
  }
  EXPECT_EQ(DiscreteGaussian(1.0).sigma(), 1.0);
  EXPECT_EQ(DiscreteGaussian(1.0).t(), 2u);
  EXPECT_EQ(DiscreteGaussian(0.5).t(), 1u);
  EXPECT_EQ(DiscreteGaussian(30.0).t(), 31u);
  for (double bad : {0.0, -1.0, std::ldexp(1.0, -11), std::ldexp(1.0, 24) * (1 + 1e-15), double(NAN), double(INFINITY)})
    EXPECT_THROW(DiscreteGaussian{bad}, std::invalid_argument) << bad;
  // sigma = 2^-10: P[Y != 0] = 2 exp(-2^19) / Z, never observed.
  const auto tiny = draw(DiscreteGaussian(std::ldexp(1.0, -10)), 5, 20000);
  EXPECT_TRUE(std::all_of(tiny.begin(), tiny.end(), [](std::int64_t y) { return y == 0; }));
  // Exact variance by summing the pmf: N_Z(0, 1/4) in closed form; for sigma >= 3 it equals sigma^2 to within
  // 4 pi^2 sigma^2 exp(-2 pi^2 sigma^2) (Poisson summation), far below double precision.
  const double e = std::exp(-2.0);
  double z = 1, m = 0;
  for (int y = 1; y < 10; ++y) z += 2 * std::pow(e, y * y), m += 2.0 * y * y * std::pow(e, y * y);
  EXPECT_NEAR(DiscreteGaussian(0.5).variance(), m / z, 1e-15);
  for (double sigma : {3.7, 30.0, 1000.0}) {
    const DiscreteGaussian dg(sigma);
    EXPECT_NEAR(dg.variance() / (dg.sigma() * dg.sigma()), 1.0, 1e-12) << sigma;
  }
}

// gamma(y) = whole + num/den must equal (y t 2^k - n)^2 / (n 2^(k+1) t^2) exactly: checked in 256 bits.
TEST(Noise, GammaIsExact) {
  struct U256 {
    u128 hi, lo;
    bool operator==(const U256&) const = default;
  };
  auto mul = [](u128 a, u128 b) {  // schoolbook on 64-bit limbs
    const u128 m = ~std::uint64_t{0};
    const u128 p00 = (a & m) * (b & m), p01 = (a & m) * (b >> 64), p10 = (a >> 64) * (b & m),
               p11 = (a >> 64) * (b >> 64);
    const u128 mid = (p00 >> 64) + (p01 & m) + (p10 & m);
    return U256{p11 + (p01 >> 64) + (p10 >> 64) + (mid >> 64), (p00 & m) | (mid << 64)};
  };
  int checked = 0;
  for (double sigma : {std::ldexp(1.0, -10), 0.1, 0.5, 1.0, 1.5, 3.7, 30.0, 1000.0, 123456.789, std::ldexp(1.0, 24)}) {
    const DiscreteGaussian dg(sigma);
    const std::uint64_t n = dg.sigma2_num(), t = dg.t();
    const int k = dg.sigma2_exp();
    const u128 den = (u128{n} * t * t) << (k + 1);
    const std::uint64_t center = static_cast<std::uint64_t>(std::ldexp(double(n), -k) / double(t));  // ~ sigma^2/t
    for (std::uint64_t y : {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{2}, t - 1, t, t + 1, center, center + 1,
                            7 * t + 3, 100 * t + t / 2, (t << 11) - 1, t << 11}) {
      const auto g = dg.gamma(y);
      ASSERT_EQ(g.den, den) << sigma;
      ASSERT_LT(g.num, g.den) << sigma;
      const u128 yt = (u128{y} * t) << k;  // < 2^83
      const u128 a = yt >= n ? yt - n : n - yt;
      U256 lhs = mul(g.whole, g.den);
      lhs.lo += g.num;
      lhs.hi += lhs.lo < g.num;
      ASSERT_TRUE(lhs == mul(a, a)) << "sigma " << sigma << " y " << y;
      ++checked;
    }
    EXPECT_THROW(dg.gamma((t << 11) + 1), std::invalid_argument);
  }
  EXPECT_EQ(checked, 120);
}

// Per sigma, N = 10^6 samples from distinct nodes. Mean, second moment and tail use 5-standard-error bounds
// (normal approximation, false failure < 6e-7 each); chi-square tests use p-value > 1e-6 (false failure 1e-6).
// Both samplers: the table (sigma <= 4096) and CKS20 (sample_exact).
class NoiseStats : public testing::TestWithParam<std::tuple<double, bool>> {};

TEST_P(NoiseStats, MatchesExactPmf) {
  const auto [sigma, exact] = GetParam();
  const DiscreteGaussian dg(sigma);
  constexpr std::size_t kN = 1000000;
  const auto ys = draw(dg, 1000 + static_cast<std::uint64_t>(sigma * 10) + exact, kN, exact);
  const Pmf pmf(dg);
  const double var = dg.variance();
  long double mu4 = 0;
  for (std::int64_t y = -pmf.ymax; y <= pmf.ymax; ++y) mu4 += pmf.at(y) * std::pow(double(y), 4);

  // Mean and second moment (the mean is exactly 0, so E[Y^2] = Var with Var[Y^2] = mu4 - Var^2).
  long double s1 = 0, s2 = 0;
  for (auto y : ys) s1 += y, s2 += static_cast<long double>(y) * y;
  const double mean = double(s1 / kN), m2 = double(s2 / kN);
  EXPECT_LT(std::fabs(mean), 5 * std::sqrt(var / kN)) << "mean " << mean;
  EXPECT_LT(std::fabs(m2 - var), 5 * std::sqrt(double(mu4 - var * var) / kN)) << "E[Y^2] " << m2 << " vs " << var;

  // Tail P[|Y| >= 3 sigma] against the pmf: binomial count within 5 standard deviations (+1 for discreteness).
  const auto c = static_cast<std::int64_t>(std::ceil(3 * dg.sigma()));
  double p3 = 0;
  for (std::int64_t y = c; y <= pmf.ymax; ++y) p3 += 2 * pmf.at(y);
  const double tail = double(std::count_if(ys.begin(), ys.end(), [c](std::int64_t y) { return y >= c || y <= -c; }));
  EXPECT_LT(std::fabs(tail - kN * p3), 5 * std::sqrt(kN * p3 * (1 - p3)) + 1) << "tail " << tail << " vs " << kN * p3;

  // Chi-square goodness of fit: groups of w = max(1, floor(sigma/16)) integers, merged left to right until each
  // bin expects >= 20 samples (so both tails are merged into their neighbours).
  const std::int64_t w = std::max<std::int64_t>(1, static_cast<std::int64_t>(sigma / 16));
  auto group = [&](std::int64_t y) {
    y = std::clamp(y, -pmf.ymax, pmf.ymax);
    return (y + pmf.ymax) / w;
  };
  const std::int64_t groups = group(pmf.ymax) + 1;
  std::vector<double> gp(groups);
  for (std::int64_t y = -pmf.ymax; y <= pmf.ymax; ++y) gp[group(y)] += pmf.at(y);
  std::vector<int> bin_of(groups);
  std::vector<double> expect;
  double acc = 0;
  for (std::int64_t g = 0; g < groups; ++g) {
    bin_of[g] = static_cast<int>(expect.size());
    acc += gp[g] * kN;
    if (acc >= 20) expect.push_back(acc), acc = 0;
  }
  ASSERT_FALSE(expect.empty());
  expect[expect.size() - 1] += acc;  // the right tail joins the last full bin
  for (auto& b : bin_of) b = std::min(b, static_cast<int>(expect.size()) - 1);
  std::vector<double> seen(expect.size());
  for (auto y : ys) ++seen[bin_of[group(y)]];
  double stat = 0;
  for (std::size_t b = 0; b < expect.size(); ++b) stat += (seen[b] - expect[b]) * (seen[b] - expect[b]) / expect[b];
  const double df = double(expect.size()) - 1, pval = chi2_pvalue(stat, df);
  std::printf("sigma %-9g var %.6g (exact %.6g) tail %.0f (exp %.1f) chi2 %.1f df %.0f p %.3g\n", sigma, m2, var, tail,
              kN * p3, stat, df, pval);
  EXPECT_GT(pval, 1e-6);

  // Symmetry: for each |y| group, the counts of +y and -y split as Binomial(., 1/2); sum of (c+ - c-)^2/(c+ + c-)
  // over groups with >= 20 expected per side is chi-square(#groups); threshold p > 1e-6. Plus a sign test.
  std::map<std::int64_t, std::pair<double, double>> pm;
  double pos = 0, neg = 0;
  for (auto y : ys) {
    if (y == 0) continue;
    auto& [cp, cn] = pm[(std::abs(y) - 1) / w];
    (y > 0 ? cp : cn) += 1;
    (y > 0 ? pos : neg) += 1;
  }
  double sym = 0, used = 0, rest_p = 0, rest_n = 0;
  for (const auto& [g, pr] : pm) {
    double cp = pr.first + rest_p, cn = pr.second + rest_n;
    if (cp + cn < 40) {
      rest_p = cp, rest_n = cn;  // merge small groups into the next one
      continue;
    }
    rest_p = rest_n = 0;
    sym += (cp - cn) * (cp - cn) / (cp + cn);
    used += 1;
  }
  EXPECT_GT(chi2_pvalue(sym, used), 1e-6) << "symmetry chi2 " << sym << " over " << used;
  EXPECT_LT(std::fabs(pos - neg), 5 * std::sqrt(pos + neg));
}

INSTANTIATE_TEST_SUITE_P(Sigmas, NoiseStats,
                         testing::Combine(testing::Values(0.5, 1.0, 3.7, 30.0, 1000.0, 1048576.0), testing::Bool()));

TEST(Noise, BenchmarkNsPerSample) {
  // A printed benchmark, not a timed assertion: node_noise on distinct nodes (stream setup + AES + sampling).
  WindowPrf prf(secret_from_seed(99), 0);
  for (double sigma : {1.0, 30.0, 1000.0, 1048576.0}) {
    const DiscreteGaussian dg(sigma);
    for (const bool exact : {false, true}) {
      constexpr std::uint64_t kN = 1000000;
      std::int64_t sink = 0;
      std::uint64_t blocks = 0;
      const auto t0 = std::chrono::steady_clock::now();
      for (std::uint64_t i = 0; i < kN; ++i) {
        NodeStream s(prf, node(i, 1000), !exact && dg.tabulated() ? 1 : NodeStream::kFirstBlocks);  // as node_noise
        sink += exact ? dg.sample_exact(s) : dg.sample(s);
        blocks += s.blocks_used();
      }
      const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / kN;
      std::printf("sigma %-8g %-6s %7.1f ns/sample  %.3f AES blocks/sample  (checksum %lld)\n", sigma,
                  exact            ? "CKS20"
                  : dg.tabulated() ? "table"
                                   : "CKS20",
                  ns, double(blocks) / kN, static_cast<long long>(sink));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// DiscreteLaplace (CKS20 Algorithm 2 with b = n / 2^k).
namespace {

std::vector<std::int64_t> draw_laplace(const DiscreteLaplace& dl, std::uint64_t seed, std::size_t count) {
  std::vector<std::int64_t> out(count);
#pragma omp parallel
  {
    WindowPrf prf(secret_from_seed(seed), 0);
#pragma omp for schedule(static)
    for (std::size_t i = 0; i < count; ++i) {
      NodeStream s(prf, node(i));
      out[i] = dl.sample(s);
    }
  }
  return out;
}

// Exact DLap(b) pmf (1 - q) / (1 + q) q^|y|, q = exp(-1/b), on [-ymax, ymax]; the mass beyond is < exp(-40).
struct LaplacePmf {
  std::int64_t ymax;
  std::vector<double> p;  // p[y + ymax]
  explicit LaplacePmf(const DiscreteLaplace& dl) : ymax(static_cast<std::int64_t>(40 * dl.scale()) + 3) {
    const long double q = std::exp(-1.0L / dl.scale()), c = (1 - q) / (1 + q);
    p.resize(2 * ymax + 1);
    for (std::int64_t y = -ymax; y <= ymax; ++y) p[y + ymax] = static_cast<double>(c * std::pow(q, std::abs(y)));
  }
  double at(std::int64_t y) const { return y < -ymax || y > ymax ? 0.0 : p[y + ymax]; }
};

// Chi-square p-value of `ys` against `pmf` on bins of w integers, merged left to right to >= 20 expected each.
double laplace_chi2_pvalue(const std::vector<std::int64_t>& ys, const LaplacePmf& pmf, std::int64_t w) {
  auto group = [&](std::int64_t y) { return (std::clamp(y, -pmf.ymax, pmf.ymax) + pmf.ymax) / w; };
  const std::int64_t groups = group(pmf.ymax) + 1;
  std::vector<double> gp(groups);
  for (std::int64_t y = -pmf.ymax; y <= pmf.ymax; ++y) gp[group(y)] += pmf.at(y);
  std::vector<int> bin_of(groups);
  std::vector<double> expect;
  double acc = 0;
  const double n = double(ys.size());
  for (std::int64_t g = 0; g < groups; ++g) {
    bin_of[g] = static_cast<int>(expect.size());
    acc += gp[g] * n;
    if (acc >= 20) expect.push_back(acc), acc = 0;
  }
  if (expect.empty()) return 0;      // fewer than 20 samples: no test
  expect[expect.size() - 1] += acc;  // the right tail joins the last full bin
  for (auto& b : bin_of) b = std::min(b, static_cast<int>(expect.size()) - 1);
  std::vector<double> seen(expect.size());
  for (auto y : ys) ++seen[bin_of[group(y)]];
  double stat = 0;
  for (std::size_t b = 0; b < expect.size(); ++b) stat += (seen[b] - expect[b]) * (seen[b] - expect[b]) / expect[b];
  std::printf("DLap chi2 %.1f df %zu\n", stat, expect.size() - 1);
  return chi2_pvalue(stat, double(expect.size()) - 1);
}

}  // namespace

TEST(DiscreteLaplace, Parameters) {
  for (double b : {std::ldexp(1.0, -10), 0.3, 1.0 / 3, 1.0, 4.5, 40.0, 1e4, 123456.789, std::ldexp(1.0, 40),
                   std::nextafter(std::ldexp(1.0, 40), 0.0), 0.1 + 0.2}) {
    const DiscreteLaplace dl(b);
    EXPECT_GE(dl.scale(), b);
    EXPECT_LE(dl.scale(), b * (1 + std::ldexp(1.0, -50))) << b;
    EXPECT_EQ(DiscreteLaplace::rounded_scale(b), dl.scale());
    EXPECT_GE(dl.scale_num(), 1ULL << 51);
    EXPECT_LT(dl.scale_num(), 1ULL << 52);
    EXPECT_EQ(std::ldexp(static_cast<double>(dl.scale_num()), -dl.scale_exp()), dl.scale());
  }
  EXPECT_EQ(DiscreteLaplace(1.0).scale(), 1.0);
  EXPECT_EQ(DiscreteLaplace(4.5).scale(), 4.5);
  EXPECT_GT(DiscreteLaplace(0.3).scale(), 0.3);  // 0.3 has 53 significant bits (odd mantissa): rounded up
  for (double bad : {0.0, -1.0, std::ldexp(1.0, -11), std::nextafter(std::ldexp(1.0, -10), 0.0),
                     std::ldexp(1.0, 40) * (1 + 1e-15), double(NAN), double(INFINITY)}) {
    EXPECT_THROW(DiscreteLaplace{bad}, std::invalid_argument) << bad;
    EXPECT_THROW(DiscreteLaplace::rounded_scale(bad), std::invalid_argument) << bad;
  }
}

TEST(DiscreteLaplace, UpperTailClosedForm) {
  // Against direct summation of the pmf in long double; symmetry for m <= 0.
  for (double b : {0.3, 1.0, 4.5, 40.0}) {
    const DiscreteLaplace dl(b);
    const long double q = std::exp(-1.0L / dl.scale()), c = (1 - q) / (1 + q);
    for (std::int64_t m : {-3, 0, 1, 2, 5, 17}) {
      long double tail = 0;
      for (std::int64_t x = m; x < m + static_cast<std::int64_t>(200 * b) + 200; ++x)
        tail += c * std::pow(q, std::abs(x));
      EXPECT_NEAR(static_cast<double>(dl.upper_tail(m) / tail), 1.0, 1e-15) << b << " " << m;
    }
  }
}

// 200k samples per scale from distinct nodes. Chi-square and symmetry thresholds p > 1e-6 (false failure 1e-6
// each), sign and mean tests at 5 standard errors (false failure < 6e-7 each).
class LaplaceStats : public testing::TestWithParam<double> {};

TEST_P(LaplaceStats, MatchesExactPmf) {
  const DiscreteLaplace dl(GetParam());
  constexpr std::size_t kN = 200000;
  const auto ys = draw_laplace(dl, 2000 + static_cast<std::uint64_t>(GetParam() * 10), kN);
  const LaplacePmf pmf(dl);
  const std::int64_t w = std::max<std::int64_t>(1, static_cast<std::int64_t>(dl.scale() / 16));
  EXPECT_GT(laplace_chi2_pvalue(ys, pmf, w), 1e-6) << "b " << dl.scale();
  // Mean 0 with Var = 2 q / (1 - q)^2.
  const long double q = std::exp(-1.0L / dl.scale());
  const double var = static_cast<double>(2 * q / ((1 - q) * (1 - q)));
  long double s1 = 0;
  double pos = 0, neg = 0;
  for (auto y : ys) s1 += y, pos += y > 0, neg += y < 0;
  EXPECT_LT(std::fabs(double(s1 / kN)), 5 * std::sqrt(var / kN)) << "mean";
  // Symmetry: the counts of +y and -y over groups of |y| split as Binomial(., 1/2).
  std::map<std::int64_t, std::pair<double, double>> pm;
  for (auto y : ys)
    if (y != 0) (y > 0 ? pm[(y - 1) / w].first : pm[(-y - 1) / w].second) += 1;
  double sym = 0, used = 0, rp = 0, rn = 0;
  for (const auto& [g, pr] : pm) {
    rp += pr.first, rn += pr.second;
    if (rp + rn < 40) continue;  // merge small groups into the next one
    sym += (rp - rn) * (rp - rn) / (rp + rn), used += 1, rp = rn = 0;
  }
  if (used > 0) {
    EXPECT_GT(chi2_pvalue(sym, used), 1e-6) << "symmetry chi2 " << sym << " over " << used;
  }
  EXPECT_LT(std::fabs(pos - neg), 5 * std::sqrt(pos + neg) + 1);
}

INSTANTIATE_TEST_SUITE_P(Scales, LaplaceStats, testing::Values(0.3, 1.0, 4.5, 40.0, 1e4));

TEST(DiscreteLaplace, TinyScaleIsZero) {
  // b = 2^-10: P[Y != 0] = 2 exp(-1024) / (1 + exp(-1024)), never observed.
  const auto ys = draw_laplace(DiscreteLaplace(std::ldexp(1.0, -10)), 11, 20000);
  EXPECT_TRUE(std::all_of(ys.begin(), ys.end(), [](std::int64_t y) { return y == 0; }));
}

TEST(DiscreteLaplace, Deterministic) {
  const DiscreteLaplace dl(4.5);
  WindowPrf a(secret_from_seed(3), 1), b(secret_from_seed(3), 1);
  std::vector<std::int64_t> seq;
  for (std::uint32_t i = 0; i < 2000; ++i) {
    const NodeId id{i, Family::SqlSelection, 0, 0, 0};
    NodeStream sa(a, id), sb(b, id);
    seq.push_back(dl.sample(sa));
    ASSERT_EQ(seq.back(), dl.sample(sb)) << i;
  }
  EXPECT_GT(std::set<std::int64_t>(seq.begin(), seq.end()).size(), 10u);  // distinct nodes, distinct noise
  EXPECT_EQ(draw_laplace(dl, 4, 500), draw_laplace(dl, 4, 500));          // threads agree with themselves
  // Regression pin (not an independent check): released selection noise must survive a restart.
  std::vector<std::int64_t> got;
  for (std::uint32_t i = 0; i < 8; ++i) {
    NodeStream s(a, NodeId{5, Family::SqlSelection, 0, 0, i});
    got.push_back(dl.sample(s));
  }
  EXPECT_EQ(got, (std::vector<std::int64_t>{-1, -8, 2, 19, 4, -1, 7, -2}));
}
