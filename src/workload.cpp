#include "src/workload.hpp"

#include <omp.h>

#include <cmath>

namespace dpstream {

namespace {
// CounterRng stream ids inside (seed, window, user): 0 draws n_u, k + 1 draws record k.
constexpr std::uint64_t kCountStream = 0;
}  // namespace

SyntheticSource::SyntheticSource(const JobConfig& config, int rank, int ranks)
    : config_(config),
      clock_{config.stream.window_seconds, config.stream.triggers},
      records_per_user_(config.input.records_per_user_min, config.input.records_per_user_max,
                        config.input.records_per_user_q, config.input.records_per_user_s),
      key_zipf_(1, config.input.keys, config.input.key_q, config.input.key_s) {
  const auto U = static_cast<uint128>(config.input.users);
  first_user_ = static_cast<std::uint64_t>(U * static_cast<unsigned>(rank) / static_cast<unsigned>(ranks));
  last_user_ = static_cast<std::uint64_t>(U * static_cast<unsigned>(rank + 1) / static_cast<unsigned>(ranks));
}

std::uint32_t SyntheticSource::draw_count(std::int64_t window, std::uint64_t user) const {
  CounterRng rng(config_.input.seed, static_cast<std::uint64_t>(window), user, kCountStream);
  const std::uint64_t x = records_per_user_.sample([&] { return rng.uniform(); });
  return static_cast<std::uint32_t>(config_.input.records_per_user_min == 0 ? 1 + x : x);  // at least one record
}

double SyntheticSource::next_position(std::int64_t window, std::uint64_t user, std::uint32_t total,
                                      std::uint32_t emitted, double position) const {
  CounterRng rng(config_.input.seed, static_cast<std::uint64_t>(window), user, emitted + 1);
  const double v = rng.uniform_pos();
  return 1.0 - (1.0 - position) * std::pow(v, 1.0 / static_cast<double>(total - emitted));
}

std::int64_t SyntheticSource::offset_of(double position) const {
  const auto W = config_.stream.window_seconds;
  auto offset = static_cast<std::int64_t>(position * static_cast<double>(W));
  return offset >= W ? W - 1 : offset;
}

Record SyntheticSource::make_record(std::int64_t window, std::uint64_t user, std::uint32_t k,
                                    std::int64_t offset) const {
  // Same stream as next_position() for record k; the first draw went to the time, the rest to the key.
  CounterRng rng(config_.input.seed, static_cast<std::uint64_t>(window), user, k + 1);
  rng.next();
  std::uint64_t key;
  if (config_.input.key_distribution == KeyDistribution::Uniform)
    key = 1 + rng.below(config_.input.keys);
  else
    key = key_zipf_.sample([&] { return rng.uniform(); });
  return Record{user, key, window * config_.stream.window_seconds + offset, synthetic_position(user, k), 1.0};
}

void SyntheticSource::begin_window(std::int64_t window) {
  window_ = window;
  const std::size_t n = last_user_ - first_user_;
  position_.assign(n, 0.0);
  emitted_.assign(n, 0);
  due_.assign(config_.stream.triggers, {});
  const int threads = omp_get_max_threads();
  std::vector<std::vector<std::vector<std::uint32_t>>> local(
      threads, std::vector<std::vector<std::uint32_t>>(config_.stream.triggers));
#pragma omp parallel num_threads(threads)
  {
    auto& mine = local[omp_get_thread_num()];
#pragma omp for schedule(static)
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t user = first_user_ + i;
      position_[i] = next_position(window, user, draw_count(window, user), 0, 0.0);
      mine[clock_.trigger_of_offset(offset_of(position_[i]))].push_back(static_cast<std::uint32_t>(i));
    }
  }
  for (auto& per_thread : local)
    for (std::uint32_t t = 0; t < config_.stream.triggers; ++t) {
      due_[t].insert(due_[t].end(), per_thread[t].begin(), per_thread[t].end());
      std::vector<std::uint32_t>().swap(per_thread[t]);
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
#pragma omp for schedule(static)
    for (std::size_t j = 0; j < due.size(); ++j) {
      const std::uint32_t i = due[j];
      const std::uint64_t user = first_user_ + i;
      const std::uint32_t total = draw_count(window, user);
      for (;;) {
        recs.push_back(make_record(window, user, emitted_[i], offset_of(position_[i])));
        ++emitted_[i];
        if (emitted_[i] == total) break;
        position_[i] = next_position(window, user, total, emitted_[i], position_[i]);
        const std::uint32_t t = clock_.trigger_of_offset(offset_of(position_[i]));
        if (t != trigger) {
          later.emplace_back(t, i);
          break;
        }
      }
    }
  }
  std::vector<std::uint32_t>().swap(due);
  std::vector<Record> records;
  std::size_t total = 0;
  for (auto& r : out) total += r.size();
  records.reserve(total);
  for (auto& r : out) {
    records.insert(records.end(), r.begin(), r.end());
    std::vector<Record>().swap(r);
  }
  for (auto& l : requeue)
    for (auto [t, i] : l) due_[t].push_back(i);
  stats_.rows += records.size();
  return records;
}

void SyntheticSource::skip_to(std::int64_t first_window, std::int64_t window, std::uint32_t trigger) {
  std::uint64_t rows = 0;
  for (std::int64_t w = first_window; w < window; ++w) {
    const auto n = static_cast<std::int64_t>(last_user_ - first_user_);
#pragma omp parallel for schedule(static) reduction(+ : rows)
    for (std::int64_t i = 0; i < n; ++i) rows += draw_count(w, first_user_ + static_cast<std::uint64_t>(i));
  }
  stats_.rows += rows;
  for (std::uint32_t t = 0; t < trigger; ++t) take_trigger(window, t);
}

std::vector<Record> SyntheticSource::user_records(std::int64_t window, std::uint64_t user) const {
  const std::uint32_t total = draw_count(window, user);
  std::vector<Record> out;
  double position = 0.0;
  for (std::uint32_t k = 0; k < total; ++k) {
    position = next_position(window, user, total, k, position);
    out.push_back(make_record(window, user, k, offset_of(position)));
  }
  return out;
}

}  // namespace dpstream
