#include "kernels/baseline_release.hpp"

#include <omp.h>

#include <openssl/crypto.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/fault_injection.hpp"
#include "partition/hash.hpp"

namespace dpstream::kernels {

namespace {
constexpr std::int64_t kOne = std::int64_t{1} << kValueFracBits;  // one user or record in fixed point
}

BaselineReleaser::BaselineReleaser(BaselineParams params, const noise::Secret& secret)
    : params_(params), secret_(secret), selection_noise_(params_.sigma_selection) {
  if (params_.release_count) count_noise_.emplace(params_.sigma_count);
  if (params_.release_sum) sum_noise_.emplace(params_.sigma_sum);
}

BaselineReleaser::~BaselineReleaser() { OPENSSL_cleanse(secret_.data(), secret_.size()); }

std::vector<KeyTotals> BaselineReleaser::running_totals(const KeyStateTable& keys) {
  std::vector<KeyTotals> all;
  all.reserve(keys.keys());
  keys.for_each([&](std::uint64_t key, const KeyState& st) { all.push_back({key, st.count, st.sum, st.users}); });
  return all;
}

std::vector<KeyRelease> BaselineReleaser::release(const std::vector<KeyTotals>& candidates, KeyStateTable& keys,
                                                  std::uint32_t trigger, DpStats& stats) {
  const int threads = omp_get_max_threads();
  std::vector<std::vector<KeyRelease>> out(static_cast<std::size_t>(threads));
  std::uint64_t tested = 0, draws = 0;
  std::string error;  // an exception must not leave the OpenMP region: keep the first, rethrow after
  const std::size_t n = candidates.size();
#pragma omp parallel num_threads(threads) reduction(+ : tested, draws)
  try {
    noise::WindowPrf prf(secret_, window_);
    auto& mine = out[static_cast<std::size_t>(omp_get_thread_num())];
    // One fresh draw per (key, family, trigger): the release's own noise, independent of every other release.
    auto draw = [&](std::uint64_t key, noise::Family family, const noise::DiscreteGaussian& dg) {
      ++draws;
      return noise::node_noise(prf, {key, family, trigger, 0, 0}, dg);
    };
#pragma omp for schedule(static)
    for (std::size_t i = 0; i < n; ++i) {
      if (i == n / 2) fault::point("dp_release");
      const KeyTotals& t = candidates[i];
      if (t.users < 1) continue;  // the key has no data in this query: it does not exist for it
      ++tested;
      const double noisy_users = static_cast<double>(t.users) +
                                 static_cast<double>(draw(t.key, noise::Family::BaselineSelection, selection_noise_));
      if (!(noisy_users > params_.tau)) continue;
      KeyRelease r{t.key, 0, 0};  // 128-bit values: no total plus noise can overflow (record.hpp)
      if (count_noise_) r.count = (int128{t.count} + draw(t.key, noise::Family::BaselineCount, *count_noise_)) * kOne;
      if (sum_noise_)
        r.sum = t.sum + int128{draw(t.key, noise::Family::BaselineSum, *sum_noise_)} * params_.sum_quantum;
      mine.push_back(r);
    }
  } catch (const std::exception& e) {
#pragma omp critical(baseline_release_error)
    if (error.empty()) error = e.what();
  }
  if (!error.empty()) throw std::runtime_error("baseline release: " + error);

  std::vector<KeyRelease> all;
  for (auto& o : out) all.insert(all.end(), o.begin(), o.end());
  std::sort(all.begin(), all.end(), [](const KeyRelease& a, const KeyRelease& b) { return a.key < b.key; });
  for (const auto& r :
       all) {  // KeyState::round counts the key's releases (checkpointed: keys released survives a resume)
    KeyState st = keys.at(r.key);
    ++st.round;
    keys.put(r.key, st);
    keys.mark_changed(r.key);
  }
  stats.tested += tested;
  stats.released += all.size();
  stats.noise_draws += draws;
  return all;
}

}  // namespace dpstream::kernels
