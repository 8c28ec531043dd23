// Privacy properties of mode = "dp" (docs/PRIVACY.md), tested on the kernels and the plan:
//  1. No tiny keys (section 5): a key whose distinct-user count in the current round is <= mu is
//     never released, whatever its record counts, sums, thresholds and noise.
//  2. Sensitivity (sections 2 and 5): one user's records move the per-trigger increments, and the
//     nodes of every value tree and key-selection tree, by no more than src/privacy_plan.cpp accounts for.
//  3. The released value formula (section 4): an independent exact Honaker implementation over the
//     noisy node values y = true + noise reproduces every release of DpReleaser bit for bit.
// Assertions are exact unless a comment states a false-failure rate.
#include <gtest/gtest.h>

#include <omp.h>
#include "tests/scoped_omp_threads.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/int128.hpp"
#include "common/record.hpp"
#include "kernels/baseline_release.hpp"
#include "kernels/bounding.hpp"
#include "kernels/dp_release.hpp"
#include "kernels/dp_tree.hpp"
#include "kernels/key_accumulate.hpp"
#include "kernels/noise.hpp"
#include "src/config.hpp"
#include "src/privacy_plan.hpp"

namespace dpstream {
namespace {

using kernels::DpParams;
using kernels::DpReleaser;
using kernels::DpStats;
using kernels::KeyStateTable;
namespace dptree = kernels::dptree;
using i128 = int128;  // common/int128.hpp

constexpr std::int64_t kOne = std::int64_t{1} << kValueFracBits;  // one user or record in fixed point

// ---------------------------------------------------------------------------------------------
// Jobs, plans and releaser parameters.

// A DP job parsed from TOML as a user would write it.
// counters: "tree" or "banded" (both selection and values).
JobConfig dp_job(std::uint32_t triggers, std::uint32_t C, double mu, double epsilon, double clamp_min, double clamp_max,
                 const std::string& counters = "tree") {
  const std::string toml = "[stream]\nwindow_seconds = 86400\ntriggers = " + std::to_string(triggers) +
                           "\n[privacy]\nmode = \"dp\"\nselection_counter = \"" + counters + "\"\nvalue_counter = \"" +
                           counters + "\"\nmax_records_per_user = " + std::to_string(C) +
                           "\nepsilon = " + std::to_string(epsilon) + "\ndelta = 1e-9\nmu = " + std::to_string(mu) +
                           "\nclamp_min = " + std::to_string(clamp_min) + "\nclamp_max = " + std::to_string(clamp_max) +
                           "\nseed = 3\n[query]\naggregations = [\"count\", \"sum\"]\n[output]\nprogress = \"never\"\n";
  return parse_job(toml, "test_privacy_properties", {});
}

// Hand-made parameters: the same tau at every step; trees, or banded counters of band 8.
DpParams flat_params(std::uint32_t T, double mu, double tau, double sigma_selection,
                     kernels::CounterKind counter = kernels::CounterKind::Tree) {
  DpParams p;
  p.selection_counter = p.value_counter = counter;
  if (counter == kernels::CounterKind::Banded) p.band = kernels::banded::optimized_band(T, 8);
  p.triggers = T;
  p.mu = mu;
  p.tau.assign(T + 1, tau);
  p.sigma_selection = sigma_selection;
  p.sigma_count = 4.0;
  p.sigma_sum = 6.0;
  p.sum_quantum = 16;
  return p;
}

using dpstream::testing::ScopedOmpThreads;

// ---------------------------------------------------------------------------------------------
// Dyadic trees and an independent Honaker implementation in exact rationals.

// Nodes (height j, index k) covering [k 2^j + 1, (k+1) 2^j] that exist in a tree of n leaves.
template <class F>
void for_each_node(std::uint32_t n, F&& f) {
  for (std::uint32_t j = 0; (1u << j) <= n; ++j)
    for (std::uint32_t k = 0; (k + 1) * (1u << j) <= n; ++k) f(j, k);
}

// Sum of leaves[l] for l in the node's range (leaves are 1-based; leaves[0] is unused).
template <class V>
V node_value(const std::vector<V>& leaves, std::uint32_t j, std::uint32_t k) {
  V s = 0;
  for (std::uint32_t l = k * (1u << j) + 1; l <= (k + 1) * (1u << j); ++l) s += leaves[l];
  return s;
}

i128 abs128(i128 x) { return x < 0 ? -x : x; }
i128 gcd128(i128 a, i128 b) {
  a = abs128(a), b = abs128(b);
  while (b != 0) {
    const i128 t = a % b;
    a = b, b = t;
  }
  return a;
}

struct Rational {  // num / den in lowest terms, den > 0
  i128 num = 0, den = 1;
};
Rational make_rational(i128 num, i128 den) {
  if (den < 0) num = -num, den = -den;
  const i128 g = gcd128(num, den);
  if (g > 1) num /= g, den /= g;
  return {num, den};
}
Rational operator+(Rational a, Rational b) { return make_rational(a.num * b.den + b.num * a.den, a.den * b.den); }
Rational operator*(Rational a, i128 m) { return make_rational(a.num * m, a.den); }
Rational operator/(Rational a, i128 d) { return make_rational(a.num, a.den * d); }

i128 floor_div(i128 a, i128 b) {  // b > 0
  i128 q = a / b;
  if (a % b != 0 && a < 0) --q;
  return q;
}
// Nearest integer. A tie would need an even denominator; Honaker denominators are products of 2^m - 1 (odd).
std::int64_t round_nearest(Rational z) {
  if (z.den % 2 == 0) throw std::logic_error("even denominator in a Honaker estimate");
  return static_cast<std::int64_t>(floor_div(2 * z.num + z.den, 2 * z.den));
}

// Honaker bottom-up estimate of node (j, k) from the noisy node values y(j, k):
//   z_0 = y,  z_j = (2^j y + (2^j - 1)(z_left + z_right)) / (2^(j+1) - 1).
using NoisyNode = std::function<i128(std::uint32_t, std::uint32_t)>;
Rational honaker_node(const NoisyNode& y, std::uint32_t j, std::uint32_t k) {
  if (j == 0) return {y(0, k), 1};
  const i128 w = i128{1} << j;
  const Rational children = honaker_node(y, j - 1, 2 * k) + honaker_node(y, j - 1, 2 * k + 1);
  return (Rational{w * y(j, k), 1} + children * (w - 1)) / (2 * w - 1);
}
// The released prefix [1, i]: its nodes are given by the set bits of i; each node's estimate is
// rounded to the integer grid of y's unit, then summed (docs/PRIVACY.md section 4).
std::int64_t honaker_prefix(const NoisyNode& y, std::uint32_t i) {
  std::int64_t total = 0;
  std::uint32_t start = 0;
  for (std::uint32_t j = 32; j-- > 0;)
    if (i >> j & 1u) {
      total += round_nearest(honaker_node(y, j, start >> j));
      start += 1u << j;
    }
  return total;
}

// Node noise of one tree, drawn through the public PRF API and memoized (noise is a pure function of the node).
class TreeNoise {
 public:
  TreeNoise(noise::WindowPrf& prf, std::uint64_t key, noise::Family family, std::uint32_t round,
            const noise::DiscreteGaussian& dg)
      : prf_(prf), key_(key), family_(family), round_(round), dg_(dg) {}
  std::int64_t operator()(std::uint32_t j, std::uint32_t k) {
    auto [it, fresh] = cache_.try_emplace({j, k}, 0);
    if (fresh) it->second = noise::node_noise(prf_, {key_, family_, round_, j, k}, dg_);
    return it->second;
  }

