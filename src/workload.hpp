// The core paper's synthetic workload (section 5.1), generated trigger by trigger.
//
// For window w, user u draws n_u ~ Zipf-Mandelbrot(records_per_user) records (1 + that with
// records_per_user_min = 0); their event times are n_u sorted uniforms over the window, produced
// one at a time by the order-statistic recurrence U_(k+1) = 1 - (1 - U_(k)) V^(1 / (n_u - k)), V ~ U(0, 1]; record k's
// key is drawn from the key distribution. Every number comes from CounterRng(seed, w, u, k), so the stream does not
// depend on the rank count, and per user only (k, U_(k)) is kept between triggers (n_u is drawn again from its
// counter).
#pragma once

#include <memory>
#include <vector>

#include "src/config.hpp"
#include "src/counter_rng.hpp"
#include "src/record_source.hpp"
#include "src/stream_clock.hpp"
#include "src/zipf.hpp"

namespace dpstream {

// Stream position of record k of user u: users in id order, records in time order.
inline std::uint64_t synthetic_position(std::uint64_t user, std::uint64_t k) { return (user << 20) | k; }

class SyntheticSource final : public RecordSource {
 public:
  // This rank generates users [users * rank / ranks, users * (rank + 1) / ranks).
  SyntheticSource(const JobConfig& config, int rank, int ranks);

  std::vector<Record> take_trigger(std::int64_t window, std::uint32_t trigger) override;
  const InputStats& stats() const override { return stats_; }
  std::uint32_t triggers_per_window() const override { return clock_.triggers; }
  // Earlier windows are only counted (n_u per user), not generated.
  void skip_to(std::int64_t first_window, std::int64_t window, std::uint32_t trigger) override;

  // All records of one user in one window, in stream order (tests and the naive reference).
  std::vector<Record> user_records(std::int64_t window, std::uint64_t user) const;

 private:
  void begin_window(std::int64_t window);
  // U_(k+1) from U_(k) = `position` for a user with `total` records of which `emitted` (= k) are out.
  double next_position(std::int64_t window, std::uint64_t user, std::uint32_t total, std::uint32_t emitted,
                       double position) const;
  std::int64_t offset_of(double position) const;  // the record time's offset in the window
  Record make_record(std::int64_t window, std::uint64_t user, std::uint32_t k, std::int64_t offset) const;
  std::uint32_t draw_count(std::int64_t window, std::uint64_t user) const;

  JobConfig config_;
  StreamClock clock_;
  ZipfMandelbrot records_per_user_;
  ZipfMandelbrot key_zipf_;
  std::uint64_t first_user_, last_user_;
  std::int64_t window_ = -1;
  // Per local user between triggers, 12 bytes (+ 4 in a due list): U_(k) of its next record and k.
  // n_u is drawn again when needed (one counter-RNG call) and the offset follows from U_(k).
  std::vector<double> position_;
  std::vector<std::uint32_t> emitted_;
  std::vector<std::vector<std::uint32_t>> due_;  // per trigger: local users with a record due
  InputStats stats_;
};

}  // namespace dpstream
