#include "src/workload.hpp"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <utility>

#include "common/prefetch.hpp"

namespace dpstream {

namespace {
// CounterRng stream ids inside (seed, window, user): 0 draws n_u, k + 1 draws record k.
constexpr std::uint64_t kCountStream = 0;
// Due users looked ahead in take_trigger: their cursors are scattered over the rank's users, so each
// visit would otherwise wait for a DRAM miss (~100 ns); 16 visits of ~60 ns each hide it (0 ahead: 1.5-2.5x slower).
constexpr std::size_t kPrefetch = 16;
constexpr std::uint32_t kMaxCachedCount = (std::uint32_t{1} << (32 - 21)) - 1;

// The per-thread parts in thread order (= due-list order with a static schedule); the first is moved.
template <class T>
std::vector<T> concatenate(std::vector<std::vector<T>>& parts) {
  std::size_t total = 0;
  for (const auto& p : parts) total += p.size();
  std::vector<T> all;
  if (parts.empty()) return all;
  all.swap(parts.front());
  all.reserve(total);
  for (std::size_t i = 1; i < parts.size(); ++i) all.insert(all.end(), parts[i].begin(), parts[i].end());
  return all;
}
}  // namespace

double SyntheticSource::Cursor::position() const {
  double p;
  std::memcpy(&p, position_bits, sizeof p);
  return p;
}

void SyntheticSource::Cursor::set(double position, std::uint32_t k, std::uint32_t total) {
  static_assert(kMaxCachedCount == (std::uint32_t{1} << (32 - kCountShift)) - 1);
  std::memcpy(position_bits, &position, sizeof position);
  state = k | (total <= kMaxCachedCount ? total << kCountShift : 0);
}

SyntheticSource::SyntheticSource(const JobConfig& config, int rank, int ranks)
    : config_(config),
      clock_{config.stream.window_seconds, config.stream.triggers},
      records_per_user_(config.input.records_per_user_min, config.input.records_per_user_max,
                        config.input.records_per_user_q, config.input.records_per_user_s),
      key_zipf_(1, config.input.keys, config.input.key_q, config.input.key_s) {
  const auto U = static_cast<uint128>(config.input.users);
  first_user_ = static_cast<std::uint64_t>(U * static_cast<unsigned>(rank) / static_cast<unsigned>(ranks));
  last_user_ = static_cast<std::uint64_t>(U * static_cast<unsigned>(rank + 1) / static_cast<unsigned>(ranks));
  // The keys of a window's kept records, independent draws of the key distribution: users x
  // E[min(records per user, C)] (a user keeps its first C).
  const double records = static_cast<double>(config.input.users) *
                         records_per_user_.mean_of_min(config.input.records_per_user_min == 0 ? 1.0 : 0.0,
                                                       static_cast<double>(config.privacy.max_records_per_user));
  kept_records_per_window_ = static_cast<std::uint64_t>(records);
  const auto K = static_cast<double>(config.input.keys);
  keys_per_window_ = static_cast<std::uint64_t>(config.input.key_distribution == KeyDistribution::Uniform
                                                    ? -K * std::expm1(records * std::log1p(-1.0 / K))
                                                    : key_zipf_.expected_distinct(records));
}

std::uint64_t SyntheticSource::window_node(std::int64_t window) const {
  return CounterRng::child(CounterRng::root(config_.input.seed), static_cast<std::uint64_t>(window));
}

std::uint32_t SyntheticSource::draw_count(std::uint64_t user_node) const {
  CounterRng rng = CounterRng::at(user_node, kCountStream);
  const std::uint64_t x = records_per_user_.sample([&] { return rng.uniform(); });
  return static_cast<std::uint32_t>(config_.input.records_per_user_min == 0 ? 1 + x : x);  // at least one record
}

double SyntheticSource::next_position(CounterRng& rng, std::uint32_t remaining, double position) {
  const double v = rng.uniform_pos();
  // A user's last record (remaining = 1, one record in six on the paper's workload) skips pow: glibc's pow
  // is within 0.52 ulp, so pow(v, 1) is v exactly (Workload.PowOfOneIsExact checks the powers of two,
  // where half an ulp below is a double).
  return 1.0 - (1.0 - position) * (remaining == 1 ? v : std::pow(v, 1.0 / static_cast<double>(remaining)));
}

std::int64_t SyntheticSource::offset_of(double position) const {
  const auto W = config_.stream.window_seconds;
  auto offset = static_cast<std::int64_t>(position * static_cast<double>(W));
  return offset >= W ? W - 1 : offset;
}

Record SyntheticSource::make_record(CounterRng& rng, std::int64_t window, std::uint64_t user, std::uint32_t k,
                                    double position) const {
  std::uint64_t key;
  if (config_.input.key_distribution == KeyDistribution::Uniform)
    key = 1 + rng.below(config_.input.keys);
  else
    key = key_zipf_.sample([&] { return rng.uniform(); });
  return Record{user, key, window * config_.stream.window_seconds + offset_of(position), synthetic_position(user, k),
                1.0};
}

void SyntheticSource::begin_window(std::int64_t window) {
  window_ = window;
  window_node_ = window_node(window);
  const std::size_t n = last_user_ - first_user_;
  cursor_.resize(n);
  due_.assign(config_.stream.triggers, {});
  const int threads = omp_get_max_threads();
  std::vector<std::vector<std::vector<std::uint32_t>>> local(
      threads, std::vector<std::vector<std::uint32_t>>(config_.stream.triggers));
#pragma omp parallel num_threads(threads)
  {
    auto& mine = local[omp_get_thread_num()];
#pragma omp for schedule(static)
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t node = CounterRng::child(window_node_, first_user_ + i);
      const std::uint32_t total = draw_count(node);
      CounterRng rng = CounterRng::at(node, 1);  // record 0's stream
      const double position = next_position(rng, total, 0.0);
      cursor_[i].set(position, 0, total);
      mine[trigger_of(position)].push_back(static_cast<std::uint32_t>(i));
    }
  }
  for (std::uint32_t t = 0; t < config_.stream.triggers; ++t) {
    std::vector<std::vector<std::uint32_t>> parts(threads);
    for (int p = 0; p < threads; ++p) parts[p].swap(local[p][t]);
    due_[t] = concatenate(parts);
  }
}