 private:
  noise::WindowPrf& prf_;
  std::uint64_t key_;
  noise::Family family_;
  std::uint32_t round_;
  const noise::DiscreteGaussian& dg_;
  std::map<std::pair<std::uint32_t, std::uint32_t>, std::int64_t> cache_;
};

// P[Y >= 0] for Y ~ N_Z(0, sigma^2): (1 + S) / (1 + 2 S) with S = sum_{y >= 1} exp(-y^2 / (2 sigma^2)).
double discrete_gaussian_nonnegative(double sigma) {
  long double s = 0;
  for (int y = 1; y < 40 * sigma + 10; ++y) s += std::exp(-static_cast<long double>(y) * y / (2.0L * sigma * sigma));
  return static_cast<double>((1 + s) / (1 + 2 * s));
}

// ---------------------------------------------------------------------------------------------
// Streams of records for the sensitivity tests.

struct Increment {  // one key's change at one trigger
  std::int64_t count = 0;
  int128 sum = 0;
  std::int64_t users = 0;
  bool operator==(const Increment&) const = default;
};
void PrintTo(const Increment& i, std::ostream* os) {
  *os << "{count " << i.count << ", sum " << static_cast<double>(i.sum) << ", users " << i.users << "}";
}
using Increments = std::vector<std::map<std::uint64_t, Increment>>;  // [trigger][key]

using Stream = std::vector<std::vector<Record>>;  // [trigger] records, in arbitrary arrival order

constexpr std::int64_t kTriggerSeconds = 1000;

// Runs bound_and_aggregate + KeyStateTable::accumulate over the window (optionally without one user)
// and returns the per-trigger increments of every key's totals.
Increments run_window(const Stream& stream, const kernels::BoundingParams& bp, std::optional<std::uint64_t> without) {
  kernels::UserState users;
  KeyStateTable keys;
  kernels::BoundingStats stats;
  std::map<std::uint64_t, Increment> totals;
  Increments out(stream.size());
  for (std::size_t t = 0; t < stream.size(); ++t) {
    std::vector<Record> records;
    for (const Record& r : stream[t])
      if (!without || r.user != *without) records.push_back(r);
    const auto partials = kernels::bound_and_aggregate(records, bp, users, stats);
    for (const KeyTotals& now : keys.accumulate(partials)) {
      Increment& before = totals[now.key];
      const Increment inc{now.count - before.count, now.sum - before.sum, now.users - before.users};
      if (inc != Increment{}) out[t][now.key] = inc;
      before = {now.count, now.sum, now.users};
    }
  }
  return out;
}

// Independent reference of one user's contribution: its first C records in stream order
// (trigger, timestamp, position), clamped, rounded to 2^-20 and then to the quantum q (nearest,
// ties away from zero); a key gains the user at the user's first kept record on it.
Increments naive_user(const Stream& stream, std::uint64_t user, const kernels::BoundingParams& bp) {
  std::vector<std::pair<std::size_t, Record>> mine;
  for (std::size_t t = 0; t < stream.size(); ++t)
    for (const Record& r : stream[t])
      if (r.user == user) mine.emplace_back(t, r);
  std::sort(mine.begin(), mine.end(), [](const auto& a, const auto& b) {
    return std::tie(a.first, a.second.timestamp, a.second.position) <
           std::tie(b.first, b.second.timestamp, b.second.position);
  });
  Increments out(stream.size());
  std::set<std::uint64_t> touched;
  for (std::size_t i = 0; i < mine.size() && i < bp.max_records_per_user; ++i) {
    const auto& [t, r] = mine[i];
    const double v = std::min(std::max(r.value, bp.clamp_min), bp.clamp_max);
    const auto fixed = static_cast<long double>(std::llround(v * kValueScale));
    const auto q = static_cast<long double>(bp.value_quantum);
    Increment& inc = out[t][r.key];
    inc.count += 1;
    inc.sum += static_cast<i128>(std::llroundl(fixed / q)) * bp.value_quantum;
    inc.users += touched.insert(r.key).second ? 1 : 0;
  }
  for (auto& per_key : out) std::erase_if(per_key, [](const auto& kv) { return kv.second == Increment{}; });
  return out;
}

// D - D': the per-trigger, per-key difference of two runs.
Increments difference(const Increments& d, const Increments& dprime) {
  Increments out(d.size());
  for (std::size_t t = 0; t < d.size(); ++t) {
    for (const auto& [key, inc] : d[t]) out[t][key] = inc;
    for (const auto& [key, inc] : dprime[t]) {
      Increment& o = out[t][key];
      o.count -= inc.count, o.sum -= inc.sum, o.users -= inc.users;
    }
    std::erase_if(out[t], [](const auto& kv) { return kv.second == Increment{}; });
  }
  return out;
}

// Per tree level j, the sum over keys (and rounds) and nodes of (node(D) - node(D'))^2.
struct LevelSquares {
  std::vector<i128> count, sum, selection;
};

// Trees under a fixed release schedule (release[key][leaf], leaves 1..T; leaf i is trigger i - 1):
// - value trees (count, sum): one per key over T leaves; the leaf at a release holds everything
//   accumulated since the key's previous release, every other leaf is 0;
// - key selection: one tree per key and round; round 0 starts at leaf 1, round r + 1 right after the
//   r-th release and ends with the next release (or at T); round step s holds the users new at that trigger.
LevelSquares tree_squares(const Increments& d, const Increments& dprime, const std::set<std::uint64_t>& keys,
                          const std::map<std::uint64_t, std::vector<bool>>& release) {
  const auto T = static_cast<std::uint32_t>(d.size());
  const std::uint32_t L = dptree::levels(T);
  LevelSquares out{std::vector<i128>(L, 0), std::vector<i128>(L, 0), std::vector<i128>(L, 0)};
  auto at = [](const Increments& inc, std::uint32_t leaf, std::uint64_t key) {
    const auto it = inc[leaf - 1].find(key);
    return it == inc[leaf - 1].end() ? Increment{} : it->second;
  };
  for (const std::uint64_t key : keys) {
    const std::vector<bool>& rel = release.at(key);
    // Value trees, built for D and D' separately.
    std::vector<i128> count_d(T + 1, 0), count_p(T + 1, 0), sum_d(T + 1, 0), sum_p(T + 1, 0);
    Increment pend_d, pend_p;
    for (std::uint32_t leaf = 1; leaf <= T; ++leaf) {
      const Increment a = at(d, leaf, key), b = at(dprime, leaf, key);
      pend_d.count += a.count, pend_d.sum += a.sum, pend_p.count += b.count, pend_p.sum += b.sum;
      if (rel[leaf]) {
        count_d[leaf] = pend_d.count, sum_d[leaf] = pend_d.sum, count_p[leaf] = pend_p.count, sum_p[leaf] = pend_p.sum;
        pend_d = pend_p = {};
      }
    }
    for_each_node(T, [&](std::uint32_t j, std::uint32_t k) {
      const i128 dc = node_value(count_d, j, k) - node_value(count_p, j, k);
      const i128 ds = node_value(sum_d, j, k) - node_value(sum_p, j, k);
      out.count[j] += dc * dc;
      out.sum[j] += ds * ds;
    });
    // Key-selection round trees.
    for (std::uint32_t start = 1; start <= T;) {
      std::uint32_t end = start;
      while (end < T && !rel[end]) ++end;
      const std::uint32_t n = end - start + 1;
      std::vector<i128> users_d(n + 1, 0), users_p(n + 1, 0);
      for (std::uint32_t s = 1; s <= n; ++s) {
        users_d[s] = at(d, start + s - 1, key).users;
        users_p[s] = at(dprime, start + s - 1, key).users;
      }
      for_each_node(n, [&](std::uint32_t j, std::uint32_t k) {
        const i128 du = node_value(users_d, j, k) - node_value(users_p, j, k);
        out.selection[j] += du * du;
      });
      start = end + 1;
    }
  }
  return out;
}

// The same for banded-inverse counters: sum over keys (and rounds) of ||C (x - x')||^2, C the inverse of
// the band's lower-triangular Toeplitz matrix over the counter's steps, computed here in long double
// from the band (power series: c_0 = 1, c_k = -sum_{i=1..min(k,b-1)} m_i c_{k-i}).
struct BandedSquares {
  long double count = 0, sum = 0, selection = 0;
};
BandedSquares banded_squares(const Increments& d, const Increments& dprime, const std::set<std::uint64_t>& keys,
                             const std::map<std::uint64_t, std::vector<bool>>& release,
                             const std::vector<std::int64_t>& band) {
  const auto T = static_cast<std::uint32_t>(d.size());
  std::vector<long double> c(T + 1, 0);
  for (std::uint32_t k = 0; k <= T; ++k) {
    c[k] = k == 0 ? 1.0L : 0.0L;
    for (std::size_t i = 1; i < band.size() && i <= k; ++i)
      c[k] -= std::ldexp(static_cast<long double>(band[i]), -30) * c[k - i];
  }
  // ||C v||^2 for v[1..n].
  auto norm2 = [&](const std::vector<i128>& v) {
    long double total = 0;
    for (std::size_t i = 1; i < v.size(); ++i) {
      long double y = 0;
      for (std::size_t j = 1; j <= i; ++j) y += c[i - j] * static_cast<long double>(v[j]);
      total += y * y;
    }
    return total;
  };
  auto at = [](const Increments& inc, std::uint32_t leaf, std::uint64_t key) {
    const auto it = inc[leaf - 1].find(key);
    return it == inc[leaf - 1].end() ? Increment{} : it->second;
  };
  BandedSquares out;
  for (const std::uint64_t key : keys) {
    const std::vector<bool>& rel = release.at(key);
    std::vector<i128> dc(T + 1, 0), ds(T + 1, 0);  // value counters: records accumulated between releases
    Increment pend;
    for (std::uint32_t leaf = 1; leaf <= T; ++leaf) {
      const Increment a = at(d, leaf, key), b = at(dprime, leaf, key);
      pend.count += a.count - b.count, pend.sum += a.sum - b.sum;
      if (rel[leaf]) dc[leaf] = pend.count, ds[leaf] = pend.sum, pend = {};
    }
    out.count += norm2(dc), out.sum += norm2(ds);
    for (std::uint32_t start = 1; start <= T;) {  // key-selection rounds, each a fresh counter
      std::uint32_t end = start;
      while (end < T && !rel[end]) ++end;
      std::vector<i128> du(end - start + 2, 0);
      for (std::uint32_t s = 1; s + start - 1 <= end; ++s)
        du[s] = at(d, start + s - 1, key).users - at(dprime, start + s - 1, key).users;
      out.selection += norm2(du);
      start = end + 1;
    }
  }
  return out;
}

}  // namespace

// =============================================================================================
// 1. No tiny keys.

// Claim: DpReleaser never releases a key whose distinct-user count in the round is <= mu, even with
// huge record counts and sums, thresholds that would let noise alone release it (tau = 0: a tested key
// passes with probability ~1/2 per test; tau = -1e9: every tested key passes), over all T triggers and
// 10^4 secrets per mu. Control: in the same tables, keys with mu + 1 users are released.
TEST(PrivacyProperties, NoTinyKeysAreEverReleased) {
  const std::uint32_t T = 8;
  const int kSecrets = 10000;
  const double sigma = 3.0;
  const std::int64_t kHugeCount = std::int64_t{1} << 40, kHugeSum = std::int64_t{1} << 42;
  const ScopedOmpThreads one_thread(1);
  for (const int mu : {1, 5, 20}) {
    // Tiny keys reach exactly mu users with four arrival patterns; control keys have mu + 1 users at trigger 0.
    std::vector<std::vector<KeyPartial>> per_trigger(T);
    std::set<std::uint64_t> tiny, control;
    for (std::uint64_t i = 0; i < 16; ++i) {
      const std::uint64_t key = 1000 + i;
      tiny.insert(key);
      std::vector<std::int64_t> arrivals(T, 0);
      switch (i % 4) {
        case 0:
          arrivals[0] = mu;
          break;  // all at once
        case 1:
          for (int u = 0; u < mu; ++u) ++arrivals[u % T];
          break;  // spread over the window
        case 2:
          arrivals[T - 1] = mu;
          break;  // all at the last trigger
        case 3:
          arrivals[0] = mu - 1, arrivals[T / 2] = 1;
          break;  // the last one mid-window
      }
      const std::int64_t sign = i % 2 ? -1 : 1;
      for (std::uint32_t t = 0; t < T; ++t)
        per_trigger[t].push_back({key, t == 0 ? kHugeCount : std::int64_t{1} << 30,
                                  sign * (t == 0 ? kHugeSum : std::int64_t{1} << 35), arrivals[t]});
    }
    for (std::uint64_t i = 0; i < 16; ++i) {
      control.insert(2000 + i);
      per_trigger[0].push_back({2000 + i, kHugeCount, kHugeSum, mu + 1});
    }
    for (const auto counter : {kernels::CounterKind::Tree, kernels::CounterKind::Banded})
      for (const double tau : {0.0, -1e9}) {
        const DpParams params = flat_params(T, mu, tau, sigma, counter);
        std::uint64_t tiny_released = 0, control_first = 0, control_ever = 0;
        KeyStateTable table;
        for (int secret = 0; secret < kSecrets; ++secret) {
          DpReleaser releaser(params, noise::secret_from_seed(static_cast<std::uint64_t>(secret)));
          releaser.begin_window(secret % 3);
          table.clear();
          DpStats stats;
          std::set<std::uint64_t> released_controls;
          for (std::uint32_t t = 0; t < T; ++t) {
            table.accumulate(per_trigger[t]);
            for (const KeyRelease& r : releaser.release(table, t, stats)) {
              tiny_released += tiny.count(r.key);
              if (control.count(r.key)) {
                released_controls.insert(r.key);
                control_first += t == 0;
              }
            }
          }
          control_ever += released_controls.size();
        }
        EXPECT_EQ(tiny_released, 0u) << "mu = " << mu << ", tau = " << tau;
        const double n = 16.0 * kSecrets;
        if (tau < 0) {
          EXPECT_EQ(control_first, 16u * kSecrets) << "mu = " << mu << ": every tested key passes tau = -1e9";
        } else {
          // At trigger 0 a control key is released iff its leaf noise Y >= 0 (noisy users mu + 1 + Y > mu); with
          // a banded counter iff sigma Z_1 > -1 (M_0 = 1; the 2^-20 rounding moves the bar by < 2^-20: P changes
          // < 1e-6). The 1.6e5 draws are independent (distinct keys or secrets); a 6-sd two-sided binomial bound
          // has a false-failure rate below 2e-9 per (mu, tau, counter).
          const double p = counter == kernels::CounterKind::Tree
                               ? discrete_gaussian_nonnegative(noise::DiscreteGaussian(sigma).sigma())
                               : 0.5 * std::erfc(-1.0 / (sigma * std::sqrt(2.0)));
          EXPECT_NEAR(static_cast<double>(control_first) / n, p, 6 * std::sqrt(p * (1 - p) / n)) << "mu = " << mu;
          // Over the window almost every control key is released ("most of the time"): the fraction is
          // ~0.97 (8 correlated tests per key), sd < 5e-4, so the bound 0.9 is > 100 sd away (false-failure rate ~0).
          EXPECT_GT(static_cast<double>(control_ever) / n, 0.9) << "mu = " << mu;
        }
      }
  }
}

// Claim (plan level): with the real plan of a parsed mode = "dp" job, after a key's release its round
// restarts (round users = users - users at the release); the key is not tested, hence not released,
// until more than mu NEW users have arrived, over many rounds, secrets and arrival patterns. Bursts of
// users larger than mu + tau + the largest possible noise are always released (so rounds do restart).
TEST(PrivacyProperties, PlanLevelNoReleaseUntilMoreThanMuNewUsers) {
  const std::uint32_t T = 32;
  const JobConfig config = dp_job(T, 4, 5, 2.0, -1.0, 2.0);
  const PrivacyPlan plan = make_privacy_plan(config);
  const DpParams params = release_params(plan);
  ASSERT_EQ(params.mu, 5.0);
  // |sample| <= 2^11 t (the sampler's cut), so |N_j| <= (j + 1) 2^j 2^11 t and a rounded prefix moves by at
  // most sum_j ((j + 1) 2^11 t + 1/2) users: a burst above mu + tau + that is released with certainty.
  const double M = std::ldexp(static_cast<double>(noise::DiscreteGaussian(params.sigma_selection).t()), 11);
  double noise_bound = 0;
  for (std::uint32_t j = 0; j < plan.levels; ++j) noise_bound += (j + 1) * M + 0.5;
  const auto burst =
      static_cast<std::int64_t>(plan.mu + *std::max_element(plan.tau.begin(), plan.tau.end()) + noise_bound) + 1;

  // Arrivals per key and trigger: bursts, trickles of 1-2 users, and triggers with only (huge) records.
  const int kKeys = 40;
  std::mt19937_64 rng(20240601);
  std::vector<std::vector<KeyPartial>> per_trigger(T);
  std::vector<std::vector<bool>> is_burst(kKeys, std::vector<bool>(T, false));
  for (int k = 0; k < kKeys; ++k)
    for (std::uint32_t t = 0; t < T; ++t) {
      const double r = std::uniform_real_distribution<double>(0, 1)(rng);
      const std::int64_t users = r < 0.12 ? burst : r < 0.6 ? 1 + static_cast<std::int64_t>(rng() % 2) : 0;
      is_burst[k][t] = users == burst;
      per_trigger[t].push_back({static_cast<std::uint64_t>(k), std::int64_t{1} << 30, std::int64_t{1} << 38, users});
    }

  const ScopedOmpThreads one_thread(1);
  std::uint64_t quiet_after_release = 0, reopened = 0;  // non-vacuity counters
  for (int secret = 0; secret < 200; ++secret) {
    DpReleaser releaser(params, noise::secret_from_seed(1000 + static_cast<std::uint64_t>(secret)));
    releaser.begin_window(0);
    KeyStateTable table;
    DpStats stats;
    std::vector<std::int64_t> users(kKeys, 0), base(kKeys, 0);  // the test's own round bookkeeping
    std::vector<bool> released_before(kKeys, false);
    for (std::uint32_t t = 0; t < T; ++t) {
      table.accumulate(per_trigger[t]);
      std::uint64_t expected_tests = 0;
      for (int k = 0; k < kKeys; ++k) {
        users[k] += per_trigger[t][k].new_users;
        const auto round_users = static_cast<double>(users[k] - base[k]);
        expected_tests += round_users > plan.mu;
        if (released_before[k] && round_users > 0 && round_users <= plan.mu) ++quiet_after_release;
        if (released_before[k] && round_users > plan.mu && !is_burst[k][t]) ++reopened;
      }
      const std::uint64_t tested_before = stats.tested;
      std::set<std::uint64_t> released;
      for (const KeyRelease& r : releaser.release(table, t, stats)) released.insert(r.key);
      EXPECT_EQ(stats.tested - tested_before, expected_tests)
          << "trigger " << t << ": keys with > mu round users are tested";
      for (int k = 0; k < kKeys; ++k) {
        const auto round_users = static_cast<double>(users[k] - base[k]);
        const bool rel = released.count(static_cast<std::uint64_t>(k)) > 0;
        ASSERT_FALSE(rel && round_users <= plan.mu) << "secret " << secret << " trigger " << t << " key " << k
                                                    << " released with " << round_users << " round users";
        EXPECT_TRUE(rel || !is_burst[k][t]) << "a burst of " << burst << " users must be released";
        if (rel) {
          base[k] = users[k];
          released_before[k] = true;
          const auto st = table.find(static_cast<std::uint64_t>(k));
          ASSERT_TRUE(st.has_value());
          EXPECT_EQ(st->users - st->round_base_users, 0) << "the round restarts after a release";
        }
      }
    }
  }
  EXPECT_GT(quiet_after_release, 1000u) << "the setup must hold keys with 1..mu new users after a release";
  EXPECT_GT(reopened, 100u) << "the setup must reopen rounds by trickles of new users";
}

// =============================================================================================
// 2. Sensitivity of one user's records.

// Claims, for D (all users) vs D' (D without user u), through bound_and_aggregate + accumulate:
//  (a) u changes new-user increments by 0 or 1, at most once per key over the window, on <= C keys;
//  (b) sum_k |dcount_k| <= C and sum_k dcount_k^2 <= C^2 (over the window);
//  (c) sum_k |dsum_k| <= C L in fixed point, L = the clamp bound after rounding to the plan's sum grid;
//  (d) the difference is exactly u's own bounded contribution (an independent reference of u alone):
//      every other user's contribution is unchanged, whoever else is in the stream;
// and for the trees under fixed release schedules, per level, the sum over keys (and rounds) and
// nodes of the squared node change is <= (C L_col)^2 for the value trees (L_count = 1) and <= C for
// key selection, hence <= levels(T) times that over all levels: the sensitivities of the plan's
// rho = levels * sensitivity^2 / (2 sigma^2). The bounds are attained by the adversaries below.
TEST(PrivacyProperties, OneUserMovesNoMoreThanTheAccountedSensitivity) {
  const std::uint32_t T = 13, C = 16, kKeys = 60;
  const JobConfig config = dp_job(T, C, 2, 1.0, -2.3, 1.7);
  const PrivacyPlan plan = make_privacy_plan(config);
  // The banded counters' plan: rho = ||C e_1||^2 sensitivity^2 / (2 sigma^2) per family.
  const PrivacyPlan banded = make_privacy_plan(dp_job(T, C, 2, 1.0, -2.3, 1.7, "banded"));
  ASSERT_EQ(banded.selection_counter, kernels::CounterKind::Banded);
  ASSERT_EQ(banded.value_counter, kernels::CounterKind::Banded);
  EXPECT_NEAR(banded.selection.rho, banded.band_norm2 * C / (2 * banded.selection.sigma * banded.selection.sigma),
              1e-12 * banded.selection.rho);
  for (const auto& f : banded.aggregation)
    EXPECT_NEAR(f.rho, banded.band_norm2 * f.sensitivity * f.sensitivity / (2 * f.sigma * f.sigma), 1e-12 * f.rho)
        << f.name;
  EXPECT_EQ(banded.sum_quantum, plan.sum_quantum);
  long double max_banded_count = 0, max_banded_sum = 0, max_banded_selection = 0;
  ASSERT_GT(plan.sum_quantum, 1) << "test setup: epsilon must make the sum grid coarser than 2^-20";
  const kernels::BoundingParams bp{C, config.privacy.clamp_min, config.privacy.clamp_max, plan.sum_quantum};
  // L on the plan's grid, computed independently: max |nearest multiple of q to round(clamp 2^20)|.
  auto on_grid = [&](double v) {
    const auto fixed = static_cast<long double>(std::llround(v * kValueScale));
    return std::llabs(std::llroundl(fixed / plan.sum_quantum) * plan.sum_quantum);
  };
  const i128 L = std::max(on_grid(bp.clamp_min), on_grid(bp.clamp_max));
  EXPECT_EQ(static_cast<double>(L), plan.clamp_bound * kValueScale);
  // The plan's accounting uses exactly these sensitivities.
  EXPECT_EQ(plan.levels, dptree::levels(T));
  EXPECT_DOUBLE_EQ(plan.selection.sensitivity * plan.selection.sensitivity, C);
  EXPECT_NEAR(plan.selection.rho, plan.levels * C / (2 * plan.selection.sigma * plan.selection.sigma),
              1e-12 * plan.selection.rho);
  ASSERT_EQ(plan.aggregation.size(), 2u);
  EXPECT_EQ(plan.aggregation[0].name, "count");
  EXPECT_DOUBLE_EQ(plan.aggregation[0].sensitivity, C);
  EXPECT_EQ(plan.aggregation[1].name, "sum");
  EXPECT_DOUBLE_EQ(plan.aggregation[1].sensitivity * kValueScale, static_cast<double>(C * L));
  double rho_used = 0;
  for (const auto& f : plan.aggregation) {
    EXPECT_NEAR(f.rho, plan.levels * f.sensitivity * f.sensitivity / (2 * f.sigma * f.sigma), 1e-12 * f.rho) << f.name;
    rho_used += f.rho;
  }
  EXPECT_LE(rho_used, plan.rho_aggregation * (1 + 1e-12));

  // The stream: 400 ordinary users plus four adversaries, ties in time, values outside the clamp range.
  std::mt19937_64 rng(777);
  Stream stream(T);
  auto add = [&](std::uint64_t user, std::uint32_t t, std::uint64_t key, std::int64_t ts, double value) {
    stream[t].push_back(Record{user, key, t * kTriggerSeconds + ts, 0, value});
  };
  std::uniform_real_distribution<double> unit(0, 1);
  for (std::uint64_t u = 1; u <= 400; ++u) {
    const int n = 1 + static_cast<int>(rng() % (u % 10 == 0 ? 60 : 12));  // every tenth user is heavy
    for (int i = 0; i < n; ++i)
      add(u, static_cast<std::uint32_t>(rng() % T), static_cast<std::uint64_t>(kKeys * unit(rng) * unit(rng)),
          static_cast<std::int64_t>(rng() % 20), -4.0 + 8.0 * unit(rng));
  }
  const double extremes[] = {1e9, -1e9, 1e300, -1e300, HUGE_VAL, -HUGE_VAL, 1.7, -2.3, 0.0};
  // A1 (spread): its first C records in stream order touch C distinct keys (5 at trigger 0, 11 at
  // trigger 2); thousands more over every trigger are dropped.
  const std::uint64_t kSpread = 900001, kConcentrated = 900002, kRandom = 900003;
  for (std::uint64_t k = 0; k < 5; ++k) add(kSpread, 0, k, 0, extremes[k % 9]);
  for (std::uint64_t k = 5; k < C; ++k) add(kSpread, 2, k, 0, extremes[k % 9]);
  for (int i = 0; i < 3000; ++i)
    add(kSpread, 2 + static_cast<std::uint32_t>(rng() % (T - 2)), rng() % kKeys,
        1 + static_cast<std::int64_t>(rng() % 500), extremes[rng() % 9]);
  // A2 (concentrated): thousands of records at trigger 3, all on key 7 and far below clamp_min, then more later.
  for (int i = 0; i < 3000; ++i)
    add(kConcentrated, 3 + static_cast<std::uint32_t>(i / 1000) * 3, 7, static_cast<std::int64_t>(rng() % 3), -1e12);
  // A3 (random): thousands of records anywhere, many timestamp ties, values of both signs far outside [-2.3, 1.7].
  for (int i = 0; i < 4000; ++i)
    add(kRandom, static_cast<std::uint32_t>(rng() % T), rng() % kKeys, static_cast<std::int64_t>(rng() % 4),
        unit(rng) < 0.2 ? extremes[rng() % 9] : -1e6 + 2e6 * unit(rng));
  // A4 (repeater): returns to the same two keys at several triggers, several records each time; it
  // must gain each key's user count once only.
  const std::uint64_t kRepeater = 900004;
  for (const std::uint32_t t : {1u, 4u, 6u, 8u, 11u})
    for (int i = 0; i < 3; ++i) {
      add(kRepeater, t, 3, i, 5.0);
      if (t >= 6) add(kRepeater, t, 9, i, -5.0);
    }
  // Unique positions in a scrambled arrival order.
  for (auto& recs : stream) std::shuffle(recs.begin(), recs.end(), rng);
  std::uint64_t position = 0;
  for (auto& recs : stream)
    for (Record& r : recs) r.position = position++ * 7919 % 1000003;

  const Increments full = run_window(stream, bp, std::nullopt);
  std::vector<std::uint64_t> removed = {kSpread, kConcentrated, kRandom, kRepeater, 10, 20, 37, 123, 400};
  i128 max_count_level = 0, max_sum_level = 0, max_selection_level = 0;
  for (const std::uint64_t u : removed) {
    SCOPED_TRACE("removed user " + std::to_string(u));
    const Increments without = run_window(stream, bp, u);
    const Increments delta = difference(full, without);
    // (d) D - D' is exactly u's own contribution, computed from u's records alone.
    EXPECT_EQ(delta, naive_user(stream, u, bp));

    // (a), (b), (c).
    std::map<std::uint64_t, std::int64_t> user_gain, count_by_key;
    std::int64_t abs_count = 0;
    i128 abs_sum = 0;
    for (std::uint32_t t = 0; t < T; ++t)
      for (const auto& [key, d] : delta[t]) {
        EXPECT_TRUE(d.users == 0 || d.users == 1) << "trigger " << t << " key " << key;
        user_gain[key] += d.users;
        count_by_key[key] += d.count;
        EXPECT_GE(d.count, 0);
        abs_count += std::llabs(d.count);
        abs_sum += abs128(d.sum);
      }
    std::size_t keys_gained = 0;
    for (const auto& [key, g] : user_gain) {
      EXPECT_LE(g, 1) << "key " << key << " gained user " << u << " more than once";
      keys_gained += g > 0;
    }
    EXPECT_LE(keys_gained, C);
    EXPECT_LE(abs_count, static_cast<std::int64_t>(C));
    std::int64_t count_squares = 0;
    for (const auto& [key, c] : count_by_key) count_squares += c * c;
    EXPECT_LE(count_squares, static_cast<std::int64_t>(C * C));
    EXPECT_LE(abs_sum, C * L);

    // Trees under release schedules: every leaf, none, only the last, and random ones.
    std::set<std::uint64_t> keys;
    for (const auto* inc : {&full, &without})
      for (const auto& per_key : *inc)
        for (const auto& [key, _] : per_key) keys.insert(key);
    for (int schedule = 0; schedule < 24; ++schedule) {
      std::map<std::uint64_t, std::vector<bool>> release;
      for (const std::uint64_t key : keys) {
        std::vector<bool>& rel = release[key];
        rel.assign(T + 1, false);
        for (std::uint32_t leaf = 1; leaf <= T; ++leaf)
          rel[leaf] = schedule == 0   ? true
                      : schedule == 1 ? false
                      : schedule == 2 ? leaf == T
                                      : unit(rng) < 0.1 * (schedule % 8);
      }
      const LevelSquares sq = tree_squares(full, without, keys, release);
      i128 count_total = 0, sum_total = 0, selection_total = 0;
      for (std::uint32_t j = 0; j < plan.levels; ++j) {
        EXPECT_LE(sq.count[j], i128{C} * C) << "schedule " << schedule << " level " << j;
        EXPECT_LE(sq.sum[j], (C * L) * (C * L)) << "schedule " << schedule << " level " << j;
        EXPECT_LE(sq.selection[j], i128{C}) << "schedule " << schedule << " level " << j;
        count_total += sq.count[j], sum_total += sq.sum[j], selection_total += sq.selection[j];
        max_count_level = std::max(max_count_level, sq.count[j]);
        max_sum_level = std::max(max_sum_level, sq.sum[j]);
        max_selection_level = std::max(max_selection_level, sq.selection[j]);
      }
      EXPECT_LE(count_total, i128{plan.levels} * C * C);
      EXPECT_LE(sum_total, i128{plan.levels} * (C * L) * (C * L));
      EXPECT_LE(selection_total, i128{plan.levels} * C);
      // Banded: the squared change of C x over every counter is within the accounted sensitivity^2 ||C e_1||^2.
      const BandedSquares bq = banded_squares(full, without, keys, release, banded.band);
      const long double norm2 = banded.band_norm2;
      const auto CL = static_cast<long double>(C * L);
      EXPECT_LE(bq.count, norm2 * C * C) << "schedule " << schedule;
      EXPECT_LE(bq.sum, norm2 * CL * CL) << "schedule " << schedule;
      EXPECT_LE(bq.selection, norm2 * C) << "schedule " << schedule;
      max_banded_count = std::max(max_banded_count, bq.count / (norm2 * C * C));
      max_banded_sum = std::max(max_banded_sum, bq.sum / (norm2 * CL * CL));
      max_banded_selection = std::max(max_banded_selection, bq.selection / (norm2 * C));
    }
  }
  // The adversaries come after step 1 of most counters, so they reach part of the bound; one unit at
  // step 1 of a T-step counter reaches it (up to the plan's 1e-9 upward margin).
  EXPECT_GT(max_banded_count, 0.5L);
  EXPECT_GT(max_banded_sum, 0.5L);
  EXPECT_GT(max_banded_selection, 0.5L);
  Increments one(T), none(T);
  one[0][0] = Increment{1, 1, 1};  // count, sum, users at step 1
  const BandedSquares unit_step = banded_squares(one, none, {0}, {{0, std::vector<bool>(T + 1, false)}}, banded.band);
  EXPECT_LE(unit_step.selection, static_cast<long double>(banded.band_norm2));
  EXPECT_GT(unit_step.selection, static_cast<long double>(banded.band_norm2) * (1 - 2e-9L));
  // The bounds are tight: A2 puts C clamped records on one key, A1 first-touches C keys.
  EXPECT_EQ(max_count_level, i128{C} * C);
  EXPECT_EQ(max_sum_level, (C * L) * (C * L));
  EXPECT_EQ(max_selection_level, i128{C});
}

// =============================================================================================
// 3. The released value formula.

// Claim: with a fixed secret, every release of DpReleaser is what docs/PRIVACY.md sections 4-5 specify,
// recomputed here independently from the node noises (noise::node_noise) with exact rationals:
// - key k is tested at trigger t iff its round users exceed mu, and released iff the rounded Honaker
//   prefix of its round's selection tree (leaves: new users per round step) exceeds (mu + tau_s) 2^20;
// - then count = Honaker prefix at leaf t + 1 of the Count tree whose leaves hold the records accumulated
//   between releases, from y = (true + noise) 2^20 rounded per node to the 2^-20 grid; sum likewise from
//   y = true fixed sum + noise * quantum;
// - after a release the next round starts at the next trigger with a fresh tree (round number + 1).
TEST(PrivacyProperties, ReleasedValuesMatchAnIndependentHonakerImplementation) {
  const std::uint32_t T = 20;
  const double mu = 3;
  DpParams params = flat_params(T, mu, 0, 2.0);
  for (std::uint32_t s = 1; s <= T; ++s)
    params.tau[s] = 1.5 * params.sigma_selection * std::sqrt(dptree::prefix_variance_factor(s));
  const noise::DiscreteGaussian dg_sel(params.sigma_selection), dg_count(params.sigma_count), dg_sum(params.sigma_sum);
  const int kKeys = 30;
  std::mt19937_64 rng(99);
  std::vector<std::vector<KeyPartial>> per_trigger(T);
  for (std::uint32_t t = 0; t < T; ++t)
    for (int k = 0; k < kKeys; ++k)
      if (rng() % 10 < 6)
        per_trigger[t].push_back({static_cast<std::uint64_t>(k) * 0x9E3779B97F4A7C15ull,
                                  1 + static_cast<std::int64_t>(rng() % 20),
                                  params.sum_quantum * (static_cast<std::int64_t>(rng() % 1001) - 500),
                                  static_cast<std::int64_t>(rng() % 4)});

  std::uint64_t releases = 0, later_rounds = 0;
  for (const std::uint64_t seed : {1ull, 2ull, 3ull}) {
    const noise::Secret secret = noise::secret_from_seed(seed);
    const std::int64_t window = 5;
    DpReleaser releaser(params, secret);
    releaser.begin_window(window);
    noise::WindowPrf prf(secret, window);
    KeyStateTable table;
    DpStats stats;
    // The test's own model of every key: per-trigger increments, round, round start (trigger), releases.
    struct Model {
      std::vector<std::int64_t> count, sum, users;  // per trigger
      std::uint32_t round = 0, round_start = 0;
      std::int64_t total_users = 0, base_users = 0;
      std::vector<std::uint32_t> released_at;  // triggers
    };
    std::map<std::uint64_t, Model> model;
    for (std::uint32_t t = 0; t < T; ++t) {
      table.accumulate(per_trigger[t]);
      for (const KeyPartial& p : per_trigger[t]) {
        Model& m = model[p.key];
        m.count.resize(T, 0), m.sum.resize(T, 0), m.users.resize(T, 0);
        m.count[t] += p.count, m.sum[t] += p.sum, m.users[t] += p.new_users, m.total_users += p.new_users;
      }
      std::vector<KeyRelease> expected;
      for (auto& [key, m] : model) {
        if (static_cast<double>(m.total_users - m.base_users) <= mu) continue;
        const std::uint32_t step = t - m.round_start + 1;
        TreeNoise sel(prf, key, noise::Family::KeySelection, m.round, dg_sel);
        const NoisyNode y_sel = [&, &m = m](std::uint32_t j,
                                            std::uint32_t k) {  // C++20 binding capture, spelled for clang 14
          i128 truth = 0;
          for (std::uint32_t s = k * (1u << j) + 1; s <= (k + 1) * (1u << j); ++s)
            truth += m.users[m.round_start + s - 1];
          return (truth + sel(j, k)) * kOne;
        };
        const std::int64_t noisy_users = honaker_prefix(y_sel, step);
        if (static_cast<double>(noisy_users) <= (mu + params.tau[step]) * static_cast<double>(kOne)) continue;
        // Value-tree leaves: at each release trigger, everything since the previous release.
        m.released_at.push_back(t);
        std::vector<i128> count_leaf(T + 1, 0), sum_leaf(T + 1, 0);
        std::uint32_t from = 0;
        for (const std::uint32_t r : m.released_at) {
          for (std::uint32_t u = from; u <= r; ++u) count_leaf[r + 1] += m.count[u], sum_leaf[r + 1] += m.sum[u];
          from = r + 1;
        }
        TreeNoise cnt(prf, key, noise::Family::Count, 0, dg_count), sm(prf, key, noise::Family::Sum, 0, dg_sum);
        const NoisyNode y_count = [&](std::uint32_t j, std::uint32_t k) {
          return (node_value(count_leaf, j, k) + cnt(j, k)) * kOne;
        };
        const NoisyNode y_sum = [&](std::uint32_t j, std::uint32_t k) {
          return node_value(sum_leaf, j, k) + i128{sm(j, k)} * params.sum_quantum;
        };
        expected.push_back({key, honaker_prefix(y_count, t + 1), honaker_prefix(y_sum, t + 1)});
        later_rounds += m.round > 0;
        ++m.round;
        m.round_start = t + 1;
        m.base_users = m.total_users;
      }
      std::sort(expected.begin(), expected.end(),
                [](const KeyRelease& a, const KeyRelease& b) { return a.key < b.key; });
      const std::vector<KeyRelease> got = releaser.release(table, t, stats);
      ASSERT_EQ(got.size(), expected.size()) << "seed " << seed << " trigger " << t;
      for (std::size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].key, expected[i].key) << "seed " << seed << " trigger " << t;
        EXPECT_EQ(got[i].count, expected[i].count) << "seed " << seed << " trigger " << t << " key " << got[i].key;
        EXPECT_EQ(got[i].sum, expected[i].sum) << "seed " << seed << " trigger " << t << " key " << got[i].key;
      }
      releases += got.size();
    }
  }
  // Non-vacuity: many releases, many of them in later rounds (restarted selection trees).
  EXPECT_GT(releases, 100u);
  EXPECT_GT(later_rounds, 50u);
}

