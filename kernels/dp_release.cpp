#include "kernels/dp_release.hpp"

#include <omp.h>

#include <openssl/crypto.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#ifdef DPSTREAM_TEST_HOOKS
#include <cmath>
#include <cstdio>
#include <cstdlib>
#endif

#include "src/fault_injection.hpp"

namespace dpstream::kernels {

namespace {
constexpr std::int64_t kOne = std::int64_t{1} << kValueFracBits;  // one user or record in fixed point

#ifdef DPSTREAM_TEST_HOOKS
// Test-hooks build only: the target dpstream_test_hooks (tests/e2e/CMakeLists.txt) compiles this file
// with DPSTREAM_TEST_HOOKS; the shipped dpstream contains no such code. DPSTREAM_TEST_NOISE_SCALE = f
// multiplies every noise sigma by f (the thresholds stay the plan's): with f < 1, a deliberately
// broken, non-private mechanism that the privacy audit (tests/e2e/test_privacy_audit.py) must detect.
void apply_test_hooks(DpParams& p) {
  const char* text = std::getenv("DPSTREAM_TEST_NOISE_SCALE");
  if (text == nullptr || *text == '\0') return;
  char* end = nullptr;
  const double f = std::strtod(text, &end);
  if (*end != '\0' || !(f > 0) || !std::isfinite(f))
    throw std::invalid_argument(std::string("DPSTREAM_TEST_NOISE_SCALE='") + text + "': expected a number > 0");
  p.sigma_selection *= f;
  p.sigma_count *= f;
  p.sigma_sum *= f;
  std::fprintf(stderr, "dpstream test-hooks build: DPSTREAM_TEST_NOISE_SCALE = %g scales every noise sigma: NOT private\n", f);
}
#endif
}  // namespace

DpReleaser::DpReleaser(DpParams params, const noise::Secret& secret)
    : params_(std::move(params)), secret_(secret), selection_noise_(params_.sigma_selection) {
#ifdef DPSTREAM_TEST_HOOKS
  apply_test_hooks(params_);
  selection_noise_ = noise::DiscreteGaussian(params_.sigma_selection);
#endif
  if (params_.triggers < 1 || params_.triggers > dptree::kMaxSteps || params_.tau.size() != params_.triggers + 1u)
    throw std::invalid_argument("DpParams: need 1 <= T <= 2^20 and tau[0..T]");
  if (params_.release_count) count_noise_.emplace(params_.sigma_count);
  if (params_.release_sum) sum_noise_.emplace(params_.sigma_sum);
}

DpReleaser::~DpReleaser() { OPENSSL_cleanse(secret_.data(), secret_.size()); }

void DpReleaser::begin_window(std::int64_t window) {
  window_ = window;
  for (auto& c : caches_) c.clear();
}

std::uint64_t DpReleaser::cached_keys() const {
  std::uint64_t n = 0;
  for (const auto& c : caches_) n += c.size();
  return n;
}

std::uint64_t DpReleaser::memory_bytes() const {
  std::uint64_t b = 0;
  for (const auto& c : caches_) b += c.capacity() * (1 + sizeof(std::pair<const std::uint64_t, NoiseCache>));
  return b;
}

std::vector<KeyRelease> DpReleaser::release(KeyStateTable& keys, std::uint32_t trigger, DpStats& stats) {
  if (trigger >= params_.triggers) throw std::out_of_range("trigger beyond T");
  const std::uint32_t leaf = trigger + 1;  // value trees: leaf i is trigger i - 1
  std::vector<std::vector<KeyRelease>> out(KeyStateTable::kShards);
  std::uint64_t tested = 0, released = 0, draws = 0;
  std::string error;  // an exception must not leave the OpenMP region: keep the first, rethrow after
#pragma omp parallel reduction(+ : tested, released, draws)
  try {
    noise::WindowPrf prf(secret_, window_);
    // Noise of one node of one tree family (drawn once per node per cache lifetime).
    auto drawer = [&](std::uint64_t key, noise::Family family, std::uint32_t round, const noise::DiscreteGaussian& dg) {
      return [&, key, family, round](std::uint32_t level, std::uint32_t index) {
        ++draws;
        return noise::node_noise(prf, {key, family, round, level, index}, dg);
      };
    };
#pragma omp for schedule(dynamic, 4)
    for (std::size_t s = 0; s < KeyStateTable::kShards; ++s) {
      if (s == KeyStateTable::kShards / 2) fault::point("dp_release");
      auto& cache = caches_[s];
      for (auto& [key, st] : keys.shards[s]) {
        const std::int64_t round_users = st.users - st.round_base_users;
        if (static_cast<double>(round_users) <= params_.mu) continue;  // never tested: no tiny keys
        const std::uint32_t step = trigger - st.round_start + 1;        // the round's leaf for this trigger
        NoiseCache& c = cache[key];
        if (c.selection_round != st.round || c.selection.at() > step) {
          c.selection.reset();
          c.selection_round = st.round;
        }
        c.selection.advance(step, drawer(key, noise::Family::KeySelection, st.round, selection_noise_));
        ++tested;
        const int128 noisy_users = int128{round_users} * kOne + c.selection.prefix_noise(kOne);
        if (static_cast<double>(noisy_users) <= (params_.mu + params_.tau[step]) * static_cast<double>(kOne)) continue;

        KeyRelease r{key, 0, 0};  // 128-bit values: no total plus noise can overflow (record.hpp)
        if (count_noise_) {
          c.count.advance(leaf, drawer(key, noise::Family::Count, 0, *count_noise_));
          r.count = int128{st.count} * kOne + c.count.prefix_noise(kOne);
        }
        if (sum_noise_) {
          c.sum.advance(leaf, drawer(key, noise::Family::Sum, 0, *sum_noise_));
          r.sum = st.sum + c.sum.prefix_noise(params_.sum_quantum);
        }
        out[s].push_back(r);
        if (keys.journal) keys.changed_keys[s].push_back(key);
        ++released;
        // The next round counts users new to the key after this trigger, in a fresh tree.
        ++st.round;
        st.round_start = trigger + 1;
        st.round_base_users = st.users;
        c.selection.reset();
        c.selection_round = st.round;
      }
    }
  } catch (const std::exception& e) {
#pragma omp critical(dp_release_error)
    if (error.empty()) error = e.what();
  }
  if (!error.empty()) throw std::runtime_error("DP release: " + error);
  stats.tested += tested;
  stats.released += released;
  stats.noise_draws += draws;
  std::vector<KeyRelease> all;
  for (auto& o : out) all.insert(all.end(), o.begin(), o.end());
  std::sort(all.begin(), all.end(), [](const KeyRelease& a, const KeyRelease& b) { return a.key < b.key; });
  return all;
}

}  // namespace dpstream::kernels