std::uint32_t SyntheticSource::visit(std::uint32_t i, std::uint32_t trigger, std::vector<Record>& out) {
  Cursor& cursor = cursor_[i];
  const std::uint64_t user = first_user_ + i;
  const std::uint64_t node = CounterRng::child(window_node_, user);
  std::uint32_t k = cursor.state & ((std::uint32_t{1} << kCountShift) - 1);
  std::uint32_t total = cursor.state >> kCountShift;
  if (total == 0) total = draw_count(node);
  double position = cursor.position();
  CounterRng rng = CounterRng::at(node, k + 1);
  rng.discard(1);  // record k's time was drawn when it was queued; the key follows it
  for (;;) {
    out.push_back(make_record(rng, window_, user, k, position));
    if (++k == total) return clock_.triggers;
    rng = CounterRng::at(node, k + 1);  // time, then (if due now) key of record k
    position = next_position(rng, total - k, position);
    const std::uint32_t t = trigger_of(position);
    if (t != trigger) {
      cursor.set(position, k, total);
      return t;
    }
  }
}

std::vector<Record> SyntheticSource::take_trigger(std::int64_t window, std::uint32_t trigger) {
  if (window != window_) begin_window(window);
  std::vector<std::uint32_t> due;
  due.swap(due_[trigger]);
  const int threads = omp_get_max_threads();
  std::vector<std::vector<Record>> out(threads);
  std::vector<std::vector<std::pair<std::uint32_t, std::uint32_t>>> requeue(threads);  // (trigger, user)
#pragma omp parallel num_threads(threads)
  {
    auto& recs = out[omp_get_thread_num()];
    auto& later = requeue[omp_get_thread_num()];
    const std::size_t share = due.size() / static_cast<std::size_t>(threads);
    recs.reserve(share + share / 8 + 64);  // about 1.03 records per visit with 100 triggers
#pragma omp for schedule(static)
    for (std::size_t j = 0; j < due.size(); ++j) {
      if (j + kPrefetch < due.size()) dpstream::prefetch_object(&cursor_[due[j + kPrefetch]]);
      const std::uint32_t t = visit(due[j], trigger, recs);
      if (t < clock_.triggers) later.emplace_back(t, due[j]);
    }
  }
  std::vector<std::uint32_t>().swap(due);
  std::vector<Record> records = concatenate(out);
  for (auto& l : requeue)
    for (auto [t, i] : l) due_[t].push_back(i);
  stats_.rows += records.size();
  return records;
}

void SyntheticSource::skip_to(std::int64_t first_window, std::int64_t window, std::uint32_t trigger) {
  std::uint64_t rows = 0;
  for (std::int64_t w = first_window; w < window; ++w) {
    const std::uint64_t node = window_node(w);
    const auto n = static_cast<std::int64_t>(last_user_ - first_user_);
#pragma omp parallel for schedule(static) reduction(+ : rows)
    for (std::int64_t i = 0; i < n; ++i)
      rows += draw_count(CounterRng::child(node, first_user_ + static_cast<std::uint64_t>(i)));
  }
  stats_.rows += rows;
  for (std::uint32_t t = 0; t < trigger; ++t) take_trigger(window, t);
}

std::vector<Record> SyntheticSource::user_records(std::int64_t window, std::uint64_t user) const {
  const std::uint64_t node = CounterRng::child(window_node(window), user);
  const std::uint32_t total = draw_count(node);
  std::vector<Record> out;
  double position = 0.0;
  for (std::uint32_t k = 0; k < total; ++k) {
    CounterRng rng = CounterRng::at(node, k + 1);  // record k: time, then key
    position = next_position(rng, total - k, position);
    out.push_back(make_record(rng, window, user, k, position));
  }
  return out;
}

}  // namespace dpstream