// The same claim for banded counters (docs/PRIVACY.md section 5): with every tested key released
// (tau = -1e9), each released count is the true count plus round(2^20 N_leaf) and each sum the true sum
// plus round(quantum N_leaf), where N_leaf = sigma sum_r M_(leaf-r) Z_r is recomputed here by the
// arbitrary-precision reference (exact_prefix_noise: all samples with 128 or more bits) from the
// BandedCount / BandedSum samples of the key; a key with mu users or fewer is never released.
TEST(PrivacyProperties, BandedReleasesMatchTheArbitraryPrecisionReference) {
  const std::uint32_t T = 24;
  const double mu = 2;
  const DpParams params = flat_params(T, mu, -1e9, 2.0, kernels::CounterKind::Banded);
  const kernels::banded::BandedPlan count_plan(params.band, params.sigma_count),
      sum_plan(params.band, params.sigma_sum);
  const auto secret = noise::secret_from_seed(17);
  std::mt19937_64 rng(5);
  std::vector<std::vector<KeyPartial>> per_trigger(T);
  for (std::uint32_t t = 0; t < T; ++t)
    for (std::uint64_t k = 1; k <= 40; ++k)
      if (rng() % 3 == 0)
        per_trigger[t].push_back({k, static_cast<std::int64_t>(1 + rng() % 5),
                                  static_cast<std::int64_t>(rng() % 4000) * 16 - 20000,
                                  static_cast<std::int64_t>(1 + rng() % 3)});
  DpReleaser releaser(params, secret);
  releaser.begin_window(2);
  noise::WindowPrf prf(secret, 2);
  KeyStateTable table;
  DpStats stats;
  std::map<std::uint64_t, std::int64_t> users;
  std::size_t checked = 0;
  for (std::uint32_t t = 0; t < T; ++t) {
    table.accumulate(per_trigger[t]);
    for (const KeyRelease& r : releaser.release(table, t, stats)) {
      const kernels::KeyState st = table.at(r.key);
      const auto redraw = [&](noise::Family family) {
        return [&, family](std::uint32_t index, std::size_t words) {
          noise::NodeStream s(prf, noise::NodeId{r.key, family, 0, 0, index});
          return noise::sample_normal(s, words);
        };
      };
      const std::int64_t one = std::int64_t{1} << kValueFracBits;
      EXPECT_TRUE(r.count == int128{st.count} * one + kernels::banded::exact_prefix_noise(
                                                          count_plan, one, t + 1, redraw(noise::Family::BandedCount)))
          << "key " << r.key << " trigger " << t;
      EXPECT_TRUE(r.sum == st.sum + kernels::banded::exact_prefix_noise(sum_plan, params.sum_quantum, t + 1,
                                                                        redraw(noise::Family::BandedSum)))
          << "key " << r.key << " trigger " << t;
      ++checked;
    }
  }
  EXPECT_GT(checked, 120u);
  EXPECT_EQ(stats.released, checked);
}

