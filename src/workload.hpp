// The core paper's synthetic workload (section 5.1), generated trigger by trigger.
//
// For window w, user u draws n_u ~ Zipf-Mandelbrot(records_per_user) records (1 + that with
// records_per_user_min = 0); their event times are n_u sorted uniforms over the window, produced
// one at a time by the order-statistic recurrence U_(k+1) = 1 - (1 - U_(k)) V^(1 / (n_u - k)), V ~ U(0, 1]; record k's
// key is drawn from the key distribution. Every number comes from CounterRng(seed, w, u, k), so the stream does not
// depend on the rank count, and per user only (k, U_(k), n_u) is kept between triggers (n_u is drawn again from its
// counter when it does not fit in the cursor).
#pragma once

#include <memory>
#include <vector>

#include "kernels/table_memory.hpp"
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
  // Every user has at least one record in every window.
  std::uint64_t users_per_window() const override { return config_.input.users; }
  std::uint64_t keys_per_window() const override { return keys_per_window_; }
  std::uint64_t kept_records_per_window() const override { return kept_records_per_window_; }
  // Earlier windows are only counted (n_u per user), not generated.
  void skip_to(std::int64_t first_window, std::int64_t window, std::uint32_t trigger) override;

  // All records of one user in one window, in stream order (tests and the naive reference).
  std::vector<Record> user_records(std::int64_t window, std::uint64_t user) const;

 private:
  // Per local user between triggers, 12 bytes (+ 4 in a due list), one cache line to miss per visit:
  // U_(k) of its next record (as bits: 4-byte alignment keeps the array at 12 B per user), k, and n_u.
  struct Cursor {
    std::uint32_t position_bits[2];
    std::uint32_t state;  // k in the low kCountShift bits, n_u above it when it fits (else 0: drawn again)
    double position() const;
    void set(double position, std::uint32_t k, std::uint32_t total);
  };
  static constexpr unsigned kCountShift = 21;  // k <= records_per_user_max + 1 <= 2^20 + 1

  void begin_window(std::int64_t window);
  // The hash of (seed, window); CounterRng::child(it, user) starts every stream of that user in the window.
  std::uint64_t window_node(std::int64_t window) const;
  std::uint32_t draw_count(std::uint64_t user_node) const;
  // U_(k) from U_(k-1) = `position`, from record k's stream `rng` (its first draw), `remaining` = n_u - k.
  static double next_position(CounterRng& rng, std::uint32_t remaining, double position);
  std::int64_t offset_of(double position) const;  // the record time's offset in the window
  std::uint32_t trigger_of(double position) const { return clock_.trigger_of_offset(offset_of(position)); }
  // Record k, its key from `rng` (record k's stream after the time draw).
  Record make_record(CounterRng& rng, std::int64_t window, std::uint64_t user, std::uint32_t k, double position) const;
  // Emits the records of local user i that fall in `trigger`; returns the trigger of its next record, or
  // triggers_per_window() when it has no more.
  std::uint32_t visit(std::uint32_t i, std::uint32_t trigger, std::vector<Record>& out);

  JobConfig config_;
  StreamClock clock_;
  ZipfMandelbrot records_per_user_;
  ZipfMandelbrot key_zipf_;
  std::uint64_t first_user_, last_user_;
  std::uint64_t keys_per_window_ = 0;          // expected distinct keys of a window (all ranks)
  std::uint64_t kept_records_per_window_ = 0;  // expected kept records of a window (all ranks)
  std::int64_t window_ = -1;
  std::uint64_t window_node_ = 0;                // the hash of (seed, window_)
  kernels::TableSlots<Cursor> cursor_;           // visited at random (12 MB at 1M users a rank): on huge pages
  std::vector<std::vector<std::uint32_t>> due_;  // per trigger: local users with a record due
  InputStats stats_;
};

}  // namespace dpstream