// A release is total + noise in 128 bits: totals far beyond int64 neither abort nor wrap, and the noise
// added to them is the noise the same key gets on small totals (same secret, window, key and round).
TEST(PrivacyProperties, TotalsBeyondInt64AreReleasedExactlyPlusTheSameNoise) {
  const std::uint64_t key = 0x5EED;
  const int128 huge_sum = (int128{1} << 100) + 12345, huge_count = int128{1} << 62;
  auto state = [&](bool huge) {
    kernels::KeyState st;
    st.users = 50;
    st.count = huge ? static_cast<std::int64_t>(huge_count) : 10;
    st.sum = huge ? huge_sum : 777;
    return st;
  };
  DpParams params = flat_params(4, 0, -1e9, 2.0);  // every tested key passes
  std::vector<KeyRelease> dp[2];
  std::vector<KeyRelease> baseline[2];
  for (const bool huge : {false, true}) {
    KeyStateTable table;
    table.put(key, state(huge));
    DpReleaser releaser(params, noise::secret_from_seed(8));
    releaser.begin_window(3);
    DpStats stats;
    dp[huge] = releaser.release(table, 0, stats);
    kernels::BaselineParams bp;
    bp.tau = -1e9;
    bp.sigma_selection = 2.0;
    bp.sigma_count = 4.0;
    bp.sigma_sum = 6.0;
    bp.sum_quantum = 16;
    kernels::BaselineReleaser base(bp, noise::secret_from_seed(8));
    base.begin_window(3);
    const kernels::KeyState st = state(huge);
    baseline[huge] = base.release({KeyTotals{key, st.count, st.sum, st.users}}, table, 0, stats);
  }
  for (const auto* rel : {dp, baseline}) {
    ASSERT_EQ(rel[0].size(), 1u);
    ASSERT_EQ(rel[1].size(), 1u);
    EXPECT_TRUE(rel[1][0].count - rel[0][0].count == (huge_count - 10) * kOne);
    EXPECT_TRUE(rel[1][0].sum - rel[0][0].sum == huge_sum - 777);
    EXPECT_TRUE(rel[1][0].sum > INT64_MAX);
  }
}

}  // namespace dpstream
